"""The corpus drafter against its naive twin; per-request vs shared documents, the token cap."""

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freespec.draft import Budget
from freespec.drafters import make
from freespec.drafters.corpus import DocumentIndex, CorpusDrafter

import naive_lookup

FAST = settings(max_examples=80, deadline=None)
small_docs = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=25), min_size=1, max_size=4)
tails = st.lists(st.integers(0, 3), min_size=0, max_size=12)


def doc_and_start(corpus_docs, starts):
    """Global offsets into the concatenated documents -> sorted (doc index, start in doc)."""
    doc_begins = np.cumsum([0] + [len(d) for d in corpus_docs])
    return sorted((int(np.searchsorted(doc_begins, s, side="right")) - 1,
                   int(s - doc_begins[np.searchsorted(doc_begins, s, side="right") - 1])) for s in starts)


@FAST
@given(small_docs, tails, st.integers(1, 3), st.integers(0, 4))
def test_find_matches_naive(docs, tail, min_match, extra):
    corpus = DocumentIndex(min_match=min_match, max_match=min_match + extra)
    for doc in docs:
        corpus.add(np.asarray(doc, np.int64))
    match_len, starts = corpus.find(np.asarray(tail, np.int64))
    want_len, want_hits = naive_lookup.corpus_longest_match(docs, tail, min_match, min_match + extra)
    assert match_len == want_len
    assert doc_and_start(docs, starts) == sorted(want_hits)


@FAST
@given(small_docs, tails, st.integers(1, 12), st.integers(1, 5))
def test_draft_paths_continue_real_occurrences(docs, tail, num_nodes, max_depth):
    corpus = DocumentIndex(min_match=1, max_match=4)
    for doc in docs:
        corpus.add(doc)
    drafter = CorpusDrafter(corpus, max_occurrences=3)
    drafter.start(0, tail)
    budget = Budget(num_nodes, max_depth)
    draft = drafter.propose(0, budget).validate(budget)
    match_len, hits = naive_lookup.corpus_longest_match(docs, tail, 1, 4)
    continuations = [docs[d][s + match_len :] for d, s in hits]
    for path in naive_lookup.paths_to_nodes(draft):
        assert any(c[: len(path)] == path for c in continuations), path
    if any(continuations):  # a match with something after it drafts at least one node
        assert draft.num_nodes >= 1


def test_large_token_ids_and_many_occurrences():
    rng = np.random.default_rng(0)
    doc = rng.integers(0, 200_000, 3000)
    doc[::10] = 151_000  # a frequent token: hundreds of occurrences
    corpus = DocumentIndex(min_match=1, max_match=6)
    corpus.add(doc)
    match_len, starts = corpus.find(doc[500:506])
    assert match_len == 6 and doc[starts[0] : starts[0] + 6].tolist() == doc[500:506].tolist()
    match_len, found = corpus.continuations(np.array([7, 151_000]), max_depth=3, max_occurrences=16)
    assert match_len == 1 and len(found) == 16
    assert corpus.find(np.array([2**31 - 1]))[0] == 0  # an id beyond the corpus's: no match


def test_per_request_documents_do_not_leak_and_shared_corpus_does():
    shared = DocumentIndex()
    shared.add([40, 41, 42, 43], doc_key="readme")
    drafter = CorpusDrafter(shared)
    other = CorpusDrafter(shared)  # the same corpus object serves a second drafter
    drafter.start("a", [1, 10, 11])
    drafter.start("b", [2, 10, 11])
    drafter.add_documents("a", [[10, 11, 12, 13]])
    assert drafter.propose("a", Budget(8, 4)).token_ids.tolist() == [12, 13]
    assert drafter.propose("b", Budget(8, 4)).num_nodes == 0
    other.start("c", [9, 41, 42])
    assert other.propose("c", Budget(8, 4)).token_ids.tolist() == [43]
    drafter.stop("a")
    drafter.start("a", [1, 10, 11])  # the request's documents went with stop()
    assert drafter.propose("a", Budget(8, 4)).num_nodes == 0


