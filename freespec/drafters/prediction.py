"""Predicted outputs: draft from a text the caller expects the output to mostly repeat.

A code-editing tool knows most of its answer in advance: the file it asked to
change. ``generate(prediction=old_code)`` hands it to the drafter (OpenAI's
API calls this "Predicted Outputs", Cursor "speculative edits"). It is a hint:
verification keeps the output exactly what the model produces; only the
number of forwards changes.

``PredictionSource`` keeps, per request, an *alignment* of the output with the
prediction ``P``: a ``cursor`` (the prediction token the output is expected to
produce next), the ``match_len`` of the output's tail that agrees with ``P``
up to the cursor, and an ``anchor`` (where the output last left a trusted
stretch of ``P``). Each committed token either equals ``P[cursor]`` (the
cursor advances) or departs; on a departure the longest tail of the output
that occurs in ``P`` re-aligns the cursor (the occurrence nearest to where the
output was, a step back costing twice a step forward), and if the tail's last
token is nowhere in ``P`` the output is *lost*: the cursor waits at the anchor
(the model may be inserting text and come back). An alignment is trusted once
``trust_after`` tokens agree, or when it resumed at the anchor; the anchor
then follows the cursor.

Each step drafts ``P`` from the cursor while the output is aligned. For the
first ``guess_window`` tokens after a departure it also *guesses* where the
model comes back, one token each: ``P[anchor]`` (it inserted text) and
``P[anchor + 1]`` (it replaced a token, as a rename does). A guess costs one
node; once the model takes it, the output is aligned again and the next step
drafts the whole rest. Guesses carry confidence 0.5, so the mixture's
calibration counts them apart from aligned nodes.

Worked example, ``P = [1, 2, 3, 4, 5, 6, 7, 8]``:

- output ``[1, 2, 3]``: in sync, cursor 3; draft ``4 5 6 7 8``;
- a deletion, output ``[1, 2, 3, 6]``: ``6 != P[3]``; the tail ``[6]`` occurs
  at 5, so cursor 6, match_len 1, not trusted yet; drafts ``7 8``, and the
  guesses ``4`` and ``5`` (from the anchor 3);
- an insertion or a changed token, output ``[1, 2, 3, 9]``: ``9`` is nowhere
  in ``P``, so the output is lost and the cursor waits at the anchor 3; the
  guesses ``4`` (the model comes back) and ``5`` (``9`` replaced ``4``); if
  the model then writes ``5``, the next step drafts ``6 7 8``.

Measured on recorded greedy outputs of qwen2.5-coder-0.5b on ``builtin:code-edit``
(8 edits, 256 new tokens, ``freespec replay``'s accounting, the mixture's cost
model fed the forward times c(k) measured on one loaded CPU thread: c(4) 1.9,
c(16) 2.6, c(64) 4.4): tau 12.8 without the original code as the prediction,
14.2 with it (15.0 on a second pass, once the calibration has seen such edits);
simulated tokens/s -3%: on such a CPU every fed node costs, and the longer
chains a prediction earns are partly rejected at the edit. A diff-based oracle
that drafts exactly the unchanged spans reaches tau 15.5 at depth 48. Guessing
whole chains instead of one token: tau 15.1, simulated tokens/s -10%. Live
(``freespec bench``, the same 8 edits, one loaded CPU thread) the mixture with
the prediction measured tau 12.70 against 12.80 without, feeding 9% fewer
tokens: the code is in the prompt, so the suffix source already drafts most
of what the prediction offers, and the live cost model gates the rest.

Cost: an in-sync token is one comparison; a departure scans ``P`` once
(``P == token``, numpy) and narrows the matches by one token per step of the
tail, so a 2,000-token prediction costs ~10 us per departed token.
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

from ..draft import Budget, Draft, merge
from .base import Drafter, as_token_array, exercise
from .options import check_int


class _Alignment:
    """One request's prediction and where its output stands in it."""

    __slots__ = ("prediction", "tokens", "tail", "cursor", "match_len", "anchor", "anchored", "departed")

    def __init__(self, prediction: np.ndarray):
        self.prediction = prediction  # [P] int32
        self.tokens = prediction.tolist()  # the same, for scalar reads in the per-token loop
        self.tail: list[int] = []  # the last output tokens (at most max_match)
        self.cursor = 0  # index in the prediction of the next token the output is expected to produce
        self.match_len = 0  # output tokens that agree with prediction[:cursor], 0 = lost
        self.anchor = 0  # where the output last left a trusted stretch of the prediction
        self.anchored = True  # the current stretch is trusted: the anchor follows the cursor
        self.departed = 0  # output tokens since the output last produced prediction[cursor]


def realign(prediction: np.ndarray, tail: np.ndarray, expected: int) -> tuple[int, int]:
    """``(cursor, match_len)``: after the longest tail of the output that occurs in ``prediction``.

    Among the occurrences of that tail, the one whose next position is nearest
    to ``expected`` wins (a position before it counts double). ``(expected, 0)``
    when the last token of ``tail`` is not in ``prediction``.
    ``realign([1, 2, 3, 1, 2, 4], tail=[7, 1, 2], expected=5) -> (5, 2)``:
    ``[1, 2]`` ends at 1 and at 4, and 5 is nearer to 5 than 2 is.
    """
    ends = np.flatnonzero(prediction == tail[-1])  # [m] candidate positions of the tail's last token
    if ends.size == 0:
        return expected, 0
    length = 1
    while length < tail.shape[0]:
        before = ends - length
        ok = before >= 0
        keep = ends[ok][prediction[before[ok]] == tail[-1 - length]]
        if keep.size == 0:
            break
        ends, length = keep, length + 1
    after = ends + 1
    distance = np.where(after >= expected, after - expected, 2 * (expected - after))
    return int(after[np.argmin(distance)]), length


