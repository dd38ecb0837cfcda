"""The drafter contract.

A drafter is a plain data structure over token ids: it never imports torch
and never sees the model (unless it declares ``needs_model``, below). The
engine drives it through one request's life::

    drafter.start(request_id, prompt_ids)            # index the prompt
    drafter.add_documents(request_id, docs, tok)     # only with documents (generate(documents=...),
                                                     # freespec.documents(...))
    drafter.add_prediction(request_id, ids)          # only with generate(prediction=...)
    while not done:
        drafter.on_verified_cache(request_id, cache, cache_len)  # for model drafters
        draft = drafter.propose(request_id, budget)   # a Draft within budget
        ...one verify forward...
        drafter.on_forward(report)                    # size and time of that forward
        drafter.observe(request_id, verify_output)    # only if observe_top_k > 0
        drafter.extend(request_id, accepted_ids)      # tokens committed this step
    drafter.stop(request_id)                         # may feed a shared index

Every hook is declared on ``Drafter`` below with its default; the engine
calls them unconditionally (never by ``hasattr``). Two extensions serve the
drafters that read the model:

- **Not-candidate nodes.** A ``Draft`` may flag nodes ``is_candidate=False``:
  they are fed and attended in the verify forward but never accepted, and
  their top-k comes back through ``observe`` (``VerifyOutput.topk_token_ids``
  has a row for every node). A lookahead drafter puts its Jacobi window there.
- **Model drafters.** A drafter with ``needs_model = True`` receives, once,
  ``attach_model(handle)``: a narrow handle the engine builds from the host
  model's public modules (run some decoder layers against the verified cache,
  the final norm, the LM head). Only such drafters ever see torch. Before
  each ``propose`` the engine hands such a drafter the request's verified
  cache (``on_verified_cache``; in a batch, the row's own) to run the handle against.

Worked example: token recycling in miniature. The target's top-1 after each
fed token comes back through ``observe``; the draft chains those successors
(``tests/test_contract.py`` runs it against plain decoding)::

    class TopOneSuccessor(Drafter):
        name, observe_top_k = "top1-successor", 1

        def __init__(self):
            super().__init__()
            self.successor = {}  # token -> the target's last top-1 after it

        def observe(self, request_id, out):  # before extend(): context[-1] is the root
            fed = [int(self.context(request_id)[-1])] + out.draft.token_ids.tolist()
            for row, token in enumerate(fed):  # row 0: the root, row i + 1: node i
                self.successor[token] = int(out.topk_token_ids[row, 0])

        def _propose(self, request_id, budget):
            chain, token = [], int(self.context(request_id)[-1])
            while len(chain) < min(budget.num_nodes, budget.max_depth) and token in self.successor:
                token = self.successor[token]
                chain.append(token)
            return Draft.chain(chain, self.name)

``Drafter`` gives the bookkeeping every lookup drafter needs: the context of
each live request as a growing int32 array, and lifecycle checks
(``propose`` before ``start`` raises ``ValueError``).

**Threads.** A host may call one drafter from several threads (two threads
calling ``generate()`` on one patched model share its drafter). Every hook
(``start``, ``propose``, ``extend``, ``observe``, ``stop``, ``add_documents``,
``add_prediction``, ``on_verified_cache``, ``on_forward``, ``attach_model``, ``warmup``), in ``Drafter`` and in any
subclass that overrides it, runs holding the instance's reentrant lock
(``__init_subclass__`` wraps the overrides; a hook added to ``Drafter`` takes
``@_locked``), so a subclass's state needs no
locking of its own; calls of different requests interleave only between
hooks. Without it, threads that share a request history crash (a match state
read against an automaton another thread just rebuilt; ``tests/test_concurrency.py``).
Measured cost, uncontended (CPython 3.11, a busy 2-core Xeon): ``propose`` of a
drafter whose ``_propose`` returns at once takes 1.0 us with the lock, 0.2 us
without, so ~0.8 us per hook call, ~2.5 us per decode step of three hooks.
State shared by several drafter instances (a ``RequestHistory``, a
``DocumentIndex``) carries a lock of its own.

**Memory.** What a request costs lives until ``stop``, which frees it even
when a subclass's ``_on_stop`` raises; state shared across requests is bounded
(each class says by what).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Sequence

import numpy as np

from ..draft import Budget, Draft
from ..kernels import check_id_range


@dataclass(frozen=True)
class VerifyOutput:
    """What a drafter may learn from one verify forward (``observe``).

    ``draft``: the tree that was verified (not-candidate nodes included).
    ``accepted_nodes``: [a] int64, indices into the draft along the accepted path.
    ``topk_token_ids``: [num_nodes + 1, k] int64, the target's top-k tokens at
    the root (row 0) and at each node (row i + 1), from the processed scores.
    ``topk_probs``: [num_nodes + 1, k] float32, the target's probability of each of
    those tokens (the engine's: softmax over the k likeliest 128-token chunks of the
    vocabulary, ``engine.top_k``), or None where the caller has none.
    """

    draft: Draft
    accepted_nodes: np.ndarray
    topk_token_ids: np.ndarray
    topk_probs: np.ndarray | None = None


@dataclass(frozen=True)
class ForwardReport:
    """One target forward, as the engine reports it to ``on_forward``.

    ``request_ids``: the requests in the batch, one per row.
    ``tokens_per_row``: tokens each row fed (pending tokens + draft nodes).
    ``forward_s``: wall seconds of the forward.
    ``prefill``: the first forward of these requests (its size is the prompt's).
    ``step_outside_s``: wall seconds the previous decode step spent outside its forward (drafting, the tree's
    inputs, verification's tensor work, the walk, the drafters' bookkeeping), or None where the host does not
    measure it (serving engines, replay); ``step_nodes``: the draft nodes that step fed, summed over its rows.
    ``packed``: False where the batch pads rows to ``width = max(tokens_per_row)`` tokens each (HF
    ``generate()``); True where the host lays rows end to end (vLLM), so the forward costs what one sequence of
    ``num_tokens = sum(tokens_per_row)`` tokens costs, however they split between rows.
    ``ForwardReport(("r",), (5,), 0.02, False).width -> 5``;
    ``ForwardReport(("a", "b"), (9, 1), 0.1, packed=True).num_tokens -> 10``.
    """

    request_ids: tuple
    tokens_per_row: tuple
    forward_s: float
    prefill: bool = False
    step_outside_s: float | None = None
    step_nodes: int = 0
    packed: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    @property
    def width(self) -> int:
        return max(self.tokens_per_row, default=0)

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_row)


MAX_TOKEN_ROWS = 1 << 18
"""Per-token arrays that grow lazily with the largest token id seen (recycling's successor rows, lookahead's
pool index) stop at this many rows: every vocabulary freespec loads fits (Gemma 3's 262,144 ids), and an id
outside any vocabulary (valid input: ids go up to 2**31 - 1) cannot make state shared across requests
allocate gigabytes. Tokens at or above it get no per-token row."""


def as_token_array(ids, name: str) -> np.ndarray:
    """Check a 1-D sequence of non-negative token ids, return it as int32."""
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    check_id_range(arr, name)
    return np.ascontiguousarray(arr, dtype=np.int32)


def encode_text(text: str, tokenizer) -> np.ndarray:
    """Token ids of ``text``, as it would appear inside an output: ``tokenizer.encode(text, add_special_tokens=False)``."""
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int64)


def exercise(drafter: "Drafter") -> None:
    """Run two tiny requests through ``drafter`` (compiles its kernels, or loads them from numba's cache; see
    ``warmup``). The first outgrows its arrays, so the kernels that grow them load here too, not at a served
    request's first growth (loading one took milliseconds, mid-step, in vLLM's ``propose()``)."""
    drafter.start("warmup", [1, 2, 3, 1, 2])
    draft = drafter.propose("warmup", Budget(16, 8))  # room for a lookahead window beside the lookup nodes
    if drafter.observe_top_k:  # the kernels that learn from the target's top-k, with the engine's dtypes
        k = drafter.observe_top_k
        drafter.observe("warmup", VerifyOutput(draft, np.zeros(0, np.int64),
                                               np.ones((draft.num_nodes + 1, k), np.int64),
                                               np.full((draft.num_nodes + 1, k), 1.0 / k, np.float32)))
    drafter.extend("warmup", [3])
    drafter.propose("warmup", Budget(4, 4))
    drafter.extend("warmup", list(range(4, 68)))
    drafter.stop("warmup")
    drafter.start("warmup", [1, 2])
    drafter.propose("warmup", Budget(4, 4))
    drafter.stop("warmup")


class Lockable:
    """Has ``lock``, a reentrant lock that pickling and ``copy.deepcopy`` leave out (a copy gets its own).

    ``Drafter``, and the indexes several drafters may share (``RequestHistory``,
    ``DocumentIndex``), are ``Lockable``.
    """

    def __init__(self):
        self.lock = threading.RLock()

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("lock", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.lock = threading.RLock()


def _locked(method):
    """``method`` run holding its drafter's ``lock`` (one per instance, reentrant)."""
    if getattr(method, "_holds_drafter_lock", False):
        return method

    @functools.wraps(method)
    def holding_lock(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    holding_lock._holds_drafter_lock = True
    return holding_lock


class _Context:
    """A request's tokens so far, amortized O(1) append."""

    __slots__ = ("buf", "size", "start")

    def __init__(self, ids: np.ndarray):
        self.buf = np.empty(max(64, 2 * len(ids)), np.int32)
        self.buf[: len(ids)] = ids
        self.size = self.start = len(ids)  # start: the prompt's tokens

    def append(self, ids: np.ndarray) -> None:
        need = self.size + len(ids)
        if need > len(self.buf):
            new = np.empty(max(need, 2 * len(self.buf)), np.int32)
            new[: self.size] = self.buf[: self.size]
            self.buf = new
        self.buf[self.size : need] = ids
        self.size = need

    def view(self) -> np.ndarray:
        return self.buf[: self.size]


class Drafter(Lockable):
    """Base class: request bookkeeping and every hook's default; subclasses implement ``_propose``.

    Class attributes a subclass may set:
    ``name``: labels this drafter's nodes in stats.
    ``observe_top_k``: > 0 asks the engine for the target's top-k tokens at every
        fed node, through ``observe``.
    ``accepts_documents``: True when ``add_documents`` works (``generate(documents=...)``).
    ``accepts_prediction``: True when ``add_prediction`` works (``generate(prediction=...)``).
    ``needs_model``: True when the drafter drafts with the model (``attach_model``).
    ``isolation_options``: constructor options under which no token one request
        has seen can appear in another request's drafts (empty when that is the
        default). A drafter that shares text across requests (a request history,
        a shared table) must name the option that turns it off here;
        ``tests/test_soak.py`` checks it for every registered drafter.

    The hooks run holding the instance's ``lock`` (see the module docstring):
    overriding one in a subclass keeps it locked.
    """

    name = "drafter"
    observe_top_k = 0
    accepts_documents = False
    accepts_prediction = False
    needs_model = False
    isolation_options: Mapping[str, Any] = {}

    def __init__(self):
        super().__init__()
        self._contexts: dict[Hashable, _Context] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, method in list(vars(cls).items()):
            if callable(method) and getattr(getattr(Drafter, name, None), "_holds_drafter_lock", False):
                setattr(cls, name, _locked(method))

    # ---- lifecycle
    @_locked
    def start(self, request_id: Hashable, prompt_ids) -> None:
        if request_id in self._contexts:
            raise ValueError(f"request {request_id!r} was already started (call stop() first)")
        self._contexts[request_id] = _Context(as_token_array(prompt_ids, "prompt_ids"))
        self._on_start(request_id)

    @_locked
    def extend(self, request_id: Hashable, accepted_ids) -> None:
        ids = as_token_array(accepted_ids, "accepted_ids")
        self._context(request_id).append(ids)
        self._on_extend(request_id, ids)

    @_locked
    def propose(self, request_id: Hashable, budget: Budget) -> Draft:
        """A draft under the context's last token (``_propose``); empty for a zero budget, and before the
        first token (an empty prompt, nothing committed yet: there is no root to draft under)."""
        context = self._context(request_id)  # an unknown request raises, whatever the budget
        if budget.num_nodes == 0 or budget.max_depth == 0 or context.size == 0:
            return Draft.empty()
        return self._propose(request_id, budget)

    @_locked
    def propose_batch(self, request_ids: Sequence[Hashable], budgets: Sequence[Budget]) -> list[Draft]:
        """``[propose(request_id, budget) for ...]``, one step's requests in one call (``budgets[i]`` is
        ``request_ids[i]``'s), so a drafter can do the step's work for all of them at once (``_propose_batch``;
        the mixture calibrates every request's lookup trees in one pass). Every request is checked before any
        drafts."""
        if len(request_ids) != len(budgets):
            raise ValueError(f"propose_batch got {len(request_ids)} request ids and {len(budgets)} budgets")
        drafts: list[Draft | None] = [None] * len(request_ids)
        to_draft = []
        for i, (request_id, budget) in enumerate(zip(request_ids, budgets)):
            context = self._context(request_id)  # an unknown request raises, whatever the budget
            if budget.num_nodes == 0 or budget.max_depth == 0 or context.size == 0:
                drafts[i] = Draft.empty()
            else:
                to_draft.append(i)
        if to_draft:
            found = self._propose_batch([request_ids[i] for i in to_draft], [budgets[i] for i in to_draft])
            for i, draft in zip(to_draft, found):
                drafts[i] = draft
        return drafts

    @_locked
    def fit_batch(self, request_ids: list, drafts: list[Draft], batch_size: int,
                  packed: bool = False) -> list[Draft]:
        """The drafts of one batch forward (``drafts[i]`` proposed for ``request_ids[i]``), as the host will verify
        them: each the proposed draft or a sub-tree of it holding its root's paths. A padded forward is as wide
        as its widest row; a packed one (``packed``: rows end to end, proposed under ``Budget.packed``) costs
        what its tokens in all cost. So a drafter that sizes drafts by cost may cut them jointly (``mixture``).
        Default: as proposed."""
        return drafts

    @_locked
    def stop(self, request_id: Hashable) -> None:
        """Forget the request (its context is freed even if ``_on_stop`` raises)."""
        self._context(request_id)
        try:
            self._on_stop(request_id)
        finally:
            del self._contexts[request_id]

    # ---- optional hooks, each with its default
    @_locked
    def add_documents(self, request_id: Hashable, docs: Iterable, tokenizer=None) -> None:
        """Documents (token-id sequences, or texts with ``tokenizer``) this request may draft from.

        Default: ``ValueError``, since this drafter does not draft from documents
        (``accepts_documents`` is False). Drafters that do override it.
        """
        raise ValueError(f"drafter {self.name!r} does not draft from documents; use one that does "
                         f"(mixture, corpus) to pass documents=")

    @_locked
    def add_prediction(self, request_id: Hashable, prediction_ids: np.ndarray) -> None:
        """A predicted output of this request (1-D token ids): most of it is expected to appear in the output.

        Default: ``ValueError``, since this drafter does not draft from a prediction
        (``accepts_prediction`` is False). Drafters that do override it.
        """
        raise ValueError(f"drafter {self.name!r} does not draft from a predicted output; use one that does "
                         f"(mixture, prediction) to pass prediction=")

    @_locked
    def observe(self, request_id: Hashable, verify_output: VerifyOutput) -> None:
        """Learn from the target's predictions (called when ``observe_top_k`` > 0). Default: nothing."""

    @_locked
    def on_forward(self, report: ForwardReport) -> None:
        """The engine reports every target forward's size and time (``ForwardReport``).

        Drafters that size their trees from a live cost model (``mixture``)
        calibrate c(k) from these; the default ignores them.
        """

    @_locked
    def attach_model(self, handle) -> None:
        """Receive the engine's model handle (only called when ``needs_model`` is True).

        Default: ``TypeError``: a drafter that declares ``needs_model`` must override it.
        """
        raise TypeError(f"drafter {self.name!r} declares needs_model but does not implement attach_model()")

    @_locked
    def on_verified_cache(self, request_id: Hashable, cache, cache_len: int) -> None:
        """The request's verified KV cache, handed over before each ``propose`` (drafters with ``needs_model``).

        A cache of one row (in a batch, ``batch.RowCacheView``: the row's slots after its
        left pads): its first ``cache_len`` entries hold ``context(request_id)[:cache_len]``
        at positions ``0..cache_len-1``; the rest of the context is pending (fed by the next
        forward). It is the engine's, valid until that forward: a drafter reads it through
        its model handle (``DraftCache``) and never writes it. Default: ignored.
        """

    @_locked
    def warmup(self) -> None:
        """Compile kernels ahead of the first request (no-op when there are none)."""

    # ---- helpers for subclasses
    def context(self, request_id: Hashable) -> np.ndarray:
        """The request's tokens so far (prompt + accepted), int32, read-only view."""
        return self._context(request_id).view()

    def num_generated(self, request_id: Hashable) -> int:
        """Tokens the request has added to its prompt so far (``extend``)."""
        context = self._context(request_id)
        return context.size - context.start

    def _progress(self, request_ids: list, packed: bool) -> list[int] | None:
        """What a drafter that composes a ``DraftSizer`` passes its ``fit_batch`` as ``progress``: each row's
        ``num_generated`` for a padded forward (where the batch lasts as long as its slowest rows), None for a
        packed one (which does not read it)."""
        return None if packed else [self.num_generated(request_id) for request_id in request_ids]

    def _context(self, request_id: Hashable) -> _Context:
        try:
            return self._contexts[request_id]
        except KeyError:
            raise ValueError(f"request {request_id!r} is not active: call start() first") from None

    def _on_start(self, request_id) -> None:
        pass

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        pass

    def _on_stop(self, request_id) -> None:
        pass

    def _propose(self, request_id, budget: Budget) -> Draft:
        raise NotImplementedError

    def _propose_batch(self, request_ids: list, budgets: list[Budget]) -> list[Draft]:
        """``_propose`` for each request (checked by ``propose_batch``); a drafter that does a step's work at once
        overrides this."""
        return [self._propose(request_id, budget) for request_id, budget in zip(request_ids, budgets)]
