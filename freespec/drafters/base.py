"""The drafter contract.

A drafter is a plain data structure over token ids: it never imports torch
and never sees the model. The engine drives it through one request's life::

    drafter.start(request_id, prompt_ids)      # index the prompt
    while not done:
        draft = drafter.propose(request_id, budget)   # a Draft within budget
        ...verify...
        drafter.observe(request_id, verify_output)    # only if observe_top_k > 0
        drafter.extend(request_id, accepted_ids)      # tokens committed this step
    drafter.stop(request_id)                   # may feed a shared corpus

``Drafter`` below gives the bookkeeping every lookup drafter needs: the
context of each live request as a growing int32 array, and lifecycle checks
(``propose`` before ``start`` raises ``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import numpy as np

from ..draft import Budget, Draft


@dataclass(frozen=True)
class VerifyOutput:
    """What a drafter may learn from one verify forward (``observe``).

    ``draft``: the tree that was verified.
    ``accepted_nodes``: indices into the draft along the accepted path.
    ``topk_token_ids``: [num_nodes + 1, k] int64, the target's top-k tokens at
    the root (row 0) and at each node (row i + 1), from the processed scores.
    """

    draft: Draft
    accepted_nodes: np.ndarray
    topk_token_ids: np.ndarray


def as_token_array(ids, name: str) -> np.ndarray:
    """Check a 1-D sequence of non-negative token ids, return it as int32."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{name} holds token ids outside [0, 2**31)")
    return np.ascontiguousarray(arr, dtype=np.int32)


def exercise(drafter: "Drafter") -> None:
    """Run two tiny requests through ``drafter`` (compiles its kernels; see ``warmup``)."""
    drafter.start("warmup", [1, 2, 3, 1, 2])
    drafter.propose("warmup", Budget(4, 4))
    drafter.extend("warmup", [3])
    drafter.stop("warmup")
    drafter.start("warmup", [1, 2])
    drafter.propose("warmup", Budget(4, 4))
    drafter.stop("warmup")


class _Context:
    """A request's tokens so far, amortized O(1) append."""

    __slots__ = ("buf", "size")

    def __init__(self, ids: np.ndarray):
        self.buf = np.empty(max(64, 2 * len(ids)), np.int32)
        self.buf[: len(ids)] = ids
        self.size = len(ids)

    def append(self, ids: np.ndarray) -> None:
        need = self.size + len(ids)
        if need > len(self.buf):
            new = np.empty(max(need, 2 * len(self.buf)), np.int32)
            new[: self.size] = self.buf[: self.size]
            self.buf = new
        self.buf[self.size : need] = ids
        self.size = need

    def view(self) -> np.ndarray:
        return self.buf[: self.size]


class Drafter:
    """Base class: request bookkeeping; subclasses implement ``_propose``.

    ``name`` labels this drafter's nodes in stats. ``observe_top_k`` > 0 asks the
    engine for the target's top-k tokens at every verified node.
    """

    name = "drafter"
    observe_top_k = 0

    def __init__(self):
        self._contexts: dict[Hashable, _Context] = {}

    # ---- lifecycle
    def start(self, request_id: Hashable, prompt_ids) -> None:
        if request_id in self._contexts:
            raise ValueError(f"request {request_id!r} was already started (call stop() first)")
        self._contexts[request_id] = _Context(as_token_array(prompt_ids, "prompt_ids"))
        self._on_start(request_id)

    def extend(self, request_id: Hashable, accepted_ids) -> None:
        ids = as_token_array(accepted_ids, "accepted_ids")
        self._context(request_id).append(ids)
        self._on_extend(request_id, ids)

    def propose(self, request_id: Hashable, budget: Budget) -> Draft:
        self._context(request_id)
        if budget.num_nodes == 0 or budget.max_depth == 0:
            return Draft.empty()
        return self._propose(request_id, budget)

    def observe(self, request_id: Hashable, verify_output: VerifyOutput) -> None:
        """Optional: learn from the target's predictions. Default: nothing."""

    def stop(self, request_id: Hashable) -> None:
        self._context(request_id)
        self._on_stop(request_id)
        del self._contexts[request_id]

    def on_forward(self, num_tokens_fed: int, forward_s: float) -> None:
        """Optional: the engine reports each target forward's size and time.

        Drafters that size their trees from a live cost model (``mixture``)
        calibrate c(k) from these; the default ignores them.
        """

    def warmup(self) -> None:
        """Compile kernels ahead of the first request (no-op when there are none)."""

    # ---- helpers for subclasses
    def context(self, request_id: Hashable) -> np.ndarray:
        """The request's tokens so far (prompt + accepted), int32, read-only view."""
        return self._context(request_id).view()

    def _context(self, request_id: Hashable) -> _Context:
        try:
            return self._contexts[request_id]
        except KeyError:
            raise ValueError(f"request {request_id!r} is not active: call start() first") from None

    def _on_start(self, request_id) -> None:
        pass

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        pass

    def _on_stop(self, request_id) -> None:
        pass

    def _propose(self, request_id, budget: Budget) -> Draft:
        raise NotImplementedError
