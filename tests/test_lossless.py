"""Patched generate() behaves as plain generate() at the edges: stop strings however they are given,
stopping criteria that read scores, bad input ids, out-of-vocabulary drafts, the patched object itself
(deepcopy, garbage collection, pickling), and the RNG stream of sampled calls."""

import copy
import gc
import io
import pickle
import weakref

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import freespec
from freespec.draft import Budget, Draft
from freespec.drafters.base import Drafter
from freespec.testing.drafters import OracleDrafter
from freespec.integrations.transformers import is_patched
from freespec.testing.models import tiny_random_llama

from conftest import patched_generate, plain_generate

PROMPT = torch.tensor([[0, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9]])


@pytest.fixture
def model():
    m = tiny_random_llama(seed=2)
    yield m
    if is_patched(m):
        freespec.unpatch(m)


# ------------------------------------------------------------------ stop strings
@pytest.mark.slow
def test_stop_strings_however_given(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("def add(a, b):\n    return a + b\n\ndef sub(a, b):", return_tensors="pt").input_ids
    calls = [
        ((ids, GenerationConfig(stop_strings=["return"], max_new_tokens=30, do_sample=False)), {"tokenizer": tokenizer}),
        ((ids,), {"generation_config": GenerationConfig(stop_strings=["return"], max_new_tokens=30,
                                                        do_sample=False), "tokenizer": tokenizer}),
        ((ids,), {"stop_strings": ["return"], "max_new_tokens": 30, "do_sample": False, "tokenizer": tokenizer}),
    ]
    saved = model.generation_config.stop_strings
    try:
        for model_default in (None, ["never-in-this-output"]):
            model.generation_config.stop_strings = model_default
            for args, kwargs in calls:
                plain = plain_generate(model, *args, **kwargs)
                out, stats = patched_generate(model, "mixture", *args, **kwargs)
                assert stats.fallback_reason is None
                assert out.tolist() == plain.tolist()
                assert tokenizer.decode(out[0, ids.shape[1]:]).rstrip().endswith("return")
    finally:
        model.generation_config.stop_strings = saved


# ------------------------------------------------------------------ stopping criteria with scores
class StopAfterFiveScores(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), len(scores) >= 5, dtype=torch.bool)


def test_stopping_criteria_receive_the_scores(model):
    reference = plain_generate(model, PROMPT, max_new_tokens=30, do_sample=False)[0]
    kwargs = dict(max_new_tokens=30, do_sample=False, return_dict_in_generate=True, output_scores=True,
                  stopping_criteria=StoppingCriteriaList([StopAfterFiveScores()]))
    plain = plain_generate(model, PROMPT, **kwargs)
    out, stats = patched_generate(model, OracleDrafter(reference, 128), PROMPT, **kwargs)
    assert plain.sequences.shape[1] == PROMPT.shape[1] + 5
    assert out.sequences.tolist() == plain.sequences.tolist() and len(out.scores) == 5
    assert stats.tau > 1  # the five tokens came from fewer forwards


# ------------------------------------------------------------------ bad input ids, out-of-vocabulary drafts
def test_float_input_ids_are_refused(model):
    freespec.patch(model)
    with pytest.raises(ValueError, match="integer token ids"):
        model.generate(PROMPT.float(), max_new_tokens=3)


class BeyondVocabulary(Drafter):
    name = "beyond"

    def _propose(self, request_id, budget: Budget) -> Draft:
        return Draft.chain([5, 500])


def test_out_of_vocabulary_drafts_name_their_source(model):
    freespec.patch(model, drafter=BeyondVocabulary())
    with pytest.raises(ValueError, match="drafter 'beyond' proposed token id 500, outside the model's vocabulary"):
        model.generate(PROMPT, max_new_tokens=5, do_sample=False)
    freespec.unpatch(model)
    freespec.patch(model)
    with pytest.raises(ValueError, match=r"documents\[1\] holds token id 128"):
        model.generate(PROMPT, max_new_tokens=5, documents=[[5, 9], [5, 128]])


def test_attention_mask_of_another_length_does_what_plain_does(model, caplog):
    freespec.patch(model)
    with pytest.raises(RuntimeError):  # shorter: plain generate() raises
        plain_generate(model, PROMPT, attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=3)
    with pytest.raises(RuntimeError):
        model.generate(PROMPT, attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=3)
    longer = torch.ones(1, PROMPT.shape[1] + 2, dtype=torch.long)
    out = model.generate(PROMPT, attention_mask=longer, max_new_tokens=3, do_sample=False)
    assert out.tolist() == plain_generate(model, PROMPT, attention_mask=longer, max_new_tokens=3,
                                          do_sample=False).tolist()
    assert "attention_mask of shape" in freespec.stats(model).fallback_reason


def test_bools_are_not_ints():
    with pytest.raises(ValueError, match="max_draft_tokens"):
        freespec.SpecConfig(max_draft_tokens=True)
    with pytest.raises(ValueError, match="adaptive_budget"):
        freespec.SpecConfig(adaptive_budget=1)


# ------------------------------------------------------------------ the patched object
def test_deepcopy_of_a_patched_model_generates_with_the_copy(model):
    freespec.patch(model)
    twin = copy.deepcopy(model)
    assert is_patched(twin) and twin.generate.model is twin
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1)  # a different model: a different output
        original, copied = model.generate(PROMPT, max_new_tokens=8, do_sample=False), \
            twin.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert original.tolist() != copied.tolist()
    assert copied.tolist() == plain_generate(twin, PROMPT, max_new_tokens=8, do_sample=False).tolist()
    freespec.unpatch(twin)
    assert is_patched(model) and not is_patched(twin)


def test_a_patched_model_is_freed():
    model = tiny_random_llama(seed=4)
    freespec.patch(model)
    model.generate(PROMPT, max_new_tokens=3, do_sample=False)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_patched_model_pickles(model, how):
    freespec.patch(model)
    expected = model.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    assert is_patched(loaded) and loaded.generate.model is loaded
    assert loaded.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist() == expected


# ------------------------------------------------------------------ the RNG stream of sampled calls
def test_sampling_consumes_the_rng_as_plain_does_when_eos_is_inside_a_draft():
    model = tiny_random_llama(seed=2, dtype=torch.float64)
    gen = dict(do_sample=True, max_new_tokens=20, temperature=1.3)
    torch.manual_seed(11)
    free = plain_generate(model, PROMPT, **gen)[0]
    eos = int(free[PROMPT.shape[1] + 4])  # emitted fifth: make it the EOS
    torch.manual_seed(11)
    plain = plain_generate(model, PROMPT, eos_token_id=eos, **gen)
    plain_next = torch.rand(4)
    torch.manual_seed(11)
    out, stats = patched_generate(model, OracleDrafter(free, 128), PROMPT, eos_token_id=eos, **gen)
    assert out.tolist() == plain.tolist()
    assert stats.accepted_draft_tokens >= 4  # the EOS was inside an accepted draft
    assert torch.equal(torch.rand(4), plain_next)
