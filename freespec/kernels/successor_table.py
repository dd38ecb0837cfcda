"""Token recycling's tables, and the draft tree grown from them.

Three kinds of *rows* say what may follow a token ``t`` (``-1`` = empty slot, rank 0 first):

- ``model`` [capacity, k] int32: the target's top-k after ``t`` at the last verified node that fed ``t``,
  and ``model_conf`` [capacity, k] int8, each entry's *confidence class* (``confidence_classes``: the
  target's probability of that token when the row was written, in ``NUM_CONF`` buckets; -1 = unknown);
- ``pair_keys`` [P] int64 / ``pair`` [P, k] int32 / ``pair_conf`` [P, k] int8: the same, keyed by
  (previous token, ``t``) in a direct-mapped hash of ``P`` slots (a newer pair overwrites an older one
  in its slot), so the prediction made after the same two tokens wins over one made after ``t`` in any
  context;
- ``text`` [capacity, kt] int32: the tokens that followed ``t`` in the request's own text, most
  recent first.

Measured on SmolLM2-135M (13 Spec-Bench questions, 128 greedy tokens each, a table kept across
them, predictions read in the true context): the rank-0 entry of a model row is the next token
28% of the time (rows exist at 68% of positions), of a pair row 50% (35%), of a text row 34% (71%).

A node's children are the union of its rows, in the order EXACT (the root only: a model row that
the caller knows was written at the root's very position, so it is the target's top-k in the true
context), PAIR, TEXT, MODEL; a child takes its *kind* (row type, depth, class, agree) from the first
row that holds it, where ``agree`` = 1 when it is the rank-0 entry of two rows or more, and *class*
is ``num_ranks + confidence class`` for a PAIR or MODEL entry whose confidence is known (and
within ``probs``), else its rank. The confidence separates what rank alone mixes: measured on
qwen2.5-coder-0.5b (bfloat16, 21 Spec-Bench outputs, model rows written in the true context and
read at a later occurrence of the token), a rank-0 entry is the next token 8-16% of the time when
it was written with probability below 0.4 and 42% when above 0.85, a rank-1 entry 5% below 0.03
and 21% at 0.4-0.6. The tree is
grown best-first: a child's path probability is its parent's times ``probs[kind]``; the most
probable frontier node is taken next (ties: the one pushed first) until ``max_nodes`` are taken or
none reaches ``min_prob``.

Worked example, k = 2, kt = 1: model rows ``5 -> [6, 9]``, ``6 -> [5, 8]``, text row ``5 -> [9]``,
no pairs. From root 5, the children of 5 are ``9`` (TEXT rank 0, agree 0) and ``6`` (MODEL rank 0);
``9`` is also in the model row but the text row holds it first. With ``probs[TEXT, 0, 0, 0] = .4``
(depth 1), ``probs[MODEL, 0, 0, 0] = .5`` and ``probs[MODEL, 1, 0, 0] = .5`` (depth 2), the nodes
come as ``6 (.5)``, ``9 (.4)``, ``6 -> 5 (.25)``, ...

Measured (CPython 3.11, k=8, a 64-node tree): grow ~15 us, a 65-row write ~3 us.
"""

from __future__ import annotations

import numba
import numpy as np

EXACT, PAIR, TEXT, MODEL = 0, 1, 2, 3  # row types, in the order a node's children are read from them
NUM_ROW_TYPES = 4
CONF_EDGES = (0.03, 0.08, 0.15, 0.25, 0.4, 0.6, 0.85)  # a probability's confidence class: how many edges it reaches
NUM_CONF = len(CONF_EDGES) + 1


def confidence_classes(probs: np.ndarray) -> np.ndarray:
    """The confidence class (0 .. ``NUM_CONF - 1``) of each probability, int8: ``[0.01, 0.5, 0.9] -> [0, 5, 7]``."""
    return np.searchsorted(np.asarray(CONF_EDGES), np.asarray(probs, np.float64), side="right").astype(np.int8)


