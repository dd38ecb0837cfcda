"""Many rows in one verify forward: the KV layout and the inputs of one batched tree forward.

Rows accept different numbers of tokens each step, so their cached texts grow
at different speeds inside one host cache of shape ``[B, heads, P, dim]``.
``KVLayout`` keeps, per row, the logical position of the token in each
physical slot (``-1``: a pad or a dropped node, never attended) and the end of
the row's cached text. A forward appends ``W`` slots for every row (its pending
tokens, its draft nodes, filler up to the widest row); compaction then moves
each row's kept entries (pending tokens, accepted nodes) to the end of its own
text and crops the cache to the longest row. So a row's slots are
``[pads | its text | junk up to P]``, and the junk of a row is only how far it
lags behind the leading row, never a hole that grows step after step.

Worked example, two rows, row 0 accepts 2 nodes, row 1 none::

    before   row 0: [a b c]       row 1: [x y -]         P = 3 (row 1 lags by one)
    forward  row 0: [a b c | p n1 n2 n3]  row 1: [x y - | q m1 f f]   (f: filler)
    compact  row 0: [a b c p n1 n3]        row 1: [x y q - - -]       P = 6

Every real query sees its row's text (positions >= 0) and its own tree; pads and
fillers see only themselves (a query that sees nothing would be NaN and poison
the keys after it). Positions are logical, so RoPE sees what plain batched
decoding sees: real token ``i`` of a left-padded row sits at position ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .draft import Draft
from .transfer import Upload
from .tree import tree_attention


@dataclass
class RowStep:
    """What one row feeds this step: pending tokens (with their logical positions, -1 = pad) and a draft."""

    pending: list[int]
    pending_positions: np.ndarray  # [p] int64
    draft: Draft

    @property
    def num_fed(self) -> int:
        return len(self.pending) + self.draft.num_nodes

    def query_positions(self, width: int) -> np.ndarray:
        """[width] logical position of each fed token (nodes by depth); fillers at the last real position."""
        base = int(self.pending_positions[-1])
        nodes = base + self.draft.depths() if self.draft.num_nodes else np.zeros(0, np.int64)
        out = np.full(width, base, np.int64)
        out[: len(self.pending)] = np.maximum(self.pending_positions, 0)
        out[len(self.pending): self.num_fed] = nodes
        return out


class KVLayout:
    """Which physical cache slots each row attends to, and at which logical positions.

    ``positions`` [B, P] int64 (-1 = masked), ``ends`` [B]: row r's text is slots ``[0, ends[r])``.
    """

    def __init__(self, batch_size: int):
        self.positions = np.zeros((batch_size, 0), np.int64)
        self.ends = np.zeros(batch_size, np.int64)
        self._pending: list[_CacheMoves] = []  # cache moves made in the layout, not yet in the tensors

    @classmethod
    def of_text(cls, length: int) -> "KVLayout":
        """One row whose cache holds its first ``length`` tokens, no pads: slot i is position i."""
        layout = cls(1)
        layout.positions = np.arange(length, dtype=np.int64)[None]
        layout.ends[0] = length
        return layout

    @property
    def length(self) -> int:
        return int(self.positions.shape[1])

    @property
    def ragged(self) -> bool:
        """Some slot is masked for some row (a pad, or a row lagging behind another)."""
        return bool((self.positions < 0).any())

    # ---------------------------------------------------------------- one forward's inputs
    def inputs(self, traits, rows: list[RowStep], pad_token_id: int, device):
        """(input_ids [B, W], attention_mask, position_ids [B, W]) of one forward over ``rows``.

        The mask is ``[B, 1, W, P + W]`` (a dict of them per layer type for models
        that take one per type), boolean for sdpa, additive for eager.
        """
        upload = Upload()
        build = self.queue_inputs(traits, rows, pad_token_id, upload)
        return build(upload.send(device))

    def queue_inputs(self, traits, rows: list[RowStep], pad_token_id: int, upload: Upload):
        """``inputs`` in two halves: the host arrays go into ``upload`` now; the returned function takes
        ``upload.send(device)`` and returns ``(input_ids, attention_mask, position_ids)`` on the device."""
        width = max(row.num_fed for row in rows)
        input_ids = np.full((len(rows), width), pad_token_id, np.int64)
        position_ids = np.empty((len(rows), width), np.int64)
        for r, row in enumerate(rows):
            input_ids[r, : row.num_fed] = row.pending + row.draft.token_ids.tolist()
            position_ids[r] = row.query_positions(width)
        masks = {}
        for layer_type, window in traits.layer_windows.items():
            allowed = np.stack([self._row_mask(row, r, width, position_ids[r], window) for r, row in enumerate(rows)])
            masks[layer_type] = upload.add(allowed[:, None])
        ids_index, positions_index = upload.add(input_ids), upload.add(position_ids)

        def build(sent: list[torch.Tensor]):
            device_masks = {layer_type: _as_host_mask(sent[index], traits) for layer_type, index in masks.items()}
            mask = (device_masks if traits.per_layer_type_masks and len(device_masks) > 1
                    else next(iter(device_masks.values())))
            return sent[ids_index], mask, sent[positions_index]

        return build

    def _row_mask(self, row: RowStep, r: int, width: int, query_positions: np.ndarray, window) -> np.ndarray:
        """[W, P + W] bool: what each of row r's queries attends to."""
        num_pending, num_fed = len(row.pending), row.num_fed
        allowed = np.zeros((width, self.length + width), bool)
        allowed[:, : self.length] = self.positions[r] >= 0
        block, _ = tree_attention(row.draft.parents, num_pending, 0)  # pending causal, nodes: their ancestors
        allowed[:num_fed, self.length: self.length + num_fed] = block
        key_positions = np.concatenate([self.positions[r], query_positions])
        if window is not None:
            allowed &= key_positions[None, :] > query_positions[:, None] - window
        alone = np.zeros(width, bool)  # pads and fillers: no real query sees them, they see only themselves
        alone[:num_pending] = row.pending_positions < 0
        alone[num_fed:] = True
        alone_slots = self.length + np.nonzero(alone)[0]
        allowed[:, alone_slots] = False
        allowed[alone] = False
        allowed[alone, alone_slots] = True
        return allowed

    def row_view(self, cache, r: int, start: int) -> tuple["RowCacheView", int]:
        """(row ``r``'s cached text as a cache of one row, its length), read in place.

        ``start``: the row's left pads; its slots ``[start, ends[r])`` hold logical
        positions ``0, 1, ...`` (compaction moves kept entries to the end of the text,
        so the text has no holes). Row 1 of ``[- - a b c | x y - - -]`` with 2 pads:
        slots 2..4, length 3, position i in slot i of the view.
        """
        self.flush(cache)
        end = int(self.ends[r])
        start = min(int(start), end)  # before the prefill nothing is cached, pads included
        if not np.array_equal(self.positions[r, start:end], np.arange(end - start)):
            raise ValueError(f"row {r}'s cached text is not positions 0.. after its {start} pads")
        return RowCacheView(cache, r, start, end), end - start

    # ---------------------------------------------------------------- after the forward
    def compact(self, cache, rows: list[RowStep], kept_nodes: list[list[int]], defer: bool = False) -> None:
        """Keep each row's pending tokens and ``kept_nodes``, moved to the end of its text; crop the rest.

        The layout changes now; the cache's tensors now too, or with ``defer`` at the next ``flush``
        (the engine's next forward makes the moves from the same upload as its inputs: one copy).
        """
        width = max(row.num_fed for row in rows)
        start = self.length  # the forward's slots begin here
        row_index, src, dst = [], [], []
        new_positions = []
        for r, (row, nodes) in enumerate(zip(rows, kept_nodes)):
            slots = list(range(len(row.pending))) + [len(row.pending) + node for node in nodes]
            positions = row.query_positions(width)[slots]
            positions[: len(row.pending)] = row.pending_positions
            end = int(self.ends[r])
            row_index += [r] * len(slots)
            src += [start + s for s in slots]
            dst += list(range(end, end + len(slots)))
            new_positions.append((end, positions))
            self.ends[r] = end + len(slots)
        new_length = int(self.ends.max())
        grown = np.full((len(rows), new_length), -1, np.int64)
        keep = min(start, new_length)
        grown[:, :keep] = self.positions[:, :keep]
        for r, (end, positions) in enumerate(new_positions):
            grown[r, end: end + positions.shape[0]] = positions
        self.positions = grown
        self._queue(cache, _CacheMoves.of(row_index, src, dst, new_length), defer)

    def clear(self, cache) -> None:
        """Forget every row's cached text (a re-prefill follows)."""
        self.positions = self.positions[:, :0]
        self.ends[:] = 0
        self._queue(cache, _CacheMoves.of([], [], [], 0), defer=False)

    def drop_rows(self, cache, keep: list[int], defer: bool = False) -> None:
        """Keep only the rows ``keep`` (finished rows stop costing compute); the cache now, or at ``flush``."""
        self.positions = self.positions[keep]
        self.ends = self.ends[keep]
        new_length = int(self.ends.max()) if len(keep) else 0
        self.positions = self.positions[:, :new_length]
        self._queue(cache, _CacheMoves(np.asarray(keep, np.int64), False, new_length), defer)

    def flush(self, cache, upload: Upload | None = None):
        """Make the cache moves that ``compact`` / ``drop_rows`` deferred.

        Without ``upload``, now (one copy of their indices to the device). With one, their indices go
        into it and the returned function, given ``upload.send(device)``, makes them.
        """
        pending, self._pending = self._pending, []
        if upload is None:
            upload = Upload()
            apply = self._queue_moves(cache, pending, upload)
            apply(upload.send(_cache_device(cache)) if upload.arrays else [])
            return None
        return self._queue_moves(cache, pending, upload)

    def _queue(self, cache, moves: "_CacheMoves", defer: bool) -> None:
        self._pending.append(moves)
        if not defer:
            self.flush(cache)

    @staticmethod
    def _queue_moves(cache, pending: list["_CacheMoves"], upload: Upload):
        """Each move's indices into ``upload`` (none for a crop alone); returns the function that makes them."""
        indices = [upload.add(moves.indices) if moves.indices.size else None for moves in pending]

        def apply(sent: list[torch.Tensor]) -> None:
            for moves, index in zip(pending, indices):
                moves.apply(cache, None if index is None else sent[index])

        return apply

