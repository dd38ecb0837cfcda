"""The vLLM adapter without vLLM: request following (``HostRequests``), hints, options, and the proposer
against a model runner shaped like vLLM 0.32's (rows that move, exits, failures). ``tests/test_vllm.py``
runs the same proposer inside a real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from freespec.drafters import make
from freespec.drafters.base import Drafter, ForwardReport
from freespec.draft import Draft
from freespec.integrations.host_requests import HostRequests
from freespec.integrations.vllm import hints, options, proposer as proposer_module


class Recording(Drafter):
    """Drafts the next 3 tokens of a fixed sequence after the context's last token; records the calls."""

    name = "recording"
    accepts_documents = accepts_prediction = True

    def __init__(self, fail_on=None):
        super().__init__()
        self.events, self.fail_on, self.hints = [], fail_on, {}

    def _on_start(self, request_id):
        self.events.append(("start", request_id, self.context(request_id).tolist()))

    def _on_extend(self, request_id, ids):
        self.events.append(("extend", request_id, ids.tolist()))

    def _on_stop(self, request_id):
        self.events.append(("stop", request_id))

    def add_documents(self, request_id, docs, tokenizer=None):
        self.hints[request_id] = ("documents", docs)

    def add_prediction(self, request_id, prediction_ids):
        self.hints[request_id] = ("prediction", prediction_ids.tolist())

    def _propose(self, request_id, budget):
        last = int(self.context(request_id)[-1])
        if self.fail_on == last:
            raise RuntimeError("drafter failure")
        return Draft.chain([last + 1, last + 2, last + 3][:budget.max_depth])


# ---------------------------------------------------------------- HostRequests
def test_host_requests_docstring_example():
    drafter = Recording()
    requests = HostRequests(drafter)
    assert requests.sync("r", [9, 1, 2, 3], 8, lambda: [5, 6, 7, 8, 9, 1, 2, 3])
    assert not requests.sync("r", [2, 3, 4, 5], 10)
    assert requests.sync("r", [7, 7, 7, 7], 12)
    assert drafter.events == [("start", "r", [5, 6, 7, 8, 9, 1, 2, 3]), ("extend", "r", [4, 5]), ("stop", "r"),
                              ("start", "r", [7, 7, 7, 7])]
    assert requests.num_restarts == 1 and requests.num_starts == 2


@pytest.mark.parametrize("seed", range(5))
def test_host_requests_follow_a_simulated_host(seed):
    """Random joins, commits, exits and preemptions: the drafter's context is always the host's sequence."""
    rng = np.random.default_rng(seed)
    drafter = Recording()
    requests = HostRequests(drafter)
    host: dict[str, list] = {}
    for step in range(200):
        if len(host) < 6 and rng.random() < 0.3:
            host[f"r{step}"] = rng.integers(0, 50, rng.integers(1, 30)).tolist()
        for rid in list(host):
            roll = rng.random()
            if roll < 0.05:
                del host[rid]  # finished or aborted
            elif roll < 0.08:
                host[rid] = host[rid][: rng.integers(1, len(host[rid]) + 1)]  # recomputed shorter: a restart
            else:
                host[rid] += rng.integers(0, 50, rng.integers(1, 5)).tolist()
        requests.release_absent(host)
        for rid, seq in host.items():
            requests.sync(rid, seq[-6:], len(seq), lambda seq=seq: list(seq))
            assert drafter.context(rid).tolist() == seq
    requests.release_all()
    assert len(requests) == 0 and not drafter._contexts


# ---------------------------------------------------------------- hints
def test_hints_parse_and_refuse():
    assert hints.parse(None) is None and hints.parse({"other": 1}) is None
    assert hints.parse({"documents": "a text", "prediction": [5, 6]}) == hints.Hints(("a text",), (5, 6))
    assert hints.parse({"documents": [[1, 2], "b"]}).documents == ((1, 2), "b")
    for bad in ({"documents": 7}, {"documents": [1.5]}, {"documents": [[1, -2]]}, {"documents": [[True]]}):
        with pytest.raises(ValueError, match=r"extra_args\['documents'\].*must be a list of texts"):
            hints.parse(bad)
    with pytest.raises(ValueError, match=r"extra_args\['prediction'\].*must be a text or a list of token ids"):
        hints.parse({"prediction": {"type": "content", "content": "x"}})


