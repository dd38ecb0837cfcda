"""``Proposer``: a freespec drafter as vLLM's speculative proposer (``method: custom_class``, vLLM 0.32-0.33).

``BatchDrafter`` is what it shares with vLLM 0.34's speculator (``speculator.py``):
the options, the request state, hints, one step's drafts for the rows of a batch
(``draft_rows``: sync every row, draft, cut the step together, chains), the
engine's step times, errors contained, counters. ``Proposer`` adds the
``custom_class`` glue below: finding the runner, its exits, its token arrays.

vLLM builds ``Proposer(vllm_config)`` in its model runner, calls ``load_model``,
then, each step after the forward, ``propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu)`` with one row per request of its persistent
batch, and expects one list of draft ids per row (vllm 0.32-0.33
``gpu_model_runner.py``, which the CPU runner inherits). vLLM's rejection sampler
verifies the drafts (point masses: greedy output is plain vLLM's, sampled output
has the model's distribution), so nothing here can change an output.

What vLLM does not hand a ``custom_class`` proposer, and how it is found:

- **request ids**: rows move as requests join and leave, and ``propose`` gets no
  ids. ``load_model`` finds the model runner that holds this proposer (the
  caller whose ``drafter`` is ``self``); each step reads its ``input_batch``
  (``req_ids``: row -> request), and checks that the ``token_ids_cpu`` it was
  handed is that batch's, or drafts nothing;
- **exits**: the runner learns of finished, aborted and preempted requests in
  ``_update_states``, also in the last step before the engine goes idle, where
  no ``propose`` follows. ``load_model`` wraps that method on the runner
  instance (not its class) so every exit releases the request's drafter state
  at once; a request that returns after preemption starts again;
- **hints**: ``runner.requests[req_id].sampling_params.extra_args`` holds a
  request's ``documents`` / ``prediction`` (``hints.py``), read when it starts;
  texts are tokenized with the model's tokenizer;
- **the target's logits**: never. The drafter gets no ``observe`` calls, so
  token recycling and lookahead are off (``options.VLLM_FIXED``);
- **forward times**: the time from the end of one ``propose`` to the start of
  the next is the engine's step (forward, sampling, bookkeeping); it goes to the
  drafter's ``on_forward`` with each row's tokens fed (1 + its draft), as a
  packed batch (vLLM lays rows end to end: a step costs what its total tokens
  cost), so the mixture sizes drafts from the engine's measured cost. A step that
  ran other tokens too (another request's prefill chunk, or drafts vLLM did not
  schedule: its ``total_num_scheduled_tokens``, read in ``_update_states``, is not
  the rows' tokens) is not reported: its time is not its rows'. Each
  row drafts under ``Budget.packed`` (sized as if alone), then the drafter cuts the
  step's rows together (``fit_batch(..., packed=True)``).

Per-request state follows vLLM's requests through ``HostRequests`` (the
lifecycle shared with the SGLang plugin): started from the row's whole sequence
the first time a request has a committed token, extended with exactly the
tokens vLLM committed (``num_tokens_no_spec`` grows by ``len(sampled)``),
restarted where the two disagree, released on every exit. A step brings every row's request up to
date before it drafts for any (as ``generate()`` does), so each draft reads every outcome of the step.

Nothing here may take the engine down: an exception while drafting for one
request costs that request this step's draft and its state (it restarts next
step); an exception outside the per-request loop (the joint cut included) costs the step's drafts. Each
kind is logged once with its traceback and counted (``num_errors``).

vLLM verifies chains only for these methods: the drafter's tree is cut to its
most confident path (``Draft.best_chain``) of at most ``num_speculative_tokens``
tokens, never past ``max_model_len``, and stops before any id outside the
vocabulary.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Hashable

import numpy as np

from freespec.draft import Budget, Draft
from freespec.drafters.base import ForwardReport

from .. import host_serving
from ..host_requests import HostRequests
from . import hints, options
from .version import check_vllm_version

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger, so its handlers print these lines
TAIL_OVERLAP = 4  # tokens before the newly committed ones that must line up with what the drafter holds
LOG_EVERY = 2000  # steps between two "served" log lines
_EMPTY = Draft.empty()


class BatchDrafter:
    """A freespec drafter serving one vLLM model runner's steps, whichever path calls it (``Proposer`` on vLLM
    0.32-0.33, ``speculator.FreespecSpeculator`` on 0.34): options, request state, hints, the step's drafts
    (``draft_rows``), errors contained, counters. The drafter comes from ``FREESPEC_VLLM_DRAFTER`` /
    ``FREESPEC_VLLM_CONFIG`` (``options.py``, default: the mixture)."""

    def __init__(self, vllm_config, *, drafter=None) -> None:
        spec = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.num_speculative_tokens = int(spec.num_speculative_tokens)
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self._tokenizer_source = (model_config.tokenizer, getattr(model_config, "tokenizer_revision", None),
                                  bool(getattr(model_config, "trust_remote_code", False)))
        self._tokenizer = None
        if drafter is None:
            self.options = options.from_env()
            drafter = options.build_drafter(self.options)
        else:
            self.options = None
        drafter.warmup()
        self.requests = HostRequests(drafter, on_start=self._add_hints)
        self._last_rows: tuple = ()  # (request ids, tokens fed per row) of the step being run
        self._step_began = None  # when the last propose returned: the engine's step runs from then
        self._scheduled_tokens = None  # the tokens vLLM scheduled for the step being run (None: not known)
        self.clock = time.perf_counter  # seconds, for the engine's step times (a replay sets a clock of its own)
        self.num_steps = self.num_rows = self.num_drafted = 0
        self.num_errors = 0
        self.num_hint_errors = 0
        self.num_mixed_steps = 0  # steps not reported to the drafter: other tokens ran in them (_report_forward)
        self._logged: set = set()
        self._budgets: dict = {}  # (max_depth, batch_size) -> Budget
        self._stats_path = os.environ.get(options.ENV_STATS) or None
        name = self.options.drafter if self.options else getattr(drafter, "name", type(drafter).__name__)
        logger.info("freespec: vLLM drafts come from drafter %r %s (num_speculative_tokens=%d)", name,
                    self.options.drafter_options if self.options else {}, self.num_speculative_tokens)

    @property
    def drafter(self):
        return self.requests.drafter

    @property
    def num_live_requests(self) -> int:
        """Requests whose drafter state is held."""
        return len(self.requests)

    # ------------------------------------------------------------ drafting
    def draft_rows(self, req_ids, num_sampled: list[int], num_tokens_of: list[int], token_rows) -> list[list[int]]:
        """One step's drafts, one list of ids per row (empty: none), both hosts' paths through it.

        Row ``i`` holds request ``req_ids[i]``, which committed ``num_sampled[i]`` tokens this step (0: a partial
        prefill, no draft) and now holds ``num_tokens_of[i]``; ``token_rows[i, start:stop]`` reads its tokens
        (a numpy array; any ``start`` from ``num_tokens_of[i] - num_sampled[i] - TAIL_OVERLAP`` on, and ``0`` the
        first time a request is seen). The caller has already released the requests that left."""
        rows = [i for i, count in enumerate(num_sampled) if count]  # none: a partial prefill
        budget_rows = max(1, len(rows))
        drafts: list[list[int]] = [[] for _ in num_sampled]
        fed_ids, fed_tokens = [], []
        synced = []  # every row's committed tokens first, then the drafts (as generate() does a step): each
        for i in rows:  # draft sees every outcome of the step, and the calibrator's estimates hold across rows
            req_id = req_ids[i]
            try:
                self._sync_row(req_id, i, num_sampled[i], num_tokens_of[i], token_rows)
                synced.append(i)
            except Exception as exc:  # this request drafts nothing this step, and restarts at the next
                self._error(f"request:{type(exc).__name__}", exc, req_id)
                self.requests.discard(req_id)
        proposed = self._draft_rows(req_ids, synced, num_tokens_of, budget_rows)  # before the step's joint cut
        if len(rows) > 1 and proposed:
            proposed = self._fit(req_ids, rows, proposed)
        for i, draft in proposed.items():
            try:
                drafts[i] = self._chain(draft, num_tokens_of[i])
            except Exception as exc:  # as above
                self._error(f"request:{type(exc).__name__}", exc, req_ids[i])
                self.requests.discard(req_ids[i])
        for i in rows:
            fed_ids.append(req_ids[i])
            fed_tokens.append(1 + len(drafts[i]))
        self._last_rows = (tuple(fed_ids), tuple(fed_tokens))
        self._count(sum(len(d) for d in drafts), len(rows))
        return drafts

    def _fit(self, req_ids, rows: list[int], proposed: dict) -> dict:
        """The step's drafts (row -> draft) as the drafter cuts them together for one packed forward
        (``Drafter.fit_batch(..., packed=True)``: the rows were proposed under ``Budget.packed``)."""
        fitted = self.drafter.fit_batch([req_ids[i] for i in rows], [proposed.get(i) or _EMPTY for i in rows],
                                        len(rows), packed=True)
        return {i: draft for i, draft in zip(rows, fitted) if draft.num_nodes}

    def _sync_row(self, req_id: Hashable, row: int, num_sampled: int, num_tokens: int, token_rows) -> None:
        """The request's drafter state brought to the row's ``num_tokens`` committed tokens."""
        tail = token_rows[row, max(0, num_tokens - num_sampled - TAIL_OVERLAP):num_tokens].tolist()
        self.requests.sync(req_id, tail, num_tokens, lambda: token_rows[row, :num_tokens].copy())

    def _max_depth(self, num_tokens: int) -> int:
        """The longest chain vLLM takes after ``num_tokens`` committed tokens: K, never past ``max_model_len``."""
        return min(self.num_speculative_tokens, self.max_model_len - num_tokens - 1)

    def _draft_rows(self, req_ids, rows: list[int], num_tokens_of: list[int], batch_size: int) -> dict:
        """Row -> its draft (a tree the sizer chose; rows drafting nothing left out), every synced row's in one
        ``Drafter.propose_batch`` call; where that raises, row by row, so a failure costs its request alone."""
        budgets = {i: self._budget(max_depth, batch_size) for i in rows
                   if (max_depth := self._max_depth(num_tokens_of[i])) > 0}
        try:
            drafts = self.drafter.propose_batch([req_ids[i] for i in budgets], list(budgets.values()))
            return {i: draft for i, draft in zip(budgets, drafts) if draft.num_nodes}
        except Exception:  # the failing request is found, and discarded, row by row below
            pass
        proposed = {}
        for i in rows:
            req_id = req_ids[i]
            try:
                draft = self._draft_row(req_id, num_tokens_of[i], batch_size)
                if draft.num_nodes:
                    proposed[i] = draft
            except Exception as exc:  # as in the sync: this request drafts nothing this step, and restarts
                self._error(f"request:{type(exc).__name__}", exc, req_id)
                self.requests.discard(req_id)
        return proposed

    def _draft_row(self, req_id: Hashable, num_tokens: int, batch_size: int) -> Draft:
        """A synced request's draft."""
        max_depth = self._max_depth(num_tokens)
        if max_depth <= 0:
            return _EMPTY
        return self.drafter.propose(req_id, self._budget(max_depth, batch_size))

    def _chain(self, draft: Draft, num_tokens: int) -> list[int]:
        """A draft's ids as the chain vLLM verifies."""
        ids = draft.token_ids.tolist()  # a chain already, mostly (the sizer's, under Budget.chain): its own path
        chain = [ids[node] for node in draft.best_path()[:self._max_depth(num_tokens)]]
        if max(chain) >= self.vocab_size:  # never an id outside the vocabulary: stop before the first
            chain = chain[:next(i for i, token in enumerate(chain) if token >= self.vocab_size)]
        return chain

    def _budget(self, max_depth: int, batch_size: int) -> Budget:
        key = (max_depth, batch_size)
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._budgets[key] = Budget(self.num_speculative_tokens, max_depth, batch_size, chain=True,
                                                 packed=True)
        return budget

    def _report_forward(self, began: float) -> None:
        """The step since the last ``propose`` returned, with the tokens each row fed, to ``on_forward``; not a step
        that ran other tokens too (vLLM scheduled more or fewer than the rows fed: a prefill chunk, cut drafts)."""
        scheduled, self._scheduled_tokens = self._scheduled_tokens, None
        if self._step_began is not None and self._last_rows and self._last_rows[0]:
            request_ids, tokens_per_row = self._last_rows
            if scheduled is not None and scheduled != sum(tokens_per_row):
                self.num_mixed_steps += 1
                return
            self.drafter.on_forward(ForwardReport(request_ids, tokens_per_row, began - self._step_began, packed=True))

    # ------------------------------------------------------------ requests
    def stats(self) -> dict:
        """Serving counters: live requests, starts, restarts, steps (``mixed_steps``: those not reported to the
        drafter's cost model, as other tokens ran in them), drafted tokens, errors; the request
        history's size (tokens and bytes allocated; None without one) and this process's resident MB (None
        where ``/proc`` is not there), so a server's growth can be told apart from the drafter's."""
        history = getattr(self.drafter, "history", None)
        return {"live_requests": len(self.requests), "starts": self.requests.num_starts,
                "restarts": self.requests.num_restarts, "steps": self.num_steps,
                "mixed_steps": self.num_mixed_steps, "rows": self.num_rows,
                "drafted_tokens": self.num_drafted, "errors": self.num_errors, "hint_errors": self.num_hint_errors,
                "history_tokens": None if history is None else history.num_tokens,
                "history_bytes": None if history is None else history.nbytes,
                "process_rss_mb": host_serving.resident_mb()}

    def write_stats(self, path: str) -> None:
        """``stats()`` as JSON at ``path`` (replaced atomically); the proposer writes it after requests leave
        when ``FREESPEC_VLLM_STATS`` names a file."""
        host_serving.write_stats(path, self.stats())

    def _add_hints(self, req_id: Hashable) -> None:
        """A (re)started request's ``documents`` / ``prediction`` from its ``SamplingParams.extra_args``."""
        try:
            found = hints.parse(self.extra_args_of(req_id))
            if found is not None:
                host_serving.add_hints(self.drafter, req_id, found, self._tokenizer_for)
        except Exception as exc:  # the request drafts without its hints
            self.num_hint_errors += 1
            self._error(f"hints:{type(exc).__name__}", exc, req_id)

    def extra_args_of(self, req_id: Hashable):
        """A request's ``SamplingParams.extra_args`` (None where not known), read when it starts."""
        return None

    def _tokenizer_for(self, items):
        if not any(isinstance(item, str) for item in items):
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            name, revision, trust_remote_code = self._tokenizer_source
            self._tokenizer = AutoTokenizer.from_pretrained(name, revision=revision,
                                                            trust_remote_code=trust_remote_code)
        return self._tokenizer

    # ------------------------------------------------------------ accounting
    def _error(self, kind: str, exc: BaseException, req_id: Hashable = None) -> None:
        self.num_errors += 1
        if kind not in self._logged:
            self._logged.add(kind)
            where = f" for request {req_id!r}" if req_id is not None else ""
            logger.error("freespec: drafting failed%s (%s; later failures of this kind are counted, not logged, "
                         "%d so far): %s\n%s", where, kind, self.num_errors, exc,
                         "".join(traceback.format_exception(exc)))

    def _count(self, num_drafted: int, num_rows: int) -> None:
        """Serving counters; a log line at the first draft and every ``LOG_EVERY`` steps."""
        if num_drafted and not self.num_drafted:
            logger.info("freespec: serving drafts (first: %d tokens for %d requests)", num_drafted, num_rows)
        self.num_steps += 1
        self.num_rows += num_rows
        self.num_drafted += num_drafted
        if self.num_steps % LOG_EVERY == 0:
            logger.info("freespec: %s", self.stats())


