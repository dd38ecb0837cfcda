"""One-line speculation for Hugging Face ``model.generate()``.

    import freespec
    model = freespec.patch(model)          # or patch(model, SpecConfig(...), max_draft_tokens=16)
    out = model.generate(**inputs, max_new_tokens=256)
    freespec.stats(model)                  # SpecStats of the last call
    freespec.unpatch(model)

The patch replaces ``generate`` on this one model instance (never on the
class) with a wrapper that calls the original ``generate()`` through its
public ``custom_generate=`` callable hook: transformers still prepares the
generation config, logits processors and stopping criteria exactly as for
plain decoding, and the callable runs freespec's engine with them.

What falls back to plain ``generate()`` (with one logged warning per reason
and ``stats(model).fallback_reason`` set), never silently different output:
batch size > 1, beam search, ``num_return_sequences > 1``, an assistant model
or HF prompt lookup, a user-supplied cache, a padded attention mask,
``output_attentions``/``output_hidden_states``, classifier-free guidance,
a non-default ``cache_implementation`` and extra model inputs (images, ...).
Streamers work: transformers does not hand a streamer to a custom_generate
callable, so the wrapper keeps it and the engine feeds it.

One argument plain ``generate()`` lacks: ``documents=[...]`` (texts, with
``tokenizer=``, or token-id sequences) gives this call's drafter documents to
draft from, e.g. the retrieved passages of a RAG prompt. If the call falls
back to plain decoding, documents only cost nothing: output is the same.
"""

from __future__ import annotations

import copy
import logging
import weakref

import torch

from ..config import SpecConfig
from ..engine import ModelTraits, SpeculativeDecoder, UnsupportedForSpeculation
from ..stats import SpecStats

logger = logging.getLogger("freespec")

SUPPORTED_TRANSFORMERS = ((5, 24), (6, 0))  # [min, max)

# model kwargs that generate() prepares for plain decoding and the engine honours
_MODEL_KWARGS_OK = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values",
                    "cache_position"}

_patched: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _PatchState:
    def __init__(self, model, config: SpecConfig):
        self.config = config
        self.original_generate = model.generate
        self.had_instance_generate = "generate" in model.__dict__
        self.drafter = config.make_drafter()
        self.stats = SpecStats()
        self.warned: set[str] = set()


def _check_transformers_version() -> None:
    import transformers

    parts = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_TRANSFORMERS
    if not (low <= parts < high):
        raise RuntimeError(
            f"freespec supports transformers >= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}; "
            f"found {transformers.__version__}"
        )


def patch(model, config: SpecConfig | None = None, **overrides):
    """Make ``model.generate()`` speculate. Returns the model.

    ``config``: a ``SpecConfig`` (default ``SpecConfig()``); ``overrides``: its
    fields by name (``patch(model, max_draft_tokens=16)``). An unknown option
    raises ``TypeError`` naming it; patching a patched model raises ``RuntimeError``.
    """
    _check_transformers_version()
    if model in _patched:
        raise RuntimeError("this model is already patched by freespec; call freespec.unpatch(model) first")
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel with generate(), got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("freespec speculates for decoder-only causal LMs; this model is encoder-decoder")
    if config is not None and not isinstance(config, SpecConfig):
        raise TypeError(f"config must be a freespec.SpecConfig, got {type(config).__name__}")
    config = config or SpecConfig()
    if overrides:
        config = config.replace(**overrides)
    try:
        ModelTraits.of(model)
    except UnsupportedForSpeculation as exc:
        raise ValueError(f"freespec cannot drive this model: {exc}") from None
    state = _PatchState(model, config)
    _patched[model] = state

    def generate(*args, **kwargs):
        return _generate(model, state, *args, **kwargs)

    generate.__doc__ = f"Speculative generate() by freespec.\n\n{state.original_generate.__doc__ or ''}"
    generate.__wrapped__ = state.original_generate
    model.generate = generate
    return model


def unpatch(model):
    """Restore the model's own ``generate()``. Returns the model."""
    state = _patched.pop(model, None)
    if state is None:
        raise RuntimeError("this model is not patched by freespec")
    if state.had_instance_generate:
        model.generate = state.original_generate
    else:
        del model.generate
    return model


def stats(model) -> SpecStats:
    state = _patched.get(model)
    if state is None:
        raise RuntimeError("this model is not patched by freespec; call freespec.patch(model) first")
    return state.stats


def is_patched(model) -> bool:
    return model in _patched


# ---------------------------------------------------------------- internals
class _Fallback(Exception):
    pass


def _fallback_reason_from_kwargs(args, kwargs) -> str | None:
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if "custom_generate" in kwargs:
        return "custom_generate was given"
    if kwargs.get("assistant_model") is not None:
        return "an assistant_model was given"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds instead of input_ids"
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return "a user-supplied cache"
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[0] > 1:
        return f"batch size {inputs.shape[0]} > 1"
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool((mask == 1).all()):
        return "a padded attention_mask"
    return None


