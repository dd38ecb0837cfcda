"""Serving benchmark on SGLang: plain SGLang, SGLang NGRAM (its default D, and chosen D) and NGRAM with drafts
from freespec, side by side::

    python -m freespec.integrations.sglang.bench serving --device cpu --out bench_out/sglang \\
        --methods plain,ngram-default,ngram,freespec --k 8,16,32 --workloads code-edit,spec-bench,repeat
    python -m freespec.integrations.sglang.bench serving --device cpu --soak 2000 --out bench_out/sglang-soak

The runner, workloads, engine order, concurrency phases, summary and soak are
``freespec.integrations.serving_bench``'s, shared with vLLM's benchmark; this module adds how SGLang starts
(an ``sglang.Engine`` per configuration in a subprocess; ``python -m sglang.launch_server`` for the soak) and how
it is asked (``Engine.generate`` on token ids; the accepted and drafted lengths from each request's
``meta_info``: ``spec_verify_ct``, ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``). SGLang counts
D - 1 proposed tokens for every verify step, however many of the D slots a drafter filled, so the table's
mean draft length is D - 1 for every speculative method.

Methods: ``plain`` (no speculation), ``ngram-default`` (``--speculative-algorithm NGRAM`` with SGLang's own
number of draft tokens), ``ngram`` (NGRAM at each ``--k`` D), ``freespec`` (NGRAM whose drafts come from
freespec's plugin, ``FREESPEC_SGLANG_DRAFTER`` = ``--drafter``, at each D).

``--device cpu`` runs SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, float32, ``torch_native`` attention,
a KV cache of ``--max-total-tokens``). On a CPU SGLang's speculative path calls five CUDA-only ``sgl_kernel``
ops and needs tree attention in ``torch_native``: the test-support plugin ``tests/sglang_cpu`` (installed in the
test environment by ``scripts/install_sglang.sh``, switched on by ``FREESPEC_TEST_SGLANG_CPU=1``) and the
``sgl_kernel`` stand-in under ``tests/sglang_stubs`` provide them, and this module sets both for every SGLang
process it starts. On a GPU (``--device cuda``) SGLang's own kernels run and none of this is used.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .. import serving_bench
from . import options as plugin_options

METHODS = ("plain", "ngram-default", "ngram", "freespec")
TAKES_D = ("ngram", "freespec")  # the others run once, at SGLang's own setting
REPOSITORY = Path(__file__).resolve().parents[2]


def device_environment(device: str, method: str, drafter: str, config: str | None, environ=os.environ) -> dict:
    """The environment of an SGLang process for ``method`` on ``device``: the plugin's variables only for
    ``freespec`` (another method must run SGLang's own corpus), the CPU engine and its test-support stand-ins on
    ``cpu``."""
    env = {key: value for key, value in environ.items() if key not in
           (plugin_options.ENV_ENABLE, plugin_options.ENV_DRAFTER, plugin_options.ENV_CONFIG)}
    if method == "freespec":
        env[plugin_options.ENV_DRAFTER] = drafter
        if config:
            env[plugin_options.ENV_CONFIG] = str(Path(config).resolve())
    if device == "cpu":
        stubs = str(REPOSITORY / "tests" / "sglang_stubs")
        env.update(SGLANG_USE_CPU_ENGINE="1", FREESPEC_TEST_SGLANG_CPU="1",
                   PYTHONPATH=os.pathsep.join(p for p in (stubs, env.get("PYTHONPATH")) if p))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def engine_settings(device: str, dtype: str, method: str, k: int | None, max_total_tokens: int) -> dict:
    """``sglang.Engine`` keywords (``launch_server`` flags, with dashes) of one configuration."""
    settings = {"device": device, "dtype": dtype, "mem_fraction_static": 0.3, "skip_server_warmup": True}
    if device == "cpu":
        settings.update(attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
                        max_total_tokens=max_total_tokens)
    if method != "plain":
        settings["speculative_algorithm"] = "NGRAM"
        if k is not None:
            settings["speculative_num_draft_tokens"] = k
    return settings


class _SglangEngine:
    """``serving_bench.Engine`` over an ``sglang.Engine``: greedy ``generate`` on token ids; counters added up
    from each request's ``meta_info`` (verify steps, correct drafts, proposed drafts)."""

    def __init__(self, engine):
        self.engine = engine
        self.totals = {"drafts": 0, "accepted_tokens": 0, "draft_tokens": 0}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs = self.engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0,
                                                                         "max_new_tokens": max_tokens})
        for out in outs:
            meta = out["meta_info"]
            self.totals["drafts"] += meta.get("spec_verify_ct", 0)
            self.totals["accepted_tokens"] += meta.get("spec_num_correct_drafts", 0)
            self.totals["draft_tokens"] += meta.get("spec_num_proposed_drafts", 0)
        return [list(out["output_ids"]) for out in outs]

    def counters(self) -> dict:
        return dict(self.totals)


