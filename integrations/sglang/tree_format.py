"""Drafts as SGLang's NGRAM tree rows: one kernel call per batch.

Per request, SGLang verifies exactly ``D = --speculative-num-draft-tokens``
nodes: node 0 is the last committed token, nodes in BFS order (parents
before children, shallower first), ``mask[i][j] = 1`` iff ``j`` is ``i`` or
an ancestor of ``i``, unused slots token 0 under node 0; flat int64 arrays
``[bs * D]`` and ``[bs * D * D]``. That mask is the ancestor matrix of a
D-node tree whose node 0 is the root and whose padding slots are children of
it, so the kernel only computes those D parents (BFS order from
``bfs_order_kernel``) and lets ``ancestor_matrix_kernel`` write the rows.

Worked example, ``D = 6``, root token 4, draft tokens ``[5, 6, 8, 7]`` with
parents ``[-1, 0, 0, 1]``: BFS order ``[0, 1, 2, 3]`` puts ``8`` (depth 2)
before ``7`` (depth 3); slot parents ``[-1, 0, 1, 1, 2, 0]``; tokens
``[4, 5, 6, 8, 7, 0]``; mask rows ``{0}, {0,1}, {0,1,2}, {0,1,3}, {0,1,2,4}, {0,5}``.

Token ids at or above ``token_bound`` are never written: such a node and its
subtree are dropped (SGLang embeds draft ids without a bounds check, and a
multimodal prompt holds image-padding values above the vocabulary).

Measured (``python -m freespec.integrations.sglang.bench``, D=16): see
examples/sglang/README.md; the kernel is ~1 us per request, the Python
around it (concatenating the drafts) ~1 us more.
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np

from freespec.draft import Draft
from freespec.kernels.tree_walk import ancestor_matrix_kernel, bfs_order_kernel

NO_BOUND = np.iinfo(np.int64).max
_ERRORS = {1: "parents must satisfy -1 <= parents[i] < i", 2: "token ids must be non-negative",
           3: "two children of one node carry the same token", 4: "more nodes than D - 1 slots"}


@numba.njit(cache=True)
def _check_draft(token_ids, parents):  # [n] int64, [n] int32 -> 0 or an _ERRORS code
    for i in range(parents.shape[0]):
        if parents[i] < -1 or parents[i] >= i:
            return 1
        if token_ids[i] < 0:
            return 2
        for j in range(i):
            if parents[j] == parents[i] and token_ids[j] == token_ids[i]:
                return 3
    return 0


@numba.njit(cache=True)
def _write_rows_kernel(token_ids, parents, offsets, root_ids, token_bound, out_tokens, out_mask, status, num_nodes):
    # token_ids [N] int64, parents [N] int32 (draft-local), offsets [B + 1] int64, root_ids [B] int64,
    # out_tokens [B, D] int64 zeros, out_mask [B, D, D] int64 zeros, status [B] int64, num_nodes [B] int64
    num_slots = out_tokens.shape[1]
    kept = np.empty(num_slots, np.int64)  # draft node -> its index among kept nodes, or -1
    kept_tokens = np.empty(num_slots, np.int64)
    kept_parents = np.empty(num_slots, np.int32)
    order = np.empty(num_slots, np.int64)
    slot_of = np.empty(num_slots, np.int64)
    slot_parents = np.empty(num_slots, np.int32)
    for b in range(root_ids.shape[0]):
        lo, hi = offsets[b], offsets[b + 1]
        if hi - lo > num_slots - 1:
            status[b] = 4
            continue
        status[b] = _check_draft(token_ids[lo:hi], parents[lo:hi])
        if status[b] != 0:
            continue
        num_kept = 0
        for i in range(hi - lo):
            parent = parents[lo + i]
            kept[i] = -1
            if token_ids[lo + i] < token_bound and (parent < 0 or kept[parent] >= 0):
                kept[i] = num_kept
                kept_tokens[num_kept] = token_ids[lo + i]
                kept_parents[num_kept] = -1 if parent < 0 else kept[parent]
                num_kept += 1
        num_nodes[b] = num_kept
        bfs_order_kernel(kept_parents[:num_kept], order[:num_kept])
        for k in range(num_kept):
            slot_of[order[k]] = k + 1
        slot_parents[0] = -1
        out_tokens[b, 0] = root_ids[b]
        for k in range(num_kept):
            parent = kept_parents[order[k]]
            slot_parents[k + 1] = 0 if parent < 0 else slot_of[parent]
            out_tokens[b, k + 1] = kept_tokens[order[k]]
        slot_parents[num_kept + 1:] = 0  # padding: token 0 under the root
        ancestor_matrix_kernel(slot_parents, out_mask[b])


def fit_to_slots(draft: Draft, num_slots: int) -> Draft:
    """The draft SGLang can verify: candidates only, pruned by confidence to ``num_slots`` nodes."""
    if draft.parents.shape[0] != draft.num_nodes:
        raise ValueError(f"Draft has {draft.num_nodes} token_ids but {draft.parents.shape[0]} parents")
    if draft.is_candidate is not None:
        draft = draft.candidates()  # not-candidate nodes (a lookahead window) cannot go to SGLang
    return draft.prune(num_slots) if draft.num_nodes > num_slots else draft


def write_sglang_trees(
    drafts: Sequence[Draft],
    root_token_ids: Sequence[int],
    num_draft_tokens: int,
    token_bound: int = NO_BOUND,
    out_num_nodes: np.ndarray | None = None,  # [bs] int64: drafted nodes per request, written in place
) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids [bs * D], mask [bs * D * D]), int64, for one draft and root token per request."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if len(drafts) != len(root_token_ids):
        raise ValueError(f"got {len(drafts)} drafts for {len(root_token_ids)} root tokens")
    fitted = [fit_to_slots(draft, num_draft_tokens - 1) for draft in drafts]
    offsets = np.zeros(len(fitted) + 1, np.int64)
    np.cumsum([draft.num_nodes for draft in fitted], out=offsets[1:])
    token_ids = np.concatenate([d.token_ids for d in fitted]) if fitted else np.zeros(0, np.int64)
    parents = np.concatenate([d.parents for d in fitted]) if fitted else np.zeros(0, np.int32)
    out_tokens = np.zeros((len(fitted), num_draft_tokens), np.int64)
    out_mask = np.zeros((len(fitted), num_draft_tokens, num_draft_tokens), np.int64)
    status = np.zeros(len(fitted), np.int64)
    num_nodes = np.zeros(len(fitted), np.int64) if out_num_nodes is None else out_num_nodes
    _write_rows_kernel(token_ids, parents, offsets, np.asarray(root_token_ids, np.int64), int(token_bound),
                       out_tokens, out_mask, status, num_nodes)
    bad = np.nonzero(status)[0]
    if bad.size:
        row = int(bad[0])
        raise ValueError(f"draft of request {row} is malformed: {_ERRORS[int(status[row])]} "
                         f"(token_ids {fitted[row].token_ids.tolist()}, parents {fitted[row].parents.tolist()})")
    return out_tokens.reshape(-1), out_mask.reshape(-1)


def to_sglang_tree(draft: Draft, root_token_id: int, num_draft_tokens: int,
                   token_bound: int = NO_BOUND) -> tuple[np.ndarray, np.ndarray]:
    """One draft as SGLang's ``D``-node tree: (token_ids [D], mask [D, D]), int64.

    ``to_sglang_tree(Draft([5, 6, 8, 7], [-1, 0, 0, 1]), 4, 6)`` gives token_ids
    ``[4, 5, 6, 8, 7, 0]`` and mask rows ``{0}, {0,1}, {0,1,2}, {0,1,3},
    {0,1,2,4}, {0,5}`` (the module docstring's example).
    """
    token_ids, mask = write_sglang_trees([draft], [root_token_id], num_draft_tokens, token_bound)
    return token_ids, mask.reshape(num_draft_tokens, num_draft_tokens)
