"""The decode loop: propose, forward, accept, commit, until a stopping criterion says stop.

The engine owns the model call, the KV cache and the positions. Every forward
feeds, for every row of the batch, the *pending* tokens (committed, not yet
cached: the prompt at prefill, the last bonus token afterwards) followed by a
draft tree hung under the last pending token, so even the prefill verifies a
draft proposed from the prompt. After verification each row's cache keeps its
pending tokens and accepted nodes (moved next to each other, ``batch.KVLayout``),
and its bonus token becomes its next pending one::

    cache [c0..cL) + pending [p] + tree [a b c d]   accepted a, c; bonus y
    -> cache [c0..cL, p, a, c]                         pending [y]

One step, as ``SpeculativeDecoder.generate`` runs it::

    drafts = propose(rows)                 # each row's drafter -> a Draft within its budget
    logits = forward(rows, drafts)         # forward_rows: masks + positions + one model call
    accept = accept(row, draft, logits)    # per row: verify.accept_tree on the processed scores
    commit(rows, ...)                      # KVLayout.compact, streamer, drafter.observe / extend

A row that finishes leaves the batch (its cache rows are dropped), so it stops
costing compute; a batch of one is the same loop.

Drafter hooks: ``on_verified_cache`` gets, for model drafters, each row's own
verified cache (``KVLayout.row_view``) before its ``propose``; ``on_forward``
gets every forward's ``ForwardReport``; ``observe`` the target's top-k at every
fed node (``observe_top_k``).
"""

from __future__ import annotations

import inspect
import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import SpecConfig
from .draft import Budget, Draft
from .batch import KVLayout, RowStep, _move_and_crop
from .transfer import Upload, fetch
from .drafters.base import ForwardReport, VerifyOutput
from .stats import SpecStats
from .verify import Acceptance, TreeScoring, _default_generator, accept_tree, choose_token, processes_rows_alone

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
    takes_logits_to_keep: bool = True  # forward(logits_to_keep=) exists (not on Bloom, MPT, ... in transformers 4.57)

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
        if "cache" not in params and "past_key_values" not in params:  # e.g. Mamba's cache_params (4.57)
            raise UnsupportedForSpeculation(f"{type(model).__name__}.forward takes no KV cache (cache= or "
                                            f"past_key_values=): only attention models are supported")
        cache_kwarg = "cache" if "cache" in params else "past_key_values"
        windows, per_type = _layer_windows(config)
        dynamic_limit, long_limit = _rope_limits(model)
        return cls(cache_kwarg, impl == "eager", model.dtype, windows, per_type,
                   vocab_size=int(model.get_input_embeddings().num_embeddings), chains_only=uses_alibi(config),
                   rope_dynamic_limit=dynamic_limit, rope_long_limit=long_limit,
                   asks_model_for_cache=long_limit is not None, takes_logits_to_keep="logits_to_keep" in params)


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
    for module in model.modules():  # read from the instance, then its class: an nn.Module's getattr of a name it
        rope_type = module.__dict__.get("rope_type", getattr(type(module), "rope_type", None))  # lacks raises inside
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


