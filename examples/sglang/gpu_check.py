"""The client and the judge of ``gpu_check.sh``: workloads, checks and the report, without a GPU.

``gpu_check.sh`` starts each SGLang server and calls this file (standard
library only, so it runs in the server's environment)::

    python gpu_check.py gpu-memory                               # MiB in use on the GPU
    python gpu_check.py wait-gpu-free --baseline-mib 600         # after a server stops
    python gpu_check.py client NAME --port P --out DIR [--logprobs] [--checks --server-pid PID]
    python gpu_check.py log-check LOG --drafter NAME             # freespec served drafts, no traceback
    python gpu_check.py report DIR                               # the table; exit 1 on any failure

Workloads (``workloads()``): code edits (a ~70-line Python file, an edit,
"return the whole file") and open chat (explanations asked for at length),
at most ``MAX_NEW_TOKENS`` = 320 new tokens each, greedy, at concurrency 1
(``NUM_SEQUENTIAL`` requests one after another), 8 and 32 (that many at once).

Batch-1 greedy agreement: speculative verification runs other kernels
(D tokens per forward instead of 1), so bf16 logits can differ in the last
bits and flip a near-tie. A freespec output passes if it equals the
no-speculation output, or first differs at a token where the no-speculation
run's two most likely tokens were within ``TIE_NATS`` = 0.5 nats of each
other (logged with ``top_logprobs_num=2``). SGLang's own NGRAM is judged by
the same rule and reported, not failed.

``--checks`` (one freespec server): aborted streams (connections closed
after a few chunks) and an ``/abort_request``, then ``/flush_cache`` (the
corpus resets), then the batch-1 prompts again (judged against no speculation
as the first ones are); then ``MEMORY_ROUNDS`` rounds of ``MEMORY_REQUESTS`` short requests,
after which the scheduler's resident memory must not grow by more than
``MEMORY_SLACK_MIB`` from the end of the first round to the end of the last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MAX_NEW_TOKENS = 320
CONCURRENCY = (1, 8, 32)
NUM_SEQUENTIAL = 4
TIE_NATS = 0.5
MEMORY_REQUESTS = 150
MEMORY_ROUNDS = 3
MEMORY_SLACK_MIB = 64.0
CONFIGS = ("baseline", "ngram", "freespec-mixture", "freespec-prompt_lookup", "freespec-suffix")

CODE = '''import json
from dataclasses import dataclass, field


@dataclass
class Item:
    name: str
    price: float
    quantity: int = 1
    tags: list = field(default_factory=list)

    def total(self):
        return self.price * self.quantity


class Cart:
    def __init__(self, owner):
        self.owner = owner
        self.items = []

    def add(self, item):
        for existing in self.items:
            if existing.name == item.name:
                existing.quantity += item.quantity
                return existing
        self.items.append(item)
        return item

    def remove(self, name):
        self.items = [item for item in self.items if item.name != name]

    def total(self):
        return sum(item.total() for item in self.items)

    def by_tag(self, tag):
        return [item for item in self.items if tag in item.tags]

    def to_json(self):
        return json.dumps({"owner": self.owner, "items": [vars(item) for item in self.items]})


def load_cart(text):
    data = json.loads(text)
    cart = Cart(data["owner"])
    for entry in data["items"]:
        cart.add(Item(**entry))
    return cart


def cheapest(cart):
    if not cart.items:
        return None
    return min(cart.items, key=lambda item: item.price)


def report(cart):
    lines = [f"Cart of {cart.owner}"]
    for item in cart.items:
        lines.append(f"- {item.name}: {item.quantity} x {item.price:.2f} = {item.total():.2f}")
    lines.append(f"Total: {cart.total():.2f}")
    return "\\n".join(lines)
'''
EDITS = ("Rename the class Cart to Basket everywhere", "Add type hints to every function and method",
         "Rename the method total to subtotal everywhere", "Add a docstring to every function and method",
         "Make remove raise KeyError when no item has that name", "Rename the variable item to entry everywhere",
         "Add a method clear that empties the cart", "Replace the f-strings in report by str.format calls")
TOPICS = ("how a hash map handles collisions", "why the sky is blue", "how vaccines train the immune system",
          "how a compiler turns source code into machine code", "the causes of the First World War",
          "how public-key cryptography works", "how photosynthesis stores energy", "how TCP recovers lost packets",
          "why the Roman Empire split in two", "how a transistor switches", "how garbage collection works",
          "how plate tectonics shapes continents", "how a neural network learns", "how inflation affects savings",
          "how the heart pumps blood", "how search engines rank pages")


# ------------------------------------------------------------------ workloads
def workloads() -> list[dict]:
    """32 distinct prompts, code edits and chat alternating: ``{"kind", "messages"}``."""
    code = [{"kind": "code-edit", "messages": [{"role": "user", "content":
             f"{edit}. Return the whole edited file and nothing else.\n\n```python\n{CODE}```"}]}
            for edit in EDITS]
    code += [{"kind": "code-edit", "messages": [{"role": "user", "content":
              f"{edit}, and keep everything else exactly as it is. Return the whole file.\n\n```python\n"
              f"{CODE.replace('Item', 'Product')}```"}]} for edit in EDITS]
    chat = [{"kind": "chat", "messages": [{"role": "user", "content":
             f"Explain {topic} to a curious student, in detail and in at least 300 words."}]} for topic in TOPICS]
    return [prompt for pair in zip(code, chat) for prompt in pair]


def render(messages: list[dict], tokenizer=None) -> str:
    """The prompt text: the model's chat template when its tokenizer has one, else plain turns."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"


