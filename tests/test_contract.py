"""The drafter contract as the engine honours it: the worked example of drafters/base.py,
not-candidate nodes (fed, attended, observed, never accepted, dropped from the cache),
and every declared hook's default."""

import numpy as np
import pytest
import torch

import freespec
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter, ForwardReport, VerifyOutput
from freespec.testing.drafters import OracleDrafter
from freespec.engine import ModelTraits, compact_cache, make_cache, tree_forward

from conftest import patched_generate, plain_generate


def _docstring_example() -> type:
    """The worked example of freespec/drafters/base.py, run as written there."""
    import freespec.drafters.base as base

    doc = base.__doc__
    start = doc.rindex("\n", 0, doc.index("class TopOneSuccessor")) + 1
    block = doc[start:doc.index("``Drafter`` gives")]
    code = "\n".join(line[4:] for line in block.rstrip().splitlines())
    namespace = {"Drafter": Drafter, "Draft": Draft}
    exec(code, namespace)  # noqa: S102 - our own docstring
    return namespace["TopOneSuccessor"]


TopOneSuccessor = _docstring_example()


class Wrapper(Drafter):
    """Runs an inner drafter's lifecycle alongside this one's (subclasses decide what to propose)."""

    def __init__(self, inner: Drafter):
        super().__init__()
        self.inner = inner

    def _on_start(self, request_id):
        self.inner.start(request_id, self.context(request_id))

    def _on_extend(self, request_id, ids):
        self.inner.extend(request_id, ids)

    def _on_stop(self, request_id):
        self.inner.stop(request_id)


def _repetitive_prompt():
    ids = torch.arange(10, 40).repeat(3)[None]  # a cycle the model tends to continue
    return ids


def test_worked_example_is_exact_and_learns(tiny_llama):
    prompt = _repetitive_prompt()
    gen = dict(max_new_tokens=60, do_sample=False)
    plain = plain_generate(tiny_llama, prompt, **gen)
    drafter = TopOneSuccessor()
    out, stats = patched_generate(tiny_llama, drafter, prompt, **gen)
    assert out.tolist() == plain.tolist()
    assert stats.draft_tokens > 0 and drafter.successor


class ShadowDrafter(Wrapper):
    """Candidates are always wrong; the true continuation rides along as not-candidate nodes."""

    name, observe_top_k = "shadow", 2

    def __init__(self, reference):
        super().__init__(OracleDrafter(reference, vocab_size=128))
        self.observed: list[VerifyOutput] = []
        self.reports: list[ForwardReport] = []

    def _propose(self, request_id, budget):
        truth = self.inner.propose(request_id, Budget(min(3, budget.num_nodes - 1), budget.max_depth))
        if truth.num_nodes == 0:
            return Draft.empty()
        wrong = (int(truth.token_ids[0]) + 1) % 128
        # root -> wrong (candidate) ; root -> truth chain (not candidates)
        token_ids = [wrong] + truth.token_ids.tolist()
        parents = [-1] + [-1] + list(range(1, truth.num_nodes))
        is_candidate = [True] + [False] * truth.num_nodes
        return Draft(token_ids, parents, sources=(self.name,) * len(token_ids), is_candidate=is_candidate)

    def observe(self, request_id, verify_output):
        self.observed.append(verify_output)

    def on_forward(self, report):
        self.reports.append(report)


