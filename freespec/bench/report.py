"""Turn per-prompt records into metrics, tables, ``results.json``, ``results.md`` and plots.

Metrics of a method over a set of prompts (a category, or all):

- ``tau``: new tokens per target forward, prefill included (sum over sum;
  plain decoding is exactly 1.0). Forwards come from a hook on the model, the
  same for every method; ``engine_tau`` is freespec's own count, for a cross-check.
- ``tokens_per_s``: new tokens / wall seconds; ``cpu_s``: process CPU seconds.
- ``speedup_vs_vanilla`` / ``speedup_vs_hf_pld``: ``median`` is the median over
  prompts of the per-prompt tokens/s ratio, ``total`` the ratio of total
  tokens/s (under greedy decoding both methods emit the same tokens, so these
  are ratios of time). ``cpu_total``: the same ratio on CPU seconds.
- ``draft_overhead``: time in the drafter over time in generate() (freespec's stats).
- ``outside_forward_ms_per_forward``: wall time outside the model's forwards per forward (every method);
  ``host_ms_per_forward`` / ``tensor_ms_per_forward``: freespec's split of its own time outside forwards
  into host work and tensor work on the model's device (``SpecStats.host_s`` / ``tensor_s``).
- ``device`` (runs with ``--device-model``, every method): per forward, the kernels, bytes they move, bytes
  copied and round trips counted outside forwards, their measured ms, the device model's charge for them
  (``charged_ms``, in the simulated times) and the host work around them (``host_ms``: the rest of the time
  outside forwards, less what the counter itself cost).
- ``fed_per_step``: tokens fed per row and forward after the prefill (root + draft nodes;
  in a batch, the widest row's, as every row is padded to it).
- ``width_shares``: the share of those forwards in each band of ``WIDTH_BANDS`` (1, 2-8,
  9-16, 17-32, 33-64, 65+ tokens), which says where a method's forwards sit on the cost
  curve: under a curve with a step after 16 tokens a sizer that prices it keeps most
  forwards at 16 or below.

A record is one prompt, or one batch of prompts (``--batch-size``): then
tokens/s is the whole batch's and tau counts per row (``runner``'s docstring).

Identity (greedy runs): per method, the share of prompts (rows, in batches)
whose output is token-identical to the reference's, and where the others
first differ (new-token index: median, min). In float32/float64 every method
must be identical; in bfloat16/float16 a forward over many tokens rounds
differently from one over a single token, so speculation (freespec's and HF
prompt lookup's alike) may depart from plain decoding where two tokens' logits
are within rounding of each other; the bench reports how often and how late.
"""

from __future__ import annotations

import json
import statistics
import zlib
from pathlib import Path
from typing import Any, Mapping, Sequence


WIDTH_BANDS = ((1, 1), (2, 8), (9, 16), (17, 32), (33, 64), (65, None))  # forward widths, inclusive; None: no end


def width_shares(widths: dict) -> list[float] | None:
    """The share of forwards in each of ``WIDTH_BANDS``: ``{"1": 1, "16": 3} -> [0.25, 0, 0.75, 0, 0, 0]``; None for
    none (or records from before widths were kept)."""
    total = sum(widths.values())
    if not total:
        return None
    return [sum(n for w, n in widths.items() if lo <= int(w) and (hi is None or int(w) <= hi)) / total
            for lo, hi in WIDTH_BANDS]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _speedup(prompts: Sequence[dict], label: str, base: str | None, key: str = "wall_s") -> dict | None:
    if base is None or base == label:
        return None
    ratios = []
    tokens_m = time_m = tokens_b = time_b = 0.0
    for prompt in prompts:
        m, b = prompt["methods"].get(label), prompt["methods"].get(base)
        if m is None or b is None:
            continue
        tokens_m += m["new_tokens"]
        time_m += m[key]
        tokens_b += b["new_tokens"]
        time_b += b[key]
        if m[key] > 0 and b[key] > 0 and b["new_tokens"] > 0:
            ratios.append((m["new_tokens"] / m[key]) / (b["new_tokens"] / b[key]))
    if not ratios or time_m <= 0 or time_b <= 0 or tokens_b <= 0:
        return None
    return {"median": _median(ratios), "total": (tokens_m / time_m) / (tokens_b / time_b)}