# ---------------------------------------------------------------- options
def test_options_from_env_and_config(tmp_path):
    assert options.from_env({}).drafter == "mixture"
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"drafter": "suffix", "drafter_options": {"suffix": {"max_depth": 7}},
                               "isolated": True}))
    opts = options.from_env({options.ENV_CONFIG: str(cfg)})
    assert (opts.drafter, opts.drafter_options, opts.isolated) == ("suffix", {"max_depth": 7}, True)
    mixture = options.build_drafter(options.VllmOptions("mixture", {}, True, "test"))
    assert mixture.recycle is None and mixture.lookahead is None  # fixed under vLLM: no logits, chains only


def test_mixture_defaults_under_vllm():
    """Under vLLM the mixture drafts after one-token matches and keeps a bounded history of earlier requests
    (VLLM_DEFAULTS); an option the file sets wins, and "isolated" keeps every request's text to itself."""
    mixture = options.build_drafter(options.VllmOptions("mixture", {}, False, "test"))
    assert mixture.suffix.min_match == 1 and mixture.history.max_tokens == 1 << 18
    own = options.build_drafter(options.VllmOptions("mixture", {"min_match": 3, "history_tokens": 0}, False, "t"))
    assert own.suffix.min_match == 3 and own.history is None
    isolated = options.build_drafter(options.VllmOptions("mixture", {}, True, "test"))
    assert isolated.history is None and isolated.suffix.min_match == 1
    suffix = options.build_drafter(options.VllmOptions("suffix", {}, False, "test"))  # other drafters: their own
    assert suffix.suffix.min_match == 2 and suffix.history is None


@pytest.mark.parametrize("config, message", [
    ({"drafter_options": {"mixture": {"nope": 1}}}, r"drafter 'mixture' has no option 'nope'"),
    ({"drafter_options": {"mixture": {"lookahead": True}}}, r"option 'lookahead' must be False under vLLM"),
    ({"drafter_options": {"mixture": {"recycle": True}}}, r"option 'recycle' must be False under vLLM"),
    ({"drafter_options": {"mixture": {"early_exit": True}}}, r"option 'early_exit' must be False under vLLM"),
    ({"isolated": "yes"}, r"'isolated' must be true or false"),
    ({"drafter": "nope"}, r"drafter 'nope' is unknown"),
    ({"surprise": 1}, r"unknown keys \['surprise'\]"),
])
def test_bad_options_name_the_file_and_option(tmp_path, config, message):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        options.build_drafter(options.from_env({options.ENV_CONFIG: str(cfg)}))


def test_bad_drafter_name_in_env():
    with pytest.raises(ValueError, match=r"FREESPEC_VLLM_DRAFTER: drafter 'nope' is unknown"):
        options.from_env({options.ENV_DRAFTER: "nope"})


# ---------------------------------------------------------------- the proposer, on a runner shaped like vLLM's
class FakeBatch:
    """vLLM's persistent batch: rows hold requests; a request's row moves when others leave."""

    def __init__(self, max_reqs=8, max_len=64):
        self.token_ids_cpu = np.zeros((max_reqs, max_len), np.int32)
        self.num_tokens_no_spec = np.zeros(max_reqs, np.int32)
        self.req_ids: list = []

    @property
    def req_id_to_index(self):
        return {rid: i for i, rid in enumerate(self.req_ids)}

    def set_rows(self, sequences: dict) -> None:
        self.req_ids = list(sequences)
        for i, seq in enumerate(sequences.values()):
            self.token_ids_cpu[i, :len(seq)] = seq
            self.num_tokens_no_spec[i] = len(seq)


