"""The SGLang corpus adapter without SGLang: tree format, request state and its release, multimodal
prompts, determinism across processes (tensor parallelism), external corpora under threads, the
benchmark, options.

``check_sglang_tree`` states the contract SGLang's NGRAM worker relies on (read
from sglang 0.5.21 and its C++ NgramCorpus); test_sglang_plugin.py checks
SGLang's own corpus against the same function.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from freespec import drafters
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.integrations.sglang import DraftServer, enabled, options, to_sglang_tree, write_sglang_trees


# ---------------------------------------------------------------- the contract
def check_sglang_tree(token_ids, mask, root_token_ids, num_draft_tokens):
    """Assert SGLang's draft format; return each row's real tree as (tokens, parents) without padding.

    Per request ``b`` (``D = num_draft_tokens``): node 0 is the last committed
    token; ``mask[i][j] = 1`` iff ``j`` is ``i`` or an ancestor of ``i``
    (parents before children: lower triangular); real nodes in BFS order;
    unused slots are token 0 directly under node 0, after the real nodes.
    """
    batch_size, d = len(root_token_ids), num_draft_tokens
    assert isinstance(token_ids, np.ndarray) and isinstance(mask, np.ndarray)
    assert token_ids.dtype == np.int64 and mask.dtype == np.int64
    assert token_ids.shape == (batch_size * d,) and mask.shape == (batch_size * d * d,)
    assert set(np.unique(mask).tolist()) <= {0, 1}
    trees = []
    for b in range(batch_size):
        tokens = token_ids[b * d:(b + 1) * d]
        rows = mask[b * d * d:(b + 1) * d * d].reshape(d, d)
        assert tokens[0] == root_token_ids[b]
        assert rows[0].tolist() == [1] + [0] * (d - 1)
        assert np.array_equal(rows, np.tril(rows)), "a node sees a later node"
        assert np.all(np.diag(rows) == 1) and np.all(rows[:, 0] == 1)
        parents = [-1]
        for i in range(1, d):
            strict = np.nonzero(rows[i, :i])[0]
            parent = int(strict[-1])
            expected = rows[parent].copy()
            expected[i] = 1
            assert np.array_equal(rows[i], expected), f"row {i} is not its parent's ancestors plus itself"
            parents.append(parent)
        depths = rows.sum(1) - 1
        # padding: trailing token-0 children of the root; they may follow deeper real nodes
        num_real = d
        while num_real > 1 and tokens[num_real - 1] == 0 and parents[num_real - 1] == 0:
            num_real -= 1
        real_parents = parents[1:num_real]
        assert all(np.diff(depths[1:num_real]) >= 0), f"not BFS: depths {depths[:num_real].tolist()}"
        assert real_parents == sorted(real_parents), f"not BFS: parents {real_parents}"
        siblings = {(p, int(t)) for p, t in zip(real_parents, tokens[1:num_real])}
        assert len(siblings) == num_real - 1, "two siblings carry the same token"
        trees.append((tokens[1:num_real].tolist(), [p - 1 for p in real_parents]))
    return trees


def tree_paths(token_ids, parents):
    return sorted(Draft(np.asarray(token_ids, np.int64), np.asarray(parents, np.int32)).paths()) \
        if token_ids else []


def random_draft(rng, num_nodes, vocab_size=6, with_scores=True):
    """A random well-formed tree: topological parents, distinct sibling tokens, monotone scores."""
    token_ids, parents, used = [], [], set()
    for i in range(num_nodes):
        for _ in range(20):
            parent = int(rng.integers(-1, i)) if i else -1
            token = int(rng.integers(1, vocab_size + 1))  # no token 0: it would read as padding
            if (parent, token) not in used:
                break
        else:
            continue
        used.add((parent, token))
        token_ids.append(token)
        parents.append(parent)
    scores = None
    if with_scores:
        scores = rng.random(len(token_ids)).astype(np.float32)
        for i, parent in enumerate(parents):
            if parent >= 0:
                scores[i] = min(scores[i], scores[parent])
    return Draft(np.asarray(token_ids, np.int64), np.asarray(parents, np.int32), scores)


# ---------------------------------------------------------- tree conversion
def test_worked_example():
    tokens, mask = to_sglang_tree(Draft(np.array([5, 6, 8, 7]), np.array([-1, 0, 0, 1])), 4, 6)
    assert tokens.tolist() == [4, 5, 6, 8, 7, 0]
    assert [set(np.nonzero(r)[0].tolist()) for r in mask] == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 1, 2, 4},
                                                             {0, 5}]


def test_chain_is_lower_triangle_of_ones():
    tokens, mask = to_sglang_tree(Draft.chain([7, 8, 9]), 3, 4)
    assert tokens.tolist() == [3, 7, 8, 9]
    assert np.array_equal(mask, np.tril(np.ones((4, 4), np.int64)))


def test_not_candidate_nodes_never_reach_sglang():
    # root 4 -> 5 -> {6, [9] -> [3]}: 9 and 3 ride in freespec's forward only
    draft = Draft(np.array([5, 6, 9, 3]), np.array([-1, 0, 0, 2]), is_candidate=np.array([1, 1, 0, 0], bool))
    tokens, mask = to_sglang_tree(draft, 4, 5)
    assert tokens.tolist() == [4, 5, 6, 0, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 0, 0, 0, 1]]


def test_empty_draft_is_all_padding_and_d1_is_root_only():
    tokens, mask = to_sglang_tree(Draft.empty(), 11, 3)
    assert tokens.tolist() == [11, 0, 0]
    assert mask.tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    tokens, mask = to_sglang_tree(Draft.chain([1, 2]), 11, 1)
    assert tokens.tolist() == [11] and mask.tolist() == [[1]]


@pytest.mark.parametrize("seed", range(40))
def test_random_trees(seed):
    rng = np.random.default_rng(seed)
    d = int(rng.integers(1, 20))
    draft = random_draft(rng, int(rng.integers(0, 30)), with_scores=bool(seed % 2))
    root = int(rng.integers(0, 50))
    tokens, mask = to_sglang_tree(draft, root, d)
    ((real_tokens, real_parents),) = check_sglang_tree(tokens.reshape(-1), mask.reshape(-1), [root], d)
    kept = draft if draft.num_nodes <= d - 1 else draft.prune(d - 1)
    assert len(real_tokens) <= d - 1
    assert tree_paths(real_tokens, real_parents) == sorted(kept.paths())
    assert sorted(real_tokens) == sorted(kept.token_ids.tolist())


def test_prune_keeps_best_scores():
    draft = Draft(np.array([1, 2, 3, 4]), np.array([-1, -1, 0, 1]), np.array([0.9, 0.2, 0.8, 0.1]))
    tokens, mask = to_sglang_tree(draft, 0, 3)  # two slots: 1 (0.9) and its child 3 (0.8)
    ((real_tokens, real_parents),) = check_sglang_tree(tokens, mask.reshape(-1), [0], 3)
    assert real_tokens == [1, 3] and real_parents == [-1, 0]


def test_rejects_malformed_drafts_naming_the_request():
    with pytest.raises(ValueError, match="request 0 is malformed: two children of one node carry the same token"):
        to_sglang_tree(Draft(np.array([1, 1]), np.array([-1, -1])), 0, 4)
    good = Draft.chain([1, 2])
    with pytest.raises(ValueError, match="request 1 is malformed: parents must satisfy"):
        write_sglang_trees([good, Draft(np.array([1, 2]), np.array([-1, 1]))], [0, 0], 4)
    with pytest.raises(ValueError, match="request 1 is malformed: token ids must be non-negative"):
        write_sglang_trees([good, Draft(np.array([1, -2]), np.array([-1, 0]))], [0, 0], 4)
    with pytest.raises(ValueError, match="2 token_ids but 3 parents"):
        write_sglang_trees([Draft(np.array([1, 2]), np.array([-1, 0, 1]))], [0], 4)
    with pytest.raises(ValueError, match="2 drafts for 1 root tokens"):
        write_sglang_trees([good, good], [0], 4)


@pytest.mark.parametrize("seed", range(10))
def test_batch_is_the_rows_of_each_draft(seed):
    rng = np.random.default_rng(seed)
    d, batch_size = int(rng.integers(1, 20)), int(rng.integers(0, 12))
    drafts = [random_draft(rng, int(rng.integers(0, 30)), with_scores=bool(i % 2)) for i in range(batch_size)]
    roots = rng.integers(0, 50, batch_size).tolist()
    tokens, mask = write_sglang_trees(drafts, roots, d)
    check_sglang_tree(tokens, mask, roots, d)
    for b, (draft, root) in enumerate(zip(drafts, roots)):
        row_tokens, row_mask = to_sglang_tree(draft, root, d)
        assert np.array_equal(tokens[b * d:(b + 1) * d], row_tokens)
        assert np.array_equal(mask[b * d * d:(b + 1) * d * d], row_mask.reshape(-1))


def test_token_bound_drops_nodes_and_their_subtrees():
    # root 4 -> 5 -> {1000007 -> 8, 6}: 1000007 is an image-padding value, 8 hangs under it
    draft = Draft(np.array([5, 1000007, 6, 8]), np.array([-1, 0, 0, 1]))
    tokens, mask = to_sglang_tree(draft, 4, 6, token_bound=1000)
    ((real_tokens, real_parents),) = check_sglang_tree(tokens, mask.reshape(-1), [4], 6)
    assert real_tokens == [5, 6] and real_parents == [-1, 0]
    tokens, _ = to_sglang_tree(draft, 4, 6)  # no bound: all four are kept
    assert tokens.tolist() == [4, 5, 1000007, 6, 8, 0]


# ------------------------------------------------------------ request state
class RecordingDrafter(Drafter):
    """Proposes a random tree and records what it is told."""

    name = "recording"

    def __init__(self, seed=0):
        super().__init__()
        self.rng = np.random.default_rng(seed)
        self.events = []

    def _on_start(self, request_id):
        self.events.append(("start", request_id, self.context(request_id).tolist()))

    def _on_extend(self, request_id, ids):
        self.events.append(("extend", request_id, ids.tolist()))

    def _on_stop(self, request_id):
        self.events.append(("stop", request_id, self.context(request_id).tolist()))

    def _propose(self, request_id, budget: Budget) -> Draft:
        return random_draft(self.rng, int(self.rng.integers(0, 2 * budget.num_nodes + 1)))


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setitem(drafters._REGISTRY, "recording", f"{__name__}:RecordingDrafter")
    return "recording"


def test_docstring_example_offered_then_incremental(recording):
    corpus = DraftServer(max_trie_depth=4, draft_token_num=5, drafter=recording)
    corpus.offer_contexts([("r", [5, 6, 7, 8], [9, 1, 2])])
    corpus.batch_get(["r"], [[9, 1, 2, 3]], [8])
    assert corpus.drafter.context("r").tolist() == [5, 6, 7, 8, 9, 1, 2, 3]
    corpus.batch_get(["r"], [[2, 3, 4, 5]], [10])
    assert corpus.drafter.events[-1] == ("extend", "r", [4, 5])
    corpus.batch_get(["r"], [[2, 3, 4, 5]], [10])  # nothing new: nothing told
    assert len(corpus.drafter.events) == 2 and corpus.num_restarts == 0


def test_tail_only_start_and_restart_on_mismatch(recording):
    corpus = DraftServer(max_trie_depth=4, draft_token_num=4, drafter=recording)
    corpus.batch_get(["r"], [[1, 2, 3, 4]], [100])  # no offered context: the tail is all it knows
    assert corpus.drafter.context("r").tolist() == [1, 2, 3, 4]
    corpus.batch_get(["r"], [[9, 9, 5, 6]], [102])  # [9, 9] contradicts [3, 4]
    assert corpus.num_restarts == 1 and corpus.drafter.context("r").tolist() == [9, 9, 5, 6]
    corpus.batch_get(["r"], [[1, 2, 3, 4]], [110])  # 8 new tokens, 4 visible: a gap
    assert corpus.num_restarts == 2 and corpus.drafter.context("r").tolist() == [1, 2, 3, 4]
    corpus.batch_get(["r"], [[1, 2]], [50])  # shorter than before (another sequence under the id)
    assert corpus.num_restarts == 3 and corpus.drafter.context("r").tolist() == [1, 2]


def test_erase_and_reset_stop_requests(recording):
    corpus = DraftServer(max_trie_depth=8, draft_token_num=4, drafter=recording)
    corpus.batch_get(["a", "b"], [[1, 2], [3, 4]], [2, 2])
    first = corpus.drafter
    corpus.erase_match_state(["a", "unknown"])
    assert ("stop", "a", [1, 2]) in first.events and "a" not in first._contexts
    corpus.reset()
    assert ("stop", "b", [3, 4]) in first.events
    assert corpus.drafter is not first and not corpus.drafter._contexts  # learned state is gone too
    tokens, mask = corpus.batch_get(["a"], [[7]], [1])  # a returning id starts afresh
    check_sglang_tree(tokens, mask, [7], 4)


@pytest.mark.parametrize("seed", range(8))
def test_simulated_worker_keeps_contexts_in_sync(recording, seed):
    """Drive the corpus as NGRAMWorker does; each drafter context must be the true sequence."""
    rng = np.random.default_rng(seed)
    depth, d = int(rng.integers(2, 10)), int(rng.integers(2, 12))
    corpus = DraftServer(max_trie_depth=depth, draft_token_num=d, drafter=recording)
    sequences = {f"r{i}": list(rng.integers(0, 9, int(rng.integers(1, 40)))) for i in range(4)}
    offered_ok = {rid: bool(rng.integers(0, 2)) for rid in sequences}
    for _step in range(25):
        live = [rid for rid in sequences if rng.random() < 0.8]
        if not live:
            continue
        corpus.offer_contexts([(rid, sequences[rid][:3], sequences[rid][3:]) for rid in live if offered_ok[rid]])
        tails = [sequences[rid][-depth:] for rid in live]
        tokens, mask = corpus.batch_get(live, tails, [len(sequences[rid]) for rid in live])
        check_sglang_tree(tokens, mask, [t[-1] for t in tails], d)
        assert sorted(corpus.drafter._contexts) == sorted(live)  # requests absent from the batch are released
        for rid in live:
            ctx = corpus.drafter.context(rid).tolist()
            assert ctx == sequences[rid][-len(ctx):]
            if offered_ok[rid]:
                assert ctx == sequences[rid]
            sequences[rid] += list(rng.integers(0, 9, int(rng.integers(1, d + 1))))  # accepted + bonus
        corpus.batch_put(tails)


def test_every_exit_releases_request_state(recording):
    """sglang 0.5.11 erases only requests that finish (or are retracted) inside a verify step.

    Here a finishes, b is retracted and comes back, c is aborted while running
    (it finishes in a verify step), d is retracted and then aborted in the
    waiting queue (it never returns): the live-request count still returns to zero.
    """
    corpus = DraftServer(max_trie_depth=4, draft_token_num=4, drafter=recording)
    seqs = {rid: [i + 1, i + 2, i + 3] for i, rid in enumerate("abcd")}

    def step(batch, finished=()):  # one decode step of the 0.5.11 worker: draft, verify, erase finished
        corpus.offer_contexts([(rid, seqs[rid], []) for rid in batch])
        corpus.batch_get(batch, [seqs[rid][-4:] for rid in batch], [len(seqs[rid]) for rid in batch])
        for rid in batch:
            seqs[rid].append(7)
        corpus.erase_match_state([rid for rid in batch if rid in finished])

    step(list("abcd"), finished={"a"})
    assert corpus.num_live_requests == 3
    step(["c"])  # b and d were retracted before this step's forward: never erased by the worker
    assert corpus.num_live_requests == 1 and corpus.drafter.context("c") is not None
    step(["b", "c"], finished={"c"})  # b is back (restarts from its offered context); c's abort finished it
    assert corpus.num_live_requests == 1 and corpus.drafter.context("b").tolist() == seqs["b"][:-1]
    step(["b"], finished={"b"})
    assert corpus.num_live_requests == 0 and not corpus.drafter._contexts
    stops = [event[1] for event in corpus.drafter.events if event[0] == "stop"]
    assert sorted(stops) == ["a", "b", "b", "c", "d"]


SERVABLE = [name for name in drafters.available() if not drafters.drafter_class(name).needs_model]


def _buildable_drafters():
    names = []
    for name in SERVABLE:
        try:
            drafters.make(name)
        except Exception:  # needs options (e.g. a reference) or an optional dependency
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("name", _buildable_drafters())
def test_registered_drafters_meet_the_contract(name):
    rng = np.random.default_rng(1)
    d, depth = 10, 12
    corpus = DraftServer(max_trie_depth=depth, draft_token_num=d, drafter=name)
    phrase = list(rng.integers(0, 20, 6))
    sequences = {"a": phrase * 4, "b": list(rng.integers(0, 20, 30))}
    corpus.offer_contexts([(rid, seq, []) for rid, seq in sequences.items()])
    for _step in range(6):
        rids = list(sequences)
        tails = [sequences[rid][-depth:] for rid in rids]
        tokens, mask = corpus.batch_get(rids, tails, [len(sequences[rid]) for rid in rids])
        check_sglang_tree(tokens, mask, [t[-1] for t in tails], d)
        for rid in rids:
            sequences[rid] += list(rng.integers(0, 20, 2))
    corpus.erase_match_state(list(sequences))


def test_prompt_lookup_drafts_from_the_offered_prompt():
    prompt = [50, 51, 52, 53, 54, 55, 56, 57] + list(range(100, 130)) + [50, 51]
    corpus = DraftServer(max_trie_depth=4, draft_token_num=6, drafter="prompt_lookup")
    corpus.offer_contexts([("r", prompt, [])])
    tokens, mask = corpus.batch_get(["r"], [prompt[-4:]], [len(prompt)])
    ((real_tokens, real_parents),) = check_sglang_tree(tokens, mask, [51], 6)
    assert real_tokens == [52, 53, 54, 55, 56] and real_parents == [-1, 0, 1, 2, 3]


def test_log_lines_show_drafts_being_served(caplog, monkeypatch):
    from freespec.integrations.sglang import draft_server

    monkeypatch.setattr(draft_server, "LOG_EVERY", 3)
    corpus = DraftServer(max_trie_depth=8, draft_token_num=6, drafter="prompt_lookup")
    phrase = list(range(100, 110))
    with caplog.at_level(logging.INFO, logger="freespec"):
        corpus.batch_get(["a"], [[1, 2, 3]], [3])  # nothing to draft yet
        corpus.offer_contexts([("b", phrase + phrase[:3], [])])
        corpus.batch_get(["a", "b"], [[1, 2, 3, 4], (phrase + phrase[:3])[-8:]], [4, 13])
        corpus.batch_get(["b"], [(phrase + phrase[:4])[-8:]], [14])
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["freespec: serving drafts from drafter 'prompt_lookup' (first: 5 nodes for 2 requests)",
                        "freespec: drafter 'prompt_lookup' served 3 decode steps, 2.50 draft nodes per request, "
                        "1 live requests, 0 restarts"]
    assert (corpus.num_steps, corpus.num_rows, corpus.num_drafted) == (3, 4, 10)


# --------------------------------------------------------------- multimodal
IMAGE = 151655  # the image placeholder token the unpadded prompt holds (a vocabulary id)
PADS = ([1_000_017] * 4, [1_003_001] * 4)  # what SGLang writes over two images in origin_input_ids


def _image_prompt(pads=PADS):
    """An image, a phrase, another image, the phrase's start: a match whose continuation is an image."""
    phrase = [10, 11, 12, 13]
    unpadded = [IMAGE] + phrase + [IMAGE] + phrase[:2]
    padded = pads[0] + phrase + pads[1] + phrase[:2]
    return unpadded, padded


