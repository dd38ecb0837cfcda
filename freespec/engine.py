"""The decode loop: propose, forward, accept, commit, until a stopping criterion says stop.

The engine owns the model call, the KV cache and the position. Every forward
feeds the *pending* tokens (committed, not yet cached: the prompt at prefill,
the last bonus token afterwards) followed by a draft tree hung under the last
pending token, so even the prefill verifies a draft proposed from the prompt.
After verification the cache keeps the pending tokens and the accepted nodes
(moved next to each other), and the bonus token becomes the next pending one::

    cache [c0..cL) + pending [p] + tree [a b c d]   accepted a, c; bonus y
    -> cache [c0..cL, p, a, c]                         pending [y]

One step, as ``SpeculativeDecoder.generate`` runs it::

    draft  = propose(state)               # drafter -> Draft within the step's budget
    logits = forward(state, draft)        # tree_forward: mask + positions + one model call
    accept = accept(state, draft, logits) # verify.accept_tree on the processed scores
    commit(state, draft, logits, accept)  # compact_cache, stopping criteria, streamer, drafter

Drafter hooks: ``on_verified_cache`` gets the request's verified cache before
each ``propose`` (model drafters draft against it); ``on_forward`` gets every
forward's ``ForwardReport``; ``observe`` the target's top-k at every fed node
(``observe_top_k``).
"""

from __future__ import annotations

import inspect
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import SpecConfig
from .draft import Budget, Draft
from .drafters.base import ForwardReport, VerifyOutput
from .stats import SpecStats
from .tree import tree_attention
from .verify import Acceptance, accept_tree

_request_ids = itertools.count()


class UnsupportedForSpeculation(Exception):
    """The call needs something speculation cannot honour; the caller falls back."""


@dataclass(frozen=True)
class ModelTraits:
    """What the engine needs to know about a host model, read once.

    Two kinds of model limit what one forward may hold, so that every committed
    token is computed exactly as plain decoding computes it:

    - **Position-dependent rotary frequencies.** A dynamic (NTK) RoPE recomputes its
      frequencies from the largest position in the forward, and LongRoPE switches
      from short to long factors when that position passes the original context.
      Draft nodes sit at future positions, so a draft must not carry the forward
      past the point where plain decoding's would change frequencies:
      ``draft_depth_limit`` caps it (``rope_dynamic_limit``: drafts only while every
      position stays below it; ``rope_long_limit``: not across it). LongRoPE models
      whose ``prepare_inputs_for_generation`` drops the cache at that point (Phi-3)
      are re-prefilled by the engine at the same step (``asks_model_for_cache``).
    - **ALiBi.** Bloom, MPT and Falcon-with-ALiBi add a bias by *key index*, which a
      tree's flattened nodes do not match: they verify chains only (``chains_only``),
      under the plain causal mask, where key index and position agree.
    """

    cache_kwarg: str  # "cache" (transformers >= 5.2x) or "past_key_values"
    additive_mask: bool  # eager attention takes an additive float mask, sdpa a boolean one
    mask_dtype: torch.dtype
    layer_windows: dict[str, int | None]  # layer type -> sliding window (None = full attention)
    per_layer_type_masks: bool  # the model takes {layer_type: mask}
    vocab_size: int = 0  # rows of the input embedding: a draft token must be below it
    chains_only: bool = False  # ALiBi: verify the draft's best chain under the causal mask
    rope_dynamic_limit: int | None = None  # dynamic RoPE: drafts only while the forward stays below
    rope_long_limit: int | None = None  # LongRoPE: a forward must not cross it with draft nodes
    asks_model_for_cache: bool = False  # the model's prepare_inputs_for_generation may drop the cache

    @property
    def no_windows(self) -> bool:
        return all(window is None for window in self.layer_windows.values())

    def draft_depth_limit(self, seq_len: int) -> int | None:
        """Deepest draft a forward may carry after ``seq_len`` committed tokens (None: no limit).

        ``seq_len`` is what plain decoding's forward would hold (its largest position
        plus one); a draft of depth d adds d positions. Worked example, dynamic RoPE
        with limit 48: after 40 tokens a draft may be 7 deep (positions up to 46), after
        47 tokens none (plain decoding's frequencies grow from then on, token by token).
        """
        limits = []
        if self.rope_dynamic_limit is not None:
            limits.append(max(0, self.rope_dynamic_limit - 1 - seq_len))
        if self.rope_long_limit is not None and seq_len <= self.rope_long_limit:
            limits.append(self.rope_long_limit - seq_len)
        return min(limits) if limits else None

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
        windows, per_type = _layer_windows(config)
        dynamic_limit, long_limit = _rope_limits(model)
        return cls(cache_kwarg, impl == "eager", model.dtype, windows, per_type,
                   vocab_size=int(model.get_input_embeddings().num_embeddings), chains_only=uses_alibi(config),
                   rope_dynamic_limit=dynamic_limit, rope_long_limit=long_limit,
                   asks_model_for_cache=long_limit is not None)


