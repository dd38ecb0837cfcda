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

Time outside forwards (``outside_forward_s``: wall seconds minus the hook's forward
seconds, measured, for every method) splits for freespec into tensor work on the
model's device (``engine.tensor_s``: the step's two copies, logits conversion,
processors, argmax / sampling, top-k, cache moves) and host work (``engine.host_s``:
Python, Numba, drafting, bookkeeping, paid as it is on any device). Under
``simulate`` the forwards are charged the curve's time but tensor work stays as
measured, at this machine's prices, and is reported apart so a reader can price it,
unless a ``DeviceModel`` prices it (``device_model``, ``freespec bench --device-model``):
then ``freespec.testing.device_ops.DeviceOps`` counts every method's work on the
model's device outside forwards (kernels, bytes, copies, round trips) and the record's
times carry the model's charge for it instead of its measured time (``device``).

Simulating another machine (``simulate``, ``freespec bench --simulate``): the hook
also times every forward and charges it a ``CostCurve``'s time instead; a record's
wall and CPU seconds are then the measured ones with the forwards' measured time
replaced by the curve's, and speculative methods' drafters see the curve's time in
``on_forward`` (``simulated_on_forward``), so a live cost model learns that curve.

Multi-turn items: turn ``k`` is asked with the reference method's answers to
the earlier turns (``vanilla`` if it runs, else the first method), so every
method sees the same history; under greedy decoding all answers are equal anyway.

Batches (``batch_size`` B > 1): items are taken B at a time and each turn of
theirs is one left-padded batch (the rows whose item has that turn); every
method runs on the same batch (plain ``generate()`` for ``vanilla``, batched
speculation for ``freespec`` and ``arctic-suffix``). HF prompt lookup has no
batch mode and is not run. A record is then one batch: its tokens/s is the
whole batch's, and each row's output is compared with the reference's row.
A row's output ends at its first EOS (the pads after it are not output).
tau counts per row: new tokens over the (forward, row) pairs in which the row
was generating: the hook's rows per forward, except for plain batched
decoding, which feeds finished rows pads until the batch ends, so there a
row counts once per token it generated (tau 1.0, as unbatched).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .datasets import Item, format_prompt
from .methods import MethodSpec, make_config, make_drafter

WARMUP_MESSAGE = "Count from one to twenty in words, separated by commas."


