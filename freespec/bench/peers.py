"""Other projects' drafters wrapped as freespec Drafters, to compare drafting under one verifier.

``ArcticSuffixDrafter`` runs Snowflake's SuffixDecoding (arctic-inference
0.3.0, ``arctic_inference.suffix_decoding.SuffixDecodingCache``): a suffix
tree over each request's prompt plus a global suffix tree over earlier
responses. freespec's engine verifies its trees exactly as it verifies its
own drafters' trees, so a benchmark compares the drafting algorithms and
nothing else. Install with ``pip install 'freespec[peers]'`` (arctic-inference
builds from source: see the README of ``freespec/bench``).

arctic's draft is already a parent array in freespec's convention
(``parents[i]`` indexes its own token list, ``-1`` = child of the root):
``token_ids=[3, 4, 9, 5], parents=[-1, -1, 0, 0]`` is ``3 -> {9, 5}`` beside ``4``.
``arctic_to_draft`` still checks it and puts nodes in topological order.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any, Sequence

import numpy as np

from ..draft import Budget, Draft
from ..drafters.base import Drafter
from ..tree import topological_order

INSTALL_HINT = ("arctic-inference is not installed: pip install 'freespec[peers]' (arctic-inference==0.3.0 builds "
                "from source; see freespec/bench/README.md)")


def arctic_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        return False
    return True


def arctic_to_draft(token_ids: Sequence[int], parents: Sequence[int], probs: Sequence[float] | None,
                    source: str) -> Draft:
    """A freespec Draft of an arctic draft, nodes reordered so that ``parents[i] < i``.

    ``arctic_to_draft([9, 3], [1, -1], [0.2, 0.5], "s")`` -> ``token_ids=[3, 9], parents=[-1, 0]``.
    """
    n = len(token_ids)
    if len(parents) != n or (probs is not None and len(probs) != n):
        raise ValueError(f"arctic draft has {n} tokens, {len(parents)} parents, "
                         f"{len(probs) if probs is not None else 0} probs")
    if n == 0:
        return Draft.empty()
    parents_arr = np.asarray(parents, np.int64)
    try:
        order = topological_order(parents_arr)
    except ValueError as exc:
        raise ValueError(f"arctic draft: {exc}") from None
    new_index = np.empty(n, np.int64)
    new_index[order] = np.arange(n)
    new_parents = np.where(parents_arr[order] < 0, -1, new_index[np.maximum(parents_arr[order], 0)])
    scores = None if probs is None else np.asarray(probs, np.float32)[order]
    draft = Draft(np.asarray(token_ids, np.int64)[order], new_parents.astype(np.int32), scores, (source,) * n)
    return draft.validate()


class ArcticSuffixDrafter(Drafter):
    """SuffixDecoding as a freespec Drafter.

    max_tree_depth: depth of arctic's suffix trees; also how many context tokens are matched.
    max_cached_requests: responses kept in the global tree (-1 = all, 0 = no global tree).
    max_spec_factor, max_spec_offset: a draft is at most ``factor * match_len + offset`` tokens.
    min_token_prob: arctic's estimated-probability cut-off for draft nodes.
    use_tree_spec: propose trees (True) or single paths (False).

    Per step arctic is asked for at most ``budget.num_nodes`` tokens; a draft
    deeper than ``budget.max_depth`` is pruned to it.
    """

    name = "arctic-suffix"
    isolation_options = {"max_cached_requests": 0}  # no text crosses requests

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = -1, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1, use_tree_spec: bool = True):
        super().__init__()
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError:
            raise ImportError(INSTALL_HINT) from None
        if max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be >= 1, got {max_tree_depth}")
        self.max_tree_depth = int(max_tree_depth)
        self.max_spec_factor = float(max_spec_factor)
        self.max_spec_offset = float(max_spec_offset)
        self.min_token_prob = float(min_token_prob)
        self.use_tree_spec = bool(use_tree_spec)
        self.cache = SuffixDecodingCache(max_tree_depth=self.max_tree_depth,
                                         max_cached_requests=int(max_cached_requests))
        # arctic keys its global tree by request id: a reused id would evict that response,
        # so every start() gets a fresh integer id
        self._arctic_ids: dict[Any, int] = {}
        self._next_id = itertools.count()

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming any option ``__init__`` does not take (arctic need not be installed)."""
        known = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"unknown arctic-suffix option(s) {', '.join(unknown)}; known: {', '.join(known)} "
                             f"and the SpecConfig fields")

    def _on_start(self, request_id) -> None:
        arctic_id = next(self._next_id)
        self._arctic_ids[request_id] = arctic_id
        self.cache.start_request(arctic_id, np.ascontiguousarray(self.context(request_id), np.int32))

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        if ids.size:
            self.cache.add_active_response(self._arctic_ids[request_id], np.ascontiguousarray(ids, np.int32))

    def _on_stop(self, request_id) -> None:
        self.cache.stop_request(self._arctic_ids.pop(request_id))

    def _propose(self, request_id, budget: Budget) -> Draft:
        context = self.context(request_id)
        tail = np.ascontiguousarray(context[-self.max_tree_depth:], np.int32)
        result = self.cache.speculate(
            self._arctic_ids[request_id], tail,
            max_spec_tokens=int(budget.num_nodes),  # always pass it: None crashes in 0.3.0
            max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob, use_tree_spec=self.use_tree_spec,
        )
        draft = arctic_to_draft(result.token_ids, result.parents, result.probs, self.name)
        if draft.num_nodes > budget.num_nodes or (draft.num_nodes and int(draft.depths().max()) > budget.max_depth):
            draft = draft.prune(budget.num_nodes, budget.max_depth)
        return draft
