"""Exact greedy tau of a drafter without running the model: replay recorded outputs.

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

Exact for drafters that do not read logits. A drafter with
``observe_top_k > 0`` gets no ``observe`` calls here (there are no logits),
and with ``adaptive_budget`` a drafter that sizes trees from measured
forward times (``on_forward``) sees none: the result notes both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..config import SpecConfig
from ..draft import Draft
from ..drafters.base import Drafter
from ..tree import follow
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
               config: SpecConfig) -> dict:
    """Counters of one replayed request (the drafter is started and stopped here)."""
    output = np.asarray(output_ids, np.int64)
    prompt = np.asarray(prompt_ids, np.int64)
    counts = {"new_tokens": int(output.shape[0]), "forwards": 0, "steps_with_draft": 0, "draft_tokens": 0,
              "accepted_draft_tokens": 0}
    drafter.start(request_id, prompt)
    try:
        generated = 0
        while generated < output.shape[0]:
            remaining = max_new_tokens - generated
            budget = config.step_budget(remaining)
            draft = drafter.propose(request_id, budget) if budget.max_depth > 0 else Draft.empty()
            if draft.num_nodes:
                draft.validate(budget)
            truth = output[generated:]
            accepted = accepted_path(draft, truth)
            committed = min(len(accepted) + 1, truth.shape[0])
            counts["forwards"] += 1
            if draft.num_nodes:
                counts["steps_with_draft"] += 1
                counts["draft_tokens"] += draft.num_nodes
                counts["accepted_draft_tokens"] += min(len(accepted), committed)
            drafter.extend(request_id, truth[:committed])
            generated += committed
    finally:
        drafter.stop(request_id)
    return counts


def _summary(counts: Iterable[dict]) -> dict:
    total = {"prompts": 0, "new_tokens": 0, "forwards": 0, "steps_with_draft": 0, "draft_tokens": 0,
             "accepted_draft_tokens": 0}
    for c in counts:
        total["prompts"] += 1
        for key in total:
            if key != "prompts":
                total[key] += c[key]
    total["tau"] = total["new_tokens"] / total["forwards"] if total["forwards"] else 0.0
    total["acceptance_rate"] = (total["accepted_draft_tokens"] / total["draft_tokens"]
                                if total["draft_tokens"] else 0.0)
    return total


def replay_tau(traces: Sequence[dict], drafter_factory: Callable[[], object], config: SpecConfig | None = None) -> dict:
    """Exact greedy tau of the drafter from ``drafter_factory()`` on ``traces``.

    One drafter replays every trace in order (as one patched model serves
    successive ``generate()`` calls, so shared corpora fill up the same way).
    ``config`` gives ``max_draft_tokens`` and ``max_draft_depth`` (its
    ``drafter`` field is ignored). Returns ``{"overall": {...}, "per_category":
    {name: {...}}, "per_trace": [...], "notes": [...]}`` where each summary has
    ``tau``, ``new_tokens``, ``forwards``, ``steps_with_draft``, ``draft_tokens``,
    ``accepted_draft_tokens``, ``acceptance_rate`` and ``prompts``.
    """
    config = config or SpecConfig()
    drafter = drafter_factory()
    notes = []
    if drafter.observe_top_k > 0:
        notes.append(f"{drafter.name} reads the target's top-k (observe_top_k > 0): replay makes no observe() "
                     f"calls, so its tau here is not what generate() measures")
    if config.adaptive_budget and type(drafter).on_forward is not Drafter.on_forward:
        notes.append(f"{drafter.name} sizes drafts from measured forward times: replay has none, so it uses the "
                     f"fixed budget (max_draft_tokens={config.max_draft_tokens})")
    drafter.warmup()
    per_trace = []
    for index, trace in enumerate(traces):
        check_trace(trace)
        counts = replay_one(drafter, ("replay", index), trace["prompt_ids"], trace["output_ids"],
                            int(trace["max_new_tokens"]), config)
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


def format_replay_table(results: dict[str, dict]) -> str:
    """A plain-text table: one row per category (and 'overall'), one tau column per drafter."""
    names = list(results)
    categories: list[str] = []
    for result in results.values():
        for category in result["per_category"]:
            if category not in categories:
                categories.append(category)
    width = max([len("category")] + [len(c) for c in categories] + [len("overall")])
    columns = [max(len(n), 6) for n in names]
    lines = ["  ".join([f"{'category':<{width}}"] + [f"{n:>{w}}" for n, w in zip(names, columns)])]
    for category in categories + ["overall"]:
        row = [f"{category:<{width}}"]
        for name, w in zip(names, columns):
            summary = (results[name]["overall"] if category == "overall"
                       else results[name]["per_category"].get(category))
            row.append(f"{summary['tau']:>{w}.3f}" if summary else f"{'-':>{w}}")
        lines.append("  ".join(row))
    return "\n".join(lines)