@pytest.mark.parametrize("host_counts", ["padded", "unpadded"])  # sglang 0.5.11-0.5.22, then 0.5.23
def test_multimodal_prompt_drafts_from_unpadded_ids(host_counts):
    unpadded, padded = _image_prompt()
    output = [12, 13]
    host_prompt = padded if host_counts == "padded" else unpadded
    corpus = DraftServer(max_trie_depth=4, draft_token_num=8, drafter="prompt_lookup")
    corpus.offer_contexts([("r", host_prompt, output, unpadded)])
    host = host_prompt + output
    tokens, mask = corpus.batch_get(["r"], [host[-4:]], [len(host)])
    assert corpus.drafter.context("r").tolist() == unpadded + output
    ((real_tokens, _),) = check_sglang_tree(tokens, mask, [13], 8)
    assert real_tokens == [IMAGE, 10, 11, 12, 13]  # what followed [12, 13]: the placeholder, not padding
    host += [IMAGE, 10]  # two more tokens: the host's coordinates keep lining up
    corpus.batch_get(["r"], [host[-4:]], [len(host)])
    assert corpus.drafter.context("r").tolist() == unpadded + output + [IMAGE, 10] and corpus.num_restarts == 0


@pytest.mark.parametrize("vocab_size", [None, 200_000])
def test_padding_ids_are_never_drafted(vocab_size):
    """Without the unpadded prompt (a tail-only start, or only padded ids offered), no padding id is drafted."""
    _, padded = _image_prompt(pads=([1 << 40] * 4, [(1 << 40) + 5] * 4))  # 0.5.23 pad values pass 2**31
    output = [12, 13]
    for offered in (None, (padded, output)):
        corpus = DraftServer(max_trie_depth=16, draft_token_num=8, drafter="prompt_lookup")
        if vocab_size:
            corpus.set_vocab_size(vocab_size)
        if offered:
            corpus.offer_contexts([("r", *offered)])
        host = padded + output
        tokens, mask = corpus.batch_get(["r"], [host[-16:]], [len(host)])
        ((real_tokens, _),) = check_sglang_tree(tokens, mask, [13], 8)
        bound = vocab_size or 1_000_000
        assert all(t < bound for t in real_tokens), real_tokens
        assert corpus.drafter.context("r").max() == bound  # padding reads as one id the vocabulary lacks
        assert bound in corpus.drafter.propose("r", Budget(7, 7)).token_ids  # which the drafter does propose
    with pytest.raises(ValueError, match="vocab_size must be in"):
        corpus.set_vocab_size(0)