def load_tokenizer(model_path: str | None):
    if not model_path or not Path(model_path).exists():
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception as exc:  # a model without a tokenizer we can load: plain turns
        print(f"gpu_check: no chat template ({type(exc).__name__}: {exc}); plain prompts", file=sys.stderr)
        return None


# ------------------------------------------------------------------- client
class Server:
    """The few SGLang HTTP endpoints the check uses."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 300.0):
        self.base, self.timeout = f"http://{host}:{port}", timeout

    def post(self, path: str, body: dict | None = None) -> tuple[int, bytes]:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def generate(self, text: str, max_new_tokens: int = MAX_NEW_TOKENS, **extra) -> dict:
        params = {"temperature": 0, "max_new_tokens": max_new_tokens}
        status, body = self.post("/generate", {"text": text, "sampling_params": params, **extra})
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {body[:300]!r}")
        return json.loads(body)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health_generate", timeout=60) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


def summarize(results: list[dict], kinds: list[str], wall_s: float) -> dict:
    """Throughput and accept length (new tokens per verify forward; 1.0 without speculation), overall and per kind."""
    def accept(rows):
        tokens = sum(r["meta_info"]["completion_tokens"] for r in rows)
        verify = sum(r["meta_info"].get("spec_verify_ct", 0) for r in rows)
        return tokens / verify if verify else 1.0

    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"tok_s": tokens / wall_s, "accept": accept(results), "new_tokens": tokens / max(1, len(results)),
            "accept_by_kind": {kind: accept([r for r, k in zip(results, kinds) if k == kind])
                               for kind in sorted(set(kinds))}}


def run_concurrency(server: Server, prompts: list[str], kinds: list[str], concurrency: int, **extra) -> tuple:
    """(summary, results): ``NUM_SEQUENTIAL`` requests one by one at 1, else ``concurrency`` at once."""
    count = NUM_SEQUENTIAL if concurrency == 1 else concurrency
    chosen, chosen_kinds = prompts[:count], kinds[:count]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda text: server.generate(text, **extra), chosen))
    return summarize(results, chosen_kinds, time.perf_counter() - start), results


def run_workloads(server: Server, tokenizer=None, logprobs: bool = False) -> dict:
    """Every concurrency; batch-1 outputs kept (with the top-2 logprobs per token when ``logprobs``)."""
    prompts = workloads()
    texts, kinds = [render(p["messages"], tokenizer) for p in prompts], [p["kind"] for p in prompts]
    server.generate(texts[0], max_new_tokens=16)  # warm-up
    out = {"rows": {}}
    for concurrency in CONCURRENCY:
        summary, results = run_concurrency(server, texts, kinds, concurrency)
        out["rows"][str(concurrency)] = summary
        if concurrency == 1:
            out["batch1_ids"] = [r["output_ids"] for r in results]
    if logprobs:
        _, results = run_concurrency(server, texts, kinds, 1, return_logprob=True, top_logprobs_num=2)
        out["batch1_top2"] = [[[entry[0] for entry in position[:2]] for position in
                               r["meta_info"]["output_top_logprobs"]] for r in results]
        out["batch1_ids_logprob_pass"] = [r["output_ids"] for r in results]
    return out


# ------------------------------------------------------------ server checks
def aborted_streams(server: Server, text: str, num_streams: int = 4, chunks: int = 3) -> int:
    """Open streams, read a few chunks, hang up; returns the streams that delivered ``chunks`` chunks."""
    def stream(i):
        body = {"text": text, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 256}}
        request = urllib.request.Request(server.base + "/generate", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        seen = 0
        with urllib.request.urlopen(request, timeout=server.timeout) as response:  # closed on exit: an abort
            for line in response:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    seen += 1
                    if seen == chunks:
                        break
        return seen == chunks

    with ThreadPoolExecutor(num_streams) as pool:
        return sum(pool.map(stream, range(num_streams)))


def explicit_abort(server: Server, text: str, rid: str = "gpu-check-abort") -> bool:
    """A long request stopped by ``/abort_request``: does it come back aborted?"""
    holder = {}
    body = {"text": text, "rid": rid, "sampling_params": {"temperature": 0, "max_new_tokens": 2048}}
    thread = threading.Thread(target=lambda: holder.update(out=server.post("/generate", body)))
    thread.start()
    time.sleep(0.5)  # let it start decoding
    server.post("/abort_request", {"rid": rid})
    thread.join(server.timeout)
    status, raw = holder.get("out", (0, b""))
    return was_aborted(status, raw)


def was_aborted(status: int, raw: bytes) -> bool:
    """SGLang answers an aborted request with finish_reason type "abort", or an error that says so."""
    try:
        reason = json.loads(raw).get("meta_info", {}).get("finish_reason") or {}
    except (ValueError, AttributeError):
        reason = {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return True
    return status >= 400 and b"abort" in raw.lower()


def flush_cache(server: Server, timeout_s: float = 60.0) -> bool:
    """``/flush_cache`` succeeds only when nothing runs: retry until it does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, _ = server.post("/flush_cache")
        if status == 200:
            return True
        time.sleep(1.0)
    return False


