"""freespec: model-free speculative decoding with lossless tree verification.

    import freespec
    model = freespec.patch(model)            # model.generate() now speculates
    out = model.generate(**inputs, max_new_tokens=256)
    freespec.stats(model)                    # SpecStats of the last call
    freespec.unpatch(model)

What plain ``generate()`` lacks, each a hint that changes speed, never output::

    model.generate(**inputs, documents=[...], tokenizer=tok)   # texts or token ids to draft from (RAG)
    model.generate(**inputs, prediction=old_code, tokenizer=tok)  # the expected output (code edits)
    with freespec.documents(docs, tokenizer=tok):              # documents for every generate() inside,
        chain.invoke(question)                                 # e.g. a framework's (contextvars)
"""

from .config import SpecConfig
from .context import active_documents, documents
from .draft import Budget, Draft, merge
from .drafters import Drafter, VerifyOutput
from .stats import DrafterStats, SpecStats

__version__ = "0.1.0"


def patch(model, config=None, **overrides):
    """Make ``model.generate()`` speculate; see ``freespec.integrations.transformers.patch``."""
    from .integrations.transformers import patch as _patch

    return _patch(model, config, **overrides)


def unpatch(model):
    """Undo ``patch``: ``model.generate()`` is plain again."""
    from .integrations.transformers import unpatch as _unpatch

    return _unpatch(model)


def stats(model) -> SpecStats:
    """SpecStats of the last ``generate()`` call of a patched model."""
    from .integrations.transformers import stats as _stats

    return _stats(model)


__all__ = [
    "Budget", "Draft", "Drafter", "DrafterStats", "SpecConfig", "SpecStats", "VerifyOutput",
    "active_documents", "documents", "merge", "patch", "stats", "unpatch",
]
