"""freespec replay: exact greedy tau from recorded outputs, checked on known drafters and against the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from freespec import SpecConfig
from freespec.bench.replay import accepted_path, load_traces, replay_one, replay_tau
from freespec.draft import Budget, Draft
from freespec.drafters import make
from freespec.drafters.base import Drafter
from freespec.testing.drafters import OracleDrafter, WrongDrafter


class PerPromptReference(Drafter):
    """Routes each request to a reference drafter built for its trace (found by prompt)."""

    name = "per-prompt"

    def __init__(self, traces, cls, **options):
        super().__init__()
        self.refs = {tuple(t["prompt_ids"]): t["prompt_ids"] + t["output_ids"] for t in traces}
        self.cls, self.options, self.live = cls, options, {}
        self.observe_top_k = 0

    def start(self, request_id, prompt_ids):
        inner = self.cls(self.refs[tuple(int(i) for i in prompt_ids)], vocab_size=1000, **self.options)
        inner.start(request_id, prompt_ids)
        self.live[request_id] = inner

    def propose(self, request_id, budget):
        return self.live[request_id].propose(request_id, budget)

    def extend(self, request_id, accepted_ids):
        self.live[request_id].extend(request_id, accepted_ids)

    def stop(self, request_id):
        self.live.pop(request_id).stop(request_id)


def _trace(prompt, output, max_new_tokens, category="c"):
    return {"prompt_ids": list(prompt), "output_ids": list(output), "max_new_tokens": max_new_tokens,
            "category": category}


def test_accepted_path_follows_the_truth_through_the_tree():
    draft = Draft(np.array([5, 6, 8, 7]), np.array([-1, 0, 0, 1]))
    assert accepted_path(draft, np.array([5, 8, 9])) == [0, 2]
    assert accepted_path(draft, np.array([5, 6, 7, 1])) == [0, 1, 3]
    assert accepted_path(draft, np.array([9])) == []
    assert accepted_path(Draft.empty(), np.array([5])) == []


def test_worked_example_from_the_docstring():
    class NextTwo(Drafter):
        def _propose(self, request_id, budget):
            truth = [5, 6, 7, 8]
            n = len(self.context(request_id)) - 1  # prompt is one token
            return Draft.chain(truth[n:n + min(2, budget.max_depth)])

    counts = replay_one(NextTwo(), 0, [1], [5, 6, 7, 8], 100, SpecConfig())
    assert counts["forwards"] == 2 and counts["new_tokens"] == 4


@pytest.mark.parametrize("length,max_new_tokens,depth,expected_forwards", [
    (40, 40, 12, 4),     # 13 + 13 + 13 (depth capped at remaining - 1 = 0 on the last) + 1
    (5, 100, 12, 1),     # stops at the end of the output (EOS) inside the first draft
    (30, 30, 4, 6),      # 5 per forward
    (1, 1, 12, 1),       # one token: the prefill alone
])
def test_oracle_gives_the_budget_bound(length, max_new_tokens, depth, expected_forwards):
    traces = [_trace([3, 4, 5], list(range(100, 100 + length)), max_new_tokens)]
    config = SpecConfig(max_draft_tokens=24, max_draft_depth=depth)
    result = replay_tau(traces, lambda: PerPromptReference(traces, OracleDrafter), config)
    assert result["overall"]["forwards"] == expected_forwards
    assert result["overall"]["tau"] == pytest.approx(length / expected_forwards)


def test_oracle_with_siblings_and_categories():
    traces = [_trace([3, 4], list(range(100, 140)), 40, "a"), _trace([7], list(range(200, 226)), 64, "b"),
              _trace([3, 9], list(range(300, 340)), 40, "a")]
    config = SpecConfig(max_draft_tokens=24, max_draft_depth=12)
    result = replay_tau(traces, lambda: PerPromptReference(traces, OracleDrafter, num_wrong_siblings=1), config)
    # depth 12 but each level costs 2 nodes: 24 nodes -> 12 levels, so the bound is still 13 per forward
    assert result["per_category"]["a"]["forwards"] == 8
    assert result["per_category"]["b"]["forwards"] == 2  # 13 + 13
    assert result["per_category"]["b"]["tau"] == pytest.approx(13.0)
    assert result["overall"]["tau"] == pytest.approx(106 / 10)
    assert [t["category"] for t in result["per_trace"]] == ["a", "b", "a"]


def test_always_wrong_drafter_gives_tau_one():
    traces = [_trace([3, 4, 5], list(range(100, 130)), 30), _trace([8], list(range(400, 417)), 64, "d")]
    result = replay_tau(traces, lambda: PerPromptReference(traces, WrongDrafter), SpecConfig())
    assert result["overall"]["tau"] == 1.0
    assert result["overall"]["forwards"] == 47
    assert result["overall"]["draft_tokens"] > 0 and result["overall"]["accepted_draft_tokens"] == 0


def test_one_drafter_serves_every_trace_in_order():
    seen = []

    class Recorder(Drafter):
        def _on_start(self, request_id):
            seen.append(request_id)

        def _propose(self, request_id, budget):
            return Draft.empty()

    traces = [_trace([1], [2, 3], 8), _trace([4], [5], 8)]
    made = []
    replay_tau(traces, lambda: made.append(1) or Recorder(), SpecConfig())
    assert len(made) == 1 and len(seen) == 2 and seen[0] != seen[1]


def test_observing_drafter_is_noted():
    class Observer(Drafter):
        name = "observer"
        observe_top_k = 4

        def _propose(self, request_id, budget):
            return Draft.empty()

    result = replay_tau([_trace([1], [2, 3], 8)], Observer, SpecConfig())
    assert any("observe" in note for note in result["notes"])


def test_replay_equals_the_engine_on_a_tiny_model():
    """The point of replay: its forward count is the engine's, exactly."""
    import torch

    import freespec
    from freespec.testing.models import tiny_random

    model = tiny_random("llama", vocab_size=64)
    prompt = [0, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    config = SpecConfig(drafter="prompt_lookup", drafter_options={"min_match": 1}, max_draft_tokens=8,
                        max_draft_depth=4, adaptive_budget=False)
    freespec.patch(model, config)
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
        stats = freespec.stats(model)
    finally:
        freespec.unpatch(model)
    output = out[0, len(prompt):].tolist()
    assert stats.fallback_reason is None
    traces = [_trace(prompt, output, 40)]
    result = replay_tau(traces, lambda: make("prompt_lookup", min_match=1), config)
    assert result["overall"]["forwards"] == stats.forward_passes
    assert result["overall"]["draft_tokens"] == stats.draft_tokens


class NextTwo(Drafter):
    """The docstring's drafter: the true next two tokens of output [5, 6, 7, 8] after a one-token prompt."""

    name = "next-two"

    def __init__(self):
        super().__init__()
        self.reports = []

    def on_forward(self, report):
        self.reports.append(report)

    def _propose(self, request_id, budget):
        n = len(self.context(request_id)) - 1
        return Draft.chain([5, 6, 7, 8][n:n + min(2, budget.max_depth)])


def test_simulated_time_of_the_docstring_example():
    from freespec.bench.cost import CostCurve
    from freespec.drafters.base import ForwardReport

    curve = CostCurve.parse("1:1,2:1.1,4:1.3", one_token_ms=10)  # c(k) = 1 + 0.1 (k - 1)
    drafter = NextTwo()
    result = replay_tau([_trace([1], [5, 6, 7, 8], 100)], lambda: drafter, SpecConfig(), curve)
    overall = result["overall"]
    # forward 1 (prefill) feeds the prompt + 2 nodes: c(3) = 1.2 -> 12 ms; forward 2 feeds 1 + 1 node: 11 ms
    assert overall["forwards"] == 2 and overall["forward_s"] == pytest.approx(0.023)
    # plain decoding: the prefill of the 1-token prompt, then 3 forwards of one token: 4 x 10 ms
    assert overall["plain_s"] == pytest.approx(0.040)
    assert 0 < overall["drafter_s"] < 0.05  # measured: start, propose, on_forward, extend, stop
    assert overall["simulated_s"] == pytest.approx(overall["forward_s"] + overall["drafter_s"])
    assert overall["tokens_per_s"] == pytest.approx(4 / overall["simulated_s"])
    assert overall["plain_tokens_per_s"] == pytest.approx(100.0)
    assert overall["speedup"] == pytest.approx(0.040 / overall["simulated_s"])
    assert drafter.reports == [ForwardReport((("replay", 0),), (3,), pytest.approx(0.012), True),
                               ForwardReport((("replay", 0),), (2,), pytest.approx(0.011), False)]
    assert result["per_category"]["c"]["forward_s"] == pytest.approx(0.023)


def test_without_a_curve_there_is_no_simulated_time():
    drafter = NextTwo()
    result = replay_tau([_trace([1], [5, 6, 7, 8], 100)], lambda: drafter, SpecConfig())
    assert drafter.reports == [] and result["overall"]["forward_s"] == 0.0
    assert "tokens_per_s" not in result["overall"] and "speedup" not in result["overall"]
    assert any("without a cost curve" in note for note in result["notes"])  # NextTwo overrides on_forward


def test_mixture_sizes_its_trees_for_the_simulated_machine():
    """An adaptive drafter learns c(k) from on_forward: on a machine where wide forwards are dear it drafts less."""
    from freespec.bench.cost import CostCurve

    block = list(range(11, 27))
    novel = [list(range(100 + 40 * i, 120 + 40 * i)) for i in range(6)]  # one-token forwards: c(1) gets measured
    traces = [_trace([1] + block * 2, novel[i] + block * 2 + novel[i][:10], 200) for i in range(6)]
    config = SpecConfig(drafter="mixture")
    mixture = lambda: make("mixture", lookahead=False)  # noqa: E731 (replay feeds the window no logits)
    cheap = replay_tau(traces, mixture, config, CostCurve.parse("1:1,64:1.05"))
    dear = replay_tau(traces, mixture, config, CostCurve.parse("1:1,2:3,64:60"))
    assert cheap["overall"]["draft_tokens"] > 1.4 * dear["overall"]["draft_tokens"]
    # the dear machine still drafts some of the repeated block, whose suffix nodes are accepted above
    # their priors (so the source's scale raises them): tau 2.60 against 1.92 at this commit
    assert cheap["overall"]["tau"] > 1.3 * dear["overall"]["tau"]


def test_load_traces_checks_records(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text(json.dumps(_trace([1], [2], 4)) + "\n\n")
    assert len(load_traces(good)) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1]}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_traces(bad)
    over = tmp_path / "over.jsonl"
    over.write_text(json.dumps(_trace([1], [2, 3, 4], 2)) + "\n")
    with pytest.raises(ValueError, match="over max_new_tokens"):
        load_traces(over)
    with pytest.raises(ValueError, match="does not exist"):
        load_traces(tmp_path / "missing.jsonl")