def method_metrics(prompts: Sequence[dict], label: str, vanilla: str | None, hf_pld: str | None) -> dict[str, Any]:
    records = [p["methods"][label] for p in prompts if label in p["methods"]]
    new_tokens = sum(r["new_tokens"] for r in records)
    forwards = sum(r["forwards"] for r in records)
    row_forwards = sum(r.get("row_forwards", r["forwards"]) for r in records)  # per row (results before batches: 1)
    wall_s = sum(r["wall_s"] for r in records)
    cpu_s = sum(r["cpu_s"] for r in records)
    steps = sum(max(0, r["forwards"] - 1) for r in records)
    fed = sum(r["tokens_fed_after_prefill"] for r in records)
    engines = [r["engine"] for r in records if r.get("engine")]
    widths: dict[str, int] = {}
    for r in records:
        for width, count in r.get("forward_widths", {}).items():
            widths[width] = widths.get(width, 0) + count
    metrics: dict[str, Any] = {
        "prompts": len(records),
        "new_tokens": new_tokens,
        "forwards": forwards,
        "tau": new_tokens / row_forwards if row_forwards else 0.0,
        "tau_median": _median([r["tau"] for r in records]),
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "fed_per_step": fed / steps if steps else None,
        "width_shares": width_shares(widths),
        "speedup_vs_vanilla": _speedup(prompts, label, vanilla),
        "speedup_vs_hf_pld": _speedup(prompts, label, hf_pld),
        "cpu_speedup_vs_vanilla": _speedup(prompts, label, vanilla, "cpu_s"),
        "mismatches": sum(1 for r in records if r.get("matches_reference") is False),
        "outside_forward_ms_per_forward": _per_forward(records, "outside_forward_s", forwards),
    }
    if engines:
        engine_forwards = sum(e["forward_passes"] for e in engines)
        engine_total = sum(e["total_s"] for e in engines)
        per_drafter: dict[str, dict[str, int]] = {}
        for e in engines:
            for name, d in e["per_drafter"].items():
                acc = per_drafter.setdefault(name, {"proposed": 0, "accepted": 0})
                acc["proposed"] += d["proposed"]
                acc["accepted"] += d["accepted"]
        metrics.update({
            "engine_tau": sum(e["new_tokens"] for e in engines) / engine_forwards if engine_forwards else 0.0,
            "draft_overhead": sum(e["draft_s"] for e in engines) / engine_total if engine_total > 0 else None,
            "verify_share": sum(e["verify_s"] for e in engines) / engine_total if engine_total > 0 else None,
            "steps_with_draft": sum(e["steps_with_draft"] for e in engines),
            "draft_tokens": sum(e["draft_tokens"] for e in engines),
            "per_drafter": per_drafter,
            "fallbacks": sum(1 for e in engines if e.get("fallback_reason")),
            "tensor_ms_per_forward": _per_forward(engines, "tensor_s", engine_forwards),
            "host_ms_per_forward": _per_forward(engines, "host_s", engine_forwards),
        })
    if records and all("device" in r for r in records):
        metrics["device"] = device_metrics(records, forwards)
    return metrics


