"""freespec serving SGLang's NGRAM drafts inside a real SGLang engine (``sgl.Engine``), on this CPU.

Two engines, each in its own process for the whole module and always stopped
(``tests/sglang_engine.py``): plain SGLang (no speculation), and SGLang with
``--speculative-algorithm NGRAM`` whose drafts come from freespec's mixture
(``FREESPEC_SGLANG_DRAFTER``), with a KV pool small enough that sixteen requests
at once make SGLang retract some, a context of 1,024 tokens, and a fault
injected into the drafter for every request whose id starts with ``fault-``.
Which parts are SGLang's and which ours: ``tests/sglang_engine.py``. Runs in the
SGLang environment (``bash scripts/test_env.sh sglang``); skips elsewhere.
"""

from __future__ import annotations


import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

import sglang_engine  # noqa: E402

if sglang_engine.MISSING:
    pytest.skip(sglang_engine.MISSING, allow_module_level=True)

from sglang_engine import ENGINE_KWARGS, ENV_FAULT, EngineProcess, model_dir, wait_for, live_requests  # noqa: E402

from freespec.integrations.host_serving import read_stats  # noqa: E402

CONTEXT_LEN = 1024
NUM_DRAFT = 16
FAULT = "fault-"


@pytest.fixture(scope="module")
def tokenizer():
    return sglang_engine.tokenizer()


@pytest.fixture(scope="module")
def workload(tokenizer):
    """Sixteen requests of mixed lengths: code edits (outputs copy the prompt) and open questions, some with
    stop strings, ``max_new_tokens`` from 10 to 40."""
    from freespec.bench.datasets import load_dataset

    def chat(text):
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
        return tokenizer(templated, add_special_tokens=False)["input_ids"]

    edits = [chat(item.turns[0]) for item in load_dataset("builtin:code-edit", limit=8)]
    questions = [chat(text) for text in (
        "What is the capital of France? Answer in one sentence.", "Write a haiku about the sea.",
        "List three prime numbers.", "Explain what a hash map is.", "Say hello in Spanish.",
        "Name two planets.", "What does CPU stand for?", "Give me a synonym for happy.")]
    prompts = [p for pair in zip(edits, questions) for p in pair]
    params = []
    for i in range(len(prompts)):
        param = {"temperature": 0, "max_new_tokens": (10, 20, 30, 40)[i % 4]}
        if i % 5 == 2:
            param["stop"] = ["\n\n"]
        params.append(param)
    return prompts, params


def _engine(request, tmp_path_factory, name: str, extra: dict, env: dict) -> EngineProcess:
    log = tmp_path_factory.mktemp(name) / "engine.log"
    kwargs = dict(ENGINE_KWARGS, model_path=model_dir(), context_length=CONTEXT_LEN, **extra)
    engine = EngineProcess(kwargs, env, log_path=log)
    request.addfinalizer(engine.close)
    return engine


@pytest.fixture(scope="module")
def plain(request, tmp_path_factory):
    return _engine(request, tmp_path_factory, "plain", {"max_total_tokens": 8192}, {})


@pytest.fixture(scope="module")
def stats_path(tmp_path_factory):
    return tmp_path_factory.mktemp("stats") / "freespec.json"


@pytest.fixture(scope="module")
def freespec(request, tmp_path_factory, stats_path):
    env = {"FREESPEC_SGLANG_DRAFTER": "mixture", "FREESPEC_SGLANG_STATS": str(stats_path), ENV_FAULT: FAULT}
    extra = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": NUM_DRAFT, "max_total_tokens": 2560,
             "schedule_conservativeness": 0.05}  # admits more than fits: sixteen at once are retracted
    return _engine(request, tmp_path_factory, "freespec", extra, env)


@pytest.fixture(scope="module")
def reference(plain, workload):
    """Plain SGLang's outputs for the workload (all at once: in float32 on this CPU they are its outputs one
    at a time too, which the concurrency-1 comparison below also checks)."""
    prompts, params = workload
    return _ids(plain.generate(prompts, params))


def _ids(outputs):
    for out in outputs:
        assert "error" not in out, out["error"]
    return [out["output_ids"] for out in outputs]


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_greedy_identical_to_plain_sglang(freespec, workload, reference, concurrency):
    prompts, params = workload
    if concurrency == 1:  # six of them one at a time (the time a CI run can give)
        prompts, params = prompts[:6], params[:6]
    got = []
    for start in range(0, len(prompts), concurrency):
        got += _ids(freespec.generate(prompts[start:start + concurrency], params[start:start + concurrency]))
    for i, (ours, plain_ids) in enumerate(zip(got, reference)):
        assert ours == plain_ids, f"request {i} at concurrency {concurrency}: freespec's output differs from plain SGLang's"


def test_retraction_keeps_outputs(freespec, workload, reference):
    """The KV pool holds fewer tokens than sixteen requests need: SGLang retracts some and runs them again."""
    prompts, params = workload
    outputs = freespec.generate(prompts, [dict(q, max_new_tokens=48) for q in params])
    got = _ids(outputs)
    retractions = sum(out["meta_info"].get("num_retractions", 0) for out in outputs)
    assert retractions > 0, "no request was retracted: the pool is not small enough"
    for i, ours in enumerate(got):  # the plain outputs are these requests' at a lower max_new_tokens: a prefix
        assert ours[:len(reference[i])] == reference[i], f"request {i}: output after retraction differs"


