"""``with freespec.documents(docs):``: documents for every generate() inside, per thread and per task."""

import asyncio
import contextvars
import threading

import numpy as np
import pytest
import torch

import freespec
from freespec.drafters.corpus import CorpusDrafter
from freespec.testing.models import tiny_random_llama

from conftest import plain_generate

PROMPT = torch.tensor([[3, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9]])


class RecordingCorpus(CorpusDrafter):
    """A corpus drafter that records the documents each request received."""

    def __init__(self):
        super().__init__()
        self.received = []
        self.received_lock = threading.Lock()  # (``lock`` is the drafter's own)

    def add_documents(self, request_id, docs, tokenizer=None):
        with self.received_lock:
            self.received.append([np.asarray(doc).tolist() for doc in docs])
        super().add_documents(request_id, docs, tokenizer)


class WordTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [int(word) for word in text.split()]


@pytest.fixture(scope="module")
def continuation():
    model = tiny_random_llama(seed=2)
    plain = plain_generate(model, PROMPT, max_new_tokens=40, do_sample=False)
    return plain, plain[0, PROMPT.shape[1]:].tolist()


@pytest.fixture
def model(fresh_llama):
    return fresh_llama


def test_documents_reach_every_generate_inside_and_none_after(model, continuation):
    plain, output = continuation
    # one successor table per request: the shared one would carry the continuation across calls by design
    freespec.patch(model, drafter="mixture", drafter_options={"recycle_shared": False})
    with freespec.documents([[7, 7] + output]) as added:
        assert [a.tolist() for a in added] == [[7, 7] + output]
        for _ in range(2):
            out = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
            assert out.tolist() == plain.tolist()
            assert freespec.stats(model).tau > 3
    assert freespec.active_documents() == ()
    model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    assert freespec.stats(model).tau < 3


def test_blocks_nest_and_join_the_calls_own_documents(model):
    drafter = RecordingCorpus()
    freespec.patch(model, drafter=drafter)
    with freespec.documents([[10, 11]]):
        with freespec.documents(["12 13"], tokenizer=WordTokenizer()):
            model.generate(PROMPT, max_new_tokens=3, documents=[[14, 15]])
        model.generate(PROMPT, max_new_tokens=3)
    model.generate(PROMPT, max_new_tokens=3)
    assert drafter.received == [[[10, 11], [12, 13], [14, 15]], [[10, 11]]]


def test_texts_need_a_tokenizer_on_entry():
    with pytest.raises(ValueError, match=r"freespec.documents\(\) docs\[1\] is a text: it needs tokenizer="):
        with freespec.documents([[1, 2], "some text"]):
            pass
    with pytest.raises(ValueError, match="list of texts or of token-id sequences"):
        with freespec.documents("one text"):
            pass
    with pytest.raises(ValueError, match=r"docs\[0\] must be a 1-D"):
        with freespec.documents([[[1, 2]]]):
            pass
    assert freespec.active_documents() == ()


def test_out_of_vocabulary_and_drafters_without_documents_raise_at_the_call(model):
    freespec.patch(model, drafter="mixture")
    with freespec.documents([[1, 500]]):
        with pytest.raises(ValueError, match=r"freespec.documents\(\) document 0 holds token id 500, outside"):
            model.generate(PROMPT, max_new_tokens=3)
    freespec.unpatch(model)
    freespec.patch(model, drafter="suffix")
    with freespec.documents([[1, 2]]):
        with pytest.raises(ValueError, match=r"freespec.documents\(\) needs a drafter that drafts from documents"):
            model.generate(PROMPT, max_new_tokens=3)


def test_unpatched_models_and_fallbacks_ignore_them(model, continuation):
    plain, output = continuation
    with freespec.documents([output]):
        assert model.generate(PROMPT, max_new_tokens=40, do_sample=False).tolist() == plain.tolist()
        freespec.patch(model)
        expected = plain_generate(model, PROMPT, max_new_tokens=5, num_beams=2, do_sample=False)
        assert model.generate(PROMPT, max_new_tokens=5, num_beams=2, do_sample=False).tolist() == expected.tolist()
        assert "beam search" in freespec.stats(model).fallback_reason


def test_other_threads_do_not_see_a_block_unless_given_its_context(model):
    drafter = RecordingCorpus()
    freespec.patch(model, drafter=drafter)
    seen = {}

    def call(name):
        model.generate(PROMPT, max_new_tokens=2)
        seen[name] = [d.tolist() for d in freespec.active_documents()]

    entered, done = threading.Event(), threading.Event()

    def outside():  # runs while the main thread is inside its block
        entered.wait()
        call("outside")
        done.set()

    thread = threading.Thread(target=outside)
    thread.start()
    with freespec.documents([[20, 21]]):
        entered.set()
        done.wait()
        plain_thread = threading.Thread(target=call, args=("plain thread",))
        plain_thread.start()
        plain_thread.join()
        copied = threading.Thread(target=contextvars.copy_context().run, args=(call, "copied context"))
        copied.start()
        copied.join()
    thread.join()
    assert seen == {"outside": [], "plain thread": [], "copied context": [[20, 21]]}
    assert drafter.received == [[[20, 21]]], "only the call that ran in the block's context got its documents"


def test_asyncio_tasks_each_see_their_own_block(model):
    drafter = RecordingCorpus()
    freespec.patch(model, drafter=drafter)

    async def ask(doc):
        with freespec.documents([doc]):
            await asyncio.sleep(0)  # let the other task enter its block
            await asyncio.to_thread(model.generate, PROMPT, max_new_tokens=2)  # to_thread copies the context
            await asyncio.sleep(0)
            return [d.tolist() for d in freespec.active_documents()]

    async def main():
        return await asyncio.gather(ask([30, 31]), ask([40, 41]), ask([50, 51]))

    assert asyncio.run(main()) == [[[30, 31]], [[40, 41]], [[50, 51]]]
    assert sorted(drafter.received) == [[[30, 31]], [[40, 41]], [[50, 51]]]
