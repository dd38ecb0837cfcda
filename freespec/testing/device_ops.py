"""What a decode loop asks of the model's device outside its forwards, counted on CPU tensors as a GPU would see it.

``DeviceOps`` is a ``TorchDispatchMode`` with a forward pre-hook and hook on the model: it sees every aten op
run outside the model's forward (the forward is the host library's, paid by plain decoding too) and sorts it:

- **round trips**, what makes the host wait for a GPU (``per_step``, one list per forward, in order):
  - ``aten._local_scalar_dense`` (``aten.item``, ``aten.is_nonzero`` under ``torch.inference_mode``): ``.item()``,
    ``int(t)``, ``bool(t)`` of a device tensor ("scalar read");
  - ``aten._to_copy`` (``aten.to`` under ``torch.inference_mode``) naming a device and making a copy: a
    blocking copy ("copy up" / "copy down"; CUDA's copy synchronizes the stream). A copy of host data is a
    copy up; a copy of device data is a copy down once the host reads it (``.numpy()``, ``.tolist()``,
    ``.item()``), else a copy on the device (plain decoding's ``logits.to(device, copy=True)``): a CPU run
    names the same device for both. ``freespec.transfer`` copies with ``copy=True`` so a CPU run makes the
    copy too: on a CPU tensor ``.to("cpu")``, ``.cpu()``, ``.numpy()`` and ``.tolist()`` copy nothing;
  - ops whose output size or answer the host must wait for (``SYNCING_OPS``: ``nonzero``, ``equal``,
    ``multinomial``, whose check of the probabilities reads a scalar, ``unique``, ...);
  - ``Tensor.tolist`` / ``.numpy()`` / ``.item()`` of a tensor that is not host data (``tolist`` and
    ``numpy`` dispatch nothing on a CPU tensor; on a CUDA one ``tolist`` copies, ``numpy`` raises): patched
    while the mode is on and counted ("Tensor.tolist"), except on host data;
- **kernels** (``work.kernels``): every other op on device data that computes (not a view, not an
  allocation), with the bytes it moves (``work.kernel_bytes``: every tensor it reads, whole, and every
  tensor it writes; a tensor written in place counts at most the bytes the op read, as an index copy
  writes what it reads, not the whole destination) and its wall time (``work.measured_s``);
- **host data**: on a CPU run, tensors the mode saw arrive on the host (a counted copy's output,
  ``torch.tensor`` / ``torch.from_numpy``: ``aten.lift_fresh``) and what ops on host data make; on a model
  on an accelerator, every CPU tensor (a copy to the CPU is then a copy down at once). Their ops are host
  work: no kernel, no round trip. A factory op (``torch.zeros``, ``torch.arange``) counts as a kernel: the dispatcher
  names a device for every one, so a CPU run cannot tell a host allocation from a device one.

Worked example: a step that takes ``argmax`` of float32 logits ``[3, 100]`` and copies the 3 int64 tokens
down makes 1 kernel of 1200 + 24 bytes and 1 round trip ("copy down", 24 bytes down).

The mode costs tens of microseconds of Python per op on a slow CPU, inside forwards too: time measured under
it is not plain decoding's. Outside forwards it estimates what it added (``work.overhead_s``: its own time
around each op, measured, plus torch's trip into Python, ``dispatch_overhead_s``), so that host work can be
read as the rest; ``freespec bench --device-model`` replaces the forwards' time by a cost curve's and the
kernels' by a device model's (``freespec.bench.device``).

    with DeviceOps(model) as ops:
        model.generate(**inputs)
    ops.per_step[1:-1]   # what each decode step did between two forwards: [["copy down", "copy up"], ...]
    ops.work             # DeviceWork(kernels=..., kernel_bytes=..., copy_bytes=..., round_trips=..., ...)
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNCING_OPS = frozenset({"nonzero", "equal", "multinomial", "unique", "_unique", "_unique2", "unique_consecutive",
                         "masked_select", "repeat_interleave"})
NOT_KERNELS = frozenset({"empty", "empty_like", "empty_strided", "_unsafe_view", "resize_", "set_", "lift_fresh",
                         "lift_fresh_copy", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                         "is_same_size"})
SCALAR_READS = frozenset({"_local_scalar_dense", "item", "is_nonzero"})  # the last two: as inference_mode shows them
_TENSOR_METHODS = ("tolist", "numpy", "item")


@dataclass
class DeviceWork:
    """Totals of the work outside forwards that ``DeviceOps`` counted on the model's device."""

    kernels: int = 0  # ops that compute on device data (a GPU launches one kernel, at least, for each)
    kernel_bytes: int = 0  # bytes those ops read and write in the device's memory
    copy_bytes: int = 0  # bytes copied between host and device, both ways
    round_trips: int = 0  # waits of the host for the device (copies, scalar reads, syncing ops, tolist ...)
    measured_s: float = 0.0  # wall seconds inside the kernels and copies, on this machine
    ops: int = 0  # every op the mode saw outside forwards (host ops and views too)
    overhead_s: float = 0.0  # what the mode itself added to the time outside forwards (estimated: see DeviceOps)
    forwards: int = 0  # forwards seen (so per-forward figures need no other counter)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class DeviceOps(TorchDispatchMode):
    """Counts, per forward (a step), the round trips and the device work outside the forward; see the module
    docstring. A context manager: entering registers the hooks, patches ``Tensor.tolist/numpy/item`` and pushes
    the mode; leaving undoes all three."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        # on an accelerator the host is plain to see: CPU tensors (on a CPU run only what the mode saw arrive)
        param = next(model.parameters(), None)
        self.cpu_is_host = param is not None and param.device.type != "cpu"
        self.host: dict[int, weakref.ref] = {}  # tensors known to be host data, by id (ids are reused: checked)
        self.in_forward = False
        self.per_step: list[list[str]] = [[]]
        self.work = DeviceWork()
        self._handles = []
        self._originals: dict[str, object] = {}
        self._dispatch_overhead_s = 0.0
        self._reading = False  # inside a patched Tensor.tolist / numpy / item, already counted
        # copies of device data made with a device named, until the host reads them (a copy down) or not:
        # id -> (tensor, kernel bytes counted for it, its time)
        self._copies: dict[int, tuple[weakref.ref, int, float]] = {}

    # ------------------------------------------------------------ entering and leaving
    def __enter__(self):
        self._dispatch_overhead_s = dispatch_overhead_s()  # measured once, here: not inside a timed call
        self._handles = [self.model.register_forward_pre_hook(self._start_forward),
                         self.model.register_forward_hook(self._end_forward)]
        self._originals = {name: getattr(torch.Tensor, name) for name in _TENSOR_METHODS}
        for name in _TENSOR_METHODS:
            setattr(torch.Tensor, name, self._counted(name))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)
            for handle in self._handles:
                handle.remove()
            self._handles, self._originals = [], {}

    def _counted(self, name: str):
        original = self._originals[name]
        mode = self

        def method(tensor, *args, **kwargs):
            if mode._reading or mode.is_host(tensor) or mode._copied_down(tensor):
                return original(tensor, *args, **kwargs)
            mode.count(f"Tensor.{name}")
            mode._reading = True  # one read, one count: not the scalar reads or copy it dispatches as well
            try:
                return original(tensor, *args, **kwargs)
            finally:
                mode._reading = False

        return method

    def _start_forward(self, *args):
        self.in_forward = True

    def _end_forward(self, *args):
        self.in_forward = False
        self.work.forwards += 1
        self.per_step.append([])

    # ------------------------------------------------------------ counting
    def count(self, what: str) -> None:
        """One round trip outside forwards."""
        if not self.in_forward and not self._reading:
            self.per_step[-1].append(what)
            self.work.round_trips += 1

    def is_host(self, tensor) -> bool:
        if self.cpu_is_host:
            return tensor.device.type == "cpu"
        ref = self.host.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.in_forward:
            return func(*args, **kwargs)
        entered = time.perf_counter()
        out, elapsed = self._sort(func, args, kwargs)
        self.work.ops += 1
        self.work.overhead_s += time.perf_counter() - entered - elapsed + self._dispatch_overhead_s
        return out

    def _sort(self, func, args, kwargs):
        """Run the op and count it; (its output, the seconds the op itself took)."""
        name = func.overloadpacket.__name__
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        inputs_host = bool(tensors) and all(self.is_host(t) for t in tensors)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        target = _copy_target(name, args, kwargs)
        if name == "lift_fresh":
            self._mark(out)
        elif name in ("to", "_to_copy") and out is args[0]:
            pass  # ``to`` where the tensor already is returns it: nothing happens
        elif target is not None and (inputs_host or self.cpu_is_host and torch.device(target).type == "cpu"):
            self.count(f"copy {'up' if inputs_host else 'down'}")
            self.work.copy_bytes += _nbytes(out)
            self.work.measured_s += elapsed
        elif name in SCALAR_READS:
            if not inputs_host and not (tensors and self._copied_down(tensors[0])):
                self.count("scalar read")
                self.work.measured_s += elapsed
        elif inputs_host:
            self._mark(out)
        else:
            if name in SYNCING_OPS:
                self.count(name)
            if name not in NOT_KERNELS and not _is_view(func, args, out):
                moved = kernel_bytes(func, args, kwargs, out)
                self.work.kernels += 1
                self.work.kernel_bytes += moved
                self.work.measured_s += elapsed
                if target is not None:  # a copy down if the host reads it, else a copy on the device
                    self._copies[id(out)] = (weakref.ref(out), moved, elapsed)
        return out, elapsed

    def _copied_down(self, tensor) -> bool:
        """Whether ``tensor`` is a copy of device data (counted as a kernel) that the host now reads: then it was
        a copy down, counted as such here (a round trip) and no longer as a kernel."""
        ref, moved, elapsed = self._copies.pop(id(tensor), (None, 0, 0.0))
        if ref is None or ref() is not tensor:
            return False
        self.work.kernels -= 1
        self.work.kernel_bytes -= moved
        self.count("copy down")
        self.work.copy_bytes += _nbytes(tensor)
        self._mark(tensor)
        return True

    def _mark(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.host[id(t)] = weakref.ref(t)


@functools.lru_cache(maxsize=None)
def dispatch_overhead_s() -> float:
    """Seconds a ``TorchDispatchMode`` adds to an op before its own Python runs (torch's trip into Python and
    back), measured once: a small op with a mode that only calls it, against the op alone, each the fastest of
    25 interleaved rounds of 50. ``DeviceOps`` adds it, and its own time around each op, to
    ``DeviceWork.overhead_s``, so that the time outside forwards can be read as it is without the mode.

    The fastest round, not the median: on a busy machine a round the scheduler interrupts reads the
    interruption as cost, and where most rounds are interrupted (2 cores, other processes) a median of a few
    long rounds read 8x the trip (45 us against 5.5), an estimate taken out of every op of a timed run."""

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.zeros(4)

    def round_s() -> float:
        t0 = time.perf_counter()
        for _ in range(50):
            torch.add(x, 1)
        return (time.perf_counter() - t0) / 50

    plain, with_mode = [], []
    for _ in range(25):
        plain.append(round_s())
        with Passthrough():
            with_mode.append(round_s())
    return max(0.0, min(with_mode) - min(plain))


def _is_view(func, args, out) -> bool:
    """Whether the op returned a view of its first argument. ``contiguous``, ``reshape`` and ``to`` may return one
    (their schemas alias, and under ``torch.inference_mode`` the mode sees them whole) or copy: then they are kernels.
    """
    if not func.is_view:
        return False
    first = args[0] if args else None
    return not (isinstance(out, torch.Tensor) and isinstance(first, torch.Tensor)) or (
        out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())


def _copy_target(name: str, args, kwargs):
    """The device a ``_to_copy`` or ``to`` names, or None (under ``torch.inference_mode`` the mode sees ``to``
    itself: ``to.device``, ``to.dtype_layout``, ``to.other``)."""
    if name not in ("to", "_to_copy"):
        return None
    if kwargs.get("device") is not None:
        return kwargs["device"]
    if name == "to" and len(args) > 1 and isinstance(args[1], (torch.device, str)):
        return args[1]
    if name == "to" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[1].device
    return None


def kernel_bytes(func, args, kwargs, out) -> int:
    """Bytes an op moves: every tensor argument it reads, whole, plus every tensor it returns; an argument it
    writes in place counts as written, at most the bytes it read (an index copy into a cache writes its source).

    ``argmax`` of float32 ``[3, 100]`` -> 1200 + 24; ``index_copy_(cache [1000], 0, idx int64 [4], src [4])`` in
    float32 -> 32 + 16 read, 48 written (not the cache's 4000).
    """
    written = set()
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    written.add(id(t))
    read = sum(_nbytes(t) for t in tree_flatten((args, kwargs))[0]
               if isinstance(t, torch.Tensor) and id(t) not in written)
    wrote = sum(min(_nbytes(t), read) if id(t) in written else _nbytes(t)
                for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    return read + wrote


def _nbytes(tensor) -> int:
    if not isinstance(tensor, torch.Tensor):
        return sum(_nbytes(t) for t in tree_flatten(tensor)[0] if isinstance(t, torch.Tensor))
    return tensor.numel() * tensor.element_size()
