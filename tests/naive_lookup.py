"""Plain-Python twins of the n-gram table and corpus lookups, by exhaustive search.

Slow and obviously right: the hypothesis tests compare the drafters against them.
"""

from __future__ import annotations


def ngram_next_counts(sequences, tail, min_n: int, max_n: int) -> dict[int, float] | None:
    """Counts of the token after the longest n-gram (min_n..max_n) ending ``tail`` seen in ``sequences``.

    ``ngram_next_counts([[1, 2, 3, 1, 2, 4]], [9, 1, 2], 1, 2) -> {3: 1, 4: 1}``.
    """
    tail = list(tail)
    for n in range(min(max_n, len(tail)), min_n - 1, -1):
        key = tail[len(tail) - n :]
        counts: dict[int, float] = {}
        for seq in sequences:
            seq = list(seq)
            for j in range(n, len(seq)):
                if seq[j - n : j] == key:
                    counts[seq[j]] = counts.get(seq[j], 0.0) + 1.0
        if counts:
            return counts
    return None


def ngram_tree(sequences, context, min_n: int, max_n: int, min_prob: float, max_depth: int) -> dict:
    """{path: probability} of every path of probability >= min_prob up to max_depth tokens.

    A path's probability is the product of next-token frequencies, each after
    the longest n-gram of (context + path so far) seen in ``sequences``.
    """
    out: dict[tuple, float] = {}

    def grow(path: tuple, prob: float) -> None:
        if len(path) == max_depth:
            return
        counts = ngram_next_counts(sequences, list(context) + list(path), min_n, max_n)
        if not counts:
            return
        total = sum(counts.values())
        for token, weight in counts.items():
            child_prob = prob * weight / total
            if child_prob >= min_prob:
                out[path + (token,)] = child_prob
                grow(path + (token,), child_prob)

    grow((), 1.0)
    return out


def corpus_longest_match(docs, tail, min_match: int, max_match: int) -> tuple[int, list[tuple[int, int]]]:
    """(match_len, [(doc index, start)]): the longest suffix of ``tail`` (<= max_match) in ``docs``.

    ``corpus_longest_match([[1, 2, 3], [2, 3]], [7, 2, 3], 2, 8) -> (2, [(0, 1), (1, 0)])``.
    """
    tail = list(tail)
    for match_len in range(min(max_match, len(tail)), min_match - 1, -1):
        key = tail[len(tail) - match_len :]
        hits = [(d, s) for d, doc in enumerate(docs) for s in range(len(doc) - match_len + 1)
                if list(doc[s : s + match_len]) == key]
        if hits:
            return match_len, hits
    return 0, []


def paths_to_nodes(draft) -> list[list[int]]:
    """The token path from the root to every node (not only leaves)."""
    paths: list[list[int]] = []
    for parent, token in zip(draft.parents.tolist(), draft.token_ids.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths
