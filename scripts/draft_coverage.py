"""Where the default mixture's drafts fall short: each step's candidates against what the model went on to emit.

    python scripts/draft_coverage.py bench --model qwen2.5-coder-0.5b \\
        --dataset ../shared/data/spec_bench_dev.jsonl --methods freespec --dtype float32 --limit 13 \\
        --max-new-tokens 128 --threads 1 --no-cost-probe --simulate 1:1,2:1.10,16:1.15,17:1.22 \\
        --one-token-ms 163.6 --out runs/coverage

runs ``freespec bench`` with those arguments (one ``mixture`` method) and records, at every step, the
*pool* (every source's candidates, merged, before the sizer keeps the best), the *kept* tree and the
tree fed (the kept one with the lookahead window hung under it), then compares each with the tokens
the request emitted from there on (greedy: the model's own continuation). Written to OUT/coverage.json
and printed:

- ``next_token``: share of steps whose pool / kept tree holds the next token (depth 1);
- ``matched``: tokens per step a greedy walk would accept in the pool / the kept tree / the fed tree with
  the window's nodes counted as candidates (they are fed at the right positions, never accepted);
- ``by_source``: per source, pool nodes whose parent was on the emitted path, how many were on it
  themselves, and the sum of their calibrated conditional probabilities (calibration at a glance);
- ``ngram``: where the pool lacks the next token, how often a 1-4-gram table over every earlier text
  of the run (prompts and outputs, the request's own included) has it among its 8 likeliest.

In float32 under a simulated curve the output is plain greedy decoding's and drafting is deterministic,
so two runs give the same numbers. A development tool: it wraps private methods of the mixture and its
sizer, and the bench's ``Drafter.stop``, for the run's duration.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import numpy as np

from freespec.tree import follow, node_depths

NGRAM_ORDERS = (4, 3, 2, 1)
NGRAM_TOP = 8


def matched(token_ids, parents, truth, usable=None) -> int:
    """Tokens of ``truth`` a greedy walk down the tree accepts (``tree.follow``; ``usable``: which nodes it may
    enter). Of equal siblings the first counts (candidates precede the window), as a verified tree's siblings are
    distinct."""
    usable = np.ones(len(token_ids), bool) if usable is None else np.array(usable, bool)
    seen = set()
    for i, sibling in enumerate(zip(np.asarray(parents).tolist(), np.asarray(token_ids).tolist())):
        if usable[i]:
            usable[i] = sibling not in seen
            seen.add(sibling)
    return len(follow(parents, token_ids, truth, usable))


class NgramCounts:
    """Next-token counts per context of 1..4 tokens, over every text added so far."""

    def __init__(self):
        self.table: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)

    def add(self, tokens: list[int], start: int, stop: int) -> None:
        for i in range(max(start, 1), stop):
            for n in NGRAM_ORDERS:
                if i - n >= 0:
                    self.table[tuple(tokens[i - n: i])][tokens[i]] += 1

    def top(self, context: list[int], k: int = NGRAM_TOP) -> list[int]:
        for n in NGRAM_ORDERS:
            found = self.table.get(tuple(context[-n:])) if len(context) >= n else None
            if found:
                return [token for token, _ in found.most_common(k)]
        return []


def coverage(steps: list[dict], finals: dict) -> dict:
    """The statistics above from recorded ``steps`` (in order) and each request's final token ids."""
    totals = collections.Counter()
    by_source: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    ngrams, seen = NgramCounts(), {}
    finals = {request: list(map(int, final)) for request, final in finals.items()}
    for step in steps:
        final = finals.get(step["request"])
        if final is None or step["context"] > len(final):
            continue
        start = seen.get(step["request"], 0)
        ngrams.add(final, start, step["context"])
        seen[step["request"]] = step["context"]
        truth = final[step["context"]:]
        if not truth:
            continue
        pool_ids, pool_parents, pool_probs, pool_sources = step["pool"]
        in_pool = matched(pool_ids, pool_parents, truth)
        in_kept = matched(*step["kept"], truth)
        fed_ids, fed_parents, fed_candidate = step["fed"]
        in_fed = matched(fed_ids, fed_parents, truth, fed_candidate)
        with_window = matched(fed_ids, fed_parents, truth)
        totals["steps"] += 1
        totals["pool_nodes"] += len(pool_ids)
        totals["kept_nodes"] += len(step["kept"][0])
        totals["pool_next"] += in_pool > 0
        totals["kept_next"] += in_kept > 0
        totals["pool_matched"] += in_pool
        totals["kept_matched"] += in_kept
        totals["fed_matched"] += in_fed
        totals["window_as_candidates_matched"] += with_window
        if in_pool == 0:
            totals["pool_misses"] += 1
            totals["ngram_has_it"] += truth[0] in ngrams.top(final[: step["context"]])
        if pool_probs is not None:
            on_path = np.zeros(len(pool_ids), bool)
            depth = node_depths(pool_parents)
            for i, (token, parent) in enumerate(zip(np.asarray(pool_ids).tolist(), np.asarray(pool_parents).tolist())):
                parent_on = parent < 0 or on_path[parent]
                if not parent_on or depth[i] > len(truth):
                    continue
                on_path[i] = truth[depth[i] - 1] == token
                row = by_source[pool_sources[i]]
                row[0] += 1
                row[1] += int(on_path[i])
                row[2] += float(pool_probs[i]) / (1.0 if parent < 0 else max(float(pool_probs[parent]), 1e-12))
    n = max(totals["steps"], 1)
    misses = max(totals["pool_misses"], 1)
    return {
        "steps": totals["steps"],
        "nodes": {"pool": totals["pool_nodes"] / n, "kept": totals["kept_nodes"] / n},
        "next_token": {"pool": totals["pool_next"] / n, "kept": totals["kept_next"] / n},
        "matched": {"pool": totals["pool_matched"] / n, "kept": totals["kept_matched"] / n,
                    "fed": totals["fed_matched"] / n,
                    "fed_window_as_candidates": totals["window_as_candidates_matched"] / n},
        "by_source": {source: {"judged": int(row[0]), "accepted": int(row[1]), "predicted": round(row[2], 1)}
                      for source, row in sorted(by_source.items())},
        "ngram": {"pool_misses": totals["pool_misses"], "in_ngram_top8": totals["ngram_has_it"],
                  "share": totals["ngram_has_it"] / misses},
    }


