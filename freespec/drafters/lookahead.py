"""Lookahead decoding: Jacobi iterations ride in the verify forward and leave n-grams behind.

Lookahead decoding (Fu et al., ICML 2024) keeps a 2-D window of guessed
future tokens, ``W`` positions wide and ``N - 1`` Jacobi iterations (levels)
deep, feeds it in every forward beside the candidates, and turns the target's
predictions along each column into an ``N``-gram for a pool keyed by first
token; later, n-grams whose first token is the last committed token are
verified as candidates.

**The window as a tree.** freespec's tree mask lets a node attend to its
ancestors only, at position ``cache_len + depth``. Lookahead's window fits
that exactly when drawn as a *comb*: the oldest level is a chain under the
root (the spine, guesses for the next ``W`` positions), and each column's
newer levels hang as a chain under that column's spine node. A node at level
``l`` of column ``j`` then sits at depth ``j + 1 + l`` (its position is right)
and attends to the root, spine nodes ``0..j`` and its column's older levels,
which is what lookahead's own mask allows it (the original builds that mask
by hand; read row by row it is this comb). The candidates hang under the root
beside the comb, as one trie, and every comb node is ``is_candidate=False``:
fed, attended, observed, never accepted, dropped from the cache.

Worked example, ``W = 3, N = 3`` (levels 0 and 1), root ``r``, window
``[[a0, a1, a2], [b0, b1, b2]]`` (level 0 guesses positions +1..+3, level 1
positions +2..+4)::

    r ── a0 ── a1 ── a2          spine (level 0): depths 1, 2, 3
         │     │     └── b2      level 1 of column 2: depth 4
         │     └── b1            level 1 of column 1: depth 3
         └── b0                  level 1 of column 0: depth 2

The target's top-1 at ``b_j`` (``o_j``, the next Jacobi iterate, position
``j + 3``) closes the n-gram ``(a_j, b_j, o_j)``: the pool gets ``a_j -> [b_j, o_j]``.
Then the window moves as the root does: with ``s`` tokens committed (``a =
s - 1`` accepted), level ``l`` column ``j`` takes the old level ``l + 1``
column ``j + a`` (the same position, one iteration newer); the new top level
takes ``o_{j + a}``; cells whose source fell off the window are guessed
afresh (the successor of their tree parent: the recycling table's top-1
when the mixture has one, else the pool's, else a token of the context).
While fewer than ``N - 1`` levels exist (the first steps), outputs add a level
instead, and nothing is harvested. Unfed columns keep their tokens, shifted.

**Cost.** The window costs ``(N - 1)`` fed nodes per column, in every forward
it rides in, and pays only later, through pool hits. Its value is measured
live: tokens accepted that only the pool proposed, per window node fed
(fading counts), so a ``DraftSizer`` option of ``c`` columns adds ``c (N - 1)``
nodes worth that value each; the sizer feeds the columns only when
``(1 + S_k + m v) / c(1 + k + m)`` beats every smaller window. Pool hits are
merged into the candidate trie (``Draft.from_sequences``), not verified as
``G`` separate chains, and sized like any lookup source (calibrated per
depth and frequency). The pool is seeded with the prompt's own ``N``-grams.

State: the pool and window are per request (``shared=True`` shares one pool
across requests: outputs never change, timing may); the value estimate is a
number about the model and machine, shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Hashable

import numpy as np

from ..draft import Budget, Draft
from ..kernels.ngram_pool import pool_insert_kernel
from ..tree import follow
from .base import MAX_TOKEN_ROWS, Drafter, ForwardReport, VerifyOutput, exercise
from .calibration import DraftSizer, calibrate_lookup
from .options import check_bool, check_int, check_number

SOURCE = "lookahead"
_MIN_KEYS = 1024


class NgramPool:
    """N-grams keyed by their first token (``kernels/ngram_pool.py``), bounded by ``max_keys`` and ``guesses``.

    The index from token to slot grows with the largest key, up to ``MAX_TOKEN_ROWS`` entries (1 MB):
    n-grams keyed by a larger id (outside every vocabulary) are not pooled.

    ``NgramPool(3, 2, 100).seed([5, 6, 7, 5, 6, 8])`` -> ``get(5) == [[6, 8], [6, 7]]`` (most recent first).
    """

    def __init__(self, ngram: int, guesses: int, max_keys: int):
        self.ngram = check_int("ngram", ngram, 2)
        self.guesses = check_int("guesses", guesses, 1)
        self.max_keys = check_int("max_keys", max_keys, 1)
        self.slot_of_key = np.full(0, -1, np.int32)
        self.key_of_slot = np.full(self.max_keys, -1, np.int64)
        self.grams = np.full((self.max_keys, self.guesses, self.ngram - 1), -1, np.int32)
        self.counts = np.zeros(self.max_keys, np.int32)
        self.stamps = np.zeros(self.max_keys, np.int64)
        self.state = np.zeros(2, np.int64)  # slots used, clock

    @property
    def num_keys(self) -> int:
        return int(self.state[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.slot_of_key, self.key_of_slot, self.grams, self.counts, self.stamps))

    def _cover(self, max_token: int) -> None:
        if max_token < self.slot_of_key.shape[0]:
            return
        size = max(_MIN_KEYS, self.slot_of_key.shape[0])
        while size <= max_token:
            size = min(2 * size, MAX_TOKEN_ROWS)
        grown = np.full(size, -1, np.int32)
        grown[: self.slot_of_key.shape[0]] = self.slot_of_key
        self.slot_of_key = grown

    def insert(self, keys, grams) -> None:
        """Add ``grams[i]`` ([m, N - 1], ``-1``-padded) under ``keys[i]`` ([m]), in order."""
        # writable, as numba types a read-only array apart: seeding (read-only context) and the window's harvest
        # then share one compiled kernel, which warmup() loads
        keys = np.require(np.asarray(keys, np.int64).reshape(-1), requirements=("C", "W"))
        grams = np.ascontiguousarray(grams, np.int64).reshape(keys.shape[0], self.ngram - 1)
        if keys.size == 0:
            return
        if keys.min() < 0:
            raise ValueError("n-gram keys must be token ids >= 0")
        if keys.max() >= MAX_TOKEN_ROWS:
            keep = keys < MAX_TOKEN_ROWS
            keys, grams = keys[keep], grams[keep]
            if keys.size == 0:
                return
        self._cover(int(keys.max()))
        pool_insert_kernel(self.slot_of_key, self.key_of_slot, self.grams, self.counts, self.stamps, self.state,
                           keys, grams)

    def seed(self, text) -> None:
        """Every full ``N``-gram of ``text``, in text order (later ones end up first)."""
        text = np.asarray(text, np.int64)
        num = text.shape[0] - self.ngram + 1
        if num <= 0:
            return
        windows = np.lib.stride_tricks.sliding_window_view(text, self.ngram)
        self.insert(windows[:, 0], windows[:, 1:])

    def get(self, key: int) -> list[list[int]]:
        """The continuations under ``key``, most recent first, padding dropped."""
        if key >= self.slot_of_key.shape[0] or self.slot_of_key[key] < 0:
            return []
        slot = self.slot_of_key[key]
        out = []
        for gram in self.grams[slot, : self.counts[slot]].tolist():
            out.append(gram[: gram.index(-1)] if -1 in gram else gram)
        return out


@dataclass
class _Fed:
    """Where a request's window rode in the last draft: node offset, columns, levels, and the tokens fed."""

    offset: int
    columns: int
    levels: int
    token_ids: np.ndarray  # [columns * levels]


