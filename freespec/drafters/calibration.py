"""What a verify step costs and what a draft node is worth, both measured live.

``CostModel`` is c(n), the time of a forward over ``n`` fed tokens relative to a
one-token forward, from the engine's ``ForwardReport``s; ``BatchCostModel`` keeps
one per batch size. ``AcceptanceCalibrator``
is P(node accepted | parent accepted) per kind of node, from the outcomes of
earlier steps. ``DraftSizer`` composes both: it picks how many of a tree's best
nodes to verify, maximizing expected tokens per unit of time, and learns from
each step's outcome; every drafter that sizes its trees (``mixture``,
``recycle``, ``lookahead``) composes one; ``calibrate_lookup`` turns a lookup
source's raw frequencies into calibrated path probabilities. All of it holds
numbers about the model and the machine (no tokens), so it may be shared across
requests.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from collections import deque
from functools import partial
from typing import Callable, Hashable

import numpy as np

from ..draft import Budget, Draft, best_path
from ..kernels.lookup_calibration import lookup_kinds_kernel, path_probabilities_kernel
from .options import check_bool, check_int, check_number


class CostModel:
    """c(n): forward time with ``n`` tokens fed over forward time with 1 token, measured live.

    Every width ``n`` from 1 to ``MAX_WIDTH`` has its own bucket, the last ``window``
    forwards of that width; a width with ``min_samples`` forwards or more is
    *measured*, its value the median time over the median time of width 1 (a line
    through the measured medians, read at n=1, while width 1 has none). Widths are
    not pooled because matrix kernels work in tiles, so the true curve is a
    staircase whose steps lie where the machine puts them: measured on
    qwen2.5-coder-0.5b in bfloat16 on an AMX CPU (``freespec bench``'s probe, 512-token
    prefix, one thread), c(16) = 1.16 but c(17) = 1.21, c(32) = 1.30 but c(33) = 1.44;
    in float32 c(2) = 1.07, c(3) = 1.13 but c(4) = 1.9. Pooled in log2 buckets, 17 was
    priced as 16 and 33 as 32, and the sizer fed a step's worth for one node. Widths
    with too few forwards of their own pool in their group (``_known_points``).

    An unmeasured width reads the line between its measured neighbours (past the last,
    the measured curve's mean slope from width 1); up to ``OPTIMISTIC_UP_TO`` tokens it
    is *optimistic* instead, the lower of that line and the prior ``1 + prior_slope
    (n - 1)`` (never below its lower neighbour) while no width of its group (``GROUPS``:
    5-6, 7-8) is pinned, so a drafter tries each small size a few times before the
    curve says whether it pays: a cheap size between two dear ones (c(3) above) is found, not
    interpolated away, while a wide size is never tried on faith (on a machine where
    c(2) is already 3, exploring 64 tokens would cost dozens of forwards). Between
    measured widths the line makes a width look as dear as its neighbours say, so the
    sizer tries it only where that pays, and a step (17 after 16) is found by the
    forwards that cross it. Pinned widths keep their measured values even where a wider
    forward costs less than a narrower one: the kernels a forward runs are chosen by its
    shape, and on smollm2-135m in float32 on one thread of an AMX Xeon (``freespec bench``'s
    probe, 64- and 200-token prefixes) c(2) = 1.6 and c(3) = 1.97 but c(4) = 1.48; made
    non-decreasing, that curve priced 4 to 8 tokens at 1.97, and the sizer fed 15 nodes
    (c(16) = 2.2) where it would have priced 3 nodes at 1.48 (tokens/s measured the same either
    way there: docs/experiments.md). An unpinned width is never read below
    its lower neighbour, and the curve is extrapolated past ``MAX_WIDTH``.

    A host that packs rows end to end (vLLM) feeds a step's tokens in all, and from 15 requests on at
    ``num_speculative_tokens`` 8 a step feeds more than ``MAX_WIDTH``. Such forwards pool in coarse bins
    (``WIDE_BINS``: 130-192, 193-256, 257-384, ...), each pinned, once it holds ``min_samples`` forwards, at
    its forwards' median width and median time; where neither width 1 nor two widths under ``MAX_WIDTH``
    have a forward, each bin with one is a point of the line that reads the one-token time. The curve runs
    from the last pinned width up to ``MAX_WIDTH`` towards the first pinned bin, and on (``cost_list``,
    ``costs``) through the pinned bins; past the last, the measured curve's mean slope. Without the bins a
    step of 32 requests was never counted: the sizer priced it by the prior line, or by the slope of widths
    it never fed. Forwards wider than the last bin are not counted.
    The curve is drawn when asked for after a change that matters: a width pinned (or
    added to a pool), or a pinned width's median, or the one-token time, moved by more than
    ``REDRAW`` (1%) from the one the curve was drawn from; each forward moves some median a
    little, and drawing the curve again for that cost up to a third of a vLLM ``propose()`` step.

    ``CostModel().cost(9) == 1.24`` before any measurement. ``prior``: a callable giving the prior curve
    c(1..MAX_WIDTH) in place of the line (``BatchCostModel`` passes batch 1's curve, rescaled); such a prior is
    steepened by the widths pinned so far where they measured dearer than it reads (``_rescaled``).
    """

    MAX_WIDTH = 129  # the root and 128 nodes (the default budget feeds 65 at most)
    OPTIMISTIC_UP_TO = 8
    REDRAW = 0.01  # the curve is drawn again once a pinned width's median moves by more than this fraction
    # widths GROUPS[g] + 1 .. GROUPS[g + 1] pool (see _known_points); 65, the default budget's widest, alone
    GROUPS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 65, 96, 128, 129)
    # a packed step's widths past MAX_WIDTH pool in bins WIDE_BINS[b] + 1 .. WIDE_BINS[b + 1]; wider: not counted
    WIDE_BINS = (129, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)

    def __init__(self, prior_slope: float = 0.03, window: int = 32, min_samples: int = 3,
                 prior: Callable[[], list[float]] | None = None):
        if not prior_slope >= 0:
            raise ValueError(f"prior_slope must be >= 0, got {prior_slope!r}")
        check_int("window", window, 1)
        self.min_samples = check_int("min_samples", min_samples, 1)
        if self.min_samples > window:
            raise ValueError(f"min_samples must be <= window, got {min_samples} > {window}")
        self.prior_slope = float(prior_slope)
        self._times = [deque(maxlen=window) for _ in range(self.MAX_WIDTH)]  # [width - 1]: forward seconds
        self._medians = np.full(self.MAX_WIDTH, np.nan)  # [width - 1]: median of _times, nan while empty
        self._widths = np.arange(1, self.MAX_WIDTH + 1, dtype=np.float64)
        self._prior_list = [1.0 + self.prior_slope * (width - 1.0) for width in range(1, self.MAX_WIDTH + 1)]
        self._prior_of = prior  # c(1..MAX_WIDTH) before measurement, when not the line above (BatchCostModel)
        self._group = [bisect.bisect_left(self.GROUPS, width) for width in range(1, self.MAX_WIDTH + 1)]  # its group
        self._curve_list: list[float] | None = None  # c(1..MAX_WIDTH), cached until the next add() changes it
        self._curve: np.ndarray | None = None  # the same as an array, made when asked for
        self._base_s: float | None = None  # the 1-token time the cached curve divides by
        self._known_at: list[int] = []  # indices of the widths the cached curve is pinned at
        self._drawn_medians: list[float] = []  # [width - 1]: the medians the cached curve was drawn from
        self._wide = [deque(maxlen=window) for _ in self.WIDE_BINS[1:]]  # [bin]: (width, seconds) of its forwards
        self._wide_points: list[tuple[float, float] | None] = [None] * len(self._wide)  # [bin]: median (width, s)
        self._drawn_wide: list[float | None] = []  # [bin]: the median seconds the cached curve was drawn from
        self._wide_knots: list[tuple[float, float]] = []  # (width, c) of the pinned bins, as the curve was drawn
        self._extension: tuple = ([], [], 0.0, 0.0)  # the curve past MAX_WIDTH, drawn with it (_extend)

    @classmethod
    def counts(cls, num_tokens_fed: int, forward_s: float) -> bool:
        """Whether ``add`` counts a forward: 1..``WIDE_BINS[-1]`` tokens fed, a finite positive time."""
        return 1 <= num_tokens_fed <= cls.WIDE_BINS[-1] and forward_s > 0 and not math.isinf(forward_s)

    def add(self, num_tokens_fed: int, forward_s: float) -> bool:
        """Count one decode forward; True if the curve will be drawn again (it may have moved)."""
        if not self.counts(num_tokens_fed, forward_s):
            return False
        if num_tokens_fed > self.MAX_WIDTH:
            return self._add_wide(num_tokens_fed, float(forward_s))
        index = num_tokens_fed - 1
        times = self._times[index]
        was_pinned = len(times) >= self.min_samples
        times.append(float(forward_s))
        median = self._medians[index] = statistics.median(times)  # 50x faster than np.median on 32
        if self._curve_list is None:
            return True
        # a width pinned when the curve was drawn (it has been since: pinning one redraws the curve) whose median
        # stays within REDRAW of the median the curve used leaves the curve as it is, while the one-token time
        # does too (``_base_holds``)
        return self._redraw_unless(self._holds(median, self._drawn_medians[index]) if was_pinned
                                   else not self._moves_unpinned(index))

    def _holds(self, median_s: float, drawn_s: float) -> bool:
        """Whether a pinned median ``median_s`` leaves the curve drawn from ``drawn_s`` as it is."""
        return abs(median_s - drawn_s) <= self.REDRAW * drawn_s and self._base_holds()

    def _redraw_unless(self, keep: bool) -> bool:
        """Drop the cached curve unless ``keep``; True when it will be drawn again."""
        if not keep:
            self._curve_list = self._curve = None
        return not keep

    def _add_wide(self, width: int, forward_s: float) -> bool:
        """``add`` past ``MAX_WIDTH``: the forward joins its bin, which is kept as drawn (as a pinned width is) while
        its median time stays within ``REDRAW`` and the one-token time holds, or while it is short of
        ``min_samples`` and the one-token time holds."""
        index = self._bin(width)
        samples = self._wide[index]
        was_pinned = len(samples) >= self.min_samples
        samples.append((width, forward_s))
        median_s = statistics.median(seconds for _, seconds in samples)
        self._wide_points[index] = (float(statistics.median(w for w, _ in samples)), median_s)
        if self._curve_list is None:
            return True
        return self._redraw_unless(self._holds(median_s, self._drawn_wide[index]) if was_pinned
                                   else len(samples) < self.min_samples and self._base_holds())

    def _moves_unpinned(self, index: int) -> bool:
        """Whether a forward just counted at width ``index + 1``, not pinned before it, changes what the curve is
        drawn from (``_known_points`` and the one-token time): it pinned the width; it is width 1 (the
        one-token time); it moved the one-token time read from every width's (width 1 has no forward) by more
        than ``REDRAW``; or it joined a group pooled, or about to be (no width of the group pinned on its own,
        ``min_samples`` forwards in all). A forward that changes none of these (a width of a group with a pinned
        width, or of a pool still short of ``min_samples``) leaves the curve as drawing it again would: on a
        flat curve, where the sizer spreads its widths, it spared most redraws of a step
        (``scripts/draft_digest.py``, ``flat1``)."""
        if index == 0 or len(self._times[index]) >= self.min_samples or not self._base_holds():
            return True
        group = self._group[index]
        members = range(self.GROUPS[group - 1], self.GROUPS[group])  # indices of the group's widths
        if any(len(self._times[i]) >= self.min_samples for i in members):
            return False
        return sum(len(self._times[i]) for i in members) >= self.min_samples

    def _base_holds(self) -> bool:
        """Whether the one-token time the curve divides by still holds: width 1's own median (``add`` follows it
        as it does any pinned width's), or, while width 1 has no forward, the line ``_one_token_s`` reads now
        within ``REDRAW`` of the one the curve was drawn with (None both, or neither). A host that packs rows end
        to end (vLLM) never feeds one token, and every forward moved that line a little: the curve was drawn
        again at every step, with every batch bucket's borrowed prior after it."""
        if self._times[0]:
            return True
        base, drawn = self._one_token_s(), self._base_s
        if base is None or drawn is None:
            return base is drawn
        return abs(base - drawn) <= self.REDRAW * drawn

    def prior_list(self) -> list[float]:
        """c(1..MAX_WIDTH) before measurement: ``prior``'s curve if given, else ``1 + prior_slope (n - 1)``."""
        return self._prior_list if self._prior_of is None else self._prior_of()

    def prior_changed(self) -> None:
        """``prior``'s curve moved: the next read draws the curve again."""
        self._curve_list = self._curve = None

    def measured(self, num_tokens: int) -> bool:
        """Whether forwards of ``num_tokens`` (1..MAX_WIDTH; past it, its bin's) tokens are measured."""
        return len(self._samples_of(num_tokens)) >= self.min_samples

    def _samples_of(self, num_tokens: int):
        """The forwards held for width ``num_tokens`` (past MAX_WIDTH its bin's; none past the last bin)."""
        if num_tokens <= self.MAX_WIDTH:
            return self._times[num_tokens - 1]
        return self._wide[self._bin(num_tokens)] if num_tokens <= self.WIDE_BINS[-1] else ()

    def _bin(self, width: int) -> int:
        """The bin of ``WIDE_BINS`` that holds ``width`` (MAX_WIDTH < width <= WIDE_BINS[-1])."""
        return bisect.bisect_left(self.WIDE_BINS, width) - 1

    def curve(self) -> np.ndarray:
        """c(1..MAX_WIDTH), ``[MAX_WIDTH]`` float64."""
        if self._curve is None:
            self._curve = np.array(self.curve_list(), np.float64)
        return self._curve

    def curve_list(self) -> list[float]:
        """``curve()`` as a list, computed in plain Python once per change (numpy on 64 floats costs more in calls
        than in arithmetic: 70 us against 25 us on a 2-core EPYC)."""
        if self._curve_list is None:
            self._curve = None
            self._curve_list = self._compute_curve()
        return self._curve_list

    def _compute_curve(self) -> list[float]:
        curve = self._draw()
        self._extension = self._extend(curve)
        return curve

    def _draw(self) -> list[float]:
        self._drawn_medians = self._medians.tolist()
        self._drawn_wide = [None if point is None else point[1] for point in self._wide_points]
        prior = self.prior_list()
        base_s = self._base_s = self._one_token_s()
        self._known_at, self._wide_knots = [], []
        if base_s is None:
            return _running_max(prior)
        known_at, known_s = self._known_points()
        known = [max(1.0, seconds / base_s) for seconds in known_s]
        known[0] = 1.0
        wide = self._wide_knots = [(width, max(1.0, seconds / base_s)) for width, seconds in self._wide_pinned()]
        if self._prior_of is not None:
            prior = _rescaled(prior, known_at, known)
        knots = known  # as measured: a wider forward may cost less (see the class)
        curve = []  # np.interp between the pinned widths (known_at[0] is 0, then rising), operation for operation
        for j in range(len(known_at) - 1):
            low, high, knot = known_at[j], known_at[j + 1], knots[j]
            slope = (knots[j + 1] - knot) / float(high - low)
            curve.append(knot)
            curve += [slope * float(step) + knot for step in range(1, high - low)]
        last = known_at[-1]
        # past the last pinned width, the measured curve's mean slope (the prior with none): on a
        # steep curve (c(2) = 3) a wide forward is not read as nearly free of the tokens it adds
        highest = max(known)
        curve.append(knots[-1])
        if wide:  # a packed step's pinned bin past MAX_WIDTH: the line towards the first (never below the highest)
            toward_at, toward = wide[0][0] - 1.0, max(highest, wide[0][1])
            slope = (toward - highest) / (toward_at - float(last))
            curve += [highest + slope * float(step) for step in range(1, self.MAX_WIDTH - last)]
        elif last > 0:
            slope = (highest - 1.0) / float(last)
            curve += [highest + slope * float(step) for step in range(1, self.MAX_WIDTH - last)]
            if self._prior_of is not None:  # a given prior is a floor there: no wider forward on the line's faith
                curve[last + 1:] = [max(value, floor) for value, floor in zip(curve[last + 1:], prior[last + 1:])]
        else:  # only width 1 pinned: highest is 1
            curve += prior[1:]
        for index, value in zip(known_at, known):
            curve[index] = value
        explored = {self._group[index] for index in known_at}  # a group with a pinned width: no optimism
        for index in range(1, self.OPTIMISTIC_UP_TO):  # optimistic, but never below the width under it
            if self._group[index] not in explored:
                curve[index] = max(min(curve[index], prior[index]), curve[index - 1])
        self._known_at = known_at
        return curve

    def _wide_pinned(self) -> list[tuple[float, float]]:
        """(median width, median seconds) of each bin of ``WIDE_BINS`` with ``min_samples`` forwards, widths rising."""
        return [point for point, samples in zip(self._wide_points, self._wide) if len(samples) >= self.min_samples]

    def _extend(self, curve: list[float]) -> tuple[list[float], list[float], float, float]:
        """The curve past ``MAX_WIDTH``: ``(widths, values, top, slope)``, the line through ``(MAX_WIDTH, c)`` and the
        pinned wide bins, past the last ``top + slope (n - its width)``: the measured curve's mean slope from
        width 1, from its highest value. Without a pinned bin, the slope of the curve's last 16 widths."""
        if not self._wide_knots:
            return [float(self.MAX_WIDTH)], [curve[-1]], curve[-1], (curve[-1] - curve[-17]) / 16.0
        widths = [float(self.MAX_WIDTH)] + [width for width, _ in self._wide_knots]
        values = [curve[-1]] + [value for _, value in self._wide_knots]
        top = max(max(values), max(curve))
        return widths, values, top, (top - 1.0) / (widths[-1] - 1.0)

    def _past(self, widths) -> list[float]:
        """``cost`` of each width of ``widths`` (all past ``MAX_WIDTH``), as ``_extend`` draws it."""
        at, values, top, slope = self._extension
        last, past = at[-1], []
        for width in widths:
            if width >= last:  # at the last pinned bin its value, past it the line
                past.append(values[-1] if width == last else top + slope * (float(width) - last))
                continue
            j = bisect.bisect_right(at, width) - 1  # np.interp's arithmetic, operation for operation
            past.append((values[j + 1] - values[j]) / (at[j + 1] - at[j]) * (float(width) - at[j]) + values[j])
        return past

    def _known_points(self) -> tuple[list[int], list[float]]:
        """(indices ``width - 1``, median seconds) of the widths the curve is pinned at, width 1 first.

        A width with ``min_samples`` forwards of its own is pinned at its median. In a group of ``GROUPS``
        where no width has that many, the group's forwards pooled are, once there are ``min_samples`` of
        them, pinned at their median width: scattered widths (13, 15, 14, ...) teach the curve as fast as
        one repeated width would, and no group crosses a multiple of 8 (where tile steps lie).
        """
        times_of, medians = self._times, self._medians
        known_at, known_s = [0], [float(medians[0]) if times_of[0] else np.nan]
        groups: dict[int, list[int]] = {}  # group -> its widths with forwards (indices), groups and widths rising
        for index in np.flatnonzero(~np.isnan(medians)).tolist():
            if index:
                groups.setdefault(self._group[index], []).append(index)
        for members in groups.values():  # GROUPS[g] + 1 .. GROUPS[g + 1]
            own = [i for i in members if len(times_of[i]) >= self.min_samples]
            if own:
                known_at += own
                known_s += [float(medians[i]) for i in own]
            elif sum(len(times_of[i]) for i in members) >= self.min_samples:
                pooled = [(t, i) for i in members for t in times_of[i]]
                known_at.append(int(statistics.median([i for _, i in pooled])))
                known_s.append(statistics.median(t for t, _ in pooled))
        return known_at, known_s

    def at_most(self, num_tokens: int) -> float:
        """A measured bound on what a forward of up to ``num_tokens`` tokens costs: the highest pinned value up
        to the nearest pinned width at or above it, else ``cost``. Unlike ``cost`` it never explores: on a CPU
        in float32 (c(2) = 1.09, c(4) = 1.73, c(16) = 2.2) a line from 1 to 16 tokens would read c(4) = 1.24;
        and where c(3) = 1.97 but c(4) = 1.48, forwards of up to 4 tokens are not cheap."""
        bound = self.measured_bound(num_tokens)
        return self.cost(num_tokens) if bound is None else bound

    def measured_bound(self, num_tokens: int) -> float | None:
        """``at_most``'s measured bound, or None where no width of ``num_tokens`` or more is pinned."""
        curve = self.curve_list()  # sets _base_s and _known_at
        if self._base_s is None:
            return None
        highest = None
        for index in self._known_at:  # rising
            highest = curve[index] if highest is None or curve[index] > highest else highest
            if index >= max(1, num_tokens) - 1:
                return highest
        return None

    def one_token_s(self) -> float | None:
        """Seconds of a one-token forward: ``_one_token_s``, as the curve last divided by."""
        self.curve_list()
        return self._base_s

    def _one_token_s(self) -> float | None:
        """Median 1-token forward time; without one, a line through the other widths' medians at n=1."""
        if self._times[0]:
            return float(self._medians[0])
        medians = self._medians.tolist()
        present = [i for i, times in enumerate(self._times) if times]
        sizes, times = [i + 1.0 for i in present], [medians[i] for i in present]
        if len(sizes) < 2:  # a packed step's bins past MAX_WIDTH, where fewer than two widths under it have forwards:
            for point in self._wide_points:  # a line across a GPU's flat region and the rise after it (256 tokens
                if point is not None:  # and more) reads the one-token time too low, and every cost too high
                    sizes.append(point[0])
                    times.append(point[1])
        if len(sizes) < 2:
            return None
        # the least-squares line through (width, median seconds), in closed form (np.polyfit's line, 50x faster)
        mean_size, mean_s = sum(sizes) / len(sizes), sum(times) / len(times)
        slope = (sum((x - mean_size) * (y - mean_s) for x, y in zip(sizes, times))
                 / sum((x - mean_size) ** 2 for x in sizes))
        line_s = mean_s - slope * mean_size + max(slope, 0.0)
        return min(min(times), line_s) if line_s > 0 else min(times)

    def has_forward(self, num_tokens: int) -> bool:
        """Whether width ``num_tokens`` (1..MAX_WIDTH; past it, its bin) has a forward."""
        return bool(self._samples_of(num_tokens))

    def measured_widths(self) -> int:
        """How many widths (and bins past MAX_WIDTH) have at least one forward."""
        return int(np.count_nonzero(~np.isnan(self._medians))) + sum(1 for samples in self._wide if samples)

    def cost(self, num_tokens: int) -> float:
        if isinstance(num_tokens, int) and 1 <= num_tokens <= self.MAX_WIDTH:  # np.interp at a knot: the knot
            return self.curve_list()[num_tokens - 1]
        return float(self.costs(np.array([num_tokens]))[0])

    def cost_list(self, num_tokens: int) -> list[float]:
        """``costs`` of 1, 2, ..., ``max(num_tokens, MAX_WIDTH)`` as a list (the curve, then its extension)."""
        curve = self.curve_list()
        if num_tokens <= self.MAX_WIDTH:
            return curve
        return curve + self._past(range(self.MAX_WIDTH + 1, num_tokens + 1))

    def costs(self, num_tokens: np.ndarray) -> np.ndarray:
        """``cost`` of each entry of ``num_tokens`` ([m] int >= 1), as [m] float64; past ``MAX_WIDTH``, as
        ``_extend`` draws it (the same values as ``cost_list``)."""
        num_tokens = np.asarray(num_tokens, np.float64)
        curve = self.curve()
        at, values, top, slope = self._extension
        inside = np.interp(num_tokens, self._widths, curve)
        past = np.where(num_tokens <= at[-1], np.interp(num_tokens, at, values), top + slope * (num_tokens - at[-1]))
        return np.where(num_tokens <= self.MAX_WIDTH, inside, past)


def _rescaled(prior: list[float], known_at: list[int], known: list[float]) -> list[float]:
    """A borrowed prior (``BatchCostModel``'s, for a padded batch) steepened by what its own pinned widths measured:
    ``1 + r (prior(n) - 1)``, ``r`` the median of ``(c(w) - 1) / (prior(w) - 1)`` over the pinned widths ``w > 1``,
    at least 1 (a prior that is steeper than measured is left as it is). The borrowed prior comes from batch 1's
    curve, and in a process that has decoded only batches that curve is batch 1's prior line, a GPU's slope:
    smollm2-135m float32, 5 rows on one thread of a 2-core AMD EPYC, measured c_4(3) = 1.45 where the prior read
    1.22; widths 4 and 5, unpinned, read the optimistic prior clamped to c(3), 1.45 (measured 1.68-1.80), and most
    of the forwards that drafted were such explorations. Worked example: prior ``[1.0, 1.11, 1.22, 1.33]``, width 3
    pinned at 1.45: ``r = 0.45 / 0.22``, the prior becomes ``[1.0, 1.23, 1.45, 1.68]``."""
    ratios = [(value - 1.0) / (prior[index] - 1.0) for index, value in zip(known_at, known)
              if index > 0 and prior[index] > 1.0]
    if not ratios:
        return prior
    scale = statistics.median(ratios)
    if scale <= 1.0:
        return prior
    return [1.0 + (value - 1.0) * scale for value in prior]


def _running_max(values: list[float]) -> list[float]:
    """``np.maximum.accumulate`` of a list: ``[1.0, 3.0, 2.0] -> [1.0, 3.0, 3.0]``."""
    out, highest = [], -math.inf
    for value in values:
        highest = value if value > highest else highest
        out.append(highest)
    return out


class BatchCostModel:
    """c_B(n): a forward of width ``n`` over one of width 1, both at batch size ``B``, measured live.

    One ``CostModel`` per batch bucket ``B in {1, 2, 4, 8, ...}`` (a batch goes to
    the nearest bucket in log2). A forward gets less memory-bound as the batch
    grows, so extra tokens cost more at larger B; until a bucket has measured
    widths of its own, its curve is borrowed from batch 1, where ``B`` rows of
    ``n`` tokens cost about one row of ``B n``: ``c_B(n) = c_1(B n) / c_1(B)``.

    Worked example, ``c_1(n) = 1 + 0.03 (n - 1)`` (the prior): ``c_4(5) =
    c_1(20) / c_1(4) = 1.57 / 1.09 = 1.44``, where batch 1 would pay ``c_1(5) = 1.12``.

    The borrowed curve is also the bucket's own prior while it measures: the widths it has
    not pinned are explored, and ``at_most`` read, against ``c_1(B n) / c_1(B)``, not against
    batch 1's prior line. Measured on smollm2-135m float32 at batch 8 (2-core Xeon):
    c_8(2, 4, 8) = 1.47, 1.78, 2.16, where the line reads 1.03, 1.09, 1.21 and the borrowed
    prior 1.20, 1.60, 2.39; against the line, the first batch's forwards took recycled trees
    and lookahead windows of up to 21 tokens (the flat gate read c(4) = 1.09).

    A host that packs rows end to end (vLLM; ``ForwardReport.packed``) reports every forward to batch 1 at the
    tokens it fed in all, so every batch size reads ``c_1(B n) / c_1(B)``: a packed step's time follows its total
    tokens, and its widest row says little of it. Measured on vLLM's CPU build (smollm2-135m float32, 8
    requests): a step took 110 ms + 5.9 ms per token fed; filed by widest row, steps of 8 rows with one row of 9
    tokens and steps with all eight at 9 shared ``c_8(9)``, which read 1.25 where 8 rows of 9 tokens cost 3.4.

    A bucket above 1 holds several batch sizes (bucket 4: 3, 4 and 5 rows, as a padded batch loses the rows that
    finish), whose one-token forwards differ (smollm2-135m float32: 123, 140 and 158 ms). So each batch size's
    one-token time is followed apart, and a forward of ``R`` rows enters its bucket's curve scaled by the bucket's
    reference one-token time over ``R`` rows' (``T_B / t_1(R)``, ``T_B`` the first batch size's median): the curve
    is then one of ratios to the forward's own batch size, where pooled seconds read c_4(6) = 1.60 for forwards of
    4 and 5 rows that cost 1.88 and 1.97 (mean predicted over measured ratio 0.91, scaled 0.98, same run).
    """

    def __init__(self, prior_slope: float = 0.03, window: int = 32):
        self.prior_slope, self.window = prior_slope, window
        self._models: dict[int, CostModel] = {1: CostModel(prior_slope, window)}
        self._memo: dict[tuple, object] = {}  # values read between two forwards (``cost_list``, ``at_most``)
        self._one_token: dict[int, deque] = {}  # batch size above 1 -> its recent one-token forwards' seconds
        self._one_token_median: dict[int, float] = {}  # batch size above 1 -> the median of those
        self._reference_s: dict[int, float] = {}  # bucket above 1 -> T_B, the seconds its curve's samples are scaled to
        self._padded: set[int] = set()  # buckets above 1 whose prefill a padding host reported (note_padded)

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, round(math.log2(max(1, batch_size))))

    def add(self, batch_size: int, width: int, forward_s: float) -> None:
        bucket = self.bucket(batch_size)
        if bucket > 1 and CostModel.counts(width, forward_s):
            forward_s = self._scaled(bucket, batch_size, width, float(forward_s))
        model = self._models.get(bucket)
        if model is None:
            model = self._models[bucket] = CostModel(self.prior_slope, self.window,
                                                     prior=partial(self._borrowed, bucket))
            self._memo.clear()  # a bucket with a model of its own answers at_most from it
        first = CostModel.counts(width, forward_s) and not model.has_forward(width)  # _own counts widths with one
        moved = model.add(width, forward_s)
        if moved and bucket == 1:  # batch 1's curve moved, and with it every bucket's prior
            for other in self._models.values():
                if other is not model:
                    other.prior_changed()
        if moved or first:  # every value memoized is a function of the curves and of which widths have forwards
            self._memo.clear()

    def note_padded(self, batch_size: int) -> None:
        """A padding host (HF ``generate()``) prefilled a batch of ``batch_size`` rows, or drafts for one (an unpacked
        ``Budget`` of several rows: the mixture notes it before its prefill step's drafts, which come before that
        step's report): until that bucket's own decode forwards are measured, ``at_most`` reads ``inf`` there (no
        gate opens on a borrowed value), as it does once the bucket has forwards but no measured bound. Without it,
        the first decode step of a batched call read batch 1's curve (its prior line, in a process that had decoded
        only batches) and drafted recycled trees and a lookahead window into a padded forward."""
        bucket = self.bucket(batch_size)
        if bucket > 1 and bucket not in self._padded:
            self._padded.add(bucket)
            self._memo.clear()

    def _scaled(self, bucket: int, batch_size: int, width: int, forward_s: float) -> float:
        """``forward_s`` of ``batch_size`` rows in the bucket's reference seconds (as is until that batch size has a
        one-token forward)."""
        if width == 1:
            times = self._one_token.get(batch_size)
            if times is None:
                times = self._one_token[batch_size] = deque(maxlen=self.window)
            times.append(forward_s)
            self._one_token_median[batch_size] = statistics.median(times)
        own_s = self._one_token_median.get(batch_size)
        if own_s is None:
            return forward_s
        return forward_s * self._reference_s.setdefault(bucket, own_s) / own_s

    def _borrowed(self, bucket: int) -> list[float]:
        """``_borrowed_costs`` of n = 1 .. ``CostModel.MAX_WIDTH``: bucket ``B``'s prior curve."""
        return self._borrowed_list(bucket, CostModel.MAX_WIDTH)

    def _borrowed_list(self, bucket: int, num_tokens: int) -> list[float]:
        """``_borrowed_costs`` of n = 1 .. ``num_tokens`` as a list, read from batch 1's curve list (the same floats:
        ``costs`` at a whole width is the curve's value there, past it the same line), without numpy's per-call
        cost: a packing host (vLLM) asks for it each time batch 1's curve is drawn again."""
        single = self._models[1].cost_list(bucket * num_tokens)
        base = single[bucket - 1]
        return [max(1.0, single[bucket * n - 1] / base) for n in range(1, num_tokens + 1)]

    def _borrowed_costs(self, bucket: int, num_tokens) -> np.ndarray:
        """c_1(B n) / c_1(B), at least 1, for each n of ``num_tokens``: bucket ``B``'s cost read from batch 1's."""
        single = self._models[1]
        return np.maximum(1.0, single.costs(bucket * np.asarray(num_tokens)) / single.cost(bucket))

    def cost(self, num_tokens: int, batch_size: int = 1) -> float:
        return float(self.costs(np.array([num_tokens]), batch_size)[0])

    def costs(self, num_tokens: np.ndarray, batch_size: int = 1) -> np.ndarray:
        """``cost`` of each entry of ``num_tokens`` ([m] int) at ``batch_size``, as [m] float64."""
        bucket = self.bucket(batch_size)
        own = self._own(bucket)
        if own is not None:
            return own.costs(num_tokens)
        return self._borrowed_costs(bucket, num_tokens)

    def _own(self, bucket: int) -> CostModel | None:
        """The bucket's model if it answers for itself (batch 1, or two widths measured), else None (borrow)."""
        own = self._models.get(bucket)
        return own if bucket == 1 or (own is not None and own.measured_widths() >= 2) else None

    def cost_list(self, num_tokens: int, batch_size: int = 1) -> list[float]:
        """``costs`` of 1, 2, ..., ``num_tokens`` (at least) at ``batch_size``, as a list: the values the sizer reads
        for every candidate size, computed once between two forwards (a plain Python list: tiny numpy arrays
        cost more to make than to read)."""
        bucket = self.bucket(batch_size)
        values = self._memo.get(("list", bucket))
        if values is None or len(values) < num_tokens:
            own = self._own(bucket)  # a borrowed list: the widths asked for (vLLM's K + 1), not the curve's 130
            values = own.cost_list(max(num_tokens, CostModel.MAX_WIDTH + 1)) if own is not None else \
                self._borrowed_list(bucket, num_tokens)
            self._memo[("list", bucket)] = values
        return values

    def at_most(self, num_tokens: int, batch_size: int = 1) -> float:
        """``CostModel.at_most`` at ``batch_size`` (borrowed from batch 1 as ``costs`` does)."""
        key = ("at_most", num_tokens, self.bucket(batch_size))
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = self._at_most(num_tokens, batch_size)
        return value

    def _at_most(self, num_tokens: int, batch_size: int) -> float:
        """Batch 1's ``at_most``; a bucket of its own (a padding host's) answers only with its measured bound, and
        reads ``inf`` without one, as does a padding host's bucket before its first decode forward (``note_padded``);
        a bucket with no forwards (a packing host's) borrows ``c_1(B n) / c_1(B)``.

        A padded batch's forward costs more than the tokens it feeds would at batch 1 (smollm2-135m float32,
        batch 8: c_8(2, 4) = 1.47, 1.78 where c_1(16) / c_1(8) and c_1(32) / c_1(8) read 1.20, 1.60), so no
        borrowed value opens a gate there: a recycled tree or a lookahead window rides a padded batch only once
        its own forwards of that width were measured cheap."""
        bucket = self.bucket(batch_size)
        single = self._models[1]
        if bucket == 1:
            return single.at_most(num_tokens)
        own = self._models.get(bucket)
        if own is None:
            if bucket in self._padded:
                return math.inf
            return max(1.0, single.at_most(bucket * num_tokens) / single.cost(bucket))
        bound = own.measured_bound(num_tokens)
        return math.inf if bound is None else bound

    def one_token_s(self, batch_size: int = 1) -> float | None:
        """Seconds of a one-token forward at ``batch_size`` (its own median where it has one-token forwards, else
        its bucket's, else batch 1's times c_1(B)); None before any decode forward."""
        own_s = self._one_token_median.get(batch_size)
        if own_s is not None:
            return own_s
        bucket = self.bucket(batch_size)
        own = self._own(bucket)
        if own is not None:
            return own.one_token_s()
        single = self._models[1].one_token_s()
        return None if single is None else single * self._models[1].cost(bucket)

    def of_batch(self, batch_size: int) -> CostModel | None:
        """The measured model of ``batch_size``'s bucket (None until it has a forward)."""
        return self._models.get(self.bucket(batch_size))


class HostCostModel:
    """h(k) = a + b k: wall seconds a decode step spends outside its forward with ``k`` draft nodes, measured live.

    The engine reports each step's time outside its forward (drafting, the tree's inputs, verification's
    tensor work, the walk, the drafters' bookkeeping) and the nodes it fed (``ForwardReport.step_outside_s``,
    ``step_nodes``); one model per batch bucket keeps the last ``window`` steps. The fit is robust to the
    pauses a shared machine adds: the steps are split at their median node count, ``b`` is the slope between
    the two halves' medians (0 while the halves' median node counts differ by less than ``min_spread``, or
    when it comes out negative) and ``a`` the median of ``seconds - b k``. Where a forward costs about the
    same whatever its width (a GPU, bfloat16 on AMX), ``b`` can be most of what a node costs.

    ``fit()`` is ``(0.0, 0.0)`` until ``min_samples`` steps are in. Worked example: steps of 0, 0, 10 and 10
    nodes taking 1, 1, 2 and 2 ms: ``b`` = (2 - 1) ms / 10 = 0.1 ms per node, ``a`` = 1 ms.
    """

    def __init__(self, window: int = 64, min_samples: int = 8, min_spread: int = 4):
        self._steps: deque = deque(maxlen=check_int("window", window, 2))  # (nodes, seconds)
        self.min_samples = check_int("min_samples", min_samples, 2)
        self.min_spread = check_int("min_spread", min_spread, 1)
        self._fit: tuple[float, float] | None = None

    def add(self, num_nodes: int, seconds: float) -> None:
        if num_nodes < 0 or not seconds >= 0 or math.isinf(seconds):
            return
        self._steps.append((int(num_nodes), float(seconds)))
        self._fit = None

    def fit(self) -> tuple[float, float]:
        """``(a, b)`` in seconds and seconds per node."""
        if self._fit is None:
            self._fit = self._compute()
        return self._fit

    def _compute(self) -> tuple[float, float]:
        if len(self._steps) < self.min_samples:
            return 0.0, 0.0
        steps = sorted(self._steps)
        half = len(steps) // 2
        low, high = steps[:half], steps[half:]
        spread = statistics.median(k for k, _ in high) - statistics.median(k for k, _ in low)
        slope = 0.0
        if spread >= self.min_spread:
            slope = max(0.0, (statistics.median(s for _, s in high) - statistics.median(s for _, s in low)) / spread)
        return max(0.0, statistics.median(s - slope * k for k, s in steps)), slope


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

    The prior is itself measured, per source: a kind's base prior times its
    source's *scale*, ``(A + q) / (E + q)`` with ``q = pool_strength``, where ``A``
    is the number of the source's judged nodes that were accepted and ``E`` the sum
    of their base priors (faded alike). Most kinds are rare (a recycled node at
    depth 5, rank 3), so their estimates are mostly prior, and a fixed prior is
    wrong for a model it was not measured on: on qwen2.5-coder-0.5b over 6
    Spec-Bench questions (bfloat16) recycled nodes' estimates summed to 186.5
    accepted where 140 were, the suffix source's to 51.0 where 68 were; with the
    scale, 156.8 where 137 were and 75.8 where 63 were. The scale moves every kind of a source by what its judged nodes showed, so a
    source the priors undersell wins its place in the tree before each of its
    kinds has counts of its own. ``pool_strength=float('inf')``: fixed priors.

    ``probability(kind("suffix", match_len=8, depth=1, frequency=1.0))`` is the
    prior, 8 / (8 + 2) = 0.8, until ``update`` says otherwise.
    """

    MATCH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # bucket b holds match lengths in [EDGES[b-1], EDGES[b])
    FREQ_EDGES = (0.2, 0.4, 0.6, 0.8, 0.999)

    def __init__(self, prior_strength: float = 2.0, half_life: float = 128.0, pool_strength: float = 16.0):
        if not prior_strength > 0 or not half_life > 0 or not pool_strength > 0:
            raise ValueError(f"need prior_strength, half_life and pool_strength > 0, got {prior_strength!r}, "
                             f"{half_life!r}, {pool_strength!r}")
        self.prior_strength, self.half_life = float(prior_strength), float(half_life)
        self.pool_strength = float(pool_strength)
        self._counts: dict[tuple, list[float]] = {}  # kind -> [accepted, seen, clock at the last update]
        self._pools: dict[Hashable, list[float]] = {}  # source -> [accepted, sum of base priors, clock]
        self._given: dict[tuple, float] = {}  # base priors passed to ``probability`` (kinds ``prior`` cannot read)
        self.clock = 0  # judged steps so far
        self._memo: dict = {}  # (kind, base prior) -> probability, while the counts and clock stay as they are
        self._memo_clock = 0
        self._scales: dict = {}  # source -> scale, as long as _memo
        self._base_priors: dict[tuple, float] = {}  # kind -> prior(kind), a pure function of the kind

    def kind(self, source: str, match_len: int, depth: int, frequency: float) -> tuple:
        effective = match_len + depth - 1 if match_len > 0 else 0
        return (source, bisect.bisect_right(self.MATCH_EDGES, effective),
                bisect.bisect_left(self.FREQ_EDGES, frequency))

    def edge_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``MATCH_EDGES`` (int64) and ``FREQ_EDGES`` (float64) as the arrays ``calibrate_lookup``'s kernel reads."""
        found = self.__dict__.get("_edge_arrays")
        if found is None:
            found = self._edge_arrays = (np.array(self.MATCH_EDGES, np.int64), np.array(self.FREQ_EDGES, np.float64))
        return found

    def prior(self, kind: tuple) -> float:
        found = self._base_priors.get(kind)
        if found is None:
            source, match_bucket, freq_bucket = kind
            frequency = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)[freq_bucket]
            match_len = ((0,) + self.MATCH_EDGES)[match_bucket]
            trust = 0.4 if match_len == 0 else match_len / (match_len + 2.0)
            found = self._base_priors[kind] = max(0.01, min(0.95, frequency * trust))
        return found

    def _faded(self, kind: tuple, counts: dict | None = None) -> tuple[float, float]:
        found = (self._counts if counts is None else counts).get(kind)
        if found is None:
            return 0.0, 0.0
        fade = 0.5 ** ((self.clock - found[2]) / self.half_life)
        return found[0] * fade, found[1] * fade

    def scale(self, source: Hashable) -> float:
        """What ``source``'s judged nodes showed over what their base priors predicted, ``(A + q) / (E + q)``."""
        if math.isinf(self.pool_strength):
            return 1.0
        accepted, expected = self._faded(source, self._pools)
        return (accepted + self.pool_strength) / (expected + self.pool_strength)

    def probability(self, kind: tuple, prior: float | None = None) -> float:
        """The estimate for ``kind``; ``prior`` replaces ``self.prior(kind)`` as its base prior (for kinds
        ``prior`` does not read, e.g. recycled nodes'); the source's ``scale`` multiplies it."""
        if prior is not None:
            self._given[kind] = prior
        if self._memo_clock != self.clock:
            self._forget_memo()
            self._memo_clock = self.clock
        key = (kind, prior)
        found = self._memo.get(key)
        if found is not None:
            return found
        base = self.prior(kind) if prior is None else prior
        scale = self._scales.get(kind[0])
        if scale is None:
            scale = self._scales[kind[0]] = self.scale(kind[0])
        base = min(0.95, base * scale)
        accepted, seen = self._faded(kind)
        found = (accepted + self.prior_strength * base) / (seen + self.prior_strength)
        self._memo[key] = found
        return found

    def _forget_memo(self) -> None:
        self._memo.clear()
        self._scales.clear()

    def probabilities(self, kinds: list[tuple], priors: list[float]) -> list[float]:
        """``[probability(kind, prior) for kind, prior in zip(kinds, priors)]`` for kinds of one source, computed
        at once: the source's scale once, counts read only for the kinds judged so far (recycling re-reads a few
        hundred kinds, most never judged)."""
        if not kinds:
            return []
        self._given.update(zip(kinds, priors))
        scale, strength = self.scale(kinds[0][0]), self.prior_strength
        out = [(0.0 + strength * min(0.95, prior * scale)) / (0.0 + strength) for prior in priors]
        counts = self._counts
        for i, kind in enumerate(kinds):
            if kind in counts:
                accepted, seen = self._faded(kind)
                out[i] = (accepted + strength * min(0.95, priors[i] * scale)) / (seen + strength)
        return out

    def update(self, kind: tuple, accepted: bool) -> None:
        if self._memo or self._scales:
            self._forget_memo()
        clock = self.clock
        old = self._counts.get(kind)  # as _faded reads it (faded by 1.0, exactly, when judged at this clock)
        if old is None:
            self._counts[kind] = [float(accepted), 1.0, clock]
        elif old[2] == clock:
            old[0] += float(accepted)
            old[1] += 1.0
        else:
            fade = 0.5 ** ((clock - old[2]) / self.half_life)
            self._counts[kind] = [old[0] * fade + float(accepted), old[1] * fade + 1.0, clock]
        given = self._given.get(kind)
        prior = given if given is not None else self.prior(kind)
        pool_accepted, pool_expected = self._faded(kind[0], self._pools)
        self._pools[kind[0]] = [pool_accepted + float(accepted), pool_expected + prior, clock]

    def tick(self) -> None:
        """One more step judged (``update`` calls of one step share a tick)."""
        self.clock += 1

    def judge(self, draft: Draft, kinds: list, committed) -> None:
        """One step's outcome: for each candidate whose parent was accepted, was it accepted too?

        The committed tokens are the accepted path followed by the bonus token;
        a node at depth d is judged against ``committed[d - 1]`` (if committed
        stopped earlier, e.g. at EOS, deeper nodes are not judged). ``kinds[i]``
        is node ``i``'s kind (not-candidate nodes are never judged).
        """
        committed = np.asarray(committed).tolist()
        self.tick()
        num_nodes, num_committed = draft.num_nodes, len(committed)
        accepted, depths = [False] * num_nodes, [0] * num_nodes
        is_candidate = None if draft.is_candidate is None else draft.is_candidate.tolist()
        for i, (parent, token) in enumerate(zip(draft.parents.tolist(), draft.token_ids.tolist())):
            depths[i] = depth = 1 if parent < 0 else depths[parent] + 1  # topological: the parent's comes first
            if (is_candidate is not None and not is_candidate[i]) or (parent >= 0 and not accepted[parent]) \
                    or depth > num_committed:
                continue
            accepted[i] = committed[depth - 1] == token
            self.update(kinds[i], accepted[i])


