"""Suffix automaton over int32 token ids: online, amortized O(1) append.

Why a suffix automaton: tokens arrive one step at a time, and a suffix
automaton is built online (amortized O(1) states and edges per token, no
rebuild per step). After each append, ``link[last]`` *is* the state of the
longest suffix that occurred before, so the own-context match comes for free;
a match over another text is kept as ``(state, match_len)`` and advanced by the
new tokens only. The end positions of a state's strings are the positions
owned by the states of its suffix-link subtree, which gives every occurrence of
a match without scanning the text.

Why a hash table for edges: the vocabulary is large (~1e5) and the root and
frequent tokens' states fan out to thousands of tokens, so a per-state scan
or a dense row would be slow or huge. Edges live in flat arrays; an
open-addressing table (linear probing, load <= 1/2) maps ``(src, token)`` to an
edge id; each state also chains its out-edges (needed to copy them on clone).

Worked example, ``ids=[1, 2, 3, 1, 2]``: after the last token the longest
suffix seen before is ``[1, 2]`` (``repeated_suffix() -> (state, 2)``); that
state's end positions are ``{1, 4}``, and ``1`` is followed by ``[3, 1, 2]``.

Memory (all int32): per state 7 (len, link, owned end, first edge, first
child, next/prev sibling) = 28 B; per edge 4 (src, token, dst, next) = 16 B;
2 hash slots per edge of capacity = 8 B; 4 B of text per token. Measured on
Python source split into words and symbols (8k to 1M tokens): 1.4 states and
2.1 edges per token, so 92 B/token used and 110-160 B/token allocated (``nbytes``).
"""

from __future__ import annotations

import numba
import numpy as np

from . import check_id_range

# rows of ``states`` [7, capacity]
LEN, LINK, END, EDGE_HEAD, CHILD_HEAD, SIB_NEXT, SIB_PREV = 0, 1, 2, 3, 4, 5, 6
# rows of ``edges`` [4, capacity]
SRC, TOKEN, DST, NEXT = 0, 1, 2, 3
# entries of ``meta`` [4] int64
NUM_STATES, NUM_EDGES, LAST, TEXT_LEN = 0, 1, 2, 3
SEPARATOR = -1  # a token no query holds: matches never cross it


@numba.njit(cache=True)
def _slot_of(src, token, mask):
    key = np.int64(src) * 1000003 + np.int64(token)  # < 2**52: no overflow
    key ^= key >> 29
    key = (key & 0xFFFFFFFF) * 0x2545F491
    key ^= key >> 32
    return key & mask


@numba.njit(cache=True)
def _find_edge(edges, slots, src, token):  # edges [4, E], slots [S]
    mask = slots.shape[0] - 1
    i = _slot_of(src, token, mask)
    while True:
        e = slots[i]
        if e == -1:
            return -1
        if edges[SRC, e] == src and edges[TOKEN, e] == token:
            return e
        i = (i + 1) & mask


@numba.njit(cache=True)
def _add_edge(states, edges, slots, meta, src, token, dst):
    e = meta[NUM_EDGES]
    meta[NUM_EDGES] = e + 1
    edges[SRC, e] = src
    edges[TOKEN, e] = token
    edges[DST, e] = dst
    edges[NEXT, e] = states[EDGE_HEAD, src]
    states[EDGE_HEAD, src] = e
    mask = slots.shape[0] - 1
    i = _slot_of(src, token, mask)
    while slots[i] != -1:
        i = (i + 1) & mask
    slots[i] = e


@numba.njit(cache=True)
def _new_state(states, meta, length, end):
    v = meta[NUM_STATES]
    meta[NUM_STATES] = v + 1
    states[LEN, v] = length
    states[END, v] = end
    states[LINK, v] = -1
    states[EDGE_HEAD, v] = -1
    states[CHILD_HEAD, v] = -1
    states[SIB_NEXT, v] = -1
    states[SIB_PREV, v] = -1
    return v


