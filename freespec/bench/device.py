"""A stated price for tensor work on the model's device: ``freespec bench --simulate ... --device-model SPEC``.

Under ``--simulate`` forwards cost a cost curve's time, but the work between them on the model's device (logits
conversion, processors, argmax or sampling, top-k, the copies up and down) would still be paid at this CPU's
prices: a float32 argmax over a 65-row tree and a 152k vocabulary takes milliseconds here and a few microseconds
on a GPU. ``DeviceModel`` charges that work instead, from what ``freespec.testing.device_ops.DeviceOps`` counted
outside the forwards of one generate() call (``DeviceWork``):

    charge = kernels x launch_us + kernel_bytes / bandwidth + copy_bytes / link + round_trips x round_trip_us

Each op on device data is one kernel launch that reads and writes its tensors once in device memory; each copy
between host and device crosses the link; each wait of the host for the device (a copy, a scalar read) costs a
round trip. The terms add up: no overlap of launches with the device's work is assumed, so the charge errs high.

A spec is a preset, or ``key=value`` pairs, or a preset with some of them changed::

    h200                                   HBM 4800 GB/s, PCIe 5 x16 at 50 GB/s, 5 us a launch, 10 us a round trip
    bandwidth=3000GB/s,launch_us=10        link 25 GB/s and round_trip_us 10 unless given
    a100,launch_us=8

Worked example: under ``bandwidth=1000GB/s,launch_us=10,link=10GB/s,round_trip_us=20`` a step of 4 kernels
moving 2,000,000 bytes, 1,000 bytes copied and 2 round trips costs 40 + 2 + 0.1 + 40 = 82.1 microseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

ARGUMENT = "--device-model"
KEYS = ("bandwidth", "launch_us", "link", "round_trip_us")
DEFAULT_LINK_GBPS = 25.0  # PCIe 4.0 x16 as measured by host-to-device copies of pinned memory, about
DEFAULT_ROUND_TRIP_US = 10.0

# name: (device memory GB/s, link GB/s, us per kernel launch, us per round trip); memory bandwidth from the
# vendors' data sheets, the link at about 80% of its PCIe generation's x16 peak
PRESETS = {
    "h200": (4800.0, 50.0, 5.0, 10.0),
    "h100": (3350.0, 50.0, 5.0, 10.0),
    "a100": (2039.0, 25.0, 5.0, 10.0),
    "l4": (300.0, 25.0, 5.0, 10.0),
}

_BANDWIDTH = re.compile(r"^([0-9.eE+-]+)\s*(GB/s|TB/s)?$", re.IGNORECASE)


@dataclass(frozen=True)
class DeviceModel:
    """Prices of a device's work outside forwards; see the module docstring."""

    bandwidth_gbps: float  # device memory, GB/s (1e9 bytes)
    launch_us: float  # per kernel
    link_gbps: float = DEFAULT_LINK_GBPS  # host <-> device copies, GB/s
    round_trip_us: float = DEFAULT_ROUND_TRIP_US  # per wait of the host for the device
    source: str = ""  # the spec it was parsed from

    def __post_init__(self):
        for key, value in (("bandwidth", self.bandwidth_gbps), ("launch_us", self.launch_us),
                           ("link", self.link_gbps), ("round_trip_us", self.round_trip_us)):
            if not math.isfinite(value) or value < 0 or (value == 0 and key in ("bandwidth", "link")):
                raise ValueError(f"{ARGUMENT}: {key} must be a {'positive' if key in ('bandwidth', 'link') else 'non-negative'} "
                                 f"finite number, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> "DeviceModel":
        """``DeviceModel.parse("h200")``, ``parse("bandwidth=3TB/s,launch_us=10")``, ``parse("a100,launch_us=8")``;
        anything else raises ``ValueError`` naming ``--device-model``."""
        parts = [part.strip() for part in str(text).split(",") if part.strip()]
        if not parts:
            raise ValueError(f"{ARGUMENT}: empty; give a preset ({', '.join(PRESETS)}) or {'=..,'.join(KEYS)}=..")
        values: dict[str, float] = {}
        if "=" not in parts[0]:
            name = parts.pop(0).lower()
            if name not in PRESETS:
                raise ValueError(f"{ARGUMENT}: unknown preset {name!r}; presets: {', '.join(PRESETS)} "
                                 f"(or key=value pairs: {', '.join(KEYS)})")
            values = dict(zip(("bandwidth", "link", "launch_us", "round_trip_us"), PRESETS[name]))
        for part in parts:
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in KEYS:
                raise ValueError(f"{ARGUMENT}: {part!r} is not key=value with a key of {', '.join(KEYS)} "
                                 f"(a preset comes first: {', '.join(PRESETS)})")
            values[key] = _gbps(value, key) if key in ("bandwidth", "link") else _number(value, key)
        missing = [key for key in ("bandwidth", "launch_us") if key not in values]
        if missing:
            raise ValueError(f"{ARGUMENT}: {' and '.join(missing)} missing (e.g. bandwidth=3000GB/s,launch_us=10, "
                             f"or a preset: {', '.join(PRESETS)})")
        return cls(values["bandwidth"], values["launch_us"], values.get("link", DEFAULT_LINK_GBPS),
                   values.get("round_trip_us", DEFAULT_ROUND_TRIP_US), str(text))

    def charge_s(self, kernels: int, kernel_bytes: int, copy_bytes: int, round_trips: int) -> float:
        """Seconds the model charges for that work (the module docstring's formula)."""
        return (kernels * self.launch_us * 1e-6 + kernel_bytes / (self.bandwidth_gbps * 1e9)
                + copy_bytes / (self.link_gbps * 1e9) + round_trips * self.round_trip_us * 1e-6)

    def charge_work(self, work) -> float:
        """``charge_s`` of a ``DeviceWork``."""
        return self.charge_s(work.kernels, work.kernel_bytes, work.copy_bytes, work.round_trips)

    def describe(self) -> str:
        return (f"{self.source + ': ' if self.source else ''}kernels x {self.launch_us:g} us + bytes / "
                f"{self.bandwidth_gbps:g} GB/s + copied bytes / {self.link_gbps:g} GB/s + round trips x "
                f"{self.round_trip_us:g} us")

    def as_dict(self) -> dict:
        return {**asdict(self), "description": self.describe()}


def _number(value: str, key: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{ARGUMENT}: {key}={value!r} is not a number") from None


def _gbps(value: str, key: str) -> float:
    """``"3000GB/s"`` -> 3000, ``"4.8TB/s"`` -> 4800, ``"50"`` -> 50 (GB/s)."""
    match = _BANDWIDTH.match(value.strip())
    if not match:
        raise ValueError(f"{ARGUMENT}: {key}={value!r} is not a bandwidth (e.g. 3000GB/s, 4.8TB/s)")
    number = _number(match.group(1), key)
    return number * 1000 if (match.group(2) or "").upper() == "TB/S" else number
