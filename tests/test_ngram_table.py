"""The n-gram table drafter against its naive twin; memory bound, text-only learning, sharing across requests."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freespec.draft import Budget
from freespec.drafters import make
from freespec.drafters.ngram_table import NgramTable, NgramTableDrafter

import naive_lookup

FAST = settings(max_examples=60, deadline=None)
small_texts = st.lists(st.integers(0, 3), min_size=1, max_size=30)


@FAST
@given(st.lists(small_texts, min_size=1, max_size=3), small_texts, st.integers(1, 3), st.integers(0, 2))
def test_lookup_matches_naive(sequences, tail, min_n, extra_n):
    max_n = min_n + extra_n
    table = NgramTable(min_n, max_n, max_entries=10_000, max_next=8)
    for seq in sequences:
        table.learn(np.asarray(seq, np.int32), 0)
    counts = table.lookup(np.asarray(tail, np.int32).tobytes())
    assert counts == naive_lookup.ngram_next_counts(sequences, tail, min_n, max_n)


@FAST
@given(st.lists(small_texts, min_size=1, max_size=3), st.lists(st.integers(0, 3), min_size=1, max_size=8),
       st.integers(1, 3), st.sampled_from([0.05, 0.2]))
def test_tree_is_every_path_above_min_prob(sequences, prompt, max_n, min_prob):
    # requests learned one after the other: the table is shared, so all of them feed the last one
    drafter = NgramTableDrafter(min_n=1, max_n=max_n, min_prob=min_prob, max_next=8)
    for i, seq in enumerate(sequences):
        drafter.start(i, seq[:3])
        drafter.extend(i, seq[3:])
        drafter.stop(i)
    drafter.start("q", prompt)
    budget = Budget(num_nodes=100_000, max_depth=3)
    draft = drafter.propose("q", budget).validate(budget)
    scores = [] if draft.confidence is None else draft.confidence.tolist()
    got = {tuple(p): s for p, s in zip(naive_lookup.paths_to_nodes(draft), scores)}
    want = naive_lookup.ngram_tree(sequences + [prompt], prompt, 1, max_n, min_prob, 3)
    assert got.keys() == want.keys()
    assert all(got[p] == pytest.approx(want[p], rel=1e-5) for p in want)
    assert all(scores[i] <= scores[p] for i, p in enumerate(draft.parents.tolist()) if p >= 0)


@FAST
@given(st.lists(st.integers(0, 50), min_size=20, max_size=200), st.integers(1, 20))
def test_draft_within_budget_and_best_first(text, num_nodes):
    drafter = NgramTableDrafter(min_prob=0.001)
    drafter.start(0, text)
    budget = Budget(num_nodes=num_nodes, max_depth=4)
    small = drafter.propose(0, budget).validate(budget)
    full = drafter.propose(0, Budget(10_000, 4))
    # the kept nodes are the best ones: nothing left out scores above anything kept
    if small.num_nodes == num_nodes and full.num_nodes > num_nodes:
        assert float(small.confidence.min()) >= np.sort(full.confidence)[::-1][num_nodes] - 1e-7


def test_memory_bound_under_many_insertions():
    rng = np.random.default_rng(0)
    table = NgramTable(1, 4, max_entries=500, max_next=3)
    for _ in range(50):
        table.learn(rng.integers(0, 200, 300).astype(np.int32), 0)
        assert len(table) <= 500
        assert max(len(counts) for counts in table.entries.values()) <= 3
    # the most recent text is still there, whole
    recent = rng.integers(0, 200, 40).astype(np.int32)
    table.learn(recent, 0)
    assert table.lookup(recent[:-1].tobytes()) == {int(recent[-1]): 1.0}


def test_learns_text_only():
    # what the target predicts is learned by token recycling's successor table, not here
    assert NgramTableDrafter.observe_top_k == 0
    with pytest.raises(TypeError):
        NgramTableDrafter(observe_top_k=8)


def test_shared_table_learns_across_requests_and_unshared_does_not():
    for shared, expect in ((True, [3, 4]), (False, [])):
        drafter = NgramTableDrafter(shared=shared, min_n=2)
        drafter.start("a", [1, 2, 3, 4])
        drafter.stop("a")
        drafter.start("b", [9, 1, 2])
        assert drafter.propose("b", Budget(8, 2)).token_ids.tolist() == expect


def test_extend_learns_across_the_step_boundary():
    drafter = NgramTableDrafter(min_n=3, max_n=3)
    drafter.start(0, [1, 2])
    drafter.extend(0, [3])
    drafter.extend(0, [4])
    assert drafter.table.lookup(np.array([1, 2, 3], np.int32).tobytes()) == {4: 1.0}
    assert len(drafter.table) == 1


def test_bad_options_and_lifecycle():
    assert isinstance(make("ngram", max_n=3), NgramTableDrafter)
    for options in ({"min_n": 0}, {"min_n": 3, "max_n": 2}, {"max_entries": 0}, {"max_next": 0},
                    {"min_prob": 0.0}, {"min_prob": 1.5}):
        with pytest.raises(ValueError):
            NgramTableDrafter(**options)
    drafter = NgramTableDrafter()
    with pytest.raises(ValueError, match="start"):
        drafter.propose(0, Budget(4, 4))
    drafter.start(0, [1, 2, 1])
    with pytest.raises(ValueError, match="already started"):
        drafter.start(0, [1])
    assert drafter.propose(0, Budget(0, 4)).num_nodes == 0
