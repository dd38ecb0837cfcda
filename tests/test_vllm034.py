"""freespec's speculator through vLLM 0.34's own classes, on CPU tensors (``bash scripts/test_env.sh vllm034``).

The calls are made as ``vllm/v1/worker/gpu/model_runner.py`` (0.34.0) makes them each step: ``finish_requests``
(``on_requests_finished``, then the slots of finished and preempted requests freed), ``add_requests``
(``req_states.add_request``, ``speculator.add_request(slot)``, then the sampler's logits processors'
``add_request(slot, sampling_params)``), the forward and sampling, ``post_update``, ``propose``. vLLM's own
pieces here: ``register_speculative_method`` (through freespec's plugin), ``init_speculator``, the CPU runner's
``CPURequestState``, ``InputBatch``, ``LogitsProcRequestState`` and the V2 logits-processor loader. Not
vLLM's, because they need CUDA: the GPU ``RequestState`` (its ``StagedWriteTensor``/UVA buffers allocate
pinned memory, which torch refuses without an accelerator), and ``post_update`` (a Triton kernel):
``_post_update`` below does what it does to the request state, in plain torch. The forward and the rejection
sampler are a recorded sequence of committed tokens. The same sequence goes through the 0.32 ``custom_class``
proposer (``test_vllm_adapter.FakeRunner``): the drafts must be the same.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
from freespec.integrations.host_options import parse_version  # noqa: E402

if parse_version(vllm.__version__) < (0, 34, 0):
    pytest.skip(f"vLLM 0.34's V2 runner interface; found vllm {vllm.__version__}", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.worker.cpu.states import CPURequestState  # noqa: E402
from vllm.v1.worker.gpu.input_batch import InputBatch  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState  # noqa: E402
from vllm.v1.worker.gpu.sample.logits_processor.loader import build_custom_logits_processors  # noqa: E402
from vllm.v1.worker.gpu.spec_decode import init_speculator  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.speculator_config import get_custom_speculator_config_class  # noqa: E402

from freespec.drafters import make  # noqa: E402
import freespec_vllm_plugin as plugin  # noqa: E402
from freespec.integrations.vllm import admission, options, proposer as proposer_module  # noqa: E402
from freespec.integrations.vllm.speculator import FreespecSpeculator  # noqa: E402
from freespec.integrations.vllm.speculator_config import FreespecSpeculatorConfig  # noqa: E402
from test_vllm_adapter import FakeBatch, FakeRunner, Recording  # noqa: E402

K = 4
MAX_MODEL_LEN = 256
MAX_NUM_REQS = 8


def _post_update(req_states, slots: list, sampled: list) -> None:
    """What vLLM's ``post_update`` kernel does to the request state after sampling: each row's accepted tokens
    written after its sequence, its length and last sampled token moved on (stand-in for the Triton kernel)."""
    for slot, tokens in zip(slots, sampled):
        if tokens:
            total = int(req_states.total_len[slot])
            req_states.all_token_ids[slot, total:total + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            req_states.total_len[slot] = total + len(tokens)
            req_states.last_sampled_tokens[slot, 0] = tokens[-1]


def test_post_update_stand_in_matches_a_plain_reference():
    states = CPURequestState(2, 16, 16, 100, torch.device("cpu"))
    states.add_request("a", 3, [1, 2, 3], 0, 8)
    _post_update(states, [states.req_id_to_index["a"]], [[4, 5]])
    slot = states.req_id_to_index["a"]
    assert states.all_token_ids[slot, :5].tolist() == [1, 2, 3, 4, 5] and int(states.total_len[slot]) == 5
    assert int(states.last_sampled_tokens[slot, 0]) == 5


@functools.lru_cache(maxsize=None)
def _target_config():
    """vLLM's ``ModelConfig`` of a small Llama (its config alone: no weights, no tokenizer are read)."""
    from transformers import LlamaConfig
    from vllm.config import ModelConfig

    path = Path(tempfile.mkdtemp(prefix="freespec-vllm034-"))
    LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=MAX_MODEL_LEN,
                architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return ModelConfig(model=str(path), max_model_len=MAX_MODEL_LEN, dtype="float32", skip_tokenizer_init=True)


