"""Batched speculation: every row of a left-padded batch speculates, and the output is plain batched generate()'s.

Rows of different lengths (so the batch is left-padded), each with its own draft tree, verified in one
forward; rows accept different lengths, finish at different steps and leave the batch.
"""

from collections import Counter

import numpy as np
import pytest
import torch

import freespec
from freespec.batch import KVLayout, RowStep
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.testing.drafters import OracleDrafter, WrongDrafter
from freespec.engine import ModelTraits, forward_rows, make_cache
from freespec.integrations.transformers import is_patched
from freespec.testing.models import tiny_random_gemma3, tiny_random_llama

from conftest import patched_generate, plain_generate


class PerRow(Drafter):
    """Each request gets its own reference drafter, found by its prompt (the batch's rows differ)."""

    name = "per-row"

    def __init__(self, references: dict[tuple, list[int]], cls, **options):
        super().__init__()
        self.references, self.cls, self.options, self.inner = references, cls, options, {}

    def _on_start(self, request_id):
        prompt = tuple(self.context(request_id).tolist())
        self.inner[request_id] = self.cls(self.references[prompt], vocab_size=128, **self.options)
        self.inner[request_id].start(request_id, prompt)

    def _on_extend(self, request_id, ids):
        self.inner[request_id].extend(request_id, ids)

    def _on_stop(self, request_id):
        self.inner.pop(request_id).stop(request_id)

    def _propose(self, request_id, budget):
        return self.inner[request_id].propose(request_id, Budget(budget.num_nodes, budget.max_depth))


def left_padded(rows: list[list[int]], pad: int):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row)
        mask[i, width - len(row):] = 1
    return ids, mask


def batch_prompts(seed=0, lengths=(5, 30, 17, 9), eos=1):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        row = torch.randint(2, 120, (n,), generator=g)
        row[row == eos] = 3
        if n >= 20:  # repeats give the lookup drafters something to find
            row = torch.cat([row, row[3:15]])
        rows.append(row.tolist())
    return rows


def references(plain_out, ids, mask):
    """prompt (without pads) -> prompt + plain output (without trailing pads)."""
    out = {}
    for b in range(ids.shape[0]):
        num_pads = int((mask[b] == 0).sum())
        prompt = ids[b, num_pads:].tolist()
        out[tuple(prompt)] = prompt + plain_out[b, ids.shape[1]:].tolist()
    return out


@pytest.mark.parametrize("build,dtype", [(tiny_random_llama, torch.float32), (tiny_random_llama, torch.float64),
                                         (tiny_random_gemma3, torch.float32)])
def test_batched_greedy_equals_plain_batched(build, dtype):
    model = build(dtype=dtype)
    pad = model.config.pad_token_id
    ids, mask = left_padded(batch_prompts(), pad)
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=pad)
    plain = plain_generate(model, ids, attention_mask=mask, **gen)
    refs = references(plain, ids, mask)
    drafters = [PerRow(refs, OracleDrafter, num_wrong_siblings=2), PerRow(refs, WrongDrafter),
                "mixture", "prompt_lookup", "suffix", "ngram"]
    for drafter in drafters:
        out, stats = patched_generate(model, drafter, ids, attention_mask=mask, **gen)
        assert stats.fallback_reason is None
        assert out.tolist() == plain.tolist(), f"drafter {drafter!r} diverged"
        if isinstance(drafter, PerRow) and drafter.cls is OracleDrafter:
            assert stats.tau > 3
        if isinstance(drafter, PerRow) and drafter.cls is WrongDrafter:
            assert stats.accepted_draft_tokens == 0 and stats.tau == 1.0


