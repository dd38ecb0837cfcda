"""What ``--methods`` means: one small grammar, parsed and checked before any model loads.

    METHODS := METHOD ("," METHOD)*             commas inside {...} do not split
    METHOD  := KIND [":" ARG] ["{" KEY=VALUE ("," KEY=VALUE)* "}"]

| method | what runs |
|---|---|
| ``vanilla`` | plain ``generate()`` of the unpatched model |
| ``hf-pld`` / ``hf-pld:N`` | transformers' prompt lookup, ``prompt_lookup_num_tokens=N`` (10 by default); options are passed to ``generate()`` (``hf-pld:10{max_matching_ngram_size=3}``) |
| ``freespec`` | ``freespec.patch(model)`` with the default ``SpecConfig`` |
| ``freespec:NAME`` | the registered drafter ``NAME`` (``freespec.drafters.available()``) |
| ``freespec:NAME{k=v,...}`` | ``k`` that is a ``SpecConfig`` field (``max_draft_tokens``, ``max_draft_depth``, ``adaptive_budget``) configures the engine; any other ``k`` is a drafter option |
| ``arctic-suffix{k=v,...}`` | Snowflake's SuffixDecoding drafter under freespec's verification (``freespec.bench.peers``); options as for ``freespec`` plus ``ArcticSuffixDrafter``'s |
| ``freespec{prediction=true}`` | also passes each item's prediction (``builtin:code-edit``: the code shown) as ``generate(prediction=...)``; the drafter must take one (``mixture``, ``prediction``) |

Values are ints, floats, ``true``/``false``, ``none`` or bare strings:
``freespec:suffix{min_match=3,max_draft_tokens=32}`` ->
``SpecConfig(drafter="suffix", drafter_options={"min_match": 3}, max_draft_tokens=32)``.

``freespec replay --drafters`` takes the speculative methods of the same grammar with the
``freespec:`` prefix optional (``parse_drafters``): ``prompt_lookup,suffix{min_match=3},arctic-suffix``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

KINDS = ("vanilla", "hf-pld", "freespec", "arctic-suffix")
HF_PLD_DEFAULT_TOKENS = 10
_METHOD_RE = re.compile(r"^(?P<kind>[A-Za-z][\w-]*)(?::(?P<arg>[\w.-]+))?(?:\{(?P<opts>[^{}]*)\})?$")


@dataclass(frozen=True)
class MethodSpec:
    """One parsed method. ``label`` is how results name it (the spec as written)."""

    label: str
    kind: str  # one of KINDS
    drafter: str | None = None  # freespec: drafter name (None = SpecConfig's default)
    drafter_options: dict[str, Any] = field(default_factory=dict)
    spec_options: dict[str, Any] = field(default_factory=dict)  # SpecConfig overrides
    hf_num_tokens: int | None = None  # hf-pld: prompt_lookup_num_tokens
    hf_options: dict[str, Any] = field(default_factory=dict)  # hf-pld: extra generate() kwargs
    use_prediction: bool = False  # freespec: pass the item's prediction as generate(prediction=...)

    @property
    def speculative(self) -> bool:
        return self.kind in ("freespec", "arctic-suffix")


def split_methods(text: str) -> list[str]:
    """``"a,b{x=1,y=2},c" -> ["a", "b{x=1,y=2}", "c"]``; unbalanced braces raise."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced '}}' in methods {text!r}")
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if depth:
        raise ValueError(f"unbalanced '{{' in methods {text!r}")
    parts.append(current.strip())
    if any(not p for p in parts):
        raise ValueError(f"empty method in {text!r} (two commas in a row, or a trailing comma?)")
    return parts


