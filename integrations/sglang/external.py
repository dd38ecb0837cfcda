"""SGLang's external corpora, served from the drafter's shared ``DocumentIndex``.

SGLang loads a corpus (``--speculative-ngram-external-corpus-path`` at start,
the ``/add_external_corpus`` endpoint later) on a background thread while the
scheduler thread keeps drafting, then commits it from the scheduler thread;
remove, list and reset come from the scheduler thread. So indexes are
copy-on-write and every build happens off the drafting thread:

- ``load`` (any thread) builds a new ``DocumentIndex`` holding every committed
  corpus and the new one, and builds its lookup structure there
  (``DocumentIndex.build``): the drafting thread never builds one.
- ``commit`` (scheduler) hands that index to the drafter: one reference
  assignment. If the committed set changed while it was built, the index is
  rebuilt on a background thread, and the new corpus is served when ``poll``
  finds it done.
- ``remove`` (scheduler) stops serving the corpus at once (the drafter gets an
  index of the remaining corpora, rebuilt on a background thread; until then
  an empty one), and only then forgets it: nothing is left half removed.

Corpora never exceed the shared index's ``max_tokens`` (a load that would
raises), so the index never evicts a committed corpus's documents.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from freespec.drafters.corpus import DocumentIndex, DocumentSource


@dataclass(frozen=True)
class _Loaded:
    arrays: list  # [num_chunks] 1-D int64 token arrays
    index: DocumentIndex  # every corpus committed at `generation`, and this one; built
    generation: int


class ExternalCorpora:
    """Named token corpora behind one drafter's shared ``DocumentIndex`` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._committed: dict[str, list] = {}  # corpus_id -> chunks, in commit order
        self._counts: dict[str, int] = {}  # corpus_id -> tokens, as committed
        self._loaded: dict[str, _Loaded] = {}  # loaded, not yet committed
        self._generation = 0  # bumped whenever the committed set changes
        self._rebuilt: tuple[int, DocumentIndex] | None = None  # a background rebuild's result
        self._threads: list[threading.Thread] = []
        self._source: DocumentSource | None = None
        self._served: DocumentIndex | None = None  # what the drafter reads
        self._options: tuple[int, int, int] | None = None  # min_match, max_match, max_tokens

    # ------------------------------------------------------------ the drafter
    def attach(self, drafter) -> bool:
        """Serve the corpora from ``drafter``'s shared index (after the drafter is built or rebuilt).

        Returns False when the drafter has no shared ``DocumentIndex``.
        """
        source = getattr(drafter, "documents", None)
        if not isinstance(source, DocumentSource) or source.shared is None:
            self._source = None
            return False
        self._source = source
        if self._options is None:
            shared = source.shared
            self._options = (shared.min_match, shared.max_match, shared.max_tokens)
            self._served = shared
        source.shared = self._served
        return True

    @property
    def attached(self) -> bool:
        return self._source is not None

    def _serve(self, index: DocumentIndex) -> None:
        self._served = index
        if self._source is not None:
            self._source.shared = index

    def _new_index(self, corpora: Iterable[tuple[str, Sequence[np.ndarray]]]) -> DocumentIndex:
        min_match, max_match, max_tokens = self._options
        index = DocumentIndex(min_match, max_match, max_tokens)
        for corpus_id, arrays in corpora:
            for i, array in enumerate(arrays):
                index.add(array, (corpus_id, i))
        return index.build()

    # ---------------------------------------------------------- SGLang's calls
    def load(self, corpus_id: str, chunks: Iterable[Sequence[int]], budget: int) -> int:
        """Index ``chunks`` under ``corpus_id`` with the committed corpora (on the calling thread); token count."""
        if self._options is None:
            raise RuntimeError("ExternalCorpora.load before attach() to a drafter with a shared index")
        with self._lock:
            if corpus_id in self._committed or corpus_id in self._loaded:
                raise ValueError(f"External corpus '{corpus_id}' already exists. Remove it before adding "
                                 f"a new corpus with the same id.")
            snapshot, generation, held = list(self._committed.items()), self._generation, self._held_locked()
        capacity = min(budget, self._options[2] - held)
        arrays, num_tokens = [], 0
        for chunk in chunks:
            array = np.asarray(list(chunk), np.int64)
            num_tokens += array.shape[0]
            if num_tokens > capacity:
                limit = "remaining token budget" if capacity == budget else "shared document index's max_tokens"
                raise ValueError(f"External corpus '{corpus_id}' exceeds the {limit} ({capacity})")
            if array.shape[0]:
                arrays.append(array)
        if num_tokens == 0:
            raise ValueError(f"External corpus '{corpus_id}' is empty: no tokens were loaded")
        index = self._new_index(snapshot + [(corpus_id, arrays)])
        with self._lock:
            if corpus_id in self._committed or corpus_id in self._loaded:
                raise ValueError(f"External corpus '{corpus_id}' was added while it loaded")
            self._loaded[corpus_id] = _Loaded(arrays, index, generation)
        return num_tokens

    def commit(self, corpus_id: str, num_tokens: int) -> None:
        """Serve a loaded corpus (scheduler thread)."""
        with self._lock:
            loaded = self._loaded.pop(corpus_id, None)
            if loaded is None:
                raise ValueError(f"External corpus '{corpus_id}' was not loaded, or was committed already")
            self._committed[corpus_id] = loaded.arrays
            self._counts[corpus_id] = int(num_tokens)
            fresh = loaded.generation == self._generation
            self._generation += 1
            if fresh:
                self._serve(loaded.index)
            else:  # a corpus came or went while this one loaded: its index is stale
                self._rebuild_locked()

    def remove(self, corpus_id: str) -> None:
        """Stop serving ``corpus_id`` now (scheduler thread); the others come back once re-indexed."""
        with self._lock:
            if corpus_id not in self._committed:
                raise ValueError(f"External corpus '{corpus_id}' does not exist")
            self._generation += 1
            self._serve(self._new_index([]))  # the removed corpus is never drafted from again
            del self._committed[corpus_id]
            del self._counts[corpus_id]
            if self._committed:
                self._rebuild_locked()

    def token_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def held_tokens(self) -> int:
        """Tokens committed or loaded (the budget SGLang's flag caps)."""
        with self._lock:
            return self._held_locked()

    def _held_locked(self) -> int:
        return sum(self._counts.values()) + sum(sum(a.shape[0] for a in x.arrays) for x in self._loaded.values())

    # ---------------------------------------------------- background rebuilds
    def _rebuild_locked(self) -> None:
        """Index the committed corpora on a new thread (caller holds the lock)."""
        generation, snapshot = self._generation, list(self._committed.items())

        def rebuild():
            index = self._new_index(snapshot)
            with self._lock:
                if generation == self._generation:  # else a newer change started a newer rebuild
                    self._rebuilt = (generation, index)

        thread = threading.Thread(target=rebuild, name="freespec-corpus-rebuild", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def poll(self) -> None:
        """Serve a finished background rebuild (scheduler thread, each step; O(1) when there is none)."""
        if self._rebuilt is None:
            return
        with self._lock:
            if self._rebuilt is not None and self._rebuilt[0] == self._generation:
                self._serve(self._rebuilt[1])
            self._rebuilt = None

    def wait(self, timeout: float | None = None) -> None:
        """Wait for background rebuilds, then serve the result (tests, shutdown)."""
        for thread in list(self._threads):
            thread.join(timeout)
        self.poll()
