"""Hypothesis drives every registered drafter with interleaved requests and odd inputs.

Inputs: empty prompts, token ids up to 2**31 - 1 (far outside any vocabulary), long repeats, up
to three requests interleaved, ``extend`` with empty arrays, ``propose`` with zero budgets and
batch sizes up to 64, documents (for drafters that take them), ``observe`` with arbitrary top-k
(for drafters that read it), ``on_forward`` reports of any size, and calls on requests that are
not live. What must hold:

- a draft is a well-formed tree within its budget (empty for a zero budget);
- a drafter drafts only tokens it was given (prompts, outputs, documents, observed top-k); under
  its ``isolation_options``, only tokens given to that request;
- misuse (unknown request, double start, bad ids) raises ``ValueError``, nothing else;
- after every request stopped, no request id is left in the drafter's state.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freespec.draft import Budget, Draft
from freespec.drafters import available, drafter_class, make
from freespec.drafters.base import ForwardReport, VerifyOutput

from test_soak import request_keys

MAX_ID = 2**31 - 1
NAMES = [name for name in available() if not drafter_class(name).needs_model]

small = st.integers(0, 6)  # a small alphabet: texts repeat, so drafters find matches
ids = st.one_of(small, small, small, st.integers(0, 200), st.sampled_from([MAX_ID, MAX_ID - 1, 2**30, 2**16]),
                st.integers(0, MAX_ID))
token_lists = st.one_of(
    st.lists(ids, max_size=40),
    st.builds(lambda pattern, times: pattern * times, st.lists(ids, min_size=1, max_size=4), st.integers(1, 120)),
)
request_ids = st.sampled_from(["a", "b", "c"])
extend = st.tuples(st.just("extend"), request_ids, st.lists(ids, max_size=6))
propose = st.tuples(st.just("propose"), request_ids, st.integers(0, 64), st.integers(0, 32), st.integers(1, 64))
documents = st.lists(token_lists, max_size=3)
starts = st.tuples(*[op for r in ("a", "b", "c") for op in (st.tuples(st.just("start"), st.just(r), token_lists),
                                                             st.tuples(st.just("documents"), st.just(r), documents))])
operations = st.lists(st.one_of(
    st.tuples(st.just("start"), request_ids, token_lists),
    extend, extend, extend, propose, propose, propose,
    st.tuples(st.just("observe"), request_ids, st.lists(ids, min_size=1, max_size=3)),
    st.tuples(st.just("documents"), request_ids, documents),
    st.tuples(st.just("forward"), st.lists(request_ids, min_size=1, max_size=3), st.integers(1, 100),
              st.floats(0, 1, allow_nan=False), st.booleans()),
    st.tuples(st.just("stop"), request_ids),
    st.tuples(st.just("bad"), request_ids, st.sampled_from(["negative", "too large", "2-D", "floats"])),
), min_size=10, max_size=40)

BAD_IDS = {"negative": [3, -1], "too large": [2**31], "2-D": [[1, 2]], "floats": [1.5]}


class Run:
    """The drafter under test and what each request (and the drafter as a whole) was given."""

    def __init__(self, drafter, isolated: bool, all_given: set[int]):
        self.drafter, self.isolated = drafter, isolated
        self.live: set[str] = set()
        self.given: dict[str, set[int]] = {}  # per request: every token given to it
        self.all_given = all_given  # every token given to this drafter, in any example
        self.last_draft: dict[str, Draft] = {}

    def give(self, request_id: str, tokens) -> None:
        tokens = {int(t) for t in np.asarray(tokens, np.int64).reshape(-1).tolist()}
        self.given.setdefault(request_id, set()).update(tokens)
        self.all_given |= tokens

    def apply(self, op) -> None:
        kind, request_id = op[0], op[1]
        live = request_id in self.live if isinstance(request_id, str) else True
        drafter = self.drafter
        if kind == "start":
            if live:
                return self.expect_error(drafter.start, request_id, op[2])
            drafter.start(request_id, op[2])
            self.live.add(request_id)
            self.given[request_id] = set()
            self.give(request_id, op[2])
        elif kind == "extend":
            if not live:
                return self.expect_error(drafter.extend, request_id, op[2])
            drafter.extend(request_id, np.asarray(op[2], np.int64))
            self.give(request_id, op[2])
        elif kind == "propose":
            budget = Budget(op[2], op[3], op[4])
            if not live:
                return self.expect_error(drafter.propose, request_id, budget)
            self.check_draft(request_id, drafter.propose(request_id, budget), budget)
        elif kind == "observe":
            draft = self.last_draft.get(request_id)
            if not live or draft is None or not drafter.observe_top_k:
                return
            top_k = np.array([op[2]] * (draft.num_nodes + 1), np.int64)  # [num_nodes + 1, k]
            drafter.observe(request_id, VerifyOutput(draft, np.zeros(0, np.int64), top_k))
            self.give(request_id, op[2])
        elif kind == "documents":
            if not live or not drafter.accepts_documents:
                return self.expect_error(drafter.add_documents, request_id, op[2])
            drafter.add_documents(request_id, [np.asarray(doc, np.int64) for doc in op[2]])
            for doc in op[2]:
                self.give(request_id, doc)
        elif kind == "forward":
            drafter.on_forward(ForwardReport(tuple(request_id), tuple([op[2]] * len(request_id)), op[3], op[4]))
        elif kind == "stop":
            if not live:
                return self.expect_error(drafter.stop, request_id)
            drafter.stop(request_id)
            self.live.discard(request_id)
            self.last_draft.pop(request_id, None)
        elif kind == "bad":
            method = drafter.extend if live else drafter.start
            self.expect_error(method, request_id, BAD_IDS[op[2]])

    def check_draft(self, request_id: str, draft: Draft, budget: Budget) -> None:
        draft.validate(budget)
        if budget.num_nodes == 0 or budget.max_depth == 0:
            assert draft.num_nodes == 0
        drafted = set(draft.token_ids.tolist())
        assert drafted <= self.all_given, f"drafted tokens never given: {sorted(drafted - self.all_given)[:5]}"
        if self.isolated:
            own = self.given[request_id]
            assert drafted <= own, f"request {request_id!r} drafted other requests' tokens {sorted(drafted - own)[:5]}"
        self.last_draft[request_id] = draft

    @staticmethod
    def expect_error(method, *args) -> None:
        with pytest.raises(ValueError):
            method(*args)

    def finish(self) -> None:
        for request_id in sorted(self.live):
            self.drafter.stop(request_id)
        assert not self.drafter._contexts
        assert not request_keys(self.drafter, lambda key: key in ("a", "b", "c")), "state left after stop"


_DRAFTERS: dict[tuple, tuple] = {}


def _drafter(name: str, isolated: bool) -> tuple:
    """(drafter, tokens given to it so far): one warmed-up instance per drafter and mode, reused across
    examples (each example stops its requests; with its defaults a drafter may share what it learned)."""
    key = (name, isolated)
    if key not in _DRAFTERS:
        drafter = make(name, **(drafter_class(name).isolation_options if isolated else {}))
        drafter.warmup()
        _DRAFTERS[key] = (drafter, set())
    return _DRAFTERS[key]


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "defaults"])
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(first=starts, ops=operations)
def test_any_sequence_of_calls_keeps_the_contract(name, isolated, first, ops):
    drafter, given = _drafter(name, isolated)
    run = Run(drafter, isolated, given)
    try:
        for op in list(first) + ops:
            run.apply(op)
    finally:
        run.finish()


@pytest.mark.parametrize("name", NAMES)
def test_extreme_inputs(name):
    """The inputs the random search may miss: the largest ids repeated, an empty prompt, a zero budget."""
    drafter = make(name)
    big = [MAX_ID, MAX_ID - 1, 0] * 50
    drafter.start("big", big)
    if drafter.accepts_documents:
        drafter.add_documents("big", [big, []])
    draft = drafter.propose("big", Budget(16, 8, 64))
    draft.validate(Budget(16, 8))
    assert set(draft.token_ids.tolist()) <= set(big)
    drafter.extend("big", np.zeros(0, np.int64))
    assert drafter.propose("big", Budget(0, 8)).num_nodes == 0 and drafter.propose("big", Budget(8, 0)).num_nodes == 0
    drafter.start("empty", [])
    drafter.propose("empty", Budget(8, 8)).validate(Budget(8, 8))
    drafter.extend("empty", [7])
    drafter.propose("empty", Budget(8, 8)).validate(Budget(8, 8))
    drafter.stop("empty")
    drafter.stop("big")