def _layer_windows(config) -> tuple[dict[str, int | None], bool]:
    """(layer type -> sliding window, whether the model takes one mask per layer type)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedForSpeculation(f"layer types {sorted(unknown)} (only attention layers are supported)")
        windows = {t: (window if t == "sliding_attention" else None) for t in set(layer_types)}
        return windows, "sliding_attention" in windows
    use_window = window is not None and getattr(config, "use_sliding_window", True) is not False
    return {"full_attention": window if use_window else None}, False


def uses_alibi(config) -> bool:
    """Bloom and MPT always, Falcon with ``alibi=True``: attention biased by key index."""
    attn_config = getattr(config, "attn_config", None)
    return (getattr(config, "model_type", "") == "bloom" or bool(getattr(config, "alibi", False))
            or bool(getattr(attn_config, "alibi", False)))


def _rope_limits(model) -> tuple[int | None, int | None]:
    """(dynamic-RoPE limit, LongRoPE limit) read from the model's rotary embedding modules."""
    dynamic_limit = long_limit = None
    config = model.config
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        if rope_type is None or not hasattr(module, "original_max_seq_len"):
            continue
        types = set(rope_type.values()) if isinstance(rope_type, dict) else {rope_type}
        if any("dynamic" in t for t in types):
            dynamic_limit = int(module.original_max_seq_len)
        if "longrope" in types:  # where each transformers reads it: rope_parameters (5.x), else the config
            parameters = getattr(config, "rope_parameters", None)
            if isinstance(parameters, dict) and "rope_type" not in parameters:  # per layer type
                parameters = next(iter(parameters.values()), None)
            if isinstance(parameters, dict):
                original = parameters.get("original_max_position_embeddings")
            else:
                original = getattr(config, "original_max_position_embeddings", None)
            long_limit = int(original or config.max_position_embeddings)
    return dynamic_limit, long_limit


def make_cache():
    """An empty cache whose every layer keeps its full history.

    Sliding windows are applied by the mask, so rejected draft nodes can be
    dropped without a window having pushed out a token that is still live.
    """
    from transformers import DynamicCache

    return DynamicCache()


def attention_inputs(traits: ModelTraits, parents: np.ndarray, num_pending: int, cache_len: int, device):
    """(attention_mask for the host model, position_ids [1, Q]) of one tree forward.

    The mask is a dict ``{layer_type: [1, 1, Q, cache_len + Q]}`` for models with
    several layer types (Gemma 3), else one tensor; boolean for sdpa, additive
    (0 / finfo.min) for eager. One pending token and no draft on a model without
    sliding windows needs no mask at all: ``None``, the host's plain decode path; so
    does a chain on an ALiBi model (``traits.chains_only``).
    """
    if traits.chains_only or (parents.shape[0] == 0 and num_pending == 1 and traits.no_windows):
        # the plain causal mask: ALiBi models verify chains only, where it is the tree's mask
        return None, torch.arange(cache_len, cache_len + num_pending + parents.shape[0], device=device)[None]
    masks = {}
    for layer_type, window in traits.layer_windows.items():
        allowed, position_ids = tree_attention(parents, num_pending, cache_len, window)
        allowed = torch.from_numpy(allowed).to(device)[None, None]
        if traits.additive_mask:
            mask = torch.zeros(allowed.shape, dtype=traits.mask_dtype, device=device)
            masks[layer_type] = mask.masked_fill_(~allowed, torch.finfo(traits.mask_dtype).min)
        else:
            masks[layer_type] = allowed
    mask = masks if traits.per_layer_type_masks and len(masks) > 1 else next(iter(masks.values()))
    return mask, torch.from_numpy(position_ids).to(device)[None]


def tree_forward(model, traits: ModelTraits, cache, cache_len: int, pending: list[int], draft: Draft) -> torch.Tensor:
    """Run pending + draft on top of ``cache_len`` cached tokens.

    Returns float32 logits of the last pending token (row 0) and of every draft
    node (row i + 1), ``[n + 1, V]``; the cache grows by ``len(pending) + n`` entries.
    """
    device = model.device
    input_ids = torch.tensor([pending + draft.token_ids.tolist()], dtype=torch.long, device=device)
    attention_mask, position_ids = attention_inputs(traits, draft.parents, len(pending), cache_len, device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        cache_position=torch.arange(cache_len, cache_len + input_ids.shape[1], device=device),
        use_cache=True,
        logits_to_keep=draft.num_nodes + 1,
        **{traits.cache_kwarg: cache},
    )
    return out.logits[0, -(draft.num_nodes + 1):].to(dtype=torch.float32)


