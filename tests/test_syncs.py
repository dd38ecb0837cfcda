"""Host-device round trips per decode step, counted on CPU tensors as a CUDA run would make them.

``freespec.testing.device_ops.DeviceOps`` sees every aten op the engine runs outside the model's forward and counts
what would make the host wait for a GPU: scalar reads, copies up and down (``freespec.transfer`` copies with
``copy=True`` so a CPU run dispatches them too), ops whose output size the host must wait for, and
``Tensor.tolist`` / ``.numpy()`` / ``.item()`` of data that is not on the host (its docstring says how).

The step verifies its whole tree on the device (``SpecConfig.verify_on_device``, the accelerator path, forced here):
one copy up (inputs, cache moves, what the tree's scoring reads), one copy down (every row's token and the
observed top-k). Before this change the walk read one scalar per emitted token, the top-k once more, and every
input and cache-move index tensor was its own copy (3 + 3 per layer): 2 + 3 * layers + tokens per step.
"""

import pytest
import torch

import freespec
from freespec import engine
from freespec.drafters.recycle import RecycleDrafter
from freespec.testing.device_ops import DeviceOps
from freespec.testing.drafters import OracleDrafter
from freespec.testing.models import tiny_random_llama

from conftest import patched_generate, plain_generate

PROMPT = torch.tensor([[0, 5, 9, 13, 5, 9, 13, 5, 9, 21, 30, 5, 9]])


@pytest.fixture
def count_round_trips():
    """Runs ``generate`` on the accelerator path (``verify_on_device``), counting round trips; returns (output,
    stats, per step)."""

    def run(model, drafter, *args, grad_mode=torch.no_grad, **kwargs):
        freespec.patch(model, drafter=drafter, max_draft_tokens=6, verify_on_device=True)  # several steps
        try:
            with grad_mode(), DeviceOps(model) as mode:
                out = model.generate(*args, **kwargs)
            stats = freespec.stats(model)
        finally:
            freespec.unpatch(model)
        # per_step[0]: before the first forward (the prompt's rows); [1..]: after each forward until the next
        return out, stats, mode.per_step

    return run


def _decode_steps(per_step):
    """What each step did between two forwards (the last entry: after the last forward, before returning)."""
    return per_step[1:-1]


@pytest.mark.parametrize("do_sample, grad_mode", [(False, torch.no_grad), (True, torch.no_grad),
                                                  (False, torch.inference_mode)])
def test_a_step_makes_two_round_trips_whatever_the_tree(count_round_trips, do_sample, grad_mode):
    """Under ``torch.inference_mode`` (as ``freespec bench`` runs) the mode sees ops before their decomposition
    (``aten.to``, ``aten.is_nonzero``): the same round trips."""
    model = tiny_random_llama(seed=2)
    gen = dict(max_new_tokens=24, do_sample=do_sample, **({"temperature": 0.9, "top_k": 20} if do_sample else {}))
    torch.manual_seed(3)
    reference = plain_generate(model, PROMPT, **gen)[0]
    torch.manual_seed(3)
    out, stats, per_step = count_round_trips(model, OracleDrafter(reference, 128, num_wrong_siblings=2), PROMPT,
                                             grad_mode=grad_mode, **gen)
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


def test_verify_on_device_is_a_bool_or_none():
    assert freespec.SpecConfig().verify_on_device is None
    with pytest.raises(ValueError, match="verify_on_device"):
        freespec.SpecConfig(verify_on_device="yes")