class FakeRunner:
    def __init__(self, proposer, extra_args=None):
        self.drafter = proposer
        self.input_batch = FakeBatch()
        self.requests: dict = {}
        self.extra_args = extra_args or {}
        self.updates = 0

    def _update_states(self, scheduler_output):
        self.updates += 1
        for rid in scheduler_output.finished_req_ids:
            self.requests.pop(rid, None)

    def load_model(self):
        self.drafter.load_model(None)

    def step(self, sequences: dict, sampled: dict, finished=(), scheduled=None):
        """One engine step: apply exits, lay out rows, then propose for rows with sampled tokens (``scheduled``:
        the step's ``total_num_scheduled_tokens``, left out where None)."""
        for rid in sequences:
            params = SimpleNamespace(extra_args=self.extra_args.get(rid))
            self.requests.setdefault(rid, SimpleNamespace(sampling_params=params))
        output = SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=None)
        if scheduled is not None:
            output.total_num_scheduled_tokens = scheduled
        self._update_states(output)
        self.input_batch.set_rows(sequences)
        return self.drafter.propose([sampled.get(rid, []) for rid in sequences],
                                    self.input_batch.num_tokens_no_spec, self.input_batch.token_ids_cpu)


def _proposer(monkeypatch, drafter, k=4, max_model_len=64, vocab_size=1000, extra_args=None):
    monkeypatch.setattr(proposer_module, "check_vllm_version", lambda: "0.32.0")
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                             model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=None,
                                                          get_vocab_size=lambda: vocab_size))
    prop = proposer_module.Proposer(config, drafter=drafter)
    runner = FakeRunner(prop, extra_args)
    runner.load_model()  # the proposer finds the runner up the stack, as in vLLM's load_model
    return prop, runner


def test_rows_follow_requests_as_they_move(monkeypatch):
    drafter = Recording()
    prop, runner = _proposer(monkeypatch, drafter)
    seqs = {"a": [1, 2, 3], "b": [10, 11], "c": [20]}
    assert runner.step(seqs, {"a": [3], "b": [11], "c": [20]}) == [[4, 5, 6, 7][:3], [12, 13, 14], [21, 22, 23]]
    seqs = {"c": [20, 21, 22], "a": [1, 2, 3, 4]}  # b finished; rows moved
    assert runner.step(seqs, {"c": [21, 22], "a": [4]}, finished=["b"]) == [[23, 24, 25], [5, 6, 7]]
    assert ("stop", "b") in drafter.events and prop.num_live_requests == 2
    assert drafter.context("c").tolist() == [20, 21, 22] and drafter.context("a").tolist() == [1, 2, 3, 4]
    runner.step({}, {}, finished=["a", "c"])  # the engine's last step before it idles: no propose rows
    assert prop.num_live_requests == 0 and not drafter._contexts


def test_a_step_syncs_every_row_before_drafting_any(monkeypatch):
    """As generate() does a step: every request's committed tokens reach the drafter, then the drafts are made
    (each draft sees every outcome of the step)."""

    class Ordered(Recording):
        def _propose(self, request_id, budget):
            self.events.append(("propose", request_id))
            return super()._propose(request_id, budget)

    drafter = Ordered()
    prop, runner = _proposer(monkeypatch, drafter)
    runner.step({"a": [1, 2], "b": [5, 6]}, {"a": [2], "b": [6]})
    drafter.events.clear()
    runner.step({"a": [1, 2, 3], "b": [5, 6, 7]}, {"a": [3], "b": [7]})
    assert drafter.events == [("extend", "a", [3]), ("extend", "b", [7]), ("propose", "a"), ("propose", "b")]


def test_exits_release_state_even_without_a_propose(monkeypatch):
    drafter = Recording()
    prop, runner = _proposer(monkeypatch, drafter)
    runner.step({"a": [1, 2]}, {"a": [2]})
    runner._update_states(SimpleNamespace(finished_req_ids={"a"}, preempted_req_ids=None))
    assert prop.num_live_requests == 0
    runner.step({"b": [5, 6]}, {"b": [6]})
    runner._update_states(SimpleNamespace(finished_req_ids=set(), preempted_req_ids={"b"}))
    assert prop.num_live_requests == 0  # preempted: released, restarted when it resumes
    assert runner.step({"b": [5, 6, 7]}, {"b": [7]}) == [[8, 9, 10]]
    assert prop.requests.num_starts == 3
    prop.detach_runner()
    assert "_update_states" not in vars(runner)