@numba.njit(cache=True)
def pair_slot(prev, token, num_slots):
    """The hash slot of the pair (prev, token): ``num_slots`` is a power of two."""
    h = (np.int64(prev) * np.int64(0x9E3779B1) + np.int64(token) * np.int64(0x85EBCA77)) & np.int64(0x7FFFFFFF)
    return h & (num_slots - 1)


@numba.njit(cache=True)
def pair_key(prev, token):
    return (np.int64(prev) << np.int64(32)) | np.int64(token)


@numba.njit(cache=True)
def write_rows_kernel(model, model_conf, pair_keys, pair, pair_conf, tokens, prevs, topk, conf, order):
    # model, model_conf [capacity, k] int32 / int8 (a token >= capacity has no model row), pair_keys [P] int64,
    # pair, pair_conf [P, k] int32 / int8, tokens [m] int64,
    # prevs [m] int64 (the token before each, -1 = none), topk [m, kk] int64, conf [m, kk] int8 (-1 = unknown),
    # order [w] int64: rows of tokens/topk to write, in this order (a later write wins)
    k = model.shape[1]
    width = min(k, topk.shape[1])
    for idx in range(order.shape[0]):
        i = order[idx]
        token = tokens[i]
        if token < model.shape[0]:  # a token past the table's rows keeps its pair row only
            for r in range(k):
                model[token, r] = topk[i, r] if r < width else -1
                model_conf[token, r] = conf[i, r] if r < width else -1
        if prevs[i] >= 0:
            slot = pair_slot(prevs[i], token, pair_keys.shape[0])
            pair_keys[slot] = pair_key(prevs[i], token)
            for r in range(k):
                pair[slot, r] = topk[i, r] if r < width else -1
                pair_conf[slot, r] = conf[i, r] if r < width else -1


@numba.njit(cache=True)
def seed_text_kernel(text_rows, text, begin):
    # text_rows [capacity, kt] int32, text [T] int32 (a token >= capacity has no text row):
    # every bigram text[j - 1] -> text[j] with j >= begin moves its follower to the front of its row
    kt = text_rows.shape[1]
    for j in range(max(begin, 1), text.shape[0]):
        token, follower = text[j - 1], text[j]
        if token >= text_rows.shape[0]:  # past the table's rows: no text row
            continue
        pos = kt - 1  # where the follower was (or the last slot, dropped)
        for r in range(kt):
            if text_rows[token, r] == follower:
                pos = r
                break
        for r in range(pos, 0, -1):
            text_rows[token, r] = text_rows[token, r - 1]
        text_rows[token, 0] = follower


@numba.njit(cache=True)
def _row(row_type, token, prev, model, model_conf, pair_keys, pair, pair_conf, text_rows, exact_root):
    """(the row of ``row_type`` for ``token`` after ``prev``, its confidence classes): empty arrays if none; the
    classes are empty for EXACT and TEXT rows (an exact row is read by rank, the target's own ranking in the true
    context; a text row has no probabilities)."""
    none = model_conf[0, :0]
    if row_type == EXACT:
        if exact_root and token < model.shape[0]:
            return model[token], none
    elif row_type == PAIR:
        if prev >= 0:
            slot = pair_slot(prev, token, pair_keys.shape[0])
            if pair_keys[slot] == pair_key(prev, token):
                return pair[slot], pair_conf[slot]
    elif row_type == TEXT:
        if token < text_rows.shape[0]:
            return text_rows[token], none
    elif not exact_root and token < model.shape[0]:
        return model[token], model_conf[token]
    return model[0, :0], none


