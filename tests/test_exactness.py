"""Greedy exactness: patched generate() == plain generate(), token for token.

Every decode path runs with a drafter that is always wrong, one that is
always right (with wrong siblings, so the tree branches), and every real
drafter (token recycling and lookahead included, and the mixture filling
every tree with recycled nodes and a lookahead window), on a tiny random
Llama, a tiny random Gemma 3 with sliding-window layers (window 8, so
prompts cross the window) and the real SmolLM2.
"""

import pytest
import torch

import freespec
from freespec.demo import EXAMPLE_CODE
from freespec.drafters.mixture import MixtureDrafter
from freespec.testing.drafters import OracleDrafter, WrongDrafter

from conftest import patched_generate, plain_generate

REAL_DRAFTERS = ["prompt_lookup", "mixture", "suffix", "ngram", "corpus", "recycle", "lookahead"]


def _full_trees(plain):
    """The mixture with every source, filling the budget: recycled trees and a whole lookahead window each step."""
    return MixtureDrafter(lookahead=True, lookahead_window=4, lookahead_ngram=3, adaptive=False)


def _prompts(vocab_size, eos_token_id):
    g = torch.Generator().manual_seed(1234)
    out = []
    for length in (1, 7, 40, 300):
        ids = torch.randint(2, vocab_size, (1, length), generator=g)
        ids[ids == eos_token_id] = 3
        if length >= 40:  # repeats give the lookup drafters something to find
            ids = torch.cat([ids, ids[:, 5:25], ids[:, :10]], dim=1)
        out.append(ids)
    return out


def _drafters(reference, vocab_size):
    yield from REAL_DRAFTERS
    yield _full_trees
    yield OracleDrafter(reference, vocab_size, num_wrong_siblings=2)
    yield WrongDrafter(reference, vocab_size)


def _check(model, prompt, drafter, plain=None, **gen):
    """``plain``: plain generate()'s output for these arguments, when the caller has it already."""
    if plain is None:
        plain = plain_generate(model, prompt, **gen)
    drafter_obj = drafter(plain) if callable(drafter) else drafter
    out, stats = patched_generate(model, drafter_obj, prompt, **gen)
    assert stats.fallback_reason is None
    assert out.tolist() == plain.tolist(), f"drafter {drafter_obj!r} diverged"
    assert stats.new_tokens == plain.shape[1] - prompt.shape[1]
    return stats


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma3"])
def test_greedy_matches_plain(which, request):
    model = request.getfixturevalue(which)
    vocab = model.config.vocab_size
    for prompt in _prompts(vocab, model.config.eos_token_id):
        plain = plain_generate(model, prompt, max_new_tokens=40, do_sample=False)
        for drafter in _drafters(plain[0], vocab):
            stats = _check(model, prompt, drafter, plain, max_new_tokens=40, do_sample=False)
            if isinstance(drafter, OracleDrafter):
                assert stats.tau > 3
            if isinstance(drafter, WrongDrafter):
                assert stats.accepted_draft_tokens == 0 and stats.tau == 1.0


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma3"])
def test_compacted_cache_equals_a_linear_run(which, request):
    """With recycled trees and a lookahead window in every forward, every step's logits equal plain decoding's:
    the cache they were computed from holds exactly the committed tokens (no trace of a rejected or
    not-candidate node), as a linear run's does."""
    model = request.getfixturevalue(which)
    prompt = _prompts(model.config.vocab_size, model.config.eos_token_id)[2]
    gen = dict(max_new_tokens=30, do_sample=False, return_dict_in_generate=True, output_logits=True)
    plain = plain_generate(model, prompt, **gen)
    out, stats = patched_generate(model, _full_trees(None), prompt, **gen)
    assert stats.noncandidate_tokens > 0 and stats.accepted_draft_tokens > 0
    assert out.sequences.tolist() == plain.sequences.tolist() and len(out.logits) == len(plain.logits)
    for ours, theirs in zip(out.logits, plain.logits):
        assert torch.allclose(ours.double(), theirs.double(), atol=1e-6)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 13])
def test_max_new_tokens_inside_a_draft(tiny_llama, max_new_tokens):
    prompt = _prompts(128, 1)[2]
    long = plain_generate(tiny_llama, prompt, max_new_tokens=30, do_sample=False)
    stats = _check(tiny_llama, prompt, OracleDrafter(long[0], 128), max_new_tokens=max_new_tokens, do_sample=False)
    assert stats.new_tokens == max_new_tokens