def test_greedy_identical_to_generate(freespec, workload):
    """Batch 1 against Hugging Face ``generate()`` on the same weights (float32, greedy)."""
    import torch

    from freespec import models

    model, _ = models.load("smollm2-135m")
    prompts, params = workload
    for i in (0, 1, 2):
        ours = _ids(freespec.generate([prompts[i]], dict(params[i], stop=None)))[0]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompts[i]]), max_new_tokens=params[i]["max_new_tokens"], do_sample=False)
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        assert _without_eos(ours, eos) == _without_eos(out[0, len(prompts[i]):].tolist(), eos), \
            f"request {i} differs from generate()"


def _without_eos(ids: list, eos: set) -> list:
    return ids[:-1] if ids and ids[-1] in eos else ids


def test_prompt_near_the_context_length(freespec, plain, tokenizer):
    """A prompt and output that end D - 4 tokens short of the context (12 here), the closest SGLang's NGRAM
    path stays inside its own bookkeeping: drafts must not run past the context.

    Not closer: each decode step SGLang 0.5.21's speculative path reserves 2 D
    KV slots past a request's committed length in its ``req_to_token`` row,
    which holds the context + 4 + D, so a request within D - 4 tokens of the
    context writes past its row (on a GPU its Triton kernel writes into the next
    row's memory; the stand-in does the same, and past the last row it fails)
    and the scheduler's idle check reports the slots as leaked. That is SGLang's
    with any NGRAM corpus, its own included; freespec cannot change it.
    """
    text = "\n".join(f"line {i}: value = {i * 7 % 13}" for i in range(400))
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    prompt = tokenizer(text)["input_ids"][:CONTEXT_LEN + 4 - NUM_DRAFT - params["max_new_tokens"]]
    assert _ids(freespec.generate([prompt], params)) == _ids(plain.generate([prompt], params))


def test_drafter_fault_costs_only_drafts(freespec, workload, reference, stats_path):
    """Requests whose drafter raises get no drafts; their outputs and everyone else's are unchanged."""
    prompts, params = workload
    errors_before = (read_stats(str(stats_path)) or {}).get("errors", 0)
    rids = [f"{FAULT}{i}" if i % 2 else f"ok-{i}" for i in range(8)]
    got = _ids(freespec.generate(prompts[:8], params[:8], rids=rids))
    assert got == reference[:8]
    stats = wait_for(lambda: (read_stats(str(stats_path)) or {}).get("errors", 0) > errors_before and
                     read_stats(str(stats_path)), 30)
    assert stats and stats["errors"] > errors_before, "the injected faults were not counted"
    assert "fault injected" in freespec.log_tail(10**7)
    assert _ids(freespec.generate(prompts[:2], params[:2])) == reference[:2], "the engine stopped serving"


def test_live_requests_back_to_zero_when_idle(freespec, workload, stats_path):
    prompts, params = workload
    _ids(freespec.generate(prompts[:4], params[:4]))
    assert wait_for(lambda: live_requests(stats_path) == 0, 30), f"live requests stayed at {live_requests(stats_path)}"


def test_prediction_hint_drafts_the_predicted_output(freespec, workload, reference):
    """``custom_params={"prediction": ...}``: the predicted output is drafted (few verify steps), output unchanged."""
    prompts, params = workload
    i = 6  # a code edit of 30 tokens whose output no earlier request produced (the history cannot know it)
    hinted = freespec.generate([prompts[i]], dict(params[i], custom_params={"prediction": reference[i]}),
                               rids=["hinted-6"])[0]
    assert "error" not in hinted, hinted["error"]
    assert hinted["output_ids"] == reference[i]
    steps = hinted["meta_info"]["spec_verify_ct"]
    assert steps <= -(-len(reference[i]) // (NUM_DRAFT - 1)) + 2, f"{steps} verify steps for {len(reference[i])} tokens"


def test_malformed_hint_fails_that_request_only(freespec, workload, reference):
    prompts, params = workload
    bad = freespec.generate([prompts[0]], dict(params[0], custom_params={"prediction": "x", "documents": 5}))[0]
    assert "error" in bad and "custom_params['documents']" in bad["error"], bad
    assert _ids(freespec.generate([prompts[0]], params[0])) == reference[:1]


def test_repeated_request_drafts_from_history(freespec, tokenizer):
    """A request sent again drafts from the first one's output (the history, on by default): fewer steps.
    An open question: its own prompt holds little of its answer."""
    question = tokenizer.apply_chat_template([{"role": "user", "content": "Describe the water cycle."}],
                                             add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(question, add_special_tokens=False)["input_ids"]  # asked nowhere else in this module
    params = {"temperature": 0, "max_new_tokens": 48}
    first = freespec.generate([prompt], params)[0]
    again = freespec.generate([prompt], params)[0]
    assert first["output_ids"] == again["output_ids"]
    assert again["meta_info"]["spec_verify_ct"] < first["meta_info"]["spec_verify_ct"], \
        (first["meta_info"], again["meta_info"])
