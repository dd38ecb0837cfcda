"""Tree attention for the verify forward of SGLang's ``torch_native`` backend (test support, see ``__init__``).

In a TARGET_VERIFY forward each request ``b`` feeds its ``D`` draft nodes at once.
``forward_batch.seq_lens[b]`` is its committed length ``P`` (the drafts' slots are
``req_to_token[b, P:P + D]``, where SGLang put them), and
``spec_info.custom_mask`` holds ``bs`` flat ``D x D`` masks, ``mask[i][j] = 1`` iff
node ``j`` is ``i`` or an ancestor of ``i``. Node ``i`` attends to the whole
prefix and to its own ancestors::

    P = 3, D = 3, node 1 and node 2 children of node 0:
              prefix   nodes
              0 1 2    0 1 2
    node 0    1 1 1    1 . .
    node 1    1 1 1    1 1 .
    node 2    1 1 1    1 . 1

``tree_attention`` is that, per request, with SDPA; ``verify_forward_around``
writes the nodes' K/V at ``out_cache_loc`` first, as the backend's own extend
path does, and leaves every other forward to SGLang.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def tree_attention(query, key, value, prefix_len: int, tree_mask, scaling, enable_gqa: bool):
    """One request's verify attention.

    query: [D, q_heads, head_dim]; key, value: [P + D, kv_heads, head_dim] (prefix, then the nodes);
    tree_mask: [D, D] bool (``mask[i][j]``: ``j`` is ``i`` or an ancestor). Returns [D, q_heads, v_dim].
    """
    num_nodes = query.shape[0]
    mask = torch.cat([torch.ones(num_nodes, prefix_len, dtype=torch.bool, device=query.device),
                      tree_mask.to(torch.bool)], dim=1)  # [D, P + D]
    out = scaled_dot_product_attention(query.movedim(0, 1).unsqueeze(0), key.movedim(0, 1).unsqueeze(0).to(query.dtype),
                                       value.movedim(0, 1).unsqueeze(0).to(query.dtype), attn_mask=mask,
                                       scale=scaling, enable_gqa=enable_gqa)
    return out.squeeze(0).movedim(0, 1)


def verify_forward_around(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    """AROUND ``TorchNativeAttnBackend.forward_extend``: the verify forward with tree attention, else SGLang's."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    if layer.is_cross_attention or getattr(layer, "sliding_window_size", None) not in (None, -1):
        raise NotImplementedError("the CPU tree-attention stand-in covers causal self-attention without a "
                                  "sliding window")
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool = backend.token_to_kv_pool
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    spec_info = forward_batch.spec_info
    num_nodes = int(spec_info.draft_token_num)
    queries = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((queries.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    masks = spec_info.custom_mask.reshape(-1, num_nodes, num_nodes)
    key_buffer, value_buffer = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    for row, (pool_index, prefix_len) in enumerate(zip(forward_batch.req_pool_indices.tolist(),
                                                       forward_batch.seq_lens.tolist())):
        slots = req_to_token[pool_index, :prefix_len + num_nodes]
        nodes = slice(row * num_nodes, (row + 1) * num_nodes)
        out[nodes] = tree_attention(queries[nodes], key_buffer[slots], value_buffer[slots], prefix_len, masks[row],
                                    layer.scaling, layer.tp_q_head_num != layer.tp_k_head_num)
    return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)
