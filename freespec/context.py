"""Documents for every ``generate()`` inside a block, without touching the call.

    with freespec.documents(passages, tokenizer=tokenizer):
        chain.invoke(question)       # a framework calls model.generate() for you: it drafts from passages

Pipelines and frameworks (``transformers.pipeline``, LangChain's
``HuggingFacePipeline``, ...) call ``model.generate()`` themselves, so a caller
cannot add ``generate(documents=...)`` (and the text-generation pipeline's own
``documents=`` goes to the chat template, not to ``generate()``). Inside
``with freespec.documents(docs)``, every ``generate()`` of a patched model
drafts from ``docs`` as if it had been given ``documents=docs``, besides its
own ``documents=`` if any. Blocks nest: an inner block adds its documents to the
outer one's. They only change speed: output stays what the model produces, and
a call that falls back to plain decoding, or a model that is not patched,
ignores them.

Texts are tokenized once, on entering the block, with ``tokenizer=`` (the
tokenizer of the model that will generate; ``tokenizer.encode(text,
add_special_tokens=False)``); token-id sequences need none. A text without a
tokenizer raises ``ValueError`` there, not inside the framework's call.

The documents live in a ``contextvars.ContextVar``: a block is seen by the code
it runs, by asyncio tasks created inside it (each task copies the context when
it is created) and by work that frameworks hand to thread pools with the
context copied (LangChain's ``ainvoke`` and ``batch`` do), never by other
threads or tasks. A thread started with ``threading.Thread`` inside the block
starts with an empty context, so it does not see the documents unless it runs
in a copy of the context: ``Thread(target=contextvars.copy_context().run,
args=(pipe, prompt))``. (LangChain's ``HuggingFacePipeline.stream`` starts such
a thread: its streamed calls decode without the documents, as plain calls would.)
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator

import numpy as np

from .drafters.corpus import document_token_ids

_ACTIVE: ContextVar[tuple[np.ndarray, ...]] = ContextVar("freespec_documents", default=())


@contextmanager
def documents(docs: Iterable, tokenizer=None) -> Iterator[tuple[np.ndarray, ...]]:
    """Every patched ``generate()`` inside the block drafts from ``docs`` (texts or token-id sequences).

    Yields the token ids of the documents this block adds. Bad input raises
    ``ValueError`` naming ``freespec.documents``, on entry.
    """
    added = tuple(document_token_ids(docs, tokenizer, name="freespec.documents() docs"))
    token = _ACTIVE.set(_ACTIVE.get() + added)
    try:
        yield added
    finally:
        _ACTIVE.reset(token)


def active_documents() -> tuple[np.ndarray, ...]:
    """Token ids of the documents of every enclosing ``freespec.documents`` block, outermost first."""
    return _ACTIVE.get()
