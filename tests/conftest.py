import os

# OpenMP threads that spin while other processes want the cores collapse throughput on a shared machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import functools

import pytest
import torch
from hypothesis import settings

from freespec import models
from freespec.testing.models import tiny_random

# property tests check values, not speed: a loaded CI core must not fail them on hypothesis's 200 ms deadline
settings.register_profile("freespec", deadline=None)
settings.load_profile("freespec")


@functools.lru_cache(maxsize=None)
def _real(name):
    return models.load(name)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, float32."""
    return _real("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_llama():
    return tiny_random("llama", vocab_size=128, seed=0)


@pytest.fixture(scope="session")
def tiny_gemma3():
    return tiny_random("gemma3", vocab_size=128, seed=0)


@pytest.fixture
def fresh_llama():
    """A tiny random Llama (seed 2) of this test's own, unpatched again after it."""
    import freespec.integrations.transformers as hf

    model = tiny_random("llama", seed=2)
    yield model
    if hf.is_patched(model):
        hf.unpatch(model)


def plain_generate(model, *args, **kwargs):
    """Unpatched generate(), whatever the model's patch state."""
    import freespec.integrations.transformers as hf

    generate = model.generate.__wrapped__ if hf.is_patched(model) else model.generate
    with torch.no_grad():
        return generate(*args, **kwargs)


def patched_generate(model, drafter, *args, **kwargs):
    """(output, SpecStats) of ``generate()`` patched with ``drafter`` (a name or a Drafter); unpatched after."""
    import freespec

    freespec.patch(model, drafter=drafter)
    try:
        with torch.no_grad():
            return model.generate(*args, **kwargs), freespec.stats(model)
    finally:
        freespec.unpatch(model)


def check_drafter_options(cls, bad_options):
    """Each of ``bad_options`` raises ``ValueError``; a default instance refuses ``propose`` before ``start``
    and warms up."""
    from freespec.draft import Budget

    for options in bad_options:
        with pytest.raises(ValueError):
            cls(**options)
    drafter = cls()
    with pytest.raises(ValueError, match="start"):
        drafter.propose("never-started", Budget(4, 4))
    drafter.warmup()


def rerun_kernel_tests_without_jit(test_file):
    """Run ``test_file``'s tests whose name holds ``kernel`` again with ``NUMBA_DISABLE_JIT=1``, so the kernels'
    Python path runs (and is covered) too."""
    import os
    import subprocess
    import sys

    if os.environ.get("NUMBA_DISABLE_JIT") == "1":
        pytest.skip("already the Python path")
    env = dict(os.environ, NUMBA_DISABLE_JIT="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-k", "kernel",
                             os.path.abspath(test_file)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