class LogitsBuffer:
    """Float32 memory for the logits of one ``generate()`` call's forwards, reused step after step.

    Converting a wide tree's logits into a fresh tensor costs the new pages every step: on one CPU
    thread, [36, 151936] took 9-10 ms after a qwen2.5-coder-0.5b forward and [64, 151936] 23 ms, against
    1-2 ms into memory already touched. ``fill`` returns a view that the next ``fill`` overwrites.

    ``acquire`` hands a ``generate()`` call its thread's buffer, kept across calls: a fresh one per call
    paid those pages again on the first wide forwards of every request (code edits, 36 rows on average:
    the conversion was 7.7 ms of the 13 ms per forward spent outside forwards). ``release`` gives it back
    and frees it when it grew past ``KEEP_BYTES`` (64 MB: 64 rows of a 152k vocabulary fit; a large
    batch's buffer lives for its call only). A ``generate()`` inside another on the same thread (a
    callback's) gets memory of its own. Threads never share one; a thread's buffer goes with the thread.
    """

    KEEP_BYTES = 64 << 20
    _threads = threading.local()

    def __init__(self):
        self._data: torch.Tensor | None = None
        self.in_use = False

    @classmethod
    def acquire(cls) -> "LogitsBuffer":
        """This thread's buffer, marked in use (a new one if it already is)."""
        buffer = getattr(cls._threads, "buffer", None)
        if buffer is None:
            buffer = cls._threads.buffer = cls()
        if buffer.in_use:
            buffer = cls()
        buffer.in_use = True
        return buffer

    def release(self) -> None:
        """The call is done with it: kept for the thread's next call unless larger than ``KEEP_BYTES``."""
        self.in_use = False
        if self._data is not None and self._data.numel() * self._data.element_size() > self.KEEP_BYTES:
            self._data = None

    def fill(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` as float32, in the buffer (grown to the next power of two of elements when too small)."""
        size = logits.numel()
        # An inference tensor cannot be written outside inference mode: memory made under
        # torch.inference_mode() (a caller's, or a benchmark's) is remade when the mode differs.
        if (self._data is None or self._data.numel() < size or self._data.device != logits.device
                or self._data.is_inference() != torch.is_inference_mode_enabled()):
            self._data = torch.empty(1 << max(0, size - 1).bit_length(), dtype=torch.float32, device=logits.device)
        view = self._data[:size].view(logits.shape)
        view.copy_(logits)
        return view


def forward_rows(model, traits: ModelTraits, cache, layout: KVLayout, rows: list[RowStep],
                 pad_token_id: int = 0, buffer: LogitsBuffer | None = None) -> torch.Tensor:
    """One forward over ``rows`` (equal numbers of pending tokens) on top of ``layout``'s cache.

    Returns float32 logits ``[B, 1 + max n, V]``: row r's last pending token at
    index 0 and its draft node i at index 1 + i (in ``buffer`` if given: valid
    until its next use). The cache grows by the forward's width W for every row
    (``KVLayout.compact`` keeps what verification accepts).
    """
    upload = Upload()
    run = queue_forward(traits, cache, layout, rows, pad_token_id, upload)
    logits = run(model, upload.send(model.device))
    return logits.to(dtype=torch.float32) if buffer is None else buffer.fill(logits)


def queue_forward(traits: ModelTraits, cache, layout: KVLayout, rows: list[RowStep], pad_token_id: int,
                  upload: Upload):
    """``forward_rows`` in two halves, so that one copy carries a step's inputs: the forward's host arrays
    (and the cache moves ``layout`` deferred) go into ``upload`` now; the returned ``run(model, sent)``, given
    ``upload.send(device)``, makes the moves and calls the model. ``run`` returns the model's own logits
    ``[B, 1 + max n, V]`` (its dtype: converting them is the caller's choice)."""
    num_pending = len(rows[0].pending)
    if any(len(row.pending) != num_pending for row in rows):
        raise ValueError("rows of one forward must have equal numbers of pending tokens")
    move = layout.flush(cache, upload)
    build = layout.queue_inputs(traits, rows, pad_token_id, upload)
    width = max(row.num_fed for row in rows)
    single = len(rows) == 1 and not layout.ragged
    causal = single and (traits.chains_only or (rows[0].num_fed == 1 and traits.no_windows))
    keep = width - num_pending + 1
    start = layout.length

    def run(model, sent: list[torch.Tensor]) -> torch.Tensor:
        move(sent)
        input_ids, mask, position_ids = build(sent)
        out = model(
            input_ids=input_ids,
            attention_mask=None if causal else mask,  # the causal mask: a plain decode step, or an ALiBi chain
            position_ids=position_ids,
            cache_position=torch.arange(start, start + width, device=input_ids.device),
            use_cache=True,
            **({"logits_to_keep": keep} if traits.takes_logits_to_keep else {}),
            **{traits.cache_kwarg: cache},
        )
        return out.logits[:, -keep:]

    return run


def tree_forward(model, traits: ModelTraits, cache, cache_len: int, pending: list[int], draft: Draft) -> torch.Tensor:
    """One row's forward: pending + draft on top of ``cache_len`` cached tokens (positions 0..).

    Returns float32 logits of the last pending token (row 0) and of every draft
    node (row i + 1), ``[n + 1, V]``; the cache grows by ``len(pending) + n`` entries.
    """
    layout = KVLayout.of_text(cache_len)
    row = RowStep(list(pending), np.arange(cache_len, cache_len + len(pending), dtype=np.int64), draft)
    return forward_rows(model, traits, cache, layout, [row])[0, : draft.num_nodes + 1]


def compact_cache(cache, keep_len: int, accepted_nodes: list[int]) -> None:
    """One row's cache: keep ``keep_len`` entries plus the accepted nodes' entries, moved right after them.

    ``keep_len=3, accepted_nodes=[1, 3]``: entries ``[0, 1, 2, 3+1, 3+3]`` remain, in that order.
    """
    src = [keep_len + i for i in accepted_nodes]
    _move_and_crop(cache, [0] * len(src), src, list(range(keep_len, keep_len + len(src))), keep_len + len(src))


@dataclass
class Row:
    """One row's decode: what is committed and pending, what to return, and its drafter request."""

    request_id: tuple
    sequence: list[int]  # committed tokens: the (left-padded) prompt + output, what criteria and processors see
    num_pads: int  # left pads of the prompt
    pending: list[int]  # committed, not yet cached
    pending_positions: np.ndarray  # [len(pending)] logical positions (-1: a pad)
    max_length: int
    done: bool = False
    out_scores: list[torch.Tensor] = field(default_factory=list)  # [1, V] processed, per new token
    out_logits: list[torch.Tensor] = field(default_factory=list)  # [1, V] raw, per new token

    @property
    def num_committed(self) -> int:
        """Real tokens committed (pads not counted): the logical position of the next token."""
        return len(self.sequence) - self.num_pads


class SpeculativeDecoder:
    """One generate() call: a batch of left-padded rows, each with its own drafter request.

    ``generate`` returns (sequences [B, L], scores per new token, raw logits per new token, cache);
    scores, logits and the cache are for a batch of one (a batch returns ``[], [], None``).
    """

    def __init__(self, model, drafter, config: SpecConfig, stats: SpecStats, traits: ModelTraits):
        self.model = model
        self.drafter = drafter
        self.config = config
        self.stats = stats
        self.traits = traits
        self.device = model.device
        self._last_step: tuple[float, int] | None = None  # reported with the next forward (``ForwardReport``)

    def generate(self, input_ids, logits_processor, stopping_criteria, generation_config, streamer=None,
                 documents=None, tokenizer=None, attention_mask=None, predictions=None):
        """Decode every row. ``attention_mask`` [B, L]: left padding (zeros first), or None for none.
        ``documents``: token-id arrays or texts (with ``tokenizer``) every row's drafter may draft from.
        ``predictions``: per row, token ids of the output the caller expects (a hint, e.g. the file being
        edited), or None; None for none."""
        self.logits_processor, self.stopping_criteria, self.streamer = logits_processor, stopping_criteria, streamer
        self.stop_rule = PlainStopRule.of(stopping_criteria)
        self.do_sample = bool(generation_config.do_sample)
        self.want_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
        self.want_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
        self.pad_token_id = _pad_token_id(generation_config)
        on_device = self.config.verify_on_device
        self.whole_tree = ((verifies_whole_tree(self.device) if on_device is None else on_device)
                           and processes_rows_alone(logits_processor))
        t_start = time.perf_counter()
        rows = self._rows(input_ids, attention_mask, int(generation_config.max_length))
        self.stats.prompt_tokens = sum(row.num_committed for row in rows)
        started: list[Row] = []
        cache, layout = make_cache(), KVLayout(len(rows))
        self.logits_buffer = LogitsBuffer.acquire()  # a step's logits: a view the next step overwrites
        try:
            for r, row in enumerate(rows):
                prediction = None if predictions is None else predictions[r]
                self._timed_draft(self._start, row, documents, tokenizer, prediction)
                started.append(row)
            active = [row for row in rows if not row.done]
            self._last_step = None  # (seconds outside its forward, draft nodes fed) of the previous decode step
            while active:
                t_step, forward_before = time.perf_counter(), self.stats.forward_s
                self._follow_model_cache_policy(active, cache, layout)
                drafts = self._timed_draft(self._propose, active, cache, layout)
                if len(active) > 1:  # one padded forward: every row pays the widest row's width
                    drafts = self._timed_draft(self._fit_batch, active, drafts)
                steps = [RowStep(row.pending, row.pending_positions, draft) for row, draft in zip(active, drafts)]
                t0 = time.perf_counter()
                logits, acceptances, observed = self._verify(active, steps, cache, layout)
                layout.compact(cache, steps, [acceptance.cached_nodes for acceptance in acceptances], defer=True)
                self.stats.verify_s += time.perf_counter() - t0
                for r, (row, step, acceptance) in enumerate(zip(active, steps, acceptances)):
                    committed = self._commit(row, step.draft, logits[r], acceptance)
                    self._timed_draft(self._learn, row, step.draft, observed[r], acceptance, committed)
                active = self._drop_finished(active, cache, layout)
                self._last_step = (time.perf_counter() - t_step - (self.stats.forward_s - forward_before),
                                   sum(step.draft.num_nodes for step in steps))
            self._timed_tensor(layout.flush, cache)  # the moves of the last step, for the returned cache
        finally:
            self.logits_buffer.release()
            for row in started:
                self.drafter.stop(row.request_id)
            if streamer is not None:
                streamer.end()
            self.stats.total_s = time.perf_counter() - t_start
        return self._outputs(rows, input_ids, cache)

    # ------------------------------------------------------------ setup and teardown
    def _rows(self, input_ids, attention_mask, max_length: int) -> list[Row]:
        rows = []
        for b, ids in enumerate(input_ids.tolist()):
            num_pads = 0 if attention_mask is None else int((attention_mask[b] == 0).sum())
            positions = np.concatenate([np.full(num_pads, -1), np.arange(len(ids) - num_pads)]).astype(np.int64)
            row = Row(("freespec", next(_request_ids)), list(ids), num_pads, list(ids), positions, max_length)
            row.done = len(row.sequence) >= max_length
            rows.append(row)
        return rows

    def _drop_finished(self, active: list[Row], cache, layout: KVLayout) -> list[Row]:
        keep = [r for r, row in enumerate(active) if not row.done]
        if len(keep) < len(active):
            layout.drop_rows(cache, keep, defer=True)  # made with the next forward's inputs
        return [active[r] for r in keep]

    def _outputs(self, rows: list[Row], input_ids, cache):
        """Sequences right-padded with the pad token, as plain batched decoding pads finished rows."""
        length = max(len(row.sequence) for row in rows)
        sequences = torch.full((len(rows), length), self.pad_token_id, dtype=input_ids.dtype)
        for r, row in enumerate(rows):
            sequences[r, : len(row.sequence)] = torch.tensor(row.sequence, dtype=input_ids.dtype)
        if len(rows) > 1:
            return sequences.to(input_ids.device), [], [], None
        return sequences.to(input_ids.device), rows[0].out_scores, rows[0].out_logits, cache

    # ------------------------------------------------------------ steps
    def _timed_draft(self, step, *args):
        return self._timed("draft_s", step, *args)

    def _timed_tensor(self, work, *args):
        """``work(*args)``, its time counted as tensor work on the model's device (``SpecStats.tensor_s``)."""
        return self._timed("tensor_s", work, *args)

    def _timed(self, counter: str, work, *args):
        t0 = time.perf_counter()
        try:
            return work(*args)
        finally:
            setattr(self.stats, counter, getattr(self.stats, counter) + time.perf_counter() - t0)

    def _start(self, row: Row, documents, tokenizer, prediction) -> None:
        self.drafter.start(row.request_id, np.asarray(row.sequence[row.num_pads:], np.int64))
        if documents is not None:
            self.drafter.add_documents(row.request_id, documents, tokenizer)
        if prediction is not None:
            self.drafter.add_prediction(row.request_id, prediction)

    def _follow_model_cache_policy(self, active: list[Row], cache, layout: KVLayout) -> None:
        """Re-prefill where the model's own ``prepare_inputs_for_generation`` would drop the cache.

        Phi-3 with LongRoPE recomputes the whole cache with long factors once the
        sequence passes its original context; plain decoding does it through that
        method, so the engine asks the same method at the same step (a batch of one:
        batches of such models decode plainly).
        """
        if not self.traits.asks_model_for_cache or layout.length == 0 or len(active) != 1:
            return
        layout.flush(cache)  # the model reads the cache's length
        row = active[0]
        ids = torch.tensor([row.sequence], dtype=torch.long, device=self.device)
        inputs = self.model.prepare_inputs_for_generation(
            ids, **{self.traits.cache_kwarg: cache}, use_cache=True,
            cache_position=torch.arange(layout.length, len(row.sequence), device=self.device))
        if inputs.get(self.traits.cache_kwarg) is None:
            layout.clear(cache)
            row.pending = list(row.sequence)
            row.pending_positions = np.arange(len(row.sequence), dtype=np.int64)

    def _propose(self, active: list[Row], cache, layout: KVLayout) -> list[Draft]:
        """Every row's draft, checked: one ``Drafter.propose_batch`` call; a drafter that needs the model gets each
        row's verified cache before that row's ``propose``."""
        budgets = [self._budget(row, len(active)) for row in active]
        if self.drafter.needs_model:
            drafts = []
            for r, (row, budget) in enumerate(zip(active, budgets)):
                if budget.max_depth == 0:
                    drafts.append(Draft.empty())
                    continue
                self.drafter.on_verified_cache(row.request_id, *layout.row_view(cache, r, row.num_pads))
                drafts.append(self.drafter.propose(row.request_id, budget))
        else:
            drafts = self.drafter.propose_batch([row.request_id for row in active], budgets)
        return [self._checked(draft, budget) for draft, budget in zip(drafts, budgets)]

    def _budget(self, row: Row, batch_size: int) -> Budget:
        budget = self.config.step_budget(row.max_length - len(row.sequence))
        depth_limit = self.traits.draft_depth_limit(row.num_committed)
        if depth_limit is not None and depth_limit < budget.max_depth:
            budget = Budget(budget.num_nodes, depth_limit)
        if batch_size != 1 or self.traits.chains_only:
            budget = Budget(budget.num_nodes, budget.max_depth, batch_size, self.traits.chains_only)
        return budget

    def _checked(self, draft: Draft, budget: Budget) -> Draft:
        """A row's draft checked against its budget and the vocabulary; its best chain where the model takes chains."""
        if not draft.num_nodes:
            return draft
        draft.validate(budget)
        if int(draft.token_ids.max()) >= self.traits.vocab_size:
            raise ValueError(f"drafter {self.drafter.name!r} proposed token id {int(draft.token_ids.max())}, "
                             f"outside the model's vocabulary of {self.traits.vocab_size} (from the prompt, "
                             f"documents= or the drafter's own state)")
        return draft.best_chain() if self.traits.chains_only else draft

    def _fit_batch(self, active: list[Row], drafts: list[Draft]) -> list[Draft]:
        """The drafter's joint cut of a padded batch's drafts (``Drafter.fit_batch``), checked: one per row, none
        grown (each is checked against the budget with the forward's other inputs)."""
        fitted = self.drafter.fit_batch([row.request_id for row in active], drafts, len(active))
        if len(fitted) != len(drafts):
            raise ValueError(f"drafter {self.drafter.name!r} fit_batch returned {len(fitted)} drafts for "
                             f"{len(drafts)} rows")
        for draft, proposed in zip(fitted, drafts):
            if draft is not proposed and draft.num_nodes > proposed.num_nodes:
                raise ValueError(f"drafter {self.drafter.name!r} fit_batch grew a draft from "
                                 f"{proposed.num_nodes} to {draft.num_nodes} nodes")
        return fitted

    def _verify(self, active: list[Row], steps: list[RowStep], cache, layout: KVLayout):
        """The step's forward and verification: (the model's logits [B, R, V], an Acceptance per row, the
        top-k each row's drafter observes, on the host).

        Whole tree on the device (``verifies_whole_tree``): one copy up (inputs, deferred cache moves, what
        the tree's scoring reads), one copy down (every row's target token and observed top-k), then the walk
        on the host. Otherwise the walk picks each visited row's token as it goes (on a CPU the cheaper
        way: it reads only the rows on the path, and a read costs no round trip there).
        """
        upload = Upload()
        run = queue_forward(self.traits, cache, layout, steps, self.pad_token_id, upload)
        width = 1 + max(step.draft.num_nodes for step in steps)
        whole_tree = self.whole_tree
        scorings = [TreeScoring.queue(step.draft.token_ids, step.draft.parents, row.sequence, width, upload,
                                      self.do_sample, bool(len(self.logits_processor)))
                    for row, step in zip(active, steps)] if whole_tree else []
        sent = self._timed_tensor(upload.send, self.device)
        logits = self._forward(active, steps, run, sent)  # the model's dtype [B, R, V]
        k = self.drafter.observe_top_k
        t0 = time.perf_counter()
        top = top_k(self._reducible(logits.reshape(-1, logits.shape[-1])), k) if k else ()
        if whole_tree:
            chosen, scores, invalid, rng_states = TreeScoring.choose(
                scorings, logits, sent, self.logits_processor, self.do_sample, self.logits_buffer)
            host = fetch([chosen] + ([] if invalid is None else [invalid]) + list(top))
            chosen_host, invalid_host = host[0], (host[1] if invalid is not None else None)
            top_host = host[-len(top):] if top else ()
        else:
            top_host = fetch(list(top))
        self.stats.tensor_s += time.perf_counter() - t0
        acceptances = []
        for r, (row, step) in enumerate(zip(active, steps)):
            if whole_tree:
                acceptance = self._accept(row, step.draft, scores[r], chosen_host[r])
                _check_probabilities(invalid_host, r, acceptance)
            else:
                acceptance = self._accept(row, step.draft, logits[r])
            acceptances.append(acceptance)
        if whole_tree and rng_states is not None:  # the stream where plain sampling leaves it
            _default_generator(self.device).set_state(rng_states[len(acceptances[0].token_ids)])
        observed = [None] * len(active)
        if k:
            ids, probs = (array.reshape(len(active), width, k) for array in top_host)
            observed = [(ids[r, : step.draft.num_nodes + 1], probs[r, : step.draft.num_nodes + 1])
                        for r, step in enumerate(steps)]
        return logits, acceptances, observed

    def _reducible(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` for ``top_k``: float16 / bfloat16 on a CPU as float32 in the step's buffer (exact), where a
        CPU reduces them 1.5-2.4x faster (one thread of a 2-core AMD EPYC, fill included, top 8: [17, 49152]
        0.70 ms against 1.39 ms, [65, 151936] 4.0 ms against 6.5 ms); elsewhere as they are. ``choose`` fills the
        buffer only after ``top_k`` has read it."""
        if scores.device.type == "cpu" and scores.dtype in (torch.float16, torch.bfloat16):
            return self.logits_buffer.fill(scores)
        return scores

    def _forward(self, active: list[Row], steps: list[RowStep], run, sent) -> torch.Tensor:
        """The batched tree forward, reported to the drafter: the model's logits [B, 1 + max n, V]."""
        prefill = self.stats.forward_passes == 0
        t0 = time.perf_counter()
        logits = run(self.model, sent)
        report = ForwardReport(tuple(row.request_id for row in active), tuple(step.num_fed for step in steps),
                               time.perf_counter() - t0, prefill, *(self._last_step or (None, 0)))
        self.stats.forward_s += report.forward_s
        self.drafter.on_forward(report)
        self.stats.forward_passes += 1
        self.stats.row_forwards += len(active)
        if not prefill:
            self.stats.tokens_fed += sum(report.tokens_per_row)
        return logits

    def _accept(self, row: Row, draft: Draft, logits: torch.Tensor, chosen: np.ndarray | None = None) -> Acceptance:
        """The walk over one row's tree; ``logits`` [R, V]: the model's (or, with ``chosen``, the scores that
        chose it, from ``TreeScoring.choose``)."""
        processor, criteria = self.logits_processor, self.stopping_criteria
        stats = self.stats

        def score_row(index: int, path: list[int]) -> torch.Tensor:
            if chosen is not None:
                return logits[index]  # a view: converted when kept (``_commit``)
            t0 = time.perf_counter()
            raw = logits[index: index + 1]
            if len(processor) == 0:
                scores = raw[0].to(torch.float32)  # one row, not the tree: no copy of float32 logits
            else:
                ids = torch.tensor([row.sequence + path], dtype=torch.long, device=self.device)
                scores = processor(ids, raw.to(torch.float32, copy=True))[0]
            stats.tensor_s += time.perf_counter() - t0
            return scores

        def choose(scores: torch.Tensor) -> int:
            t0 = time.perf_counter()
            token = choose_token(scores, self.do_sample)
            stats.tensor_s += time.perf_counter() - t0
            return token

        def should_stop(emitted: list[int], emitted_scores: list[torch.Tensor]) -> bool:
            """The stopping criteria, asked as plain decoding asks them (with its scores when it keeps them)."""
            length = len(row.sequence) + len(emitted)
            if length >= row.max_length:
                return True
            if self.stop_rule is not None and self.stop_rule.applies(length):
                return self.stop_rule.stops(length, emitted[-1])
            ids = torch.tensor([row.sequence + emitted], dtype=torch.long, device=self.device)
            scores = (tuple(row.out_scores) + tuple(s[None].to(torch.float32) for s in emitted_scores)
                      if self.want_scores else None)
            return bool(criteria(ids, scores).any())

        acceptance = accept_tree(draft.token_ids, draft.parents, score_row, self.do_sample, draft.is_candidate,
                                 should_stop, chosen=chosen, choose=choose)
        self.stats.count_draft(draft, acceptance.accepted_nodes, self.drafter.name)
        return acceptance

    def _commit(self, row: Row, draft: Draft, logits: torch.Tensor, acceptance: Acceptance) -> list[int]:
        """Commit the emitted tokens (the walk already asked the stopping criteria after each one)."""
        committed = list(acceptance.token_ids)
        for k in range(len(committed)):
            if self.want_scores:  # float32 copies: the scores may be views of the step's logits
                row.out_scores.append(acceptance.scores[k][None].to(torch.float32, copy=True))
            if self.want_logits:
                index = 0 if k == 0 else acceptance.accepted_nodes[k - 1] + 1
                row.out_logits.append(logits[index: index + 1].to(torch.float32, copy=True))
        next_position = row.num_committed
        row.sequence.extend(committed)
        row.done = acceptance.stopped
        self.stats.new_tokens += len(committed)
        if self.streamer is not None:
            for token in committed:
                self.streamer.put(torch.tensor([token]))
        # the last emitted token is committed but not cached: the next step's pending token
        row.pending = [committed[-1]]
        row.pending_positions = np.array([next_position + len(committed) - 1], np.int64)
        return committed

    def _learn(self, row: Row, draft: Draft, observed, acceptance: Acceptance, committed: list[int]) -> None:
        """``observed``: (top-k ids, probabilities) [num_nodes + 1, k] at the root and every node, on the host."""
        if observed is not None:
            accepted = np.asarray(acceptance.accepted_nodes, np.int64)
            self.drafter.observe(row.request_id, VerifyOutput(draft, accepted, *observed))
        self.drafter.extend(row.request_id, np.asarray(committed, np.int64))


def verifies_whole_tree(device) -> bool:
    """Whether a step on ``device`` verifies its whole tree on the device (``TreeScoring``): on an accelerator,
    where every read of the device costs a round trip; not on a CPU, where reading only the path's rows is
    cheaper. ``SpecConfig.verify_on_device`` overrides it."""
    return torch.device(device).type != "cpu"


def _check_probabilities(invalid: np.ndarray | None, r: int, acceptance: Acceptance) -> None:
    """Raise as ``torch.multinomial`` raises if a row that emitted a token had no valid distribution."""
    if invalid is None:
        return
    rows = [0] + [node + 1 for node in acceptance.accepted_nodes][: len(acceptance.token_ids) - 1]
    if invalid[r, rows].any():
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")


@dataclass(frozen=True)
class PlainStopRule:
    """The stopping criteria plain ``generate()`` builds by itself (transformers' ``MaxLengthCriteria`` and
    ``EosTokenCriteria``, nothing else), answered from the length and the last token.

    The engine asks the criteria after every emitted token; through the criteria objects that is a tensor of the
    whole sequence and two tensor ops each time (40-50 us: 0.8 ms a step when a step emits 17 tokens). For these
    two types the answer is ``length >= max_length or last token in the EOS ids``, the same as theirs. Past the
    model's ``max_position_embeddings`` (where ``MaxLengthCriteria`` logs a warning) the engine asks the objects.
    Any other criterion (stop strings, a caller's own, a subclass) sends every question to the objects.
    """

    max_length: int | None
    eos_token_ids: frozenset
    max_position_embeddings: int | None

    @classmethod
    def of(cls, criteria) -> "PlainStopRule | None":
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        max_length, eos, max_positions = None, set(), None
        for criterion in criteria:
            if type(criterion) is MaxLengthCriteria:
                max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
                limit = criterion.max_position_embeddings
                if limit is not None:
                    max_positions = limit if max_positions is None else min(max_positions, limit)
            elif type(criterion) is EosTokenCriteria:
                eos.update(int(t) for t in torch.as_tensor(criterion.eos_token_id).reshape(-1).tolist())
            else:
                return None
        return cls(max_length, frozenset(eos), max_positions)

    def applies(self, length: int) -> bool:
        return self.max_position_embeddings is None or length <= self.max_position_embeddings

    def stops(self, length: int, last_token: int) -> bool:
        return (self.max_length is not None and length >= self.max_length) or last_token in self.eos_token_ids


def top_k(scores: torch.Tensor, k: int, chunk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(``torch.topk(scores, k, dim=-1).indices``, their probabilities) for [n, V] scores, fast for a large V.

    Every one of a row's k largest values lies in one of the k chunks (of ``chunk`` columns) with
    the largest maxima: a chunk holding the j-th largest value has a maximum at least that value,
    and at most j - 1 chunks have a larger one. So a max per chunk (one pass over the row,
    vectorized) and a top-k over k chunks replace a top-k over the row. Measured on [17, 151936]
    float32, one thread: 0.54 ms against 3.4 ms (the recycling table reads every fed node's top-k,
    each step). Ties may be ordered differently from ``torch.topk``.

    The probabilities are a softmax over those k chunks' columns, not the whole row (a logsumexp
    over [17, 151936] costs 3.3 ms, a step's 2%): exact where the rest of the row holds no mass,
    an upper bound where it holds some: ``top_k(torch.tensor([[0., 0., 2.]]), 1, chunk=3)`` (one chunk,
    the whole row) -> ``([[2]], [[0.787]])``; with ``chunk=1`` only column 2's chunk is kept: ``[[1.0]]``.
    """
    num_rows, vocab = scores.shape
    num_chunks = vocab // chunk
    if num_chunks <= k:
        values, ids = torch.topk(scores, k=min(k, vocab), dim=-1)
        return ids, torch.exp(_widened(values) - torch.logsumexp(_widened(scores), dim=-1, keepdim=True))
    body = scores[:, : num_chunks * chunk].reshape(num_rows, num_chunks, chunk)
    chunks = torch.topk(body.amax(dim=-1), k=k, dim=-1).indices  # [n, k]
    candidates = body.gather(1, chunks[:, :, None].expand(-1, -1, chunk)).reshape(num_rows, k * chunk)
    columns = (chunks[:, :, None] * chunk + torch.arange(chunk, device=scores.device)).reshape(num_rows, k * chunk)
    if num_chunks * chunk < vocab:  # the columns past the last whole chunk are candidates too
        candidates = torch.cat([candidates, scores[:, num_chunks * chunk:]], 1)
        tail = torch.arange(num_chunks * chunk, vocab, device=scores.device).expand(num_rows, -1)
        columns = torch.cat([columns, tail], 1)
    values, picked = torch.topk(candidates, k=k, dim=-1)  # probabilities in float32 at least
    return columns.gather(1, picked), torch.exp(_widened(values) - torch.logsumexp(_widened(candidates), dim=-1,
                                                                                   keepdim=True))


def _widened(scores: torch.Tensor) -> torch.Tensor:
    """float16 / bfloat16 logits as float32 (the others as they are)."""
    return scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores


def _pad_token_id(generation_config) -> int:
    """The id plain decoding pads finished rows with (transformers falls back to EOS)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    if pad is None:
        return 0
    pad = torch.as_tensor(pad).reshape(-1)
    return int(pad[0]) if pad.numel() else 0
