"""Token recycling: the successor table's kernels against their twins, its memory bound, what observe()
writes, calibrated best-first trees, sharing across requests, and the drafter end to end.

Tests whose name holds ``kernel`` are rerun with ``NUMBA_DISABLE_JIT=1`` in a subprocess.
"""


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freespec.draft import Budget, Draft
from freespec.drafters import make
from freespec.drafters.base import ForwardReport, VerifyOutput
from freespec.drafters.calibration import AcceptanceCalibrator
from freespec.drafters.recycle import RecycleDrafter, RecycleSource, SuccessorTable, recycle_prior
from freespec.kernels.successor_table import EXACT, MODEL, PAIR, TEXT, confidence_classes

import naive
from conftest import (check_drafter_options, patched_generate, plain_generate,
                      rerun_kernel_tests_without_jit)

FAST = settings(max_examples=60, deadline=None)


@FAST
@given(st.integers(1, 4), st.integers(1, 600), st.integers(1, 12), st.sampled_from([1, 4, 16, 128]), st.integers(0, 2**16))
def test_top_k_matches_its_twin(num_rows, vocab, k, chunk, seed):
    """The engine's chunked top-k (what observe() receives) against a sort, on distinct scores."""
    from freespec.engine import top_k

    scores = torch.from_numpy(np.random.default_rng(seed).permutation(num_rows * vocab).reshape(num_rows, vocab))
    scores = scores.to(torch.float32) - vocab  # distinct, some negative
    got = top_k(scores, k, chunk=chunk)[0].tolist()
    assert got == naive.naive_top_k_ids(scores.tolist(), k)


@FAST
@given(st.integers(1, 4), st.integers(1, 600), st.integers(1, 12), st.sampled_from([1, 4, 16, 128]), st.integers(0, 2**16))
def test_top_k_probabilities_match_their_twin(num_rows, vocab, k, chunk, seed):
    """The probabilities observe() receives: a softmax over the chunks the top-k came from (an upper bound of the
    row's softmax, equal when the row has at most k chunks)."""
    from freespec.engine import top_k

    scores = torch.from_numpy(np.random.default_rng(seed).permutation(num_rows * vocab).reshape(num_rows, vocab))
    scores = scores.to(torch.float64) / 50.0  # distinct, a spread that leaves mass outside the top chunks
    ids, probs = top_k(scores, k, chunk=chunk)
    expect = naive.naive_top_k_probs(scores.tolist(), k, chunk)
    assert [p for row in probs.tolist() for p in row] == pytest.approx([p for row in expect for p in row], rel=1e-9,
                                                                       abs=1e-12)
    exact = torch.softmax(scores, dim=-1).gather(1, ids)
    assert bool((probs >= exact * (1 - 1e-9)).all())
    if vocab // chunk <= k:
        assert torch.allclose(probs, exact)


def test_top_k_on_real_vocabulary_sizes():
    from freespec.engine import top_k

    for vocab in (151936, 32001, 49152):
        scores = torch.randn(9, vocab)
        assert torch.equal(top_k(scores, 8)[0], torch.topk(scores, 8, dim=-1).indices)


def test_half_logits_reach_top_k_as_their_float32_conversion():
    """On a CPU the engine hands top_k float16 / bfloat16 logits as float32 in its buffer (reduced faster there):
    the ids and probabilities top_k gives the half-precision logits themselves; other logits pass as they are."""
    from types import SimpleNamespace

    from freespec.engine import LogitsBuffer, SpeculativeDecoder, top_k

    engine = SimpleNamespace(logits_buffer=LogitsBuffer())
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        scores = (torch.randn(17, 49152, generator=generator) * 3).to(dtype)
        converted = SpeculativeDecoder._reducible(engine, scores)
        assert converted.dtype == torch.float32 and torch.equal(converted, scores.float())
        ids, probs = top_k(scores, 8)
        converted_ids, converted_probs = top_k(converted, 8)
        assert torch.equal(ids, converted_ids) and torch.equal(probs, converted_probs)
    single = torch.randn(3, 100)
    assert SpeculativeDecoder._reducible(engine, single) is single


