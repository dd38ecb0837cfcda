"""A frequency-weighted draft tree from the continuations of a match's occurrences.

Given the end positions of the matched string, read up to ``max_depth`` tokens
after each (stopping at the text's end or a separator) into a trie whose node
counts are how many occurrences continue with that path: ``count(match + path)``.
A node's score is ``count / num_ends``, the estimated chance the path follows.
The draft keeps the ``num_nodes`` highest-scoring nodes with score >=
``min_prob``; a child never outscores its parent, so sorting by (score desc,
depth asc) puts parents first and the kept nodes form a tree, in topological
order -- best-first expansion by path probability, done as one sort.

Worked example, text ``[1, 2, 3, 1, 2, 4, 1, 2, 3]``, ends ``[1, 4]`` of ``[1, 2]``,
``max_depth=2``: continuations ``[3, 1]`` and ``[4, 1]`` give
``token_ids=[3, 4, 1, 1]``, ``parents=[-1, -1, 0, 1]``, ``scores=[.5, .5, .5, .5]``.
"""

from __future__ import annotations

import numba
import numpy as np

from .suffix_match import _collect_ends

# rows of the scratch ``trie`` [6, capacity]; node 0 is the root
TOKEN, PARENT, COUNT, FIRST_CHILD, NEXT_SIBLING, DEPTH = 0, 1, 2, 3, 4, 5


@numba.njit(cache=True)
def _continuation_tree(text, text_len, ends, max_depth, num_nodes, min_prob, trie,
                       out_token_ids, out_parents, out_scores):
    # text [T] int32, ends [num_ends] int64, trie [6, 1 + num_ends * max_depth] int32 scratch,
    # out_token_ids [num_nodes] int64, out_parents [num_nodes] int32, out_scores [num_nodes] float32
    num_ends = ends.shape[0]
    trie[FIRST_CHILD, 0] = -1
    trie_size = 1
    for i in range(num_ends):
        node = 0
        for d in range(max_depth):
            pos = ends[i] + 1 + d
            if pos >= text_len or text[pos] < 0:
                break
            token = text[pos]
            child = trie[FIRST_CHILD, node]
            while child != -1 and trie[TOKEN, child] != token:
                child = trie[NEXT_SIBLING, child]
            if child == -1:
                child = trie_size
                trie_size += 1
                trie[TOKEN, child] = token
                trie[PARENT, child] = node
                trie[COUNT, child] = 0
                trie[FIRST_CHILD, child] = -1
                trie[NEXT_SIBLING, child] = trie[FIRST_CHILD, node]
                trie[DEPTH, child] = d + 1
                trie[FIRST_CHILD, node] = child
            trie[COUNT, child] += 1
            node = child
    # rank: higher count first, then shallower, then older trie node (stable sort)
    keys = np.empty(trie_size - 1, np.int64)
    for node in range(1, trie_size):
        keys[node - 1] = -(np.int64(trie[COUNT, node]) * (max_depth + 1) + (max_depth - trie[DEPTH, node]))
    order = np.argsort(keys, kind="mergesort")
    new_index = trie[NEXT_SIBLING]  # reuse as trie node -> draft node
    new_index[0] = -1
    kept = 0
    for r in range(order.shape[0]):
        node = order[r] + 1
        score = trie[COUNT, node] / num_ends
        if kept == num_nodes or score < min_prob:
            break
        new_index[node] = kept
        out_token_ids[kept] = trie[TOKEN, node]
        out_parents[kept] = new_index[trie[PARENT, node]]
        out_scores[kept] = score
        kept += 1
    return kept


def continuation_tree(text, ends, max_depth: int, num_nodes: int, min_prob: float = 0.0):
    """``(token_ids [n] int64, parents [n] int32, scores [n] float32)`` of the best ``n <= num_nodes`` nodes.

    ``text``: [T] int32 (negative tokens are separators); ``ends``: [num_ends] int64
    end positions of the matched string's occurrences, each ``< T - 1``.
    """
    text = np.ascontiguousarray(text, dtype=np.int32)
    ends = np.ascontiguousarray(ends, dtype=np.int64)
    if max_depth < 0 or num_nodes < 0:
        raise ValueError(f"max_depth and num_nodes must be >= 0, got {max_depth}, {num_nodes}")
    if not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"min_prob must be in [0, 1], got {min_prob}")
    if ends.size and (ends.min() < 0 or ends.max() >= text.shape[0]):
        raise ValueError(f"ends must lie in [0, {text.shape[0]}), got {ends.tolist()}")
    out_token_ids = np.empty(num_nodes, np.int64)
    out_parents = np.empty(num_nodes, np.int32)
    out_scores = np.empty(num_nodes, np.float32)
    if ends.size == 0 or num_nodes == 0 or max_depth == 0:
        return out_token_ids[:0], out_parents[:0], out_scores[:0]
    trie = np.empty((6, 1 + ends.size * max_depth), np.int32)
    kept = _continuation_tree(text, text.shape[0], ends, max_depth, num_nodes, float(min_prob), trie,
                              out_token_ids, out_parents, out_scores)
    return out_token_ids[:kept], out_parents[:kept], out_scores[:kept]


@numba.njit(cache=True)
def _state_continuations(states, text, text_len, state, max_ends, max_depth, num_nodes, min_prob,
                         out_token_ids, out_parents, out_scores):
    ends = np.empty(max_ends, np.int64)
    num_ends = _collect_ends(states, text, text_len, state, max_ends, ends)
    if num_ends == 0:
        return 0
    trie = np.empty((6, 1 + num_ends * max_depth), np.int32)
    return _continuation_tree(text, text_len, ends[:num_ends], max_depth, num_nodes, min_prob, trie,
                              out_token_ids, out_parents, out_scores)


def state_continuations(automaton, state: int, max_ends: int, max_depth: int, num_nodes: int,
                        min_prob: float = 0.0):
    """``continuation_tree(automaton.tokens(), occurrence_ends(automaton, state, max_ends), max_depth, num_nodes,
    min_prob)`` in one kernel call: what a drafter runs every step (the ends never leave the kernel, and the
    automaton's own text needs none of ``continuation_tree``'s checks)."""
    if not 0 < state < automaton.num_states:
        raise ValueError(f"state {state} is not a non-root state of this automaton")
    if max_ends < 1 or max_depth < 0 or num_nodes < 0 or not 0.0 <= min_prob <= 1.0:
        raise ValueError(f"need max_ends >= 1, max_depth >= 0, num_nodes >= 0 and min_prob in [0, 1], got "
                         f"{max_ends}, {max_depth}, {num_nodes}, {min_prob}")
    out_token_ids = np.empty(num_nodes, np.int64)
    out_parents = np.empty(num_nodes, np.int32)
    out_scores = np.empty(num_nodes, np.float32)
    if num_nodes == 0 or max_depth == 0:
        return out_token_ids, out_parents, out_scores
    kept = _state_continuations(automaton.states, automaton.text, automaton.num_tokens, state, max_ends, max_depth,
                                num_nodes, float(min_prob), out_token_ids, out_parents, out_scores)
    return out_token_ids[:kept], out_parents[:kept], out_scores[:kept]
