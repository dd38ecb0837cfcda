"""One drafter, many requests at once: host threads sharing a drafter, and the rows of a batch.

- Every hook of ``Drafter`` (and any override in a subclass) runs holding the instance's lock;
  a hook of one request waits while another request's hook runs.
- Real threads hammer one drafter with interleaved requests: no exception, and every request gets
  the drafts a single-threaded run of the same per-request streams gives it.
- Indexes shared by several drafters (``RequestHistory``, ``DocumentIndex``) survive threads that
  add to them while others draft; drafters and indexes deep-copy and pickle (the copy gets its own lock).
- A batched ``generate()`` reports every forward with its rows' request ids and batch size, asks
  for drafts priced at that batch size, and the mixture's cost model files the forwards by batch.
"""

from __future__ import annotations

import copy
import pickle
import sys
import threading

import numpy as np
import pytest
import torch

import freespec
from freespec import SpecConfig
from freespec.bench.replay import ReplayedRequest
from freespec.draft import Budget, Draft
from freespec.drafters import available, drafter_class, make
from freespec.drafters.base import Drafter, ForwardReport
from freespec.drafters.calibration import AcceptanceCalibrator
from freespec.drafters.corpus import CorpusDrafter, DocumentIndex
from freespec.drafters.mixture import MixtureDrafter
from freespec.drafters.suffix import RequestHistory, SuffixDrafter
from freespec.testing.streams import code_streams, draft_paths

UNLOCKED = {"context", "num_generated"}  # public methods of Drafter that need no lock (reads for subclasses)


