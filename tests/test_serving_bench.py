"""The serving benchmark's shared runner (integrations/serving_bench.py) and SGLang's side of it, on fake engines,
a fake tokenizer and a fake server: no engine needed."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from types import SimpleNamespace

import pytest

from freespec.integrations import serving_bench
from freespec.integrations.sglang import bench_serving


class Tokenizer:
    """Characters as token ids; a chat is its messages' contents joined by "|" (user) and "#" (assistant)."""

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(("|" if m["role"] == "user" else "#") + m["content"] for m in messages)
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class Engine:
    """Answers each prompt with its last three ids reversed; counts a verify step per answer, one accepted and
    two drafted tokens; records each call's prompts (a list per call)."""

    def __init__(self):
        self.calls, self.totals = [], {"drafts": 0, "accepted_tokens": 0, "draft_tokens": 0}

    def generate(self, prompts, max_tokens):
        self.calls.append([list(p) for p in prompts])
        for name, grow in (("drafts", 1), ("accepted_tokens", 1), ("draft_tokens", 2)):
            self.totals[name] += grow * len(prompts)
        return [list(reversed(p[-3:]))[:max_tokens] for p in prompts]

    def counters(self):
        return dict(self.totals)


def test_single_turn_phases_go_in_chunks_of_the_concurrency_and_count_what_the_engine_counted():
    engine = Engine()
    workloads = {"code-edit": {"1": [["a", [1, 2, 3]], ["b", [4, 5, 6]]], "2": [["a", [7, 8, 9]], ["b", [1, 1, 2]],
                                                                               ["a", [3, 3, 3]]]}}
    result = serving_bench.run_phases(engine, workloads, {"code-edit": 8}, Tokenizer())
    assert [len(call) for call in engine.calls] == [1, 1, 2, 1]
    one, two = result["code-edit@1"], result["code-edit@2"]
    assert one["outputs"] == [[3, 2, 1], [6, 5, 4]] and one["categories"] == ["a", "b"] and one["tokens"] == 6
    assert len(one["request_seconds"]) == 2 and two["request_seconds"] is None
    assert (two["drafts"], two["accepted_tokens"], two["draft_tokens"]) == (3, 3, 6)  # this phase's alone
    assert two["mean_accepted_length"] == 2.0 and two["mean_draft_length"] == 2.0
    assert two["propose_rows"] == 0  # an engine that does not time its proposer


def test_repeat_sessions_resend_the_engines_own_answers_after_they_come_back():
    """A session's turn k+1 prompt holds the engine's answer to turn k as it produced it; at concurrency 2 two
    sessions go together, turn by turn; outputs and categories come session by session."""
    engine = Engine()
    sessions = [{"turns": ["ab", "cd", "ef"], "categories": ["turn1", "turn2", "turn3"]},
                {"turns": ["gh", "ij", "kl"], "categories": ["turn1", "turn2", "turn3"]}]
    result = serving_bench.run_phases(engine, {"repeat": {"2": sessions}}, {"repeat": 8}, Tokenizer())
    assert [len(call) for call in engine.calls] == [2, 2, 2]  # three turns, both sessions each time
    tokenizer = Tokenizer()
    first_answer = engine.generate([engine.calls[0][0]], 8)[0]
    assert tokenizer.decode(engine.calls[1][0]) == "|ab#" + tokenizer.decode(first_answer) + "|cd"
    assert tokenizer.decode(engine.calls[2][1]).startswith("|gh#")
    phase = result["repeat@2"]
    assert len(phase["outputs"]) == 6 and phase["categories"] == ["turn1", "turn2", "turn3"] * 2
    assert phase["outputs"][1] == list(reversed(engine.calls[1][0][-3:]))  # session 1's turn 2
    one = serving_bench.run_phases(Engine(), {"repeat": {"1": sessions}}, {"repeat": 8}, Tokenizer())["repeat@1"]
    assert len(one["request_seconds"]) == 6 and one["outputs"] == phase["outputs"]  # one at a time, same answers


def test_configurations_run_methods_without_k_once():
    takes_k = {"plain": False, "ngram-default": False, "ngram": True, "freespec": True}.get
    assert serving_bench.configurations(["plain", "ngram-default", "ngram", "freespec"], [8, 16], takes_k) == [
        ("plain", "plain", None), ("ngram-default", "ngram-default", None), ("ngram-k8", "ngram", 8),
        ("freespec-k8", "freespec", 8), ("ngram-k16", "ngram", 16), ("freespec-k16", "freespec", 16)]
    assert serving_bench.configurations(["plain", "ngram"], [8], takes_k) == [("plain", "plain", None),
                                                                            ("ngram", "ngram", 8)]


