"""freespec's proposer inside a real vLLM engine (vllm-cpu, SmolLM2-135M, float32): run with
``bash scripts/test_env.sh vllm``; skipped where vLLM is not installed.

One plain engine computes every reference output first and is shut down; then one engine with
freespec's proposer (a KV cache of a few blocks, so a batch of 16 is preempted) and one
``vllm serve`` with it answer the same requests. Greedy output must be plain vLLM's, token for
token; sampled output must have its distribution; every request's drafter state must be gone when
the engine is idle.
"""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("vllm")

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # workers must not inherit numba (llvmlite)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of the test's functions

import numpy as np  # noqa: E402

from freespec import models  # noqa: E402
from freespec.integrations.vllm import PROPOSER  # noqa: E402
from freespec.integrations.vllm.bench import idle_proposer_stats, served  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 1024
NUM_BLOCKS = 12  # KV blocks of the freespec engine (128 tokens each on CPU): a batch's outputs do not fit
SPEC = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 8}
SAMPLES = 100  # seeded sampling runs per engine (one request at a time: about a second each on 2 cores)
SAMPLE_TOKENS = 6


def _model_dir() -> str:
    return str(models.local_dir("smollm2-135m"))


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_dir())


def _code_snippets() -> list[str]:
    root = os.path.join(os.path.dirname(__file__), "..", "freespec")
    texts = []
    for name in ("draft.py", "tree.py", "verify.py", "config.py", "stats.py"):
        with open(os.path.join(root, name)) as source:
            texts.append(source.read())
    return texts


def _prompts(tokenizer) -> list[list[int]]:
    """16 chat prompts of mixed lengths (30 to ~700 tokens): code to repeat with a change, and open questions."""
    questions = ["Tell me about the history of the bicycle.", "What is 17 times 23? Explain step by step.",
                 "Write a haiku about autumn.", "List five uses of a paperclip.",
                 "Translate to French: the cat sleeps on the warm roof.", "Why is the sky blue?"]
    prompts = []
    for i, code in enumerate(_code_snippets() * 2):
        lines = code.splitlines()
        start = (i * 13) % max(1, len(lines) - 60)
        snippet = "\n".join(lines[start:start + 12 + 6 * i])
        prompts.append(f"Repeat this code exactly, renaming nothing:\n\n{snippet}")
    prompts += questions
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in prompts[:16]]
    return [list(map(int, p if isinstance(p, list) else p["input_ids"])) for p in ids]


def _requests(tokenizer):
    """(name, prompts, SamplingParams kwargs): the greedy cases compared with plain vLLM."""
    prompts = _prompts(tokenizer)
    long_prompt = prompts[0] * (MAX_MODEL_LEN // len(prompts[0]) + 1)
    return {
        "one": ([prompts[0]], dict(max_tokens=96)),
        "four": (prompts[2:6], dict(max_tokens=64)),
        "sixteen": (prompts, dict(max_tokens=48)),
        "stop_strings": (prompts[8:12], dict(max_tokens=80, stop=["\n\n", "return"])),
        # 1016 + 7 tokens end one short of max_model_len; 1022 + 7 would pass it: vLLM stops at it
        "max_model_len": ([long_prompt[:MAX_MODEL_LEN - 8], long_prompt[:MAX_MODEL_LEN - 2]], dict(max_tokens=7)),
        "hints": ([prompts[1]], dict(max_tokens=64)),
        # NUM_BLOCKS hold all 8 prompts, not all 8 outputs: vLLM preempts requests as they grow
        "preempted": (prompts[:8], dict(max_tokens=224, ignore_eos=True)),
    }


def _sampling(**kwargs):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, **kwargs)


