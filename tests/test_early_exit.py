"""The early-exit drafter: greedy output identical and sampling exact, the model's weights and the
verified cache untouched, calibration chosen from measurements and cached per model."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

import freespec
from freespec.draft import Budget
from freespec.drafters import make
from freespec.drafters.early_exit import EarlyExitDrafter
from freespec.drafters.self_draft_calibration import (DraftRule, SelfDraftSetting, TeacherForced, candidate_layer_sets,
                                                      setting_path, simulate, speedup)
from freespec.testing.models import tiny_random, tiny_random_gemma3, tiny_random_llama

from conftest import patched_generate, plain_generate
from test_batch import left_padded
from test_sampling import _chi_square_p

PROMPTS = [[3, 5, 7, 9, 11, 3, 5, 7], [20, 21, 22, 23, 20, 21], [40, 2, 90, 17]]
FIXED = dict(layers=[0, 2, 4, 5], threshold=0.3)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Calibrations go to a fresh $FREESPEC_CACHE (the real models are loaded before it is set)."""
    monkeypatch.setenv("FREESPEC_CACHE", str(tmp_path))


def six_layer_llama(**overrides):
    return tiny_random_llama(num_hidden_layers=6, **overrides)


def six_layer_gemma3():
    return tiny_random_gemma3(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])


def six_layer(family):
    return lambda: tiny_random(family, num_hidden_layers=6)


def _generate_both(model, prompt, options, **gen):
    expected = plain_generate(model, torch.tensor([prompt]), **gen)
    freespec.patch(model, drafter="early_exit", drafter_options=options)
    try:
        out = model.generate(torch.tensor([prompt]), **gen)
        return out, expected, freespec.stats(model), model.generate.drafter
    finally:
        freespec.unpatch(model)


@pytest.mark.parametrize("make_model", [six_layer_llama, six_layer_gemma3, six_layer("qwen2"), six_layer("qwen3")])
@pytest.mark.parametrize("options", [FIXED, dict(exit_layer=3, threshold=0.0, max_siblings=2, min_sibling_prob=0.0),
                                     dict(FIXED, head_vocab=16)])
def test_greedy_output_is_plain_decoding(make_model, options):
    model = make_model()
    for prompt in PROMPTS:
        out, expected, stats, _ = _generate_both(model, prompt, options, max_new_tokens=30, do_sample=False)
        assert torch.equal(out, expected)
        assert stats.fallback_reason is None and stats.draft_tokens > 0


def test_drafts_come_from_the_chosen_layers():
    """With every layer and the full head, the draft is the target's own greedy continuation: all accepted."""
    model = six_layer_llama()
    out, expected, stats, drafter = _generate_both(model, PROMPTS[0], dict(layers=list(range(6)), threshold=0.0,
                                                                          head_vocab=None, max_depth=4),
                                                   max_new_tokens=21, do_sample=False)
    assert torch.equal(out, expected)
    assert stats.accepted_draft_tokens == stats.draft_tokens == 16  # 4 steps of 4, then the bonus tokens
    assert stats.forward_passes == 5 and stats.tau == 21 / 5


@pytest.mark.parametrize("make_model", [six_layer_llama, six_layer_gemma3])
def test_batched_rows_draft_against_their_own_cache(make_model):
    """A left-padded batch: with every layer and the full head each row's draft is its own greedy
    continuation (so every node is accepted) only if its pass reads its own cached text."""
    model = make_model()
    pad = model.config.pad_token_id
    ids, mask = left_padded(PROMPTS, pad)
    gen = dict(max_new_tokens=20, do_sample=False, pad_token_id=pad, eos_token_id=None)
    plain = plain_generate(model, ids, attention_mask=mask, **gen)
    everything = EarlyExitDrafter(layers=list(range(6)), threshold=0.0, head_vocab=None, max_depth=4)
    out, stats = patched_generate(model, everything, ids, attention_mask=mask, **gen)
    assert stats.fallback_reason is None and out.tolist() == plain.tolist()
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens
    out, stats = patched_generate(model, EarlyExitDrafter(**FIXED), ids, attention_mask=mask, **gen)
    assert out.tolist() == plain.tolist() and stats.draft_tokens > 0


