"""Mixture drafter: every source's draft in one tree, sized by a live cost model.

Sources, each a tree of continuations:

- ``suffix``: a suffix automaton over the request's own prompt + output (always);
- ``history``: a ``RequestHistory`` of earlier requests (opt-in: ``history_tokens`` or
  ``history``);
- ``corpus``: documents, shared (``documents=DocumentIndex``) or per request (``add_documents``);
- ``prediction``: the request's predicted output (``add_prediction``, ``generate(prediction=...)``),
  re-aligned after the output departs from it (``PredictionSource``);
- ``ngram``: an n-gram table (per request unless ``ngram_shared``), consulted only when no
  other source has a match of ``ngram_below`` tokens or more. Off by default: on recorded
  outputs of qwen2.5-coder-0.5b it raises tau from 1.50 to 1.63 (Spec-Bench) and 6.30 to
  6.98 (code-edit), mostly by drafting after 1-token matches, but with the verify cost
  measured on 2 CPU threads (c(2..16) ~2.2) those extra drafts cost more than they save;
- ``recycle``: token recycling (``RecycleSource``, on by default): trees grown from the
  target's own top-k of earlier steps, per token and per (previous token, token), and from
  the request's bigrams; it drafts where no text repeats (chat, translation, QA). With
  ``recycle_below`` > 0 it is consulted only while no lookup source matches that many
  tokens, SAM-Decoding's rule (a long match wins outright); by default every step, and the
  cost model decides;
- ``lookahead``: a Jacobi window riding in the forward as not-candidate nodes and the n-gram
  pool it fills (``LookaheadSource``, on by default unless ``early_exit``).

The two sources that read the model (``recycle``, ``lookahead``) run only where verification
is nearly flat: while the live cost model's c(4) <= ``flat_max_cost`` (1.5; ``flat_curve``).
There (bfloat16 on AMX CPUs, GPUs) their wide trees and the window cost little more than a
one-token forward; on a CPU in float32 (c(4) ~ 1.7) recycled nodes raised tau but cost time
(README Results). While the gate is closed they cost nothing: no drafts, no window, and the
engine computes no top-k for them (``observe_top_k`` is 0).

Each step, every node gets a *calibrated* path probability: the chance it is accepted,
the product along its path of P(accepted | parent accepted) per kind of node, counted
live by ``AcceptanceCalibrator`` (lookups: per source, effective match length and raw
frequency, ``calibrate_lookup``; recycled nodes: per row type, depth, rank and agreement,
``RecycleSource``; a kind without counts of its own starts from a prior scaled by what its
source's judged nodes showed). The trees are merged (``draft.merge``: shared paths become one node,
named by the most trusted source), and ``DraftSizer`` keeps the ``k`` best nodes that
maximize ``(1 + sum of their path probabilities) / (c(1 + k + m) + h(k + m) / t1)``, where ``c`` is
the forward time with ``n`` tokens fed over that with 1, measured live from ``on_forward``
(per batch size), ``h`` the step's time outside its forward with that many nodes (measured
live too, ``HostCostModel``; it makes wide trees pay for their host work where the forward is
flat), ``t1`` a one-token forward's time, and ``m`` the lookahead window's nodes, priced at the tokens a window
node was measured to bring; ``k = 0`` (no draft) when nothing pays. So a long suffix or
corpus match fills the tree where it is trusted, recycled nodes fill what the cost curve
still affords (one to three nodes on a CPU in float32, where c(4) ~ 1.9; dozens where it
is flat), and the window rides only where its measured value beats its cost.

Self-drafting (``early_exit=True``, opt-in): where the sizer keeps no node worth
verifying, an ``EarlyExitDrafter`` drafts with the target's own layers, but only
in a batch of one and when its live numbers (the draft pass's measured cost,
c(n) of the verify forwards, its acceptance per step) predict a gain over plain
decoding (``EarlyExitDrafter.worth_drafting``); its tree is verified as it is
(its threshold was chosen with the pass's cost, which is spent by then). The
mixture then needs the model (``needs_model``) and only architectures with a
model handle can be patched. It excludes ``lookahead``, which fills the same gap.

State across requests: the cost model and the calibration counts are numbers about the
model and the machine, shared. The successor table is shared across requests by default
(``recycle_shared``; about 10 MB for a 152k vocabulary): a token's successors learned in
one request draft in another. It never changes any output (verification decides every
token), only draft sizes and so timing; ``recycle_shared=False`` keeps one table per
request, for multi-tenant deployments. No other token crosses requests unless a request
history or a shared n-gram table is configured.
"""


