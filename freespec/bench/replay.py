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

**Chains.** A host that verifies one chain per step (vLLM's and SGLang's linear speculation) drops every
branch of a tree but its best path. With ``chain=True`` every budget says so (``Budget.chain``: a drafter
that sizes by cost sizes that path), the draft is cut to ``best_path()[:max_depth]`` before it is verified
and counted, and forwards are reported as a packing host reports them (``ForwardReport.packed``): the
verify steps, tau and simulated time such a host would see. Worked example: a drafter that proposes the
tree ``5 -> 6`` plus ``5 -> 9`` (``6`` the more confident), output ``[5, 6, 7]``: the chain ``5, 6`` is
verified, two nodes fed.

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
from ..draft import Budget, Draft
from ..drafters.base import Drafter, ForwardReport, VerifyOutput
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


class ReplayedRequest:
    """One recorded request stepped through a drafter, one forward at a time.

    ``propose`` asks the drafter for this step's draft (the engine's budget;
    none once no token may be drafted), ``commit`` verifies it against the
    recorded output as greedy verification would (the longest matching path,
    then the bonus token, cut at the output's end) and extends the drafter.
    Several requests stepped in turn are a batch: ``freespec replay`` steps one
    at a time, ``tests/test_soak.py`` many, interleaved, with one
    ``ForwardReport`` per simulated forward.

    ``observe_truth``: for drafters with ``observe_top_k``, call ``observe``
    with the recorded token as the target's top-1 where the output says it (the
    root and the accepted path; other nodes get their own token). That is a
    stand-in for logits to exercise the hook, not what ``generate()`` observes.
    ``call(method, *args)`` makes every drafter call (``freespec replay`` times them).
    """

    def __init__(self, drafter, request_id, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 max_new_tokens: int, config: SpecConfig, observe_truth: bool = False,
                 call: Callable = lambda method, *args: method(*args), chain: bool = False):
        self.drafter, self.request_id, self.config, self.call = drafter, request_id, config, call
        self.chain = chain
        self.prompt = np.asarray(prompt_ids, np.int64)
        self.output = np.asarray(output_ids, np.int64)
        self.max_new_tokens, self.observe_truth = max_new_tokens, observe_truth
        self.generated = 0  # output tokens committed
        self.forwards = 0

    @property
    def done(self) -> bool:
        return self.generated >= self.output.shape[0]

    def propose(self, batch_size: int = 1) -> Draft:
        budget = self.config.step_budget(self.max_new_tokens - self.generated)
        if budget.max_depth == 0:
            return Draft.empty()
        if batch_size != 1 or self.chain:
            budget = Budget(budget.num_nodes, budget.max_depth, batch_size, chain=self.chain)
        draft = self.call(self.drafter.propose, self.request_id, budget)
        if draft.num_nodes:
            draft.validate(budget)
            if self.chain:  # the host verifies the best path alone (its nodes ascend: parents come first)
                draft = draft.select(np.array(draft.best_path()[:budget.max_depth], np.int64))
        return draft

    def num_fed(self, draft: Draft) -> int:
        """Tokens this step's forward feeds: the prompt (prefill) or the pending token, plus the draft."""
        return (self.prompt.shape[0] if self.forwards == 0 else 1) + draft.num_nodes

    def commit(self, draft: Draft) -> tuple[int, int]:
        """Verify ``draft`` against the recording and extend the drafter: (accepted nodes, tokens committed)."""
        truth = self.output[self.generated:]
        accepted = accepted_path(draft, truth)
        committed = min(len(accepted) + 1, truth.shape[0])
        self.forwards += 1
        if self.observe_truth and self.drafter.observe_top_k:
            self.call(self.drafter.observe, self.request_id,
                      VerifyOutput(draft, np.asarray(accepted, np.int64), _truth_top1(draft, accepted, truth)))
        self.call(self.drafter.extend, self.request_id, truth[:committed])
        self.generated += committed
        return min(len(accepted), committed), committed


def _truth_top1(draft: Draft, accepted: list[int], truth: np.ndarray) -> np.ndarray:
    """[num_nodes + 1, 1]: the recorded next token at the root and after each accepted node, else the node's own."""
    top1 = np.concatenate([truth[:1], draft.token_ids])  # row 0: the root, row i + 1: node i
    for depth, node in enumerate(accepted, start=1):
        if depth < truth.shape[0]:
            top1[node + 1] = truth[depth]
    return top1[:, None]


def replay_one(drafter, request_id, prompt_ids: Sequence[int], output_ids: Sequence[int], max_new_tokens: int,
               config: SpecConfig, cost: CostCurve | None = None, chain: bool = False) -> dict:
    """Counters of one replayed request (the drafter is started and stopped here); ``chain``: see the module.

    With ``cost``: ``forward_s`` (simulated forwards), ``plain_s`` (simulated
    plain decoding) and ``drafter_s`` (measured); without, those are 0.
    """
    counts = {"new_tokens": len(output_ids), "forwards": 0, "steps_with_draft": 0, "draft_tokens": 0,
              "accepted_draft_tokens": 0, "forward_s": 0.0, "drafter_s": 0.0, "plain_s": 0.0}
    def timed(method, *args):  # a drafter call, its wall time counted
        t0 = time.perf_counter()
        try:
            return method(*args)
        finally:
            counts["drafter_s"] += time.perf_counter() - t0

    request = ReplayedRequest(drafter, request_id, prompt_ids, output_ids, max_new_tokens, config, call=timed,
                              chain=chain)
    timed(drafter.start, request_id, request.prompt)
    try:
        while not request.done:
            draft = request.propose()
            prefill = counts["forwards"] == 0
            counts["forwards"] += 1
            if cost is not None:
                num_fed = request.num_fed(draft)
                forward_s = cost.forward_ms(num_fed) / 1000
                counts["forward_s"] += forward_s
                timed(drafter.on_forward, ForwardReport((request_id,), (num_fed,), forward_s, prefill, packed=chain))
            accepted, _ = request.commit(draft)
            if draft.num_nodes:
                counts["steps_with_draft"] += 1
                counts["draft_tokens"] += draft.num_nodes
                counts["accepted_draft_tokens"] += accepted
    finally:
        timed(drafter.stop, request_id)
    prompt_len, output_len = request.prompt.shape[0], request.output.shape[0]
    if cost is not None and output_len:
        counts["plain_s"] = (cost.forward_ms(prompt_len) + (output_len - 1) * cost.forward_ms(1)) / 1000
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
               cost: CostCurve | None = None, chain: bool = False) -> dict:
    """Exact greedy tau of the drafter from ``drafter_factory()`` on ``traces``; with ``cost``, its simulated speed.

    One drafter replays every trace in order (as one patched model serves
    successive ``generate()`` calls, so a request history fills up the same way).
    ``config`` gives ``max_draft_tokens`` and ``max_draft_depth`` (its
    ``drafter`` field is ignored); ``chain``: the host verifies one chain a step (see the module). Returns ``{"overall": {...}, "per_category":
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
                            int(trace["max_new_tokens"]), config, cost, chain)
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
