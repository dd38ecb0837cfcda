"""Faults injected into freespec's drafter inside a running SGLang engine (test support, see ``__init__``)."""

from __future__ import annotations

import functools


class InjectedFault(RuntimeError):
    """Raised by the drafter for the requests a test chose."""


def inject(rid_prefix: str) -> None:
    """``MixtureDrafter.propose`` raises ``InjectedFault`` for requests whose id starts with ``rid_prefix``."""
    from freespec.drafters.mixture import MixtureDrafter

    original = MixtureDrafter.propose
    if getattr(original, "injected_fault", False):
        return

    @functools.wraps(original)
    def propose(self, request_id, budget):
        if isinstance(request_id, str) and request_id.startswith(rid_prefix):
            raise InjectedFault(f"fault injected for request {request_id!r}")
        return original(self, request_id, budget)

    propose.injected_fault = True
    MixtureDrafter.propose = propose
