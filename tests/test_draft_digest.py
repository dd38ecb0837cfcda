"""scripts/draft_digest.py: the drive is deterministic, and its digest sees a changed draft."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "draft_digest.py"
spec = importlib.util.spec_from_file_location("draft_digest", SCRIPT)
draft_digest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draft_digest)


def test_the_same_drive_gives_the_same_digest_and_another_drive_another():
    options, drive_options = draft_digest.CONFIGS["lookup"]
    short = {**drive_options, "num_requests": 2, "steps": 6}
    first, accepted, cpu_us = draft_digest.drive(options, **short)
    assert (first, accepted) == draft_digest.drive(options, **short)[:2]
    assert accepted > 0 and cpu_us > 0
    assert draft_digest.drive(options, **{**short, "num_nodes": 4})[0] != first  # smaller trees, other drafts


def test_flat_drive_runs_recycling_and_the_window(capsys):
    assert draft_digest.main(["flat1"]) == 0
    assert "flat1   digest" in capsys.readouterr().out
