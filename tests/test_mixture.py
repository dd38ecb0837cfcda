"""MixtureDrafter: validity, dedup and attribution, cost model, calibration, gating, isolation, recycling, lookahead."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from freespec.draft import Budget, Draft
from freespec.drafters import make
from freespec.drafters.base import ForwardReport
from freespec.drafters.corpus import DocumentIndex
from freespec.drafters.base import VerifyOutput
from freespec.drafters.calibration import AcceptanceCalibrator, CostModel, DraftSizer, HostCostModel, padded_step_values
from freespec.drafters.mixture import MixtureDrafter
from freespec.drafters.suffix import RequestHistory

RNG = np.random.default_rng(7)
TEXT = RNG.integers(10, 500, size=200).astype(np.int64)  # no repeats to speak of, then repeated below
PROMPT = np.concatenate([TEXT, TEXT[:50]])  # the tail TEXT[40:50] occurred before, followed by TEXT[50:]


def _true_next(depth):
    return TEXT[50 : 50 + depth]


def test_registered_and_default():
    from freespec.config import SpecConfig

    assert isinstance(make("mixture"), MixtureDrafter)
    assert SpecConfig().drafter == "mixture"


@pytest.mark.parametrize("budget", [Budget(1, 1), Budget(5, 3), Budget(24, 12), Budget(64, 16), Budget(0, 5)])
@pytest.mark.parametrize("adaptive", [True, False])
def test_draft_is_valid_within_budget(budget, adaptive):
    drafter = MixtureDrafter(adaptive=adaptive, ngram=True, min_prob=0.0)
    drafter.start("r", PROMPT)
    for step in range(30):
        draft = drafter.propose("r", budget)
        draft.validate(budget)
        assert draft.num_nodes == 0 or draft.confidence is not None
        if draft.num_nodes:
            assert np.all(draft.confidence[draft.parents[draft.parents >= 0]] >= draft.confidence[draft.parents >= 0])
            assert set(draft.sources) <= {"suffix", "ngram", "recycle", "lookahead"}
        drafter.extend("r", RNG.integers(10, 500, size=1 + step % 3))
    drafter.stop("r")


def test_copies_a_repeat_whole():
    drafter = MixtureDrafter(recycle=False)
    drafter.start("r", PROMPT)
    draft = drafter.propose("r", Budget(24, 12))
    assert draft.paths()[0][:12] == _true_next(12).tolist()
    assert set(draft.sources) == {"suffix"}


def test_dedup_across_sources_and_attribution():
    shared = RequestHistory(10_000)
    documents = DocumentIndex()
    documents.add(TEXT)
    drafter = MixtureDrafter(history=shared, documents=documents, adaptive=False, recycle=False, lookahead=False)
    drafter.start("old", PROMPT[:10])
    drafter.extend("old", TEXT[10:120])  # output: a later request finds TEXT in the shared corpus
    drafter.stop("old")
    drafter.start("r", PROMPT)
    draft = drafter.propose("r", Budget(64, 12))
    # three sources propose the same continuation: it appears once
    truth = _true_next(12).tolist()
    assert draft.paths().count(truth) == 1
    assert sum(1 for p, t in zip(draft.parents.tolist(), draft.token_ids.tolist()) if p == -1 and t == truth[0]) == 1
    assert len(draft.sources) == draft.num_nodes
    assert set(draft.sources) <= {"suffix", "history", "corpus"}
    # a source only the document corpus knows is attributed to it
    drafter.stop("r")
    doc_only = np.arange(1000, 1040)
    documents.add(doc_only)
    drafter.start("s", np.concatenate([[7, 8], doc_only[:10]]))
    draft = drafter.propose("s", Budget(16, 8))
    assert draft.token_ids.tolist()[:8] == doc_only[10:18].tolist()
    assert set(draft.sources) == {"corpus"}
    drafter.stop("s")


def test_add_documents_is_per_request():
    drafter = MixtureDrafter(recycle=False, lookahead=False)
    doc = np.arange(2000, 2040)
    drafter.start("a", [5, 6])
    drafter.add_documents("a", [doc])
    drafter.extend("a", doc[:6])
    assert drafter.propose("a", Budget(8, 8)).token_ids.tolist()[:4] == doc[6:10].tolist()
    drafter.stop("a")
    drafter.start("b", np.concatenate([[5, 6], doc[:6]]))
    assert drafter.propose("b", Budget(8, 8)).num_nodes == 0
    drafter.stop("b")


def test_no_tokens_cross_requests_with_recycle_shared_off():
    drafter = MixtureDrafter(ngram=True, recycle_shared=False, lookahead=True)
    drafter.start("a", TEXT)
    drafter.extend("a", TEXT[:30])
    drafter.stop("a")
    drafter.start("b", TEXT[:20])
    # "b" never saw TEXT[20:]: nothing it proposes can come from "a"
    for _ in range(5):
        draft = drafter.propose("b", Budget(24, 12))
        assert not set(draft.token_ids.tolist()) & (set(TEXT[20:].tolist()) - set(TEXT[:20].tolist()))
        drafter.extend("b", [9999])
    drafter.stop("b")
    assert drafter.history is None and not drafter.ngram.shared and not drafter.recycle.shared


def test_cost_model_fits_synthetic_timings():
    model = CostModel()
    assert model.cost(1) == 1.0 and model.cost(17) == pytest.approx(1.48)
    for i in range(40):
        for n in (1, 2, 4, 8, 16, 32, 64):
            t = 0.05 * (1 + 0.1 * (n - 1)) * (1 + 0.2 * RNG.standard_normal() * 0.1)
            model.add(n, t)
        if i % 5 == 0:
            model.add(1, 50.0)  # an outlier: medians ignore it
        model.add(500, 9.0)  # a prefill: ignored
    for n in (2, 8, 16, 64):
        assert model.cost(n) == pytest.approx(1 + 0.1 * (n - 1), rel=0.1)
    # 12 is a bucket of its own, unmeasured: a wide size reads the line between 8 and 16
    assert model.cost(12) == pytest.approx(2.1, rel=0.1)
    # 3 and 6 too, but small sizes are optimistic: never above the prior, never below their lower neighbour
    assert model.cost(3) == pytest.approx(model.cost(2)) and model.cost(6) == pytest.approx(model.cost(4))
    assert model.cost(80) > model.cost(64)


def test_cost_model_finds_a_cheap_size_between_dear_ones():
    model = CostModel()
    one_token_s = 0.1
    true_cost = {1: 1.0, 2: 1.07, 3: 1.13, 4: 1.9, 8: 2.7}  # float32 on a CPU: the cliff at 4 (measured)
    for n in (1, 2, 4, 8):
        for _ in range(5):
            model.add(n, one_token_s * true_cost[n])
    assert model.cost(3) == pytest.approx(1.07)  # unmeasured: optimistic, so a drafter tries it
    for _ in range(3):
        model.add(3, one_token_s * true_cost[3])
    assert model.cost(3) == pytest.approx(1.13) and model.cost(4) == pytest.approx(1.9)
    assert model.costs(np.array([1, 3, 80])).tolist() == pytest.approx([1.0, 1.13, model.cost(80)])


def test_cost_model_keeps_every_width_apart_and_the_sizer_stops_below_a_step():
    """Matrix tiles make c a staircase (bfloat16 on AMX: c(32) = 1.31, c(33) = 1.44): a width has its own value."""
    sizer = DraftSizer()
    forward_s = lambda n: 0.1 * (1 + 0.005 * (n - 1)) if n <= 16 else 0.125  # noqa: E731  a step after 16
    for width in range(1, 33):
        for _ in range(3):
            sizer.on_forward(ForwardReport(("r",), (width,), forward_s(width)))
    model = sizer.cost_model.of_batch(1)
    assert model.cost(16) == pytest.approx(1.075) and model.cost(17) == pytest.approx(1.25)
    assert model.at_most(16) == pytest.approx(1.075)
    probs = (0.9 ** np.arange(1, 25)).astype(np.float32)  # a chain whose nodes are worth less and less
    chain = Draft(np.arange(100, 124), np.arange(-1, 23), probs)
    chosen, _ = sizer.select("r", chain, [("k",)] * 24, Budget(64, 48))
    assert chosen.num_nodes == 15  # 16 tokens fed; a 16th node would cross the step
    # an unmeasured width reads the line between the widths it lies between, at the widths they were fed
    model = CostModel()
    for width, c in ((1, 1.0), (13, 1.2), (40, 1.6)):
        for _ in range(3):
            model.add(width, 0.1 * c)
    assert model.cost(20) == pytest.approx(1.2 + 0.4 * 7 / 27)


def test_host_cost_model_fits_a_line_through_pauses():
    """h(k) = a + b k from the halves' medians: the docstring's example, then a pause a shared machine adds."""
    model = HostCostModel(min_samples=4)
    for nodes, seconds in ((0, 1e-3), (0, 1e-3), (10, 2e-3)):
        model.add(nodes, seconds)
    assert model.fit() == (0.0, 0.0)  # too few steps
    model.add(10, 2e-3)
    assert model.fit() == pytest.approx((1e-3, 1e-4))
    rng = np.random.default_rng(0)
    model = HostCostModel()
    for step in range(64):
        nodes = int(rng.integers(0, 65))
        model.add(nodes, 2e-3 + 5e-5 * nodes + (0.1 if step % 16 == 0 else 0.0))  # 4 pauses of 100 ms
    a, b = model.fit()
    assert a == pytest.approx(2e-3, rel=0.05) and b == pytest.approx(5e-5, rel=0.1)
    same = HostCostModel(min_samples=2)
    for _ in range(8):
        same.add(16, 3e-3)
    assert same.fit() == pytest.approx((3e-3, 0.0))  # no spread in nodes: no slope to read
    model.add(-1, 1.0), model.add(3, float("nan")), model.add(3, float("inf"))  # ignored
    assert model.fit() == pytest.approx((a, b))


def test_the_sizer_prices_the_steps_host_work():
    """Under a flat curve a long chain of fading nodes is cut where a node's host work outweighs its worth, and
    a fixed host cost per step makes drafting worth more, not less; host_cost=False sizes by c(n) alone."""
    probs = (0.95 ** np.arange(1, 61)).astype(np.float32)
    chain = Draft(np.arange(100, 160), np.arange(-1, 59), probs)

    def chosen(host_cost, per_step_s, per_node_s):
        sizer = DraftSizer(host_cost=host_cost)
        rng = np.random.default_rng(1)
        for step in range(64):
            width = int(rng.integers(1, 65))
            sizer.on_forward(ForwardReport(("r",), (width,), 0.010 * (1 + 0.001 * (width - 1)),
                                           step_outside_s=per_step_s + per_node_s * (width - 1),
                                           step_nodes=width - 1))
        return sizer.select("r", chain, [("k",)] * 60, Budget(64, 64))[0].num_nodes

    assert chosen(False, 1e-3, 2e-4) == chosen(True, 0.0, 0.0) == 60  # c(61) = 1.06: every node pays
    # a node costs 0.02 of a forward outside it: the chain stops where 0.95 ** k falls near that
    cut = chosen(True, 1e-3, 2e-4)
    assert 20 <= cut <= 45
    assert chosen(True, 1e-2, 2e-4) > cut  # a dearer step: each token saves more, so more nodes pay
    # without an engine that measures it (step_outside_s None) nothing changes
    sizer = DraftSizer()
    sizer.on_forward(ForwardReport(("r",), (2,), 0.01))
    assert sizer.host_models == {}


def test_a_host_that_verifies_one_chain_gets_its_best_path_sized():
    """Budget(chain=True): the sizer prices the best path alone, not branches the host would drop; the
    mixture's draft is then a chain (every node the child of the one before)."""
    # root -> a (0.9) -> b (0.85) -> c (0.2); root -> x (0.6) -> y (0.55)
    tree = Draft(np.array([10, 11, 12, 20, 21]), np.array([-1, 0, 1, -1, 3]),
                 np.array([0.9, 0.85, 0.2, 0.6, 0.55], np.float32))
    sizer = DraftSizer()
    chosen, _ = sizer.select("r", tree, [("k",)] * 5, Budget(8, 8))
    assert sorted(chosen.token_ids.tolist()) == [10, 11, 12, 20, 21]  # the flat prior keeps both branches
    chosen, _ = sizer.select("r", tree, [("k",)] * 5, Budget(8, 8, chain=True))
    assert chosen.token_ids.tolist() == [10, 11, 12] and chosen.parents.tolist() == [-1, 0, 1]
    drafter = MixtureDrafter(min_match=1)
    drafter.start("r", PROMPT)
    draft = drafter.propose("r", Budget(16, 12, chain=True))
    assert draft.num_nodes > 0 and draft.parents.tolist() == list(range(-1, draft.num_nodes - 1))
    assert draft.token_ids.tolist() == _true_next(draft.num_nodes).tolist()


