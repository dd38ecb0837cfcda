"""Mixture drafter: every source's draft in one tree, sized by a live cost model.

Sources, each a tree of continuations with the length of the match it came from:

- ``suffix``: a suffix automaton over the request's own prompt + output (always);
- ``history``: a ``RequestHistory`` of earlier requests (opt-in: ``history_tokens`` or
  ``history``); without it nothing a request reads comes from another request;
- ``corpus``: documents, shared (``documents=DocumentIndex``) or per request (``add_documents``);
- ``ngram``: an n-gram table (per request unless ``ngram_shared``), consulted only when no
  other source has a match of ``ngram_below`` tokens or more. Off by default: on recorded
  outputs of qwen2.5-coder-0.5b it raises tau from 1.50 to 1.63 (Spec-Bench) and 6.30 to
  6.98 (code-edit), mostly by drafting after 1-token matches, but with the verify cost
  measured on 2 CPU threads (c(2..16) ~2.2) those extra drafts cost more than they save
  (-3% tokens/s on code-edit); learning the target's top-k (``ngram_observe_top_k``)
  adds a top-k of the logits and ~2 ms per step (live: +5% tau, +5% CPU time).

Each step, every node's raw score (the frequency of its path among the
match's occurrences) becomes a *calibrated* probability: the chance that the
node is accepted given its parent is, looked up per (source, effective match
length = match length + depth - 1, raw conditional frequency) in
``AcceptanceCalibrator``, which counts what was accepted in earlier steps; a
node's path probability is the product along its path. The trees are merged
(``draft.merge``: shared paths become one node, each node keeps the source
that proposed it), nodes sorted best-first, and the number of nodes ``k``
chosen to maximize expected tokens per unit of time,
``(1 + sum of the k best path probabilities) / c(1 + k)``, where ``c`` is
``CostModel`` (``calibration.py``), the forward time with ``n`` tokens fed
over that with 1, measured live from ``on_forward``. ``k = 0`` (no draft) when nothing pays.

Worked example: ``c(n) = 1 + 0.03 (n - 1)``, path probabilities
``[0.9, 0.8, 0.1, 0.02]``: k=0 gives 1.0, k=1 1.9/1.03=1.84, k=2 2.7/1.06=2.55,
k=3 2.8/1.09=2.57, k=4 2.82/1.12=2.52, so three nodes are proposed.

Self-drafting (``early_exit=True``, opt-in): where no lookup source yields a
draft worth verifying, an ``EarlyExitDrafter`` drafts with the target's own
layers, but only when its live numbers (the draft pass's measured cost, c(n)
of the verify forwards, its acceptance per step) predict a gain over plain
decoding (``EarlyExitDrafter.worth_drafting``). The mixture then needs the model
(``needs_model``) and only architectures with a model handle can be patched.

State across requests: the cost model (forward times) and the calibration
counts (how often nodes of each kind were accepted) are numbers about the
model and the machine and are shared; no token of one request is read by
another unless a request history or a shared n-gram table is configured.
"""


from __future__ import annotations

from typing import Hashable, Iterable

import numpy as np

from ..draft import Budget, Draft, merge
from .base import Drafter, ForwardReport, exercise
from .calibration import AcceptanceCalibrator, CostModel
from .corpus import DocumentIndex, DocumentSource
from .early_exit import EarlyExitDrafter
from .ngram_table import NgramTableDrafter
from .options import check_bool, check_int, check_number
from .suffix import RequestHistory, SuffixSource, resolve_history


