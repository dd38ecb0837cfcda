"""SpecConfig: everything that configures speculation, in one frozen dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class SpecConfig:
    """How freespec speculates.

    drafter: a registered drafter name (``freespec.drafters.available()``; default ``mixture``) or a
        ``Drafter`` instance (shared across calls: that is how a corpus is shared).
    drafter_options: keyword arguments for the named drafter's constructor.
    max_draft_tokens: most tree nodes verified per step (the root not counted).
    max_draft_depth: longest path in a draft. Both are caps: the default ``mixture``
        drafter sizes each tree below them from its live cost model, so they are set
        for copy-heavy output (code edits accept 30+ token chains); a drafter without
        a cost model fills them whenever it has a match.
    adaptive_budget: let the drafter size the tree from a measured cost model
        (drafters that support it, e.g. ``mixture``); otherwise the budget is fixed.
    allow_untested_model: patch a model whose architecture (``config.model_type``) is
        not in freespec's exactness matrix; by default ``patch()`` refuses it.
    verify_on_device: verify each step's whole tree on the model's device (one argmax or
        sampling pass, every row's token down in one copy: two round trips a step). None (the
        default): on an accelerator, not on a CPU, where walking the tree and reading only the
        path's rows is cheaper. True on a CPU runs the accelerator's path (``freespec bench
        --device-model`` prices its tensor work as a GPU's); the output is the same either way.
    """

    drafter: Any = "mixture"
    drafter_options: Mapping[str, Any] = field(default_factory=dict)
    max_draft_tokens: int = 64
    max_draft_depth: int = 48
    adaptive_budget: bool = True
    allow_untested_model: bool = False
    verify_on_device: bool | None = None

    def __post_init__(self):
        from .drafters.options import check_bool, check_int

        check_int("max_draft_tokens", self.max_draft_tokens, 0)
        check_int("max_draft_depth", self.max_draft_depth, 0)
        check_bool("adaptive_budget", self.adaptive_budget)
        check_bool("allow_untested_model", self.allow_untested_model)
        if self.verify_on_device is not None:
            check_bool("verify_on_device", self.verify_on_device)
        if not isinstance(self.drafter_options, Mapping):
            raise ValueError(f"drafter_options must be a mapping, got {type(self.drafter_options).__name__}")
        if not isinstance(self.drafter, str) and not hasattr(self.drafter, "propose"):
            raise ValueError(
                f"drafter must be a drafter name or an object with start/propose/extend/stop, got {self.drafter!r}"
            )
        if isinstance(self.drafter, str):
            from .drafters import available

            if self.drafter not in available():
                raise ValueError(f"drafter={self.drafter!r} is unknown; available: {', '.join(available())}")
        elif self.drafter_options:
            raise ValueError("drafter_options only apply to a drafter given by name, not to a Drafter instance")

    def make_drafter(self):
        """The drafter this config names (built with its options), or the instance it holds.

        A drafter class with an ``adaptive`` option gets ``adaptive_budget``.
        """
        if not isinstance(self.drafter, str):
            return self.drafter
        import inspect

        from .drafters import drafter_class, make

        options = dict(self.drafter_options)
        if "adaptive" in inspect.signature(drafter_class(self.drafter)).parameters:
            if "adaptive" in options and options["adaptive"] != self.adaptive_budget:
                raise ValueError("drafter_options['adaptive'] contradicts adaptive_budget; set only adaptive_budget")
            options["adaptive"] = self.adaptive_budget
        return make(self.drafter, **options)

    def step_budget(self, remaining: int):
        """The draft budget of one step with ``remaining`` tokens left before ``max_length``.

        Every forward commits the accepted nodes plus one bonus token, so a path may
        hold at most ``remaining - 1`` nodes: ``SpecConfig().step_budget(5) ->
        Budget(num_nodes=64, max_depth=4)``. The engine and ``freespec replay`` both call this.
        """
        from .draft import Budget

        return Budget(num_nodes=self.max_draft_tokens, max_depth=max(0, min(self.max_draft_depth, remaining - 1)))

    def replace(self, **overrides) -> "SpecConfig":
        """A copy with ``overrides``; an unknown key raises ``TypeError`` naming it."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(
                f"unknown SpecConfig option(s) {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(self, **overrides)