from __future__ import annotations

from functools import partial
from typing import Hashable, Iterable

import numpy as np

from ..draft import Budget, Draft, merge_indexed
from ..tree import follow
from .base import Drafter, ForwardReport, VerifyOutput, exercise
from .calibration import DraftSizer, calibrate_lookup, calibrate_lookups
from .corpus import DocumentIndex, DocumentSource
from .early_exit import EarlyExitDrafter
from .lookahead import LookaheadSource
from .ngram_table import NgramTableDrafter
from .options import check_bool, check_int, check_number
from .prediction import PredictionSource
from .recycle import RecycleSource
from .suffix import RequestHistory, SuffixSource, resolve_history


class MixtureDrafter(Drafter):
    """Suffix, request history, documents, n-gram table, token recycling and lookahead, merged and sized.

    adaptive: size the tree from the cost model and calibrated acceptance (the
        default); False always fills ``budget.num_nodes`` with the best nodes
        (``SpecConfig.make_drafter`` passes ``adaptive_budget`` here).
    min_match / max_depth / min_prob / max_occurrences: the suffix sources' options
        (``SuffixSource``'s); max_occurrences also caps the documents' occurrences.
    history_tokens: > 0 builds a private ``RequestHistory`` of finished requests
        of that many tokens; history: a ``RequestHistory`` to share instead;
        history_prompts: index prompts too.
    documents: a ``DocumentIndex`` seen by every request; ``add_documents`` adds per-request ones.
    ``add_prediction`` gives a request its predicted output (drafted up to ``max_depth`` deep).
    ngram: consult an n-gram table when no source matches ``ngram_below`` tokens;
        ngram_shared: one table for all requests.
    recycle: token recycling (``RecycleSource``) while no lookup source matches
        ``recycle_below`` tokens or more (0: always); recycle_top_k: successors per token;
        recycle_confidence: calibrate recycled nodes per confidence class of the target's probability
        (``RecycleSource``'s ``confidence``; False: per rank);
        recycle_shared: one successor table for all requests (False: one per request).
    lookahead: a Jacobi window and n-gram pool (``LookaheadSource``); None (the default): on
        unless ``early_exit``; lookahead_window / lookahead_ngram / lookahead_guesses: its W, N, G.
    flat_max_cost: recycling and lookahead run while the live cost of a 4-token forward is at
        most this many 1-token ones (``flat_curve``; ``float('inf')``: whatever the cost).
    prior_cost_slope: the cost model's prior, ``c(n) = 1 + slope (n - 1)``.
    host_cost: price each step's time outside its forward, measured live, beside the forward's
        (``DraftSizer``); False sizes trees by the forward's cost alone.
    early_exit: self-draft with the target's own layers where no other source pays (see above).
    """

    name = "mixture"
    isolation_options = {"history_tokens": 0, "history": None, "ngram_shared": False,  # no text crosses requests
                         "recycle_shared": False}
    accepts_documents = True
    accepts_prediction = True

    def __init__(self, adaptive: bool = True, min_match: int = 2, max_depth: int = 64, min_prob: float = 0.1,
                 max_occurrences: int = 64, history_tokens: int = 0, history_prompts: bool = False,
                 history: RequestHistory | None = None, documents: DocumentIndex | None = None,
                 ngram: bool = False, ngram_below: int = 3, ngram_shared: bool = False,
                 recycle: bool = True, recycle_below: int = 0, recycle_top_k: int = 8, recycle_shared: bool = True,
                 recycle_confidence: bool = True,
                 lookahead: bool | None = None, lookahead_window: int = 5, lookahead_ngram: int = 4,
                 lookahead_guesses: int = 5, flat_max_cost: float = 1.5, prior_cost_slope: float = 0.03,
                 host_cost: bool = True, early_exit: bool = False):
        super().__init__()
        history = resolve_history(history_tokens, history_prompts, history)
        self.suffix = SuffixSource(min_match, max_depth, min_prob, max_occurrences, history)
        self.documents = DocumentSource(documents, max_occurrences=max_occurrences, max_request_tokens=1 << 22)
        self.prediction = PredictionSource(max_depth=max_depth)
        self.ngram_below = check_int("ngram_below", ngram_below, 1)
        check_bool("ngram_shared", ngram_shared)
        self.ngram = NgramTableDrafter(shared=ngram_shared) if check_bool("ngram", ngram) else None
        self.recycle_below = check_int("recycle_below", recycle_below, 0)
        self.flat_max_cost = check_number("flat_max_cost", flat_max_cost, 1.0)
        recycle_options = (check_int("recycle_top_k", recycle_top_k, 1), check_bool("recycle_shared", recycle_shared))
        confidence = check_bool("recycle_confidence", recycle_confidence)
        self.recycle = RecycleSource(*recycle_options, confidence=confidence) if check_bool("recycle", recycle) else None
        lookahead_options = (check_int("lookahead_window", lookahead_window, 1),
                             check_int("lookahead_ngram", lookahead_ngram, 2),
                             check_int("lookahead_guesses", lookahead_guesses, 1))
        if check_bool("early_exit", early_exit) and lookahead:
            raise ValueError("early_exit and lookahead both draft where lookup has nothing; enable one of them")
        lookahead = not early_exit if lookahead is None else check_bool("lookahead", lookahead)
        self.lookahead = LookaheadSource(*lookahead_options) if lookahead else None
        self._top_k = self.recycle.top_k if self.recycle is not None else (1 if self.lookahead else 0)
        self._batch_size = 1  # the latest budget's: observe_top_k's gate reads that batch size
        self.sizer = DraftSizer(adaptive, prior_cost_slope, host_cost)
        self._pool_only: dict[Hashable, tuple[Draft, np.ndarray]] = {}  # request -> verified draft, pool-only nodes
        self.early_exit = EarlyExitDrafter() if early_exit else None
        self.needs_model = early_exit

    @property
    def history(self) -> RequestHistory | None:
        return self.suffix.history

    @property
    def adaptive(self) -> bool:
        return self.sizer.adaptive

    @property
    def observe_top_k(self) -> int:
        """The target's top-k the recycling table and the window read; 0 while ``flat_curve`` is False at the batch
        size of the latest draft (the step the engine verifies next): a padded batch whose own forwards read steep
        computes no top-k for sources gated off there, whatever batch 1's prior says."""
        return self._top_k if self._top_k and self.flat_curve(self._batch_size) else 0

    @property
    def cost_model(self):
        return self.sizer.cost_model

    @property
    def calibrator(self):
        return self.sizer.calibrator

    # ---------------------------------------------------------------- lifecycle
    def _on_start(self, request_id) -> None:
        context = self.context(request_id)
        self.suffix.start(request_id, context)
        if self.ngram is not None:
            self.ngram.start(request_id, context)
        if self.recycle is not None:
            self.recycle.start(request_id, context)
        if self.lookahead is not None:
            self.lookahead.start(request_id, partial(self.context, request_id), self._successor(request_id))
        if self.early_exit is not None:
            self.early_exit.start(request_id, context)

    def add_documents(self, request_id: Hashable, docs: Iterable, tokenizer=None) -> None:
        """Add documents (1-D token ids, or texts with ``tokenizer``) seen only by this request."""
        self._context(request_id)
        self.documents.add(request_id, docs, tokenizer)

    def add_prediction(self, request_id: Hashable, prediction_ids) -> None:
        """The request's predicted output (1-D token ids), drafted from as the output follows it."""
        self._context(request_id)
        self.prediction.add(request_id, prediction_ids)

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        self.sizer.judge(request_id, ids)
        self.suffix.extend(request_id, ids)
        self.prediction.extend(request_id, ids)
        if self.ngram is not None:
            self.ngram.extend(request_id, ids)
        if self.recycle is not None:
            self.recycle.extend(request_id, self.context(request_id), ids.shape[0])
        if self.lookahead is not None:
            verified = self._pool_only.pop(request_id, None)
            if verified is not None:
                accepted = follow(verified[0].parents, verified[0].token_ids, ids)
                self.lookahead.credit(int(verified[1][accepted].sum()))
            self.lookahead.advance(request_id, ids.shape[0], self._successor(request_id))
        if self.early_exit is not None:
            self.early_exit.extend(request_id, ids)

    def observe(self, request_id, verify_output: VerifyOutput) -> None:
        """The target's top-k at every fed node: rows of the successor table; the lookahead window's outputs."""
        if self.recycle is not None:
            self.recycle.observe(request_id, self.context(request_id), verify_output)
        if self.lookahead is not None:
            self.lookahead.observe(request_id, verify_output)

    def _on_stop(self, request_id) -> None:
        self.sizer.forget(request_id)
        self._pool_only.pop(request_id, None)
        self.suffix.stop(request_id)
        self.documents.stop(request_id)
        self.prediction.stop(request_id)
        for source in (self.ngram, self.recycle, self.lookahead, self.early_exit):
            if source is not None:
                source.stop(request_id)

    def on_forward(self, report: ForwardReport) -> None:
        self.sizer.on_forward(report)
        if self.early_exit is not None:
            self.early_exit.on_forward(report)

    def attach_model(self, handle) -> None:
        """The model handle, for the early-exit source (only called with ``early_exit=True``)."""
        self.early_exit.attach_model(handle)

    def on_verified_cache(self, request_id, cache, cache_len: int) -> None:
        if self.early_exit is not None:
            self.early_exit.on_verified_cache(request_id, cache, cache_len)

    def _successor(self, request_id):
        """The lookahead window's guess of what follows a token: the successor table's top-1, if any."""
        if self.recycle is None:
            return None
        table = self.recycle.table_for(request_id)
        return table.top1

    def flat_curve(self, batch_size: int = 1) -> bool:
        """Whether recycling and lookahead run: verification is nearly flat, ``c(4) <= flat_max_cost``.

        Measured on qwen2.5-coder-0.5b (README Results): where c(4) ~ 1.1-1.3 (bfloat16 on AMX)
        recycling raises Spec-Bench tokens/s from 1.51x to 1.57x plain decoding and the window
        to 1.63x; where c(4) ~ 1.7 (float32) recycling raises tau but costs time (code edits
        4.42x -> 3.89x plain, Spec-Bench equal). Until forwards of about 4 tokens are measured
        the prior curve counts as flat; after that an unmeasured c(4) reads the nearest measured
        width above it (``at_most``), not the sizer's optimistic exploration, which would keep the
        gate open on a steep curve whose 4-token forwards happen to be rare. A padded batch (HF
        ``generate()`` at batch size above 1) opens it only once its own forwards of 4 tokens or more
        per row were measured cheap: there, a borrowed batch-1 value reads padded forwards as cheaper
        than they are (``BatchCostModel._at_most``).
        """
        return self.cost_model.at_most(4, batch_size) <= self.flat_max_cost

    # ---------------------------------------------------------------- drafting
    def _source_drafts(self, request_id, budget: Budget) -> list[tuple[str, int, Draft]]:
        """(source, match_len, draft with raw frequencies as confidence) for every lookup source that matches."""
        out = self.suffix.drafts(request_id, budget)
        depth = min(self.suffix.max_depth, budget.max_depth)
        for match_len, found in self.documents.matches(request_id, self.context(request_id), depth):
            out.append(("corpus", match_len, Draft.from_sequences(found, num_nodes=budget.num_nodes,
                                                                  max_depth=depth, source="corpus")))
        out += self.prediction.drafts(request_id, budget)
        if self.ngram is not None and max((m for _, m, _ in out), default=0) < self.ngram_below:
            out.append(("ngram", 1, self.ngram.propose(request_id, Budget(budget.num_nodes, depth))))
        return [source for source in out if source[2].num_nodes]

    def _scored_drafts(self, request_id, budget: Budget, flat: bool, lookups: list,
                       scored: list) -> list[tuple[Draft, list[tuple]]]:
        """Every source's tree with calibrated path probabilities as confidence, and its nodes' kinds: the lookup
        sources' (``lookups``, calibrated as ``scored``), then recycling's and the pool's where ``flat``."""
        if not flat:  # the sources that read the model run only where verification is nearly flat
            return [(draft, kinds) for draft, kinds in scored if draft.num_nodes]
        longest = max((match_len for _, match_len, _ in lookups), default=0)
        if self.recycle is not None and (self.recycle_below == 0 or longest < self.recycle_below):
            scored.append(self.recycle.draft(request_id, self.context(request_id), budget, self.calibrator))
        if self.lookahead is not None:
            root = int(self.context(request_id)[-1])
            scored.append(calibrate_lookup(self.calibrator, "lookahead", 1,
                                           self.lookahead.candidates(request_id, root, budget)))
        return [(draft, kinds) for draft, kinds in scored if draft.num_nodes]

    def _propose(self, request_id, budget: Budget) -> Draft:
        return self._propose_batch([request_id], [budget])[0]

    def _propose_batch(self, request_ids: list, budgets: list[Budget]) -> list[Draft]:
        """Every request's lookup trees first, calibrated in one pass (``calibrate_lookups``: the calibrator's
        counts do not change while a step drafts), then each request's tree merged and sized."""
        lookups = [self._source_drafts(request_id, budget) for request_id, budget in zip(request_ids, budgets)]
        scored = iter(calibrate_lookups(self.calibrator, [lookup for found in lookups for lookup in found]))
        return [self._sized(request_id, budget, found, [next(scored) for _ in found])
                for request_id, budget, found in zip(request_ids, budgets, lookups)]

    def _sized(self, request_id, budget: Budget, lookups: list, scored: list) -> Draft:
        """The request's draft from its lookup sources' trees (``lookups``, calibrated as ``scored``) and the
        sources that read the model: merged, sized, with the lookahead window where it rides."""
        self._batch_size = budget.batch_size
        if budget.batch_size > 1 and not budget.packed:  # a padding host's rows: its prefill step drafts before the
            self.cost_model.note_padded(budget.batch_size)  # prefill's report would mark the bucket (the gate's)
        # the gate matters only to the sources that read the model (the cost curve is not read without them)
        flat = (self.recycle is not None or self.lookahead is not None) and self.flat_curve(budget.batch_size)
        scored = self._scored_drafts(request_id, budget, flat, lookups, scored)
        if len(scored) > 1:  # the most trusted source names shared nodes
            scored.sort(key=lambda c: -float(c[0].confidence.max()))
        if len(scored) == 1:
            (merged, kinds), node_maps = scored[0], [range(scored[0][0].num_nodes)]
        elif scored:
            merged, node_maps = merge_indexed([draft for draft, _ in scored])
            best: list = [None] * merged.num_nodes  # merged node -> (path probability, kind), best source wins
            for (draft, draft_kinds), node_map in zip(scored, node_maps):
                for j, probability, kind in zip(node_map, draft.confidence.tolist(), draft_kinds):
                    if best[j] is None or best[j][0] < probability:
                        best[j] = (probability, kind)
            kinds = [kind for _, kind in best]
        else:
            merged, kinds, node_maps = Draft.empty(), [], []
        if self.lookahead is None or not flat or budget.chain:  # a chain has no room for the window's columns
            self._pool_only.pop(request_id, None)
            chosen = self.sizer.select(request_id, merged, kinds, budget)[0]
            return chosen if chosen.num_nodes else self._self_draft(request_id, budget)
        options = self.lookahead.options(request_id, budget)
        chosen, kept, option = self.sizer.select_nodes(request_id, merged, kinds, budget, tuple(options))
        self._remember_pool_only(request_id, scored, node_maps, merged.num_nodes, chosen, kept)
        return self.lookahead.hang_window(request_id, chosen, options[option][0])

    def fit_batch(self, request_ids: list, drafts: list[Draft], batch_size: int,
                  packed: bool = False) -> list[Draft]:
        """The sizer's joint cut (``DraftSizer.fit_batch``): every row of a padded forward pays its widest, a packed
        one pays its tokens in all."""
        return self.sizer.fit_batch(request_ids, drafts, batch_size, self._progress(request_ids, packed), packed)

    def _self_draft(self, request_id, budget: Budget) -> Draft:
        """The early-exit draft, in a batch of one, when its gate predicts a gain; else none."""
        if self.early_exit is None or budget.batch_size != 1 or not self.early_exit.worth_drafting(request_id):
            return Draft.empty()
        return self.early_exit.propose(request_id, budget)

    def _remember_pool_only(self, request_id, scored: list, node_maps: list, num_merged: int, chosen: Draft,
                            kept: list[int]) -> None:
        """Which verified candidates only the lookahead pool proposed (their acceptance is the window's credit).

        ``node_maps[d][i]``: the merged node of node ``i`` of ``scored[d]``; ``kept``: the merged nodes chosen."""
        others = [False] * num_merged  # merged node -> proposed by a source other than the pool
        for (_, kinds), node_map in zip(scored, node_maps):
            if kinds and kinds[0][0] != "lookahead":
                for j in node_map:
                    others[j] = True
        self._pool_only[request_id] = (chosen, np.array([not others[j] for j in kept], bool))

    def warmup(self) -> None:
        """Compile the suffix, table and pool kernels on a tiny request."""
        exercise(MixtureDrafter(min_match=1, history_tokens=64))
