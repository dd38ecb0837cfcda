"""Host-device round trips per decode step, counted on CPU tensors as a CUDA run would make them.

A ``TorchDispatchMode`` sees every aten op the engine runs outside the model's forward (the forward is the host
library's, paid by plain decoding too). What it counts, and why each is a round trip on a GPU:

- ``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)`` of a device tensor: the host waits for it;
- ``aten._to_copy`` naming a device: a blocking copy up or down (CUDA's copy synchronizes the
  stream). ``freespec.transfer`` copies with ``copy=True`` so a CPU run dispatches it too: on a CPU tensor
  ``.to("cpu")``, ``.cpu()``, ``.numpy()`` and ``.tolist()`` dispatch no copy at all;
- ops whose output size or answer the host must wait for: ``nonzero``, ``equal``, ``multinomial`` (its check of
  the probabilities reads a scalar), ``unique``, ``masked_select``, ``repeat_interleave``;
- ``Tensor.tolist`` / ``.numpy()`` / ``.item()`` called on a tensor that is not host data (``tolist`` and
  ``numpy`` dispatch nothing on a CPU tensor; on a CUDA one ``tolist`` copies, ``numpy`` raises): patched and
  counted, except on tensors the mode saw arrive on the host (a counted copy's output, ``torch.from_numpy``,
  ``torch.tensor``: ``aten.lift_fresh``) and views of them.

The step verifies its whole tree on the device (``verifies_whole_tree``, the accelerator path, forced here):
one copy up (inputs, cache moves, what the tree's scoring reads), one copy down (every row's token and the
observed top-k). Before this change the walk read one scalar per emitted token, the top-k once more, and every
input and cache-move index tensor was its own copy (3 + 3 per layer): 2 + 3 * layers + tokens per step.
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import freespec
from freespec import engine
from freespec.drafters.recycle import RecycleDrafter
from freespec.testing.drafters import OracleDrafter
from freespec.testing.models import tiny_random_llama

from conftest import patched_generate, plain_generate

PROMPT = torch.tensor([[0, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9]])
SYNCING_OPS = {"nonzero", "equal", "multinomial", "unique", "_unique", "_unique2", "unique_consecutive",
               "masked_select", "repeat_interleave"}


class RoundTrips(TorchDispatchMode):
    """Counts, per forward (a step), what would make the host wait for a GPU; see the module docstring."""

    def __init__(self, model):
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # tensors known to be host data, by id (ids are reused: checked)
        self.in_forward = False
        self.per_step: list[list[str]] = [[]]
        self.handles = [model.register_forward_pre_hook(self._start_forward),
                        model.register_forward_hook(self._end_forward)]

    def _start_forward(self, *args):
        self.in_forward = True

    def _end_forward(self, *args):
        self.in_forward = False
        self.per_step.append([])

    def count(self, what: str) -> None:
        if not self.in_forward:
            self.per_step[-1].append(what)

    def is_host(self, tensor) -> bool:
        ref = self.host.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        inputs_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        if name == "lift_fresh":
            self._mark(out)
        elif name == "_to_copy" and kwargs.get("device") is not None:
            self.count(f"copy {'up' if inputs_host else 'down'}")
            if not inputs_host:
                self._mark(out)
        elif name == "_local_scalar_dense":
            if not inputs_host:
                self.count("scalar read")
        elif name in SYNCING_OPS and not inputs_host:
            self.count(name)
        elif inputs_host:
            self._mark(out)
        return out

    def _mark(self, out) -> None:
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.host[id(t)] = weakref.ref(t)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.fixture
def count_round_trips(monkeypatch):
    """Runs ``generate`` on the accelerator path, counting round trips; returns (output, stats, per step)."""
    monkeypatch.setattr(engine, "verifies_whole_tree", lambda device: True)

    def run(model, drafter, *args, **kwargs):
        mode = RoundTrips(model)
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "item")}

        def counted(name):
            def method(self, *a, **k):
                if not mode.is_host(self):
                    mode.count(f"Tensor.{name}")
                return originals[name](self, *a, **k)
            return method

        for name in originals:
            monkeypatch.setattr(torch.Tensor, name, counted(name))
        try:
            freespec.patch(model, drafter=drafter, max_draft_tokens=6)  # several steps
            with torch.no_grad(), mode:
                out = model.generate(*args, **kwargs)
            stats = freespec.stats(model)
        finally:
            for name, original in originals.items():
                monkeypatch.setattr(torch.Tensor, name, original)
            freespec.unpatch(model)
            mode.close()
        # per_step[0]: before the first forward (the prompt's rows); [1..]: after each forward until the next
        return out, stats, mode.per_step

    return run


def _decode_steps(per_step):
    """What each step did between two forwards (the last entry: after the last forward, before returning)."""
    return per_step[1:-1]


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_step_makes_two_round_trips_whatever_the_tree(count_round_trips, do_sample):
    model = tiny_random_llama(seed=2)
    gen = dict(max_new_tokens=24, do_sample=do_sample, **({"temperature": 0.9, "top_k": 20} if do_sample else {}))
    torch.manual_seed(3)
    reference = plain_generate(model, PROMPT, **gen)[0]
    torch.manual_seed(3)
    out, stats, per_step = count_round_trips(model, OracleDrafter(reference, 128, num_wrong_siblings=2), PROMPT, **gen)
    assert out[0].tolist() == reference.tolist()
    assert stats.tau > 2  # steps accepted several tokens: a walk would have read one scalar per token
    steps = _decode_steps(per_step)
    assert len(steps) >= 3 and all(step == ["copy down", "copy up"] for step in steps), per_step


def test_a_batch_with_a_learning_drafter_makes_two_round_trips(count_round_trips):
    """Recycling reads every fed node's top-k: it comes down in the same copy as the tokens; rows that finish
    leave the cache with the next step's inputs."""
    model = tiny_random_llama(seed=2)
    prompts = torch.tensor([[1, 0, 5, 9, 13, 5, 9, 13], [0, 5, 9, 21, 30, 5, 9, 13]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1], [1] * 8])
    gen = dict(max_new_tokens=20, do_sample=False, attention_mask=mask, pad_token_id=1)
    reference = plain_generate(model, prompts, **gen)
    out, stats, per_step = count_round_trips(model, RecycleDrafter(adaptive=False), prompts, **gen)
    assert out.tolist() == reference.tolist()
    steps = _decode_steps(per_step)
    assert steps and all(sorted(step) == ["copy down", "copy up"] for step in steps), steps


