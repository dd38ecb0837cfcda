"""Every change the plugin makes to SGLang, declared in one place.

``install()`` checks the SGLang version and that every target exists, then
registers with ``sglang.srt.plugins.hook_registry.HookRegistry``:

| target | hook | why |
|---|---|---|
| ``ServerArgs.add_cli_args`` | AFTER | adds ``--freespec-drafter`` and ``--freespec-config`` |
| ``ServerArgs.from_cli_args`` | AROUND | checks them, exports them to env vars, drops them (ServerArgs has no such fields) |
| ``ngram_worker.NgramCorpus`` | REPLACE | the NGRAM worker builds ``DraftServer`` instead |
| ``NGRAMWorker._prepare_draft_tokens`` | BEFORE | hands the corpus each request's full prompt (unpadded too) + output and hints (read only when a request starts), the vocabulary size and the tokenizer's path |
| ``Scheduler.on_idle`` | AFTER | once no request is left, releases what the corpus still holds (the worker erases a batch's requests only at the next verify step) |
| ``SamplingParams.verify`` | AFTER | refuses a request whose ``custom_params`` hints are malformed, with a message naming the key (the engine serves on) |

SGLang applies registered hooks right after running the plugins
(``load_plugins``). ``uninstall()`` puts the originals back (for tests).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import pkgutil
import sys

from ..host_options import parse_version
from ..host_serving import parse_hints
from . import options as plugin_options
from .draft_server import DraftServer

logger = logging.getLogger(__name__)

# The NGRAM corpus interface and the worker's calls were read in these releases;
# tests run against 0.5.21.
MIN_VERSION = (0, 5, 11)
MAX_VERSION = (0, 5, 23)
ENV_ALLOW_UNTESTED = "FREESPEC_SGLANG_ALLOW_UNTESTED"

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
NGRAM_CORPUS = "sglang.srt.speculative.ngram_worker.NgramCorpus"
PREPARE_DRAFT_TOKENS = "sglang.srt.speculative.ngram_worker.NGRAMWorker._prepare_draft_tokens"
ON_IDLE = "sglang.srt.managers.scheduler.Scheduler.on_idle"
VERIFY_SAMPLING = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
TARGETS = (ADD_CLI_ARGS, FROM_CLI_ARGS, NGRAM_CORPUS, PREPARE_DRAFT_TOKENS, VERIFY_SAMPLING)
# patched where the release has them: without on_idle, the last batch's requests are released at the next one
OPTIONAL_TARGETS = (ON_IDLE,)
# what NGRAMWorker calls on its corpus; each must exist on SGLang's class (else SGLang changed)
CORPUS_METHODS = ("batch_put", "synchronize", "reset", "batch_get", "erase_match_state",
                  "load_external_corpus_named", "commit_external_corpus_load", "remove_external_corpus",
                  "list_external_corpora")

# From 0.5.23 the worker's tails and lengths count the unpadded prompt (origin_input_ids_unpadded);
# before, the padded one (origin_input_ids). Set by install().
UNPADDED_FROM = (0, 5, 23)
_worker_reads_unpadded = False
_originals: dict[str, tuple[object, str, object]] = {}  # target -> (owner, attribute, raw original)


class IncompatibleSGLang(RuntimeError):
    """The installed SGLang is not one this plugin can patch safely."""


def import_sglang():
    try:
        import sglang
    except ImportError as exc:
        raise ImportError(f"the freespec SGLang plugin needs sglang: pip install freespec[sglang] ({exc})") from None
    return sglang


def check_version(version: str, environ=os.environ) -> None:
    if MIN_VERSION <= parse_version(version) <= MAX_VERSION:
        return
    tested = f"{'.'.join(map(str, MIN_VERSION))} to {'.'.join(map(str, MAX_VERSION))}"
    if environ.get(ENV_ALLOW_UNTESTED) == "1":
        logger.warning("freespec: sglang %s is outside the tested range %s (%s=1 set)", version, tested,
                       ENV_ALLOW_UNTESTED)
        return
    raise IncompatibleSGLang(f"freespec supports sglang {tested}, found {version}; set {ENV_ALLOW_UNTESTED}=1 "
                             f"to try anyway")


def resolve_target(target: str):
    """(owner, attribute, raw value) of a dotted target; the raw value keeps static/classmethod wrappers."""
    owner_path, attribute = target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise IncompatibleSGLang(f"hook target {target} is missing in this sglang ({exc})") from None
    if isinstance(owner, type) and attribute in vars(owner):
        return owner, attribute, vars(owner)[attribute]
    if not hasattr(owner, attribute):
        raise IncompatibleSGLang(f"hook target {target} is missing in this sglang")
    return owner, attribute, getattr(owner, attribute)


def check_corpus_interface(original) -> None:
    """SGLang's corpus must take only keywords ours takes and have the methods its worker calls."""
    ours = inspect.signature(DraftServer.__init__).parameters
    for name in list(inspect.signature(original.__init__).parameters)[1:]:
        if name not in ours:
            raise IncompatibleSGLang(f"hook target {NGRAM_CORPUS}: its constructor takes {name!r}, which "
                                     f"freespec's corpus does not")
    for name in CORPUS_METHODS:
        if not callable(getattr(original, name, None)):
            raise IncompatibleSGLang(f"hook target {NGRAM_CORPUS}: it has no method {name!r}; the NGRAM "
                                     f"worker's corpus interface changed")


