"""verify.accept_tree on its own, with synthetic target scores (as vLLM tests its rejection sampler).

Rows are the root (0) and the draft nodes (i + 1). ``rows`` below gives each
row's scores; greedy takes the argmax, sampling draws from softmax(scores).
"""

from collections import Counter

import numpy as np
import pytest
import torch

from freespec.verify import accept_tree

VOCAB = 6


def one_hot_rows(tokens_by_row: dict[int, int], num_rows: int) -> list[torch.Tensor]:
    """Scores whose argmax at row r is tokens_by_row[r] (token 0 elsewhere)."""
    rows = []
    for row in range(num_rows):
        scores = torch.zeros(VOCAB)
        scores[tokens_by_row.get(row, 0)] = 5.0
        rows.append(scores)
    return rows


def run(token_ids, parents, rows, do_sample=False, is_candidate=None):
    calls = []

    def score_row(row, path):
        calls.append((row, list(path)))
        return rows[row]

    acceptance = accept_tree(np.asarray(token_ids), np.asarray(parents), score_row, do_sample,
                             None if is_candidate is None else np.asarray(is_candidate, bool))
    return acceptance, calls


def test_perfect_match_accepts_the_whole_chain_and_adds_a_bonus():
    rows = one_hot_rows({0: 2, 1: 3, 2: 4, 3: 5}, 4)
    acceptance, calls = run([2, 3, 4], [-1, 0, 1], rows)
    assert acceptance.accepted_nodes == [0, 1, 2]
    assert acceptance.token_ids == [2, 3, 4, 5]  # bonus 5 from the last node's row
    assert calls == [(0, []), (1, [2]), (2, [2, 3]), (3, [2, 3, 4])]  # each row sees its own prefix
    assert [int(s.argmax()) for s in acceptance.scores] == [2, 3, 4, 5]


def test_early_mismatch_accepts_nothing_and_scores_only_the_root():
    rows = one_hot_rows({0: 1, 1: 3}, 4)
    acceptance, calls = run([2, 3, 4], [-1, 0, 1], rows)
    assert acceptance.accepted_nodes == [] and acceptance.token_ids == [1]
    assert calls == [(0, [])]


#         root ─┬─ 1 (node 0) ─┬─ 2 (node 1) ── 3 (node 3) ── 4 (node 5)
#               │              └─ 5 (node 2) ── 1 (node 4)
#               └─ 2 (node 6)
TREE_TOKENS = [1, 2, 5, 3, 1, 4, 2]
TREE_PARENTS = [-1, 0, 0, 1, 2, 3, -1]


@pytest.mark.parametrize("num_accepted,target,expected_nodes,expected_tokens", [
    (0, {0: 3}, [], [3]),                                   # no root child is 3
    (1, {0: 2, 7: 0}, [6], [2, 0]),                         # the second root child, a leaf
    (1, {0: 1, 1: 4}, [0], [1, 4]),                         # node 0's children are 2 and 5
    (2, {0: 1, 1: 5, 3: 3}, [0, 2], [1, 5, 3]),             # node 2's child is 1
    (3, {0: 1, 1: 2, 2: 3, 4: 0}, [0, 1, 3], [1, 2, 3, 0]), # node 3's child is 4
    (4, {0: 1, 1: 2, 2: 3, 4: 4, 6: 5}, [0, 1, 3, 5], [1, 2, 3, 4, 5]),  # the deepest path, all accepted
])
def test_mismatch_at_each_depth_of_a_tree(num_accepted, target, expected_nodes, expected_tokens):
    rows = one_hot_rows(target, len(TREE_TOKENS) + 1)
    acceptance, calls = run(TREE_TOKENS, TREE_PARENTS, rows)
    assert acceptance.accepted_nodes == expected_nodes
    assert acceptance.token_ids == expected_tokens
    # one scored row per emitted token: the root, then each accepted node
    assert [row for row, _ in calls] == [0] + [node + 1 for node in expected_nodes]
    assert len(acceptance.accepted_nodes) == num_accepted


def test_not_candidate_nodes_are_never_accepted():
    # node 1 (token 3) is the target's choice after node 0, but it is not a candidate
    rows = one_hot_rows({0: 2, 1: 3, 2: 4}, 4)
    acceptance, _ = run([2, 3, 3], [-1, 0, 1], rows, is_candidate=[True, False, False])
    assert acceptance.accepted_nodes == [0] and acceptance.token_ids == [2, 3]
    # a candidate sibling with the same token as a not-candidate one is the one accepted
    acceptance, _ = run([2, 3, 3], [-1, 0, 0], rows, is_candidate=[True, False, True])
    assert acceptance.accepted_nodes == [0, 2] and acceptance.token_ids == [2, 3, 0]


