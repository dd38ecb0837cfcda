"""Predicted outputs: the alignment, the drafter, generate(prediction=...) exactness and validation."""

import numpy as np
import pytest
import torch

import freespec
from freespec.draft import Budget
from freespec.drafters.mixture import MixtureDrafter
from freespec.drafters.prediction import PredictionDrafter, PredictionSource, realign

from conftest import plain_generate

P = [1, 2, 3, 4, 5, 6, 7, 8]
BIG = Budget(64, 48)


def _chains(source, request_id="r", budget=BIG):
    return [(match_len, draft.token_ids.tolist()) for _, match_len, draft in source.drafts(request_id, budget)]


def _source_after(output):
    source = PredictionSource()
    source.add("r", P)
    source.extend("r", np.asarray(output, np.int64))
    return source


def test_realign_worked_example():
    prediction = np.asarray([1, 2, 3, 1, 2, 4])
    assert realign(prediction, np.asarray([7, 1, 2]), expected=5) == (5, 2)
    assert realign(prediction, np.asarray([7, 1, 2]), expected=1) == (2, 2)
    assert realign(prediction, np.asarray([3, 1, 2, 4]), expected=0) == (6, 4)
    assert realign(prediction, np.asarray([9]), expected=3) == (3, 0)
    # a step back costs twice a step forward: from 3, position 1 (back 2, cost 4) loses to 5 (forward 2)
    assert realign(np.asarray([5, 0, 0, 0, 5]), np.asarray([5]), expected=3) == (5, 1)


def test_in_sync_drafts_the_rest_of_the_prediction():
    assert _chains(_source_after([])) == [(1, P)]
    assert _chains(_source_after([1, 2, 3])) == [(3, [4, 5, 6, 7, 8])]
    assert _chains(_source_after(P)) == []  # all of it produced


def test_deletion_realigns_and_guesses_at_the_anchor():
    source = _source_after([1, 2, 3, 6])
    assert _chains(source) == [(1, [7, 8]), (1, [4, 5])]  # the chain; one-token guesses at the anchor 3
    source.extend("r", np.asarray([7]))  # aligned again: no more guesses
    assert _chains(source) == [(2, [8])]


def test_insertion_guesses_then_stops_guessing_then_resumes():
    source = _source_after([1, 2, 3, 9])
    assert _chains(source) == [(1, [4, 5])]  # lost: only the guesses (the model comes back / 9 replaced 4)
    source.extend("r", np.asarray([9, 9, 9]))
    assert _chains(source) == [(1, [4, 5])]  # 4 tokens since the departure: still guessing
    source.extend("r", np.asarray([9]))
    assert _chains(source) == []  # a long insertion: wait for the output to come back by itself
    source.extend("r", np.asarray([4, 5]))
    assert _chains(source) == [(2, [6, 7, 8])]  # resumed at the anchor: trusted at once


def test_changed_token_is_guessed_past():
    source = _source_after([1, 2, 3, 9])  # 9 replaced 4: the guess one past the anchor is right
    source.extend("r", np.asarray([5]))
    assert _chains(source)[0] == (1, [6, 7, 8])
    source.extend("r", np.asarray([6, 7]))
    assert _chains(source)[0] == (3, [8])


