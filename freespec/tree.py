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

from .kernels.tree_walk import ancestor_matrix_kernel, bfs_order_kernel, node_depths_kernel


def check_parents(parents) -> np.ndarray:
    """``parents`` as a contiguous int32 array; ``ValueError`` unless ``-1 <= parents[i] < i``."""
    parents = np.ascontiguousarray(parents, dtype=np.int32).reshape(-1)
    if parents.size and (np.any(parents < -1) or np.any(parents >= np.arange(parents.shape[0]))):
        raise ValueError(f"parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")
    return parents


def node_depths(parents) -> np.ndarray:
    """Depth per node, 1 for children of the root: ``[-1, 0, 1, -1] -> [1, 2, 3, 1]``. [n] int64."""
    parents = np.ascontiguousarray(parents, dtype=np.int32).reshape(-1)
    return _walk(node_depths_kernel, parents, np.empty(parents.shape[0], np.int64))


def ancestor_matrix(parents) -> np.ndarray:
    """``out[i, j]`` is True iff node ``j`` is ``i`` or an ancestor of ``i``. [n, n] bool."""
    parents = np.ascontiguousarray(parents, dtype=np.int32).reshape(-1)
    return _walk(ancestor_matrix_kernel, parents, np.zeros((parents.shape[0], parents.shape[0]), bool))


def warm_kernels() -> None:
    """Compile the tree kernels every decode step runs (or load them from numba's cache) on a two-node tree, so
    the first ``generate()`` after ``patch()`` does not (loading them took tens of milliseconds)."""
    parents = np.array([-1, 0], np.int32)
    node_depths(parents)
    ancestor_matrix(parents)
    bfs_order(parents)


def _walk(kernel, parents: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out`` as ``kernel(parents, out)`` fills it; the kernel checks the parents as it walks them (-1: in order),
    which costs less than ``check_parents``'s two numpy reductions before it."""
    if kernel(parents, out) >= 0:
        raise ValueError(f"parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")
    return out


def bfs_order(parents) -> np.ndarray:
    """Breadth-first node order: ``bfs_order([-1, -1, 1, 0]) -> [0, 1, 3, 2]``. [n] int64."""
    parents = check_parents(parents)
    out = np.empty(parents.shape[0], np.int64)
    bfs_order_kernel(parents, out)
    return out


def topological_order(parents) -> np.ndarray:
    """Breadth-first order of a parent array in ANY node order (``-1`` = root child).

    For trees whose parents may come after their children (another project's
    drafts): ``topological_order([1, -1]) -> [1, 0]``. ``ValueError`` unless
    the array is one tree. [n] int64.
    """
    parents = np.asarray(parents, np.int64).reshape(-1)
    n = parents.shape[0]
    if n and (np.any(parents < -1) or np.any(parents >= n) or np.any(parents == np.arange(n))):
        raise ValueError(f"parents out of range: {parents.tolist()}")
    if np.all(parents < np.arange(n)):
        return np.arange(n)
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(i)
    order, head = list(children.get(-1, [])), 0
    while head < len(order):
        order.extend(children.get(order[head], []))
        head += 1
    if len(order) != n:
        raise ValueError(f"parents do not form a tree: {parents.tolist()}")
    return np.asarray(order, np.int64)


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


def path_to(parents, node: int) -> list[int]:
    """Nodes from the root's child down to ``node``: ``path_to([-1, 0, 0, 2], 3) -> [0, 2, 3]``."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def children_by_token(parents, token_ids, is_candidate=None) -> list[dict[int, int]]:
    """``out[i + 1]`` maps token -> child node of node ``i``; ``out[0]`` is the root's.

    ``children_by_token([-1, 0, 0], [5, 6, 8]) -> [{5: 0}, {6: 1, 8: 2}, {}, {}]``.
    With ``is_candidate`` ([n] bool), not-candidate nodes are left out.
    """
    out: list[dict[int, int]] = [{} for _ in range(len(parents) + 1)]
    nodes = range(len(parents)) if is_candidate is None else np.nonzero(is_candidate)[0].tolist()
    parents, token_ids = np.asarray(parents).tolist(), np.asarray(token_ids).tolist()
    for i in nodes:
        out[parents[i] + 1][token_ids[i]] = i
    return out


def follow(parents, token_ids, tokens, is_candidate=None) -> list[int]:
    """Nodes of the longest root path of candidates that spells a prefix of ``tokens``.

    ``follow([-1, 0, 0, 1], [5, 6, 8, 7], [5, 8, 9]) -> [0, 2]``: the path a
    greedy verifier accepts when ``tokens`` is what the target would decode.
    """
    children = children_by_token(parents, token_ids, is_candidate)
    path: list[int] = []
    for token in np.asarray(tokens).tolist():
        child = children[path[-1] + 1 if path else 0].get(token)
        if child is None:
            break
        path.append(child)
    return path
