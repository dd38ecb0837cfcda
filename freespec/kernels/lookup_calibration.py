"""Calibration of a step's lookup trees, as two passes over their parent arrays laid end to end.

A lookup source's tree (``parents`` int32, topological; ``raw`` float32, each path's share of the match's
occurrences) is scored by ``drafters.calibration.calibrate_lookups``, which validates, allocates and lays every
tree of a step end to end (tree ``t`` holds nodes ``trees[t, FIRST]:trees[t, END]``, each parent an index inside
its tree, as vLLM's kernels lay a batch):

1. ``lookup_kinds_kernel``: each node's depth and the code of its kind, ``trees[t, CODE_BASE] + match bucket *
   (F + 1) + frequency bucket``: the match bucket of ``trees[t, MATCH_LEN] + depth - 1`` (0 without a match) among
   ``match_edges`` (the count of edges at or below it, ``bisect_right``), the frequency bucket of its raw
   frequency over its parent's (``raw[i]`` under the root; 0 under a parent of frequency 0) among the ``F``
   ``freq_edges`` (the count of edges below it, ``bisect_left``); the code bases tell the trees' sources apart;
2. the caller reads one probability per code that occurs from the calibrator's counts (a step has few);
3. ``path_probabilities_kernel``: each node's path probability, its code's probability times its parent's
   path probability, in float64 as the Python walk it replaced multiplied them, stored as float32.

Worked example, one tree, ``trees=[[0, 3, 2, 0]]`` (nodes 0 to 3, a match of 2, code base 0), ``parents=[-1, 0, 0]``, ``raw=[1.0, 0.75,
0.25]``, ``match_edges=(1, 2, 3, 4, ...)``, ``freq_edges=(0.2, 0.4, 0.6, 0.8, 0.999)``: depths ``[1, 2, 2]``,
effective match lengths ``[2, 3, 3]``, match buckets ``[2, 3, 3]``, frequency buckets ``[5, 3, 1]``, codes
``[17, 21, 19]``; with probabilities ``{17: 0.9, 21: 0.8, 19: 0.3}`` the path probabilities are ``[0.9, 0.72,
0.27]``.
"""

from __future__ import annotations

import numba
import numpy as np

FIRST, END, MATCH_LEN, CODE_BASE = 0, 1, 2, 3  # columns of ``trees`` [T, 4] int64


@numba.njit(cache=True)
def lookup_kinds_kernel(parents, trees, raw, match_edges, freq_edges, depths, codes):
    """-1, or the first node (flat index) whose parent breaks ``-1 <= parents[i] < i`` within its tree.

    parents [N] int32, trees [T, 4] int64 (each tree's first node, end, match length, code base), raw [N] float32,
    match_edges [M] int64 ascending, freq_edges [F] float64 ascending; out: depths [N] int64, codes [N] int64."""
    num_freq = freq_edges.shape[0] + 1
    for tree in range(trees.shape[0]):
        first = trees[tree, FIRST]
        match_len = trees[tree, MATCH_LEN]
        for i in range(first, trees[tree, END]):
            parent = parents[i]
            if parent < -1 or parent >= i - first:
                return i
            if parent < 0:
                depth = 1
                frequency = np.float64(raw[i])
            else:
                depth = depths[first + parent] + 1
                above = np.float64(raw[first + parent])
                frequency = np.float64(raw[i]) / above if above > 0 else 0.0
            depths[i] = depth
            effective = match_len - 1 + depth if match_len > 0 else 0
            match_bucket = 0
            while match_bucket < match_edges.shape[0] and match_edges[match_bucket] <= effective:
                match_bucket += 1
            freq_bucket = 0
            while freq_bucket < freq_edges.shape[0] and freq_edges[freq_bucket] < frequency:
                freq_bucket += 1
            codes[i] = trees[tree, CODE_BASE] + match_bucket * num_freq + freq_bucket
    return -1


@numba.njit(cache=True)
def path_probabilities_kernel(parents, trees, codes, code_probabilities, out):
    """parents [N] int32 and trees [T, 4] int64 (checked by ``lookup_kinds_kernel``), codes [N] int64,
    code_probabilities [C] float64 (read at the codes that occur), out [N] float32."""
    paths = np.empty(parents.shape[0], np.float64)
    for tree in range(trees.shape[0]):
        first = trees[tree, FIRST]
        for i in range(first, trees[tree, END]):
            probability = code_probabilities[codes[i]]
            parent = parents[i]
            paths[i] = probability if parent < 0 else probability * paths[first + parent]
            out[i] = paths[i]