def _batch_sizer(batch_size, slope):
    """A sizer that measured c_B(n) = 1 + slope (n - 1) on padded forwards of ``batch_size`` rows."""
    sizer = DraftSizer()
    rows = tuple(f"r{i}" for i in range(batch_size))
    for width in range(1, 17):
        for _ in range(3):
            sizer.on_forward(ForwardReport(rows, (width,) * batch_size, 0.1 * (1 + slope * (width - 1))))
    return sizer


def test_a_padded_batch_is_cut_to_its_best_common_width():
    """fit_batch's worked example: one row's draft pays alone, but every row of a padded forward pays its width,
    so the batch drafts nothing; what the sizer remembers for judge is cut with it."""
    sizer = _batch_sizer(8, 0.3)
    chain = Draft(np.array([10, 11]), np.array([-1, 0]), np.array([0.9, 0.5], np.float32))
    alone = sizer.select("r0", chain, [("k", 0), ("k", 1)], Budget(8, 8, 8))[0]
    assert alone.num_nodes == 2  # 2.4 / 1.6 > 1.9 / 1.3 > 1
    drafts = [alone] + [Draft.empty()] * 7
    fitted = sizer.fit_batch([f"r{i}" for i in range(8)], drafts, 8)
    assert [draft.num_nodes for draft in fitted] == [0] * 8 and "r0" not in sizer._pending
    # two rows that both draft well: the common width is kept
    sizer = _batch_sizer(2, 0.3)
    good = Draft(np.array([10, 11]), np.array([-1, 0]), np.array([0.95, 0.9], np.float32))
    drafts = [sizer.select(rid, good, [("k", 0), ("k", 1)], Budget(8, 8, 2))[0] for rid in ("r0", "r1")]
    same = lambda fitted, drafts: all(a is b for a, b in zip(fitted, drafts, strict=True))  # noqa: E731
    assert same(sizer.fit_batch(["r0", "r1"], drafts, 2), drafts)
    # a batch of one, a draft the sizer did not choose, or a lookahead window: left as they are
    assert same(sizer.fit_batch(["r0"], drafts[:1], 1), drafts[:1])
    empty = Draft.empty()
    assert same(sizer.fit_batch(["r0", "r1"], [good, empty], 2), [good, empty])
    windowed = Draft(np.array([10, 11]), np.array([-1, 0]), np.array([0.9, 0.5], np.float32),
                     is_candidate=np.array([True, False]))
    sizer._pending["r0"] = (windowed, [("k", 0), ("k", 1)])
    assert same(sizer.fit_batch(["r0", "r1"], [windowed, empty], 2), [windowed, empty])


def _step_worth(rows, progress, second_token_cost, cap):
    """padded_step_values' value at ``cap``, computed by enumerating every joint outcome: row i accepts d tokens
    with probability P(g_i >= d) - P(g_i >= d + 1); the step is worth B + beta * sum g + alpha * (the rise of
    the least progress beyond the bonus token)."""
    import itertools

    beta = min(1.0, max(0.0, second_token_cost - 1.0))
    alpha = len(rows) * (1.0 - beta)
    outcomes = []
    for nodes in rows:
        tail = [1.0]
        for probability, depth in nodes[:cap]:
            tail += [0.0] * (depth + 1 - len(tail))
            tail[depth] += probability
        tail.append(0.0)
        outcomes.append([(d, tail[d] - tail[d + 1]) for d in range(len(tail) - 1)])
    least, worth = min(progress), 0.0
    for joint in itertools.product(*outcomes):
        chance = math.prod(p for _, p in joint)
        gained = [d for d, _ in joint]
        rise = min(done + g for done, g in zip(progress, gained)) - least
        worth += chance * (len(rows) + beta * sum(gained) + alpha * rise)
    return worth


def test_padded_step_values_is_the_expected_worth_of_every_outcome():
    """padded_step_values' worked example; where a second token costs a whole forward, every token is worth 1
    (the rows' sum); on random chains and trees, each cap's value is what enumerating every joint outcome gives."""
    assert padded_step_values([[(0.8, 1)], []], [3, 3], 1.5, 1) == pytest.approx([2.0, 2.4])
    rows = [[(0.9, 1), (0.8, 2)], [(0.9, 1), (0.7, 2)]]
    assert padded_step_values(rows, [3, 3], 2.5, 2) == pytest.approx([2.0, 3.8, 5.3])
    assert padded_step_values(rows, [3, 3], 1.0, 2) == pytest.approx([2.0, 2 + 2 * 0.81, 2 + 2 * (0.81 + 0.56)])
    rng = np.random.default_rng(11)
    for _ in range(150):
        rows = []
        for _ in range(int(rng.integers(2, 5))):
            n = int(rng.integers(0, 5))
            parents = [int(rng.integers(-1, i)) for i in range(n)]
            depth, probability = [], []
            for i, parent in enumerate(parents):  # siblings share their parent's probability, as a tree's paths do
                depth.append(1 if parent < 0 else depth[parent] + 1)
                above = 1.0 if parent < 0 else probability[parent]
                siblings = sum(probability[j] for j in range(i) if parents[j] == parent)
                probability.append(float(rng.random()) * max(0.0, above - siblings))
            rows.append(sorted(zip(probability, depth), key=lambda node: -node[0]))
        progress = rng.integers(0, 3, len(rows)).tolist()
        cost = 1.0 + 1.2 * float(rng.random())
        widest = max(len(nodes) for nodes in rows)
        values = padded_step_values(rows, progress, cost, widest)
        assert values == pytest.approx([_step_worth(rows, progress, cost, cap) for cap in range(widest + 1)])


def _random_selected_rows(rng, sizer: DraftSizer, budget: Budget, most: int) -> tuple[list, list, dict]:
    """``(request ids, drafts, kinds)``: ``budget.batch_size`` random calibrated trees of fewer than ``most``
    nodes (a child's probability at most its parent's), each sized by ``sizer.select_nodes`` under ``budget``,
    and the kinds of the nodes each kept."""
    rids, drafts, proposed_kinds = [f"r{i}" for i in range(budget.batch_size)], [], {}
    for rid in rids:
        n = int(rng.integers(0, most))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)], np.int32)
        confidence = rng.random(n).astype(np.float32)
        for i in range(n):
            if parents[i] >= 0:
                confidence[i] *= confidence[parents[i]]
        kinds = [("k", rid, i) for i in range(n)]
        chosen, keep, _ = sizer.select_nodes(rid, Draft(np.arange(100, 100 + n), parents, confidence), kinds, budget)
        drafts.append(chosen)
        proposed_kinds[rid] = [kinds[i] for i in keep]
    return rids, drafts, proposed_kinds


