"""vLLM adapter: freespec drafters serve vLLM's speculative decoding, on the path each vLLM release has.

vLLM 0.34 (a speculator of the V2 model runner, ``method: freespec``, registered by the
``vllm.general_plugins`` entry point ``freespec_vllm_plugin.register``)::

    llm = LLM(model=MODEL, speculative_config={"method": "freespec", "num_speculative_tokens": 8})
    vllm serve MODEL --speculative-config '{"method": "freespec", "num_speculative_tokens": 8}'

vLLM 0.32-0.33 (``method: custom_class``, gone in 0.34)::

    llm = LLM(model=MODEL, speculative_config={"method": "custom_class",
              "model": "freespec.integrations.vllm.Proposer", "num_speculative_tokens": 8})

Either way: ``llm.generate(prompt, SamplingParams(max_tokens=256, extra_args={"documents": [text],
"prediction": old_code}))``. vLLM's engine verifies every draft (its rejection sampler), so output stays
vLLM's. The files: ``proposer.py`` (``BatchDrafter``, what both paths share: request state, hints, the step's
drafts, errors contained; and ``Proposer``, the ``custom_class`` glue), ``speculator.py`` /
``speculator_config.py`` (the 0.34 speculator and its config; the top-level ``freespec_vllm_plugin`` registers it), ``options.py``
(``FREESPEC_VLLM_DRAFTER`` / ``FREESPEC_VLLM_CONFIG``), ``hints.py`` (``documents`` / ``prediction`` in
``SamplingParams.extra_args``), ``admission.py`` (vLLM checks those hints when it admits a request; under 0.34
it also hands them to the speculator), ``version.py`` (which release runs which path), ``bench.py``
(``propose()`` cost beside vLLM's own proposers). Request state follows vLLM's requests through
``freespec.integrations.host_requests``, as in the SGLang plugin. Nothing here imports vllm until vLLM
loads the plugin or builds the proposer.
"""

from __future__ import annotations

PROPOSER = "freespec.integrations.vllm.Proposer"  # speculative_config["model"] under 0.32-0.33
METHOD = "freespec"  # speculative_config["method"] under 0.34 (freespec_vllm_plugin.METHOD)


def __getattr__(name):
    if name == "Proposer":  # vLLM imports this module and reads the class by name
        from .proposer import Proposer

        return Proposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def speculative_config(num_speculative_tokens: int = 8, vllm_version: str | None = None) -> dict:
    """The ``speculative_config`` for ``LLM(...)`` that runs freespec on ``vllm_version`` (default: the installed
    vLLM's): ``{"method": "freespec", ...}`` on 0.34, ``{"method": "custom_class", "model": PROPOSER, ...}`` on
    0.32-0.33; ``IncompatibleVLLM`` elsewhere."""
    from . import version

    found = vllm_version or version.installed_version()
    path = version.path_of(found)
    if path == version.SPECULATOR:
        return {"method": METHOD, "num_speculative_tokens": int(num_speculative_tokens)}
    if path == version.CUSTOM_CLASS:
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": int(num_speculative_tokens)}
    raise version.IncompatibleVLLM(f"freespec supports no path on vllm {found} ({version.WHAT_EACH_RELEASE_GETS})")


def runner_proposer(model_runner):
    """What proposes drafts in a vLLM model runner: ``drafter`` (0.32-0.33), ``speculator`` (0.34's V2 runner)."""
    found = getattr(model_runner, "drafter", None)
    return found if found is not None else getattr(model_runner, "speculator", None)


__all__ = ["METHOD", "PROPOSER", "Proposer", "runner_proposer", "speculative_config"]
