"""``FreespecHints``: vLLM checks freespec's per-request hints when it admits a request.

Registered as a plugin of vLLM's ``vllm.logits_processors`` entry-point group
(pyproject), the one hook vLLM runs on every request's ``SamplingParams`` at
admission (``validate_params``) in the process that received it: a malformed
``documents`` or ``prediction`` is refused there (HTTP 400 from ``vllm serve``,
``ValueError`` from ``LLM.generate``), and never reaches the engine. It changes
no logits.

Two interfaces, one per path (``version.py``):

- vLLM 0.32-0.33 (``vllm.v1.sample.logits_processor``): vLLM does not build plugin
  logits processors for speculative engines; where it builds this one (an engine
  without speculation) ``apply`` returns the logits as they are and it declares
  itself argmax-invariant. The proposer reads hints from the runner's requests.
- vLLM 0.34 (the V2 runner's ``vllm.v1.worker.gpu.sample.logits_processor``): every
  engine builds it, and refuses to start on a plugin of the old interface. Its
  ``add_request(req_idx, sampling_params)`` is how a request's ``extra_args``
  reach ``FreespecSpeculator`` (the V2 runner hands a speculator only the slot):
  it finds the speculator of its own model runner by the request state both were
  given, and declines to process any request's logits (returns False).
"""

from __future__ import annotations

from . import hints

try:  # vLLM 0.32-0.33
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

    V2 = False
except ImportError:  # vLLM 0.34: the V2 model runner's interface (import-light, as vLLM requires of it)
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

    V2 = True


if not V2:
    class FreespecHints(LogitsProcessor):
        @classmethod
        def validate_params(cls, sampling_params) -> None:
            hints.parse(sampling_params.extra_args)

        def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
            pass

        def is_argmax_invariant(self) -> bool:
            return True

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            pass

        def apply(self, logits):
            return logits
else:
    class FreespecHints(LogitsProcessor):
        @classmethod
        def validate_params(cls, sampling_params) -> None:
            hints.parse(sampling_params.extra_args)

        def __init__(self, vllm_config, req_states) -> None:
            self._token_history = req_states.all_token_ids  # the model runner's; its speculator's key

        def add_request(self, req_idx: int, sampling_params) -> bool:
            extra_args = getattr(sampling_params, "extra_args", None)
            if extra_args and any(key in extra_args for key in hints.HINT_KEYS):
                from .speculator import for_token_history  # in the worker only (torch, the speculator)

                speculator = for_token_history(self._token_history)
                if speculator is not None:
                    speculator.set_hints(req_idx, extra_args)
            return False

        def apply(self, logits, ctx):
            return logits
