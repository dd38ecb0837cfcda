"""What a serving adapter does around its drafter, whatever the engine: hints, contained errors, counters.

- **Hints.** ``parse_hints(values, channel)`` checks a request's ``documents`` and
  ``prediction`` (vLLM carries them in ``SamplingParams.extra_args``, SGLang in
  ``SamplingParams.custom_params``; ``channel`` names that field in errors), and
  ``add_hints`` hands them to the drafter, tokenizing texts::

      parse_hints({"documents": "a text", "prediction": [5, 6]}, "extra_args")
      -> Hints(documents=("a text",), prediction=(5, 6))

- **Contained errors.** Inside a server nothing of freespec's may take the engine
  down: an adapter catches what its drafter raises, drops that request's drafts
  for the step, and calls ``ServingErrors.record``, which counts every error and
  logs the first of each kind with its traceback.
- **Counters in a file.** ``write_stats`` replaces a JSON file atomically, so a
  test or a soak in another process reads a server's live requests and memory;
  ``resident_mb`` is this process's resident memory.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Hashable

import numpy as np

HINT_KEYS = ("documents", "prediction")


@dataclass(frozen=True)
class Hints:
    documents: tuple = ()  # texts (str) or token-id tuples
    prediction: str | tuple | None = None  # text, or token ids


def _token_ids(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in value)


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_hints(values, channel: str, note: str = "") -> Hints | None:
    """The hints in ``values`` (a request's per-request dict; None without any); ``ValueError`` naming
    ``channel[key]`` (then ``note``) when one is malformed. ``documents``: a list of texts or of token-id
    lists (or one text); ``prediction``: a text or a list of token ids."""
    if not isinstance(values, dict) or not any(key in values for key in HINT_KEYS):
        return None
    documents = values.get("documents", ())
    if isinstance(documents, str):
        documents = (documents,)
    if not isinstance(documents, (list, tuple)) or not all(isinstance(d, str) or _token_ids(d) for d in documents):
        raise ValueError(f"{channel}['documents']{note} must be a list of texts, or of token-id lists (or one "
                         f"text), got {_describe(documents)}")
    prediction = values.get("prediction")
    if prediction is not None and not (isinstance(prediction, str) or _token_ids(prediction)):
        raise ValueError(f"{channel}['prediction']{note} must be a text or a list of token ids, got "
                         f"{_describe(prediction)}")
    return Hints(tuple(d if isinstance(d, str) else tuple(d) for d in documents),
                 prediction if prediction is None or isinstance(prediction, str) else tuple(prediction))


def add_hints(drafter, req_id: Hashable, hints: Hints, tokenizer_for) -> None:
    """Give a (re)started request's hints to ``drafter``; ``tokenizer_for(items)`` returns the tokenizer that
    encodes the texts among ``items`` (None when all are token ids)."""
    from freespec.drafters.base import encode_text

    if hints.documents:
        drafter.add_documents(req_id, list(hints.documents), tokenizer_for(hints.documents))
    if hints.prediction is not None:
        prediction = hints.prediction
        ids = encode_text(prediction, tokenizer_for([prediction])) if isinstance(prediction, str) \
            else np.asarray(prediction, np.int64)
        drafter.add_prediction(req_id, ids)


class ServingErrors:
    """Counts the errors an adapter contained; logs the first of each kind with its traceback."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.count = 0
        self._logged: set = set()

    def record(self, kind: str, exc: BaseException, req_id: Hashable = None) -> None:
        self.count += 1
        if kind in self._logged:
            return
        self._logged.add(kind)
        where = f" for request {req_id!r}" if req_id is not None else ""
        self.logger.error("freespec: drafting failed%s (%s; later failures of this kind are counted, not logged, "
                          "%d so far): %s\n%s", where, kind, self.count, exc,
                          "".join(traceback.format_exception(exc)))


def resident_mb() -> float | None:
    """This process's resident memory in MB (Linux ``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm") as statm:
            return round(int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        return None


def write_stats(path: str, stats: dict) -> None:
    """``stats`` as JSON at ``path`` (replaced atomically), with this process's id and the time."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as out:
        json.dump({**stats, "pid": os.getpid(), "time": time.time()}, out)
    os.replace(tmp, path)


def read_stats(path: str) -> dict | None:
    """What ``write_stats`` last wrote at ``path``, or None before it wrote anything."""
    try:
        with open(path) as src:
            return json.load(src)
    except (OSError, ValueError):
        return None
