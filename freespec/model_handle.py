"""The narrow handle a drafter that runs the model receives (``Drafter.needs_model``).

A self-drafting drafter (``drafters/early_exit.py``) runs *part* of the target:
some of its decoder layers over a few new tokens, attending to the verified
KV cache, then the final norm and the LM head (possibly over a reduced
vocabulary). ``ModelHandle.of(model)`` builds that from the host model's public
modules (``get_decoder().layers``, ``.norm``, ``.rotary_emb``, the input and
output embeddings) and calls each decoder layer as the host's own loop does;
no host function is copied and nothing in the model is patched. Attention
masks and position ids come from the engine's ``KVLayout.inputs`` (the tree
masks of ``tree.py``), so sliding windows are applied the same way.

A draft pass never writes the verified cache. It reads it in place through a
``DraftCache``: decoder layers call ``cache.update(keys, values, layer_idx)``
on whatever cache they are given, and ``DraftCache.update`` returns the
verified entries followed by the pass's own (scratch) entries, which live in
the ``DraftCache`` and are dropped with it::

    verified cache, layer l:  [k0 .. k(L-1)]                 (never written)
    DraftCache, layer l:      [k0 .. k(L-1) | s0 s1 s2]       s = the pass's tokens
    run(embed([s3]), layers, cache)  -> s3 attends to k0..k(L-1), s0..s3

Each update concatenates, as the host's ``DynamicCache`` does on every
forward: one copy of the layer's keys/values per layer run per call, no copy
of the whole cache per step. Layers a pass skips get no entries.

Supported: ``SUPPORTED_MODEL_TYPES`` (Llama, Qwen2, Qwen3, Gemma 3); ``of()``
raises ``UnsupportedModel`` (a ``ValueError``) naming any other architecture.
What differs between transformers releases (the cache keyword, Gemma 3's
rotary embeddings per layer type) is read once in ``of()`` and used in
``_call_layer``/``position_embeddings`` only.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .batch import KVLayout, RowStep
from .draft import Draft
from .engine import ModelTraits, UnsupportedForSpeculation

SUPPORTED_MODEL_TYPES = ("gemma3_text", "llama", "qwen2", "qwen3")


class UnsupportedModel(ValueError):
    """The model's architecture has no ``ModelHandle`` (see ``SUPPORTED_MODEL_TYPES``)."""