def test_weights_and_verified_cache_are_unchanged():
    model = six_layer_llama()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    snapshots = []

    class Checked(EarlyExitDrafter):
        def _draft(self, request_id, pending, cache, cache_len, budget):
            before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
            result = super()._draft(request_id, pending, cache, cache_len, budget)
            snapshots.append(all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)
                                 for (k, v), layer in zip(before, cache.layers)))
            return result

    drafter = Checked(**FIXED)
    freespec.patch(model, drafter=drafter)
    model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=30, do_sample=False)
    freespec.unpatch(model)
    assert snapshots and all(snapshots)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------ sampling
VOCAB = 8
N = 2000
GEN = dict(do_sample=True, temperature=0.9, top_k=6, top_p=0.95, repetition_penalty=1.2)


def _exact(model, prompt, num_tokens):
    """Exact distribution of the next ``num_tokens`` tokens under generate()'s processors (EOS ends early)."""
    from transformers.generation.logits_process import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(GEN["repetition_penalty"]),
                                      TemperatureLogitsWarper(GEN["temperature"]), TopKLogitsWarper(GEN["top_k"]),
                                      TopPLogitsWarper(GEN["top_p"])])
    out, frontier = {}, [((), 1.0)]
    for depth in range(num_tokens):
        grown = []
        for path, prob in frontier:
            ids = torch.tensor([prompt + list(path)])
            with torch.no_grad():
                logits = model(ids).logits[0, -1:].to(torch.float32)
            probs = torch.softmax(processors(ids, logits), -1)[0].double().numpy()
            for token in np.nonzero(probs)[0].tolist():
                if token == model.config.eos_token_id or depth + 1 == num_tokens:
                    out[path + (token,)] = prob * probs[token]
                else:
                    grown.append((path + (token,), prob * probs[token]))
        frontier = grown
    return out


@pytest.mark.parametrize("options", [
    dict(layers=[0, 2, 3], threshold=1.0, max_siblings=3, min_sibling_prob=0.0),  # a root with siblings
    dict(layers=[0, 3], threshold=0.0, max_depth=2),  # a chain of 2
])
def test_sampled_distribution_is_exact(options):
    """Prompt of 3 tokens: the prefill already verifies a draft (depth <= 2 for 3 new tokens)."""
    model = tiny_random_llama(vocab_size=VOCAB, seed=5, initializer_range=0.5, num_hidden_layers=4)
    prompt, num_tokens = [0, 3, 5], 3 if options.get("max_depth") == 2 else 2
    exact = _exact(model, prompt, num_tokens)
    assert abs(sum(exact.values()) - 1) < 1e-6
    freespec.patch(model, drafter="early_exit", drafter_options=dict(options, head_vocab=None))
    torch.manual_seed(1234)
    counts, drafted = Counter(), 0
    try:
        for _ in range(N):
            out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, **GEN)
            counts[tuple(out[0, len(prompt):].tolist())] += 1
            drafted += freespec.stats(model).draft_tokens
    finally:
        freespec.unpatch(model)
    assert set(counts) <= set(exact) and drafted >= N
    tv = 0.5 * sum(abs(counts.get(k, 0) / N - v) for k, v in exact.items())
    assert tv < (0.1 if num_tokens == 2 else 0.15), f"total variation {tv:.3f}"
    assert _chi_square_p(counts, exact, N) > 1e-3


