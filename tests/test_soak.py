"""Every registered drafter serves many short requests without growing, and keeps each request's text to it.

Soak: 10,000 requests (24-token prompts, 4-token outputs cut from standard-library source; every 16th
with a document, every other with a prediction, where the drafter takes them) through
each drafter of ``freespec.drafters.available()``, 8 live at a time with one ``ForwardReport`` per
simulated forward (``freespec.testing.streams.serve``), no model. Memory is the process's resident set
(``/proc/self/statm``) after ``gc.collect()`` and glibc's ``malloc_trim(0)``, read every 2,000
requests; after a warm-up of 2,000 it may not grow by more than 1 MiB (128 bytes per request; a
request's own state, its context buffer alone, is over 300 bytes). Measured on a shared 2-core
machine: flat to within 16 KiB for every drafter. Drafters with bounded shared state run with small
bounds (``SOAK_OPTIONS``) so the bound is reached during the warm-up and eviction is exercised.
After the last ``stop`` no dict or set reachable from the drafter may hold a request id.
``-m slow`` runs 3,000 longer requests per drafter (128-token prompts, 32-token outputs; read every 750
after a warm-up of 750: a request's context buffer alone is over 600 bytes, so one kept per request
would pass the 1 MiB tolerance).

Isolation: request A's text (prompt, output, documents) uses token ids no other request uses; B
and C (started after A stopped) share a phrase with A. Under its ``isolation_options`` no drafter
ever drafts A's ids for B or C; with cross-request sharing on (``SHARING_ON``) they do, which shows
the check can see a leak, and adding ``isolation_options`` turns it off.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import types

import numpy as np
import pytest

from freespec import SpecConfig
from freespec.draft import Budget
from freespec.drafters import available, drafter_class, make
from freespec.testing.streams import code_streams, serve

# small bounds on shared state (reached within the warm-up), and sharing on, to exercise eviction
SOAK_OPTIONS = {
    "ngram": {"shared": True, "max_entries": 2048},
    "suffix": {"history_tokens": 2048, "min_match": 1},
    "mixture": {"history_tokens": 2048, "ngram": True},  # its shared n-gram table is the ngram drafter's
}
# options that share text across requests, per drafter that can
SHARING_ON = {
    "ngram": {"shared": True},
    "suffix": {"history_tokens": 4096},
    "mixture": {"history_tokens": 4096},
}
MEMORY_TOLERANCE = 1 << 20
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _drafter_names():
    return [pytest.param(name, marks=pytest.mark.skipif(drafter_class(name).needs_model,
                                                          reason="drafts with the model: no model here"))
            for name in available()]


def resident_bytes() -> int | None:
    """The resident set after a full collection and returning free heap pages to the system (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def request_keys(root, is_request_id) -> list:
    """Request ids held as dict keys or set members anywhere in the object graph under ``root``."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _NOT_STATE):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            found += [key for key in obj if is_request_id(key)]
        elif isinstance(obj, (set, frozenset)):
            found += [key for key in obj if is_request_id(key)]
        stack.extend(gc.get_referents(obj))
    return found


def _documents(j, stream):
    return [stream[0][::-1].copy()] if j % 16 == 0 else None  # every 16th request brings a document


def _predictions(j, stream):
    # every other request predicts its output with a token changed, as a served request's prediction does
    if j % 2 == 0:
        return None
    predicted = np.concatenate([stream[1], stream[0][:8]])
    predicted[len(predicted) // 2] += 1
    return predicted


def _soak(name: str, num_requests: int, checkpoint: int, prompt_len: int, output_len: int):
    drafter = make(name, **SOAK_OPTIONS.get(name, {}))
    drafter.warmup()
    rss = []
    for start in range(0, num_requests, checkpoint):
        serve(drafter, code_streams(checkpoint, prompt_len, output_len, start=start), documents=_documents,
              predictions=_predictions, request_ids=((name, start + j) for j in range(checkpoint)))
        rss.append(resident_bytes())
    assert not drafter._contexts
    leftover = request_keys(drafter, lambda key: isinstance(key, tuple) and len(key) == 2 and key[0] == name)
    assert not leftover, f"{name} keeps state of finished requests: {leftover[:5]}"
    if rss[0] is not None:
        growth = max(rss[1:]) - rss[0]
        assert growth <= MEMORY_TOLERANCE, (f"{name}: resident memory grew by {growth / 1024:.0f} KiB after the "
                                            f"warm-up (every {checkpoint} requests: {[r // 1024 for r in rss]} KiB)")


@pytest.mark.parametrize("name", _drafter_names())
def test_ten_thousand_requests_leave_memory_flat(name):
    _soak(name, 10_000, 2_000, prompt_len=24, output_len=4)


@pytest.mark.slow
@pytest.mark.parametrize("name", _drafter_names())
def test_three_thousand_longer_requests_leave_memory_flat(name):
    _soak(name, 3_000, 750, prompt_len=128, output_len=32)


def test_request_keys_finds_ids_anywhere():
    class Holder:
        def __init__(self):
            self.nested = [{"x": {("r", 1): 2}}, {("r", 2)}]

    assert sorted(request_keys(Holder(), lambda k: isinstance(k, tuple) and k[0] == "r")) == [("r", 1), ("r", 2)]
    assert request_keys({"a": 1}, lambda k: isinstance(k, tuple)) == []


# ------------------------------------------------------------------------------ isolation
PHRASE = list(range(10, 22))  # common tokens every request may hold
A_PRIVATE = range(1000, 2000)  # only request A's prompt, output and documents hold these


def _a_text(rng):
    secret = rng.choice(np.arange(1000, 1500), 16, replace=False).tolist()
    doc_secret = rng.choice(np.arange(1500, 2000), 16, replace=False).tolist()
    prompt = PHRASE + secret + [30, 31] + PHRASE + secret[:4]
    output = secret[4:] + PHRASE + secret + [1000 + i for i in range(8)]
    return prompt, output, [PHRASE + doc_secret + PHRASE + doc_secret]


def _other_text(rng, base):
    own = rng.choice(np.arange(base, base + 500), 20, replace=False).tolist()
    return own + PHRASE, PHRASE[:3] + own[:6] + PHRASE + own[6:12]


def _leaks(drafter) -> list[int]:
    """Run A, B and C interleaved (C starts after A stopped); the ids of A's text drafted for B or C."""
    rng = np.random.default_rng(0)
    a_prompt, a_output, a_docs = _a_text(rng)
    texts = {"A": (a_prompt, a_output), "B": _other_text(rng, 2000), "C": _other_text(rng, 3000)}
    budget = Budget(32, 16)
    leaked = []

    def step(rid, k):
        draft = drafter.propose(rid, budget)
        if rid != "A":
            leaked.extend(t for t in draft.token_ids.tolist() if t in A_PRIVATE)
        output = texts[rid][1]
        if k < len(output):
            drafter.extend(rid, output[k: k + 1])

    drafter.start("A", a_prompt)
    if drafter.accepts_documents:
        drafter.add_documents("A", a_docs)
    drafter.start("B", texts["B"][0])
    for k in range(len(a_output)):
        step("A", k)
        step("B", k)
    drafter.stop("A")
    drafter.start("C", texts["C"][0])
    for k in range(len(texts["C"][1])):
        step("B", len(a_output) + k)
        step("C", k)
    drafter.stop("B")
    drafter.stop("C")
    return leaked


@pytest.mark.parametrize("name", _drafter_names())
def test_no_request_drafts_another_requests_text_under_isolation_options(name):
    cls = drafter_class(name)
    leaked = _leaks(make(name, **cls.isolation_options))
    assert not leaked, f"{name}{dict(cls.isolation_options)} drafted request A's tokens for another request"
    if _leaks(make(name)):  # sharing by default: then it must declare how to turn it off
        assert cls.isolation_options, f"{name} shares text across requests by default and declares no isolation_options"


@pytest.mark.parametrize("name", sorted(SHARING_ON))
def test_sharing_is_seen_and_isolation_options_turn_it_off(name):
    assert _leaks(make(name, **SHARING_ON[name])), f"{name} with {SHARING_ON[name]} should share A's text"
    options = {**SHARING_ON[name], **drafter_class(name).isolation_options}
    assert not _leaks(make(name, **options)), f"{name} with {options} still drafts A's tokens for others"


def test_a_request_sees_its_own_documents_only():
    """The documents of request A are drafted for A, never for B, in both drafters that take documents."""
    for name in [n for n in available() if drafter_class(n).accepts_documents and not drafter_class(n).needs_model]:
        drafter = make(name, **drafter_class(name).isolation_options)
        doc = list(range(500, 540))
        drafter.start("A", [1, 2] + doc[:6])
        drafter.add_documents("A", [doc])
        drafter.start("B", [1, 2] + doc[:6])
        assert set(drafter.propose("A", Budget(16, 8)).token_ids.tolist()) & set(doc[6:]), name
        draft_b = drafter.propose("B", Budget(16, 8))  # a lookahead window may ride, guessed from B's own text
        assert draft_b.candidates().num_nodes == 0 and not set(draft_b.token_ids.tolist()) & set(doc[6:]), name
        drafter.stop("A")
        drafter.stop("B")