def _speculative_config(k: int = K, **extra):
    """vLLM's own ``SpeculativeConfig`` for ``method: freespec``, as ``LLM(speculative_config=...)`` builds it."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    return SpeculativeConfig(method=plugin.METHOD, num_speculative_tokens=k, target_model_config=_target_config(),
                             target_parallel_config=ParallelConfig(), **extra)


class V2Runner:
    """vLLM 0.34's model runner as far as a speculator sees it, over vLLM's own classes (module docstring)."""

    def __init__(self, monkeypatch, drafter=None, k=K, tensor_parallel_size=1):
        assert plugin.register(), "the plugin registered nothing on vLLM 0.34"
        assert get_custom_speculator_config_class(plugin.METHOD) is FreespecSpeculatorConfig
        if drafter is not None:
            monkeypatch.setattr(options, "build_drafter", lambda opts: drafter)
        config = SimpleNamespace(speculative_config=_speculative_config(k, enable_adaptive_verification=True),
                                 scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_REQS),
                                 model_config=_target_config(),
                                 parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size))
        self.req_states = CPURequestState(MAX_NUM_REQS, MAX_MODEL_LEN, 1024, 1000, torch.device("cpu"))
        self.speculator = init_speculator(config, torch.device("cpu"), self.req_states)
        assert isinstance(self.speculator, FreespecSpeculator)
        # the logits processors as the V2 sampler builds them: entry-point plugins (freespec's among them) first
        self.processors = build_custom_logits_processors(config, self.req_states, False, (admission.FreespecHints,))
        assert any(isinstance(p, admission.FreespecHints) for p in self.processors)
        self.computed: dict = {}  # request -> tokens whose KV is computed (the scheduler's num_computed_tokens)
        self.fed: dict = {}  # request -> tokens it is fed at its next decode step (1 + its draft)
        self.k = k

    def step(self, rows: list, sampled: dict, new=None, finished=(), preempted=()) -> dict:
        """One engine step; ``new``: request -> (its tokens to prefill, extra_args). Returns request -> draft."""
        rs = self.req_states
        if finished:
            self.speculator.on_requests_finished(set(finished))
        for req_id in sorted(set(finished) | set(preempted)):
            rs.remove_request(req_id)
            self.fed.pop(req_id, None)
        for req_id, (ids, extra_args) in (new or {}).items():
            rs.add_request(req_id, len(ids), list(ids), 0, 1000)
            slot = rs.req_id_to_index[req_id]
            self.speculator.add_request(slot)
            for processor in self.processors:
                processor.add_request(slot, SimpleNamespace(extra_args=extra_args))
            self.computed[req_id] = 0
            self.fed[req_id] = len(ids)
        slots = [rs.req_id_to_index[r] for r in rows]
        scheduled = np.array([self.fed[r] for r in rows], dtype=np.int32)
        values = {field.name: None for field in dataclasses.fields(InputBatch)}
        values.update(req_ids=list(rows), num_reqs=len(rows), num_reqs_after_padding=len(rows),
                      idx_mapping=torch.tensor(slots, dtype=torch.int64), idx_mapping_np=np.array(slots),
                      num_scheduled_tokens=scheduled, num_tokens=int(scheduled.sum()), has_prefill=bool(new),
                      num_computed_tokens_np=np.array([self.computed[r] for r in rows], dtype=np.int32))
        batch = InputBatch(**values)
        tokens = [sampled.get(r, []) for r in rows]
        _post_update(rs, slots, tokens)
        num_sampled = torch.tensor([len(t) for t in tokens], dtype=torch.int32)
        drafts = self.speculator.propose(batch, None, None, None, None, num_sampled, torch.zeros_like(num_sampled),
                                         rs.last_sampled_tokens, rs.next_prefill_tokens, None, None,
                                         num_speculative_tokens=self.k)
        lengths = self.speculator.draft_token_confidence_probs[:len(rows)].sum(1).long().tolist()
        out = {}
        for i, req_id in enumerate(rows):
            self.computed[req_id] = int(rs.total_len[slots[i]]) - 1
            self.fed[req_id] = 1 + lengths[i]
            out[req_id] = drafts[i, :lengths[i]].tolist()
            assert drafts[i, lengths[i]:].tolist() == [int(rs.last_sampled_tokens[slots[i], 0])] * (self.k - lengths[i])
        return out


def _recorded_sequence(seed: int, num_steps: int = 60):
    """Steps of a small engine: requests join (prompts over a small vocabulary, so lookups find matches),
    commit 1-3 tokens a step from a pattern that repeats their prompt, finish (at most one a step), and are
    preempted, then resumed with their output so far. Each step: (batch rows in order, sampled, new, finished,
    preempted), and every request's whole sequence after it."""
    rng = np.random.default_rng(seed)
    running: dict = {}  # request -> its tokens
    waiting: dict = {}  # preempted -> its tokens
    fresh = itertools.count()
    steps = []
    for _ in range(num_steps):
        new, finished, preempted = {}, [], []
        if running and rng.random() < 0.15:
            victim = sorted(running)[rng.integers(len(running))]
            finished.append(victim)
            del running[victim]
        if len(running) > 1 and rng.random() < 0.1:
            victim = sorted(running)[rng.integers(len(running))]
            preempted.append(victim)
            waiting[victim] = running.pop(victim)
        elif waiting and rng.random() < 0.5:
            req_id = sorted(waiting)[0]
            running[req_id] = waiting.pop(req_id)
            new[req_id] = (list(running[req_id]), None)
        if len(running) < 5 and rng.random() < 0.4:
            req_id = f"r{next(fresh)}"
            prompt = rng.integers(1, 12, rng.integers(6, 30)).tolist()
            running[req_id] = prompt
            new[req_id] = (list(prompt), {"prediction": prompt[:8]} if rng.random() < 0.5 else None)
        sampled = {}
        for req_id, ids in running.items():
            if len(ids) + 4 >= MAX_MODEL_LEN - 8:
                continue  # leaves at the next step
            count = 1 if req_id in new else int(rng.integers(1, 4))
            sampled[req_id] = [ids[(len(ids) + j) % min(7, len(ids))] for j in range(count)]  # its own tokens, repeated
            ids.extend(sampled[req_id])
        rows = list(running)
        rng.shuffle(rows)  # the V2 runner orders its batch for itself, step by step
        steps.append((rows, sampled, new, finished, preempted, {r: list(running[r]) for r in rows}))
    return steps