def padded_step_values(rows: list[list[tuple[float, int]]], progress: list[int], second_token_cost: float,
                       widest: int) -> list[float]:
    """What a padded batch step is worth for each common cap ``W = 0 .. widest``, in the step's mean tokens
    (``B`` with no draft): ``rows[i]`` holds row ``i``'s draft nodes best first as ``(path probability, depth)``
    (it keeps its first ``min(k_i, W)``), ``progress[i]`` the tokens it has generated.

    A padded batch runs until its last row is done, and a row that is done leaves it. With rows that have as
    many tokens to go (``generate()``'s ``max_new_tokens``; a row that ends early makes ``progress`` a guess)
    and a forward of ``r`` rows costing ``T(r) = alpha + beta r``, the batch's remaining time is ``alpha *
    (the most steps any row has left) + beta * (the steps all rows have left)``. A step gains every row its
    bonus token and ``g_i`` accepted ones, so, in units of ``T(B) / B``, it is worth ``B + b * sum g_i + a *
    (how far the least progress rose beyond the bonus)``: ``b = c_B(2) - 1`` (``second_token_cost``; a second
    token in each of ``B`` rows adds ``c_B(2) - 1`` one-token forwards, so one row's token a ``B``-th of
    that), at most 1, and ``a = B (1 - b)``. The expected sum is the rows' path probabilities; the expected
    rise, rows accepting independently, ``sum over t >= 1 of prod over rows of P(g_i >= t - (progress_i -
    least))``, ``P(g_i >= d)`` the summed path probabilities of row ``i``'s kept nodes at depth ``d``. So a
    token of a row ahead of others is worth ``b`` (it spares one row's share of a later forward), and the
    rows behind are worth whole forwards only together: on a GPU (``c_B(2)`` near 1) a batch drafts where
    its slowest rows are likely to gain; where ``c_B(2) >= 2`` every token is worth 1.

    Before, every token was worth 1, and on a CPU batches widened their forwards for drafts whose gains no
    forward was spared by. Measured in one process (smollm2-135m float32, one thread of a 2-core AMD EPYC;
    plain batched decoding and the mixture with every token at 1 and with these values, alternated three
    times, a fresh drafter each call): the first turns of Spec-Bench's stem questions (5 rows, 96 new tokens)
    went from 0.956x to 1.001x plain batched decoding, its writing questions (5 rows, 128) from 0.928x to
    1.011x, code edits in batches of 4 (128) from 1.222x to 1.272x and from 1.119x to 1.131x. Valuing the
    rows behind each on its own (a share of the step each, not together) read 0.983x on the writing questions
    and 1.142x on the second batch of code edits.

    Worked example: two rows, progress ``[3, 3]``, ``c_B(2) = 1.5``, row 0 drafting one node of probability
    0.8 at depth 1 and row 1 none: ``W = 0`` is worth 2, ``W = 1`` ``2 + 0.5 * 0.8 + 1 * 0 = 2.4`` (the least
    progress cannot rise: row 1 drafts nothing), where every token at 1 read 2.8.
    """
    beta = min(1.0, max(0.0, second_token_cost - 1.0))
    alpha = len(rows) * (1.0 - beta)
    least = min(progress)
    lead = [done - least for done in progress]  # tokens each row is ahead of the rows behind
    tails = [[1.0] for _ in rows]  # tails[i][d]: P(row i accepts d tokens or more), of the nodes kept so far
    total, values = 0.0, []
    for cap in range(widest + 1):
        if cap:
            for nodes, tail in zip(rows, tails):
                if cap <= len(nodes):
                    probability, depth = nodes[cap - 1]
                    total += probability
                    tail.extend([0.0] * (depth + 1 - len(tail)))
                    tail[depth] += probability
        rise, t = 0.0, 1
        while True:
            together = 1.0
            for ahead, tail in zip(lead, tails):
                if t > ahead:
                    together *= tail[t - ahead] if t - ahead < len(tail) else 0.0
                    if together == 0.0:
                        break
            if together == 0.0:
                break
            rise += together
            t += 1
        values.append(len(rows) + beta * total + alpha * rise)
    return values


