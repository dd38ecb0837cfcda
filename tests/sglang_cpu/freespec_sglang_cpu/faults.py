"""Faults injected into freespec's drafter inside a running SGLang engine (test support, see ``__init__``)."""

from __future__ import annotations

import functools


class InjectedFault(RuntimeError):
    """Raised by the drafter for the requests a test chose."""


def inject(rid_prefix: str) -> None:
    """The mixture drafter raises ``InjectedFault`` whenever it drafts for a request whose id starts with
    ``rid_prefix``: ``propose`` for that request, ``propose_batch`` for a step that holds one."""
    from freespec.drafters.mixture import MixtureDrafter

    def chosen(request_id) -> bool:
        return isinstance(request_id, str) and request_id.startswith(rid_prefix)

    def wrap(name: str, hit):
        original = getattr(MixtureDrafter, name, None)
        if original is None or getattr(original, "injected_fault", False):
            return

        @functools.wraps(original)
        def faulty(self, request_ids, *args, **kwargs):
            if hit(request_ids):
                raise InjectedFault(f"fault injected into {name} for {request_ids!r}")
            return original(self, request_ids, *args, **kwargs)

        faulty.injected_fault = True
        setattr(MixtureDrafter, name, faulty)

    wrap("propose", chosen)
    wrap("propose_batch", lambda request_ids: any(chosen(r) for r in request_ids))
