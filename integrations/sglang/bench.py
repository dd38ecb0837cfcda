"""What drafting costs on SGLang's scheduler thread: ``DraftServer`` beside SGLang's C++ ``NgramCorpus``.

Every decode step SGLang's NGRAM worker calls its corpus on the scheduler's
critical path, between two GPU forwards: ``synchronize``, ``batch_get`` and,
after verification, ``batch_put``. This script makes the same calls on each
corpus, in one process on the CPU, and reports microseconds per request::

    python -m freespec.integrations.sglang.bench                  # batch 1, 8, 32, 128
    python -m freespec.integrations.sglang.bench --batch-sizes 32 --drafters prompt_lookup

(``python -m freespec.integrations.sglang.bench serving ...`` is the serving benchmark instead: plain SGLang,
NGRAM and freespec's drafts in real engines, ``bench_serving.py``.)

Workload: requests with ``--prompt-len``-token prompts of Zipf-distributed
phrases; each output copies spans of its prompt (70%) or new phrases (30%),
as code edits and summaries do. Every step each request advances by 1 to 4
tokens, the same for every corpus (whatever it drafted), so all corpora get
identical calls. The first ``batch_get`` of a request indexes its prompt
(``start``, reported apart); the C++ corpus is fed what the worker feeds it:
only the last ``max_trie_depth`` tokens after each step. Between steps the
script sleeps ``--forward-ms`` (untimed), standing for the GPU forward during
which the C++ corpus inserts ``batch_put``'s tails on its own thread.
``freespec adapter only`` serves a drafter that proposes one fixed chain
without any lookup: what ``DraftServer`` itself costs (request sync, tree rows).
Last, the tree rows alone (``write_sglang_trees``) per request.

Times are the calling thread's CPU time (``time.thread_time``): what the
scheduler thread spends, whatever else the machine runs meanwhile; the C++
corpus's insert thread is not counted (its work overlaps the GPU forward).
Needs sglang importable (its C++ corpus compiles on first use, ~40 s; ``--no-sglang``
skips it). Columns: ``get`` = ``batch_get`` per request, ``step`` =
everything the worker calls per step per request (ours: offer + get + put;
C++: synchronize + get + put), ``nodes`` = mean drafted nodes per request.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from freespec.draft import Budget, Draft
from freespec.drafters import Drafter

from .draft_server import DraftServer
from .tree_format import write_sglang_trees


class FixedChain(Drafter):
    """Proposes the chain 1, 2, ..., budget.num_nodes every step: a drafter that costs nothing to ask."""

    name = "fixed-chain"

    def _propose(self, request_id, budget: Budget) -> Draft:
        return Draft.chain(list(range(1, budget.num_nodes + 1)))


def make_requests(num_requests: int, prompt_len: int, output_len: int, seed: int) -> list[tuple[list, list]]:
    """(prompt, output) token lists: Zipf phrases; outputs copy prompt spans (70%) or new phrases (30%)."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(1, 50_000, int(rng.integers(2, 12))).tolist() for _ in range(2000)]

    def text(length):
        out = []
        while len(out) < length:
            out += phrases[int(rng.zipf(1.2)) % len(phrases)]
        return out[:length]

    requests = []
    for _ in range(num_requests):
        prompt, output = text(prompt_len), []
        while len(output) < output_len:
            if rng.random() < 0.7:
                start = int(rng.integers(0, prompt_len - 32))
                output += prompt[start:start + int(rng.integers(8, 32))]
            else:
                output += text(int(rng.integers(4, 16)))
        requests.append((prompt, output[:output_len]))
    return requests


class _Stream:
    """The worker's calls for a batch of requests: per step, each request advances by 1 to 4 tokens."""

    def __init__(self, requests, steps: int, depth: int, seed: int):
        rng = np.random.default_rng(seed)
        self.rids = [f"req-{i}" for i in range(len(requests))]
        self.requests, self.depth = requests, depth
        self.advance = rng.integers(1, 5, (steps, len(requests)))  # [steps, B]
        self.num_out = np.ones(len(requests), np.int64)  # output tokens committed (one from the prefill)

    def tails(self):
        out = []
        for (prompt, output), n in zip(self.requests, self.num_out.tolist()):
            out.append((prompt[-max(0, self.depth - n):] if n < self.depth else []) + output[max(0, n - self.depth):n])
        return out, [len(prompt) + n for (prompt, _), n in zip(self.requests, self.num_out.tolist())]

    def offers(self):
        return [(rid, prompt, output[:n]) for rid, (prompt, output), n in
                zip(self.rids, self.requests, self.num_out.tolist())]

    def step(self, step: int) -> None:
        self.num_out = np.minimum(self.num_out + self.advance[step], [len(o) for _, o in self.requests])