def parse_value(text: str) -> Any:
    """``"3" -> 3``, ``"0.5" -> 0.5``, ``"true" -> True``, ``"none" -> None``, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_options(text: str | None, where: str) -> dict[str, Any]:
    """``"a=1, b=x" -> {"a": 1, "b": "x"}``; a missing ``=`` or a repeated key raises."""
    options: dict[str, Any] = {}
    if not text or not text.strip():
        return options
    for pair in text.split(","):
        key, sep, value = pair.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key.isidentifier() or not value:
            raise ValueError(f"bad option {pair.strip()!r} in {where!r}: write key=value, e.g. {{min_match=3}}")
        if key in options:
            raise ValueError(f"option {key!r} given twice in {where!r}")
        options[key] = parse_value(value)
    return options


def _spec_fields() -> set[str]:
    from ..config import SpecConfig

    return {f.name for f in dataclasses.fields(SpecConfig)} - {"drafter", "drafter_options"}


def _split_spec_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec_fields = _spec_fields()
    spec_options = {k: v for k, v in options.items() if k in spec_fields}
    drafter_options = {k: v for k, v in options.items() if k not in spec_fields}
    return spec_options, drafter_options


def parse_method(text: str) -> MethodSpec:
    """Parse one method (see the module docstring); bad input raises ``ValueError`` saying why."""
    label = re.sub(r"\s+", "", text)
    match = _METHOD_RE.match(label)
    if not match:
        raise ValueError(f"cannot parse method {text!r}: expected KIND[:ARG][{{key=value,...}}] "
                         f"with KIND one of {', '.join(KINDS)}")
    kind, arg, opts = match["kind"], match["arg"], match["opts"]
    if kind not in KINDS:
        raise ValueError(f"unknown method {kind!r} in {text!r}; known: {', '.join(KINDS)}")
    options = parse_options(opts, text)
    if kind == "vanilla":
        if arg or options:
            raise ValueError(f"method 'vanilla' takes no argument or options, got {text!r}")
        return MethodSpec(label, kind)
    if kind == "hf-pld":
        num_tokens = HF_PLD_DEFAULT_TOKENS
        if arg is not None:
            if not arg.isdigit() or int(arg) < 1:
                raise ValueError(f"hf-pld:N needs a positive integer N (prompt_lookup_num_tokens), got {arg!r}")
            num_tokens = int(arg)
        return MethodSpec(label, kind, hf_num_tokens=num_tokens, hf_options=options)
    if kind == "arctic-suffix":
        if arg:
            raise ValueError(f"arctic-suffix takes options in braces, not ':{arg}'")
        spec_options, drafter_options = _split_spec_options(options)
        from .peers import ArcticSuffixDrafter

        ArcticSuffixDrafter.check_options(drafter_options)
        _check_spec_options(spec_options, text)
        return MethodSpec(label, kind, "arctic-suffix", drafter_options, spec_options)
    # freespec
    from ..drafters import available, drafter_class

    if arg is not None and arg not in available():
        raise ValueError(f"unknown drafter {arg!r} in {text!r}; available: {', '.join(available())}")
    use_prediction = options.pop("prediction", False)
    if use_prediction not in (True, False):
        raise ValueError(f"prediction must be true or false in {text!r}, got {use_prediction!r}")
    if use_prediction and not drafter_class(arg or "mixture").accepts_prediction:
        raise ValueError(f"prediction=true in {text!r} needs a drafter that drafts from a prediction "
                         f"(mixture, prediction)")
    spec_options, drafter_options = _split_spec_options(options)
    if drafter_options and arg is None:
        raise ValueError(f"drafter options {sorted(drafter_options)} in {text!r} need a drafter name: "
                         f"freespec:NAME{{...}}")
    _check_spec_options(spec_options, text)
    return MethodSpec(label, kind, arg, drafter_options, spec_options, use_prediction=use_prediction)


def _check_spec_options(spec_options: dict[str, Any], where: str) -> None:
    from ..config import SpecConfig

    try:
        SpecConfig(**spec_options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad engine option in {where!r}: {exc}") from None


def parse_methods(text: str) -> list[MethodSpec]:
    """Parse a comma-separated list; duplicate labels raise."""
    return _unique([parse_method(part) for part in split_methods(text)])


def parse_drafters(text: str) -> list[MethodSpec]:
    """``freespec replay --drafters``: speculative methods, the ``freespec:`` prefix optional.

    ``"prompt_lookup,suffix{min_match=3},arctic-suffix"`` -> methods labelled as
    written, parsed as ``freespec:prompt_lookup``, ``freespec:suffix{min_match=3}``
    and ``arctic-suffix``; ``freespec`` alone is the default drafter.
    """
    methods = []
    for part in split_methods(text):
        label = re.sub(r"\s+", "", part)
        method = parse_method(label if label.startswith(("freespec", "arctic-suffix")) else "freespec:" + label)
        methods.append(dataclasses.replace(method, label=label))
    return _unique(methods)


def _unique(methods: list[MethodSpec]) -> list[MethodSpec]:
    labels = [m.label for m in methods]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"listed twice: {', '.join(duplicates)}")
    return methods


def make_drafter(method: MethodSpec):
    """A fresh Drafter for a speculative method (one per method, shared by all its prompts)."""
    if method.kind == "arctic-suffix":
        from .peers import ArcticSuffixDrafter

        return ArcticSuffixDrafter(**method.drafter_options)
    from ..config import SpecConfig

    # one instance per method, built here so it lives across prompts (as one patched model's does)
    options = dict(method.spec_options)
    if method.drafter is not None:
        options.update(drafter=method.drafter, drafter_options=method.drafter_options)
    return SpecConfig(**options).make_drafter()


def make_config(method: MethodSpec, drafter=None):
    """The SpecConfig of a speculative method (``drafter``: an instance from ``make_drafter``)."""
    from ..config import SpecConfig

    options = dict(method.spec_options)
    if drafter is not None:
        options["drafter"] = drafter
    return SpecConfig(**options)
