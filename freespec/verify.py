"""Lossless verification of a draft tree (drafts are point masses).

Glossary (as in vLLM's rejection sampler):
- *accepted* tokens: draft nodes on the path the target keeps;
- *bonus* token: the target's own token after the last accepted node (or at
  the root when nothing is accepted); every forward yields at least this one.

Rule, greedy and sampling alike: at the current node (the root first) pick
``y`` from the target — argmax of the processed scores when greedy,
``y ~ softmax(scores)`` when sampling — then descend to the child whose
token is ``y``; if there is none, emit ``y`` as the bonus token and stop.

For a chain this is "accept draft ``x`` with probability ``p(x)``, else
sample from ``p`` with ``x`` removed", and the emitted tokens have exactly
the target distribution: each emitted token is a fresh draw from ``p`` at
its own prefix, whatever the draft was. Siblings must be distinct tokens.

Worked example (greedy): root children ``{5: node 0, 7: node 2}``, node 0's
children ``{6: node 1}``; argmax at the root is 5, at node 0 is 9: the
accepted nodes are ``[0]`` and the bonus token is 9.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .transfer import Upload
from .tree import ancestor_matrix, children_by_token


@dataclass
class Acceptance:
    accepted_nodes: list[int]  # draft node indices along the kept path
    token_ids: list[int]  # emitted tokens: the accepted nodes' tokens, then the bonus token
    scores: list[torch.Tensor]  # processed scores [V] that chose each emitted token
    stopped: bool = False  # should_stop said stop after the last emitted token (no bonus after it)

    @property
    def cached_nodes(self) -> list[int]:
        """Accepted nodes whose KV stays cached: all but one that is the last emitted token."""
        return self.accepted_nodes[: len(self.token_ids) - 1]


def choose_token(scores: torch.Tensor, do_sample: bool) -> int:
    """argmax, or one draw from softmax(scores) with the global RNG, exactly as HF's sampling loop does.

    Greedy on a CPU tensor of floats takes numpy's argmax: the same index as ``torch.argmax`` (the first
    maximum; the first NaN if any), ten times faster over a 152k vocabulary (0.01 ms against 0.1-0.2 ms, one
    thread), which a step that accepts 15 tokens pays 16 times.
    """
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1).item())
    if scores.device.type == "cpu" and scores.dtype in (torch.float32, torch.float64) and scores.dim() == 1:
        return int(scores.detach().numpy().argmax())
    return int(torch.argmax(scores, dim=-1).item())


def accept_tree(
    draft_token_ids: np.ndarray,  # [n]
    parents: np.ndarray,  # [n]
    score_row: Callable[[int, list[int]], torch.Tensor],
    do_sample: bool,
    is_candidate: np.ndarray | None = None,  # [n] bool, None = every node
    should_stop: Callable[[list[int], list[torch.Tensor]], bool] | None = None,
    chosen: np.ndarray | None = None,  # [n + 1] the target's token at every row, chosen already (TreeScoring)
    choose: Callable[[torch.Tensor], int] | None = None,
) -> Acceptance:
    """Walk the tree from the root as the target would decode.

    ``score_row(row, path_token_ids)`` returns the processed scores [V] at
    ``row`` (0 = root, i + 1 = draft node i); ``path_token_ids`` are the tokens
    accepted before it, so the caller can run the user's logits processors on
    the right prefix. Only rows on the walked path are scored. Nodes with
    ``is_candidate[i] = False`` are never descended into, whatever their token.
    ``should_stop(emitted_token_ids, their_scores)`` is asked after each emitted token (EOS,
    max length, stop strings): the walk ends there, as plain decoding would, so
    a sampled walk draws exactly as many times as plain sampling does.

    ``chosen``: the token the target picks at every row, computed on the device for the whole tree at once
    (``TreeScoring.choose``); the walk then only follows it (``score_row`` still gives each emitted token's
    scores). ``choose(scores) -> token``: how a row's token is picked otherwise (``choose_token``).
    """
    children = children_by_token(parents, draft_token_ids, is_candidate)
    accepted_nodes: list[int] = []
    token_ids: list[int] = []
    scores: list[torch.Tensor] = []
    row = 0
    while True:
        row_scores = score_row(row, token_ids)
        if chosen is not None:
            token = int(chosen[row])
        elif choose is not None:
            token = choose(row_scores)
        else:
            token = choose_token(row_scores, do_sample)
        token_ids.append(token)
        scores.append(row_scores)
        child = children[row].get(token)
        if child is not None:
            accepted_nodes.append(child)
        if should_stop is not None and should_stop(token_ids, scores):
            return Acceptance(accepted_nodes, token_ids, scores, stopped=True)
        if child is None:
            return Acceptance(accepted_nodes, token_ids, scores)
        row = child + 1


# Logits processors of transformers that treat each row of a batch on its own, as a function of that row's
# token ids and scores alone: a batch of tree nodes at one depth gets each node the scores it would get alone.
ROW_WISE_PROCESSORS = frozenset({
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper", "TypicalLogitsWarper",
    "EpsilonLogitsWarper", "EtaLogitsWarper", "RepetitionPenaltyLogitsProcessor", "NoRepeatNGramLogitsProcessor",
    "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor", "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor", "SuppressTokensLogitsProcessor", "SuppressTokensAtBeginLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor", "ForcedEOSTokenLogitsProcessor", "ExponentialDecayLengthPenalty",
    "InfNanRemoveLogitsProcessor", "LogitNormalization",
})


def processes_rows_alone(processors) -> bool:
    """Every processor is one of transformers' own ``ROW_WISE_PROCESSORS`` (a subclass or a user's may not be)."""
    return all(type(p).__name__ in ROW_WISE_PROCESSORS and type(p).__module__.startswith("transformers.")
               for p in processors)


@dataclass
class TreeScoring:
    """One row's whole tree scored and chosen on the device: what it reads there, queued in the step's upload.

    ``choose`` turns the forward's logits ``[B, R, V]`` (row 0 the root, row i + 1 draft node i) into every
    row's target token at once, so a step copies one answer to the host instead of one per accepted node:

    - processors run once per depth on the nodes of that depth, each with its own token ids (the committed
      sequence, then the path from the root to it): ``depth_groups`` = (depth, node rows, their paths);
    - greedy: the argmax of every row; no float32 copy of the logits without processors (the argmax of the
      model's dtype is the argmax of its float32 conversion);
    - sampling: ``torch.multinomial(probs, 1)`` draws ``q ~ Exp(1)`` of the row's shape and takes
      ``argmax(probs / q)``; here every node at depth d divides by the same draw ``q_d``, drawn in depth
      order. Only one node per depth is on the walked path, so each emitted token is a fresh draw from its
      node's distribution (exactly plain sampling's law). With one row, the generator is set back to where
      plain sampling would leave it after the tokens emitted (``rng_states[m]`` after m tokens), so a seeded
      call draws the tokens and leaves the stream as plain sampling does.

    Worked example: draft ``tokens [5, 7, 6], parents [-1, -1, 0]`` under a root after ``seq``: depth groups
    ``(0, rows [0], -)``, ``(1, rows [1, 2], paths [[5], [7]])``, ``(2, rows [3], paths [[5, 6]])``; the
    processors see ``seq``, ``seq+[5]``, ``seq+[7]`` and ``seq+[5, 6]``.
    """

    depth_of_row: int | None  # upload index: [R] depth of every row (fillers 0), for sampling
    num_depths: int
    sequence: int | None  # upload index: [L] the row's committed tokens, for processors
    depth_groups: list[tuple[int, int, int | None]]  # (depth, upload index of node rows, of their paths)

    @classmethod
    def queue(cls, token_ids: np.ndarray, parents: np.ndarray, sequence: list[int], width: int, upload: Upload,
              sampling: bool, processing: bool) -> "TreeScoring":
        """``width``: rows of the step's logits (R = 1 + the widest draft of the batch)."""
        depths = np.zeros(width, np.int64)
        num_nodes = len(token_ids)
        if num_nodes:
            ancestors = ancestor_matrix(parents)  # [n, n]: node i's path from the root, in node order
            depths[1: num_nodes + 1] = ancestors.sum(1)
        num_depths = int(depths.max()) + 1
        groups: list[tuple[int, int, int | None]] = []
        if processing:
            groups.append((0, upload.add(np.zeros(1, np.int64)), None))
            for depth in range(1, num_depths):
                nodes = np.nonzero(depths[1: num_nodes + 1] == depth)[0]
                paths = np.stack([np.asarray(token_ids)[ancestors[i]] for i in nodes]).astype(np.int64)
                groups.append((depth, upload.add(nodes + 1), upload.add(paths)))
        return cls(upload.add(depths) if sampling else None, num_depths,
                   upload.add(np.asarray(sequence, np.int64)) if processing else None, groups)

    @staticmethod
    def choose(scorings: list["TreeScoring"], logits: torch.Tensor, sent: list[torch.Tensor], processors,
               do_sample: bool, buffer=None):
        """(chosen [B, R] int64, scores [B, R, V] that chose them, invalid [B, R] bool or None, rng states).

        ``scores`` are the processed float32 scores (in ``buffer`` if given), or the model's logits when greedy
        without processors. ``invalid`` (sampling): rows whose probabilities ``torch.multinomial`` refuses
        (inf, nan, negative). ``rng states``: with one row, the generator's state before each depth's draw
        and after the last (``None`` otherwise).
        """
        if not do_sample and not len(processors):
            return logits.argmax(-1), logits, None, None
        scores = logits.to(torch.float32) if buffer is None else buffer.fill(logits)
        if len(processors):
            for b, scoring in enumerate(scorings):
                sequence = sent[scoring.sequence]
                for depth, nodes_index, paths_index in scoring.depth_groups:
                    nodes = sent[nodes_index]
                    ids = sequence.expand(nodes.shape[0], -1)
                    if paths_index is not None:
                        ids = torch.cat([ids, sent[paths_index]], 1)
                    scores[b].index_copy_(0, nodes, processors(ids, scores[b].index_select(0, nodes)))
        if not do_sample:
            return scores.argmax(-1), scores, None, None
        probs = torch.softmax(scores, dim=-1)
        generator = _default_generator(probs.device) if len(scorings) == 1 else None
        states = [] if generator is not None else None
        chosen = []
        for b, scoring in enumerate(scorings):
            draws = []
            for _ in range(scoring.num_depths):  # as torch.multinomial draws: q ~ Exp(1) of the row's shape
                if states is not None:
                    states.append(generator.get_state())
                draws.append(torch.empty_like(probs[b, :1]).exponential_(1))
            if states is not None:
                states.append(generator.get_state())
            noise = torch.cat(draws).index_select(0, sent[scoring.depth_of_row])  # [R, V]: row i's depth's draw
            chosen.append((probs[b] / noise).argmax(-1))
        invalid = ~((probs.amax(-1) < float("inf")) & (probs.amin(-1) >= 0))
        return torch.stack(chosen), scores, invalid, states


def _default_generator(device: torch.device):
    """The generator ``torch.multinomial`` uses on ``device`` without one given (None where unknown)."""
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None
