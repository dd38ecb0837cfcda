"""The benchmark loop: every method on the same prompts, in one process, interleaved.

For each prompt every method runs once, in list order on even prompts and in
reverse order on odd ones (ABAB / BABA), so a drift in the machine's speed
hits all methods alike. Before the first timed prompt every method runs once
on a fixed warm-up prompt (compiled kernels, allocator, caches).

Every method is measured the same way: a forward pre-hook on the model counts
target forwards and the tokens fed to them, ``time.perf_counter`` gives wall
seconds and ``time.process_time`` CPU seconds. freespec's own ``SpecStats``
is recorded beside them (draft and verify time, per-drafter counts) and its
forward count is cross-checked against the hook's.

Multi-turn items: turn ``k`` is asked with the reference method's answers to
the earlier turns (``vanilla`` if it runs, else the first method), so every
method sees the same history; under greedy decoding all answers are equal anyway.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .datasets import Item, format_prompt
from .methods import MethodSpec, make_config, make_drafter

WARMUP_MESSAGE = "Count from one to twenty in words, separated by commas."


class ForwardCounter:
    """Counts calls of ``model.forward`` and tokens fed after the first (prefill) call."""

    def __init__(self, model):
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        self.tokens_fed = 0  # tokens fed by forwards after the prefill

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
            num_tokens = 0 if ids is None else int(ids.shape[1])
        else:
            num_tokens = int(ids.shape[-1])
        self.forwards += 1
        if self.forwards > 1:
            self.tokens_fed += num_tokens

    def close(self) -> None:
        self.handle.remove()


@dataclass
class MethodRunner:
    """Runs one method's generate() calls; speculative methods keep one drafter across prompts."""

    method: MethodSpec
    drafter: Any = None
    available: bool = True
    unavailable_reason: str | None = None

    @classmethod
    def build(cls, method: MethodSpec) -> "MethodRunner":
        if not method.speculative:
            return cls(method)
        try:
            drafter = make_drafter(method)
        except ImportError as exc:
            return cls(method, available=False, unavailable_reason=str(exc))
        drafter.warmup()
        return cls(method, drafter)

    def warmup_copy(self) -> "MethodRunner":
        """A runner with a fresh drafter: the warm-up must not leave text in the timed drafter's request history
        (``freespec replay`` replays the timed prompts alone, and must see the same drafter state)."""
        if not self.method.speculative:
            return self
        return MethodRunner(self.method, make_drafter(self.method))

    def generate(self, model, input_ids, gen_kwargs: dict) -> tuple[Any, Any]:
        """(output ids [1, L], SpecStats or None)."""
        import freespec

        if self.method.kind == "vanilla":
            return model.generate(input_ids, **gen_kwargs), None
        if self.method.kind == "hf-pld":
            return model.generate(input_ids, prompt_lookup_num_tokens=self.method.hf_num_tokens,
                                  **self.method.hf_options, **gen_kwargs), None
        freespec.patch(model, make_config(self.method, self.drafter))
        try:
            out = model.generate(input_ids, **gen_kwargs)
            return out, freespec.stats(model)
        finally:
            freespec.unpatch(model)


@dataclass
class BenchRun:
    """What ``run_bench`` returns: one record per prompt plus what went wrong, loudly."""

    prompts: list[dict] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    unavailable: dict[str, str] = field(default_factory=dict)  # method label -> why it did not run
    notes: list[str] = field(default_factory=list)
    greedy: bool = True
    reference: str = ""
    traces: list[dict] = field(default_factory=list)


def _stats_record(stats) -> dict | None:
    if stats is None:
        return None
    return {
        "new_tokens": stats.new_tokens, "forward_passes": stats.forward_passes, "tau": stats.tau,
        "draft_s": stats.draft_s, "verify_s": stats.verify_s, "total_s": stats.total_s,
        "tokens_fed": stats.tokens_fed, "steps_with_draft": stats.steps_with_draft,
        "draft_tokens": stats.draft_tokens, "accepted_draft_tokens": stats.accepted_draft_tokens,
        "fallback_reason": stats.fallback_reason,
        "per_drafter": {name: {"proposed": d.proposed, "accepted": d.accepted}
                        for name, d in sorted(stats.per_drafter.items())},
    }


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# ------------------------------------------------------------------------------ one prompt
def conversation(item: Item, turn: int, answers: Sequence[str]) -> list[dict]:
    """The messages of ``item``'s turn ``turn``: earlier turns with ``answers`` to them, then the question.

    ``conversation(Item("1", "c", ("a", "b")), 1, ["A"])`` ->
    ``[user "a", assistant "A", user "b"]``.
    """
    if len(answers) < turn:
        raise ValueError(f"turn {turn} needs the answers to the {turn} earlier turn(s), got {len(answers)}")
    messages = []
    for k in range(turn):
        messages += [{"role": "user", "content": item.turns[k]}, {"role": "assistant", "content": answers[k]}]
    messages.append({"role": "user", "content": item.turns[turn]})
    return messages


