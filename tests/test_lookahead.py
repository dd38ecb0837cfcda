"""Lookahead decoding: the n-gram pool against its twin and its memory bound, the Jacobi window's comb
and its position bookkeeping under a target whose predictions depend on position only, the value of a
window node, and the drafter end to end.

Tests whose name holds ``kernel`` are rerun with ``NUMBA_DISABLE_JIT=1`` in a subprocess.
"""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freespec.draft import Budget, Draft
from freespec.drafters import make
from freespec.drafters.base import VerifyOutput
from freespec.drafters.lookahead import JacobiWindow, LookaheadDrafter, LookaheadSource, NgramPool

import naive
from conftest import (check_drafter_options, patched_generate, plain_generate,
                      rerun_kernel_tests_without_jit)

FAST = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------------ the pool vs its twin
@st.composite
def pool_ops(draw):
    ngram, guesses, max_keys = draw(st.integers(2, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    inserts = draw(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(-1, 3), min_size=ngram - 1,
                                                                   max_size=ngram - 1)), max_size=40))
    return ngram, guesses, max_keys, inserts


@FAST
@given(pool_ops(), st.integers(1, 5))
def test_kernel_pool_matches_twin(ops, batch):
    ngram, guesses, max_keys, inserts = ops
    pool, twin = NgramPool(ngram, guesses, max_keys), OrderedDict()
    for start in range(0, len(inserts), batch):  # several inserts per kernel call, in order
        chunk = inserts[start: start + batch]
        pool.insert([key for key, _ in chunk], [gram for _, gram in chunk])
        for key, gram in chunk:
            naive.naive_pool_insert(twin, max_keys, guesses, key, gram)
    strip = lambda gram: list(gram[: gram.index(-1)] if -1 in gram else gram)  # noqa: E731
    assert {key: pool.get(key) for key in range(7) if pool.get(key) or key in twin} == {
        key: [strip(g) for g in grams] for key, grams in twin.items()}
    assert pool.num_keys == len(twin)


def test_kernels_without_jit():
    rerun_kernel_tests_without_jit(__file__)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 100_000), min_size=0, max_size=40), min_size=1, max_size=6),
       st.integers(2, 5), st.integers(1, 4), st.integers(1, 50))
def test_pool_memory_is_bounded(texts, ngram, guesses, max_keys):
    pool, largest = NgramPool(ngram, guesses, max_keys), 0
    fixed = max_keys * (guesses * (ngram - 1) * 4 + 8 + 4 + 8)
    for text in texts:
        pool.seed(text)
        largest = max([largest] + text)
        assert pool.num_keys <= max_keys and pool.counts.max() <= guesses
        assert pool.nbytes <= fixed + 4 * max(1024, 2 * (largest + 1))


def test_worked_examples():
    pool = NgramPool(3, 2, 100)  # NgramPool's docstring
    pool.seed([5, 6, 7, 5, 6, 8])
    assert pool.get(5) == [[6, 8], [6, 7]] and pool.get(9) == []
    pool = NgramPool(3, 2, 1)  # kernels/ngram_pool.py
    pool.insert([5, 5, 5], [[6, 7], [8, 9], [6, 7]])
    assert pool.get(5) == [[6, 7], [8, 9]]
    pool.insert([4], [[1, 2]])
    assert pool.get(5) == [] and pool.get(4) == [[1, 2]]
    window = JacobiWindow(3, 3)  # JacobiWindow.comb and the module docstring's comb
    window.levels[:] = [[10, 11, 12], [20, 21, 22]]
    window.num_levels = 2
    token_ids, parents = window.comb(3)
    assert token_ids.tolist() == [10, 11, 12, 20, 21, 22] and parents.tolist() == [-1, 0, 1, 0, 1, 2]
    assert Draft(token_ids, parents).depths().tolist() == [1, 2, 3, 2, 3, 4]  # level l, column j: depth j + 1 + l
    assert window.comb(2)[1].tolist() == [-1, 0, 0, 1] and window.top_node(2, 1) == 3


# ------------------------------------------------------------------------ the window's positions
TRUTH = np.arange(1000, 1600)
GUESSED = 99_999  # what the window guesses for a cell it has no output for


