"""The test support that runs a real SGLang engine on a CPU, checked against SGLang's own kernels.

Ours, test support only (never installed with freespec): the ``sgl_kernel``
stand-in ops (``tests/sglang_stubs/sgl_kernel``) and the verify forward's tree
attention (``tests/sglang_cpu``). Each op is checked against SGLang's own Triton
kernel for the same op, run by Triton's interpreter (``TRITON_INTERPRET=1``, which
executes a kernel with NumPy on the CPU) on random inputs; the tree attention
against a plain softmax written out by hand, and against causal attention for a
chain. Importing sglang patches transformers process-wide, so the checks run in
one child process (``python tests/test_sglang_cpu_support.py --json OUT``), as in
``test_sglang_plugin.py``; they skip where sglang is not installed
(``bash scripts/install_sglang.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CHECKS: dict = {}
pytestmark = pytest.mark.sglang


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang_cpu") / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FREESPEC_", "SGLANG_"))}
    env.update(TRITON_INTERPRET="1", SGLANG_USE_CPU_ENGINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE / "sglang_stubs"), str(HERE / "sglang_cpu")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    if not out.exists():
        pytest.fail(f"the check process died (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    data = json.loads(out.read_text())
    if "unavailable" in data:
        pytest.skip(f"sglang is not importable here ({data['unavailable']}); install it with: "
                    f"bash scripts/install_sglang.sh")
    return data


@pytest.mark.parametrize("name", ["copy_all_layer_kv_cache", "assign_req_to_token_pool", "assign_extend_cache_locs",
                                  "fill_accept_out_cache_loc", "fill_bonus_tokens", "verify_tree_greedy",
                                  "tree_attention_matches_plain_softmax", "tree_attention_chain_is_causal",
                                  "unexpected_op_fails_loudly"])
def test_stand_in(results, name):
    outcome, detail = results[name]
    if outcome != "pass":
        pytest.fail(detail, pytrace=False)


# ============================================================ child side
def _random_spans(gen, batch_size, pool_len, max_len):
    """Spans of up to ``max_len`` slots, some running past the row's ``pool_len`` (into the next row, as a
    request's draft slots near the end of its context do)."""
    import torch

    starts = torch.randint(0, pool_len, (batch_size,), generator=gen)
    lens = torch.randint(0, max_len + 1, (batch_size,), generator=gen)
    return starts, starts + lens


@check
def copy_all_layer_kv_cache():
    import torch
    import sgl_kernel
    from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        num_slots, num_locs = 64, int(torch.randint(1, 12, (1,), generator=gen))
        buffers = [torch.randn(num_slots, 2, 8, generator=gen) for _ in range(3)]
        locs = torch.randperm(num_slots, generator=gen)[:2 * num_locs]
        tgt, src = locs[:num_locs].clone(), locs[num_locs:].clone()  # disjoint, as the pool's moves are
        if trial % 4 == 0:
            src = tgt.roll(1)  # a permutation of the same slots: every row read before any is written
        ours = [b.clone() for b in buffers]
        ptrs = torch.tensor([b.data_ptr() for b in ours], dtype=torch.uint64)
        strides = torch.tensor([b[0].numel() * b.element_size() for b in ours], dtype=torch.int64)
        sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
        theirs = [b.clone() for b in buffers]
        ptrs = torch.tensor([b.data_ptr() for b in theirs], dtype=torch.uint64)
        row_bytes = int(strides[0])
        copy_all_layer_kv_cache_tiled[(len(theirs), 1)](ptrs, strides, tgt, src, num_locs, 16, BYTES_PER_TILE=row_bytes)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), f"trial {trial}: KV rows differ from SGLang's kernel"


@check
def assign_req_to_token_pool():
    import torch
    import sgl_kernel
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool as kernel

    gen = torch.Generator().manual_seed(1)
    for trial in range(20):
        bs, pool_len = int(torch.randint(1, 6, (1,), generator=gen)), 48
        pools = torch.randperm(7, generator=gen)[:bs]  # never the last row: a span may run past its end
        start, end = _random_spans(gen, bs, pool_len, 40)
        out_cache_loc = torch.randint(0, 1000, (int((end - start).sum()),), generator=gen)
        ours = torch.zeros(8, pool_len, dtype=torch.int32)
        theirs = ours.clone()
        sgl_kernel.assign_req_to_token_pool_cpu(pools, ours, start, end, out_cache_loc, pool_len)
        kernel[(bs,)](pools, theirs, start, end, out_cache_loc, pool_len, 8)
        assert torch.equal(ours, theirs), f"trial {trial}: req_to_token differs from SGLang's kernel"


