"""Per-request hints under vLLM: ``documents`` and ``prediction`` in ``SamplingParams.extra_args``.

vLLM's own per-request channel carries them, from Python and over HTTP alike::

    SamplingParams(max_tokens=256, extra_args={"documents": [text_or_ids, ...], "prediction": text_or_ids})
    client.chat.completions.create(..., extra_body={"vllm_xargs": {"documents": [...], "prediction": "..."}})

``documents``: texts the output may copy from (a list of strings, or one string),
or token-id sequences (a list of lists of ints; not over HTTP, where
``vllm_xargs`` values are flat). ``prediction``: the output the caller expects
(a string, or a list of token ids). Each changes only speed: vLLM's engine
verifies every token.

``parse`` checks them; ``FreespecHints`` (entry point ``vllm.logits_processors``,
so vLLM loads it in its API server and engine) runs ``parse`` when vLLM admits a
request, so a bad hint is refused with HTTP 400 (``ValueError`` from ``LLM``)
naming the key, before it reaches the engine. It changes no logits.
"""

from __future__ import annotations

from ..host_serving import HINT_KEYS, Hints, parse_hints

__all__ = ["HINT_KEYS", "Hints", "parse"]


def parse(extra_args) -> Hints | None:
    """The hints in ``extra_args`` (None without any); ``ValueError`` naming the key that is malformed.

    ``parse({"documents": "a text", "prediction": [5, 6]}) -> Hints(documents=("a text",), prediction=(5, 6))``
    """
    return parse_hints(extra_args, "extra_args", " (vllm_xargs over HTTP)")
