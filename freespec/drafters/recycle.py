"""Token recycling: draft from the target's own top-k predictions of earlier steps.

Every verify forward computes the target's logits at the root and at every
fed node, and most of those predictions are thrown away (only the accepted
path's are used). Token recycling (Luo et al. 2024, "Turning Trash into
Treasure") keeps them: a table maps each token to the target's top-k
successors the last time a node with that token was fed, and the next draft
is a tree grown from the table, starting at the root token. Drafting costs a
table lookup; learning costs a top-k of logits the forward already computed.

``SuccessorTable`` holds three kinds of rows (``kernels/successor_table.py``):
*model* rows per token (TR's ``vocab x k`` table), *pair* rows per (previous
token, token) in a bounded hash, and *text* rows, the successors the token had
in the request's own text. Measured on SmolLM2-135M over 13 Spec-Bench
questions (predictions read in the true context), the rank-0 entry is the
next token 28% of the time for a model row, 50% for a pair row and 34% for a
text row, so a node's children are read from all the rows that know it, pair
first. Rows are written from every fed node's top-k (``observe``): rejected
nodes first, then the root and the accepted path, then the children of the
last accepted node, so predictions made in the truest context win; when the
target's bonus token was one of those children (a drafted sibling), its row
holds the target's top-k in the true context, and the next step reads it as
*exact*. Each model and pair entry keeps the target's probability of it when
it was written, as a confidence class: rank alone mixes a 0.95 successor with
a 0.3 one, and the calibrated acceptance of a recycled node is counted per
class (``kernels/successor_table.py`` has the measurement). Memory is bounded:
``rows x (5 k + 4 text_k)`` bytes, rows grown lazily to the largest token id
seen (``vocab_size`` fixes it), plus the pair hash; 10.4 MB for Qwen's 151,936
tokens at the defaults (k = 8, text_k = 2, 65,536 pair slots).

``RecycleSource`` is the component drafters compose: the tables (one set
shared by every request, or one per request) and the draft tree. The tree is
grown best-first (``grow_tree_kernel``): a node's path probability is the
product of calibrated P(accepted | parent accepted) per (row type, depth,
rank, agreement of two rows), counted live by an ``AcceptanceCalibrator``, so
the tree's shape follows what this model accepts on this text rather than a
static tree tuned for another GPU (the published 60-80-node trees came from
A100s). ``RecycleDrafter`` sizes the tree with a ``DraftSizer`` (the live cost
model c(n)): on a CPU where c(4) is ~1.9 in float32 it verifies one to three
nodes, where c is flat (bfloat16 on AMX, GPUs) dozens.

Worked example, k = 2: prompt ``[5, 6, 5, 7]`` seeds the text rows
``5 -> [7, 6]`` and ``6 -> [5]``. The root is 7, whose row is empty: the
prefill has no draft, and the target's top-2 at the root, ``[8, 5]``, become
row 7 (model). The bonus token 8 is committed; row 8 is empty, no draft; the
target's top-2 after 8, ``[5, 9]``, become row 8. Next root 5: the tree grows
from row 5 (text) and the rows below it, ``7 -> 8 -> 5`` beside ``6``, ranked by
calibrated acceptance, and the cost model decides how much of it is verified.

State across requests: ``shared=True`` (the default) keeps one table for
all requests, so a token's successors learned in one request draft in
another; it never changes any output (verification decides every token), but
draft sizes, and so timing, depend on earlier requests. ``shared=False`` keeps
one table per request, dropped at ``stop()``, for multi-tenant deployments.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from ..draft import Budget, Draft
from ..kernels.successor_table import (CONF_EDGES, EXACT, MODEL, NUM_CONF, NUM_ROW_TYPES, PAIR, TEXT,
                                       confidence_classes, grow_tree_kernel, pair_key, pair_slot, seed_text_kernel,
                                       write_rows_kernel)
from .base import MAX_TOKEN_ROWS, Drafter, ForwardReport, VerifyOutput, exercise
from .calibration import AcceptanceCalibrator, DraftSizer
from .options import check_bool, check_int, check_number

SOURCE = "recycle"
_MIN_ROWS = 1024
_DEPTH_KINDS = 6  # depths >= 6 share their calibration counts
_REFRESH_TICKS = 4  # the probability matrix is re-read from the calibrator after this many judged steps


class SuccessorTable:
    """Model rows, pair rows and text rows (``kernels/successor_table.py``), bounded.

    top_k: entries of a model or pair row (the target's top-k). text_k: entries of a text
    row. vocab_size: rows of the per-token tables (None: grown lazily to cover the largest
    token seen, doubling from 1024). pair_slots: slots of the pair hash (a power of two).
    Model and pair rows keep each entry's confidence class beside it (``model_conf``, ``pair_conf``:
    the target's probability of the entry when it was written, bucketed; -1 where ``write`` got none).
    ``nbytes`` = rows (5 top_k + 4 text_k) + pair_slots (8 + 5 top_k), rows <= min(max(1024,
    2 (largest id + 1)), ``MAX_TOKEN_ROWS``); Qwen's 151,936 tokens at the defaults: 7.3 MB + 3.1 MB,
    at most 12.6 MB + 3.1 MB. A token id >= ``vocab_size`` raises ``ValueError``; without
    ``vocab_size``, one >= ``MAX_TOKEN_ROWS`` (outside every vocabulary) keeps its pair rows only.
    """

    def __init__(self, top_k: int = 8, text_k: int = 2, vocab_size: int | None = None, pair_slots: int = 1 << 16):
        self.top_k = check_int("top_k", top_k, 1)
        self.text_k = check_int("text_k", text_k, 1)
        self.vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, 1)
        pair_slots = check_int("pair_slots", pair_slots, 1)
        if pair_slots & (pair_slots - 1):
            raise ValueError(f"pair_slots must be a power of two, got {pair_slots}")
        rows = self.vocab_size if self.vocab_size is not None else _MIN_ROWS
        self.model = np.full((rows, self.top_k), -1, np.int32)
        self.model_conf = np.full((rows, self.top_k), -1, np.int8)
        self.text = np.full((rows, self.text_k), -1, np.int32)
        self.pair_keys = np.full(pair_slots, -1, np.int64)
        self.pair = np.full((pair_slots, self.top_k), -1, np.int32)
        self.pair_conf = np.full((pair_slots, self.top_k), -1, np.int8)

    @property
    def nbytes(self) -> int:
        return int(sum(getattr(self, name).nbytes
                       for name in ("model", "model_conf", "text", "pair_keys", "pair", "pair_conf")))

    @property
    def num_rows(self) -> int:
        return int(self.model.shape[0])

    def _cover(self, max_token: int) -> None:
        """Grow the per-token tables so that row ``max_token`` exists."""
        if max_token < self.num_rows:
            return
        if self.vocab_size is not None:
            raise ValueError(f"token id {max_token} is outside vocab_size={self.vocab_size}")
        rows = self.num_rows
        while rows <= max_token and rows < MAX_TOKEN_ROWS:
            rows = min(2 * rows, MAX_TOKEN_ROWS)
        if rows == self.num_rows:
            return
        for name in ("model", "model_conf", "text"):
            old = getattr(self, name)
            grown = np.full((rows, old.shape[1]), -1, old.dtype)
            grown[: old.shape[0]] = old
            setattr(self, name, grown)

    def write(self, tokens, prevs, topk, order, probs=None) -> None:
        """Model row ``tokens[i]`` and pair row ``(prevs[i], tokens[i])`` := ``topk[i]`` for ``i`` in ``order``
        (later writes win; ``prevs[i] = -1``: no pair). [m] int, [m] int, [m, kk] int, [w] int; ``probs``
        [m, kk] float: the target's probability of each entry (its confidence class is kept), or None."""
        tokens = np.ascontiguousarray(tokens, np.int64)
        prevs = np.ascontiguousarray(prevs, np.int64)
        topk = np.ascontiguousarray(topk, np.int64)
        order = np.ascontiguousarray(order, np.int64)
        if order.size == 0:
            return
        if topk.ndim != 2 or topk.shape[0] != tokens.shape[0] or prevs.shape != tokens.shape:
            raise ValueError(f"need tokens [m], prevs [m], topk [m, k]; got {tokens.shape}, {prevs.shape}, "
                             f"{topk.shape}")
        if probs is None:
            conf = np.full(topk.shape, -1, np.int8)
        else:
            probs = np.asarray(probs)
            if probs.shape != topk.shape:
                raise ValueError(f"probs must have topk's shape {topk.shape}, got {probs.shape}")
            conf = np.ascontiguousarray(confidence_classes(probs))
        if tokens[order].min() < 0 or topk[order].min() < 0:
            raise ValueError("token ids must be >= 0")
        self._cover(int(max(tokens[order].max(), topk[order].max(), prevs[order].max())))
        write_rows_kernel(self.model, self.model_conf, self.pair_keys, self.pair, self.pair_conf, tokens, prevs, topk,
                          conf, order)

    def seed(self, text, begin: int = 0) -> None:
        """Text rows from the bigrams ``text[j - 1] -> text[j]``, ``j >= begin``, most recent first."""
        text = np.ascontiguousarray(text, np.int32)
        if text.shape[0] < 2 or begin >= text.shape[0]:
            return
        if text.min() < 0:
            raise ValueError("token ids must be >= 0")
        self._cover(int(text.max()))
        seed_text_kernel(self.text, text, begin)

    def row(self, token: int, kind: int = MODEL, prev: int = -1) -> list[int]:
        """The entries of ``token``'s row of ``kind`` (MODEL, TEXT, or PAIR after ``prev``): ``[]`` if none."""
        return self._row(token, kind, prev)[0]

    def confidences(self, token: int, kind: int = MODEL, prev: int = -1) -> list[int]:
        """The confidence classes of the entries ``row`` returns (-1: written without probabilities; TEXT: -1)."""
        return self._row(token, kind, prev)[1]

    def _row(self, token: int, kind: int, prev: int) -> tuple[list[int], list[int]]:
        if kind == PAIR:
            slot = pair_slot(prev, token, self.pair_keys.shape[0])
            hit = self.pair_keys[slot] == pair_key(prev, token)
            found, conf = (self.pair[slot], self.pair_conf[slot]) if hit else (self.pair[0, :0], self.pair_conf[0, :0])
        else:
            table = self.model if kind == MODEL else self.text
            inside = 0 <= token < self.num_rows
            found = table[token] if inside else table[0, :0]
            conf = self.model_conf[token] if inside and kind == MODEL else np.full(found.shape, -1, np.int8)
        kept = found >= 0
        return found[kept].tolist(), conf[kept].tolist()

    def top1(self, token: int) -> int:
        """The likeliest successor of ``token`` (its text row's first, else its model row's), or -1."""
        if not 0 <= token < self.num_rows:
            return -1
        for table in (self.text, self.model):  # ``row``'s first entry, without its arrays (the window asks per cell)
            for entry in table[token].tolist():
                if entry >= 0:
                    return entry
        return -1

    def grow(self, root: int, root_prev: int, exact_root: bool, probs: np.ndarray, max_nodes: int, max_depth: int,
             min_prob: float, num_ranks: int | None = None):
        """Best-first tree from ``root`` (after ``root_prev``, -1 = none): (token_ids [n] int64, parents [n] int32,
        path probs [n] float64, kinds [n, 4] int64 = (row type, depth, class, agree)). ``probs``:
        [4, D, C, 2] float64 per class: ranks ``0 .. num_ranks - 1`` (None: all C), then confidence classes;
        ``exact_root``: the root's model row is exact; see the kernel."""
        num_ranks = probs.shape[2] if num_ranks is None else num_ranks
        token_ids = np.empty(max_nodes, np.int64)
        parents = np.empty(max_nodes, np.int32)
        path_probs = np.empty(max_nodes, np.float64)
        kinds = np.empty((max_nodes, 4), np.int64)
        count = 0
        if max_nodes > 0 and max_depth > 0 and 0 <= root < self.num_rows:
            count = grow_tree_kernel(self.model, self.model_conf, self.pair_keys, self.pair, self.pair_conf, self.text,
                                     int(root), int(root_prev), bool(exact_root), np.ascontiguousarray(probs, np.float64),
                                     int(num_ranks), max_nodes, max_depth, float(min_prob), token_ids, parents,
                                     path_probs, kinds)
        return token_ids[:count], parents[:count], path_probs[:count], kinds[:count]


_BASE_PRIOR = {EXACT: 0.9, PAIR: 0.5, TEXT: 0.35, MODEL: 0.28}  # rank-0 acceptance before any is counted
_CONF_MIDS = tuple((lo + hi) / 2 for lo, hi in zip((0.0,) + CONF_EDGES, CONF_EDGES + (1.0,)))
_CONF_PRIOR = {PAIR: (0.1, 0.6), MODEL: (0.05, 0.45)}  # acceptance ~ a + b q at the class's middle probability q


def recycle_prior(row_type: int, depth: int, rank: int, agree: int, num_ranks: int = 8) -> float:
    """Acceptance prior of a recycled node: ``recycle_prior(PAIR, 1, 0, 0) -> 0.5``; rank r divides by r + 1
    (an exact row's others: 0.05), depth multiplies by 0.9 per level, agreement of two rows by 1.4 (at most 0.95).
    ``rank >= num_ranks`` is confidence class ``rank - num_ranks`` of a PAIR or MODEL entry: ``a + b q`` at the
    class's middle probability ``q`` (model rows: 0.05 + 0.45 q, fitted to the measurement in
    ``kernels/successor_table.py``; pair rows 0.1 + 0.6 q), ``recycle_prior(MODEL, 1, 8 + 7, 0) -> 0.47``."""
    if row_type == EXACT:
        return 0.9 if rank == 0 else 0.05
    if rank >= num_ranks:
        a, b = _CONF_PRIOR.get(row_type, (0.05, 0.45))
        prior = (a + b * _CONF_MIDS[min(rank - num_ranks, NUM_CONF - 1)]) * 0.9 ** (depth - 1)
    else:
        prior = _BASE_PRIOR[row_type] / (rank + 1) * 0.9 ** (depth - 1)
    return min(0.95, prior * (1.4 if agree else 1.0))


class RecycleSource:
    """Successor tables and calibrated best-first trees; ``RecycleDrafter`` and ``MixtureDrafter`` compose one.

    top_k / text_k / vocab_size / pair_slots: the tables' (``SuccessorTable``). shared: one
    table set for every request (True) or one per request. max_depth: deepest node drafted.
    min_prob: grow no node whose path probability is lower. seed_text: text rows from the
    request's bigrams (prompt and output). confidence: keep the target's probability of each
    model and pair entry (its confidence class) and calibrate per class (False: per rank only).
    """

    def __init__(self, top_k: int = 8, shared: bool = True, vocab_size: int | None = None, max_depth: int = 16,
                 min_prob: float = 0.01, seed_text: bool = True, text_k: int = 2, pair_slots: int = 1 << 16,
                 confidence: bool = True):
        self.top_k = check_int("top_k", top_k, 1)
        self.shared = check_bool("shared", shared)
        self.max_depth = check_int("max_depth", max_depth, 1)
        self.min_prob = check_number("min_prob", min_prob, 0.0, 1.0)
        self.seed_text = check_bool("seed_text", seed_text)
        self.confidence = check_bool("confidence", confidence)
        self._table_options = (top_k, text_k, vocab_size, pair_slots)
        self.table = SuccessorTable(*self._table_options) if shared else None
        self._tables: dict[Hashable, SuccessorTable] = {}
        self._exact: dict[Hashable, np.ndarray] = {}  # request -> tokens whose rows the last step wrote exactly
        self.num_ranks = ranks = max(self.top_k, text_k)  # classes: ranks, then confidence classes
        self._priors = np.array([[[[recycle_prior(row_type, d, r, agree, ranks) for agree in (0, 1)]
                                   for r in range(ranks + NUM_CONF)]
                                  for d in range(1, _DEPTH_KINDS + 1)] for row_type in range(NUM_ROW_TYPES)])
        self._probs: tuple[int, AcceptanceCalibrator | None, np.ndarray] = (-_REFRESH_TICKS, None, self._priors)
        # the entries the calibrator re-reads: an exact row is only ever the root's (depth 1), and only pair and
        # model rows have confidence classes; the others keep their priors
        calibrated = [(row_type, d, rank, agree) for row_type in range(NUM_ROW_TYPES)
                      for d in range(1 if row_type == EXACT else _DEPTH_KINDS)
                      for rank in range(ranks + (NUM_CONF if row_type in (PAIR, MODEL) else 0))
                      for agree in (0, 1)]
        self._calibrated_kinds = [(SOURCE, row_type, d + 1, rank, agree) for row_type, d, rank, agree in calibrated]
        self._calibrated_priors = [float(self._priors[index]) for index in calibrated]
        self._calibrated_at = np.ravel_multi_index(tuple(np.array(calibrated).T), self._priors.shape)

    def table_for(self, request_id: Hashable) -> SuccessorTable:
        return self.table if self.shared else self._tables[request_id]

    def start(self, request_id: Hashable, prompt_ids: np.ndarray) -> None:
        if not self.shared:
            self._tables[request_id] = SuccessorTable(*self._table_options)
        if self.seed_text:
            self.table_for(request_id).seed(prompt_ids)

    def extend(self, request_id: Hashable, context: np.ndarray, num_new: int) -> None:
        """The context after ``num_new`` tokens were committed: their bigrams seed text rows."""
        if self.seed_text:
            self.table_for(request_id).seed(context[-(num_new + 1):])

    def stop(self, request_id: Hashable) -> None:
        self._tables.pop(request_id, None)
        self._exact.pop(request_id, None)

    def observe(self, request_id: Hashable, context: np.ndarray, verify_output: VerifyOutput) -> None:
        """Every fed node's top-k becomes its token's model row and its (parent token, token) pair row.

        Rejected nodes are written first (deepest first), then the root and the accepted path,
        then the children of the last accepted node (the *frontier*), so predictions made in the
        truest context win. A frontier node's token is the bonus token whenever the target picked
        a drafted sibling other than the accepted one: its row is then exact for the next step's
        root (``EXACT``). ``context``: the committed tokens, the root last.
        """
        if context.shape[0] == 0:
            return  # nothing committed yet: no root, so no forward fed one
        draft = verify_output.draft
        topk = np.asarray(verify_output.topk_token_ids)  # [num_nodes + 1, kk]
        if topk.ndim != 2 or topk.shape[0] != draft.num_nodes + 1:
            raise ValueError(f"topk_token_ids must have shape [num_nodes + 1, k] = [{draft.num_nodes + 1}, k], "
                             f"got {topk.shape}")
        fed = np.concatenate([context[-1:], draft.token_ids]).astype(np.int64)  # row i: root, then node i - 1
        prevs = np.empty_like(fed)
        prevs[0] = context[-2] if context.shape[0] > 1 else -1
        prevs[1:] = fed[draft.parents + 1]  # a node's previous token is its parent's (the root's: row 0)
        accepted_rows = np.asarray(verify_output.accepted_nodes, np.int64) + 1
        last = accepted_rows[-1] - 1 if accepted_rows.size else -1
        frontier = np.zeros(fed.shape[0], bool)
        frontier[1:] = draft.parents == last
        frontier[accepted_rows] = False
        rest = np.ones(fed.shape[0], bool)
        rest[0] = rest[accepted_rows] = False
        rest &= ~frontier
        rest_rows, frontier_rows = np.nonzero(rest)[0], np.nonzero(frontier)[0]
        rest_rows = rest_rows[np.argsort(-draft.depths()[rest_rows - 1], kind="stable")]  # shallower: truer context
        order = np.concatenate([rest_rows, [0], accepted_rows, frontier_rows])
        self.table_for(request_id).write(fed, prevs, topk, order, verify_output.topk_probs if self.confidence else None)
        self._exact[request_id] = fed[frontier_rows]

    def probabilities(self, calibrator: AcceptanceCalibrator) -> np.ndarray:
        """[4, D, R + C, 2] float64: calibrated P(accepted | parent accepted) per (row type, depth, class, agree),
        classes being R ranks then C confidence classes, re-read from ``calibrator`` every few judged steps."""
        clock, source, probs = self._probs
        if source is calibrator and calibrator.clock - clock < _REFRESH_TICKS:
            return probs
        probs = self._priors.copy()
        probs.reshape(-1)[self._calibrated_at] = calibrator.probabilities(self._calibrated_kinds,
                                                                          self._calibrated_priors)
        self._probs = (calibrator.clock, calibrator, probs)
        return probs

    def draft(self, request_id: Hashable, context: np.ndarray, budget: Budget,
              calibrator: AcceptanceCalibrator) -> tuple[Draft, list[tuple]]:
        """(tree under ``context[-1]`` with calibrated path probabilities as confidence, each node's kind)."""
        table = self.table_for(request_id)
        root = int(context[-1])
        root_prev = int(context[-2]) if context.shape[0] > 1 else -1
        exact = self._exact.pop(request_id, None)
        exact_root = exact is not None and root in exact
        depth = min(self.max_depth, budget.max_depth)
        token_ids, parents, path_probs, kinds = table.grow(root, root_prev, exact_root, self.probabilities(calibrator),
                                                           budget.num_nodes, depth, self.min_prob, self.num_ranks)
        if token_ids.size == 0:
            return Draft.empty(), []
        draft = Draft(token_ids, parents, path_probs.astype(np.float32), (SOURCE,) * token_ids.size)
        return draft, [(SOURCE, row_type, min(d, _DEPTH_KINDS), rank, agree)
                       for row_type, d, rank, agree in kinds.tolist()]


class RecycleDrafter(Drafter):
    """Token recycling (see the module docstring), sized by a live cost model.

    top_k: successors per token (the engine hands over this many of the target's top tokens).
    shared: one table for all requests (default) or one per request (multi-tenant).
    vocab_size / max_depth / min_prob / seed_text / text_k / pair_slots / confidence: ``RecycleSource``'s.
    adaptive / prior_cost_slope: ``DraftSizer``'s (``SpecConfig.adaptive_budget`` sets adaptive).
    """

    name = SOURCE
    isolation_options = {"shared": False}  # no request's tokens or top-k reach another's drafts

    def __init__(self, top_k: int = 8, shared: bool = True, vocab_size: int | None = None, max_depth: int = 16,
                 min_prob: float = 0.01, seed_text: bool = True, text_k: int = 2, pair_slots: int = 1 << 16,
                 adaptive: bool = True, prior_cost_slope: float = 0.03, confidence: bool = True):
        super().__init__()
        self.recycle = RecycleSource(top_k, shared, vocab_size, max_depth, min_prob, seed_text, text_k, pair_slots,
                                     confidence)
        self.sizer = DraftSizer(adaptive, prior_cost_slope)
        self.observe_top_k = self.recycle.top_k

    def _on_start(self, request_id) -> None:
        self.recycle.start(request_id, self.context(request_id))

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        self.sizer.judge(request_id, ids)
        self.recycle.extend(request_id, self.context(request_id), ids.shape[0])

    def _on_stop(self, request_id) -> None:
        self.sizer.forget(request_id)
        self.recycle.stop(request_id)

    def observe(self, request_id: Hashable, verify_output: VerifyOutput) -> None:
        self.recycle.observe(request_id, self.context(request_id), verify_output)

    def on_forward(self, report: ForwardReport) -> None:
        self.sizer.on_forward(report)

    def fit_batch(self, request_ids: list, drafts: list[Draft], batch_size: int,
                  packed: bool = False) -> list[Draft]:
        return self.sizer.fit_batch(request_ids, drafts, batch_size, self._progress(request_ids, packed), packed)

    def _propose(self, request_id, budget: Budget) -> Draft:
        draft, kinds = self.recycle.draft(request_id, self.context(request_id), budget, self.sizer.calibrator)
        return self.sizer.select(request_id, draft, kinds, budget)[0]

    def warmup(self) -> None:
        """Compile the table kernels on a tiny request."""
        drafter = RecycleDrafter(top_k=2, shared=False)
        drafter.start("warmup", [1, 2, 3, 1, 2])
        draft = drafter.propose("warmup", Budget(4, 4))
        topk = np.tile(np.array([[1, 2]]), (draft.num_nodes + 1, 1))
        drafter.observe("warmup", VerifyOutput(draft, np.zeros(0, np.int64), topk))
        drafter.stop("warmup")
        exercise(drafter)
