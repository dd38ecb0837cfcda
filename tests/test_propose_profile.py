"""scripts/propose_profile.py: each phase counts its own time, not the time of the phases nested in it."""

import importlib.util
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "propose_profile.py"
spec = importlib.util.spec_from_file_location("propose_profile", SCRIPT)
propose_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(propose_profile)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_nested_phases_are_counted_apart_and_only_while_on():
    timer = propose_profile.PhaseTimer()
    inner = timer.wrap(lambda: _spin(0.02), "inner")
    outer = timer.wrap(lambda: (_spin(0.01), inner(), inner()), "outer")
    outer()  # off: nothing counted
    assert timer.seconds == {}
    timer.on = True
    outer()
    assert timer.seconds["inner"] == pytest.approx(0.04, abs=0.01)
    assert timer.seconds["outer"] == pytest.approx(0.01, abs=0.008)  # its own spin, not inner's


def test_every_phase_names_a_function_of_this_checkout():
    import importlib

    found = 0
    for module_name, owner_name, name, _ in propose_profile.PHASES:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        found += hasattr(owner, name)
    assert found == len(propose_profile.PHASES)