def compact_cache(cache, keep_len: int, accepted_nodes: list[int]) -> None:
    """Keep ``keep_len`` entries plus the accepted nodes' entries, moved right after them.

    ``keep_len=3, accepted_nodes=[1, 3]``: entries ``[0, 1, 2, 3+1, 3+3]`` remain, in that order.
    """
    src = torch.tensor([keep_len + i for i in accepted_nodes], dtype=torch.long)
    new_len = keep_len + len(accepted_nodes)
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if src.numel():
            idx = src.to(layer.keys.device)
            layer.keys[..., keep_len:new_len, :] = layer.keys[..., idx, :]
            layer.values[..., keep_len:new_len, :] = layer.values[..., idx, :]
        layer.keys = layer.keys[..., :new_len, :]
        layer.values = layer.values[..., :new_len, :]


@dataclass
class DecodeState:
    """One request's decode: what is committed, cached and pending, and what to return."""

    request_id: tuple
    sequence: list[int]  # committed tokens: prompt + output
    pending: list[int]  # committed, not yet cached
    max_length: int
    cache: object = field(default_factory=make_cache)
    cache_len: int = 0
    done: bool = False
    out_scores: list[torch.Tensor] = field(default_factory=list)  # [1, V] processed, per new token
    out_logits: list[torch.Tensor] = field(default_factory=list)  # [1, V] raw, per new token


