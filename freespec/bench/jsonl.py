"""JSON Lines files of the benchmark (Spec-Bench datasets, traces): one reader, one writer.

``read_jsonl(path, parse, "trace")`` parses every non-blank line with
``parse(record)``; any error names the file and the line, e.g.
``traces.jsonl:3: not a trace (trace lacks 'output_ids')``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")


def read_jsonl(path: str | Path, parse: Callable[[Any], T], what: str, missing_hint: str = "") -> list[T]:
    """``[parse(record) for each non-blank line]``; ``what`` names a record in errors.

    ``parse`` raises ``ValueError``, ``KeyError`` or ``TypeError`` for a bad
    record; a missing file, a line that is not JSON, a bad record and a file
    without records raise ``ValueError`` (with the line number where there is one).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist{missing_hint}")
    out = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(parse(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: not a {what} ({exc})") from None
    if not out:
        raise ValueError(f"{what} file {str(path)!r} holds no records")
    return out


def write_jsonl(records: Iterable[Any], path: str | Path) -> Path:
    """One JSON object per line; returns ``path``."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path