def test_drafts_stop_at_max_model_len_and_the_vocabulary(monkeypatch):
    prop, runner = _proposer(monkeypatch, Recording(), k=8, max_model_len=10, vocab_size=12)
    assert runner.step({"a": [1, 2, 3, 4, 5, 6, 7]}, {"a": [7]}) == [[8, 9]]  # 7 + 2 drafts + 1 bonus = 10
    assert runner.step({"a": [1, 2, 3, 4, 5, 6, 7, 8, 9]}, {"a": [8, 9]}) == [[]]
    assert runner.step({"b": [9, 10]}, {"b": [10]}) == [[11]]  # 12, 13 are not in the vocabulary
    assert runner.step({"c": [4], "d": [5]}, {"c": [], "d": [5]}) == [[], [6, 7, 8][:3]]  # c: a partial prefill


def test_a_failing_drafter_costs_only_that_requests_draft(monkeypatch, caplog):
    drafter = Recording(fail_on=50)
    prop, runner = _proposer(monkeypatch, drafter)
    out = runner.step({"a": [1, 50], "b": [2, 3]}, {"a": [50], "b": [3]})
    assert out == [[], [4, 5, 6]] and prop.num_errors == 1 and "a" not in prop.requests
    out = runner.step({"a": [1, 50], "b": [2, 3, 4]}, {"a": [50], "b": [4]})
    assert out == [[], [5, 6, 7]] and prop.num_errors == 2
    assert sum("drafting failed" in r.getMessage() for r in caplog.records) == 1  # logged once, then counted
    assert runner.step({"a": [1, 50, 51]}, {"a": [51]}) == [[52, 53, 54]]  # restarted cleanly


def test_a_mismatched_batch_costs_the_steps_drafts(monkeypatch):
    prop, runner = _proposer(monkeypatch, Recording())
    runner.input_batch.set_rows({"a": [1, 2]})
    out = prop.propose([[2]], runner.input_batch.num_tokens_no_spec, np.zeros((8, 64), np.int32))
    assert out == [[]] and prop.num_errors == 1


def test_hints_reach_the_drafter(monkeypatch):
    drafter = Recording()
    prop, runner = _proposer(monkeypatch, drafter, extra_args={"a": {"prediction": [7, 8, 9]},
                                                                 "b": {"documents": [[3, 4, 5]]},
                                                                 "c": {"documents": 5}})
    runner.step({"a": [1], "b": [2], "c": [3]}, {"a": [1], "b": [2], "c": [3]})
    assert drafter.hints == {"a": ("prediction", [7, 8, 9]), "b": ("documents", [(3, 4, 5)])}
    assert prop.num_hint_errors == 1 and prop.num_live_requests == 3  # c drafts without its bad hint


def test_each_step_is_reported_as_a_packed_batch(monkeypatch):
    """vLLM lays rows end to end: the step since the last propose goes to on_forward with each row's tokens fed
    (1 + its draft) as a packed batch, so the cost model files it by its tokens in all."""
    drafter = Recording()
    reports = []
    drafter.on_forward = reports.append
    prop, runner = _proposer(monkeypatch, drafter)
    runner.step({"a": [1, 2, 3], "b": [10, 11]}, {"a": [3], "b": [11]})
    assert reports == []  # no step before the first propose
    runner.step({"a": [1, 2, 3, 4], "b": [10, 11, 12]}, {"a": [4], "b": [12]})
    (report,) = reports
    assert report.request_ids == ("a", "b") and report.tokens_per_row == (4, 4)
    assert report.packed and report.num_tokens == 8 and report.forward_s > 0
    # vLLM scheduled the step's 8 tokens: reported; 8 and another request's prefill chunk, or fewer (drafts it
    # cut): not, as its time is not its rows'
    for scheduled, reported in ((8, True), (8 + 30, False), (5, False)):
        reports.clear()
        runner.step({"a": [1, 2, 3, 4], "b": [10, 11, 12]}, {}, scheduled=scheduled)  # (no row drafts after it)
        runner.step({"a": [1, 2, 3, 4, 5], "b": [10, 11, 12, 13]}, {"a": [5], "b": [13]}, scheduled=2)
        assert len(reports) == reported
    assert prop.stats()["mixed_steps"] == 2