def test_trust_after_moves_the_anchor():
    source = PredictionSource(trust_after=2)
    source.add("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    source.extend("r", np.asarray([1, 2, 6, 7]))  # deletion of 3..5, re-aligned at 6, two agree: trusted
    assert _chains(source) == [(2, [8, 9, 10])]


def test_guesses_are_distinct_siblings():
    source = PredictionSource()
    source.add("r", [1, 2, 2, 3])
    source.extend("r", np.asarray([1, 9]))  # lost at the anchor 1, where the prediction repeats 2
    (_, _, draft), = source.drafts("r", BIG)
    assert draft.token_ids.tolist() == [2] and draft.parents.tolist() == [-1]
    never = PredictionSource(guess_window=0)
    never.add("r", [1, 2, 2, 3])
    never.extend("r", np.asarray([1, 9]))
    assert never.drafts("r", BIG) == []


def test_budget_caps_the_chains():
    source = _source_after([])
    assert _chains(source, budget=Budget(3, 48)) == [(1, [1, 2, 3])]
    assert _chains(source, budget=Budget(64, 2)) == [(1, [1, 2])]
    assert PredictionSource(max_depth=4).drafts("r", BIG) == []  # no prediction for this request


def test_prediction_drafter_lifecycle_and_errors():
    drafter = PredictionDrafter()
    with pytest.raises(ValueError, match="not active"):
        drafter.add_prediction("r", [1, 2])
    drafter.start("r", [5, 6])
    assert drafter.propose("r", BIG).num_nodes == 0  # no prediction: nothing to draft
    with pytest.raises(ValueError, match="1-D"):
        drafter.add_prediction("r", [[1, 2]])
    drafter.add_prediction("r", [1, 2, 3])
    assert drafter.propose("r", BIG).token_ids.tolist() == [1, 2, 3]
    drafter.extend("r", [1, 9])
    draft = drafter.propose("r", BIG)
    assert draft.paths() == [[2], [3]]  # resume at the anchor 1, or 9 replaced 2
    drafter.stop("r")
    assert drafter.prediction._requests == {}
    with pytest.raises(ValueError, match="max_match"):
        PredictionDrafter(max_match=0)


def test_drafters_without_predictions_refuse_them():
    from freespec.drafters.suffix import SuffixDrafter

    drafter = SuffixDrafter()
    drafter.start("r", [1, 2])
    assert not drafter.accepts_prediction
    with pytest.raises(ValueError, match="does not draft from a predicted output"):
        drafter.add_prediction("r", [1, 2])


def test_mixture_composes_the_prediction():
    drafter = MixtureDrafter(adaptive=False)
    assert drafter.accepts_prediction
    drafter.start("r", [40, 41, 42])
    drafter.add_prediction("r", [10, 11, 12, 13])
    draft = drafter.propose("r", BIG)
    candidates = draft.candidates()  # the lookahead window rides beside them as not-candidates
    assert [10, 11, 12, 13] in candidates.paths() and set(candidates.sources) == {"prediction"}
    drafter.stop("r")
    assert drafter.prediction._requests == {}


# ------------------------------------------------------------------ generate(prediction=...)
PROMPT = torch.tensor([[0, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9]])


def _variants(output: list[int], vocab_size: int) -> dict[str, list[int]]:
    """Predictions that are right, wrong everywhere (no token of the output), and right but for an edit."""
    absent = [t for t in range(vocab_size) if t not in set(output)]
    other = [absent[i % len(absent)] for i in range(len(output))]
    return {
        "right": output,
        "wrong": other,
        "output-inserts": output[:8] + output[16:],  # the output has 8 tokens the prediction lacks
        "output-deletes": output[:8] + other[:6] + output[8:],  # the prediction has 6 the output skips
        "changed-span": output[:8] + other[8:11] + output[11:],
        "empty": [],
        "longer": output + output,
    }


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_gemma3"])
@pytest.mark.parametrize("drafter", ["mixture", "prediction"])
def test_greedy_output_is_exact_whatever_the_prediction(which, drafter, request):
    model = request.getfixturevalue(which)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, vocab, (1, 12), generator=g)  # no BOS, EOS or padding id
    prompts = [torch.cat([base, base[:, :6]], dim=1), torch.randint(3, vocab, (1, 30), generator=g)]
    for prompt in prompts:
        plain = plain_generate(model, prompt, max_new_tokens=40, do_sample=False)
        output = plain[0, prompt.shape[1]:].tolist()
        taus = {}
        for name, prediction in _variants(output, vocab).items():
            freespec.patch(model, drafter=drafter)
            try:
                out = model.generate(prompt, max_new_tokens=40, do_sample=False, prediction=prediction)
                stats = freespec.stats(model)
            finally:
                freespec.unpatch(model)
            assert out.tolist() == plain.tolist(), f"prediction {name!r} changed the output"
            assert stats.fallback_reason is None
            taus[name] = stats.tau
        assert taus["wrong"] == 1.0 or drafter == "mixture"  # the mixture may draft from the prompt too
        if drafter == "prediction":
            assert taus["right"] == len(output)  # one forward: the prefill verifies the whole output
            assert taus["output-inserts"] > 2 and taus["output-deletes"] > 2 and taus["changed-span"] > 2


