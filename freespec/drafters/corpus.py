"""Document lookup: draft what followed the context's tail in a set of documents.

For RAG (retrieved passages) and code editing (repository files), output
copies spans of documents absent from the prompt. ``DocumentIndex`` indexes every
n-gram of ``min_match..max_match`` tokens of its documents as a word of a
pyahocorasick trie (``KEY_SEQUENCE``: integer letters). A lookup tries the
last ``max_match`` context tokens, then one fewer, ... down to ``min_match``,
with ``get()``; the first hit is the longest match. Word values are node ids:
node ``j`` owns ``starts[lo[j]:hi[j]]``, n-gram start offsets sorted by the
``max_match`` tokens from there, so an n-gram's occurrences are one slice
(no per-word lists), grouped by what follows.

The lookup is a trie, not an Aho-Corasick automaton. Why exact ``get()`` per
length and not Aho-Corasick ``iter()`` over the tail:
both find the longest match, but ``iter()`` needs ``make_automaton()``, whose
failure links we measured at ~1 us per trie node (2 s per 100k tokens) to save
at most ``max_match - min_match + 1`` short lookups. The trie is rebuilt
lazily, on the first lookup after a change. pyahocorasick scans children
linearly, so a token id is two letters (high, low bits) of ~sqrt(vocabulary)
values each: one letter per id built 10x slower at a 150k vocabulary.

Worked example, ``min_match=2``, documents ``[1, 2, 3, 4]`` and
``[9, 2, 3, 5, 6]``, context ``[..., 7, 2, 3]``: ``[7, 2, 3]`` occurs in no
document, ``[2, 3]`` occurs twice, so ``match_len=2`` and the draft merges
``4`` and ``5 -> 6`` (weights 1 and 1).

Measured (``max_match=8``, 100k text-like tokens): ~500 bytes per indexed
token (700 for all-distinct random ids), building 1.5-2.5 s (4k tokens of
per-request documents: 35 ms), ``propose`` 0.05 ms, 0.35 ms when 32
occurrences merge. A document tokenized alone may tokenize differently from
the same text inside the output (a leading space merges with the first
word): add documents as they will appear; matches resynchronize a few tokens in.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Hashable, NamedTuple

import numpy as np

from ..draft import Budget, Draft
from .base import Drafter, Lockable, as_token_array, encode_text
from .options import check_instance, check_int, check_match_range


def _ahocorasick():
    try:
        import ahocorasick
    except ImportError:
        raise ImportError("the corpus drafter needs pyahocorasick: pip install pyahocorasick") from None
    return ahocorasick


def _letters(tokens: np.ndarray, bits: int) -> np.ndarray:
    """Each token id as two trie letters, high and low ``bits``: ``[..., L] -> [..., 2L]``.

    ``_letters([1000, 7], 8) -> [3, 232, 0, 7]``.
    """
    tokens = np.asarray(tokens, np.int64)
    letters = np.stack([tokens >> bits, tokens & ((1 << bits) - 1)], -1)  # [..., L, 2]
    return letters.reshape(tokens.shape[:-1] + (2 * tokens.shape[-1],))


def document_token_ids(docs: Iterable, tokenizer=None, name: str = "documents") -> list[np.ndarray]:
    """Each document as 1-D int32 token ids: sequences of ids as they are, texts through ``tokenizer``.

    ``document_token_ids([[5, 6], "hi"], tok) -> [array([5, 6]), encode_text("hi", tok)]``;
    a text without ``tokenizer`` raises ``ValueError`` naming ``name[i]``.
    """
    if isinstance(docs, (str, bytes)) or not isinstance(docs, Iterable):
        raise ValueError(f"{name} must be a list of texts or of token-id sequences")
    out = []
    for i, doc in enumerate(docs):
        if isinstance(doc, str):
            if tokenizer is None:
                raise ValueError(f"{name}[{i}] is a text: it needs tokenizer= (an object with encode())")
            doc = encode_text(doc, tokenizer)
        out.append(as_token_array(doc, f"{name}[{i}]"))
    return out


class _Index(NamedTuple):
    trie: object  # ahocorasick.Automaton, or None when no document has min_match tokens
    tokens: np.ndarray  # [N] int32, the documents concatenated
    doc_ends: np.ndarray  # [D] int64, end offset of each document in tokens
    starts: np.ndarray  # [M] int64, n-gram start offsets sorted by their max_match tokens
    lo: np.ndarray  # [num_nodes] int64, node j's occurrences are starts[lo[j]:hi[j]]
    hi: np.ndarray  # [num_nodes] int64
    bits: int  # low bits per letter


class DocumentIndex(Lockable):
    """Token-id documents indexed for longest-tail lookup; share one across drafters and requests.

    ``max_tokens`` caps the indexed tokens: adding past it drops the oldest
    documents first (a document over ``max_tokens`` raises). ``add`` under an
    existing key replaces that document (a file that changed is re-added under
    its path). Memory bound: ``max_tokens`` tokens at ~500 bytes each once built
    (~700 for all-distinct ids; see the module docstring), so ~2-3 GB at the
    default 4M tokens; pass a smaller ``max_tokens`` to bound it lower.

    Threads: ``add``, ``remove`` and the lookups hold ``lock``; a lookup reads
    one built index throughout, so another thread's ``add`` never mixes two.
    """

    def __init__(self, min_match: int = 2, max_match: int = 8, max_tokens: int = 1 << 22):
        super().__init__()
        self.min_match, self.max_match = check_match_range(min_match, max_match)
        self.max_tokens = check_int("max_tokens", max_tokens, 1)
        self._docs: dict[Hashable, np.ndarray] = {}  # insertion order = eviction order
        self._next_key = itertools.count()
        self.num_tokens = 0
        self._index: _Index | None = None  # built lazily, on the first lookup after a change

    def add(self, doc_ids, doc_key: Hashable | None = None) -> Hashable:
        doc = as_token_array(doc_ids, "doc_ids").copy()
        if doc.shape[0] > self.max_tokens:
            raise ValueError(f"document of {doc.shape[0]} tokens is over max_tokens={self.max_tokens}")
        with self.lock:
            key = next(self._next_key) if doc_key is None else doc_key
            if key in self._docs:
                self.remove(key)
            while self.num_tokens + doc.shape[0] > self.max_tokens:
                self.remove(next(iter(self._docs)))
            self._docs[key] = doc
            self.num_tokens += doc.shape[0]
            self._index = None
        return key

    def add_text(self, text: str, tokenizer, doc_key: Hashable | None = None) -> Hashable:
        """Tokenize ``text`` with ``tokenizer.encode(text, add_special_tokens=False)`` and add it."""
        return self.add(encode_text(text, tokenizer), doc_key)

    def add_all(self, docs: Iterable, tokenizer=None) -> None:
        """Add each document: 1-D token ids, or a text (needs ``tokenizer``); see ``document_token_ids``."""
        for doc in document_token_ids(docs, tokenizer):
            self.add(doc)

    def remove(self, doc_key: Hashable) -> None:
        with self.lock:
            if doc_key not in self._docs:
                raise ValueError(f"no document with key {doc_key!r} in the index")
            self.num_tokens -= self._docs.pop(doc_key).shape[0]
            self._index = None

    def __len__(self) -> int:
        return len(self._docs)

    def __contains__(self, doc_key) -> bool:
        return doc_key in self._docs

    def find(self, tail) -> tuple[int, np.ndarray]:
        """(match_len, starts): the longest n-gram ending ``tail`` and where it starts.

        ``starts`` are offsets into the concatenated documents, grouped by the
        tokens that follow; ``(0, [])`` when no n-gram of ``min_match`` tokens matches.
        """
        return self._find(self._built(), tail)

    def _find(self, index: _Index, tail) -> tuple[int, np.ndarray]:
        tail = np.asarray(tail)[-self.max_match :]
        if index.trie is not None and tail.shape[0] >= self.min_match:
            letters = _letters(tail, index.bits).tolist()  # [2 * len(tail)]
            for match_len in range(tail.shape[0], self.min_match - 1, -1):
                node = index.trie.get(tuple(letters[2 * (tail.shape[0] - match_len) :]), -1)
                if node >= 0:
                    return match_len, index.starts[index.lo[node] : index.hi[node]]
        return 0, np.zeros(0, np.int64)

    def continuations(self, tail, max_depth: int, max_occurrences: int) -> tuple[int, list[np.ndarray]]:
        """(match_len, what followed up to max_occurrences occurrences, at most max_depth tokens each).

        Occurrences at a document's end (nothing follows) are left out first; over
        ``max_occurrences`` of the rest, take evenly spaced ones: they are grouped by
        what follows, so this is a stratified sample of continuations.
        """
        index = self._built()
        match_len, starts = self._find(index, tail)
        doc_ends = index.doc_ends[np.searchsorted(index.doc_ends, starts, side="right")]  # [m]
        followed = starts + match_len < doc_ends
        starts, doc_ends = starts[followed], doc_ends[followed]
        if starts.shape[0] > max_occurrences:
            pick = (np.arange(max_occurrences) * starts.shape[0]) // max_occurrences
            starts, doc_ends = starts[pick], doc_ends[pick]
        begins = starts + match_len  # [m]
        ends = np.minimum(doc_ends, begins + max_depth)
        return match_len, [index.tokens[b:e] for b, e in zip(begins.tolist(), ends.tolist())]

    def build(self) -> "DocumentIndex":
        """Build the lookup structure now instead of at the first lookup after a change; returns self.

        A lookup after a change builds the index while holding ``lock``, so a
        drafting thread would wait for it: to add documents without stalling
        the thread that drafts, fill and ``build()`` a new index on another
        thread, then hand it over (``integrations/sglang/external.py`` does this).
        """
        self._built()
        return self

    def _built(self) -> _Index:
        with self.lock:
            if self._index is None:
                self._index = self._build()
            return self._index

    def _build(self) -> _Index:
        docs = list(self._docs.values())
        tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)  # [N]
        doc_ends = np.cumsum([d.shape[0] for d in docs], dtype=np.int64)  # [D]
        bits = max(1, (int(tokens.max(initial=0)).bit_length() + 1) // 2)
        windows, starts, offset = [], [], 0
        for doc in docs:  # windows[i]: the max_match tokens from starts[i], -1 past the document's end
            num_starts = doc.shape[0] - self.min_match + 1
            if num_starts > 0:
                padded = np.concatenate([doc, np.full(self.max_match - 1, -1, np.int32)])
                windows.append(np.lib.stride_tricks.sliding_window_view(padded, self.max_match)[:num_starts])
                starts.append(offset + np.arange(num_starts, dtype=np.int64))
            offset += doc.shape[0]
        empty = np.zeros(0, np.int64)
        if not windows:
            return _Index(None, tokens, doc_ends, empty, empty, empty, bits)
        windows, starts = np.concatenate(windows), np.concatenate(starts)  # [M, max_match], [M]
        order = np.lexsort(windows.T[::-1])  # lexicographic; -1 (past the end) sorts first
        windows, starts = windows[order], starts[order]
        ahocorasick = _ahocorasick()
        trie = ahocorasick.Automaton(ahocorasick.STORE_INTS, ahocorasick.KEY_SEQUENCE)
        num_rows = windows.shape[0]
        differs = np.zeros(num_rows, bool)  # row i's first `length` tokens differ from row i - 1's
        differs[0] = True
        lo, hi = [], []  # per length: [num_runs] each
        num_nodes = 0
        for length in range(1, self.max_match + 1):
            differs[1:] |= windows[1:, length - 1] != windows[:-1, length - 1]
            if length < self.min_match:
                continue
            run_lo = np.nonzero(differs)[0]  # runs of rows sharing their first `length` tokens
            run_hi = np.append(run_lo[1:], num_rows)
            keep = windows[run_lo, length - 1] >= 0  # the run's n-gram has `length` tokens
            run_lo, run_hi = run_lo[keep], run_hi[keep]
            for i, key in enumerate(_letters(windows[run_lo, :length], bits).tolist()):
                trie.add_word(tuple(key), num_nodes + i)
            num_nodes += run_lo.shape[0]
            lo.append(run_lo)
            hi.append(run_hi)
        return _Index(trie, tokens, doc_ends, starts, np.concatenate(lo), np.concatenate(hi), bits)


class DocumentSource:
    """Documents a drafter drafts from: one shared ``DocumentIndex`` and one per request.

    ``CorpusDrafter`` and ``MixtureDrafter`` compose one. Per-request documents
    (``add``) are dropped at ``stop``; the shared index is seen by every request.
    min_match / max_match: of the per-request indexes; default the shared
        index's, else 2 and 8; if given with a shared index they must equal its.
    max_occurrences: read the continuations of at most this many occurrences.
    max_request_tokens: token cap of each request's own documents (a
        ``DocumentIndex`` per request, freed at ``stop``: memory grows with the
        live requests, never with the finished ones).
    """

    def __init__(self, shared: DocumentIndex | None = None, min_match: int | None = None,
                 max_match: int | None = None, max_occurrences: int = 32, max_request_tokens: int = 1 << 20):
        self.shared = check_instance("documents", shared, DocumentIndex)
        for name, value in (("min_match", min_match), ("max_match", max_match)):
            if shared is not None and value is not None and value != getattr(shared, name):
                raise ValueError(f"{name}={value} differs from the shared index's {getattr(shared, name)}")
        default = shared if shared is not None else DocumentIndex()
        self.min_match = default.min_match if min_match is None else min_match
        self.max_match = default.max_match if max_match is None else max_match
        self.max_occurrences = check_int("max_occurrences", max_occurrences, 1)
        self.max_request_tokens = max_request_tokens
        DocumentIndex(self.min_match, self.max_match, max_request_tokens)  # validates the options
        self._per_request: dict[Hashable, DocumentIndex] = {}

    def add(self, request_id: Hashable, docs: Iterable, tokenizer=None) -> None:
        """Documents (1-D token ids, or texts with ``tokenizer``) seen only by this request."""
        index = self._per_request.get(request_id)
        if index is None:
            index = DocumentIndex(self.min_match, self.max_match, self.max_request_tokens)
        index.add_all(docs, tokenizer)
        self._per_request[request_id] = index

    def stop(self, request_id: Hashable) -> None:
        self._per_request.pop(request_id, None)

    def matches(self, request_id: Hashable, context: np.ndarray, max_depth: int) -> list[tuple[int, list]]:
        """``(match_len, continuations)`` of each index (the request's, then the shared one) that matches."""
        out = []
        for index in (self._per_request.get(request_id), self.shared):
            if index is not None and len(index):
                match_len, found = index.continuations(context, max_depth, self.max_occurrences)
                if found:
                    out.append((match_len, found))
        return out


class CorpusDrafter(Drafter):
    """Drafts continuations of the context's tail found in documents (a ``DocumentSource``).

    documents: a shared ``DocumentIndex`` seen by every request of this drafter
        (and by any other drafter given the same object); None for none.
    add_documents(request_id, docs): documents seen only by that request, dropped at stop().
    min_match, max_match, max_occurrences, max_request_tokens: as ``DocumentSource``'s.

    The longest match wins: when the shared and the request's documents both
    match, only those with the longer match draft (both on a tie).
    """

    name = "corpus"
    accepts_documents = True

    def __init__(self, documents: DocumentIndex | None = None, min_match: int | None = None,
                 max_match: int | None = None, max_occurrences: int = 32, max_request_tokens: int = 1 << 20):
        super().__init__()
        self.documents = DocumentSource(documents, min_match, max_match, max_occurrences, max_request_tokens)

    def add_documents(self, request_id: Hashable, docs: Iterable, tokenizer=None) -> None:
        self._context(request_id)
        self.documents.add(request_id, docs, tokenizer)

    def _on_stop(self, request_id) -> None:
        self.documents.stop(request_id)

    def _propose(self, request_id, budget: Budget) -> Draft:
        matches = self.documents.matches(request_id, self.context(request_id), budget.max_depth)
        if not matches:
            return Draft.empty()
        best_len = max(match_len for match_len, _ in matches)
        continuations = [c for match_len, found in matches if match_len == best_len for c in found]
        return Draft.from_sequences(continuations, num_nodes=budget.num_nodes, max_depth=budget.max_depth,
                                    source=self.name)
