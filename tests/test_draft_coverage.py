"""scripts/draft_coverage.py: its statistics on hand-made steps, and a run on a tiny model."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from test_bench import _dataset, tiny_model  # noqa: F401  (a pytest fixture)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "draft_coverage.py"
spec = importlib.util.spec_from_file_location("draft_coverage", SCRIPT)
draft_coverage = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draft_coverage)


def test_matched_walks_candidates_only_where_told():
    ids, parents = np.array([5, 7, 6, 9]), np.array([-1, -1, 0, 2])
    assert draft_coverage.matched(ids, parents, [5, 6, 9, 1]) == 3
    assert draft_coverage.matched(ids, parents, [7, 6]) == 1
    assert draft_coverage.matched(ids, parents, [5, 6, 9], usable=np.array([True, True, True, False])) == 2
    assert draft_coverage.matched(ids, parents, [8]) == 0


def _step(request, context, pool, kept, fed):
    return {"request": request, "context": context, "pool": pool, "kept": kept, "fed": fed}


def test_coverage_counts_what_the_pool_and_the_kept_tree_hold():
    final = [1, 2, 3, 1, 2, 4, 5]  # the prompt is [1, 2, 3]; the request emitted [1, 2, 4, 5]
    pool = (np.array([1, 9, 2, 4]), np.array([-1, -1, 0, 2]), np.array([0.6, 0.3, 0.3, 0.1], np.float32),
            ["suffix", "recycle", "suffix", "suffix"])
    kept = (np.array([1]), np.array([-1]))
    fed = (np.array([1, 2, 4]), np.array([-1, 0, 1]), np.array([True, False, False]))  # a window under node 0
    missing = (np.array([8]), np.array([-1]), np.array([0.5], np.float32), ["recycle"])
    steps = [_step("a", 3, pool, kept, fed),
             _step("a", 6, missing, (np.zeros(0, np.int64), np.zeros(0, np.int64)),
                   (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)))]
    result = draft_coverage.coverage(steps, {"a": np.array(final)})
    assert result["steps"] == 2
    assert result["next_token"] == {"pool": 0.5, "kept": 0.5}
    assert result["matched"]["pool"] == 1.5  # 3 tokens at the first step, none at the second
    assert result["matched"]["kept"] == 0.5
    assert result["matched"]["fed"] == 0.5
    assert result["matched"]["fed_window_as_candidates"] == 1.5
    # judged: nodes whose parent lay on the emitted path; conditional probabilities 0.6, 0.5, 1/3 (suffix)
    assert result["by_source"]["suffix"] == {"judged": 3, "accepted": 3, "predicted": pytest.approx(1.4, abs=0.05)}
    assert result["by_source"]["recycle"] == {"judged": 2, "accepted": 0, "predicted": 0.8}
    # the second step's next token (5) follows (2, 4) nowhere earlier; 1 -> 2 was seen, 4 -> 5 was not
    assert result["ngram"] == {"pool_misses": 1, "in_ngram_top8": 0, "share": 0.0}


def test_ngram_counts_back_off_to_shorter_contexts():
    counts = draft_coverage.NgramCounts()
    counts.add([1, 2, 3, 1, 2, 4, 1, 2, 4], 0, 9)
    assert counts.top([7, 1, 2]) == [4, 3]  # (1, 2) -> 4 twice, 3 once; (7, 1, 2) unseen
    assert counts.top([9]) == []


def test_runs_the_bench_writes_coverage_and_unwraps(tmp_path, tiny_model):  # noqa: F811
    from freespec.drafters import base, calibration, mixture

    wrapped = (calibration.DraftSizer.select_nodes, mixture.MixtureDrafter._sized, base.Drafter.stop)
    out = tmp_path / "run"
    code = draft_coverage.main(["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--methods",
                                "freespec", "--max-new-tokens", "12", "--threads", "1", "--no-cost-probe",
                                "--simulate", "1:1,16:1.1", "--no-plots", "--no-progress", "--out", str(out)])
    assert code == 0
    result = json.loads((out / "coverage.json").read_text())
    assert result["steps"] > 0 and 0 <= result["next_token"]["kept"] <= result["next_token"]["pool"] <= 1
    assert result["matched"]["kept"] <= result["matched"]["pool"]
    assert (calibration.DraftSizer.select_nodes, mixture.MixtureDrafter._sized, base.Drafter.stop) == wrapped