def test_engines_run_in_abba_order_each_in_its_own_environment(tmp_path):
    import sys

    def command(method, k, path):
        return [sys.executable, "-c", f"import json, os; open({str(path)!r}, 'w').write(json.dumps("
                f"{{'method': {method!r}, 'k': {k!r}, 'env': os.environ.get('WHO')}}))"]

    configs = [("plain", "plain", None), ("ngram", "ngram", 8)]
    runs = serving_bench.run_engines(configs, "abba", tmp_path, command, lambda m: {**os.environ, "WHO": m}, "test")
    assert runs == {"plain": [{"method": "plain", "k": None, "env": "plain"}] * 2,
                    "ngram": [{"method": "ngram", "k": 8, "env": "ngram"}] * 2}
    assert sorted(p.name for p in tmp_path.glob("run*.json")) == ["run0-plain.json", "run1-ngram.json",
                                                                  "run2-ngram.json", "run3-plain.json"]


def test_summary_names_the_engine_and_its_plain_method(tmp_path):
    def run(seconds, outputs):
        return {"spec-bench@1": {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs,
                                 "categories": ["qa", "math"], "request_seconds": [seconds / 2] * 2,
                                 "mean_accepted_length": 1.5, "mean_draft_length": 15.0}}

    same = [[1, 2], [3, 4]]
    runs = {"plain": [run(4.0, same)] * 2, "ngram-default": [run(2.0, same)] * 2, "freespec": [run(1.0, same)] * 2}
    configs = [("plain", "plain", None), ("ngram-default", "ngram-default", None), ("freespec", "freespec", 16)]
    table = serving_bench.summarize(runs, configs, 16, tmp_path, plain="plain", engine="SGLang")
    assert "x plain SGLang" in table and "| spec-bench | 1 | ngram-default | - | 2.0 | 2.00x | 1.50 |" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert [row["method"] for row in results["best_k"]] == ["freespec"]  # ngram-default takes no K
    serving_bench.plot(results["rows"], tmp_path / "speedups.png", "SGLang")
    assert (tmp_path / "speedups.png").stat().st_size > 1000


def test_repeat_prompts_are_sessions_disjoint_between_phases(tmp_path):
    from freespec import models

    model_dir = str(models.local_dir("smollm2-135m"))
    workloads = serving_bench.build_prompts(model_dir, {"repeat": 2}, 3, "unused", repeat_turns=3)
    phases = workloads["repeat"]
    assert [len(phases[c]) for c in (1, 3)] == [2, 3]
    firsts = [session["turns"][0] for c in (1, 3) for session in phases[c]]
    assert len(set(firsts)) == 5 and all(len(s["turns"]) == 3 and s["categories"] == ["turn1", "turn2", "turn3"]
                                         for c in (1, 3) for s in phases[c])
    with pytest.raises(ValueError, match="repeat_turns"):
        serving_bench.build_prompts(model_dir, {"repeat": 1}, 1, "unused", repeat_turns=1)
    with pytest.raises(ValueError, match="unknown workloads"):
        serving_bench.build_prompts(model_dir, {"chat": 1}, 1, "unused")


class Client:
    """An OpenAI client's ``completions.create``: every answer finishes with "length"; a stream yields chunks
    and records its close. Thread-safe counters."""

    def __init__(self, fail_every=0):
        self.lock, self.created, self.closed, self.fail_every = threading.Lock(), [], 0, fail_every
        self.completions = self

    def create(self, model, prompt, max_tokens, stream=False, extra_body=None):
        with self.lock:
            self.created.append((prompt, stream, extra_body))
            n = len(self.created)
        if self.fail_every and n % self.fail_every == 0:
            raise ConnectionError("dropped")
        if not stream:
            return SimpleNamespace(choices=[SimpleNamespace(finish_reason="length")])
        client = self

        class Stream:
            def __iter__(self):
                return iter(range(5))

            def close(self):
                with client.lock:
                    client.closed += 1

        return Stream()


def test_soak_reports_every_requests_fate_memory_and_the_plugins_counters():
    client = Client()
    stats = iter(range(100))

    @contextlib.contextmanager
    def served():
        yield client, SimpleNamespace(pid=os.getpid())

    result = serving_bench.soak(served(), 95, 4, ["p0", "p1", "p2"], plugin_stats=lambda: {"n": next(stats)},
                                idle_stats=lambda: {"live_requests": 0},
                                hints=lambda prompt: {"prediction": prompt}, abort_every=10, checkpoints=4)
    assert (result["answered"], result["aborted"], result["failed"]) == (85, 10, 0)
    assert client.closed == 10 and len(client.created) == 96  # the warm-up request too
    assert sum(1 for _, _, extra in client.created if extra) == 47  # every odd request (none is aborted)
    assert [point[0] for point in result["rss_mb_after"]] == [23, 46, 69, 92]
    assert all(point[1] > 0 and point[2] and "n" in point[3] for point in result["rss_mb_after"])
    assert result["before"]["plugin"] == result["after"]["plugin"] == {"live_requests": 0}
    assert result["before"]["rss_mb"] > 0 and result["after"]["rss_mb_by_process"]
    client = Client(fail_every=5)  # the 5th, 10th, ... call fails (the warm-up is the first)
    failing = serving_bench.soak(served(), 20, 2, ["p"], plugin_stats=dict, idle_stats=dict, abort_every=1000,
                                 checkpoints=1)
    # request 0 is a stream closed early
    assert (failing["answered"], failing["aborted"], failing["failed"]) == (15, 1, 4)
    with pytest.raises(ValueError, match="num_requests"):
        serving_bench.soak(served(), 0, 1, ["p"], plugin_stats=dict, idle_stats=dict)


