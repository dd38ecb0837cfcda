"""The cost of a verify forward as a function of the tokens it feeds: measured, read, applied.

``c(k)`` is the time of a forward that feeds ``k`` tokens (the pending token
plus ``k - 1`` draft nodes, on top of a cached prefix) over the time of a
forward that feeds one. It decides what speculation is worth on a machine: on
an Intel Xeon with AMX a bfloat16 forward over 64 tokens costs about what a
one-token forward costs, while in float32 on 2 CPU threads c(2..16) is ~2.2.

- ``measure_cost_curve(model)``: ``freespec bench``'s probe. Over a cached
  prefix of 512 random tokens it times the engine's own verify forward
  (``forward_rows``) with a chain draft for k = 1, 2, 4, 8, 16, 17, 32, 33, 64 (the exact
  forward verification runs), cropping the cache back to the prefix after
  each, a few rounds in alternating order, and takes medians; it also times
  the prefill of the prefix itself (k = 512 over an empty cache). With
  ``batch_size=B`` every forward feeds k tokens to each of B rows (the prefix
  prefilled once and copied to every row): c_B(k), what the mixture's
  ``BatchCostModel`` learns live, and ``ms[0]`` over the batch-1 one-token
  time (``one_row_ms``) says what a batch costs per row.
- ``CostCurve``: c(k) as points, read from ``"1:1,2:1.16,4:1.06"``
  (``CostCurve.parse``) or from a bench ``results.json``
  (``CostCurve.from_results``), applied by ``freespec replay`` to simulate
  a machine. Between points c is linear in k; past the last point it goes on
  along the last segment's slope (never downwards); a single point is flat.

Worked example: points ``1:1, 2:1.2, 4:1.6`` give ``cost(3) == 1.4`` and
``cost(6) == 2.0`` (slope 0.2 per token past 4); with ``one_token_ms=10`` a
forward feeding 6 tokens takes ``forward_ms(6) == 20.0`` ms.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROBE_SIZES = (1, 2, 4, 8, 16, 17, 32, 33, 64)  # 17 and 33: the steps of 16-row matrix tiles
DEFAULT_ONE_TOKEN_MS = 100.0


@dataclass(frozen=True)
class CostCurve:
    """c(k) at ``sizes`` (increasing, the first is 1 with c = 1), and the time of a one-token forward.

    ``source`` says where the curve comes from (a file, the command line).
    """

    sizes: tuple[int, ...]
    ratios: tuple[float, ...]
    one_token_ms: float = DEFAULT_ONE_TOKEN_MS
    source: str = ""

    def __post_init__(self):
        if len(self.sizes) != len(self.ratios) or not self.sizes:
            raise ValueError(f"a cost curve needs one ratio per size, got {len(self.sizes)} sizes and "
                             f"{len(self.ratios)} ratios")
        if self.sizes[0] != 1 or any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"cost curve sizes must increase from 1, got {list(self.sizes)}")
        if self.ratios[0] != 1.0 or not all(math.isfinite(r) and r > 0 for r in self.ratios):
            raise ValueError(f"cost curve ratios must be positive and finite with c(1) = 1, got {list(self.ratios)}")
        if not (math.isfinite(self.one_token_ms) and self.one_token_ms > 0):
            raise ValueError(f"one_token_ms must be a positive number, got {self.one_token_ms!r}")

    @classmethod
    def from_points(cls, points: dict[int, float], one_token_ms: float = DEFAULT_ONE_TOKEN_MS,
                    source: str = "") -> "CostCurve":
        """``{1: 20.0, 2: 23.0}`` (any unit) -> sizes ``(1, 2)``, ratios ``(1.0, 1.15)``."""
        if 1 not in points:
            raise ValueError(f"a cost curve needs k=1, the cost all others are relative to; got k = {sorted(points)}")
        sizes = tuple(sorted(points))
        return cls(sizes, tuple(points[k] / points[1] for k in sizes), one_token_ms, source)

    @classmethod
    def parse(cls, text: str, argument: str = "cost_curve", one_token_ms: float | None = None) -> "CostCurve":
        """``"1:1,2:1.16,4:1.06"``: ``k:c`` pairs, c relative to the value at k=1 (which must be there)."""
        points: dict[int, float] = {}
        for part in text.split(","):
            k_text, sep, c_text = part.strip().partition(":")
            try:
                k, c = int(k_text), float(c_text)
            except ValueError:
                k, c = 0, 0.0
            if not sep or k < 1 or not (math.isfinite(c) and c > 0):
                raise ValueError(f"{argument}: {part.strip()!r} is not k:c (k a positive integer, c a positive "
                                 f"number) in {text!r}; e.g. 1:1,2:1.16,4:1.06")
            if k in points:
                raise ValueError(f"{argument}: k={k} is given twice in {text!r}")
            points[k] = c
        try:
            return cls.from_points(points, DEFAULT_ONE_TOKEN_MS if one_token_ms is None else one_token_ms,
                                   f"{argument} {text}")
        except ValueError as exc:
            raise ValueError(f"{argument}: {exc}") from None

    @classmethod
    def from_results(cls, path: str | Path, argument: str = "cost_curve",
                     one_token_ms: float | None = None) -> "CostCurve":
        """The curve ``freespec bench`` measured (``results.json``'s ``cost_curve``), prefill point included."""
        try:
            results = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{argument}: cannot read {str(path)!r} as a bench results.json ({exc})") from None
        probe = results.get("cost_curve") if isinstance(results, dict) else None
        if not probe:
            raise ValueError(f"{argument}: {str(path)!r} holds no measured cost curve (a results.json of freespec "
                             f"bench run without --no-cost-probe)")
        if probe.get("batch_size", 1) != 1:
            raise ValueError(f"{argument}: the cost curve in {str(path)!r} was measured at batch size "
                             f"{probe['batch_size']}; replay simulates one request at a time: use a results.json of "
                             f"freespec bench at --batch-size 1")
        config = results.get("config", {})
        threads = probe.get("threads", "?")
        source = (f"{path} (measured: {config.get('model', '?')}, {config.get('dtype', '?')}, "
                  f"{threads} thread{'' if threads == 1 else 's'})")
        try:
            points = {int(k): float(ms) for k, ms in zip(probe["sizes"], probe["ms"])}
            prefill = probe.get("prefill")
            if prefill and prefill["tokens"] > max(points):
                points[int(prefill["tokens"])] = float(prefill["ms"])
            measured_ms = points.get(1)
            return cls.from_points(points, measured_ms if one_token_ms is None else one_token_ms, source)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{argument}: the cost curve in {str(path)!r} is malformed ({exc})") from None

    @classmethod
    def load(cls, value: str, argument: str = "cost_curve", one_token_ms: float | None = None) -> "CostCurve":
        """A results.json path (a file, or a name ending in .json) or ``k:c`` pairs."""
        if value.endswith(".json") or Path(value).is_file():
            return cls.from_results(value, argument, one_token_ms)
        return cls.parse(value, argument, one_token_ms)

    def cost(self, num_tokens: int) -> float:
        """c(num_tokens): linear between points, along the last segment past the last point."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if num_tokens <= self.sizes[-1]:
            return float(np.interp(num_tokens, self.sizes, self.ratios))
        if len(self.sizes) == 1:
            return self.ratios[0]
        slope = (self.ratios[-1] - self.ratios[-2]) / (self.sizes[-1] - self.sizes[-2])
        return self.ratios[-1] + max(0.0, slope) * (num_tokens - self.sizes[-1])

    def forward_ms(self, num_tokens: int) -> float:
        """Simulated milliseconds of a forward feeding ``num_tokens`` tokens."""
        return self.cost(num_tokens) * self.one_token_ms

    def describe(self) -> str:
        return (f"{self.source}: c(k) x {self.one_token_ms:.2f} ms, "
                + ", ".join(f"c({k})={c:.2f}" for k, c in zip(self.sizes, self.ratios)))


def measure_cost_curve(model, sizes=PROBE_SIZES, prefix_tokens: int = 512, repeats: int = 5,
                       prefill_repeats: int = 3, seed: int = 0, batch_size: int = 1) -> dict:
    """Time the engine's verify forward feeding each of ``sizes`` tokens (to each of ``batch_size`` rows)
    over ``prefix_tokens`` cached ones.

    Returns ``{"sizes", "ms" (median per size), "ratios" (ms / ms at size 1), "samples_ms" (every timing,
    per size), "prefill": {"tokens", "ms"} (one row), "prefix_tokens", "repeats", "batch_size", "threads",
    "dtype", "device", "seconds"}``; with ``batch_size`` > 1 also ``one_row_ms``: the median one-token
    forward of a single row, timed in the same rounds. One untimed round goes first; rounds alternate
    increasing and decreasing order so a drift in the machine's speed hits every size alike.
    """
    import torch

    from ..batch import KVLayout, RowStep
    from ..draft import Draft
    from ..engine import ModelTraits, compact_cache, make_cache

    _check_probe(sizes, prefix_tokens, repeats, prefill_repeats, batch_size)
    started = time.perf_counter()
    traits = ModelTraits.of(model)
    ids = np.random.default_rng(seed).integers(0, model.get_input_embeddings().num_embeddings,
                                               prefix_tokens + sizes[-1]).tolist()
    prefix, fed = ids[:prefix_tokens], ids[prefix_tokens:]
    positions = np.arange(prefix_tokens + 1, dtype=np.int64)

    def timed_ms(cache, layout, rows) -> float:
        return _timed_forward_ms(model, traits, cache, layout, rows)

    def prefilled(num_rows: int):
        """A cache holding the prefix in every row (prefilled once, copied) and its layout."""
        cache, layout = make_cache(), KVLayout(1)
        timed_ms(cache, layout, [RowStep(prefix, positions[:-1], Draft.empty())])
        layout.compact(cache, [RowStep(prefix, positions[:-1], Draft.empty())], [[]])
        layout.drop_rows(cache, [0] * num_rows)  # row 0 kept num_rows times: a copy per row
        return cache, layout

    def step(k: int, num_rows: int) -> list:
        return [RowStep(fed[:1], positions[-1:], Draft.chain(fed[1:k]))] * num_rows

    with torch.inference_mode():
        prefill_ms = [timed_ms(make_cache(), KVLayout(1), [RowStep(prefix, positions[:-1], Draft.empty())])
                      for _ in range(prefill_repeats + 1)][1:]
        batch, single = prefilled(batch_size), (prefilled(1) if batch_size > 1 else None)
        samples, one_row = {k: [] for k in sizes}, []  # ms per size; one-row one-token ms
        for rep in range(repeats + 1):  # round 0 warms up
            for k in (sizes if rep % 2 == 0 else sizes[::-1]):
                ms = timed_ms(batch[0], batch[1], step(k, batch_size))
                compact_cache(batch[0], prefix_tokens, [])  # every row holds the prefix again
                if rep:
                    samples[k].append(ms)
            if single is not None:
                ms = timed_ms(single[0], single[1], step(1, 1))
                compact_cache(single[0], prefix_tokens, [])
                if rep:
                    one_row.append(ms)
    out = _probe_result(model, samples, prefill_ms, prefix_tokens, repeats, batch_size)
    if one_row:
        out["one_row_ms"] = statistics.median(one_row)
    out["seconds"] = time.perf_counter() - started
    return out


def _timed_forward_ms(model, traits, cache, layout, rows) -> float:
    """Milliseconds of one engine forward, the device synchronized on both sides."""
    from ..engine import forward_rows

    _synchronize(model.device)
    t0 = time.perf_counter()
    forward_rows(model, traits, cache, layout, rows)
    _synchronize(model.device)
    return 1000 * (time.perf_counter() - t0)


def _check_probe(sizes, prefix_tokens: int, repeats: int, prefill_repeats: int, batch_size: int) -> None:
    if not sizes or sizes[0] != 1 or any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"sizes must increase from 1, got {list(sizes)}")
    if prefix_tokens < 1 or repeats < 1 or prefill_repeats < 1 or batch_size < 1:
        raise ValueError(f"prefix_tokens, repeats, prefill_repeats and batch_size must be >= 1, got {prefix_tokens}, "
                         f"{repeats}, {prefill_repeats}, {batch_size}")


def _probe_result(model, samples: dict, prefill_ms: list, prefix_tokens: int, repeats: int, batch_size: int) -> dict:
    """``measure_cost_curve``'s dict from its timings (per size, in ms) and the model's settings."""
    import torch

    sizes = list(samples)
    medians = [statistics.median(samples[k]) for k in sizes]
    return {
        "sizes": sizes, "ms": medians, "ratios": [ms / medians[0] for ms in medians],
        "samples_ms": {str(k): v for k, v in samples.items()},
        "prefill": {"tokens": prefix_tokens, "ms": statistics.median(prefill_ms)},
        "prefix_tokens": prefix_tokens, "repeats": repeats, "batch_size": batch_size,
        "threads": torch.get_num_threads(), "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
    }


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