def test_a_step_is_cut_together_as_one_packed_forward(monkeypatch, caplog):
    """Every row drafts under a packed budget (sized alone), then the drafter cuts the step's rows together
    (``fit_batch(..., packed=True)``), every row of the step in its order, an empty draft where a row has none;
    what it keeps is what vLLM verifies. A step of one row is not cut; a failing cut costs the step's drafts."""

    class Fitting(Recording):
        def __init__(self, fail=False):
            super().__init__(fail_on=50)
            self.budgets, self.fits, self.fail = [], [], fail

        def _propose(self, request_id, budget):
            self.budgets.append(budget)
            return super()._propose(request_id, budget)

        def fit_batch(self, request_ids, drafts, batch_size, packed=False):
            if self.fail:
                raise RuntimeError("fit failure")
            self.fits.append((list(request_ids), [d.token_ids.tolist() for d in drafts], batch_size, packed))
            return [d.select(np.arange(min(1, d.num_nodes))) if rid == "b" else d for rid, d in zip(request_ids, drafts)]

    drafter = Fitting()
    prop, runner = _proposer(monkeypatch, drafter)
    out = runner.step({"a": [1, 2], "b": [10, 11], "c": [1, 50], "d": [30]}, {"a": [2], "b": [11], "c": [50], "d": []})
    assert out == [[3, 4, 5], [12], [], []]  # c: its drafter failed; d: a partial prefill (no row of the step)
    assert drafter.fits == [(["a", "b", "c"], [[3, 4, 5], [12, 13, 14], []], 3, True)]
    assert all(budget.packed and budget.chain and budget.batch_size == 3 for budget in drafter.budgets)
    drafter.fits.clear()
    assert runner.step({"a": [1, 2, 3]}, {"a": [3]}, finished=["b", "c", "d"]) == [[4, 5, 6]] and not drafter.fits
    failing = Fitting(fail=True)
    prop, runner = _proposer(monkeypatch, failing)
    assert runner.step({"a": [1, 2], "b": [10, 11]}, {"a": [2], "b": [11]}) == [[], []]
    assert prop.num_errors == 1


def test_the_mixture_cuts_a_packed_step_by_its_tokens_in_all(monkeypatch):
    """Under vLLM the mixture sizes each row alone and cuts the step's rows together: four rows that copy their
    prompts each draft a prefix of what the same row drafts alone on the same packed curve; where tokens are free
    (a flat curve) every row keeps its whole draft, where each costs a tenth of a step the step keeps fewer."""

    def mixture(slope):
        drafter = make("mixture", recycle=False, lookahead=False)
        for width in range(1, 60):
            for _ in range(3):
                drafter.on_forward(ForwardReport(("x",), (width,), 0.1 * (1 + slope * (width - 1)), packed=True))
        return drafter

    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7]
    rows = {rid: [t + 100 * i for t in prompt] for i, rid in enumerate("abcd")}
    kept = {}
    for slope in (0.0, 0.1):
        alone = []
        for rid, seq in rows.items():
            _, runner = _proposer(monkeypatch, mixture(slope), k=6)
            alone += runner.step({rid: seq}, {rid: seq[-1:]})
        _, runner = _proposer(monkeypatch, mixture(slope), k=6)
        together = runner.step(rows, {rid: seq[-1:] for rid, seq in rows.items()})
        assert all(draft == mine[:len(draft)] for draft, mine in zip(together, alone)), (slope, together, alone)
        kept[slope] = (sum(map(len, together)), sum(map(len, alone)))
    assert kept[0.0][0] == kept[0.0][1] > 0 and 0 < kept[0.1][0] < kept[0.1][1], kept


def test_the_mixture_drafts_a_chain_from_the_prompt(monkeypatch):
    prop, runner = _proposer(monkeypatch, make("mixture", recycle=False, lookahead=False), k=6)
    seq = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    out = runner.step({"a": seq}, {"a": [7]})
    assert out[0][:3] == [8, 9, 10]