class JacobiWindow:
    """One request's window: ``levels`` [N - 1, W] int64, of which the first ``num_levels`` are filled."""

    def __init__(self, width: int, ngram: int):
        self.width, self.ngram = width, ngram
        self.levels = np.full((ngram - 1, width), -1, np.int64)
        self.num_levels = 0
        self.outputs: np.ndarray | None = None  # [columns] top-1 at each fed column's top node, this step

    def comb(self, columns: int) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids, parents) of the first ``columns`` columns as a comb (spine first, then each column's
        levels 1..): ``columns=2, num_levels=2`` -> tokens ``[a0, a1, b0, b1]``, parents ``[-1, 0, 0, 1]``."""
        levels = self.num_levels
        token_ids = np.empty(columns * levels, np.int64)
        parents = np.empty(columns * levels, np.int32)
        token_ids[:columns] = self.levels[0, :columns]
        parents[:columns] = np.arange(-1, columns - 1)
        for j in range(columns):
            base = columns + j * (levels - 1)
            token_ids[base: base + levels - 1] = self.levels[1:levels, j]
            parents[base: base + levels - 1] = [j] + list(range(base, base + levels - 2))
        return token_ids, parents

    def top_node(self, columns: int, j: int) -> int:
        """Index in ``comb(columns)`` of column ``j``'s newest level."""
        return j if self.num_levels == 1 else columns + j * (self.num_levels - 1) + self.num_levels - 2

    def harvest(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys [c], grams [c, N - 1]) of the fed columns, once every level is filled; else empty."""
        if self.outputs is None or self.num_levels < self.ngram - 1:
            return np.zeros(0, np.int64), np.zeros((0, self.ngram - 1), np.int64)
        columns = self.outputs.shape[0]
        grams = np.concatenate([self.levels[1:, :columns].T, self.outputs[:, None]], axis=1)
        return self.levels[0, :columns].copy(), grams

    def advance(self, num_committed: int, root: int, guess: Callable[[int], int]) -> None:
        """Move the window by ``num_committed`` positions (see the module docstring); ``root``: the new root."""
        old, outputs, levels = self.levels.copy(), self.outputs, self.num_levels
        accepted = num_committed - 1
        width = self.width
        self.levels[:] = -1
        if outputs is not None and levels == self.ngram - 1:  # iterate: one level newer, shifted by `accepted`
            for j in range(max(0, width - accepted)):
                self.levels[: levels - 1, j] = old[1:levels, j + accepted]
                if j + accepted < outputs.shape[0]:
                    self.levels[levels - 1, j] = outputs[j + accepted]
        else:  # fill a level (if observed), or keep the levels, shifted by `num_committed` columns
            keep = width - num_committed
            if keep > 0:
                self.levels[:levels, :keep] = old[:levels, num_committed:]
            if outputs is not None and levels < self.ngram - 1:
                for j in range(max(0, keep)):
                    if j + num_committed < outputs.shape[0]:
                        self.levels[levels, j] = outputs[j + num_committed]
                self.num_levels = levels + 1
        self.num_levels = max(self.num_levels, 1)
        self.outputs = None
        for j in range(width):  # guess the cells left empty, each from its tree parent
            for level in range(self.num_levels):
                if self.levels[level, j] < 0:
                    parent = root if level == 0 and j == 0 else (
                        self.levels[0, j - 1] if level == 0 else self.levels[level - 1, j])
                    self.levels[level, j] = guess(int(parent))


class LookaheadSource:
    """Jacobi windows and n-gram pools; ``LookaheadDrafter`` and ``MixtureDrafter`` compose one.

    window (W): positions the window guesses ahead. ngram (N): n-gram length; the window
    has N - 1 levels. guesses (G): continuations kept per first token. max_keys: first
    tokens kept per pool (least recently written evicted). shared: one pool for all
    requests. value_prior: tokens a window node is worth before any is measured.
    half_life: steps over which the value's counts fade by half.
    """

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, max_keys: int = 8192,
                 shared: bool = False, value_prior: float = 0.05, half_life: float = 256.0):
        self.width = check_int("window", window, 1)
        self.ngram = check_int("ngram", ngram, 2)
        self.guesses = check_int("guesses", guesses, 1)
        self.max_keys = check_int("max_keys", max_keys, 1)
        self.shared = check_bool("shared", shared)
        self.value_prior = check_number("value_prior", value_prior, 0.0, 1.0)
        self.half_life = check_number("half_life", half_life, 0.0, low_open=True)
        self.pool = NgramPool(ngram, guesses, max_keys) if shared else None
        self._pools: dict[Hashable, NgramPool] = {}
        self._windows: dict[Hashable, JacobiWindow] = {}
        self._contexts: dict[Hashable, Callable[[], np.ndarray]] = {}
        self._fed: dict[Hashable, _Fed] = {}
        self._gained, self._nodes_fed = 0.0, 0.0  # fading sums: pool-only accepted tokens, window nodes fed
        self._prior_nodes = 64.0  # the prior weighs as much as this many fed nodes

    # ------------------------------------------------------------------ lifecycle
    def pool_for(self, request_id: Hashable) -> NgramPool:
        return self.pool if self.shared else self._pools[request_id]

    def start(self, request_id: Hashable, context: Callable[[], np.ndarray],
              successor: Callable[[int], int] | None = None) -> None:
        """``context()``: the request's tokens so far; ``successor(token)``: a guess of what follows (-1: none)."""
        if not self.shared:
            self._pools[request_id] = NgramPool(self.ngram, self.guesses, self.max_keys)
        prompt = context()
        self.pool_for(request_id).seed(prompt)
        self._contexts[request_id] = context
        window = self._windows[request_id] = JacobiWindow(self.width, self.ngram)
        if prompt.shape[0]:  # an empty prompt: the window fills at the first committed token
            window.advance(self.width + 1, int(prompt[-1]), self._guesser(request_id, successor))

    def stop(self, request_id: Hashable) -> None:
        for store in (self._pools, self._windows, self._contexts, self._fed):
            store.pop(request_id, None)

    def _guesser(self, request_id: Hashable, successor: Callable[[int], int] | None) -> Callable[[int], int]:
        """The successor of a token: ``successor``'s, else the pool's newest, else a token of the context."""
        pool, context = self.pool_for(request_id), self._contexts[request_id]()
        picks = iter(range(1, 1 << 30))

        def guess(token: int) -> int:
            found = successor(token) if successor is not None else -1
            if found < 0:
                grams = pool.get(token)
                found = grams[0][0] if grams and grams[0] else -1
            if found < 0:  # a deterministic spread of the context's tokens, as lookahead's random init
                found = int(context[(next(picks) * 7919) % context.shape[0]])
            return found

        return guess

    # ------------------------------------------------------------------ drafting
    def candidates(self, request_id: Hashable, root: int, budget: Budget) -> Draft:
        """The pool's continuations of ``root`` as one trie, confidence = their frequency."""
        grams = self.pool_for(request_id).get(root)
        if not grams:
            return Draft.empty()
        return Draft.from_sequences(grams, num_nodes=budget.num_nodes, max_depth=budget.max_depth, source=SOURCE)

    def value(self) -> float:
        """Tokens a window node is worth: pool-only accepted tokens per window node fed (fading, with a prior)."""
        return (self._gained + self._prior_nodes * self.value_prior) / (self._nodes_fed + self._prior_nodes)

    def options(self, request_id: Hashable, budget: Budget) -> list[tuple[int, float]]:
        """``DraftSizer`` extras: option ``c`` feeds the first ``c`` columns, ``c (levels)`` nodes."""
        levels = self._windows[request_id].num_levels
        max_columns = min(self.width, budget.max_depth - levels + 1, budget.num_nodes // levels)
        value = self.value()
        return [(columns * levels, value) for columns in range(max(0, max_columns) + 1)]

    def hang_window(self, request_id: Hashable, candidates: Draft, num_nodes: int) -> Draft:
        """``candidates`` followed by the comb of ``num_nodes`` window nodes (an ``options`` size), not candidates."""
        self._fed.pop(request_id, None)
        window = self._windows[request_id]
        columns = num_nodes // window.num_levels if num_nodes else 0
        if columns == 0:
            return candidates
        token_ids, parents = window.comb(columns)
        offset = candidates.num_nodes
        self._fed[request_id] = _Fed(offset, columns, window.num_levels, token_ids)
        confidence = np.zeros(offset + token_ids.size, np.float32)
        if candidates.confidence is not None:
            confidence[:offset] = candidates.confidence
        sources = (candidates.sources or ("",) * offset) + (SOURCE,) * token_ids.size
        return Draft(np.concatenate([candidates.token_ids, token_ids]),
                     np.concatenate([candidates.parents, np.where(parents < 0, -1, parents + offset)]),
                     confidence, sources, np.arange(offset + token_ids.size) < offset)

    # ------------------------------------------------------------------ learning
    def observe(self, request_id: Hashable, verify_output: VerifyOutput) -> None:
        """The window's outputs (top-1 at each fed column's newest level); n-grams into the pool."""
        fed = self._fed.pop(request_id, None)
        draft = verify_output.draft
        end = None if fed is None else fed.offset + fed.token_ids.shape[0]
        if fed is None or draft.num_nodes < end or not np.array_equal(draft.token_ids[fed.offset:end], fed.token_ids):
            return  # no window rode in this forward
        window = self._windows[request_id]
        top1 = np.asarray(verify_output.topk_token_ids)[:, 0]  # [num_nodes + 1]
        rows = [fed.offset + 1 + window.top_node(fed.columns, j) for j in range(fed.columns)]
        window.outputs = top1[rows].astype(np.int64)
        keys, grams = window.harvest()
        self.pool_for(request_id).insert(keys, grams)
        self._nodes_fed += fed.token_ids.shape[0]

    def advance(self, request_id: Hashable, num_committed: int, successor: Callable[[int], int] | None = None) -> None:
        """After ``num_committed`` tokens: move the window (not for none, nor before the first token), fade the
        value counts."""
        context = self._contexts[request_id]()
        if num_committed and context.shape[0]:
            self._windows[request_id].advance(num_committed, int(context[-1]), self._guesser(request_id, successor))
        fade = 0.5 ** (1.0 / self.half_life)
        self._gained *= fade
        self._nodes_fed *= fade

    def credit(self, gained_tokens: int) -> None:
        """Tokens accepted this step that only the pool had proposed."""
        self._gained += gained_tokens


class LookaheadDrafter(Drafter):
    """Lookahead decoding (see the module docstring): pool hits as candidates, the window as not-candidates.

    window / ngram / guesses / max_keys / shared / value_prior: ``LookaheadSource``'s (W, N, G, ...).
    adaptive / prior_cost_slope: ``DraftSizer``'s (``SpecConfig.adaptive_budget`` sets adaptive;
    without it the whole window rides in every forward, as in the original).
    """

    name = SOURCE
    observe_top_k = 1

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, max_keys: int = 8192,
                 shared: bool = False, value_prior: float = 0.05, adaptive: bool = True,
                 prior_cost_slope: float = 0.03):
        super().__init__()
        self.lookahead = LookaheadSource(window, ngram, guesses, max_keys, shared, value_prior)
        self.sizer = DraftSizer(adaptive, prior_cost_slope)
        self._proposed: dict[Hashable, Draft] = {}  # request -> candidates verified this step

    def _on_start(self, request_id) -> None:
        self.lookahead.start(request_id, partial(self.context, request_id))

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        candidates = self._proposed.pop(request_id, None)
        if candidates is not None and candidates.num_nodes:
            self.lookahead.credit(len(follow(candidates.parents, candidates.token_ids, ids)))
        self.sizer.judge(request_id, ids)
        self.lookahead.advance(request_id, ids.shape[0])

    def _on_stop(self, request_id) -> None:
        self._proposed.pop(request_id, None)
        self.sizer.forget(request_id)
        self.lookahead.stop(request_id)

    def observe(self, request_id: Hashable, verify_output: VerifyOutput) -> None:
        self.lookahead.observe(request_id, verify_output)

    def on_forward(self, report: ForwardReport) -> None:
        self.sizer.on_forward(report)

    def _propose(self, request_id, budget: Budget) -> Draft:
        root = int(self.context(request_id)[-1])
        scored, kinds = calibrate_lookup(self.sizer.calibrator, SOURCE, 1,
                                         self.lookahead.candidates(request_id, root, budget))
        options = self.lookahead.options(request_id, budget)
        chosen, option = self.sizer.select(request_id, scored, kinds, budget, tuple(options))
        self._proposed[request_id] = chosen
        return self.lookahead.hang_window(request_id, chosen, options[option][0])

    def fit_batch(self, request_ids: list, drafts: list[Draft], batch_size: int,
                  packed: bool = False) -> list[Draft]:
        """The sizer's joint cut (``DraftSizer.fit_batch``; a draft with a window is left as it is); a row cut
        is credited for the nodes it keeps."""
        fitted = self.sizer.fit_batch(request_ids, drafts, batch_size, self._progress(request_ids, packed), packed)
        for request_id, proposed, kept in zip(request_ids, drafts, fitted):
            if kept is not proposed:
                self._proposed[request_id] = kept
        return fitted

    def warmup(self) -> None:
        """Compile the pool kernel on a tiny request."""
        exercise(LookaheadDrafter(window=2, ngram=2))
