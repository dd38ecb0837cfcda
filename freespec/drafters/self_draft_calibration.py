"""Which layers an early-exit drafter runs, and how deep it drafts: chosen from measurements.

``calibrate(handle, sequences)`` takes a few of the model's own outputs (token
ids with their prompts) and:

1. runs the full model once over each (teacher forcing), keeping the hidden
   state entering every layer; the full model's argmax at each output position
   is the token a greedy verifier accepts there;
2. ranks the middle layers by how little they change the hidden state
   (``1 - cos(h_in, h_out)``, averaged over output positions);
3. scores candidate layer sets: early exit after the first L layers
   (L = N/2, 2N/3, 3N/4) and the full model with the least important
   10..50% of the middle layers skipped (first and last layer always run). A
   candidate whose first skipped layer is ``s`` starts from the full model's
   states entering layer ``s``: the layers below it compute exactly those, so
   they are not run again. Each candidate gives, per output position, the
   draft's top tokens and probabilities and whether they are the target's;
4. measures what a pass costs on this machine (``measure_costs``): a 1-token
   pass through ``n`` layers and the head, relative to a full 1-token forward
   (``r``), and a full forward over ``k`` tokens (``c(k)``);
5. simulates the drafting rule (``simulate``) for every candidate, threshold and
   number of siblings (up to the drafter's ``max_siblings``) and keeps the one
   with the most tokens per unit of time.

Worked example of the objective (``simulate``): a step drafts 3 tokens in 3
passes of cost r = 0.5 and verifies 4 tokens at c(4) = 1.2; 2 drafts are
accepted, so the step yields 3 tokens in 1.2 + 3 * 0.5 = 2.7 time units:
1.11 tokens per unit against plain decoding's 1.0.

``SelfDraftSetting`` is the result; ``load_setting``/``save_setting`` keep it per
model under ``$FREESPEC_CACHE/early_exit/`` (default ``~/.cache/freespec``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

THRESHOLDS = (0.3, 0.5, 0.6, 0.7, 0.8, 0.9)
SKIP_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5)
EXIT_FRACTIONS = (1 / 2, 2 / 3, 3 / 4)
COST_SIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class SelfDraftSetting:
    """The layers a draft pass runs and the confidence it keeps drafting at, with what was measured.

    ``mode``: "skip" (middle layers skipped) or "exit" (the first L layers);
    ``layers``: ascending layer indices a pass runs; ``threshold``: a draft grows
    while the draft's top-1 probability is at least this; ``max_siblings``: where it
    is below, this many next-best tokens may join as siblings. The rest is what the
    calibration measured (zeros when the user fixed the setting):
    ``agreement``: share of output positions where the draft's top-1 is the
    target's; ``draft_cost``: a 1-token pass over a full 1-token forward;
    ``verify_cost``: c(k) at ``COST_SIZES``; ``predicted_speedup``: simulated
    tokens per unit of time over plain decoding's; ``mean_nodes`` /
    ``mean_accepted`` / ``mean_passes``: per step, in that simulation.
    """

    mode: str
    layers: tuple[int, ...]
    threshold: float
    max_siblings: int = 1
    agreement: float = 0.0
    draft_cost: float = 0.0
    verify_cost: tuple[float, ...] = ()
    predicted_speedup: float = 0.0
    mean_nodes: float = 0.0
    mean_accepted: float = 0.0
    mean_passes: float = 0.0
    calibration_tokens: int = 0
    candidates: tuple = field(default=(), compare=False)  # (mode, layers, threshold, siblings, speedup, agreement)

    def to_json(self) -> dict:
        out = asdict(self)
        out["layers"], out["verify_cost"] = list(self.layers), list(self.verify_cost)
        out["candidates"] = [list(c) for c in self.candidates]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "SelfDraftSetting":
        data = dict(data)
        data["layers"] = tuple(int(i) for i in data["layers"])
        data["verify_cost"] = tuple(float(c) for c in data.get("verify_cost", ()))
        data["candidates"] = tuple(tuple(c) for c in data.get("candidates", ()))
        return cls(**data)


@dataclass(frozen=True)
class DraftRule:
    """How a draft grows (``EarlyExitDrafter``'s options): depth cap, siblings where confidence is low."""

    max_depth: int = 8
    max_siblings: int = 3
    min_sibling_prob: float = 0.1


@dataclass
class TeacherForced:
    """One candidate's draft at every output position: top tokens' probabilities and whether each is the target."""

    probs: np.ndarray  # [T, 1 + max_siblings] float64, descending
    hits: np.ndarray  # [T, 1 + max_siblings] bool: that token is the full model's argmax
    segment: np.ndarray  # [T] int64: which sequence the position belongs to (drafts never cross)


# ---------------------------------------------------------------------------- persistence
def setting_path(key: str) -> Path:
    from ..models import cache_root

    return cache_root() / "early_exit" / f"{key}.json"


def load_setting(key: str) -> SelfDraftSetting | None:
    path = setting_path(key)
    try:
        return SelfDraftSetting.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_setting(key: str, setting: SelfDraftSetting) -> Path:
    """Write atomically (another process may read or write the same model's file)."""
    path = setting_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(setting.to_json(), f, indent=1)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------- measuring
def full_states(handle, sequences: Sequence[np.ndarray], prompt_lens: Sequence[int]):
    """Per sequence: (hidden states entering each layer + the last output, target ids at output positions).

    Output position ``t`` (``prompt_len - 1 <= t < len - 1``) predicts token ``t + 1``;
    its target is the full model's argmax there.
    """
    out = []
    for ids, prompt_len in zip(sequences, prompt_lens):
        states = handle.run(handle.embed(ids), range(handle.num_layers), handle.draft_cache(), keep_hidden=True)
        logits = handle.logits(states[-1][0, prompt_len - 1: len(ids) - 1])
        out.append((states, logits.argmax(-1).cpu().numpy()))
    return out


def layer_importance(handle, states_and_targets, prompt_lens) -> np.ndarray:
    """``1 - cos(h_in, h_out)`` of every layer, averaged over output positions. [N] float64."""
    import torch

    total, count = np.zeros(handle.num_layers), 0
    for (states, _), prompt_len in zip(states_and_targets, prompt_lens):
        for i in range(handle.num_layers):
            before = states[i][0, prompt_len - 1: -1].to(torch.float32)
            after = states[i + 1][0, prompt_len - 1: -1].to(torch.float32)
            total[i] += float((1 - torch.nn.functional.cosine_similarity(before, after, dim=-1)).sum())
        count += states[0].shape[1] - prompt_len
    return total / max(count, 1)


def candidate_layer_sets(num_layers: int, importance: np.ndarray) -> list[tuple[str, tuple[int, ...]]]:
    """Early exits and skip sets (least important middle layers first), deduplicated, each shorter than N."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for fraction in EXIT_FRACTIONS:
        exit_layer = max(1, int(round(fraction * num_layers)))
        out.append(("exit", tuple(range(exit_layer))))
    middle = sorted(range(1, num_layers - 1), key=lambda i: (importance[i], i))
    for ratio in SKIP_RATIOS:
        skipped = set(middle[: max(1, int(round(ratio * num_layers)))])
        out.append(("skip", tuple(i for i in range(num_layers) if i not in skipped)))
    seen, unique = set(), []
    for mode, layers in out:
        if layers not in seen and 0 < len(layers) < num_layers:
            seen.add(layers)
            unique.append((mode, layers))
    return unique


def teacher_forced(handle, states_and_targets, prompt_lens, layers: Sequence[int], heads,
                   num_top: int) -> TeacherForced:
    """The candidate ``layers``' draft at every output position, reusing the full states below the first skip."""
    layers = list(layers)
    first_skip = next((i for i, layer in enumerate(layers) if layer != i), len(layers))
    probs, hits, segment = [], [], []
    for index, ((states, targets), prompt_len) in enumerate(zip(states_and_targets, prompt_lens)):
        hidden = handle.run(states[first_skip], layers[first_skip:], handle.draft_cache())
        top_probs, top_ids = draft_top(handle, hidden[0, prompt_len - 1: -1], heads, num_top)
        probs.append(top_probs)
        hits.append(top_ids == targets[:, None])
        segment.append(np.full(len(targets), index))
    return TeacherForced(np.concatenate(probs), np.concatenate(hits), np.concatenate(segment))


def draft_top(handle, hidden: torch.Tensor, heads, num_top: int) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities [Q, num_top] float64, token ids [Q, num_top] int64) of the draft's best tokens."""
    import torch

    logits = handle.logits(hidden, heads)
    probs = torch.softmax(logits, dim=-1)
    top = torch.topk(probs, k=min(num_top, probs.shape[-1]), dim=-1)
    ids = top.indices if heads is None else torch.cat([h.token_ids for h in heads])[top.indices]
    return top.values.to(torch.float64).cpu().numpy(), ids.cpu().numpy()