def run_method(runner: MethodRunner, model, counter: ForwardCounter, input_ids, gen_kwargs: dict):
    """One method on one prompt: ``(output_ids, record, SpecStats or None)``.

    The record holds new tokens, the hook's forward count and tau, wall and CPU
    seconds, tokens/s, tokens fed after the prefill and freespec's own stats.
    """
    import torch

    counter.reset()
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        out, stats = runner.generate(model, input_ids, gen_kwargs)
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    output_ids = out[0, input_ids.shape[1]:].tolist()
    new_tokens = len(output_ids)
    record = {
        "new_tokens": new_tokens, "forwards": counter.forwards,
        "tau": new_tokens / counter.forwards if counter.forwards else 0.0,
        "wall_s": wall_s, "cpu_s": cpu_s,
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0,
        "tokens_fed_after_prefill": counter.tokens_fed,
        "engine": _stats_record(stats),
    }
    return output_ids, record, stats


def engine_disagreement(label: str, prompt_index: int, stats, record: dict) -> str | None:
    """A loud line when freespec fell back to plain decoding or its counts differ from the hook's."""
    if stats is None:
        return None
    if stats.fallback_reason:
        return f"!!! {label} fell back to plain decoding on prompt {prompt_index}: {stats.fallback_reason}"
    if stats.forward_passes != record["forwards"] or stats.new_tokens != record["new_tokens"]:
        return (f"!!! {label} prompt {prompt_index}: engine counted {stats.forward_passes} forwards / "
                f"{stats.new_tokens} tokens, the hook {record['forwards']} / {record['new_tokens']}")
    return None


def compare_outputs(outputs: dict[str, list[int]], reference: str) -> list[dict]:
    """One record per method whose output differs from ``reference``'s (greedy runs).

    ``compare_outputs({"a": [1, 2], "b": [1, 3, 4]}, "a")`` ->
    ``[{"method": "b", "reference": "a", "first_difference": 1, "len": 3, "reference_len": 2}]``.
    """
    ref_ids = outputs[reference]
    return [{"method": label, "reference": reference, "first_difference": _first_difference(ids, ref_ids),
             "len": len(ids), "reference_len": len(ref_ids)}
            for label, ids in outputs.items() if ids != ref_ids]


# ------------------------------------------------------------------------------ the run
def run_bench(model, tokenizer, items: Sequence[Item], methods: Sequence[MethodSpec], *,
              max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0, warmup: bool = True,
              save_traces: bool = False, progress: bool = True,
              log: Callable[[str], None] = print) -> BenchRun:
    """Run every method on every prompt of ``items``; see the module docstring."""
    run = BenchRun(greedy=temperature <= 0)
    runners = _build_runners(methods, run, log)
    if any(r.method.use_prediction for r in runners) and not any(item.predictions for item in items):
        run.notes.append("a method asks for prediction=true but no item carries a prediction: it ran without one")
    gen_kwargs = _generation_kwargs(tokenizer, max_new_tokens, temperature, seed, run)
    loop = _Loop(model, tokenizer, runners, run, gen_kwargs, seed, save_traces, log)
    try:
        if warmup:
            loop.warm_up()
        loop.total_prompts, loop.progress = sum(len(item.turns) for item in items), progress
        loop.bar = _progress_bar(loop.total_prompts, progress)
        for item in items:
            answers: list[str] = []
            for turn in range(len(item.turns)):
                answers.append(loop.run_prompt(item, turn, answers))
        if loop.bar is not None:
            loop.bar.close()
    finally:
        loop.counter.close()
    return run


def _build_runners(methods: Sequence[MethodSpec], run: BenchRun, log) -> list[MethodRunner]:
    """Runners of the methods that can run (the others go to ``run.unavailable``); sets the reference."""
    runners = []
    for method in methods:
        runner = MethodRunner.build(method)
        if runner.available:
            runners.append(runner)
        else:
            run.unavailable[method.label] = runner.unavailable_reason or "unavailable"
            log(f"!!! method {method.label} NOT RUN: {runner.unavailable_reason}")
    if not runners:
        raise ValueError("no method can run: " + "; ".join(f"{k}: {v}" for k, v in run.unavailable.items()))
    labels = [r.method.label for r in runners]
    run.reference = "vanilla" if "vanilla" in labels else labels[0]
    if run.reference != "vanilla":
        run.notes.append(f"vanilla is not among the methods: outputs and multi-turn history come from {run.reference}")
    return runners


def _generation_kwargs(tokenizer, max_new_tokens: int, temperature: float, seed: int, run: BenchRun) -> dict:
    gen_kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    if run.greedy:
        gen_kwargs["do_sample"] = False
    else:
        gen_kwargs.update(do_sample=True, temperature=temperature)
        run.notes.append(f"sampling (temperature {temperature}, seed {seed}): outputs differ between methods by "
                         f"design, so they are not compared; speedups are ratios of tokens/s")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "eos_token_id", None)
    if pad_id is not None:
        gen_kwargs["pad_token_id"] = pad_id
    return gen_kwargs