def test_not_candidate_nodes_are_never_accepted_but_observed(tiny_llama):
    prompt = _repetitive_prompt()
    gen = dict(max_new_tokens=20, do_sample=False)
    plain = plain_generate(tiny_llama, prompt, **gen)
    drafter = ShadowDrafter(plain[0])
    out, stats = patched_generate(tiny_llama, drafter, prompt, **gen)
    assert out.tolist() == plain.tolist()
    assert stats.accepted_draft_tokens == 0 and stats.tau == 1.0
    assert stats.noncandidate_tokens > 0 and stats.per_drafter["shadow"].proposed == stats.draft_tokens
    # the not-candidate chain is the truth: the target's top-1 at each of its nodes is the next true token
    reference = plain[0].tolist()
    for step, verify_output in enumerate(drafter.observed):
        draft = verify_output.draft
        chain = np.nonzero(~draft.candidate_mask())[0]
        position = prompt.shape[1] + step  # the root is the last committed token
        for k, node in enumerate(chain[:-1].tolist()):
            assert verify_output.topk_token_ids[node + 1, 0] == reference[position + k + 1]
    assert drafter.reports[0].prefill and not any(r.prefill for r in drafter.reports[1:])
    assert all(r.request_ids == drafter.reports[0].request_ids and r.batch_size == 1 for r in drafter.reports)
    # each decode forward reports the step before it: its time outside its forward and the nodes it fed
    assert drafter.reports[0].step_outside_s is None
    assert all(r.step_outside_s > 0 for r in drafter.reports[1:])
    assert [r.step_nodes for r in drafter.reports[1:]] == [o.draft.num_nodes for o in drafter.observed[:-1]]
    assert sum(r.step_nodes for r in drafter.reports) > 0


def test_cache_keeps_no_trace_of_not_candidate_nodes(tiny_llama):
    model = tiny_llama
    rng = np.random.default_rng(3)
    committed = rng.integers(2, 120, 12).tolist()
    draft = Draft(rng.integers(2, 120, 5), np.array([-1, 0, -1, 2, 3]), is_candidate=[1, 1, 0, 0, 0])
    cache = make_cache()
    with torch.no_grad():
        tree_forward(model, ModelTraits.of(model), cache, 0, committed, draft)
    compact_cache(cache, len(committed), [0, 1])
    reference = make_cache()
    with torch.no_grad():
        model(torch.tensor([committed + draft.token_ids[:2].tolist()]), cache=reference, use_cache=True)
    for layer, ref in zip(cache.layers, reference.layers):
        assert torch.allclose(layer.keys, ref.keys, atol=1e-9) and torch.allclose(layer.values, ref.values, atol=1e-9)


def test_draft_rules_for_not_candidate_nodes():
    # a candidate under a not-candidate node could never be reached
    with pytest.raises(ValueError, match="candidate node under a not-candidate"):
        Draft([1, 2], [-1, 0], is_candidate=[False, True]).validate()
    # siblings must differ among candidates only
    Draft([1, 1], [-1, -1], is_candidate=[True, False]).validate()
    with pytest.raises(ValueError, match="two candidate children"):
        Draft([1, 1], [-1, -1]).validate()
    draft = Draft([5, 6, 9, 4], [-1, 0, 0, 2], is_candidate=[1, 1, 0, 0])
    assert draft.num_candidates == 2 and draft.candidates().token_ids.tolist() == [5, 6]
    assert Draft([1], [-1], is_candidate=[True]).is_candidate is None  # all candidates: the plain form
    merged = freespec.merge([draft, Draft([5, 9], [-1, 0])])
    assert sorted(zip(merged.token_ids.tolist(), merged.candidate_mask().tolist())) == [
        (4, False), (5, True), (6, True), (9, False), (9, True)]
    assert draft.prune(3).num_nodes == 3 and draft.select(np.array([0, 2])).is_candidate.tolist() == [True, False]


def _fields(draft: Draft) -> list:
    """Every field as stored: arrays with their dtype, shape and layout; the rest as is."""
    out = []
    for name in ("token_ids", "parents", "confidence", "sources", "is_candidate"):
        value = getattr(draft, name)
        out.append((name, (value.dtype, value.shape, value.flags.c_contiguous, value.tolist())
                    if isinstance(value, np.ndarray) else value))
    return out