# ------------------------------------------------------- tensor parallelism
# Options that give each drafter state shared across requests, where it has some
DETERMINISM_OPTIONS = {
    "suffix": {"history_tokens": 4096, "history_prompts": True, "max_occurrences": 4},
    "corpus": {"documents": {"min_match": 2, "max_match": 8}},
    "mixture": {"history_tokens": 4096, "history_prompts": True, "max_occurrences": 4, "ngram": True,
                "documents": {"min_match": 2, "max_match": 8}},
}


def draft_stream_digest(name: str, seed: int = 0) -> str:
    """sha256 of every draft for a scripted request stream: requests start, grow by accepted drafts, leave
    (named in set order, as sglang 0.5.23's worker does), are absent and come back; an external corpus."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, 200, int(rng.integers(3, 9))).tolist() for _ in range(30)]

    def text(num_phrases):
        return [t for i in rng.integers(0, len(phrases), num_phrases) for t in phrases[i]]

    corpus = DraftServer(max_trie_depth=12, draft_token_num=10, drafter=name,
                         drafter_options=DETERMINISM_OPTIONS.get(name, {}))
    if corpus._external.attached:
        corpus.commit_external_corpus_load("docs", corpus.load_external_corpus_named("docs", [text(40), text(40)]))
    sequences = {f"req-{i}": text(int(rng.integers(2, 30))) for i in range(6)}
    digest, next_id = hashlib.sha256(), 6
    for _step in range(40):
        live = [rid for rid in sequences if rng.random() < 0.85]
        corpus.offer_contexts([(rid, sequences[rid], []) for rid in live])
        tokens, mask = corpus.batch_get(live, [sequences[rid][-12:] for rid in live],
                                        [len(sequences[rid]) for rid in live])
        digest.update(tokens.tobytes() + mask.tobytes())
        for row, rid in enumerate(live):  # accept a prefix of the first path, then a bonus token
            path = [int(t) for t in tokens[row * 10 + 1:(row + 1) * 10] if t]
            sequences[rid] += path[:int(rng.integers(0, len(path) + 1))] + text(1)[:1]
        leaving = {rid for rid in live if rng.random() < 0.4}
        corpus.erase_match_state(list(leaving))
        for rid in sorted(leaving):
            del sequences[rid]
            sequences[f"req-{next_id}"] = text(int(rng.integers(2, 30)))
            next_id += 1
    return digest.hexdigest()


@pytest.fixture(scope="module")
def digests_under_other_hash_seeds():
    """Each registered drafter's digest from two processes with different PYTHONHASHSEED (as two TP ranks)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import test_sglang_adapter as t; "
            "from freespec import drafters; print(json.dumps({n: t.draft_stream_digest(n) for n in t.SERVABLE}))")
    out = []
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=env,
                              capture_output=True, text=True, timeout=600, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