def test_stats_file(monkeypatch, tmp_path):
    path = tmp_path / "stats.json"
    monkeypatch.setenv(options.ENV_STATS, str(path))
    prop, runner = _proposer(monkeypatch, Recording())
    runner.step({"a": [1, 2]}, {"a": [2]})
    runner.step({}, {}, finished=["a"])
    stats = json.loads(path.read_text())
    assert stats["live_requests"] == 0 and stats["starts"] == 1 and stats["errors"] == 0
    assert stats["history_tokens"] is None and stats["process_rss_mb"] > 10  # Recording keeps no history


def test_stats_report_the_history(monkeypatch):
    """The history's size is in the counters: a server's memory can be read against what the drafter holds."""
    prop, runner = _proposer(monkeypatch, options.build_drafter(options.VllmOptions("mixture", {}, False, "t")))
    runner.step({"a": [1, 2, 3]}, {"a": [3]})
    runner.step({"a": [1, 2, 3, 4, 5]}, {"a": [4, 5]})
    runner.step({}, {}, finished=["a"])
    stats = prop.stats()
    assert stats["history_tokens"] == 3 and 0 < stats["history_bytes"] < 2**20  # the output and its separator


def _naive_best_path(parents, confidence, is_candidate):
    """Plain twin of ``Draft.best_path``: at each node, the first most confident candidate child."""
    path, parent = [], -1
    while True:
        children = [i for i, p in enumerate(parents) if p == parent and is_candidate[i]]
        if not children:
            return path
        top = max(confidence[i] for i in children)
        parent = next(i for i in children if confidence[i] == top)
        path.append(parent)


