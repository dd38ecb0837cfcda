"""Replayed token streams: many short requests driven through a drafter, no model.

``code_streams(n)`` cuts ``n`` (prompt, output) pairs of token ids from the
Python standard library's source (the functions ``builtin:code-edit`` edits),
split into words, symbols and runs of spaces, one id per distinct piece, so
the streams repeat the way code does. ``serve(drafter, streams)`` plays a
server: up to ``live`` requests at a time, each step proposing for every live
request, reporting one ``ForwardReport`` for all of them (a batch), verifying
each draft against its recorded output (``bench.replay.ReplayedRequest``) and
stopping finished requests while new ones start.

    drafter = freespec.drafters.make("suffix")
    logs = serve(drafter, code_streams(1000), live=8, keep_drafts=True)
    logs[("serve", 0)]  # the drafts request 0 received, each as its set of token paths
"""

from __future__ import annotations

import itertools
import re
from typing import Callable, Hashable, Iterable, Iterator

import numpy as np

from ..config import SpecConfig
from ..draft import Draft
from ..drafters.base import ForwardReport

Stream = tuple[np.ndarray, np.ndarray]  # (prompt_ids, output_ids), int64 each

_PIECE = re.compile(r"\w+|[^\w\s]|\s+")


def code_texts() -> list[np.ndarray]:
    """Token ids of each standard-library function of ``builtin:code-edit`` (ids from 2, in order of appearance)."""
    from ..bench.datasets import code_sources

    vocab: dict[str, int] = {}
    return [np.array([vocab.setdefault(piece, len(vocab) + 2) for piece in _PIECE.findall(src.source)], np.int64)
            for src in code_sources()]


def code_streams(n: int, prompt_len: int = 24, output_len: int = 4, start: int = 0) -> Iterator[Stream]:
    """``n`` windows of the code texts: ``prompt_len`` tokens, then the ``output_len`` that follow.

    Request ``j`` (counting from ``start``) reads text ``j % num_texts`` at offset
    ``37 j`` modulo what fits, so consecutive requests differ and later ones revisit
    earlier texts (what a request history can exploit).
    """
    texts = code_texts()
    for j in range(start, start + n):
        text = texts[j % len(texts)]
        offset = (37 * j) % max(1, text.shape[0] - prompt_len - output_len)
        yield text[offset: offset + prompt_len], text[offset + prompt_len: offset + prompt_len + output_len]


def draft_paths(draft: Draft) -> frozenset:
    """The draft as the set of its candidates' root paths (independent of node order)."""
    return frozenset(draft.candidates().node_paths())


def serve(drafter, streams: Iterable[Stream], live: int = 8, config: SpecConfig | None = None,
          keep_drafts: bool = False, documents: Callable[[int, Stream], list] | None = None,
          request_ids: Iterator[Hashable] | None = None, forward_s: float = 0.01,
          predictions: Callable[[int, Stream], np.ndarray | None] | None = None) -> dict:
    """Drive every stream through ``drafter``, ``live`` requests at a time (see the module docstring).

    ``documents(j, stream)``: documents for request ``j`` (drafters with
    ``accepts_documents``), or None; ``predictions(j, stream)``: its predicted
    output's token ids (drafters with ``accepts_prediction``), or None. ``request_ids``: the ids to give requests
    (default ``("serve", j)``). Each simulated forward takes ``forward_s`` plus
    0.1 ms per node of the widest row, reported through ``on_forward``;
    drafters with ``observe_top_k`` get ``observe`` with the recorded tokens.
    Returns ``{request_id: [draft paths per step]}`` with ``keep_drafts``, else ``{}``.
    """
    from ..bench.replay import ReplayedRequest

    config = config or SpecConfig(max_draft_tokens=16, max_draft_depth=8)
    request_ids = request_ids or (("serve", j) for j in itertools.count())
    pending = enumerate(streams)
    logs: dict[Hashable, list] = {}
    active: list = []
    while True:
        while len(active) < live:
            j, stream = next(pending, (None, None))
            if stream is None:
                break
            request_id = next(request_ids)
            prompt, output = stream
            drafter.start(request_id, prompt)
            docs = documents(j, stream) if documents is not None and drafter.accepts_documents else None
            if docs:
                drafter.add_documents(request_id, docs)
            predicted = predictions(j, stream) if predictions is not None and drafter.accepts_prediction else None
            if predicted is not None:
                drafter.add_prediction(request_id, predicted)
            request = ReplayedRequest(drafter, request_id, prompt, output, output.shape[0] + 1, config,
                                      observe_truth=True)
            if request.done:  # nothing to generate
                drafter.stop(request_id)
            else:
                active.append(request)
        if not active:
            return logs
        drafts = [request.propose(len(active)) for request in active]
        width = max(draft.num_nodes for draft in drafts)
        drafter.on_forward(ForwardReport(tuple(r.request_id for r in active),
                                         tuple(r.num_fed(d) for r, d in zip(active, drafts)),
                                         forward_s + 1e-4 * width, all(r.forwards == 0 for r in active)))
        for request, draft in zip(active, drafts):
            if keep_drafts:
                logs.setdefault(request.request_id, []).append(draft_paths(draft))
            request.commit(draft)
        for request in active:
            if request.done:
                drafter.stop(request.request_id)
        active = [request for request in active if not request.done]