@check
def assign_extend_cache_locs():
    import torch
    import sgl_kernel
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs as kernel

    gen = torch.Generator().manual_seed(2)
    for trial in range(20):
        bs, pool_len = int(torch.randint(1, 6, (1,), generator=gen)), 48
        pools = torch.randperm(7, generator=gen)[:bs]
        start, end = _random_spans(gen, bs, pool_len, 40)
        req_to_token = torch.randint(0, 1000, (8, pool_len), generator=gen, dtype=torch.int32)
        total = int((end - start).sum())
        ours, theirs = torch.full((total,), -7, dtype=torch.int64), torch.full((total,), -7, dtype=torch.int64)
        sgl_kernel.assign_extend_cache_locs_cpu(pools, req_to_token, start, end, ours, pool_len)
        kernel[(bs,)](pools, req_to_token, start, end, theirs, pool_len, 8)
        assert torch.equal(ours, theirs), f"trial {trial}: out_cache_loc differs from SGLang's kernel"


@check
def fill_accept_out_cache_loc():
    import torch
    import sgl_kernel
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc as kernel

    gen = torch.Generator().manual_seed(3)
    for trial in range(20):
        bs, width = int(torch.randint(1, 6, (1,), generator=gen)), 8
        out_cache_loc = torch.randint(0, 1000, (bs * width,), generator=gen)
        accept_index = torch.full((bs, width), -1, dtype=torch.int64)
        for row in range(bs):
            n = int(torch.randint(1, width + 1, (1,), generator=gen))
            accept_index[row, :n] = torch.randperm(width, generator=gen)[:n] + row * width
        ours, theirs = torch.zeros(bs * width, dtype=torch.int64), torch.zeros(bs * width, dtype=torch.int64)
        sgl_kernel.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, ours)
        kernel[(bs * width,)](accept_index, out_cache_loc, theirs, 64)
        assert torch.equal(ours, theirs), f"trial {trial}: accepted slots differ from SGLang's kernel"


@check
def fill_bonus_tokens():
    import torch
    import sgl_kernel
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens as kernel

    gen = torch.Generator().manual_seed(4)
    bs, width = 5, 6
    accept_tokens = torch.randint(0, 1000, (bs, width), generator=gen)
    accept_lens = torch.randint(1, width + 1, (bs,), generator=gen)
    ours, theirs = torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64)
    sgl_kernel.fill_bonus_tokens_cpu(accept_tokens, accept_lens, ours, width)
    kernel[(bs,)](accept_tokens, accept_lens, theirs, width)
    assert torch.equal(ours, theirs), "bonus tokens differ from SGLang's kernel"


def _random_tree(gen, num_nodes):
    """parents of a random tree in BFS order (node 0 the root), and its ancestor mask."""
    import torch

    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes)]
    parents = [-1] + sorted(parents[1:])  # BFS order: a parent's children after every earlier node's
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for i in range(num_nodes):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return parents, mask


@check
def verify_tree_greedy():
    import torch
    import sgl_kernel
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_kernel_triton as kernel

    gen = torch.Generator().manual_seed(5)
    for trial in range(30):
        bs, num_nodes, vocab = int(torch.randint(1, 5, (1,), generator=gen)), 8, 4  # few tokens: many matches
        masks = torch.stack([_random_tree(gen, num_nodes)[1] for _ in range(bs)])
        positions = torch.zeros(bs * num_nodes, dtype=torch.int64)
        links = [torch.zeros(bs, num_nodes, dtype=torch.int64) for _ in range(3)]
        reconstruct_indices_from_tree_mask(masks.reshape(-1), torch.zeros(bs, dtype=torch.int64), positions, *links,
                                           bs, num_nodes)
        candidates = torch.randint(0, vocab, (bs, num_nodes), generator=gen)
        target = torch.randint(0, vocab, (bs, num_nodes), generator=gen)
        outs = []
        for run in range(2):
            predicts = torch.full((bs * num_nodes,), -5, dtype=torch.int64)
            accept_index = torch.full((bs, num_nodes), -1, dtype=torch.int64)
            accept_num = torch.zeros(bs, dtype=torch.int64)
            if run == 0:
                sgl_kernel.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index,
                                                  accept_token_num=accept_num, candidates=candidates,
                                                  retrive_index=links[0], retrive_next_token=links[1],
                                                  retrive_next_sibling=links[2], target_predict=target)
            else:
                kernel[(bs,)](predicts, accept_index, accept_num, candidates, *links, target, batch_size=bs,
                              num_speculative_tokens=num_nodes, num_draft_tokens=num_nodes)
            outs.append((predicts, accept_index, accept_num))
        for name, a, b in zip(("predicts", "accept_index", "accept_token_num"), *outs):
            assert torch.equal(a, b), f"trial {trial}: {name} differs from SGLang's kernel: {a} vs {b}"


