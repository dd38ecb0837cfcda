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

from dataclasses import dataclass

HINT_KEYS = ("documents", "prediction")


@dataclass(frozen=True)
class Hints:
    documents: tuple = ()  # texts (str) or token-id lists
    prediction: str | tuple | None = None  # text, or token ids


def _token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in value)


def parse(extra_args) -> Hints | None:
    """The hints in ``extra_args`` (None without any); ``ValueError`` naming the key that is malformed.

    ``parse({"documents": "a text", "prediction": [5, 6]}) -> Hints(documents=("a text",), prediction=(5, 6))``
    """
    if not extra_args or not any(key in extra_args for key in HINT_KEYS):
        return None
    documents = extra_args.get("documents", ())
    if isinstance(documents, str):
        documents = (documents,)
    if not isinstance(documents, (list, tuple)) or not all(isinstance(d, str) or _token_ids(d) for d in documents):
        raise ValueError("extra_args['documents'] (vllm_xargs over HTTP) must be a list of texts, or of token-id "
                         f"lists, got {_describe(documents)}")
    prediction = extra_args.get("prediction")
    if prediction is not None and not (isinstance(prediction, str) or _token_ids(prediction)):
        raise ValueError("extra_args['prediction'] (vllm_xargs over HTTP) must be a text or a list of token ids, "
                         f"got {_describe(prediction)}")
    return Hints(tuple(d if isinstance(d, str) else tuple(d) for d in documents),
                 prediction if prediction is None or isinstance(prediction, str) else tuple(prediction))


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