def test_eos_inside_an_accepted_draft(tiny_llama):
    prompt = _prompts(128, 1)[2]
    free = plain_generate(tiny_llama, prompt, max_new_tokens=30, do_sample=False)
    eos = int(free[0, prompt.shape[1] + 6])  # a token the model emits: make it the EOS
    plain = plain_generate(tiny_llama, prompt, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert plain.shape[1] < free.shape[1] and int(plain[0, -1]) == eos
    # the oracle drafts past the EOS (the free-running continuation), so EOS sits inside the draft
    stats = _check(tiny_llama, prompt, OracleDrafter(free[0], 128), max_new_tokens=30, do_sample=False,
                   eos_token_id=eos)
    assert stats.forward_passes <= 2


def test_logits_processors_apply_on_the_right_prefix(tiny_llama):
    prompt = _prompts(128, 1)[2]
    gen = dict(max_new_tokens=40, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    plain = plain_generate(tiny_llama, prompt, **gen)
    for drafter in _drafters(plain[0], 128):
        _check(tiny_llama, prompt, drafter, **gen)


def test_eager_attention_matches_plain():
    from freespec.testing.models import tiny_random_llama

    model = tiny_random_llama(seed=3, attn_implementation="eager")
    prompt = _prompts(128, 1)[2]
    plain = plain_generate(model, prompt, max_new_tokens=24, do_sample=False)
    for drafter in _drafters(plain[0], 128):
        _check(model, prompt, drafter, plain, max_new_tokens=24, do_sample=False)


# ---------------------------------------------------------------- real models
def _chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


CODE = EXAMPLE_CODE


def _real_prompts(tokenizer):
    return {
        "chat": _chat(tokenizer, "Name three primary colors."),
        "code-edit": _chat(tokenizer, "Rename `values` to `xs` and output the whole function.\n\n" + CODE),
        "mid-word": tokenizer("The capital of France is Par", return_tensors="pt")["input_ids"],
        "long": _chat(tokenizer, "Summarize this code in one sentence.\n\n" + CODE * 6),
    }


def test_real_smollm2_greedy(smollm2):
    model, tokenizer = smollm2
    for name, prompt in _real_prompts(tokenizer).items():
        plain = plain_generate(model, prompt, max_new_tokens=48, do_sample=False)
        for drafter in _drafters(plain[0], model.config.vocab_size):
            _check(model, prompt, drafter, plain, max_new_tokens=48, do_sample=False)


def test_real_smollm2_stop_strings_and_eos(smollm2):
    model, tokenizer = smollm2
    prompt = _chat(tokenizer, "Rename `values` to `xs` and output the whole function.\n\n" + CODE)
    free = plain_generate(model, prompt, max_new_tokens=80, do_sample=False)
    gen = dict(max_new_tokens=80, do_sample=False, stop_strings=["raise", "return ["], tokenizer=tokenizer)
    plain = plain_generate(model, prompt, **gen)
    assert plain.shape[1] < free.shape[1], "the stop string should end generation early"
    for drafter in ["prompt_lookup", OracleDrafter(free[0], model.config.vocab_size), WrongDrafter(free[0])]:
        _check(model, prompt, drafter, plain, **gen)
    # the answer ends with EOS: the oracle drafts past it (the answer again), so EOS sits inside a draft
    eos_ids = model.generation_config.eos_token_id
    eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
    assert int(free[0, -1]) in eos_ids and free.shape[1] < prompt.shape[1] + 80
    padded = torch.cat([free[0], free[0, prompt.shape[1]:]])
    _check(model, prompt, OracleDrafter(padded, model.config.vocab_size), free, max_new_tokens=80, do_sample=False)


@pytest.mark.slow
def test_real_gemma3_sliding_window_greedy():
    from conftest import _real

    model, tokenizer = _real("gemma3-270m")
    assert "sliding_attention" in model.config.layer_types
    window = model.config.sliding_window
    text = CODE * 12
    prompt = tokenizer(text, return_tensors="pt")["input_ids"]
    assert prompt.shape[1] > window + 20, "the prompt must cross the sliding window"
    plain = plain_generate(model, prompt, max_new_tokens=40, do_sample=False)
    for drafter in _drafters(plain[0], model.config.vocab_size):
        _check(model, prompt, drafter, plain, max_new_tokens=40, do_sample=False)
