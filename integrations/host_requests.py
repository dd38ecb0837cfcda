"""Following a serving host's requests: one drafter's per-request state, kept in step with the host.

A serving engine (SGLang, vLLM) decodes many requests at once in a batch whose
rows move as requests join and leave. Each step it tells its draft source which
requests are in the batch, how long each sequence now is (prompt + committed
output) and its last tokens. ``HostRequests`` turns that into the drafter's
lifecycle, the same for every host:

- **start**: a request seen for the first time starts with its whole context
  (``context()``, read only then), then ``on_start`` (per-request hints);
- **extend**: at a later step, with ``k`` the length the drafter holds and ``n``
  the host's length, the tail's last ``n - k`` tokens are the ones the host
  committed, and go to ``drafter.extend`` once the rest of the tail lines up
  with the tokens held;
- **restart**: when it does not line up (more new tokens than the tail holds, a
  shorter sequence, other tokens under the same id: a preempted request
  recomputed, an id reused), the request is stopped and started again from the
  host's context. Drafts are only proposals: a restart costs speed, never output;
- **release**: requests absent from a step's batch (finished, aborted,
  preempted) and those the host names are stopped, so nothing is held for a
  request the host no longer runs.

Worked example (tails of 4 tokens)::

    sync("r", tail=[9, 1, 2, 3], total_len=8, context=lambda: [5, 6, 7, 8, 9, 1, 2, 3])
        -> start("r", [5, 6, 7, 8, 9, 1, 2, 3])
    sync("r", tail=[2, 3, 4, 5], total_len=10)   -> extend("r", [4, 5])   # [2, 3] lines up
    sync("r", tail=[7, 7, 7, 7], total_len=12)   -> stop("r"); start("r", [7, 7, 7, 7])  # does not

Requests are started and stopped in the order the host lists them, never in set
or hash order, so every tensor-parallel rank that drafts for itself holds the
same state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence


@dataclass
class _Held:
    num_tokens: int  # the host's sequence length the drafter is synced to
    recent_ids: list  # the host's last tokens, ending at num_tokens


class HostRequests:
    """The drafter's requests, kept in step with what a host reports each step.

    ``draftable(ids)`` maps host ids to what the drafter reads (SGLang's image
    padding, say); ``on_start(req_id)`` runs after every start and restart.
    """

    def __init__(self, drafter, draftable: Callable | None = None,
                 on_start: Callable[[Hashable], None] | None = None) -> None:
        self.drafter = drafter
        self._draftable = draftable or (lambda ids: ids)
        self._on_start = on_start
        self._held: dict[Hashable, _Held] = {}  # insertion order = the host's order (deterministic)
        self.num_starts = 0  # requests started, restarts included
        self.num_restarts = 0  # requests restarted because the host's tokens did not line up

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._held

    def ids(self) -> list:
        """Held requests, in the order they were started."""
        return list(self._held)

    def sync(self, req_id: Hashable, tail: list, total_len: int,
             context: Callable[[], Sequence[int]] | None = None) -> bool:
        """Bring ``req_id`` to the host's ``total_len`` tokens, whose last ones are ``tail`` (a list).

        ``context()`` returns the whole sequence (prompt + output, ``total_len``
        tokens); it is called only to start or restart, and without it the
        request starts from ``tail``. Returns True when the request (re)started.
        """
        held = self._held.get(req_id)
        if held is not None:
            num_new = total_len - held.num_tokens
            keep = len(tail) - num_new  # tail[:keep] ends where the drafter's tokens end
            overlap = min(keep, len(held.recent_ids))
            if 0 <= num_new <= len(tail) and \
                    held.recent_ids[len(held.recent_ids) - overlap:] == tail[keep - overlap:keep]:
                if num_new:
                    self.drafter.extend(req_id, self._draftable(tail[keep:]))
                    held.num_tokens, held.recent_ids = total_len, tail
                return False
            self.release([req_id])
            self.num_restarts += 1
        ids = tail if context is None else context()
        self.drafter.start(req_id, self._draftable(ids))
        self._held[req_id] = _Held(total_len, tail)
        self.num_starts += 1
        if self._on_start is not None:
            self._on_start(req_id)
        return True

    def release(self, req_ids: Iterable[Hashable]) -> None:
        """Stop these requests (unknown ids are ignored); their state is gone even if ``drafter.stop`` raises."""
        for req_id in req_ids:
            if self._held.pop(req_id, None) is not None:
                self.drafter.stop(req_id)

    def release_absent(self, present: Iterable[Hashable]) -> list:
        """Stop every held request not in ``present`` (it left the host's batch); returns their ids."""
        if not self._held:
            return []
        present = present if isinstance(present, (set, frozenset, dict)) else set(present)
        gone = [req_id for req_id in self._held if req_id not in present]  # host order, not set order
        self.release(gone)
        return gone

    def release_all(self) -> None:
        self.release(list(self._held))

    def discard(self, req_id: Hashable) -> None:
        """Forget ``req_id`` after a failure, whatever state the drafter is in (errors of its ``stop`` dropped)."""
        if self._held.pop(req_id, None) is not None:
            try:
                self.drafter.stop(req_id)
            except Exception:  # the drafter is already inconsistent for this request; it restarts next time
                pass
