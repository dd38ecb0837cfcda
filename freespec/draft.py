"""Draft: a token tree proposed by a drafter, as a parent array.

A draft hangs under the *root*, the last committed token. Node ``i`` carries
``token_ids[i]`` and its parent ``parents[i]`` (``-1`` = child of the root).
Nodes are in topological order (``parents[i] < i``) and siblings carry
distinct tokens, so every root-to-node path is a distinct continuation.

Worked example: continuations ``[5, 6, 7]`` and ``[5, 8]`` of the context
merge into ``token_ids=[5, 6, 8, 7]``, ``parents=[-1, 0, 0, 1]``::

    root ── 5 ─┬─ 6 ── 7
               └─ 8

A chain is ``parents=[-1, 0, 1, ...]``. ``confidence[i]`` is the drafter's
estimate that node ``i`` is accepted (monotone: a child never scores above
its parent); ``sources[i]`` names the drafter that proposed node ``i`` so
the engine can count proposed/accepted tokens per drafter.

Not-candidate nodes (``is_candidate[i] = False``) are fed to the verify
forward and attended like any node (tree mask, position by depth) but are
never accepted, even when their token is the target's; their logits go back
to the drafter through ``observe`` and their KV entries are dropped. A
lookahead (Jacobi) window rides in the forward this way. A candidate never
hangs under a not-candidate node (it could never be reached), and sibling
tokens must be distinct among candidates only::

    root ── 5 ─┬─ 6            candidates: 5, 6
               └─ [9] ── [4]   not candidates: 9, 4 (fed, never accepted)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from .tree import node_depths


_INT64, _INT32, _FLOAT32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)


def _some_not_candidates(is_candidate: np.ndarray | None) -> np.ndarray | None:
    """A draft's ``is_candidate`` as stored: None (the plain form) where every node is a candidate, else the mask."""
    return None if is_candidate is None or is_candidate.all() else is_candidate


def _is_vector(value, dtype: np.dtype) -> bool:
    """Whether ``value`` is already a contiguous 1-D array of ``dtype`` (most drafts are built from such)."""
    return type(value) is np.ndarray and value.dtype is dtype and value.ndim == 1 and value.flags.c_contiguous


@dataclass(frozen=True)
class Budget:
    """How large a draft the engine will verify this step.

    ``num_nodes``: at most this many tree nodes (the root not counted).
    ``max_depth``: no path longer than this (tokens left before max_length,
    minus the bonus token the verifier always adds).
    ``batch_size``: how many rows share the forward (each with its own tree):
    a drafter that sizes trees by cost prices a node at that batch size.
    ``chain``: the host verifies one chain, the draft's ``best_path`` (vLLM, ALiBi models): a drafter that
    sizes by cost sizes that path, not a tree whose other branches the host drops.
    ``packed``: the host feeds the rows end to end (vLLM), so a step costs what its tokens in all cost and a
    row's nodes add only their own; such a host calls ``Drafter.fit_batch(..., packed=True)`` once every row
    has proposed. A drafter that sizes by cost then sizes each row as if it were alone (the most any row can
    be worth) and cuts the rows together in ``fit_batch``.
    """

    num_nodes: int
    max_depth: int
    batch_size: int = 1
    chain: bool = False
    packed: bool = False

    def __post_init__(self):
        if self.num_nodes < 0 or self.max_depth < 0 or self.batch_size < 1:
            raise ValueError(f"Budget needs num_nodes >= 0, max_depth >= 0 and batch_size >= 1, got {self}")