SLOTS = 8  # pair slots in the kernel tests: collisions happen, and the twin must agree on them


def _as_dicts(table: SuccessorTable) -> dict:
    model = {t: table.row(t, MODEL) for t in range(table.num_rows) if table.row(t, MODEL)}
    model_conf = {t: table.confidences(t, MODEL) for t in model}
    text = {t: table.row(t, TEXT) for t in range(table.num_rows) if table.row(t, TEXT)}
    pair = {slot: ((int(key) >> 32, int(key) & 0xFFFFFFFF), table.pair[slot][table.pair[slot] >= 0].tolist(),
                   table.pair_conf[slot][table.pair[slot] >= 0].tolist())
            for slot, key in enumerate(table.pair_keys.tolist()) if key >= 0}
    return {"model": model, "model_conf": model_conf, "text": text, "pair": pair}


@st.composite
def table_ops(draw, max_token=12, k=3):
    """A sequence of seed (text) and write (tokens, previous tokens, top-k rows, order) operations."""
    ops = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            text = draw(st.lists(st.integers(0, max_token), min_size=0, max_size=15))
            ops.append(("seed", text, draw(st.integers(0, 3))))
        else:
            m = draw(st.integers(1, 5))
            tokens = draw(st.lists(st.integers(0, max_token), min_size=m, max_size=m))
            prevs = draw(st.lists(st.integers(-1, max_token), min_size=m, max_size=m))
            width = draw(st.integers(1, k + 1))
            topk = [draw(st.lists(st.integers(0, max_token), min_size=width, max_size=width, unique=True))
                    for _ in range(m)]
            order = draw(st.permutations(range(m)))[: draw(st.integers(0, m))]
            probs = None
            if draw(st.booleans()):  # with the target's probabilities (confidence classes), or without
                probs = [draw(st.lists(st.floats(0.0, 1.0), min_size=width, max_size=width)) for _ in range(m)]
            ops.append(("write", tokens, prevs, topk, order, probs))
    return ops


def _apply(ops, k, kt=2):
    table = SuccessorTable(top_k=k, text_k=kt, pair_slots=SLOTS)
    twin = {"model": {}, "model_conf": {}, "text": {}, "pair": {}}
    for op in ops:
        if op[0] == "seed":
            table.seed(np.array(op[1], np.int64), op[2])
            naive.naive_seed_text(twin, op[1], op[2], kt)
        else:
            _, tokens, prevs, topk, order, probs = op
            width = len(topk[0])
            table.write(np.array(tokens), np.array(prevs), np.array(topk).reshape(len(tokens), width),
                        np.array(order, np.int64), None if probs is None else np.array(probs).reshape(-1, width))
            naive.naive_write_rows(twin, tokens, prevs, topk, order, k, SLOTS, probs)
    return table, twin


# ------------------------------------------------------------------------ kernels vs twins
@FAST
@given(table_ops())
def test_kernel_table_updates_match_twin(ops):
    table, twin = _apply(ops, k=3)
    assert _as_dicts(table) == twin


@FAST
@given(table_ops(), st.integers(0, 12), st.integers(-1, 12), st.booleans(), st.integers(0, 12), st.integers(1, 6),
       st.floats(0.0, 0.2), st.lists(st.floats(0.05, 1.0), min_size=176, max_size=176), st.integers(0, 8))
