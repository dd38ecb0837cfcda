"""The serving comparison on vLLM 0.34 (run by vllm_compare.sh where vLLM 0.34 is installed): plain vLLM, vLLM
``ngram``, vLLM ``suffix`` and freespec, one engine each in turn, one table.

It is ``python -m freespec.integrations.vllm.bench`` with what vLLM 0.34 changed, and nothing else:

- freespec's method is ``{"method": "freespec"}`` (``freespec.integrations.vllm.speculative_config``), not
  ``custom_class``, which 0.34 removed;
- ``suffix`` is vLLM's own device-side speculator, so arctic-inference is not asked for;
- the propose() timer finds the V2 runner's ``speculator`` (``runner_proposer``) where 0.32-0.33 had ``drafter``.
  It counts each call's CPU time; the V2 speculators take tensors, so the rows it drafted for are not counted
  and the table's per-request column stays empty.

The engines, prompts, order (plain, ngram, suffix, freespec, then in reverse), phases and table are the
benchmark's own (``integrations/serving_bench.py``); each engine runs in a child process of this script, which
applies the same three changes to the benchmark module before it runs it.

    python examples/gpu/vllm034_compare.py --model qwen2.5-coder-0.5b --dtype bfloat16 --compile --out runs/x
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def adapt(bench) -> None:
    """The benchmark module, made to run on vLLM 0.34 (module docstring); a no-op on 0.32-0.33."""
    from freespec.integrations.vllm import speculative_config, version

    if version.path_of(version.installed_version()) != version.SPECULATOR:
        return
    spec = speculative_config(8)
    del spec["num_speculative_tokens"]  # the benchmark sets K per engine
    bench.METHODS["freespec"] = spec
    if getattr(bench, "_propose_timer_of_the_bench", None) is None:
        bench._propose_timer_of_the_bench = bench._propose_timer
        bench._propose_timer = propose_timer


def propose_timer(worker):
    """The benchmark's propose() timer, run in the engine's worker, on the V2 runner's speculator."""
    from freespec.integrations.vllm import bench, runner_proposer

    runner = worker.model_runner
    if getattr(runner, "drafter", None) is None:
        runner.drafter = runner_proposer(runner)  # the name the benchmark's timer reads
    # the worker imported the benchmark afresh (its timer is the benchmark's own); in a process that ran adapt(),
    # the benchmark's own timer is kept aside
    return getattr(bench, "_propose_timer_of_the_bench", bench._propose_timer)(worker)


def child(argv: list) -> int:
    """One engine (the benchmark's ``--run-method``), in a process of its own."""
    from freespec.integrations.vllm import bench

    adapt(bench)
    return bench.main(argv)


def main(argv=None) -> int:
    from freespec.integrations import serving_bench
    from freespec.integrations.vllm import bench

    adapt(bench)
    parser = bench._parser()
    args = parser.parse_args(argv)
    ks = serving_bench.parse_ks(parser, args)
    counts, methods = serving_bench.check_arguments(parser, args, bench.METHODS, "vanilla", "vLLM")
    configs = serving_bench.configurations(methods, ks, lambda m: bench.METHODS[m] is not None)
    bench_command = bench._engine_command(args)

    def command(model_dir, prompts, method, k, result_path):
        found = bench_command(model_dir, prompts, method, k, result_path)
        if found[1] != "-c":
            raise RuntimeError(f"the benchmark starts an engine as {found[:3]}; this script expects python -c")
        return [found[0], "-c", "import sys, vllm034_compare; sys.exit(vllm034_compare.child(sys.argv[1:]))",
                *found[3:]]

    # the engine's workers unpickle the propose() timer by this module's name: they find it on PYTHONPATH; the
    # timer is a function sent to them (LLM.collective_rpc), which vLLM pickles only with
    # VLLM_ALLOW_INSECURE_SERIALIZATION (the engine talks to this process alone)
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    return serving_bench.benchmark(args, counts, configs, command, lambda method: env, "vLLM", "vanilla")


if __name__ == "__main__":
    sys.exit(main())
