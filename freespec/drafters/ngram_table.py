"""N-gram table: next-token statistics learned across requests.

A fallback for when no long match exists. ``NgramTable`` maps each context
n-gram (``min_n..max_n`` tokens) to weights of the tokens seen next, learned
from every request's prompt and accepted output. The draft is grown
best-first: a node's score is the product of next-token frequencies along
its path, each read from the longest n-gram of (context + path) that the
table holds; nodes under ``min_prob`` are not drafted. Text only: what the
target itself predicts is learned in one place, token recycling's
``SuccessorTable`` (``drafters/recycle.py``), which keeps the target's top-k
per token in a fixed ``vocab x k`` array.

Worked example, ``min_n=1, max_n=2``, learned ``[1, 2, 3, 1, 2, 4, 1, 2, 3]``:
after ``[1, 2]`` the table holds ``{3: 2, 4: 1}``, after ``[2, 3]`` ``{1: 1}``.
For the context ``[..., 1, 2]`` the draft begins ``3 (0.67) -> 1 (0.67)``
beside ``4 (0.33)``.

The table LEARNS ACROSS REQUESTS: with ``shared=True`` (the default) every
request reads and feeds one table, so text of one request can be drafted in
another. ``shared=False`` keeps one table per request, dropped at ``stop()``.
Memory is bounded: at most ``max_entries`` contexts (least recently updated
evicted first, O(1) per insertion) of at most ``max_next`` next tokens each
(the lightest dropped for a new one). Measured (CPython 3.11, text-like
ids): ~470 bytes per context entry, so the default 250k entries hold ~120 MB.

Plain dicts, no Numba: measured on a full 250k-entry table and an 8k-token
context, ``propose`` takes 0.1 ms (16 nodes), 0.33 ms (64), 0.6 ms (256);
``extend`` of 4 tokens 0.04 ms; learning an 8k-token prompt at ``start`` ~60 ms.
"""

from __future__ import annotations

import heapq
import itertools
import struct
from collections import OrderedDict
from typing import Hashable

import numpy as np

from ..draft import Budget, Draft
from .base import Drafter
from .options import check_bool, check_int, check_number

_TOKEN = struct.Struct("=i")  # keys are native int32 bytes, as ndarray.tobytes() of an int32 context


class NgramTable:
    """Bounded map: context n-gram (int32 bytes) -> {next_token: weight}."""

    def __init__(self, min_n: int, max_n: int, max_entries: int, max_next: int):
        self.min_n, self.max_n, self.max_entries, self.max_next = min_n, max_n, max_entries, max_next
        self.entries: OrderedDict[bytes, dict[int, float]] = OrderedDict()  # least recently updated first

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: bytes, token: int, weight: float) -> None:
        counts = self.entries.get(key)
        if counts is None:
            if len(self.entries) >= self.max_entries:
                self.entries.popitem(last=False)
            counts = self.entries[key] = {}
        else:
            self.entries.move_to_end(key)
        if token in counts:
            counts[token] += weight
            return
        if len(counts) >= self.max_next:
            del counts[min(counts, key=counts.__getitem__)]
        counts[token] = weight

    def learn(self, tokens: np.ndarray, begin: int, weight: float = 1.0) -> None:
        """Add ``tokens[j - n : j] -> tokens[j]`` for every ``j >= begin`` and n in range.

        ``learn([1, 2, 3], 0)`` with ``min_n=1, max_n=2`` adds ``[1]->2, [2]->3, [1, 2]->3``.
        """
        raw = np.ascontiguousarray(tokens, np.int32).tobytes()  # [len(tokens)] int32
        token_list = tokens.tolist()
        for j in range(max(begin, self.min_n), len(token_list)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self.add(raw[4 * (j - n) : 4 * j], token_list[j], weight)

    def lookup(self, tail: bytes) -> dict[int, float] | None:
        """Next-token weights after the longest n-gram ending ``tail`` that the table holds."""
        for n in range(min(self.max_n, len(tail) // 4), self.min_n - 1, -1):
            counts = self.entries.get(tail[len(tail) - 4 * n :])
            if counts:
                return counts
        return None


class NgramTableDrafter(Drafter):
    """Best-first tree from n-gram next-token frequencies (see the module docstring).

    min_n / max_n: context lengths of the table's keys.
    max_entries / max_next: the memory bound (contexts, next tokens per context).
    min_prob: draft no node whose path probability is below this.
    shared: one table for all requests (True) or one per request (False).
    """

    name = "ngram"
    isolation_options = {"shared": False}  # no text crosses requests

    def __init__(self, min_n: int = 1, max_n: int = 4, max_entries: int = 250_000, max_next: int = 8,
                 min_prob: float = 0.05, shared: bool = True):
        super().__init__()
        min_n, max_n = check_int("min_n", min_n, 1), check_int("max_n", max_n, 1)
        if max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.max_entries, self.max_next = check_int("max_entries", max_entries, 1), check_int("max_next", max_next, 1)
        self.min_prob = check_number("min_prob", min_prob, 0.0, 1.0, low_open=True)
        self.shared = check_bool("shared", shared)
        self.table = NgramTable(min_n, max_n, max_entries, max_next) if shared else None
        self._request_tables: dict[Hashable, NgramTable] = {}

    def table_for(self, request_id: Hashable) -> NgramTable:
        self._context(request_id)
        return self.table if self.shared else self._request_tables[request_id]

    def _on_start(self, request_id) -> None:
        if not self.shared:
            self._request_tables[request_id] = NgramTable(self.min_n, self.max_n, self.max_entries, self.max_next)
        self.table_for(request_id).learn(self.context(request_id), 0)

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        context = self.context(request_id)
        begin = max(0, context.shape[0] - ids.shape[0] - self.max_n)
        self.table_for(request_id).learn(context[begin:], context.shape[0] - ids.shape[0] - begin)

    def _on_stop(self, request_id) -> None:
        self._request_tables.pop(request_id, None)

    def _propose(self, request_id, budget: Budget) -> Draft:
        table = self.table_for(request_id)
        keep = 4 * self.max_n
        heap: list = []  # (-path_prob, tie, parent node, token, parent tail bytes, depth)
        tie = itertools.count()

        def push_children(tail: bytes, parent: int, prob: float, depth: int) -> None:
            counts = table.lookup(tail)
            if counts:
                total = sum(counts.values())
                for token, weight in counts.items():
                    if prob * weight / total >= self.min_prob:
                        heapq.heappush(heap, (-prob * weight / total, next(tie), parent, token, tail, depth + 1))

        push_children(self.context(request_id)[-self.max_n :].tobytes(), -1, 1.0, 0)
        token_ids, parents, scores = [], [], []
        while heap and len(token_ids) < budget.num_nodes:
            neg_prob, _, parent, token, tail, depth = heapq.heappop(heap)
            token_ids.append(token)
            parents.append(parent)
            scores.append(-neg_prob)
            if depth < budget.max_depth:
                push_children((tail + _TOKEN.pack(token))[-keep:], len(token_ids) - 1, -neg_prob, depth)
        if not token_ids:
            return Draft.empty()
        return Draft(np.asarray(token_ids, np.int64), np.asarray(parents, np.int32),
                     np.asarray(scores, np.float32), (self.name,) * len(token_ids))