class Proposer(BatchDrafter):
    """``speculative_config={"method": "custom_class", "model": "freespec.integrations.vllm.Proposer",
    "num_speculative_tokens": K}`` (vLLM 0.32-0.33); the drafter comes from ``FREESPEC_VLLM_DRAFTER`` /
    ``FREESPEC_VLLM_CONFIG`` (``options.py``, default: the mixture)."""

    def __init__(self, vllm_config, *, drafter=None) -> None:
        check_vllm_version()
        self._runner = None
        super().__init__(vllm_config, drafter=drafter)

    # ------------------------------------------------------------ vLLM's calls
    def load_model(self, *args, **kwargs) -> None:
        """Find the model runner that holds this proposer and follow its request exits."""
        self.attach_runner(_find_holder(self))

    def attach_runner(self, runner) -> None:
        """Draft for ``runner``'s batch (``input_batch``, ``requests``) and release requests as it drops them.

        Wraps ``_update_states`` on that runner instance once; attaching to the runner already followed is a no-op."""
        if runner is self._runner:
            return
        self.detach_runner()
        for attribute in ("input_batch", "requests", "_update_states"):
            if not hasattr(runner, attribute):
                raise RuntimeError(f"freespec: vLLM's model runner {type(runner).__name__} has no {attribute!r}; "
                                   f"this vLLM is not one freespec supports")
        self._runner = runner
        update_states = runner._update_states

        def _update_states(scheduler_output, *args, **kwargs):
            result = update_states(scheduler_output, *args, **kwargs)
            self._scheduled_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
            self._release_exits(scheduler_output)
            return result

        runner._update_states = _update_states

    def detach_runner(self) -> None:
        """Undo ``attach_runner`` (tests)."""
        if self._runner is not None:
            vars(self._runner).pop("_update_states", None)
        self._runner = None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None,
                **kwargs) -> list[list[int]]:
        """One list of draft ids per row of vLLM's batch (empty: no draft for that row)."""
        began = self.clock()
        try:
            drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, began)
        except Exception as exc:  # never the engine: this step goes without drafts
            self._error("step", exc)
            drafts = [[] for _ in sampled_token_ids]
            self._last_rows = ()
        self._step_began = self.clock()
        return drafts

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, began: float) -> list[list[int]]:
        batch = self._input_batch(token_ids_cpu)
        self._report_forward(began)
        self.requests.release_absent(batch.req_id_to_index)
        num_rows = len(sampled_token_ids)
        return self.draft_rows(batch.req_ids, [len(sampled) for sampled in sampled_token_ids],
                               np.asarray(num_tokens_no_spec[:num_rows]).tolist(), token_ids_cpu)

    def _input_batch(self, token_ids_cpu):
        if self._runner is None:  # load_model was not called (a vLLM that skips it): find the runner now
            self.attach_runner(_find_holder(self))
        batch = self._runner.input_batch
        if batch.token_ids_cpu is not token_ids_cpu:
            raise RuntimeError("the token_ids_cpu vLLM handed propose() is not its input batch's; rows cannot be "
                               "matched to requests")
        return batch

    def _release_exits(self, scheduler_output) -> None:
        """After vLLM's ``_update_states``: release finished, aborted and preempted requests."""
        try:
            leaving = set(getattr(scheduler_output, "finished_req_ids", ()) or ())
            leaving |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
            gone = [r for r in self.requests.ids() if r in leaving or r not in self._runner.requests]
            self.requests.release(gone)
            if gone and self._stats_path:
                self.write_stats(self._stats_path)
        except Exception as exc:
            self._error("release", exc)

    def extra_args_of(self, req_id: Hashable):
        state = self._runner.requests.get(req_id) if self._runner is not None else None
        return getattr(getattr(state, "sampling_params", None), "extra_args", None)


def _find_holder(proposer, max_frames: int = 8):
    """The object up the call stack whose ``drafter`` is ``proposer`` (vLLM's model runner)."""
    frame = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            break
        holder = frame.f_locals.get("self")
        if holder is not proposer and getattr(holder, "drafter", None) is proposer:
            return holder
        frame = frame.f_back
    raise RuntimeError("freespec: the vLLM model runner that holds this proposer was not found up the call stack "
                       "of load_model/propose; this vLLM is not one freespec supports")
