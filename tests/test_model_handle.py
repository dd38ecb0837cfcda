"""ModelHandle: the host's own layers, run piecewise, give the host's own logits; the verified cache is
read in place and never written; unsupported architectures are refused (for model drafters only)."""

import numpy as np
import pytest
import torch

import freespec
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.model_handle import SUPPORTED_MODEL_TYPES, DraftCache, ModelHandle, UnsupportedModel
from freespec.models import tiny_random_gemma3, tiny_random_llama


def tiny_qwen(version: int, seed: int = 0):
    """A small random Qwen2 or Qwen3 causal LM (4 layers), float64, eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if version == 2 else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                        attn_implementation="sdpa", **({"head_dim": 16} if version == 3 else {}))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(torch.float64).eval()


MODELS = {
    "llama": lambda: tiny_random_llama(num_hidden_layers=4),
    "gemma3_text": lambda: tiny_random_gemma3(),
    "qwen2": lambda: tiny_qwen(2),
    "qwen3": lambda: tiny_qwen(3),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _ids(n, seed=1):
    return torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_every_supported_type_is_tested():
    assert sorted(MODELS) == sorted(SUPPORTED_MODEL_TYPES)


def test_all_layers_give_the_model_logits(model):
    handle = ModelHandle.of(model)
    ids = _ids(20)  # longer than Gemma 3's window of 8: the sliding mask matters
    with torch.no_grad():
        expected = model(ids).logits[0].double()
    hidden = handle.run(handle.embed(ids[0].numpy()), range(handle.num_layers), handle.draft_cache())
    torch.testing.assert_close(handle.logits(hidden)[0].double(), expected, atol=1e-5, rtol=1e-5)


def test_passes_over_the_verified_cache_match_the_model_and_leave_it_unchanged(model):
    from transformers import DynamicCache

    handle = ModelHandle.of(model)
    ids = _ids(20)
    with torch.no_grad():
        expected = model(ids).logits[0, 14:].double()
        cache = DynamicCache()
        model(ids[:, :14], cache=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    draft_cache = handle.draft_cache(cache, 14)
    rows = []
    for chunk in (ids[0, 14:16], ids[0, 16:17], ids[0, 17:20]):  # 2, 1 and 3 new tokens per pass
        rows.append(handle.logits(handle.run(handle.embed(chunk.numpy()), range(handle.num_layers), draft_cache))[0])
    assert draft_cache.length == 20 and draft_cache.scratch_len == 6
    torch.testing.assert_close(torch.cat(rows).double(), expected, atol=1e-5, rtol=1e-5)
    for (keys, values), layer in zip(before, cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
        assert layer.keys.shape[-2] == 14


def test_skipped_layers_get_no_scratch_entries_and_weights_stay():
    model = tiny_random_llama(num_hidden_layers=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ModelHandle.of(model)
    draft_cache = handle.draft_cache()
    handle.run(handle.embed([5, 6, 7]), [0, 3], draft_cache)
    assert sorted(draft_cache._keys) == [0, 3] and draft_cache.length == 3
    handle.reduced_head([3, 9])
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_reduced_heads_are_columns_of_the_full_head():
    model = tiny_random_gemma3()  # final logit soft-cap
    handle = ModelHandle.of(model)
    hidden = handle.run(handle.embed([4, 8, 15]), range(handle.num_layers), handle.draft_cache())
    full = handle.logits(hidden)
    heads = [handle.reduced_head([9, 3, 3, 40]), handle.reduced_head([100])]
    assert heads[0].token_ids.tolist() == [3, 9, 40]
    torch.testing.assert_close(handle.logits(hidden, heads), full[..., [3, 9, 40, 100]])


def test_bad_input():
    handle = ModelHandle.of(tiny_random_llama(num_hidden_layers=4))
    with pytest.raises(ValueError, match="ascending"):
        handle.run(handle.embed([1]), [2, 1], handle.draft_cache())
    with pytest.raises(ValueError, match="empty"):
        handle.embed([])
    with pytest.raises(ValueError, match="token_ids"):
        handle.reduced_head([128])
    with pytest.raises(ValueError, match="verified_len"):
        DraftCache(None, -1)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()


def test_unsupported_architectures_are_refused_for_model_drafters_only():
    model = _gpt2()
    with pytest.raises(UnsupportedModel, match="gpt2"):
        ModelHandle.of(model)
    with pytest.raises(ValueError, match=r"'early_exit'.*'gpt2'"):
        freespec.patch(model, drafter="early_exit")
    assert not freespec.integrations.transformers.is_patched(model)
    freespec.patch(model)  # the default drafter does not need the model
    freespec.unpatch(model)


class RecordsCache(Drafter):
    """Records what the engine hands over before each propose."""

    name = "records-cache"

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_verified_cache(self, request_id, cache, cache_len):
        layer = cache.layers[0] if cache_len else None
        self.seen.append((cache_len, len(self.context(request_id)), None if layer is None else layer.keys.shape[-2]))

    def _propose(self, request_id, budget: Budget) -> Draft:
        return Draft.empty()


def test_engine_hands_the_verified_cache_before_each_propose():
    model = tiny_random_llama()
    drafter = RecordsCache()
    freespec.patch(model, drafter=drafter)
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False)
    # prefill: nothing cached yet; then every committed token but the pending one is cached
    # (the last step, with one token left, has no room for a draft and proposes nothing)
    assert drafter.seen == [(0, 3, None), (3, 4, 3), (4, 5, 4)]
