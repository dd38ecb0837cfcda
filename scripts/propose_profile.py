"""Where a step's host time goes in freespec's vLLM proposer: CPU time per request and step, split by phase.

Runs the batches of ``python -m freespec.integrations.vllm.bench --propose-cost`` (vLLM's persistent batch,
requests ending after 25 to 75 steps, ``--lifetime 50``) through freespec's proposer alone, with each phase's
function wrapped in a timer of the thread's CPU time (``time.thread_time``). A phase's time is exclusive:
what its wrapped functions nested inside it took is counted under their own phases. The wrappers cost about a
microsecond a call, so the total reads a little above ``--propose-cost``'s; ``the rest`` is what no phase
holds (the proposer's rows, budgets, chains and counters, the lock, the calls between phases). Needs vLLM
importable, as ``--propose-cost`` does (the proposer checks its version).

    python scripts/propose_profile.py                    # 1 and 32 requests, 200 steps each
    python scripts/propose_profile.py --batch-sizes 8 --steps 400
"""

from __future__ import annotations

import argparse
import sys
import time

PHASES = [  # (module, owner attribute or None for a module function, function, phase)
    ("freespec.integrations.host_requests", "HostRequests", "sync", "sync: host bookkeeping, context append"),
    ("freespec.drafters.calibration", "DraftSizer", "judge", "sync: judging the last draft (calibrator counts)"),
    ("freespec.drafters.suffix", "SuffixSource", "extend", "sync: suffix automaton, history match"),
    ("freespec.drafters.mixture", "MixtureDrafter", "_source_drafts", "draft: lookup trees (own text, history)"),
    ("freespec.drafters.mixture", None, "calibrate_lookups", "draft: calibration (kinds, path probabilities)"),
    ("freespec.drafters.mixture", None, "calibrate_lookup", "draft: calibration (kinds, path probabilities)"),
    ("freespec.drafters.mixture", None, "merge_indexed", "draft: merging the sources' trees"),
    ("freespec.drafters.mixture", "MixtureDrafter", "_sized", "draft: per-node best source, gate"),
    ("freespec.drafters.mixture", "MixtureDrafter", "_propose", "draft: per-node best source, gate"),
    ("freespec.drafters.calibration", "DraftSizer", "select_nodes", "draft: sizing (select_nodes, cost curve)"),
    ("freespec.drafters.calibration", "DraftSizer", "fit_batch", "the step's joint cut (fit_batch)"),
    ("freespec.drafters.mixture", "MixtureDrafter", "on_forward", "forward report (cost model)"),
    ("freespec.drafters.base", "Drafter", "start", "request starts (prompt indexed)"),
    ("freespec.drafters.base", "Drafter", "stop", "request exits (history indexed)"),
]
REST = "the rest (proposer rows, budgets, chains, counters)"


class PhaseTimer:
    """Exclusive thread CPU seconds per phase of the wrapped functions, counted while ``on``."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.on = False
        self._nested: list[float] = []  # per open call: the time of the wrapped calls inside it

    def wrap(self, function, phase: str):
        def timed(*args, **kwargs):
            if not self.on:
                return function(*args, **kwargs)
            began = time.thread_time()
            self._nested.append(0.0)
            try:
                return function(*args, **kwargs)
            finally:
                took, inner = time.thread_time() - began, self._nested.pop()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + took - inner
                if self._nested:
                    self._nested[-1] += took
        return timed

    def install(self) -> None:
        import importlib

        for module_name, owner_name, name, phase in PHASES:
            module = importlib.import_module(module_name)
            owner = module if owner_name is None else getattr(module, owner_name)
            if hasattr(owner, name):  # a checkout from before propose_batch names fewer (``_propose`` held _sized)
                setattr(owner, name, self.wrap(getattr(owner, name), phase))


def profile(timer: PhaseTimer, batch_size: int, steps: int, prompt_len: int = 256, k: int = 8,
            lifetime: int = 50) -> dict:
    """``{"us_per_request": total, "phases": {phase: us per request and step}}`` over steps 1.. (step 0 starts
    every request), ``timer`` installed."""
    from freespec.integrations.vllm import bench

    timer.seconds = {}
    config = bench._harness_config([batch_size], steps, prompt_len, k)
    batch, step_ids = bench._harness_steps(config, batch_size, steps, prompt_len, k, 0, lifetime)
    proposer = bench._attached_freespec_proposer(config, batch)
    total = 0.0
    for step, sampled in enumerate(step_ids):
        timer.on = step > 0
        began = time.thread_time()
        proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
        if step:
            total += time.thread_time() - began
    timer.on = False
    count = (steps - 1) * batch_size
    phases = dict(sorted(timer.seconds.items(), key=lambda item: -item[1]))
    phases[REST] = total - sum(phases.values())
    return {"us_per_request": total / count * 1e6, "phases": {name: s / count * 1e6 for name, s in phases.items()}}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    timer = PhaseTimer()
    timer.install()
    for batch_size in (int(size) for size in args.batch_sizes.split(",")):
        found = profile(timer, batch_size, args.steps)  # a fresh proposer and harness per size, as --propose-cost
        print(f"\n{batch_size} request(s): {found['us_per_request']:.1f} us per request and step")
        print("| phase | us | share |\n|---|---:|---:|")
        for phase, us in found["phases"].items():
            print(f"| {phase} | {us:.1f} | {us / found['us_per_request']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
