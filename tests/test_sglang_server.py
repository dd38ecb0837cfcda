"""freespec inside ``python -m sglang.launch_server`` on 127.0.0.1, on this CPU: HTTP, OpenAI client, aborts,
``/flush_cache``, external corpora, per-request hints, live requests, and launch errors.

One server for the module (NGRAM, D=16, freespec's mixture with a document index
through ``--freespec-config``, an external corpus file at launch), always stopped.
Which parts are SGLang's and which ours: ``tests/sglang_engine.py``. Runs in the
SGLang environment (``bash scripts/test_env.sh sglang``); skips elsewhere.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import time

import pytest

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

import sglang_engine  # noqa: E402

if sglang_engine.MISSING:
    pytest.skip(sglang_engine.MISSING, allow_module_level=True)

from sglang_engine import ServerProcess, engine_env, model_dir, server_command, wait_for, live_requests  # noqa: E402

from freespec.integrations.host_serving import read_stats  # noqa: E402

NUM_DRAFT = 16
CORPUS_PROMPT = "A short story about a lighthouse keeper:\n"


@pytest.fixture(scope="module")
def tokenizer():
    return sglang_engine.tokenizer()


@pytest.fixture(scope="module")
def hf_model():
    from freespec import models

    return models.load("smollm2-135m")[0]


def _greedy(model, prompt_ids, max_new_tokens):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0, len(prompt_ids):].tolist()
    eos = model.generation_config.eos_token_id
    return ids[:-1] if ids and ids[-1] in (eos if isinstance(eos, list) else [eos]) else ids


@pytest.fixture(scope="module")
def stats_path(tmp_path_factory):
    return tmp_path_factory.mktemp("stats") / "freespec.json"


@pytest.fixture(scope="module")
def corpus_case(tokenizer, hf_model):
    """A prompt and the model's greedy output for it, whose text becomes the launch corpus's one document."""
    prompt = tokenizer(CORPUS_PROMPT)["input_ids"]
    expected = _greedy(hf_model, prompt, 40)
    return prompt, expected, tokenizer.decode(expected)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, stats_path, corpus_case):
    work = tmp_path_factory.mktemp("server")
    config = work / "freespec.json"
    config.write_text(json.dumps({"drafter": "mixture",
                                  "drafter_options": {"mixture": {"documents": {"min_match": 2, "max_match": 8}}}}))
    corpus = work / "corpus.jsonl"
    corpus.write_text(json.dumps(corpus_case[2]) + "\n")
    args = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(NUM_DRAFT),
            "--max-total-tokens", "8192", "--context-length", "2048", "--freespec-config", str(config),
            "--speculative-ngram-external-corpus-path", str(corpus),
            "--speculative-ngram-external-sam-budget", "4"]  # SGLang requires one; its trie knob, not ours
    srv = ServerProcess(model_dir(), args, {"FREESPEC_SGLANG_STATS": str(stats_path)}, log_path=work / "server.log")
    request.addfinalizer(srv.close)
    return srv


def _generate(server, input_ids, max_new_tokens=32, **params):
    status, body = server.post("/generate", {"input_ids": input_ids, "sampling_params": dict(
        temperature=0, max_new_tokens=max_new_tokens, **params)})
    return status, body


def test_http_generate_identical_to_generate(server, tokenizer, hf_model):
    prompt = tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    status, body = _generate(server, prompt, 48)
    assert status == 200, body
    assert body["output_ids"] == _greedy(hf_model, prompt, 48)
    assert "freespec: serving drafts" in server.log_tail(10**7)


def test_openai_client_chat(server, tokenizer):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Write the word 'banana' three times."}]
    reply = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=24)
    text = reply.choices[0].message.content
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    status, body = _generate(server, tokenizer(templated, add_special_tokens=False)["input_ids"], 24)
    assert status == 200 and text == body["text"]
    # hints travel in SGLang's custom_params, from the OpenAI client too
    hinted = client.chat.completions.create(model="default", messages=messages, temperature=0, max_tokens=24,
                                            extra_body={"custom_params": {"prediction": text}})
    assert hinted.choices[0].message.content == text


def _stream_and_drop(server, prompt_ids, chunks: int = 2) -> None:
    """A streamed /generate whose client goes away after ``chunks`` chunks (SGLang aborts the request)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", "/generate", json.dumps({"input_ids": prompt_ids, "stream": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    seen = 0
    while seen < chunks:
        line = response.readline()
        if not line:
            break
        seen += line.startswith(b"data:")
    conn.close()