def _check_rows_keep_their_best_nodes(sizer: DraftSizer, rids: list, drafts: list, fitted: list,
                                      proposed_kinds: dict) -> None:
    """Each row of a joint cut is its draft where it keeps every node, else a valid tree of its best nodes (ties:
    the lower index), and what the sizer remembers for judge is that tree with those nodes' kinds."""
    for rid, draft, cut in zip(rids, drafts, fitted, strict=True):
        if cut.num_nodes == draft.num_nodes:
            assert cut is draft
            continue
        order = sorted(range(draft.num_nodes), key=lambda i: (-float(draft.confidence[i]), i))[:cut.num_nodes]
        assert cut.token_ids.tolist() == draft.token_ids[sorted(order)].tolist()
        cut.validate()
        if cut.num_nodes:
            assert sizer._pending[rid] == (cut, [proposed_kinds[rid][i] for i in sorted(order)])
        else:
            assert rid not in sizer._pending


def test_fit_batch_is_the_brute_force_common_width():
    """On random calibrated trees in random batches, the common cap is the one a brute-force search over every
    width finds (the rate each width gives, computed plainly: with the rows' progress, the step's expected worth
    over every joint outcome), each row keeps its best min(k, W) nodes and judge sees the kinds of those nodes
    only."""
    rng = np.random.default_rng(5)
    caps = []  # (the cap, the widest row's width) per batch
    for case in range(120):
        batch_size, slope = int(rng.integers(2, 9)), float(rng.choice([0.01, 0.1, 0.3, 1.0]))
        sizer = _batch_sizer(batch_size, slope)
        rids, drafts, proposed_kinds = _random_selected_rows(rng, sizer, Budget(16, 16, batch_size), 10)
        progress = None if case % 2 else rng.integers(0, 3, batch_size).tolist()
        fitted = sizer.fit_batch(rids, drafts, batch_size, progress)
        widths = [draft.num_nodes for draft in drafts]
        tops = [sorted(draft.confidence.tolist(), reverse=True) if draft.num_nodes else [] for draft in drafts]
        nodes = [sorted(zip(draft.confidence.tolist(), draft.depths().tolist()), key=lambda node: -node[0])
                 if draft.num_nodes else [] for draft in drafts]

        def rate(cap):
            fed = [min(width, cap) for width in widths]
            worth = sum(1.0 + sum(top[:k]) for top, k in zip(tops, fed)) if progress is None else \
                _step_worth(nodes, progress, sizer.cost_model.cost(2, batch_size), cap)
            return worth / sizer.cost_model.cost(1 + cap, batch_size)

        best = max(range(max(widths) + 1), key=lambda cap: (rate(cap), -cap))
        caps.append((best, max(widths)))
        assert [cut.num_nodes for cut in fitted] == [min(draft.num_nodes, best) for draft in drafts]
        _check_rows_keep_their_best_nodes(sizer, rids, drafts, fitted, proposed_kinds)
    assert any(cap == 0 < widest for cap, widest in caps) and any(0 < cap < widest for cap, widest in caps)
    assert any(0 < cap == widest for cap, widest in caps)


def _packed_sizer(slope: float) -> DraftSizer:
    """A sizer whose batch-1 curve is c_1(n) = 1 + slope (n - 1), measured as a packing host reports its steps
    (each by its tokens in all)."""
    sizer = DraftSizer()
    for width in range(1, 97):
        for _ in range(3):
            sizer.on_forward(ForwardReport(("x",), (width,), 0.1 * (1 + slope * (width - 1)), packed=True))
    return sizer


def test_a_packed_batch_keeps_the_best_nodes_of_all_rows():
    """_fit_packed's worked examples: sized alone (Budget.packed) each row keeps what pays for a step of its own;
    together the step keeps the nodes that beat what its tokens earn, whatever their rows."""
    budget = Budget(8, 8, 4, chain=True, packed=True)
    chain = lambda probs: Draft(np.arange(10, 10 + len(probs)), np.arange(-1, len(probs) - 1),  # noqa: E731
                                np.array(probs, np.float32))
    for slope, kept in ((0.1, [2, 0, 0, 0]), (0.01, [2, 1, 1, 1])):
        sizer = _packed_sizer(slope)
        rids = ["r0", "r1", "r2", "r3"]
        drafts = [sizer.select(rid, chain(probs), [("k", rid, i) for i in range(len(probs))], budget)[0]
                  for rid, probs in zip(rids, ([0.9, 0.5], [0.3], [0.3], [0.3]))]
        assert [draft.num_nodes for draft in drafts] == [2, 1, 1, 1]  # alone: 1.3 / c(2) > 1
        # slope 0.1: M = 0 gives 4 / 1.3 = 3.08, M = 1 4.9 / 1.4 = 3.5, M = 2 5.4 / 1.5 = 3.6, M = 3 5.7 / 1.6
        fitted = sizer.fit_batch(rids, drafts, 4, packed=True)
        assert [draft.num_nodes for draft in fitted] == kept
        assert all(cut is draft for cut, draft in zip(fitted, drafts) if cut.num_nodes == draft.num_nodes)
        assert all((rid in sizer._pending) == bool(k) for rid, k in zip(rids, kept))
    # the docstring's: two rows, [0.9, 0.5] and [0.3]; at slope 0.5 alone the first keeps one node, the second none
    sizer = _packed_sizer(0.5)
    budget = Budget(8, 8, 2, chain=True, packed=True)
    drafts = [sizer.select(rid, chain(probs), [("k", i) for i in range(len(probs))], budget)[0]
              for rid, probs in (("a", [0.9, 0.5]), ("b", [0.3]))]
    assert [draft.num_nodes for draft in drafts] == [1, 0]
    assert [draft.num_nodes for draft in sizer.fit_batch(["a", "b"], drafts, 2, packed=True)] == [1, 0]


def test_fit_packed_is_the_brute_force_best_choice_of_every_rows_nodes():
    """On random calibrated trees sized alone (Budget.packed), the packed cut keeps, of all choices of each row's
    best nodes (every combination of how many each row keeps), one of the best rate ``(B + kept probabilities) /
    c_1(B + kept nodes)``, with the fewest nodes among those; each row keeps its best nodes, judge their kinds."""
    import itertools

    rng = np.random.default_rng(8)
    cuts = 0
    for case in range(100):
        batch_size, slope = int(rng.integers(2, 6)), float(rng.choice([0.0, 0.01, 0.05, 0.2, 1.0]))
        sizer = _packed_sizer(slope)
        rids, drafts, proposed_kinds = _random_selected_rows(rng, sizer, Budget(16, 16, batch_size, packed=True), 6)
        fitted = sizer.fit_batch(rids, drafts, batch_size, packed=True)
        tops = [sorted(draft.confidence.tolist(), reverse=True) if draft.num_nodes else [] for draft in drafts]
        cost = lambda tokens: 1 + slope * (tokens - 1)  # noqa: E731  (the measured curve, exactly)

        def rate(counts):
            return (batch_size + sum(sum(top[:k]) for top, k in zip(tops, counts))) / cost(batch_size + sum(counts))

        choices = list(itertools.product(*(range(len(top) + 1) for top in tops)))
        best = max(rate(counts) for counts in choices)
        fewest = min(sum(counts) for counts in choices if rate(counts) >= best * (1 - 1e-9))
        counts = [draft.num_nodes for draft in fitted]
        assert rate(counts) == pytest.approx(best, rel=1e-9) and sum(counts) == fewest, (case, counts)
        cuts += counts != [draft.num_nodes for draft in drafts]
        _check_rows_keep_their_best_nodes(sizer, rids, drafts, fitted, proposed_kinds)
    assert 20 < cuts < 100  # the cut is taken, and left where every node pays


def test_chain_sizing_is_the_sorted_path_sizing():
    """Under Budget(chain=True) the sizer reads the best path as it stands when its probabilities never rise (the
    sort would not move it) and sorts it when they do: on random trees both give what sorting always gives."""
    rng = np.random.default_rng(3)
    for case in range(300):
        n = int(rng.integers(1, 12))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)], np.int32)
        confidence = rng.random(n).astype(np.float32)
        if case % 2:  # a calibrated tree: a child never above its parent
            for i in range(n):
                if parents[i] >= 0:
                    confidence[i] *= confidence[parents[i]]
        tree = Draft(np.arange(100, 100 + n), parents, confidence)
        budget = Budget(int(rng.integers(0, 12)), int(rng.integers(1, 12)), int(rng.integers(1, 9)), chain=True)
        sizer = DraftSizer()
        for width in (1, 2, 4, 8):
            sizer.on_forward(ForwardReport(("r",), (width,), 0.01 * (1 + 0.2 * (width - 1))))
        chosen, keep, _ = sizer.select_nodes("r", tree, [("k", i) for i in range(n)], budget)
        path = [i for i in tree.best_path() if tree.depths()[i] <= budget.max_depth]
        order = sorted(path, key=lambda i: (-float(confidence[i]), i))
        _, num_nodes = sizer._best([float(confidence[i]) for i in order], budget, ((0, 0.0),))
        assert keep == sorted(order[:num_nodes])
        assert chosen.token_ids.tolist() == [100 + i for i in keep]
        if case % 2:  # a path that never gains confidence: the choice is its first nodes, a chain
            assert chosen.parents.tolist() == list(range(-1, len(keep) - 1))
        assert sizer._pending.get("r", (None, []))[1] == [("k", i) for i in keep]


def test_calibrated_trees_keep_their_depths():
    """calibrate_lookup hands the sizer its tree with the depths its walk found (node_depths' values) and each
    node's ``calibrator.kind``."""
    from freespec.drafters.calibration import calibrate_lookup
    from freespec.tree import node_depths

    rng = np.random.default_rng(4)
    for _ in range(50):
        n = int(rng.integers(1, 16))
        parents = np.array([int(rng.integers(-1, i)) for i in range(n)], np.int32)
        raw = rng.random(n).astype(np.float32)
        calibrator, match_len = AcceptanceCalibrator(), int(rng.integers(0, 6))
        scored, kinds = calibrate_lookup(calibrator, "suffix", match_len, Draft(np.arange(n), parents, raw))
        depths = node_depths(parents).tolist()
        assert scored.depths().tolist() == depths
        raw = raw.tolist()
        assert kinds == [calibrator.kind("suffix", match_len, depths[i], raw[i] / (raw[p] if p >= 0 else 1.0))
                         for i, p in enumerate(parents.tolist())]  # the kinds calibrator.kind names
        assert all(scored.confidence[i] <= scored.confidence[p] for i, p in enumerate(parents.tolist()) if p >= 0)


