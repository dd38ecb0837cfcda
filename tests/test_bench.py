"""freespec bench: datasets, method specs, reports, the arctic wrapper, and a run end to end on a tiny model."""

from __future__ import annotations

import ast
import dataclasses
import json
import re

import numpy as np
import pytest

from freespec.bench import datasets
from freespec.bench.datasets import Item, format_prompt, load_dataset, round_robin
from freespec.bench.methods import parse_drafters, parse_method, parse_methods, split_methods
from freespec.bench.peers import ArcticSuffixDrafter, arctic_available, arctic_to_draft
from freespec.bench.report import console_report, markdown_report, summarize, width_shares, write_results
from freespec.draft import Budget
from freespec.drafters import make


class CharTokenizer:
    """One token per character of newline + printable ASCII (ids 2..97, others read as '?'), bos 0, eos 1."""

    eos_token_id = 1
    pad_token_id = 1
    chars = "\n" + "".join(chr(c) for c in range(32, 127))

    def __init__(self, chat_template=None):
        self.chat_template = chat_template

    def __call__(self, text, add_special_tokens=True):
        ids = [2 + self.chars.index(c if c in self.chars else "?") for c in text]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.chars[i - 2] if 2 <= i < 2 + len(self.chars) else "?" for i in ids if i > 1)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


# ------------------------------------------------------------------------------ datasets
@pytest.mark.parametrize("name", datasets.BUILTIN)
def test_builtin_datasets_are_deterministic_and_well_formed(name):
    first, second = load_dataset(f"builtin:{name}"), load_dataset(f"builtin:{name}")
    assert first == second and len(first) >= 8
    assert len({item.item_id for item in first}) == len(first)
    for item in first:
        assert item.turns and all(isinstance(t, str) and len(t) > 50 for t in item.turns)
        assert item.category
    categories = {item.category for item in first}
    if name == "code-edit":
        assert categories == set(datasets.EDIT_KINDS)
        for item in first:
            code = re.search(r"```python\n(.*?)```", item.turns[0], re.S).group(1)
            ast.parse(code)  # the code shown is valid Python (a fix-bug item's bug is semantic)
            assert 10 <= len(code.splitlines()) <= 60
    elif name == "rag":
        assert categories == set(datasets.RAG_KINDS)
        for item in first:
            assert 2 <= item.turns[0].count("Document [") <= 4 and "Question:" in item.turns[0]
    else:
        for item in first:
            assert len(item.turns) == 4
            assert [item.category_of(t) for t in range(4)] == ["turn1", "turn2", "turn3", "turn4"]
            assert "```python" in item.turns[0] and "as you last wrote it" in item.turns[1]


def test_fix_bug_items_show_a_flipped_operator():
    items = [i for i in load_dataset("builtin:code-edit") if i.category == "fix-bug"]
    src = {f"{s.module}.{s.qualname}": s.source for s in datasets.code_sources()}
    for item in items:
        shown = re.search(r"```python\n(.*?)```", item.turns[0], re.S).group(1)
        original = src[item.item_id.split("-", 3)[3]]
        diff = [(a, b) for a, b in zip(shown.splitlines(), original.splitlines()) if a != b]
        assert len(diff) == 1 and f"`{diff[0][0].strip()}`" in item.turns[0]


