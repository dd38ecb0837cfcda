"""The ``freespec`` command: ``freespec demo``, ``freespec bench`` and ``freespec replay``.

    freespec bench --model smollm2-135m --dataset builtin:code-edit \\
        --methods vanilla,hf-pld,freespec,freespec:suffix{min_match=3} --limit 20 --out runs/code-edit
    freespec replay runs/code-edit/traces.jsonl --drafters prompt_lookup,suffix --cost-curve runs/code-edit/results.json

``freespec bench`` sets ``OMP_WAIT_POLICY=PASSIVE`` before torch is imported
unless the variable is already set: with OpenMP's default busy-waiting, threads
that spin while other processes want the cores can collapse throughput on a
shared machine. ``export OMP_WAIT_POLICY=ACTIVE`` to measure the other way.
This module imports torch only inside the commands, after that.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_MISMATCH = 1
EXIT_BAD_INPUT = 2

METHODS_HELP = """\
comma-separated methods (commas inside {...} do not split):
  vanilla                  plain generate() of the unpatched model
  hf-pld[:N]               transformers' prompt lookup, prompt_lookup_num_tokens=N (default 10)
  freespec                 freespec.patch(model) with the default SpecConfig
  freespec:NAME            a registered drafter (prompt_lookup, suffix, ...)
  freespec:NAME{k=v,...}   SpecConfig fields (max_draft_tokens, max_draft_depth, adaptive_budget)
                           configure the engine; other keys are drafter options,
                           e.g. freespec:suffix{min_match=3,max_draft_tokens=32}
  freespec{prediction=true} also passes each item's prediction (builtin:code-edit: the
                           code shown) as generate(prediction=...)
  arctic-suffix[{k=v,...}] Snowflake's SuffixDecoding drafter under freespec's verifier
                           (needs: pip install 'freespec[peers]')
quote the list in a shell: --methods 'vanilla,freespec:suffix{min_match=3}'"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freespec", description="freespec: model-free speculative decoding")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_bench_parser(sub)
    demo = sub.add_parser("demo", help="a real model generates with and without speculation, side by side",
                          description="Load an offline model, generate greedily with plain generate() and with "
                                      "freespec, print both outputs, whether they are identical, tokens/s and tau.")
    demo.add_argument("--model", default="smollm2-135m", help="registered name or path (default: %(default)s)")
    demo.add_argument("--prompt", help="the user message (default: a code-rewrite request)")
    demo.add_argument("--max-new-tokens", type=int, default=160, help="(default: %(default)s)")
    demo.add_argument("--drafter", help="drafter name (default: SpecConfig's default)")
    _add_replay_parser(sub)
    return parser


