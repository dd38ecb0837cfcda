"""Suffix drafting: continuations of the longest earlier match, from suffix automata.

``SuffixSource`` is the component: each live request has its own automaton
over its prompt + output, extended by the accepted tokens (amortized O(1) per
token), whose longest suffix seen before is known after every append; the
occurrences of that suffix and what followed them become a frequency-weighted
tree (``kernels.suffix_continuations``). Opt in to a ``RequestHistory`` and
finished requests' outputs (and prompts, if asked) are indexed too; a live
request keeps its match against the history and advances it by the new
tokens only. ``SuffixDrafter`` (here) and ``MixtureDrafter`` both compose one.

Worked example, ``min_match=2``: context ``[7, 1, 2, 3, 9, 1, 2, 4, 1, 2]``;
the longest earlier match is ``[1, 2]`` (ends 2 and 6), so the draft is
``3 -> 9`` beside ``4 -> 1``, each branch with confidence 0.5.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable

import numpy as np

from ..draft import Budget, Draft, merge
from ..kernels.suffix_automaton import SuffixAutomaton
from ..kernels.suffix_continuations import state_continuations
from ..kernels.suffix_match import advance_match
from .base import Drafter, Lockable, as_token_array, exercise
from .options import check_bool, check_instance, check_int, check_number

_RESYNC_TOKENS = 1024  # after the history changes, a live request re-matches this many tail tokens
_LOW_WATER = 0.75  # an eviction frees the history down to this fraction, so rebuilds are amortized


class RequestHistory(Lockable):
    """Finished requests' tokens, indexed by one suffix automaton, at most ``max_tokens``.

    FIFO eviction by token count (separators count as one token per document):
    when a new document does not fit, the oldest documents are dropped until
    the history holds at most 3/4 of ``max_tokens``, and the automaton is rebuilt
    from what is left; so rebuilds re-index at most ~3 tokens per added token, amortized.
    A document longer than ``max_tokens - 1`` keeps its last ``max_tokens - 1`` tokens.
    Memory bound: ``max_tokens`` indexed tokens, ~92 bytes each used, 110-160
    allocated (``nbytes``; measured on Python source split into words and symbols,
    8k to 1M tokens), whatever the number of requests.
    ``include_prompts``: index requests' prompts as well as their outputs.

    Several drafters (and threads) may share one: ``add`` and every reader
    (``SuffixSource``) hold ``lock``.
    """

    def __init__(self, max_tokens: int, include_prompts: bool = False):
        self.max_tokens = check_int("max_tokens", max_tokens, 2)
        self.include_prompts = check_bool("include_prompts", include_prompts)
        super().__init__()
        self.automaton = SuffixAutomaton()
        self.version = 0  # bumped on every change: live matches must re-sync
        self._doc_lengths: deque[int] = deque()  # oldest first; the text itself is the automaton's
        self._num_tokens = 0

    def add(self, ids) -> None:
        """Index one finished document (evicting the oldest ones if needed)."""
        doc = as_token_array(ids, "ids")[-(self.max_tokens - 1):]
        if doc.size == 0:
            return
        with self.lock:
            self._add(doc)

    def _add(self, doc: np.ndarray) -> None:
        need = doc.size + 1
        if self._num_tokens + need > self.max_tokens:
            text, start = self.automaton.tokens(), 0
            while self._doc_lengths and self._num_tokens + need > _LOW_WATER * self.max_tokens:
                evicted = self._doc_lengths.popleft() + 1
                self._num_tokens -= evicted
                start += evicted
            self.automaton = SuffixAutomaton(self._num_tokens + need)
            for length in self._doc_lengths:  # rebuild from the kept documents' text
                self.automaton.extend(text[start : start + length])
                self.automaton.add_separator()
                start += length + 1
        self._doc_lengths.append(doc.size)
        self._num_tokens += need
        self.automaton.extend(doc)
        self.automaton.add_separator()
        self.version += 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_documents(self) -> int:
        return len(self._doc_lengths)

    @property
    def nbytes(self) -> int:
        return self.automaton.nbytes


class _Match:
    """A live request's match against the history: ``(state, match_len)`` at ``version``."""

    __slots__ = ("state", "match_len", "version")

    def __init__(self):
        self.state, self.match_len, self.version = 0, 0, -1


class _Request:
    __slots__ = ("own", "prompt_len", "history_match")

    def __init__(self, own: SuffixAutomaton, prompt_len: int):
        self.own, self.prompt_len, self.history_match = own, prompt_len, _Match()