def _attention_case(gen, prefix_len, num_nodes, q_heads=4, kv_heads=2, head_dim=8):
    import torch

    query = torch.randn(num_nodes, q_heads, head_dim, generator=gen)
    key = torch.randn(prefix_len + num_nodes, kv_heads, head_dim, generator=gen)
    value = torch.randn(prefix_len + num_nodes, kv_heads, head_dim, generator=gen)
    return query, key, value


@check
def tree_attention_matches_plain_softmax():
    import torch
    from freespec_sglang_cpu.tree_attention import tree_attention

    gen = torch.Generator().manual_seed(6)
    for trial in range(10):
        prefix_len, num_nodes = int(torch.randint(1, 20, (1,), generator=gen)), 8
        query, key, value = _attention_case(gen, prefix_len, num_nodes)
        _, mask = _random_tree(gen, num_nodes)
        out = tree_attention(query, key, value, prefix_len, mask, 0.3, enable_gqa=True)
        for i in range(num_nodes):
            seen = list(range(prefix_len)) + [prefix_len + j for j in range(num_nodes) if mask[i, j]]
            for head in range(query.shape[1]):
                k, v = key[seen, head // 2], value[seen, head // 2]  # 4 query heads share 2 kv heads
                weights = torch.softmax((k @ query[i, head]) * 0.3, dim=0)
                assert torch.allclose(out[i, head], weights @ v, atol=1e-5), f"trial {trial} node {i} head {head}"


@check
def tree_attention_chain_is_causal():
    import torch
    from torch.nn.functional import scaled_dot_product_attention
    from freespec_sglang_cpu.tree_attention import tree_attention

    gen = torch.Generator().manual_seed(7)
    prefix_len, num_nodes = 11, 6
    query, key, value = _attention_case(gen, prefix_len, num_nodes, q_heads=2, kv_heads=2)
    chain = torch.tril(torch.ones(num_nodes, num_nodes, dtype=torch.bool))
    out = tree_attention(query, key, value, prefix_len, chain, None, enable_gqa=False)
    full_q = torch.cat([torch.zeros(prefix_len, 2, 8), query])  # the same queries at the end of a causal pass
    causal = scaled_dot_product_attention(full_q.movedim(0, 1), key.movedim(0, 1), value.movedim(0, 1),
                                          is_causal=True).movedim(0, 1)[prefix_len:]
    assert torch.allclose(out, causal, atol=1e-5), "a chain's tree attention is not causal attention"


@check
def unexpected_op_fails_loudly():
    import sgl_kernel

    try:
        sgl_kernel.build_tree_kernel_efficient_cpu()
    except NotImplementedError as exc:
        assert "build_tree_kernel_efficient_cpu" in str(exc)
    else:
        raise AssertionError("an op without a stand-in ran")
    try:
        sgl_kernel.no_such_op
    except AttributeError:
        return
    raise AssertionError("an unknown sgl_kernel name resolved")


def _child(out: Path) -> None:
    try:
        import sglang  # noqa: F401
        import triton  # noqa: F401
    except ImportError as exc:
        out.write_text(json.dumps({"unavailable": str(exc)}))
        return
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn()
            results[name] = ("pass", "")
        except Exception:
            results[name] = ("fail", traceback.format_exc()[-3000:])
    out.write_text(json.dumps(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    _child(parser.parse_args().json)