@pytest.mark.parametrize("gen", [
    dict(do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3),
    dict(do_sample=False, output_scores=True, output_logits=True, return_dict_in_generate=True),
])
def test_whole_tree_greedy_equals_plain_with_right_and_wrong_drafts(monkeypatch, gen):
    """The accelerator path (every row processed on its own prefix, per depth) against plain decoding, with an
    always-right and an always-wrong drafter."""
    monkeypatch.setattr(engine, "verifies_whole_tree", lambda device: True)
    model = tiny_random_llama(seed=2)
    plain = plain_generate(model, PROMPT, max_new_tokens=30, **gen)
    sequences = plain.sequences if hasattr(plain, "sequences") else plain
    right = OracleDrafter(sequences[0], 128)
    wrong = OracleDrafter(torch.cat([PROMPT[0], (sequences[0, PROMPT.shape[1]:] + 1) % 100]), 128)
    for drafter in (right, wrong):
        out, stats = patched_generate(model, drafter, PROMPT, max_new_tokens=30, **gen)
        assert stats.fallback_reason is None
        if hasattr(plain, "sequences"):
            assert out.sequences.tolist() == plain.sequences.tolist()
            for a, b in zip(out.scores + out.logits, plain.scores + plain.logits):
                assert torch.allclose(a, b, atol=1e-6)
        else:
            assert out.tolist() == plain.tolist()
    assert stats.tau == pytest.approx(1.0)


def test_whole_tree_sampling_keeps_the_rng_in_step(monkeypatch):
    """Seeded sampling through the accelerator path draws what plain sampling draws and leaves the generator
    where plain sampling leaves it (EOS inside an accepted draft, so the walk stops mid-tree)."""
    import test_lossless

    monkeypatch.setattr(engine, "verifies_whole_tree", lambda device: True)
    test_lossless.test_sampling_consumes_the_rng_as_plain_does_when_eos_is_inside_a_draft()


def test_whole_tree_sampling_has_the_target_distribution(monkeypatch):
    """The depth-shared draws give each emitted token its node's distribution: the sampling test's tree draft,
    through the accelerator path."""
    import test_sampling

    monkeypatch.setattr(engine, "verifies_whole_tree", lambda device: True)
    model = tiny_random_llama(vocab_size=test_sampling.VOCAB, seed=5, initializer_range=0.5)
    test_sampling.test_sampled_distribution_is_exact(model, "tree")
