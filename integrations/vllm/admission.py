"""``FreespecHints``: vLLM checks freespec's per-request hints when it admits a request.

Registered as a plugin of vLLM's ``vllm.logits_processors`` entry-point group
(pyproject), the one hook vLLM runs on every request's ``SamplingParams`` at
admission (``validate_params``) in the process that received it: a malformed
``documents`` or ``prediction`` is refused there (HTTP 400 from ``vllm serve``,
``ValueError`` from ``LLM.generate``), and never reaches the engine. vLLM does
not build plugin logits processors for speculative engines; where it builds
this one (an engine without speculation) it changes nothing: ``apply`` returns
the logits as they are and it declares itself argmax-invariant.
"""

from __future__ import annotations

from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from . import hints


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