class PredictionSource:
    """Per-request predicted outputs, each aligned with the output as it grows.

    ``PredictionDrafter`` and ``MixtureDrafter`` compose one.
    max_depth: no draft path longer than this (the budget may cut it shorter).
    max_match: longest output tail used to re-align after a departure.
    trust_after: output tokens that must agree with a re-aligned stretch before
        it becomes the new anchor.
    guess_window: guess where the model comes back for this many output tokens
        after a departure (0: never guess).
    """

    def __init__(self, max_depth: int = 64, max_match: int = 32, trust_after: int = 4, guess_window: int = 4):
        self.max_depth = check_int("max_depth", max_depth, 1)
        self.max_match = check_int("max_match", max_match, 1)
        self.trust_after = check_int("trust_after", trust_after, 1)
        self.guess_window = check_int("guess_window", guess_window, 0)
        self._requests: dict[Hashable, _Alignment] = {}

    def add(self, request_id: Hashable, prediction_ids) -> None:
        """Set the request's predicted output (1-D token ids), aligned from its first token: before any output."""
        self._requests[request_id] = _Alignment(as_token_array(prediction_ids, "prediction_ids"))

    def extend(self, request_id: Hashable, ids: np.ndarray) -> None:
        """Follow the committed tokens through the prediction."""
        state = self._requests.get(request_id)
        if state is None:
            return
        tokens = state.tokens
        for token in ids.tolist():
            state.tail.append(token)
            if state.cursor < len(tokens) and tokens[state.cursor] == token:
                state.cursor += 1
                state.match_len += 1
                state.departed = 0
                if not state.anchored and state.match_len >= self.trust_after:
                    state.anchored = True
                if state.anchored:
                    state.anchor = state.cursor
            else:
                state.departed += 1
                self._depart(state)
        del state.tail[:-self.max_match]

    def _depart(self, state: _Alignment) -> None:
        cursor, match_len = realign(state.prediction, np.asarray(state.tail[-self.max_match:]), state.cursor)
        if match_len == 0:  # lost: wait at the anchor, the model may come back there
            state.cursor, state.match_len, state.anchored = state.anchor, 0, True
        else:
            state.cursor, state.match_len = cursor, match_len
            state.anchored = cursor == state.anchor or match_len >= self.trust_after
            if state.anchored:
                state.anchor = cursor

    def stop(self, request_id: Hashable) -> None:
        self._requests.pop(request_id, None)

    def drafts(self, request_id: Hashable, budget: Budget) -> list[tuple[str, int, Draft]]:
        """``(source, match_len, draft)``: ``P`` from the cursor while aligned, and the guesses.

        The chain carries confidence 1 and the alignment's ``match_len``; the
        guesses (one node each, ``P[anchor]`` and ``P[anchor + 1]``) confidence
        0.5 and ``match_len`` 1.
        """
        state = self._requests.get(request_id)
        if state is None:
            return []
        out, taken = [], set()
        if state.match_len or not state.tail:  # aligned, or at the start
            length = min(self.max_depth, budget.max_depth, budget.num_nodes)
            chain = state.prediction[state.cursor:state.cursor + length]
            if chain.size:
                out.append(("prediction", max(1, state.match_len), Draft.chain(chain, "prediction", score=1.0)))
                taken.add(int(chain[0]))
        if state.tail and 0 < state.departed <= self.guess_window and not (state.match_len and state.anchored):
            guesses = []
            for token in state.tokens[state.anchor:state.anchor + 2]:
                if token not in taken and len(guesses) < budget.num_nodes:
                    guesses.append(token)
                    taken.add(token)
            if guesses:
                out.append(("prediction", 1, Draft(np.asarray(guesses), np.full(len(guesses), -1),
                                                   np.full(len(guesses), 0.5), ("prediction",) * len(guesses))))
        return out


class PredictionDrafter(Drafter):
    """Drafts from the request's predicted output (``generate(prediction=...)``), re-aligned after departures.

    Without a prediction it proposes nothing; ``mixture`` composes the same
    ``PredictionSource`` beside its other sources. Options as ``PredictionSource``'s.
    """

    name = "prediction"
    accepts_prediction = True

    def __init__(self, max_depth: int = 64, max_match: int = 32, trust_after: int = 4, guess_window: int = 4):
        super().__init__()
        self.prediction = PredictionSource(max_depth, max_match, trust_after, guess_window)

    def add_prediction(self, request_id: Hashable, prediction_ids) -> None:
        self._context(request_id)
        self.prediction.add(request_id, prediction_ids)

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        self.prediction.extend(request_id, ids)

    def _on_stop(self, request_id) -> None:
        self.prediction.stop(request_id)

    def _propose(self, request_id, budget: Budget) -> Draft:
        drafts = [draft for _, _, draft in self.prediction.drafts(request_id, budget)]
        if len(drafts) <= 1:
            return drafts[0] if drafts else Draft.empty()
        return merge(drafts, num_nodes=budget.num_nodes)

    def warmup(self) -> None:
        """Nothing to compile; runs a tiny request through the lifecycle."""
        exercise(PredictionDrafter())