def _run_both(monkeypatch, make_drafter, steps):
    """The recorded steps through the V2 speculator and the 0.32 proposer, each with its own drafter; both clocks
    the same fixed steps, so a cost model reads the same times."""
    v2 = V2Runner(monkeypatch, make_drafter())
    v2.speculator.core.clock = itertools.count(0, 0.01).__next__
    monkeypatch.setattr(proposer_module, "check_vllm_version", lambda: "0.32.0")
    extra_args = {}
    for _, _, new, _, _, _ in steps:
        extra_args.update({r: args for r, (_, args) in new.items() if args})
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                             model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN, tokenizer=None,
                                                          get_vocab_size=lambda: 1000))
    old = proposer_module.Proposer(config, drafter=make_drafter())
    old.clock = itertools.count(0, 0.01).__next__
    runner = FakeRunner(old, extra_args)
    runner.input_batch = FakeBatch(MAX_NUM_REQS, MAX_MODEL_LEN)
    runner.load_model()
    for number, (rows, sampled, new, finished, preempted, sequences) in enumerate(steps):
        scheduled = sum(len(new[r][0]) if r in new else v2.fed[r] for r in rows)
        got = v2.step(rows, sampled, new, finished, preempted)
        runner._update_states(SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted)))
        for req_id in new:
            runner.requests.pop(req_id, None)  # resumed: vLLM 0.32 adds it again from the scheduler's new requests
        expected = runner.step({r: sequences[r] for r in rows}, {r: sampled.get(r, []) for r in rows},
                               scheduled=scheduled)
        assert [got[r] for r in rows] == expected, f"step {number}"
    return v2, old


