"""Drafters: one file per source of drafts. ``make(name, **options)`` builds one by name."""

from __future__ import annotations

import importlib

from .base import Drafter, VerifyOutput

# name -> "module:Class"; modules import lazily so a missing optional dependency
# only matters to the drafter that needs it
_REGISTRY = {
    "prompt_lookup": "freespec.drafters.prompt_lookup:PromptLookupDrafter",
    "suffix": "freespec.drafters.suffix:SuffixDrafter",
    "ngram": "freespec.drafters.ngram_table:NgramTableDrafter",
    "corpus": "freespec.drafters.corpus:CorpusDrafter",
    "mixture": "freespec.drafters.mixture:MixtureDrafter",
    "prediction": "freespec.drafters.prediction:PredictionDrafter",
    "recycle": "freespec.drafters.recycle:RecycleDrafter",
    "lookahead": "freespec.drafters.lookahead:LookaheadDrafter",
    "early_exit": "freespec.drafters.early_exit:EarlyExitDrafter",
}


def register(name: str, target: str) -> None:
    """Register a drafter class under ``name`` ("package.module:Class")."""
    _REGISTRY[name] = target


def available() -> list[str]:
    return sorted(_REGISTRY)


def drafter_class(name: str) -> type:
    """The class registered as ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"drafter={name!r} is unknown; available: {', '.join(available())}")
    module_name, cls_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def make(name: str, **options) -> Drafter:
    """Build the drafter registered as ``name`` with ``options``.

    ``make("prompt_lookup", max_ngram=4)``; an unknown name or option raises.
    """
    cls = drafter_class(name)
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"bad drafter_options for {name!r}: {exc}") from None


__all__ = ["Drafter", "VerifyOutput", "available", "drafter_class", "make", "register"]
