"""Prompt lookup: draft what followed earlier occurrences of the context's tail.

Over the request's own prompt + output, find the occurrences of the longest
suffix of the context that occurred before (up to ``max_match`` tokens), and
merge what followed each into a tree; continuations seen more often get the
heavier branches.

Worked example, context ``[7, 1, 2, 3, 9, 1, 2, 4, 1, 2]``: the tail ``[1, 2]``
occurred at 1..2 (followed by ``3, 9``) and at 5..6 (followed by ``4, 1``);
``[8, 1, 2]`` occurs nowhere earlier, so the longest match is 2 and the draft
is ``3 -> 9`` beside ``4 -> 1``.
"""

from __future__ import annotations

import numpy as np

from ..draft import Budget, Draft
from .base import Drafter
from .options import check_int, check_match_range


def longest_match_ends(context: np.ndarray, max_match: int) -> tuple[int, np.ndarray]:
    """(match_len, ends): the longest earlier match of the tail and where it ends.

    ``ends`` are indices ``e < len(context) - 1`` with
    ``context[e - match_len + 1 : e + 1] == context[-match_len:]``, most recent first.
    ``longest_match_ends([7,1,2,3,9,1,2,4,1,2], 8) -> (2, [6, 2])``.
    """
    n = context.shape[0]
    if n < 2:
        return 0, np.zeros(0, np.int64)
    ends = np.nonzero(context[: n - 1] == context[n - 1])[0]
    match_len = 1 if ends.size else 0
    while ends.size and match_len < max_match:
        starts = ends - match_len  # next token to compare on the left
        ok = starts >= 0
        ok[ok] &= context[starts[ok]] == context[n - 1 - match_len]
        if not ok.any():
            break
        ends = ends[ok]
        match_len += 1
    return match_len, ends[::-1].astype(np.int64)


class PromptLookupDrafter(Drafter):
    """Longest-match lookup over the request's own prompt and output.

    min_match: propose nothing when the longest match is shorter.
    max_match: stop extending a match beyond this many tokens.
    max_occurrences: merge the continuations of at most this many (most recent) occurrences.
    """

    name = "prompt_lookup"

    def __init__(self, min_match: int = 2, max_match: int = 32, max_occurrences: int = 32):
        super().__init__()
        self.min_match, self.max_match = check_match_range(min_match, max_match)
        self.max_occurrences = check_int("max_occurrences", max_occurrences, 1)

    def _propose(self, request_id, budget: Budget) -> Draft:
        context = self.context(request_id)
        match_len, ends = longest_match_ends(context, self.max_match)
        if match_len < self.min_match:
            return Draft.empty()
        ends = ends[: self.max_occurrences]
        n = context.shape[0]
        continuations = [context[e + 1 : min(n, e + 1 + budget.max_depth)] for e in ends.tolist()]
        continuations = [c for c in continuations if c.size]
        if not continuations:
            return Draft.empty()
        return Draft.from_sequences(continuations, num_nodes=budget.num_nodes, max_depth=budget.max_depth,
                                    source=self.name)