@pytest.mark.parametrize("seed", range(20))
def test_best_path_matches_its_naive_twin(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    confidence = rng.choice([0.1, 0.5, 0.9], n).astype(np.float32)  # ties on purpose
    is_candidate = rng.random(n) < 0.8
    draft = Draft(rng.integers(0, 100, n), parents, confidence, is_candidate=is_candidate)
    expected = _naive_best_path(parents, confidence.tolist(), is_candidate.tolist())
    assert draft.best_path() == expected
    assert draft.best_chain().token_ids.tolist() == draft.token_ids[expected].tolist()
    assert Draft(draft.token_ids, parents).best_path() == _naive_best_path(parents, [0.0] * n, [True] * n)
    chain = list(range(-1, n - 1))  # best_path's shortcut for chains
    assert Draft.chain(draft.token_ids.tolist()).best_path() == _naive_best_path(chain, [0.0] * n, [True] * n)
    assert Draft(draft.token_ids, chain, confidence, is_candidate=is_candidate).best_path() == \
        _naive_best_path(chain, confidence.tolist(), is_candidate.tolist())


def test_attaching_twice_wraps_the_runner_once(monkeypatch):
    prop, runner = _proposer(monkeypatch, Recording())
    wrapped = runner._update_states
    prop.attach_runner(runner)
    assert runner._update_states is wrapped
    runner.step({"a": [1, 2]}, {"a": [2]})
    runner.step({}, {}, finished=["a"])
    assert prop.num_live_requests == 0 and runner.updates == 2


def test_serving_bench_summary_speedups_best_k_categories_and_identity(tmp_path):
    """The serving benchmark's summary: rates are each configuration's tokens over its seconds summed over its
    runs, speedups over plain vLLM, each method's best K beside the default, per-category speedups from each
    request's own seconds at concurrency 1, and an output that differs from plain vLLM's flagged."""
    from freespec.integrations.vllm import bench

    def run(seconds, request_seconds, outputs, propose=(0.0, 0, 0)):
        return {"code-edit@1": {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs,
                                "categories": ["rename", "fix-bug"], "request_seconds": request_seconds,
                                "mean_accepted_length": 2.0, "mean_draft_length": 3.0,
                                **dict(zip(("propose_s", "propose_calls", "propose_rows"), propose))}}

    same = [[1, 2, 3, 4], [5, 6]]
    runs = {"vanilla": [run(6.0, [4.0, 2.0], same), run(6.0, [4.0, 2.0], same)],
            "ngram-k8": [run(3.0, [2.0, 1.0], same, (0.003, 50, 100)), run(3.0, [2.0, 1.0], same, (0.005, 50, 100))],
            "ngram-k16": [run(2.0, [1.0, 1.0], same), run(2.0, [1.0, 1.0], [[1, 2, 3, 9], [5, 6]])]}
    configs = [("vanilla", "vanilla", None), ("ngram-k8", "ngram", 8), ("ngram-k16", "ngram", 16)]
    table = bench._summarize(runs, configs, 8, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    speedups = {row["label"]: row["speedup"] for row in results["rows"]}
    assert speedups == pytest.approx({"vanilla": 1.0, "ngram-k8": 2.0, "ngram-k16": 3.0})
    assert [row["identical_to_plain"] for row in results["rows"]] == [True, True, False]
    assert results["best_k"] == [{"workload": "code-edit", "concurrency": 1, "method": "ngram", "best_k": 16,
                                  "speedup_at_best_k": pytest.approx(3.0), "speedup_at_default_k": pytest.approx(2.0)}]
    by_category = {(row["label"], row["category"]): row["speedup"] for row in results["categories"]}
    assert by_category[("ngram-k16", "rename")] == pytest.approx(4.0)  # 8 tokens in 2 s against 8 in 8 s
    assert by_category[("ngram-k8", "fix-bug")] == pytest.approx(2.0)
    assert "| code-edit | 1 | ngram | 16 | 3.0 | 3.00x | 2.00 | 3.00 | - | NO |" in table
    propose = {row["label"]: row["propose_us_per_request"] for row in results["rows"]}
    assert propose["vanilla"] is None and propose["ngram-k8"] == pytest.approx(40.0)  # 8 ms over 200 rows
    assert "| code-edit | 1 | ngram | 8 | 2.0 | 2.00x | 2.00 | 3.00 | 40 | yes |" in table


def test_serving_bench_times_propose_inside_the_engine_for_every_method():
    """The timer the serving benchmark sends to the engine's worker wraps its drafter's propose() whatever the
    method's signature (vLLM's ngram: K first; suffix: K and the input batch; freespec: the sampled ids first),
    counts CPU time, calls and rows with new tokens (not a row still in its prefill), returns what it holds
    and starts again from zero; a second call finds the wrapper and does not wrap it again; the engine's first
    call (where vLLM's ngram compiles its kernel) is not counted."""
    from types import SimpleNamespace

    from freespec.integrations.vllm import bench

    class Drafter:
        def __init__(self, where):
            self.where = where

        def propose(self, *args, **kwargs):
            sum(range(20000))  # some CPU time
            return [[7] for _ in args[self.where]]

    for where, call in ((1, lambda d, sampled: d.propose(8, sampled, None, None, slot_mappings=None)),
                        (2, lambda d, sampled: d.propose(8, object(), sampled)),
                        (0, lambda d, sampled: d.propose(sampled, None, None))):
        worker = SimpleNamespace(model_runner=SimpleNamespace(drafter=Drafter(where)))
        assert bench._propose_timer(worker) == (0.0, 0, 0) and bench._propose_timer(worker) == (0.0, 0, 0)
        drafter = worker.model_runner.drafter
        assert call(drafter, [[9]]) == [[7]] and bench._propose_timer(worker) == (0.0, 0, 0)  # the first
        assert call(drafter, [[1], [], [2, 3]]) == [[7], [7], [7]]
        call(drafter, [[4], [5]])
        seconds, calls, rows = bench._propose_timer(worker)
        assert seconds > 0 and (calls, rows) == (2, 4)  # counted once a call: wrapped once
        assert bench._propose_timer(worker) == (0.0, 0, 0)


def test_serving_bench_refuses_methods_without_plain_vllm(capsys):
    """Every speedup and the identity check are against plain vLLM: a --methods list without it is refused
    before any engine starts, naming the argument."""
    from freespec.integrations.vllm import bench

    with pytest.raises(SystemExit):
        bench.main(["--methods", "ngram,freespec", "--out", "unused"])
    assert "--methods must include vanilla" in capsys.readouterr().err


def test_serving_bench_workloads_option(tmp_path, capsys):
    """``--workloads`` picks the workloads a run measures: an unknown or repeated name is refused before any
    engine starts, naming the argument; a run of Spec-Bench alone builds that workload's prompts only,
    both phases from the given file."""
    from freespec import models
    from freespec.integrations.vllm import bench

    for bad in ("spec-bench,chat", "code-edit,code-edit", ""):
        with pytest.raises(SystemExit):
            bench.main(["--workloads", bad, "--out", str(tmp_path / "unused")])
        assert "--workloads: expected some of code-edit,spec-bench" in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"question {i}"]} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workloads = bench._prompts(str(models.local_dir("smollm2-135m")), {"spec-bench": 2}, 2, str(path))
    assert list(workloads) == ["spec-bench"]
    assert [len(workloads["spec-bench"][c]) for c in (1, 2)] == [2, 2]
    phases = [[tuple(ids) for _, ids in workloads["spec-bench"][c]] for c in (1, 2)]
    assert len(set(phases[0] + phases[1])) == 4  # four different prompts, none in both phases


