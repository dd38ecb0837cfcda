"""ModelHandle: the host's own layers, run piecewise, give the host's own logits; the verified cache is
read in place and never written; unsupported architectures are refused (for model drafters only)."""

import numpy as np
import pytest
import torch

import freespec
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.model_handle import SUPPORTED_MODEL_TYPES, DraftCache, ModelHandle, UnsupportedModel
from freespec.testing.models import tiny_random, tiny_random_gemma3, tiny_random_llama


MODELS = {
    "llama": lambda: tiny_random_llama(num_hidden_layers=4),
    "gemma3_text": lambda: tiny_random_gemma3(),
    "qwen2": lambda: tiny_random("qwen2", num_hidden_layers=4),
    "qwen3": lambda: tiny_random("qwen3", num_hidden_layers=4),
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
    """A model drafter that records what the engine hands over before each propose."""

    name = "records-cache"
    needs_model = True

    def __init__(self):
        super().__init__()
        self.seen = []  # (request, cache_len, context length, cached entries of layer 0)
        self.keys = {}  # request -> layer 0's verified keys at the last propose

    def attach_model(self, handle) -> None:
        self.handle = handle

    def on_verified_cache(self, request_id, cache, cache_len):
        layer = cache.layers[0] if cache_len else None
        self.seen.append((request_id, cache_len, len(self.context(request_id)),
                          None if layer is None else layer.keys.shape[-2]))
        if layer is not None:
            self.keys[request_id] = layer.keys[..., :cache_len, :].clone()

    def _propose(self, request_id, budget: Budget) -> Draft:
        return Draft.empty()


def test_engine_hands_the_verified_cache_before_each_propose():
    model = tiny_random_llama()
    drafter = RecordsCache()
    freespec.patch(model, drafter=drafter)
    model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False)
    freespec.unpatch(model)
    # prefill: nothing cached yet; then every committed token but the pending one is cached
    # (the last step, with one token left, has no room for a draft and proposes nothing)
    assert [seen[1:] for seen in drafter.seen] == [(0, 3, None), (3, 4, 3), (4, 5, 4)]


def test_each_row_of_a_batch_gets_its_own_verified_cache():
    """Left-padded rows: each view holds its row's text only (no pads), as that row alone would cache it."""
    model = tiny_random_llama()
    drafter = RecordsCache()
    freespec.patch(model, drafter=drafter)
    ids, mask = torch.tensor([[3, 4, 5, 6], [1, 1, 7, 8]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=1)
    freespec.unpatch(model)
    requests = sorted({seen[0] for seen in drafter.seen}, key=lambda request: request[1])
    assert [[seen[1:] for seen in drafter.seen if seen[0] == r] for r in requests] == [
        [(0, 4, None), (4, 5, 4)], [(0, 2, None), (2, 3, 2)]]  # the last step has no room for a draft
    for request, row, num_pads in zip(requests, out, (0, 2)):
        keys = drafter.keys[request]
        with torch.no_grad():
            alone = model(row[None, num_pads: num_pads + keys.shape[-2]], use_cache=True).past_key_values
        torch.testing.assert_close(keys, alone.layers[0].keys)