@dataclass(frozen=True)
class Draft:
    token_ids: np.ndarray  # [n] int64
    parents: np.ndarray  # [n] int32, -1 = child of the root
    confidence: np.ndarray | None = None  # [n] float32, or None for "unknown"
    sources: tuple[str, ...] = field(default=())  # [n] drafter name per node, or () for "unnamed"
    is_candidate: np.ndarray | None = None  # [n] bool, False = fed but never accepted; None = all candidates

    def __post_init__(self):
        for name, dtype in (("token_ids", _INT64), ("parents", _INT32), ("confidence", _FLOAT32)):
            value = getattr(self, name)
            if value is not None and not _is_vector(value, dtype):
                object.__setattr__(self, name, np.ascontiguousarray(value, dtype).reshape(-1))
        if type(self.sources) is not tuple:
            object.__setattr__(self, "sources", tuple(self.sources))
        if self.is_candidate is not None:
            is_candidate = np.ascontiguousarray(self.is_candidate, dtype=bool).reshape(-1)
            object.__setattr__(self, "is_candidate", _some_not_candidates(is_candidate))

    # ------------------------------------------------------------------ builders
    @classmethod
    def _of(cls, token_ids: np.ndarray, parents: np.ndarray, confidence: np.ndarray | None = None,
            sources: tuple = (), is_candidate: np.ndarray | None = None) -> "Draft":
        """A draft of fields already in the form ``__post_init__`` gives them (contiguous 1-D int64 / int32 /
        float32 arrays, ``sources`` a tuple, ``is_candidate`` None or a bool array with a False), without its
        checks: for the paths that build one from another draft's arrays or a kernel's outputs every step
        (0.4 us a draft against 1.5)."""
        draft = object.__new__(cls)
        draft.__dict__.update(token_ids=token_ids, parents=parents, confidence=confidence, sources=sources,
                              is_candidate=is_candidate)
        return draft

    @classmethod
    def empty(cls) -> "Draft":
        return cls._of(np.zeros(0, np.int64), np.zeros(0, np.int32))

    @classmethod
    def chain(cls, token_ids: Sequence[int], source: str = "", score: float | None = None) -> "Draft":
        """``chain([4, 9, 2]) -> token_ids=[4, 9, 2], parents=[-1, 0, 1]``."""
        n = len(token_ids)
        confidence = None if score is None else np.full(n, score, np.float32)
        return cls(np.asarray(token_ids, np.int64), np.arange(-1, n - 1, dtype=np.int32), confidence,
                   (source,) * n if source else ())

    @classmethod
    def from_sequences(
        cls,
        sequences: Iterable[Sequence[int]],
        weights: Iterable[float] | None = None,
        num_nodes: int | None = None,
        max_depth: int | None = None,
        source: str = "",
    ) -> "Draft":
        """Merge continuations into a trie, keep the ``num_nodes`` most likely nodes.

        A node's score is the weight of the sequences through it over the total
        weight, an estimate of the chance its path is the true continuation.
        ``from_sequences([[5, 6, 7], [5, 8]], weights=[3, 1])`` gives confidence
        ``5 -> 1.0, 6 -> 0.75, 7 -> 0.75, 8 -> 0.25``; with ``num_nodes=3``
        node ``8`` is dropped.
        """
        sequences = [list(s) for s in sequences]
        weights = [1.0] * len(sequences) if weights is None else [float(w) for w in weights]
        if len(weights) != len(sequences):
            raise ValueError(f"weights has {len(weights)} entries for {len(sequences)} sequences")
        trie = _Trie()
        for seq, weight in zip(sequences, weights):
            trie.insert(seq[:max_depth] if max_depth is not None else seq, weight)
        return trie.to_draft(num_nodes, source)

    # ---------------------------------------------------------------- properties
    @property
    def num_nodes(self) -> int:
        return int(self.token_ids.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    def depths(self) -> np.ndarray:
        """Depth of each node, 1 for children of the root: ``[-1, 0, 0, 1] -> [1, 2, 2, 3]`` (read-only).

        Computed once per draft (a draft is frozen) and kept: the sizer, the calibrator and
        the engine's checks all read it in one step."""
        depths = self.__dict__.get("_depths")
        if depths is None:
            depths = node_depths(self.parents)
            depths.flags.writeable = False
            object.__setattr__(self, "_depths", depths)
        return depths

    def node_source(self, i: int) -> str:
        return self.sources[i] if self.sources else ""

    @property
    def num_candidates(self) -> int:
        return self.num_nodes if self.is_candidate is None else int(self.is_candidate.sum())

    def candidate_mask(self) -> np.ndarray:
        """[n] bool, True for nodes the verifier may accept."""
        return np.ones(self.num_nodes, bool) if self.is_candidate is None else self.is_candidate

    def rescored(self, confidence: np.ndarray, sources: tuple[str, ...]) -> "Draft":
        """The same tree with new ``confidence`` ([n] float32) and ``sources`` (its depths kept, if known)."""
        if _is_vector(confidence, _FLOAT32) and type(sources) is tuple:  # the calibrators' (every step)
            draft = Draft._of(self.token_ids, self.parents, confidence, sources, self.is_candidate)
        else:
            draft = Draft(self.token_ids, self.parents, confidence, sources, self.is_candidate)
        depths = self.__dict__.get("_depths")
        if depths is not None:
            object.__setattr__(draft, "_depths", depths)
        return draft

    def candidates(self) -> "Draft":
        """The tree without its not-candidate nodes (for hosts that verify candidates only)."""
        return self if self.is_candidate is None else self.select(np.nonzero(self.is_candidate)[0])

    def validate(self, budget: Budget | None = None) -> "Draft":
        """Raise ``ValueError`` unless this is a well-formed tree (within ``budget``)."""
        n = self.num_nodes
        if self.parents.shape[0] != n:
            raise ValueError(f"Draft has {n} token_ids but {self.parents.shape[0]} parents")
        if self.confidence is not None and self.confidence.shape[0] != n:
            raise ValueError(f"Draft has {n} nodes but {self.confidence.shape[0]} confidence values")
        if self.sources and len(self.sources) != n:
            raise ValueError(f"Draft has {n} nodes but {len(self.sources)} sources")
        if self.is_candidate is not None and self.is_candidate.shape[0] != n:
            raise ValueError(f"Draft has {n} nodes but {self.is_candidate.shape[0]} is_candidate flags")
        if n == 0:
            return self
        try:
            depths = self.depths()  # its kernel checks the parents as it walks them
        except ValueError:
            raise ValueError(f"Draft parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}") from None
        if self.token_ids.min() < 0:
            raise ValueError("Draft token_ids must be non-negative")
        parents, token_ids = self.parents, self.token_ids
        if self.is_candidate is not None:
            is_candidate = self.is_candidate
            if np.any(is_candidate & (parents >= 0) & ~is_candidate[np.maximum(parents, 0)]):
                raise ValueError("Draft has a candidate node under a not-candidate node (it could never be accepted)")
            parents, token_ids = parents[is_candidate], token_ids[is_candidate]
        children = list(zip(parents.tolist(), token_ids.tolist()))
        if len(set(children)) < len(children):
            seen = set()
            for parent, token in children:
                if (parent, token) in seen:
                    raise ValueError(f"Draft has two candidate children of node {parent} with token {token}")
                seen.add((parent, token))
        if budget is not None:
            if n > budget.num_nodes:
                raise ValueError(f"Draft has {n} nodes, over the budget of {budget.num_nodes}")
            if int(depths.max()) > budget.max_depth:
                raise ValueError(f"Draft is deeper than the budget's max_depth={budget.max_depth}")
        return self

    # -------------------------------------------------------------- transforms
    def prune(self, num_nodes: int, max_depth: int | None = None) -> "Draft":
        """Keep at most ``num_nodes`` nodes no deeper than ``max_depth``.

        With confidence values, the most confident nodes are kept (a node is kept
        only with its parent); without, the first nodes in order.
        """
        n = self.num_nodes
        keep = np.ones(n, bool)
        if max_depth is not None:
            keep &= self.depths() <= max_depth
        if keep.sum() > num_nodes:
            if self.confidence is None:
                idx = np.nonzero(keep)[0][:num_nodes]
                keep[:] = False
                keep[idx] = True
            else:
                order = sorted(np.nonzero(keep)[0].tolist(), key=lambda i: (-float(self.confidence[i]), i))
                chosen = np.zeros(n, bool)
                count = 0
                for i in order:
                    if count == num_nodes:
                        break
                    if self.parents[i] < 0 or chosen[self.parents[i]]:
                        chosen[i] = True
                        count += 1
                keep = chosen
        for i in range(n):  # a node whose parent is dropped is dropped
            if keep[i] and self.parents[i] >= 0 and not keep[self.parents[i]]:
                keep[i] = False
        return self.select(np.nonzero(keep)[0])

    def select(self, nodes: np.ndarray) -> "Draft":
        """Sub-tree of the given nodes (ascending, closed under parents), renumbered."""
        nodes = np.asarray(nodes, np.int64)
        node_list = nodes.tolist()
        if node_list == list(range(self.num_nodes)):
            return self  # every node, in order: this draft (frozen)
        new_index = {old: new for new, old in enumerate(node_list)}
        new_index[-1] = -1
        old_parents = self.parents.tolist()
        parents = [new_index.get(old_parents[i], -2) for i in node_list]  # -2: a parent left out
        well_formed = all(-1 <= parent < k for k, parent in enumerate(parents))  # closed and ascending
        chosen = Draft._of(  # fancy indexing gives contiguous arrays of the same dtypes
            self.token_ids[nodes],
            np.array(parents if well_formed else [max(-1, parent) for parent in parents], np.int32),
            None if self.confidence is None else self.confidence[nodes],
            tuple([self.sources[i] for i in node_list]) if self.sources else (),
            None if self.is_candidate is None else _some_not_candidates(self.is_candidate[nodes]),
        )
        depths = self.__dict__.get("_depths")
        if depths is not None and well_formed:  # a node keeps its ancestors, so its depth
            depths = depths[nodes]
            depths.flags.writeable = False
            object.__setattr__(chosen, "_depths", depths)
        return chosen

    def best_chain(self) -> "Draft":
        """The candidate path that follows the most confident child at each node (the first, without confidence).

        For hosts that can verify chains only (ALiBi, vLLM): ``[-1, 0, 0, 1]`` with
        confidence ``[0.9, 0.3, 0.5, 0.2]`` -> nodes ``[0, 2]``.
        """
        return self.select(np.asarray(self.best_path(), np.int64))

    def best_path(self) -> list[int]:
        """The nodes of ``best_chain``, root first: one pass over the nodes (ties: the first child)."""
        return best_path(self.parents.tolist(), self.confidence.tolist() if self.confidence is not None else None,
                         self.is_candidate.tolist() if self.is_candidate is not None else None)

    def node_paths(self) -> list[tuple[int, ...]]:
        """Token path from the root to every node: ``[-1, 0, 0] with tokens [5, 6, 8] -> [(5,), (5, 6), (5, 8)]``."""
        paths: list[tuple[int, ...]] = []
        for parent, token in zip(self.parents.tolist(), self.token_ids.tolist()):
            paths.append((paths[parent] if parent >= 0 else ()) + (token,))
        return paths

    def paths(self) -> list[list[int]]:
        """Token path of every leaf: ``[-1, 0, 0] with tokens [5, 6, 8] -> [[5, 6], [5, 8]]``."""
        has_child = np.zeros(self.num_nodes, bool)
        has_child[self.parents[self.parents >= 0]] = True
        out = []
        for leaf in np.nonzero(~has_child)[0].tolist():
            path = []
            node = leaf
            while node >= 0:
                path.append(int(self.token_ids[node]))
                node = int(self.parents[node])
            out.append(path[::-1])
        return out


def best_path(parents: list[int], confidence: list[float] | None = None,
              is_candidate: list[bool] | None = None) -> list[int]:
    """``Draft.best_path`` from a draft's arrays as lists (for callers that hold them already)."""
    if is_candidate is None and parents == list(range(-1, len(parents) - 1)):
        return list(range(len(parents)))  # a chain is its own path (most drafts a host verifying chains sees)
    best: dict[int, int] = {}  # parent -> its most confident candidate child
    for node, parent in enumerate(parents):
        if is_candidate is not None and not is_candidate[node]:
            continue
        current = best.get(parent)
        if current is None or (confidence is not None and confidence[node] > confidence[current]):
            best[parent] = node
    path, node = [], best.get(-1)
    while node is not None:
        path.append(node)
        node = best.get(node)
    return path


def merge(drafts: Sequence[Draft], num_nodes: int | None = None) -> Draft:
    """Merge drafts into one deduplicated tree.

    Paths shared by several drafts become one path; a shared node keeps the
    highest confidence and the source of the draft that proposed it first.
    Candidate and not-candidate nodes are never merged into each other.
    ``merge([chain([1, 2]), chain([1, 3])]) -> token_ids=[1, 2, 3], parents=[-1, 0, 0]``.
    """
    merged = merge_indexed(drafts)[0]
    return merged if num_nodes is None else merged.prune(num_nodes)


def merge_indexed(drafts: Sequence[Draft]) -> tuple[Draft, list[list[int]]]:
    """``merge(drafts)`` and, per draft, the merged node of each of its nodes.

    ``merge_indexed([chain([1, 2]), chain([1, 3])])[1] -> [[0, 1], [0, 2]]``.
    """
    token_ids: list[int] = []
    parents: list[int] = []
    confidence: list[float] = []
    sources: list[str] = []
    is_candidate: list[bool] = []
    index: dict[tuple[int, int, bool], int] = {}
    node_maps: list[list[int]] = []
    for draft in drafts:
        local: list[int] = []
        flags = [True] * draft.num_nodes if draft.is_candidate is None else draft.is_candidate.tolist()
        values = [1.0] * draft.num_nodes if draft.confidence is None else draft.confidence.tolist()
        names = draft.sources or ("",) * draft.num_nodes
        for parent, token, flag, value, name in zip(draft.parents.tolist(), draft.token_ids.tolist(), flags, values,
                                                    names):
            key = (-1 if parent < 0 else local[parent], token, flag)
            j = index.get(key)
            if j is not None:
                if value > confidence[j]:
                    confidence[j] = value
            else:
                j = index[key] = len(token_ids)
                token_ids.append(token)
                parents.append(key[0])
                confidence.append(value)
                sources.append(name)
                is_candidate.append(flag)
            local.append(j)
        node_maps.append(local)
    for i, parent in enumerate(parents):  # max() across merged drafts can break monotonicity: restore it
        if parent >= 0 and confidence[parent] < confidence[i]:
            confidence[i] = confidence[parent]
    merged = Draft._of(np.array(token_ids, np.int64), np.array(parents, np.int32), np.array(confidence, np.float32),
                       tuple(sources) if any(sources) else (),
                       _some_not_candidates(np.array(is_candidate, bool)))
    return merged, node_maps


class _Trie:
    """Weighted trie over token sequences; ``to_draft`` keeps the heaviest nodes."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]  # node 0 is the root
        self.token: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.weight: list[float] = [0.0]

    def insert(self, seq: Sequence[int], weight: float) -> None:
        node = 0
        self.weight[0] += weight
        for token in seq:
            token = int(token)
            child = self.children[node].get(token)
            if child is None:
                child = len(self.token)
                self.children[node][token] = child
                self.children.append({})
                self.token.append(token)
                self.parent.append(node)
                self.weight.append(0.0)
            self.weight[child] += weight
            node = child

    def to_draft(self, num_nodes: int | None, source: str) -> Draft:
        total = self.weight[0]
        if total <= 0 or len(self.token) == 1:
            return Draft.empty()
        # best-first: a child never outweighs its parent, so the heaviest nodes form a subtree
        import heapq

        chosen: list[int] = []
        heap = [(-self.weight[c], c) for c in self.children[0].values()]
        heapq.heapify(heap)
        limit = len(self.token) - 1 if num_nodes is None else num_nodes
        while heap and len(chosen) < limit:
            _, node = heapq.heappop(heap)
            chosen.append(node)
            for c in self.children[node].values():
                heapq.heappush(heap, (-self.weight[c], c))
        # chosen is in pop order, which is topological (parents pop before children)
        new_index = {0: -1}
        for i, node in enumerate(chosen):
            new_index[node] = i
        token_ids = np.asarray([self.token[n] for n in chosen], np.int64)
        parents = np.asarray([new_index[self.parent[n]] for n in chosen], np.int32)
        confidence = np.asarray([self.weight[n] / total for n in chosen], np.float32)
        return Draft(token_ids, parents, confidence, (source,) * len(chosen) if source else ())