# ------------------------------------------------------------------ calibration
def test_calibrates_from_output_then_reuses_the_cached_setting():
    model = six_layer_gemma3()
    out, expected, stats, drafter = _generate_both(model, PROMPTS[0], dict(calibration_tokens=20),
                                                   max_new_tokens=40, do_sample=False)
    assert torch.equal(out, expected)
    setting = drafter.setting
    assert setting is not None and stats.draft_tokens > 0  # calibrated after 20 tokens, then drafted
    assert setting.calibration_tokens >= 20 and setting.predicted_speedup > 0 and 0 <= setting.agreement <= 1
    assert setting.layers[0] == 0 and len(setting.layers) < 6 and setting.candidates
    saved = json.loads(setting_path(drafter.calibration_key).read_text())
    assert SelfDraftSetting.from_json(saved) == setting
    again = EarlyExitDrafter(calibration_tokens=20)
    freespec.patch(model, drafter=again)
    freespec.unpatch(model)
    assert again.setting == setting  # loaded at attach: no calibration needed


def test_fixed_options_are_respected_by_calibration():
    model = six_layer_llama()
    drafter = EarlyExitDrafter(layers=[0, 1, 5], calibration_tokens=8)
    freespec.patch(model, drafter=drafter)
    model.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=20, do_sample=False)
    freespec.unpatch(model)
    assert drafter.setting.layers == (0, 1, 5) and drafter.setting.mode == "skip"


def test_candidate_layer_sets_keep_first_and_last_layers():
    importance = np.array([0.9, 0.1, 0.05, 0.2, 0.01, 0.3, 0.5, 0.8])
    sets = candidate_layer_sets(8, importance)
    assert ("exit", (0, 1, 2, 3)) in sets
    skips = [layers for mode, layers in sets if mode == "skip"]
    assert skips[0] == (0, 1, 2, 3, 5, 6, 7)  # 10% of 8 rounds to 1: the least important middle layer (4)
    assert all(layers[0] == 0 and layers[-1] == 7 for layers in skips)


def test_simulate_worked_example():
    """Positions' top-1 probabilities 0.9, 0.9, 0.5 with hits, miss, hit (one sequence), threshold 0.8.

    From 0: node (hit, 0.9), node (miss, 0.9), node (0.5 < 0.8: its sibling of 0.3 joins, the draft
    stops): 3 passes, 4 nodes, 1 accepted. From 1: miss, then the low node and its sibling: 2 passes,
    3 nodes, 0 accepted. From 2: the low node (hit) and its sibling: 1 pass, 2 nodes, 1 accepted.
    """
    forced = TeacherForced(np.array([[0.9, 0.05], [0.9, 0.05], [0.5, 0.3]]),
                           np.array([[True, False], [False, True], [True, False]]), np.zeros(3, np.int64))
    nodes, accepted, passes, steps = simulate(forced, 0.8, DraftRule(max_depth=8, max_siblings=1,
                                                                     min_sibling_prob=0.1))
    assert steps == 3 and (nodes, accepted, passes) == pytest.approx((3, 2 / 3, 2))
    assert speedup(0.0, 0.0, 1.0, 0.5, np.ones(5)) == pytest.approx(1 / 1.5)


def test_bad_options_and_use_without_a_model():
    with pytest.raises(ValueError, match="not both"):
        EarlyExitDrafter(layers=[0, 1], exit_layer=2)
    with pytest.raises(ValueError, match="ascending"):
        EarlyExitDrafter(layers=[2, 1])
    with pytest.raises(ValueError, match="threshold"):
        EarlyExitDrafter(threshold=1.5)
    with pytest.raises(ValueError, match="exit_layer"):
        make("early_exit", exit_layer=0)
    with pytest.raises(ValueError, match="layer 9 does not exist"):
        freespec.patch(six_layer_llama(), drafter="early_exit", drafter_options=dict(layers=[0, 9]))
    drafter = EarlyExitDrafter()
    drafter.start("r", [1, 2, 3])
    with pytest.raises(ValueError, match="patch"):
        drafter.propose("r", Budget(4, 4))