def test_kernel_grow_tree_matches_twin(ops, root, root_prev, exact_root, max_nodes, max_depth, min_prob,
                                       flat_probs, num_conf):
    table, twin = _apply(ops, k=3)
    # 4 row types x 2 depth kinds x (3 ranks + num_conf confidence classes, some classes past the last) x agree
    probs = np.array(flat_probs[: 16 * (3 + num_conf)]).reshape(4, 2, 3 + num_conf, 2)
    token_ids, parents, path_probs, kinds = table.grow(root, root_prev, exact_root, probs, max_nodes, max_depth,
                                                       min_prob, num_ranks=3)
    expect = naive.naive_grow_tree(twin, root, root_prev, exact_root, probs.tolist(), max_nodes, max_depth,
                                   min_prob, SLOTS, num_ranks=3)
    assert token_ids.tolist() == expect[0] and parents.tolist() == expect[1]
    assert path_probs.tolist() == pytest.approx(expect[2], rel=1e-12)
    assert [tuple(k) for k in kinds.tolist()] == expect[3]
    draft = Draft(token_ids, parents, path_probs)
    draft.validate(Budget(max_nodes, max_depth))  # distinct siblings, topological, within the budget


def test_kernels_without_jit():
    rerun_kernel_tests_without_jit(__file__)


def test_confidence_classes_reach_the_tree_kinds():
    """The target's probability of each entry is kept as a confidence class; a node's kind carries
    ``num_ranks + class`` (per rank with ``confidence=False``), and its prior follows the class."""
    for confidence, expect in ((True, [2 + 7, 2 + 1]), (False, [0, 1])):
        drafter = RecycleDrafter(top_k=2, shared=False, adaptive=False, confidence=confidence)
        drafter.start("r", [5, 6])
        topk, probs = np.array([[7, 8]]), np.array([[0.9, 0.05]], np.float32)
        drafter.observe("r", VerifyOutput(Draft.empty(), np.zeros(0, np.int64), topk, probs))
        table = drafter.recycle.table_for("r")
        assert table.row(6) == [7, 8] and table.row(6, PAIR, prev=5) == [7, 8]
        assert table.confidences(6) == ([7, 1] if confidence else [-1, -1])
        draft, kinds = drafter.recycle.draft("r", drafter.context("r"), Budget(4, 1), drafter.sizer.calibrator)
        assert draft.token_ids.tolist() == [7, 8]
        assert [kind[1] for kind in kinds] == [PAIR, PAIR] and [kind[3] for kind in kinds] == expect
    assert recycle_prior(MODEL, 1, 8 + 7, 0) == pytest.approx(0.05 + 0.45 * 0.925)
    assert recycle_prior(PAIR, 1, 8 + 7, 0) > recycle_prior(PAIR, 1, 8 + 2, 0) > recycle_prior(PAIR, 1, 8 + 0, 0)
    assert confidence_classes(np.array([0.01, 0.03, 0.5, 0.9])).tolist() == [0, 1, 5, 7]


def test_worked_examples():
    # kernels/successor_table.py
    table = SuccessorTable(top_k=2, text_k=1)
    table.write(np.array([5, 6]), np.array([-1, -1]), np.array([[6, 9], [5, 8]]), np.array([0, 1]))
    table.seed(np.array([5, 9]))
    assert table.row(5, MODEL) == [6, 9] and table.row(5, TEXT) == [9] and table.top1(5) == 9
    probs = np.full((4, 2, 2, 2), 0.1)
    probs[TEXT, 0, 0, 0], probs[MODEL, 0, 0, 0], probs[MODEL, 1, 0, 0] = 0.4, 0.5, 0.5
    token_ids, parents, path_probs, kinds = table.grow(5, -1, False, probs, 3, 4, 0.0)
    assert token_ids.tolist() == [6, 9, 5] and parents.tolist() == [-1, -1, 0]
    assert path_probs.tolist() == pytest.approx([0.5, 0.4, 0.25])
    assert kinds[:2].tolist() == [[MODEL, 1, 0, 0], [TEXT, 1, 0, 0]]
    # drafters/recycle.py: the prompt's bigrams, then the target's rows
    drafter = RecycleDrafter(top_k=2, shared=False, adaptive=False)
    drafter.start("r", [5, 6, 5, 7])
    assert drafter.propose("r", Budget(8, 4)).num_nodes == 0  # nothing ever followed 7
    drafter.observe("r", VerifyOutput(Draft.empty(), np.zeros(0, np.int64), np.array([[8, 5]])))
    drafter.extend("r", [8])
    drafter.observe("r", VerifyOutput(Draft.empty(), np.zeros(0, np.int64), np.array([[5, 9]])))
    drafter.extend("r", [5])
    draft = drafter.propose("r", Budget(16, 3))  # root 5: text row [7, 6], model rows 7 -> [8, 5], 8 -> [5, 9]
    assert draft.token_ids[0] == 7 and [7, 8, 5] in draft.paths() and (6, 5) in draft.node_paths()
    assert recycle_prior(PAIR, 1, 0, 0) == 0.5 and recycle_prior(EXACT, 1, 0, 0) == 0.9


