"""The decode loop: prefill, draft, one tree forward, verify, compact the KV cache.

The engine owns the model call, the KV cache and the position. Every forward
feeds the *pending* tokens (committed, not yet cached: the prompt at prefill,
the last bonus token afterwards) followed by a draft tree hung under the last
pending token, so even the prefill verifies a draft proposed from the prompt.
After verification the cache keeps the pending tokens and the accepted nodes
(moved next to each other), and the bonus token becomes the next pending one::

    cache [c0..cL) + pending [p] + tree [a b c d]   accepted a, c; bonus y
    -> cache [c0..cL, p, a, c]                         pending [y]

Hooks for drafters that need the model: ``Drafter.observe`` receives the
target's top-k at every verified node (``observe_top_k``), and
``Drafter.on_forward`` the size and time of every forward (cost model).
"""

from __future__ import annotations

import inspect
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from .config import SpecConfig
from .draft import Budget, Draft
from .drafters.base import VerifyOutput
from .stats import SpecStats
from .tree import tree_attention
from .verify import accept_tree

_request_ids = itertools.count()


class UnsupportedForSpeculation(Exception):
    """The call needs something speculation cannot honour; the caller falls back."""


@dataclass(frozen=True)
class ModelTraits:
    """What the engine needs to know about a host model, read once."""

    cache_kwarg: str  # "cache" (transformers >= 5.2x) or "past_key_values"
    additive_mask: bool  # eager attention takes an additive float mask, sdpa a boolean one
    mask_dtype: torch.dtype
    layer_windows: dict[str, int | None]  # layer type -> sliding window (None = full attention)
    per_layer_type_masks: bool  # the model takes {layer_type: mask}

    @property
    def no_windows(self) -> bool:
        return all(window is None for window in self.layer_windows.values())

    @classmethod
    def of(cls, model) -> "ModelTraits":
        config = model.config
        impl = getattr(config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise UnsupportedForSpeculation(
                f"attention implementation {impl!r} (supported: 'sdpa', 'eager'; load with attn_implementation='sdpa')"
            )
        params = inspect.signature(model.forward).parameters
        cache_kwarg = "cache" if "cache" in params else "past_key_values"
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            unknown = set(layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise UnsupportedForSpeculation(f"layer types {sorted(unknown)} (only attention layers are supported)")
            windows = {t: (window if t == "sliding_attention" else None) for t in set(layer_types)}
            per_type = "sliding_attention" in windows
        else:
            use_window = window is not None and getattr(config, "use_sliding_window", True) is not False
            windows = {"full_attention": window if use_window else None}
            per_type = False
        return cls(cache_kwarg, impl == "eager", model.dtype, windows, per_type)


def _make_cache():
    from transformers import DynamicCache

    # no config: every layer keeps its full history (sliding windows are applied
    # by the mask), so rejected draft nodes can be dropped without losing tokens
    return DynamicCache()


class SpeculativeDecoder:
    """One generate() call for a batch of one row."""

    def __init__(self, model, drafter, config: SpecConfig, stats: SpecStats, traits: ModelTraits):
        self.model = model
        self.drafter = drafter
        self.config = config
        self.stats = stats
        self.traits = traits
        self.device = model.device

    # ------------------------------------------------------------ model call
    def _forward(self, cache, cache_len: int, pending: list[int], draft: Draft) -> torch.Tensor:
        """Run pending + draft; return float32 logits of the last pending token and every node. [n+1, V]"""
        traits = self.traits
        input_ids = torch.tensor([pending + draft.token_ids.tolist()], dtype=torch.long, device=self.device)
        masks = {}
        position_ids = np.array([cache_len], np.int64)
        if draft.num_nodes == 0 and len(pending) == 1 and traits.no_windows:
            # one query that sees the whole cache: no mask, the host's plain decode path
            masks = {"full_attention": None}
        for layer_type, window in traits.layer_windows.items() if not masks else ():
            allowed, position_ids = tree_attention(draft.parents, len(pending), cache_len, window)
            allowed = torch.from_numpy(allowed).to(self.device)[None, None]
            if traits.additive_mask:
                mask = torch.zeros(allowed.shape, dtype=traits.mask_dtype, device=self.device)
                mask.masked_fill_(~allowed, torch.finfo(traits.mask_dtype).min)
            else:
                mask = allowed
            masks[layer_type] = mask
        attention_mask = masks if traits.per_layer_type_masks and len(masks) > 1 else next(iter(masks.values()))
        q_len = input_ids.shape[1]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=torch.from_numpy(position_ids).to(self.device)[None],
            cache_position=torch.arange(cache_len, cache_len + q_len, device=self.device),
            use_cache=True,
            logits_to_keep=draft.num_nodes + 1,
            **{traits.cache_kwarg: cache},
        )
        return out.logits[0, -(draft.num_nodes + 1):].to(dtype=torch.float32)

    @staticmethod
    def _compact(cache, keep_len: int, accepted_nodes: list[int]) -> None:
        """Keep ``keep_len`` entries plus the accepted nodes' entries, moved right after them."""
        src = torch.tensor([keep_len + i for i in accepted_nodes], dtype=torch.long)
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
                continue
            if src.numel():
                idx = src.to(layer.keys.device)
                layer.keys[..., keep_len: keep_len + len(accepted_nodes), :] = layer.keys[..., idx, :]
                layer.values[..., keep_len: keep_len + len(accepted_nodes), :] = layer.values[..., idx, :]
            new_len = keep_len + len(accepted_nodes)
            layer.keys = layer.keys[..., :new_len, :]
            layer.values = layer.values[..., :new_len, :]

    # ------------------------------------------------------------ the loop
    def generate(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                 generator: torch.Generator | None = None, documents=None, tokenizer=None):
        """Decode one row; returns (sequences [1, L], scores per new token, raw logits per new token, cache).

        ``documents``: token-id arrays or texts (with ``tokenizer``) this request's drafter
        may draft from (RAG passages, files being edited); needs a drafter with ``add_documents``.
        """
        config, stats, drafter = self.config, self.stats, self.drafter
        t_start = time.perf_counter()
        do_sample = bool(generation_config.do_sample)
        max_length = int(generation_config.max_length)
        prompt = input_ids[0].tolist()
        stats.prompt_tokens = len(prompt)
        sequence = list(prompt)  # committed tokens
        out_scores: list[torch.Tensor] = []
        out_logits: list[torch.Tensor] = []
        want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        observe_k = int(getattr(drafter, "observe_top_k", 0) or 0)
        request_id = ("freespec", next(_request_ids))
        cache = _make_cache()
        cache_len = 0
        pending = list(prompt)

        t0 = time.perf_counter()
        drafter.start(request_id, np.asarray(prompt, np.int64))
        try:
            if documents is not None:
                drafter.add_documents(request_id, documents, tokenizer)
            stats.draft_s += time.perf_counter() - t0
            done = len(sequence) >= max_length
            while not done:
                budget = config.step_budget(max_length - len(sequence))
                t0 = time.perf_counter()
                draft = drafter.propose(request_id, budget) if budget.max_depth > 0 else Draft.empty()
                if draft.num_nodes:
                    draft = draft.validate(budget)
                t1 = time.perf_counter()
                stats.draft_s += t1 - t0

                logits = self._forward(cache, cache_len, pending, draft)  # [n+1, V]
                t_fwd = time.perf_counter() - t1
                drafter.on_forward(len(pending) + draft.num_nodes, t_fwd)
                stats.forward_passes += 1
                if stats.forward_passes > 1:
                    stats.tokens_fed += len(pending) + draft.num_nodes
                cache_len += len(pending)

                def score_row(row: int, path: list[int]) -> torch.Tensor:
                    raw = logits[row: row + 1]
                    if len(logits_processor) == 0:
                        return raw[0]
                    ids = torch.tensor([sequence + path], dtype=torch.long, device=self.device)
                    return logits_processor(ids, raw.clone())[0]

                acceptance = accept_tree(draft.token_ids, draft.parents, score_row, do_sample, generator)
                self._compact(cache, cache_len, acceptance.accepted_nodes)
                cache_len += len(acceptance.accepted_nodes)
                stats.verify_s += time.perf_counter() - t1

                if draft.num_nodes:
                    stats.steps_with_draft += 1
                    stats.draft_tokens += draft.num_nodes
                    stats.accepted_draft_tokens += len(acceptance.accepted_nodes)
                    for i in range(draft.num_nodes):
                        stats.drafter(draft.node_source(i) or getattr(drafter, "name", "drafter")).proposed += 1
                    for i in acceptance.accepted_nodes:
                        stats.drafter(draft.node_source(i) or getattr(drafter, "name", "drafter")).accepted += 1

                # commit token by token, asking the stopping criteria after each one as plain decoding does
                committed = []
                for k, token in enumerate(acceptance.token_ids):
                    sequence.append(token)
                    committed.append(token)
                    if want_scores:
                        out_scores.append(acceptance.scores[k][None])
                    if want_logits:
                        row = 0 if k == 0 else acceptance.accepted_nodes[k - 1] + 1
                        out_logits.append(logits[row: row + 1].clone())
                    ids = torch.tensor([sequence], dtype=torch.long, device=self.device)
                    if bool(stopping_criteria(ids, None).any()) or len(sequence) >= max_length:
                        done = True
                        break
                stats.new_tokens += len(committed)
                if streamer is not None:
                    for token in committed:
                        streamer.put(torch.tensor([token]))

                t0 = time.perf_counter()
                if observe_k and draft.num_nodes:
                    topk = torch.topk(logits, k=min(observe_k, logits.shape[-1]), dim=-1).indices.cpu().numpy()
                    drafter.observe(request_id, VerifyOutput(draft, np.asarray(acceptance.accepted_nodes, np.int64), topk))
                drafter.extend(request_id, np.asarray(committed, np.int64))
                stats.draft_s += time.perf_counter() - t0
                # the bonus token is committed but not cached: it is the next step's root
                pending = [acceptance.token_ids[-1]]
        finally:
            drafter.stop(request_id)
            if streamer is not None:
                streamer.end()
            stats.total_s = time.perf_counter() - t_start
        sequences = torch.tensor([sequence], dtype=input_ids.dtype, device=input_ids.device)
        return sequences, out_scores, out_logits, cache
