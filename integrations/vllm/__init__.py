"""vLLM adapter: freespec drafters serve vLLM's speculative decoding (``method: custom_class``).

::

    from vllm import LLM, SamplingParams
    llm = LLM(model=MODEL, speculative_config={"method": "custom_class",
              "model": "freespec.integrations.vllm.Proposer", "num_speculative_tokens": 8})
    llm.generate(prompt, SamplingParams(max_tokens=256, extra_args={"documents": [text], "prediction": old_code}))

    vllm serve MODEL --speculative-config '{"method": "custom_class", "model": "freespec.integrations.vllm.Proposer", "num_speculative_tokens": 8}'

vLLM's engine verifies every draft (its rejection sampler), so output stays
vLLM's. The files: ``proposer.py`` (the proposer: rows to requests, exits,
hints, errors contained), ``options.py`` (``FREESPEC_VLLM_DRAFTER`` /
``FREESPEC_VLLM_CONFIG``), ``hints.py`` (``documents`` / ``prediction`` in
``SamplingParams.extra_args``), ``admission.py`` (vLLM checks those hints when it
admits a request), ``version.py`` (the vLLM releases supported), ``bench.py``
(``propose()`` cost beside vLLM's own proposers). Request state follows vLLM's
requests through ``freespec.integrations.host_requests``, as in the SGLang
plugin. Nothing here imports vllm until vLLM builds the proposer.
"""

from __future__ import annotations

PROPOSER = "freespec.integrations.vllm.Proposer"  # speculative_config["model"]


def __getattr__(name):
    if name == "Proposer":  # vLLM imports this module and reads the class by name
        from .proposer import Proposer

        return Proposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def speculative_config(num_speculative_tokens: int = 8) -> dict:
    """``{"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}`` for ``LLM(...)``."""
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(num_speculative_tokens)}


__all__ = ["PROPOSER", "Proposer", "speculative_config"]