def test_longest_match_wins_between_request_and_shared_documents():
    shared = DocumentIndex(min_match=1)
    shared.add([3, 4, 5, 6])
    drafter = CorpusDrafter(shared)
    drafter.start(0, [2, 3, 4])
    drafter.add_documents(0, [[4, 9]])  # matches only [4]; the shared [3, 4] is longer
    assert drafter.propose(0, Budget(8, 4)).token_ids.tolist() == [5, 6]
    drafter.add_documents(0, [[3, 4, 7]])  # now both match [3, 4]: both draft
    assert sorted(drafter.propose(0, Budget(8, 1)).token_ids.tolist()) == [5, 7]


def test_token_cap_replace_remove_and_text():
    corpus = DocumentIndex(max_tokens=10)
    first = corpus.add([1, 2, 3, 4])
    corpus.add([5, 6, 7, 8], doc_key="b")
    corpus.add([9, 10, 11])  # 11 tokens: the oldest document goes
    assert first not in corpus and "b" in corpus and corpus.num_tokens == 7
    assert corpus.find([1, 2])[0] == 0 and corpus.find([5, 6])[0] == 2
    corpus.add([5, 6, 20], doc_key="b")  # same key: replaced
    assert corpus.continuations([5, 6], 4, 8)[1][0].tolist() == [20]
    corpus.remove("b")
    assert corpus.find([5, 6])[0] == 0 and len(corpus) == 1
    with pytest.raises(ValueError, match="no document"):
        corpus.remove("b")
    with pytest.raises(ValueError, match="max_tokens"):
        corpus.add(list(range(11)))

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return [ord(c) for c in text]

    corpus.add_text("hello", Tokenizer())
    assert corpus.continuations([ord("h"), ord("e")], 8, 8)[1][0].tolist() == [ord(c) for c in "llo"]
    drafter = CorpusDrafter()
    drafter.start(0, [ord("x"), ord("y")])
    drafter.add_documents(0, ["xyz"], tokenizer=Tokenizer())
    assert drafter.propose(0, Budget(4, 4)).token_ids.tolist() == [ord("z")]
    with pytest.raises(ValueError, match="tokenizer"):
        drafter.add_documents(0, ["xyz"])


def test_bad_options_lifecycle_and_missing_dependency(monkeypatch):
    assert isinstance(make("corpus", max_occurrences=4), CorpusDrafter)
    for options in ({"min_match": 0}, {"min_match": 3, "max_match": 2}, {"max_occurrences": 0},
                    {"max_request_tokens": 0}, {"documents": [1, 2]}, {"documents": DocumentIndex(), "max_match": 5}):
        with pytest.raises(ValueError):
            CorpusDrafter(**options)
    assert CorpusDrafter(DocumentIndex(max_match=5)).documents.max_match == 5
    drafter = CorpusDrafter()
    with pytest.raises(ValueError, match="start"):
        drafter.add_documents(0, [[1, 2]])
    drafter.start(0, [1, 2])
    assert drafter.propose(0, Budget(4, 4)).num_nodes == 0  # no documents at all
    with pytest.raises(ValueError, match="1-D"):
        drafter.add_documents(0, [[[1, 2]]])
    monkeypatch.setitem(sys.modules, "ahocorasick", None)
    corpus = DocumentIndex()
    corpus.add([1, 2, 3])
    with pytest.raises(ImportError, match="pip install pyahocorasick"):
        corpus.find([1, 2])


def test_occurrences_at_document_ends_do_not_take_sample_slots():
    index = DocumentIndex(min_match=1, max_match=4)
    for doc in ([0], [0], [0, 0]):
        index.add(doc)
    match_len, found = index.continuations([0], max_depth=3, max_occurrences=3)
    assert match_len == 1 and [f.tolist() for f in found] == [[0]]
