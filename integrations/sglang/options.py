"""Which drafter the SGLang plugin serves, and with which options: flags, a JSON file, env vars.

The launcher parses ``--freespec-drafter NAME`` and ``--freespec-config PATH``;
SGLang then spawns its scheduler processes, which never see those flags. So
the launcher exports them (``export_env``) and every process reads them back
(``from_env``) when it builds the corpus adapter::

    FREESPEC_SGLANG=1                      # enable the plugin without any flag
    FREESPEC_SGLANG_DRAFTER=prompt_lookup  # drafter name (overrides the file's)
    FREESPEC_SGLANG_CONFIG=/path/cfg.json  # the config file below
    FREESPEC_SGLANG_STATS=/path/stats.json # the plugin writes its counters there as requests leave

A config file holds one JSON object, every key optional. ``drafter_options``
maps drafter names to that drafter's own options, so one file can serve every
drafter and a ``--freespec-drafter`` that overrides the file's ``drafter``
takes its own section (or the defaults, without one)::

    {"drafter": "prompt_lookup",
     "drafter_options": {"prompt_lookup": {"max_match": 16},
                         "mixture": {"min_match": 2, "max_depth": 16}},
     "isolated": false}

Memory across requests (``SGLANG_DEFAULTS``): a drafter that can keep a history
of earlier requests (``mixture``, ``suffix``) keeps one by default under SGLang,
of the last 262,144 tokens of finished requests' outputs (about 30-40 MB per
scheduler process), and drafts from it beside the request's own text, as
SGLang's NGRAM trie keeps every earlier request. It never changes an output.
``"isolated": true`` turns off everything that carries text from one request to
another (the drafter's ``isolation_options``: history, shared tables), for
multi-tenant servers; an option that contradicts it is refused.

Every section is checked against its drafter's constructor (``check_config``,
run by the launcher before anything starts): a key that is not a drafter, an
option the drafter does not take, or a value it rejects raises ``ValueError``
naming the file, the drafter and the option.

Options fixed under SGLang (``SGLANG_FIXED``): ``adaptive`` is False. SGLang
verifies all ``D = --speculative-num-draft-tokens`` slots every step and
reports no forward times, so a tree sized down by a cost model saves no
compute and only drops drafts; and sizing from measured times would let
tensor-parallel ranks, which draft independently, propose different trees.
The mixture's ``lookahead`` is False: its Jacobi window rides in the forward
as not-candidate nodes, which SGLang's draft tree cannot carry, and the
worker hands drafters no logits to fill its pool from.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import host_options
from ..host_options import PluginOptions, check_option_names, default_drafter, read_config  # noqa: F401

ENV_ENABLE = "FREESPEC_SGLANG"
ENV_DRAFTER = "FREESPEC_SGLANG_DRAFTER"
ENV_CONFIG = "FREESPEC_SGLANG_CONFIG"
ENV_STATS = "FREESPEC_SGLANG_STATS"
EXTRA_KEYS = ("isolated",)
SGLANG_DEFAULTS = {"history_tokens": 1 << 18}  # option -> its default under SGLang where the drafter takes it
# option -> the only value it may take under SGLang (the default when the drafter has the option)
SGLANG_FIXED = {  # option -> (its value under SGLang, why)
    "adaptive": (False, "SGLang verifies all --speculative-num-draft-tokens slots every step and reports no "
                        "forward times, so a smaller tree saves nothing"),
    "lookahead": (False, "the lookahead window rides as not-candidate nodes, which SGLang's draft tree cannot "
                         "carry"),
}


def sglang_options(name: str, drafter_options: dict, where: str) -> dict:
    """``drafter_options`` with ``SGLANG_FIXED`` applied: filled in where the drafter takes them, else refused."""
    return host_options.fix_options(name, drafter_options, where, SGLANG_FIXED, "SGLang")


def build_drafter(name: str, drafter_options: dict, where: str = "drafter_options", isolated: bool = False):
    """The drafter ``name`` with its options under SGLang; ``ValueError`` naming ``where``, the drafter and the option.

    ``SGLANG_DEFAULTS`` fill what the options leave out, unless ``isolated``,
    which applies the drafter's ``isolation_options`` instead. A dict under
    ``"documents"`` becomes a ``DocumentIndex`` (the shared index that also
    takes SGLang's external corpora).
    """
    host_options.check_option_names(name, drafter_options, where)
    drafter_options = host_options.with_isolation(name, drafter_options, isolated, where)
    if not isolated:
        drafter_options = host_options.with_defaults(name, drafter_options, SGLANG_DEFAULTS)
    return host_options.build_drafter(name, drafter_options, where, SGLANG_FIXED, "SGLang",
                                      "SGLang's NGRAM worker does not hand to drafters")


def isolated(config_path: str | os.PathLike | None) -> bool:
    """The file's ``"isolated"`` (False without a file or the key); ``ValueError`` unless it is a boolean."""
    if not config_path:
        return False
    value = read_config(config_path, EXTRA_KEYS).get("isolated", False)
    if not isinstance(value, bool):
        raise ValueError(f"freespec config {str(config_path)!r}: 'isolated' must be true or false, got {value!r}")
    return value


def check_config(config_path: str | os.PathLike) -> None:
    """Build every drafter the file configures, so a bad option stops the launcher, not a scheduler."""
    config = read_config(config_path, EXTRA_KEYS)
    is_isolated = isolated(config_path)
    for name, section in config.get("drafter_options", {}).items():
        build_drafter(name, section, f"freespec config {str(config_path)!r}", is_isolated)


def resolve(drafter: str | None = None, config_path: str | os.PathLike | None = None) -> PluginOptions:
    """The drafter to serve (the name wins over the file's ``drafter``) and its own section of the file.

    ``resolve("suffix", "cfg.json")`` with ``cfg.json`` =
    ``{"drafter": "prompt_lookup", "drafter_options": {"prompt_lookup": {"max_match": 16}, "suffix":
    {"max_depth": 8}}}`` -> ``PluginOptions("suffix", {"max_depth": 8})``.
    """
    return host_options.resolve(drafter, config_path, "--freespec-drafter", EXTRA_KEYS)


def from_env(environ=os.environ) -> PluginOptions:
    """``resolve()`` from ``FREESPEC_SGLANG_DRAFTER`` and ``FREESPEC_SGLANG_CONFIG``."""
    return resolve(environ.get(ENV_DRAFTER) or None, environ.get(ENV_CONFIG) or None)


def isolated_from_env(environ=os.environ) -> bool:
    """``isolated`` of the file ``FREESPEC_SGLANG_CONFIG`` names."""
    return isolated(environ.get(ENV_CONFIG) or None)


def where(environ=os.environ) -> str:
    """How to name the options' origin in an error: the config file, else the env var."""
    config = environ.get(ENV_CONFIG)
    return f"freespec config {config!r}" if config else "freespec drafter_options"


def export_env(drafter: str | None, config_path: str | None, environ=os.environ) -> None:
    """Make the launcher's flags visible to the processes it spawns."""
    environ[ENV_ENABLE] = "1"
    if drafter:
        environ[ENV_DRAFTER] = drafter
    if config_path:
        environ[ENV_CONFIG] = str(Path(config_path).resolve())