def measure_costs(handle, ids: np.ndarray, heads, repeats: int = 5) -> tuple[float, float, np.ndarray]:
    """(intercept, per-layer cost, c(k) at ``COST_SIZES``), in full 1-token forwards, on a cache of ``ids``.

    A 1-token pass through ``n`` layers and the draft head costs ``intercept +
    n * per_layer`` (a line fitted through passes of N/4, N/2, 3N/4 and N layers);
    c(k) is a full forward (all layers, full head) over ``k`` tokens. Each round
    times everything once and divides by its own 1-token forward; medians over
    rounds are taken, so a load spike or drift hits every size alike.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    handle.run(handle.embed(ids), range(handle.num_layers), cache)
    num_layers = handle.num_layers
    layer_counts = sorted({max(1, round(num_layers * f)) for f in (0.25, 0.5, 0.75, 1.0)})
    token = ids[-1:]

    def timed(num_layers_run, num_tokens, draft_heads):
        draft_cache = handle.draft_cache(cache, len(ids))
        handle.synchronize()
        t0 = time.perf_counter()
        hidden = handle.run(handle.embed(np.repeat(token, num_tokens)), range(num_layers_run), draft_cache)
        handle.logits(hidden[0], draft_heads)
        handle.synchronize()
        return time.perf_counter() - t0

    passes, verify = [], []
    for round_index in range(repeats + 1):  # the first round warms up and is dropped
        full = [timed(num_layers, k, None) for k in COST_SIZES]
        pass_s = [timed(n, 1, heads) for n in layer_counts]
        if round_index:
            passes.append(np.array(pass_s) / full[0])
            verify.append(np.array(full) / full[0])
    per_layer, intercept = np.polyfit(layer_counts, np.median(passes, axis=0), 1)
    if len(layer_counts) < 2 or per_layer <= 0:  # a model too small (or a machine too noisy) for a slope
        per_layer, intercept = float(np.median(passes, axis=0)[-1]) / num_layers, 0.0
    return max(float(intercept), 0.0), float(per_layer), np.maximum.accumulate(np.median(verify, axis=0))


def simulate(forced: TeacherForced, threshold: float, rule: DraftRule) -> tuple[float, float, float, int]:
    """(mean nodes, mean accepted, mean passes, steps) of the drafting rule started at every output position.

    From position ``t`` the draft takes the top-1 token while its probability is
    at least ``threshold`` (one more pass each time), and where it falls below
    adds up to ``max_siblings`` siblings of probability >= ``min_sibling_prob``
    and stops. A node counts as accepted while every node above it was. Past
    a miss the teacher-forced probabilities stand in for the draft's own.
    """
    probs, hits, segment = forced.probs, forced.hits, forced.segment
    num_positions = probs.shape[0]
    nodes = accepted = passes = 0
    for start in range(num_positions):
        alive, t = True, start
        for depth in range(rule.max_depth):
            if t >= num_positions or segment[t] != segment[start]:
                break
            nodes += 1
            passes += 1  # the pass that proposed this chain node
            low = probs[t, 0] < threshold
            hit = alive and bool(hits[t, 0])
            if low:
                for j in range(1, min(1 + rule.max_siblings, probs.shape[1])):
                    if probs[t, j] >= rule.min_sibling_prob:
                        nodes += 1
                        hit = hit or (alive and bool(hits[t, j]))
            accepted += hit
            alive = alive and bool(hits[t, 0])
            if low or depth + 1 == rule.max_depth:
                break
            t += 1
    steps = max(num_positions, 1)
    return nodes / steps, accepted / steps, passes / steps, num_positions


def speedup(mean_nodes: float, mean_accepted: float, mean_passes: float, pass_cost: float,
            verify_cost: np.ndarray) -> float:
    """Tokens per unit of time over plain decoding's: ``(1 + accepted) / (c(1 + nodes) + passes * r)``."""
    verify = float(np.interp(1 + mean_nodes, COST_SIZES, verify_cost))
    return (1 + mean_accepted) / (verify + mean_passes * pass_cost)