class _Loop:
    """The state ``run_bench`` carries from prompt to prompt: the hook, the prompt index, the progress bar."""

    def __init__(self, model, tokenizer, runners, run: BenchRun, gen_kwargs: dict, seed: int, save_traces: bool,
                 log):
        self.model, self.tokenizer, self.runners, self.run = model, tokenizer, runners, run
        self.gen_kwargs, self.seed, self.save_traces, self.log = gen_kwargs, seed, save_traces, log
        self.counter = ForwardCounter(model)
        self.prompt_index = 0
        self.total_prompts = 0
        self.progress = False
        self.bar = None

    def warm_up(self) -> None:
        import torch

        warm_ids = torch.tensor([format_prompt(self.tokenizer, [{"role": "user", "content": WARMUP_MESSAGE}])],
                                device=self.model.device)
        warm_kwargs = dict(self.gen_kwargs, max_new_tokens=min(16, self.gen_kwargs["max_new_tokens"]))
        for runner in self.runners:
            with torch.inference_mode():
                runner.warmup_copy().generate(self.model, warm_ids, warm_kwargs)

    def run_prompt(self, item: Item, turn: int, answers: Sequence[str]) -> str:
        """Every method on turn ``turn`` of ``item``, in ABAB / BABA order; returns the reference's answer."""
        import torch

        run, index = self.run, self.prompt_index
        prompt_ids = format_prompt(self.tokenizer, conversation(item, turn, answers))
        input_ids = torch.tensor([prompt_ids], device=self.model.device)
        call_kwargs = dict(self.gen_kwargs, attention_mask=torch.ones_like(input_ids))
        order = self.runners if index % 2 == 0 else self.runners[::-1]
        results: dict[str, dict] = {}
        outputs: dict[str, list[int]] = {}
        for runner in order:
            label = runner.method.label
            if not run.greedy:
                torch.manual_seed(self.seed * 1_000_003 + index)
            outputs[label], results[label], stats = run_method(
                runner, self.model, self.counter, input_ids,
                _with_prediction(runner, call_kwargs, item.prediction_of(turn), self.tokenizer))
            disagreement = engine_disagreement(label, index, stats, results[label])
            if disagreement:
                run.notes.append(disagreement)
                _write(self.bar, self.log, disagreement)
        if run.greedy:
            self._record_mismatches(outputs, results, item, turn)
        ref_ids = outputs[run.reference]
        answer = self.tokenizer.decode(ref_ids, skip_special_tokens=True).strip()
        category = item.category_of(turn)
        run.prompts.append({
            "index": index, "item_id": item.item_id, "turn": turn + 1, "category": category,
            "prompt_tokens": len(prompt_ids), "order": [r.method.label for r in order], "reference_output": answer,
            "methods": {r.method.label: results[r.method.label] for r in self.runners},
        })
        if self.save_traces:
            run.traces.append({"item_id": item.item_id, "turn": turn + 1, "category": category,
                               "prompt_ids": prompt_ids, "output_ids": ref_ids,
                               "max_new_tokens": self.gen_kwargs["max_new_tokens"], "method": run.reference})
        self.prompt_index += 1
        self._progress(results)
        return answer

    def _record_mismatches(self, outputs: dict, results: dict, item: Item, turn: int) -> None:
        mismatches = {m["method"]: m for m in compare_outputs(outputs, self.run.reference)}
        for label in outputs:
            results[label]["matches_reference"] = label not in mismatches
        for label, mismatch in mismatches.items():
            self.run.mismatches.append({"prompt_index": self.prompt_index, "item_id": item.item_id, "turn": turn,
                                        **mismatch})
            _write(self.bar, self.log, f"!!! OUTPUT MISMATCH: {label} differs from {self.run.reference} on prompt "
                                       f"{self.prompt_index} ({item.item_id}, turn {turn + 1}) at new token "
                                       f"{mismatch['first_difference']}")

    def _progress(self, results: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(_postfix(results, self.run.reference), refresh=False)
            self.bar.update(1)
        elif self.progress:  # no tqdm: one line per prompt
            self.log(f"[{self.prompt_index}/{self.total_prompts}] {_postfix(results, self.run.reference)}")


def _with_prediction(runner: MethodRunner, call_kwargs: dict, prediction: str | None, tokenizer) -> dict:
    """The call's generate() kwargs, with the item's prediction for a method with ``{prediction=true}``."""
    if not runner.method.use_prediction or prediction is None:
        return call_kwargs
    return dict(call_kwargs, prediction=prediction, tokenizer=tokenizer)


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="prompt", desc="bench", dynamic_ncols=True)


def _write(bar, log, msg: str) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        log(msg)


def _postfix(results: dict[str, dict], reference: str) -> str:
    base = results[reference]["wall_s"]
    return " ".join(f"{label}:{base / r['wall_s']:.2f}x" for label, r in results.items()
                    if label != reference and r["wall_s"] > 0)
