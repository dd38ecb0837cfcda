"""Mixture drafter: every source's draft in one tree, sized by a live cost model.

Sources, each a tree of continuations with the length of the match it came from:

- ``suffix``: a suffix automaton over the request's own prompt + output (always);
- ``suffix-shared``: a ``SharedCorpus`` of earlier requests (opt-in: ``shared_corpus_tokens``
  or ``shared_corpus``); without it nothing a request reads comes from another request;
- ``corpus``: documents, shared (``documents=Corpus``) or per request (``add_documents``);
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
``CostModel``, the forward time with ``n`` tokens fed over that with 1,
measured live from ``on_forward``. ``k = 0`` (no draft) when nothing pays.

Worked example: ``c(n) = 1 + 0.03 (n - 1)``, path probabilities
``[0.9, 0.8, 0.1, 0.02]``: k=0 gives 1.0, k=1 1.9/1.03=1.84, k=2 2.7/1.06=2.55,
k=3 2.8/1.09=2.57, k=4 2.82/1.12=2.52, so three nodes are proposed.

State across requests: the cost model (forward times) and the calibration
counts (how often nodes of each kind were accepted) are numbers about the
model and the machine and are shared; no token of one request is read by
another unless a shared corpus or a shared n-gram table is configured.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Hashable, Iterable

import numpy as np

from ..draft import Budget, Draft, merge
from ..kernels.suffix_automaton import SuffixAutomaton
from ..kernels.suffix_continuations import continuation_tree
from ..kernels.suffix_match import advance_match, occurrence_ends
from .base import Drafter, ForwardReport, exercise
from .corpus import Corpus
from .ngram_table import NgramTableDrafter
from .suffix import SharedCorpus

_RESYNC_TOKENS = 1024  # after the shared corpus changes, a live request re-matches this many tail tokens


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class CostModel:
    """c(n): forward time with ``n`` tokens fed over forward time with 1 token, measured live.

    Forwards are kept per bucket ``n in {1, 2, 4, ..., 64}`` (a forward goes to
    the nearest bucket in log2), the last ``window`` of each; a bucket's value is
    the median time over the median time of bucket 1 (a line through the
    buckets' medians, read at n=1, while bucket 1 has none). Unmeasured buckets
    are interpolated between measured ones (the prior's slope past the last);
    the prior ``1 + prior_slope (n - 1)`` holds until two buckets are measured.
    The curve is made non-decreasing and read linearly in ``n`` between buckets
    (measured on qwen2.5-coder-0.5b, 2 CPU threads: c(2..16) ~2.2, nearly flat),
    extrapolated past 64. Forwards of more than 64 tokens
    (prefills) are ignored.

    ``CostModel().cost(9) == 1.24`` before any measurement.
    """

    BUCKETS = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, prior_slope: float = 0.03, window: int = 32):
        if not prior_slope >= 0:
            raise ValueError(f"prior_slope must be >= 0, got {prior_slope!r}")
        if not _is_int(window) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.prior_slope = float(prior_slope)
        self._times = [deque(maxlen=window) for _ in self.BUCKETS]  # per bucket: forward seconds
        self._curve: np.ndarray | None = None  # c at BUCKETS, cached until the next add()

    def add(self, num_tokens_fed: int, forward_s: float) -> None:
        if num_tokens_fed < 1 or num_tokens_fed > self.BUCKETS[-1] or not forward_s > 0 or math.isinf(forward_s):
            return
        bucket = min(range(len(self.BUCKETS)), key=lambda b: abs(math.log2(self.BUCKETS[b] / num_tokens_fed)))
        self._times[bucket].append(float(forward_s))
        self._curve = None

    def prior(self, num_tokens: float) -> float:
        return 1.0 + self.prior_slope * (num_tokens - 1)

    def curve(self) -> np.ndarray:
        """c at ``BUCKETS``, ``[7]`` float64."""
        if self._curve is None:
            sizes = np.array(self.BUCKETS, np.float64)
            curve = 1.0 + self.prior_slope * (sizes - 1)
            base_s = self._one_token_s()
            if base_s is not None:
                measured = [b for b in range(1, len(sizes)) if self._times[b]]
                known_at, known = [0], [1.0]
                for b in measured:
                    known_at.append(b)
                    known.append(max(1.0, float(np.median(self._times[b])) / base_s))
                # unmeasured buckets: interpolated between measured ones, the prior's slope past the last
                curve = np.interp(sizes, sizes[known_at], known)
                last = known_at[-1]
                curve[last + 1:] = known[-1] + self.prior_slope * (sizes[last + 1:] - sizes[last])
            self._curve = np.maximum.accumulate(curve)
        return self._curve

    def _one_token_s(self) -> float | None:
        """Median 1-token forward time; without one, a line through the other buckets' medians at n=1."""
        if self._times[0]:
            return float(np.median(self._times[0]))
        measured = [(n, float(np.median(t))) for n, t in zip(self.BUCKETS, self._times) if t]
        if len(measured) < 2:
            return None
        sizes, times = np.array(measured).T
        slope, intercept = np.polyfit(sizes, times, 1)
        line_s = intercept + max(slope, 0.0)
        return float(min(times.min(), line_s)) if line_s > 0 else float(times.min())

    def cost(self, num_tokens: int) -> float:
        curve = self.curve()
        if num_tokens <= self.BUCKETS[-1]:
            return float(np.interp(num_tokens, self.BUCKETS, curve))
        slope = (curve[-1] - curve[-2]) / (self.BUCKETS[-1] - self.BUCKETS[-2])
        return float(curve[-1] + slope * (num_tokens - self.BUCKETS[-1]))

    def num_samples(self, num_tokens: int) -> int:
        return len(self._times[self.BUCKETS.index(num_tokens)])


class AcceptanceCalibrator:
    """P(node accepted | parent accepted), counted per kind of node.

    A node's kind is ``(source, effective match bucket, raw frequency bucket)``:
    the effective match is the source's match length plus the node's depth - 1
    (the text the node continues, if its parent is accepted), the raw frequency
    the node's score over its parent's. The estimate is
    ``(accepted + s * prior) / (seen + s)`` with ``s = prior_strength`` and a
    prior that grows with the match and the raw frequency. Counts fade with a
    half-life of ``half_life`` judged steps (of any kind), so estimates follow
    drift and a kind that was gated out (never proposed, never judged) drifts
    back to its prior and is tried again.

    ``probability(kind("suffix", match_len=8, depth=1, frequency=1.0))`` is the
    prior, 8 / (8 + 2) = 0.8, until ``update`` says otherwise.
    """

    MATCH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # bucket b holds match lengths in [EDGES[b-1], EDGES[b])
    FREQ_EDGES = (0.2, 0.4, 0.6, 0.8, 0.999)

    def __init__(self, prior_strength: float = 2.0, half_life: float = 128.0):
        if not prior_strength > 0 or not half_life > 0:
            raise ValueError(f"need prior_strength > 0 and half_life > 0, got {prior_strength!r}, {half_life!r}")
        self.prior_strength, self.half_life = float(prior_strength), float(half_life)
        self._counts: dict[tuple, list[float]] = {}  # kind -> [accepted, seen, clock at the last update]
        self.clock = 0  # judged steps so far

    def kind(self, source: str, match_len: int, depth: int, frequency: float) -> tuple:
        effective = match_len + depth - 1 if match_len > 0 else 0
        return (source, bisect.bisect_right(self.MATCH_EDGES, effective),
                bisect.bisect_left(self.FREQ_EDGES, frequency))

    def prior(self, kind: tuple) -> float:
        source, match_bucket, freq_bucket = kind
        frequency = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)[freq_bucket]
        match_len = ((0,) + self.MATCH_EDGES)[match_bucket]
        trust = 0.4 if match_len == 0 else match_len / (match_len + 2.0)
        return max(0.01, min(0.95, frequency * trust))

    def _faded(self, kind: tuple) -> tuple[float, float]:
        counts = self._counts.get(kind)
        if counts is None:
            return 0.0, 0.0
        fade = 0.5 ** ((self.clock - counts[2]) / self.half_life)
        return counts[0] * fade, counts[1] * fade

    def probability(self, kind: tuple) -> float:
        accepted, seen = self._faded(kind)
        return (accepted + self.prior_strength * self.prior(kind)) / (seen + self.prior_strength)

    def update(self, kind: tuple, accepted: bool) -> None:
        old_accepted, old_seen = self._faded(kind)
        self._counts[kind] = [old_accepted + float(accepted), old_seen + 1.0, self.clock]

    def tick(self) -> None:
        """One more step judged (``update`` calls of one step share a tick)."""
        self.clock += 1


class _Request:
    __slots__ = ("own", "prompt_len", "shared_state", "shared_match_len", "shared_version", "documents",
                 "last_draft", "last_kinds")

    def __init__(self, own: SuffixAutomaton, prompt_len: int):
        self.own = own
        self.prompt_len = prompt_len
        self.shared_state, self.shared_match_len, self.shared_version = 0, 0, -1
        self.documents: Corpus | None = None
        self.last_draft: Draft | None = None  # what this request proposed last, and each node's kind
        self.last_kinds: list[tuple] = []


class MixtureDrafter(Drafter):
    """Suffix + optional shared corpus, documents and n-gram table, merged and sized by a cost model.

    adaptive: size the tree from the cost model and calibrated acceptance (the
        default); False always fills ``budget.num_nodes`` with the best nodes
        (``SpecConfig.make_drafter`` passes ``adaptive_budget`` here).
    min_match / max_depth / min_prob / max_occurrences: the suffix sources' options
        (as ``SuffixDrafter``'s).
    shared_corpus_tokens: > 0 builds a private ``SharedCorpus`` of finished requests
        of that many tokens; shared_corpus: a ``SharedCorpus`` to share instead;
        corpus_prompts: index prompts too.
    documents: a ``Corpus`` seen by every request; ``add_documents`` adds per-request ones.
    ngram: consult an n-gram table when no source matches ``ngram_below`` tokens;
        ngram_shared: one table for all requests; ngram_observe_top_k: let it learn
        the target's top-k (costs ~2 ms and a top-k of the logits per step).
    prior_cost_slope: the cost model's prior, ``c(n) = 1 + slope (n - 1)``.
    """

    name = "mixture"
    accepts_documents = True

    def __init__(self, adaptive: bool = True, min_match: int = 2, max_depth: int = 64, min_prob: float = 0.1,
                 max_occurrences: int = 64, shared_corpus_tokens: int = 0, corpus_prompts: bool = False,
                 shared_corpus: SharedCorpus | None = None, documents: Corpus | None = None,
                 ngram: bool = False, ngram_below: int = 3, ngram_shared: bool = False,
                 ngram_observe_top_k: int = 0, prior_cost_slope: float = 0.03):
        super().__init__()
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        int_options = {"min_match": min_match, "max_depth": max_depth, "max_occurrences": max_occurrences,
                       "ngram_below": ngram_below}
        for option, value in int_options.items():
            if not _is_int(value) or value < 1:
                raise ValueError(f"{option} must be an int >= 1, got {value!r}")
        if not isinstance(min_prob, (int, float)) or isinstance(min_prob, bool) or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be a number in [0, 1], got {min_prob!r}")
        if not _is_int(shared_corpus_tokens) or shared_corpus_tokens < 0 or shared_corpus_tokens == 1:
            raise ValueError(f"shared_corpus_tokens must be 0 (off) or an int >= 2, got {shared_corpus_tokens!r}")
        if shared_corpus is not None and not isinstance(shared_corpus, SharedCorpus):
            raise ValueError(f"shared_corpus must be a SharedCorpus, got {type(shared_corpus).__name__}")
        if shared_corpus is not None and shared_corpus_tokens:
            raise ValueError("pass either shared_corpus= (shared) or shared_corpus_tokens= (private), not both")
        if documents is not None and not isinstance(documents, Corpus):
            raise ValueError(f"documents must be a freespec.drafters.corpus.Corpus, got {type(documents).__name__}")
        for option, value in (("ngram", ngram), ("ngram_shared", ngram_shared), ("corpus_prompts", corpus_prompts)):
            if not isinstance(value, bool):
                raise ValueError(f"{option} must be True or False, got {value!r}")
        if not _is_int(ngram_observe_top_k) or ngram_observe_top_k < 0:
            raise ValueError(f"ngram_observe_top_k must be an int >= 0, got {ngram_observe_top_k!r}")
        if not isinstance(prior_cost_slope, (int, float)) or not prior_cost_slope >= 0:
            raise ValueError(f"prior_cost_slope must be a number >= 0, got {prior_cost_slope!r}")
        self.adaptive = adaptive
        self.min_match, self.max_depth, self.min_prob = int(min_match), int(max_depth), float(min_prob)
        self.max_occurrences = int(max_occurrences)
        if shared_corpus_tokens:
            shared_corpus = SharedCorpus(shared_corpus_tokens, include_prompts=corpus_prompts)
        self.shared_corpus = shared_corpus
        self.documents = documents
        self.ngram_below = int(ngram_below)
        self.ngram = (NgramTableDrafter(shared=ngram_shared, observe_top_k=ngram_observe_top_k)
                      if ngram else None)
        self.observe_top_k = ngram_observe_top_k if ngram else 0
        self.cost_model = CostModel(prior_slope=float(prior_cost_slope))
        self.calibrator = AcceptanceCalibrator()
        self._requests: dict[Hashable, _Request] = {}

    # ---------------------------------------------------------------- lifecycle
    def _on_start(self, request_id) -> None:
        prompt_ids = self.context(request_id)
        own = SuffixAutomaton(2 * prompt_ids.size)
        own.extend(prompt_ids)
        self._requests[request_id] = _Request(own, prompt_ids.size)
        if self.ngram is not None:
            self.ngram.start(request_id, prompt_ids)

    def add_documents(self, request_id: Hashable, docs: Iterable, tokenizer=None) -> None:
        """Add documents (1-D token ids, or texts with ``tokenizer``) seen only by this request."""
        self._context(request_id)
        request = self._requests[request_id]
        if request.documents is None:
            request.documents = Corpus()
        for doc in docs:
            if isinstance(doc, str):
                if tokenizer is None:
                    raise ValueError("a text document needs tokenizer= (an object with encode())")
                request.documents.add_text(doc, tokenizer)
            else:
                request.documents.add(doc)

    def _on_extend(self, request_id, ids: np.ndarray) -> None:
        request = self._requests[request_id]
        if request.last_draft is not None:
            self._learn_outcome(request.last_draft, request.last_kinds, ids)
            request.last_draft, request.last_kinds = None, []
        request.own.extend(ids)
        if self.shared_corpus is not None and request.shared_version == self.shared_corpus.version:
            request.shared_state, request.shared_match_len = advance_match(
                self.shared_corpus.automaton, request.shared_state, request.shared_match_len, ids)
        if self.ngram is not None:
            self.ngram.extend(request_id, ids)

    def observe(self, request_id, verify_output) -> None:
        if self.ngram is not None and self.ngram.observe_top_k:
            self.ngram.observe(request_id, verify_output)

    def _on_stop(self, request_id) -> None:
        request = self._requests.pop(request_id)
        if self.ngram is not None:
            self.ngram.stop(request_id)
        if self.shared_corpus is not None:
            start = 0 if self.shared_corpus.include_prompts else request.prompt_len
            self.shared_corpus.add(request.own.tokens()[start:])

    def on_forward(self, report: ForwardReport) -> None:
        if report.prefill or report.batch_size != 1:  # a prefill's cost is the prompt's
            return
        self.cost_model.add(report.width, report.forward_s)

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
            depth = depths[i]
            if (parent >= 0 and not accepted[parent]) or depth > len(committed):
                continue
            accepted[i] = committed[depth - 1] == token
            self.calibrator.update(kinds[i], bool(accepted[i]))

    # ---------------------------------------------------------------- drafting
    def _source_drafts(self, request_id, request: _Request, budget: Budget) -> list[tuple[str, int, Draft]]:
        """(source, match_len, draft with raw frequency scores) for every source that matches."""
        out = []
        depth = min(self.max_depth, budget.max_depth)
        state, match_len = request.own.repeated_suffix()
        if match_len >= self.min_match:
            out.append(("suffix", match_len, self._suffix_draft(request.own, state, depth, budget.num_nodes)))
        if self.shared_corpus is not None:
            corpus = self.shared_corpus
            if request.shared_version != corpus.version:  # re-match the tail once per corpus change
                request.shared_state, request.shared_match_len = advance_match(
                    corpus.automaton, 0, 0, self.context(request_id)[-_RESYNC_TOKENS:])
                request.shared_version = corpus.version
            if request.shared_match_len >= self.min_match:
                out.append(("suffix-shared", request.shared_match_len,
                            self._suffix_draft(corpus.automaton, request.shared_state, depth, budget.num_nodes)))
        for documents in (request.documents, self.documents):
            if documents is not None and len(documents):
                doc_match_len, found = documents.continuations(self.context(request_id), depth, self.max_occurrences)
                if found:
                    out.append(("corpus", doc_match_len,
                                Draft.from_sequences(found, num_nodes=budget.num_nodes, max_depth=depth)))
        if self.ngram is not None and max((m for _, m, _ in out), default=0) < self.ngram_below:
            out.append(("ngram", 1, self.ngram.propose(request_id, Budget(budget.num_nodes, depth))))
        return [source for source in out if source[2].num_nodes]

    def _suffix_draft(self, automaton: SuffixAutomaton, state: int, depth: int, num_nodes: int) -> Draft:
        ends = occurrence_ends(automaton, state, self.max_occurrences)
        token_ids, parents, scores = continuation_tree(automaton.tokens(), ends, depth, num_nodes, self.min_prob)
        return Draft(token_ids, parents, scores)

    def _calibrated(self, source: str, match_len: int, draft: Draft) -> tuple[Draft, list[tuple], np.ndarray]:
        """The draft with calibrated path probabilities as scores, each node's kind and conditional probability."""
        raw = np.ones(draft.num_nodes, np.float64) if draft.confidence is None else draft.confidence.astype(np.float64)
        path_probs = np.empty(draft.num_nodes, np.float64)
        conditionals = np.empty(draft.num_nodes, np.float64)
        depths = draft.depths()
        kinds = []
        for i, parent in enumerate(draft.parents.tolist()):
            parent_raw = 1.0 if parent < 0 else raw[parent]
            frequency = raw[i] / parent_raw if parent_raw > 0 else 0.0
            kind = self.calibrator.kind(source, match_len, int(depths[i]), frequency)
            kinds.append(kind)
            conditionals[i] = self.calibrator.probability(kind)
            path_probs[i] = conditionals[i] * (1.0 if parent < 0 else path_probs[parent])
        scored = Draft(draft.token_ids, draft.parents, path_probs.astype(np.float32), (source,) * draft.num_nodes)
        return scored, kinds, path_probs

    def _propose(self, request_id, budget: Budget) -> Draft:
        request = self._requests[request_id]
        calibrated = []
        for source, match_len, draft in self._source_drafts(request_id, request, budget):
            scored, kinds, path_probs = self._calibrated(source, match_len, draft)
            calibrated.append((float(path_probs.max()), scored, kinds))
        if not calibrated:
            return Draft.empty()
        calibrated.sort(key=lambda c: -c[0])  # the most trusted source names shared nodes
        kind_of: dict[tuple, tuple] = {}  # token path -> (path probability, kind), best source wins
        for _, scored, kinds in calibrated:
            paths: list[tuple] = []
            for i, parent in enumerate(scored.parents.tolist()):
                path = (paths[parent] if parent >= 0 else ()) + (int(scored.token_ids[i]),)
                paths.append(path)
                if path not in kind_of or kind_of[path][0] < scored.confidence[i]:
                    kind_of[path] = (float(scored.confidence[i]), kinds[i])
        merged = merge([scored for _, scored, _ in calibrated]) if len(calibrated) > 1 else calibrated[0][1]
        in_depth = merged.depths() <= budget.max_depth  # a hard cap, whatever a source returned
        order = sorted(np.nonzero(in_depth)[0].tolist(), key=lambda i: (-float(merged.confidence[i]), i))  # parents first
        num_nodes = self._choose_size(merged.confidence[order], budget.num_nodes)
        if num_nodes == 0:
            return Draft.empty()
        draft = merged.select(np.sort(np.asarray(order[:num_nodes], np.int64)))
        paths = []
        kinds = []
        for i, parent in enumerate(draft.parents.tolist()):
            path = (paths[parent] if parent >= 0 else ()) + (int(draft.token_ids[i]),)
            paths.append(path)
            kinds.append(kind_of[path][1])
        request.last_draft, request.last_kinds = draft, kinds
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
        exercise(MixtureDrafter(min_match=1, shared_corpus_tokens=64))