def calibrate(handle, sequences: Sequence[np.ndarray], prompt_lens: Sequence[int], heads, rule: DraftRule,
              layer_sets: Sequence[tuple[str, tuple[int, ...]]] | None = None,
              thresholds: Sequence[float] = THRESHOLDS) -> SelfDraftSetting:
    """The candidate and threshold with the best simulated speedup (see the module docstring).

    ``sequences``: token ids (prompt + the model's output), ``prompt_lens``: where
    each output starts (>= 1). ``layer_sets``: candidates to consider (default:
    ``candidate_layer_sets``); ``thresholds``: thresholds to consider.
    """
    sequences = [np.asarray(s, np.int64) for s in sequences]
    prompt_lens = [int(p) for p in prompt_lens]
    if not sequences or any(not 1 <= p < len(s) for s, p in zip(sequences, prompt_lens)):
        raise ValueError("calibration needs sequences with 1 <= prompt_len < len(sequence)")
    states = full_states(handle, sequences, prompt_lens)
    if layer_sets is None:
        layer_sets = candidate_layer_sets(handle.num_layers, layer_importance(handle, states, prompt_lens))
    intercept, per_layer, verify_cost = measure_costs(handle, max(sequences, key=len), heads)
    results = []
    for mode, layers in layer_sets:
        forced = teacher_forced(handle, states, prompt_lens, layers, heads, 1 + rule.max_siblings)
        pass_cost = intercept + len(layers) * per_layer
        for threshold in thresholds:
            for siblings in range(rule.max_siblings + 1):
                nodes, accepted, passes, steps = simulate(forced, threshold, replace(rule, max_siblings=siblings))
                results.append((speedup(nodes, accepted, passes, pass_cost, verify_cost), mode, layers, threshold,
                                siblings, float(forced.hits[:, 0].mean()), pass_cost, nodes, accepted, passes, steps))
    best = max(results, key=lambda r: r[0])
    rate, mode, layers, threshold, siblings, agreement, pass_cost, nodes, accepted, passes, steps = best
    per_candidate = {}
    for r in results:  # the best threshold and siblings of each candidate
        if r[2] not in per_candidate or r[0] > per_candidate[r[2]][4]:
            per_candidate[r[2]] = (r[1], list(r[2]), r[3], r[4], round(r[0], 4), round(r[5], 4))
    return SelfDraftSetting(mode, tuple(layers), float(threshold), int(siblings), agreement=agreement,
                            draft_cost=pass_cost, verify_cost=tuple(float(c) for c in verify_cost),
                            predicted_speedup=float(rate), mean_nodes=nodes, mean_accepted=accepted,
                            mean_passes=passes, calibration_tokens=int(steps), candidates=tuple(per_candidate.values()))
