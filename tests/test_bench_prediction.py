"""freespec bench with predicted outputs: items that carry one, methods that pass it."""

import json
import re

import pytest

from freespec.bench.datasets import Item, load_dataset
from freespec.bench.methods import parse_method, parse_methods

from test_bench import CharTokenizer


class EncodingCharTokenizer(CharTokenizer):
    def encode(self, text, add_special_tokens=True):
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]


def test_code_edit_items_predict_the_code_shown():
    for item in load_dataset("builtin:code-edit"):
        shown = re.search(r"```python\n(.*?)```", item.turns[0], re.S).group(1)
        assert item.prediction_of(0) == shown and item.prediction_of(1) is None
    assert all(item.predictions is None for item in load_dataset("builtin:rag", limit=3))


def test_spec_bench_items_may_carry_predictions(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "a", "turns": ["one", "two"], "prediction": "first"},
            {"question_id": 2, "category": "a", "turns": ["three", "four"], "prediction": [None, "second"]},
            {"question_id": 3, "category": "b", "turns": ["five"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second, third = load_dataset(str(path))
    assert first == Item("1", "a", ("one", "two"), predictions=("first",))
    assert [second.prediction_of(t) for t in range(2)] == [None, "second"]
    assert third.predictions is None
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": ["x"], "prediction": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1.*prediction must be a string"):
        load_dataset(str(tmp_path / "bad.jsonl"))


def test_prediction_method_option():
    plain, predicted, alone = parse_methods("freespec,freespec{prediction=true},freespec:prediction{prediction=true}")
    assert not plain.use_prediction and predicted.use_prediction and alone.use_prediction
    assert predicted.label == "freespec{prediction=true}" and predicted.drafter_options == {}
    assert not parse_method("freespec{prediction=false}").use_prediction
    with pytest.raises(ValueError, match="needs a drafter that drafts from a prediction"):
        parse_method("freespec:suffix{prediction=true}")
    with pytest.raises(ValueError, match="prediction must be true or false"):
        parse_method("freespec{prediction=3}")


def test_bench_passes_the_prediction_to_the_methods_that_ask(tmp_path, monkeypatch, capsys):
    from freespec import models
    from freespec.cli import main
    from freespec.testing.models import tiny_random_llama

    model = tiny_random_llama(vocab_size=128)
    monkeypatch.setattr(models, "load", lambda name, dtype=None, **kw: (model, EncodingCharTokenizer()))
    path = tmp_path / "predicted.jsonl"
    rows = [{"question_id": 1, "category": "edit", "turns": ["abcd abcd"], "prediction": "abcd abcd abcd"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    code = main(["bench", "--model", "tiny", "--dataset", str(path), "--methods",
                 "vanilla,freespec,freespec:prediction{prediction=true}", "--max-new-tokens", "12", "--threads", "1",
                 "--no-progress", "--no-plots", "--no-warmup", "--out", str(out)])
    assert code == 0, capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["mismatches"] == []
    methods = results["prompts"][0]["methods"]
    assert "prediction" in methods["freespec:prediction{prediction=true}"]["engine"]["per_drafter"]
    assert "prediction" not in methods["freespec"]["engine"]["per_drafter"]