@numba.njit(cache=True)
def _add_child(states, parent, v):
    """Link ``v`` under ``parent`` in the suffix-link tree, newest child first."""
    head = states[CHILD_HEAD, parent]
    states[LINK, v] = parent
    states[SIB_PREV, v] = -1
    states[SIB_NEXT, v] = head
    if head != -1:
        states[SIB_PREV, head] = v
    states[CHILD_HEAD, parent] = v


@numba.njit(cache=True)
def _edges_needed(states, edges, slots, last, c):
    """How many edges appending token ``c`` adds (a dry run, same amortized cost as the real step)."""
    need = 0
    p = last
    while p != -1 and _find_edge(edges, slots, p, c) == -1:
        need += 1
        p = states[LINK, p]
    if p != -1:
        q = edges[DST, _find_edge(edges, slots, p, c)]
        if states[LEN, p] + 1 != states[LEN, q]:  # a clone copies q's edges: one more if
            need += 1  # q is on the suffix path and gains its edge by c first (q == last does)
            e = states[EDGE_HEAD, q]
            while e != -1:
                need += 1
                e = edges[NEXT, e]
    return need


@numba.njit(cache=True)
def _take_place(states, new, old):
    """Put state ``new`` where ``old`` is in the suffix-link tree (same parent, same siblings)."""
    parent, prev, nxt = states[LINK, old], states[SIB_PREV, old], states[SIB_NEXT, old]
    states[LINK, new] = parent
    states[SIB_PREV, new] = prev
    states[SIB_NEXT, new] = nxt
    if prev != -1:
        states[SIB_NEXT, prev] = new
    else:
        states[CHILD_HEAD, parent] = new
    if nxt != -1:
        states[SIB_PREV, nxt] = new


@numba.njit(cache=True)
def _append_tokens(ids, text, states, edges, slots, meta):  # ids [k], text [T], states [7, V], edges [4, E]
    """Append ``ids``; stop early (returning how many went in) when edges would overflow.

    The caller guarantees room for the text and for 2 states per token.
    """
    for k in range(ids.shape[0]):
        c = ids[k]
        if meta[NUM_EDGES] + _edges_needed(states, edges, slots, meta[LAST], c) > edges.shape[1]:
            return k
        pos = meta[TEXT_LEN]
        text[pos] = c
        meta[TEXT_LEN] = pos + 1
        last = meta[LAST]
        cur = _new_state(states, meta, states[LEN, last] + 1, pos)
        p = last
        while p != -1 and _find_edge(edges, slots, p, c) == -1:
            _add_edge(states, edges, slots, meta, p, c, cur)
            p = states[LINK, p]
        if p == -1:
            _add_child(states, 0, cur)
        else:
            q = edges[DST, _find_edge(edges, slots, p, c)]
            if states[LEN, p] + 1 == states[LEN, q]:
                _add_child(states, q, cur)
            else:
                clone = _new_state(states, meta, states[LEN, p] + 1, -1)
                e = states[EDGE_HEAD, q]
                while e != -1:
                    _add_edge(states, edges, slots, meta, clone, edges[TOKEN, e], edges[DST, e])
                    e = edges[NEXT, e]
                _take_place(states, clone, q)  # the clone takes q's place under link[q]; q and cur hang under it
                _add_child(states, clone, q)
                _add_child(states, clone, cur)
                while p != -1:
                    e = _find_edge(edges, slots, p, c)
                    if e == -1 or edges[DST, e] != q:
                        break
                    edges[DST, e] = clone
                    p = states[LINK, p]
        meta[LAST] = cur
    return ids.shape[0]


@numba.njit(cache=True)
def _rehash(edges, num_edges, slots):  # edges [4, E], slots [S] all -1
    mask = slots.shape[0] - 1
    for e in range(num_edges):
        i = _slot_of(edges[SRC, e], edges[TOKEN, e], mask)
        while slots[i] != -1:
            i = (i + 1) & mask
        slots[i] = e