def check() -> dict[str, tuple[object, str, object]]:
    """Raise ``IncompatibleSGLang`` unless this SGLang can be patched; returns the targets resolved."""
    sglang = import_sglang()
    check_version(getattr(sglang, "__version__", "0"))
    resolved = {target: resolve_target(target) for target in TARGETS}
    check_corpus_interface(resolved[NGRAM_CORPUS][2])
    for target in OPTIONAL_TARGETS:
        try:
            resolved[target] = resolve_target(target)
        except IncompatibleSGLang as exc:
            logger.warning("freespec: %s; requests left when the engine goes idle are released at its next batch",
                           exc)
    return resolved


# ------------------------------------------------------------------ the hooks
def add_cli_args_after(result, parser: argparse.ArgumentParser):
    """AFTER ``ServerArgs.add_cli_args(parser)``: the freespec flags."""
    if "--freespec-drafter" in parser._option_string_actions:  # the same parser twice
        return result
    group = parser.add_argument_group("freespec", "drafts for --speculative-algorithm NGRAM from freespec")
    group.add_argument("--freespec-drafter", type=str, default=None,
                       help="freespec drafter serving NGRAM drafts (default: the config's, else mixture if "
                            "registered, else prompt_lookup)")
    group.add_argument("--freespec-config", type=str, default=None,
                       help='JSON file: {"drafter": NAME, "drafter_options": {NAME: {...}, ...}}')
    return result


def from_cli_args_around(original, cls, args: argparse.Namespace):
    """AROUND ``ServerArgs.from_cli_args``: check the freespec flags, export them, build ServerArgs."""
    drafter = getattr(args, "freespec_drafter", None)
    config_path = getattr(args, "freespec_config", None)
    if drafter is not None or config_path is not None:
        resolved = plugin_options.resolve(drafter, config_path)
        where = f"freespec config {config_path!r}" if config_path else "--freespec-drafter"
        if config_path:
            plugin_options.check_config(config_path)  # every section, so bad options fail here, not in a subprocess
        plugin_options.build_drafter(resolved.drafter, resolved.drafter_options, where)
        if getattr(args, "speculative_algorithm", None) != "NGRAM":
            logger.warning("freespec: --freespec-* flags take effect only with --speculative-algorithm NGRAM")
        plugin_options.export_env(drafter, config_path)
    return original(cls, args)