# ------------------------------------------------------------------------ memory bound
@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 200_000), min_size=1, max_size=20), min_size=1, max_size=8),
       st.integers(1, 8), st.integers(1, 4))
def test_memory_is_bounded_by_the_largest_token(texts, k, kt):
    table, largest = SuccessorTable(top_k=k, text_k=kt, pair_slots=64), 0
    pairs_bytes = 64 * (8 + 5 * k)  # key, entries, confidence classes
    for text in texts:
        table.seed(np.array(text))
        rows = np.array(text[:3], np.int64)
        table.write(rows, rows[::-1], np.tile(np.array(text[:1] * k), (rows.shape[0], 1)), np.arange(rows.shape[0]))
        largest = max(largest, max(text))
        assert table.nbytes <= max(1024, 2 * (largest + 1)) * (5 * k + 4 * kt) + pairs_bytes
    fixed = SuccessorTable(top_k=k, text_k=kt, vocab_size=largest + 1, pair_slots=64)
    for text in texts:
        fixed.seed(np.array(text))
    assert fixed.nbytes == (largest + 1) * (5 * k + 4 * kt) + pairs_bytes
    with pytest.raises(ValueError, match="vocab_size"):
        fixed.seed(np.array([largest + 1, 0]))


def test_qwen_sized_table_is_a_few_megabytes():
    table = SuccessorTable(top_k=8, vocab_size=151_936)
    assert table.nbytes == 151_936 * 48 + (1 << 16) * 48 and table.nbytes < 10.5e6
    lazy = SuccessorTable(top_k=8)
    lazy.seed(np.array([151_935, 3]))
    assert lazy.num_rows == 262_144  # doubled from 1024 to cover the largest id seen
    with pytest.raises(ValueError, match="power of two"):
        SuccessorTable(pair_slots=100)


# ------------------------------------------------------------------------ observe, trees, sharing
def test_observe_lets_the_true_context_win():
    source = RecycleSource(top_k=2, shared=False)
    context = np.array([1, 2])
    source.start("r", context)
    # root 2 -> 3 (node 0, accepted) -> 5 (node 3, rejected: the frontier); 2 -> 4 (node 1) -> 3 (node 2);
    # 5 -> 4 (node 4, under the frontier node)
    draft = Draft([3, 4, 3, 5, 4], [-1, -1, 1, 0, 3])
    topk = np.array([[30, 31], [40, 41], [50, 51], [60, 61], [70, 71], [80, 81]])  # rows: root, then node i + 1
    source.observe("r", context, VerifyOutput(draft, np.array([0]), topk))
    table = source.table_for("r")
    assert table.row(2) == [30, 31] and table.row(2, PAIR, prev=1) == [30, 31]
    assert table.row(3) == [40, 41]  # the accepted node's prediction, not the rejected one's
    assert table.row(3, PAIR, prev=4) == [60, 61]  # each context keeps its own pair row
    assert table.row(5) == [70, 71] and table.row(5, PAIR, prev=3) == [70, 71]
    assert table.row(4) == [50, 51]  # node 1's (a true context) over node 4's (under a rejected node)
    # the frontier's tokens have exact rows: if the bonus token is 5, the next root's row is the true top-k
    budget = Budget(4, 2)
    draft, kinds = source.draft("r", np.array([1, 2, 3, 5]), budget, AcceptanceCalibrator())
    assert draft.token_ids.tolist()[0] == 70 and kinds[0] == ("recycle", EXACT, 1, 0, 1)  # exact and pair agree
    source.observe("r", context, VerifyOutput(Draft([3], [-1]), np.array([0]), topk[:2]))
    draft, kinds = source.draft("r", np.array([1, 2, 3]), budget, AcceptanceCalibrator())  # no frontier
    assert kinds[0] == ("recycle", PAIR, 1, 0, 1)  # the pair (2, 3) and the model row of 3 agree
    with pytest.raises(ValueError, match="num_nodes"):
        source.observe("r", context, VerifyOutput(draft, np.array([0]), topk[:2]))