def test_serving_bench_refuses_suffix_without_arctic_inference(monkeypatch, capsys, tmp_path):
    """vLLM's suffix method needs arctic-inference: without it the run stops before any engine starts (not
    after the engines before it have run), naming the method and the fix."""
    import importlib.util

    from freespec.integrations.vllm import bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "arctic_inference" else real(name, *args))
    with pytest.raises(SystemExit):
        bench.main(["--methods", "vanilla,suffix,freespec", "--out", str(tmp_path / "unused")])
    assert "suffix is vLLM's SuffixDecoding, which needs arctic-inference" in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


# ---------------------------------------------------------------- which vLLM runs which path
def test_each_release_gets_its_path():
    from freespec.integrations.vllm import version

    assert version.path_of("0.32.0") == version.path_of("0.33.1") == version.CUSTOM_CLASS
    assert version.path_of("0.34.0") == version.path_of("0.34.2") == version.SPECULATOR
    assert version.path_of("0.31.9") is None and version.path_of("0.35.0", environ={}) is None
    assert version.path_of("0.35.0", environ={version.ENV_ALLOW_UNTESTED: "1"}) == version.SPECULATOR
    assert version.check_vllm_version("0.34.0", environ={}, path=version.SPECULATOR) == "0.34.0"
    with pytest.raises(version.IncompatibleVLLM, match="vllm 0.34: speculative_config=.*'freespec'"):
        version.check_vllm_version("0.34.0", environ={})  # the custom_class proposer, on 0.34
    with pytest.raises(version.IncompatibleVLLM, match="custom_class"):
        version.check_vllm_version("0.33.0", environ={}, path=version.SPECULATOR)
    from freespec.integrations import vllm as adapter

    assert adapter.speculative_config(6, "0.34.0") == {"method": "freespec", "num_speculative_tokens": 6}
    assert adapter.speculative_config(6, "0.33.2")["model"] == adapter.PROPOSER


def test_the_plugin_registers_nothing_outside_the_speculators_range(monkeypatch):
    import freespec_vllm_plugin as plugin
    from freespec.integrations.vllm import version

    assert plugin.RANGE == version.RANGES[version.SPECULATOR] and plugin.ENV_ALLOW_UNTESTED == version.ENV_ALLOW_UNTESTED
    for found in ("0.31.0", "0.32.0", "0.33.1", "0.34.0", "0.34.1rc1+cu130", "0.35.0"):
        assert plugin.runs_speculator(found, environ={}) == (version.path_of(found, environ={}) == version.SPECULATOR)
    assert plugin.runs_speculator("0.35.0", environ={version.ENV_ALLOW_UNTESTED: "1"})
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(__version__="0.33.0"))
    assert plugin.register() is False  # and imports nothing of vLLM's speculator interface
    monkeypatch.setitem(sys.modules, "vllm", None)  # no vLLM: an ImportError
    assert plugin.register() is False  # never raises into vLLM's plugin loader


def test_the_plugin_imports_nothing_of_freespec():
    """vLLM loads it in a worker before its CPU platform's kernel scan, which numba's objects fail (where vLLM is
    installed, importing it brings torch: that is vLLM's own)."""
    code = ("import sys, freespec_vllm_plugin; freespec_vllm_plugin.register(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('freespec', 'numba')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
