"""DraftServer: SGLang's NGRAM draft source, served by a freespec drafter.

SGLang's ``NGRAMWorker`` asks its corpus, each decode step, for exactly
``D = --speculative-num-draft-tokens`` nodes per request (``batch_get``), and
verifies them as a tree. This class answers with a freespec drafter instead of
SGLang's n-gram trie; the verification stays SGLang's (lossless).

What the worker hands the corpus (sglang 0.5.11 to 0.5.23 ``ngram_worker.py``):
``batch_get(req_ids, batch_tokens, total_lens)`` gets only the last
``max_trie_depth`` tokens of each request (prompt + output) and the request's
full length; ``batch_put`` gets the same tails again after verification, and
``erase_match_state(req_ids)`` names some requests that left the decode batch
(0.5.11 names only those that finished or were retracted during a verify step).
A drafter needs the whole context (the prompt is where prompt lookup finds
its matches), so the plugin also hooks the worker's ``_prepare_draft_tokens``
to ``offer_contexts``: references to each request's full prompt + output,
read only when a request starts or restarts.

Per-request state, keyed by ``req_id``, follows SGLang's requests through
``freespec.integrations.host_requests.HostRequests`` (the lifecycle shared with
the vLLM adapter): at each ``batch_get``, with ``k`` the synced length and ``n``
the new total length, the tail's last ``n - k`` tokens are the newly committed
ones (``drafter.extend``), once the rest of the tail lines up with what the
drafter holds. Worked example, ``max_trie_depth=4``::

    first sight: offered [5, 6, 7, 8, 9, 1, 2], tail [9, 1, 2, 3], total 8
                 -> start(rid, [5, 6, 7, 8, 9, 1, 2, 3])     # offered + last 1
    next step:   tail [2, 3, 4, 5], total 10
                 -> extend(rid, [4, 5])                       # [2, 3] lines up

When it does not line up (more new tokens than the tail holds, a shorter
sequence, another text under the same id), the request restarts from what is
known (the offered context, else the tail). Drafts are only proposals, so a
restart costs speed, never correctness.

Every exit releases a request's state: ``erase_match_state``, and any request
absent from a decode batch (finished, aborted, retracted: SGLang's decode
batch holds every running request) is stopped at the next ``batch_get``.

Multimodal prompts: SGLang replaces an image's tokens by padding values of
1,000,000 and up in ``req.origin_input_ids``. The drafter reads the unpadded
prompt (``origin_input_ids_unpadded``) while lengths stay in the host's
coordinates; any id the drafter still sees at or above ``token_bound`` (the
vocabulary size once known, else 1,000,000) becomes ``token_bound``, and no
node at or above it is ever drafted (``tree_format``).

Tensor parallelism: SGLang does not broadcast NGRAM drafts, each rank drafts
for itself, so everything here is a function of the calls alone (requests are
started and stopped in batch order, never in set or hash order).
"""

from __future__ import annotations

import logging
import os
from typing import Hashable, Iterable, Sequence

import numpy as np

from freespec.draft import Budget, Draft

from .. import host_serving
from ..host_requests import HostRequests
from ..host_serving import ServingErrors
from . import options as plugin_options
from .external import ExternalCorpora
from .tree_format import write_sglang_trees

logger = logging.getLogger(__name__)

# SGLang's MM_PAD_SHIFT_VALUE: image-padding ids start here, and SGLang refuses larger vocabularies
SGLANG_PAD_START = 1_000_000
LOG_EVERY = 2000  # decode steps between two "freespec: served" log lines
_EMPTY = Draft.empty()


def _last_tokens(prompt_ids, output_ids, count: int) -> list:
    """The last ``count`` tokens of prompt + output, without concatenating them."""
    if count <= 0:
        return []
    from_output = list(output_ids[max(0, len(output_ids) - count):])
    need = count - len(from_output)
    return (list(prompt_ids[max(0, len(prompt_ids) - need):]) if need else []) + from_output


