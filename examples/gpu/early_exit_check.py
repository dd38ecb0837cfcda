"""Where does early-exit self-drafting pay? Measured on a device (a GPU), or on the CPU.

    python examples/gpu/early_exit_check.py --model qwen2.5-coder-1.5b --dtype bfloat16 --device cuda \\
        --dataset ../shared/data/spec_bench_dev.jsonl --prompts 12 --max-new-tokens 128 --out ee_gpu.json

On a GPU a verify forward over k tokens costs about one token's (c(k) ~ 1), so
the question is whether the draft passes (a fraction r of a forward each) buy
more tokens than they cost. The script:

1. decodes the first ``--calibration-prompts`` prompts plainly and calibrates the
   drafter on those outputs (layers, threshold; c(k) and r measured on the device);
2. prints the break-even: a drafted step yields ``1 + accepted`` tokens in
   ``c(1 + nodes) + passes * r`` forward-times (the calibration's simulated means);
3. decodes the other prompts with plain ``generate()``, ``freespec:early_exit`` and
   ``mixture{early_exit=True}``, interleaved (the order alternates per prompt): tokens/s,
   tau (tokens per target forward), and whether greedy output is identical;
4. measures the most that reusing the draft's entries below the first skipped layer in
   the verify forward could save (the verify forward from that layer on, over the full
   one). Only an upper bound: the draft's leaves (its last chain node and the siblings)
   were never fed, and computing their states below that layer costs another pass.

``--tiny`` runs it on a small random Llama on any device (the test suite does, on
the CPU). Nothing here changes freespec's behaviour: it only measures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

OPEN_CHAT = ("writing", "roleplay", "stem", "humanities", "translation", "qa")


def load(args):
    """(model on the device, tokenizer or None, prompts as token-id lists)."""
    from freespec import models

    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from freespec.testing.models import tiny_random_llama

        model = tiny_random_llama(vocab_size=256, num_hidden_layers=8, dtype=dtype)
        rng = np.random.default_rng(0)
        base = rng.integers(2, 256, 12).tolist()
        prompts = [base + rng.integers(2, 256, 4).tolist() for _ in range(args.prompts)]
        return model.to(args.device), None, prompts
    from freespec.bench.datasets import format_prompt

    model, tokenizer = models.load(args.model, dtype)
    items = [json.loads(line) for line in open(args.dataset)] if args.dataset else [
        {"category": "writing", "turns": ["Write a short story about a lighthouse keeper."]},
        {"category": "qa", "turns": ["Why is the sky blue?"]},
        {"category": "humanities", "turns": ["Summarize the causes of the French Revolution."]},
        {"category": "stem", "turns": ["Explain how a transistor works."]},
    ]
    items = [item for item in items if item["category"] in OPEN_CHAT]
    by_category: dict[str, list] = {}
    for item in items:
        by_category.setdefault(item["category"], []).append(item)
    ordered = [group[i] for i in range(max(map(len, by_category.values()))) for group in by_category.values()
               if i < len(group)]  # round-robin over categories
    prompts = [format_prompt(tokenizer, [{"role": "user", "content": item["turns"][0]}])
               for item in ordered[: args.prompts]]
    return model.to(args.device), tokenizer, prompts


def timed_generate(model, prompt, max_new_tokens):
    """(new token ids, seconds, freespec stats or None)."""
    import freespec
    from freespec.integrations.transformers import is_patched

    ids = torch.tensor([prompt], device=model.device)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id)
    new = out[0, len(prompt):].tolist()  # .tolist() waits for the device
    return new, time.perf_counter() - t0, freespec.stats(model) if is_patched(model) else None


def reuse_saving(handle, setting, ids, num_tokens: int, repeats: int = 5) -> dict:
    """Verify forward over ``num_tokens`` tokens from the first skipped layer on, over the full one."""
    from transformers import DynamicCache

    first_skip = next((i for i, layer in enumerate(setting.layers) if layer != i), len(setting.layers))
    cache = DynamicCache()
    handle.run(handle.embed(ids), range(handle.num_layers), cache)
    tokens = np.repeat(np.asarray(ids[-1:]), num_tokens)
    times = {"full": [], "from_first_skip": []}
    for _ in range(repeats + 1):
        for key, start in (("full", 0), ("from_first_skip", first_skip)):
            draft_cache = handle.draft_cache(cache, len(ids))
            hidden = handle.embed(tokens)
            handle.synchronize()
            t0 = time.perf_counter()
            handle.logits(handle.run(hidden, range(start, handle.num_layers), draft_cache)[0])
            handle.synchronize()
            times[key].append(time.perf_counter() - t0)
    full, rest = (float(np.median(times[k][1:])) for k in ("full", "from_first_skip"))
    return {"first_skipped_layer": first_skip, "num_layers": handle.num_layers, "tokens": num_tokens,
            "verify_s": full, "verify_from_first_skip_s": rest, "saving": 1 - rest / full}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="registered name or a model directory")
    parser.add_argument("--tiny", action="store_true", help="a small random Llama instead of --model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--dataset", help="Spec-Bench JSONL (open-chat categories are used)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in all (default: %(default)s)")
    parser.add_argument("--calibration-prompts", type=int, default=2, help="of which calibrate (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.calibration_prompts < args.prompts:
        parser.error("need 0 < --calibration-prompts < --prompts")

    from freespec.drafters.mixture import MixtureDrafter

    model, _, prompts = load(args)
    calibration, timed = prompts[: args.calibration_prompts], prompts[args.calibration_prompts:]
    drafter, setting, break_even, reuse = calibrate_and_report(model, calibration, args.max_new_tokens)
    mixture = MixtureDrafter(early_exit=True)
    mixture.early_exit = drafter  # the calibrated one
    summary = compare(model, {"vanilla": None, "early_exit": drafter, "mixture+early_exit": mixture}, timed,
                      args.max_new_tokens)
    result = {"args": vars(args), "device": str(model.device), "setting": setting.to_json(),
              "break_even_tau": break_even, "reuse": reuse, "methods": summary}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def calibrate_and_report(model, calibration: list, max_new_tokens: int):
    """(the calibrated drafter, its setting, the break-even tau, the reuse bound), printed as it goes."""
    import freespec
    from freespec.drafters.early_exit import EarlyExitDrafter

    outputs = [timed_generate(model, p, max_new_tokens)[0] for p in calibration]
    drafter = EarlyExitDrafter(cache_calibration=False)
    freespec.patch(model, drafter=drafter)
    setting = drafter.calibrate([p + o for p, o in zip(calibration, outputs)], [len(p) for p in calibration])
    freespec.unpatch(model)
    verify_cost = np.interp(1 + setting.mean_nodes, (1, 2, 4, 8, 16), setting.verify_cost)
    break_even = float(verify_cost + setting.mean_passes * setting.draft_cost)
    print(f"calibrated: {setting.mode}, {len(setting.layers)} of {drafter.handle.num_layers} layers, threshold "
          f"{setting.threshold}, agreement {setting.agreement:.2f}\n  c(k) at 1,2,4,8,16: "
          f"{[round(c, 2) for c in setting.verify_cost]}; draft pass r = {setting.draft_cost:.2f}\n"
          f"  per step: {setting.mean_nodes:.2f} nodes, {setting.mean_passes:.2f} passes, "
          f"{setting.mean_accepted:.2f} accepted -> tau {1 + setting.mean_accepted:.2f} vs break-even "
          f"{break_even:.2f}: predicted {setting.predicted_speedup:.2f}x")
    reuse = reuse_saving(drafter.handle, setting, calibration[0] + outputs[0], 1 + int(round(setting.mean_nodes)))
    print(f"  a {reuse['tokens']}-token verify forward from layer {reuse['first_skipped_layer']} on costs "
          f"{100 * (1 - reuse['saving']):.0f}% of the full one: the most reusing the draft's entries below that "
          f"layer could save (the last chain node and the siblings were never fed: they would need a pass "
          f"through those layers first)")
    return drafter, setting, break_even, reuse


def compare(model, methods: dict, prompts: list, max_new_tokens: int) -> dict:
    """Each method (name -> drafter, None: plain) on every prompt, interleaved; tokens/s, tau, identical outputs."""
    import freespec

    rows = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "outputs": []} for name in methods}
    for index, prompt in enumerate(prompts):
        for name in (list(methods) if index % 2 == 0 else list(methods)[::-1]):
            if methods[name] is not None:
                freespec.patch(model, drafter=methods[name])
            try:
                new, seconds, stats = timed_generate(model, prompt, max_new_tokens)
            finally:
                if methods[name] is not None:
                    freespec.unpatch(model)
            row = rows[name]
            row["tokens"] += len(new)
            row["seconds"] += seconds
            row["forwards"] += stats.forward_passes if stats is not None else len(new)
            row["outputs"].append(new)
    reference = rows["vanilla"]["outputs"]
    base = rows["vanilla"]["tokens"] / rows["vanilla"]["seconds"]
    summary = {}
    for name, row in rows.items():
        identical = sum(a == b for a, b in zip(row.pop("outputs"), reference))
        rate = row["tokens"] / row["seconds"]
        summary[name] = {"tokens_per_s": rate, "speedup": rate / base, "tau": row["tokens"] / max(row["forwards"], 1),
                         "identical": f"{identical}/{len(prompts)}"}
        print(f"{name:>20}: {rate:7.2f} tokens/s  {rate / base:5.2f}x  tau {summary[name]['tau']:.2f}  "
              f"greedy identical {summary[name]['identical']}")
    return summary


if __name__ == "__main__":
    main()