# ------------------------------------------------------------------ in the mixture
def test_mixture_with_early_exit_is_plain_decoding():
    model = six_layer_gemma3()
    drafter = make("mixture", early_exit=True)
    drafter.early_exit = EarlyExitDrafter(**FIXED)  # fixed setting: no calibration needed
    assert drafter.needs_model and not make("mixture").needs_model
    freespec.patch(model, drafter=drafter)
    self_drafted = 0
    try:
        for prompt in PROMPTS:
            expected = plain_generate(model, torch.tensor([prompt]), max_new_tokens=30, do_sample=False)
            assert torch.equal(model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False), expected)
            stats = freespec.stats(model).per_drafter.get("early_exit")
            self_drafted += 0 if stats is None else stats.proposed
    finally:
        freespec.unpatch(model)
    assert self_drafted > 0  # a fixed setting drafts until its outcomes are measured
    with pytest.raises(ValueError, match=r"'mixture'.*'gpt2'"):
        from transformers import GPT2Config, GPT2LMHeadModel

        freespec.patch(GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2)),
                       drafter="mixture", drafter_options=dict(early_exit=True))


def test_mixture_self_drafts_in_a_batch_of_one_only():
    """In a batch the early-exit source stays off (its passes run row by row; its gate's numbers are
    a batch of one's); the output is plain batched decoding. With lookahead it is refused."""
    model = six_layer_llama()
    ids, mask = left_padded(PROMPTS, model.config.pad_token_id)
    gen = dict(max_new_tokens=20, do_sample=False, pad_token_id=model.config.pad_token_id)
    drafter = make("mixture", early_exit=True)
    drafter.early_exit = EarlyExitDrafter(**FIXED)
    out, stats = patched_generate(model, drafter, ids, attention_mask=mask, **gen)
    assert out.tolist() == plain_generate(model, ids, attention_mask=mask, **gen).tolist()
    assert stats.fallback_reason is None and "early_exit" not in stats.per_drafter
    with pytest.raises(ValueError, match="lookahead"):
        make("mixture", early_exit=True, lookahead=True)


def test_gate_drafts_only_when_live_numbers_predict_a_gain():
    from freespec.drafters.base import ForwardReport
    from freespec.drafters.early_exit import PROBE_EVERY

    drafter = EarlyExitDrafter(**FIXED)
    freespec.patch(six_layer_llama(), drafter=drafter)
    drafter.start("r", [1, 2, 3])
    drafter.on_verified_cache("r", None, 2)
    assert drafter.ready("r")
    assert drafter.live_speedup() is None and drafter.worth_drafting("r")  # fixed, nothing measured: try it
    drafter._use(SelfDraftSetting("skip", (0, 2, 4, 5), 0.3, draft_cost=0.5, mean_nodes=3.0, mean_accepted=2.5,
                                  mean_passes=3.0, calibration_tokens=100))
    for _ in range(8):
        drafter.on_forward(ForwardReport(("r",), (1,), 0.010))
        drafter.on_forward(ForwardReport(("r",), (4,), 0.011))
    drafter.pass_seconds.extend([0.003] * 8)  # a pass costs 0.3 of a forward: 3.5 / (1.1 + 0.9) = 1.75
    assert drafter.live_speedup() == pytest.approx(3.5 / (1.1 + 0.9)) and drafter.worth_drafting("r")
    drafter.pass_seconds.extend([0.010] * 64)  # as much as a forward: 3.5 / (1.1 + 3) < 1
    assert drafter.live_speedup() < 1
    decisions = [drafter.worth_drafting("r") for _ in range(PROBE_EVERY)]
    assert decisions == [False] * (PROBE_EVERY - 1) + [True]  # one probe per PROBE_EVERY refusals


def test_gpu_check_runs_on_the_cpu(tmp_path):
    """examples/gpu/early_exit_check.py --tiny --device cpu: calibration, break-even, live comparison."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "gpu" / "early_exit_check.py"
    spec = importlib.util.spec_from_file_location("early_exit_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "check.json"
    result = script.main(["--tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "3",
                          "--max-new-tokens", "12", "--out", str(out)])
    assert json.loads(out.read_text())["methods"].keys() == {"vanilla", "early_exit", "mixture+early_exit"}
    assert all(m["identical"] == "1/1" for m in result["methods"].values())  # 3 prompts, 2 calibrate
    assert result["break_even_tau"] > 1 and result["reuse"]["saving"] < 1  # a timing: either sign on a busy CPU
