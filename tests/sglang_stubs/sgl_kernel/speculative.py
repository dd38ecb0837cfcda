"""``reconstruct_indices_from_tree_mask`` on the CPU, from its documented contract.

Per batch row ``b`` and node ``i`` of an ``n``-node tree whose flat boolean
``tree_mask[b, i, j]`` says node ``j`` is ``i`` or an ancestor of ``i``:
``positions = seq_len + number of strict ancestors``, ``retrieve_index = b * n + i``,
``retrieve_next_token`` = first child, ``retrieve_next_sibling`` = next node with
the same parent (``-1`` when none, and for the root). Outputs are written in place.
"""

import torch


def reconstruct_indices_from_tree_mask(
    tree_mask,  # [bs * n * n] bool
    verified_seq_len,  # [bs]
    positions,  # [bs * n] out
    retrieve_index,  # [bs, n] out
    retrieve_next_token,  # [bs, n] out
    retrieve_next_sibling,  # [bs, n] out
    batch_size,
    draft_token_num,
):
    n = draft_token_num
    mask = tree_mask.reshape(batch_size, n, n).to(torch.bool).cpu()
    seq_lens = verified_seq_len.cpu().tolist()
    for b in range(batch_size):
        parents = []
        for i in range(n):
            ancestors = [j for j in range(i) if bool(mask[b, i, j])]
            parents.append(ancestors[-1] if ancestors else -1)
            positions[b * n + i] = seq_lens[b] + len(ancestors)
            retrieve_index[b, i] = b * n + i
        for i in range(n):
            children = [k for k in range(i + 1, n) if parents[k] == i]
            retrieve_next_token[b, i] = children[0] if children else -1
            siblings = [k for k in range(i + 1, n) if parents[i] >= 0 and parents[k] == parents[i]]
            retrieve_next_sibling[b, i] = siblings[0] if siblings else -1
