"""SpecStats: counters and timings of one generate() call."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DrafterStats:
    proposed: int = 0  # draft nodes this drafter put in verified trees
    accepted: int = 0  # of those, nodes on the accepted path

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass
class SpecStats:
    """Counters of the last call.

    ``tau`` is new tokens per target forward and row, prefill included, so plain
    decoding scores exactly 1.00, batched or not (not the mean accepted draft
    length, which is ``tau - 1``).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    forward_passes: int = 0
    row_forwards: int = 0  # forwards times the rows they verified (a batch of 4 counts 4 per forward)
    steps_with_draft: int = 0
    tokens_fed: int = 0  # tokens fed to the target after the prompt (roots + draft nodes)
    draft_tokens: int = 0  # candidate draft nodes verified
    noncandidate_tokens: int = 0  # not-candidate nodes fed (lookahead windows), never accepted
    accepted_draft_tokens: int = 0
    draft_s: float = 0.0  # time in the drafter (propose/extend/observe)
    verify_s: float = 0.0  # time in target forwards and verification
    forward_s: float = 0.0  # of verify_s: time inside the model's forward calls
    tensor_s: float = 0.0  # tensor work on the model's device outside forwards: copies up and down, logits
    #                        conversion, processors, argmax / sampling, top-k (on a GPU: launches and waits)
    total_s: float = 0.0
    fallback_reason: str | None = None  # set when generate() ran without speculation
    per_drafter: dict[str, DrafterStats] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        """New tokens per row and target forward (a batch's rows each count)."""
        return self.new_tokens / self.row_forwards if self.row_forwards else 0.0

    @property
    def host_s(self) -> float:
        """Time outside forwards and outside tensor work: Python, Numba, drafting, bookkeeping (paid as it is on
        any device)."""
        return max(0.0, self.total_s - self.forward_s - self.tensor_s)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s else 0.0

    def count_draft(self, draft, accepted_nodes, default_source: str) -> None:
        """Count one verified draft: its candidates per source, and which were accepted."""
        if not draft.num_nodes:
            return
        self.steps_with_draft += 1
        self.draft_tokens += draft.num_candidates
        self.noncandidate_tokens += draft.num_nodes - draft.num_candidates
        self.accepted_draft_tokens += len(accepted_nodes)
        sources = draft.sources or ("",) * draft.num_nodes
        if draft.is_candidate is not None:
            sources = [sources[i] for i in np.nonzero(draft.is_candidate)[0].tolist()]
        for name, count in Counter(sources).items():  # names in the order of their first node, as one by one
            self.drafter(name or default_source).proposed += count
        for i in accepted_nodes:
            self.drafter(draft.node_source(i) or default_source).accepted += 1

    def drafter(self, name: str) -> DrafterStats:
        if name not in self.per_drafter:
            self.per_drafter[name] = DrafterStats()
        return self.per_drafter[name]

    def summary(self) -> str:
        parts = [
            f"{self.new_tokens} new tokens in {self.forward_passes} forwards (tau {self.tau:.2f})",
            f"{self.tokens_per_s:.1f} tok/s",
            f"draft {self.draft_s * 1e3:.0f} ms, verify {self.verify_s * 1e3:.0f} ms",
            f"forwards {self.forward_s * 1e3:.0f} ms, tensor work {self.tensor_s * 1e3:.0f} ms, "
            f"host {self.host_s * 1e3:.0f} ms",
        ]
        for name, d in sorted(self.per_drafter.items()):
            parts.append(f"{name}: {d.accepted}/{d.proposed} accepted")
        if self.fallback_reason:
            parts.append(f"fallback: {self.fallback_reason}")
        return "; ".join(parts)
