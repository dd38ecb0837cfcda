"""SGLang plugin: freespec drafters serve ``--speculative-algorithm NGRAM``.

SGLang runs ``register()`` in each of its processes (entry point group
``sglang.srt.plugins``, declared in pyproject). It does nothing unless the
plugin is enabled, by ``FREESPEC_SGLANG=1`` or by any ``--freespec-*`` flag
on the command line (``FREESPEC_SGLANG_DRAFTER`` / ``FREESPEC_SGLANG_CONFIG``,
exported by the launcher, enable it in the processes it spawns)::

    python -m sglang.launch_server --model-path MODEL --speculative-algorithm NGRAM \\
        --speculative-num-draft-tokens 16 --freespec-drafter prompt_lookup --freespec-config cfg.json

Enabled, it checks the SGLang version and every hook target, and fails the
process with ``SystemExit`` naming what is missing: a user who asked for
freespec never gets plain NGRAM instead without knowing. The files:
``hooks.py`` (what is patched), ``options.py`` (flags, config file, env vars),
``draft_server.py`` (SGLang's corpus interface over a drafter: request state,
multimodal prompts), ``tree_format.py`` (drafts as SGLang's tree rows, one
kernel per batch), ``external.py`` (external corpora, built off the drafting
thread), ``bench.py`` (cost on the scheduler thread beside SGLang's C++
corpus). Nothing here imports sglang until the plugin is enabled.
"""

from __future__ import annotations

import logging
import os
import sys

from . import options
from .draft_server import DraftServer
from .tree_format import to_sglang_tree, write_sglang_trees

logger = logging.getLogger(__name__)


def enabled(argv=None, environ=None) -> bool:
    """``FREESPEC_SGLANG=1``, a freespec drafter/config env var, or a ``--freespec-*`` flag in argv."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    if environ.get(options.ENV_ENABLE, "").lower() in ("1", "true", "yes"):
        return True
    if environ.get(options.ENV_DRAFTER) or environ.get(options.ENV_CONFIG):
        return True
    return any(isinstance(arg, str) and arg.startswith("--freespec-") for arg in argv)


def register() -> None:
    """Entry point for SGLang's plugin loader: install the hooks when enabled."""
    if not enabled():
        return
    from . import hooks

    try:
        hooks.install()
    except (hooks.IncompatibleSGLang, ImportError) as exc:
        # SGLang's loader logs and swallows plugin exceptions; SystemExit passes
        # through, so a server asked to use freespec does not start without it.
        raise SystemExit(f"freespec SGLang plugin: {exc}. Unset {options.ENV_ENABLE}/"
                         f"{options.ENV_DRAFTER}/{options.ENV_CONFIG} and drop the --freespec-* flags to "
                         f"run SGLang without freespec.") from exc


def unregister() -> None:
    """Undo ``register()`` in this process (tests)."""
    from . import hooks

    hooks.uninstall()


__all__ = ["DraftServer", "enabled", "options", "register", "to_sglang_tree", "unregister", "write_sglang_trees"]