def _vocab_size(worker) -> int | None:
    """The target model's vocabulary size, where the worker exposes it."""
    model_config = getattr(getattr(worker, "model_runner", None), "model_config", None)
    size = getattr(model_config, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _tokenizer_path(worker) -> str | None:
    """Where the target's tokenizer is (the server's ``tokenizer_path``, else the model's path)."""
    server_args = getattr(worker, "server_args", None)
    model_config = getattr(getattr(worker, "model_runner", None), "model_config", None)
    path = getattr(server_args, "tokenizer_path", None) or getattr(model_config, "model_path", None)
    return path if isinstance(path, str) else None


def _offers(reqs):
    """(rid, prompt in the worker's coordinates, output, unpadded prompt, custom_params) per request."""
    for req in reqs:
        unpadded = getattr(req, "origin_input_ids_unpadded", None)
        unpadded = req.origin_input_ids if unpadded is None else unpadded
        custom_params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        yield (req.rid, unpadded if _worker_reads_unpadded else req.origin_input_ids, req.output_ids, unpadded,
               custom_params if isinstance(custom_params, dict) else None)


def prepare_draft_tokens_before(worker, batch, *args, **kwargs):
    """BEFORE ``NGRAMWorker._prepare_draft_tokens(batch)``: offer the corpus every request's full context."""
    corpus = getattr(worker, "ngram_corpus", None)
    if isinstance(corpus, DraftServer):
        if corpus.vocab_size is None and _vocab_size(worker) is not None:
            corpus.set_vocab_size(_vocab_size(worker))
            corpus.set_tokenizer_path(_tokenizer_path(worker))
        corpus.offer_contexts(_offers(batch.reqs))
    return None


def on_idle_after(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.on_idle()``: once no request runs or waits, the corpus releases what it holds."""
    corpus = getattr(getattr(scheduler, "draft_worker", None), "ngram_corpus", None)
    if isinstance(corpus, DraftServer) and corpus.num_live_requests and scheduler.is_fully_idle():
        corpus.release_idle()
    return result


def verify_sampling_after(result, sampling_params, *args, **kwargs):
    """AFTER ``SamplingParams.verify()``: a malformed hint fails its request with a ``ValueError`` naming it."""
    parse_hints(getattr(sampling_params, "custom_params", None), "sampling_params.custom_params")
    return result


# ------------------------------------------------------------- install/undo
def install() -> None:
    """Check SGLang and register the hooks; a second call does nothing."""
    if _originals:
        logger.debug("freespec: SGLang hooks already registered")
        return
    global _worker_reads_unpadded
    resolved = check()
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _worker_reads_unpadded = parse_version(import_sglang().__version__) >= UNPADDED_FROM

    HookRegistry.register(ADD_CLI_ARGS, add_cli_args_after, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, from_cli_args_around, HookType.AROUND)
    HookRegistry.register(NGRAM_CORPUS, DraftServer, HookType.REPLACE)
    HookRegistry.register(PREPARE_DRAFT_TOKENS, prepare_draft_tokens_before, HookType.BEFORE)
    if ON_IDLE in resolved:
        HookRegistry.register(ON_IDLE, on_idle_after, HookType.AFTER)
    HookRegistry.register(VERIFY_SAMPLING, verify_sampling_after, HookType.AFTER)
    _originals.update(resolved)
    logger.info("freespec: SGLang hooks registered (%s)", ", ".join(TARGETS))


def installed() -> bool:
    return bool(_originals)


def original(target: str):
    """The object ``target`` named before the plugin (e.g. SGLang's own NgramCorpus)."""
    return _originals[target][2]


def uninstall() -> None:
    """Drop the hooks and put every original back, in every module that took a copy."""
    global _worker_reads_unpadded
    if not _originals:
        return
    _worker_reads_unpadded = False
    from sglang.srt.plugins.hook_registry import HookRegistry

    ours = {add_cli_args_after, from_cli_args_around, DraftServer, prepare_draft_tokens_before, on_idle_after,
            verify_sampling_after}
    for target, (owner, attribute, raw) in _originals.items():
        HookRegistry._hooks[target] = [h for h in HookRegistry._hooks.get(target, []) if h[1] not in ours]
        if not HookRegistry._hooks[target]:
            del HookRegistry._hooks[target]
        current = getattr(owner, attribute)
        setattr(owner, attribute, raw)
        HookRegistry._patched.discard(target)
        if isinstance(raw, type):  # HookRegistry copied the class into modules that imported it
            for module_name, module in list(sys.modules.items()):
                namespace = getattr(module, "__dict__", None)
                if namespace is None or module_name.split(".")[0] == "freespec":
                    continue
                for name, value in list(namespace.items()):
                    if value is current and value is not raw:
                        setattr(module, name, raw)
    _originals.clear()
