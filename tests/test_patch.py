"""The generate() patch: API, bad input, fallbacks, streamers, outputs."""

import logging

import pytest
import torch

import freespec
from freespec import SpecConfig

from conftest import plain_generate

PROMPT = torch.tensor([[0, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9]])


@pytest.fixture
def model(fresh_llama):
    return fresh_llama


def test_patch_unpatch_roundtrip(model):
    plain = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert freespec.patch(model) is model
    assert model.generate(PROMPT, max_new_tokens=12, do_sample=False).tolist() == plain.tolist()
    stats = freespec.stats(model)
    assert stats.new_tokens == 12 and stats.forward_passes >= 1 and stats.fallback_reason is None
    assert 1.0 <= stats.tau <= 12
    freespec.unpatch(model)
    assert "generate" not in model.__dict__
    with pytest.raises(RuntimeError, match="not patched"):
        freespec.stats(model)
    with pytest.raises(RuntimeError, match="not patched"):
        freespec.unpatch(model)


def test_patch_twice_is_refused(model):
    freespec.patch(model)
    with pytest.raises(RuntimeError, match="already patched"):
        freespec.patch(model)


def test_unknown_config_key_names_it(model):
    with pytest.raises(TypeError, match="max_draft_tokenz"):
        freespec.patch(model, max_draft_tokenz=3)
    with pytest.raises(ValueError, match="drafter='nope' is unknown"):
        freespec.patch(model, drafter="nope")
    with pytest.raises(ValueError, match="max_draft_tokens"):
        freespec.patch(model, max_draft_tokens=-1)
    with pytest.raises(TypeError, match="SpecConfig"):
        freespec.patch(model, {"drafter": "suffix"})
    with pytest.raises(ValueError, match="bad drafter_options for 'prompt_lookup'"):
        freespec.patch(model, drafter="prompt_lookup", drafter_options={"min_matchh": 2})
    assert not freespec.integrations.transformers.is_patched(model)


def test_config_object_and_overrides(model):
    freespec.patch(model, SpecConfig(drafter="prompt_lookup", max_draft_tokens=4), max_draft_depth=3)
    model.generate(PROMPT, max_new_tokens=20, do_sample=False)
    stats = freespec.stats(model)
    assert stats.draft_tokens <= 4 * stats.steps_with_draft


def test_empty_prompt_and_zero_new_tokens(model):
    freespec.patch(model)
    with pytest.raises(ValueError, match="input_ids is empty"):
        model.generate(torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(PROMPT, max_new_tokens=0)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(num_beams=2), "beam search"),
    (dict(prompt_lookup_num_tokens=3), "prompt lookup"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(use_cache=False), "use_cache=False"),
])
def test_unsupported_modes_fall_back_with_one_warning(model, kwargs, reason, caplog):
    gen = dict(max_new_tokens=6, do_sample=False) | kwargs
    torch.manual_seed(0)
    plain = plain_generate(model, PROMPT, **gen)
    freespec.patch(model)
    with caplog.at_level(logging.WARNING, logger="freespec"):
        for _ in range(2):
            torch.manual_seed(0)
            out = model.generate(PROMPT, **gen)
            assert freespec.stats(model).fallback_reason is not None
            assert reason in freespec.stats(model).fallback_reason
    sequences = out.sequences if hasattr(out, "sequences") else out
    expected = plain.sequences if hasattr(plain, "sequences") else plain
    assert sequences.tolist() == expected.tolist()
    assert len([r for r in caplog.records if "falling back" in r.getMessage()]) == 1


def test_a_batch_speculates_and_matches(model):
    batch = torch.cat([PROMPT, PROMPT.flip(1)])
    plain = plain_generate(model, batch, max_new_tokens=8, do_sample=False)
    freespec.patch(model)
    out = model.generate(batch, max_new_tokens=8, do_sample=False)
    assert out.tolist() == plain.tolist()
    assert freespec.stats(model).fallback_reason is None and freespec.stats(model).row_forwards >= 2


def test_user_cache_falls_back(model):
    from transformers import DynamicCache

    freespec.patch(model)
    model.generate(PROMPT, max_new_tokens=4, do_sample=False, past_key_values=DynamicCache())
    assert "cache" in freespec.stats(model).fallback_reason


