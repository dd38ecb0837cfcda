"""Hash every draft of a deterministic drive of the default mixture, and time its host work.

A change meant only to make drafting cheaper must leave every draft as it was. This script drives
``MixtureDrafter`` through synthetic requests with fixed forward times (no model, no clock in the
loop) and prints, per configuration, a digest of every proposed tree (tokens, parents, confidence to
5 decimals, sources, candidate flags), the accepted tokens and the drafter's CPU microseconds per
request and step (``time.thread_time``: little moved by other processes). Run it before and after a
change: the digests must match; the times say what the change saved.

Configurations: ``lookup`` (recycling and lookahead off, as under vLLM: 8 requests, 8 nodes), ``flat``
and ``steep`` (the defaults, 4 requests, 64 nodes, forward cost 1 + 0.01 (n - 1) and 1 + 0.3 (n - 1)),
``flat1`` (one request). The target's top-k, which recycling and lookahead read, is synthetic: the
true next token first where a node lies on the true continuation, hashed tokens elsewhere.

    python scripts/draft_digest.py            # every configuration
    python scripts/draft_digest.py lookup     # one
"""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np

from freespec.draft import Budget
from freespec.drafters.base import ForwardReport, VerifyOutput
from freespec.drafters.mixture import MixtureDrafter
from freespec.integrations.sglang.bench import make_requests  # Zipf phrases; outputs copy prompt spans
from freespec.tree import follow

CONFIGS = {  # name -> (mixture options, drive options)
    "lookup": ({"recycle": False, "lookahead": False}, {"num_requests": 8, "num_nodes": 8, "max_depth": 8,
                                                       "slope": 0.05}),
    "flat": ({}, {"slope": 0.01}),
    "steep": ({}, {"slope": 0.3}),
    "flat1": ({}, {"slope": 0.01, "num_requests": 1, "steps": 150}),
}


def synthetic_top_k(draft, truth: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[num_nodes + 1, k] ids and probabilities: the root's row and each node's (see the module docstring)."""
    rows = [(truth[0] if truth else None, -1)]
    for node, path in enumerate(draft.node_paths()):
        on_path = list(path) == truth[:len(path)] and len(path) < len(truth)
        rows.append((truth[len(path)] if on_path else None, int(draft.token_ids[node]) + 31 * len(path)))
    ids = np.empty((len(rows), k), np.int64)
    for r, (true_next, salt) in enumerate(rows):
        base = (salt * 2654435761 + 12345) % 49999 + 1
        ids[r] = [(base + 7 * j) % 49999 + 1 for j in range(k)]
        if true_next is not None:
            ids[r, 1:] = [token + 1 if token == true_next else token for token in ids[r, 1:].tolist()]
            ids[r, 0] = true_next
    probs = np.tile(np.linspace(0.9, 0.01, k, dtype=np.float32), (len(rows), 1))
    return ids, probs


def drive(options: dict, num_requests: int = 4, steps: int = 60, slope: float = 0.01, num_nodes: int = 64,
          max_depth: int = 48, seed: int = 0) -> tuple[str, int, float]:
    """(digest of every draft, accepted draft tokens, drafter CPU us per request and step)."""
    drafter = MixtureDrafter(**options)
    requests = make_requests(num_requests, 256, 4 * steps + 64, seed)
    ids = [f"r{i}" for i in range(num_requests)]
    for request_id, (prompt, _) in zip(ids, requests):
        drafter.start(request_id, prompt)
    digest, positions, accepted, cpu_s = hashlib.sha256(), [0] * num_requests, 0, 0.0
    for step in range(steps):
        began = time.thread_time()
        drafts = [drafter.propose(request_id, Budget(num_nodes, max_depth, num_requests)) for request_id in ids]
        widths = tuple(1 + draft.num_nodes for draft in drafts)
        drafter.on_forward(ForwardReport(tuple(ids), widths, 0.01 * (1 + slope * (max(widths) - 1)), step == 0))
        cpu_s += time.thread_time() - began
        for draft in drafts:
            for array in (draft.token_ids, draft.parents, draft.is_candidate):
                digest.update(b"-" if array is None else array.tobytes())
            digest.update(b"-" if draft.confidence is None else np.round(draft.confidence, 5).tobytes())
            digest.update(repr(draft.sources).encode())
        for r, (request_id, draft) in enumerate(zip(ids, drafts)):
            truth = requests[r][1][positions[r]:]
            path = follow(draft.parents, draft.token_ids, truth, draft.is_candidate)
            committed = truth[:len(path) + 1]
            accepted += len(path)
            observed = synthetic_top_k(draft, truth, drafter.observe_top_k) if drafter.observe_top_k else None
            began = time.thread_time()
            if observed is not None:
                drafter.observe(request_id, VerifyOutput(draft, np.asarray(path, np.int64), *observed))
            drafter.extend(request_id, np.asarray(committed, np.int64))
            cpu_s += time.thread_time() - began
            positions[r] += len(committed)
    for request_id in ids:
        drafter.stop(request_id)
    return digest.hexdigest()[:16], accepted, cpu_s / steps / num_requests * 1e6


def main(argv: list[str]) -> int:
    names = argv or list(CONFIGS)
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise SystemExit(f"draft_digest.py: unknown configuration {unknown[0]!r}; choose from {list(CONFIGS)}")
    MixtureDrafter().warmup()
    for name in names:
        options, drive_options = CONFIGS[name]
        drive(options, **{**drive_options, "steps": 3})  # compiles what warmup() did not reach
        digest, accepted, cpu_us = drive(options, **drive_options)
        print(f"{name:7s} digest {digest}  accepted {accepted:5d}  drafter CPU {cpu_us:7.0f} us per request and step")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
