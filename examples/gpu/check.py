"""The GPU check in one command: HF generate() in bfloat16, plain / HF prompt lookup / arctic-suffix / freespec.

    python examples/gpu/check.py                 # one CUDA GPU: about 5-6 minutes with qwen2.5-coder-0.5b
    python examples/gpu/check.py --cpu-dry-run   # the same path on the CPU: smollm2-135m in float32, 1 item per
                                                 # workload, 8 new tokens (tests/test_gpu_example.py: a tiny model)

Runs ``compare.py``'s comparison (``freespec bench``'s loop: methods interleaved per prompt, outputs
compared with plain decoding) on two workloads, Spec-Bench (``../shared/data/spec_bench_dev.jsonl`` from
the repository root, ``--limit-spec-bench`` items) and ``builtin:code-edit`` (``--limit-code-edit``), then
counts the host-device round trips (syncs) of every method during the first ``--sync-tokens`` new tokens
of one prompt per workload (``freespec.testing.device_ops.DeviceOps``, the counter of
``tests/test_syncs.py``: copies up and down, scalar reads, ops the host waits for). It prints one table:

    workload  method  tok/s  tau  x vanilla  x hf-pld  fwd ms  off-fwd ms  host ms  tensor ms  syncs/step

per forward: ``fwd`` the model's forward, ``off-fwd`` the rest of the step, split for freespec into host
work (Python, Numba, drafting) and tensor work on the device (``SpecStats.host_s`` / ``tensor_s``);
speedups are ratios of total tokens/s. On a GPU every forward is followed by a synchronize (a forward
hook) so that its time is the device's, not only its launches' (one more wait per forward, the same for
every method; ``--no-sync-forwards`` for tokens/s without it). results.json and results.md of each
workload go to ``--out``.

Sizing: Spec-Bench 12 items (20 prompts) x 128 new tokens and code edits 8 x 256, four methods, a 0.5B
model: 20 x ~9 s + 8 x ~10 s at HF's ~25 ms per eager forward, plus warm-ups, the cost probe and the round-trip
counts: about 5-6 minutes on one recent GPU (the first run also converts the model, about a minute more;
1.5B: about 7); within 10.

Exit status: 0 when the check ran (in bfloat16 greedy outputs may depart from plain decoding by rounding:
reported, not failed, unless ``--require-identical``), and 0 on a machine without CUDA, which says so and
runs nothing (``--cpu-dry-run`` runs the path there); 1 when an output differs where it must not; 2 on
bad arguments or a missing dataset.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec_bench_dev.jsonl"
METHODS = "vanilla,hf-pld,arctic-suffix,freespec"
EXIT_NO_CUDA = 0


def count_syncs(model, tokenizer, dataset: str, methods: str, max_new_tokens: int) -> dict[str, float | None]:
    """Per method: round trips per decode step (median over the steps between two forwards) while
    generating ``max_new_tokens`` for the first prompt of ``dataset``; None for a method that cannot run."""
    import torch

    from freespec.bench.datasets import format_prompt, load_dataset
    from freespec.bench.methods import parse_methods
    from freespec.bench.runner import MethodRunner
    from freespec.testing.device_ops import DeviceOps

    item = load_dataset(dataset, limit=1)[0]
    ids = torch.tensor([format_prompt(tokenizer, [{"role": "user", "content": item.turns[0]}])],
                       device=model.device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False, "attention_mask": torch.ones_like(ids),
                  **({} if pad is None else {"pad_token_id": pad})}
    syncs = {}
    for method in parse_methods(methods):
        runner = MethodRunner.build(method)
        if not runner.available:
            syncs[method.label] = None
            continue
        with torch.inference_mode(), DeviceOps(model) as ops:
            runner.generate(model, ids, gen_kwargs)
        steps = ops.per_step[1:-1]  # between two forwards: one decode step each
        syncs[method.label] = statistics.median(len(step) for step in steps) if steps else None
    return syncs


def workload_rows(name: str, results: dict, syncs: dict) -> list[list[str]]:
    """The table's rows of one workload, from ``compare``'s results and ``count_syncs``."""
    overall = results["summary"]["overall"]
    rows = []
    for label, m in overall.items():
        records = [p["methods"][label] for p in results["prompts"] if label in p["methods"]]
        forwards = sum(r["forwards"] for r in records)
        forward_ms = 1e3 * sum(r["wall_s"] - r["outside_forward_s"] for r in records) / forwards if forwards else None
        speedup = [(m.get(key) or {}).get("total") for key in ("speedup_vs_vanilla", "speedup_vs_hf_pld")]
        rows.append([name, label, f"{m['tokens_per_s']:.1f}", f"{m['tau']:.2f}", *(_fmt(s, "x") for s in speedup),
                     _fmt(forward_ms), _fmt(m.get("outside_forward_ms_per_forward")),
                     _fmt(m.get("host_ms_per_forward")), _fmt(m.get("tensor_ms_per_forward")),
                     _fmt(syncs.get(label), spec=".0f")])
    return rows


HEADER = ["workload", "method", "tok/s", "tau", "x vanilla", "x hf-pld", "fwd ms", "off-fwd ms", "host ms",
          "tensor ms", "syncs/step"]


def _fmt(value, suffix: str = "", spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from compare import compare, parse_checked

    from freespec.cli import mismatch_fails

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name or local path (0.5-1.5B)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        help="default: bfloat16 (float32 with --cpu-dry-run)")
    parser.add_argument("--methods", default=METHODS, help="as freespec bench (default: %(default)s)")
    parser.add_argument("--spec-bench", default=str(SPEC_BENCH), help="Spec-Bench JSONL (default: %(default)s)")
    parser.add_argument("--limit-spec-bench", type=int, default=12)
    parser.add_argument("--limit-code-edit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Spec-Bench (code edits: twice as many)")
    parser.add_argument("--sync-tokens", type=int, default=32, help="new tokens of the round-trip count")
    parser.add_argument("--no-sync-forwards", action="store_true", help="no synchronize after each forward")
    parser.add_argument("--out", default="runs/gpu-check", help="results per workload (default: %(default)s)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run on the CPU with 1 item per workload and 8 new tokens (smollm2-135m unless --model, "
                             "float32 unless --dtype)")
    args = parse_checked(parser, argv)

    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu check: torch sees no CUDA device on this machine; nothing to run "
              "(--cpu-dry-run runs the same path on the CPU with tiny limits)")
        return EXIT_NO_CUDA
    if args.cpu_dry_run:
        if args.model == parser.get_default("model"):
            args.model = "smollm2-135m"
        args.dtype = args.dtype or "float32"
        args.limit_spec_bench, args.limit_code_edit, args.max_new_tokens, args.sync_tokens = 1, 1, 8, 8
    args.dtype = args.dtype or "bfloat16"
    if not Path(args.spec_bench).is_file():
        print(f"gpu check: no Spec-Bench file at {args.spec_bench} (--spec-bench PATH)", file=sys.stderr)
        return 2

    from freespec import models
    from freespec.bench.report import text_table

    device = "cpu" if args.cpu_dry_run else "cuda"
    model, tokenizer = models.load(args.model, getattr(torch, args.dtype))
    model.to(device)
    if device == "cuda" and not args.no_sync_forwards:
        model.register_forward_hook(lambda *_: torch.cuda.synchronize(model.device))
    name = torch.cuda.get_device_name(model.device) if device == "cuda" else "CPU (dry run)"
    print(f"gpu check: {args.model} ({args.dtype}) on {name}", flush=True)
    workloads = [("spec-bench", args.spec_bench, args.limit_spec_bench, args.max_new_tokens),
                 ("code-edit", "builtin:code-edit", args.limit_code_edit, 2 * args.max_new_tokens)]
    rows, failed = [], False
    for i, (workload, dataset, limit, max_new_tokens) in enumerate(workloads):
        print(f"== {workload}: {limit} items, {max_new_tokens} new tokens", flush=True)
        results = compare(model, tokenizer, dataset, args.methods, limit, max_new_tokens,
                          str(Path(args.out) / workload), argv, cost_probe=i == 0 and not args.cpu_dry_run,
                          script="examples/gpu/check.py")
        syncs = count_syncs(model, tokenizer, dataset, args.methods, args.sync_tokens)
        rows += workload_rows(workload, results, syncs)
        for label, count in syncs.items():
            if device == "cuda" and label.startswith("freespec") and count is not None and count > 2:
                print(f"!!! {label} made {count:g} host-device round trips a decode step on {workload}: more "
                      f"than the two (one copy up, one down) it should")
        if results["mismatches"]:
            print(f"{len(results['mismatches'])} greedy output(s) differ from vanilla on {workload}"
                  f"{' (bfloat16/float16 rounding: reported)' if args.dtype != 'float32' else ''}")
            failed = failed or mismatch_fails(args)
    print()
    print(text_table(HEADER, rows))
    print("per forward; speedups: ratios of total tokens/s; host/tensor: freespec's split of off-fwd; syncs/step: "
          "host-device round trips per decode step (median)"
          + ("; on a CPU freespec verifies row by row (one read per node): a GPU run verifies the whole tree "
             "on the device" if device == "cpu" else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