def test_streamer_receives_prompt_then_every_new_token(model):
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    plain_rec, spec_rec = Recorder(), Recorder()
    plain = plain_generate(model, PROMPT, max_new_tokens=10, do_sample=False, streamer=plain_rec)
    freespec.patch(model)
    out = model.generate(PROMPT, max_new_tokens=10, do_sample=False, streamer=spec_rec)
    assert out.tolist() == plain.tolist()
    assert spec_rec.ended and plain_rec.ended
    assert spec_rec.chunks[0] == PROMPT[0].tolist()
    assert sum(spec_rec.chunks[1:], []) == sum(plain_rec.chunks[1:], []) == plain[0, PROMPT.shape[1]:].tolist()


def test_return_dict_with_scores(model):
    gen = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True,
               output_logits=True)
    plain = plain_generate(model, PROMPT, **gen)
    freespec.patch(model)
    out = model.generate(PROMPT, **gen)
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert len(out.scores) == len(plain.scores) == 8
    for a, b in zip(out.scores, plain.scores):
        assert torch.allclose(a, b, atol=1e-6)
    for a, b in zip(out.logits, plain.logits):
        assert torch.allclose(a, b, atol=1e-6)


def test_logits_buffer_reuses_its_memory():
    """Each step's float32 logits go into the same memory (grown when a wider forward needs more): the values are
    the conversion's, and a fill overwrites the last one's view, which is why kept scores are copies."""
    from freespec.engine import LogitsBuffer

    buffer = LogitsBuffer()
    first = torch.randn(1, 3, 10).to(torch.bfloat16)
    view = buffer.fill(first)
    assert view.dtype == torch.float32 and torch.equal(view, first.float())
    second = torch.randn(1, 2, 10).to(torch.bfloat16)
    again = buffer.fill(second)
    assert again.data_ptr() == view.data_ptr() and torch.equal(again, second.float())
    wide = torch.randn(2, 9, 10).to(torch.bfloat16)
    assert torch.equal(buffer.fill(wide), wide.float())  # grown


PROCESSED = dict(do_sample=False, repetition_penalty=1.2)


def test_logits_buffer_is_kept_per_thread_across_calls_and_never_shared(model, monkeypatch):
    """generate() calls on one thread convert into the same memory (a fresh buffer per call paid its new pages
    on every request's wide forwards); a call inside another, or on another thread, gets memory of its own;
    a buffer grown past KEEP_BYTES is freed when its call ends."""
    import threading

    from freespec import engine
    from freespec.engine import LogitsBuffer

    seen = []
    acquire = LogitsBuffer.acquire.__func__

    def recording_acquire(cls):
        buffer = acquire(cls)
        seen.append(buffer)
        return buffer

    monkeypatch.setattr(LogitsBuffer, "acquire", classmethod(recording_acquire))
    # the buffer holds a whole tree's float32 scores: on the accelerator path, with processors (a CPU walk converts
    # only the rows it reads)
    monkeypatch.setattr(engine, "verifies_whole_tree", lambda device: True)
    freespec.patch(model, drafter="prompt_lookup", drafter_options={"min_match": 1})
    plain = freespec.unpatch(model).generate(PROMPT, max_new_tokens=8, **PROCESSED)
    freespec.patch(model, drafter="prompt_lookup", drafter_options={"min_match": 1})
    for _ in range(2):
        assert model.generate(PROMPT, max_new_tokens=8, **PROCESSED).tolist() == plain.tolist()
    assert seen[0] is seen[1] and not seen[0].in_use and seen[0]._data is not None
    pointer = seen[0]._data.data_ptr()

    outer = LogitsBuffer.acquire()  # as if a callback of this thread's call generated again
    assert outer is seen[0]
    assert model.generate(PROMPT, max_new_tokens=8, **PROCESSED).tolist() == plain.tolist()
    assert seen[-1] is not outer and outer.in_use and outer._data.data_ptr() == pointer
    outer.release()

    other = []
    thread = threading.Thread(target=lambda: other.append(model.generate(PROMPT, max_new_tokens=8, **PROCESSED)))
    thread.start()
    thread.join()
    assert other[0].tolist() == plain.tolist() and seen[-1] is not seen[0]

    monkeypatch.setattr(engine.LogitsBuffer, "KEEP_BYTES", 16)
    model.generate(PROMPT, max_new_tokens=8, **PROCESSED)
    assert seen[-1] is seen[0] and seen[0]._data is None  # too large to keep