def test_unchecked_drafts_are_stored_as_the_checked_constructor_stores_them():
    """``select``, ``rescored``, ``empty`` and ``merge`` build drafts without ``__post_init__`` (the hot paths):
    each must hold exactly what ``Draft(...)`` of the same values holds, all-candidate flags as None included."""
    tree = Draft([5, 6, 9, 4, 7], [-1, 0, 0, 2, 1], [0.9, 0.5, 0.4, 0.2, 0.1], ("a", "b", "a", "c", "b"),
                 is_candidate=[1, 1, 1, 0, 1])
    plain = Draft([5, 6, 9], [-1, 0, 0])
    for draft, nodes in ((tree, [0, 1, 4]), (tree, [0, 2, 3]), (tree, [0, 2]), (tree, []), (plain, [0, 2])):
        chosen = draft.select(np.array(nodes, np.int64))
        rebuilt = Draft(chosen.token_ids.tolist(), chosen.parents.tolist(),
                        None if chosen.confidence is None else chosen.confidence.tolist(), list(chosen.sources),
                        None if chosen.is_candidate is None else chosen.is_candidate.tolist())
        assert _fields(chosen) == _fields(rebuilt), nodes
        assert chosen.validate() is chosen
    assert tree.select(np.array([0, 1, 4])).is_candidate is None  # every chosen node a candidate: the plain form
    confidence = np.array([0.3, 0.2, 0.1], np.float32)
    for rescored in (plain.rescored(confidence, ("x",) * 3), plain.rescored([0.3, 0.2, 0.1], ["x"] * 3)):
        assert _fields(rescored) == _fields(Draft([5, 6, 9], [-1, 0, 0], [0.3, 0.2, 0.1], ("x",) * 3))
    assert _fields(Draft.empty()) == _fields(Draft([], []))
    for drafts in ([tree, plain], [plain, Draft([5, 7], [-1, 0], [0.8, 0.6])], []):
        merged = freespec.merge(drafts)
        rebuilt = Draft(merged.token_ids.tolist(), merged.parents.tolist(), merged.confidence.tolist(),
                        list(merged.sources), None if merged.is_candidate is None else merged.is_candidate.tolist())
        assert _fields(merged) == _fields(rebuilt)


def test_hook_defaults():
    class Plain(Drafter):
        name = "plain"

        def _propose(self, request_id, budget):
            return Draft.empty()

    drafter = Plain()
    drafter.start("r", [1, 2])
    with pytest.raises(ValueError, match="does not draft from documents"):
        drafter.add_documents("r", ["text"])
    with pytest.raises(TypeError, match="needs_model"):
        drafter.attach_model(object())
    drafter.observe("r", None)
    drafter.on_forward(ForwardReport(("r",), (1,), 0.01))
    drafter.warmup()
    drafter.stop("r")
    assert not Plain.accepts_documents and not Plain.needs_model and Plain.observe_top_k == 0
    assert ForwardReport(("a", "b"), (3, 5), 0.1).width == 5


@pytest.mark.parametrize("name", ["mixture", "suffix", "prompt_lookup"])
def test_propose_batch_is_propose_for_each_request(name):
    """A step's requests in one ``propose_batch`` call draft what one ``propose`` each would (two drafters fed the
    same steps); a zero budget or an empty context gives an empty draft, an unknown request or a length mismatch
    raises before any request drafts."""
    from freespec.drafters import make

    one_by_one, batched = make(name), make(name)
    prompts = {"a": [1, 2, 3, 1, 2, 4, 1, 2], "b": [7, 8, 9, 7, 8], "c": []}
    for drafter in (one_by_one, batched):
        for request_id, prompt in prompts.items():
            drafter.start(request_id, prompt)
    budgets = [Budget(8, 4, 3), Budget(8, 4, 3), Budget(8, 4, 3)]
    for step in range(4):
        expected = [one_by_one.propose(request_id, budget) for request_id, budget in zip(prompts, budgets)]
        found = batched.propose_batch(list(prompts), budgets)
        for want, got in zip(expected, found):
            assert got.token_ids.tolist() == want.token_ids.tolist() and got.parents.tolist() == want.parents.tolist()
            assert (got.confidence is None) == (want.confidence is None)
            assert got.confidence is None or got.confidence.tolist() == want.confidence.tolist()
        for drafter in (one_by_one, batched):
            for request_id in prompts:
                drafter.extend(request_id, [3 + step, 1, 2])
    assert batched.propose_batch(["a", "b"], [Budget(0, 4), Budget(8, 0)])[0].num_nodes == 0
    with pytest.raises(ValueError, match="not active"):
        batched.propose_batch(["a", "nobody"], budgets[:2])
    with pytest.raises(ValueError, match="2 request ids and 3 budgets"):
        batched.propose_batch(["a", "b"], budgets)