def scheduler_rss_mib(server_pid: int, proc: str = "/proc") -> float:
    """Resident memory of the server's scheduler process(es): titled ``sglang::scheduler``, same process group."""
    total, found = 0.0, False
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(proc, entry, "cmdline").read_bytes().replace(b"\0", b" ")
            stat = Path(proc, entry, "stat").read_text()
            status = Path(proc, entry, "status").read_text()
        except OSError:  # the process ended meanwhile
            continue
        process_group = int(stat.rsplit(")", 1)[1].split()[2])
        if process_group == server_pid and cmdline.startswith(b"sglang::scheduler"):
            found = True
            total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
    if not found:
        raise RuntimeError(f"no sglang::scheduler process in process group {server_pid}")
    return total


def memory_rounds(server: Server, server_pid: int, rss=None) -> list[float]:
    """Scheduler RSS (MiB) after each of ``MEMORY_ROUNDS`` rounds of ``MEMORY_REQUESTS`` short requests."""
    rss = rss or scheduler_rss_mib
    samples = []
    for round_index in range(MEMORY_ROUNDS):
        texts = [f"Request {round_index}-{i}: write a sentence about the number {i * 7 + round_index}."
                 for i in range(MEMORY_REQUESTS)]
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda text: server.generate(text, max_new_tokens=32), texts))
        samples.append(rss(server_pid))
    return samples


def memory_is_flat(samples: list[float], slack_mib: float = MEMORY_SLACK_MIB) -> bool:
    """The first round warms up; after it, growth stays within ``slack_mib``."""
    return len(samples) >= 2 and max(samples[1:]) - samples[0] <= slack_mib


