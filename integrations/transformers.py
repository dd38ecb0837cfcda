"""One-line speculation for Hugging Face ``model.generate()``.

    import freespec
    model = freespec.patch(model)          # or patch(model, SpecConfig(...), max_draft_tokens=16)
    out = model.generate(**inputs, max_new_tokens=256)
    freespec.stats(model)                  # SpecStats of the last call
    freespec.unpatch(model)

The patch puts a ``PatchedGenerate`` in this one model instance's ``generate``
(never on the class), which calls the model's own ``generate()`` through its
public ``custom_generate=`` callable hook: transformers still prepares the
generation config, logits processors and stopping criteria (stop strings
included: the callable takes ``tokenizer``, so transformers routes it there)
exactly as for plain decoding, and the callable runs freespec's engine with them.

A left-padded batch speculates row by row (each row its own draft tree, one
forward for all). What falls back to plain ``generate()`` (with one logged
warning per reason and ``stats(model).fallback_reason`` set), never silently
different output: beam search, an assistant model or HF prompt lookup, a
user-supplied cache, an attention mask that is not left padding or whose shape
differs from the input's, ``output_attentions``/``output_hidden_states``,
classifier-free guidance, a non-default ``cache_implementation``, token healing
and extra model inputs (images, ...); and, for batches of several rows only,
``output_scores``/``output_logits``, ALiBi or dynamic/LongRoPE models and
``prefix_allowed_tokens_fn``. Streamers work: transformers does not hand
a streamer to a custom_generate callable, so the wrapper keeps it and the engine
feeds it.

Arguments plain ``generate()`` lacks, each a hint that changes speed, never
output: ``documents=[...]`` (texts, with ``tokenizer=``, or token-id sequences)
gives this call's drafter documents to draft from, e.g. the retrieved passages
of a RAG prompt, after those of the enclosing ``freespec.documents(...)``
blocks (``freespec/context.py``: how a framework that calls ``generate()`` for
you gets them); ``prediction=`` (a text, with ``tokenizer=``, or 1-D token ids;
for a batch, one for all rows or a list of one per row) is the output the caller
expects, e.g. the file a code edit rewrites. Both are
checked on every call (a bad one raises ``ValueError`` naming it) and dropped
when the call falls back to plain decoding.
"""

from __future__ import annotations

import copy
import logging

import numpy as np
import torch

from ..compat import generate_output, transformers_version
from ..config import SpecConfig
from ..drafters.base import as_token_array, encode_text
from ..engine import ModelTraits, SpeculativeDecoder, UnsupportedForSpeculation
from ..stats import SpecStats
from ..tree import warm_kernels

logger = logging.getLogger("freespec")

SUPPORTED_TRANSFORMERS = ((4, 57), (6, 0))  # [min, max)

# model kwargs that generate() prepares for plain decoding and the engine honours
# model kwargs that generate() prepares for plain decoding and the engine honours
_MODEL_KWARGS_OK = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values",
                    "cache_position"}

# model_type of every architecture the exactness matrix (tests/test_architectures.py) checks against plain
# generate(); anything else is refused at patch() unless SpecConfig(allow_untested_model=True)
TESTED_MODEL_TYPES = frozenset({
    "bloom", "cohere", "falcon", "gemma", "gemma2", "gemma3_text", "gpt2", "gpt_bigcode", "gpt_neox", "gptj",
    "granite", "llama", "mistral", "mixtral", "mpt", "olmo2", "opt", "phi", "phi3", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_moe", "stablelm", "starcoder2",
})