class ForwardCounter:
    """Counts calls of ``model.forward``, the rows each fed, and tokens per row fed after the first (prefill) call;
    times each call (wall and CPU seconds) and, with a ``CostCurve`` (``simulate``), charges it the curve's time.

    Simulation: a forward feeding ``k`` tokens is charged ``curve.forward_ms(k)`` (the prefill too, at the prompt's
    width); ``last_simulated_s`` is the charge of the latest forward, which a drafter's ``on_forward`` sees in place
    of the measured time (``simulated_on_forward``), so its cost model sizes trees for the simulated machine.
    """

    def __init__(self, model, simulate=None):
        self.simulate = simulate
        self.handles = [model.register_forward_pre_hook(self._hook, with_kwargs=True),
                        model.register_forward_hook(self._done)]
        self._started = (0.0, 0.0)
        self.last_simulated_s = 0.0
        self.device_adjustment = None  # () -> seconds a device model adds to the measured time outside forwards
        self.reset()

    def outside_adjustment_s(self) -> float:
        """What the device model (``run_method``'s ``device_model``) has changed in the time outside forwards since
        the previous call: its charge for the device's work minus that work's measured time and the counter's
        own cost. 0 without one."""
        if self.device_adjustment is None:
            return 0.0
        total = self.device_adjustment()
        delta, self._adjusted_s = total - self._adjusted_s, total
        return delta

    def reset(self) -> None:
        self.forwards = 0
        self.row_forwards = 0  # rows fed, summed over forwards
        self.tokens_fed = 0  # tokens per row (the forward's width) fed by forwards after the prefill
        self.widths: dict[int, int] = {}  # forwards after the prefill, by width
        self.forward_s = 0.0  # wall seconds inside forwards
        self.forward_cpu_s = 0.0  # CPU seconds inside forwards
        self.simulated_s = 0.0  # the curve's seconds for the same forwards (simulate only)
        self._adjusted_s = 0.0  # device_adjustment() at the latest outside_adjustment_s()

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
            num_rows, num_tokens = (1, 0) if ids is None else (int(ids.shape[0]), int(ids.shape[1]))
        else:
            num_rows, num_tokens = (int(ids.shape[0]) if ids.dim() > 1 else 1), int(ids.shape[-1])
        self.forwards += 1
        self.row_forwards += num_rows
        if self.forwards > 1:
            self.tokens_fed += num_tokens
            self.widths[num_tokens] = self.widths.get(num_tokens, 0) + 1
        if self.simulate is not None:
            if num_rows != 1:
                raise ValueError(f"a simulated machine charges one row's forwards (its cost curve is a batch of "
                                 f"one's); this forward fed {num_rows} rows")
            self.last_simulated_s = self.simulate.forward_ms(max(1, num_tokens)) / 1000.0
            self.simulated_s += self.last_simulated_s
        self._started = (time.perf_counter(), time.process_time())

    def _done(self, module, args, output):
        wall, cpu = self._started
        self.forward_s += time.perf_counter() - wall
        self.forward_cpu_s += time.process_time() - cpu

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def simulated_on_forward(drafter, counter: ForwardCounter) -> None:
    """Make ``drafter`` see each forward's simulated time (``counter.last_simulated_s``) in its ``on_forward``.

    The engine reports a forward's measured seconds right after the model call returns;
    under simulation the drafter's cost model must learn the simulated machine's curve,
    not this machine's, or it sizes trees for the wrong machine. Under a device model the
    previous step's time outside its forward (``step_outside_s``) is the simulated one too: the
    device's work at the model's price, without the counter's own cost (``outside_adjustment_s``, the
    change since the previous forward: about one step). Only the bench does this.
    """
    import dataclasses

    measured = drafter.on_forward

    def on_forward(report):
        changes = {"forward_s": counter.last_simulated_s}
        adjustment = counter.outside_adjustment_s()
        if report.step_outside_s is not None:
            changes["step_outside_s"] = max(0.0, report.step_outside_s + adjustment)
        measured(dataclasses.replace(report, **changes))

    drafter.on_forward = on_forward


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

    def generate(self, model, input_ids, gen_kwargs: dict, verify_on_device: bool | None = None) -> tuple[Any, Any]:
        """(output ids [B, L], SpecStats or None). ``verify_on_device``: ``SpecConfig.verify_on_device`` of a
        speculative method (None: its own)."""
        import dataclasses

        import freespec

        if self.method.kind == "vanilla":
            return model.generate(input_ids, **gen_kwargs), None
        if self.method.kind == "hf-pld":
            return model.generate(input_ids, prompt_lookup_num_tokens=self.method.hf_num_tokens,
                                  **self.method.hf_options, **gen_kwargs), None
        config = make_config(self.method, self.drafter)
        if verify_on_device is not None:
            config = dataclasses.replace(config, verify_on_device=verify_on_device)
        freespec.patch(model, config)
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
    batch_size: int = 1


