"""The SGLang corpus adapter without SGLang: tree format, request state, options.

``check_sglang_tree`` states the contract SGLang's NGRAM worker relies on (read
from sglang 0.5.21 and its C++ NgramCorpus); test_sglang_plugin.py checks
SGLang's own corpus against the same function.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from freespec import drafters
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.integrations.sglang import DraftServer, enabled, options, to_sglang_tree


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


def test_rejects_malformed_draft():
    with pytest.raises(ValueError):
        to_sglang_tree(Draft(np.array([1, 1]), np.array([-1, -1])), 0, 4)  # duplicate siblings


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
        for rid in live:
            ctx = corpus.drafter.context(rid).tolist()
            assert ctx == sequences[rid][-len(ctx):]
            if offered_ok[rid]:
                assert ctx == sequences[rid]
            sequences[rid] += list(rng.integers(0, 9, int(rng.integers(1, d + 1))))  # accepted + bonus
        corpus.batch_put(tails)
        departed = [rid for rid in sequences if rid not in live]
        corpus.erase_match_state(departed)


def _buildable_drafters():
    names = []
    for name in drafters.available():
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


# ------------------------------------------------------------------ options
def test_options_from_file_env_and_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"drafter": "prompt_lookup", "drafter_options": {"max_match": 9}}))
    assert options.resolve(None, cfg) == options.PluginOptions("prompt_lookup", {"max_match": 9})
    assert options.resolve("suffix", cfg).drafter == "suffix"  # the flag wins over the file
    assert options.resolve().drafter == options.default_drafter()
    env = {}
    options.export_env("prompt_lookup", str(cfg), env)
    assert env == {"FREESPEC_SGLANG": "1", "FREESPEC_SGLANG_DRAFTER": "prompt_lookup",
                   "FREESPEC_SGLANG_CONFIG": str(cfg.resolve())}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    corpus = DraftServer(draft_token_num=4)  # what a spawned scheduler process builds
    assert corpus.drafter_name == "prompt_lookup" and corpus.drafter.max_match == 9


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1]", "must hold a JSON object"),
    ('{"drafer": "x"}', "unknown keys"),
    ('{"drafter": 3}', "'drafter' must be a string"),
    ('{"drafter_options": [1]}', "'drafter_options' must be an object"),
    ('{"drafter": "nope"}', "drafter 'nope' is unknown"),
])
def test_bad_config_files(tmp_path, text, message):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=message):
        options.resolve(None, cfg)


def test_bad_drafter_options_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        options.resolve(None, tmp_path / "missing.json")
    with pytest.raises(ValueError, match="bad drafter_options"):
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