def _offered_context(offered: tuple, tail: list, total_len: int) -> np.ndarray | None:
    """Drafting prompt + output + the tail's new tokens, if the offered host context lines up with the tail."""
    host_prompt, output_ids, drafting_prompt = offered
    num_new = total_len - len(host_prompt) - len(output_ids)
    if not 0 <= num_new <= len(tail):
        return None
    keep = len(tail) - num_new  # tail[:keep] is the end of host_prompt + output_ids
    overlap = min(keep, len(host_prompt) + len(output_ids))
    if _last_tokens(host_prompt, output_ids, overlap) != tail[keep - overlap:keep]:
        return None
    return np.concatenate([np.asarray(drafting_prompt, np.int64).reshape(-1),
                           np.asarray(output_ids, np.int64).reshape(-1), np.asarray(tail[keep:], np.int64)])


class DraftServer:
    """Drop-in for ``sglang.srt.speculative.cpp_ngram.ngram_corpus.NgramCorpus``.

    The constructor takes the same keywords as SGLang's; ``draft_token_num``
    (D) and ``max_trie_depth`` (how many tail tokens the worker sends) matter
    here, the trie's own knobs (BFS breadths, match type, capacity, external
    SAM budget) do not. ``drafter`` / ``drafter_options`` / ``isolated``
    default to the plugin's configuration (``options.from_env``); unless
    isolated, a drafter that can keep a history of earlier requests keeps one
    (``options.SGLANG_DEFAULTS``).
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
        isolated: bool | None = None,
    ) -> None:
        if draft_token_num < 1:
            raise ValueError(f"draft_token_num must be >= 1, got {draft_token_num}")
        if max_trie_depth < 1:
            raise ValueError(f"max_trie_depth must be >= 1, got {max_trie_depth}")
        self._where = "drafter_options"
        if drafter is None:
            resolved = plugin_options.from_env()
            drafter, self._where = resolved.drafter, plugin_options.where()
            drafter_options = resolved.drafter_options if drafter_options is None else drafter_options
            isolated = plugin_options.isolated_from_env() if isolated is None else isolated
        self.isolated = bool(isolated)
        self.drafter_name = drafter
        self.drafter_options = dict(drafter_options or {})
        self.draft_token_num = int(draft_token_num)
        self.max_trie_depth = int(max_trie_depth)
        self.external_corpus_max_tokens = int(external_corpus_max_tokens)
        self.token_bound = SGLANG_PAD_START  # no id >= this is drafted (set_vocab_size: the vocabulary size)
        self.vocab_size: int | None = None
        self.num_steps = self.num_rows = self.num_drafted = 0  # batch_get calls, requests, drafted nodes
        self._budget = Budget(self.draft_token_num - 1, self.draft_token_num - 1)
        self._offered: dict[Hashable, tuple] = {}  # req_id -> (host prompt, output, drafting prompt)
        self._hints: dict[Hashable, dict] = {}  # req_id -> its custom_params (offered), read when it starts
        self._external = ExternalCorpora()
        self.errors = ServingErrors(logger)
        self.num_hint_errors = 0
        self._tokenizer_path: str | None = None
        self._tokenizer = None
        self._stats_path = os.environ.get(plugin_options.ENV_STATS) or None
        self._requests = HostRequests(self._build_drafter(), self._draftable, on_start=self._add_hints)
        write_sglang_trees([_EMPTY], [0], self.draft_token_num)  # compile the kernel now, not at a decode step
        self.drafter.warmup()
        logger.info("freespec: NGRAM drafts come from drafter %r %s (D=%d%s)", self.drafter_name,
                    self.drafter_options, self.draft_token_num, ", isolated" if self.isolated else "")

    def _build_drafter(self):
        drafter = plugin_options.build_drafter(self.drafter_name, self.drafter_options, self._where, self.isolated)
        self._external.attach(drafter)
        return drafter

    def set_vocab_size(self, vocab_size: int) -> None:
        """Never draft ids at or above ``vocab_size`` (the hook reads it from the model)."""
        if not 1 <= int(vocab_size) < 2**31:
            raise ValueError(f"vocab_size must be in [1, 2**31), got {vocab_size!r}")
        self.vocab_size = self.token_bound = int(vocab_size)

    def set_tokenizer_path(self, path: str | None) -> None:
        """Where the model's tokenizer is: texts among a request's hints are tokenized with it (loaded on first use)."""
        self._tokenizer_path = path

    @property
    def drafter(self):
        """The drafter serving the drafts."""
        return self._requests.drafter

    @drafter.setter
    def drafter(self, drafter) -> None:
        if len(self._requests):
            raise ValueError(f"the drafter can be replaced only while no request is live ({len(self._requests)} are)")
        self._requests = HostRequests(drafter, self._draftable, on_start=self._add_hints)

    @property
    def num_live_requests(self) -> int:
        """Requests whose drafter state is held."""
        return len(self._requests)

    @property
    def num_restarts(self) -> int:
        """Requests restarted because their tail did not line up with what the drafter held."""
        return self._requests.num_restarts

    # ------------------------------------------------------------ worker API
    def batch_get(
        self,
        req_ids: Sequence[Hashable],
        batch_tokens: Sequence[Sequence[int]],
        total_lens: Sequence[int],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for a batch: (token_ids [bs * D], mask [bs * D * D]), both int64.

        Nothing raised by a drafter leaves this call: a request whose sync or
        proposal fails gets no draft this step (its state is dropped; it restarts
        at its next step), and a failure outside one request's drafting (the tree
        rows) leaves every request of the step without a draft. SGLang then
        verifies the root alone, which decodes one token as plain decoding does.
        """
        if not len(req_ids) == len(batch_tokens) == len(total_lens):
            raise ValueError(f"batch_get got {len(req_ids)} req_ids, {len(batch_tokens)} token lists "
                             f"and {len(total_lens)} lengths")
        root_ids = [0] * len(req_ids)
        try:
            self._external.poll()
            if self._requests.release_absent(req_ids):
                self._write_stats()
            tails = []
            for row, tail in enumerate(batch_tokens):
                tail = list(tail) if isinstance(tail, list) else np.asarray(tail).reshape(-1).tolist()
                if tail:
                    root_ids[row] = tail[-1]
                tails.append(tail)
            drafts = self._draft_rows(req_ids, tails, total_lens)
            self._offered.clear()
            self._hints.clear()
            num_nodes = np.zeros(len(drafts), np.int64)
            out = write_sglang_trees(drafts, root_ids, self.draft_token_num, self.token_bound, num_nodes)
        except Exception as exc:  # nothing of ours stops the scheduler: this step goes without drafts
            self.errors.record(f"step:{type(exc).__name__}", exc)
            num_nodes = np.zeros(len(req_ids), np.int64)
            out = write_sglang_trees([_EMPTY] * len(req_ids), root_ids, self.draft_token_num, self.token_bound,
                                     num_nodes)
        self._count(int(num_nodes.sum()), len(req_ids))
        return out

    def _draft_rows(self, req_ids: Sequence[Hashable], tails: list[list], total_lens: Sequence[int]) -> list[Draft]:
        """Each request's draft this step: every row's committed tokens reach the drafter first, then one
        ``Drafter.propose_batch`` drafts the rows (as ``generate()`` and the vLLM proposer do a step: each draft
        reads every outcome of the step). An empty draft where a request has no tokens or its sync fails, and,
        where the batch call raises, row by row, so a failure costs its request alone (its state is dropped; it
        restarts at its next step)."""
        drafts, synced = [_EMPTY] * len(req_ids), []
        for row, (req_id, tail, total_len) in enumerate(zip(req_ids, tails, total_lens)):
            if not tail:  # nothing committed: nothing to draft from
                continue
            try:
                self._sync(req_id, tail, int(total_len))
                synced.append(row)
            except Exception as exc:
                self._drop(req_id, exc)
        try:
            for row, draft in zip(synced, self.drafter.propose_batch([req_ids[row] for row in synced],
                                                                     [self._budget] * len(synced))):
                drafts[row] = draft
            return drafts
        except Exception:  # the failing request is found, and dropped, row by row below
            pass
        for row in synced:
            try:
                drafts[row] = self.drafter.propose(req_ids[row], self._budget)
            except Exception as exc:
                self._drop(req_ids[row], exc)
        return drafts

    def _drop(self, req_id: Hashable, exc: Exception) -> None:
        """A request whose drafting failed: recorded, its state dropped (it restarts at its next step)."""
        self.errors.record(f"request:{type(exc).__name__}", exc, req_id)
        self._requests.discard(req_id)

    def offer_contexts(self, requests: Iterable[tuple]) -> None:
        """``(req_id, prompt_ids, output_ids[, drafting_prompt_ids[, custom_params]])`` of the coming batch.

        ``prompt_ids`` are in the host's coordinates (what its lengths count);
        ``drafting_prompt_ids`` (default ``prompt_ids``) are what the drafter
        reads: the unpadded prompt of a multimodal request; ``custom_params``
        (SGLang's per-request dict) may hold the request's hints, ``documents``
        and ``prediction`` (``host_serving.parse_hints``). Only references are
        kept (O(1) per request); they are read, and copied, only when a request
        starts or restarts in the next ``batch_get``.
        """
        for request in requests:
            req_id, prompt_ids, output_ids = request[:3]
            drafting = request[3] if len(request) > 3 and request[3] is not None else prompt_ids
            self._offered[req_id] = (prompt_ids, output_ids, drafting)
            if len(request) > 4 and request[4]:
                self._hints[req_id] = request[4]

    def batch_put(self, batch_tokens: Sequence[Sequence[int]]) -> None:
        """Accepted and ignored: these tails repeat what ``batch_get`` saw this step.

        Shared state (n-gram tables, histories) learns from whole requests
        through the drafter's ``stop``, which sees more than these tails.
        """

    def synchronize(self) -> None:
        """Nothing to wait for: this corpus drafts synchronously."""

    def erase_match_state(self, req_ids: Iterable[Hashable]) -> None:
        """Requests that left the decode batch: ``drafter.stop`` them (a later return restarts)."""
        self._release(list(req_ids))

    def release_idle(self) -> None:
        """The engine has no request left (its idle hook): release every request still held.

        SGLang's NGRAM worker erases the requests that leave a decode batch at
        the next verify step, so the last batch before the engine goes idle would
        stay held (and out of the drafter's history) until the next request.
        """
        if len(self._requests):
            self._release(list(self._requests.ids()))

    def _release(self, req_ids: list) -> None:
        """Stop the held ones among ``req_ids`` in the order they were started (never set order), forget what
        was offered for any of them; a drafter that fails to stop one still loses its state."""
        leaving = set(req_ids)
        held = [r for r in self._requests.ids() if r in leaving]
        try:
            self._requests.release(held)
        except Exception as exc:
            self.errors.record(f"release:{type(exc).__name__}", exc)
            for req_id in held:
                self._requests.discard(req_id)
        for req_id in leaving:
            self._offered.pop(req_id, None)
            self._hints.pop(req_id, None)
        self._write_stats()

    def reset(self) -> None:
        """Forget every request and what the drafter learned; external corpora stay (as in SGLang)."""
        for req_id in list(self._requests.ids()):
            self._requests.discard(req_id)
        self._offered.clear()
        self._hints.clear()
        self.drafter = self._build_drafter()
        self._write_stats()

    # ------------------------------------------------------ external corpora
    @property
    def remaining_token_budget(self) -> int:
        return self.external_corpus_max_tokens - self._external.held_tokens()

    def load_external_corpus_named(self, corpus_id: str, chunks: Iterable[Sequence[int]]) -> int:
        """Index documents for the drafter's shared corpus (any thread); returns the number of tokens loaded."""
        if not self._external.attached:
            raise ValueError(
                f"drafter {self.drafter_name!r} has no shared document index for an external corpus; use drafter "
                f'"corpus" or "mixture" with its option "documents": {{"min_match": 2, "max_match": 8}}')
        return self._external.load(corpus_id, chunks, self.remaining_token_budget)

    def commit_external_corpus_load(self, corpus_id: str, loaded_token_count: int) -> None:
        """Draft from a loaded corpus from now on (scheduler thread)."""
        self._external.commit(corpus_id, loaded_token_count)

    def remove_external_corpus(self, corpus_id: str) -> None:
        self._external.remove(corpus_id)

    def list_external_corpora(self) -> dict[str, int]:
        return self._external.token_counts()

    # --------------------------------------------------------------- helpers
    def stats(self) -> dict:
        """Serving counters: live requests, starts, restarts, decode steps, requests drafted for, drafted
        nodes, contained errors (hint errors among them), the request history's size (None without one) and
        this process's resident MB."""
        history = getattr(self.drafter, "history", None)
        return {"live_requests": len(self._requests), "starts": self._requests.num_starts,
                "restarts": self.num_restarts, "steps": self.num_steps, "rows": self.num_rows,
                "drafted_tokens": self.num_drafted, "errors": self.errors.count, "hint_errors": self.num_hint_errors,
                "history_tokens": None if history is None else history.num_tokens,
                "history_bytes": None if history is None else history.nbytes,
                "process_rss_mb": host_serving.resident_mb()}

    def _write_stats(self) -> None:
        """``stats()`` to the file ``FREESPEC_SGLANG_STATS`` names, if any (after requests leave)."""
        if self._stats_path:
            try:
                host_serving.write_stats(self._stats_path, self.stats())
            except OSError as exc:
                self.errors.record("stats", exc)

    def _add_hints(self, req_id: Hashable) -> None:
        """A (re)started request's ``documents`` / ``prediction`` from its ``custom_params``; a malformed
        hint (SGLang refuses it when the request arrives) or a failure costs the request its hints only."""
        values = self._hints.get(req_id)
        if not values:
            return
        try:
            found = host_serving.parse_hints(values, "custom_params")
            if found is not None:
                host_serving.add_hints(self.drafter, req_id, found, self._tokenizer_for)
        except Exception as exc:  # the request drafts without its hints
            self.num_hint_errors += 1
            self.errors.record(f"hints:{type(exc).__name__}", exc, req_id)

    def _tokenizer_for(self, items):
        if not any(isinstance(item, str) for item in items):
            return None
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise ValueError("a text hint needs the model's tokenizer, and SGLang's worker did not say where "
                                 "it is; pass token ids")
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    def _count(self, num_drafted: int, num_rows: int) -> None:
        """Serving statistics, and the log lines that show drafts are served (``gpu_check.sh`` reads them)."""
        first = self.num_drafted == 0 and num_drafted > 0
        self.num_steps += 1
        self.num_rows += num_rows
        self.num_drafted += num_drafted
        if first:
            logger.info("freespec: serving drafts from drafter %r (first: %d nodes for %d requests)",
                        self.drafter_name, num_drafted, num_rows)
        if self.num_steps % LOG_EVERY == 0:
            logger.info("freespec: drafter %r served %d decode steps, %.2f draft nodes per request, "
                        "%d live requests, %d restarts", self.drafter_name, self.num_steps,
                        self.num_drafted / max(1, self.num_rows), len(self._requests), self.num_restarts)

    def _draftable(self, ids: list | np.ndarray):
        """``ids`` with every id at or above ``token_bound`` replaced by ``token_bound`` (as they are when none is)."""
        if len(ids) == 0 or (ids.max() if isinstance(ids, np.ndarray) else max(ids)) < self.token_bound:
            return ids
        return np.minimum(np.asarray(ids, np.int64), self.token_bound)

    def _sync(self, req_id: Hashable, tail: list, total_len: int) -> None:
        """Bring the drafter's context of ``req_id`` to ``total_len`` host tokens ending in ``tail``."""
        offered = self._offered.pop(req_id, None)

        def context():
            known = _offered_context(offered, tail, total_len) if offered is not None else None
            return tail if known is None else known

        self._requests.sync(req_id, tail, total_len, context)