def test_replay_cli(tmp_path, capsys):
    from freespec.cli import main

    path = tmp_path / "traces.jsonl"
    rows = [_trace([1, 2, 3, 1, 2], [3, 1, 2, 3, 1, 2, 3], 16, "rep"), _trace([9, 8], [7, 6, 5], 16, "none")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_json = tmp_path / "replay.json"
    code = main(["replay", str(path), "--drafters", "prompt_lookup,prompt_lookup{min_match=1,max_draft_depth=2}",
                 "--json", str(out_json)])
    assert code == 0
    text = capsys.readouterr().out
    assert "overall" in text and "rep" in text and "prompt_lookup{min_match=1,max_draft_depth=2}" in text
    saved = json.loads(out_json.read_text())
    assert saved["results"]["prompt_lookup"]["per_category"]["none"]["tau"] == 1.0
    assert saved["results"]["prompt_lookup{min_match=1,max_draft_depth=2}"]["config"]["max_draft_depth"] == 2
    assert saved["cost_curve"] is None and "tau only" in text
    assert main(["replay", str(path), "--drafters", "no_such_drafter"]) == 2

    code = main(["replay", str(path), "--drafters", "prompt_lookup,suffix", "--cost-curve", "1:1,2:1.1,64:2",
                 "--one-token-ms", "20", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert code == 0
    assert "SIMULATED" in text and "simulated tokens/s" in text and "simulated speedup" in text
    assert "plain" in text and "--cost-curve 1:1,2:1.1,64:2" in text and "20.00 ms" in text
    saved = json.loads(out_json.read_text())
    assert saved["cost_curve"]["one_token_ms"] == 20.0 and saved["cost_curve"]["sizes"] == [1, 2, 64]
    none = saved["results"]["prompt_lookup"]["per_category"]["none"]  # no match: plain decoding's forwards
    assert none["speedup"] < 1.0 and none["forward_s"] == pytest.approx(none["plain_s"])

    assert main(["replay", str(path), "--drafters", "suffix", "--chain", "--json", str(out_json)]) == 0
    assert "one chain a step" in capsys.readouterr().out and json.loads(out_json.read_text())["chain"] is True


@pytest.mark.parametrize("extra,message", [
    (["--one-token-ms", "5"], "--one-token-ms scales a cost curve"),
    (["--cost-curve", "1:1", "--one-token-ms", "-3"], "--one-token-ms must be a positive"),
    (["--cost-curve", "1:1,2:x"], "--cost-curve: '2:x' is not k:c"),
    (["--cost-curve", "nothing-here.json"], "--cost-curve: cannot read"),
])
def test_replay_cli_bad_cost_arguments(tmp_path, capsys, extra, message):
    from freespec.cli import main

    path = tmp_path / "traces.jsonl"
    path.write_text(json.dumps(_trace([1, 2], [3], 4)) + "\n")
    assert main(["replay", str(path), "--drafters", "prompt_lookup"] + extra) == 2
    assert message in capsys.readouterr().err


def test_budget_is_the_engines(tiny_llama):
    """generate() and replay ask the drafter with the same budgets, step for step."""
    import torch

    import freespec

    from test_contract import Wrapper

    class Spy(Wrapper):
        def __init__(self, reference):
            super().__init__(OracleDrafter(reference, vocab_size=128))
            self.budgets = []

        def _propose(self, request_id, budget):
            self.budgets.append(budget)  # accept 2 tokens per step, whatever the budget
            return self.inner.propose(request_id, Budget(min(2, budget.num_nodes), min(2, budget.max_depth)))

    model = tiny_llama
    prompt = [1, 5, 9, 3]
    config = SpecConfig(max_draft_tokens=5, max_draft_depth=4)
    with torch.no_grad():
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False)[0].tolist()
    live = Spy(reference)
    freespec.patch(model, config.replace(drafter=live))
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=9, do_sample=False)[0].tolist()
    finally:
        freespec.unpatch(model)
    assert out == reference
    replayed = Spy(reference)
    replay_one(replayed, 0, prompt, reference[len(prompt):], 9, config)
    assert replayed.budgets == live.budgets
    # 9 tokens, 3 per step: remaining 9 -> depth 4, 6 -> 4, 3 -> 2
    assert live.budgets == [Budget(5, 4), Budget(5, 4), Budget(5, 2)]


class Forked(Drafter):
    """The module docstring's chain example: the tree 5 -> 6 (0.9) and 5 -> 9 (0.5) after the prompt [1]."""

    name = "forked"

    def __init__(self):
        super().__init__()
        self.budgets, self.reports = [], []

    def on_forward(self, report):
        self.reports.append(report)

    def _propose(self, request_id, budget):
        self.budgets.append(budget)
        if len(self.context(request_id)) > 1:
            return Draft.empty()
        return Draft(np.array([5, 6, 9]), np.array([-1, 0, 0]), np.array([1.0, 0.9, 0.5], np.float32))


def test_chain_replay_verifies_the_best_path_alone():
    """--chain: the budget says the host verifies a chain, the draft is cut to its best path before it is fed
    and counted, and forwards are reported packed."""
    from freespec.bench.cost import CostCurve

    drafter = Forked()
    result = replay_tau([_trace([1], [5, 6, 7], 16)], lambda: drafter, SpecConfig(), CostCurve.parse("1:1,2:1.1"),
                        chain=True)
    overall = result["overall"]
    assert overall["forwards"] == 1 and overall["draft_tokens"] == 2 and overall["accepted_draft_tokens"] == 2
    assert drafter.budgets[0].chain and drafter.reports[0].packed and drafter.reports[0].tokens_per_row == (3,)
    tree = replay_tau([_trace([1], [5, 6, 7], 16)], Forked, SpecConfig())["overall"]
    assert tree["draft_tokens"] == 3 and tree["forwards"] == 1


class BestPathOf(Drafter):
    """Twin of chain replay: the inner drafter's tree cut to its best path, under a plain (tree) budget."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.name = inner, inner.name

    def start(self, request_id, prompt_ids):
        self.inner.start(request_id, prompt_ids)

    def propose(self, request_id, budget):
        draft = self.inner.propose(request_id, budget)
        path = draft.best_path()[:budget.max_depth] if draft.num_nodes else []
        return draft.select(np.array(path, np.int64)) if path else Draft.empty()

    def extend(self, request_id, accepted_ids):
        self.inner.extend(request_id, accepted_ids)

    def stop(self, request_id):
        self.inner.stop(request_id)


def test_chain_replay_of_a_tree_drafter_equals_its_best_paths():
    """A drafter that does not size by cost: chain replay counts what replaying its best paths counts."""
    rng = np.random.default_rng(3)
    block = rng.integers(10, 40, 24).tolist()
    traces = [_trace(block + rng.integers(10, 40, 8).tolist(), (block[5:] + rng.integers(10, 40, 6).tolist()) * 2,
                     96) for _ in range(4)]
    config = SpecConfig(max_draft_tokens=8, max_draft_depth=6)
    chained = replay_tau(traces, lambda: make("suffix", min_match=1), config, chain=True)["overall"]
    twin = replay_tau(traces, lambda: BestPathOf(make("suffix", min_match=1)), config)["overall"]
    for key in ("forwards", "draft_tokens", "accepted_draft_tokens", "steps_with_draft"):
        assert chained[key] == twin[key], key
    assert chained["tau"] > 1.5
