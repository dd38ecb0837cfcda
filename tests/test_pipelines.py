"""Speculation behind frameworks: transformers.pipeline, TextIteratorStreamer, LangChain's HuggingFacePipeline."""

import asyncio
import threading

import pytest

import freespec
from freespec.demo import DEFAULT_PROMPT, EXAMPLE_CODE
from freespec.drafters.mixture import MixtureDrafter

MESSAGES = [{"role": "user", "content": DEFAULT_PROMPT}]
GEN = dict(max_new_tokens=32, do_sample=False)


class RecordingMixture(MixtureDrafter):
    """The default drafter, recording the number of documents each request received."""

    def __init__(self):
        super().__init__()
        self.received = []

    def add_documents(self, request_id, docs, tokenizer=None):
        docs = list(docs)
        self.received.append(len(docs))
        super().add_documents(request_id, docs, tokenizer)


@pytest.fixture
def pipe(smollm2):
    from transformers import pipeline

    model, tokenizer = smollm2
    yield pipeline("text-generation", model=model, tokenizer=tokenizer)
    if freespec.integrations.transformers.is_patched(model):
        freespec.unpatch(model)


def _answer(result) -> str:
    return result[0]["generated_text"][-1]["content"]


def _stream(pipe, **kwargs) -> str:
    from transformers import TextIteratorStreamer

    streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    thread = threading.Thread(target=pipe, args=(MESSAGES,), kwargs=dict(GEN, streamer=streamer, **kwargs))
    thread.start()
    text = "".join(streamer)
    thread.join()
    return text


def test_text_generation_pipeline_speculates_with_identical_greedy_output(pipe):
    plain = pipe(MESSAGES, **GEN)
    plain_streamed = _stream(pipe)
    freespec.patch(pipe.model)
    assert pipe(MESSAGES, **GEN) == plain
    stats = freespec.stats(pipe.model)
    assert stats.fallback_reason is None and stats.new_tokens == 32
    assert stats.accepted_draft_tokens > 0 and stats.forward_passes < 32, stats.summary()
    assert _stream(pipe) == plain_streamed
    assert freespec.stats(pipe.model).accepted_draft_tokens > 0
    assert plain_streamed.strip() == _answer(plain).strip()


def test_pipeline_forwards_prediction_and_the_documents_block(pipe):
    plain = pipe(MESSAGES, **GEN)
    drafter = RecordingMixture()
    freespec.patch(pipe.model, drafter=drafter)
    assert pipe(MESSAGES, **GEN, prediction=EXAMPLE_CODE, tokenizer=pipe.tokenizer) == plain
    assert freespec.stats(pipe.model).per_drafter["prediction"].proposed > 0
    with freespec.documents([_answer(plain)], tokenizer=pipe.tokenizer):
        assert pipe(MESSAGES, **GEN) == plain
    assert drafter.received == [1]
    assert pipe(MESSAGES, **GEN) == plain
    assert drafter.received == [1], "documents end with the block"


def test_langchain_huggingface_pipeline_gets_the_documents(pipe):
    pytest.importorskip("langchain_huggingface", reason="needs the optional extra: pip install 'freespec[langchain]'")
    from langchain_huggingface import HuggingFacePipeline

    llm = HuggingFacePipeline(pipeline=pipe)
    prompt = pipe.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    call = dict(pipeline_kwargs=dict(GEN, return_full_text=False))
    plain = llm.invoke(prompt, **call)
    drafter = RecordingMixture()
    freespec.patch(pipe.model, drafter=drafter)
    with freespec.documents([plain], tokenizer=pipe.tokenizer):
        assert llm.invoke(prompt, **call) == plain
        assert asyncio.run(llm.ainvoke(prompt, **call)) == plain  # LangChain runs it in a copied context
        assert llm.batch([prompt, prompt], **call) == [plain, plain]
    assert drafter.received == [1, 1, 1, 1]
    assert llm.invoke(prompt, **call) == plain
    assert drafter.received == [1, 1, 1, 1], "documents end with the block"