def device_metrics(records: Sequence[dict], forwards: int) -> dict[str, float] | None:
    """Per forward: what ``DeviceOps`` counted outside forwards and the device model's charge for it.

    One record of 2 forwards with ``device = {kernels: 10, kernel_bytes: 4000, copy_bytes: 100, round_trips: 4,
    measured_s: 0.002, charged_s: 0.0001, overhead_s: 0.001}`` and ``outside_forward_s`` 0.011 (the counter's
    own cost, ``overhead_s``, is not host work) -> ``{"kernels": 5, "kernel_kb": 2,
    "copy_kb": 0.05, "round_trips": 2, "measured_ms": 1, "charged_ms": 0.05, "host_ms": 4}``.
    """
    if not forwards:
        return None
    total = {key: sum(r["device"][key] for r in records)
             for key in ("kernels", "kernel_bytes", "copy_bytes", "round_trips", "measured_s", "charged_s", "overhead_s")}
    outside = sum(r["outside_forward_s"] for r in records) - total["overhead_s"]
    return {"kernels": total["kernels"] / forwards, "kernel_kb": total["kernel_bytes"] / 1e3 / forwards,
            "copy_kb": total["copy_bytes"] / 1e3 / forwards, "round_trips": total["round_trips"] / forwards,
            "measured_ms": 1e3 * total["measured_s"] / forwards, "charged_ms": 1e3 * total["charged_s"] / forwards,
            "host_ms": 1e3 * (outside - total["measured_s"]) / forwards}


def _per_forward(records: Sequence[dict], key: str, forwards: int) -> float | None:
    """Milliseconds of ``key`` per forward over ``records`` (None where a record lacks it: older results)."""
    if not forwards or any(key not in r for r in records):
        return None
    return 1e3 * sum(r[key] for r in records) / forwards


def summarize(prompts: Sequence[dict], labels: Sequence[str]) -> dict[str, Any]:
    """``{"overall": {label: metrics}, "per_category": {category: {label: metrics}}}``."""
    vanilla = "vanilla" if "vanilla" in labels else None
    hf_pld = next((label for label in labels if label.startswith("hf-pld")), None)
    categories: dict[str, list[dict]] = {}
    for prompt in prompts:
        categories.setdefault(prompt["category"], []).append(prompt)
    return {
        "vanilla": vanilla,
        "hf_pld": hf_pld,
        "overall": {label: method_metrics(prompts, label, vanilla, hf_pld) for label in labels},
        "per_category": {name: {label: method_metrics(group, label, vanilla, hf_pld) for label in labels}
                         for name, group in categories.items()},
    }


REDUCED_PRECISION = ("bfloat16", "float16")


def identity_summary(results: dict) -> dict[str, dict]:
    """Per method: prompts (rows) compared with the reference, how many are identical, and where the rest differ.

    ``{label: {"compared": 21, "identical": 17, "share": 0.81, "first_difference":
    {"median": 38, "min": 13}}}`` (``first_difference`` None when all are identical);
    ``{}`` for sampled runs. Works on results.json of any version (a prompt without
    ``rows`` is one row).
    """
    if not results.get("greedy", True):
        return {}
    reference = results.get("reference")
    positions: dict[str, list[int]] = {}
    for mismatch in results.get("mismatches", []):
        positions.setdefault(mismatch["method"], []).append(int(mismatch["first_difference"]))
    out = {}
    for label in results["summary"]["overall"]:
        if label == reference:
            continue
        compared = sum(len(p.get("rows", [None])) for p in results["prompts"] if label in p["methods"])
        found = positions.get(label, [])
        identical = compared - len(found)
        out[label] = {"compared": compared, "identical": identical,
                      "share": identical / compared if compared else None,
                      "first_difference": {"median": _median(found), "min": min(found)} if found else None}
    return out


def identity_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    header = ["method", "identical", "share", "first difference (median)", "first difference (min)"]
    rows = []
    for label, m in identity_summary(results).items():
        first = m["first_difference"]
        rows.append([label, f"{m['identical']}/{m['compared']}", _fmt(None if m["share"] is None else 100 * m["share"],
                                                                     ".0f", "%"),
                     "-" if first is None else f"{first['median']:g}", "-" if first is None else str(first["min"])])
    return header, rows


def identity_title(results: dict) -> str:
    unit = "rows" if results.get("config", {}).get("batch_size", 1) > 1 else "prompts"
    return (f"Greedy outputs identical to {results.get('reference', 'vanilla')} ({unit}; first difference: index of "
            f"the first new token that differs)")