def test_spec_bench_file(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "a", "turns": ["one", "two"]},
            {"question_id": 2, "category": "a", "turns": ["three"]},
            {"question_id": 3, "category": "b", "turns": ["four"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_dataset(str(path))
    assert items[0] == Item("1", "a", ("one", "two"))
    assert [i.item_id for i in load_dataset(str(path), limit=2)] == ["1", "3"]  # round-robin over categories
    assert [i.item_id for i in load_dataset(str(path), categories=["b"])] == ["3"]
    with pytest.raises(ValueError, match="unknown category"):
        load_dataset(str(path), categories=["zzz"])
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "turns": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_dataset(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown built-in"):
        load_dataset("builtin:nope")


def test_one_jsonl_reader_names_file_and_line(tmp_path):
    from freespec.bench.jsonl import read_jsonl, write_jsonl

    path = write_jsonl([{"a": 1}, {"a": 2}], tmp_path / "r.jsonl")
    path.write_text(path.read_text() + "\n  \n")  # blank lines are skipped
    assert read_jsonl(path, lambda r: r["a"], "record") == [1, 2]
    path.write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(ValueError, match=r"r.jsonl:3: not a record \("):
        read_jsonl(path, lambda r: r["a"], "record")
    with pytest.raises(ValueError, match=r"r.jsonl:1: not a record \('b'\)"):
        read_jsonl(path, lambda r: r["b"], "record")
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        read_jsonl(path, dict, "record")
    with pytest.raises(ValueError, match="does not exist, try X"):
        read_jsonl(tmp_path / "missing.jsonl", dict, "record", missing_hint=", try X")


def test_spec_bench_layout_limit_covers_every_category(tmp_path):
    """Spec-Bench's layout: 8 MT-bench categories of 5 two-turn items, then 5 of 40 one-turn items, in blocks."""
    two_turn = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    one_turn = ["translation", "summarization", "qa", "math_reasoning", "rag"]
    rows, qid = [], 80
    for category in two_turn + one_turn:
        for _ in range(5 if category in two_turn else 40):
            qid += 1
            turns = [f"question {qid}", "follow-up"] if category in two_turn else [f"question {qid}"]
            rows.append({"question_id": qid, "category": category, "turns": turns})
    path = tmp_path / "spec_bench.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_dataset(str(path), limit=13)
    assert [i.category for i in items] == two_turn + one_turn
    assert sum(len(i.turns) for i in items) == 21
    assert len(load_dataset(str(path))) == 240


def test_round_robin_order():
    items = [Item(str(k), c, ("x",)) for k, c in enumerate("aaabbc")]
    assert [i.category for i in round_robin(items, 4)] == ["a", "b", "c", "a"]
    assert len(round_robin(items, 100)) == 6


def test_format_prompt_with_and_without_chat_template():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    plain = CharTokenizer()
    assert plain.decode(format_prompt(plain, messages)) == "User: hi\nAssistant: yo\nUser: again\nAssistant:"
    chat = CharTokenizer(chat_template="{{ messages }}")
    ids = format_prompt(chat, messages)
    assert ids[0] != 0 and chat.decode(ids).endswith("<assistant>")


# ------------------------------------------------------------------------------ methods
def test_method_specs():
    methods = parse_methods("vanilla, hf-pld, hf-pld:5{max_matching_ngram_size=3}, freespec, "
                            "freespec:prompt_lookup{min_match=3,max_draft_tokens=32,adaptive_budget=false}, "
                            "arctic-suffix{max_spec_factor=2.5,max_draft_depth=8}")
    assert [m.kind for m in methods] == ["vanilla", "hf-pld", "hf-pld", "freespec", "freespec", "arctic-suffix"]
    assert methods[1].hf_num_tokens == 10 and methods[2].hf_num_tokens == 5
    assert methods[2].hf_options == {"max_matching_ngram_size": 3}
    assert methods[3].drafter is None
    m = methods[4]
    assert m.label == "freespec:prompt_lookup{min_match=3,max_draft_tokens=32,adaptive_budget=false}"
    assert m.drafter_options == {"min_match": 3}
    assert m.spec_options == {"max_draft_tokens": 32, "adaptive_budget": False}
    assert methods[5].drafter_options == {"max_spec_factor": 2.5} and methods[5].spec_options == {"max_draft_depth": 8}
    assert split_methods("a,b{x=1,y=2},c") == ["a", "b{x=1,y=2}", "c"]


@pytest.mark.parametrize("text,message", [
    ("nope", "unknown method"),
    ("vanilla:3", "takes no argument"),
    ("hf-pld:x", "positive integer"),
    ("hf-pld:0", "positive integer"),
    ("freespec:no_such_drafter", "unknown drafter"),
    ("freespec{min_match=3}", "need a drafter name"),
    ("freespec:prompt_lookup{max_draft_tokens=-1}", "bad engine option"),
    ("freespec:prompt_lookup{min_match}", "key=value"),
    ("freespec:prompt_lookup{min_match=1,min_match=2}", "given twice"),
    ("freespec:prompt_lookup{min_match=1", "unbalanced"),
    ("vanilla,,hf-pld", "empty method"),
    ("vanilla,vanilla", "listed twice"),
    ("arctic-suffix{bogus=1}", "unknown arctic-suffix option"),
    ("arctic-suffix:3", "options in braces"),
    ("free spec!", "cannot parse"),
])
def test_bad_method_specs_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_methods(text)


def test_drafter_specs_for_replay():
    specs = parse_drafters("prompt_lookup, suffix{min_match=3,max_draft_depth=8},freespec,freespec:suffix,"
                           "arctic-suffix")
    assert [m.label for m in specs] == ["prompt_lookup", "suffix{min_match=3,max_draft_depth=8}", "freespec",
                                        "freespec:suffix", "arctic-suffix"]
    assert [m.kind for m in specs] == ["freespec"] * 4 + ["arctic-suffix"]
    assert specs[1].drafter == "suffix" and specs[1].drafter_options == {"min_match": 3}
    assert specs[1].spec_options == {"max_draft_depth": 8} and specs[2].drafter is None
    assert specs[1] == dataclasses.replace(parse_method("freespec:suffix{min_match=3,max_draft_depth=8}"),
                                           label="suffix{min_match=3,max_draft_depth=8}")  # one grammar
    for text, message in [("vanilla", "unknown drafter"), ("suffix,suffix", "listed twice"),
                          ("suffix{min_match}", "key=value"), ("hf-pld:3", "cannot parse")]:
        with pytest.raises(ValueError, match=message):
            parse_drafters(text)


def test_single_method_value_types():
    m = parse_method("freespec:prompt_lookup{min_match=2,max_occurrences=4}")
    assert m.drafter_options == {"min_match": 2, "max_occurrences": 4}


# ------------------------------------------------------------------------------ arctic wrapper
def test_arctic_to_draft_reorders_and_checks():
    draft = arctic_to_draft([9, 3], [1, -1], [0.2, 0.5], "s")
    assert draft.token_ids.tolist() == [3, 9] and draft.parents.tolist() == [-1, 0]
    assert draft.confidence.tolist() == pytest.approx([0.5, 0.2]) and draft.sources == ("s", "s")
    same = arctic_to_draft([3, 4, 9, 5], [-1, -1, 0, 0], None, "s")
    assert same.parents.tolist() == [-1, -1, 0, 0]
    assert arctic_to_draft([], [], [], "s").num_nodes == 0
    with pytest.raises(ValueError):
        arctic_to_draft([1, 2], [1, 0], None, "s")  # a cycle
    with pytest.raises(ValueError):
        arctic_to_draft([1], [-1, 0], None, "s")


@pytest.mark.skipif(not arctic_available(), reason="arctic-inference is not installed (pip install 'freespec[peers]')")
def test_arctic_suffix_drafter_lifecycle():
    drafter = ArcticSuffixDrafter(max_tree_depth=16, min_token_prob=0.0, max_spec_factor=4.0)
    prompt = np.array([7, 1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 5, 1, 2])
    drafter.start("r", prompt)
    draft = drafter.propose("r", Budget(num_nodes=6, max_depth=3)).validate(Budget(6, 3))
    assert 0 < draft.num_nodes <= 6 and set(draft.sources) == {"arctic-suffix"}
    assert [3] in [p[:1] for p in draft.paths()]  # "1 2" was followed by 3 (and 4)
    drafter.extend("r", [3, 9])
    drafter.stop("r")
    # the response went to the global tree: a new request with the same tail can draft from it
    drafter.start("r", np.array([8, 8, 2, 3]))
    assert drafter.propose("r", Budget(num_nodes=4, max_depth=4)).num_nodes >= 1
    drafter.stop("r")
    with pytest.raises(ValueError):
        drafter.propose("r", Budget(4, 4))


def test_arctic_missing_is_reported(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_arctic(name, *args, **kwargs):
        if name.startswith("arctic_inference"):
            raise ImportError("no arctic")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_arctic)
    with pytest.raises(ImportError, match=r"freespec\[peers\]"):
        ArcticSuffixDrafter()


# ------------------------------------------------------------------------------ report
def _record(new_tokens, forwards, wall_s, engine=None, matches=True):
    # widths of the forwards after the prefill: a quarter feed 1 token, a quarter 17, half 4
    widths = {"1": (forwards - 1) // 4, "17": (forwards - 1) // 4, "4": forwards - 1 - 2 * ((forwards - 1) // 4)}
    return {"new_tokens": new_tokens, "forwards": forwards, "tau": new_tokens / forwards, "wall_s": wall_s,
            "cpu_s": wall_s * 2, "tokens_per_s": new_tokens / wall_s, "tokens_fed_after_prefill": 3 * (forwards - 1),
            "forward_widths": widths, "engine": engine, "matches_reference": matches}


def _synthetic_results():
    engine = {"new_tokens": 100, "forward_passes": 25, "tau": 4.0, "draft_s": 0.1, "verify_s": 0.8, "total_s": 1.0,
              "tokens_fed": 72, "steps_with_draft": 20, "draft_tokens": 60, "accepted_draft_tokens": 50,
              "fallback_reason": None, "per_drafter": {"prompt_lookup": {"proposed": 60, "accepted": 50}}}
    prompts = []
    for k, (category, fs_wall) in enumerate([("a", 1.0), ("a", 2.0), ("b", 4.0)]):
        prompts.append({"index": k, "item_id": str(k), "turn": 1, "category": category, "prompt_tokens": 10,
                        "order": [], "reference_output": "",
                        "methods": {"vanilla": _record(100, 100, 4.0),
                                    "hf-pld": _record(100, 50, 8.0),
                                    "freespec": _record(100, 25, fs_wall, engine, matches=(k != 2))}})
    labels = ["vanilla", "hf-pld", "freespec"]
    return {
        "config": {"model": "m", "dataset": "d", "methods": labels, "max_new_tokens": 100, "dtype": "float32",
                   "temperature": 0.0},
        "environment": {"cpu_model": "cpu", "torch_threads": 2, "torch": "t", "transformers": "tf",
                        "freespec": "f", "date": "today", "command": "freespec bench ...",
                        "cpu_features": {"amx_bf16": True, "avx512f": True, "avx2": False},
                        "torch_cpu_capability": "AVX512", "gpu": None},
        "cost_curve": {"sizes": [1, 2, 4], "ms": [10.0, 12.0, 15.0], "ratios": [1.0, 1.2, 1.5],
                       "prefill": {"tokens": 512, "ms": 200.0}, "prefix_tokens": 512, "repeats": 5, "threads": 2,
                       "dtype": "float32", "device": "cpu"},
        "greedy": True, "reference": "vanilla",
        "unavailable": {"arctic-suffix": "arctic-inference is not installed"},
        "mismatches": [{"prompt_index": 2, "method": "freespec", "first_difference": 5}],
        "notes": ["OMP_WAIT_POLICY=PASSIVE"],
        "summary": summarize(prompts, labels), "prompts": prompts,
    }


def test_summary_metrics():
    results = _synthetic_results()
    overall = results["summary"]["overall"]
    assert overall["vanilla"]["tau"] == 1.0 and overall["hf-pld"]["tau"] == 2.0 and overall["freespec"]["tau"] == 4.0
    fs = overall["freespec"]
    assert fs["speedup_vs_vanilla"]["median"] == pytest.approx(2.0)  # per prompt 4, 2, 1
    assert fs["speedup_vs_vanilla"]["total"] == pytest.approx(12.0 / 7.0)
    assert fs["speedup_vs_hf_pld"]["median"] == pytest.approx(4.0)
    assert fs["draft_overhead"] == pytest.approx(0.1) and fs["engine_tau"] == pytest.approx(4.0)
    assert fs["fed_per_step"] == pytest.approx(3.0) and fs["mismatches"] == 1
    assert fs["width_shares"] == pytest.approx([6 / 24, 12 / 24, 0, 6 / 24, 0, 0])  # 24 forwards after the prefill
    assert width_shares({"1": 1, "16": 3}) == [0.25, 0, 0.75, 0, 0, 0] and width_shares({}) is None
    assert width_shares({"64": 1, "65": 1}) == [0, 0, 0, 0, 0.5, 0.5]
    assert overall["vanilla"]["speedup_vs_vanilla"] is None
    per_b = results["summary"]["per_category"]["b"]["freespec"]
    assert per_b["speedup_vs_vanilla"]["median"] == pytest.approx(1.0) and per_b["prompts"] == 1


def test_reports_and_files(tmp_path):
    results = _synthetic_results()
    text = console_report(results)
    assert "freespec" in text and "2.00/1.71" in text
    assert "METHOD NOT RUN: arctic-suffix" in text and "GREEDY OUTPUT MISMATCH" in text
    md = markdown_report(results)
    assert "| method | tau |" in md and "**METHOD NOT RUN: arctic-suffix" in md
    assert "CPU matrix features: amx_bf16, avx512f; torch CPU capability AVX512; GPU: none." in md
    assert "| 4 | 15.0 | 1.50 |" in md and "| 512 (prefill) | 200.0 | 20.00 |" in md
    assert "| method | 1 | 2-8 | 9-16 | 17-32 | 33-64 | 65+ |" in md
    assert "| freespec | 25% | 50% | 0% | 25% | 0% | 0% |" in md
    assert "Forwards after the prefill by tokens fed" in text
    assert "Cost of a forward feeding k tokens over 512 cached ones" in text
    written = write_results(results, tmp_path / "out")
    names = {p.name for p in written}
    assert {"results.json", "results.md"} <= names
    pytest.importorskip("matplotlib")
    assert {"speedup_by_category.png", "tau_by_category.png", "tau_distribution.png", "cost_curve.png"} <= names
    assert all(p.stat().st_size > 1000 for p in written)
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["summary"]["overall"]["freespec"]["tau"] == 4.0


# ------------------------------------------------------------------------------ runner pieces
def test_conversation_puts_earlier_answers_in_the_history():
    from freespec.bench.runner import conversation

    item = Item("1", "c", ("first", "second", "third"))
    assert conversation(item, 0, []) == [{"role": "user", "content": "first"}]
    assert conversation(item, 2, ["A", "B"]) == [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "A"},
        {"role": "user", "content": "second"}, {"role": "assistant", "content": "B"},
        {"role": "user", "content": "third"}]
    with pytest.raises(ValueError, match="needs the answers"):
        conversation(item, 2, ["A"])


def test_compare_outputs_records_the_first_difference():
    from freespec.bench.runner import compare_outputs

    outputs = {"vanilla": [1, 2, 3], "same": [1, 2, 3], "short": [1, 2], "other": [1, 9, 3, 4]}
    assert compare_outputs(outputs, "vanilla") == [
        {"method": "short", "reference": "vanilla", "first_difference": 2, "len": 2, "reference_len": 3},
        {"method": "other", "reference": "vanilla", "first_difference": 1, "len": 4, "reference_len": 3}]
    assert compare_outputs({"a": [5]}, "a") == []


# ------------------------------------------------------------------------------ end to end
@pytest.fixture
def tiny_model(monkeypatch):
    from freespec import models
    from freespec.testing.models import tiny_random

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the CLI would set it for the whole test process

    model = tiny_random("llama", vocab_size=128)
    monkeypatch.setattr(models, "load", lambda name, dtype=None, **kw: (model, CharTokenizer()))
    return model


def _dataset(tmp_path):
    path = tmp_path / "tiny.jsonl"
    rows = [{"question_id": 1, "category": "rep", "turns": ["abcd abcd abcd", "again"]},
            {"question_id": 2, "category": "other", "turns": ["xyz"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_end_to_end_then_replay(tmp_path, tiny_model, capsys):
    from freespec.cli import main

    out = tmp_path / "run"
    code = main(["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--methods",
                 "vanilla,hf-pld:4,freespec:prompt_lookup{min_match=1,max_draft_tokens=8}", "--max-new-tokens", "12",
                 "--threads", "1", "--save-traces", "--no-progress", "--no-plots", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    results = json.loads((out / "results.json").read_text())
    assert results["mismatches"] == [] and len(results["prompts"]) == 3
    assert [p["order"][0] for p in results["prompts"]] == ["vanilla", results["prompts"][1]["order"][0], "vanilla"]
    assert results["prompts"][1]["order"] == results["prompts"][0]["order"][::-1]  # ABAB / BABA
    overall = results["summary"]["overall"]
    assert overall["vanilla"]["tau"] == 1.0
    method = "freespec:prompt_lookup{min_match=1,max_draft_tokens=8}"
    fs = overall[method]
    assert fs["engine_tau"] == pytest.approx(fs["tau"]) and fs["draft_overhead"] is not None
    for prompt in results["prompts"]:  # every forward after the prefill, by its width
        for record in prompt["methods"].values():
            widths = {int(w): n for w, n in record["forward_widths"].items()}
            assert sum(widths.values()) == record["forwards"] - 1
            assert sum(w * n for w, n in widths.items()) == record["tokens_fed_after_prefill"]
    assert overall["vanilla"]["width_shares"] == [1.0, 0, 0, 0, 0, 0]
    assert 0 < fs["width_shares"][0] < 1 and fs["width_shares"][3:] == [0, 0, 0]  # at most 1 + 8 tokens
    assert max(int(w) for p in results["prompts"] for w in p["methods"][method]["forward_widths"]) <= 9
    assert results["environment"]["torch_threads"] == 1 and results["config"]["threads"] == 1
    assert "PASSIVE" in " ".join(results["notes"]) or "OMP_WAIT_POLICY" in " ".join(results["notes"])
    assert (out / "results.md").read_text().startswith("Model `tiny`")
    assert "Overall" in text
    env, probe = results["environment"], results["cost_curve"]
    assert "cpu_features" in env and "gpu" in env and "torch_cpu_capability" in env
    assert probe["sizes"] == [1, 2, 4, 8, 16, 17, 32, 33, 64] and probe["ratios"][0] == 1.0 and probe["threads"] == 1
    assert "Cost of a forward" in (out / "results.md").read_text() and "Cost of a forward" in text

    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert [t["category"] for t in traces] == ["rep", "rep", "other"]
    assert all(len(t["output_ids"]) <= 12 for t in traces)
    # the second turn's prompt holds the first turn's answer
    assert len(traces[1]["prompt_ids"]) > len(traces[0]["prompt_ids"])

    from freespec.bench.replay import replay_tau
    from freespec import SpecConfig

    replayed = replay_tau(traces, lambda: make("prompt_lookup", min_match=1), SpecConfig(max_draft_tokens=8))
    engine_forwards = sum(p["methods"]["freespec:prompt_lookup{min_match=1,max_draft_tokens=8}"]["forwards"]
                          for p in results["prompts"])
    assert replayed["overall"]["forwards"] == engine_forwards

    method = "freespec:prompt_lookup{min_match=1,max_draft_tokens=8}"
    code = main(["replay", str(out / "traces.jsonl"), "--drafters", method,
                 "--cost-curve", str(out / "results.json"), "--json", str(tmp_path / "replay.json")])
    assert code == 0, capsys.readouterr().out
    saved = json.loads((tmp_path / "replay.json").read_text())
    assert saved["cost_curve"]["one_token_ms"] == probe["ms"][0]
    assert saved["cost_curve"]["sizes"] == probe["sizes"] + [probe["prefill"]["tokens"]]
    assert saved["results"][method]["overall"]["forwards"] == engine_forwards


def test_bench_reports_a_mismatch_and_exits_nonzero(tmp_path, tiny_model, monkeypatch, capsys):
    from freespec.bench import runner
    from freespec.cli import main

    real = runner.MethodRunner.generate

    def corrupt(self, model, input_ids, gen_kwargs, **kwargs):
        out, stats = real(self, model, input_ids, gen_kwargs, **kwargs)
        if self.method.kind == "hf-pld":
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % 100 + 2
        return out, stats

    monkeypatch.setattr(runner.MethodRunner, "generate", corrupt)
    args = ["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--methods", "vanilla,hf-pld",
            "--limit", "1", "--categories", "other", "--max-new-tokens", "6", "--no-warmup", "--no-progress",
            "--no-plots", "--no-cost-probe", "--out", str(tmp_path / "mm")]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "OUTPUT MISMATCH" in captured.out and "mismatch" in captured.err
    results = json.loads((tmp_path / "mm" / "results.json").read_text())
    assert results["mismatches"][0]["method"] == "hf-pld" and results["cost_curve"] is None
    assert main(args + ["--allow-mismatch"]) == 0


def test_bench_rejects_bad_arguments_before_loading(tmp_path, capsys, monkeypatch):
    from freespec import models
    from freespec.cli import main

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("model loaded before arguments were checked"))
    base = ["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--out", str(tmp_path / "x")]
    assert main(base + ["--methods", "vanilla,bogus"]) == 2
    assert "unknown method" in capsys.readouterr().err
    assert main(base + ["--temperature", "0.7", "--save-traces"]) == 2
    assert main(["bench", "--model", "tiny", "--dataset", "builtin:nope", "--out", "x"]) == 2
    assert main(base + ["--one-token-ms", "50"]) == 2
    assert "--one-token-ms" in capsys.readouterr().err
    assert main(base + ["--simulate", "1:1,4:1.1", "--batch-size", "2"]) == 2
    assert "--batch-size 1" in capsys.readouterr().err
    assert main(base + ["--simulate", "2:1.1"]) == 2
    assert "--simulate" in capsys.readouterr().err


def test_bench_simulates_a_machine_live(tmp_path, tiny_model, capsys, monkeypatch):
    """--simulate charges every forward the curve's time (the prefill at the prompt's width), keeps the time outside
    forwards as measured, and freespec's drafter sees the simulated time of every forward."""
    from freespec.bench import runner
    from freespec.bench.cost import CostCurve
    from freespec.cli import main

    seen = []  # (width, forward_s) of every report the timed drafter's own on_forward received
    make_drafter = runner.make_drafter

    def spied(method):
        drafter = make_drafter(method)
        own = drafter.on_forward
        drafter.on_forward = lambda report: (seen.append((report.width, report.forward_s)), own(report))
        return drafter

    monkeypatch.setattr(runner, "make_drafter", spied)
    curve = "1:1,2:1.5,8:2,64:2"
    out = tmp_path / "sim"
    method = "freespec:mixture{flat_max_cost=100}"
    code = main(["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--methods",
                 f"vanilla,hf-pld:4,{method}", "--max-new-tokens", "10", "--threads", "1", "--no-progress",
                 "--no-plots", "--no-cost-probe", "--simulate", curve, "--one-token-ms", "200", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    results = json.loads((out / "results.json").read_text())
    expected = CostCurve.parse(curve, one_token_ms=200)
    assert results["simulated"]["one_token_ms"] == 200 and results["simulated"]["ratios"] == [1.0, 1.5, 2.0, 2.0]
    for prompt in results["prompts"]:
        vanilla = prompt["methods"]["vanilla"]  # a prefill, then one token per forward
        assert vanilla["simulated_forward_s"] == pytest.approx(
            expected.forward_ms(prompt["prompt_tokens"]) / 1000 + 0.2 * (vanilla["forwards"] - 1))
        for record in prompt["methods"].values():
            outside = record["measured_wall_s"] - record["measured_forward_s"]
            assert 0 < outside < record["measured_wall_s"]
            assert record["wall_s"] == pytest.approx(outside + record["simulated_forward_s"])
            assert record["tokens_per_s"] == pytest.approx(record["new_tokens"] / record["wall_s"])
            assert record["simulated_forward_s"] >= 0.2 * record["forwards"]
    assert seen and all(s == pytest.approx(expected.forward_ms(w) / 1000) for w, s in seen)
    assert any(w > 1 for w, _ in seen[1:])  # the mixture drafted, at the simulated curve's price
    assert "SIMULATED machine" in text and "SIMULATED machine" in (out / "results.md").read_text()


def test_left_pad_and_row_output():
    from freespec.bench.runner import left_pad, row_output

    ids, mask = left_pad([[5, 6], [7]], 0)
    assert ids.tolist() == [[5, 6], [0, 7]] and mask.tolist() == [[1, 1], [0, 1]]
    assert row_output([5, 2, 0, 0], [2]) == [5, 2] and row_output([5, 6], [2]) == [5, 6]
    assert row_output([5, 3, 2, 3], [2, 3]) == [5, 3]


def test_tokens_after_eos_are_counted_and_reported(tiny_model):
    import torch

    from freespec.bench.runner import ForwardCounter, MethodRunner, engine_disagreement, run_method

    class Fixed(MethodRunner):
        """Returns the prompt followed by ``new_rows``."""

        def generate(self, model, input_ids, gen_kwargs, **kwargs):
            return torch.cat([input_ids, torch.tensor(self.new_rows)], dim=1), None

    prompt = torch.tensor([[3, 4], [3, 4], [3, 4]])
    # EOS is 1, pad 0: row 0 padded after its EOS, row 1 pads with EOS (no pad token), row 2 goes on after it
    runner = Fixed(parse_method("vanilla"))
    runner.new_rows = [[5, 1, 0, 0], [6, 1, 1, 1], [7, 1, 9, 0]]
    counter = ForwardCounter(tiny_model)
    try:
        outputs, record, _ = run_method(runner, tiny_model, counter, prompt, {"pad_token_id": 0}, eos_ids=(1,))
    finally:
        counter.close()
    assert outputs == [[5, 1], [6, 1], [7, 1]] and record["row_new_tokens"] == [2, 2, 2]
    assert record["rows_past_eos"] == 1
    assert engine_disagreement("m", 3, None, record) == "!!! m prompt 3: 1 row(s) hold tokens after their EOS"
    assert engine_disagreement("m", 3, None, dict(record, rows_past_eos=0)) is None


def test_identity_summary_counts_rows_and_first_differences():
    from freespec.bench.report import identity_rows, identity_summary

    results = _synthetic_results()
    results["prompts"][0]["rows"] = [{}, {}]  # a batch of two rows, then two prompts of one
    results["mismatches"] = [{"method": "freespec", "first_difference": 5}, {"method": "freespec",
                                                                             "first_difference": 12},
                             {"method": "hf-pld", "first_difference": 40}]
    identity = identity_summary(results)
    assert identity["freespec"] == {"compared": 4, "identical": 2, "share": 0.5,
                                    "first_difference": {"median": 8.5, "min": 5}}
    assert identity["hf-pld"]["identical"] == 3 and "vanilla" not in identity
    assert identity_rows(results)[1][0] == ["hf-pld", "3/4", "75%", "40", "40"]
    assert identity_summary(dict(results, greedy=False)) == {}


def _short_run(tmp_path, out: str, *extra: str) -> list[str]:
    """Arguments of a quick bench of vanilla and prompt lookup on the tiny dataset, writing to ``out``."""
    return ["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--methods",
            "vanilla,freespec:prompt_lookup{min_match=1}", "--max-new-tokens", "6", "--no-warmup", "--no-progress",
            "--no-plots", "--no-cost-probe", *extra, "--out", str(tmp_path / out)]


def _corrupt_freespec_row(monkeypatch, row: int):
    from freespec.bench import runner

    real = runner.MethodRunner.generate

    def corrupt(self, model, input_ids, gen_kwargs, **kwargs):
        out, stats = real(self, model, input_ids, gen_kwargs, **kwargs)
        if self.method.kind == "freespec" and out.shape[0] > row:
            out = out.clone()
            out[row, input_ids.shape[1] + 1] = (out[row, input_ids.shape[1] + 1] + 1) % 90 + 2  # never EOS (1)
        return out, stats

    monkeypatch.setattr(runner.MethodRunner, "generate", corrupt)


def test_bench_batches_every_method_and_compares_row_by_row(tmp_path, tiny_model, capsys):
    from freespec.cli import main

    out = tmp_path / "batched"
    code = main(["bench", "--model", "tiny", "--dataset", str(_dataset(tmp_path)), "--methods",
                 "vanilla,hf-pld:4,freespec:prompt_lookup{min_match=1,max_draft_tokens=8}", "--max-new-tokens", "10",
                 "--batch-size", "2", "--threads", "1", "--save-traces", "--no-progress", "--no-plots",
                 "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    results = json.loads((out / "results.json").read_text())
    label = "freespec:prompt_lookup{min_match=1,max_draft_tokens=8}"
    assert "hf-pld:4" in results["unavailable"] and "no batch mode" in results["unavailable"]["hf-pld:4"]
    assert results["config"]["batch_size"] == 2 and results["cost_curve"]["batch_size"] == 2
    # items 1 (two turns) and 2 (one turn): turn 1 is a batch of two rows, turn 2 a batch of one
    assert [len(p["rows"]) for p in results["prompts"]] == [2, 1]
    assert [r["item_id"] for r in results["prompts"][0]["rows"]] == ["1", "2"]
    assert results["prompts"][0]["category"] == "mixed" and results["prompts"][1]["category"] == "rep"
    first = results["prompts"][0]["methods"]
    assert first["vanilla"]["tau"] == 1.0 and first["vanilla"]["row_forwards"] == first["vanilla"]["new_tokens"]
    assert first[label]["rows_matching"] == 2 and first[label]["matches_reference"]
    assert sum(first[label]["row_new_tokens"]) == first[label]["new_tokens"] == first[label]["engine"]["new_tokens"]
    assert first[label]["row_forwards"] == first[label]["engine"]["row_forwards"]  # the hook's rows = the engine's
    assert results["identity"][label] == {"compared": 3, "identical": 3, "share": 1.0, "first_difference": None}
    assert not [n for n in results["notes"] if n.startswith("!!!")]  # the engine's counts agree with the hook's
    assert all(m["rows_past_eos"] == 0 for p in results["prompts"] for m in p["methods"].values())
    md = (out / "results.md").read_text()
    assert "batch size 2" in md and "Greedy outputs identical to vanilla (rows" in md and "no batch mode" in md
    assert "to each of 2 rows" in md
    traces = [json.loads(line) for line in (out / "traces.jsonl").read_text().splitlines()]
    assert [t["item_id"] for t in traces] == ["1", "2", "1"]


def test_bench_batch_mismatch_names_the_row(tmp_path, tiny_model, monkeypatch, capsys):
    from freespec.cli import main

    _corrupt_freespec_row(monkeypatch, row=1)
    assert main(_short_run(tmp_path, "mm", "--batch-size", "2")) == 1
    results = json.loads((tmp_path / "mm" / "results.json").read_text())
    assert [(m["row"], m["item_id"], m["first_difference"]) for m in results["mismatches"]] == [(1, "2", 1)]
    assert results["prompts"][0]["methods"]["freespec:prompt_lookup{min_match=1}"]["rows_matching"] == 1
    assert "row 1" in capsys.readouterr().out


def test_reduced_precision_reports_identity_and_exits_zero(tmp_path, tiny_model, monkeypatch, capsys):
    from freespec.cli import main

    _corrupt_freespec_row(monkeypatch, row=0)
    args = _short_run(tmp_path, "bf16", "--dtype", "bfloat16")
    assert main(args) == 0
    text = capsys.readouterr().out
    results = json.loads((tmp_path / "bf16" / "results.json").read_text())
    identity = results["identity"]["freespec:prompt_lookup{min_match=1}"]
    assert identity["compared"] == 3 and identity["identical"] == 0 and identity["first_difference"]["min"] == 1
    assert "Greedy outputs identical to vanilla" in text and "0/3" in text and "bfloat16: a forward" in text
    assert "GREEDY OUTPUT MISMATCH" not in text  # reported as identity, not as an error
    md = (tmp_path / "bf16" / "results.md").read_text()
    assert "| freespec:prompt_lookup{min_match=1} | 0/3 | 0% | 1 | 1 |" in md
    assert main(args + ["--require-identical"]) == 1
    assert main(_short_run(tmp_path, "f32", "--dtype", "float32")) == 1
    assert main(args + ["--require-identical", "--allow-mismatch"]) == 2


def test_cli_help(capsys):
    from freespec.cli import main

    for argv in (["--help"], ["bench", "--help"], ["replay", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "arctic-suffix" in text and "--save-traces" in text and "--drafters" in text
    assert main([]) == 2