class SuffixSource:
    """Per-request suffix automata (and an optional shared ``RequestHistory``) that drafters compose.

    min_match: propose nothing from a source whose longest match is shorter.
    max_depth: no path longer than this (the budget may cut it shorter).
    min_prob: drop nodes whose estimated probability (count / occurrences) is lower.
    max_occurrences: read the continuations of at most this many occurrences per source.
    history: a ``RequestHistory`` of finished requests (None: nothing crosses requests).

    Cost (measured, 8k-token context of Python source, budget 24 nodes / depth 12):
    drafts + extend ~0.03-0.09 ms per step on the own index, ~0.1-0.3 ms with a
    1M-token history; a history change costs a re-match of the last 1024 tokens.
    """

    def __init__(self, min_match: int = 2, max_depth: int = 64, min_prob: float = 0.1, max_occurrences: int = 64,
                 history: RequestHistory | None = None):
        self.min_match = check_int("min_match", min_match, 1)
        self.max_depth = check_int("max_depth", max_depth, 1)
        self.min_prob = check_number("min_prob", min_prob, 0.0, 1.0)
        self.max_occurrences = check_int("max_occurrences", max_occurrences, 1)
        self.history = check_instance("history", history, RequestHistory)
        self._requests: dict[Hashable, _Request] = {}

    def start(self, request_id: Hashable, prompt_ids: np.ndarray) -> None:
        own = SuffixAutomaton(2 * prompt_ids.size)
        own.extend(prompt_ids)
        self._requests[request_id] = _Request(own, prompt_ids.size)

    def extend(self, request_id: Hashable, ids: np.ndarray) -> None:
        request = self._requests[request_id]
        request.own.extend(ids)
        if self.history is not None:
            match = request.history_match
            with self.history.lock:
                if match.version == self.history.version:
                    match.state, match.match_len = advance_match(self.history.automaton, match.state,
                                                                 match.match_len, ids)

    def stop(self, request_id: Hashable) -> None:
        """Forget the request; with a history, index its text there."""
        request = self._requests.pop(request_id)
        if self.history is not None:
            start = 0 if self.history.include_prompts else request.prompt_len
            self.history.add(request.own.tokens()[start:])

    def drafts(self, request_id: Hashable, budget: Budget) -> list[tuple[str, int, Draft]]:
        """``(source, match_len, draft)`` per source matching ``min_match`` tokens or more.

        Sources: ``"suffix"`` (the request's own text), ``"history"`` (earlier
        requests). Each draft's confidence is the frequency of its path among
        the match's occurrences; nodes are labelled with their source.
        """
        request = self._requests[request_id]
        depth = min(self.max_depth, budget.max_depth)
        state, match_len = request.own.repeated_suffix()
        drafts = [self._tree("suffix", match_len, request.own, state, depth, budget.num_nodes)]
        if self.history is not None:
            match = request.history_match
            with self.history.lock:
                if match.version != self.history.version:  # re-match the tail once per history change
                    match.state, match.match_len = advance_match(
                        self.history.automaton, 0, 0, request.own.tokens()[-_RESYNC_TOKENS:])
                    match.version = self.history.version
                drafts.append(self._tree("history", match.match_len, self.history.automaton, match.state, depth,
                                         budget.num_nodes))
        return [draft for draft in drafts if draft is not None]

    def _tree(self, source: str, match_len: int, automaton: SuffixAutomaton, state: int, depth: int,
              num_nodes: int) -> tuple[str, int, Draft] | None:
        """``(source, match_len, draft)`` of what followed the match's occurrences, or None."""
        if match_len < self.min_match:
            return None
        token_ids, parents, confidence = state_continuations(automaton, state, self.max_occurrences, depth, num_nodes,
                                                            self.min_prob)
        if not token_ids.size:
            return None
        return source, match_len, Draft._of(token_ids, parents, confidence, (source,) * token_ids.size)  # kernel's


class SuffixDrafter(Drafter):
    """Suffix-automaton lookup over the request's own text, and optionally earlier requests.

    min_match, max_depth, min_prob, max_occurrences: as ``SuffixSource``'s.
    history_tokens: > 0 builds a private ``RequestHistory`` of that many tokens (0 = off).
    history_prompts: with ``history_tokens``, index prompts as well as outputs.
    history: a ``RequestHistory`` to share with other drafters (instead of ``history_tokens``).

    Both sources' trees are merged, the longer match first (it wins ties when
    the budget prunes).
    """

    name = "suffix"
    isolation_options = {"history_tokens": 0, "history": None}  # no text crosses requests

    def __init__(self, min_match: int = 2, max_depth: int = 64, min_prob: float = 0.1,
                 max_occurrences: int = 64, history_tokens: int = 0, history_prompts: bool = False,
                 history: RequestHistory | None = None):
        super().__init__()
        history = resolve_history(history_tokens, history_prompts, history)
        self.suffix = SuffixSource(min_match, max_depth, min_prob, max_occurrences, history)

    @property
    def history(self) -> RequestHistory | None:
        return self.suffix.history

    def _on_start(self, request_id) -> None:
        self.suffix.start(request_id, self.context(request_id))

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        self.suffix.extend(request_id, ids)

    def _on_stop(self, request_id) -> None:
        self.suffix.stop(request_id)

    def _propose(self, request_id, budget: Budget) -> Draft:
        drafts = [draft for _, _, draft in sorted(self.suffix.drafts(request_id, budget), key=lambda s: -s[1])]
        if len(drafts) <= 1:
            return drafts[0] if drafts else Draft.empty()
        return merge(drafts, num_nodes=budget.num_nodes)

    def warmup(self) -> None:
        """Compile the kernels (cached on disk after the first process) on a tiny request."""
        exercise(SuffixDrafter(min_match=1, history_tokens=64))


def resolve_history(history_tokens, history_prompts, history) -> RequestHistory | None:
    """The history a drafter's options ask for: a new private one, the shared one given, or none."""
    history_tokens = check_int("history_tokens", history_tokens, 0)
    if history_tokens == 1:
        raise ValueError("history_tokens must be 0 (off) or an int >= 2, got 1")
    check_bool("history_prompts", history_prompts)
    check_instance("history", history, RequestHistory)
    if history is not None and history_tokens:
        raise ValueError("pass either history= (shared) or history_tokens= (private), not both")
    if history_tokens:
        return RequestHistory(history_tokens, include_prompts=history_prompts)
    return history