@numba.njit(cache=True)
def _push_children(model, model_conf, pair_keys, pair, pair_conf, text_rows, probs, num_ranks, node, token, prev,
                   exact_root, prob, depth, frontier, frontier_prob, size, seq, child_buf):
    # frontier [capacity, 6] int64: (parent node, token, row type, class, agree, push order); child_buf [m] int64
    num_children = 0
    d = min(depth + 1, probs.shape[1]) - 1
    firsts = np.full(NUM_ROW_TYPES, -1, np.int64)  # each row's rank-0 entry
    for row_type in range(NUM_ROW_TYPES):
        row, _ = _row(row_type, token, prev, model, model_conf, pair_keys, pair, pair_conf, text_rows, exact_root)
        if row.shape[0] > 0:
            firsts[row_type] = row[0]
    for row_type in range(NUM_ROW_TYPES):
        row, conf = _row(row_type, token, prev, model, model_conf, pair_keys, pair, pair_conf, text_rows, exact_root)
        for r in range(min(row.shape[0], num_ranks)):
            child = row[r]
            if child < 0:
                continue
            seen = False
            for c in range(num_children):
                if child_buf[c] == child:
                    seen = True
                    break
            if seen:
                continue
            agree = 1 if np.sum(firsts == child) >= 2 else 0
            cls = r
            if r < conf.shape[0] and conf[r] >= 0 and num_ranks + conf[r] < probs.shape[2]:
                cls = num_ranks + conf[r]
            child_buf[num_children] = child
            num_children += 1
            frontier[size, 0] = node
            frontier[size, 1] = child
            frontier[size, 2] = row_type
            frontier[size, 3] = cls
            frontier[size, 4] = agree
            frontier[size, 5] = seq
            frontier_prob[size] = prob * probs[row_type, d, cls, agree]
            size += 1
            seq += 1
    return size, seq


@numba.njit(cache=True)
def grow_tree_kernel(model, model_conf, pair_keys, pair, pair_conf, text_rows, root, root_prev, exact_root, probs,
                     num_ranks, max_nodes, max_depth, min_prob, out_token_ids, out_parents, out_probs, out_kinds):
    # model, model_conf [capacity, k] int32 / int8, pair_keys [P] int64, pair, pair_conf [P, k] int32 / int8,
    # text_rows [capacity, kt] int32, root_prev: the token before the root (-1 = none), exact_root: the root's
    # model row is EXACT, probs [4, D, C, 2] float64 per (row type, depth, class, agree): classes 0 .. num_ranks - 1
    # are ranks, num_ranks + c confidence class c; at most num_ranks entries of a row are read;
    # out_token_ids [max_nodes] int64, out_parents [max_nodes] int32, out_probs [max_nodes] float64,
    # out_kinds [max_nodes, 4] int64: (row type, depth, class, agree); returns the number of nodes
    per_node = 2 * model.shape[1] + text_rows.shape[1]
    capacity = per_node * (max_nodes + 1)
    frontier = np.empty((capacity, 6), np.int64)
    frontier_prob = np.empty(capacity, np.float64)
    child_buf = np.empty(per_node, np.int64)
    node_token = np.empty(max_nodes, np.int64)
    node_depth = np.empty(max_nodes, np.int64)
    size, seq = _push_children(model, model_conf, pair_keys, pair, pair_conf, text_rows, probs, num_ranks, -1, root,
                               root_prev, exact_root, 1.0, 0, frontier, frontier_prob, 0, 0, child_buf)
    count = 0
    while count < max_nodes and size > 0:
        best = 0
        for f in range(1, size):
            if frontier_prob[f] > frontier_prob[best] or (
                    frontier_prob[f] == frontier_prob[best] and frontier[f, 5] < frontier[best, 5]):
                best = f
        if frontier_prob[best] < min_prob:
            break
        parent, token, prob = frontier[best, 0], frontier[best, 1], frontier_prob[best]
        depth = 1 if parent < 0 else node_depth[parent] + 1
        out_token_ids[count] = token
        out_parents[count] = parent
        out_probs[count] = prob
        out_kinds[count, 0] = frontier[best, 2]
        out_kinds[count, 1] = depth
        out_kinds[count, 2] = frontier[best, 3]
        out_kinds[count, 3] = frontier[best, 4]
        size -= 1
        frontier[best] = frontier[size]
        frontier_prob[best] = frontier_prob[size]
        node_token[count] = token
        node_depth[count] = depth
        if depth < max_depth:
            prev = root if parent < 0 else node_token[parent]
            size, seq = _push_children(model, model_conf, pair_keys, pair, pair_conf, text_rows, probs, num_ranks,
                                       count, token, prev, False, prob, depth, frontier, frontier_prob, size, seq,
                                       child_buf)
        count += 1
    return count
