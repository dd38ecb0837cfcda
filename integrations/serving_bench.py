"""The serving benchmark's runner, shared by every engine (``vllm/bench.py``, ``sglang/serving.py``).

An engine adds only how it starts (a child process running one engine configuration, a server for the soak)
and how it is asked (``Engine.generate``); everything else is here: the workloads and their prompts, the
engine order, the concurrency phases, what is counted, the summary, the plot and the soak.

Workloads (``WORKLOADS``), chat-templated, greedy:

- ``code-edit``: ``builtin:code-edit`` items ("apply this change, output the whole function");
- ``spec-bench``: Spec-Bench questions (one turn each), spread over its categories;
- ``repeat``: ``builtin:multi-turn-edit`` sessions served as a client would: turn ``k + 1``'s prompt holds
  the engine's own answer to turn ``k`` (decoded as the engine produced it), so it is sent only once that
  answer is back; at concurrency C, C sessions run at once (their turns in lock step), so a request re-sends
  text an earlier request of the same session produced.

Every engine configuration runs in a process of its own (no method inherits another's state): each workload
at concurrency 1 (one request at a time), then at concurrency ``batch`` (that many requests together) on
other prompts (disjoint, so no engine sees a prompt twice: a proposer that keeps earlier requests' outputs
would replay its own answer). Configurations run in the order given, then reversed (``abba``: A B C C B A),
and each figure is the mean of the two runs, which cancels a drifting machine. Reported per method, K (D for
SGLang), workload and concurrency: output tokens/s, speedup over the plain engine, mean accepted length (the
engine's own counters: tokens per verify step), mean draft length, CPU microseconds in the proposer where the
engine times it, and whether every output is the plain engine's, token for token; each method at its best K
beside the first K given; at concurrency 1 the speedup per category (each request's own seconds).

The soak (``soak``) sends N short requests from concurrent clients to an engine's OpenAI-compatible server
(every ``abort_every``-th a stream closed after two chunks, which the server aborts) and reports every
request's fate, the server's memory (RSS of its processes) before, at checkpoints and after, and the plugin's
live requests before and after.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

WORKLOADS = ("code-edit", "spec-bench", "repeat")
COUNTERS = ("drafts", "accepted_tokens", "draft_tokens", "propose_s", "propose_calls", "propose_rows")


class Engine(Protocol):
    """How a benchmark asks one engine configuration (an engine adapter implements it)."""

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy outputs (token ids) of ``prompts``, submitted together; returns once every one is done."""

    def counters(self) -> dict:
        """Running totals since the engine started, any of ``COUNTERS`` it keeps: verify steps with a draft,
        accepted draft tokens, drafted tokens; CPU seconds, calls and rows of its proposer's ``propose()``."""


# ---------------------------------------------------------------------------------------------- prompts
def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat ending with a user message, with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(map(int, ids if isinstance(ids, list) else ids["input_ids"]))


def _split_phases(chosen: list, single_count: int, batch: int) -> dict:
    """``{1: single_count items, batch: the rest}``: every other item to the concurrency-1 phase (then the rest,
    if it needs more), so both phases span the categories."""
    wanted = len(chosen)
    single = list(range(0, wanted, 2))[:single_count]
    single += list(range(1, wanted, 2))[:single_count - len(single)]
    return {1: [chosen[i] for i in single], batch: [chosen[i] for i in range(wanted) if i not in single]}