class DraftCache:
    """The verified KV cache, read in place, plus the scratch entries of one draft pass.

    ``verified``: the engine's cache of one row (``batch.RowCacheView``, or a ``DynamicCache``);
    ``verified_len``: how many of its entries are verified (later ones, if any, are ignored).
    ``length`` is ``verified_len`` plus the tokens this pass fed so far. Worked
    example: ``verified_len=10``; ``y`` then ``a`` run through it -> ``length == 12``,
    ``a`` sat at position 11 and attended to the 10 verified entries, ``y`` and itself.
    """

    def __init__(self, verified, verified_len: int):
        if verified_len < 0:
            raise ValueError(f"verified_len must be >= 0, got {verified_len}")
        self.verified, self.verified_len = verified, int(verified_len)
        self._fed: dict[int, int] = {}  # layer -> tokens this pass fed through it
        self._keys: dict[int, torch.Tensor] = {}  # layer -> verified + scratch keys [1, heads, length, dim]
        self._values: dict[int, torch.Tensor] = {}

    @property
    def scratch_len(self) -> int:
        """Tokens this pass fed (through its first layer)."""
        return max(self._fed.values(), default=0)

    @property
    def length(self) -> int:
        return self.verified_len + self.scratch_len

    def _verified_layer(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layers = getattr(self.verified, "layers", None)
        layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
        keys = getattr(layer, "keys", None)
        if self.verified_len == 0 or keys is None or keys.numel() == 0:
            if self.verified_len:
                raise ValueError(f"the verified cache has no entries in layer {layer_idx}, "
                                 f"expected {self.verified_len}")
            empty = like[..., :0, :]
            return empty, empty
        if keys.shape[-2] < self.verified_len:
            raise ValueError(f"the verified cache holds {keys.shape[-2]} entries in layer {layer_idx}, "
                             f"fewer than verified_len={self.verified_len}")
        return keys[..., : self.verified_len, :], layer.values[..., : self.verified_len, :]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """What a decoder layer's attention calls: store this pass's entries, return all of the layer's."""
        if layer_idx not in self._keys:
            self._keys[layer_idx], self._values[layer_idx] = self._verified_layer(layer_idx, key_states)
        self._fed[layer_idx] = self._fed.get(layer_idx, 0) + int(key_states.shape[-2])
        self._keys[layer_idx] = torch.cat([self._keys[layer_idx], key_states], dim=-2)
        self._values[layer_idx] = torch.cat([self._values[layer_idx], value_states], dim=-2)
        return self._keys[layer_idx], self._values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


@dataclass(frozen=True)
class ReducedHead:
    """An LM head over a subset of the vocabulary: ``token_ids`` [V'] and their rows of the head."""

    token_ids: torch.Tensor  # [V'] int64, ascending
    weight: torch.Tensor  # [V', hidden]
    bias: torch.Tensor | None = None  # [V']

    @property
    def size(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass
class ModelHandle:
    """Run a subset of a host model's decoder layers against a cache; final norm; LM head.

    Built by ``of(model)``; a drafter receives it through ``attach_model``. Weights
    are the host's own modules (read, never written): the handle adds only a
    reduced head's gathered rows when a drafter asks for one (``reduced_head``).
    """

    model_type: str
    layers: Sequence[torch.nn.Module]
    norm: torch.nn.Module
    rotary: torch.nn.Module
    embed_tokens: torch.nn.Module
    head: torch.nn.Module
    traits: ModelTraits
    layer_types: tuple[str, ...]
    cache_kwarg: str  # the decoder layer's cache keyword ("cache" or "past_key_values")
    rotary_per_layer_type: bool  # rotary_emb(x, position_ids, layer_type) (Gemma 3 in transformers 5)
    logit_softcap: float | None
    fingerprint: str  # identifies the weights (name, shape, dtype, a digest of a few tensors)
    _model: object = field(repr=False, default=None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def of(cls, model) -> "ModelHandle":
        """The handle of a transformers causal LM; ``UnsupportedModel`` for other architectures."""
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"model_type {model_type!r} has no model handle (supported: "
                                   f"{', '.join(SUPPORTED_MODEL_TYPES)})")
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        parts = {name: getattr(decoder, name, None) for name in ("layers", "norm", "rotary_emb")}
        missing = sorted(name for name, part in parts.items() if part is None)
        if missing:
            raise UnsupportedModel(f"model_type {model_type!r}: the decoder has no {', '.join(missing)} "
                                   f"(this transformers release lays the model out differently)")
        layers = list(parts["layers"])[: config.num_hidden_layers]
        for index, layer in enumerate(layers):
            if getattr(getattr(layer, "self_attn", None), "layer_idx", index) != index:
                raise UnsupportedModel(f"model_type {model_type!r}: decoder layer {index} caches as layer "
                                       f"{layer.self_attn.layer_idx}")
        try:
            traits = ModelTraits.of(model)
        except UnsupportedForSpeculation as exc:
            raise UnsupportedModel(f"model_type {model_type!r}: {exc}") from None
        layer_params = inspect.signature(layers[0].forward).parameters
        if "position_embeddings" not in layer_params:
            raise UnsupportedModel(f"model_type {model_type!r}: its decoder layers take no position_embeddings "
                                   f"(this transformers release lays the model out differently)")
        layer_types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * len(layers))
        rotary_params = inspect.signature(parts["rotary_emb"].forward).parameters
        return cls(
            model_type=model_type, layers=layers, norm=parts["norm"], rotary=parts["rotary_emb"],
            embed_tokens=model.get_input_embeddings(), head=model.get_output_embeddings(), traits=traits,
            layer_types=layer_types[: len(layers)],
            cache_kwarg="cache" if "cache" in layer_params else "past_key_values",
            rotary_per_layer_type="layer_type" in rotary_params,
            logit_softcap=getattr(config, "final_logit_softcapping", None),
            fingerprint=_fingerprint(model, layers), _model=model,
        )

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def vocab_size(self) -> int:
        return int(self.head.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def synchronize(self) -> None:
        """Wait for the device's queued work (timing on an accelerator); a no-op on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def draft_cache(self, verified_cache=None, verified_len: int = 0) -> DraftCache:
        """A ``DraftCache`` over the engine's verified cache (or an empty one, for calibration)."""
        return DraftCache(verified_cache, verified_len)

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def embed(self, token_ids) -> torch.Tensor:
        """The input embeddings of ``token_ids`` ([Q] ints): ``[1, Q, hidden]``."""
        ids = torch.as_tensor(np.asarray(token_ids, np.int64), device=self.device).reshape(1, -1)
        if ids.shape[1] == 0:
            raise ValueError("token_ids is empty: a pass feeds at least one token")
        return self.embed_tokens(ids)

    @torch.no_grad()
    def run(self, hidden: torch.Tensor, layers: Sequence[int], cache,
            keep_hidden: bool = False) -> torch.Tensor | list[torch.Tensor]:
        """Run ``hidden`` ([1, Q, hidden]: Q new tokens at positions ``cache.length ..``) through ``layers``.

        ``layers``: ascending layer indices. The new tokens attend causally to
        everything in ``cache`` and to each other; their entries go to ``cache``'s
        scratch (layers not run get none); a host cache given instead grows.
        Returns the hidden states after the last layer run (before the final norm); with ``keep_hidden``, the list of
        the states entering each run layer followed by the last output.
        ``run(embed(ids), range(num_layers), cache)`` is the host's own forward.
        """
        layers = list(layers)
        ascending = all(a < b for a, b in zip(layers, layers[1:]))
        if not ascending or (layers and not 0 <= layers[0] <= layers[-1] < self.num_layers):
            raise ValueError(f"layers must be ascending indices in [0, {self.num_layers}), got {layers}")
        num_new = int(hidden.shape[1])
        mask, position_ids = self._pass_inputs(num_new, cache.get_seq_length())
        position_embeddings = self.position_embeddings(hidden, position_ids)
        kept = [hidden] if keep_hidden else None
        for index in layers:
            layer_type = self.layer_types[index]
            layer_mask = mask[layer_type] if isinstance(mask, dict) else mask
            hidden = self._call_layer(index, hidden, layer_mask, position_embeddings[layer_type], position_ids, cache)
            if keep_hidden:
                kept.append(hidden)
        return kept if keep_hidden else hidden

    def _pass_inputs(self, num_new: int, cache_len: int):
        """(mask, position_ids [1, Q]) of Q new tokens after ``cache_len`` cached ones: the engine's
        masks (``KVLayout.inputs``; sliding windows included); no mask for one token without windows."""
        new_positions = np.arange(cache_len, cache_len + num_new, dtype=np.int64)
        step = RowStep([0] * num_new, new_positions, Draft.empty())
        _, mask, position_ids = KVLayout.of_text(cache_len).inputs(self.traits, [step], 0, self.device)
        return (None if num_new == 1 and self.traits.no_windows else mask), position_ids

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """``{layer_type: (cos, sin)}`` from the host's rotary embedding module."""
        if self.rotary_per_layer_type:
            return {t: self.rotary(hidden, position_ids, t) for t in set(self.layer_types)}
        shared = self.rotary(hidden, position_ids)
        return {t: shared for t in set(self.layer_types)}

    def _call_layer(self, index: int, hidden, mask, position_embeddings, position_ids, cache) -> torch.Tensor:
        """One decoder layer, called with the keywords the host model's own loop passes."""
        out = self.layers[index](hidden, attention_mask=mask, position_embeddings=position_embeddings,
                                 position_ids=position_ids, **{self.cache_kwarg: cache})
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, heads: Sequence[ReducedHead] | None = None) -> torch.Tensor:
        """Final norm and LM head (and the host's final logit soft-cap), float32.

        ``heads=None``: the full head, ``[..., V]``; else the reduced heads' logits
        side by side, ``[..., sum of their sizes]`` (column j is the j-th of their
        concatenated ``token_ids``).
        """
        normed = self.norm(hidden)
        if heads is None:
            logits = self.head(normed)
        else:
            logits = torch.cat([torch.nn.functional.linear(normed, h.weight, h.bias) for h in heads], dim=-1)
        logits = logits.to(torch.float32)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def reduced_head(self, token_ids) -> ReducedHead:
        """The head's rows for ``token_ids`` (deduplicated, sorted), gathered once."""
        ids = np.unique(np.asarray(token_ids, np.int64))
        if ids.size == 0 or ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"token_ids must be non-empty ids in [0, {self.vocab_size})")
        index = torch.as_tensor(ids, device=self.device)
        bias = getattr(self.head, "bias", None)
        with torch.no_grad():
            return ReducedHead(index, self.head.weight.index_select(0, index).contiguous(),
                               None if bias is None else bias.index_select(0, index).contiguous())


def _fingerprint(model, layers) -> str:
    """A short id of the weights: shape, dtype, name and a digest of the final norm and first layer."""
    config = model.config
    digest = hashlib.sha256()
    for value in (config.model_type, getattr(config, "_name_or_path", ""), config.num_hidden_layers,
                  config.hidden_size, getattr(config, "vocab_size", 0), str(model.dtype)):
        digest.update(repr(value).encode())
    with torch.no_grad():
        for tensor in (model.get_decoder().norm.weight, next(layers[0].parameters())):
            digest.update(tensor.detach().reshape(-1)[:256].to(torch.float64).cpu().numpy().tobytes())
    return f"{config.model_type}-{digest.hexdigest()[:16]}"
