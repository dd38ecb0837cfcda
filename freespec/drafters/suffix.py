"""Suffix drafter: continuations of the longest earlier match, from a suffix automaton.

Each request has its own automaton over its prompt + output, extended by the
accepted tokens (amortized O(1) per token). Its longest suffix seen before is
known after every append; the occurrences of that suffix and what followed
them become a frequency-weighted tree (``kernels.suffix_continuations``).
Opt in to a ``SharedCorpus`` and finished requests' outputs (and prompts, if
asked) are indexed too; a live request keeps its match against the corpus and
advances it by the new tokens only. Both drafts are merged, the longer match
first (it wins ties when the budget prunes).

Worked example, ``min_match=2``: context ``[7, 1, 2, 3, 9, 1, 2, 4, 1, 2]``;
the longest earlier match is ``[1, 2]`` (ends 2 and 6), so the draft is
``3 -> 9`` beside ``4 -> 1``, each branch scored 0.5.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..draft import Budget, Draft, merge
from ..kernels.suffix_automaton import SuffixAutomaton
from ..kernels.suffix_continuations import continuation_tree
from ..kernels.suffix_match import advance_match, occurrence_ends
from .base import Drafter, as_token_array, exercise

_RESYNC_TOKENS = 1024  # after the corpus changes, a live request re-matches this many tail tokens
_LOW_WATER = 0.75  # an eviction frees the corpus down to this fraction, so rebuilds are amortized


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class SharedCorpus:
    """Finished requests' tokens, indexed by one suffix automaton, at most ``max_tokens``.

    FIFO eviction by token count (separators count as one token per document):
    when a new document does not fit, the oldest documents are dropped until
    the corpus holds at most 3/4 of ``max_tokens``, and the automaton is rebuilt
    from what is left; so rebuilds re-index at most ~3 tokens per added token, amortized.
    Memory: ~92 bytes per indexed token used, 110-160 allocated (``nbytes``;
    measured on Python source split into words and symbols, 8k to 1M tokens).
    ``include_prompts``: index requests' prompts as well as their outputs.
    """

    def __init__(self, max_tokens: int, include_prompts: bool = False):
        if not _is_int(max_tokens) or max_tokens < 2:
            raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
        self.max_tokens = int(max_tokens)
        self.include_prompts = bool(include_prompts)
        self.automaton = SuffixAutomaton()
        self.version = 0  # bumped on every change: live matches must re-sync
        self._doc_lengths: deque[int] = deque()  # oldest first; the text itself is the automaton's
        self._num_tokens = 0

    def add(self, ids) -> None:
        """Index one finished document (evicting the oldest ones if needed)."""
        doc = as_token_array(ids, "ids")[-(self.max_tokens - 1):]
        if doc.size == 0:
            return
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


class _Request:
    __slots__ = ("own", "prompt_len", "corpus_state", "corpus_match_len", "corpus_version")

    def __init__(self, own: SuffixAutomaton, prompt_len: int):
        self.own = own
        self.prompt_len = prompt_len
        self.corpus_state, self.corpus_match_len, self.corpus_version = 0, 0, -1


class SuffixDrafter(Drafter):
    """Suffix-automaton lookup over the request's own text, and optionally a shared corpus.

    min_match: propose nothing from a source whose longest match is shorter.
    max_depth: no path longer than this (the budget may cut it shorter).
    min_prob: drop nodes whose estimated probability (count / occurrences) is lower.
    max_occurrences: read the continuations of at most this many occurrences per source.
    shared_corpus_tokens: > 0 builds a private ``SharedCorpus`` of that many tokens (0 = off).
    corpus_prompts: with ``shared_corpus_tokens``, index prompts as well as outputs.
    corpus: a ``SharedCorpus`` to share with other drafters (instead of ``shared_corpus_tokens``).

    Cost (measured, 8k-token context of Python source, budget 24 nodes / depth 12):
    propose + extend ~0.03-0.09 ms per step on the own index, ~0.1-0.3 ms with a
    1M-token corpus; a corpus change costs a re-match of the last 1024 tokens.
    """

    name = "suffix"

    def __init__(self, min_match: int = 2, max_depth: int = 64, min_prob: float = 0.1,
                 max_occurrences: int = 64, shared_corpus_tokens: int = 0, corpus_prompts: bool = False,
                 corpus: SharedCorpus | None = None):
        super().__init__()
        int_options = {"min_match": min_match, "max_depth": max_depth, "max_occurrences": max_occurrences}
        for option, value in int_options.items():
            if not _is_int(value) or value < 1:
                raise ValueError(f"{option} must be an int >= 1, got {value!r}")
        if not _is_int(shared_corpus_tokens) or shared_corpus_tokens < 0 or shared_corpus_tokens == 1:
            raise ValueError(f"shared_corpus_tokens must be 0 (off) or an int >= 2, got {shared_corpus_tokens!r}")
        if not isinstance(min_prob, (int, float)) or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be a number in [0, 1], got {min_prob!r}")
        if corpus is not None and not isinstance(corpus, SharedCorpus):
            raise ValueError(f"corpus must be a SharedCorpus, got {type(corpus).__name__}")
        if corpus is not None and shared_corpus_tokens:
            raise ValueError("pass either corpus= (shared) or shared_corpus_tokens= (private), not both")
        self.min_match, self.max_depth, self.min_prob = int(min_match), int(max_depth), float(min_prob)
        self.max_occurrences = int(max_occurrences)
        if shared_corpus_tokens:
            corpus = SharedCorpus(shared_corpus_tokens, include_prompts=corpus_prompts)
        self.corpus = corpus
        self._requests: dict = {}

    # ---------------------------------------------------------------- lifecycle
    def _on_start(self, request_id) -> None:
        prompt_ids = self.context(request_id)
        own = SuffixAutomaton(2 * prompt_ids.size)
        own.extend(prompt_ids)
        self._requests[request_id] = _Request(own, prompt_ids.size)

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        request = self._requests[request_id]
        request.own.extend(ids)
        if self.corpus is not None and request.corpus_version == self.corpus.version:
            request.corpus_state, request.corpus_match_len = advance_match(
                self.corpus.automaton, request.corpus_state, request.corpus_match_len, ids)

    def _on_stop(self, request_id) -> None:
        request = self._requests.pop(request_id)
        if self.corpus is not None:
            start = 0 if self.corpus.include_prompts else request.prompt_len
            self.corpus.add(request.own.tokens()[start:])

    # ---------------------------------------------------------------- drafting
    def _propose(self, request_id, budget: Budget) -> Draft:
        request = self._requests[request_id]
        state, match_len = request.own.repeated_suffix()
        sources = [(match_len, self._draft(request.own, state, match_len, budget))]
        if self.corpus is not None:
            if request.corpus_version != self.corpus.version:  # re-match the tail once per corpus change
                request.corpus_state, request.corpus_match_len = advance_match(
                    self.corpus.automaton, 0, 0, self.context(request_id)[-_RESYNC_TOKENS:])
                request.corpus_version = self.corpus.version
            sources.append((request.corpus_match_len, self._draft(
                self.corpus.automaton, request.corpus_state, request.corpus_match_len, budget)))
        drafts = [draft for _, draft in sorted(sources, key=lambda s: -s[0]) if draft.num_nodes]
        if len(drafts) <= 1:
            return drafts[0] if drafts else Draft.empty()
        return merge(drafts, num_nodes=budget.num_nodes)

    def _draft(self, automaton: SuffixAutomaton, state: int, match_len: int, budget: Budget) -> Draft:
        if match_len < self.min_match:
            return Draft.empty()
        ends = occurrence_ends(automaton, state, self.max_occurrences)
        token_ids, parents, scores = continuation_tree(
            automaton.tokens(), ends, min(self.max_depth, budget.max_depth), budget.num_nodes, self.min_prob)
        return Draft(token_ids, parents, scores, (self.name,) * token_ids.size)

    def warmup(self) -> None:
        """Compile the kernels (cached on disk after the first process) on a tiny request."""
        exercise(SuffixDrafter(min_match=1, shared_corpus_tokens=64))