def run_method(args) -> dict:
    """One engine configuration (this process's environment already set by the parent): every workload at
    concurrency 1, then at ``batch``."""
    import sglang
    from transformers import AutoTokenizer

    engine = sglang.Engine(model_path=args.model_dir, random_seed=0, **engine_settings(
        args.device, args.dtype, args.method, args.k if args.method in TAKES_D else None, args.max_total_tokens))
    try:
        return serving_bench.run_phases(_SglangEngine(engine), json.loads(Path(args.prompts).read_text()),
                                        serving_bench.max_tokens(args), AutoTokenizer.from_pretrained(args.model_dir))
    finally:
        engine.shutdown()


def server_command(model_dir: str, port: int, settings: dict, drafter: str | None) -> list[str]:
    """``python -m sglang.launch_server`` on 127.0.0.1 with ``settings`` as flags (``--freespec-drafter``:
    the plugin's own flag)."""
    flags = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "model", *flags,
            *(["--freespec-drafter", drafter] if drafter else [])]


def soak(args, model_dir: str, out: Path) -> dict:
    """``serving_bench.soak`` through ``launch_server`` with ``--soak-method``'s speculation; for ``freespec`` the
    plugin's counters (live requests, errors, its process's memory) from the file ``FREESPEC_SGLANG_STATS``
    names (None where the plugin writes none). Writes ``soak-METHOD.json``."""
    method = args.soak_method
    log_path, stats_path = out / f"soak-{method}-server.log", out / f"soak-{method}-plugin-stats.json"
    settings = engine_settings(args.device, args.dtype, method, args.soak_d if method in TAKES_D else None,
                               args.max_total_tokens)
    drafter = args.drafter if method == "freespec" else None
    env = {**device_environment(args.device, method, args.drafter, args.freespec_config),
           plugin_options.ENV_STATS: str(stats_path)}
    server = serving_bench.serve(lambda port: server_command(model_dir, port, settings, drafter), env, log_path,
                                 900.0, "SGLang")
    ours = method == "freespec"
    result = serving_bench.soak(
        server, args.soak, args.soak_clients, serving_bench.soak_prompts(args.spec_bench_path),
        plugin_stats=lambda: serving_bench.read_plugin_stats(stats_path) if ours else None,
        idle_stats=lambda: serving_bench.idle_plugin_stats(stats_path) if ours else None)
    result = {"method": method, **result}
    (out / f"soak-{method}.json").write_text(json.dumps(result, indent=1))
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m freespec.integrations.sglang.bench serving",
                                     description=__doc__.split("\n\n")[0])
    serving_bench.add_arguments(parser, ",".join(METHODS), "bench_out/sglang",
                                k_name="D (--speculative-num-draft-tokens)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--drafter", default="mixture", help="freespec's drafter (FREESPEC_SGLANG_DRAFTER)")
    parser.add_argument("--freespec-config", help="a freespec plugin config file (FREESPEC_SGLANG_CONFIG)")
    parser.add_argument("--max-total-tokens", type=int, default=8192, help="--device cpu: the KV cache's tokens")
    parser.add_argument("--soak-method", default="freespec", choices=list(METHODS))
    parser.add_argument("--soak-d", type=int, default=16, help="--soak: D of ngram and freespec")
    parser.add_argument("--run-method", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    return parser


def _engine_command(args):
    """How one configuration starts: this module in a fresh interpreter with ``--run-method`` (SGLang's
    scheduler processes are spawned, so the entry point is ``-c``, as for vLLM), in ``device_environment``."""
    def command(model_dir, prompts, method, k, result_path):
        return [sys.executable, "-c", "import sys; from freespec.integrations.sglang.bench_serving import main; "
                "sys.exit(main(sys.argv[1:]))", "--run-method", method, "--model-dir", model_dir,
                "--prompts", str(prompts), "--out", str(result_path), "--device", args.device,
                "--max-total-tokens", str(args.max_total_tokens), *serving_bench.child_arguments(args, k or 0)]
    return command


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    ks = serving_bench.parse_ks(parser, args) if not args.run_method else [int(args.k)]
    if args.run_method:  # the child: one engine, its environment set by the parent
        args.method, args.k = args.run_method, ks[0]
        Path(args.out).write_text(json.dumps(run_method(args)))
        return 0
    from freespec import models

    out = Path(args.out)
    if args.soak:
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(soak(args, str(models.local_dir(args.model)), out), indent=1))
        return 0
    counts, methods = serving_bench.check_arguments(parser, args, dict.fromkeys(METHODS), "plain", "SGLang")
    configs = serving_bench.configurations(methods, ks, lambda m: m in TAKES_D)
    command = _engine_command(args)
    # each configuration's process gets its own environment (the plugin's variables for freespec alone)
    envs = {method: device_environment(args.device, method, args.drafter, args.freespec_config) for method in methods}
    return serving_bench.benchmark(args, counts, configs, command, envs.get, "SGLang", "plain")


if __name__ == "__main__":
    sys.exit(main())