def _add_bench_parser(sub) -> None:
    bench = sub.add_parser(
        "bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="measure methods on the same prompts, interleaved, in one process",
        description="Run every method on the same prompts in one process, interleaved per prompt (ABAB/BABA), "
                    "after a warm-up; check greedy outputs are token-identical to vanilla; report tau, tokens/s, "
                    "wall and CPU seconds and speedups per category, and the machine's cost curve c(k) (time of "
                    "a forward feeding k tokens over a one-token forward). Sets OMP_WAIT_POLICY=PASSIVE unless "
                    "it is already set.",
        epilog=METHODS_HELP)
    bench.add_argument("--model", required=True, help="registered name (freespec.models.available()) or a path")
    bench.add_argument("--dataset", required=True,
                       help="Spec-Bench JSONL path, or builtin:code-edit | builtin:rag | builtin:multi-turn-edit")
    bench.add_argument("--methods", default="vanilla,hf-pld,freespec", help="see below (default: %(default)s)")
    bench.add_argument("--limit", type=int, help="at most N items, taken round-robin over categories")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--max-new-tokens", type=int, default=256, help="per prompt (default: %(default)s)")
    bench.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16", "float16"),
                       help="(default: %(default)s) in bfloat16/float16 speculation may depart from plain decoding "
                            "(rounding): differences are reported, and fail the run only with --require-identical")
    bench.add_argument("--batch-size", type=int, default=1, metavar="B",
                       help="run every method on left-padded batches of B prompts (vanilla: plain batched "
                            "generate(); hf-pld has no batch mode and is skipped for B > 1) (default: %(default)s)")
    bench.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    bench.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: derived from it)")
    bench.add_argument("--threads", type=int, help="torch.set_num_threads(N) (default: torch's choice)")
    bench.add_argument("--save-traces", action="store_true",
                       help="write traces.jsonl (prompt ids, greedy output ids, category) for freespec replay")
    add_mismatch_arguments(bench)
    bench.add_argument("--no-warmup", action="store_true", help="skip the warm-up generate() of each method")
    bench.add_argument("--simulate", metavar="PATH|PAIRS",
                       help="simulate another machine live: every target forward is charged c(k) x the one-token "
                            "time of this cost curve (a bench results.json, e.g. an AMX CPU's or a GPU's, or k:c "
                            "pairs) instead of its measured time; outputs, drafts and the time outside forwards are "
                            "real, and freespec's cost model learns the simulated curve; batch size 1")
    bench.add_argument("--one-token-ms", type=float, metavar="MS",
                       help="with --simulate: time of a one-token forward (default: the results.json's, else 100)")
    bench.add_argument("--device-model", metavar="SPEC",
                       help="with --simulate: charge every method's tensor work on the model's device outside "
                            "forwards (kernels, bytes moved, copies, round trips, counted per call) at a stated "
                            "device's prices instead of this machine's: a preset (h200, h100, a100, l4), key=value "
                            "pairs (bandwidth=3000GB/s,launch_us=10[,link=25GB/s,round_trip_us=10]) or a preset "
                            "with changes (a100,launch_us=8); see docs/benchmarking.md")
    bench.add_argument("--no-cost-probe", action="store_true",
                       help="skip measuring the cost curve c(k) before the prompts (~20 s on smollm2-135m)")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--out", required=True, help="output directory")


