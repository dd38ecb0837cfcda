"""Which drafter the SGLang plugin serves, and with which options: flags, a JSON file, env vars.

The launcher parses ``--freespec-drafter NAME`` and ``--freespec-config PATH``;
SGLang then spawns its scheduler processes, which never see those flags. So
the launcher exports them (``export_env``) and every process reads them back
(``from_env``) when it builds the corpus adapter::

    FREESPEC_SGLANG=1                      # enable the plugin without any flag
    FREESPEC_SGLANG_DRAFTER=prompt_lookup  # drafter name (overrides the file's)
    FREESPEC_SGLANG_CONFIG=/path/cfg.json  # the config file below

A config file holds one JSON object, every key optional. ``drafter_options``
maps drafter names to that drafter's own options, so one file can serve every
drafter and a ``--freespec-drafter`` that overrides the file's ``drafter``
takes its own section (or the defaults, without one)::

    {"drafter": "prompt_lookup",
     "drafter_options": {"prompt_lookup": {"max_match": 16},
                         "mixture": {"min_match": 2, "max_depth": 16}}}

Every section is checked against its drafter's constructor (``check_config``,
run by the launcher before anything starts): a key that is not a drafter, an
option the drafter does not take, or a value it rejects raises ``ValueError``
naming the file, the drafter and the option.

Options fixed under SGLang (``SGLANG_FIXED``): ``adaptive`` is False. SGLang
verifies all ``D = --speculative-num-draft-tokens`` slots every step and
reports no forward times, so a tree sized down by a cost model saves no
compute and only drops drafts; and sizing from measured times would let
tensor-parallel ranks, which draft independently, propose different trees.
The mixture's ``lookahead`` is False: its Jacobi window rides in the forward
as not-candidate nodes, which SGLang's draft tree cannot carry, and the
worker hands drafters no logits to fill its pool from.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_ENABLE = "FREESPEC_SGLANG"
ENV_DRAFTER = "FREESPEC_SGLANG_DRAFTER"
ENV_CONFIG = "FREESPEC_SGLANG_CONFIG"
CONFIG_KEYS = ("drafter", "drafter_options")
# option -> the only value it may take under SGLang (the default when the drafter has the option)
SGLANG_FIXED = {  # option -> (its value under SGLang, why)
    "adaptive": (False, "SGLang verifies all --speculative-num-draft-tokens slots every step and reports no "
                        "forward times, so a smaller tree saves nothing"),
    "lookahead": (False, "the lookahead window rides as not-candidate nodes, which SGLang's draft tree cannot "
                         "carry"),
}


@dataclass(frozen=True)
class PluginOptions:
    drafter: str
    drafter_options: dict = field(default_factory=dict)  # the chosen drafter's own options


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


def read_config(path: str | os.PathLike) -> dict:
    """Load and check the shape of a config file: ``{"drafter": str, "drafter_options": {name: {...}}}``."""
    from freespec import drafters

    path = Path(path)
    config = _load_json_object(path)
    where = f"freespec config {str(path)!r}"
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{where} has unknown keys {unknown}; allowed: {list(CONFIG_KEYS)}")
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


def sglang_options(name: str, drafter_options: dict, where: str) -> dict:
    """``drafter_options`` with ``SGLANG_FIXED`` applied: filled in where the drafter takes them, else refused."""
    from freespec import drafters

    parameters = inspect.signature(drafters.drafter_class(name).__init__).parameters
    out = dict(drafter_options)
    for option, (value, why) in SGLANG_FIXED.items():
        if option in out and out[option] != value:
            raise ValueError(f"{where}: drafter {name!r} option {option!r} must be {value!r} under SGLang, got "
                             f"{out[option]!r}: {why}")
        if option in parameters:
            out[option] = value
    return out


def build_drafter(name: str, drafter_options: dict, where: str = "drafter_options"):
    """The drafter ``name`` with its options under SGLang; ``ValueError`` naming ``where``, the drafter and the option.

    A dict under ``"documents"`` becomes a ``DocumentIndex`` (the shared index
    that also takes SGLang's external corpora).
    """
    from freespec import drafters

    check_option_names(name, drafter_options, where)
    built = sglang_options(name, drafter_options, where)
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
        raise ValueError(f"{where}: drafter {name!r} drafts with the target model's layers, which SGLang's NGRAM "
                         f"worker does not hand to drafters; use a lookup drafter (mixture, suffix, ...) under SGLang")
    return drafter


def check_config(config_path: str | os.PathLike) -> None:
    """Build every drafter the file configures, so a bad option stops the launcher, not a scheduler."""
    config = read_config(config_path)
    for name, section in config.get("drafter_options", {}).items():
        build_drafter(name, section, f"freespec config {str(config_path)!r}")


def resolve(drafter: str | None = None, config_path: str | os.PathLike | None = None) -> PluginOptions:
    """The drafter to serve (the name wins over the file's ``drafter``) and its own section of the file.

    ``resolve("suffix", "cfg.json")`` with ``cfg.json`` =
    ``{"drafter": "prompt_lookup", "drafter_options": {"prompt_lookup": {"max_match": 16}, "suffix":
    {"max_depth": 8}}}`` -> ``PluginOptions("suffix", {"max_depth": 8})``.
    """
    from freespec import drafters

    config = read_config(config_path) if config_path else {}
    name = drafter or config.get("drafter") or default_drafter()
    if name not in drafters.available():
        where = "--freespec-drafter" if drafter else f"freespec config {str(config_path)!r}"
        raise ValueError(f"{where}: drafter {name!r} is unknown; available: {', '.join(drafters.available())}")
    return PluginOptions(name, dict(config.get("drafter_options", {}).get(name, {})))


def from_env(environ=os.environ) -> PluginOptions:
    """``resolve()`` from ``FREESPEC_SGLANG_DRAFTER`` and ``FREESPEC_SGLANG_CONFIG``."""
    return resolve(environ.get(ENV_DRAFTER) or None, environ.get(ENV_CONFIG) or None)


def where(environ=os.environ) -> str:
    """How to name the options' origin in an error: the config file, else the env var."""
    config = environ.get(ENV_CONFIG)
    return f"freespec config {config!r}" if config else "freespec drafter_options"


def export_env(drafter: str | None, config_path: str | None, environ=os.environ) -> None:
    """Make the launcher's flags visible to the processes it spawns."""
    environ[ENV_ENABLE] = "1"
    if drafter:
        environ[ENV_DRAFTER] = drafter
    if config_path:
        environ[ENV_CONFIG] = str(Path(config_path).resolve())