def _fallback_reason_from_config(generation_config, model_kwargs) -> str | None:
    gc = generation_config
    checks = [
        (getattr(gc, "num_beams", 1) not in (None, 1), "beam search (num_beams > 1)"),
        (getattr(gc, "num_return_sequences", 1) not in (None, 1), "num_return_sequences > 1"),
        (getattr(gc, "prompt_lookup_num_tokens", None) is not None, "HF prompt lookup was requested"),
        (getattr(gc, "assistant_early_exit", None) is not None, "assistant_early_exit was requested"),
        (bool(getattr(gc, "output_attentions", False)), "output_attentions"),
        (bool(getattr(gc, "output_hidden_states", False)), "output_hidden_states"),
        (getattr(gc, "guidance_scale", None) not in (None, 1, 1.0), "classifier-free guidance"),
        (getattr(gc, "cache_implementation", None) is not None, f"cache_implementation={gc.cache_implementation!r}"),
        (getattr(gc, "use_cache", True) is False, "use_cache=False"),
        (getattr(gc, "dola_layers", None) is not None, "DoLa decoding"),
        (getattr(gc, "penalty_alpha", None) is not None, "contrastive search"),
    ]
    for bad, reason in checks:
        if bad:
            return reason
    extra = {k for k, v in model_kwargs.items() if v is not None} - _MODEL_KWARGS_OK
    if extra:
        return f"extra model inputs {sorted(extra)}"
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        return "a padded attention_mask"
    return None


def _fall_back(state: _PatchState, reason: str, args, kwargs, streamer):
    if reason not in state.warned:
        state.warned.add(reason)
        logger.warning("freespec: falling back to plain generate() because of %s", reason)
    state.stats = SpecStats(fallback_reason=reason)
    if streamer is not None:
        kwargs["streamer"] = streamer
    return state.original_generate(*args, **kwargs)


def _move_stop_strings(model, kwargs) -> dict:
    """Turn stop strings into a StopStringCriteria in ``stopping_criteria``.

    transformers drops the ``tokenizer`` argument on its way to a
    custom_generate callable, so stop strings would fail there; built here,
    the criterion is the one plain generate() builds. Returns new kwargs.
    """
    from transformers import StoppingCriteriaList, StopStringCriteria

    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    config = kwargs.get("generation_config")
    if stop_strings is None and config is not None and getattr(config, "stop_strings", None):
        stop_strings = config.stop_strings
        kwargs["generation_config"] = copy.deepcopy(config)
        kwargs["generation_config"].stop_strings = None
    if stop_strings is None and getattr(model.generation_config, "stop_strings", None):
        stop_strings = model.generation_config.stop_strings
        kwargs["stop_strings"] = None
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= to generate()")
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
    return kwargs


def _generate(model, state: _PatchState, *args, **kwargs):
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(inputs, torch.Tensor) and inputs.shape[-1] == 0:
        raise ValueError("input_ids is empty: freespec needs a prompt of at least one token (e.g. the BOS token)")
    streamer = kwargs.pop("streamer", None)
    documents = kwargs.pop("documents", None)
    if documents is not None:
        if not state.drafter.accepts_documents:
            raise ValueError(f"documents= needs a drafter that drafts from documents (mixture, corpus); "
                             f"this model's drafter is {state.drafter.name!r}")
        if isinstance(documents, (str, bytes)) or not hasattr(documents, "__iter__"):
            raise ValueError("documents must be a list of texts or of token-id sequences")
        documents = list(documents)
        if any(isinstance(d, str) for d in documents) and kwargs.get("tokenizer") is None:
            raise ValueError("text documents need tokenizer= in generate() to turn them into token ids")
    reason = _fallback_reason_from_kwargs(args, kwargs)
    if reason is not None:
        return _fall_back(state, reason, args, kwargs, streamer)

    stats_box: list[SpecStats] = []

    def speculative_generate(model_, input_ids, logits_processor, stopping_criteria, generation_config,
                             **model_kwargs):
        reason_ = _fallback_reason_from_config(generation_config, model_kwargs)
        if reason_ is None and input_ids.shape[0] != 1:
            reason_ = f"batch size {input_ids.shape[0]} > 1"
        if reason_ is not None:
            raise _Fallback(reason_)
        traits = ModelTraits.of(model_)
        stats_ = SpecStats()
        stats_box.append(stats_)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        decoder = SpeculativeDecoder(model_, state.drafter, state.config, stats_, traits)
        sequences, scores, logits, cache = decoder.generate(
            input_ids, logits_processor, stopping_criteria, generation_config, streamer,
            documents=documents, tokenizer=tokenizer)
        if generation_config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(
                sequences=sequences,
                scores=tuple(scores) if generation_config.output_scores else None,
                logits=tuple(logits) if generation_config.output_logits else None,
                cache=cache,
            )
        return sequences

    tokenizer = kwargs.get("tokenizer")
    if kwargs.get("token_healing"):
        return _fall_back(state, "token_healing", args, kwargs, streamer)
    try:
        result = state.original_generate(*args, custom_generate=speculative_generate,
                                         **_move_stop_strings(model, kwargs))
    except (_Fallback, UnsupportedForSpeculation) as exc:
        return _fall_back(state, str(exc), args, kwargs, streamer)
    if stats_box:
        state.stats = stats_box[-1]
    return result