class PatchedGenerate:
    """What ``patch()`` puts in ``model.generate``: speculation, with the patch's state.

    A module-level class (not a closure), so a patched model deep-copies (the copy
    generates with the copy, and is patched) and pickles (``torch.save``), and
    nothing outside the model keeps it alive.
    """

    def __init__(self, model, config: SpecConfig):
        self.model = model
        self.config = config
        self.previous = model.__dict__.get("generate")  # an instance generate() set before ours, if any
        self.drafter = config.make_drafter()
        self.stats = SpecStats()
        self.warned: set[str] = set()
        if self.drafter.needs_model:
            self.drafter.attach_model(model_handle(model, self.drafter.name))
        # numba's kernels compile, or load from its cache, here rather than inside the first generate(): loading
        # them took about 0.4 s of that call's drafting (smollm2-135m, a batch of 5, 2-core AMD EPYC)
        self.drafter.warmup()
        warm_kernels()

    @property
    def __wrapped__(self):
        """The model's own ``generate()``."""
        return self.previous if self.previous is not None else type(self.model).generate.__get__(self.model)

    @property
    def __doc__(self):
        return f"Speculative generate() by freespec.\n\n{type(self.model).generate.__doc__ or ''}"

    def __call__(self, *args, **kwargs):
        return _generate(self, *args, **kwargs)


def model_handle(model, drafter_name: str):
    """The narrow handle a drafter with ``needs_model`` receives (``freespec.model_handle``).

    An architecture the handle does not support raises ``ValueError`` naming the
    drafter and the architecture: only drafters that run the model refuse it.
    """
    from ..model_handle import ModelHandle, UnsupportedModel

    try:
        return ModelHandle.of(model)
    except UnsupportedModel as exc:
        raise ValueError(f"drafter {drafter_name!r} drafts with the model's own layers and cannot run on this "
                         f"model: {exc}; choose a drafter that does not (e.g. mixture)") from None


def _check_transformers_version() -> None:
    import transformers

    low, high = SUPPORTED_TRANSFORMERS
    if not (low <= transformers_version() < high):
        raise RuntimeError(
            f"freespec supports transformers >= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}; "
            f"found {transformers.__version__}"
        )


def patch(model, config: SpecConfig | None = None, **overrides):
    """Make ``model.generate()`` speculate. Returns the model.

    ``config``: a ``SpecConfig`` (default ``SpecConfig()``); ``overrides``: its
    fields by name (``patch(model, max_draft_tokens=16)``). An unknown option
    raises ``TypeError`` naming it; patching a patched model raises ``RuntimeError``;
    a model whose architecture freespec has not been tested on raises ``ValueError``
    naming it (``allow_untested_model=True`` to try it anyway). The drafter's and the engine's compiled kernels
    load here (numba's on-disk cache; about half a second the first time in a process), so the first
    ``generate()`` is as fast as the next.

    What it promises: with ``do_sample=False`` the output is token-for-token the
    output of unpatched ``generate()`` in float32 and float64; in bfloat16 and
    float16 a forward over many tokens rounds differently from one over a single
    token, so the output may depart from plain decoding's where two tokens' logits
    are within rounding of each other (as with transformers' own assisted decoding
    and prompt lookup). With sampling, the output has the model's distribution.
    """
    _check_transformers_version()
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel with generate(), got {type(model).__name__}")
    if is_patched(model):
        raise RuntimeError("this model is already patched by freespec; call freespec.unpatch(model) first")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("freespec speculates for decoder-only causal LMs; this model is encoder-decoder")
    if config is not None and not isinstance(config, SpecConfig):
        raise TypeError(f"config must be a freespec.SpecConfig, got {type(config).__name__}")
    config = config or SpecConfig()
    if overrides:
        config = config.replace(**overrides)
    model_type = getattr(model.config, "model_type", None)
    if model_type not in TESTED_MODEL_TYPES and not config.allow_untested_model:
        raise ValueError(f"freespec has not been tested on model_type {model_type!r}: its output is checked against "
                         f"plain generate() for {', '.join(sorted(TESTED_MODEL_TYPES))}; pass "
                         f"allow_untested_model=True to speculate anyway")
    try:
        ModelTraits.of(model)
    except UnsupportedForSpeculation as exc:
        raise ValueError(f"freespec cannot drive this model: {exc}") from None
    model.generate = PatchedGenerate(model, config)
    return model