def test_rows_finish_at_different_steps_and_are_padded_as_plain_pads_them():
    model = tiny_random_llama(dtype=torch.float64)
    ids, mask = left_padded(batch_prompts(1), 1)
    free = plain_generate(model, ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=1)
    eos = int(free[2, ids.shape[1] + 3])  # row 2 emits it early: make it the EOS
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=1, eos_token_id=eos)
    plain = plain_generate(model, ids, attention_mask=mask, **gen)
    refs = references(plain, ids, mask)
    for drafter in (PerRow(refs, OracleDrafter), "mixture"):
        out, stats = patched_generate(model, drafter, ids, attention_mask=mask, **gen)
        assert out.tolist() == plain.tolist()
    assert (out[2, ids.shape[1] + 4:] == 1).all()  # row 2 stopped at its EOS and was padded


def test_num_return_sequences_rows_share_their_prompt():
    """Sampling several sequences per prompt: rows of one prompt speculate as separate requests."""
    model = tiny_random_llama(dtype=torch.float64)
    ids, mask = left_padded(batch_prompts(2, lengths=(25, 12)), 1)
    gen = dict(max_new_tokens=20, do_sample=True, top_k=1, pad_token_id=1, num_return_sequences=3)
    plain = plain_generate(model, ids, attention_mask=mask, **gen)  # top_k=1: the draws are deterministic
    out, stats = patched_generate(model, "mixture", ids, attention_mask=mask, **gen)
    assert stats.fallback_reason is None and out.shape[0] == 6 and stats.row_forwards >= 6
    assert out.tolist() == plain.tolist()
    assert out[:3, : ids.shape[1]].tolist() == [ids[0].tolist()] * 3


@pytest.mark.parametrize("kwargs,reason", [
    (dict(return_dict_in_generate=True, output_scores=True), "output_scores"),
    (dict(prefix_allowed_tokens_fn=lambda batch_id, ids: list(range(128))), "prefix_allowed_tokens_fn"),
])
def test_what_a_batch_cannot_honour_falls_back(kwargs, reason):
    model = tiny_random_llama(dtype=torch.float64)
    ids, mask = left_padded(batch_prompts(3, lengths=(6, 11)), 1)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=1, **kwargs)
    plain = plain_generate(model, ids, attention_mask=mask, **gen)
    out, stats = patched_generate(model, "mixture", ids, attention_mask=mask, **gen)
    assert reason in stats.fallback_reason
    sequences = out.sequences if hasattr(out, "sequences") else out
    assert sequences.tolist() == (plain.sequences if hasattr(plain, "sequences") else plain).tolist()


def test_right_padding_falls_back():
    model = tiny_random_llama(dtype=torch.float64)
    ids, mask = left_padded(batch_prompts(3, lengths=(6, 11)), 1)
    ids, mask = ids.flip(-1), mask.flip(-1)
    out, stats = patched_generate(model, "mixture", ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                          pad_token_id=1)
    assert "not left padding" in stats.fallback_reason


# ------------------------------------------------------------------ the KV layout against linear runs
def test_compacted_rows_equal_linear_runs():
    """Two rows, different caches, drafts and acceptances: each row's kept KV is its linear run's KV."""
    model = tiny_random_llama(dtype=torch.float64)
    traits = ModelTraits.of(model)
    rng = np.random.default_rng(4)
    texts = [rng.integers(2, 120, 9).tolist(), rng.integers(2, 120, 14).tolist()]
    ids, mask = left_padded(texts, 1)
    cache, layout = make_cache(), KVLayout(2)
    prefill = [RowStep(ids[b].tolist(), np.where(mask[b].numpy() == 1, np.cumsum(mask[b].numpy()) - 1, -1),
                       Draft.empty()) for b in range(2)]
    with torch.no_grad():
        forward_rows(model, traits, cache, layout, prefill, pad_token_id=1)
    layout.compact(cache, prefill, [[], []])
    drafts = [Draft(rng.integers(2, 120, 4), [-1, 0, -1, 2]), Draft(rng.integers(2, 120, 2), [-1, 0])]
    kept = [[2, 3], [0]]
    steps = [RowStep([texts[b][-1] + 1], np.array([len(texts[b])]), drafts[b]) for b in range(2)]
    with torch.no_grad():
        forward_rows(model, traits, cache, layout, steps, pad_token_id=1)
    layout.compact(cache, steps, kept)
    for b in range(2):
        linear = texts[b] + steps[b].pending + [int(drafts[b].token_ids[i]) for i in kept[b]]
        reference = make_cache()
        with torch.no_grad():
            model(torch.tensor([linear]), cache=reference, use_cache=True)
        slots = np.nonzero(layout.positions[b] >= 0)[0]
        assert layout.positions[b, slots].tolist() == list(range(len(linear)))
        for layer, ref in zip(cache.layers, reference.layers):
            assert torch.allclose(layer.keys[b, :, slots], ref.keys[0], atol=1e-9)
            assert torch.allclose(layer.values[b, :, slots], ref.values[0], atol=1e-9)
    assert layout.ends.tolist() == [ids.shape[1] + 1 + len(k) for k in kept] and layout.length == max(layout.ends)


