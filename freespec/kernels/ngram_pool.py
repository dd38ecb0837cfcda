"""Lookahead's n-gram pool: continuations keyed by their first token, bounded two ways.

Arrays (owned by ``drafters.lookahead.NgramPool``):
``slot_of_key`` [capacity] int32 (token -> slot, -1 = none), ``key_of_slot``
[max_keys] int64, ``grams`` [max_keys, G, L] int32 (each slot's continuations,
most recent first; ``L = N - 1`` tokens each, ``-1``-padded when shorter),
``counts`` [max_keys] int32, ``stamps`` [max_keys] int64 (when the slot was last
written) and ``state`` [2] int64 = (slots used, clock).

Inserting ``(key, gram)``: a key without a slot takes a free slot or evicts the
least recently written key; a gram already in the slot moves to the front
(deduplicated), a new one goes to the front and the oldest falls off past G.
Memory is ``max_keys * G * L * 4`` bytes plus 4 bytes per token id seen.

Worked example, G = 2, L = 2, max_keys = 1: insert ``5: [6, 7]``, ``5: [8, 9]``,
``5: [6, 7]`` -> slot of 5 holds ``[[6, 7], [8, 9]]``; insert ``4: [1, 2]``
-> key 5 is evicted, the slot holds ``[[1, 2]]`` for key 4.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True)
def pool_insert_kernel(slot_of_key, key_of_slot, grams, counts, stamps, state, keys, new_grams):
    # slot_of_key [capacity] int32, key_of_slot [max_keys] int64, grams [max_keys, G, L] int32,
    # counts [max_keys] int32, stamps [max_keys] int64, state [2] int64, keys [m] int64, new_grams [m, L] int64
    max_keys, num_guesses, length = grams.shape[0], grams.shape[1], grams.shape[2]
    for i in range(keys.shape[0]):
        key = keys[i]
        slot = slot_of_key[key]
        if slot < 0:
            if state[0] < max_keys:
                slot = state[0]
                state[0] += 1
            else:
                slot = 0
                for s in range(1, max_keys):
                    if stamps[s] < stamps[slot]:
                        slot = s
                slot_of_key[key_of_slot[slot]] = -1
            key_of_slot[slot] = key
            counts[slot] = 0
            slot_of_key[key] = slot
        count = counts[slot]
        pos = -1
        for g in range(count):
            same = True
            for t in range(length):
                if grams[slot, g, t] != new_grams[i, t]:
                    same = False
                    break
            if same:
                pos = g
                break
        if pos < 0:
            pos = min(count, num_guesses - 1)
            counts[slot] = min(count + 1, num_guesses)
        for g in range(pos, 0, -1):
            for t in range(length):
                grams[slot, g, t] = grams[slot, g - 1, t]
        for t in range(length):
            grams[slot, 0, t] = new_grams[i, t]
        stamps[slot] = state[1]
        state[1] += 1