class MixtureDrafter(Drafter):
    """Suffix, request history, documents and n-gram table, merged and sized by a cost model.

    adaptive: size the tree from the cost model and calibrated acceptance (the
        default); False always fills ``budget.num_nodes`` with the best nodes
        (``SpecConfig.make_drafter`` passes ``adaptive_budget`` here).
    min_match / max_depth / min_prob / max_occurrences: the suffix sources' options
        (``SuffixSource``'s); max_occurrences also caps the documents' occurrences.
    history_tokens: > 0 builds a private ``RequestHistory`` of finished requests
        of that many tokens; history: a ``RequestHistory`` to share instead;
        history_prompts: index prompts too.
    documents: a ``DocumentIndex`` seen by every request; ``add_documents`` adds per-request ones.
    ngram: consult an n-gram table when no source matches ``ngram_below`` tokens;
        ngram_shared: one table for all requests; ngram_observe_top_k: let it learn
        the target's top-k (costs ~2 ms and a top-k of the logits per step).
    prior_cost_slope: the cost model's prior, ``c(n) = 1 + slope (n - 1)``.
    early_exit: self-draft with the target's own layers where lookup has nothing (see above).
    """

    name = "mixture"
    accepts_documents = True

    def __init__(self, adaptive: bool = True, min_match: int = 2, max_depth: int = 64, min_prob: float = 0.1,
                 max_occurrences: int = 64, history_tokens: int = 0, history_prompts: bool = False,
                 history: RequestHistory | None = None, documents: DocumentIndex | None = None,
                 ngram: bool = False, ngram_below: int = 3, ngram_shared: bool = False,
                 ngram_observe_top_k: int = 0, prior_cost_slope: float = 0.03, early_exit: bool = False):
        super().__init__()
        self.adaptive = check_bool("adaptive", adaptive)
        history = resolve_history(history_tokens, history_prompts, history)
        self.suffix = SuffixSource(min_match, max_depth, min_prob, max_occurrences, history)
        self.documents = DocumentSource(documents, max_occurrences=max_occurrences, max_request_tokens=1 << 22)
        self.ngram_below = check_int("ngram_below", ngram_below, 1)
        check_bool("ngram_shared", ngram_shared)
        ngram_observe_top_k = check_int("ngram_observe_top_k", ngram_observe_top_k, 0)
        self.ngram = (NgramTableDrafter(shared=ngram_shared, observe_top_k=ngram_observe_top_k)
                      if check_bool("ngram", ngram) else None)
        self.observe_top_k = ngram_observe_top_k if ngram else 0
        self.cost_model = CostModel(prior_slope=check_number("prior_cost_slope", prior_cost_slope, 0.0))
        self.calibrator = AcceptanceCalibrator()
        self._last: dict[Hashable, tuple[Draft, list[tuple]]] = {}  # request -> last draft, each node's kind
        self.early_exit = EarlyExitDrafter() if check_bool("early_exit", early_exit) else None
        self.needs_model = early_exit

    @property
    def history(self) -> RequestHistory | None:
        return self.suffix.history

    # ---------------------------------------------------------------- lifecycle
    def _on_start(self, request_id) -> None:
        self.suffix.start(request_id, self.context(request_id))
        if self.ngram is not None:
            self.ngram.start(request_id, self.context(request_id))
        if self.early_exit is not None:
            self.early_exit.start(request_id, self.context(request_id))

    def add_documents(self, request_id: Hashable, docs: Iterable, tokenizer=None) -> None:
        """Add documents (1-D token ids, or texts with ``tokenizer``) seen only by this request."""
        self._context(request_id)
        self.documents.add(request_id, docs, tokenizer)

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        last = self._last.pop(request_id, None)
        if last is not None:
            self._learn_outcome(*last, ids)
        self.suffix.extend(request_id, ids)
        if self.ngram is not None:
            self.ngram.extend(request_id, ids)
        if self.early_exit is not None:
            self.early_exit.extend(request_id, ids)

    def observe(self, request_id, verify_output) -> None:
        if self.ngram is not None and self.ngram.observe_top_k:
            self.ngram.observe(request_id, verify_output)

    def _on_stop(self, request_id) -> None:
        self._last.pop(request_id, None)
        self.suffix.stop(request_id)
        self.documents.stop(request_id)
        if self.ngram is not None:
            self.ngram.stop(request_id)
        if self.early_exit is not None:
            self.early_exit.stop(request_id)

    def on_forward(self, report: ForwardReport) -> None:
        if self.early_exit is not None:
            self.early_exit.on_forward(report)
        if report.prefill or report.batch_size != 1:  # a prefill's cost is the prompt's
            return
        self.cost_model.add(report.width, report.forward_s)

    def attach_model(self, handle) -> None:
        """The model handle, for the early-exit source (only called with ``early_exit=True``)."""
        self.early_exit.attach_model(handle)

    def on_verified_cache(self, request_id, cache, cache_len: int) -> None:
        if self.early_exit is not None:
            self.early_exit.on_verified_cache(request_id, cache, cache_len)

    # ---------------------------------------------------------------- learning
    def _learn_outcome(self, draft: Draft, kinds: list[tuple], committed: np.ndarray) -> None:
        """Count, for each node whose parent was accepted, whether it was accepted too.

        The committed tokens are the accepted path followed by the bonus token;
        a node at depth d is judged against ``committed[d - 1]`` (if committed
        stopped earlier, e.g. at EOS, deeper nodes are not judged).
        """
        committed = committed.tolist()
        self.calibrator.tick()
        accepted = np.zeros(draft.num_nodes, bool)
        depths = draft.depths().tolist()
        for i, (parent, token) in enumerate(zip(draft.parents.tolist(), draft.token_ids.tolist())):
            if (parent >= 0 and not accepted[parent]) or depths[i] > len(committed):
                continue
            accepted[i] = committed[depths[i] - 1] == token
            self.calibrator.update(kinds[i], bool(accepted[i]))

    # ---------------------------------------------------------------- drafting
    def _source_drafts(self, request_id, budget: Budget) -> list[tuple[str, int, Draft]]:
        """(source, match_len, draft with raw frequencies as confidence) for every source that matches."""
        out = self.suffix.drafts(request_id, budget)
        depth = min(self.suffix.max_depth, budget.max_depth)
        for match_len, found in self.documents.matches(request_id, self.context(request_id), depth):
            out.append(("corpus", match_len, Draft.from_sequences(found, num_nodes=budget.num_nodes,
                                                                  max_depth=depth, source="corpus")))
        if self.ngram is not None and max((m for _, m, _ in out), default=0) < self.ngram_below:
            out.append(("ngram", 1, self.ngram.propose(request_id, Budget(budget.num_nodes, depth))))
        return [source for source in out if source[2].num_nodes]

    def _calibrated(self, source: str, match_len: int, draft: Draft) -> tuple[Draft, list[tuple]]:
        """The draft with calibrated path probabilities as confidence, and each node's kind."""
        raw = np.ones(draft.num_nodes) if draft.confidence is None else draft.confidence.astype(np.float64)
        path_probs = np.empty(draft.num_nodes, np.float64)
        depths = draft.depths()
        kinds = []
        for i, parent in enumerate(draft.parents.tolist()):
            parent_raw = 1.0 if parent < 0 else raw[parent]
            frequency = raw[i] / parent_raw if parent_raw > 0 else 0.0
            kinds.append(self.calibrator.kind(source, match_len, int(depths[i]), frequency))
            path_probs[i] = self.calibrator.probability(kinds[-1]) * (1.0 if parent < 0 else path_probs[parent])
        return Draft(draft.token_ids, draft.parents, path_probs.astype(np.float32), (source,) * draft.num_nodes), kinds

    def _propose(self, request_id, budget: Budget) -> Draft:
        draft = self._propose_lookup(request_id, budget)
        if not draft.num_nodes and self.early_exit is not None and self.early_exit.worth_drafting(request_id):
            return self.early_exit.propose(request_id, budget)
        return draft

    def _propose_lookup(self, request_id, budget: Budget) -> Draft:
        calibrated = [self._calibrated(*source) for source in self._source_drafts(request_id, budget)]
        if not calibrated:
            return Draft.empty()
        calibrated.sort(key=lambda c: -float(c[0].confidence.max()))  # the most trusted source names shared nodes
        kind_of: dict[tuple, tuple] = {}  # token path -> (path probability, kind), best source wins
        for scored, kinds in calibrated:
            for path, probability, kind in zip(scored.node_paths(), scored.confidence.tolist(), kinds):
                if path not in kind_of or kind_of[path][0] < probability:
                    kind_of[path] = (probability, kind)
        merged = merge([scored for scored, _ in calibrated]) if len(calibrated) > 1 else calibrated[0][0]
        in_depth = merged.depths() <= budget.max_depth  # a hard cap, whatever a source returned
        order = sorted(np.nonzero(in_depth)[0].tolist(), key=lambda i: (-float(merged.confidence[i]), i))
        num_nodes = self._choose_size(merged.confidence[order], budget.num_nodes)
        if num_nodes == 0:
            return Draft.empty()
        draft = merged.select(np.sort(np.asarray(order[:num_nodes], np.int64)))  # parents sort before children
        self._last[request_id] = (draft, [kind_of[path][1] for path in draft.node_paths()])
        return draft

    def _choose_size(self, sorted_probs: np.ndarray, max_nodes: int) -> int:
        """How many of the best nodes to verify: argmax of (1 + sum of their probabilities) / c(1 + k)."""
        available = min(int(sorted_probs.shape[0]), max_nodes)
        if not self.adaptive:
            return available
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(sorted_probs[:available], dtype=np.float64)])
        rates = expected / np.array([self.cost_model.cost(1 + k) for k in range(available + 1)])
        return int(np.argmax(rates))  # the first maximum: ties go to the smaller tree

    def warmup(self) -> None:
        """Compile the suffix kernels on a tiny request."""
        exercise(MixtureDrafter(min_match=1, history_tokens=64))
