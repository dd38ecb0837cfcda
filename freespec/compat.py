"""What differs between the transformers releases freespec supports (4.57 to 5.x), in one place.

Each difference is read from the installed transformers itself (a class field, an exported name),
not from its version number, so a release between the two that CI runs (4.57.x and the newest 5.x)
takes whichever side it has:

| what | transformers 4.57 ... | ... transformers 5.x |
|---|---|---|
| cache field of ``GenerateDecoderOnlyOutput`` | ``past_key_values`` | ``cache`` (5.2x) |
| cache argument of ``model.forward`` | ``past_key_values`` | ``cache`` (5.2x); ``engine.ModelTraits`` reads it |
| GGUF loading | always dequantizes | takes ``quantization_config=GgufConfig(dequantize=True)`` (5.2x) |
| a saved model directory | ``rope_theta``, tokenizer classes by model | ``rope_parameters``, ``TokenizersBackend`` (5.0) |
| ``logits_to_keep`` of ``model.forward`` | missing on Bloom, MPT, ... | everywhere; ``ModelTraits`` reads it |
| a recurrent model (Mamba) | no ``layer_types``: refused for its forward taking no KV cache | ``layer_types`` name its layers |

The last row is why a converted model copy is kept per major version (``saved_format_suffix``):
transformers 4.57 reads a 5.x ``config.json`` without error but falls back to its default RoPE
base (SmolLM2: 10,000 instead of 100,000), a silently different model. One difference stays: the
SmolLM2 tokenizer that 4.57 converts from GGUF puts a BOS token before plain text (5.x's does not);
chat templates give the same ids under both.
"""

from __future__ import annotations

import dataclasses


def transformers_version() -> tuple[int, ...]:
    """``(major, minor)`` of the installed transformers: ``"5.24.0" -> (5, 24)``, ``"4.57.6" -> (4, 57)``."""
    import transformers

    return tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())


def generate_output(sequences, scores, logits, cache):
    """``GenerateDecoderOnlyOutput`` with the cache under this release's field name.

    ``scores``/``logits``: tuples of ``[1, V]`` tensors or None; ``cache``: the KV cache.
    """
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    fields = {field.name for field in dataclasses.fields(GenerateDecoderOnlyOutput)}
    cache_field = "cache" if "cache" in fields else "past_key_values"
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **{cache_field: cache})


def gguf_dequantize_kwargs() -> dict:
    """``from_pretrained`` keyword arguments that load a GGUF file as plain float weights.

    Releases before ``GgufConfig`` always dequantize GGUF weights, so they need none.
    """
    import transformers

    if hasattr(transformers, "GgufConfig"):
        return {"quantization_config": transformers.GgufConfig(dequantize=True)}
    return {}


def saved_format_suffix() -> str:
    """Suffix of a converted model copy's directory name: ``""`` for 5.x, ``"-transformers4"`` for 4.x.

    A directory written by one major version is read wrongly by the other (see the module docstring).
    """
    major = transformers_version()[0]
    return "" if major >= 5 else f"-transformers{major}"