def _stats_record(stats) -> dict | None:
    if stats is None:
        return None
    return {
        "new_tokens": stats.new_tokens, "forward_passes": stats.forward_passes, "row_forwards": stats.row_forwards,
        "tau": stats.tau,
        "draft_s": stats.draft_s, "verify_s": stats.verify_s, "total_s": stats.total_s,
        "forward_s": stats.forward_s, "tensor_s": stats.tensor_s, "host_s": stats.host_s,
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


def run_method(runner: MethodRunner, model, counter: ForwardCounter, input_ids, gen_kwargs: dict,
               eos_ids: Sequence[int] = (), device_model=None):
    """One method on one batch of prompts (B >= 1): ``(output ids per row, record, SpecStats or None)``.

    The record holds new tokens (all rows), the hook's forward count, row-forwards
    and tau (per row), wall and CPU seconds, tokens/s (the whole batch), tokens per
    row fed after the prefill and those forwards by width (``forward_widths``,
    ``{"16": 40, ...}``), each row's new tokens and freespec's own stats. A
    row's output ends at its first token of ``eos_ids``; ``rows_past_eos`` counts
    rows with anything but the pad token (or an EOS, which generate() pads with when
    there is no pad token) after it: a bug of the method.

    ``device_model`` (a ``DeviceModel``, with a simulating ``counter``): the work on the model's device outside
    forwards is counted (``DeviceOps``) and charged the model's price in place of its measured time; the
    record's ``device`` holds the counts, ``measured_s``, ``charged_s`` and the counter's own cost, taken out of
    the simulated times (``overhead_s``). freespec then verifies on the device as on a GPU (``on_device``).
    """
    import contextlib

    import torch

    from ..testing.device_ops import DeviceOps

    counter.reset()
    ops = DeviceOps(model) if device_model is not None else None
    counter.device_adjustment = None if ops is None else (
        lambda: device_model.charge_work(ops.work) - ops.work.measured_s - ops.work.overhead_s)
    with torch.inference_mode(), ops if ops is not None else contextlib.nullcontext():
        t0, c0 = time.perf_counter(), time.process_time()
        out, stats = runner.generate(model, input_ids, gen_kwargs, verify_on_device=on_device(device_model))
        wall_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    counter.device_adjustment = None
    outside_forward_s = wall_s - counter.forward_s  # measured: host work and tensor work between forwards
    simulated, device = {}, {}
    if counter.simulate is not None:  # the forwards at the curve's price, everything else as measured
        simulated = {"measured_wall_s": wall_s, "measured_cpu_s": cpu_s, "measured_forward_s": counter.forward_s,
                     "simulated_forward_s": counter.simulated_s}
        wall_s += counter.simulated_s - counter.forward_s
        cpu_s += counter.simulated_s - counter.forward_cpu_s
    if ops is not None:  # the device's work at the model's price instead of this machine's, without the counter's
        charged_s = device_model.charge_work(ops.work)
        device = {"device": {**ops.work.as_dict(), "charged_s": charged_s}}
        wall_s += charged_s - ops.work.measured_s - ops.work.overhead_s
        cpu_s += charged_s - ops.work.measured_s - ops.work.overhead_s
    rows = out[:, input_ids.shape[1]:].tolist()
    outputs = [row_output(row, eos_ids) for row in rows]
    filler = {gen_kwargs.get("pad_token_id"), *eos_ids}
    past_eos = sum(1 for row, ids in zip(rows, outputs) if any(token not in filler for token in row[len(ids):]))
    row_tokens = [len(ids) for ids in outputs]
    new_tokens = sum(row_tokens)
    # plain batched decoding feeds a finished row pads until the batch ends: count its generating forwards only
    row_forwards = new_tokens if runner.method.kind == "vanilla" else counter.row_forwards
    record = {
        "new_tokens": new_tokens, "forwards": counter.forwards, "row_forwards": row_forwards,
        "tau": new_tokens / row_forwards if row_forwards else 0.0,
        "wall_s": wall_s, "cpu_s": cpu_s, "outside_forward_s": outside_forward_s,
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0,
        "tokens_fed_after_prefill": counter.tokens_fed,
        "forward_widths": {str(width): count for width, count in sorted(counter.widths.items())},
        "row_new_tokens": row_tokens, "rows_past_eos": past_eos,
        "engine": _stats_record(stats),
        **simulated, **device,
    }
    return outputs, record, stats


def on_device(device_model) -> bool | None:
    """``SpecConfig.verify_on_device`` of speculative methods: True where a ``DeviceModel`` prices the device's
    work (the accelerator's path: the whole tree verified on the device, two round trips a step, whatever this
    machine is), else None (the engine's choice for this machine)."""
    return True if device_model is not None else None


def row_output(ids: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """A row's new tokens up to and including its first EOS: ``row_output([5, 2, 0, 0], [2]) -> [5, 2]``."""
    for i, token in enumerate(ids):
        if token in eos_ids:
            return list(ids[: i + 1])
    return list(ids)


def engine_disagreement(label: str, prompt_index: int, stats, record: dict) -> str | None:
    """A loud line when a row holds tokens after its EOS, freespec fell back to plain decoding, or its counts
    differ from the hook's (every one of these that holds, joined by "; ")."""
    problems = []
    if record.get("rows_past_eos"):
        problems.append(f"!!! {label} prompt {prompt_index}: {record['rows_past_eos']} row(s) hold tokens after "
                        f"their EOS")
    if stats is not None and stats.fallback_reason:
        problems.append(f"!!! {label} fell back to plain decoding on prompt {prompt_index}: {stats.fallback_reason}")
    elif stats is not None and (stats.forward_passes, stats.row_forwards, stats.new_tokens) != (
            record["forwards"], record["row_forwards"], record["new_tokens"]):
        problems.append(f"!!! {label} prompt {prompt_index}: engine counted {stats.forward_passes} forwards / "
                        f"{stats.row_forwards} row-forwards / {stats.new_tokens} tokens, the hook "
                        f"{record['forwards']} / {record['row_forwards']} / {record['new_tokens']}")
    return "; ".join(problems) or None


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
              save_traces: bool = False, progress: bool = True, batch_size: int = 1, simulate=None,
              device_model=None, log: Callable[[str], None] = print) -> BenchRun:
    """Run every method on every prompt of ``items``, ``batch_size`` prompts at a time; see the module docstring.

    ``simulate``: a ``CostCurve``; every target forward is then charged the curve's time instead
    of its measured time, and freespec's drafters see that time (see ``ForwardCounter``).
    ``device_model``: a ``DeviceModel`` (with ``simulate``); the work on the model's device outside forwards
    is then charged its price instead of its measured time (see ``run_method``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if simulate is not None and batch_size != 1:
        raise ValueError(f"simulate: a cost curve prices one row's forwards; it needs batch_size 1, got {batch_size}")
    if device_model is not None and simulate is None:
        raise ValueError("device_model prices the tensor work of a simulated machine: it needs simulate (a cost "
                         "curve for the forwards)")
    run = BenchRun(greedy=temperature <= 0, batch_size=batch_size)
    runners = _build_runners(methods, run, log)
    if any(r.method.use_prediction for r in runners) and not any(item.predictions for item in items):
        run.notes.append("a method asks for prediction=true but no item carries a prediction: it ran without one")
    gen_kwargs = _generation_kwargs(tokenizer, max_new_tokens, temperature, seed, run)
    loop = _Loop(model, tokenizer, runners, run, gen_kwargs, seed, save_traces, log, simulate, device_model)
    try:
        if warmup:
            loop.warm_up()
        groups = [items[i: i + batch_size] for i in range(0, len(items), batch_size)]
        loop.total_prompts = sum(max(len(item.turns) for item in group) for group in groups)
        loop.progress = progress
        loop.bar = _progress_bar(loop.total_prompts, progress)
        for group in groups:
            answers: dict[int, list[str]] = {k: [] for k in range(len(group))}
            for turn in range(max(len(item.turns) for item in group)):
                rows = [k for k, item in enumerate(group) if turn < len(item.turns)]
                replies = loop.run_batch([(group[k], turn, answers[k]) for k in rows])
                for k, reply in zip(rows, replies):
                    answers[k].append(reply)
        if loop.bar is not None:
            loop.bar.close()
    finally:
        loop.counter.close()
    return run


def _build_runners(methods: Sequence[MethodSpec], run: BenchRun, log) -> list[MethodRunner]:
    """Runners of the methods that can run (the others go to ``run.unavailable``); sets the reference."""
    runners = []
    for method in methods:
        if method.kind == "hf-pld" and run.batch_size > 1:
            run.unavailable[method.label] = (f"HF prompt lookup has no batch mode (transformers runs it on one "
                                             f"sequence only): not run at batch size {run.batch_size}")
            log(f"!!! method {method.label} NOT RUN: {run.unavailable[method.label]}")
            continue
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
    """The state ``run_bench`` carries from batch to batch: the hook, the record index, the progress bar."""

    def __init__(self, model, tokenizer, runners, run: BenchRun, gen_kwargs: dict, seed: int, save_traces: bool,
                 log, simulate=None, device_model=None):
        self.model, self.tokenizer, self.runners, self.run = model, tokenizer, runners, run
        self.device_model = device_model
        self.gen_kwargs, self.seed, self.save_traces, self.log = gen_kwargs, seed, save_traces, log
        self.counter = ForwardCounter(model, simulate)
        if simulate is not None:
            for runner in runners:
                if runner.drafter is not None:
                    simulated_on_forward(runner.drafter, self.counter)
        self.eos_ids = _eos_ids(model, gen_kwargs)
        self.prompt_index = 0
        self.total_prompts = 0
        self.progress = False
        self.bar = None

    def warm_up(self) -> None:
        import torch

        warm_ids = format_prompt(self.tokenizer, [{"role": "user", "content": WARMUP_MESSAGE}])
        rows = [warm_ids[: len(warm_ids) - k] for k in range(self.run.batch_size)]  # ragged: exercise the padding
        input_ids, attention_mask = left_pad(rows, self.gen_kwargs.get("pad_token_id", 0), self.model.device)
        warm_kwargs = dict(self.gen_kwargs, max_new_tokens=min(16, self.gen_kwargs["max_new_tokens"]),
                           attention_mask=attention_mask)
        for runner in self.runners:
            warm = runner.warmup_copy()
            if self.counter.simulate is not None and warm.drafter is not None:
                simulated_on_forward(warm.drafter, self.counter)
            with torch.inference_mode():
                warm.generate(self.model, input_ids, warm_kwargs, verify_on_device=on_device(self.device_model))

    def run_batch(self, entries: Sequence[tuple[Item, int, Sequence[str]]]) -> list[str]:
        """Every method on one batch of prompts (item, turn, earlier answers), in ABAB / BABA order across
        batches; returns the reference's answer per row."""
        import torch

        run, index = self.run, self.prompt_index
        prompts = [format_prompt(self.tokenizer, conversation(item, turn, answers)) for item, turn, answers in entries]
        input_ids, attention_mask = left_pad(prompts, self.gen_kwargs.get("pad_token_id", 0), self.model.device)
        call_kwargs = dict(self.gen_kwargs, attention_mask=attention_mask)
        predictions = [item.prediction_of(turn) for item, turn, _ in entries]
        order = self.runners if index % 2 == 0 else self.runners[::-1]
        results: dict[str, dict] = {}
        outputs: dict[str, list[list[int]]] = {}
        for runner in order:
            label = runner.method.label
            if not run.greedy:
                torch.manual_seed(self.seed * 1_000_003 + index)
            outputs[label], results[label], stats = run_method(
                runner, self.model, self.counter, input_ids,
                _with_prediction(runner, call_kwargs, predictions, self.tokenizer), self.eos_ids, self.device_model)
            disagreement = engine_disagreement(label, index, stats, results[label])
            if disagreement:
                run.notes.append(disagreement)
                _write(self.bar, self.log, disagreement)
        if run.greedy:
            self._record_mismatches(outputs, results, entries)
        ref_rows = outputs[run.reference]
        answers = [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in ref_rows]
        rows = [{"item_id": item.item_id, "turn": turn + 1, "category": item.category_of(turn),
                 "prompt_tokens": len(prompt)} for (item, turn, _), prompt in zip(entries, prompts)]
        categories = {row["category"] for row in rows}
        run.prompts.append({
            "index": index, "item_id": ",".join(row["item_id"] for row in rows), "turn": rows[0]["turn"],
            "category": categories.pop() if len(categories) == 1 else "mixed",
            "prompt_tokens": sum(row["prompt_tokens"] for row in rows), "rows": rows,
            "order": [r.method.label for r in order], "reference_output": answers[0] if len(answers) == 1 else answers,
            "methods": {r.method.label: results[r.method.label] for r in self.runners},
        })
        if self.save_traces:
            for row, prompt, output in zip(rows, prompts, ref_rows):
                run.traces.append({"item_id": row["item_id"], "turn": row["turn"], "category": row["category"],
                                   "prompt_ids": prompt, "output_ids": output,
                                   "max_new_tokens": self.gen_kwargs["max_new_tokens"], "method": run.reference})
        self.prompt_index += 1
        self._progress(results)
        return answers

    def _record_mismatches(self, outputs: dict, results: dict, entries) -> None:
        """Compare each row with the reference's row; record every difference (its position in new tokens)."""
        for label in outputs:
            results[label]["rows_matching"] = 0
        for r, (item, turn, _) in enumerate(entries):
            mismatches = {m["method"]: m for m in compare_outputs({k: v[r] for k, v in outputs.items()},
                                                                  self.run.reference)}
            for label in outputs:
                results[label]["rows_matching"] += label not in mismatches
            for label, mismatch in mismatches.items():
                self.run.mismatches.append({"prompt_index": self.prompt_index, "row": r, "item_id": item.item_id,
                                            "turn": turn, **mismatch})
                where = f" row {r}" if len(entries) > 1 else ""
                _write(self.bar, self.log, f"!!! OUTPUT MISMATCH: {label} differs from {self.run.reference} on "
                                           f"prompt {self.prompt_index}{where} ({item.item_id}, turn {turn + 1}) at "
                                           f"new token {mismatch['first_difference']}")
        for label in outputs:
            results[label]["matches_reference"] = results[label]["rows_matching"] == len(entries)

    def _progress(self, results: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(_postfix(results, self.run.reference), refresh=False)
            self.bar.update(1)
        elif self.progress:  # no tqdm: one line per batch
            self.log(f"[{self.prompt_index}/{self.total_prompts}] {_postfix(results, self.run.reference)}")


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, device=None):
    """(input_ids [B, L], attention_mask [B, L]) of token-id rows padded on the left to the longest, on ``device``.

    ``left_pad([[5, 6], [7]], 0)`` -> ``[[5, 6], [0, 7]]``, mask ``[[1, 1], [0, 1]]``.
    """
    import torch

    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):] = torch.tensor(list(row), dtype=torch.long)
        attention_mask[b, width - len(row):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _eos_ids(model, gen_kwargs: dict) -> tuple[int, ...]:
    """The ids that end a row: the call's ``eos_token_id``, else the model's generation config's."""
    eos = gen_kwargs.get("eos_token_id", getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _with_prediction(runner: MethodRunner, call_kwargs: dict, predictions: Sequence[str | None], tokenizer) -> dict:
    """The call's generate() kwargs, with each row's item's prediction (None: that row has none) for a method
    with ``{prediction=true}``."""
    if not runner.method.use_prediction or all(p is None for p in predictions):
        return call_kwargs
    return dict(call_kwargs, prediction=list(predictions), tokenizer=tokenizer)


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
