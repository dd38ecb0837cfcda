"""Sampling is lossless: continuations sampled through draft chains and draft
trees have exactly the target distribution.

On a tiny random model with an 8-token vocabulary, the exact distribution of
two-token continuations (EOS after one token included) is enumerated from
the model with the same warpers generate() applies (temperature, top-k,
top-p, repetition penalty). Then N = 2000 continuations are sampled with a
fixed seed through (a) a chain draft, (b) a tree draft, (c) plain sampling,
(d) token recycling and (e) the mixture with a lookahead window (both
deterministic drafts learned from earlier calls' top-k).

Thresholds (documented): Pearson's chi-square against the exact
distribution, cells with expected count < 5 pooled, must have p > 1e-3, and
the total variation distance must be < 0.1 (its expected value at N = 2000
over ~40 cells is about 0.05).
"""

import math
from collections import Counter

import numpy as np
import pytest
import torch

import freespec
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.drafters.mixture import MixtureDrafter
from freespec.drafters.recycle import RecycleDrafter
from freespec.testing.models import tiny_random_llama

from conftest import plain_generate

VOCAB = 8
N = 2000
GEN = dict(do_sample=True, max_new_tokens=2, temperature=0.9, top_k=6, top_p=0.95, repetition_penalty=1.2)


class FixedDrafter(Drafter):
    """Proposes the same tree at every step (any deterministic draft must be lossless)."""

    name = "fixed"

    def __init__(self, draft: Draft):
        super().__init__()
        self.draft = draft

    def _propose(self, request_id, budget: Budget) -> Draft:
        return self.draft.prune(budget.num_nodes, budget.max_depth)


@pytest.fixture(scope="module")
def model():
    return tiny_random_llama(vocab_size=VOCAB, seed=5, initializer_range=0.5)


def _exact_distribution(model, prompt):
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(GEN["repetition_penalty"]),
                                      TemperatureLogitsWarper(GEN["temperature"]), TopKLogitsWarper(GEN["top_k"]),
                                      TopPLogitsWarper(GEN["top_p"])])
    eos = model.config.eos_token_id

    def probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1:].to(torch.float32)
        return torch.softmax(processors(torch.tensor([ids]), logits), -1)[0].double().numpy()

    base = prompt[0].tolist()
    out = {}
    first = probs(base)
    for x1 in range(VOCAB):
        if first[x1] == 0:
            continue
        if x1 == eos:
            out[(x1,)] = first[x1]
            continue
        second = probs(base + [x1])
        for x2 in range(VOCAB):
            if second[x2] > 0:
                out[(x1, x2)] = first[x1] * second[x2]
    return out


def _chi_square_p(counts: Counter, exact: dict, n: int) -> float:
    assert set(counts) <= set(exact), f"impossible outcomes {set(counts) - set(exact)}"
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in exact.items():
        if prob * n < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += prob * n
        else:
            cells.append((counts.get(key, 0), prob * n))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    # Wilson-Hilferty: (stat/df)^(1/3) is ~normal(1 - 2/(9df), 2/(9df))
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _sample(model, prompt, drafter):
    torch.manual_seed(1234)
    counts = Counter()
    if drafter is not None:
        freespec.patch(model, drafter=drafter)
    try:
        for _ in range(N):
            if drafter is None:
                out = plain_generate(model, prompt, **GEN)
            else:
                out = model.generate(prompt, **GEN)
                assert freespec.stats(model).fallback_reason is None
            counts[tuple(out[0, prompt.shape[1]:].tolist())] += 1
    finally:
        if drafter is not None:
            freespec.unpatch(model)
    return counts


def _likely_chain(exact):
    best = max(exact, key=exact.get)
    return Draft.chain(list(best))


@pytest.mark.parametrize("mode", ["chain", "tree", "plain", "recycle", "mixture-lookahead"])
def test_sampled_distribution_is_exact(model, mode):
    prompt = torch.tensor([[0, 3, 5, 2, 6, 3]])
    exact = _exact_distribution(model, prompt)
    assert abs(sum(exact.values()) - 1) < 1e-6
    if mode == "chain":
        drafter = FixedDrafter(_likely_chain(exact))
    elif mode == "tree":
        first = sorted({k[0] for k in exact}, key=lambda t: -sum(v for k, v in exact.items() if k[0] == t))
        token_ids, parents = [], []
        for t in first[:3]:  # the three likeliest first tokens, each with two children
            token_ids.append(t)
            parents.append(-1)
            node = len(token_ids) - 1
            for c in (2, 4):
                token_ids.append(c)
                parents.append(node)
        drafter = FixedDrafter(Draft(np.array(token_ids), np.array(parents)))
    elif mode == "recycle":  # trees from the target's own top-k of earlier calls (one shared table)
        drafter = RecycleDrafter(adaptive=False)
    elif mode == "mixture-lookahead":  # recycled trees beside a lookahead window of not-candidate nodes
        drafter = MixtureDrafter(lookahead=True, lookahead_window=2, lookahead_ngram=2, adaptive=False)
    else:
        drafter = None
    counts = _sample(model, prompt, drafter)
    if drafter is not None and mode not in ("chain", "tree"):
        assert (drafter.recycle.table_for(None).model >= 0).any()  # it learned, so later calls drafted
    tv = 0.5 * sum(abs(counts.get(k, 0) / N - v) for k, v in exact.items())
    p_value = _chi_square_p(counts, exact, N)
    assert tv < 0.1, f"total variation {tv:.3f}"
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"