def test_a_prediction_past_the_eos_stops_where_plain_decoding_stops(tiny_llama):
    plain = plain_generate(tiny_llama, PROMPT, max_new_tokens=30, do_sample=False)
    eos = int(plain[0, PROMPT.shape[1] + 5])
    expected = plain_generate(tiny_llama, PROMPT, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    freespec.patch(tiny_llama, drafter="prediction")
    try:
        prediction = plain[0, PROMPT.shape[1]:]  # a tensor is fine
        out = tiny_llama.generate(PROMPT, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                                  prediction=prediction)
        assert out.tolist() == expected.tolist()
        assert freespec.stats(tiny_llama).forward_passes == 1
    finally:
        freespec.unpatch(tiny_llama)


@pytest.fixture
def patched_llama(fresh_llama):
    return freespec.patch(fresh_llama)


@pytest.mark.parametrize("prediction, message", [
    ("some text", "prediction given as text needs tokenizer="),
    (b"bytes", "prediction must be a text or a 1-D sequence"),
    (17, "prediction must be a text or a 1-D sequence"),
    ([[1, 2], [3, 4]], r"prediction has 2 entries \(one per row\) for a batch of 1 row"),
    ([[[1, 2]]], r"prediction\[0\] must be a 1-D"),
    ([1.5, 2.0], "integer token ids"),
    ([1, -2], "outside"),
    ([1, 5000], r"prediction holds token id 5000, outside the model's vocabulary \[0, 128\)"),
])
def test_bad_predictions_raise_naming_the_argument(patched_llama, prediction, message):
    with pytest.raises(ValueError, match=message):
        patched_llama.generate(PROMPT, max_new_tokens=4, prediction=prediction)


def test_prediction_needs_a_drafter_that_takes_one(fresh_llama):
    freespec.patch(fresh_llama, drafter="suffix")
    with pytest.raises(ValueError, match="prediction= needs a drafter .*'suffix'"):
        fresh_llama.generate(PROMPT, max_new_tokens=4, prediction=[1, 2])


def test_text_prediction_uses_the_calls_tokenizer(patched_llama):
    class Tokenizer:
        calls = []

        def encode(self, text, add_special_tokens=True):
            self.calls.append((text, add_special_tokens))
            return [int(word) for word in text.split()]

    plain = plain_generate(patched_llama, PROMPT, max_new_tokens=20, do_sample=False)
    text = " ".join(str(t) for t in plain[0, PROMPT.shape[1]:].tolist())
    out = patched_llama.generate(PROMPT, max_new_tokens=20, do_sample=False, prediction=text, tokenizer=Tokenizer())
    assert out.tolist() == plain.tolist()
    assert Tokenizer.calls == [(text, False)]
    assert freespec.stats(patched_llama).tau > 5


def test_a_batch_takes_one_prediction_per_row_or_one_for_all(patched_llama):
    from test_batch import left_padded

    rows = [[3, 5, 9, 13, 5, 9, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
    ids, mask = left_padded(rows, pad=1)
    plain = plain_generate(patched_llama, ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    outputs = [plain[r, ids.shape[1]:].tolist() for r in range(2)]
    for prediction in (outputs, [outputs[0], None], outputs[1], torch.tensor(outputs)):
        out = patched_llama.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                     prediction=prediction)
        assert out.tolist() == plain.tolist()
        assert freespec.stats(patched_llama).fallback_reason is None
    patched_llama.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, prediction=outputs)
    assert freespec.stats(patched_llama).per_drafter["prediction"].accepted >= 30
    with pytest.raises(ValueError, match=r"prediction has 3 entries \(one per row\) for a batch of 2 row"):
        patched_llama.generate(ids, attention_mask=mask, max_new_tokens=4, prediction=[[1], [2], [3]])
    with pytest.raises(ValueError, match=r"prediction\[1\] given as text needs tokenizer="):
        patched_llama.generate(ids, attention_mask=mask, max_new_tokens=4, prediction=[[1], "text"])


def test_num_return_sequences_repeats_the_prediction_with_the_rows(patched_llama):
    plain = plain_generate(patched_llama, PROMPT, max_new_tokens=12, do_sample=False)
    torch.manual_seed(0)
    out = patched_llama.generate(PROMPT, max_new_tokens=12, do_sample=True, num_return_sequences=3,
                                 prediction=plain[0, PROMPT.shape[1]:])
    assert out.shape[0] == 3 and freespec.stats(patched_llama).fallback_reason is None
    assert freespec.stats(patched_llama).per_drafter["prediction"].proposed > 0


def test_prediction_is_dropped_when_the_call_falls_back(patched_llama):
    beams = plain_generate(patched_llama, PROMPT, max_new_tokens=6, num_beams=2, do_sample=False)
    out = patched_llama.generate(PROMPT, max_new_tokens=6, num_beams=2, do_sample=False, prediction=[1, 2, 3])
    assert out.tolist() == beams.tolist()
    assert "beam search" in freespec.stats(patched_llama).fallback_reason


@pytest.mark.slow
def test_real_smollm2_prediction_is_exact(smollm2):
    model, tokenizer = smollm2
    code = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
            "    return total / len(values)\n")
    messages = [{"role": "user", "content": f"Rename the parameter `values` to `numbers`. Output the whole "
                                            f"function.\n\n```python\n{code}```"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    plain = plain_generate(model, **inputs, max_new_tokens=80, do_sample=False)
    output = plain[0, inputs["input_ids"].shape[1]:].tolist()
    freespec.patch(model, adaptive_budget=False)  # a fixed budget: the live cost model makes tau depend on load
    try:
        taus = {}
        for name, prediction in [("code", code), ("right", output), ("wrong", [(t + 1) % 1000 for t in output]),
                                 ("inserted", output[:20] + output[35:]), ("deleted", output[:20] + [42] * 9 + output[20:])]:
            out = model.generate(**inputs, max_new_tokens=80, do_sample=False, prediction=prediction,
                                 tokenizer=tokenizer)
            assert out.tolist() == plain.tolist(), f"prediction {name!r} changed the output"
            taus[name] = freespec.stats(model).tau
        model.generate(**inputs, max_new_tokens=80, do_sample=False)
        taus["none"] = freespec.stats(model).tau
    finally:
        freespec.unpatch(model)
    assert taus["right"] > taus["none"]