@pytest.mark.parametrize("name", SERVABLE)
def test_drafters_are_deterministic(name, digests_under_other_hash_seeds):
    """SGLang does not broadcast NGRAM drafts: every TP rank must draft the same tree from the same calls."""
    here = draft_stream_digest(name)
    assert draft_stream_digest(name) == here  # two instances, same process
    assert [d[name] for d in digests_under_other_hash_seeds] == [here, here]  # other processes, other hash seeds
    assert draft_stream_digest(name, seed=1) != here  # the digest does see the drafts


# ------------------------------------------------------------ external corpus
def test_external_corpus_feeds_the_corpus_drafter():
    corpus = DraftServer(max_trie_depth=6, draft_token_num=5, drafter="corpus",
                            drafter_options={"documents": {"min_match": 2, "max_match": 4}})
    assert corpus.load_external_corpus_named("docs", [[1, 2, 3, 4, 5, 6], [7, 8]]) == 8
    corpus.commit_external_corpus_load("docs", 8)
    assert corpus.list_external_corpora() == {"docs": 8} and corpus.remaining_token_budget == 10000000 - 8
    tokens, mask = corpus.batch_get(["r"], [[9, 1, 2]], [3])
    assert check_sglang_tree(tokens, mask, [2], 5)[0][0] == [3, 4, 5, 6]
    corpus.reset()  # external corpora survive a reset
    tokens, mask = corpus.batch_get(["r"], [[9, 1, 2]], [3])
    assert check_sglang_tree(tokens, mask, [2], 5)[0][0] == [3, 4, 5, 6]
    with pytest.raises(ValueError, match="already exists"):
        corpus.load_external_corpus_named("docs", [[1]])
    corpus.remove_external_corpus("docs")
    assert corpus.list_external_corpora() == {}
    with pytest.raises(ValueError, match="budget"):
        DraftServer(drafter="corpus", drafter_options={"documents": {}},
                       external_corpus_max_tokens=3).load_external_corpus_named("big", [[1, 2, 3, 4]])


