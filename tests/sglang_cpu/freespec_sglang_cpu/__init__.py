"""Test support: what a real SGLang engine lacks to verify NGRAM drafts on a CPU (never installed with freespec).

SGLang 0.5.21 decodes on a CPU with its ``torch_native`` attention backend, and
its NGRAM speculation runs there too but for two pieces built only for GPUs:

- five ``sgl_kernel`` ops (cache-slot bookkeeping and greedy tree verification),
  which the ``sgl_kernel`` stand-in in ``tests/sglang_stubs`` gives in plain torch;
- the verify forward's tree attention: ``torch_native`` has no TARGET_VERIFY path
  (its extend path reads ``extend_prefix_lens``, None in a verify batch), and the
  one CPU backend with a tree mask (``intel_amx``) needs compiled AMX kernels.
  ``tree_attention.verify_forward_around`` adds it, registered by ``register()``
  through SGLang's own ``HookRegistry`` as an AROUND hook of
  ``TorchNativeAttnBackend.forward_extend``.

Everything else, the scheduler, the NGRAM worker, the KV pool, the model,
sampling and the verification rule, is SGLang's own code. On a GPU SGLang runs
its own kernels and attention backends, and none of this is used.

``register()`` is the entry point SGLang's plugin loader calls in each of its
processes; it does nothing unless ``FREESPEC_TEST_SGLANG_CPU=1`` (``engine_env``
sets it, with ``tests/sglang_stubs`` on ``PYTHONPATH`` for ``sgl_kernel``).

For the tests of freespec's own error containment it can also inject faults
into freespec's drafter: with ``FREESPEC_TEST_SGLANG_FAULT=PREFIX``, the
mixture drafter's ``propose`` raises ``RuntimeError`` for every request whose
SGLang ``rid`` starts with ``PREFIX`` (``faults.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_ENABLE = "FREESPEC_TEST_SGLANG_CPU"
ENV_FAULT = "FREESPEC_TEST_SGLANG_FAULT"
FORWARD_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend"
STUBS = Path(__file__).resolve().parents[2] / "sglang_stubs"  # tests/sglang_stubs: sgl_kernel, torchvision

# sgl.Engine / launch_server settings that run on this CPU (plus speculative_* for NGRAM)
ENGINE_KWARGS = {
    "device": "cpu",
    "dtype": "float32",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.3,  # on a CPU SGLang budgets the machine's memory; 0.1 leaves no KV cache
    "skip_server_warmup": True,
}


def engine_env(environ=None) -> dict:
    """The environment an SGLang engine needs on this CPU: SGLang's CPU engine, the stand-ins, this plugin."""
    env = dict(os.environ if environ is None else environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # else SGLang's is_cpu() is false without a CPU kernel build
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no busy-waiting OpenMP threads beside other processes
    env[ENV_ENABLE] = "1"
    paths = [str(STUBS)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(STUBS)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def register() -> None:
    """SGLang's plugin entry point: the tree-attention hook, when ``FREESPEC_TEST_SGLANG_CPU=1``."""
    if os.environ.get(ENV_ENABLE) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .tree_attention import verify_forward_around

    HookRegistry.register(FORWARD_EXTEND, verify_forward_around, HookType.AROUND)
    if os.environ.get(ENV_FAULT):
        from .faults import inject

        inject(os.environ[ENV_FAULT])
