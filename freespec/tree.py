"""Tree attention inputs: pure functions of a draft's ``parents``.

One verify forward feeds ``num_pending`` committed-but-uncached tokens (the
prompt at prefill, the last accepted token afterwards) followed by the draft
nodes. Pending tokens attend causally; a draft node attends to everything
cached, every pending token, its ancestors and itself. A node at depth ``d``
sits at position ``cache_len + num_pending + d - 1``: siblings share a
position, exactly as each branch would run alone.

Worked example: ``cache_len=2, num_pending=1, parents=[-1, 0, -1]``
(root ─ a ─ b, root ─ c)::

    keys:        c0 c1 | p | a  b  c        position_ids = [2, 3, 4, 3]
    query p      1  1  | 1 | 0  0  0
    query a      1  1  | 1 | 1  0  0
    query b      1  1  | 1 | 1  1  0
    query c      1  1  | 1 | 0  0  1
"""

from __future__ import annotations

import numpy as np


def node_depths(parents: np.ndarray) -> np.ndarray:
    """Depth per node, 1 for children of the root: ``[-1, 0, 1, -1] -> [1, 2, 3, 1]``."""
    parents = np.asarray(parents)
    depths = np.empty(parents.shape[0], np.int64)  # [n]
    for i, parent in enumerate(parents.tolist()):
        depths[i] = 1 if parent < 0 else depths[parent] + 1
    return depths


def ancestor_matrix(parents: np.ndarray) -> np.ndarray:
    """``out[i, j]`` is True iff node ``j`` is ``i`` or an ancestor of ``i``. [n, n] bool."""
    n = len(parents)
    out = np.zeros((n, n), bool)
    for i, parent in enumerate(np.asarray(parents).tolist()):
        if parent >= 0:
            out[i] = out[parent]
        out[i, i] = True
    return out


def tree_attention(
    parents: np.ndarray,  # [n]
    num_pending: int,
    cache_len: int,
    sliding_window: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(mask [Q, cache_len + Q] bool, position_ids [Q]) for Q = num_pending + n.

    With ``sliding_window`` a query at position q also masks keys at position
    ``<= q - sliding_window``, as the host's sliding-window layers do.
    """
    if num_pending < 1:
        raise ValueError(f"num_pending must be >= 1 (the root's token), got {num_pending}")
    n = len(parents)
    q_len = num_pending + n
    base = cache_len + num_pending
    depths = node_depths(parents)
    position_ids = np.concatenate([np.arange(cache_len, base), base + depths - 1]).astype(np.int64)
    mask = np.zeros((q_len, cache_len + q_len), bool)
    mask[:, :cache_len] = True
    mask[:num_pending, cache_len:base] = np.tril(np.ones((num_pending, num_pending), bool))
    mask[num_pending:, cache_len:base] = True
    mask[num_pending:, base:] = ancestor_matrix(parents)
    if sliding_window is not None:
        key_positions = np.concatenate([np.arange(cache_len), position_ids])
        mask &= key_positions[None, :] > position_ids[:, None] - sliding_window
    return mask, position_ids


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """Nodes from the root's child down to ``node``: ``path_to([-1, 0, 0, 2], 3) -> [0, 2, 3]``."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def children_by_token(parents: np.ndarray, token_ids: np.ndarray) -> list[dict[int, int]]:
    """``out[i + 1]`` maps token -> child node of node ``i``; ``out[0]`` is the root's."""
    out: list[dict[int, int]] = [{} for _ in range(len(parents) + 1)]
    for i, (parent, token) in enumerate(zip(np.asarray(parents).tolist(), np.asarray(token_ids).tolist())):
        out[parent + 1][token] = i
    return out