def test_generate_inside_then_outside_inference_mode(model):
    """A thread's kept buffer made under torch.inference_mode() holds an inference tensor, which cannot be
    written outside it: a later call outside (and one inside again) still decodes as plain decoding does."""
    plain = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    freespec.patch(model, drafter="prompt_lookup", drafter_options={"min_match": 1})
    with torch.inference_mode():
        inside = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    outside = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    with torch.inference_mode():
        again = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert inside.tolist() == outside.tolist() == again.tolist() == plain.tolist()


def test_drafter_instance_is_reused_across_calls(model):
    from freespec.drafters.prompt_lookup import PromptLookupDrafter

    drafter = PromptLookupDrafter(min_match=1)
    freespec.patch(model, drafter=drafter)
    for _ in range(2):
        model.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert drafter._contexts == {}, "every request is stopped"
    with pytest.raises(ValueError, match="only apply to a drafter given by name"):
        SpecConfig(drafter=drafter, drafter_options={"a": 1})


@pytest.mark.parametrize("drafter", ["corpus", "mixture"])
def test_documents_feed_the_drafter_and_keep_output_exact(model, drafter):
    plain = plain_generate(model, PROMPT, max_new_tokens=40, do_sample=False)
    continuation = plain[0, PROMPT.shape[1]:].tolist()
    # a fixed budget: the mixture's live cost model would make the tau below depend on the machine's load
    freespec.patch(model, drafter=drafter, adaptive_budget=False)
    out = model.generate(PROMPT, max_new_tokens=40, do_sample=False, documents=[[7, 7] + continuation + [3]])
    assert out.tolist() == plain.tolist()
    with_docs = freespec.stats(model).tau
    model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert with_docs > freespec.stats(model).tau, "the per-call documents must not outlive the call"
    assert with_docs > 3


def test_documents_errors(model):
    freespec.patch(model, drafter="prompt_lookup")
    with pytest.raises(ValueError, match="documents= needs a drafter"):
        model.generate(PROMPT, max_new_tokens=4, documents=[[1, 2, 3]])
    freespec.unpatch(model)
    freespec.patch(model, drafter="corpus")
    with pytest.raises(ValueError, match="tokenizer="):
        model.generate(PROMPT, max_new_tokens=4, documents=["some text"])
    with pytest.raises(ValueError, match="list of texts"):
        model.generate(PROMPT, max_new_tokens=4, documents="some text")


FIRST_CALL_SCRIPT = r"""
import importlib, pkgutil, sys
import torch
import freespec, freespec.kernels
from freespec.testing.models import tiny_random

modules = [importlib.import_module(f"freespec.kernels.{m.name}") for m in pkgutil.iter_modules(freespec.kernels.__path__)]
def compiled():
    return {(module.__name__, name, str(signature)) for module in modules for name in dir(module)
            for signature in getattr(getattr(module, name), "signatures", ())}
model = tiny_random("llama", vocab_size=128, seed=0)
freespec.patch(model)
before = compiled()
rows = torch.tensor([[0, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9], [0, 0, 0, 7, 8, 9, 7, 8, 9, 7, 8, 9, 7]])
mask = (torch.arange(13) >= torch.tensor([[0], [3]])).long()
model.generate(rows, attention_mask=mask, max_new_tokens=24, do_sample=False)
model.generate(rows[:1], max_new_tokens=24, do_sample=False)
torch.manual_seed(0)
model.generate(rows[:1], max_new_tokens=24, do_sample=True)
new = sorted(compiled() - before)
print("\n".join(f"{m}.{n}: {s}" for m, n, s in new))
sys.exit(1 if new else 0)
"""


def test_patch_loads_every_kernel_the_first_generate_runs():
    """patch() compiles (or loads) the kernels a decode step runs, so the first generate() compiles none: in a fresh
    interpreter, a batched and a single-row greedy call and a sampled one of the default mixture add no numba
    signature."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", FIRST_CALL_SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"compiled during the first generate():\n{result.stdout}{result.stderr[-2000:]}"
