"""Which drafter the SGLang plugin serves, from flags, a JSON file or env vars.

The launcher parses ``--freespec-drafter NAME`` and ``--freespec-config PATH``;
SGLang then spawns its scheduler processes, which never see those flags. So
the launcher exports them (``export_env``) and every process reads them back
(``from_env``) when it builds the corpus adapter::

    FREESPEC_SGLANG=1                      # enable the plugin without any flag
    FREESPEC_SGLANG_DRAFTER=prompt_lookup  # drafter name (overrides the file's)
    FREESPEC_SGLANG_CONFIG=/path/cfg.json  # {"drafter": ..., "drafter_options": {...}}

A config file holds one JSON object, every key optional::

    {"drafter": "prompt_lookup", "drafter_options": {"min_match": 2, "max_match": 16}}

Anything else (unknown keys, a drafter that is not registered, options its
class rejects) raises ``ValueError`` naming the file and the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_ENABLE = "FREESPEC_SGLANG"
ENV_DRAFTER = "FREESPEC_SGLANG_DRAFTER"
ENV_CONFIG = "FREESPEC_SGLANG_CONFIG"
CONFIG_KEYS = ("drafter", "drafter_options")


@dataclass(frozen=True)
class PluginOptions:
    drafter: str
    drafter_options: dict = field(default_factory=dict)


def default_drafter() -> str:
    """``"mixture"`` when it is registered, else ``"prompt_lookup"``."""
    from freespec import drafters

    return "mixture" if "mixture" in drafters.available() else "prompt_lookup"


def read_config(path: str | os.PathLike) -> dict:
    """Load and check a ``--freespec-config`` file: ``{"drafter": str, "drafter_options": dict}``."""
    path = Path(path)
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
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"freespec config {str(path)!r} has unknown keys {unknown}; "
                         f"allowed: {list(CONFIG_KEYS)}")
    if "drafter" in config and not isinstance(config["drafter"], str):
        raise ValueError(f"freespec config {str(path)!r}: 'drafter' must be a string, got {config['drafter']!r}")
    if not isinstance(config.get("drafter_options", {}), dict):
        raise ValueError(f"freespec config {str(path)!r}: 'drafter_options' must be an object, "
                         f"got {config['drafter_options']!r}")
    return config


def resolve(drafter: str | None = None, config_path: str | os.PathLike | None = None) -> PluginOptions:
    """Combine a drafter name and a config file; the name wins over the file's ``drafter``.

    ``resolve("prompt_lookup", "cfg.json")`` with ``cfg.json`` =
    ``{"drafter": "suffix", "drafter_options": {"max_match": 16}}``
    -> ``PluginOptions("prompt_lookup", {"max_match": 16})``.
    """
    from freespec import drafters

    config = read_config(config_path) if config_path else {}
    name = drafter or config.get("drafter") or default_drafter()
    if name not in drafters.available():
        where = "--freespec-drafter" if drafter else f"freespec config {str(config_path)!r}"
        raise ValueError(f"{where}: drafter {name!r} is unknown; available: {', '.join(drafters.available())}")
    return PluginOptions(name, dict(config.get("drafter_options", {})))


def from_env(environ=os.environ) -> PluginOptions:
    """``resolve()`` from ``FREESPEC_SGLANG_DRAFTER`` and ``FREESPEC_SGLANG_CONFIG``."""
    return resolve(environ.get(ENV_DRAFTER) or None, environ.get(ENV_CONFIG) or None)


def export_env(drafter: str | None, config_path: str | None, environ=os.environ) -> None:
    """Make the launcher's flags visible to the processes it spawns."""
    environ[ENV_ENABLE] = "1"
    if drafter:
        environ[ENV_DRAFTER] = drafter
    if config_path:
        environ[ENV_CONFIG] = str(Path(config_path).resolve())
