"""examples/gpu/compare.py runs (on the CPU, with --device cpu) and reports every method it was given."""

import importlib.util
import json
from pathlib import Path

import pytest

from test_bench import _dataset, tiny_model  # noqa: F401  (a pytest fixture)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "gpu" / "compare.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("gpu_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_on_cpu_with_the_default_methods(tmp_path, tiny_model, capsys):  # noqa: F811
    script = _load_script()
    out = tmp_path / "gpu"
    code = script.main(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--dataset",
                        str(_dataset(tmp_path)), "--max-new-tokens", "10", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    results = json.loads((out / "results.json").read_text())
    assert results["mismatches"] == [] and results["environment"]["device"] == "cpu"
    labels = [label for label in script.DEFAULT_METHODS.split(",") if label not in results["unavailable"]]
    assert list(results["summary"]["overall"]) == labels and "freespec" in labels
    assert results["summary"]["overall"]["vanilla"]["tau"] == 1.0
    assert "Overall" in text and "freespec:recycle" in text


def test_a_bfloat16_difference_fails_only_with_require_identical(tmp_path, tiny_model, monkeypatch, capsys):  # noqa: F811
    """As in freespec bench: a greedy output that differs from plain decoding fails a float32 run (unless
    --allow-mismatch); in bfloat16, where a tree's shape changes rounding, it is reported and fails only with
    --require-identical. Both flags together are refused, naming them."""
    script = _load_script()
    compare = script.compare

    def with_a_difference(*args, **kwargs):
        results = compare(*args, **kwargs)
        results["mismatches"].append({"prompt_index": 0, "row": 0, "item_id": "1", "turn": 0, "method": "freespec",
                                       "reference": "vanilla", "first_difference": 2, "len": 6, "reference_len": 6})
        return results

    monkeypatch.setattr(script, "compare", with_a_difference)
    base = ["--model", "tiny", "--device", "cpu", "--dataset", str(_dataset(tmp_path)), "--methods",
            "vanilla,freespec", "--max-new-tokens", "6", "--no-cost-probe"]
    assert script.main(base + ["--dtype", "float32"]) == 1
    assert script.main(base + ["--dtype", "float32", "--allow-mismatch"]) == 0
    assert script.main(base + ["--dtype", "bfloat16"]) == 0
    assert script.main(base + ["--dtype", "bfloat16", "--require-identical"]) == 1
    with pytest.raises(SystemExit) as refused:
        script.main(base + ["--allow-mismatch", "--require-identical"])
    assert refused.value.code == 2
    assert "--allow-mismatch and --require-identical contradict" in capsys.readouterr().err


CHECK = SCRIPT.parent / "check.py"


def _load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_says_there_is_no_cuda_and_exits(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _load_check().main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_the_check_runs_its_path_on_the_cpu(tmp_path, tiny_model, capsys):  # noqa: F811
    """--cpu-dry-run: both workloads, every method, the round trips per step, one table."""
    check = _load_check()
    out = tmp_path / "check"
    code = check.main(["--cpu-dry-run", "--dtype", "float32", "--spec-bench", str(_dataset(tmp_path)),
                       "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    table = text[text.index("workload  "):]
    for workload in ("spec-bench", "code-edit"):
        results = json.loads((out / workload / "results.json").read_text())
        assert results["mismatches"] == [] and results["environment"]["command"].startswith(
            "python examples/gpu/check.py")
        for label in results["summary"]["overall"]:
            line = next(row for row in table.splitlines() if row.split()[:2] == [workload, label])
            assert line.split()[-1] != "-", line  # its syncs per step were counted
    vanilla = next(row for row in table.splitlines() if row.split()[:2] == ["spec-bench", "vanilla"]).split()
    assert vanilla[3] == "1.00" and vanilla[4] == "-"  # tau 1, no speedup over itself
    assert "freespec" in table and "syncs/step" in table