def _spread(items: list, wanted: int, source: str, count: int, batch: int) -> list:
    if len(items) < wanted:
        raise ValueError(f"{source}: {len(items)} items, {wanted} needed ({count} + {batch})")
    return items[::len(items) // wanted][:wanted]


def build_prompts(model_dir: str, counts: dict, batch: int, spec_bench: str, repeat_turns: int = 3) -> dict:
    """``{workload: {concurrency: [request]}}`` (JSON-ready). A request of ``code-edit``/``spec-bench`` is
    ``[category, prompt token ids]``; one of ``repeat`` is a session ``{"turns": [text], "categories":
    [turn category]}`` of ``repeat_turns`` turns, templated as it runs (``_ask_sessions``). ``counts[workload]``
    requests at concurrency 1, ``batch`` others at concurrency ``batch``."""
    from transformers import AutoTokenizer

    from freespec.bench.datasets import load_dataset, multi_turn_edit_items

    unknown = set(counts) - set(WORKLOADS)
    if unknown:
        raise ValueError(f"counts: unknown workloads {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    if repeat_turns < 2:
        raise ValueError(f"repeat_turns: expected >= 2 (later turns re-send earlier answers), got {repeat_turns}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workloads = {}
    for workload, count in counts.items():
        wanted = count + batch
        if workload == "repeat":
            sessions = _spread(multi_turn_edit_items(num_sessions=wanted), wanted, "builtin:multi-turn-edit",
                               count, batch)
            chosen = [{"turns": list(item.turns[:repeat_turns]),
                       "categories": list(item.turn_categories[:repeat_turns])} for item in sessions]
        else:
            source = "builtin:code-edit" if workload == "code-edit" else spec_bench
            chosen = [[item.category, encode_chat(tokenizer, [{"role": "user", "content": item.turns[0]}])]
                      for item in _spread(load_dataset(source), wanted, source, count, batch)]
        workloads[workload] = _split_phases(chosen, count, batch)
    return workloads


# ---------------------------------------------------------------------------------------------- one engine
def _ask_in_chunks(engine: Engine, requests: list, concurrency: int, max_tokens: int):
    """Single-turn requests, ``concurrency`` at a time: ``(outputs, categories, seconds of each chunk)``."""
    outputs, seconds = [], []
    for first in range(0, len(requests), concurrency):
        chunk = requests[first:first + concurrency]
        began = time.perf_counter()
        outputs += engine.generate([ids for _, ids in chunk], max_tokens)
        seconds.append(time.perf_counter() - began)
    return outputs, [category for category, _ in requests], seconds


def _ask_sessions(engine: Engine, sessions: list, concurrency: int, max_tokens: int, tokenizer):
    """``concurrency`` sessions at a time, turn by turn: a session's next turn carries the engine's answers to
    its earlier turns, so it goes out once they are back. Outputs and categories session by session."""
    outputs, categories, seconds = [], [], []
    for first in range(0, len(sessions), concurrency):
        group = sessions[first:first + concurrency]
        messages = [[] for _ in group]
        answers = [[] for _ in group]
        for turn in range(len(group[0]["turns"])):
            for session, chat in zip(group, messages):
                chat.append({"role": "user", "content": session["turns"][turn]})
            began = time.perf_counter()
            replies = engine.generate([encode_chat(tokenizer, chat) for chat in messages], max_tokens)
            seconds.append(time.perf_counter() - began)
            for chat, mine, reply in zip(messages, answers, replies):
                mine.append(reply)
                chat.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
        for session, mine in zip(group, answers):
            outputs += mine
            categories += session["categories"]
    return outputs, categories, seconds


def run_phases(engine: Engine, workloads: dict, max_tokens: dict, tokenizer) -> dict:
    """Every workload at each of its concurrencies, in order: ``{"workload@concurrency": phase result}``."""
    result = {}
    for workload, phases in workloads.items():
        for concurrency, requests in phases.items():
            concurrency = int(concurrency)
            before = engine.counters()
            begin = time.perf_counter()
            if workload == "repeat":
                asked = _ask_sessions(engine, requests, concurrency, max_tokens[workload], tokenizer)
            else:
                asked = _ask_in_chunks(engine, requests, concurrency, max_tokens[workload])
            seconds = time.perf_counter() - begin
            after = engine.counters()
            key = f"{workload}@{concurrency}"
            result[key] = phase_result(*asked, seconds, concurrency, before, after)
            print(f"serving bench: {key}: {result[key]['tokens']} tokens in {seconds:.1f} s", flush=True)
    return result


def phase_result(outputs: list, categories: list, request_seconds: list, seconds: float, concurrency: int,
                 before: dict, after: dict) -> dict:
    """One phase: its outputs and seconds, and what the engine's counters grew by meanwhile."""
    grown = {name: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
    drafts = grown["drafts"]
    return {"seconds": seconds, "tokens": sum(map(len, outputs)), "outputs": outputs, "categories": categories,
            # concurrency 1: each request's own seconds (per-category speedups); else one per batch
            "request_seconds": request_seconds if concurrency == 1 else None,
            "mean_accepted_length": (1 + grown["accepted_tokens"] / drafts) if drafts else 1.0,
            "mean_draft_length": grown["draft_tokens"] / drafts if drafts else 0.0, **grown}


# ---------------------------------------------------------------------------------------------- engines in turn
def configurations(methods: list, ks: list, takes_k: Callable[[str], bool]) -> list[tuple]:
    """``(label, method, K)``: every method that takes a K at every K (labelled ``method-kK`` when there are
    several), every other method (the plain engine, a method at the engine's own setting) once, K None."""
    return [(m, m, None) if not takes_k(m) else (m if len(ks) == 1 else f"{m}-k{k}", m, k)
            for k in ks for m in methods if takes_k(m) or k == ks[0]]


def run_engines(configs: list, order: str, out: Path, command: Callable, env_of: Callable[[str], dict],
                name: str) -> dict:
    """Each configuration in a process of its own (``command(method, K, result path)`` in the environment
    ``env_of(method)``), in ``order`` (abba: as given, then reversed): ``{label: [result of each run]}``."""
    sequence = configs + configs[::-1] if order == "abba" else configs
    runs: dict = {label: [] for label, _, _ in configs}
    for i, (label, method, k) in enumerate(sequence):
        result_path = out / f"run{i}-{label}.json"
        print(f"{name} bench: run {i + 1}/{len(sequence)}: {label}", flush=True)
        with open(out / f"run{i}-{label}.log", "w") as log:
            subprocess.run(command(method, k, result_path), env=env_of(method), stdout=log, stderr=subprocess.STDOUT,
                           check=True)
        runs[label].append(json.loads(result_path.read_text()))
    return runs


# ---------------------------------------------------------------------------------------------- summary
def summarize(runs: dict, configs: list, default_k: int, out: Path, plain: str = "vanilla",
              engine: str = "vLLM") -> str:
    """The mean of each configuration's runs, per workload and concurrency (``_rows``); each method at its best
    K beside ``default_k``; per-category speedups at concurrency 1. Writes ``results.json``; returns
    Markdown."""
    rows, best_rows, category_rows = [], [], []
    for key in runs[configs[0][0]][0]:
        mine = _rows(runs, configs, key, plain)
        rows += mine
        best_rows += _best_k(mine, configs, default_k)
        if key.endswith("@1") and plain in runs:
            category_rows += _category_speedups(runs, configs, key, plain)
    (out / "results.json").write_text(json.dumps({"rows": rows, "best_k": best_rows, "categories": category_rows},
                                                 indent=1))
    return markdown(rows, best_rows, category_rows, engine)


def _rows(runs: dict, configs: list, key: str, plain: str) -> list[dict]:
    workload, concurrency = key.split("@")
    base = runs[plain][0][key]["outputs"] if plain in runs else None
    rates, rows = {}, []
    for label, method, k in configs:
        results = [run[key] for run in runs[label]]
        rates[label] = sum(r["tokens"] for r in results) / sum(r["seconds"] for r in results)
        rows.append({"workload": workload, "concurrency": int(concurrency), "method": method, "k": k,
                     "label": label, "tokens_per_s": rates[label],
                     "speedup": rates[label] / rates[plain] if plain in rates else None,
                     "mean_accepted_length": sum(r["mean_accepted_length"] for r in results) / len(results),
                     "mean_draft_length": sum(r["mean_draft_length"] for r in results) / len(results),
                     # CPU microseconds in propose() per row it drafted for, inside the engine (both runs)
                     "propose_us_per_request": _per_request_us(results),
                     "identical_to_plain": None if base is None else all(r["outputs"] == base for r in results)})
    return rows


def _best_k(rows: list, configs: list, default_k: int) -> list[dict]:
    """Each speculative method's best K (tokens/s) among ``rows`` (one workload and concurrency)."""
    found = []
    for method in dict.fromkeys(method for _, method, k in configs if k is not None):
        mine = [row for row in rows if row["method"] == method]
        best = max(mine, key=lambda row: row["tokens_per_s"])
        default = next((row for row in mine if row["k"] == default_k), None)
        found.append({"workload": best["workload"], "concurrency": best["concurrency"], "method": method,
                      "best_k": best["k"], "speedup_at_best_k": best["speedup"],
                      "speedup_at_default_k": default and default["speedup"]})
    return found


def _per_request_us(results: list) -> float | None:
    """CPU microseconds in ``propose()`` per row it drafted for, over a configuration's runs (None: an engine
    that does not time it, or the plain engine)."""
    rows = sum(r.get("propose_rows", 0) for r in results)
    return sum(r["propose_s"] for r in results) / rows * 1e6 if rows else None


def _category_speedups(runs: dict, configs: list, key: str, plain: str) -> list[dict]:
    """Per category of ``key``'s (concurrency-1) requests: each configuration's output tokens over its
    requests' own seconds, over the plain engine's."""
    def rates(label):
        tokens, seconds = {}, {}
        for run in runs[label]:
            result = run[key]
            for category, output, s in zip(result["categories"], result["outputs"], result["request_seconds"]):
                tokens[category] = tokens.get(category, 0) + len(output)
                seconds[category] = seconds.get(category, 0.0) + s
        return {category: tokens[category] / seconds[category] for category in tokens}

    base = rates(plain)
    found = []
    for label, method, k in configs:
        mine = rates(label)
        found += [{"workload": key.split("@")[0], "category": category, "label": label, "method": method, "k": k,
                   "prompts": runs[label][0][key]["categories"].count(category),
                   "speedup": mine[category] / base[category]} for category in mine]
    return found


def markdown(rows: list, best_rows: list, category_rows: list, engine: str = "vLLM") -> str:
    def yes(value):
        return "-" if value is None else "yes" if value else "NO"

    def us(value):
        return "-" if value is None else f"{value:.0f}"

    lines = [f"| workload | concurrency | method | K | tokens/s | x plain {engine} | mean accepted length | mean draft "
             "length | propose() us per request | identical |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['k'] or '-'} | {r['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} | {r['mean_draft_length']:.2f} | "
              f"{us(r.get('propose_us_per_request'))} | {yes(r['identical_to_plain'])} |" for r in rows]
    lines += ["", "| workload | concurrency | method | best K | x plain at best K | x plain at default K |",
              "|---|---:|---|---:|---:|---:|"]
    lines += [f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['best_k']} | "
              f"{r['speedup_at_best_k']:.2f}x | "
              + (f"{r['speedup_at_default_k']:.2f}x |" if r["speedup_at_default_k"] else "- |") for r in best_rows]
    if category_rows:
        labels = list(dict.fromkeys(r["label"] for r in category_rows))
        lines += ["", f"Concurrency 1, per category (x plain {engine}):", "",
                  "| workload | category | prompts | " + " | ".join(labels) + " |",
                  "|---|---|---:|" + "---:|" * len(labels)]
        for workload, category in dict.fromkeys((r["workload"], r["category"]) for r in category_rows):
            cells = {r["label"]: r for r in category_rows if (r["workload"], r["category"]) == (workload, category)}
            lines.append(f"| {workload} | {category} | {next(iter(cells.values()))['prompts']} | "
                         + " | ".join(f"{cells[label]['speedup']:.2f}x" for label in labels) + " |")
    return "\n".join(lines)


def plot(rows: list, path: Path, engine: str) -> None:
    """Bars of tokens/s over the plain engine per workload and concurrency, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["concurrency"]) for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 2, 3.6))
    for i, label in enumerate(labels):
        cells = {(r["workload"], r["concurrency"]): r["speedup"] for r in rows if r["label"] == label}
        ax.bar([g + (i - (len(labels) - 1) / 2) * width for g in range(len(groups))],
               [cells.get(group, 0.0) for group in groups], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{w}\n{c} at once" for w, c in groups])
    ax.set_ylabel(f"tokens/s over plain {engine}")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- soak
def soak_prompts(spec_bench: str, chars: int = 400) -> list[str]:
    """Spec-Bench questions and code-edit requests cut to ``chars`` characters: a soak is about many requests,
    not long prefills."""
    from freespec.bench.datasets import load_dataset

    return [item.turns[0][:chars] for item in load_dataset(spec_bench) + load_dataset("builtin:code-edit")]


def rss_by_process(pid: int) -> dict:
    """Resident MB of a server's processes (the root first, then its descendants by pid), by name and pid."""
    import psutil

    root = psutil.Process(pid)
    found = {}
    for proc in [root] + sorted(root.children(recursive=True), key=lambda p: p.pid):
        try:
            found[f"{proc.name()}:{proc.pid}"] = round(proc.memory_info().rss / 2**20, 1)
        except psutil.Error:  # gone between the listing and the read
            pass
    return found


def memory(pid: int) -> dict:
    by_process = rss_by_process(pid)
    return {"rss_mb": round(sum(by_process.values()), 1), "rss_mb_by_process": by_process}


def soak_request(client, i: int, prompt: str, max_tokens: int, abort_every: int, hints: Callable | None) -> str:
    """Request ``i``: every ``abort_every``-th a stream closed after two chunks (the server aborts it), the
    others answered whole, every other one with ``hints(prompt)`` as extra body. Its fate: answered, aborted
    or failed."""
    try:
        if i % abort_every == 0:
            stream = client.completions.create(model="model", prompt=prompt, max_tokens=200, stream=True)
            for j, _ in enumerate(stream):
                if j == 1:
                    break
            stream.close()
            return "aborted"
        extra = hints(prompt) if hints is not None and i % 2 else None
        done = client.completions.create(model="model", prompt=prompt, max_tokens=max_tokens, extra_body=extra)
        return "answered" if done.choices[0].finish_reason in ("stop", "length") else "failed"
    except Exception:
        return "failed"


class _Clients:
    """``clients`` threads that take the next request index until ``num_requests`` are sent; counts fates and,
    every ``every`` requests done, records ``[requests done, server MB, {process: MB}, plugin counters]``."""

    def __init__(self, ask: Callable[[int], str], num_requests: int, every: int, checkpoint: Callable[[], list]):
        self.ask, self.num_requests, self.every, self.checkpoint = ask, num_requests, every, checkpoint
        self.outcome = {"answered": 0, "aborted": 0, "failed": 0}
        self.trail: list = []
        self._lock, self._next = threading.Lock(), 0

    def _take(self) -> int | None:
        with self._lock:
            i, self._next = self._next, self._next + 1
        return i if i < self.num_requests else None

    def _worker(self) -> None:
        while (i := self._take()) is not None:
            kind = self.ask(i)
            with self._lock:
                self.outcome[kind] += 1
                done = sum(self.outcome.values())
                if done % self.every == 0 and done < self.num_requests:
                    self.trail.append([done, *self.checkpoint()])

    def run(self, clients: int) -> float:
        begin = time.time()
        threads = [threading.Thread(target=self._worker) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.time() - begin


def soak(served, num_requests: int, clients: int, prompts: list[str], *, plugin_stats: Callable,
         idle_stats: Callable, hints: Callable | None = None, max_tokens: int = 16, abort_every: int = 10,
         checkpoints: int = 4) -> dict:
    """``num_requests`` from ``clients`` concurrent clients to the server ``served`` starts (a context manager
    yielding ``(OpenAI client, server process)``), each a ``soak_request``. Reports every request's fate, the
    server's memory after a warm-up request, after each ``num_requests / checkpoints`` requests and after the
    last, each process apart (which one grows), and the plugin's counters: ``idle_stats()`` (once it holds no
    request) before and after, ``plugin_stats()`` (as they are) at each checkpoint. A leak grows at every
    checkpoint; a cache filling its reserved pages levels off."""
    if num_requests < 1 or clients < 1 or abort_every < 1 or checkpoints < 1:
        raise ValueError(f"soak: num_requests, clients, abort_every and checkpoints must be >= 1, got "
                         f"{num_requests}, {clients}, {abort_every}, {checkpoints}")
    with served as (client, server):
        client.completions.create(model="model", prompt=prompts[0], max_tokens=max_tokens)  # warm
        before = {**memory(server.pid), "plugin": idle_stats()}

        def checkpoint():
            now = memory(server.pid)
            return [now["rss_mb"], now["rss_mb_by_process"], plugin_stats()]

        crowd = _Clients(lambda i: soak_request(client, i, prompts[i % len(prompts)], max_tokens, abort_every, hints),
                         num_requests, max(1, num_requests // checkpoints), checkpoint)
        seconds = crowd.run(clients)
        after = {**memory(server.pid), "plugin": idle_stats()}
    return {"requests": num_requests, "clients": clients, "seconds": seconds, **crowd.outcome, "before": before,
            "rss_mb_after": crowd.trail, "after": after}


def read_plugin_stats(stats_path: Path) -> dict | None:
    """A plugin's counters as it last wrote them to ``stats_path`` (vLLM's ``FREESPEC_VLLM_STATS``, SGLang's
    ``FREESPEC_SGLANG_STATS``), or None before it has."""
    try:
        return json.loads(Path(stats_path).read_text())
    except (OSError, ValueError):
        return None


def idle_plugin_stats(stats_path: Path, timeout: float = 60.0) -> dict | None:
    """The plugin's counters once it holds no request, or as they are at ``timeout``; None if it never wrote
    them."""
    deadline = time.time() + timeout
    while True:
        stats = read_plugin_stats(stats_path)
        if stats is not None and stats["live_requests"] == 0 or time.time() > deadline:
            return stats
        time.sleep(0.5)


@contextlib.contextmanager
def serve(command_of: Callable[[int], list], env: dict, log_path: Path, timeout: float, name: str):
    """An engine's OpenAI-compatible server (``command_of(port)``, output to ``log_path``) on a free 127.0.0.1
    port; yields ``(OpenAI client, server process)`` once it lists its models, and stops it on leaving. Raises
    if the server exits first (with its log's tail) or ``timeout`` seconds pass."""
    import socket

    from openai import OpenAI

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command_of(port), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
            _wait_for_server(server, client, log_path, timeout, name)
            yield client, server
        finally:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def _wait_for_server(server: subprocess.Popen, client, log_path: Path, timeout: float, name: str) -> None:
    deadline = time.time() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"the {name} server exited: {Path(log_path).read_text()[-3000:]}")
        try:
            client.models.list()
            return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(2)


# ---------------------------------------------------------------------------------------------- command line
def add_arguments(parser, methods: str, out: str, k_name: str = "K") -> None:
    """The options every engine's benchmark shares (each adds its own beside them)."""
    parser.add_argument("--model", default="smollm2-135m", help="a registered model name (freespec.models)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default=methods)
    parser.add_argument("--k", default="8", help=f"{k_name} of every speculative method; several (8,16,32): an "
                        "engine per method and value, each method's best reported beside the first")
    parser.add_argument("--workloads", default="code-edit,spec-bench",
                        help="comma-separated: code-edit (builtin:code-edit), spec-bench (--spec-bench-path), "
                        "repeat (multi-turn edit sessions whose later turns re-send earlier answers)")
    parser.add_argument("--code-edit", type=int, default=4,
                        help="builtin:code-edit prompts at concurrency 1 (--batch more, others, at --batch)")
    parser.add_argument("--spec-bench", type=int, default=8,
                        help="Spec-Bench prompts at concurrency 1 (--batch more, others, at --batch), spread over "
                        "its categories")
    parser.add_argument("--repeat", type=int, default=2,
                        help="repeat sessions at concurrency 1 (--batch more, others, at --batch)")
    parser.add_argument("--repeat-turns", type=int, default=3, help="turns of each repeat session (>= 2)")
    parser.add_argument("--spec-bench-path", default="../shared/data/spec_bench_dev.jsonl")
    parser.add_argument("--code-edit-tokens", type=int, default=192)
    parser.add_argument("--spec-bench-tokens", type=int, default=128)
    parser.add_argument("--repeat-tokens", type=int, default=192)
    parser.add_argument("--batch", type=int, default=8, help="the second concurrency")
    parser.add_argument("--order", choices=["abba", "ab"], default="abba",
                        help="abba: the methods, then again in reverse (cancels drift); ab: once each")
    parser.add_argument("--out", default=out)
    parser.add_argument("--soak", type=int, metavar="N", help="N requests through the engine's server instead")
    parser.add_argument("--soak-clients", type=int, default=16, help="--soak: concurrent clients")


def max_tokens(args) -> dict:
    return {"code-edit": args.code_edit_tokens, "spec-bench": args.spec_bench_tokens, "repeat": args.repeat_tokens}


def parse_ks(parser, args) -> list[int]:
    try:
        ks = [int(k) for k in args.k.split(",")]
        if not ks or min(ks) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--k: expected positive integers separated by commas (8,16,32), got {args.k!r}")
    return ks


def check_arguments(parser, args, known: dict, plain: str, engine: str) -> tuple[dict, list]:
    """``(counts per workload, methods)`` from ``--workloads`` and ``--methods``; a bad value stops the run
    before any engine starts, naming the option."""
    workloads = args.workloads.split(",")
    if set(workloads) - set(WORKLOADS) or len(set(workloads)) < len(workloads):
        parser.error(f"--workloads: expected some of {','.join(WORKLOADS)} separated by commas, got "
                     f"{args.workloads!r}")
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in known]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(known)}")
    if plain not in methods:
        parser.error(f"--methods must include {plain} (plain {engine}): every speedup and the identity of outputs "
                     f"are measured against it; got {args.methods!r}")
    if args.batch < 1 or args.repeat_turns < 2:
        parser.error(f"--batch must be >= 1 and --repeat-turns >= 2, got {args.batch} and {args.repeat_turns}")
    every = {"code-edit": args.code_edit, "spec-bench": args.spec_bench, "repeat": args.repeat}
    return {w: every[w] for w in workloads}, methods


def benchmark(args, counts: dict, configs: list, command: Callable, env_of: Callable[[str], dict], engine: str,
              plain: str) -> int:
    """Prompts, every configuration in turn (``run_engines``), then the summary (``table.md``, ``results.json``,
    ``speedups.png``) under ``args.out``; prints the tables."""
    from freespec import models

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(models.local_dir(args.model))
    prompts = out / "prompts.json"
    prompts.write_text(json.dumps(build_prompts(model_dir, counts, args.batch, args.spec_bench_path,
                                                args.repeat_turns)))
    runs = run_engines(configs, args.order, out, lambda method, k, path: command(model_dir, prompts, method, k, path),
                       env_of, engine)
    table = summarize(runs, configs, parse_ks_of(configs), out, plain, engine)
    (out / "table.md").write_text(table + "\n")
    print(table)
    replot(out, engine)
    return 0


def replot(out: Path, engine: str) -> None:
    """``speedups.png`` from ``out``'s ``results.json``, where matplotlib is installed (an engine's environment
    may lack it: ``python -m freespec.integrations.serving_bench DIR ENGINE`` draws it elsewhere)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print(f"no plot: matplotlib is not installed here (pip install matplotlib, or run "
              f"python -m freespec.integrations.serving_bench {out} {engine} where it is)")
        return
    plot(json.loads((Path(out) / "results.json").read_text())["rows"], Path(out) / "speedups.png", engine)


def parse_ks_of(configs: list) -> int | None:
    """The first K the configurations name (the default K of the summary)."""
    return next((k for _, _, k in configs if k is not None), None)


def child_arguments(args, k: int) -> list[str]:
    """The options a configuration's process gets (beside which engine and where its prompts are)."""
    return ["--dtype", args.dtype, "--k", str(k), "--batch", str(args.batch),
            "--code-edit-tokens", str(args.code_edit_tokens), "--spec-bench-tokens", str(args.spec_bench_tokens),
            "--repeat-tokens", str(args.repeat_tokens)]



if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        sys.exit("usage: python -m freespec.integrations.serving_bench OUT_DIR ENGINE (draws OUT_DIR/speedups.png "
                 "from OUT_DIR/results.json)")
    replot(Path(sys.argv[1]), sys.argv[2])