def unpatch(model):
    """Restore the model's own ``generate()``. Returns the model."""
    patched = _patched(model)
    if patched.previous is not None:
        model.generate = patched.previous
    else:
        del model.generate
    return model


def stats(model) -> SpecStats:
    """SpecStats of the last ``generate()`` call of a patched model."""
    return _patched(model, "; call freespec.patch(model) first").stats


def is_patched(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get("generate"), PatchedGenerate)


def _patched(model, hint: str = "") -> PatchedGenerate:
    if not is_patched(model):
        raise RuntimeError(f"this model is not patched by freespec{hint}")
    return model.__dict__["generate"]


# ---------------------------------------------------------------- internals
class _Fallback(Exception):
    pass


def _input_ids(args, kwargs):
    return args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))


def _check_input_ids(inputs) -> None:
    if not isinstance(inputs, torch.Tensor):
        return
    if inputs.shape[-1] == 0:
        raise ValueError("input_ids is empty: freespec needs a prompt of at least one token (e.g. the BOS token)")
    if inputs.is_floating_point() or inputs.is_complex() or inputs.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {inputs.dtype}")


def _fallback_reason_from_kwargs(args, kwargs) -> str | None:
    inputs = _input_ids(args, kwargs)
    if "custom_generate" in kwargs:
        return "custom_generate was given"
    if kwargs.get("assistant_model") is not None:
        return "an assistant_model was given"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds instead of input_ids"
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return "a user-supplied cache"
    if kwargs.get("token_healing"):
        return "token_healing"
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and isinstance(inputs, torch.Tensor) and mask.shape != inputs.shape:
        return f"attention_mask of shape {list(mask.shape)} for input_ids of shape {list(inputs.shape)}"
    return _padding_reason(mask)