class RowCacheView:
    """One row's slots ``[start, end)`` of a host cache: ``layers[i].keys`` / ``.values`` [1, heads, end - start, dim].

    Views of the host's tensors (no copy), valid until the next forward or compaction;
    a layer not yet filled has ``keys is None``.
    """

    def __init__(self, cache, r: int, start: int, end: int):
        self.layers = []
        for layer in getattr(cache, "layers", ()):
            filled = getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None
            keys = layer.keys[r: r + 1, :, start:end] if filled else None
            values = layer.values[r: r + 1, :, start:end] if filled else None
            self.layers.append(_LayerView(keys, values))


@dataclass
class _LayerView:
    keys: torch.Tensor | None
    values: torch.Tensor | None


def _layers(cache):
    for layer in cache.layers:
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            yield layer


@dataclass
class _CacheMoves:
    """One change of the cache's tensors: rows kept (``rows`` [k], ``slot_moves`` None) or slots moved
    (``indices`` [3, m]: row, source slot, destination slot), then every layer cropped to ``new_length``."""

    indices: np.ndarray  # [k] rows kept, or [3, m] (row, src, dst)
    slot_moves: bool  # False: rows kept
    new_length: int

    @classmethod
    def of(cls, row_index: list[int], src: list[int], dst: list[int], new_length: int) -> "_CacheMoves":
        """Copy slot ``src[i]`` of row ``row_index[i]`` to its slot ``dst[i]`` (all at once), then crop.

        A pair whose slot does not move is skipped: the ``dst`` slots are distinct, so no other pair writes
        it, and pairs read the slots as they were. A batch of one whose accepted nodes lead the draft (a chain
        accepted from its first node, or nothing accepted) moves nothing and is only cropped.
        """
        moved = [(r, s, d) for r, s, d in zip(row_index, src, dst) if s != d]
        return cls(np.asarray(moved, np.int64).reshape(-1, 3).T.copy(), True, new_length)

    def apply(self, cache, indices: torch.Tensor | None) -> None:
        """``indices``: ``self.indices`` on the cache's device (None when it is empty)."""
        for layer in _layers(cache):
            if not self.slot_moves:
                keep = slice(0, 0) if indices is None else indices
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            elif indices is not None:
                rows, src, dst = indices
                layer.keys[rows, :, dst] = layer.keys[rows, :, src]
                layer.values[rows, :, dst] = layer.values[rows, :, src]
            layer.keys = layer.keys[..., : self.new_length, :]
            layer.values = layer.values[..., : self.new_length, :]


def _move_and_crop(cache, row_index: list[int], src: list[int], dst: list[int], new_length: int) -> None:
    """``_CacheMoves.of(...)`` made now (one copy of its indices to the cache's device)."""
    moves = _CacheMoves.of(row_index, src, dst, new_length)
    if not moves.indices.size:
        moves.apply(cache, None)
        return
    upload = Upload()
    index = upload.add(moves.indices)
    moves.apply(cache, upload.send(_cache_device(cache))[index])


def _cache_device(cache):
    for layer in _layers(cache):
        return layer.keys.device
    return "cpu"


def _as_host_mask(allowed: torch.Tensor, traits) -> torch.Tensor:
    if not traits.additive_mask:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=traits.mask_dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(traits.mask_dtype).min)