def _instrument(steps: list[dict], finals: dict):
    """Wrap the sizer's ``select_nodes`` (``select`` calls it), the mixture's ``_sized`` (each request's draft of a
    step, however the host asks: ``propose`` or ``propose_batch``) and ``Drafter.stop``; returns the undo."""
    from freespec.drafters import base, calibration, mixture

    select, sized, stop = calibration.DraftSizer.select_nodes, mixture.MixtureDrafter._sized, base.Drafter.stop
    contexts: dict = {}

    def recording_select(self, request_id, draft, kinds, budget, extras=((0, 0.0),)):
        kept, nodes, option = select(self, request_id, draft, kinds, budget, extras)
        if request_id in contexts:
            sources = [kind[0] if isinstance(kind, tuple) else str(kind) for kind in kinds]
            confidence = None if draft.confidence is None else draft.confidence.copy()
            steps.append({"request": request_id, "context": contexts[request_id],
                          "pool": (draft.token_ids.copy(), draft.parents.copy(), confidence, sources),
                          "kept": (kept.token_ids.copy(), kept.parents.copy())})
        return kept, nodes, option

    def recording_sized(self, request_id, budget, *args):
        contexts[request_id] = int(self.context(request_id).shape[0])
        count = len(steps)
        fed = sized(self, request_id, budget, *args)
        if len(steps) > count:
            steps[-1]["fed"] = (fed.token_ids.copy(), fed.parents.copy(), fed.candidate_mask().copy())
        return fed

    def recording_stop(self, request_id):
        if isinstance(self, mixture.MixtureDrafter):
            finals[request_id] = np.asarray(self.context(request_id)).copy()
        return stop(self, request_id)

    calibration.DraftSizer.select_nodes = recording_select
    mixture.MixtureDrafter._sized = recording_sized
    base.Drafter.stop = recording_stop

    def undo() -> None:
        calibration.DraftSizer.select_nodes, mixture.MixtureDrafter._sized, base.Drafter.stop = select, sized, stop

    return undo


def main(argv: list[str]) -> int:
    if "--out" not in argv:
        raise SystemExit("draft_coverage.py: give freespec bench's arguments, --out included")
    steps: list[dict] = []
    finals: dict = {}
    undo = _instrument(steps, finals)
    from freespec.cli import main as freespec_main

    try:
        code = freespec_main(argv)
    finally:
        undo()
    steps = [step for step in steps if "fed" in step]
    result = coverage(steps, finals)
    out = Path(argv[argv.index("--out") + 1]) / "coverage.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
