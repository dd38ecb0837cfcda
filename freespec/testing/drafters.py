"""Drafters for tests and calibration: one always right, one always wrong.

Both know the true continuation (``reference``: prompt + the output plain
decoding gives), so an exactness test can force every step to accept a whole
draft (``OracleDrafter``) or to reject every node (``WrongDrafter``).
"""

from __future__ import annotations

import numpy as np

from ..draft import Budget, Draft
from ..drafters.base import Drafter, as_token_array


class _ReferenceDrafter(Drafter):
    def __init__(self, reference_ids, vocab_size: int | None = None):
        super().__init__()
        self.reference = as_token_array(reference_ids, "reference_ids")
        self.vocab_size = int(vocab_size) if vocab_size is not None else int(self.reference.max(initial=0)) + 2

    def _truth(self, request_id, depth: int) -> np.ndarray | None:
        """The next ``depth`` reference tokens, or None if the context left the reference."""
        context = self.context(request_id)
        n = context.shape[0]
        if n > self.reference.shape[0] or not np.array_equal(self.reference[:n], context):
            return None
        return self.reference[n : n + depth]


class OracleDrafter(_ReferenceDrafter):
    """Drafts the true continuation, plus ``num_wrong_siblings`` wrong siblings per node.

    ``OracleDrafter(ref)`` proposes a chain that is accepted whole; with siblings
    the tree exercises branch selection while the right path still wins.
    """

    name = "oracle"

    def __init__(self, reference_ids, vocab_size: int | None = None, num_wrong_siblings: int = 0):
        super().__init__(reference_ids, vocab_size)
        self.num_wrong_siblings = num_wrong_siblings

    def _propose(self, request_id, budget: Budget) -> Draft:
        truth = self._truth(request_id, budget.max_depth)
        if truth is None or truth.size == 0:
            return Draft.empty()
        token_ids, parents = [], []
        parent = -1
        for token in truth.tolist():
            if len(token_ids) >= budget.num_nodes:
                break
            wrong = [(token + 1 + j) % self.vocab_size for j in range(self.num_wrong_siblings)]
            for w in wrong[: max(0, budget.num_nodes - len(token_ids) - 1)]:
                token_ids.append(w)
                parents.append(parent)
            token_ids.append(token)
            parents.append(parent)
            parent = len(token_ids) - 1
        return Draft(np.asarray(token_ids), np.asarray(parents), sources=(self.name,) * len(token_ids))


class WrongDrafter(_ReferenceDrafter):
    """Drafts a full tree in which no node is the true next token.

    Off the reference (possible only if decoding diverged) it drafts arbitrary tokens.
    """

    name = "wrong"

    def __init__(self, reference_ids, vocab_size: int | None = None, branching: int = 2):
        super().__init__(reference_ids, vocab_size)
        self.branching = branching

    def _propose(self, request_id, budget: Budget) -> Draft:
        truth = self._truth(request_id, 1)
        avoid = int(truth[0]) if truth is not None and truth.size else -1
        first = [(avoid + 1 + j) % self.vocab_size for j in range(self.branching)]
        token_ids = first[: budget.num_nodes]
        parents, depths = [-1] * len(token_ids), [1] * len(token_ids)
        # deeper nodes: any tokens; they are never reached since their roots are wrong
        node = 0
        while len(token_ids) < budget.num_nodes and node < len(token_ids):
            if depths[node] < budget.max_depth:
                token_ids.append((token_ids[node] * 7 + 3) % self.vocab_size)
                parents.append(node)
                depths.append(depths[node] + 1)
            node += 1
        return Draft(np.asarray(token_ids), np.asarray(parents), sources=(self.name,) * len(token_ids))
