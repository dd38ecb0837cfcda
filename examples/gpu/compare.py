"""The drafter comparison of ``freespec bench``, on a GPU: HF generate() in bfloat16, every method interleaved.

    python examples/gpu/compare.py --model qwen2.5-coder-0.5b --device cuda \\
        --dataset spec_bench_dev.jsonl --max-new-tokens 128 --out runs/gpu

What it answers: the CPU this project is developed on verifies 4 tokens at
~1.9x the cost of one in float32 (``CostModel``), so token recycling's trees
are cut to 1-3 nodes there and lookahead's window rarely rides; on a GPU the
cost of a forward is nearly flat up to dozens of tokens, which is where the
published 60-80-node recycling trees and lookahead's W x N window were tuned.
The same drafters, sized by the same live cost model, should grow their trees
here by themselves; this script measures whether they do and what it buys.

It runs the methods of ``freespec bench`` (``--methods``; by default plain
decoding, HF prompt lookup, the lookup-only mixture, the default mixture,
token recycling alone, lookahead alone and arctic-suffix, SuffixDecoding's
drafter, where arctic-inference is installed) on the same prompts in one
process, interleaved per prompt, compares greedy outputs with plain decoding
(in float32 a difference fails the run unless ``--allow-mismatch``; in
bfloat16/float16, where a tree's shape changes rounding, differences are
reported and fail it only with ``--require-identical``, as in ``freespec
bench``), and prints tau, tokens/s and speedups per category and the
measured cost curve c(k) (the ``freespec bench`` report; results.json and
results.md go to ``--out``).
Everything runs on ``--device`` (``cuda``, ``cuda:1``, or ``cpu`` to try it
without a GPU: ``tests/test_gpu_example.py`` runs it on a tiny model).
"""

from __future__ import annotations

import argparse
import shlex
import sys

DEFAULT_METHODS = (
    "vanilla,hf-pld,freespec:mixture{recycle=false},freespec,freespec:recycle,freespec:lookahead,arctic-suffix"
)


def compare(model, tokenizer, dataset: str, methods: str = DEFAULT_METHODS, limit: int | None = None,
            max_new_tokens: int = 128, out: str | None = None, argv: list[str] | None = None,
            cost_probe: bool = True, script: str = "examples/gpu/compare.py") -> dict:
    """Run the comparison with ``model`` (already on its device) and return ``freespec bench``'s results dict.

    ``argv``: the command line of ``script`` to record (default: this process's). ``cost_probe``: measure the
    cost curve c(k) first (``freespec.bench.cost.measure_cost_curve``), as ``freespec bench`` does.
    """
    from freespec.bench.cost import measure_cost_curve
    from freespec.bench.datasets import load_dataset
    from freespec.bench.environment import environment
    from freespec.bench.methods import parse_methods
    from freespec.bench.report import summarize, write_results
    from freespec.bench.runner import run_bench

    specs = parse_methods(methods)
    items = load_dataset(dataset, limit=limit)
    cost_curve = measure_cost_curve(model) if cost_probe else None
    run = run_bench(model, tokenizer, items, specs, max_new_tokens=max_new_tokens, progress=False)
    labels = [m.label for m in specs if m.label not in run.unavailable]
    env = environment()
    env["command"] = shlex.join(["python", script] + list(sys.argv[1:] if argv is None else argv))
    env["device"] = str(model.device)
    if model.device.type == "cuda":
        import torch

        env["gpu"] = torch.cuda.get_device_name(model.device)
    results = {
        "config": {"model": getattr(model.config, "_name_or_path", "") or type(model).__name__,
                   "dataset": dataset, "methods": [m.label for m in specs], "limit": limit,
                   "max_new_tokens": max_new_tokens, "dtype": str(model.dtype).removeprefix("torch."),
                   "temperature": 0.0, "device": str(model.device)},
        "environment": env, "greedy": run.greedy, "reference": run.reference, "unavailable": run.unavailable,
        "mismatches": run.mismatches, "notes": run.notes, "summary": summarize(run.prompts, labels),
        "cost_curve": cost_curve, "prompts": run.prompts,
    }
    if out is not None:
        write_results(results, out, plots=False)
    return results


def parse_checked(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments and ``--allow-mismatch`` / ``--require-identical`` (as ``freespec bench``), parsed;
    both at once exit 2 naming them."""
    from freespec.cli import add_mismatch_arguments, check_mismatch_arguments

    add_mismatch_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_mismatch_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    from freespec.cli import mismatch_fails

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="registered name or local path")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--dataset", required=True, help="Spec-Bench JSONL or builtin:NAME (as freespec bench)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="as freespec bench (default: %(default)s)")
    parser.add_argument("--limit", type=int, help="at most N items, round-robin over categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="write results.json and results.md here")
    parser.add_argument("--no-cost-probe", action="store_true", help="skip measuring the cost curve c(k) first")
    args = parse_checked(parser, argv)

    import torch

    from freespec import models
    from freespec.bench.report import console_report

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu to try it here)")
    model, tokenizer = models.load(args.model, getattr(torch, args.dtype))
    model.to(args.device)
    print(f"{args.model} ({args.dtype}) on {model.device}", flush=True)
    results = compare(model, tokenizer, args.dataset, args.methods, args.limit, args.max_new_tokens, args.out, argv,
                      cost_probe=not args.no_cost_probe)
    print(console_report(results))
    return 1 if results["mismatches"] and mismatch_fails(args) else 0


if __name__ == "__main__":
    sys.exit(main())