def precision_note(results: dict) -> str | None:
    dtype = results.get("config", {}).get("dtype")
    if dtype not in REDUCED_PRECISION:
        return None
    return (f"{dtype}: a forward over many tokens rounds differently from one over a single token, so speculation "
            f"(freespec's and HF prompt lookup's alike) may depart from plain decoding where two tokens' logits are "
            f"within rounding of each other; differences are reported, not errors (--require-identical to fail on them)")


# ------------------------------------------------------------------------------ text
def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _speed(value: dict | None) -> str:
    return "-" if value is None else f"{value['median']:.2f}/{value['total']:.2f}"


def overall_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    header = ["method", "tau", "tok/s", "x vanilla (med/tot)", "x hf-pld (med/tot)", "x vanilla CPU",
              "draft %", "off-fwd ms/fwd (host+tensor)", "fed/step", "wall s", "CPU s", "prompts"]
    rows = []
    for label, m in summary["overall"].items():
        cpu = m["cpu_speedup_vs_vanilla"]
        rows.append([
            label, f"{m['tau']:.2f}", f"{m['tokens_per_s']:.1f}", _speed(m["speedup_vs_vanilla"]),
            _speed(m["speedup_vs_hf_pld"]), "-" if cpu is None else f"{cpu['total']:.2f}",
            _fmt(None if m.get("draft_overhead") is None else 100 * m["draft_overhead"], ".1f"),
            _off_forward(m), _fmt(m["fed_per_step"], ".1f"), f"{m['wall_s']:.1f}", f"{m['cpu_s']:.1f}", str(m["prompts"]),
        ])
    return header, rows


def _off_forward(m: dict) -> str:
    """``"3.5 (2.9+0.6)"``: ms per forward outside forwards, then host and tensor work where freespec split it."""
    outside = m.get("outside_forward_ms_per_forward")
    if outside is None:
        return "-"
    if m.get("host_ms_per_forward") is None or m.get("tensor_ms_per_forward") is None:
        return f"{outside:.1f}"
    return f"{outside:.1f} ({m['host_ms_per_forward']:.1f}+{m['tensor_ms_per_forward']:.1f})"


DEVICE_TITLE = "Tensor work on the model's device outside forwards, per forward (host: the rest of that time)"


def device_title(results: dict) -> str:
    return f"{DEVICE_TITLE}; charged by the device model {results['device_model']['description']}"


