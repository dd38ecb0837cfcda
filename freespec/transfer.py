"""A step's data between the host and the model's device: one copy up, one copy down.

On a GPU a blocking copy between host and device waits until the device has run everything queued
before it: a round trip, during which the host waits for the device and then the device for the host.
A decode step needs two of them, whatever its tree size and batch:

- **up** (``Upload``): the forward's token ids, positions and masks, the cache moves the previous
  step's acceptance asked for, and what verifying the whole tree on the device reads (each node's
  depth, the token paths the logits processors see);
- **down** (``fetch``): every fed node's target token, the top-k a learning drafter observes, and
  any per-row flags, packed into one buffer of bytes.

Both copies are made with ``copy=True``, so a CPU run dispatches the same ``aten._to_copy`` a CUDA
run does (``tensor.to("cpu")`` on a CPU tensor returns the tensor itself and dispatches nothing): a
test counts them (``tests/test_syncs.py``).

Worked example: ``Upload`` of ``ids = int64 [2, 3]`` and ``allowed = bool [2, 3, 5]`` is one uint8
buffer of 48 + 30 bytes (each array at an offset that is a multiple of 8), copied once; the device
tensors are views of that copy (``view(torch.int64).view(2, 3)``).
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8  # bytes: every array of an upload starts at a multiple of the largest item size


class Upload:
    """Host arrays gathered during a step and sent to the device in one copy (``send``)."""

    def __init__(self):
        self.arrays: list[np.ndarray] = []

    def add(self, array: np.ndarray) -> int:
        """Queue ``array`` (any shape; int, float or bool); returns its index in ``send``'s list."""
        self.arrays.append(np.ascontiguousarray(array))
        return len(self.arrays) - 1

    @property
    def nbytes(self) -> int:
        return sum(-(-a.nbytes // _ALIGN) * _ALIGN for a in self.arrays)

    def send(self, device) -> list[torch.Tensor]:
        """Every queued array as a tensor on ``device`` (views of one copied buffer), in ``add`` order."""
        offsets, end = [], 0
        for array in self.arrays:
            offsets.append(end)
            end += -(-array.nbytes // _ALIGN) * _ALIGN
        buffer = np.empty(end, np.uint8)
        for array, offset in zip(self.arrays, offsets):
            buffer[offset: offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        sent = torch.from_numpy(buffer).to(device, copy=True)
        out = []
        for array, offset in zip(self.arrays, offsets):
            raw = sent[offset: offset + array.nbytes]
            out.append(raw.view(_torch_dtype(array.dtype)).view(array.shape))
        return out


def fetch(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """``[t.cpu().numpy() for t in tensors]`` in one copy: the tensors (on one device) packed as bytes.

    Packed largest item size first, so every array's offset is a multiple of its item size.
    """
    if not tensors:
        return []
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    parts = [tensors[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in order]
    packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    host = packed.to("cpu", copy=True).numpy()
    out: list[np.ndarray] = [np.empty(0)] * len(tensors)
    offset = 0
    for i, part in zip(order, parts):
        size = part.numel()
        out[i] = host[offset: offset + size].view(_numpy_dtype(tensors[i].dtype)).reshape(tensors[i].shape)
        offset += size
    return out


_DTYPES = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
           torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
           torch.float64: np.float64}
_TORCH_DTYPES = {np.dtype(v): k for k, v in _DTYPES.items()}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return _TORCH_DTYPES[np.dtype(dtype)]


def _numpy_dtype(dtype: torch.dtype):
    if dtype not in _DTYPES:
        raise ValueError(f"{dtype} has no numpy dtype: fetch it converted (bfloat16 as float32)")
    return _DTYPES[dtype]
