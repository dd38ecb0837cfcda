"""Stand-in for the compiled ``sgl_kernel`` package on a CPU machine (see tests/sglang_stubs/README.md).

SGLang's CPU path imports a handful of ``sgl_kernel`` ops by name. The package
that holds them is built for CUDA (and for Intel AMX) only, so this module gives
each op SGLang 0.5.21 calls when it decodes with NGRAM speculation a few lines of
plain torch, with the semantics of SGLang's own Triton version of the same op
(``sglang/kernels/ops/...``), which the tests check them against in Triton's
interpreter (tests/test_sglang_cpu_support.py). These are ours; everything around
them is SGLang's. On a GPU SGLang runs its own kernels and none of this is used.

Plain decoding calls none of these ops. Names SGLang imports at load but never
calls on this path resolve to a function that raises ``NotImplementedError``
naming the op, so an unexpected call fails loudly instead of computing anything.

Shapes: ``[bs]`` a row per request; ``loc`` tensors are KV-pool slot indices.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

# what the CPU modules of sglang 0.5.21 import at load time but this path never calls
_IMPORT_ONLY = ("build_tree_kernel_efficient_cpu",)  # EAGLE's tree building (eagle_utils)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every KV buffer ``b`` (base pointer ``data_ptrs[b]``, ``strides[b]`` bytes a slot), slot
    ``tgt_loc[i] <- src_loc[i]``; every source row is read before any is written (as the Triton kernel
    loads a tile before it stores it).

    data_ptrs: [num_buffers] uint64; strides: [num_buffers] int64 (bytes); tgt_loc, src_loc: [num_locs].
    Example: a buffer of 4 one-byte slots [7, 8, 9, 0], tgt [3, 0], src [0, 2] -> [9, 8, 9, 7].
    """
    tgt = tgt_loc.to(torch.int64).cpu().numpy()
    src = src_loc.to(torch.int64).cpu().numpy()
    if tgt.size == 0:
        return
    num_slots = int(max(tgt.max(), src.max())) + 1
    for pointer, stride in zip(data_ptrs.tolist(), strides.tolist()):
        pointer, stride = int(pointer) & (2**64 - 1), int(stride)
        raw = (ctypes.c_uint8 * (num_slots * stride)).from_address(pointer)
        rows = np.ctypeslib.as_array(raw).reshape(num_slots, stride)
        rows[tgt] = rows[src].copy()


def _spans(start_offset, end_offset):
    """``(row, start, end, out_start)`` per request: its slice of the flat ``out_cache_loc``."""
    starts = start_offset.to(torch.int64).cpu().tolist()
    ends = end_offset.to(torch.int64).cpu().tolist()
    out_start = 0
    for row, (start, end) in enumerate(zip(starts, ends)):
        yield row, start, end, out_start
        out_start += end - start


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    """``req_to_token[req_pool_indices[b], start[b]:end[b]] = out_cache_loc[o_b : o_b + end[b] - start[b]]``,
    ``o_b`` the lengths of the requests before ``b`` (a request's new slots, written into its row).

    Addressed as the Triton kernel addresses it, from the row's start in the flat buffer: a span that runs
    past the row's ``pool_len`` entries goes on into the next row's memory, as it does on a GPU.
    Example: rows [1], start [2], end [4], out_cache_loc [40, 41] -> req_to_token[1, 2:4] = [40, 41].
    """
    flat = req_to_token.view(-1)
    pools = req_pool_indices.to(torch.int64).cpu().tolist()
    for row, start, end, out_start in _spans(start_offset, end_offset):
        base = pools[row] * int(pool_len)
        flat[base + start:base + end] = out_cache_loc[out_start:out_start + end - start].to(flat.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len) -> None:
    """The reverse copy: ``out_cache_loc[o_b : o_b + end[b] - start[b]] = req_to_token[req_pool_indices[b],
    start[b]:end[b]]`` (the slots of each request's draft tokens, read from its row; addressed in the flat
    buffer, as above)."""
    flat = req_to_token.view(-1)
    pools = req_pool_indices.to(torch.int64).cpu().tolist()
    for row, start, end, out_start in _spans(start_offset, end_offset):
        base = pools[row] * int(pool_len)
        out_cache_loc[out_start:out_start + end - start] = flat[base + start:base + end].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """The slots of the accepted nodes, packed: the ``n``-th entry of ``accept_index`` (flat) that is not -1
    puts ``out_cache_loc[that entry]`` at ``accept_out_cache_loc[n]``.

    Example: accept_index [[0, 2, -1], [3, -1, -1]], out_cache_loc [50, 51, 52, 53] -> [50, 52, 53, ...].
    """
    flat = accept_index.reshape(-1).to(torch.int64)
    kept = flat[flat != -1]
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """``bonus_tokens[b] = accept_tokens.flat[accept_stride * b + accept_lens[b] - 1]`` (each request's last
    accepted token; ``accept_lens`` counts it)."""
    flat = accept_tokens.reshape(-1)
    rows = torch.arange(bonus_tokens.numel(), device=flat.device)
    bonus_tokens.copy_(flat[rows * int(accept_stride) + accept_lens.to(torch.int64) - 1].to(bonus_tokens.dtype))


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict) -> None:
    """Greedy tree verification, per request: from the root, at each level take the child whose token is
    the target's argmax at the last accepted node; stop where none is.

    candidates, retrive_*, target_predict: [bs, D]; accept_index: [bs, S] (S = the most nodes a request
    can accept, D here; the caller fills it with -1); accept_token_num: [bs]; predicts: [bs * D], indexed
    by ``retrive_index`` (a node's flat index). Writes ``accept_index[b, :n + 1]`` (root, then the accepted
    nodes), ``accept_token_num[b] = n`` and ``predicts`` at each accepted node (the target's token there,
    which for every node but the last is the next accepted node's token; the last one's is the bonus).
    """
    num_draft = candidates.shape[1]
    num_spec = accept_index.shape[1]
    flat_target = target_predict.reshape(-1)
    for row in range(candidates.shape[0]):
        last = int(retrive_index[row, 0])  # flat index of the last accepted node (the root first)
        accept_index[row, 0] = last
        num_accepted, node = 0, 0
        for _ in range(1, num_spec):
            target_token = flat_target[last]
            child = int(retrive_next_token[row, node])
            while child != -1 and candidates[row, child] != target_token:
                child = int(retrive_next_sibling[row, child])
            if child == -1:
                break
            predicts[last] = target_token
            num_accepted += 1
            last = int(retrive_index[row, child])
            accept_index[row, num_accepted] = last
            node = child
        accept_token_num[row] = num_accepted
        predicts[last] = flat_target[last]


def _not_on_this_path(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in here: SGLang called an op that its "
                                  f"plain and NGRAM decoding on the CPU never call (tests/sglang_stubs/sgl_kernel)")

    op.__name__ = name
    return op


def __getattr__(name: str):
    if name in _IMPORT_ONLY:
        return _not_on_this_path(name)
    raise AttributeError(f"module 'sgl_kernel' (a CPU stand-in) has no attribute {name!r}")