def test_calibration_reshapes_the_tree():
    from freespec.tree import follow

    drafter = RecycleDrafter(top_k=2, shared=False)
    drafter.start("r", [10])
    successor = lambda t: 10 + (t - 9) % 10  # noqa: E731  the text cycles through 10..19
    for _ in range(5):
        drafter.on_forward(ForwardReport(("r",), (1,), 0.01))
    sizes = []
    for _ in range(120):
        last = int(drafter.context("r")[-1])
        draft = drafter.propose("r", Budget(16, 8))
        sizes.append(draft.num_nodes)
        drafter.on_forward(ForwardReport(("r",), (1 + draft.num_nodes,), 0.01 * (1 + 0.01 * draft.num_nodes)))
        truth = [successor(last)]
        while len(truth) < 10:
            truth.append(successor(truth[-1]))
        accepted = follow(draft.parents, draft.token_ids, truth)
        # the target's top-2 at token t: [its successor, t + 100 (never right)]
        topk = np.array([[successor(t), t + 100] for t in [last] + draft.token_ids.tolist()])
        drafter.observe("r", VerifyOutput(draft, np.array(accepted, np.int64), topk))
        drafter.extend("r", truth[: len(accepted) + 1])
    counts = drafter.sizer.calibrator._counts  # kind -> [accepted, seen, clock]
    by_rank = {rank: [sum(c[i] for kind, c in counts.items() if kind[3] == rank) for i in (0, 1)] for rank in (0, 1)}
    assert by_rank[0][0] / by_rank[0][1] > 0.95  # rank 0 is always right
    assert by_rank[1][1] > 0 and by_rank[1][0] == 0  # rank 1 never
    # the tree follows: rank-0 chains as deep as the budget allows, the rank-1 siblings gated out
    assert sizes[-1] == 8
    drafter.stop("r")


def test_shared_table_crosses_requests_only_when_asked():
    for shared, expect in ((True, [8]), (False, [])):
        drafter = RecycleDrafter(shared=shared, adaptive=False)
        drafter.start("a", [1, 2])
        drafter.observe("a", VerifyOutput(Draft.empty(), np.zeros(0, np.int64), np.arange(8, 16)[None]))
        drafter.extend("a", [8])
        drafter.stop("a")
        drafter.start("b", [5, 2])
        assert drafter.propose("b", Budget(1, 1)).token_ids.tolist() == expect
        drafter.stop("b")


def test_options_and_lifecycle():
    assert isinstance(make("recycle", top_k=4), RecycleDrafter) and make("recycle", top_k=4).observe_top_k == 4
    check_drafter_options(RecycleDrafter, ({"top_k": 0}, {"shared": 1}, {"vocab_size": 0}, {"max_depth": 0},
                                           {"min_prob": 2.0}, {"seed_text": "yes"}, {"adaptive": None},
                                           {"prior_cost_slope": -1}))


# ------------------------------------------------------------------------ end to end
def test_learns_a_cycle_on_a_tiny_model(tiny_llama):
    prompt = torch.arange(10, 40).repeat(3)[None]
    gen = dict(max_new_tokens=60, do_sample=False)
    plain = plain_generate(tiny_llama, prompt, **gen)
    out, stats = patched_generate(tiny_llama, RecycleDrafter(adaptive=False), prompt, **gen)
    assert out.tolist() == plain.tolist()
    assert stats.per_drafter["recycle"].accepted > 0 and stats.tau > 1.2
