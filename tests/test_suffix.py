"""Suffix automaton kernels against their naive twins; the suffix drafter and its shared corpus.

Tests whose name holds ``kernel`` are rerun with ``NUMBA_DISABLE_JIT=1`` in a
subprocess, so the kernels' Python path runs (and is covered) too.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freespec.draft import Budget
from freespec.drafters import make
from freespec.drafters.suffix import RequestHistory, SuffixDrafter
from freespec.kernels.suffix_automaton import SuffixAutomaton
from freespec.kernels.suffix_continuations import continuation_tree, state_continuations
from freespec.kernels.suffix_match import advance_match, occurrence_ends

import naive
from conftest import rerun_kernel_tests_without_jit

FAST = settings(max_examples=60, deadline=None)


@st.composite
def texts(draw, max_len=40):
    """A small-alphabet text (many repeats) and a split of it into append chunks."""
    alphabet = draw(st.integers(2, 5))
    ids = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len))
    chunks, i = [], 0
    while i < len(ids):
        size = draw(st.integers(1, 6))
        chunks.append(ids[i : i + size])
        i += size
    return ids, chunks


# ------------------------------------------------------------------------ kernels vs twins
@FAST
@given(texts())
def test_kernel_append_and_repeated_suffix(case):
    ids, chunks = case
    automaton, seen = SuffixAutomaton(capacity=1), []
    for chunk in chunks:
        automaton.extend(chunk)
        seen += chunk
        assert automaton.num_edges <= automaton.edges.shape[1]  # the kernel never wrote past its arrays
        assert automaton.num_states <= automaton.states.shape[1]
        state, match_len = automaton.repeated_suffix()
        assert match_len == naive.naive_repeated_suffix_len(seen)
        if match_len:
            ends = occurrence_ends(automaton, state, max_ends=len(seen))
            assert sorted(ends.tolist()) == naive.naive_occurrence_ends(seen, seen[len(seen) - match_len :])
    assert automaton.tokens().tolist() == ids
    states = automaton.states
    distinct = sum(int(states[0, v] - states[0, states[1, v]]) for v in range(1, automaton.num_states))
    assert distinct == naive.naive_distinct_substrings(ids)
    assert automaton.num_states <= max(2 * len(ids) - 1, 2) and automaton.num_edges <= max(3 * len(ids) - 4, 3)


@FAST
@given(st.lists(texts(max_len=15), min_size=1, max_size=3), texts(max_len=20))
def test_kernel_advance_match_over_corpus(docs, query):
    automaton, corpus_text = SuffixAutomaton(capacity=1), []
    for doc, _ in docs:
        automaton.extend(doc)
        automaton.add_separator()
        corpus_text += doc + [-1]
    state, match_len, context = 0, 0, []
    for chunk in query[1]:
        state, match_len = advance_match(automaton, state, match_len, chunk)
        context += chunk
        assert match_len == naive.naive_match_len(corpus_text, context)
        if match_len:
            ends = occurrence_ends(automaton, state, max_ends=100)
            tail = context[len(context) - match_len :]
            assert sorted(ends.tolist()) == naive.naive_occurrence_ends(corpus_text, tail)
            capped = occurrence_ends(automaton, state, max_ends=2)
            assert len(capped) == min(2, len(ends)) and set(capped.tolist()) <= set(ends.tolist())


@FAST
@given(texts(max_len=30), st.integers(1, 4), st.integers(0, 12), st.integers(1, 6),
       st.sampled_from([0.0, 0.2, 0.5]))
def test_kernel_continuation_tree(case, pattern_len, num_nodes, max_depth, min_prob):
    ids = case[0]
    text = ids[: len(ids) // 2] + [-1] + ids[len(ids) // 2 :]
    ends = naive.naive_occurrence_ends(text, ids[-pattern_len:])[::-1]
    token_ids, parents, scores = continuation_tree(np.asarray(text), np.asarray(ends, np.int64), max_depth,
                                                   num_nodes, min_prob)
    want = naive.naive_continuation_tree(text, ends, max_depth, num_nodes, min_prob) if ends else ([], [], [])
    assert token_ids.tolist() == want[0] and parents.tolist() == want[1]
    np.testing.assert_allclose(scores, want[2], rtol=1e-6)


@FAST
@given(st.lists(texts(max_len=15), min_size=1, max_size=3), texts(max_len=20), st.integers(1, 8), st.integers(0, 12),
       st.integers(1, 6), st.sampled_from([0.0, 0.2, 0.5]))
def test_kernel_state_continuations_is_ends_then_tree(docs, query, max_ends, num_nodes, max_depth, min_prob):
    """The fused kernel drafters run: ``continuation_tree`` over ``occurrence_ends``, separators included."""
    automaton = SuffixAutomaton(capacity=1)
    for doc, _ in docs:
        automaton.extend(doc)
        automaton.add_separator()
    state, match_len = advance_match(automaton, 0, 0, query[0])
    if not match_len:
        return
    ends = occurrence_ends(automaton, state, max_ends)
    want = continuation_tree(automaton.tokens(), ends, max_depth, num_nodes, min_prob)
    got = state_continuations(automaton, state, max_ends, max_depth, num_nodes, min_prob)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    with pytest.raises(ValueError, match="non-root state"):
        state_continuations(automaton, 0, max_ends, max_depth, num_nodes, min_prob)


def test_kernel_grows_with_a_large_vocabulary():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1 << 30, 200)
    ids = np.concatenate([ids, ids[50:90], rng.integers(0, 1 << 30, 30), ids[50:90]])
    automaton = SuffixAutomaton(capacity=1)
    for chunk in np.array_split(ids, 17):
        automaton.extend(chunk)
    state, match_len = automaton.repeated_suffix()
    assert match_len == 40
    assert sorted(occurrence_ends(automaton, state, 10).tolist()) == [89, 239]
    assert automaton.nbytes > 0 and automaton.num_tokens == ids.size


def test_kernel_bad_input():
    automaton = SuffixAutomaton()
    with pytest.raises(ValueError, match="outside"):
        automaton.extend([1, -3])
    with pytest.raises(ValueError, match="1-D"):
        automaton.extend([[1, 2]])
    with pytest.raises(ValueError, match="1-D"):
        automaton.extend([1.5])
    automaton.extend([1, 2, 1])
    with pytest.raises(ValueError, match="non-root"):
        occurrence_ends(automaton, 0, 4)
    with pytest.raises(ValueError, match="not a state"):
        advance_match(automaton, 99, 0, [1])
    with pytest.raises(ValueError, match="min_prob"):
        continuation_tree([1, 2], [0], 2, 2, min_prob=1.5)
    with pytest.raises(ValueError, match="ends"):
        continuation_tree([1, 2], [5], 2, 2)


def test_kernels_under_disable_jit():
    rerun_kernel_tests_without_jit(__file__)


# ------------------------------------------------------------------------ the drafter
def _is_continuation(text, tail, path) -> bool:
    """Some occurrence of ``tail`` in ``text`` is followed by ``path``."""
    n, k = len(tail), len(path)
    return any(text[end - n + 1 : end + 1] == tail and text[end + 1 : end + 1 + k] == path
               for end in range(n - 1, len(text)))


@FAST
@given(texts(max_len=60), st.integers(0, 10), st.integers(1, 6), st.integers(1, 3))
def test_draft_is_a_valid_tree_of_real_continuations(case, num_nodes, max_depth, min_match):
    ids, chunks = case
    drafter = SuffixDrafter(min_match=min_match, min_prob=0.0)
    drafter.start("r", chunks[0])
    context = list(chunks[0])
    for chunk in chunks[1:] + [[]]:
        budget = Budget(num_nodes, max_depth)
        draft = drafter.propose("r", budget).validate(budget)
        match_len = naive.naive_repeated_suffix_len(context)
        if match_len < min_match or num_nodes == 0:
            assert draft.num_nodes == 0
        else:
            assert draft.num_nodes == min(num_nodes, len(naive.naive_continuation_counts(
                context, naive.naive_occurrence_ends(context, context[len(context) - match_len :]), max_depth)))
            for path in draft.paths():
                assert _is_continuation(context, context[len(context) - match_len :], path)
            children = draft.parents >= 0
            assert np.all(draft.confidence[children] <= draft.confidence[draft.parents[children]])
            assert set(draft.sources) == {"suffix"}
        drafter.extend("r", chunk)
        context += chunk
    drafter.stop("r")


def test_docstring_example_and_min_prob():
    drafter = SuffixDrafter()
    drafter.start(0, [7, 1, 2, 3, 9, 1, 2, 4, 1, 2])
    draft = drafter.propose(0, Budget(4, 2))
    assert sorted(draft.paths()) == [[3, 9], [4, 1]] and draft.confidence.tolist() == [0.5] * 4
    drafter.stop(0)
    drafter = SuffixDrafter(min_prob=0.3)  # [1, 2] is followed by 3 twice and by 4 once
    drafter.start(0, [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    assert drafter.propose(0, Budget(8, 1)).token_ids.tolist() == [3, 4]
    drafter.stop(0)
    drafter = SuffixDrafter(min_prob=0.5)
    drafter.start(0, [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    assert drafter.propose(0, Budget(8, 1)).token_ids.tolist() == [3]


def test_lifecycle_errors():
    drafter = SuffixDrafter()
    with pytest.raises(ValueError, match="not active"):
        drafter.propose("x", Budget(4, 4))
    drafter.start("x", [1, 2, 1, 2])
    with pytest.raises(ValueError, match="already started"):
        drafter.start("x", [1])
    with pytest.raises(ValueError, match="token ids"):
        drafter.extend("x", [-1])
    drafter.stop("x")
    for call in (lambda: drafter.extend("x", [1]), lambda: drafter.stop("x")):
        with pytest.raises(ValueError, match="not active"):
            call()
    assert drafter.suffix._requests == {}


@pytest.mark.parametrize("options, message", [
    ({"min_match": 0}, "min_match"), ({"max_depth": 0}, "max_depth"), ({"max_occurrences": 0}, "max_occurrences"),
    ({"min_prob": 1.5}, "min_prob"), ({"min_prob": "a"}, "min_prob"),
    ({"history_tokens": -1}, "history_tokens"), ({"history_tokens": 1}, "history_tokens"),
    ({"min_match": 2.5}, "min_match"), ({"min_match": True}, "min_match"), ({"history": 3}, "history"),
    ({"history": RequestHistory(10), "history_tokens": 10}, "either"), ({"bogus": 1}, "bad drafter_options"),
])
def test_option_validation(options, message):
    with pytest.raises(ValueError, match=message):
        make("suffix", **options) if "bogus" in options else SuffixDrafter(**options)


def test_no_state_leaks_without_corpus_and_sharing_with_one():
    shared = RequestHistory(1000)
    for drafter, drafts in ((SuffixDrafter(), False), (SuffixDrafter(history=shared), True)):
        drafter.start("a", [50, 51])
        drafter.extend("a", [1, 2, 3, 4, 5])
        drafter.stop("a")
        drafter.start("b", [9, 1, 2])
        draft = drafter.propose("b", Budget(8, 8))
        assert draft.paths() == ([[3, 4, 5]] if drafts else [])
        drafter.stop("b")
    other = SuffixDrafter(history=shared)  # a second drafter sees what the first one indexed
    other.start("c", [7, 3, 4])
    assert other.propose("c", Budget(8, 8)).paths() == [[5]]
    assert 50 not in shared.automaton.tokens().tolist()  # prompts are not indexed by default


def test_corpus_match_follows_corpus_changes():
    drafter = SuffixDrafter(history_tokens=100, history_prompts=True)
    drafter.start("live", [8, 8, 6])
    assert drafter.propose("live", Budget(4, 4)).num_nodes == 0
    drafter.start("done", [6, 7])  # finished while "live" runs: its match re-syncs
    drafter.extend("done", [1, 2, 6, 7, 3])
    drafter.stop("done")
    drafter.extend("live", [7])
    assert sorted(drafter.propose("live", Budget(8, 2)).paths()) == [[1, 2], [3]]
    drafter.extend("live", [1])
    assert drafter.propose("live", Budget(8, 4)).paths() == [[2, 6, 7, 3]]
    drafter.extend("live", [2, 6, 7])  # own text now matches [6, 7] too: both sources merge
    draft = drafter.propose("live", Budget(8, 4)).validate(Budget(8, 4))
    assert sorted(draft.paths()) == [[1, 2, 6, 7], [3]]


@FAST
@given(st.lists(st.integers(0, 30), max_size=25), st.integers(2, 40), st.booleans())
def test_shared_corpus_eviction_is_bounded_fifo(doc_sizes, max_tokens, include_prompts):
    corpus = RequestHistory(max_tokens, include_prompts=include_prompts)
    added = []
    for i, size in enumerate(doc_sizes):
        doc = [i] * size
        corpus.add(doc)
        if size:
            added.append(doc[-(max_tokens - 1):])
        assert corpus.num_tokens <= max_tokens
        kept = added[len(added) - corpus.num_documents :]  # the newest documents, in order
        assert corpus.num_tokens == sum(len(d) + 1 for d in kept)
        assert corpus.automaton.tokens().tolist() == [t for d in kept for t in d + [-1]]
        if added:
            assert kept[-1] == added[-1]


def test_warmup_and_registry():
    drafter = make("suffix", min_match=3)
    assert isinstance(drafter, SuffixDrafter) and drafter.suffix.min_match == 3
    drafter.warmup()
    assert drafter.suffix._requests == {}
    with pytest.raises(ValueError, match="max_tokens"):
        RequestHistory(1)