def _padding_reason(mask) -> str | None:
    """Left padding (each row: zeros, then ones) is what batched generate() takes; anything else falls back."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or bool((mask == 1).all()):
        return None
    if not bool(((mask == 0) | (mask == 1)).all()) or bool((mask[:, 1:] < mask[:, :-1]).any()):
        return "an attention_mask that is not left padding (right padding or holes)"
    if bool((mask.sum(-1) == 0).any()):
        return "a row of the attention_mask with no token"
    return None


def _fallback_reason_from_config(generation_config, model_kwargs) -> str | None:
    gc = generation_config
    checks = [
        (getattr(gc, "num_beams", 1) not in (None, 1), "beam search (num_beams > 1)"),
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
    return _padding_reason(model_kwargs.get("attention_mask"))


def _batch_fallback_reason(model, generation_config, logits_processor, batch_size: int) -> str | None:
    """What a batch of several rows cannot honour (a batch of one can)."""
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor

    if batch_size == 1:
        return None
    traits = ModelTraits.of(model)
    checks = [
        (bool(generation_config.return_dict_in_generate and (generation_config.output_scores
                                                             or generation_config.output_logits)),
         "output_scores / output_logits with a batch (rows advance unevenly)"),
        (traits.chains_only, "an ALiBi model with a batch (its bias follows key indices, which padding shifts)"),
        (traits.rope_dynamic_limit is not None or traits.rope_long_limit is not None,
         "a dynamic or LongRoPE rotary embedding with a batch (its frequencies follow the whole batch's length)"),
        (any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in logits_processor),
         "prefix_allowed_tokens_fn with a batch (it is called with a row index)"),
    ]
    return next((reason for bad, reason in checks if bad), None)


def _fall_back(patched: PatchedGenerate, reason: str, args, kwargs, streamer):
    if reason not in patched.warned:
        patched.warned.add(reason)
        logger.warning("freespec: falling back to plain generate() because of %s", reason)
    patched.stats = SpecStats(fallback_reason=reason)
    if streamer is not None:
        kwargs["streamer"] = streamer
    return patched.__wrapped__(*args, **kwargs)


def _stop_strings_as_criteria(model, args, kwargs) -> tuple[tuple, dict]:
    """Stop strings, wherever given, as a ``StopStringCriteria`` in ``stopping_criteria``.

    transformers drops generate()'s ``tokenizer`` on the way to a ``custom_generate``
    callable and then cannot build the stop-string criterion itself. So the stop
    strings it would use are taken here, with its priority (``stop_strings=`` over a
    ``generation_config`` passed positionally or by name over ``model.generation_config``),
    removed from all three, and the same criterion plain generate() builds is passed in.
    """
    from transformers import StoppingCriteriaList, StopStringCriteria

    args, kwargs = list(args), dict(kwargs)
    position = 1 if len(args) > 1 else None
    config = args[1] if position else kwargs.get("generation_config")
    stop_strings = kwargs.get("stop_strings")
    if "stop_strings" not in kwargs:
        stop_strings = getattr(config, "stop_strings", None) or model.generation_config.stop_strings
    if config is not None and getattr(config, "stop_strings", None) is not None:
        config = copy.deepcopy(config)
        config.stop_strings = None
        if position:
            args[1] = config
        else:
            kwargs["generation_config"] = config
    if "stop_strings" in kwargs or model.generation_config.stop_strings is not None:
        kwargs["stop_strings"] = None  # over model.generation_config's, whose value fills unset fields
    if stop_strings:
        tokenizer = kwargs.pop("tokenizer", None)
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer= to generate()")
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
    return tuple(args), kwargs


def _documents(patched: PatchedGenerate, documents, tokenizer) -> list | None:
    """This call's documents: those of ``generate(documents=...)`` (texts, with ``tokenizer=``, or token-id
    sequences) after those of the enclosing ``freespec.documents`` blocks, checked against the vocabulary."""
    from ..context import active_documents

    scoped = list(active_documents())
    if documents is None and not scoped:
        return None
    where = "documents=" if documents is not None else "freespec.documents()"
    if not patched.drafter.accepts_documents:
        raise ValueError(f"{where} needs a drafter that drafts from documents (mixture, corpus); "
                         f"this model's drafter is {patched.drafter.name!r}")
    if documents is not None:
        if isinstance(documents, (str, bytes)) or not hasattr(documents, "__iter__"):
            raise ValueError("documents must be a list of texts or of token-id sequences")
        documents = list(documents)
        if tokenizer is None and any(isinstance(doc, str) for doc in documents):
            raise ValueError("text documents need tokenizer= in generate() to turn them into token ids")
    vocab_size = patched.model.get_input_embeddings().num_embeddings
    for i, doc in enumerate(scoped):
        _check_in_vocab(doc, vocab_size, f"freespec.documents() document {i}")
    for i, doc in enumerate(documents or []):
        if not isinstance(doc, str):
            _check_in_vocab(np.asarray(doc), vocab_size, f"documents[{i}]")
    return scoped + (documents or [])


def _prediction(patched: PatchedGenerate, prediction, tokenizer, batch_size: int) -> list | None:
    """``generate(prediction=...)`` as token ids per row (None: no prediction for that row).

    One prediction (a text, tokenized with ``tokenizer=``, or 1-D token ids) serves
    every row; a list with one entry per row (each a text, token ids or None), or a
    2-D tensor, gives each row its own.
    """
    if prediction is None:
        return None
    if not patched.drafter.accepts_prediction:
        raise ValueError(f"prediction= needs a drafter that drafts from a predicted output (mixture, prediction); "
                         f"this model's drafter is {patched.drafter.name!r}")
    if isinstance(prediction, torch.Tensor):
        prediction = prediction.cpu().numpy()
    per_row = (isinstance(prediction, np.ndarray) and prediction.ndim == 2) or (
        isinstance(prediction, (list, tuple)) and any(p is None or isinstance(p, str) or hasattr(p, "__len__")
                                                      for p in prediction))
    if not per_row:
        return [_prediction_ids(patched, prediction, tokenizer, "prediction")] * batch_size
    if len(prediction) != batch_size:
        raise ValueError(f"prediction has {len(prediction)} entries (one per row) for a batch of {batch_size} "
                         f"row(s); pass one text or one 1-D sequence of token ids for every row")
    return [None if p is None else _prediction_ids(patched, p, tokenizer, f"prediction[{r}]")
            for r, p in enumerate(prediction)]


def _prediction_ids(patched: PatchedGenerate, prediction, tokenizer, name: str) -> np.ndarray:
    """One row's prediction as int64 token ids in the vocabulary."""
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError(f"{name} given as text needs tokenizer= in generate() to turn it into token ids "
                             f"(or pass token ids)")
        ids = encode_text(prediction, tokenizer)
    elif isinstance(prediction, bytes) or not hasattr(prediction, "__len__"):
        raise ValueError(f"{name} must be a text or a 1-D sequence of token ids, got {type(prediction).__name__}")
    else:
        ids = as_token_array(prediction, name)
    _check_in_vocab(ids, patched.model.get_input_embeddings().num_embeddings, name)
    return ids.astype(np.int64)


