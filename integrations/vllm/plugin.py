"""The ``vllm.general_plugins`` entry point: ``method: freespec`` on vLLM 0.34.

vLLM loads every general plugin in each of its processes (front end, engine
core, workers; ``VLLM_PLUGINS`` is an allow-list). ``register`` registers
freespec's speculator by its config's qualified name, so nothing heavier than
vLLM's own config module is imported until an engine asks for the method::

    LLM(model, speculative_config={"method": "freespec", "num_speculative_tokens": 8})
    vllm serve MODEL --speculative-config '{"method": "freespec", "num_speculative_tokens": 8}'

On a release outside the speculator's range (``version.py``: 0.32-0.33 run the
``custom_class`` proposer instead) it registers nothing and says why at debug
level; it never raises into vLLM's plugin loader.
"""

from __future__ import annotations

import logging

from . import version

METHOD = "freespec"
CONFIG = "freespec.integrations.vllm.speculator_config.FreespecSpeculatorConfig"
logger = logging.getLogger(f"vllm.{__name__}")


def register() -> bool:
    """Register ``method: freespec`` where the installed vLLM runs the speculator; True if it did."""
    try:
        found = version.installed_version()
        if version.path_of(found) != version.SPECULATOR:
            logger.debug("freespec: vllm %s runs no registered speculator (%s)", found, version.WHAT_EACH_RELEASE_GETS)
            return False
        from vllm.v1.worker.gpu.spec_decode.speculator_config import register_speculative_method

        register_speculative_method(METHOD, CONFIG)
        return True
    except Exception as exc:  # a plugin that raises stops vLLM from starting at all, with or without freespec
        logger.warning("freespec: method %r not registered with vLLM: %s", METHOD, exc)
        return False