@pytest.mark.parametrize("seed", range(3))
def test_drafts_equal_the_032_proposers_on_a_recorded_sequence(monkeypatch, seed):
    steps = _recorded_sequence(seed)
    assert any(step[3] for step in steps) and any(step[4] for step in steps), "the sequence lacks exits"
    v2, old = _run_both(monkeypatch, lambda: make("mixture", min_match=1, history_tokens=4096), steps)
    assert v2.speculator.core.num_drafted > 0 and v2.speculator.core.num_drafted == old.num_drafted
    assert v2.speculator.core.num_errors == 0 and v2.speculator.num_extra_copies == 0
    # one copy each way per step with a batch (an empty one calls for none), and no more
    assert v2.speculator.num_copies_to_host == v2.speculator.num_copies_to_device == sum(1 for s in steps if s[0])
    # every request that left is released; those still running are the only ones held
    assert sorted(v2.speculator.core.requests.ids()) == sorted(steps[-1][0])


def test_every_exit_releases_the_request(monkeypatch):
    drafter = Recording()
    v2 = V2Runner(monkeypatch, drafter)
    v2.step(["a", "b"], {"a": [3], "b": [6]}, new={"a": ([1, 2, 3], None), "b": ([4, 5, 6], None)})
    assert v2.step(["a", "b"], {"a": [4], "b": [7]}) == {"a": [5, 6, 7], "b": [8, 9, 10]}
    v2.step(["b"], {"b": [8]}, finished=["a"])
    assert ("stop", "a") in drafter.events and "a" not in v2.speculator.core.requests
    v2.step(["c"], {"c": [9]}, new={"c": ([9, 9, 9], None)}, preempted=["b"])  # b's slot freed, no finish
    assert "b" not in v2.speculator.core.requests
    # b resumes with its output so far: it starts over from its whole sequence
    v2.step(["c", "b"], {"c": [9], "b": [9]}, new={"b": ([4, 5, 6, 7, 8], None)})
    assert drafter.context("b").tolist() == [4, 5, 6, 7, 8, 9]
    v2.step([], {}, finished=["b", "c"])  # the last step before the engine idles
    assert len(v2.speculator.core.requests) == 0 and not drafter._contexts


def test_hints_reach_the_drafter_through_the_logits_processor(monkeypatch):
    drafter = Recording()
    v2 = V2Runner(monkeypatch, drafter)
    v2.step(["a", "b"], {"a": [3], "b": [6]},
            new={"a": ([1, 2, 3], {"prediction": [7, 8]}), "b": ([4, 5, 6], {"temperature_hint": 1})})
    assert drafter.hints == {"a": ("prediction", [7, 8])}


def test_errors_are_contained(monkeypatch, caplog):
    drafter = Recording(fail_on=3)
    v2 = V2Runner(monkeypatch, drafter)
    got = v2.step(["a", "b"], {"a": [3], "b": [6]}, new={"a": ([1, 2, 3], None), "b": ([4, 5, 6], None)})
    assert got == {"a": [], "b": [7, 8, 9]} and v2.speculator.core.num_errors == 1
    assert "a" not in v2.speculator.core.requests  # restarts at its next step

    def broken(*args, **kwargs):
        raise RuntimeError("a broken step")

    monkeypatch.setattr(v2.speculator.core, "draft_rows", broken)
    got = v2.step(["b"], {"b": [7]})  # the whole step fails: every row padded with its last token, no draft
    assert got == {"b": []} and v2.speculator.core.num_errors == 2