def test_sampling_emits_exactly_the_target_distribution():
    """Two emitted tokens through a chain draft [2, 3]: their joint law is p_root x p_next, exactly.

    Exact law: the first token y0 ~ p0; if y0 == 2 the second is drawn at node 0's row
    (p1), else the walk stops (one token). Thresholds: N = 20000 draws, every cell's
    frequency within 4 standard errors of its exact probability.
    """
    p0 = torch.tensor([0.05, 0.1, 0.5, 0.15, 0.1, 0.1])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.3, 0.1, 0.1])
    rows = [p0.log(), p1.log(), torch.zeros(VOCAB)]
    torch.manual_seed(0)
    n = 20000
    counts = Counter()
    for _ in range(n):
        acceptance, _ = run([2, 3], [-1, 0], rows, do_sample=True)
        counts[tuple(acceptance.token_ids[:2])] += 1
    exact = {(y0,): float(p0[y0]) for y0 in range(VOCAB) if y0 != 2}
    exact.update({(2, y1): float(p0[2] * p1[y1]) for y1 in range(VOCAB)})
    assert set(counts) <= set(exact)
    for cell, probability in exact.items():
        stderr = (probability * (1 - probability) / n) ** 0.5
        assert abs(counts[cell] / n - probability) < 4 * stderr + 1e-9, (cell, counts[cell] / n, probability)


def test_sampling_consumes_one_draw_per_emitted_token():
    """Each emitted token is one multinomial draw, as in plain sampling (the RNG stays in step)."""
    rows = one_hot_rows({0: 2, 1: 3, 2: 4}, 4)  # peaked: the draws follow the chain
    torch.manual_seed(7)
    acceptance, _ = run([2, 3], [-1, 0], rows, do_sample=True)
    after_tree = torch.rand(1)
    torch.manual_seed(7)
    for row in range(len(acceptance.token_ids)):
        torch.multinomial(torch.softmax(rows[row], -1), 1)
    assert torch.equal(after_tree, torch.rand(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_choice_is_torch_argmax(dtype):
    """``choose_token``'s fast greedy path picks the index ``torch.argmax`` picks: the first maximum, the first NaN,
    index 0 of an all -inf row; bfloat16 (no numpy dtype) takes torch's path."""
    from freespec.verify import choose_token

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(151936, generator=gen), torch.zeros(50), torch.full((9,), float("-inf")),
            torch.randint(0, 3, (1000,), generator=gen).float()]  # ties everywhere
    with_nan = torch.randn(100, generator=gen)
    with_nan[[7, 40]] = float("nan")
    rows += [with_nan, torch.tensor([float("inf"), 1.0, float("inf")])]
    for row in rows:
        row = row.to(dtype)
        assert choose_token(row, do_sample=False) == int(torch.argmax(row, dim=-1))


def test_plain_stop_rule_answers_as_the_criteria_objects_do():
    """The engine's shortcut for the criteria plain generate() builds (max length, EOS) gives the objects' answer
    for every length and last token; past max_position_embeddings, or with any other criterion, it steps aside."""
    from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, StoppingCriteria,
                                                           StoppingCriteriaList)

    from freespec.engine import PlainStopRule

    criteria = StoppingCriteriaList([MaxLengthCriteria(12, max_position_embeddings=10), EosTokenCriteria([3, 7])])
    rule = PlainStopRule.of(criteria)
    assert rule == PlainStopRule(12, frozenset({3, 7}), 10)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, 9, size=int(rng.integers(1, 14))).tolist()
        if not rule.applies(len(ids)):
            assert len(ids) > 10
            continue
        expected = bool(criteria(torch.tensor([ids]), None).any())
        assert rule.stops(len(ids), ids[-1]) == expected, ids
    one_eos = PlainStopRule.of(StoppingCriteriaList([EosTokenCriteria(torch.tensor(5))]))
    assert one_eos == PlainStopRule(None, frozenset({5}), None) and one_eos.applies(10 ** 6)
    assert PlainStopRule.of(StoppingCriteriaList([])) == PlainStopRule(None, frozenset(), None)

    class Mine(MaxLengthCriteria):
        pass

    class Custom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    assert PlainStopRule.of(StoppingCriteriaList([Mine(5)])) is None
    assert PlainStopRule.of(StoppingCriteriaList([EosTokenCriteria(2), Custom()])) is None
