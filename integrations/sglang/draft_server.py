"""DraftServer: SGLang's NGRAM draft source, served by a freespec drafter.

SGLang's ``NGRAMWorker`` asks its corpus, each decode step, for exactly
``D = --speculative-num-draft-tokens`` nodes per request (``batch_get``), and
verifies them as a tree. This class answers with a freespec drafter instead of
SGLang's n-gram trie; the verification stays SGLang's (lossless).

What the worker hands the corpus, read from sglang 0.5.21 ``ngram_worker.py``:
``batch_get(req_ids, batch_tokens, total_lens)`` gets only the last
``max_trie_depth`` tokens of each request (prompt + output) and the request's
full length; ``batch_put`` gets the same tails again after verification, and
``erase_match_state(req_ids)`` names requests that left the decode batch.
A drafter needs the whole context (the prompt is where prompt lookup finds
its matches), so the plugin also hooks the worker's ``_prepare_draft_tokens``
to ``offer_contexts``: references to each request's full prompt + output,
read only when a request starts or restarts.

Per-request state, keyed by ``req_id``: the host's length the drafter is synced
to and the last tokens of it. At each ``batch_get``, with ``k`` the synced
length and ``n`` the new total length, the tail's last ``n - k`` tokens are the
newly committed ones (``drafter.extend``), once the rest of the tail lines up
with what the drafter holds. Worked example, ``max_trie_depth=4``::

    first sight: offered [5, 6, 7, 8, 9, 1, 2], tail [9, 1, 2, 3], total 8
                 -> start(rid, [5, 6, 7, 8, 9, 1, 2, 3])     # offered + last 1
    next step:   tail [2, 3, 4, 5], total 10
                 -> extend(rid, [4, 5])                       # [2, 3] lines up

When it does not line up (more new tokens than the tail holds, a shorter
sequence, another text under the same id), the request restarts from what is
known (the offered context, else the tail). Drafts are only proposals, so a
restart costs speed, never correctness.

The tree SGLang expects per request (``to_sglang_tree``): node 0 is the last
committed token, nodes in BFS order (parents before children),
``mask[i][j] = 1`` iff ``j`` is ``i`` or an ancestor of ``i``, and unused slots
token 0 under node 0; flat int64 arrays ``[bs * D]`` and ``[bs * D * D]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import numpy as np

from freespec import drafters
from freespec.draft import Budget, Draft
from freespec.tree import ancestor_matrix, bfs_order

from . import options as plugin_options

logger = logging.getLogger(__name__)


def to_sglang_tree(
    draft: Draft,
    root_token_id: int,
    num_draft_tokens: int,
    out_token_ids: np.ndarray | None = None,  # [D] int64, written in place
    out_mask: np.ndarray | None = None,  # [D, D] int64, written in place
) -> tuple[np.ndarray, np.ndarray]:
    """A draft as SGLang's ``D``-node tree: (token_ids [D], mask [D, D]), int64.

    Not-candidate nodes (a lookahead window) are dropped; a draft of more than
    ``D - 1`` nodes is pruned by confidence (``Draft.prune``).
    ``to_sglang_tree(Draft([5, 6, 8, 7], [-1, 0, 0, 1]), 4, 6)`` (root 4) gives
    token_ids ``[4, 5, 6, 8, 7, 0]`` and mask rows ``{0}, {0,1}, {0,1,2},
    {0,1,3}, {0,1,2,4}, {0,5}``: BFS order puts ``8`` (depth 2) before ``7``
    (depth 3), and the free slot is token 0 under the root.
    """
    num_slots = num_draft_tokens - 1
    if num_slots < 0:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    draft = draft.candidates()  # SGLang verifies candidates only: not-candidate nodes cannot go there
    if draft.num_nodes > num_slots:
        draft = draft.prune(num_slots)
    draft.validate()
    token_ids = np.zeros(num_draft_tokens, np.int64) if out_token_ids is None else out_token_ids
    mask = np.zeros((num_draft_tokens, num_draft_tokens), np.int64) if out_mask is None else out_mask
    token_ids[:] = 0
    mask[:] = 0

    order = bfs_order(draft.parents)  # [n] draft node of each slot after the root
    num_used = order.shape[0] + 1
    token_ids[0] = root_token_id
    token_ids[1:num_used] = draft.token_ids[order]
    ancestors = ancestor_matrix(draft.parents)  # [n, n] in draft order
    mask[0, 0] = 1
    mask[1:num_used, 0] = 1
    mask[1:num_used, 1:num_used] = ancestors[np.ix_(order, order)]
    for slot in range(num_used, num_draft_tokens):  # padding: token 0 under the root
        mask[slot, 0] = 1
        mask[slot, slot] = 1
    return token_ids, mask


@dataclass
class _Request:
    num_tokens: int  # host's sequence length (prompt + output) the drafter is synced to
    recent_ids: np.ndarray  # [<= max_trie_depth] int64, its last tokens


def _lines_up(known_ids: np.ndarray, tail_ids: np.ndarray) -> bool:
    """Do two sequences that end at the same position agree where both have tokens?"""
    overlap = min(known_ids.shape[0], tail_ids.shape[0])
    return overlap == 0 or np.array_equal(known_ids[known_ids.shape[0] - overlap:],
                                          tail_ids[tail_ids.shape[0] - overlap:])


def build_drafter(name: str, drafter_options: dict):
    """``drafters.make(name, **drafter_options)``; a dict under ``"documents"`` becomes a shared ``DocumentIndex``."""
    drafter_options = dict(drafter_options)
    if isinstance(drafter_options.get("documents"), dict):
        from freespec.drafters.corpus import DocumentIndex

        try:
            drafter_options["documents"] = DocumentIndex(**drafter_options["documents"])
        except TypeError as exc:
            raise ValueError(f"bad drafter_options['documents'] for {name!r}: {exc}") from None
    return drafters.make(name, **drafter_options)


class DraftServer:
    """Drop-in for ``sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus``.

    The constructor takes the same keywords as SGLang's; ``draft_token_num``
    (D) and ``max_trie_depth`` (how many tail tokens the worker sends) matter
    here, the trie's own knobs (BFS breadths, match type, capacity, external
    SAM budget) do not. ``drafter`` / ``drafter_options`` default to the
    plugin's configuration (``options.from_env``).
    """

    def __init__(
        self,
        max_trie_depth=18,
        min_bfs_breadth=1,
        max_bfs_breadth=8,
        draft_token_num=8,
        match_type="BFS",
        capacity=1000000,
        external_sam_budget=0,
        external_corpus_max_tokens=10000000,
        *,
        drafter: str | None = None,
        drafter_options: dict | None = None,
    ) -> None:
        if draft_token_num < 1:
            raise ValueError(f"draft_token_num must be >= 1, got {draft_token_num}")
        if max_trie_depth < 1:
            raise ValueError(f"max_trie_depth must be >= 1, got {max_trie_depth}")
        if drafter is None:
            resolved = plugin_options.from_env()
            drafter = resolved.drafter
            drafter_options = resolved.drafter_options if drafter_options is None else drafter_options
        self.drafter_name = drafter
        self.drafter_options = dict(drafter_options or {})
        self.drafter = build_drafter(self.drafter_name, self.drafter_options)
        self.draft_token_num = int(draft_token_num)
        self.max_trie_depth = int(max_trie_depth)
        self.external_corpus_max_tokens = int(external_corpus_max_tokens)
        self._requests: dict[Hashable, _Request] = {}
        self._offered: dict[Hashable, tuple] = {}  # req_id -> (prompt_ids, output_ids), until batch_get
        self._external: dict[str, list[np.ndarray]] = {}  # corpus_id -> chunks
        self._external_tokens: dict[str, int] = {}  # committed corpus_id -> token count
        self.num_restarts = 0  # requests restarted because their tail did not line up
        logger.info("freespec: NGRAM drafts come from drafter %r %s (D=%d)", self.drafter_name,
                    self.drafter_options, self.draft_token_num)

    # ------------------------------------------------------------ worker API
    def batch_get(
        self,
        req_ids: Sequence[Hashable],
        batch_tokens: Sequence[Sequence[int]],
        total_lens: Sequence[int],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for a batch: (token_ids [bs * D], mask [bs * D * D]), both int64."""
        if not len(req_ids) == len(batch_tokens) == len(total_lens):
            raise ValueError(f"batch_get got {len(req_ids)} req_ids, {len(batch_tokens)} token lists "
                             f"and {len(total_lens)} lengths")
        num_nodes = self.draft_token_num
        batch_size = len(req_ids)
        token_ids = np.zeros((batch_size, num_nodes), np.int64)
        mask = np.zeros((batch_size, num_nodes, num_nodes), np.int64)
        budget = Budget(num_nodes - 1, num_nodes - 1)
        for row, (req_id, tail, total_len) in enumerate(zip(req_ids, batch_tokens, total_lens)):
            tail_ids = np.asarray(tail, np.int64).reshape(-1)
            if tail_ids.shape[0] == 0:  # nothing committed: nothing to draft from
                to_sglang_tree(Draft.empty(), 0, num_nodes, token_ids[row], mask[row])
                continue
            self._sync(req_id, tail_ids, int(total_len))
            draft = self.drafter.propose(req_id, budget)
            to_sglang_tree(draft, int(tail_ids[-1]), num_nodes, token_ids[row], mask[row])
        self._offered.clear()
        return token_ids.reshape(-1), mask.reshape(-1)

    def offer_contexts(self, requests: Iterable[tuple[Hashable, Sequence[int], Sequence[int]]]) -> None:
        """(req_id, prompt_ids, output_ids) of the coming batch, for requests that (re)start in it.

        Only references are kept (O(1) per request); they are read, and
        copied, only when a request starts or restarts in the next ``batch_get``.
        """
        for req_id, prompt_ids, output_ids in requests:
            self._offered[req_id] = (prompt_ids, output_ids)

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        """Accepted and ignored: these tails repeat what ``batch_get`` saw this step.

        Shared state (n-gram tables, corpora) learns from whole requests
        through the drafter's ``stop``, which sees more than these tails.
        """

    def synchronize(self) -> None:
        """Nothing to wait for: this corpus works synchronously."""

    def erase_match_state(self, req_ids: Iterable[Hashable]) -> None:
        """Requests that left the decode batch: ``drafter.stop`` them (a later return restarts)."""
        for req_id in req_ids:
            self._offered.pop(req_id, None)
            if self._requests.pop(req_id, None) is not None:
                self.drafter.stop(req_id)

    def reset(self) -> None:
        """Forget every request and what the drafter learned; external corpora stay (as in SGLang)."""
        for req_id in list(self._requests):
            self.drafter.stop(req_id)
        self._requests.clear()
        self._offered.clear()
        self.drafter = build_drafter(self.drafter_name, self.drafter_options)
        for corpus_id in self._external_tokens:
            self._add_to_shared_corpus(corpus_id, self._external[corpus_id])

    # ------------------------------------------------------ external corpora
    @property
    def remaining_token_budget(self) -> int:
        return self.external_corpus_max_tokens - sum(self._external_tokens.values())

    def load_external_corpus_named(self, corpus_id: str, chunks: Iterable[Sequence[int]]) -> int:
        """Add documents to the drafter's shared corpus; returns the number of tokens loaded."""
        if corpus_id in self._external:
            raise ValueError(f"External corpus '{corpus_id}' already exists. Remove it before adding "
                             f"a new corpus with the same id.")
        arrays, num_tokens, budget = [], 0, self.remaining_token_budget
        for chunk in chunks:
            array = np.asarray(list(chunk), np.int64)
            num_tokens += array.shape[0]
            if num_tokens > budget:
                raise ValueError(f"External corpus '{corpus_id}' exceeds the remaining token budget ({budget})")
            arrays.append(array)
        if num_tokens == 0:
            raise ValueError(f"External corpus '{corpus_id}' is empty: no tokens were loaded")
        self._add_to_shared_corpus(corpus_id, arrays)
        self._external[corpus_id] = arrays
        return num_tokens

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int) -> None:
        self._external_tokens[corpus_id] = int(loaded_token_count)

    def remove_external_corpus(self, corpus_id: str) -> None:
        if corpus_id not in self._external:
            raise ValueError(f"External corpus '{corpus_id}' does not exist")
        shared = self._shared_corpus()
        for i in range(len(self._external.pop(corpus_id))):
            shared.remove((corpus_id, i))
        self._external_tokens.pop(corpus_id, None)

    def list_external_corpora(self) -> dict[str, int]:
        return dict(self._external_tokens)

    # --------------------------------------------------------------- helpers
    def _sync(self, req_id: Hashable, tail_ids: np.ndarray, total_len: int) -> None:
        """Bring the drafter's context of ``req_id`` to ``total_len`` tokens ending in ``tail_ids``."""
        request = self._requests.get(req_id)
        if request is not None:
            num_new = total_len - request.num_tokens
            if 0 <= num_new <= tail_ids.shape[0] and _lines_up(request.recent_ids,
                                                               tail_ids[: tail_ids.shape[0] - num_new]):
                if num_new:
                    new_ids = tail_ids[tail_ids.shape[0] - num_new:]
                    self.drafter.extend(req_id, new_ids)
                    request.num_tokens = total_len
                    request.recent_ids = np.concatenate([request.recent_ids, new_ids])[-self.max_trie_depth:]
                return
            self.drafter.stop(req_id)
            del self._requests[req_id]
            self.num_restarts += 1
        context = tail_ids
        offered = self._offered.pop(req_id, None)
        if offered is not None:
            offered = np.concatenate([np.asarray(ids, np.int64).reshape(-1) for ids in offered])
            num_new = total_len - offered.shape[0]
            if 0 <= num_new <= tail_ids.shape[0] and _lines_up(offered, tail_ids[: tail_ids.shape[0] - num_new]):
                context = np.concatenate([offered, tail_ids[tail_ids.shape[0] - num_new:]])
        self.drafter.start(req_id, context)
        self._requests[req_id] = _Request(total_len, context[-self.max_trie_depth:].copy())

    def _shared_corpus(self):
        from freespec.drafters.corpus import DocumentSource

        documents = getattr(self.drafter, "documents", None)  # the drafter's DocumentSource, if it has one
        shared = documents.shared if isinstance(documents, DocumentSource) else None
        if shared is None:
            raise ValueError(
                f"drafter {self.drafter_name!r} has no shared document index for an external corpus; use "
                f'drafter "corpus" or "mixture" with drafter_options {{"documents": {{"min_match": 2, "max_match": 8}}}}')
        return shared

    def _add_to_shared_corpus(self, corpus_id: str, arrays: list[np.ndarray]) -> None:
        shared = self._shared_corpus()
        for i, array in enumerate(arrays):
            shared.add(array, (corpus_id, i))
