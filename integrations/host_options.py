"""Which drafter a serving adapter runs, with which options: the config file both adapters read.

A config file holds one JSON object, every key optional. ``drafter_options`` maps
drafter names to that drafter's own options, so one file can serve every drafter,
and a drafter named elsewhere (a flag, an env var) that overrides the file's
``drafter`` takes its own section (or the defaults, without one)::

    {"drafter": "prompt_lookup",
     "drafter_options": {"prompt_lookup": {"max_match": 16},
                         "mixture": {"min_match": 2, "max_depth": 16}}}

A host may allow more keys (``read_config(path, extra_keys)``: vLLM's
``"isolated"``). Every section is checked against its drafter's constructor
(``build_drafter``): a key that is not a drafter, an option the drafter does not
take, or a value it rejects raises ``ValueError`` naming the file, the drafter
and the option. Each host fixes the options its engine cannot honour
(``fixed``: option -> (value, why)), and checks its release (``parse_version``).
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_KEYS = ("drafter", "drafter_options")


@dataclass(frozen=True)
class PluginOptions:
    drafter: str
    drafter_options: dict = field(default_factory=dict)  # the chosen drafter's own options


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.5.21" -> (0, 5, 21)``, ``"0.5.21.post1" -> (0, 5, 21)``, ``"0.5.22rc0" -> (0, 5, 22)``."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def default_drafter() -> str:
    """``"mixture"`` when it is registered, else ``"prompt_lookup"``."""
    from freespec import drafters

    return "mixture" if "mixture" in drafters.available() else "prompt_lookup"


def _load_json_object(path: Path) -> dict:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"freespec config {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"freespec config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"freespec config {str(path)!r} must hold a JSON object, got {type(config).__name__}")
    return config


def read_config(path: str | os.PathLike, extra_keys: tuple = ()) -> dict:
    """Load and check the shape of a config file: ``{"drafter": str, "drafter_options": {name: {...}}}``."""
    from freespec import drafters

    path = Path(path)
    config = _load_json_object(path)
    where = f"freespec config {str(path)!r}"
    allowed = list(CONFIG_KEYS) + list(extra_keys)
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {allowed}")
    if "drafter" in config and not isinstance(config["drafter"], str):
        raise ValueError(f"{where}: 'drafter' must be a string, got {config['drafter']!r}")
    sections = config.get("drafter_options", {})
    if not isinstance(sections, dict):
        raise ValueError(f"{where}: 'drafter_options' must be an object, got {sections!r}")
    for name, section in sections.items():
        if name not in drafters.available():
            raise ValueError(f"{where}: drafter_options maps drafter names to their options, and {name!r} is "
                             f"not a drafter (available: {', '.join(drafters.available())}); write e.g. "
                             f'{{"drafter_options": {{"prompt_lookup": {{"max_match": 16}}}}}}')
        if not isinstance(section, dict):
            raise ValueError(f"{where}: drafter_options[{name!r}] must be an object, got {section!r}")
    return config


def check_option_names(name: str, drafter_options: dict, where: str) -> None:
    """Every option must be a keyword of drafter ``name``'s constructor (any, if it takes ``**kwargs``)."""
    from freespec import drafters

    parameters = inspect.signature(drafters.drafter_class(name).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [p for p in parameters if p != "self"]
    for option in drafter_options:
        if option not in accepted:
            raise ValueError(f"{where}: drafter {name!r} has no option {option!r}; its options: "
                             f"{', '.join(accepted)}")


def fix_options(name: str, drafter_options: dict, where: str, fixed: dict, host: str) -> dict:
    """``drafter_options`` with ``fixed`` applied: filled in where the drafter takes them, else refused."""
    from freespec import drafters

    parameters = inspect.signature(drafters.drafter_class(name).__init__).parameters
    out = dict(drafter_options)
    for option, (value, why) in fixed.items():
        if option in out and out[option] != value:
            raise ValueError(f"{where}: drafter {name!r} option {option!r} must be {value!r} under {host}, got "
                             f"{out[option]!r}: {why}")
        if option in parameters:
            out[option] = value
    return out


def with_isolation(name: str, drafter_options: dict, isolated: bool, where: str) -> dict:
    """``drafter_options`` with the drafter's ``isolation_options`` applied when ``isolated`` (no text of one
    request reaches another's drafts); an option the file sets against them raises ``ValueError``."""
    from freespec.drafters import drafter_class

    if not isolated:
        return dict(drafter_options)
    out = dict(drafter_options)
    for option, value in drafter_class(name).isolation_options.items():
        if option in out and out[option] != value:
            raise ValueError(f"{where}: 'isolated' is true, so drafter {name!r} option {option!r} must be "
                             f"{value!r}, got {out[option]!r}")
        out[option] = value
    return out


def with_defaults(name: str, drafter_options: dict, defaults: dict) -> dict:
    """``drafter_options`` with a host's ``defaults`` filled in where the drafter takes them and the options do
    not set them (``history_tokens`` stays out where the options pass a shared ``history``)."""
    from freespec import drafters

    parameters = inspect.signature(drafters.drafter_class(name).__init__).parameters
    out = dict(drafter_options)
    for option, value in defaults.items():
        if option in parameters and not (option == "history_tokens" and "history" in out):
            out.setdefault(option, value)
    return out


def build_drafter(name: str, drafter_options: dict, where: str, fixed: dict, host: str, no_model_why: str):
    """The drafter ``name`` with its options under ``host``; ``ValueError`` naming ``where``, the drafter and the option.

    A dict under ``"documents"`` becomes a ``DocumentIndex`` (a shared index of
    documents every request may draft from).
    """
    from freespec import drafters

    check_option_names(name, drafter_options, where)
    built = fix_options(name, drafter_options, where, fixed, host)
    if isinstance(built.get("documents"), dict):
        from freespec.drafters.corpus import DocumentIndex

        try:
            built["documents"] = DocumentIndex(**built["documents"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: drafter {name!r} option 'documents': {exc}") from None
    try:
        drafter = drafters.make(name, **built)
    except ValueError as exc:
        raise ValueError(f"{where}: drafter {name!r}: {exc}") from None
    if drafter.needs_model:  # early_exit, or a mixture with early_exit=True
        raise ValueError(f"{where}: drafter {name!r} drafts with the target model's layers, which {no_model_why}; "
                         f"use a lookup drafter (mixture, suffix, ...) under {host}")
    return drafter


def resolve(drafter: str | None, config_path: str | os.PathLike | None, drafter_origin: str,
            extra_keys: tuple = ()) -> PluginOptions:
    """The drafter to serve (``drafter`` wins over the file's) and its own section of the file.

    ``resolve("suffix", "cfg.json", ...)`` with ``cfg.json`` =
    ``{"drafter": "prompt_lookup", "drafter_options": {"prompt_lookup": {"max_match": 16}, "suffix":
    {"max_depth": 8}}}`` -> ``PluginOptions("suffix", {"max_depth": 8})``. ``drafter_origin`` names
    where ``drafter`` came from in an error (a flag, an env var).
    """
    from freespec import drafters

    config = read_config(config_path, extra_keys) if config_path else {}
    name = drafter or config.get("drafter") or default_drafter()
    if name not in drafters.available():
        where = drafter_origin if drafter else f"freespec config {str(config_path)!r}"
        raise ValueError(f"{where}: drafter {name!r} is unknown; available: {', '.join(drafters.available())}")
    return PluginOptions(name, dict(config.get("drafter_options", {}).get(name, {})))
