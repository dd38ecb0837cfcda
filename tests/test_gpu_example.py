"""examples/gpu/compare.py runs (on the CPU, with --device cpu) and reports every method it was given."""

import importlib.util
import json
from pathlib import Path

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
    labels = script.DEFAULT_METHODS.split(",")
    assert list(results["summary"]["overall"]) == labels
    assert results["summary"]["overall"]["vanilla"]["tau"] == 1.0
    assert "Overall" in text and "freespec:recycle" in text
