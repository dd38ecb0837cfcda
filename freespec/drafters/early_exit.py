"""Early-exit (self-speculative) drafter: part of the target drafts, the whole target verifies.

No auxiliary model and no training. A draft pass runs a subset of the target's
own decoder layers over one token, against the verified KV cache, then the
final norm and the LM head; the full model verifies the draft in the engine's
tree forward, losslessly. Two modes (Draft & Verify, SWIFT, CLaSp, LayerSkip):

- ``skip``: every layer but a set of middle ones (first and last always run).
  Off-the-shelf models draft far better this way than by exiting early.
- ``exit``: the first L layers (for checkpoints trained for it, LayerSkip).

One step (``layers`` the chosen set, ``threshold`` 0.8, pending token ``y``)::

    pass(y)  -> top-1 "the" p=0.93        node 0
    pass(the) -> top-1 "cat" p=0.85       node 1, child of 0
    pass(cat) -> top-1 "sat" p=0.41 < 0.8 node 2, child of 1; sibling "is" p=0.22
                                          (node 3, child of 1); stop

A node's confidence is the product of the draft probabilities on its path.
Drafts grow while the top-1 probability stays at or above ``threshold``; where
it falls below, up to ``max_siblings`` next-best tokens of probability
>= ``min_sibling_prob`` become siblings, and the draft stops.

**Choosing the layers and the threshold.** Unless the user fixes them
(``layers`` or ``exit_layer``, ``threshold``), the drafter calibrates once per
model (``self_draft_calibration.calibrate``): from ``calibration_tokens`` tokens
of the model's own output (the first requests; until then it proposes nothing),
it measures per candidate layer set the draft's agreement with the target and
the cost of a pass on this machine, simulates the drafting rule, and keeps the
layers and threshold with the most tokens per unit of time. The result is
cached per model (weights fingerprint and these options) under
``$FREESPEC_CACHE/early_exit/``; ``setting`` holds it, with the predicted speedup.

**KV.** A pass reads the verified cache in place through a ``DraftCache``
(``model_handle.py``); its own entries live there and are dropped with it, so
the verified cache is never written and never cloned (SWIFT drafts on a clone).
Attention needs each run layer's keys as one tensor, so every layer a pass runs
concatenates the verified entries with the pass's, as transformers'
``DynamicCache`` does on every forward. The verify forward is the host model's
own call and recomputes every layer for the accepted tokens: the entries a pass
computed below its first skipped layer (exactly the target's) are not reused,
since the host's forward cannot start from a layer's hidden states.

**Head.** ``head_vocab=V'`` drafts from the head's rows for token ids below
``V'`` plus every token id in the request's context (FR-Spec-style: byte-level
BPE vocabularies number tokens in merge order, roughly by frequency; ids below
32768 cover 92% of Spec-Bench's text in Qwen2.5's vocabulary of 151,936). The
verify forward keeps the full vocabulary: output is unchanged either way.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from typing import Hashable, Sequence

import numpy as np

from ..draft import Budget, Draft
from ..tree import follow
from .base import Drafter, ForwardReport
from .calibration import CostModel
from .options import check_bool, check_int, check_number
from .self_draft_calibration import (THRESHOLDS, DraftRule, SelfDraftSetting, calibrate, draft_top, load_setting,
                                     save_setting)

logger = logging.getLogger("freespec")

MAX_PENDING = 4  # a step feeds more uncached tokens only after a (re-)prefill: no draft then
MAX_CALIBRATION_SEQUENCES = 4
MAX_CALIBRATION_LEN = 512  # tokens per calibration sequence (the prompt is cut from the front)
PROBE_EVERY = 64  # a gate that says no still lets one step in this many draft, to follow drift


class EarlyExitDrafter(Drafter):
    """Drafts with a subset of the target's own layers; see the module docstring.

    layers: the layer indices a pass runs (ascending), fixing the ``skip`` mode's set;
    exit_layer: L, fixing the ``exit`` mode (layers 0..L-1); give at most one of them.
    threshold: keep drafting while the top-1 draft probability is >= this (None: calibrated).
    max_depth: longest chain; max_siblings / min_sibling_prob: siblings where confidence is low
        (the calibration chooses how many, up to max_siblings).
    head_vocab: draft over token ids below this plus the context's tokens (None: the full head).
    calibration_tokens: output tokens to calibrate on; cache_calibration: keep the result
        under ``$FREESPEC_CACHE/early_exit/`` and reuse it.
    """

    name = "early_exit"
    needs_model = True

    def __init__(self, layers: Sequence[int] | None = None, exit_layer: int | None = None,
                 threshold: float | None = None, max_depth: int = 8, max_siblings: int = 3,
                 min_sibling_prob: float = 0.1, head_vocab: int | None = 32768, calibration_tokens: int = 128,
                 cache_calibration: bool = True):
        super().__init__()
        if layers is not None and exit_layer is not None:
            raise ValueError("give layers (the skip mode's set) or exit_layer (the exit mode), not both")
        if layers is not None:
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
                raise ValueError(f"layers must be a sequence of layer indices, got {layers!r}")
            layers = tuple(check_int("layers[i]", i, 0) for i in layers)
            if not layers or any(b <= a for a, b in zip(layers, layers[1:])):
                raise ValueError(f"layers must be non-empty and strictly ascending, got {list(layers)}")
        self.fixed_layers = ("skip", layers) if layers is not None else None
        if exit_layer is not None:
            self.fixed_layers = ("exit", tuple(range(check_int("exit_layer", exit_layer, 1))))
        self.fixed_threshold = None if threshold is None else check_number("threshold", threshold, 0.0, 1.0)
        self.rule = DraftRule(check_int("max_depth", max_depth, 1), check_int("max_siblings", max_siblings, 0),
                              check_number("min_sibling_prob", min_sibling_prob, 0.0, 1.0))
        self.head_vocab = None if head_vocab is None else check_int("head_vocab", head_vocab, 1)
        self.calibration_tokens = check_int("calibration_tokens", calibration_tokens, 1)
        self.cache_calibration = check_bool("cache_calibration", cache_calibration)
        self.handle = None
        self.setting: SelfDraftSetting | None = None
        self.pass_seconds: deque[float] = deque(maxlen=64)  # wall time of recent draft passes
        self._finished: deque[tuple[np.ndarray, int]] = deque(maxlen=MAX_CALIBRATION_SEQUENCES)
        self._prompt_lens: dict[Hashable, int] = {}
        self._verified: dict[Hashable, tuple[object, int]] = {}  # request -> (engine's cache, verified length)
        self._base_head = None
        self._extra: dict[Hashable, tuple[np.ndarray, object]] = {}  # request -> (context ids >= head_vocab, head)
        self._last: dict[Hashable, tuple[Draft, int]] = {}  # request -> (last draft, its passes)
        self._step_means: np.ndarray | None = None  # running (nodes, accepted, passes) per step
        self.cost_model = CostModel()  # c(n) of the verify forward, measured live (``on_forward``)
        self._one_token_s: deque[float] = deque(maxlen=64)  # recent 1-token forwards
        self._gated_off = 0  # steps the gate refused since the last probe

    # ---------------------------------------------------------------- the model
    def attach_model(self, handle) -> None:
        """Take the model handle; load this model's calibrated setting if one is cached."""
        if self.handle is not None and self.handle.fingerprint == handle.fingerprint:
            self.handle = handle  # the same weights patched again: keep the setting and the heads
            return
        if self.fixed_layers is not None and self.fixed_layers[1][-1] >= handle.num_layers:
            raise ValueError(f"early_exit: layer {self.fixed_layers[1][-1]} does not exist; the model has "
                             f"{handle.num_layers} layers")
        self.handle, self.setting, self._base_head, self._extra = handle, None, None, {}
        if self.fixed_layers is not None and self.fixed_threshold is not None:
            self._use(SelfDraftSetting(self.fixed_layers[0], self.fixed_layers[1], self.fixed_threshold,
                                       self.rule.max_siblings))
        elif self.cache_calibration:
            cached = load_setting(self.calibration_key)
            if cached is not None:
                self._use(cached)

    @property
    def calibration_key(self) -> str:
        """The cache file's name: the weights' fingerprint and every option the calibration depends on."""
        options = [self.fixed_layers, self.fixed_threshold, self.rule, self.head_vocab]
        digest = hashlib.sha256(repr(options).encode()).hexdigest()[:12]
        return f"{self.handle.fingerprint}-{digest}"

    def calibrate(self, sequences: Sequence, prompt_lens: Sequence[int]) -> SelfDraftSetting:
        """Choose the layers and threshold from ``sequences`` (prompt + the model's output, token ids).

        ``prompt_lens[i]``: where sequence i's output starts. Also called by the
        drafter itself once it has seen ``calibration_tokens`` output tokens.
        """
        if self.handle is None:
            raise ValueError("early_exit drafts with the model: freespec.patch(model) attaches it first")
        layer_sets = None if self.fixed_layers is None else [self.fixed_layers]
        thresholds = THRESHOLDS if self.fixed_threshold is None else (self.fixed_threshold,)
        setting = calibrate(self.handle, sequences, prompt_lens, self._heads(None), self.rule, layer_sets, thresholds)
        self._use(setting)
        if self.cache_calibration:
            save_setting(self.calibration_key, setting)
        logger.info("freespec: early_exit calibrated (%s %d of %d layers, threshold %.2f, agreement %.2f, "
                    "draft pass %.2f of a forward, predicted speedup %.2fx)", setting.mode, len(setting.layers),
                    self.handle.num_layers, setting.threshold, setting.agreement, setting.draft_cost,
                    setting.predicted_speedup)
        return setting

    def _use(self, setting: SelfDraftSetting) -> None:
        if setting.layers[-1] >= self.handle.num_layers:
            raise ValueError(f"early_exit setting names layer {setting.layers[-1]} of a "
                             f"{self.handle.num_layers}-layer model")
        self.setting = setting
        measured = setting.calibration_tokens > 0  # a setting the user fixed has no simulated step yet
        self._step_means = (np.array([setting.mean_nodes, setting.mean_accepted, setting.mean_passes])
                            if measured else None)

    # ---------------------------------------------------------------- lifecycle
    def on_verified_cache(self, request_id, cache, cache_len: int) -> None:
        self._verified[request_id] = (cache, int(cache_len))

    def _on_start(self, request_id) -> None:
        self._prompt_lens[request_id] = len(self.context(request_id))
        self._extra[request_id] = (np.zeros(0, np.int64), None)
        self._add_context_tokens(request_id, self.context(request_id))

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        last = self._last.pop(request_id, None)
        if last is not None:
            draft, passes = last
            outcome = np.array([draft.num_nodes, len(follow(draft.parents, draft.token_ids, ids)), passes], float)
            means = self._step_means
            self._step_means = outcome if means is None else means + (outcome - means) / 32
        self._add_context_tokens(request_id, ids)

    def _on_stop(self, request_id) -> None:
        context, prompt_len = self.context(request_id), self._prompt_lens.pop(request_id)
        if self.setting is None and len(context) > prompt_len:
            self._finished.append(_calibration_sequence(context, prompt_len))
        for state in (self._verified, self._extra, self._last):
            state.pop(request_id, None)

    # ---------------------------------------------------------------- live numbers (the mixture's gate)
    def on_forward(self, report: ForwardReport) -> None:
        """Verify forwards, timed like the mixture's c(k); 1-token ones give the unit a pass is measured in."""
        if report.prefill or report.batch_size != 1:
            return
        self.cost_model.add(report.width, report.forward_s)
        if report.width == 1:
            self._one_token_s.append(report.forward_s)

    def expected_step(self) -> tuple[float, float, float] | None:
        """Running means per drafted step: (nodes, accepted nodes, passes), starting from the
        calibration's simulation (or the first outcome); None before either."""
        return None if self._step_means is None else tuple(float(x) for x in self._step_means)

    def live_speedup(self) -> float | None:
        """Predicted tokens per unit of time of a drafted step over an undrafted one, from live numbers.

        ``(1 + accepted) / (c(1 + nodes) + passes * pass_s / one_token_s)``: the step
        means from outcomes (the calibration's simulation until then), c from the
        verify forwards seen, a pass's and a 1-token forward's median wall time
        (the calibration's ratio until both are measured). None while nothing is known.
        """
        means = self.expected_step()
        if means is None:
            return None
        nodes, accepted, passes = means
        if self.pass_seconds and self._one_token_s:
            pass_cost = float(np.median(self.pass_seconds)) / float(np.median(self._one_token_s))
        else:
            pass_cost = self.setting.draft_cost
        return (1 + accepted) / (self.cost_model.cost(1 + nodes) + passes * pass_cost)

    def worth_drafting(self, request_id) -> bool:
        """Whether a draft for this request is predicted to gain (``live_speedup`` > 1), or probes.

        Calibrates first when enough output was seen; a fixed setting with no outcome
        yet drafts (to measure); every ``PROBE_EVERY`` refusals
        one step drafts anyway, so the step means follow the text.
        """
        if self.setting is None and self.handle is not None:
            self._calibrate_when_ready(request_id)
        if not self.ready(request_id):
            return False
        speedup = self.live_speedup()
        if speedup is None or speedup > 1.0:  # a setting the user fixed: draft until outcomes say
            return True
        self._gated_off += 1
        if self._gated_off >= PROBE_EVERY:
            self._gated_off = 0
            return True
        return False

    def ready(self, request_id) -> bool:
        """A model, a setting and the request's verified cache: ``propose`` can draft."""
        return self.handle is not None and self.setting is not None and request_id in self._verified

    # ---------------------------------------------------------------- drafting
    def _propose(self, request_id, budget: Budget) -> Draft:
        if self.handle is None:
            raise ValueError("early_exit drafts with the model: use it through freespec.patch(model)")
        if self.setting is None:
            self._calibrate_when_ready(request_id)
        if not self.ready(request_id):
            return Draft.empty()
        cache, cache_len = self._verified[request_id]
        pending = self.context(request_id)[cache_len:]
        if not 1 <= len(pending) <= MAX_PENDING:
            return Draft.empty()
        draft, passes = self._draft(request_id, pending, cache, cache_len, budget)
        self._last[request_id] = (draft, passes)
        return draft

    def _draft(self, request_id, pending: np.ndarray, cache, cache_len: int, budget: Budget) -> tuple[Draft, int]:
        """One draft tree and the number of passes it took (see the module docstring)."""
        handle, setting, rule = self.handle, self.setting, self.rule
        draft_cache = handle.draft_cache(cache, cache_len)
        heads = self._heads(request_id)
        max_depth = min(rule.max_depth, budget.max_depth)
        token_ids, parents, confidence = [], [], []
        feed, parent, path_prob, passes = pending, -1, 1.0, 0
        for depth in range(max_depth):
            t0 = time.perf_counter()
            hidden = handle.run(handle.embed(feed), setting.layers, draft_cache)
            probs, ids = draft_top(handle, hidden[0, -1:], heads, 1 + setting.max_siblings)
            self.pass_seconds.append(time.perf_counter() - t0)
            passes += 1
            probs, ids = probs[0].tolist(), ids[0].tolist()
            node = len(token_ids)
            token_ids.append(ids[0])
            parents.append(parent)
            confidence.append(path_prob * probs[0])
            low = probs[0] < setting.threshold
            if low:
                for prob, token in zip(probs[1:], ids[1:]):
                    if prob >= rule.min_sibling_prob and len(token_ids) < budget.num_nodes:
                        token_ids.append(token)
                        parents.append(parent)
                        confidence.append(path_prob * prob)
            if low or len(token_ids) >= budget.num_nodes or depth + 1 == max_depth:
                break
            feed, parent, path_prob = ids[:1], node, path_prob * probs[0]
        draft = Draft(np.asarray(token_ids, np.int64), np.asarray(parents, np.int32),
                      np.asarray(confidence, np.float32), (self.name,) * len(token_ids))
        return draft, passes

    # ---------------------------------------------------------------- calibration data, heads
    def _calibrate_when_ready(self, request_id) -> None:
        """Calibrate once the finished requests and this one hold ``calibration_tokens`` output tokens."""
        pool = list(self._finished)
        context, prompt_len = self.context(request_id), self._prompt_lens[request_id]
        if len(context) > prompt_len:
            pool.append(_calibration_sequence(context, prompt_len))
        if sum(len(ids) - start for ids, start in pool) < self.calibration_tokens:
            return
        pool = pool[-MAX_CALIBRATION_SEQUENCES:]
        self.calibrate([ids for ids, _ in pool], [start for _, start in pool])
        self._finished.clear()

    def _heads(self, request_id) -> list | None:
        """The reduced heads a pass drafts over (base ids, then the context's rarer ids); None: the full head."""
        if self.head_vocab is None or self.head_vocab >= self.handle.vocab_size:
            return None
        if self._base_head is None:
            self._base_head = self.handle.reduced_head(np.arange(self.head_vocab))
        extra = self._extra.get(request_id, (None, None))[1]
        return [self._base_head] if extra is None else [self._base_head, extra]

    def _add_context_tokens(self, request_id, ids: np.ndarray) -> None:
        if self.head_vocab is None or self.handle is None or request_id not in self._extra:
            return
        known, head = self._extra[request_id]
        rare = np.asarray(ids, np.int64)
        rare = rare[(rare >= self.head_vocab) & (rare < self.handle.vocab_size)]
        new = np.setdiff1d(rare, known)
        if new.size:
            known = np.union1d(known, new)
            self._extra[request_id] = (known, self.handle.reduced_head(known))


def _calibration_sequence(context: np.ndarray, prompt_len: int) -> tuple[np.ndarray, int]:
    """(the last ``MAX_CALIBRATION_LEN`` tokens, where the output starts in them; at least 1)."""
    cut = max(0, len(context) - MAX_CALIBRATION_LEN)
    return np.array(context[cut:], np.int64), max(1, prompt_len - cut)
