"""examples/gpu/vllm034_compare.py without a GPU: what it changes in the serving benchmark for vLLM 0.34, the engines
it would start and how, and its propose() timer on a V2 runner's speculator. (No engine of vLLM 0.34 runs here.)"""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from freespec.integrations import serving_bench
from freespec.integrations.vllm import bench, version

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu" / "vllm034_compare.py"


@pytest.fixture
def compare(monkeypatch):
    """The script as a module, and the benchmark module's state restored after the test."""
    monkeypatch.setattr(bench, "METHODS", dict(bench.METHODS))
    monkeypatch.setattr(bench, "_propose_timer", bench._propose_timer)
    monkeypatch.delattr(bench, "_propose_timer_of_the_bench", raising=False)
    spec = importlib.util.spec_from_file_location("vllm034_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_on_034_freespec_is_its_method_and_the_timer_finds_the_speculator(compare, monkeypatch):
    monkeypatch.setattr(version, "installed_version", lambda: "0.34.0")
    compare.adapt(bench)
    compare.adapt(bench)  # twice: the benchmark's own timer is kept once
    assert bench.METHODS["freespec"] == {"method": "freespec"}
    assert bench.METHODS["suffix"] == {"method": "suffix"} and bench._propose_timer is compare.propose_timer

    calls = []

    class Speculator:  # the V2 runner's: propose takes tensors, no list of sampled ids
        def propose(self, input_batch, *args, **kwargs):
            calls.append(input_batch)
            time.sleep(0.001)
            return "drafts"

    worker = SimpleNamespace(model_runner=SimpleNamespace(speculator=Speculator()))
    assert bench._propose_timer(worker) == (0.0, 0, 0)  # installs the wrapper
    speculator = worker.model_runner.speculator
    assert speculator.propose("first") == "drafts"  # the engine's first call is not counted
    assert speculator.propose("second") == "drafts"
    seconds, num_calls, rows = bench._propose_timer(worker)
    assert num_calls == 1 and rows == 0 and seconds >= 0 and calls == ["first", "second"]


def test_on_033_the_benchmark_is_left_as_it_is(compare, monkeypatch):
    monkeypatch.setattr(version, "installed_version", lambda: "0.33.0")
    compare.adapt(bench)
    assert bench.METHODS["freespec"]["method"] == "custom_class" and bench._propose_timer is not compare.propose_timer


def test_the_engines_start_as_children_of_the_script(compare, monkeypatch, tmp_path):
    """Plain, ngram, suffix and freespec (suffix without arctic-inference), each started by the script's child,
    which finds the script on PYTHONPATH, as the engine's workers do to unpickle its timer."""
    monkeypatch.setattr(version, "installed_version", lambda: "0.34.0")
    seen = {}

    def benchmark(args, counts, configs, command, env_of, engine, plain):
        seen.update(configs=configs, command=command("/m", tmp_path / "p.json", "freespec", 8, tmp_path / "r.json"),
                    env=env_of("freespec"), engine=engine, plain=plain, counts=counts)
        return 0

    monkeypatch.setattr(serving_bench, "benchmark", benchmark)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no arctic-inference anywhere
    assert compare.main(["--methods", "vanilla,ngram,suffix,freespec", "--code-edit", "8", "--spec-bench", "16",
                         "--out", str(tmp_path)]) == 0
    assert [label for label, _, _ in seen["configs"]] == ["vanilla", "ngram", "suffix", "freespec"]
    command = seen["command"]
    assert command[1] == "-c" and "vllm034_compare.child" in command[2]
    assert command[3:5] == ["--run-method", "freespec"] and "--model-dir" in command
    assert str(SCRIPT.parent) in seen["env"]["PYTHONPATH"].split(":")
    assert seen["env"]["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert seen["counts"] == {"code-edit": 8, "spec-bench": 16} and seen["plain"] == "vanilla"


def test_a_child_runs_the_benchmarks_engine_after_adapting_it(compare, monkeypatch):
    monkeypatch.setattr(version, "installed_version", lambda: "0.34.0")
    monkeypatch.setattr(bench, "main", lambda argv: (bench.METHODS["freespec"]["method"], argv))
    assert compare.child(["--run-method", "freespec"]) == ("freespec", ["--run-method", "freespec"])


def test_the_shell_script_says_there_is_no_gpu():
    script = SCRIPT.parent / "vllm_compare.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "no CUDA device" in done.stderr
