"""Exact greedy tau of a drafter without running the model, and its speed on a simulated machine.

Under greedy decoding the target's next token at every position is fixed by
the text so far, so the verifier keeps the longest draft path that matches
the recorded continuation, then adds one bonus token. The accepted length
depends only on the drafter's tree and the true continuation. Replaying a
recorded greedy output (``freespec bench --save-traces``) through a drafter
with the engine's budget logic therefore gives exactly the tau that
``generate()`` would measure, in milliseconds per prompt.

Forwards are counted as the engine counts them: the first forward is the
prefill, which also verifies a draft proposed from the prompt alone; each
forward commits ``min(accepted + 1, tokens left)`` tokens (the last forward
can end inside the draft at the end of the output, e.g. at EOS).

Worked example, output ``[5, 6, 7, 8]``, a drafter that always proposes the
true next two tokens: forward 1 (prefill) accepts ``5, 6`` + bonus ``7``;
forward 2 accepts ``8`` (the end); tau = 4 tokens / 2 forwards = 2.0.

**Simulated time.** Given a ``CostCurve`` (``freespec.bench.cost``), every
forward takes ``c(tokens fed) * one_token_ms``: the prefill feeds the prompt
plus its draft, later forwards the pending token plus the draft. The drafter
gets that time in ``on_forward`` as the engine would report it (so a drafter
that sizes its trees from forward times, like ``mixture``, sizes them for the
simulated machine), and the wall time of its own calls (start, propose,
on_forward, extend, stop) is measured and added. Plain decoding is simulated
the same way: the prefill of the prompt, then one token per forward at c(1).
In the example above with ``c(k) = 1 + 0.1 (k - 1)``, 10 ms per token and a
1-token prompt: forward 1 feeds 1 + 2 tokens (12 ms), forward 2 feeds 1 + 1
(11 ms): 23 ms plus the drafter's time; plain decoding: 4 forwards at c(1), 40 ms.

Exact for drafters that do not read logits: a drafter with
``observe_top_k > 0`` gets no ``observe`` calls here (there are no logits),
and the result says so.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..config import SpecConfig
from ..draft import Draft
from ..drafters.base import Drafter, ForwardReport
from ..tree import follow
from .cost import CostCurve
from .jsonl import read_jsonl


def load_traces(path: str | Path) -> list[dict]:
    """Traces written by ``freespec bench --save-traces``: one JSON object per line."""
    return read_jsonl(path, check_trace, "trace")


def check_trace(trace: dict) -> dict:
    """``trace`` if it has a prompt, output ids and ``max_new_tokens`` they fit in, else ``ValueError``."""
    for key in ("prompt_ids", "output_ids", "max_new_tokens"):
        if key not in trace:
            raise ValueError(f"trace lacks {key!r}")
    if not trace["prompt_ids"]:
        raise ValueError("trace has an empty prompt")
    if len(trace["output_ids"]) > trace["max_new_tokens"]:
        raise ValueError(f"trace has {len(trace['output_ids'])} output tokens, over max_new_tokens="
                         f"{trace['max_new_tokens']}")
    return trace


def accepted_path(draft: Draft, truth: np.ndarray) -> list[int]:
    """Nodes of the longest root path whose tokens are a prefix of ``truth`` (``tree.follow``).

    ``token_ids=[5, 6, 8, 7], parents=[-1, 0, 0, 1]``, truth ``[5, 8, 9]`` -> ``[0, 2]``.
    """
    return follow(draft.parents, draft.token_ids, truth, draft.is_candidate)


def replay_one(drafter, request_id, prompt_ids: Sequence[int], output_ids: Sequence[int], max_new_tokens: int,
               config: SpecConfig, cost: CostCurve | None = None) -> dict:
    """Counters of one replayed request (the drafter is started and stopped here).

    With ``cost``: ``forward_s`` (simulated forwards), ``plain_s`` (simulated
    plain decoding) and ``drafter_s`` (measured); without, those are 0.
    """
    output = np.asarray(output_ids, np.int64)
    prompt = np.asarray(prompt_ids, np.int64)
    counts = {"new_tokens": int(output.shape[0]), "forwards": 0, "steps_with_draft": 0, "draft_tokens": 0,
              "accepted_draft_tokens": 0, "forward_s": 0.0, "drafter_s": 0.0, "plain_s": 0.0}
    def timed(method, *args):  # a drafter call, its wall time counted
        t0 = time.perf_counter()
        try:
            return method(*args)
        finally:
            counts["drafter_s"] += time.perf_counter() - t0

    timed(drafter.start, request_id, prompt)
    try:
        generated = 0
        while generated < output.shape[0]:
            budget = config.step_budget(max_new_tokens - generated)
            draft = timed(drafter.propose, request_id, budget) if budget.max_depth > 0 else Draft.empty()
            if draft.num_nodes:
                draft.validate(budget)
            truth = output[generated:]
            accepted = accepted_path(draft, truth)
            committed = min(len(accepted) + 1, truth.shape[0])
            prefill = counts["forwards"] == 0
            counts["forwards"] += 1
            if cost is not None:
                num_fed = (prompt.shape[0] if prefill else 1) + draft.num_nodes
                forward_s = cost.forward_ms(num_fed) / 1000
                counts["forward_s"] += forward_s
                timed(drafter.on_forward, ForwardReport((request_id,), (num_fed,), forward_s, prefill))
            if draft.num_nodes:
                counts["steps_with_draft"] += 1
                counts["draft_tokens"] += draft.num_nodes
                counts["accepted_draft_tokens"] += min(len(accepted), committed)
            timed(drafter.extend, request_id, truth[:committed])
            generated += committed
    finally:
        timed(drafter.stop, request_id)
    if cost is not None and output.shape[0]:
        counts["plain_s"] = (cost.forward_ms(prompt.shape[0]) + (output.shape[0] - 1) * cost.forward_ms(1)) / 1000
    return counts


_SUMMED = ("new_tokens", "forwards", "steps_with_draft", "draft_tokens", "accepted_draft_tokens", "forward_s",
           "drafter_s", "plain_s")


def _summary(counts: Iterable[dict]) -> dict:
    total = {"prompts": 0, **{key: 0 for key in _SUMMED}}
    for c in counts:
        total["prompts"] += 1
        for key in _SUMMED:
            total[key] += c[key]
    total["tau"] = total["new_tokens"] / total["forwards"] if total["forwards"] else 0.0
    total["acceptance_rate"] = (total["accepted_draft_tokens"] / total["draft_tokens"]
                                if total["draft_tokens"] else 0.0)
    simulated_s = total["forward_s"] + total["drafter_s"]
    if total["plain_s"] > 0 and simulated_s > 0:
        total.update(simulated_s=simulated_s, tokens_per_s=total["new_tokens"] / simulated_s,
                     plain_tokens_per_s=total["new_tokens"] / total["plain_s"],
                     speedup=total["plain_s"] / simulated_s)
    return total


def replay_tau(traces: Sequence[dict], drafter_factory: Callable[[], object], config: SpecConfig | None = None,
               cost: CostCurve | None = None) -> dict:
    """Exact greedy tau of the drafter from ``drafter_factory()`` on ``traces``; with ``cost``, its simulated speed.

    One drafter replays every trace in order (as one patched model serves
    successive ``generate()`` calls, so a request history fills up the same way).
    ``config`` gives ``max_draft_tokens`` and ``max_draft_depth`` (its
    ``drafter`` field is ignored). Returns ``{"overall": {...}, "per_category":
    {name: {...}}, "per_trace": [...], "notes": [...]}`` where each summary has
    ``tau``, ``new_tokens``, ``forwards``, ``steps_with_draft``, ``draft_tokens``,
    ``accepted_draft_tokens``, ``acceptance_rate`` and ``prompts``; with ``cost``
    also ``forward_s``, ``drafter_s``, ``simulated_s`` (their sum), ``plain_s``,
    ``tokens_per_s``, ``plain_tokens_per_s`` and ``speedup`` (``plain_s / simulated_s``).
    """
    config = config or SpecConfig()
    drafter = drafter_factory()
    notes = []
    if drafter.observe_top_k > 0:
        notes.append(f"{drafter.name} reads the target's top-k (observe_top_k > 0): replay makes no observe() "
                     f"calls, so its tau here is not what generate() measures")
    if cost is None and config.adaptive_budget and type(drafter).on_forward is not Drafter.on_forward:
        notes.append(f"{drafter.name} sizes drafts from forward times: without a cost curve replay reports none, "
                     f"so it drafts as before any measurement")
    drafter.warmup()
    per_trace = []
    for index, trace in enumerate(traces):
        check_trace(trace)
        counts = replay_one(drafter, ("replay", index), trace["prompt_ids"], trace["output_ids"],
                            int(trace["max_new_tokens"]), config, cost)
        counts["category"] = trace.get("category", "all")
        counts["item_id"] = trace.get("item_id", str(index))
        counts["tau"] = counts["new_tokens"] / counts["forwards"] if counts["forwards"] else 0.0
        per_trace.append(counts)
    categories: dict[str, list[dict]] = {}
    for counts in per_trace:
        categories.setdefault(counts["category"], []).append(counts)
    return {
        "overall": _summary(per_trace),
        "per_category": {name: _summary(group) for name, group in categories.items()},
        "per_trace": per_trace,
        "notes": notes,
    }


REPLAY_METRICS = {  # metric -> (title, format)
    "tau": ("greedy tau (new tokens per target forward, prefill included)", "{:.3f}"),
    "tokens_per_s": ("simulated tokens/s", "{:.1f}"),
    "speedup": ("simulated speedup over plain decoding (one token per forward at c(1))", "{:.2f}x"),
}


def format_replay_table(results: dict[str, dict], metric: str = "tau") -> str:
    """A plain-text table: one row per category (and 'overall'), one column per drafter.

    ``metric``: ``tau``, ``tokens_per_s`` (with a first column for simulated
    plain decoding) or ``speedup``; the last two need a replay with a cost curve.
    """
    from .report import text_table

    if metric not in REPLAY_METRICS:
        raise ValueError(f"metric must be one of {', '.join(REPLAY_METRICS)}, got {metric!r}")
    fmt = REPLAY_METRICS[metric][1]
    names = list(results)
    categories: list[str] = []
    for result in results.values():
        for category in result["per_category"]:
            if category not in categories:
                categories.append(category)
    plain = metric == "tokens_per_s"
    header = ["category"] + (["plain"] if plain else []) + names
    rows = []
    for category in categories + ["overall"]:
        summaries = [results[name]["overall"] if category == "overall" else results[name]["per_category"].get(category)
                     for name in names]
        row = [category]
        if plain:
            first = next(s for s in summaries if s)
            row.append(fmt.format(first["plain_tokens_per_s"]) if "plain_tokens_per_s" in first else "-")
        row += [fmt.format(s[metric]) if s and metric in s else "-" for s in summaries]
        rows.append(row)
    return text_table(header, rows)
