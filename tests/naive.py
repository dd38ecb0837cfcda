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


# =====================================================================================
# freespec.kernels.lookup_calibration (via freespec.drafters.calibration.calibrate_lookups)
# =====================================================================================


def naive_lookup_kinds(parents, raw, match_len, match_edges, freq_edges) -> tuple[list[int], list[tuple[int, int]]]:
    """Twin of ``lookup_kinds_kernel`` for one tree: each node's depth (steps up to the root) and its
    (match bucket, frequency bucket), by ``bisect``."""
    import bisect

    depths = naive_depths(parents)
    buckets = []
    for i, parent in enumerate(parents):
        frequency = raw[i] if parent < 0 else (raw[i] / raw[parent] if raw[parent] > 0 else 0.0)
        effective = match_len + depths[i] - 1 if match_len > 0 else 0
        buckets.append((bisect.bisect_right(match_edges, effective), bisect.bisect_left(freq_edges, frequency)))
    return depths, buckets


def naive_path_probabilities(parents, node_probabilities) -> list[float]:
    """Twin of ``path_probabilities_kernel`` for one tree: the product of the probabilities from the root down."""
    out = []
    for node in range(len(parents)):
        product, path = 1.0, []
        while node >= 0:
            path.append(node)
            node = parents[node]
        for step in reversed(path):  # root first, as the kernel multiplies
            product = node_probabilities[step] if step == path[-1] else node_probabilities[step] * product
        out.append(product)
    return out


# =====================================================================================
# freespec.kernels.successor_table
# Tables are dicts: "model" token -> list, "model_conf" token -> list of confidence classes, "text" token -> list,
# "pair" slot -> ((prev, token), list, list of confidence classes).
# =====================================================================================

EXACT_ROW, PAIR_ROW, TEXT_ROW, MODEL_ROW = 0, 1, 2, 3


def naive_pair_slot(prev, token, num_slots) -> int:
    """Twin of ``pair_slot``: Python integers, the same low bits."""
    return ((prev * 0x9E3779B1 + token * 0x85EBCA77) & 0x7FFFFFFF) & (num_slots - 1)


def naive_confidence_class(prob) -> int:
    """Twin of ``confidence_classes`` for one probability: how many of the edges it reaches."""
    return sum(prob >= edge for edge in (0.03, 0.08, 0.15, 0.25, 0.4, 0.6, 0.85))


def naive_write_rows(tables, tokens, prevs, topk, order, k, num_slots, probs=None) -> None:
    """Twin of ``write_rows_kernel``: model row and pair row := the first ``k`` of ``topk[i]``, for ``i`` in ``order``,
    with each entry's confidence class (-1 without ``probs``)."""
    for i in order:
        conf = [naive_confidence_class(q) for q in probs[i][:k]] if probs is not None else [-1] * len(topk[i][:k])
        tables["model"][tokens[i]] = list(topk[i][:k])
        tables["model_conf"][tokens[i]] = conf
        if prevs[i] >= 0:
            tables["pair"][naive_pair_slot(prevs[i], tokens[i], num_slots)] = ((prevs[i], tokens[i]),
                                                                                list(topk[i][:k]), conf)


def naive_seed_text(tables, text, begin, kt) -> None:
    """Twin of ``seed_text_kernel``: each bigram moves its follower to the front of the text row."""
    for j in range(max(begin, 1), len(text)):
        token, follower = text[j - 1], text[j]
        row = tables["text"].get(token, [])
        tables["text"][token] = ([follower] + [s for s in row if s != follower])[:kt]


def naive_rows(tables, token, prev, exact_root, num_slots) -> list[tuple[list[int], list[int]]]:
    """The four rows of ``token`` after ``prev`` as (entries, confidence classes), in the order EXACT, PAIR, TEXT,
    MODEL (``[]`` if absent; EXACT and TEXT rows are read by rank: no classes)."""
    model = tables["model"].get(token, [])
    model_conf = tables["model_conf"].get(token, [])
    slot = tables["pair"].get(naive_pair_slot(prev, token, num_slots)) if prev >= 0 else None
    pair, pair_conf = (slot[1], slot[2]) if slot is not None and slot[0] == (prev, token) else ([], [])
    return [(model if exact_root else [], []), (pair, pair_conf), (tables["text"].get(token, []), []),
            ([], []) if exact_root else (model, model_conf)]


