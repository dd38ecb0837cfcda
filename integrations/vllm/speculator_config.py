"""``FreespecSpeculatorConfig``: how vLLM 0.34 sets up ``method: freespec`` (imported in every process).

A ``SpeculatorConfig`` with no draft model (vLLM's ``configure`` points the
draft config at the target's, as for ``ngram``). ``apply_options`` runs where
vLLM builds its ``SpeculativeConfig``, as the engine starts: it reads the
drafter and its options (``FREESPEC_VLLM_DRAFTER`` / ``FREESPEC_VLLM_CONFIG``,
``options.py``, as under 0.32-0.33) and builds the drafter once, so a bad option
fails the start with a message naming the file (or variable), the drafter and
the option. Imports neither torch nor the speculator (vLLM's rule for config
modules).
"""

from __future__ import annotations

from vllm.v1.worker.gpu.spec_decode.speculator_config import SpeculatorConfig

from . import options


class FreespecSpeculatorConfig(SpeculatorConfig):
    speculator_class = "freespec.integrations.vllm.speculator.FreespecSpeculator"

    @classmethod
    def apply_options(cls, spec) -> None:
        options.build_drafter(options.from_env())