@pytest.fixture
def fast_switching():
    """Threads switch every 10 us instead of 5 ms, so their calls interleave finely."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def test_every_hook_is_locked_in_the_base_and_in_overrides():
    public = [name for name, value in vars(Drafter).items() if callable(value) and not name.startswith("_")]
    hooks = {"start", "propose", "extend", "observe", "stop", "add_documents", "add_prediction", "on_forward"}
    assert hooks <= set(public)
    for name in set(public) - UNLOCKED:
        assert getattr(getattr(Drafter, name), "_holds_drafter_lock", False), f"Drafter.{name} is not locked"
    for drafter_name in available():
        cls = drafter_class(drafter_name)
        for name in set(public) - UNLOCKED:
            assert getattr(getattr(cls, name), "_holds_drafter_lock", False), f"{cls.__name__}.{name} is not locked"


def test_a_hook_waits_while_another_requests_hook_runs():
    entered, release = threading.Event(), threading.Event()

    class Blocking(Drafter):
        def _propose(self, request_id, budget):
            entered.set()
            release.wait(5)
            return Draft.empty()

        def on_forward(self, report):  # an override: locked too
            self.reported = report

    drafter = Blocking()
    drafter.start("a", [1, 2])
    drafter.start("b", [3, 4])
    proposer = threading.Thread(target=drafter.propose, args=("a", Budget(4, 4)))
    proposer.start()
    assert entered.wait(5)
    others = [threading.Thread(target=drafter.extend, args=("b", [5])),
              threading.Thread(target=drafter.on_forward, args=(ForwardReport(("a",), (1,), 0.01),))]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(0.2)
        assert thread.is_alive(), "a hook ran while another request's propose held the drafter"
    release.set()
    for thread in [proposer] + others:
        thread.join(5)
    assert drafter.context("b").tolist() == [3, 4, 5] and drafter.reported.request_ids == ("a",)


# options under which a request's drafts depend on its own stream alone (nothing shared, no cost model;
# the acceptance calibration, numbers shared by design, is frozen by the test)
DETERMINISTIC = {"mixture": {"adaptive": False}, "recycle": {"adaptive": False}, "lookahead": {"adaptive": False}}


def _run_requests(drafter, requests: list[tuple], config, drafts: dict, interleave: int = 2) -> None:
    """Run ``requests`` (id, prompt, output) on this thread, ``interleave`` at a time, recording their drafts."""
    pending = list(requests)
    live: list[ReplayedRequest] = []
    while pending or live:
        while pending and len(live) < interleave:
            request_id, prompt, output = pending.pop(0)
            drafter.start(request_id, prompt)
            if drafter.accepts_documents:  # a document that holds the answer
                drafter.add_documents(request_id, [np.concatenate([prompt[-8:], output])])
            if drafter.accepts_prediction:  # a prediction that holds the answer but for its first tokens
                drafter.add_prediction(request_id, output[4:])
            live.append(ReplayedRequest(drafter, request_id, prompt, output, len(output) + 1, config,
                                        observe_truth=True))
        for request in live:
            draft = request.propose(len(live))
            drafter.on_forward(ForwardReport((request.request_id,), (request.num_fed(draft),), 0.01))
            drafts.setdefault(request.request_id, []).append(draft_paths(draft))
            request.commit(draft)
        for request in [r for r in live if r.done]:
            drafter.stop(request.request_id)
        live = [r for r in live if not r.done]


def _in_threads(jobs: list[tuple], config, drafts: dict | None = None, interleave: int = 2) -> list:
    """Run each job (drafter, requests) on its own thread; the exceptions they raised (and a TimeoutError per
    thread still running after 120 s)."""
    errors = []

    def work(drafter, requests):
        try:
            _run_requests(drafter, requests, config, {} if drafts is None else drafts, interleave)
        except BaseException as exc:  # noqa: BLE001 (returned, with its thread's traceback)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return errors + [TimeoutError(f"{t.name} still running after 120 s") for t in threads if t.is_alive()]


@pytest.mark.parametrize("name", [n for n in available() if not drafter_class(n).needs_model])
def test_threads_hammering_one_drafter_get_the_single_threaded_drafts(name, fast_switching, monkeypatch):
    # acceptance counts are shared across requests by design (numbers about the model, no tokens) and
    # order recycled and lookup trees: frozen at their priors, a request's drafts are its own stream's
    monkeypatch.setattr(AcceptanceCalibrator, "update", lambda self, kind, accepted: None)
    options = {**drafter_class(name).isolation_options, **DETERMINISTIC.get(name, {})}
    config = SpecConfig(max_draft_tokens=256, max_draft_depth=16)
    requests = [((name, j), prompt, output) for j, (prompt, output) in enumerate(code_streams(48, 64, 24))]
    num_threads = 8
    alone: dict = {}
    _run_requests(make(name, **options), requests, config, alone)
    shared, together = make(name, **options), {}
    errors = _in_threads([(shared, requests[t::num_threads]) for t in range(num_threads)], config, together)
    assert not errors, errors
    assert not shared._contexts
    assert together == alone
    assert sum(1 for steps in alone.values() for paths in steps if paths) > 20  # drafts were made


@pytest.mark.parametrize("name", [n for n in available() if not drafter_class(n).needs_model])
def test_threads_on_state_shared_across_requests_raise_nothing(name, fast_switching):
    """Sharing on, small bounds (``test_soak.SOAK_OPTIONS``): requests of 8 threads feed and evict one
    request history / n-gram table while the others draft from it. Without the drafter's lock this
    segfaults or raises (a match state read against a rebuilt automaton, a deque mutated while read)."""
    from test_soak import SOAK_OPTIONS

    drafter = make(name, **SOAK_OPTIONS.get(name, {}))
    requests = [((name, j), prompt, output) for j, (prompt, output) in enumerate(code_streams(256, 32, 16))]
    errors = _in_threads([(drafter, requests[t::8]) for t in range(8)], SpecConfig(max_draft_tokens=64,
                                                                                   max_draft_depth=16), interleave=1)
    assert not errors, errors
    assert not drafter._contexts


def test_shared_history_and_documents_under_threads(fast_switching):
    """Two drafters share one RequestHistory and one DocumentIndex, a loader thread adds documents."""
    history, index = RequestHistory(300), DocumentIndex(max_tokens=1 << 12)  # small: rebuilt, evicted often
    drafters = [SuffixDrafter(history=history), SuffixDrafter(history=history, min_match=1),
                CorpusDrafter(documents=index), MixtureDrafter(history=history, documents=index)]
    streams = list(code_streams(64, 48, 16))
    stop_loading = threading.Event()

    def load():
        k = 0
        while not stop_loading.is_set():
            prompt, output = streams[k % len(streams)]
            index.add(np.concatenate([prompt, output]), doc_key=k % 40)  # replaces, evicts
            k += 1

    loader = threading.Thread(target=load)
    loader.start()
    jobs = [(drafter, [((t, j), p, o) for j, (p, o) in enumerate(streams)]) for t, drafter in enumerate(drafters)]
    errors = _in_threads(jobs, SpecConfig(max_draft_tokens=32, max_draft_depth=8), interleave=3)
    stop_loading.set()
    loader.join(10)
    assert not errors, errors
    assert history.num_documents > 0 and history.num_tokens <= history.max_tokens and len(index) > 0


def test_drafters_and_shared_indexes_copy_and_pickle_with_their_own_lock():
    history = RequestHistory(256)
    drafter = MixtureDrafter(history=history, documents=DocumentIndex())
    drafter.start("r", [1, 2, 3, 1, 2])
    for twin in (copy.deepcopy(drafter), pickle.loads(pickle.dumps(drafter))):
        assert twin.lock is not drafter.lock and twin.history.lock is not history.lock
        assert twin.documents.shared.lock is not drafter.documents.shared.lock
        assert twin.propose("r", Budget(8, 4)).token_ids.tolist() == drafter.propose("r", Budget(8, 4)).token_ids.tolist()
        twin.stop("r")
    drafter.stop("r")


def test_stop_frees_the_request_even_when_on_stop_raises():
    class Failing(Drafter):
        def _on_stop(self, request_id):
            raise RuntimeError("index full")

    drafter = Failing()
    drafter.start("r", [1])
    with pytest.raises(RuntimeError):
        drafter.stop("r")
    assert not drafter._contexts
    drafter.start("r", [2])  # the id can be used again


# ------------------------------------------------------------------ batches: reports and budgets
def test_a_batch_reports_its_rows_and_the_mixture_prices_at_the_batch_size():
    from freespec.testing.models import tiny_random_llama

    from test_batch import batch_prompts, left_padded

    class Recording(MixtureDrafter):
        def __init__(self):
            super().__init__()
            self.started, self.budgets, self.reports = [], [], []

        def _on_start(self, request_id):
            self.started.append(request_id)
            super()._on_start(request_id)

        def _propose(self, request_id, budget):
            self.budgets.append((request_id, budget.batch_size))
            return super()._propose(request_id, budget)

        def on_forward(self, report):
            self.reports.append(report)
            super().on_forward(report)

    model = tiny_random_llama(dtype=torch.float64)
    ids, mask = left_padded(batch_prompts(1), 1)
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=1)
    eos = int(free[2, ids.shape[1] + 3])  # row 2 emits it early: it leaves the batch
    drafter = Recording()
    freespec.patch(model, SpecConfig(drafter=drafter))
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=1,
                           eos_token_id=eos)
    finally:
        freespec.unpatch(model)
    rows = drafter.started
    assert len(rows) == 4 and drafter.reports[0].request_ids == tuple(rows) and drafter.reports[0].prefill
    sizes = [report.batch_size for report in drafter.reports]
    assert sizes[0] == 4 and min(sizes) < 4 and sizes == sorted(sizes, reverse=True)  # rows leave as they finish
    for report in drafter.reports:
        assert set(report.request_ids) <= set(rows) and len(report.tokens_per_row) == report.batch_size
        assert report.width == max(report.tokens_per_row)
    for request_id, batch_size in drafter.budgets:  # each draft priced at the batch of its forward
        assert any(request_id in r.request_ids and r.batch_size == batch_size for r in drafter.reports)
    decode = [r for r in drafter.reports if not r.prefill]
    for bucket in {drafter.cost_model.bucket(r.batch_size) for r in decode}:
        assert drafter.cost_model.of_batch(bucket).measured_widths()  # the forwards filed under their batch