# ---------------------------------------------------------------------------------------------- SGLang's side
def test_sglang_environment_sets_the_plugin_for_freespec_alone_and_the_cpu_stand_ins():
    outside = {"FREESPEC_SGLANG_DRAFTER": "suffix", "FREESPEC_SGLANG": "1", "PYTHONPATH": "/x", "HOME": "/h"}
    ngram = bench_serving.device_environment("cpu", "ngram", "mixture", None, outside)
    assert "FREESPEC_SGLANG_DRAFTER" not in ngram and "FREESPEC_SGLANG" not in ngram  # SGLang's own corpus
    assert ngram["SGLANG_USE_CPU_ENGINE"] == ngram["FREESPEC_TEST_SGLANG_CPU"] == "1"
    stubs, rest = ngram["PYTHONPATH"].split(os.pathsep)
    assert stubs.endswith(os.path.join("tests", "sglang_stubs")) and os.path.isdir(stubs) and rest == "/x"
    ours = bench_serving.device_environment("cuda", "freespec", "mixture", None, outside)
    assert ours["FREESPEC_SGLANG_DRAFTER"] == "mixture" and "SGLANG_USE_CPU_ENGINE" not in ours
    assert ours["PYTHONPATH"] == "/x"  # on a GPU SGLang's own kernels run


def test_sglang_engine_settings_and_server_flags():
    plain = bench_serving.engine_settings("cpu", "float32", "plain", None, 8192)
    assert "speculative_algorithm" not in plain and plain["attention_backend"] == "torch_native"
    default = bench_serving.engine_settings("cpu", "float32", "ngram-default", None, 8192)
    assert default["speculative_algorithm"] == "NGRAM" and "speculative_num_draft_tokens" not in default
    gpu = bench_serving.engine_settings("cuda", "float16", "freespec", 16, 8192)
    assert gpu["speculative_num_draft_tokens"] == 16 and "attention_backend" not in gpu
    command = bench_serving.server_command("/m", 1234, gpu, "mixture")
    assert command[1:3] == ["-m", "sglang.launch_server"] and "--skip-server-warmup" in command
    at = command.index("--speculative-num-draft-tokens")
    assert command[at + 1] == "16" and command[-2:] == ["--freespec-drafter", "mixture"]
    assert command[command.index("--host") + 1] == "127.0.0.1"


def test_sglang_engine_counts_from_each_requests_meta_info():
    class Fake:
        def generate(self, input_ids, sampling_params):
            assert sampling_params == {"temperature": 0.0, "max_new_tokens": 4}
            return [{"output_ids": [9, 9], "meta_info": {"spec_verify_ct": 2, "spec_num_correct_drafts": 3,
                                                         "spec_num_proposed_drafts": 30}},
                    {"output_ids": [8], "meta_info": {}}]  # plain SGLang: no spec counters

    engine = bench_serving._SglangEngine(Fake())
    assert engine.generate([[1], [2]], 4) == [[9, 9], [8]]
    assert engine.counters() == {"drafts": 2, "accepted_tokens": 3, "draft_tokens": 30}


def test_sglang_serving_bench_refuses_bad_options_before_any_engine(tmp_path, capsys):
    for argv, message in ((["--methods", "ngram,freespec"], "--methods must include plain"),
                          (["--workloads", "chat"], "--workloads: expected some of"),
                          (["--k", "8,x"], "--k: expected positive integers")):
        with pytest.raises(SystemExit):
            bench_serving.main([*argv, "--out", str(tmp_path / "unused")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


def test_plugin_stats_are_read_once_the_plugin_is_idle(tmp_path):
    path = tmp_path / "stats.json"
    assert serving_bench.read_plugin_stats(path) is None and serving_bench.idle_plugin_stats(path, 0.0) is None
    path.write_text(json.dumps({"live_requests": 2}))
    assert serving_bench.idle_plugin_stats(path, 0.0) == {"live_requests": 2}  # as they are at the timeout

    def settle():
        path.write_text(json.dumps({"live_requests": 0}))

    timer = threading.Timer(0.3, settle)
    timer.start()
    assert serving_bench.idle_plugin_stats(path, 30.0) == {"live_requests": 0}
    timer.join()