@st.composite
def lookup_trees(draw):
    """(source, match_len, draft) of a step's lookup sources: random trees, raw frequencies (zeros and a missing
    confidence included) and match lengths."""
    trees = []
    for _ in range(draw(st.integers(0, 5))):
        n = draw(st.integers(0, 12))
        parents = np.array([draw(st.integers(-1, i - 1)) for i in range(n)], np.int32)
        raw = None if draw(st.booleans()) and n and draw(st.booleans()) else np.array(
            [draw(st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.4, 0.5, 0.8, 0.999, 1.0])) for _ in range(n)], np.float32)
        trees.append((draw(st.sampled_from(["suffix", "history", "corpus"])), draw(st.integers(0, 40)),
                      Draft(np.arange(n), parents, raw)))
    return trees


@given(lookup_trees())
@settings(deadline=None)  # two Numba kernels per example on a loaded 2-core machine
def test_calibrate_lookups_matches_its_twins(lookups):
    """A step's trees scored in one pass (calibrate_lookups' kernels) are what the naive walk gives each tree: depths,
    kinds (calibrator.kind's buckets), path probabilities (the product of the kinds' probabilities from the root);
    and each is what calibrate_lookup gives it alone."""
    from freespec.drafters.calibration import calibrate_lookup, calibrate_lookups
    from naive import naive_lookup_kinds, naive_path_probabilities

    calibrator = AcceptanceCalibrator()
    for kind, accepted in ((("suffix", 3, 5), True), (("suffix", 3, 5), False), (("history", 2, 4), True)):
        calibrator.update(kind, accepted)  # a few counted kinds, the rest at their priors
    calibrator.tick()
    scored = calibrate_lookups(calibrator, lookups)
    assert len(scored) == len(lookups)
    for (source, match_len, draft), (tree, kinds), alone in zip(lookups, scored, (calibrate_lookup(calibrator, *lookup)
                                                                                 for lookup in lookups)):
        parents = draft.parents.tolist()
        raw = [1.0] * len(parents) if draft.confidence is None else draft.confidence.tolist()
        depths, buckets = naive_lookup_kinds(parents, raw, match_len, calibrator.MATCH_EDGES, calibrator.FREQ_EDGES)
        assert tree.depths().tolist() == depths
        assert kinds == [(source, *bucket) for bucket in buckets]
        expected = naive_path_probabilities(parents, [calibrator.probability(kind) for kind in kinds])
        assert tree.confidence.tolist() == np.array(expected, np.float32).tolist()
        assert tree.sources == (source,) * len(parents) and tree.token_ids is draft.token_ids
        assert alone[1] == kinds and alone[0].confidence.tolist() == tree.confidence.tolist()


def test_calibrate_lookups_refuses_a_parent_after_its_child():
    from freespec.drafters.calibration import calibrate_lookups

    good = ("suffix", 2, Draft.chain([1, 2], score=0.5))
    bad = ("history", 2, Draft._of(np.array([1, 2], np.int64), np.array([-1, 1], np.int32),
                                   np.ones(2, np.float32)))
    with pytest.raises(ValueError, match="node 1 of the 'history' tree has parent 1"):
        calibrate_lookups(AcceptanceCalibrator(), [good, bad])
    assert calibrate_lookups(AcceptanceCalibrator(), []) == []


def test_cost_model_pools_scattered_widths_in_their_group():
    model = CostModel()
    for _ in range(3):
        model.add(1, 0.1)
    for width in (13, 15, 14):  # one forward each: none is measured alone, their group 13-16 is
        model.add(width, 0.12)
    assert not model.measured(14)
    assert model.cost(14) == pytest.approx(1.2)  # pinned at the group's median width
    assert model.at_most(10) == pytest.approx(1.2)  # a measured bound
    # a steep machine: once 8 is measured, 7 (its group) reads the line from 2 to 8 instead of the prior
    steep = CostModel()
    for _ in range(3):
        steep.add(1, 0.1), steep.add(2, 0.3), steep.add(8, 0.9)
    assert steep.cost(7) == pytest.approx(8.0) and steep.cost(5) == pytest.approx(3.0)
    assert steep.cost(20) == pytest.approx(9.0 + 8.0 / 7 * 12)  # past the last width: the mean slope


def _reference_known_points(model: CostModel) -> tuple[list[int], list[float]]:
    """The twin of ``CostModel._known_points``: every group of ``GROUPS`` in turn, every width of it."""
    counts = [len(times) for times in model._times]
    medians = model._medians.tolist()
    known_at, known_s = [0], [medians[0] if counts[0] else np.nan]
    for lo, hi in zip(model.GROUPS, model.GROUPS[1:]):  # widths lo + 1 .. hi, indices lo .. hi - 1
        own = [i for i in range(lo, hi) if counts[i] >= model.min_samples]
        if own:
            known_at += own
            known_s += [medians[i] for i in own]
        elif sum(counts[lo:hi]) >= model.min_samples:
            pooled = [(t, i) for i in range(lo, hi) for t in model._times[i]]
            known_at.append(int(statistics.median([i for _, i in pooled])))
            known_s.append(statistics.median(t for t, _ in pooled))
    return known_at, known_s


def _reference_curve(model: CostModel) -> list[float]:
    """The curve as numpy draws it (np.interp between the pinned widths, as measured): the twin of
    ``CostModel._compute_curve``."""
    prior = np.asarray(model.prior_list())
    base_s = model._one_token_s()
    if base_s is None:
        return np.maximum.accumulate(prior).tolist()
    known_at, known_s = _reference_known_points(model)
    got_at, got_s = model._known_points()
    assert got_at == known_at and np.array_equal(got_s, known_s, equal_nan=True)
    known = np.maximum(1.0, np.asarray(known_s) / base_s)
    known[0] = 1.0
    if model._prior_of is not None:  # a borrowed prior, steepened by what the pinned widths measured
        at = np.asarray(known_at[1:], np.int64)
        above = prior[at] > 1.0
        ratios = (known[1:][above] - 1.0) / (prior[at][above] - 1.0)
        if ratios.size and np.median(ratios) > 1.0:
            prior = 1.0 + (prior - 1.0) * np.median(ratios)
    curve = np.interp(np.arange(model.MAX_WIDTH, dtype=np.float64), np.asarray(known_at, np.float64), known)
    last, highest = known_at[-1], float(known.max())
    wide = _reference_wide_knots(model, base_s)
    if wide:  # past the last pinned width, the line towards the first pinned bin past MAX_WIDTH
        toward_at, toward = wide[0][0] - 1.0, max(highest, wide[0][1])
        curve[last + 1:] = np.interp(np.arange(last + 1, model.MAX_WIDTH, dtype=np.float64), [last, toward_at],
                                     [highest, toward])
    elif last > 0:
        slope = (highest - 1.0) / last
        curve[last + 1:] = highest + slope * (np.arange(last + 1, model.MAX_WIDTH) - last).astype(np.float64)
        if model._prior_of is not None:
            curve[last + 1:] = np.maximum(curve[last + 1:], prior[last + 1:])
    else:
        curve[1:] = prior[1:]
    curve[known_at] = known
    explored = {model._group[i] for i in known_at}
    for i in range(1, model.OPTIMISTIC_UP_TO):
        if model._group[i] not in explored:
            curve[i] = max(min(curve[i], prior[i]), curve[i - 1])
    return curve.tolist()


def _reference_wide_knots(model: CostModel, base_s: float) -> list[tuple[float, float]]:
    """(median width, c) of every bin of ``WIDE_BINS`` with ``min_samples`` forwards, from the forwards held."""
    knots = []
    for lo, hi in zip(model.WIDE_BINS, model.WIDE_BINS[1:]):
        held = [(width, seconds) for samples in model._wide for width, seconds in samples if lo < width <= hi]
        if len(held) >= model.min_samples:
            widths, seconds = np.array(held, np.float64).T
            knots.append((float(np.median(widths)), max(1.0, float(np.median(seconds)) / base_s)))
    return knots


def _reference_past(model: CostModel, widths: np.ndarray) -> np.ndarray:
    """The twin of the curve past ``MAX_WIDTH`` (``CostModel._extend``): np.interp through ``(MAX_WIDTH, c)`` and
    the pinned bins, past the last the mean slope from width 1 and the highest value; without a pinned bin, the
    slope of the last 16 widths."""
    curve = np.asarray(_reference_curve(model))
    base_s = model._one_token_s()
    wide = _reference_wide_knots(model, base_s) if base_s is not None else []
    if not wide:
        return curve[-1] + (curve[-1] - curve[-17]) / 16.0 * (widths - model.MAX_WIDTH)
    at = np.array([model.MAX_WIDTH] + [width for width, _ in wide], np.float64)
    values = np.array([curve[-1]] + [value for _, value in wide])
    top = max(values.max(), curve.max())
    slope = (top - 1.0) / (at[-1] - 1.0)
    return np.where(widths <= at[-1], np.interp(widths, at, values), top + slope * (widths - at[-1]))