def run_checks(server: Server, server_pid: int | None, texts: list[str]) -> tuple[list[dict], list]:
    """Aborts, /flush_cache and flat scheduler memory; and the batch-1 outputs once more after them.

    The outputs after the checks are judged by ``report`` against no speculation, as the first ones are.
    """
    checks = [{"name": "aborted streams delivered their first chunks", "ok": aborted_streams(server, texts[0]) == 4},
              {"name": "/abort_request aborts a running request", "ok": explicit_abort(server, texts[1])},
              {"name": "/flush_cache succeeds after the aborts", "ok": flush_cache(server)}]
    again = [server.generate(text)["output_ids"] for text in texts[:NUM_SEQUENTIAL]]
    if server_pid is not None:
        samples = memory_rounds(server, server_pid)
        checks.append({"name": f"scheduler memory flat over {MEMORY_ROUNDS * MEMORY_REQUESTS} requests",
                       "ok": memory_is_flat(samples), "detail": "RSS MiB " + ", ".join(f"{s:.0f}" for s in samples)})
    checks.append({"name": "server healthy after the checks", "ok": server.healthy()})
    return checks, again


def client(name: str, port: int, out: str, model: str | None, logprobs: bool, checks: bool,
           server_pid: int | None) -> None:
    server = Server(port)
    tokenizer = load_tokenizer(model)
    result = run_workloads(server, tokenizer, logprobs)
    if checks:
        texts = [render(p["messages"], tokenizer) for p in workloads()]
        result["checks"], result["batch1_ids_after_checks"] = run_checks(server, server_pid, texts)
    Path(out, f"{name}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------ the GPU
def gpu_memory_mib(gpu: int = 0, run=subprocess.run) -> int:
    """Memory in use on GPU ``gpu`` (nvidia-smi), MiB."""
    out = run(["nvidia-smi", f"--id={gpu}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
              capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[0])


def wait_gpu_free(baseline_mib: int, timeout_s: float = 90.0, slack_mib: int = 1024, gpu: int = 0,
                  run=subprocess.run, sleep=time.sleep, clock=time.monotonic) -> bool:
    """Wait until the GPU holds at most ``baseline_mib + slack_mib``: the last server's memory is released."""
    deadline = clock() + timeout_s
    while True:
        if gpu_memory_mib(gpu, run) <= baseline_mib + slack_mib:
            return True
        if clock() >= deadline:
            return False
        sleep(1.0)


# ------------------------------------------------------------- the judging
def log_check(text: str, drafter: str) -> list[str]:
    """Problems in a freespec server's log: no sign of served drafts, or a traceback."""
    problems = []
    if f"freespec: NGRAM drafts come from drafter {drafter!r}" not in text:
        problems.append(f"the scheduler never built freespec's corpus with drafter {drafter!r}")
    if not re.search(rf"freespec: serving drafts from drafter {re.escape(repr(drafter))} \(first: [1-9]", text):
        problems.append("freespec never served a draft (no 'freespec: serving drafts' line)")
    if "Traceback (most recent call last)" in text:
        problems.append("the log holds a traceback")
    return problems


def first_divergence(ids: list[int], reference: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None when equal)."""
    for i, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return i
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def judge_batch1(ids: list, reference: list, top2: list) -> list[str]:
    """Per prompt: "same", "tie at i (gap g)" or "MISMATCH at i (gap g)" against no speculation."""
    verdicts = []
    for out, ref, logprobs in zip(ids, reference, top2):
        i = first_divergence(out, ref)
        if i is None:
            verdicts.append("same")
            continue
        gap = logprobs[i][0] - logprobs[i][1] if i < len(logprobs) and len(logprobs[i]) > 1 else float("inf")
        verdicts.append(f"{'tie' if gap < TIE_NATS else 'MISMATCH'} at {i} (gap {gap:.3f})")
    return verdicts


def table(runs: dict) -> str:
    base = runs.get("baseline", {}).get("rows", {})
    lines = [f"{'config':<24} {'conc':>4} {'tok/s':>9} {'speedup':>8} {'accept':>7} {'code':>6} {'chat':>6} "
             f"{'new tok':>7}"]
    for name in CONFIGS:
        for concurrency, row in runs.get(name, {}).get("rows", {}).items():
            ref = base.get(concurrency, {}).get("tok_s")
            speedup = f"{row['tok_s'] / ref:.2f}x" if ref else "-"
            kinds = row["accept_by_kind"]
            lines.append(f"{name:<24} {concurrency:>4} {row['tok_s']:>9.1f} {speedup:>8} {row['accept']:>7.2f} "
                         f"{kinds.get('code-edit', 0):>6.2f} {kinds.get('chat', 0):>6.2f} {row['new_tokens']:>7.0f}")
    return "\n".join(lines)


def report(out: str) -> tuple[str, list[str]]:
    """(text to print, failures) from the runs written in ``out``."""
    runs = {name: json.loads(Path(out, f"{name}.json").read_text()) for name in CONFIGS
            if Path(out, f"{name}.json").exists()}
    failures = [f"{name}: no results (server failed or time ran out; see {out}/{name}.log)"
                for name in CONFIGS if name not in runs]
    lines = [table(runs), ""]
    base = runs.get("baseline", {})
    if base and base.get("batch1_ids") != base.get("batch1_ids_logprob_pass"):
        lines.append("note: no-speculation batch-1 outputs changed when logprobs were asked for")
    for name, run in runs.items():
        if name == "baseline" or not base:
            continue
        for label, ids in (("", run["batch1_ids"]), (" after aborts and /flush_cache", run.get("batch1_ids_after_checks"))):
            if ids is None:
                continue
            verdicts = judge_batch1(ids, base["batch1_ids_logprob_pass"], base["batch1_top2"])
            lines.append(f"batch-1 greedy vs no speculation, {name}{label}: {', '.join(verdicts)}")
            if name.startswith("freespec") and any(v.startswith("MISMATCH") for v in verdicts):
                failures.append(f"{name}: batch-1 greedy output{label} differs from no speculation beyond a tie")
        for check in run.get("checks", []):
            lines.append(f"{'ok  ' if check['ok'] else 'FAIL'} {name}: {check['name']} {check.get('detail', '')}")
            if not check["ok"]:
                failures.append(f"{name}: {check['name']} {check.get('detail', '')}".strip())
    return "\n".join(lines), failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("gpu-memory").add_argument("--gpu", type=int, default=0)
    wait = commands.add_parser("wait-gpu-free")
    wait.add_argument("--baseline-mib", type=int, required=True)
    wait.add_argument("--timeout", type=float, default=90.0)
    wait.add_argument("--gpu", type=int, default=0)
    run = commands.add_parser("client")
    run.add_argument("name")
    run.add_argument("--port", type=int, required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--model", default=None, help="model path, for its chat template")
    run.add_argument("--logprobs", action="store_true")
    run.add_argument("--checks", action="store_true")
    run.add_argument("--server-pid", type=int, default=None)
    logs = commands.add_parser("log-check")
    logs.add_argument("log")
    logs.add_argument("--drafter", required=True)
    commands.add_parser("report").add_argument("out")
    args = parser.parse_args(argv)
    return COMMANDS[args.command](args)


def _report_command(args) -> int:
    text, failures = report(args.out)
    print(text)
    for failure in failures:
        print(f"FAILED: {failure}")
    print("gpu_check: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


def _log_command(args) -> int:
    problems = log_check(Path(args.log).read_text(errors="replace"), args.drafter)
    for problem in problems:
        print(f"{args.log}: {problem}", file=sys.stderr)
    return 1 if problems else 0


COMMANDS = {
    "gpu-memory": lambda args: print(gpu_memory_mib(args.gpu)) or 0,
    "wait-gpu-free": lambda args: 0 if wait_gpu_free(args.baseline_mib, args.timeout, gpu=args.gpu) else 1,
    "client": lambda args: client(args.name, args.port, args.out, args.model, args.logprobs, args.checks,
                                  args.server_pid) or 0,
    "log-check": _log_command,
    "report": _report_command,
}

if __name__ == "__main__":
    sys.exit(main())