def _token_ids(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def _generate(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _sample_prompt(tokenizer) -> list[int]:
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(map(int, ids if isinstance(ids, list) else ids["input_ids"]))


def _sample_tokens(llm, prompt) -> np.ndarray:
    """[SAMPLES, SAMPLE_TOKENS] token ids, each run with its own seed, one request at a time.

    One at a time: with speculation, vllm-cpu 0.32 draws the same random numbers for every row of a
    batch (its own ngram method included), so same-prompt rows of one batch are not independent
    samples; and it fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does
    not use offset")."""
    from vllm import SamplingParams

    rows = []
    for i in range(SAMPLES):
        params = SamplingParams(temperature=0.9, seed=1000 + i, max_tokens=SAMPLE_TOKENS, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        rows.append(list(out[0].outputs[0].token_ids))
    return np.array(rows)


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # shut down already
        pass


def _proposer_stats(llm) -> dict:
    return llm.collective_rpc(lambda worker: worker.model_runner.drafter.stats())[0]


def _idle_stats(llm, timeout: float = 20.0) -> dict:
    """The proposer's stats once the engine has run its last step: the one that hands the model runner the
    requests that finished (``generate`` can return before it)."""
    deadline = time.time() + timeout
    while True:
        stats = _proposer_stats(llm)
        if stats["live_requests"] == 0 or time.time() > deadline:
            return stats
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tokenizer():
    return _tokenizer()


@pytest.fixture(scope="module")
def plain(tokenizer):
    """Every reference output of plain vLLM (no speculation), computed before the freespec engine starts."""
    from vllm import LLM

    llm = LLM(model=_model_dir(), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0)
    try:
        refs = {name: _token_ids(_generate(llm, prompts, _sampling(**kwargs)))
                for name, (prompts, kwargs) in _requests(tokenizer).items()}
        refs["samples"] = _sample_tokens(llm, _sample_prompt(tokenizer))
    finally:
        _shutdown(llm)
    return refs


@pytest.fixture(scope="module")
def spec_llm(plain):
    """vLLM with freespec's proposer (the default mixture) and a KV cache of ``NUM_BLOCKS`` blocks."""
    from vllm import LLM

    llm = LLM(model=_model_dir(), dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN, seed=0,
              speculative_config=SPEC, num_gpu_blocks_override=NUM_BLOCKS)
    yield llm
    _shutdown(llm)


@pytest.mark.parametrize("case", ["one", "four", "sixteen", "stop_strings", "max_model_len", "preempted"])
def test_greedy_output_is_plain_vllms(spec_llm, plain, tokenizer, case):
    prompts, kwargs = _requests(tokenizer)[case]
    before = _proposer_stats(spec_llm)
    got = _token_ids(_generate(spec_llm, prompts, _sampling(**kwargs)))
    assert got == plain[case]
    after = _idle_stats(spec_llm)
    assert after["live_requests"] == 0  # every request released by the time the engine is idle
    assert after["errors"] == 0
    if case != "max_model_len":  # there vLLM itself drafts nothing: no room for a draft and its bonus token
        assert after["rows"] > before["rows"]
    if case == "preempted":  # preempted requests were released, and restarted when they resumed
        assert after["starts"] - before["starts"] > len(prompts)
    if case in ("one", "four", "sixteen"):
        assert after["drafted_tokens"] > before["drafted_tokens"]  # freespec drafted (the copy prompts)
    if case == "one":  # one request: every step vLLM ran is the tokens the proposer fed (1 + its draft), reported
        assert after["mixed_steps"] == before["mixed_steps"]


def test_hints_through_sampling_params(spec_llm, plain, tokenizer):
    """documents and prediction as text and as token ids: same output, more drafted, nothing lost."""
    prompts, kwargs = _requests(tokenizer)["hints"]
    expected_text = tokenizer.decode(plain["hints"][0])
    for hints in ({"documents": [expected_text]}, {"prediction": expected_text},
                  {"prediction": plain["hints"][0], "documents": [plain["hints"][0][:20]]}):
        before = _proposer_stats(spec_llm)
        got = _token_ids(_generate(spec_llm, prompts, _sampling(**kwargs, extra_args=hints)))
        after = _idle_stats(spec_llm)
        assert got == plain["hints"]
        assert after["hint_errors"] == before["hint_errors"] and after["live_requests"] == 0
        assert after["drafted_tokens"] - before["drafted_tokens"] >= len(got[0]) // 2  # drafted from the hint


def test_bad_hints_are_refused_per_request(spec_llm, plain, tokenizer):
    from vllm.exceptions import VLLMValidationError

    prompts, kwargs = _requests(tokenizer)["one"]
    with pytest.raises(VLLMValidationError, match=r"extra_args\['documents'\].*must be a list of texts"):
        _generate(spec_llm, prompts, _sampling(**kwargs, extra_args={"documents": [1.5]}))
    with pytest.raises(VLLMValidationError, match=r"extra_args\['prediction'\]"):
        _generate(spec_llm, prompts, _sampling(**kwargs, extra_args={"prediction": {"type": "content"}}))
    assert _token_ids(_generate(spec_llm, prompts, _sampling(**kwargs))) == plain["one"]  # the engine serves on


@pytest.mark.xfail(strict=False, reason=(
    "vllm-cpu 0.32's speculative sampling is not plain vLLM's distribution whichever proposer drafts: the same "
    "comparison with vLLM's own ngram method fails too (p=5e-10 at the 4th token, 300 runs; docs/vllm.md), and "
    "freespec's passes or fails with how much it drafted; an XPASS here means vLLM's sampler matched"))
def test_seeded_sampling_has_plain_vllms_distribution(spec_llm, plain, tokenizer):
    """Chi-square homogeneity per position of the sampled tokens, freespec against plain vLLM."""
    import torch

    before = _proposer_stats(spec_llm)
    ours = _sample_tokens(spec_llm, _sample_prompt(tokenizer))
    assert _proposer_stats(spec_llm)["drafted_tokens"] > before["drafted_tokens"]
    theirs = plain["samples"]
    assert ours.shape == theirs.shape
    for position in range(1, SAMPLE_TOKENS):
        tokens, counts = np.unique(np.concatenate([ours[:, position], theirs[:, position]]), return_counts=True)
        frequent = tokens[counts >= 10]  # pool the rare tokens into one class
        table = np.array([[np.sum(run[:, position] == t) for t in frequent] + [np.sum(~np.isin(run[:, position],
                          frequent))] for run in (ours, theirs)], float)
        table = table[:, table.sum(0) > 0]
        if table.shape[1] < 2:
            continue
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        df = table.shape[1] - 1
        p_value = float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(chi2 / 2.0)))
        assert p_value > 1e-3, (position, chi2, df, table)
    assert not np.array_equal(ours, theirs[::-1])  # sampled, not a constant


# ---------------------------------------------------------------------------- vllm serve over HTTP
@pytest.fixture(scope="module")
def server(spec_llm, tmp_path_factory):
    """``vllm serve`` with freespec's proposer on 127.0.0.1 (after the in-process engine's tests)."""
    _shutdown(spec_llm)
    stats = tmp_path_factory.mktemp("vllm") / "freespec-stats.json"
    with served(_model_dir(), stats.with_suffix(".log"), stats, "--dtype", "float32", "--enforce-eager",
                "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--speculative-config",
                json.dumps(SPEC)) as (client, _):
        yield client, stats


def test_server_greedy_and_hints_over_http(server, plain, tokenizer):
    client, stats = server
    prompts, kwargs = _requests(tokenizer)["hints"]
    expected = tokenizer.decode(plain["hints"][0])
    for extra in ({}, {"vllm_xargs": {"documents": [expected]}}, {"vllm_xargs": {"prediction": expected}},
                  {"vllm_xargs": {"prediction": plain["hints"][0]}}):
        out = client.completions.create(model="model", prompt=prompts[0], max_tokens=kwargs["max_tokens"],
                                        temperature=0.0, extra_body=extra)
        assert out.choices[0].text == expected
    state = idle_proposer_stats(stats, 30.0)
    assert state["live_requests"] == 0 and state["errors"] == 0 and state["hint_errors"] == 0


def test_server_refuses_bad_hints_with_400(server, plain, tokenizer):
    import openai

    client, stats = server
    prompt = _requests(tokenizer)["one"][0][0]
    with pytest.raises(openai.BadRequestError, match="documents"):
        client.completions.create(model="model", prompt=prompt, max_tokens=8,
                                  extra_body={"vllm_xargs": {"documents": 7}})
    out = client.completions.create(model="model", prompt=prompt, max_tokens=96, temperature=0.0)
    assert out.choices[0].text == tokenizer.decode(plain["one"][0])


def test_server_aborted_streams_release_their_state(server, plain, tokenizer):
    """Streams closed after a few chunks are aborted by vLLM; their drafter state goes with them."""
    import threading

    client, stats = server
    prompts = _prompts(tokenizer)

    def stream_and_abort(prompt):
        stream = client.completions.create(model="model", prompt=prompt, max_tokens=200, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                stream.close()
                break

    threads = [threading.Thread(target=stream_and_abort, args=(p,)) for p in prompts[:8]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out = client.completions.create(model="model", prompt=prompts[0], max_tokens=96, temperature=0.0)
    assert out.choices[0].text == tokenizer.decode(plain["one"][0])
    state = idle_proposer_stats(stats, 30.0)
    assert state["live_requests"] == 0 and state["errors"] == 0


def test_propose_digest_is_a_function_of_the_code():
    """``--propose-digest`` drafts under a fixed clock: two runs hash alike, and the mixture drafts at every
    batch size (the harness's outputs copy prompt spans)."""
    from freespec.integrations.vllm.bench import propose_digest

    first, second = (propose_digest([1, 8], steps=30, prompt_len=64, k=8) for _ in range(2))
    assert first == second and min(first["drafted"].values()) > 0


def test_propose_harness_ends_requests_and_refills_their_rows():
    """With a lifetime, the harness's requests end and new ones take their rows (vLLM's persistent batch):
    freespec's proposer releases every ended request into its history, holds only the running ones, and a
    new request's row holds its own prompt; every proposer drafts through it."""
    from freespec.integrations.vllm import bench

    config = bench._harness_config([3], 40, 64, 8)
    batch, steps = bench._harness_steps(config, 3, 40, 64, 8, seed=0, lifetime=6)
    proposer = bench._attached_freespec_proposer(config, batch)
    seen, drafted = set(), 0
    for sampled in steps:
        assert sorted(batch.req_id_to_index.values()) == [0, 1, 2]
        assert all(batch.req_id_to_index[rid] == row for row, rid in enumerate(batch.req_ids))
        seen.update(batch.req_ids)
        drafted += sum(map(len, proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)))
        assert proposer.num_live_requests == 3 and proposer.stats()["errors"] == 0
    assert len(seen) >= 3 + 3 * (40 // 9)  # each row's requests live 3 to 9 steps: at least 4 ended in 40
    assert drafted > 0 and proposer.stats()["history_tokens"] > 0
    assert proposer.requests.num_starts == len(seen) and proposer.requests.num_restarts == 0
    rows = bench.propose_cost([2], steps=20, prompt_len=64, k=8, lifetime=5)
    assert {row["proposer"] for row in rows} >= {"vllm ngram", "freespec"} and all(
        row["us_per_request"] > 0 for row in rows)