def test_cost_model_curve_is_numpys_bit_for_bit():
    rng = np.random.default_rng(11)
    for case in range(300):
        steps = rng.random(CostModel.MAX_WIDTH - 1) * float(rng.choice([0.01, 0.3]))
        given = [1.0] + (1.0 + np.cumsum(steps)).tolist()  # a borrowed prior (BatchCostModel's), every 4th case
        model = CostModel(prior_slope=float(rng.choice([0.0, 0.03, 0.2])), window=8,
                          min_samples=int(rng.integers(1, 4)), prior=None if case % 4 else lambda: given)
        # every 5th case a packing host's steps past MAX_WIDTH too (WIDE_BINS), every 10th only those
        highest = 130 if case % 5 else 700
        widths = rng.choice(np.arange(1 + (case % 3 == 0) if case % 10 else 130, highest),
                            size=int(rng.integers(1, 12)))
        for _ in range(int(rng.integers(0, 60))):
            width = int(rng.choice(widths))
            model.add(width, 0.01 * (1 + width * float(rng.random())) * float(rng.normal(1.0, 0.05)))
        assert model.curve_list() == _reference_curve(model)
        past = np.arange(model.MAX_WIDTH + 1, 900)
        np.testing.assert_allclose(model.cost_list(899)[model.MAX_WIDTH:], _reference_past(model, past),
                                   rtol=1e-12, err_msg=f"case {case}")
        assert model.cost_list(899)[model.MAX_WIDTH:] == model.costs(past).tolist()  # the same floats either way


def test_cost_model_prior_until_measured_and_keeps_what_it_measured():
    model = CostModel(prior_slope=0.05)
    model.add(8, 0.1)  # no 1-token forward yet: still the prior
    assert model.cost(8) == pytest.approx(1.35)
    model.add(1, 0.1)
    model.add(16, 0.05)  # faster than one token: noise, c stays >= 1
    curve = model.curve()
    assert np.all(curve >= 1.0) and curve[0] == 1.0
    # a wider forward that costs less (kernels chosen by shape) keeps its value, and the sizer reads it
    shaped = CostModel(window=8)
    for width, ratio in ((1, 1.0), (2, 1.6), (3, 1.97), (4, 1.48), (8, 1.7), (16, 2.2)):
        for _ in range(3):
            shaped.add(width, 0.05 * ratio)
    got = shaped.curve_list()
    assert got[:4] == pytest.approx([1.0, 1.6, 1.97, 1.48]) and got[15] == pytest.approx(2.2)
    assert got[9] == pytest.approx(1.7 + 2 * (2.2 - 1.7) / 8)  # between pinned widths: the line
    assert got[4] == got[5] == pytest.approx(1.48)  # 5-6 not explored yet: optimistic, not below width 4
    assert shaped.at_most(2) == pytest.approx(1.6) and shaped.at_most(4) == pytest.approx(1.97)  # up to 4 tokens
    assert shaped.at_most(5) == pytest.approx(1.97) and shaped.at_most(17) == shaped.cost(17)  # none pinned above
    sizer = DraftSizer(host_cost=False)
    for width, ratio in ((1, 1.0), (2, 1.6), (3, 1.97), (4, 1.48), (8, 1.7), (16, 2.2)):
        for _ in range(3):
            sizer.on_forward(ForwardReport(("r",), (width,), 0.05 * ratio))
    chain = Draft(np.arange(100, 103), np.arange(-1, 2), np.array([0.6, 0.2, 0.1], np.float32))
    chosen = sizer.select("r", chain, [("k",)] * 3, Budget(24, 8))[0]
    assert chosen.num_nodes == 3  # 1.9 / c(4) = 1.28 beats 1.6 / c(2) = 1.0 and 1 / c(1) (non-decreasing: none)


def test_cost_model_redraws_its_curve_once_a_pinned_median_moves_more_than_redraw():
    """``add`` keeps the cached curve while every pinned width's median stays within ``REDRAW`` (1%) of the one
    the curve was drawn from, so up to the last pinned width the kept curve is within 2% of a curve drawn from
    scratch (a width's median and width 1's each within 1%); a median moved further, or a width pinned, redraws."""
    model = CostModel(window=8)
    for _ in range(3):
        model.add(1, 0.100)
        model.add(9, 0.200)
    drawn = model.curve_list()
    assert drawn[8] == pytest.approx(2.0)
    for _ in range(3):  # the median 0.200, 0.200, 0.2015: within 1% of 0.200, the same curve
        model.add(9, 0.203)
        assert model.curve_list() is drawn
    model.add(9, 0.203)  # 0.203, 1.5% from 0.200: redrawn
    assert model.curve_list() is not drawn and model.curve_list()[8] == pytest.approx(2.03)
    drawn = model.curve_list()
    for expected in (0.100, 0.100, 0.095):  # width 1's median: 0.100 kept, 5% lower redrawn
        model.add(1, 0.090)
        assert (model.curve_list() is drawn) == (expected == 0.100)
    assert model.curve_list()[8] == pytest.approx(0.203 / 0.095)
    drawn = model.curve_list()
    # a width not pinned, in a group (5-6) with no width pinned: kept while the group's pool is short of
    # min_samples (3); redrawn once the pool pins the group, as its pooled median moves and when the width's own
    # forwards pin it. In a group with a pinned width (9 of 9-12), the others' forwards leave the curve as it
    # is until one of them is pinned
    for width, redrawn in ((5, False), (6, False), (6, True), (5, True), (5, True),
                           (10, False), (11, False), (10, False), (10, True)):
        model.add(width, {5: 0.15, 6: 0.16}.get(width, 0.2))
        assert (model.curve_list() is not drawn) == redrawn, (width, redrawn)
        drawn = model.curve_list()
    assert drawn[4] == pytest.approx(0.15 / 0.095)
    # without a 1-token forward (a host that packs rows end to end never feeds one) the base is a line through
    # every median, and it holds the curve as width 1's median does: redrawn once it moves by more than REDRAW
    no_one_token = CostModel(window=8)
    for width, redrawn in ((4, False), (4, False), (4, True), (9, True), (9, False), (9, True), (20, False)):
        before = no_one_token.curve_list()
        no_one_token.add(width, 0.1 + width / 100)  # one width: no line (the prior); then on one line, at 1 0.11
        assert (no_one_token.curve_list() is not before) == redrawn, (width, redrawn)
    drawn = no_one_token.curve_list()
    assert no_one_token.one_token_s() == pytest.approx(0.11) and drawn[8] == pytest.approx(0.19 / 0.11)
    for redrawn in (False, True):  # width 20 on the line: a pool of 2 leaves it, 3 pin its group
        no_one_token.add(20, 0.30)
        assert (no_one_token.curve_list() is not drawn) == redrawn
        drawn = no_one_token.curve_list()
    for _ in range(2):  # width 20's median stays at 0.30
        no_one_token.add(20, 0.40)
        assert no_one_token.curve_list() is drawn
    no_one_token.add(20, 0.40)  # and moves to 0.35: so do the line at 1 and the curve
    assert no_one_token.curve_list() is not drawn and no_one_token.one_token_s() != pytest.approx(0.11)

    # where no pinned width's median moves, a kept curve is the one drawn from scratch (exactly where width 1 has
    # forwards; without, to the rounding of the line through the medians, which a new width on that line moves)
    rng = np.random.default_rng(4)
    for case in range(40):
        model = CostModel(window=8, min_samples=int(rng.integers(1, 4)))
        widths = rng.choice(np.arange(1, 60), size=int(rng.integers(2, 14)))
        for _ in range(80):
            width = int(rng.choice(widths))
            model.add(width, 0.1 * (1 + width / 40))
            fresh = CostModel(window=8, min_samples=model.min_samples)
            fresh._times, fresh._medians = model._times, model._medians
            if model.has_forward(1):
                assert model.curve_list() == fresh.curve_list(), (case, width)
            else:
                assert model.curve_list() == pytest.approx(fresh.curve_list(), rel=1e-12), (case, width)

    for widths in ([1, 2, 5, 16, 17, 23, 40], [9, 16, 17, 23, 40, 57, 64]):  # the second: no 1-token forward
        _check_kept_curves_stay_near_fresh_ones(widths)


def _check_kept_curves_stay_near_fresh_ones(widths: list[int]) -> None:
    rng = np.random.default_rng(3)
    model = CostModel(window=8)
    kept = redrawn = 0
    for step in range(600):
        width = int(rng.choice(widths))
        forward_s = 0.1 * (1 + width / 50) * float(rng.normal(1.0, 0.01 if rng.random() < 0.8 else 0.05))
        before = model._curve_list
        model.add(width, forward_s)
        cached = model.curve_list()
        kept += cached is before
        redrawn += before is not None and cached is not before
        fresh = CostModel(window=8)
        fresh._times, fresh._medians = model._times, model._medians
        last = max(fresh._known_points()[0])
        np.testing.assert_allclose(cached[:last + 1], fresh.curve_list()[:last + 1], rtol=0.021,
                                   err_msg=f"step {step}, width {width}")
    assert kept > 200 and redrawn > 20  # the cache was kept, and redrawn when a median moved


def test_calibration_learns_synthetic_outcomes():
    calibrator = AcceptanceCalibrator()
    good, bad = calibrator.kind("suffix", 2, 1, 1.0), calibrator.kind("ngram", 0, 1, 0.5)
    assert 0.3 < calibrator.probability(good) < 0.8
    rng = np.random.default_rng(0)
    for _ in range(400):
        calibrator.tick()
        calibrator.update(good, rng.random() < 0.9)
        calibrator.update(bad, rng.random() < 0.05)
    assert calibrator.probability(good) == pytest.approx(0.9, abs=0.06)
    assert calibrator.probability(bad) == pytest.approx(0.05, abs=0.04)
    # unjudged for many steps, an estimate fades back to the prior
    for _ in range(20 * 512):
        calibrator.tick()
    assert calibrator.probability(bad) == pytest.approx(calibrator.prior(bad), abs=0.01)
    # a longer match is a different kind, with a higher prior
    assert calibrator.kind("suffix", 20, 1, 1.0) != good
    assert calibrator.probability(calibrator.kind("suffix", 20, 1, 1.0)) > 0.8


