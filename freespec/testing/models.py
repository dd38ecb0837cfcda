"""Tiny random-weight causal LMs for fast tests: one builder, one table row per architecture family.

    from freespec.testing.models import tiny_random
    model = tiny_random("llama")                         # LlamaForCausalLM: hidden 64, 2 layers, float64
    model = tiny_random("gemma3", vocab_size=64, seed=3) # Gemma3ForCausalLM with sliding-window layers
    model = tiny_random("llama", num_hidden_layers=1, attn_implementation="eager")  # any config field

Every model is in eval mode, deterministic given ``seed`` (the global RNG is
left untouched), with ``initializer_range=0.2`` so that next-token
distributions are peaked rather than near-uniform, and ``sdpa`` attention.

A family is a row of ``FAMILIES``: transformers' ``model_type`` (the model
class is what ``AutoModelForCausalLM`` maps it to) and the config kwargs that
make it tiny. Adding an architecture is adding a row; families whose config
uses Llama's field names (``hidden_size``, ``num_hidden_layers``, ...) start
from ``llama_style()``, others (GPT-2's ``n_embd``, ``n_layer``) list theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..models import check_dtype


@dataclass(frozen=True)
class TinyFamily:
    """One architecture: ``model_type`` for ``AutoConfig.for_model`` and the kwargs that make it tiny."""

    model_type: str
    config: Mapping[str, Any] = field(default_factory=dict)
    notes: str = ""


def llama_style(**extra) -> dict[str, Any]:
    """Sizes in Llama's field names (hidden 64, 2 layers, 4 heads, 2 kv heads), updated with ``extra``."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)
    return {**sizes, **extra}


IDS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

FAMILIES: dict[str, TinyFamily] = {
    "llama": TinyFamily("llama", llama_style(**IDS), "LlamaForCausalLM; bos=0, eos=1, pad=1"),
    "llama-linear-rope": TinyFamily("llama", llama_style(rope_scaling={"rope_type": "linear", "factor": 2.0}, **IDS)),
    "llama-dynamic-rope": TinyFamily(
        "llama", llama_style(max_position_embeddings=48, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, **IDS),
        "dynamic NTK RoPE from position 48: prompts in tests cross it"),
    "llama-yarn-rope": TinyFamily("llama", llama_style(
        rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}, **IDS)),
    "llama3-rope": TinyFamily("llama", llama_style(rope_scaling=ROPE_LLAMA3, **IDS)),
    "mistral": TinyFamily("mistral", llama_style(sliding_window=8, **IDS), "sliding window 8"),
    "mixtral": TinyFamily("mixtral", llama_style(sliding_window=None, num_local_experts=4, num_experts_per_tok=2,
                                                 **IDS)),
    "qwen2": TinyFamily("qwen2", llama_style(**IDS)),
    "qwen2_moe": TinyFamily("qwen2_moe", llama_style(shared_expert_intermediate_size=64, **MOE, **IDS)),
    "qwen3": TinyFamily("qwen3", llama_style(head_dim=16, **IDS)),
    "qwen3_moe": TinyFamily("qwen3_moe", llama_style(head_dim=16, **MOE, **IDS)),
    "gemma": TinyFamily("gemma", llama_style(head_dim=16, **IDS)),
    "gemma2": TinyFamily("gemma2", llama_style(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                               attn_implementation="eager", **IDS),
                         "alternating sliding (window 8) and full layers; eager attention (no sdpa)"),
    "gemma3": TinyFamily(
        "gemma3_text",
        llama_style(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                    bos_token_id=2, eos_token_id=1, pad_token_id=0),
        "Gemma3ForCausalLM; layers sliding, sliding, full, sliding (window 8); bos=2, eos=1, pad=0"),
    "phi": TinyFamily("phi", llama_style(**IDS)),
    "phi3-longrope": TinyFamily(
        "phi3", llama_style(original_max_position_embeddings=48, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}, **IDS),
        "LongRoPE: short factors up to position 48, long ones (and a re-prefill) past it"),
    "starcoder2": TinyFamily("starcoder2", llama_style(sliding_window=None, **IDS)),
    "stablelm": TinyFamily("stablelm", llama_style(**IDS)),
    "cohere": TinyFamily("cohere", llama_style(**IDS)),
    "olmo2": TinyFamily("olmo2", llama_style(**IDS)),
    "granite": TinyFamily("granite", llama_style(**IDS)),
    "gpt2": TinyFamily("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **IDS)),
    "gpt_bigcode": TinyFamily("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024,
                                                  multi_query=True, **IDS), "multi-query attention"),
    "gpt_neox": TinyFamily("gpt_neox", llama_style(**IDS)),
    "gptj": TinyFamily("gptj", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=1024, **IDS)),
    "opt": TinyFamily("opt", dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                  max_position_embeddings=1024, word_embed_proj_dim=64, init_std=0.2, **IDS)),
    "falcon": TinyFamily("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=False,
                                        new_decoder_architecture=True, num_kv_heads=2, **IDS), "rotary"),
    "falcon-alibi": TinyFamily("falcon", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                              alibi=True, **IDS), "ALiBi: chains only"),
    "bloom": TinyFamily("bloom", dict(hidden_size=64, n_layer=2, n_head=4, attn_implementation="eager", **IDS),
                        "ALiBi: chains only; eager attention (no sdpa)"),
    "mpt": TinyFamily("mpt", dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=1024, use_cache=True,
                                  init_config={"init_std": 0.2}, attn_implementation="eager", **IDS),
                      "ALiBi: chains only; eager attention (no sdpa)"),
}

_COMMON = {"initializer_range": 0.2, "attn_implementation": "sdpa"}


def tiny_random(family: str, vocab_size: int = 128, seed: int = 0, dtype=torch.float64, **overrides):
    """A small random-weight causal LM of ``family`` (a key of ``FAMILIES``), eval mode.

    ``overrides`` replace the family's config kwargs (``num_hidden_layers=1``,
    ``attn_implementation="eager"``, ...); a key the config does not know raises
    ``ValueError`` (a misspelt one would otherwise be kept and ignored).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family={family!r} is unknown; known: {', '.join(sorted(FAMILIES))}")
    if not isinstance(vocab_size, int) or vocab_size < 4:
        raise ValueError(f"vocab_size must be an int >= 4, got {vocab_size!r}")
    check_dtype(dtype)
    row = FAMILIES[family]
    known = set(AutoConfig.for_model(row.model_type).to_dict()) | set(_COMMON)
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{family} config has no field(s) {', '.join(unknown)}")
    options = {"vocab_size": vocab_size, **_COMMON, **row.config, **overrides}
    config = AutoConfig.for_model(row.model_type, **options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def tiny_random_llama(vocab_size: int = 128, seed: int = 0, dtype=torch.float64, **overrides):
    """``tiny_random("llama", ...)``."""
    return tiny_random("llama", vocab_size, seed, dtype, **overrides)


def tiny_random_gemma3(vocab_size: int = 128, seed: int = 0, dtype=torch.float64, **overrides):
    """``tiny_random("gemma3", ...)``."""
    return tiny_random("gemma3", vocab_size, seed, dtype, **overrides)
