"""Matching a context against a suffix automaton, and the occurrences of a match.

A match is ``(state, match_len)``: the last ``match_len`` tokens of the context
occur in the indexed text, and no longer suffix does; ``state`` is the
automaton state holding that string. ``advance_match`` moves it by the new
tokens only (amortized O(1) per token); ``occurrence_ends`` lists where the
matched string ends in the text by walking the state's suffix-link subtree
(each state owns at most one end position, clones own none), without a stack.

Worked example, text ``[1, 2, 3, 1, 2, 4]`` and context ``[9, 1, 2]``:
``advance_match(a, 0, 0, [9, 1, 2]) -> (state, 2)`` and
``occurrence_ends(a, state, 8) -> [4, 1]``. The walk is post-order with the
newest child first, so ends come roughly newest first (a state's own end is
the first occurrence of its strings: it comes after its subtree's); only ends
followed by a token (not the text's end, not a separator) are listed.
"""

from __future__ import annotations

import numba
import numpy as np

from .suffix_automaton import CHILD_HEAD, DST, LEN, LINK, SIB_NEXT, END, SuffixAutomaton, _find_edge


@numba.njit(cache=True)
def _advance_match(ids, states, edges, slots, state, match_len):  # ids [k], states [7, V], edges [4, E]
    for k in range(ids.shape[0]):
        c = ids[k]
        while state != 0 and _find_edge(edges, slots, state, c) == -1:
            state = states[LINK, state]
            match_len = states[LEN, state]
        e = _find_edge(edges, slots, state, c)
        if e == -1:
            state, match_len = 0, 0
        else:
            state, match_len = edges[DST, e], match_len + 1
    return state, match_len


@numba.njit(cache=True)
def _collect_ends(states, text, text_len, state, max_ends, out_ends):  # out_ends [max_ends] int64
    num_ends = 0
    u = state
    while states[CHILD_HEAD, u] != -1:
        u = states[CHILD_HEAD, u]
    while num_ends < max_ends:
        end = states[END, u]
        if end >= 0 and end + 1 < text_len and text[end + 1] >= 0:
            out_ends[num_ends] = end
            num_ends += 1
        if u == state:
            break
        if states[SIB_NEXT, u] != -1:
            u = states[SIB_NEXT, u]
            while states[CHILD_HEAD, u] != -1:
                u = states[CHILD_HEAD, u]
        else:
            u = states[LINK, u]
    return num_ends


def advance_match(automaton: SuffixAutomaton, state: int, match_len: int, ids) -> tuple[int, int]:
    """The match after the context grows by ``ids``; start from ``(0, 0)`` for an empty context."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    if not 0 <= state < automaton.num_states:
        raise ValueError(f"state {state} is not a state of this automaton ({automaton.num_states} states)")
    state, match_len = _advance_match(ids, automaton.states, automaton.edges, automaton.slots, state, match_len)
    return int(state), int(match_len)


def occurrence_ends(automaton: SuffixAutomaton, state: int, max_ends: int) -> np.ndarray:
    """Up to ``max_ends`` end positions of ``state``'s strings that have a next token; ``[num_ends]`` int64."""
    if not 0 < state < automaton.num_states:
        raise ValueError(f"state {state} is not a non-root state of this automaton")
    if max_ends < 1:
        raise ValueError(f"max_ends must be >= 1, got {max_ends}")
    out_ends = np.empty(max_ends, np.int64)
    num_ends = _collect_ends(automaton.states, automaton.text, automaton.num_tokens, state, max_ends, out_ends)
    return out_ends[:num_ends]
