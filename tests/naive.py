"""Plain-Python twins of the Numba kernels: slow, short, obviously right.

Each kernel's tests compare it with its twin here on small random inputs.
Keep one section per kernel module, under a heading naming it.
"""

from __future__ import annotations


# =====================================================================================
# freespec.kernels.suffix_automaton / suffix_match / suffix_continuations
# Texts are lists of ints; -1 is a separator (never in a query, never continued).
# =====================================================================================


def _ends_with_at(text, pattern, end) -> bool:
    """``text[end - len(pattern) + 1 : end + 1] == pattern``."""
    start = end - len(pattern) + 1
    return start >= 0 and list(text[start : end + 1]) == list(pattern)


def naive_repeated_suffix_len(text) -> int:
    """Twin of ``SuffixAutomaton.repeated_suffix``: the longest suffix that also ends earlier.

    ``[1, 2, 3, 1, 2] -> 2``; ``[1, 1, 1] -> 2``; ``[1, 2] -> 0``.
    """
    n = len(text)
    for length in range(n - 1, 0, -1):
        if any(_ends_with_at(text, text[n - length :], end) for end in range(n - 1)):
            return length
    return 0


def naive_distinct_substrings(text) -> int:
    """Twin of the whole automaton: its states hold every distinct substring exactly once."""
    return len({tuple(text[i:j]) for i in range(len(text)) for j in range(i + 1, len(text) + 1)})


def naive_match_len(text, context) -> int:
    """Twin of ``_advance_match``: the longest suffix of ``context`` that occurs in ``text``."""
    for length in range(len(context), 0, -1):
        if any(_ends_with_at(text, context[len(context) - length :], end) for end in range(len(text))):
            return length
    return 0


def naive_occurrence_ends(text, pattern) -> list[int]:
    """Twin of ``_collect_ends`` (as a sorted list): ends of ``pattern`` that have a next token."""
    return [end for end in range(len(text) - 1) if _ends_with_at(text, pattern, end) and text[end + 1] >= 0]


def naive_continuation_counts(text, ends, max_depth) -> dict[tuple, int]:
    """``count(path)``: how many of ``ends`` are followed by ``path`` (up to ``max_depth``, no separator)."""
    counts: dict[tuple, int] = {}
    for end in ends:
        path: tuple = ()
        for pos in range(end + 1, min(len(text), end + 1 + max_depth)):
            if text[pos] < 0:
                break
            path = path + (text[pos],)
            counts[path] = counts.get(path, 0) + 1
    return counts


def naive_continuation_tree(text, ends, max_depth, num_nodes, min_prob):
    """Twin of ``_continuation_tree``: ``(token_ids, parents, scores)`` as lists.

    Nodes rank by count (desc), then depth (asc), then first appearance, reading
    the ends in order; the first ``num_nodes`` with ``count / len(ends) >= min_prob`` are kept.
    """
    counts = naive_continuation_counts(text, ends, max_depth)
    first_seen = list(counts)  # dicts keep insertion order: the order paths first appear
    ranked = sorted(range(len(first_seen)), key=lambda i: (-counts[first_seen[i]], len(first_seen[i]), i))
    index: dict[tuple, int] = {(): -1}
    token_ids, parents, scores = [], [], []
    for i in ranked:
        path = first_seen[i]
        score = counts[path] / len(ends)
        if len(token_ids) == num_nodes or score < min_prob:
            break
        index[path] = len(token_ids)
        token_ids.append(path[-1])
        parents.append(index[path[:-1]])
        scores.append(score)
    return token_ids, parents, scores


# =====================================================================================
# freespec.kernels.tree_walk (via freespec.tree)
# =====================================================================================


def naive_depths(parents) -> list[int]:
    """Twin of ``node_depths``: count the steps up to the root."""
    depths = []
    for node in range(len(parents)):
        depth = 0
        while node >= 0:
            depth, node = depth + 1, parents[node]
        depths.append(depth)
    return depths


def naive_ancestors(parents) -> list[list[bool]]:
    """Twin of ``ancestor_matrix``: walk up from each node."""
    n = len(parents)
    out = [[False] * n for _ in range(n)]
    for i in range(n):
        node = i
        while node >= 0:
            out[i][node] = True
            node = parents[node]
    return out


def naive_bfs(parents) -> list[int]:
    """Twin of ``bfs_order`` and ``topological_order``: a queue, children in index order."""
    order, queue = [], [i for i, p in enumerate(parents) if p == -1]
    while queue:
        node = queue.pop(0)
        order.append(node)
        queue += [i for i, p in enumerate(parents) if p == node]
    return order