def test_calibration_scales_a_sources_priors_by_its_judged_nodes():
    """A source accepted at half its priors' rate scales down the priors of its kinds that have no counts yet."""
    rng = np.random.default_rng(1)
    for pool_strength, factor in ((16.0, (0.4, 0.65)), (float("inf"), (1.0, 1.0))):
        calibrator = AcceptanceCalibrator(pool_strength=pool_strength)
        common = calibrator.kind("suffix", 2, 1, 1.0)  # prior 0.5, accepted 25% of the time
        rare, other = calibrator.kind("suffix", 8, 1, 1.0), calibrator.kind("corpus", 8, 1, 1.0)  # priors 0.8
        recycled = ("recycle", 1, 1, 0, 0)  # a kind whose base prior is given
        assert calibrator.probability(recycled, 0.6) == pytest.approx(0.6)
        for _ in range(400):
            calibrator.tick()
            calibrator.update(common, rng.random() < 0.25)
            calibrator.update(recycled, rng.random() < 0.9)
        low, high = factor
        assert low * 0.8 <= calibrator.probability(rare) <= high * 0.8 + 1e-9
        assert calibrator.probability(other) == pytest.approx(0.8)  # another source keeps its prior
        assert calibrator.scale("recycle") >= 1.0  # better than its given prior: scaled up (or fixed)
        assert calibrator.probability(("recycle", 2, 1, 0, 0), 0.5) >= 0.5
    with pytest.raises(ValueError, match="pool_strength"):
        AcceptanceCalibrator(pool_strength=0)


def test_choose_size():
    sizer = DraftSizer()  # prior cost c(n) = 1 + 0.03 (n - 1)
    chain = Draft.chain([5, 6, 7, 8])
    probs = [0.9, 0.8, 0.1, 0.02]

    def size(sizer, probs, num_nodes, extras=((0, 0.0),)):
        draft = Draft(chain.token_ids[: len(probs)], np.arange(-1, len(probs) - 1), probs)
        chosen, option = sizer.select("r", draft, [("k",)] * len(probs), Budget(num_nodes, 8), extras)
        return chosen.num_nodes, option

    assert size(sizer, probs, 24) == (3, 0)  # the worked example of DraftSizer's docstring
    assert size(sizer, probs, 2) == (2, 0)
    assert size(sizer, [0.02, 0.01], 24) == (0, 0)
    assert size(DraftSizer(adaptive=False), [0.02, 0.01], 24) == (2, 0)
    # not-candidate extras: worth it when their value beats their cost, skipped when over the budget
    assert size(sizer, probs, 24, ((0, 0.0), (4, 0.5))) == (2, 1)  # 4.7 / c(7) beats 4.8 / c(8)
    assert size(sizer, probs, 24, ((0, 0.0), (4, 0.001))) == (3, 0)
    assert size(sizer, probs, 5, ((0, 0.0), (4, 0.5))) == (1, 1)
    assert size(sizer, probs, 3, ((0, 0.0), (4, 0.5))) == (3, 0)
    assert size(DraftSizer(adaptive=False), probs, 6, ((0, 0.0), (4, 0.0))) == (2, 1)


def _run_steps(drafter, source_draft, truth_fn, num_steps, forward_s=lambda n: 0.05 * (1 + 0.06 * (n - 1))):
    """Drive the drafter with one fake source; return the draft sizes."""
    drafter._source_drafts = lambda request_id, budget: [("suffix", 12, source_draft)]
    drafter.start("r", PROMPT)
    drafter.on_forward(ForwardReport(("r",), (len(PROMPT),), 1.0, prefill=True))  # ignored
    for _ in range(3):
        drafter.on_forward(ForwardReport(("r",), (1,), forward_s(1)))
    sizes = []
    for step in range(num_steps):
        draft = drafter.propose("r", Budget(24, 12))
        sizes.append(draft.num_nodes)
        drafter.on_forward(ForwardReport(("r",), (1 + draft.num_nodes,), forward_s(1 + draft.num_nodes)))
        drafter.extend("r", truth_fn(step))
    drafter.stop("r")
    return sizes


def test_gating_drops_an_always_wrong_source():
    wrong = Draft.chain(list(range(100, 112)), score=1.0)  # confident, 12-token match, always wrong
    sizes = _run_steps(MixtureDrafter(recycle=False, lookahead=False), wrong, lambda step: [7], 45)
    assert sizes[0] == 12  # trusted at first (a long match)
    assert max(sizes[3:]) <= 3  # the tree shrinks after a few rejections
    assert sizes[-10:] == [0] * 10  # and is gated out: one node no longer pays c(2) / c(1)
    # without adaptive sizing it keeps proposing
    sizes = _run_steps(MixtureDrafter(adaptive=False, recycle=False, lookahead=False), wrong, lambda step: [7], 10)
    assert sizes == [12] * 10


def test_always_right_source_keeps_full_trees():
    chain = list(range(100, 124))
    right = Draft.chain(chain, score=1.0)
    sizes = _run_steps(MixtureDrafter(recycle=False, lookahead=False), right, lambda step: chain[:12] + [5], 30)
    assert sizes == [12] * 30  # the budget's depth caps the chain (the source returned 24 nodes)


def test_option_validation():
    for options in ({"adaptive": 1}, {"min_match": 0}, {"max_depth": 0}, {"min_prob": 1.5},
                    {"history_tokens": 1}, {"history_tokens": -3}, {"history": object()},
                    {"history": RequestHistory(100), "history_tokens": 100}, {"documents": [1, 2]},
                    {"ngram": "yes"}, {"ngram_below": 0}, {"prior_cost_slope": -1}, {"recycle": 1},
                    {"recycle_below": -1}, {"flat_max_cost": 0.5}, {"recycle_top_k": 0}, {"recycle_shared": "no"}, {"lookahead": "yes"},
                    {"lookahead_window": 0}, {"lookahead_ngram": 1}, {"lookahead_guesses": 0}):
        with pytest.raises(ValueError):
            MixtureDrafter(**options)
    with pytest.raises(ValueError):
        make("mixture", no_such_option=1)
    drafter = MixtureDrafter()
    with pytest.raises(ValueError):
        drafter.propose("nope", Budget(4, 4))
    drafter.start("r", [1, 2])
    with pytest.raises(ValueError):
        drafter.add_documents("r", ["text"])  # a text needs a tokenizer
    with pytest.raises(ValueError):
        drafter.add_documents("other", [[1, 2, 3]])


def test_observe_top_k_follows_the_sources():
    assert MixtureDrafter().observe_top_k == 8
    assert MixtureDrafter(recycle_top_k=4).observe_top_k == 4
    assert MixtureDrafter(recycle=False, lookahead=False).observe_top_k == 0
    assert MixtureDrafter(recycle=False).observe_top_k == 1  # the window reads the top-1
    assert MixtureDrafter().lookahead is not None and MixtureDrafter(lookahead=False).lookahead is None
    assert MixtureDrafter(early_exit=True).lookahead is None  # lookahead defaults to on, except beside early_exit


def test_observe_feeds_the_successor_table():
    drafter = MixtureDrafter(recycle_top_k=2, adaptive=False)
    drafter.start("r", [1, 2, 3])
    draft = drafter.propose("r", Budget(8, 4))
    drafter.observe("r", VerifyOutput(draft, np.zeros(0, np.int64), np.array([[42, 43]] * (draft.num_nodes + 1))))
    drafter.extend("r", [5])
    drafter.extend("r", [3])  # the context ends with 3 again: the model said 3 -> 42, 43; the text 3 -> 5
    draft = drafter.propose("r", Budget(8, 1))
    assert sorted(draft.token_ids.tolist()) == [5, 42, 43] and set(draft.sources) == {"recycle"}
    drafter.stop("r")


def test_recycle_below_keeps_long_matches_alone():
    for below, expect in ((0, {"suffix", "recycle"}), (4, {"suffix"})):
        drafter = MixtureDrafter(recycle_below=below, adaptive=False, lookahead=False)
        # a long match; the root TEXT[49] was also followed by 7 once: its text row is [7, TEXT[50]]
        drafter.start("r", np.concatenate([TEXT, TEXT[49:50], [7], TEXT[:50]]))
        assert set(drafter.propose("r", Budget(64, 12)).sources) == expect
        drafter.stop("r")


def _measure_c4(drafter, c4: float, one_token_s: float = 0.1) -> None:
    for _ in range(4):
        drafter.on_forward(ForwardReport(("r",), (1,), one_token_s))
        drafter.on_forward(ForwardReport(("r",), (4,), one_token_s * c4))


def test_recycling_and_lookahead_run_only_where_the_measured_cost_curve_is_flat():
    prompt = np.concatenate([TEXT, TEXT[49:50], [7], TEXT[:50]])
    for c4, flat in ((1.73, False), (1.10, True)):  # float32 / bfloat16 on AMX, README
        drafter = MixtureDrafter(adaptive=False)
        assert drafter.flat_curve() and drafter.observe_top_k == 8  # before any measurement the prior is flat
        _measure_c4(drafter, c4)
        assert drafter.flat_curve() == flat
        assert drafter.observe_top_k == (8 if flat else 0)  # no top-k computed for a gated-off table
        drafter.start("r", prompt)
        draft = drafter.propose("r", Budget(64, 12))
        expect = {"suffix", "recycle", "lookahead"} if flat else {"suffix"}
        assert set(draft.sources) == expect
        assert draft.candidate_mask().all() != flat  # the window rides (as not-candidates) only where flat
        drafter.stop("r")
    assert MixtureDrafter(flat_max_cost=float("inf")).flat_curve()


def test_the_gate_reads_measured_widths_not_the_sizers_exploration():
    """A steep curve closes the gate even when no 4-token forward was measured (the window keeps forwards wide)."""
    drafter = MixtureDrafter()
    for _ in range(4):
        drafter.on_forward(ForwardReport(("r",), (1,), 0.1))
        drafter.on_forward(ForwardReport(("r",), (16,), 0.22))  # float32 on a CPU: c(16) ~ 2.2
    assert drafter.cost_model.cost(4) < 1.5  # the sizer still explores 4 tokens optimistically
    assert drafter.cost_model.at_most(4) == pytest.approx(2.2)  # the nearest measured width above 4
    assert not drafter.flat_curve() and drafter.observe_top_k == 0
    drafter = MixtureDrafter()
    for _ in range(4):
        drafter.on_forward(ForwardReport(("r",), (1,), 0.1))
        drafter.on_forward(ForwardReport(("r",), (16,), 0.114))  # bfloat16 on AMX: c(16) ~ 1.14
    assert drafter.flat_curve()


