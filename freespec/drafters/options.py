"""Checks of drafter options: each raises ``ValueError`` naming the option and what it must be.

``check_int("min_match", 0, minimum=1)`` raises ``min_match must be an int >= 1, got 0``.
"""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """An integer that is not a bool: ``is_int(3) -> True``, ``is_int(True) -> False``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 0) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_number(name: str, value, low: float = 0.0, high: float = float("inf"), low_open: bool = False) -> float:
    """A real number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and value <= high
    ok = ok and (value > low if low_open else value >= low)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def check_match_range(min_match, max_match) -> tuple[int, int]:
    """``1 <= min_match <= max_match``, both ints."""
    min_match = check_int("min_match", min_match, 1)
    max_match = check_int("max_match", max_match, 1)
    if max_match < min_match:
        raise ValueError(f"max_match must be >= min_match, got {max_match} < {min_match}")
    return min_match, max_match


def check_instance(name: str, value, cls: type, optional: bool = True):
    """``value`` is a ``cls`` (or None when ``optional``)."""
    if (value is None and optional) or isinstance(value, cls):
        return value
    raise ValueError(f"{name} must be a {cls.__module__}.{cls.__name__}, got {type(value).__name__}")