def test_a_bad_option_fails_the_engine_start_naming_it(monkeypatch, tmp_path):
    assert plugin.register()
    config = tmp_path / "freespec.json"
    config.write_text('{"drafter": "mixture", "drafter_options": {"mixture": {"min_match": "x"}}}')
    monkeypatch.setenv(options.ENV_CONFIG, str(config))
    with pytest.raises(ValueError, match=r"freespec\.json.*min_match"):
        _speculative_config()
    monkeypatch.delenv(options.ENV_CONFIG)
    monkeypatch.setenv(options.ENV_DRAFTER, "no_such_drafter")
    with pytest.raises(ValueError, match="FREESPEC_VLLM_DRAFTER: drafter 'no_such_drafter' is unknown"):
        _speculative_config()


def test_vllms_plugin_loader_registers_the_method():
    """The entry point as vLLM's loader finds it (pyproject's ``vllm.general_plugins``), then ``LLM``'s config."""
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.worker.gpu.spec_decode.speculator_config import registered_speculative_methods

    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert "freespec" in found
    found["freespec"]()
    assert "freespec" in registered_speculative_methods()
    found["freespec"]()  # every process loads it, some twice: registering the same config again is a no-op
    spec = _speculative_config(6)
    assert spec.custom_method == "freespec" and spec.num_speculative_tokens == 6
    assert spec.speculator_config.speculator_class == "freespec.integrations.vllm.speculator.FreespecSpeculator"
    from freespec.integrations import vllm as adapter

    assert adapter.speculative_config(6) == {"method": "freespec", "num_speculative_tokens": 6}


def test_pinned_staging_buffers_are_kept_across_steps_and_grown(monkeypatch):
    speculator = V2Runner(monkeypatch, Recording()).speculator
    first = speculator._staging("_to_host_buffer", 5, torch.int32)
    again = speculator._staging("_to_host_buffer", 7, torch.int32)
    assert first.data_ptr() == again.data_ptr() and speculator._to_host_buffer.numel() == 8
    assert speculator._staging("_to_host_buffer", 9, torch.int32).numel() == 9
    assert speculator._to_host_buffer.numel() == 16


def test_registering_imports_nothing_of_freespec():
    """vLLM loads general plugins in a worker before its CPU platform's kernel scan, which numba's objects fail:
    registering loads vLLM's config module, and neither freespec nor numba."""
    import subprocess
    import sys

    code = ("import sys, freespec_vllm_plugin; assert freespec_vllm_plugin.register(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('freespec', 'numba')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_the_forward_is_reported_with_the_tokens_vllm_scheduled(monkeypatch):
    """Every row fed what vLLM scheduled for it (1 + K: the padding is verified too); a step with a prefill in
    it is not reported (other tokens ran)."""

    class Timed(Recording):
        def on_forward(self, report):
            self.events.append(("forward", report.request_ids, report.tokens_per_row, round(report.forward_s, 6)))

    drafter = Timed()
    v2 = V2Runner(monkeypatch, drafter)
    v2.speculator.core.clock = itertools.count(0, 0.5).__next__
    v2.step(["a"], {"a": [3]}, new={"a": ([1, 2, 3], None)})
    v2.fed["a"] = 1 + K  # the scheduler verifies every slot
    v2.step(["a"], {"a": [4, 5]})
    v2.step(["a", "b"], {"a": [6], "b": [9]}, new={"b": ([7, 8, 9], None)})
    forwards = [event for event in drafter.events if event[0] == "forward"]
    assert forwards == [("forward", ("a",), (1 + K,), 0.5)]
    assert v2.speculator.core.num_mixed_steps == 1
    # tensor parallel ranks draft from the tokens alone: no step time reaches the drafter
    drafter = Timed()
    v2 = V2Runner(monkeypatch, drafter, tensor_parallel_size=2)
    v2.step(["a"], {"a": [3]}, new={"a": ([1, 2, 3], None)})
    v2.step(["a"], {"a": [4, 5]})
    assert not [event for event in drafter.events if event[0] == "forward"]
