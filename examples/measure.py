"""What the pipeline examples share: one text-generation pipeline call per method, measured.

``plain``: the unpatched model; ``hf-pld``: transformers' prompt lookup
(``prompt_lookup_num_tokens=10``) on the unpatched model; ``freespec``: the
patched model, with whatever the caller adds (documents, a prediction), and one
drafter kept across calls (its cost model and acceptance counts keep learning,
as they do in a patched model that serves many calls). Every call is greedy;
tokens/s is wall-clock, tau is new tokens per target forward, counted for every
method alike by a forward pre-hook (``ForwardCounter``, as ``freespec bench``
counts them). ``warm_up`` runs each method once first, untimed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import freespec
from freespec.bench.runner import ForwardCounter

HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass
class Run:
    answer: str
    token_ids: list[int]
    seconds: float
    forwards: int

    @property
    def tau(self) -> float:
        return len(self.token_ids) / max(self.forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds


def run(pipe, messages, max_new_tokens: int, **generate_kwargs) -> Run:
    """One greedy pipeline call on a chat, with its new tokens, time and target forwards."""
    prompt_len = len(pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
    counter = ForwardCounter(pipe.model)
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            result = pipe(messages, max_new_tokens=max_new_tokens, do_sample=False, return_tensors=True,
                          **generate_kwargs)
            seconds = time.perf_counter() - start
    finally:
        counter.close()
    token_ids = list(result[0]["generated_token_ids"])[prompt_len:]
    return Run(pipe.tokenizer.decode(token_ids, skip_special_tokens=True), token_ids, seconds, counter.forwards)


def warm_up(pipe, drafter) -> None:
    """One short call of each method (first-call allocations, compiled kernels), untimed."""
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    run(pipe, messages, 8)
    run(pipe, messages, 8, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
    freespec.patch(pipe.model, drafter=drafter)
    try:
        run(pipe, messages, 8)
    finally:
        freespec.unpatch(pipe.model)


class Totals:
    """Tokens and seconds per method over several questions; prints one line per method."""

    def __init__(self):
        self.runs: dict[str, list[Run]] = {}

    def add(self, name: str, result: Run) -> None:
        self.runs.setdefault(name, []).append(result)

    def line(self, name: str, result: Run) -> str:
        return f"{name:20s} tau {result.tau:5.2f}  {result.tokens_per_s:6.1f} tokens/s"

    def report(self) -> str:
        lines, base = [], None
        for name, runs in self.runs.items():
            tokens = sum(len(r.token_ids) for r in runs)
            seconds = sum(r.seconds for r in runs)
            forwards = sum(r.forwards for r in runs)
            rate = tokens / seconds
            base = base or rate
            lines.append(f"{name:20s} tau {tokens / max(forwards, 1):5.2f}  {rate:6.1f} tokens/s  "
                         f"{rate / base:4.2f}x {next(iter(self.runs))}")
        return "\n".join(lines)