def naive_grow_tree(tables, root, root_prev, exact_root, probs, max_nodes, max_depth, min_prob, num_slots,
                    num_ranks=None):
    """Twin of ``grow_tree_kernel``, a heap of (path probability, push order): (token_ids, parents, probs, kinds)."""
    import heapq

    heap, pushed = [], 0
    num_classes = len(probs[0][0])
    num_ranks = num_classes if num_ranks is None else num_ranks

    def push(node, token, prev, exact, prob, depth):
        nonlocal pushed
        rows = naive_rows(tables, token, prev, exact, num_slots)
        firsts = [row[0] for row, _ in rows if row]
        seen = set()
        for row_type, (row, conf) in enumerate(rows):
            for rank, child in enumerate(row[:num_ranks]):
                if child in seen:
                    continue
                seen.add(child)
                agree = int(firsts.count(child) >= 2)
                known = rank < len(conf) and conf[rank] >= 0 and num_ranks + conf[rank] < num_classes
                cls = num_ranks + conf[rank] if known else rank
                conditional = probs[row_type][min(depth + 1, len(probs[0])) - 1][cls][agree]
                heapq.heappush(heap, (-(prob * conditional), pushed, node, child, token, (row_type, depth + 1,
                                                                                          cls, agree)))
                pushed += 1

    push(-1, root, root_prev, exact_root, 1.0, 0)
    token_ids, parents, path_probs, kinds = [], [], [], []
    while heap and len(token_ids) < max_nodes:
        neg_prob, _, parent, token, parent_token, kind = heapq.heappop(heap)
        if -neg_prob < min_prob:
            break
        token_ids.append(token)
        parents.append(parent)
        path_probs.append(-neg_prob)
        kinds.append(kind)
        if kind[1] < max_depth:
            push(len(token_ids) - 1, token, parent_token, False, -neg_prob, kind[1])
    return token_ids, parents, path_probs, kinds


# =====================================================================================
# freespec.kernels.ngram_pool
# A pool is an OrderedDict: key -> list of grams (tuples), most recent first; keys in write order.
# =====================================================================================


def naive_pool_insert(pool, max_keys, guesses, key, gram) -> None:
    """Twin of ``pool_insert_kernel``: LRU over keys (by last write), LRU and dedup within a key."""
    if key not in pool and len(pool) == max_keys:
        pool.popitem(last=False)
    grams = [g for g in pool.pop(key, []) if g != tuple(gram)]
    pool[key] = [tuple(gram)] + grams[: guesses - 1]


# =====================================================================================
# freespec.engine.top_k (the recycling table's top-k of every fed node, and their probabilities)
# =====================================================================================


def naive_top_k_ids(rows, k) -> list[list[int]]:
    """Each row's ``k`` largest entries' columns, largest first: ``[[1, 9, 5]], 2 -> [[1, 2]]``."""
    return [sorted(range(len(row)), key=lambda c: -row[c])[:k] for row in rows]


def naive_top_k_probs(rows, k, chunk) -> list[list[float]]:
    """Twin of ``top_k``'s probabilities: a softmax over the columns of the ``k`` chunks with the largest maxima
    and the columns past the last whole chunk (the whole row when it has at most ``k`` chunks), read at the
    row's ``k`` largest entries."""
    import math

    out = []
    for row in rows:
        num_chunks = len(row) // chunk
        columns = list(range(len(row)))
        if num_chunks > k:
            best = sorted(range(num_chunks), key=lambda j: -max(row[j * chunk:(j + 1) * chunk]))[:k]
            columns = [j * chunk + c for j in best for c in range(chunk)] + list(range(num_chunks * chunk, len(row)))
        top = max(row[c] for c in columns)
        total = sum(math.exp(row[c] - top) for c in columns)
        out.append([math.exp(row[c] - top) / total for c in naive_top_k_ids([row], k)[0]])
    return out