def _add_replay_parser(sub) -> None:
    replay = sub.add_parser(
        "replay", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="exact greedy tau of drafters from recorded outputs, and their speed on a simulated machine",
        description="Replay greedy outputs recorded by `freespec bench --save-traces` through drafters, with the "
                    "engine's budget logic: the exact tau generate() would measure, for drafters that do not "
                    "read logits. With --cost-curve, also simulated tokens/s and speedup over plain decoding: "
                    "each forward takes c(tokens fed) x the one-token time, plus the drafter's measured time.",
        epilog="drafters: NAME or NAME{k=v,...} (as freespec:NAME in bench), or arctic-suffix[{...}]; "
               "e.g. --drafters 'prompt_lookup,suffix{min_match=3},arctic-suffix'\n"
               "cost curve: a results.json of freespec bench (its measured curve and one-token time), or k:c "
               "pairs relative to k=1, e.g. --cost-curve 1:1,2:1.16,4:1.06,8:1.04,16:1.14,32:1.29,64:1.69")
    replay.add_argument("traces", help="traces.jsonl written by freespec bench --save-traces")
    replay.add_argument("--drafters", required=True, help="comma-separated drafter specs")
    replay.add_argument("--max-draft-tokens", type=int, help="default: SpecConfig's")
    replay.add_argument("--max-draft-depth", type=int, help="default: SpecConfig's")
    replay.add_argument("--cost-curve", metavar="PATH|PAIRS",
                        help="simulate a machine: a bench results.json or k:c pairs (see below)")
    replay.add_argument("--one-token-ms", type=float, metavar="MS",
                        help="time of a one-token forward (default: the results.json's, else 100)")
    replay.add_argument("--chain", action="store_true",
                        help="the host verifies one chain a step, as vLLM does: every draft is cut to its best "
                             "path and drafters that size by cost size that path (with --max-draft-tokens K "
                             "--max-draft-depth K: vLLM's num_speculative_tokens K)")
    replay.add_argument("--json", help="also write the full results to this JSON file")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        if args.command == "bench":
            return bench_command(args, argv)
        if args.command == "demo":
            return demo_command(args)
        return replay_command(args)
    except ValueError as exc:
        print(f"freespec {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


# ------------------------------------------------------------------------------ demo
def demo_command(args) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    print(_set_omp_wait_policy())
    from .demo import DEFAULT_PROMPT, run_demo

    result = run_demo(args.model, args.prompt or DEFAULT_PROMPT, args.max_new_tokens, args.drafter)
    return 0 if result["identical"] else EXIT_MISMATCH


# ------------------------------------------------------------------------------ bench
def bench_command(args, argv=None) -> int:
    omp_note = _set_omp_wait_policy()
    methods, categories, items = _bench_inputs(args)  # every argument is checked before the model loads
    simulate = _simulated_curve(args)
    device_model = _device_model(args)

    import torch

    from . import models
    from .bench.datasets import PLAIN_FORMAT_NOTE, has_chat_template
    from .bench.runner import run_bench

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(omp_note)
    print(f"loading {args.model} ({args.dtype}) ...", flush=True)
    model, tokenizer = models.load(args.model, getattr(torch, args.dtype))
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer: the benchmark needs one to build prompts")
    notes = [omp_note]
    if not has_chat_template(tokenizer):
        notes.append(PLAIN_FORMAT_NOTE)
        print(f"note: {PLAIN_FORMAT_NOTE}")
    cost_curve = None if args.no_cost_probe else _probe_costs(model, args.batch_size)
    num_prompts = sum(len(item.turns) for item in items)
    print(f"{len(items)} items, {num_prompts} prompts, batch size {args.batch_size}, methods: "
          f"{', '.join(m.label for m in methods)}; {torch.get_num_threads()} threads", flush=True)

    if simulate is not None:
        print(f"simulating a machine: {simulate.describe()}", flush=True)
    if device_model is not None:
        print(f"tensor work on the device charged by the model {device_model.describe()}", flush=True)
    run = run_bench(model, tokenizer, items, methods, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, seed=args.seed, warmup=not args.no_warmup,
                    save_traces=args.save_traces, progress=not args.no_progress, batch_size=args.batch_size,
                    simulate=simulate, device_model=device_model)
    results = _bench_results(args, argv, methods, categories, run, notes, cost_curve)
    if simulate is not None:
        results["simulated"] = {"sizes": list(simulate.sizes), "ratios": list(simulate.ratios),
                                "one_token_ms": simulate.one_token_ms, "source": simulate.source,
                                "description": simulate.describe()}
    if device_model is not None:
        results["device_model"] = device_model.as_dict()
    return _write_bench_outputs(args, results, run)


def _probe_costs(model, batch_size: int = 1) -> dict:
    """The cost curve of this model, dtype, thread count and batch size, measured before the prompts."""
    from .bench.cost import measure_cost_curve

    print(f"measuring the cost curve c(k){f' at batch size {batch_size}' if batch_size > 1 else ''} "
          f"(--no-cost-probe to skip) ...", flush=True)
    cost_curve = measure_cost_curve(model, batch_size=batch_size)
    print("c(k): " + ", ".join(f"{k}:{ratio:.2f}" for k, ratio in zip(cost_curve["sizes"], cost_curve["ratios"]))
          + f" ({cost_curve['ms'][0]:.1f} ms at k=1; {cost_curve['seconds']:.1f} s)", flush=True)
    return cost_curve


def _cost_curve_argument(value: str | None, one_token_ms: float | None, option: str):
    """The ``CostCurve`` an option names (a results.json or k:c pairs), scaled by ``--one-token-ms``, or None."""
    import math

    from .bench.cost import CostCurve

    if one_token_ms is not None:
        if value is None:
            raise ValueError(f"--one-token-ms scales a cost curve: it needs {option}")
        if not (math.isfinite(one_token_ms) and one_token_ms > 0):
            raise ValueError(f"--one-token-ms must be a positive number of milliseconds, got {one_token_ms}")
    return None if value is None else CostCurve.load(value, option, one_token_ms)


def _simulated_curve(args):
    """The ``CostCurve`` of ``--simulate`` (scaled by ``--one-token-ms``), or None; checked before the model loads."""
    if args.simulate is not None and args.batch_size != 1:
        raise ValueError(f"--simulate prices one row's forwards (a cost curve of a batch of one): it needs "
                         f"--batch-size 1, got {args.batch_size}")
    return _cost_curve_argument(args.simulate, args.one_token_ms, "--simulate")


def _device_model(args):
    """The ``DeviceModel`` of ``--device-model``, or None; checked before the model loads."""
    if args.device_model is None:
        return None
    if args.simulate is None:
        raise ValueError("--device-model prices the tensor work of a simulated machine: it needs --simulate (a cost "
                         "curve for the forwards)")
    from .bench.device import DeviceModel

    return DeviceModel.parse(args.device_model)


def _bench_inputs(args):
    """(methods, categories, items) from the arguments; anything wrong raises ``ValueError`` naming it."""
    from .bench.datasets import load_dataset
    from .bench.methods import parse_methods

    methods = parse_methods(args.methods)
    if args.temperature > 0 and args.save_traces:
        raise ValueError("--save-traces records greedy outputs for replay: it needs --temperature 0")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    check_mismatch_arguments(args)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    return methods, categories, load_dataset(args.dataset, limit=args.limit, categories=categories)


def _bench_results(args, argv, methods, categories, run, notes: list[str], cost_curve: dict | None) -> dict:
    """What results.json holds."""
    import torch

    from .bench.environment import environment
    from .bench.report import identity_summary, summarize

    labels = [m.label for m in methods if m.label not in run.unavailable]
    results = {
        "config": {"model": args.model, "dataset": args.dataset, "methods": [m.label for m in methods],
                   "limit": args.limit, "categories": categories, "max_new_tokens": args.max_new_tokens,
                   "dtype": args.dtype, "temperature": args.temperature, "seed": args.seed,
                   "threads": torch.get_num_threads(), "warmup": not args.no_warmup,
                   "batch_size": args.batch_size},
        "environment": environment(argv),
        "greedy": run.greedy,
        "reference": run.reference,
        "unavailable": run.unavailable,
        "mismatches": run.mismatches,
        "notes": notes + run.notes,
        "summary": summarize(run.prompts, labels),
        "cost_curve": cost_curve,
        "prompts": run.prompts,
    }
    results["identity"] = identity_summary(results)
    return results


def _write_bench_outputs(args, results: dict, run) -> int:
    """Write the result files and print the report; the exit code."""
    from .bench.jsonl import write_jsonl
    from .bench.report import console_report, write_results

    written = write_results(results, args.out, plots=not args.no_plots)
    if args.save_traces:
        written.append(write_jsonl(run.traces, os.path.join(args.out, "traces.jsonl")))
    print()
    print(console_report(results))
    print()
    print("wrote " + ", ".join(str(p) for p in written))
    if run.mismatches and mismatch_fails(args):
        print(f"!!! {len(run.mismatches)} greedy output mismatch(es): exit code {EXIT_MISMATCH} "
              f"({'--allow-mismatch to exit 0' if args.dtype in ('float32', 'float64') else 'without --require-identical: exit 0'})",
              file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def add_mismatch_arguments(parser: argparse.ArgumentParser) -> None:
    """``--allow-mismatch`` and ``--require-identical``, read by ``mismatch_fails`` (``freespec bench``,
    ``examples/gpu/compare.py``)."""
    parser.add_argument("--allow-mismatch", action="store_true",
                        help="exit 0 even if a greedy output differs from vanilla in float32/float64 (still reported)")
    parser.add_argument("--require-identical", action="store_true",
                        help="exit 1 if a greedy output differs from vanilla in bfloat16/float16 too")


def check_mismatch_arguments(args) -> None:
    """ValueError when both ``--allow-mismatch`` and ``--require-identical`` are given."""
    if args.allow_mismatch and args.require_identical:
        raise ValueError("--allow-mismatch and --require-identical contradict each other: give one")


def mismatch_fails(args) -> bool:
    """Whether a greedy output that differs from vanilla fails the run: in float32/float64 unless
    --allow-mismatch; in bfloat16/float16 (where rounding may change the output) only with --require-identical."""
    if args.dtype in ("float32", "float64"):
        return not args.allow_mismatch
    return args.require_identical


def _set_omp_wait_policy() -> str:
    """Set OMP_WAIT_POLICY=PASSIVE unless set; say what was done (OpenMP reads it when torch loads)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} (from the environment)"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if "torch" in sys.modules:
        return ("OMP_WAIT_POLICY=PASSIVE was set, but torch was already imported in this process, so OpenMP "
                "may not have seen it: export it before starting Python")
    return "OMP_WAIT_POLICY=PASSIVE (set by freespec bench before loading torch; export OMP_WAIT_POLICY to override)"


# ------------------------------------------------------------------------------ replay
def replay_command(args) -> int:
    import dataclasses
    import json

    from .bench.methods import parse_drafters
    from .bench.replay import load_traces

    cost = _cost_curve_argument(args.cost_curve, args.one_token_ms, "--cost-curve")
    methods = parse_drafters(args.drafters)
    traces = load_traces(args.traces)
    results, skipped = _replay_all(args, methods, traces, cost)
    _print_replay(args, traces, cost, results, skipped)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"traces": args.traces, "chain": args.chain,
                       "cost_curve": dataclasses.asdict(cost) if cost else None,
                       "results": results, "skipped": skipped}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if results else EXIT_BAD_INPUT


def _replay_all(args, methods, traces, cost) -> tuple[dict, dict]:
    """``({label: replay_tau result}, {label: why it was not replayed})``."""
    from .bench.methods import make_config, make_drafter
    from .bench.replay import replay_tau

    results, skipped = {}, {}
    for method in methods:
        label = method.label
        overrides = {}
        if args.max_draft_tokens is not None and "max_draft_tokens" not in method.spec_options:
            overrides["max_draft_tokens"] = args.max_draft_tokens
        if args.max_draft_depth is not None and "max_draft_depth" not in method.spec_options:
            overrides["max_draft_depth"] = args.max_draft_depth
        config = make_config(method).replace(**overrides)
        try:
            make_drafter(method)  # fail early (e.g. arctic-inference missing) before replaying others
        except ImportError as exc:
            skipped[label] = str(exc)
            print(f"!!! {label} NOT REPLAYED: {exc}", file=sys.stderr)
            continue
        results[label] = replay_tau(traces, lambda m=method: make_drafter(m), config, cost, args.chain)
        results[label]["config"] = {"max_draft_tokens": config.max_draft_tokens,
                                    "max_draft_depth": config.max_draft_depth}
    return results, skipped


def _print_replay(args, traces, cost, results: dict, skipped: dict) -> None:
    from .bench.replay import REPLAY_METRICS, format_replay_table

    print(f"{len(traces)} traces from {args.traces}")
    metrics = ["tau", "tokens_per_s", "speedup"] if cost is not None else ["tau"]
    for metric in metrics if results else []:
        print(f"\n{REPLAY_METRICS[metric][0]}")
        print(format_replay_table(results, metric))
    print("\ntau is exact for drafters that do not read logits; budget caps: "
          + ", ".join(f"{label}: {r['config']['max_draft_tokens']} nodes, depth {r['config']['max_draft_depth']}"
                      for label, r in results.items()))
    if args.chain:
        print("one chain a step (--chain): every draft cut to its best path, as a host that verifies chains "
              "(vLLM) does")
    if cost is not None:
        print(f"times are SIMULATED, not measured: each forward takes c(tokens fed) x one-token time, from "
              f"{cost.describe()}; c is linear between points and continues along its last segment past "
              f"k={cost.sizes[-1]}; drafters receive these times in on_forward, and their own calls' wall time "
              f"(measured here) is added")
    else:
        print("no --cost-curve: tau only (give a bench results.json or k:c pairs for simulated tokens/s)")
    for label, result in results.items():
        for note in result["notes"]:
            print(f"note: {label}: {note}")
    for label, why in skipped.items():
        print(f"!!! {label} NOT REPLAYED: {why}")


if __name__ == "__main__":
    sys.exit(main())