@pytest.mark.parametrize("width,ngram", [(1, 2), (3, 3), (5, 4), (4, 5)])
def test_every_cell_holds_its_position_under_a_position_only_target(width, ngram):
    """A target whose prediction at position p is TRUTH[p + 1] whatever the tokens: every window cell
    that came from an output must hold the truth of its own position, whatever was committed, fed or skipped."""
    rng = np.random.default_rng(width * 10 + ngram)
    source = LookaheadSource(window=width, ngram=ngram, guesses=4)
    committed = [12]
    source.start("r", lambda: TRUTH[: committed[0]], successor=lambda token: GUESSED)
    harvested = 0
    for step in range(80):
        n = committed[0]
        options = source.options("r", Budget(64, 48))
        # mostly the whole window; some steps part of it, some none
        num_nodes = options[-1 if rng.random() < 0.7 else rng.integers(len(options))][0] if step % 7 else 0
        prefix = Draft.chain([int(t) for t in TRUTH[n: n + rng.integers(0, 3)]])  # candidates: a true prefix
        draft = source.hang_window("r", prefix, num_nodes).validate()
        assert (~draft.candidate_mask()).sum() == num_nodes
        topk = np.concatenate([[TRUTH[n]], TRUTH[n + draft.depths()]])[:, None]  # row 0: the root's
        before = source.pool_for("r").stamps.max()
        source.observe("r", VerifyOutput(draft, np.arange(prefix.num_nodes), topk))
        harvested += source.pool_for("r").stamps.max() > before
        num_committed = prefix.num_nodes + 1
        committed[0] += num_committed
        source.advance("r", num_committed, successor=lambda token: GUESSED)
        window, root = source._windows["r"], committed[0] - 1
        for level in range(window.num_levels):
            for j in range(width):
                assert window.levels[level, j] in (GUESSED, TRUTH[root + 1 + j + level]), (step, level, j)
    assert window.num_levels == ngram - 1 and harvested > 10
    # every n-gram in the pool under a true token continues it truly, where it is not a guess
    pool = source.pool_for("r")
    true_grams = 0
    for position, key in enumerate(TRUTH[: committed[0] + width].tolist()):
        for gram in pool.get(key):
            assert all(g in (GUESSED, TRUTH[position + 1 + i]) for i, g in enumerate(gram))
            true_grams += position >= 12 and GUESSED not in gram
    assert true_grams > 2  # harvested beyond the prompt's own n-grams


def test_options_fit_the_budget_and_value_follows_credit():
    source = LookaheadSource(window=4, ngram=3)
    source.start("r", lambda: np.arange(10, 30), successor=None)
    assert [m for m, _ in source.options("r", Budget(64, 48))] == [0, 1, 2, 3, 4]  # one level at first
    window = source._windows["r"]
    window.num_levels = 2
    assert [m for m, _ in source.options("r", Budget(64, 48))] == [0, 2, 4, 6, 8]
    assert [m for m, _ in source.options("r", Budget(64, 2))] == [0, 2]  # the comb's depth: columns + 1
    assert [m for m, _ in source.options("r", Budget(5, 48))] == [0, 2, 4]
    assert source.value() == pytest.approx(source.value_prior)
    source._nodes_fed += 100
    source.credit(30)
    assert source.value() == pytest.approx((30 + 64 * 0.05) / 164)


# ------------------------------------------------------------------------ the drafter
def test_drafter_options_and_lifecycle():
    assert isinstance(make("lookahead", window=3, ngram=3), LookaheadDrafter)
    check_drafter_options(LookaheadDrafter, ({"window": 0}, {"ngram": 1}, {"guesses": 0}, {"max_keys": 0},
                                             {"shared": 1}, {"value_prior": 2.0}, {"adaptive": "no"}))


def test_window_rides_and_is_never_accepted(tiny_llama):
    prompt = torch.arange(10, 40).repeat(3)[None]
    gen = dict(max_new_tokens=50, do_sample=False)
    plain = plain_generate(tiny_llama, prompt, **gen)
    out, stats = patched_generate(tiny_llama, LookaheadDrafter(window=4, ngram=3, adaptive=False), prompt, **gen)
    assert out.tolist() == plain.tolist()
    assert stats.noncandidate_tokens > 0 and stats.per_drafter["lookahead"].proposed == stats.draft_tokens
    assert stats.accepted_draft_tokens <= stats.draft_tokens
