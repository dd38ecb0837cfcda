import os

# OpenMP threads that spin while other processes want the cores collapse throughput on a shared machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import functools

import pytest
import torch

from freespec import models
from freespec.testing.models import tiny_random


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