def test_aborted_streams_release_their_requests(server, tokenizer, stats_path):
    prompts = [tokenizer(f"Count from {i} to one thousand: {i}, {i + 1},")["input_ids"] for i in range(3)]
    for prompt in prompts:
        _stream_and_drop(server, prompt)
    assert wait_for(lambda: live_requests(stats_path) == 0, 60), f"live requests stayed at {live_requests(stats_path)}"
    status, body = _generate(server, prompts[0], 8)
    assert status == 200 and len(body["output_ids"]) == 8


def test_abort_request_endpoint(server, tokenizer, stats_path):
    import threading

    prompt = tokenizer("Recite the alphabet slowly:")["input_ids"]
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=server.post("/generate", {
        "input_ids": prompt, "rid": "to-abort", "sampling_params": {"temperature": 0, "max_new_tokens": 400,
                                                                    "ignore_eos": True}})))
    worker.start()
    time.sleep(3)
    server.post("/abort_request", {"rid": "to-abort"})
    worker.join(120)
    status, body = result["out"]
    assert body.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort" or status != 200, body
    assert wait_for(lambda: live_requests(stats_path) == 0, 60)


def test_external_corpus_served_by_freespec(server, corpus_case):
    import urllib.request

    with urllib.request.urlopen(server.url + "/list_external_corpora", timeout=30) as response:
        corpora = json.loads(response.read())["corpus_token_counts"]
    assert any(count > 0 for count in corpora.values()), corpora
    status, body = server.post("/add_external_corpus", {"corpus_id": "extra", "documents": ["alpha beta gamma"]})
    assert status == 200 and body["success"] and body["loaded_token_count"] > 0, body
    status, body = server.post("/remove_external_corpus", {"corpus_id": "extra"})
    assert status == 200 and body["success"], body
    # the launch corpus holds this prompt's output (no request produced it yet): freespec drafts it from there
    prompt, expected, _ = corpus_case
    status, body = _generate(server, prompt, len(expected))
    assert status == 200 and body["output_ids"] == expected
    assert body["meta_info"]["spec_verify_ct"] <= len(expected) // 3, body["meta_info"]


def test_prediction_over_http(server, tokenizer, hf_model):
    prompt = tokenizer("Here is a list of fruits:")["input_ids"]
    expected = _greedy(hf_model, prompt, 45)
    status, body = _generate(server, prompt, 45, custom_params={"prediction": expected})
    assert status == 200 and body["output_ids"] == expected
    assert body["meta_info"]["spec_verify_ct"] <= -(-len(expected) // (NUM_DRAFT - 1)) + 2, body["meta_info"]
    status, body = _generate(server, prompt, 8, custom_params={"prediction": {"not": "ids"}})
    assert status == 400 and "custom_params['prediction']" in json.dumps(body), (status, body)
    status, body = _generate(server, prompt, 8)
    assert status == 200 and body["output_ids"] == expected[:8]


def test_flush_cache_forgets_and_serves_on(server, tokenizer, stats_path):
    prompt = tokenizer("The three primary colors are")["input_ids"]
    status, first = _generate(server, prompt, 16)
    assert wait_for(lambda: live_requests(stats_path) == 0, 60)
    assert (read_stats(str(stats_path)) or {}).get("history_tokens", 0) > 0
    import urllib.request

    with urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", method="POST"), timeout=60) as r:
        assert r.status == 200
    assert wait_for(lambda: (read_stats(str(stats_path)) or {}).get("history_tokens") == 0, 30)
    status, again = _generate(server, prompt, 16)
    assert status == 200 and again["output_ids"] == first["output_ids"]


@pytest.mark.parametrize("args, expected", [
    (["--freespec-drafter", "no_such_drafter"], "drafter 'no_such_drafter' is unknown"),
    (["--freespec-config", "{config}"], "has no option 'no_such_option'"),
    (["--freespec-config", "{isolated}"], "'isolated' must be true or false"),
])
def test_launch_errors_name_what_is_wrong(tmp_path, args, expected):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"drafter_options": {"mixture": {"no_such_option": 1}}}))
    isolated = tmp_path / "isolated.json"
    isolated.write_text(json.dumps({"isolated": "yes"}))
    args = [a.format(config=config, isolated=isolated) for a in args]
    cmd = server_command(model_dir(), 1, "--speculative-algorithm", "NGRAM", *args)
    proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