def test_the_top_k_gate_reads_the_batch_size_being_drafted():
    """A process that decodes only padded batches has batch 1's prior (flat) and its batch bucket's own, steep,
    forwards: the engine computes no top-k for the recycling table while the batch drafts (it costs a padded
    batch of 5 rows about 0.5 ms a forward on a 2-core AMD EPYC), and does again once the batch is down to one
    row, where batch 1's curve opens the gate."""
    drafter = MixtureDrafter()
    for _ in range(3):
        drafter.on_forward(ForwardReport(("a", "b", "c", "d", "e"), (1,) * 5, 0.1))
        drafter.on_forward(ForwardReport(("a", "b", "c", "d", "e"), (5,) * 5, 0.18))
    prompt = np.arange(40) % 7
    for request_id in "ab":
        drafter.start(request_id, prompt)
    drafter.propose("a", Budget(16, 8, batch_size=5))
    assert not drafter.flat_curve(5) and drafter.observe_top_k == 0
    drafter.propose("b", Budget(16, 8, batch_size=1))
    assert drafter.flat_curve(1) and drafter.observe_top_k == 8


def test_a_closed_gate_draws_nothing_from_the_sources_that_read_the_model():
    """While c(4) is steep the mixture proposes exactly what the lookup-only mixture proposes."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 40, 300)
    gated, lookup = MixtureDrafter(), MixtureDrafter(recycle=False, lookahead=False)
    for drafter in (gated, lookup):
        _measure_c4(drafter, 1.9)
        drafter.start("r", prompt)
    for step in range(40):
        budget = Budget(16, 8)
        a, b = gated.propose("r", budget), lookup.propose("r", budget)
        assert a.node_paths() == b.node_paths()
        assert gated.observe_top_k == 0
        committed = rng.integers(0, 40, 1 + step % 3)
        gated.extend("r", committed)
        lookup.extend("r", committed)


def test_lookahead_window_rides_as_not_candidates():
    drafter = MixtureDrafter(lookahead=True, lookahead_window=3, lookahead_ngram=3, adaptive=False)
    drafter.start("r", TEXT[:30])
    budget = Budget(24, 12)
    draft = drafter.propose("r", budget).validate(budget)
    window = ~draft.candidate_mask()
    assert window.sum() == 3  # one level until the first outputs come back
    assert set(draft.sources[i] for i in np.nonzero(window)[0]) == {"lookahead"}
    topk = np.tile(np.arange(600, 608), (draft.num_nodes + 1, 1))
    drafter.observe("r", VerifyOutput(draft, np.zeros(0, np.int64), topk))
    drafter.extend("r", [7])
    draft = drafter.propose("r", budget).validate(budget)
    assert (~draft.candidate_mask()).sum() == 6  # two levels now: the outputs became the second
    drafter.stop("r")


def test_batch_cost_model_borrows_from_batch_one_until_measured():
    from freespec.drafters.calibration import BatchCostModel

    model = BatchCostModel()
    assert model.cost(5, 4) == pytest.approx((1 + 0.03 * 19) / (1 + 0.03 * 3))  # c_1(20) / c_1(4)
    for width, seconds in ((1, 0.1), (4, 0.3), (16, 0.9)):  # batch 8: widths cost much more
        for _ in range(3):
            model.add(8, width, seconds)
    assert model.cost(4, 8) == pytest.approx(3.0) and model.cost(16, 8) == pytest.approx(9.0)
    assert model.cost(4, 6) == pytest.approx(3.0)  # 6 rows: the batch-8 bucket
    assert model.cost(4, 1) == pytest.approx(1.09)  # batch 1 untouched
    assert model.costs(np.array([4, 16]), 8).tolist() == pytest.approx([3.0, 9.0])


def test_batch_cost_model_memo_follows_every_change_that_matters():
    """Values read between two forwards (``cost_list``, ``at_most``) are memoized until a forward changes a curve
    or gives a width its first forward; whatever the forwards, they read what a model that memoized nothing
    reads. The case that needs the second condition: bucket 4 with only width 1 measured borrows batch 1's
    curve; a first forward at width 5 (its group's pool one short of pinning: the curve is kept) makes the bucket
    answer for itself."""
    from freespec.drafters.calibration import BatchCostModel

    model, fresh = BatchCostModel(), BatchCostModel()
    for _ in range(3):
        model.add(4, 1, 0.1)
        fresh.add(4, 1, 0.1)
    borrowed = model.cost_list(140, 4)  # past MAX_WIDTH, batch 1's extrapolation
    assert model.at_most(4, 4) == math.inf  # draws bucket 4's own curve (width 1 alone: no bound)
    model.add(4, 5, 0.15)  # the curve kept (group 5-6's pool is 1 of 3), the bucket's second width
    fresh.add(4, 5, 0.15)
    assert model.cost_list(140, 4) == fresh.cost_list(140, 4) != borrowed  # its own curve's extrapolation

    rng = np.random.default_rng(5)
    for case in range(20):
        model, replay = BatchCostModel(), []
        for _ in range(60):
            batch_size = int(rng.choice([1, 1, 3, 4, 8]))
            width = int(rng.choice([1, 1, 2, 3, 5, 6, 9, 17, 40]))
            seconds = 0.1 * (1 + width / 30) * (1 + batch_size / 8)  # medians that never move: no REDRAW slack
            model.add(batch_size, width, seconds)
            replay.append((batch_size, width, seconds))
            fresh = BatchCostModel()
            for args in replay:
                fresh.add(*args)
            for size in (1, 4, 8):  # (a curve drawn at other moments can differ in its last bit)
                assert model.cost_list(12, size)[:12] == pytest.approx(fresh.cost_list(12, size)[:12], rel=1e-12)
                assert model.at_most(4, size) == pytest.approx(fresh.at_most(4, size), rel=1e-12)


def test_a_padded_prefill_keeps_the_gate_shut_until_the_bucket_measures():
    """A padding host's prefill of 5 rows marks bucket 4: before its first decode forward the flat gate reads
    ``inf`` there, not batch 1's prior line (which reads flat); a packing host's (vLLM's) buckets still borrow, and
    batch 1 is untouched."""
    padded, packed = MixtureDrafter(), MixtureDrafter()
    assert padded.flat_curve(5) and packed.flat_curve(5)  # the prior line: flat
    rows = tuple(f"r{i}" for i in range(5))
    padded.on_forward(ForwardReport(rows, (40,) * 5, 0.5, prefill=True))
    packed.on_forward(ForwardReport(rows, (40,) * 5, 0.5, prefill=True, packed=True))
    assert not padded.flat_curve(5) and not padded.flat_curve(3)  # 3 rows: bucket 4 too
    assert padded.flat_curve(1) and padded.flat_curve(2) and packed.flat_curve(5)  # other buckets: as they were
    for _ in range(3):  # its own forwards of 5 tokens a row, measured cheap: the gate opens on them
        padded.on_forward(ForwardReport(rows, (1,) * 5, 0.20))
        padded.on_forward(ForwardReport(rows, (5,) * 5, 0.21))
    assert padded.flat_curve(5)


def test_a_padded_budget_shuts_the_gate_from_the_prefill_steps_drafts():
    """A padding host's first step (the prefill, drafted before its forward is reported) asks with a budget of
    5 unpacked rows: that marks bucket 4 as its prefill's report would, so the step drafts no lookahead window
    or recycled nodes on the borrowed flat line. A packed budget (vLLM's) leaves its bucket borrowing."""
    padded, packed = MixtureDrafter(min_match=1), MixtureDrafter(min_match=1)
    for drafter in (padded, packed):
        drafter.start("r", PROMPT)
    assert padded.flat_curve(5) and packed.flat_curve(5)
    draft = padded.propose("r", Budget(16, 8, batch_size=5))
    assert not padded.flat_curve(5) and padded.flat_curve(1)
    assert draft.is_candidate is None  # no window's not-candidate nodes
    packed.propose("r", Budget(16, 8, batch_size=5, chain=True, packed=True))
    assert packed.flat_curve(5)


def test_a_batch_bucket_measures_against_the_borrowed_curve():
    """Bucket 8's own model, once it answers for itself, explores against c_1(8 n) / c_1(8), not against batch 1's
    prior line, and that borrowed curve is steepened by what the bucket measured (with widths 1 and 2 pinned,
    c_8(2) = 1.5 where the borrowed curve reads 1.198, width 3 is priced on the borrowed curve scaled by
    0.5 / 0.198: 2.0, not its neighbour's 1.5); the flat gate reads only its measured widths: shut until one of
    4 or more is measured."""
    from freespec.drafters.calibration import BatchCostModel

    model = BatchCostModel()
    borrowed = [(1 + 0.03 * (8 * n - 1)) / (1 + 0.03 * 7) for n in range(1, 9)]
    for width, seconds in ((1, 0.2), (2, 0.3)):
        for _ in range(3):
            model.add(8, width, seconds)
    assert model.of_batch(8).prior_list()[:8] == pytest.approx(borrowed)
    assert model.cost(2, 8) == pytest.approx(1.5)
    assert model.at_most(4, 8) == math.inf  # MixtureDrafter's gate: closed until a width of 4 or more is measured
    scale = 0.5 / (borrowed[1] - 1)
    assert model.cost(3, 8) == pytest.approx(1 + (borrowed[2] - 1) * scale) == pytest.approx(2.0)
    cheap = BatchCostModel()  # two early widths that read cheap (c_8(2) = 1.05) open no gate
    assert cheap.at_most(4, 8) == pytest.approx(borrowed[3])  # no bucket-8 forward yet: a packing host's borrowing
    for width, seconds in ((1, 0.2), (2, 0.21)):
        for _ in range(3):
            cheap.add(8, width, seconds)
    assert cheap.at_most(4, 8) == math.inf
    assert cheap.cost(40, 8) == pytest.approx(cheap.of_batch(8).prior_list()[39])  # nor a wide forward on faith
    for _ in range(3):  # its own 5-token forwards measured cheap: the gate opens on them
        cheap.add(8, 5, 0.24)
    assert cheap.at_most(4, 8) == pytest.approx(1.2)
    for _ in range(3):  # batch 1 measured steep: bucket 8's prior follows it
        model.add(1, 1, 0.1)
        model.add(1, 16, 0.3)
        model.add(1, 32, 0.5)
    assert model.of_batch(8).prior_list()[3] == pytest.approx(model.cost(32, 1) / model.cost(8, 1))
    # redrawn: past its pinned widths the bucket reads the borrowed curve where it is above its own line (2.0)
    assert model.cost(3, 8) == pytest.approx(model.cost(24, 1) / model.cost(8, 1)) and model.cost(3, 8) > 3


def test_a_padded_bucket_steepens_its_borrowed_prior_by_what_it_measured():
    """A process that decoded only batches has batch 1's prior line as every bucket's borrowed curve (a GPU's
    slope). Measured on smollm2-135m float32, 5 rows on a 2-core AMD EPYC: c_4(3) = 1.45 where the borrowed curve
    read 1.22, and widths 4 and 5, unpinned, were priced at 1.45 (clamped to their neighbour; measured 1.68-1.80):
    most forwards that drafted were such explorations, and Spec-Bench's stem questions ran at 0.91x plain batched
    decoding. Scaled by the measured ratio, width 4 reads 1.675. Where the bucket measures cheaper than its
    borrowed curve (a flat machine), the borrowed curve stays as it was; batch 1's own curve is never rescaled."""
    from freespec.drafters.calibration import BatchCostModel

    steep, flat = BatchCostModel(), BatchCostModel()
    for width, seconds in ((1, 0.1), (3, 0.145)):
        for _ in range(3):
            steep.add(5, width, seconds)
            flat.add(5, width, 0.1 if width == 1 else 0.101)
    borrowed = steep.of_batch(4).prior_list()
    scale = 0.45 / (borrowed[2] - 1)
    assert steep.cost(3, 5) == pytest.approx(1.45)
    assert steep.cost(4, 5) == pytest.approx(1 + (borrowed[3] - 1) * scale) == pytest.approx(1.45 + 0.45 / 2)
    assert flat.cost(4, 5) == pytest.approx(borrowed[3])  # the borrowed curve as it was: c_1(16) / c_1(4)
    single = BatchCostModel()
    for width, seconds in ((1, 0.1), (3, 0.145)):
        for _ in range(3):
            single.add(1, width, seconds)
    assert single.cost(4, 1) == pytest.approx(max(1.45, min(1 + 0.03 * 3, 1.675)))  # batch 1: optimistic as before


def test_a_bucket_reads_each_batch_size_against_its_own_one_token_forward():
    """Bucket 4 holds batches of 3, 4 and 5 rows: a forward of 6 tokens per row costs 1.9 one-token forwards at
    each size, whose one-token forwards differ (0.12, 0.14, 0.16 s). A shrinking batch drafts wide while it has
    more rows; the bucket's curve reads 1.9, where the medians of pooled seconds read 0.304 / 0.14 = 2.17, and
    each size's one-token time is its own."""
    from freespec.drafters.calibration import BatchCostModel

    scaled, pooled = BatchCostModel(), CostModel()
    for rows, one_token_s, widths in ((5, 0.16, (1, 6, 6, 6)), (4, 0.14, (1, 1, 1, 6)), (3, 0.12, (1, 6))):
        for width in widths:
            seconds = one_token_s * (1.9 if width == 6 else 1.0)
            scaled.add(rows, width, seconds)
            pooled.add(width, seconds)
    assert scaled.cost(6, 4) == pytest.approx(1.9) and scaled.cost(6, 5) == pytest.approx(1.9)
    assert pooled.cost(6) == pytest.approx(0.16 * 1.9 / 0.14)
    assert [scaled.one_token_s(rows) for rows in (3, 4, 5)] == pytest.approx([0.12, 0.14, 0.16])


def test_a_large_batch_drafts_less():
    drafter = MixtureDrafter(recycle=False)
    for width in (1, 2, 3, 4, 16):  # at batch 8, each token more per row costs half a forward
        for _ in range(3):
            drafter.on_forward(ForwardReport(tuple(range(8)), (width,) * 8, 0.1 * (1 + 0.5 * (width - 1))))
    probs = [0.3, 0.2, 0.1]  # 0.6 expected tokens: worth 3 nodes at c_1 (the prior), nothing at c_8
    draft = Draft([5, 6, 7], [-1, 0, 1], probs)
    for batch_size, expect in ((1, 3), (8, 0)):
        chosen, _ = drafter.sizer.select("r", draft, [("k",)] * 3, Budget(24, 8, batch_size))
        assert chosen.num_nodes == expect


def test_a_packed_batch_is_priced_by_its_tokens_in_all():
    """vLLM lays rows end to end: a step costs 110 ms + 6 ms per token fed in all. Steps of 8 rows where one or
    two rows draft 8 tokens and a step where all eight do have the same widest row (9), not the same cost."""
    rng = np.random.default_rng(0)

    def step_s(tokens_per_row):
        return 0.110 + 0.006 * sum(tokens_per_row)

    def reports(packed):
        for _ in range(40):
            drafting = int(rng.integers(1, 3))  # rows with a draft of 8 tokens (few copy at once); the others feed 1
            rows = (9,) * drafting + (1,) * (8 - drafting)
            yield ForwardReport(tuple(range(8)), rows, step_s(rows), packed=packed)
        for _ in range(5):
            yield ForwardReport(tuple(range(8)), (1,) * 8, step_s((1,) * 8), packed=packed)

    truth = step_s((9,) * 8) / step_s((1,) * 8)  # 3.4
    for packed in (True, False):
        sizer = DraftSizer()
        for report in reports(packed):
            sizer.on_forward(report)
        if packed:
            assert sizer.cost_model.cost(9, 8) == pytest.approx(truth, rel=0.05)
        else:  # filed by the widest row, the mixed steps make eight drafting rows look cheap
            assert sizer.cost_model.cost(9, 8) < 0.7 * truth
    assert ForwardReport(("a", "b"), (9, 1), 0.1, packed=True).num_tokens == 10


def test_a_packed_step_wider_than_max_width_teaches_the_curve():
    """From 15 requests on at K 8, a vLLM step feeds more than ``CostModel.MAX_WIDTH`` tokens. Such steps pool in
    ``WIDE_BINS``: the one-token time and the curve past the widest width fed below ``MAX_WIDTH`` follow them,
    where the sizer read the prior line (no step of 32 rows counted) or the slope of narrower steps."""
    rng = np.random.default_rng(1)

    def cpu(n):  # a CPU: every token fed costs
        return 0.110 + 0.006 * n

    def gpu(n):  # a GPU: flat to 256 tokens, then compute-bound
        return 0.010 * max(1.0, n / 256)

    for step_s in (cpu, gpu):
        for low in (33, 130):  # 32 requests feed 33 tokens and more; 130: none under MAX_WIDTH
            sizer = DraftSizer()
            for _ in range(200):  # 32 rows: one row's draft holds every draft token of the step (its cost alike)
                for fed in (32 + int(rng.integers(1, 30)) * int(rng.integers(1, 16)), low + int(rng.integers(160))):
                    sizer.on_forward(ForwardReport(tuple(range(32)), (1,) * 31 + (fed - 31,), step_s(fed),
                                                   packed=True))
            costs = sizer.cost_model.cost_list(600, 1)
            # within 1%, but where the one-token time comes from a line through the bins across the GPU's rise
            # (8% low: every cost that much high), and between two bins' medians around that rise (the line
            # between them: 1.13 at 250 tokens, where the GPU pays 1.0)
            rel = 0.01 if step_s is cpu or low < 130 else 0.1
            for n in (40, 100, 160, 300, 400):
                if n >= low:
                    assert costs[n - 1] == pytest.approx(step_s(n) / step_s(1), rel=rel), (step_s.__name__, low, n)
            assert costs[249] == pytest.approx(step_s(250) / step_s(1), rel=0.01 if step_s is cpu else 0.15)
            assert sizer.cost_model.one_token_s(1) == pytest.approx(step_s(1), rel=rel)
    model = CostModel()
    assert not model.add(CostModel.WIDE_BINS[-1] + 1, 0.5) and not model.has_forward(CostModel.WIDE_BINS[-1] + 1)


def test_a_pinned_wide_bin_redraws_the_curve_as_a_pinned_width_does():
    """A bin past MAX_WIDTH holds the drawn curve while its median stays within REDRAW (and the one-token time
    holds); it redraws the curve once pinned, and once its median moves further."""
    model = CostModel(window=8)
    for _ in range(3):
        model.add(1, 0.100)
    drawn = model.curve_list()
    for width, seconds, redrawn in ((200, 0.5, False), (210, 0.5, False), (220, 0.5, True),  # pinned at 3
                                    (200, 0.504, False), (200, 0.6, False), (200, 0.6, False),  # 0.502, 0.5
                                    (200, 0.6, False), (200, 0.6, True),  # median 0.504 (0.8%), then 0.552
                                    (300, 0.7, False)):  # another bin, short of min_samples
        model.add(width, seconds)
        assert (model.curve_list() is not drawn) == redrawn, (width, seconds)
        drawn = model.curve_list()
    assert model.cost_list(200)[199] == pytest.approx(0.552 / 0.100)
    assert model.measured(200) and not model.measured(300) and model.has_forward(300)