def test_external_corpus_needs_a_shared_corpus():
    with pytest.raises(ValueError, match="no shared document index"):
        DraftServer(drafter="prompt_lookup").load_external_corpus_named("docs", [[1, 2, 3]])


def _corpus_server(**kwargs):
    return DraftServer(max_trie_depth=6, draft_token_num=5, drafter="corpus",
                       drafter_options={"documents": {"min_match": 2, "max_match": 4, **kwargs}})


def _drafted(corpus, tail):
    tokens, mask = corpus.batch_get(["r"], [tail], [len(tail)])
    corpus.erase_match_state(["r"])
    return check_sglang_tree(tokens, mask, [tail[-1]], 5)[0][0]


@pytest.fixture
def index_builds(monkeypatch):
    """(thread name, inside batch_get) of every DocumentIndex build."""
    from freespec.drafters.corpus import DocumentIndex

    builds, drafting, build, batch_get = [], threading.local(), DocumentIndex._build, DraftServer.batch_get

    def recording_build(self):
        builds.append((threading.current_thread().name, getattr(drafting, "on", False)))
        return build(self)

    def recording_batch_get(self, *args):
        drafting.on = True
        try:
            return batch_get(self, *args)
        finally:
            drafting.on = False

    monkeypatch.setattr(DocumentIndex, "_build", recording_build)
    monkeypatch.setattr(DraftServer, "batch_get", recording_batch_get)
    return builds


def test_external_corpus_loads_on_a_thread_while_the_scheduler_drafts(index_builds):
    """As SGLang's ExternalCorpusManager: load on a thread, draft meanwhile, commit from the scheduler thread."""
    corpus = _corpus_server()
    rng = np.random.default_rng(0)
    chunks = [rng.integers(10, 5000, 2000).tolist() for _ in range(10)] + [[1, 2, 3, 4, 5, 6]]
    loaded = {}
    loader = threading.Thread(target=lambda: loaded.update(n=corpus.load_external_corpus_named("docs", chunks)),
                              name="loader")
    loader.start()
    while loader.is_alive():  # the scheduler keeps drafting: never from a half-built index, never building one
        assert _drafted(corpus, [9, 1, 2]) == []
    loader.join()
    assert loaded["n"] == 20006 and corpus.list_external_corpora() == {}  # loaded, not served until committed
    corpus.commit_external_corpus_load("docs", loaded["n"])
    assert _drafted(corpus, [9, 1, 2]) == [3, 4, 5, 6]
    assert corpus.list_external_corpora() == {"docs": 20006}
    assert ("loader", False) in index_builds and not any(in_batch_get for _, in_batch_get in index_builds)


def test_remove_is_never_half_done(index_builds):
    corpus = _corpus_server(max_tokens=20)
    corpus.commit_external_corpus_load("a", corpus.load_external_corpus_named("a", [[1, 2, 3, 4, 5, 6]] * 2))
    # a corpus that would make the shared index evict another corpus's documents is refused, whole
    with pytest.raises(ValueError, match=r"'b' exceeds the shared document index's max_tokens \(8\)"):
        corpus.load_external_corpus_named("b", [[7, 8, 9, 10, 11]] * 2)
    assert corpus.list_external_corpora() == {"a": 12} and _drafted(corpus, [9, 1, 2]) == [3, 4, 5, 6]
    corpus.commit_external_corpus_load("c", corpus.load_external_corpus_named("c", [[7, 8, 9, 10, 11]]))
    corpus.remove_external_corpus("a")
    assert corpus.list_external_corpora() == {"c": 5}
    assert _drafted(corpus, [9, 1, 2]) == []  # gone at once
    corpus._external.wait()  # the remaining corpus, re-indexed on a background thread
    assert _drafted(corpus, [9, 7, 8]) == [9, 10, 11] and _drafted(corpus, [9, 1, 2]) == []
    corpus.remove_external_corpus("c")
    assert corpus.list_external_corpora() == {} and _drafted(corpus, [9, 7, 8]) == []
    with pytest.raises(ValueError, match="'c' does not exist"):
        corpus.remove_external_corpus("c")
    assert ("freespec-corpus-rebuild", False) in index_builds
    assert not any(in_batch_get for _, in_batch_get in index_builds)  # never on the decode hot path