class SpeculativeDecoder:
    """One generate() call for a batch of one row.

    ``generate`` returns (sequences [1, L], scores per new token, raw logits per new token, cache).
    """

    def __init__(self, model, drafter, config: SpecConfig, stats: SpecStats, traits: ModelTraits):
        self.model = model
        self.drafter = drafter
        self.config = config
        self.stats = stats
        self.traits = traits
        self.device = model.device

    def generate(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                 documents=None, tokenizer=None):
        """Decode one row. ``documents``: token-id arrays or texts (with ``tokenizer``) the drafter
        may draft from this request (RAG passages, files being edited)."""
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        self.do_sample = bool(generation_config.do_sample)
        self.want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        t_start = time.perf_counter()
        prompt = input_ids[0].tolist()
        state = DecodeState(("freespec", next(_request_ids)), list(prompt), list(prompt),
                            int(generation_config.max_length))
        state.done = len(state.sequence) >= state.max_length
        self.stats.prompt_tokens = len(prompt)
        try:
            self._timed_draft(self._start, state, documents, tokenizer)
            while not state.done:
                self._follow_model_cache_policy(state)
                draft = self._timed_draft(self._propose, state)
                t0 = time.perf_counter()
                logits = self._forward(state, draft)
                acceptance = self._accept(state, draft, logits)
                compact_cache(state.cache, state.cache_len, acceptance.cached_nodes)
                state.cache_len += len(acceptance.cached_nodes)
                self.stats.verify_s += time.perf_counter() - t0
                committed = self._commit(state, draft, logits, acceptance)
                self._timed_draft(self._learn, state, draft, logits, acceptance, committed)
        finally:
            self.drafter.stop(state.request_id)
            if streamer is not None:
                streamer.end()
            self.stats.total_s = time.perf_counter() - t_start
        sequences = torch.tensor([state.sequence], dtype=input_ids.dtype, device=input_ids.device)
        return sequences, state.out_scores, state.out_logits, state.cache

    # ------------------------------------------------------------ steps
    def _timed_draft(self, step, *args):
        t0 = time.perf_counter()
        try:
            return step(*args)
        finally:
            self.stats.draft_s += time.perf_counter() - t0

    def _start(self, state: DecodeState, documents, tokenizer) -> None:
        self.drafter.start(state.request_id, np.asarray(state.sequence, np.int64))
        if documents is not None:
            self.drafter.add_documents(state.request_id, documents, tokenizer)

    def _follow_model_cache_policy(self, state: DecodeState) -> None:
        """Re-prefill where the model's own ``prepare_inputs_for_generation`` would drop the cache.

        Phi-3 with LongRoPE recomputes the whole cache with long factors once the
        sequence passes its original context; plain decoding does it through that
        method, so the engine asks the same method at the same step.
        """
        if not self.traits.asks_model_for_cache or state.cache_len == 0:
            return
        ids = torch.tensor([state.sequence], dtype=torch.long, device=self.device)
        inputs = self.model.prepare_inputs_for_generation(
            ids, **{self.traits.cache_kwarg: state.cache}, use_cache=True,
            cache_position=torch.arange(state.cache_len, len(state.sequence), device=self.device))
        if inputs.get(self.traits.cache_kwarg) is None:
            state.cache, state.cache_len, state.pending = make_cache(), 0, list(state.sequence)

    def _propose(self, state: DecodeState) -> Draft:
        budget = self.config.step_budget(state.max_length - len(state.sequence))
        depth_limit = self.traits.draft_depth_limit(len(state.sequence))
        if depth_limit is not None and depth_limit < budget.max_depth:
            budget = Budget(budget.num_nodes, depth_limit)
        if budget.max_depth == 0:
            return Draft.empty()
        self.drafter.on_verified_cache(state.request_id, state.cache, state.cache_len)
        draft = self.drafter.propose(state.request_id, budget)
        if not draft.num_nodes:
            return draft
        draft.validate(budget)
        if draft.num_nodes and int(draft.token_ids.max()) >= self.traits.vocab_size:
            raise ValueError(f"drafter {self.drafter.name!r} proposed token id {int(draft.token_ids.max())}, "
                             f"outside the model's vocabulary of {self.traits.vocab_size} (from the prompt, "
                             f"documents= or the drafter's own state)")
        return draft.best_chain() if self.traits.chains_only else draft

    def _forward(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """The tree forward, reported to the drafter; the pending tokens are cached after it. [n + 1, V]"""
        prefill = self.stats.forward_passes == 0
        num_fed = len(state.pending) + draft.num_nodes
        t0 = time.perf_counter()
        logits = tree_forward(self.model, self.traits, state.cache, state.cache_len, state.pending, draft)
        self.drafter.on_forward(ForwardReport((state.request_id,), (num_fed,), time.perf_counter() - t0, prefill))
        self.stats.forward_passes += 1
        if not prefill:
            self.stats.tokens_fed += num_fed
        state.cache_len += len(state.pending)
        return logits

    def _accept(self, state: DecodeState, draft: Draft, logits: torch.Tensor) -> Acceptance:
        processor, criteria = self.logits_processor, self.stopping_criteria

        def score_row(row: int, path: list[int]) -> torch.Tensor:
            raw = logits[row: row + 1]
            if len(processor) == 0:
                return raw[0]
            ids = torch.tensor([state.sequence + path], dtype=torch.long, device=self.device)
            return processor(ids, raw.clone())[0]

        def should_stop(emitted: list[int], emitted_scores: list[torch.Tensor]) -> bool:
            """The stopping criteria, asked as plain decoding asks them (with its scores when it keeps them)."""
            if len(state.sequence) + len(emitted) >= state.max_length:
                return True
            ids = torch.tensor([state.sequence + emitted], dtype=torch.long, device=self.device)
            scores = tuple(state.out_scores) + tuple(s[None] for s in emitted_scores) if self.want_scores else None
            return bool(criteria(ids, scores).any())

        acceptance = accept_tree(draft.token_ids, draft.parents, score_row, self.do_sample, draft.is_candidate,
                                 should_stop)
        self.stats.count_draft(draft, acceptance.accepted_nodes, self.drafter.name)
        return acceptance

    def _commit(self, state: DecodeState, draft: Draft, logits: torch.Tensor, acceptance: Acceptance) -> list[int]:
        """Commit the emitted tokens (the walk already asked the stopping criteria after each one)."""
        committed = list(acceptance.token_ids)
        for k in range(len(committed)):
            if self.want_scores:
                state.out_scores.append(acceptance.scores[k][None])
            if self.want_logits:
                row = 0 if k == 0 else acceptance.accepted_nodes[k - 1] + 1
                state.out_logits.append(logits[row: row + 1].clone())
        state.sequence.extend(committed)
        state.done = acceptance.stopped
        self.stats.new_tokens += len(committed)
        if self.streamer is not None:
            for token in committed:
                self.streamer.put(torch.tensor([token]))
        state.pending = [committed[-1]]  # the last emitted token is committed but not cached
        return committed

    def _learn(self, state: DecodeState, draft: Draft, logits: torch.Tensor, acceptance: Acceptance,
               committed: list[int]) -> None:
        top_k = self.drafter.observe_top_k
        if top_k:
            topk = torch.topk(logits, k=min(top_k, logits.shape[-1]), dim=-1).indices.cpu().numpy()
            accepted = np.asarray(acceptance.accepted_nodes, np.int64)
            self.drafter.observe(state.request_id, VerifyOutput(draft, accepted, topk))
        self.drafter.extend(state.request_id, np.asarray(committed, np.int64))
