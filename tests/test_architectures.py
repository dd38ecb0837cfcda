"""Every architecture patch() accepts, against plain generate(): greedy output identical with an always-wrong
tree drafter, an always-right one (with wrong siblings) and the default drafter; or refused with a reason.

One tiny random model per family (``freespec.testing.models.FAMILIES``): rotary variants (linear, dynamic,
yarn, llama3, LongRoPE), sliding windows, ALiBi (Bloom, MPT, Falcon), learned positions (GPT-2, OPT),
multi-query attention, mixtures of experts. Prompts cross the dynamic-RoPE and LongRoPE limits (48) and
the sliding windows (8), so the paths where a draft could change what a committed token sees are exercised.
"""

import copy

import pytest
import torch

import freespec
from freespec.integrations.transformers import TESTED_MODEL_TYPES
from freespec.testing.drafters import OracleDrafter, WrongDrafter
from freespec.testing.models import FAMILIES, tiny_random

from conftest import patched_generate, plain_generate

VOCAB = 96


def _prompt(length: int, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (1, length), generator=g)
    return torch.cat([ids, ids[:, 4:20]], 1) if length >= 20 else ids  # a repeat for the lookup drafters


def _check(pristine, prompt, max_new_tokens=30):
    """Each run on a fresh copy: a dynamic RoPE keeps the frequencies of the longest sequence it has seen
    until a shorter one resets them, so even two plain runs on one model object can differ."""
    gen = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=1)
    plain = plain_generate(copy.deepcopy(pristine), prompt, **gen)
    taus = {}
    for label, drafter in (("wrong", WrongDrafter(plain[0], VOCAB)),
                           ("oracle-tree", OracleDrafter(plain[0], VOCAB, num_wrong_siblings=2)),
                           ("oracle", OracleDrafter(plain[0], VOCAB)), ("mixture", "mixture")):
        out, stats = patched_generate(copy.deepcopy(pristine), drafter, prompt, **gen)
        assert stats.fallback_reason is None
        assert out.tolist() == plain.tolist(), f"{drafter!r} diverged"
        if label == "wrong":
            assert stats.accepted_draft_tokens == 0
        taus[label] = stats.tau
    return taus


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("prompt_length", [10, 25, 40])
def test_greedy_identical_on_every_family(family, prompt_length):
    """Prompt 10 (+30 new) stays below the RoPE limits of 48, 25 (+16 repeated) crosses them mid-generation,
    40 (+16) starts past them."""
    model = tiny_random(family, vocab_size=VOCAB, dtype=torch.float32)
    assert model.config.model_type in TESTED_MODEL_TYPES
    _check(model, _prompt(prompt_length))


@pytest.mark.parametrize("family", ["llama-dynamic-rope", "phi3-longrope"])
def test_position_limited_rope_speculates_below_the_limit(family):
    """Below its limit a dynamic/LongRoPE model accepts drafts; crossing it, it decodes exactly (tau drops)."""
    below = _check(tiny_random(family, vocab_size=VOCAB), _prompt(5), max_new_tokens=20)["oracle"]
    assert below > 3
    crossing = _check(tiny_random(family, vocab_size=VOCAB), _prompt(30), max_new_tokens=30)["oracle"]
    assert crossing < below


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon-alibi"])
def test_alibi_models_verify_chains(family):
    model = tiny_random(family, vocab_size=VOCAB)
    prompt = _prompt(40)
    plain = plain_generate(model, prompt, max_new_tokens=20, do_sample=False)
    freespec.patch(model, drafter=OracleDrafter(plain[0], VOCAB))
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=20, do_sample=False)
        stats = freespec.stats(model)
    finally:
        freespec.unpatch(model)
    assert out.tolist() == plain.tolist() and stats.tau > 3


def test_untested_architectures_are_refused_with_the_reason():
    model = tiny_random("llama", vocab_size=VOCAB)
    model.config.model_type = "my-llama-fork"
    with pytest.raises(ValueError, match="not been tested on model_type 'my-llama-fork'"):
        freespec.patch(model)
    freespec.patch(model, allow_untested_model=True)
    freespec.unpatch(model)


def test_recurrent_models_are_refused():
    from transformers import MambaConfig, MambaForCausalLM

    model = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2))
    with pytest.raises(ValueError, match="mamba"):
        freespec.patch(model)
    with pytest.raises(ValueError, match="freespec cannot drive this model"):
        freespec.patch(model, allow_untested_model=True)
