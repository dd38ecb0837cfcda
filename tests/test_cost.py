"""freespec.bench.cost: the cost curve c(k), read from pairs or a results.json, applied, and measured."""

from __future__ import annotations

import json

import pytest

from freespec.bench.cost import DEFAULT_ONE_TOKEN_MS, CostCurve, measure_cost_curve


def test_parse_and_interpolate_the_docstring_example():
    curve = CostCurve.parse("1:1,2:1.2,4:1.6", one_token_ms=10)
    assert curve.sizes == (1, 2, 4) and curve.ratios == (1.0, 1.2, 1.6)
    assert curve.cost(1) == 1.0 and curve.cost(2) == pytest.approx(1.2)
    assert curve.cost(3) == pytest.approx(1.4)  # linear between points
    assert curve.cost(6) == pytest.approx(2.0)  # along the last segment (0.2 per token) past the last point
    assert curve.forward_ms(6) == pytest.approx(20.0)
    assert CostCurve.parse("1:1").one_token_ms == DEFAULT_ONE_TOKEN_MS


def test_parse_normalizes_sorts_and_never_extrapolates_downwards():
    curve = CostCurve.parse(" 4:46 , 1:20,2:23 ")
    assert curve.sizes == (1, 2, 4) and curve.ratios == pytest.approx((1.0, 1.15, 2.3))
    assert CostCurve.parse("1:1").cost(500) == 1.0  # a single point is flat
    falling = CostCurve.parse("1:1,2:3,4:2")
    assert falling.cost(3) == pytest.approx(2.5) and falling.cost(64) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="num_tokens"):
        falling.cost(0)


@pytest.mark.parametrize("text,message", [
    ("", "is not k:c"),
    ("1:1,x:2", "'x:2' is not k:c"),
    ("1:1,2", "'2' is not k:c"),
    ("1:1,0:1", "'0:1' is not k:c"),
    ("1:1,2:-1", "'2:-1' is not k:c"),
    ("1:1,2:nan", "'2:nan' is not k:c"),
    ("1:1,2.5:3", "'2.5:3' is not k:c"),
    ("1:1,1:2", "k=1 is given twice"),
    ("2:1.2,4:1.5", "needs k=1"),
])
def test_bad_pairs_name_the_argument(text, message):
    with pytest.raises(ValueError, match="^--cost-curve: .*" + message):
        CostCurve.parse(text, "--cost-curve")


def _probe_like(ms=(20.0, 24.0, 30.0), prefill_ms=400.0):
    return {"sizes": [1, 2, 4][:len(ms)], "ms": list(ms), "ratios": [m / ms[0] for m in ms],
            "prefill": {"tokens": 64, "ms": prefill_ms}, "prefix_tokens": 64, "repeats": 3, "threads": 2,
            "dtype": "float32", "device": "cpu"}


def test_from_results_takes_the_measured_curve_and_prefill(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {"model": "m", "dtype": "float32"}, "cost_curve": _probe_like()}))
    curve = CostCurve.load(str(path), "--cost-curve")
    assert curve.sizes == (1, 2, 4, 64) and curve.ratios == pytest.approx((1.0, 1.2, 1.5, 20.0))
    assert curve.one_token_ms == 20.0 and str(path) in curve.source and "m, float32, 2 threads" in curve.source
    assert curve.cost(34) == pytest.approx(1.5 + 18.5 * 30 / 60)  # between c(4) and the prefill point
    assert CostCurve.load(str(path), one_token_ms=5.0).one_token_ms == 5.0


def test_from_results_errors_name_the_argument(tmp_path):
    no_curve = tmp_path / "old.json"
    no_curve.write_text(json.dumps({"config": {}, "cost_curve": None}))
    with pytest.raises(ValueError, match="^--cost-curve: .*holds no measured cost curve.*--no-cost-probe"):
        CostCurve.load(str(no_curve), "--cost-curve")
    with pytest.raises(ValueError, match="^--cost-curve: cannot read .*missing.json"):
        CostCurve.load(str(tmp_path / "missing.json"), "--cost-curve")
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"cost_curve": {"sizes": [2, 4], "ms": [1.0, 2.0]}}))
    with pytest.raises(ValueError, match="^--cost-curve: the cost curve in .* is malformed"):
        CostCurve.load(str(broken), "--cost-curve")
    with pytest.raises(ValueError, match="one_token_ms"):
        CostCurve.parse("1:1", one_token_ms=0.0)


def test_probe_on_tiny_models_has_the_documented_shape(tiny_llama, tiny_gemma3):
    for model in (tiny_llama, tiny_gemma3):  # gemma3: sliding-window layers (window 8 < the prefix)
        probe = measure_cost_curve(model, sizes=(1, 2, 4, 8), prefix_tokens=24, repeats=2, prefill_repeats=1)
        assert probe["sizes"] == [1, 2, 4, 8] and len(probe["ms"]) == 4 and len(probe["ratios"]) == 4
        assert probe["ratios"][0] == 1.0 and all(ms > 0 for ms in probe["ms"])
        assert {k: len(v) for k, v in probe["samples_ms"].items()} == {"1": 2, "2": 2, "4": 2, "8": 2}
        assert probe["prefill"]["tokens"] == 24 and probe["prefill"]["ms"] > 0
        assert probe["prefix_tokens"] == 24 and probe["repeats"] == 2 and probe["dtype"] == "float64"
        assert probe["device"] == "cpu" and probe["threads"] >= 1 and probe["seconds"] > 0
        curve = CostCurve.from_points(dict(zip(probe["sizes"], probe["ms"])))
        assert curve.ratios == pytest.approx(tuple(probe["ratios"]))
    with pytest.raises(ValueError, match="sizes"):
        measure_cost_curve(tiny_llama, sizes=(2, 4))
    with pytest.raises(ValueError, match="repeats"):
        measure_cost_curve(tiny_llama, repeats=0)


def test_batch_probe_feeds_k_tokens_to_every_row_over_the_prefix(tiny_llama):
    shapes = []
    handle = tiny_llama.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)
    try:
        probe = measure_cost_curve(tiny_llama, sizes=(1, 2, 4), prefix_tokens=16, repeats=2, prefill_repeats=1,
                                   batch_size=3)
    finally:
        handle.remove()
    assert probe["batch_size"] == 3 and probe["one_row_ms"] > 0 and len(probe["ms"]) == 3
    timed = [s for s in shapes if s[1] in (1, 2, 4)]  # after the prefills of 16 tokens
    assert {s for s in timed if s[0] == 3} == {(3, 1), (3, 2), (3, 4)} and {s for s in timed if s[0] == 1} == {(1, 1)}
    assert len([s for s in timed if s[0] == 3]) == 3 * 3  # 3 sizes x (1 untimed + 2 timed rounds)


def test_replay_refuses_a_curve_measured_on_batches(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": {}, "cost_curve": dict(_probe_like(), batch_size=4)}))
    with pytest.raises(ValueError, match="batch size 4.*--batch-size 1"):
        CostCurve.load(str(path), "--cost-curve")