def test_remove_while_another_corpus_loads():
    """SGLang leaves this undefined; here the loaded corpus is served without the removed one."""
    corpus = _corpus_server()
    corpus.commit_external_corpus_load("a", corpus.load_external_corpus_named("a", [[1, 2, 3, 4, 5, 6]]))
    count = corpus.load_external_corpus_named("b", [[7, 8, 9, 10, 11]])  # its index holds a as well
    corpus.remove_external_corpus("a")
    corpus.commit_external_corpus_load("b", count)
    corpus._external.wait()
    assert corpus.list_external_corpora() == {"b": 5}
    assert _drafted(corpus, [9, 7, 8]) == [9, 10, 11] and _drafted(corpus, [9, 1, 2]) == []
    with pytest.raises(ValueError, match="'b' was not loaded, or was committed already"):
        corpus.commit_external_corpus_load("b", count)


def test_corpora_come_and_go_while_drafting(index_builds):
    """Loader threads, commits and removals from the scheduler thread, drafting throughout: nothing breaks."""
    corpus = _corpus_server()
    rng = np.random.default_rng(1)
    pending, served = None, []
    for step in range(300):
        if pending is None and step % 20 == 0:
            corpus_id = f"c{step}"
            chunk = [step // 20 + 1000, 1, 2] + rng.integers(10, 500, 300).tolist()
            pending = (corpus_id, threading.Thread(target=corpus.load_external_corpus_named, args=(corpus_id, [chunk])))
            pending[1].start()
        elif pending is not None and not pending[1].is_alive():
            corpus.commit_external_corpus_load(pending[0], 303)
            served.append(pending[0])
            pending = None
        if len(served) > 2:
            corpus.remove_external_corpus(served.pop(0))
        tail = [int(rng.integers(1000, 1016)), 1, 2]
        for token in _drafted(corpus, tail):
            assert token < 1000  # never a corpus's first token: drafts follow [.., 1, 2] in some corpus
        assert sorted(corpus.list_external_corpora()) == sorted(served)
    corpus._external.wait()
    assert not any(in_batch_get for _, in_batch_get in index_builds)


# ---------------------------------------------------------------- benchmark
def test_bench_makes_the_same_calls_on_every_corpus():
    from freespec.integrations.sglang import bench

    rows = bench.run([1, 4], ["prompt_lookup"], steps=5, prompt_len=200, num_draft_tokens=8, depth=12, seed=0,
                     with_sglang=False, forward_ms=0.0)
    assert [(r["batch"], r["corpus"]) for r in rows] == [
        (1, "freespec adapter only"), (1, "freespec prompt_lookup"),
        (4, "freespec adapter only"), (4, "freespec prompt_lookup")]
    assert all(r["get"] > 0 and r["step"] >= r["get"] for r in rows)
    assert rows[0]["nodes"] == 7.0 and rows[3]["nodes"] > 0  # the fixed chain fills D - 1; outputs copy prompts
    table = bench.table(rows + [{"batch": 4, "corpus": "sglang C++ NgramCorpus", "start": 1.0, "get": rows[3]["get"] / 2,
                                 "step": 1.0, "nodes": 3.0}]).splitlines()
    assert table[0].startswith("| batch | corpus |") and table[5].endswith("| 2.00 | " + f"{rows[3]['nodes']:.1f} |")
    assert set(bench.time_tree_rows([1, 8], 8, 0, repeats=2)) == {1, 8}


# ------------------------------------------------------------------ options
EXAMPLE_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "sglang" / "freespec.json"


def write_config(tmp_path, config) -> Path:
    path = tmp_path / "cfg.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def test_options_from_file_env_and_flags(tmp_path, monkeypatch):
    cfg = write_config(tmp_path, {"drafter": "prompt_lookup", "drafter_options": {
        "prompt_lookup": {"max_match": 9}, "suffix": {"max_depth": 7}}})
    assert options.resolve(None, cfg) == options.PluginOptions("prompt_lookup", {"max_match": 9})
    # the flag wins over the file's drafter and takes that drafter's own section (or none)
    assert options.resolve("suffix", cfg) == options.PluginOptions("suffix", {"max_depth": 7})
    assert options.resolve("mixture", cfg) == options.PluginOptions("mixture", {})
    assert options.resolve().drafter == options.default_drafter()
    env = {}
    options.export_env("suffix", str(cfg), env)
    assert env == {"FREESPEC_SGLANG": "1", "FREESPEC_SGLANG_DRAFTER": "suffix",
                   "FREESPEC_SGLANG_CONFIG": str(cfg.resolve())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    corpus = DraftServer(draft_token_num=4)  # what a spawned scheduler process builds
    assert corpus.drafter_name == "suffix" and corpus.drafter.suffix.max_depth == 7


@pytest.mark.parametrize("name", SERVABLE)
def test_example_config_serves_every_drafter(name):
    """launch.sh NAME and DRAFTER=NAME gpu_check.sh pass the example file with any drafter."""
    options.check_config(EXAMPLE_CONFIG)
    resolved = options.resolve(name, EXAMPLE_CONFIG)
    corpus = DraftServer(draft_token_num=8, drafter=resolved.drafter, drafter_options=resolved.drafter_options)
    assert corpus.drafter_name == name


def test_model_drafters_are_refused_under_sglang():
    """SGLang's NGRAM worker drafts without the model: a drafter that needs it is refused by name at launch."""
    assert "early_exit" in drafters.available() and "early_exit" not in SERVABLE
    with pytest.raises(ValueError, match=r"drafter 'early_exit' drafts with the target model's layers"):
        DraftServer(drafter="early_exit")
    with pytest.raises(ValueError, match=r"drafter 'mixture' drafts with the target model's layers"):
        DraftServer(drafter="mixture", drafter_options={"early_exit": True})


def test_mixture_fills_every_slot_under_sglang():
    """SGLang verifies D slots whatever is drafted: the mixture is never sized down by its cost model."""
    corpus = DraftServer(draft_token_num=16, drafter="mixture")
    assert corpus.drafter.adaptive is False
    assert corpus.drafter.lookahead is None  # the window cannot ride in SGLang's tree
    with pytest.raises(ValueError, match=r"drafter 'mixture' option 'adaptive' must be False under SGLang"):
        DraftServer(drafter="mixture", drafter_options={"adaptive": True})
    with pytest.raises(ValueError, match=r"option 'lookahead' must be False under SGLang, got True: the lookahead "
                                         r"window rides as not-candidate nodes"):
        DraftServer(drafter="mixture", drafter_options={"lookahead": True})
    # [7, 8] was followed by 8 different texts: deep nodes are unlikely, and an adaptive mixture keeps 8 nodes
    # of its suffix tree (recycling off: its bigram rows would add a few of their own)
    rng = np.random.default_rng(0)
    context = [t for _ in range(8) for t in [7, 8] + rng.integers(100, 2000, 15).tolist()] + [7, 8]
    adaptive = drafters.make("mixture", adaptive=True, recycle=False, lookahead=False)
    adaptive.start("r", context)
    assert adaptive.propose("r", Budget(15, 15)).num_nodes == 8
    corpus.offer_contexts([("r", context, [])])
    tokens, mask = corpus.batch_get(["r"], [context[-18:]], [len(context)])
    ((real_tokens, _),) = check_sglang_tree(tokens, mask, [8], 16)
    assert len(real_tokens) == 15


@pytest.mark.parametrize("config, message", [
    ("{", "not valid JSON"),
    ("[1]", "must hold a JSON object"),
    ({"drafer": "x"}, "unknown keys"),
    ({"drafter": 3}, "'drafter' must be a string"),
    ({"drafter_options": [1]}, "'drafter_options' must be an object"),
    ({"drafter": "nope"}, "drafter 'nope' is unknown"),
    ({"drafter_options": {"max_match": 16}}, "drafter_options maps drafter names to their options, and "
                                             "'max_match' is not a drafter"),
    ({"drafter_options": {"suffix": 3}}, r"drafter_options\['suffix'\] must be an object"),
])
def test_bad_config_files(tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        options.resolve(None, write_config(tmp_path, config))


@pytest.mark.parametrize("section, message", [
    ({"mixture": {"max_match": 16}}, "drafter 'mixture' has no option 'max_match'; its options: adaptive"),
    ({"prompt_lookup": {"min_match": 0}}, "drafter 'prompt_lookup': min_match must be an int >= 1"),
    ({"corpus": {"documents": {"max_match": 0}}}, "drafter 'corpus' option 'documents': max_match must be"),
])
def test_bad_options_name_the_file_the_drafter_and_the_option(tmp_path, section, message):
    cfg = write_config(tmp_path, {"drafter": "prompt_lookup", "drafter_options": section})
    with pytest.raises(ValueError, match=f"freespec config '{cfg}': {message}"):
        options.check_config(cfg)  # every section is checked, not only the chosen drafter's


def test_bad_drafter_options_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        options.resolve(None, tmp_path / "missing.json")
    with pytest.raises(ValueError, match="drafter 'prompt_lookup' has no option 'no_such_option'"):
        DraftServer(drafter="prompt_lookup", drafter_options={"no_such_option": 1})
    with pytest.raises(ValueError, match="--freespec-drafter: drafter 'nope' is unknown"):
        options.resolve("nope")


def test_enabled_by_env_or_flags():
    assert not enabled(argv=["launch_server", "--model-path", "m"], environ={})
    assert enabled(argv=["x", "--freespec-drafter", "suffix"], environ={})
    assert enabled(argv=["x", "--freespec-config=cfg.json"], environ={})
    assert enabled(argv=[], environ={"FREESPEC_SGLANG": "1"})
    assert enabled(argv=[], environ={"FREESPEC_SGLANG_DRAFTER": "suffix"})
    assert not enabled(argv=[], environ={"FREESPEC_SGLANG": "0"})


def test_register_is_inert_when_disabled_and_never_imports_sglang():
    code = ("import os, sys; [os.environ.pop(k, None) for k in list(os.environ) if k.startswith('FREESPEC_')];"
            "import freespec.integrations.sglang as plugin; plugin.register();"
            "assert 'sglang' not in sys.modules, 'sglang imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_sglang_says_what_to_install(monkeypatch):
    from freespec.integrations.sglang import hooks, register

    if hooks.installed():
        pytest.skip("hooks installed in this process")
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    monkeypatch.setenv("FREESPEC_SGLANG", "1")
    with pytest.raises(SystemExit, match=r"pip install freespec\[sglang\]"):
        register()


# ------------------------------------------------- serving: errors, stats, hints, memory
class FailingDrafter(RecordingDrafter):
    """Raises in ``propose`` for requests named ``bad*`` (and in ``stop`` for ``stopfail*``)."""

    name = "failing"

    def _propose(self, request_id, budget):
        if str(request_id).startswith("bad"):
            raise RuntimeError(f"injected for {request_id}")
        return super()._propose(request_id, budget)

    def _on_stop(self, request_id):
        super()._on_stop(request_id)
        if str(request_id).startswith("stopfail"):
            raise RuntimeError("stop failed")


@pytest.fixture
def failing(monkeypatch):
    monkeypatch.setitem(drafters._REGISTRY, "failing", f"{__name__}:FailingDrafter")
    return "failing"


def test_drafter_errors_cost_only_that_requests_drafts(failing, caplog):
    corpus = DraftServer(max_trie_depth=4, draft_token_num=6, drafter=failing)
    with caplog.at_level(logging.ERROR, logger="freespec.integrations.sglang.draft_server"):
        for step in range(3):
            tokens, mask = corpus.batch_get(["ok", "bad1"], [[1, 2, 3 + step], [4, 5, 6 + step]], [3 + step] * 2)
            ((_, _), (bad_tokens, bad_parents)) = check_sglang_tree(tokens, mask, [3 + step, 6 + step], 6)
            assert bad_tokens == [] and bad_parents == []  # the failing request: root only
    assert corpus.errors.count == 3 and corpus.num_live_requests == 1  # "bad1" is dropped each time it fails
    assert sum("drafting failed" in r.message for r in caplog.records) == 1  # one log line per kind


def test_a_failing_step_leaves_every_request_without_drafts(recording, monkeypatch):
    corpus = DraftServer(max_trie_depth=4, draft_token_num=4, drafter=recording)
    import freespec.integrations.sglang.draft_server as module

    calls = []

    def broken(drafts, *args, **kwargs):
        calls.append(len(drafts))
        if len(calls) == 1:
            raise RuntimeError("tree rows failed")
        return write_sglang_trees(drafts, *args, **kwargs)

    monkeypatch.setattr(module, "write_sglang_trees", broken)
    tokens, mask = corpus.batch_get(["a", "b"], [[1, 2], [3, 4]], [2, 2])
    for real_tokens, _ in check_sglang_tree(tokens, mask, [2, 4], 4):
        assert real_tokens == []
    assert corpus.errors.count == 1


def test_stop_errors_still_release(failing):
    corpus = DraftServer(max_trie_depth=4, draft_token_num=4, drafter=failing)
    corpus.batch_get(["stopfail1", "x"], [[1, 2], [3, 4]], [2, 2])
    corpus.erase_match_state(["stopfail1"])
    corpus.release_idle()
    assert corpus.num_live_requests == 0


def test_stats_file_follows_live_requests(recording, tmp_path, monkeypatch):
    path = tmp_path / "stats.json"
    monkeypatch.setenv(options.ENV_STATS, str(path))
    corpus = DraftServer(max_trie_depth=4, draft_token_num=4, drafter=recording)
    corpus.batch_get(["a", "b"], [[1, 2], [3, 4]], [2, 2])
    corpus.erase_match_state(["a"])
    assert json.loads(path.read_text())["live_requests"] == 1
    corpus.release_idle()  # what the scheduler's idle hook calls once no request is left
    stats = json.loads(path.read_text())
    assert stats["live_requests"] == 0 and stats["steps"] == 1 and stats["errors"] == 0


def test_hints_from_custom_params(monkeypatch):
    corpus = DraftServer(max_trie_depth=4, draft_token_num=8, drafter="mixture")
    prediction = [40, 41, 42, 43, 44, 45]
    corpus.offer_contexts([("r", [5, 6, 7], [], None, {"prediction": prediction, "__req__": object()})])
    tokens, mask = corpus.batch_get(["r"], [[5, 6, 7]], [3])
    ((real_tokens, real_parents),) = check_sglang_tree(tokens, mask, [7], 8)
    assert real_tokens[:6] == prediction and real_parents[:6] == [-1, 0, 1, 2, 3, 4]
    # a malformed hint (SGLang refuses it at admission; here it slipped through) costs only the hint
    corpus.offer_contexts([("s", [5, 6, 7], [], None, {"prediction": {"a": 1}})])
    corpus.batch_get(["r", "s"], [[5, 6, 7], [5, 6, 7]], [3, 3])
    assert corpus.num_hint_errors == 1 and corpus.num_live_requests == 2
    # a text hint needs the model's tokenizer, which the worker hook names
    corpus.offer_contexts([("t", [5, 6, 7], [], None, {"documents": ["some text"]})])
    corpus.batch_get(["t"], [[5, 6, 7]], [3])
    assert corpus.num_hint_errors == 2


def test_history_by_default_and_isolated(tmp_path):
    corpus = DraftServer(max_trie_depth=8, draft_token_num=8, drafter="mixture")
    assert corpus.drafter.history is not None and corpus.drafter.history.max_tokens == options.SGLANG_DEFAULTS[
        "history_tokens"]
    # a request's output reaches the next request's drafts through the history
    output = list(range(300, 330))
    corpus.offer_contexts([("a", [1, 2, 3], output)])
    corpus.batch_get(["a"], [([1, 2, 3] + output)[-8:]], [33])
    corpus.release_idle()
    corpus.offer_contexts([("b", [9, 9, 9] + output[:4], [])])
    tokens, mask = corpus.batch_get(["b"], [[9, 9, 9] + output[:4]], [7])
    ((real_tokens, _),) = check_sglang_tree(tokens, mask, [output[3]], 8)
    assert real_tokens[0] == output[4] and set(output[4:7]) <= set(real_tokens)  # the history drafts them
    isolated = DraftServer(drafter="mixture", isolated=True)
    assert isolated.drafter.history is None
    with pytest.raises(ValueError, match=r"'isolated' is true, so drafter 'mixture' option 'history_tokens' must be 0"):
        DraftServer(drafter="mixture", drafter_options={"history_tokens": 64}, isolated=True)


def test_isolated_from_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps({"drafter": "mixture", "isolated": True}))
    monkeypatch.setenv(options.ENV_CONFIG, str(config))
    monkeypatch.delenv(options.ENV_DRAFTER, raising=False)
    assert DraftServer().drafter.history is None
    config.write_text(json.dumps({"isolated": "yes"}))
    with pytest.raises(ValueError, match=r"'isolated' must be true or false, got 'yes'"):
        options.check_config(config)


def test_a_step_syncs_every_row_before_drafting_any_and_a_failure_costs_its_request(monkeypatch, recording):
    """As generate() and the vLLM proposer do a step: every request's committed tokens reach the drafter, then one
    propose_batch drafts the rows; where it raises, the rows are drafted one by one and only the failing request
    goes without a draft (its state dropped, restarted at its next step)."""
    corpus = DraftServer(max_trie_depth=4, draft_token_num=5, drafter=recording)
    drafter = corpus.drafter
    proposed = []
    real_propose = type(drafter)._propose

    def recorded(self, request_id, budget):
        proposed.append(request_id)
        self.events.append(("propose", request_id))
        if request_id == "b" and getattr(self, "fail_b", False):
            raise RuntimeError("b fails")
        return real_propose(self, request_id, budget)

    monkeypatch.setattr(type(drafter), "_propose", recorded)
    corpus.batch_get(["a", "b"], [[1, 2], [5, 6]], [2, 2])
    drafter.events.clear()
    corpus.batch_get(["a", "b"], [[1, 2, 3], [5, 6, 7]], [3, 3])
    assert drafter.events == [("extend", "a", [3]), ("extend", "b", [7]), ("propose", "a"), ("propose", "b")]
    drafter.fail_b = True
    proposed.clear()
    token_ids, _ = corpus.batch_get(["a", "b"], [[2, 3, 4], [6, 7, 8]], [4, 4])
    assert proposed == ["a", "b", "a", "b"]  # the batch, then row by row
    assert "b" not in drafter._contexts and "a" in drafter._contexts  # b dropped; a drafts on
    assert corpus.errors.count >= 1