# ------------------------------------------------------------------ sampling, per row
def test_sampled_rows_have_the_target_distribution():
    """Each row of a sampled batch is a draw from the model (chi-square against the exact law of two tokens)."""
    from test_sampling import GEN, N, FixedDrafter, _chi_square_p, _exact_distribution, _likely_chain, model as _m

    model = _m.__wrapped__()
    prompt = torch.tensor([[0, 3, 5, 2, 6, 3]])
    exact = _exact_distribution(model, prompt)
    batch = prompt.repeat(4, 1)
    freespec.patch(model, drafter=FixedDrafter(_likely_chain(exact)))
    torch.manual_seed(99)
    counts = Counter()
    try:
        for _ in range(N // 4):
            out = model.generate(batch, attention_mask=torch.ones_like(batch), pad_token_id=1, **GEN)
            assert freespec.stats(model).fallback_reason is None
            for row in out[:, prompt.shape[1]:].tolist():
                counts[tuple(row[:1]) if row[0] == model.config.eos_token_id else tuple(row)] += 1
    finally:
        freespec.unpatch(model)
    n = sum(counts.values())
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - v) for k, v in exact.items())
    assert tv < 0.1, f"total variation {tv:.3f}"
    assert _chi_square_p(counts, exact, n) > 1e-3


class CutToRoot(PerRow):
    """Oracle rows whose drafts the batch cuts to their first node each (``fit_batch``), counting the cuts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuts = 0

    def fit_batch(self, request_ids, drafts, batch_size):
        assert batch_size == len(request_ids) == len(drafts) > 1
        self.cuts += sum(draft.num_nodes > 1 for draft in drafts)
        return [draft.select(np.array([0])) if draft.num_nodes else draft for draft in drafts]


class GrowsDrafts(PerRow):
    def fit_batch(self, request_ids, drafts, batch_size):
        return [Draft(np.array([5, 6]), np.array([-1, 0]))] * len(drafts)


def test_a_batch_verifies_the_drafts_its_drafter_fits_to_the_batch():
    """``Drafter.fit_batch`` decides what a padded forward verifies: drafts cut to one node each still decode
    plain batched greedy's output; a fit that grows a draft is refused with the drafter's name."""
    model = tiny_random_llama(dtype=torch.float64)
    ids, mask = left_padded(batch_prompts(3), 1)
    gen = dict(max_new_tokens=20, do_sample=False, pad_token_id=1)
    plain = plain_generate(model, ids, attention_mask=mask, **gen)
    refs = references(plain, ids, mask)
    drafter = CutToRoot(refs, OracleDrafter)
    out, stats = patched_generate(model, drafter, ids, attention_mask=mask, **gen)
    assert out.tolist() == plain.tolist() and drafter.cuts > 0
    assert stats.tau == pytest.approx(2.0, abs=0.35)  # one right node a step: about two tokens per forward
    with pytest.raises(ValueError, match="fit_batch grew a draft"):
        patched_generate(model, GrowsDrafts(refs, WrongDrafter), ids, attention_mask=mask, **gen)
