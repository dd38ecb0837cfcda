"""What a verify step costs and what a draft node is worth, both measured live.

``CostModel`` is c(n), the time of a forward over ``n`` fed tokens relative to a
one-token forward, from the engine's ``ForwardReport``s. ``AcceptanceCalibrator``
is P(node accepted | parent accepted) per kind of node, from the outcomes of
earlier steps. A drafter that sizes its trees (``mixture``) maximizes expected
tokens per unit of time with both; so will any drafter whose nodes cost compute.
Both are numbers about the model and the machine (no tokens), so they may be
shared across requests.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

import numpy as np

from .options import check_int


class CostModel:
    """c(n): forward time with ``n`` tokens fed over forward time with 1 token, measured live.

    Forwards are kept per bucket ``n in {1, 2, 4, ..., 64}`` (a forward goes to
    the nearest bucket in log2), the last ``window`` of each; a bucket's value is
    the median time over the median time of bucket 1 (a line through the
    buckets' medians, read at n=1, while bucket 1 has none). Unmeasured buckets
    are interpolated between measured ones (the prior's slope past the last);
    the prior ``1 + prior_slope (n - 1)`` holds until two buckets are measured.
    The curve is made non-decreasing and read linearly in ``n`` between buckets
    (measured on qwen2.5-coder-0.5b, 2 CPU threads: c(2..16) ~2.2, nearly flat),
    extrapolated past 64. Forwards of more than 64 tokens
    (prefills) are ignored.

    ``CostModel().cost(9) == 1.24`` before any measurement.
    """

    BUCKETS = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, prior_slope: float = 0.03, window: int = 32):
        if not prior_slope >= 0:
            raise ValueError(f"prior_slope must be >= 0, got {prior_slope!r}")
        check_int("window", window, 1)
        self.prior_slope = float(prior_slope)
        self._times = [deque(maxlen=window) for _ in self.BUCKETS]  # per bucket: forward seconds
        self._curve: np.ndarray | None = None  # c at BUCKETS, cached until the next add()

    def add(self, num_tokens_fed: int, forward_s: float) -> None:
        if num_tokens_fed < 1 or num_tokens_fed > self.BUCKETS[-1] or not forward_s > 0 or math.isinf(forward_s):
            return
        bucket = min(range(len(self.BUCKETS)), key=lambda b: abs(math.log2(self.BUCKETS[b] / num_tokens_fed)))
        self._times[bucket].append(float(forward_s))
        self._curve = None

    def prior(self, num_tokens: float) -> float:
        return 1.0 + self.prior_slope * (num_tokens - 1)

    def curve(self) -> np.ndarray:
        """c at ``BUCKETS``, ``[7]`` float64."""
        if self._curve is None:
            sizes = np.array(self.BUCKETS, np.float64)
            curve = 1.0 + self.prior_slope * (sizes - 1)
            base_s = self._one_token_s()
            if base_s is not None:
                measured = [b for b in range(1, len(sizes)) if self._times[b]]
                known_at, known = [0], [1.0]
                for b in measured:
                    known_at.append(b)
                    known.append(max(1.0, float(np.median(self._times[b])) / base_s))
                # unmeasured buckets: interpolated between measured ones, the prior's slope past the last
                curve = np.interp(sizes, sizes[known_at], known)
                last = known_at[-1]
                curve[last + 1:] = known[-1] + self.prior_slope * (sizes[last + 1:] - sizes[last])
            self._curve = np.maximum.accumulate(curve)
        return self._curve

    def _one_token_s(self) -> float | None:
        """Median 1-token forward time; without one, a line through the other buckets' medians at n=1."""
        if self._times[0]:
            return float(np.median(self._times[0]))
        measured = [(n, float(np.median(t))) for n, t in zip(self.BUCKETS, self._times) if t]
        if len(measured) < 2:
            return None
        sizes, times = np.array(measured).T
        slope, intercept = np.polyfit(sizes, times, 1)
        line_s = intercept + max(slope, 0.0)
        return float(min(times.min(), line_s)) if line_s > 0 else float(times.min())

    def measured_widths(self) -> int:
        """How many width buckets hold at least one forward."""
        return sum(1 for times in self._times if times)

    def cost(self, num_tokens: int) -> float:
        curve = self.curve()
        if num_tokens <= self.BUCKETS[-1]:
            return float(np.interp(num_tokens, self.BUCKETS, curve))
        slope = (curve[-1] - curve[-2]) / (self.BUCKETS[-1] - self.BUCKETS[-2])
        return float(curve[-1] + slope * (num_tokens - self.BUCKETS[-1]))


class BatchCostModel:
    """c_B(n): a forward of width ``n`` over one of width 1, both at batch size ``B``, measured live.

    One ``CostModel`` per batch bucket ``B in {1, 2, 4, 8, ...}`` (a batch goes to
    the nearest bucket in log2). A forward gets less memory-bound as the batch
    grows, so extra tokens cost more at larger B; until a bucket has measured
    widths of its own, its curve is borrowed from batch 1, where ``B`` rows of
    ``n`` tokens cost about one row of ``B n``: ``c_B(n) = c_1(B n) / c_1(B)``.

    Worked example, ``c_1(n) = 1 + 0.03 (n - 1)`` (the prior): ``c_4(5) =
    c_1(20) / c_1(4) = 1.57 / 1.09 = 1.44``, where batch 1 would pay ``c_1(5) = 1.12``.
    """

    def __init__(self, prior_slope: float = 0.03, window: int = 32):
        self.prior_slope, self.window = prior_slope, window
        self._models: dict[int, CostModel] = {1: CostModel(prior_slope, window)}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, round(math.log2(max(1, batch_size))))

    def add(self, batch_size: int, width: int, forward_s: float) -> None:
        bucket = self.bucket(batch_size)
        if bucket not in self._models:
            self._models[bucket] = CostModel(self.prior_slope, self.window)
        self._models[bucket].add(width, forward_s)

    def cost(self, num_tokens: int, batch_size: int = 1) -> float:
        bucket = self.bucket(batch_size)
        own = self._models.get(bucket)
        if bucket == 1 or (own is not None and own.measured_widths() >= 2):
            return own.cost(num_tokens)
        single = self._models[1]
        return max(1.0, single.cost(bucket * num_tokens) / single.cost(bucket))

    def of_batch(self, batch_size: int) -> CostModel | None:
        """The measured model of ``batch_size``'s bucket (None until it has a forward)."""
        return self._models.get(self.bucket(batch_size))


class AcceptanceCalibrator:
    """P(node accepted | parent accepted), counted per kind of node.

    A node's kind is ``(source, effective match bucket, raw frequency bucket)``:
    the effective match is the source's match length plus the node's depth - 1
    (the text the node continues, if its parent is accepted), the raw frequency
    the node's score over its parent's. The estimate is
    ``(accepted + s * prior) / (seen + s)`` with ``s = prior_strength`` and a
    prior that grows with the match and the raw frequency. Counts fade with a
    half-life of ``half_life`` judged steps (of any kind), so estimates follow
    drift and a kind that was gated out (never proposed, never judged) drifts
    back to its prior and is tried again.

    ``probability(kind("suffix", match_len=8, depth=1, frequency=1.0))`` is the
    prior, 8 / (8 + 2) = 0.8, until ``update`` says otherwise.
    """

    MATCH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # bucket b holds match lengths in [EDGES[b-1], EDGES[b])
    FREQ_EDGES = (0.2, 0.4, 0.6, 0.8, 0.999)

    def __init__(self, prior_strength: float = 2.0, half_life: float = 128.0):
        if not prior_strength > 0 or not half_life > 0:
            raise ValueError(f"need prior_strength > 0 and half_life > 0, got {prior_strength!r}, {half_life!r}")
        self.prior_strength, self.half_life = float(prior_strength), float(half_life)
        self._counts: dict[tuple, list[float]] = {}  # kind -> [accepted, seen, clock at the last update]
        self.clock = 0  # judged steps so far

    def kind(self, source: str, match_len: int, depth: int, frequency: float) -> tuple:
        effective = match_len + depth - 1 if match_len > 0 else 0
        return (source, bisect.bisect_right(self.MATCH_EDGES, effective),
                bisect.bisect_left(self.FREQ_EDGES, frequency))

    def prior(self, kind: tuple) -> float:
        source, match_bucket, freq_bucket = kind
        frequency = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)[freq_bucket]
        match_len = ((0,) + self.MATCH_EDGES)[match_bucket]
        trust = 0.4 if match_len == 0 else match_len / (match_len + 2.0)
        return max(0.01, min(0.95, frequency * trust))

    def _faded(self, kind: tuple) -> tuple[float, float]:
        counts = self._counts.get(kind)
        if counts is None:
            return 0.0, 0.0
        fade = 0.5 ** ((self.clock - counts[2]) / self.half_life)
        return counts[0] * fade, counts[1] * fade

    def probability(self, kind: tuple) -> float:
        accepted, seen = self._faded(kind)
        return (accepted + self.prior_strength * self.prior(kind)) / (seen + self.prior_strength)

    def update(self, kind: tuple, accepted: bool) -> None:
        old_accepted, old_seen = self._faded(kind)
        self._counts[kind] = [old_accepted + float(accepted), old_seen + 1.0, self.clock]

    def tick(self) -> None:
        """One more step judged (``update`` calls of one step share a tick)."""
        self.clock += 1