class SuffixAutomaton:
    """The automaton of one growing text; owns and grows the kernel's arrays.

    ``a = SuffixAutomaton(); a.extend([1, 2, 3, 1, 2]); a.repeated_suffix()[1] -> 2``.
    ``add_separator()`` ends a document (for a corpus of several texts).
    """

    def __init__(self, capacity: int = 64):
        capacity = 1 << (max(16, int(capacity)) - 1).bit_length()  # a power of two
        self.text = np.empty(capacity, np.int32)  # [capacity]
        self.states = np.empty((7, 2 * capacity + 1), np.int32)  # [7, num_states capacity]
        self.edges = np.empty((4, 2 * capacity), np.int32)  # [4, num_edges capacity]
        self.slots = np.full(4 * capacity, -1, np.int32)  # [2 * edge capacity]: load <= 1/2
        self.meta = np.zeros(4, np.int64)  # num_states, num_edges, last, text_len
        self.states[:, 0] = [0, -1, -1, -1, -1, -1, -1]  # the root: empty string
        self.meta[NUM_STATES] = 1

    # ---------------------------------------------------------------- growing
    def extend(self, ids) -> None:
        """Append token ids (non-negative ints); amortized O(1) per token."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"ids must be a 1-D sequence of integer token ids, got {ids.dtype} {ids.shape}")
        check_id_range(ids, "ids")
        self._append(np.ascontiguousarray(ids, dtype=np.int32))

    def add_separator(self) -> None:
        """Append the separator token: no match and no continuation crosses it."""
        self._append(np.full(1, SEPARATOR, np.int32))

    def _append(self, ids: np.ndarray) -> None:  # ids [k] int32
        if ids.size == 0:
            return
        text_len, num_states = int(self.meta[TEXT_LEN]), int(self.meta[NUM_STATES])
        if text_len + ids.size > self.text.shape[0]:
            self.text = _grown(self.text, text_len + ids.size, text_len)
        if num_states + 2 * ids.size > self.states.shape[1]:
            self.states = _grown(self.states, num_states + 2 * ids.size, num_states)
        done = 0
        while done < ids.size:
            done += _append_tokens(ids[done:], self.text, self.states, self.edges, self.slots, self.meta)
            if done < ids.size:  # out of edges: double them and the hash table
                num_edges = int(self.meta[NUM_EDGES])
                self.edges = _grown(self.edges, 2 * self.edges.shape[1], num_edges)
                self.slots = np.full(2 * self.slots.shape[0], -1, np.int32)
                _rehash(self.edges, num_edges, self.slots)

    # ---------------------------------------------------------------- reading
    def repeated_suffix(self) -> tuple[int, int]:
        """``(state, match_len)`` of the longest suffix of the text that also ends earlier."""
        state = int(self.states[LINK, self.meta[LAST]]) if self.meta[LAST] else 0
        return state, int(self.states[LEN, state])

    @property
    def num_tokens(self) -> int:
        return int(self.meta[TEXT_LEN])

    @property
    def num_states(self) -> int:
        return int(self.meta[NUM_STATES])

    @property
    def num_edges(self) -> int:
        return int(self.meta[NUM_EDGES])

    def tokens(self) -> np.ndarray:
        """The indexed text (separators are ``-1``), a view: ``[num_tokens]`` int32."""
        return self.text[: self.num_tokens]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this automaton's arrays."""
        return self.text.nbytes + self.states.nbytes + self.edges.nbytes + self.slots.nbytes + self.meta.nbytes


def _grown(arr: np.ndarray, need: int, used: int) -> np.ndarray:
    """A copy of ``arr`` with its last axis grown to at least ``need`` (doubling); first ``used`` kept."""
    size = max(need, 2 * arr.shape[-1])
    out = np.empty(arr.shape[:-1] + (size,), arr.dtype)
    out[..., :used] = arr[..., :used]
    return out
