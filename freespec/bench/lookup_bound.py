"""How few verify steps any lookup drafter could need: an oracle over the text a request has seen.

A lookup drafter (prompt lookup, suffix matching, n-gram tables, request histories; freespec under vLLM,
vLLM's ``ngram`` and ``suffix``) can only draft a continuation that follows an occurrence of the text's last
tokens somewhere it has seen: the prompt, the output so far, and (with a request history) earlier requests.
The oracle here knows the output in advance and picks, at every step, the occurrence whose continuation is
longest right, up to ``k`` tokens; the target then adds one token of its own. No lookup drafter that matches
at least ``min_match`` tokens takes fewer steps, so ``tokens / steps`` bounds its tokens per step, and a
method that already takes about the oracle's steps cannot go much faster one request at a time.

    python -m freespec.bench.lookup_bound runs/vllm --k 4,8,16

reads a serving benchmark's ``prompts.json`` and plain vLLM's outputs (``run0-vanilla.json``) and prints,
per workload and concurrency, the output tokens, the oracle's steps and its tokens per step.

``oracle_steps([1, 2, 3], [4, 1, 2, 3, 4], k=8) == 3``: 4 follows no earlier 3 (the target's token, a step),
nor 1 an earlier 4 (another), then 2 3 follow the prompt's 1 and the target adds the last 4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def longest_copy(text: list, start: int, future: list, k: int, min_match: int) -> int:
    """The most tokens of ``future[:k]`` that follow some occurrence, in ``text[:start]``, of the ``min_match``
    tokens that end ``text[:start]``. The continuation may run past ``start`` into the tokens being copied (a
    repeat), which makes the oracle stronger, never weaker: its steps stay a lower bound. ``text[start:]`` is
    ``future`` and more."""
    if start < min_match:
        return 0
    anchor = text[start - min_match:start]
    best = 0
    limit = min(k, len(future))
    for end in range(min_match, start):  # an occurrence ending at ``end`` (before the current position)
        if text[end - min_match:end] != anchor:
            continue
        length = 0
        while length < limit and text[end + length] == future[length]:
            length += 1
        best = max(best, length)
        if best == limit:
            break
    return best


def oracle_steps(prompt: list, output: list, k: int, min_match: int = 1, history: list = ()) -> int:
    """Verify steps an oracle lookup drafter of ``k`` tokens needs for ``output`` (see the module docstring):
    each step drafts the longest right continuation found after the last ``min_match`` tokens in
    ``history + prompt + output so far``, and the target adds one token."""
    if k < 1 or min_match < 1:
        raise ValueError(f"k and min_match must be >= 1, got {k} and {min_match}")
    text = list(history) + list(prompt) + list(output)
    position, end, steps = len(history) + len(prompt), len(text), 0
    while position < end:
        drafted = longest_copy(text, position, text[position:end - 1], k, min_match)  # the last token is the target's
        position += drafted + 1
        steps += 1
    return steps


def bound(prompts: dict, outputs: dict, ks: list[int], min_match: int = 1) -> list[dict]:
    """Per ``workload@concurrency`` of a serving benchmark and per ``k``: output tokens, oracle steps, tokens per
    step (``prompts``: its ``prompts.json``; ``outputs``: a run's ``{key: {"outputs": [...]}}``)."""
    rows = []
    for workload, phases in prompts.items():
        for concurrency, items in phases.items():
            key = f"{workload}@{concurrency}"
            pairs = list(zip([ids for _, ids in items], outputs[key]["outputs"]))
            tokens = sum(len(out) for _, out in pairs)
            for k in ks:
                steps = sum(oracle_steps(prompt, out, k, min_match) for prompt, out in pairs)
                rows.append({"workload": workload, "concurrency": int(concurrency), "k": k, "tokens": tokens,
                             "oracle_steps": steps, "tokens_per_step": tokens / steps if steps else 0.0})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a serving benchmark's --out (prompts.json, run0-vanilla.json)")
    parser.add_argument("--k", default="8", help="draft lengths, comma-separated")
    parser.add_argument("--min-match", type=int, default=1)
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    prompts = json.loads((run_dir / "prompts.json").read_text())
    outputs = json.loads((run_dir / "run0-vanilla.json").read_text())
    ks = [int(k) for k in args.k.split(",")]
    print("| workload | concurrency | K | output tokens | oracle steps | tokens per step |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in bound(prompts, outputs, ks, args.min_match):
        print(f"| {row['workload']} | {row['concurrency']} | {row['k']} | {row['tokens']} | {row['oracle_steps']} | "
              f"{row['tokens_per_step']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