def _expanded(predictions: list | None, num_rows: int) -> list | None:
    """Per-row predictions for ``num_rows`` rows: generate() repeats each row for ``num_return_sequences``.

    ``_expanded([a, b], 4) -> [a, a, b, b]`` (as ``repeat_interleave`` expands the input rows).
    """
    if predictions is None or len(predictions) == num_rows:
        return predictions
    return [p for p in predictions for _ in range(num_rows // len(predictions))]


def _check_in_vocab(ids: np.ndarray, vocab_size: int, name: str) -> None:
    if ids.size and np.issubdtype(ids.dtype, np.integer) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} holds token id {int(ids.max() if ids.max() >= vocab_size else ids.min())}, "
                         f"outside the model's vocabulary [0, {vocab_size})")


def _generate(patched: PatchedGenerate, *args, **kwargs):
    _check_input_ids(_input_ids(args, kwargs))
    streamer = kwargs.pop("streamer", None)
    documents = _documents(patched, kwargs.pop("documents", None), kwargs.get("tokenizer"))
    inputs = _input_ids(args, kwargs)
    batch_size = inputs.shape[0] if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 1
    predictions = _prediction(patched, kwargs.pop("prediction", None), kwargs.get("tokenizer"), batch_size)
    reason = _fallback_reason_from_kwargs(args, kwargs)
    if reason is not None:
        return _fall_back(patched, reason, args, kwargs, streamer)
    stats_box: list[SpecStats] = []

    tokenizer = kwargs.get("tokenizer")
    args, kwargs = _stop_strings_as_criteria(patched.model, args, kwargs)

    def speculative_generate(model_, input_ids, logits_processor, stopping_criteria, generation_config,
                             **model_kwargs):
        reason_ = (_fallback_reason_from_config(generation_config, model_kwargs)
                   or _batch_fallback_reason(model_, generation_config, logits_processor, input_ids.shape[0]))
        if reason_ is not None:
            raise _Fallback(reason_)
        stats_box.append(SpecStats())
        if streamer is not None:
            streamer.put(input_ids.cpu())
        decoder = SpeculativeDecoder(model_, patched.drafter, patched.config, stats_box[-1], ModelTraits.of(model_))
        sequences, scores, logits, cache = decoder.generate(
            input_ids, logits_processor, stopping_criteria, generation_config, streamer,
            documents=documents, tokenizer=tokenizer, attention_mask=model_kwargs.get("attention_mask"),
            predictions=_expanded(predictions, input_ids.shape[0]))
        if not generation_config.return_dict_in_generate:
            return sequences
        return generate_output(sequences, tuple(scores) if generation_config.output_scores else None,
                               tuple(logits) if generation_config.output_logits else None, cache)

    try:
        result = patched.__wrapped__(*args, custom_generate=speculative_generate, **kwargs)
    except (_Fallback, UnsupportedForSpeculation) as exc:
        return _fall_back(patched, str(exc), args, kwargs, streamer)
    if stats_box:
        patched.stats = stats_box[-1]
    return result