def calibrate_lookup(calibrator: AcceptanceCalibrator, source: str, match_len: int,
                     draft: Draft) -> tuple[Draft, list[tuple]]:
    """A lookup source's tree with calibrated path probabilities as confidence, and each node's kind.

    ``draft.confidence`` holds raw frequencies (a path's share of the match's
    occurrences); a node's kind is ``calibrator.kind(source, match_len, depth,
    its frequency over its parent's)`` and its path probability the product of
    its kinds' probabilities along the path. Sources are labelled ``source``.
    ``calibrate_lookups`` scores a step's trees in one pass.
    """
    return calibrate_lookups(calibrator, [(source, match_len, draft)])[0]


def calibrate_lookups(calibrator: AcceptanceCalibrator,
                      lookups: list[tuple[str, int, Draft]]) -> list[tuple[Draft, list[tuple]]]:
    """``[calibrate_lookup(calibrator, *lookup) for lookup in lookups]``, every tree in one pass of two kernels
    (``kernels.lookup_calibration``: the trees laid end to end; a probability read per kind that occurs).

    The counts must not change in between (they do not while a step drafts: ``judge`` counts at ``extend``), so
    the trees of all of a step's requests score as they would one by one."""
    if not lookups:
        return []
    match_edges, freq_edges = calibrator.edge_arrays()
    num_freq = freq_edges.shape[0] + 1
    num_codes = (match_edges.shape[0] + 1) * num_freq  # per source
    names: dict[str, int] = {}  # source -> its index (codes of different sources never meet)
    rows, ends, end = [], [0], 0  # rows: ``trees`` [T, 4] flat (first node, end, match length, code base)
    for source, match_len, draft in lookups:
        first, end = end, end + draft.num_nodes
        rows += (first, end, match_len, names.setdefault(source, len(names)) * num_codes)
        ends.append(end)
    trees = np.array(rows, np.int64).reshape(-1, 4)
    if len(lookups) == 1:
        parents, raw = lookups[0][2].parents, lookups[0][2].confidence
    else:
        parents = np.concatenate([draft.parents for _, _, draft in lookups])
        raw = None if any(draft.confidence is None for _, _, draft in lookups) else \
            np.concatenate([draft.confidence for _, _, draft in lookups])
    if raw is None:  # a tree without frequencies: 1.0 where one is missing
        raw = np.concatenate([np.ones(draft.num_nodes, np.float32) if draft.confidence is None else draft.confidence
                              for _, _, draft in lookups])
    walked = np.empty((2, end), np.int64)  # each node's depth, its kind's code
    depths, codes = walked[0], walked[1]
    bad = lookup_kinds_kernel(parents, trees, raw, match_edges, freq_edges, depths, codes)
    if bad >= 0:
        tree = next(t for t in range(len(lookups)) if bad < ends[t + 1])
        raise ValueError(f"node {bad - ends[tree]} of the {lookups[tree][0]!r} tree has parent "
                         f"{int(parents[bad])}: parents must precede their children")
    code_list = codes.tolist()
    sources = list(names)
    kind_of: dict[int, tuple] = {}  # code -> kind (a step has few kinds; counts stay put while it drafts)
    code_probabilities = np.empty(len(sources) * num_codes)
    for code in set(code_list):
        source, local = divmod(code, num_codes)
        kind_of[code] = kind = (sources[source], local // num_freq, local % num_freq)
        code_probabilities[code] = calibrator.probability(kind)
    path_probs = np.empty(end, np.float32)
    path_probabilities_kernel(parents, trees, codes, code_probabilities, path_probs)
    walked.flags.writeable = False  # the depths the drafts keep (``Draft.depths``)
    out = []
    for (source, _, draft), first, last in zip(lookups, ends, ends[1:]):
        scored = Draft._of(draft.token_ids, draft.parents, path_probs[first:last], (source,) * (last - first),
                           draft.is_candidate)  # the tree's own arrays, new confidence: as its checks left them
        scored.__dict__["_depths"] = depths[first:last]
        out.append((scored, [kind_of[code] for code in code_list[first:last]]))
    return out


class DraftSizer:
    """How many of a tree's best nodes to verify, from the cost model and calibrated acceptance.

    A drafter hands ``select`` its candidate tree with each node's *path
    probability* as confidence (the calibrated chance that the node is accepted;
    a child never above its parent) and each node's kind. ``select`` keeps the
    ``k`` best nodes that maximize expected tokens per unit of time,
    ``(1 + sum of their path probabilities) / (c(1 + k) + h(k) / t1)``, where ``h(k)`` is the time a step
    with ``k`` nodes spends outside its forward (``HostCostModel``, measured live where the engine reports it;
    ``host_cost=False`` leaves it out) and ``t1`` a one-token forward's, and remembers them
    until ``judge`` sees the committed tokens and counts, per kind, what was
    accepted. ``k = 0`` (no draft) when nothing pays.

    ``extras`` price not-candidate nodes riding in the same forward (a lookahead
    window): an option ``(m, v)`` feeds ``m`` more nodes worth ``v`` tokens each
    (later, through what they teach the drafter), so its rate is
    ``(1 + S_k + m v) / c(1 + k + m)``; the best (option, k) pair wins.

    Worked example: ``c(n) = 1 + 0.03 (n - 1)``, path probabilities
    ``[0.9, 0.8, 0.1, 0.02]``: k=0 gives 1.0, k=1 1.9/1.03=1.84, k=2 2.7/1.06=2.55,
    k=3 2.8/1.09=2.57, k=4 2.82/1.12=2.52, so three nodes are proposed.

    adaptive: False fills the budget instead (the largest extra option that fits, then candidates).
    Shared across requests: numbers about the model and the machine, no tokens.
    """

    def __init__(self, adaptive: bool = True, prior_cost_slope: float = 0.03, host_cost: bool = True):
        self.adaptive = check_bool("adaptive", adaptive)
        self.cost_model = BatchCostModel(prior_slope=check_number("prior_cost_slope", prior_cost_slope, 0.0))
        self.calibrator = AcceptanceCalibrator()
        self.host_cost = check_bool("host_cost", host_cost)
        self.host_models: dict[int, HostCostModel] = {}  # batch bucket -> h(k), the step's time outside its forward
        self._step_costs: dict[int, list[float]] = {}  # bucket -> c(w) + h(w - 1) / t1, until the next forward
        self._pending: dict[Hashable, tuple[Draft, list]] = {}  # request -> verified candidates, their kinds

    def on_forward(self, report) -> None:
        """A ``ForwardReport``: decode forwards calibrate c_B(n) (a prefill's cost is the prompt's; a padding host's
        prefill of several rows marks their bucket, ``note_padded``) and, where the host measures it, h(k) (the
        previous step's time outside its forward)."""
        if report.prefill:
            if not report.packed and report.batch_size > 1:
                self.cost_model.note_padded(report.batch_size)
            return
        if report.packed:  # rows end to end: a sequence of all their tokens, whatever the rows (see BatchCostModel)
            self.cost_model.add(1, report.num_tokens, report.forward_s)
        else:
            self.cost_model.add(report.batch_size, report.width, report.forward_s)
        self._step_costs.clear()
        if self.host_cost and report.step_outside_s is not None:
            bucket = self.cost_model.bucket(report.batch_size)
            model = self.host_models.get(bucket)
            if model is None:
                model = self.host_models[bucket] = HostCostModel()
            model.add(report.step_nodes, report.step_outside_s)

    def step_costs(self, num_nodes: int, batch_size: int = 1) -> list[float]:
        """What a step feeding ``w - 1`` draft nodes costs, in one-token forwards, for ``w`` = 1 ..
        ``num_nodes + 1`` (at least): the forward, ``c_B(w)``, plus the time outside it, ``(a + b (w - 1)) / t1``
        (``HostCostModel``; ``t1`` the one-token forward's seconds). Without host measurements, ``c_B(w)``."""
        bucket = self.cost_model.bucket(batch_size)
        found = self._step_costs.get(bucket)
        if found is not None and len(found) > num_nodes:
            return found
        costs = self.cost_model.cost_list(num_nodes + 1, batch_size)
        a, b = self._host_line(batch_size, batch_size)
        if a or b:  # the widths asked for only (9 under vLLM's K = 8, not the curve's 129): a later, wider ask redraws
            costs = [cost + a + b * nodes for nodes, cost in enumerate(costs[:num_nodes + 1])]
        self._step_costs[bucket] = costs
        return costs

    def _host_line(self, batch_size: int, one_token_batch: int) -> tuple[float, float]:
        """``(a, b)``: the step's time outside its forward at ``batch_size``'s bucket, ``a + b k`` for ``k`` nodes
        (``HostCostModel``), in one-token forwards of ``one_token_batch`` rows; ``(0, 0)`` without host
        measurements or a one-token time."""
        host = self.host_models.get(self.cost_model.bucket(batch_size))
        one_token_s = self.cost_model.one_token_s(one_token_batch) if host is not None else None
        if not one_token_s:
            return 0.0, 0.0
        a, b = host.fit()
        return a / one_token_s, b / one_token_s

    def select(self, request_id: Hashable, draft: Draft, kinds: list, budget: Budget,
               extras: tuple = ((0, 0.0),)) -> tuple[Draft, int]:
        """(the chosen sub-tree, index of the chosen extra option); remembers it for ``judge``.

        ``draft``: candidates only, confidence = path probabilities; nodes deeper than
        ``budget.max_depth`` are dropped. An extra option whose ``m`` exceeds the budget is skipped.
        """
        chosen, _, option = self.select_nodes(request_id, draft, kinds, budget, extras)
        return chosen, option

    def select_nodes(self, request_id: Hashable, draft: Draft, kinds: list, budget: Budget,
                     extras: tuple = ((0, 0.0),)) -> tuple[Draft, list[int], int]:
        """``select``, with the chosen nodes' indices in ``draft`` (ascending) between the two; with ``budget.chain``
        only the nodes of ``draft.best_path()`` are candidates (the chosen sub-tree is a chain)."""
        self._pending.pop(request_id, None)
        if draft.num_nodes == 0:
            return Draft.empty(), [], self._best([], budget, extras)[0]
        confidence = draft.confidence.tolist()
        # best first; ties: parents (lower index) first; a host that verifies one chain gets the best path's nodes
        if budget.chain:  # the path's first max_depth nodes (depths 1, 2, ...), best first as they stand unless a
            order = best_path(draft.parents.tolist(), confidence,  # node outscores its parent (never, calibrated)
                              None if draft.is_candidate is None else draft.is_candidate.tolist())[:budget.max_depth]
            probs = [confidence[i] for i in order]
            if any(above < below for above, below in zip(probs, probs[1:])):
                order = sorted(order, key=lambda i: (-confidence[i], i))
                probs = [confidence[i] for i in order]
        else:
            depths = draft.depths().tolist()
            order = sorted((i for i in range(draft.num_nodes) if depths[i] <= budget.max_depth),
                           key=lambda i: (-confidence[i], i))
            probs = [confidence[i] for i in order]
        option, num_nodes = self._best(probs, budget, extras)
        if num_nodes == 0:
            return Draft.empty(), [], option
        keep = sorted(order[:num_nodes])  # parents sort before children
        chosen = draft.select(np.array(keep, np.int64))
        self._pending[request_id] = (chosen, [kinds[i] for i in keep])
        return chosen, keep, option

    def _best(self, sorted_probs: list[float], budget: Budget, extras) -> tuple[int, int]:
        """(extra option, number of nodes) of the best rate at the budget's batch size (a large batch, where
        extra tokens cost more, drafts less); ties go to the earlier option, fewer nodes."""
        best = (-1.0, 0, 0)
        for option, (num_extra, value) in enumerate(extras):
            available = min(len(sorted_probs), budget.num_nodes - num_extra)
            if available < 0:
                continue
            if not self.adaptive:
                best = (0.0, option, available)  # the last option that fits
                continue
            # [w - 1]: c(w) + h(w - 1) / t1; rows packed end to end: the row alone (fit_batch cuts them together)
            costs = self.step_costs(num_extra + available, 1 if budget.packed else budget.batch_size)
            base = 1.0 + num_extra * value
            best_rate, best_k, expected = base / costs[num_extra], 0, 0.0
            for k in range(available):  # expected tokens of the k + 1 best nodes: base + their sum
                expected += sorted_probs[k]
                rate = (base + expected) / costs[num_extra + k + 1]
                if rate > best_rate:
                    best_rate, best_k = rate, k + 1
            if best_rate > best[0]:
                best = (best_rate, option, best_k)
        return best[1], best[2]

    def fit_batch(self, request_ids: list, drafts: list[Draft], batch_size: int,
                  progress: list[int] | None = None, packed: bool = False) -> list[Draft]:
        """The rows' drafts of one padded batch forward, each cut to its ``W`` best nodes for the one ``W`` that
        maximizes the batch's expected tokens per unit of time; of one packed forward (``packed``), ``_fit_packed``.

        ``select`` sizes each row as if its width were the step's, but a padded batch forward is as wide as its
        widest row: every row pays ``c_B(1 + max k)``. So the step keeps the common cap ``W`` that maximizes
        ``V(W) / (c_B(1 + W) + h(sum of min(k_i, W)) / t1)`` (ties: the smaller ``W``), ``V(W)`` what the step is
        worth: with ``progress`` (the tokens each row has generated so far), ``padded_step_values``, where the
        batch lasts as long as its slowest rows; without, ``sum over rows of (1 + S_i(min(k_i, W)))``, ``S_i(k)``
        the sum of row ``i``'s ``k`` highest path probabilities. A row's remembered nodes (for ``judge``) are cut
        with it. Drafts with not-candidate nodes (a lookahead window), without confidence, or any not chosen by
        ``select`` for its request, leave the batch as it is.
        Worked example: ``c(n) = 1 + 0.3 (n - 1)``, one row drafting path probabilities ``[0.9, 0.5]`` and
        seven drafting none: ``W = 0`` gives 8/1 = 8, ``W = 1`` 8.9/1.3 = 6.85, ``W = 2`` 9.4/1.6 = 5.88,
        so no row drafts (alone, that row would have kept both nodes: 2.4/1.6 = 1.5 against 1).
        """
        widths = [draft.num_nodes for draft in drafts]
        if len(drafts) <= 1 or not self.adaptive or not any(widths):
            return drafts
        sorted_rows = self._sorted_rows(request_ids, drafts)
        if sorted_rows is None:
            return drafts
        orders, sorted_probs = sorted_rows
        if packed:
            return self._fit_packed(request_ids, drafts, orders, sorted_probs)
        widest = max(widths)
        forward = self.cost_model.cost_list(widest + 1, batch_size)  # [w - 1]: c_B(w)
        a, b = self._host_line(batch_size, batch_size)
        if progress is None:
            prefix = [[0.0] + list(itertools.accumulate(probs)) for probs in sorted_probs]
            worth = None
        else:
            best_nodes = [list(zip(probs, draft.depths()[order].tolist())) if order else []
                          for probs, draft, order in zip(sorted_probs, drafts, orders)]
            worth = padded_step_values(best_nodes, progress, forward[1], widest)
        best_rate, best_cap = -1.0, widest
        for cap in range(widest + 1):
            fed = [min(width, cap) for width in widths]
            expected = sum(1.0 + sums[k] for sums, k in zip(prefix, fed)) if worth is None else worth[cap]
            rate = expected / (forward[cap] + a + b * sum(fed))
            if rate > best_rate:
                best_rate, best_cap = rate, cap
        if best_cap == widest:
            return drafts
        return self._cut_rows(request_ids, drafts, orders, [best_cap] * len(drafts))

    def _sorted_rows(self, request_ids: list, drafts: list[Draft]) -> tuple[list, list] | None:
        """Per row, its nodes best first (ties: the lower index) and their path probabilities; None where a draft
        has not-candidate nodes (a lookahead window), no confidence, or was not chosen by ``select`` for its
        request (the batch is then left as it is)."""
        orders, sorted_probs = [], []
        for request_id, draft in zip(request_ids, drafts):
            if not draft.num_nodes:
                orders.append([])
                sorted_probs.append([])
                continue
            pending = self._pending.get(request_id)
            if draft.is_candidate is not None or draft.confidence is None or pending is None \
                    or pending[0] is not draft:
                return None
            confidence = draft.confidence.tolist()
            order = sorted(range(len(confidence)), key=confidence.__getitem__, reverse=True)  # stable: ties by index
            orders.append(order)
            sorted_probs.append([confidence[i] for i in order])
        return orders, sorted_probs

    def _fit_packed(self, request_ids: list, drafts: list[Draft], orders: list, sorted_probs: list) -> list[Draft]:
        """The rows of one packed forward (rows end to end, ``B`` of them), cut together: the ``M`` best nodes of
        all rows for the ``M`` that maximizes ``(B + their probabilities' sum) / (c_1(B + M) + h(M) / t1)``
        (ties: the smaller ``M``), where ``c_1`` is the cost of a step by its tokens in all (``BatchCostModel``:
        a packing host reports every forward so) and ``h`` the step's time outside its forward at ``B`` rows.

        Each row was sized alone (``Budget.packed``), against ``c_1(1 + k)``. Sized as if every row fed as many
        tokens as itself (``c_B``, a padded batch's price), a row with a good draft beside rows with none was
        priced for tokens they did not feed; alone, it is priced as if no other row shared the step. Together,
        a node pays where its probability beats what the step's other tokens earn per token, whatever row it
        is in. A step's value and cost depend on ``M`` alone, so the best ``M`` nodes are the best of every
        choice of rows' prefixes (``tests/test_mixture.py`` searches them all).
        Worked example: ``c_1(n) = 1 + 0.1 (n - 1)``, two rows, one drafting ``[0.9, 0.5]``, one ``[0.3]``:
        ``M = 0`` gives 2 / 1.1 = 1.82, ``M = 1`` 2.9 / 1.2 = 2.42, ``M = 2`` 3.4 / 1.3 = 2.62, ``M = 3``
        3.7 / 1.4 = 2.64: every node is kept; at ``c_1(n) = 1 + 0.5 (n - 1)`` ``M = 1`` (2.9 / 2 = 1.45
        against 2 / 1.5 = 1.33 and 3.4 / 2.5 = 1.36) keeps the first row's best node alone.
        """
        batch_size = len(drafts)
        merged = sorted((-probability, row, rank) for row, probs in enumerate(sorted_probs)
                        for rank, probability in enumerate(probs))
        forward = self.cost_model.cost_list(batch_size + len(merged), 1)  # [n - 1]: c_1(n), n tokens in all
        a, b = self._host_line(batch_size, 1)
        best_rate, best_m, expected = batch_size / (forward[batch_size - 1] + a), 0, 0.0
        for m, (negative, _, _) in enumerate(merged, 1):
            expected -= negative
            rate = (batch_size + expected) / (forward[batch_size + m - 1] + a + b * m)
            if rate > best_rate:
                best_rate, best_m = rate, m
        if best_m == len(merged):
            return drafts
        caps = [0] * batch_size
        for _, row, _ in merged[:best_m]:
            caps[row] += 1
        return self._cut_rows(request_ids, drafts, orders, caps)

    def _cut_rows(self, request_ids: list, drafts: list[Draft], orders: list, caps: list[int]) -> list[Draft]:
        """Each row cut to its ``caps[i]`` best nodes (in ``orders[i]``), each with its parent; a row's remembered
        nodes (for ``judge``) are cut with it."""
        fitted = []
        for request_id, draft, order, cap in zip(request_ids, drafts, orders, caps):
            if draft.num_nodes <= cap:
                fitted.append(draft)
                continue
            parents = draft.parents.tolist()
            chosen: set[int] = set()  # the best nodes, each with its parent (path probabilities: the best anyway)
            for i in order:
                if len(chosen) == cap:
                    break
                if parents[i] < 0 or parents[i] in chosen:
                    chosen.add(i)
            keep = sorted(chosen)
            if not keep:
                self._pending.pop(request_id, None)
                fitted.append(Draft.empty())
                continue
            cut = draft.select(np.array(keep, np.int64))
            self._pending[request_id] = (cut, [self._pending[request_id][1][i] for i in keep])
            fitted.append(cut)
        return fitted

    def judge(self, request_id: Hashable, committed) -> None:
        """Count the outcome of the request's last selected draft (``committed``: this step's tokens)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.calibrator.judge(*pending, committed)

    def forget(self, request_id: Hashable) -> None:
        self._pending.pop(request_id, None)