def time_corpus(corpus, stream: _Stream, steps: int, ours: bool, forward_s: float) -> dict:
    """CPU microseconds per request: start (first batch_get), get, step; and mean drafted nodes."""
    batch_size, d = len(stream.rids), corpus.draft_token_num
    get_s = step_s = 0.0
    nodes = 0
    for step in range(steps + 1):
        tails, lens = stream.tails()
        begin = time.thread_time()
        if ours:
            corpus.offer_contexts(stream.offers())
        else:
            corpus.synchronize()
        got = time.thread_time()
        token_ids, _ = corpus.batch_get(stream.rids, tails, lens)
        done = time.thread_time()
        corpus.batch_put(tails)
        end = time.thread_time()
        time.sleep(forward_s)  # the GPU forward: C++ inserts the tails meanwhile
        if step == 0:
            start_s = end - begin  # requests start: prompts are indexed
        else:
            get_s += done - got
            step_s += end - begin
            nodes += int(np.count_nonzero(token_ids.reshape(batch_size, d)[:, 1:]))
            stream.step(step - 1)
    per = 1e6 / (steps * batch_size)
    return {"start": start_s * 1e6 / batch_size, "get": get_s * per, "step": step_s * per,
            "nodes": nodes / (steps * batch_size)}


def sglang_corpus(depth: int, num_draft_tokens: int):
    """SGLang's own C++ NgramCorpus with the worker's default knobs (0.5.23 flags' defaults)."""
    from . import hooks

    if hooks.installed():  # the plugin replaced it where SGLang imports it
        NgramCorpus = hooks.original(hooks.NGRAM_CORPUS)
    else:
        from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus
    return NgramCorpus(max_trie_depth=depth, min_bfs_breadth=1, max_bfs_breadth=10, draft_token_num=num_draft_tokens,
                       match_type="BFS", capacity=10_000_000)


def adapter_only(depth: int, num_draft_tokens: int) -> DraftServer:
    server = DraftServer(max_trie_depth=depth, draft_token_num=num_draft_tokens, drafter="prompt_lookup")
    server.drafter = FixedChain()
    return server


def run(batch_sizes, drafters, steps: int, prompt_len: int, num_draft_tokens: int, depth: int, seed: int,
        with_sglang: bool = True, forward_ms: float = 5.0) -> list[dict]:
    """One row per (batch size, corpus)."""
    rows = []
    output_len = 4 * steps + 8
    for batch_size in batch_sizes:
        requests = make_requests(batch_size, prompt_len, output_len, seed)
        corpora = [("sglang C++ NgramCorpus", lambda: sglang_corpus(depth, num_draft_tokens), False)] \
            if with_sglang else []
        corpora.append(("freespec adapter only", lambda: adapter_only(depth, num_draft_tokens), True))
        corpora += [(f"freespec {name}", lambda name=name: DraftServer(
            max_trie_depth=depth, draft_token_num=num_draft_tokens, drafter=name), True) for name in drafters]
        for label, build, ours in corpora:
            result = time_corpus(build(), _Stream(requests, steps, depth, seed), steps, ours, forward_ms / 1e3)
            rows.append({"batch": batch_size, "corpus": label, **result})
    return rows


def time_tree_rows(batch_sizes, num_draft_tokens: int, seed: int, repeats: int = 20) -> dict[int, float]:
    """CPU microseconds per request of ``write_sglang_trees`` alone, on branchy drafts of D - 1 nodes."""
    rng = np.random.default_rng(seed)
    out = {}
    for batch_size in batch_sizes:
        drafts = [Draft.from_sequences([rng.integers(1, 50, num_draft_tokens).tolist() for _ in range(4)],
                                       num_nodes=num_draft_tokens - 1) for _ in range(batch_size)]
        roots = [1] * batch_size
        write_sglang_trees(drafts, roots, num_draft_tokens)
        best = float("inf")
        for _ in range(repeats):
            begin = time.thread_time()
            write_sglang_trees(drafts, roots, num_draft_tokens)
            best = min(best, time.thread_time() - begin)
        out[batch_size] = best * 1e6 / batch_size
    return out


def table(rows: list[dict]) -> str:
    """Markdown table; ``x C++`` is get time over the C++ corpus's at the same batch size."""
    reference = {row["batch"]: row["get"] for row in rows if row["corpus"].startswith("sglang")}
    lines = ["| batch | corpus | start us/req | get us/req | step us/req | x C++ (get) | nodes/req |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        ratio = f"{row['get'] / reference[row['batch']]:.2f}" if row["batch"] in reference else "-"
        lines.append(f"| {row['batch']} | {row['corpus']} | {row['start']:.0f} | {row['get']:.1f} | "
                     f"{row['step']:.1f} | {ratio} | {row['nodes']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serving"]:  # the serving benchmark (bench_serving.py)
        from .bench_serving import main as serving_main

        sys.exit(serving_main(argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--drafters", default="prompt_lookup,suffix,mixture")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--draft-tokens", type=int, default=16, help="D, --speculative-num-draft-tokens")
    parser.add_argument("--depth", type=int, default=18, help="--speculative-ngram-max-trie-depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--forward-ms", type=float, default=5.0, help="untimed pause standing for the GPU forward")
    parser.add_argument("--no-sglang", action="store_true", help="skip SGLang's C++ corpus")
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = run(batch_sizes, [d for d in args.drafters.split(",") if d],
               args.steps, args.prompt_len, args.draft_tokens, args.depth, args.seed, not args.no_sglang,
               args.forward_ms)
    print(table(rows))
    trees = time_tree_rows(batch_sizes, args.draft_tokens, args.seed)
    print("\ntree rows alone (write_sglang_trees, best of 20), us/req: "
          + ", ".join(f"batch {b}: {us:.1f}" for b, us in trees.items()))


if __name__ == "__main__":
    main()