def device_rows(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    """A row per method with ``device`` metrics (``--device-model`` runs); None when none has them."""
    header = ["method", "kernels", "KB moved", "KB copied", "round trips", "measured ms", "charged ms", "host ms"]
    rows = [[label, f"{d['kernels']:.1f}", f"{d['kernel_kb']:.0f}", f"{d['copy_kb']:.1f}", f"{d['round_trips']:.1f}",
             f"{d['measured_ms']:.2f}", f"{d['charged_ms']:.3f}", f"{d['host_ms']:.2f}"]
            for label, m in summary["overall"].items() if (d := m.get("device"))]
    return (header, rows) if rows else None


def category_rows(summary: dict, what: str) -> tuple[list[str], list[list[str]]]:
    """Rows per category, a column per method: ``what`` is "speedup" (median vs vanilla) or "tau"."""
    labels = list(summary["overall"])
    if what == "speedup":
        labels = [label for label in labels if label != summary["vanilla"]]
    header = ["category", "prompts"] + labels
    rows = []
    for name, per_method in list(summary["per_category"].items()) + [("overall", summary["overall"])]:
        first = next(iter(per_method.values()))
        row = [name, str(first["prompts"])]
        for label in labels:
            m = per_method[label]
            if what == "tau":
                row.append(f"{m['tau']:.2f}")
            else:
                s = m["speedup_vs_vanilla"]
                row.append("-" if s is None else f"{s['median']:.2f}x")
        rows.append(row)
    return header, rows


WIDTH_TITLE = "Forwards after the prefill by tokens fed (share of each method's; where it sits on the cost curve)"


def width_rows(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    """A row per method with widths recorded: its ``width_shares`` in percent; None when no method has them."""
    header = ["method"] + [str(lo) if hi == lo else f"{lo}+" if hi is None else f"{lo}-{hi}"
                           for lo, hi in WIDTH_BANDS]
    rows = [[label] + [f"{100 * share:.0f}%" for share in m["width_shares"]]
            for label, m in summary["overall"].items() if m.get("width_shares")]
    return (header, rows) if rows else None


def batch_note(results: dict) -> str | None:
    batch_size = results.get("config", {}).get("batch_size", 1)
    if batch_size <= 1:
        return None
    return (f"batches of {batch_size} prompts: tokens/s and speedups are whole batches' (vanilla: plain generate() "
            f"on the left-padded batch), tau counts per row, identity row by row; a batch mixes categories, so "
            f"per-category figures cover the batches whose rows share one ('mixed' holds the rest)")


def cost_title(cost_curve: dict) -> str:
    batch_size = cost_curve.get("batch_size", 1)
    rows = f" to each of {batch_size} rows" if batch_size > 1 else ""
    return (f"Cost of a forward feeding k tokens{rows} over {cost_curve['prefix_tokens']} cached ones (median of "
            f"{cost_curve['repeats']}; c(k) = ms / ms at k=1; {cost_curve['dtype']}, {_threads(cost_curve)})")


def _threads(cost_curve: dict) -> str:
    return f"{cost_curve['threads']} thread{'' if cost_curve['threads'] == 1 else 's'}"


def cost_rows(cost_curve: dict) -> tuple[list[str], list[list[str]]]:
    """One row per measured k, then the prefill (the prefix over an empty cache)."""
    header = ["k (tokens fed)", "ms", "c(k)"]
    rows = [[str(k), f"{ms:.1f}", f"{ratio:.2f}"]
            for k, ms, ratio in zip(cost_curve["sizes"], cost_curve["ms"], cost_curve["ratios"])]
    prefill = cost_curve["prefill"]
    prefill_ratio = prefill["ms"] / cost_curve["ms"][0]
    rows.append([f"{prefill['tokens']} (prefill)", f"{prefill['ms']:.1f}", f"{prefill_ratio:.2f}"])
    return header, rows


def machine_line(env: dict) -> str:
    """``CPU matrix features: amx_bf16, avx2; torch CPU capability AVX512; GPU: none.``"""
    features = env.get("cpu_features")
    listed = "unknown" if features is None else (", ".join(f for f, on in features.items() if on) or "none")
    return (f"CPU matrix features: {listed}; torch CPU capability {env.get('torch_cpu_capability', '?')}; "
            f"GPU: {env.get('gpu') or 'none'}.")


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def warnings_of(results: dict) -> list[str]:
    """The loud lines: output mismatches, methods that did not run, fallbacks, count disagreements."""
    lines = []
    for label, why in results.get("unavailable", {}).items():
        lines.append(f"METHOD NOT RUN: {label}: {why}")
    if results.get("mismatches") and not precision_note(results):
        by_method: dict[str, int] = {}
        for m in results["mismatches"]:
            by_method[m["method"]] = by_method.get(m["method"], 0) + 1
        lines.append("GREEDY OUTPUT MISMATCH vs " + results.get("reference", "vanilla") + ": "
                     + ", ".join(f"{k} on {v} prompt(s)" for k, v in by_method.items()))
    lines += [n for n in results.get("notes", []) if n.startswith("!!!")]
    return lines


def simulated_note(results: dict) -> str | None:
    """What a run with ``--simulate`` measured and what it simulated (None for a run without)."""
    simulated = results.get("simulated")
    if not simulated:
        return None
    return (f"SIMULATED machine: every target forward (prefill included) is charged c(k) x "
            f"{simulated['one_token_ms']:.1f} ms of the cost curve {simulated['description']}; outputs, drafts and "
            f"the time outside forwards are real (measured on this machine), and freespec's cost model learned "
            f"the simulated curve. tok/s, wall s, CPU s and speedups are simulated (measured ones: measured_wall_s, "
            f"measured_cpu_s per prompt in results.json); draft % is a share of the measured time."
            + (f" Tensor work on the device outside forwards is charged by the device model "
               f"{results['device_model']['description']} instead of its measured time (every method; see its table)."
               if results.get("device_model") else ""))


def console_report(results: dict) -> str:
    summary = results["summary"]
    parts = ([simulated_note(results), ""] if results.get("simulated") else []) + [
             "Overall (speedups: median of per-prompt ratios / ratio of totals)",
             text_table(*overall_rows(summary)), ""]
    devices = device_rows(summary) if results.get("device_model") else None
    if devices:
        parts += [device_title(results), text_table(*devices), ""]
    parts += ["Speedup over vanilla by category (median of per-prompt ratios)"
              if summary["vanilla"] else "tau by category",
              text_table(*category_rows(summary, "speedup" if summary["vanilla"] else "tau")), ""]
    if summary["vanilla"]:
        parts += ["tau by category", text_table(*category_rows(summary, "tau")), ""]
    if identity_summary(results):
        parts += [identity_title(results), text_table(*identity_rows(results)), ""]
    widths = width_rows(summary)
    if widths:
        parts += [WIDTH_TITLE, text_table(*widths), ""]
    if results.get("cost_curve"):
        parts += [cost_title(results["cost_curve"]), text_table(*cost_rows(results["cost_curve"])), ""]
    for note in [precision_note(results), batch_note(results)] + results.get("notes", []):
        if note and not note.startswith("!!!"):
            parts.append(f"note: {note}")
    for line in warnings_of(results):
        parts.append(f"!!! {line.removeprefix('!!! ')}")
    return "\n".join(parts)


def markdown_report(results: dict) -> str:
    summary, env = results["summary"], results["environment"]
    parts = [
        f"Model `{results['config']['model']}` ({results['config']['dtype']}), dataset "
        f"`{results['config']['dataset']}`, {len(results['prompts'])} prompts, "
        f"max_new_tokens={results['config']['max_new_tokens']}, batch size {results['config'].get('batch_size', 1)}, "
        + ("greedy" if results["greedy"] else f"sampling T={results['config']['temperature']}")
        + f"; {env.get('cpu_model', '?')}, {env.get('torch_threads', '?')} threads, torch {env.get('torch')}, "
          f"transformers {env.get('transformers')}, freespec {env.get('freespec')}, {env.get('date')}.",
        "",
        machine_line(env),
        "",
        *([f"**{simulated_note(results)}**", ""] if results.get("simulated") else []),
        "Speedups: median of per-prompt ratios / ratio of totals. tau: new tokens per target forward "
        "(prefill included).",
        "",
        markdown_table(*overall_rows(summary)),
        "",
    ]
    devices = device_rows(summary) if results.get("device_model") else None
    if devices:
        parts += [device_title(results) + ":", "", markdown_table(*devices), ""]
    if summary["vanilla"]:
        parts += ["Speedup over vanilla by category (median of per-prompt ratios):", "",
                  markdown_table(*category_rows(summary, "speedup")), ""]
    parts += ["tau by category:", "", markdown_table(*category_rows(summary, "tau")), ""]
    if identity_summary(results):
        parts += [identity_title(results) + ":", "", markdown_table(*identity_rows(results)), ""]
    widths = width_rows(summary)
    if widths:
        parts += [WIDTH_TITLE + ":", "", markdown_table(*widths), ""]
    if results.get("cost_curve"):
        parts += [cost_title(results["cost_curve"]) + ":", "", markdown_table(*cost_rows(results["cost_curve"])), ""]
    warnings = warnings_of(results)
    if warnings:
        parts += ["**Warnings:**", ""] + [f"- **{w.removeprefix('!!! ')}**" for w in warnings] + [""]
    notes = [n for n in [precision_note(results), batch_note(results)] + results.get("notes", [])
             if n and not n.startswith("!!!")]
    if notes:
        parts += [f"- {n}" for n in notes] + [""]
    parts += [f"Command: `{env.get('command', '')}`", ""]
    return "\n".join(parts)


# ------------------------------------------------------------------------------ files
def write_results(results: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write results.json, results.md and (with matplotlib) the PNG plots; return the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = write_plots(results, out_dir) if plots else []  # first: a missing matplotlib adds a note
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")
    written.append(path)
    path = out_dir / "results.md"
    path.write_text(markdown_report(results), encoding="utf-8")
    written.append(path)
    return written


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """speedup_by_category.png, tau_by_category.png, tau_distribution.png, cost_curve.png (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results.setdefault("notes", []).append(
            "!!! plots not written: matplotlib is not installed (pip install 'freespec[bench]')")
        return []
    summary = results["summary"]
    per = dict(summary["per_category"], overall=summary["overall"])
    labels = list(summary["overall"])
    regime = regime_title(results)
    written = []
    if summary["vanilla"]:
        speed_methods = [label for label in labels if label != summary["vanilla"]]
        if speed_methods:
            speedups = {c: {m: (per[c][m]["speedup_vs_vanilla"] or {}).get("median") for m in speed_methods if m in per[c]}
                        for c in per}
            written.append(plot_category_bars(
                plt, speedups, speed_methods, out_dir / "speedup_by_category.png",
                f"Speedup over plain decoding by category\n{regime}", "tokens/s over vanilla (median per prompt)"))
    taus = {c: {m: per[c][m]["tau"] for m in labels if m in per[c]} for c in per}
    written.append(plot_category_bars(plt, taus, labels, out_dir / "tau_by_category.png",
                                      f"tau by category\n{regime}", "tau (new tokens per target forward)", unit=""))
    written.append(plot_tau_distribution(plt, results, labels, out_dir / "tau_distribution.png"))
    if results.get("cost_curve"):
        written.append(plot_cost_curve(plt, results, out_dir / "cost_curve.png"))
    return written


# One colour per method in every plot: the methods of the published tables by name, any other label by
# the crc32 of its text, so a variant such as "freespec:mixture{ngram=true}" keeps its colour across runs.
METHOD_COLOURS = {"vanilla": "#7f7f7f", "hf-pld": "#1f77b4", "freespec": "#d62728", "arctic-suffix": "#2ca02c",
                  "freespec:mixture{recycle=false}": "#ff7f0e", "freespec:recycle": "#9467bd"}
OTHER_COLOURS = ("#8c564b", "#e377c2", "#bcbd22", "#17becf", "#393b79", "#637939")
MACHINE_COLOURS = ("#222222", "#e6550d", "#6baed6", "#756bb1")  # cost curves: machines, not methods


def method_colour(label: str) -> str:
    """``method_colour("freespec") -> "#d62728"``; an unlisted label: one of OTHER_COLOURS, always the same."""
    return METHOD_COLOURS.get(label) or OTHER_COLOURS[zlib.crc32(label.encode()) % len(OTHER_COLOURS)]


def regime_title(results: dict) -> str:
    """``qwen2.5-coder-0.5b, bfloat16, Intel Xeon ...`` and, under ``--simulate``, ``SIMULATED forward costs``."""
    env, config = results.get("environment", {}), results["config"]
    machine = env.get("gpu") or env.get("cpu_model") or "unknown machine"
    simulated = ", SIMULATED forward costs" if results.get("simulated") else ""
    return f"{config['model']}, {config.get('dtype', 'float32')}, {machine}{simulated}"


def plot_category_bars(plt, values: Mapping[str, Mapping[str, float | None]], methods: Sequence[str], path: Path,
                       title: str, xlabel: str, unit: str = "x") -> Path:
    """Horizontal bars, one group per category (top to bottom, as given) and one bar per method, each
    annotated with its value; a log axis, so one category at 8x does not flatten the others at 1.3x.
    ``values[category][method]`` (None or missing: no bar). A dashed line marks 1 (plain decoding)."""
    categories, num_methods = list(values), max(1, len(methods))
    bar = 0.8 / num_methods
    height = min(10.0, 1.8 + 0.09 * len(categories) * num_methods + 0.1 * len(categories))  # inches
    fig, ax = plt.subplots(figsize=(8.0, height))
    shown = []
    for j, method in enumerate(methods):
        ys, xs = [], []
        for i, category in enumerate(categories):
            value = values[category].get(method)
            if value is not None and value > 0:
                ys.append(i + (j - (num_methods - 1) / 2) * bar)
                xs.append(value)
        ax.barh(ys, xs, bar, color=method_colour(method), label=method)
        for y, x in zip(ys, xs):
            ax.annotate(f"{x:.2f}{unit}", (x, y), xytext=(2, 0), textcoords="offset points", va="center",
                        fontsize=6)
        shown += xs
    ax.set_xscale("log")
    low, high = min(shown + [1.0]), max(shown + [1.0])
    ax.set_xlim(low / 1.15, high * 1.45)  # room for the labels at the bars' ends
    ticks = [t for t in (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if low / 1.15 <= t <= high * 1.45]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}{unit}" for t in ticks])
    ax.minorticks_off()
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_yticks(range(len(categories)))
    ax.set_yticklabels(categories)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.55 / (height - 1.2)), ncol=min(3, num_methods),
              frameon=False)  # below the axes: never over a bar
    return _save(plt, fig, ax, title, path)


def plot_tau_distribution(plt, results: dict, labels: list[str], path: Path) -> Path:
    """A box per method of its per-prompt tau."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 2), 4.5))
    data = [[p["methods"][label]["tau"] for p in results["prompts"] if label in p["methods"]] for label in labels]
    boxes = ax.boxplot(data, showmeans=True, patch_artist=True)
    for box, label in zip(boxes["boxes"], labels):
        box.set_facecolor(method_colour(label))
        box.set_alpha(0.6)
    ax.set_xticks(range(1, len(labels) + 1))
    ax.set_xticklabels(labels, rotation=20, ha="right")
    ax.set_ylabel("tau per prompt")
    return _save(plt, fig, ax, f"Distribution of per-prompt tau\n{regime_title(results)}", path)


def plot_cost_curve(plt, results: dict, path: Path) -> Path:
    """The run's probe: c(k) against k, the one-token time and the machine in the legend."""
    cost_curve, env = results["cost_curve"], results["environment"]
    machine = env.get("gpu") or env.get("cpu_model", "?")
    label = f"{machine} ({cost_curve['ms'][0]:.1f} ms at k=1)"
    title = (f"Cost of a forward: {results['config']['model']}, {cost_curve['dtype']}, {_threads(cost_curve)}, "
             f"over {cost_curve['prefix_tokens']} cached tokens")
    return plot_cost_curves(plt, {label: (cost_curve["sizes"], cost_curve["ratios"])}, path, title)


def plot_cost_curves(plt, curves: Mapping[str, tuple[Sequence[int], Sequence[float]]], path: Path,
                     title: str) -> Path:
    """c(k) against k (log2 axis) for each machine: ``curves[label] = (sizes, ratios)``, ratios relative to
    k=1. A flat curve (AMX or a GPU in bfloat16) is where wide draft trees pay; a dashed line marks 1."""
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    sizes = sorted({k for ks, _ in curves.values() for k in ks if k & (k - 1) == 0})  # 17 and 33 unlabelled
    for i, (label, (ks, ratios)) in enumerate(curves.items()):
        ax.plot(ks, ratios, marker="o", markersize=4, label=label, color=MACHINE_COLOURS[i % len(MACHINE_COLOURS)])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(k) for k in sizes], fontsize="small")
    ax.minorticks_off()
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("k: tokens fed to one forward")
    ax.set_ylabel("c(k): forward time / one-token forward time")
    ax.legend(fontsize="small", loc="upper left")
    return _save(plt, fig, ax, title, path)


def _save(plt, fig, ax, title: str, path: Path) -> Path:
    """Title, layout, a 120-dpi PNG at ``path``; the figure closed."""
    ax.set_title(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
