"""freespec's declared requirements install together with every SGLang release the plugin supports.

``pip install "freespec[sglang]"`` resolves only if, for every package both declare, some release on
PyPI satisfies freespec's range and the SGLang release's pin together. SGLang pins exactly
(``transformers==5.12.1``, ``torch==2.13.0``, ``numba==0.65.1``), so a freespec range that misses one
pin makes that SGLang release uninstallable with the plugin, e.g. ``transformers>=5.24`` against
sglang 0.5.21's ``transformers==5.12.1``.

The pins come from ``tests/data/sglang_releases.json``: the ``Requires-Dist`` of each sglang release
in the plugin's range (``integrations/sglang/hooks.py``: ``MIN_VERSION`` .. ``MAX_VERSION``, post
releases included), read from the wheels' METADATA, and the versions PyPI offers of each package
freespec declares. ``python tests/test_packaging.py --write`` regenerates it (it downloads each
sglang wheel once, ~30 MB, and keeps only the metadata). With PyPI reachable, a test checks the
file still lists every sglang release in the range; in an environment with sglang installed
(``scripts/test_env.sh sglang``), another checks its entry against the installed metadata.

Requirements are evaluated for CPython on Linux x86_64 (the platform CI runs), for each Python
version both projects accept; sglang's optional extras are left out.
"""

from __future__ import annotations

import argparse
import email.parser
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sglang_releases.json"
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
PLATFORM = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython"}
WHEEL_PLATFORM = ["--python-version", "3.11", "--implementation", "cp", "--platform", "manylinux_2_34_x86_64",
                  "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                  "--platform", "manylinux2014_x86_64"]


# ---------------------------------------------------------------- what freespec declares
def pyproject() -> dict:
    """The ``[project]`` table of pyproject.toml."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def freespec_requirements(project: dict, extras=("sglang",)) -> list[Requirement]:
    """The base requirements plus those of ``extras``."""
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def plugin_range() -> tuple[tuple[int, ...], tuple[int, ...]]:
    from freespec.integrations.sglang import hooks

    return hooks.MIN_VERSION, hooks.MAX_VERSION


def in_plugin_range(version: str) -> bool:
    """What the plugin's run-time check accepts (``0.5.21.post1`` counts as 0.5.21); never a pre-release."""
    from freespec.integrations.sglang import hooks

    low, high = plugin_range()
    return not Version(version).is_prerelease and low <= hooks.parse_version(version) <= high


# ---------------------------------------------------------------- the check
def applies(requirement: Requirement, python: str) -> bool:
    if requirement.marker is None:
        return True
    return requirement.marker.evaluate({**default_environment(), **PLATFORM, "python_version": python,
                                        "python_full_version": f"{python}.0", "extra": ""})


def conflicts(ours: list[Requirement], requires_python: str, release: dict, available: dict) -> list[str]:
    """Why ``ours`` (with ``requires_python``) cannot install with one sglang release; [] if it can.

    ``release``: ``{"requires_python": ..., "requires_dist": [...]}``; ``available``: name -> versions
    on PyPI. For every package both declare, some available version must satisfy both specifiers.
    """
    pythons = [py for py in PYTHONS
               if py in SpecifierSet(requires_python) and py in SpecifierSet(release["requires_python"] or "")]
    if not pythons:
        return [f"python: freespec needs {requires_python}, sglang {release['requires_python']}"]
    problems = []
    for python in pythons:
        mine = {canonicalize_name(req.name): req for req in ours if applies(req, python)}
        for line in release["requires_dist"]:
            theirs = Requirement(line)
            name = canonicalize_name(theirs.name)
            if name not in mine or not applies(theirs, python):
                continue
            both = mine[name].specifier & theirs.specifier
            if not any(both.contains(version) for version in available[name]):
                problem = f"{name}: freespec needs {mine[name].specifier or 'any'}, sglang pins {theirs.specifier}"
                if problem not in problems:
                    problems.append(problem)
    return problems


# ---------------------------------------------------------------- the data
def load_data() -> dict:
    return json.loads(DATA.read_text())


DATA_RELEASES = sorted(json.loads(DATA.read_text())["releases"], key=Version) if DATA.exists() else []


def pip(*args: str) -> str:
    """Run pip (``--isolated``: PyPI only, this machine's pip configuration ignored); its stdout."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def pypi_versions(name: str) -> list[str]:
    """Every final release of ``name`` that PyPI offers for Python 3.11 on Linux x86_64, newest first."""
    out = pip("index", "versions", name, *WHEEL_PLATFORM, "--only-binary=:all:")
    match = re.search(r"^Available versions: (.*)$", out, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"pip index versions {name}: no version list in {out!r}")
    return match.group(1).split(", ")


def wheel_metadata(name: str, version: str) -> dict:
    """``requires_python`` and ``requires_dist`` (extras left out) read from the wheel's METADATA.

    A release's files never change on PyPI, so the result is kept in ``$FREESPEC_CACHE/pypi``.
    """
    from freespec.models import cache_root

    cached = cache_root() / "pypi" / f"{canonicalize_name(name)}-{version}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        pip("download", "--no-deps", "--only-binary=:all:", *WHEEL_PLATFORM, "-d", tmp, f"{name}=={version}")
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            member = next(m for m in archive.namelist() if m.endswith(".dist-info/METADATA"))
            text = archive.read(member).decode()
    fields = metadata_fields(email.parser.HeaderParser().parsestr(text))
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(fields, indent=1))
    return fields


def metadata_fields(metadata) -> dict:
    """``{"requires_python", "requires_dist"}`` of a METADATA message, requirements of extras left out."""
    requires_dist = [line.strip() for line in metadata.get_all("Requires-Dist") or []
                     if "extra" not in str(Requirement(line).marker or "")]
    return {"requires_python": metadata.get("Requires-Python"), "requires_dist": requires_dist}


def collect(project: dict) -> dict:
    """The data file's content, fetched from PyPI now."""
    sglang_versions = pypi_versions("sglang")
    releases = {v: wheel_metadata("sglang", v) for v in sorted(sglang_versions, key=Version) if in_plugin_range(v)}
    names = sorted({canonicalize_name(req.name) for req in freespec_requirements(project)} - {"sglang"})
    return {
        "about": "Requires-Dist of each sglang release in the plugin's range (extras left out) and the versions "
                 "PyPI offers (Python 3.11, Linux x86_64) of each package freespec declares; written by "
                 "`python tests/test_packaging.py --write`",
        "sglang_versions": sglang_versions,
        "releases": releases,
        "available": {name: pypi_versions(name) for name in names},
    }


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("version", DATA_RELEASES)
def test_freespec_installs_with_sglang_release(version):
    project = pyproject()
    data = load_data()
    ours = freespec_requirements(project)
    sglang = next(req for req in ours if canonicalize_name(req.name) == "sglang")
    assert sglang.specifier.contains(version), f"freespec[sglang] excludes sglang {version}, which the plugin supports"
    problems = conflicts(ours, project["requires-python"], data["releases"][version], data["available"])
    assert not problems, f"freespec[sglang] cannot install with sglang {version}: " + "; ".join(problems)


def test_data_covers_what_freespec_declares():
    data = load_data()
    names = {canonicalize_name(req.name) for req in freespec_requirements(pyproject())} - {"sglang"}
    missing = names - set(data["available"])
    assert not missing, f"{DATA.name} lacks {sorted(missing)}: run python tests/test_packaging.py --write"
    in_range = [v for v in data["sglang_versions"] if in_plugin_range(v)]
    assert sorted(in_range, key=Version) == DATA_RELEASES and len(DATA_RELEASES) >= 2


def test_the_check_rejects_a_range_that_misses_a_pin():
    """The transformers range freespec declared before (>=5.24) excludes every supported release's pin."""
    project = pyproject()
    data = load_data()
    old = [req for req in freespec_requirements(project) if canonicalize_name(req.name) != "transformers"]
    old.append(Requirement("transformers>=5.24,<6"))
    for version in DATA_RELEASES:
        problems = conflicts(old, project["requires-python"], data["releases"][version], data["available"])
        assert problems and all(p.startswith("transformers: freespec needs") for p in problems), (version, problems)
    too_new_python = conflicts(old, ">=3.15", data["releases"][DATA_RELEASES[0]], data["available"])
    assert too_new_python and too_new_python[0].startswith("python:")


def test_sglang_extra_is_the_plugins_range():
    """Every sglang on PyPI is in the extra's specifier exactly when the plugin's version check accepts it."""
    sglang = next(req for req in freespec_requirements(pyproject()) if canonicalize_name(req.name) == "sglang")
    (a, b, low), (c, d, high) = plugin_range()
    edges = [f"{a}.{b}.{low - 1}", f"{a}.{b}.{low}", f"{c}.{d}.{high}.post3", f"{c}.{d}.{high + 1}rc0", f"{c}.{d}.{high + 1}"]
    for version in load_data()["sglang_versions"] + edges:
        assert sglang.specifier.contains(version) == in_plugin_range(version), (version, str(sglang.specifier))


def test_transformers_range_is_the_patchs_range():
    """Every transformers release on PyPI is in the declared range exactly when patch() accepts it."""
    from freespec.integrations.transformers import SUPPORTED_TRANSFORMERS

    low, high = SUPPORTED_TRANSFORMERS
    project = pyproject()
    transformers = next(req for req in freespec_requirements(project, ()) if req.name == "transformers")
    versions = load_data()["available"]["transformers"]
    assert any(low <= Version(v).release[:2] for v in versions)
    for version in versions:
        assert transformers.specifier.contains(version) == (low <= Version(version).release[:2] < high), version


LOWEST = ROOT / "scripts" / "constraints-lowest.txt"
NO_LOWEST_RUN = {"torch": "CI has only the CPU wheel 2.13.0"}


def test_lowest_environment_pins_the_declared_lower_bounds():
    """CI's lowest environment (scripts/test_env.sh lowest) installs each declared lower bound."""
    lines = [line.split("#")[0].strip() for line in LOWEST.read_text().splitlines()]
    pins = {}
    for req in map(Requirement, filter(None, lines)):
        (spec,) = req.specifier
        assert spec.operator == "==", f"{LOWEST.name}: {req} is not a pin"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    expected = {}
    for req in freespec_requirements(pyproject(), ()):
        lower = [Version(spec.version) for spec in req.specifier if spec.operator == ">="]
        if lower and canonicalize_name(req.name) not in NO_LOWEST_RUN:
            expected[canonicalize_name(req.name)] = lower[0]
    assert pins == expected


def test_data_lists_every_sglang_release_on_pypi():
    """A release PyPI gained in the plugin's range must be checked: regenerate the file."""
    try:
        live = pypi_versions("sglang")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"PyPI not reachable: {str(exc)[:200]}")
    live_in_range = sorted((v for v in live if in_plugin_range(v)), key=Version)
    assert live_in_range == DATA_RELEASES, f"run python tests/test_packaging.py --write ({DATA.name} is stale)"


def test_data_matches_installed_sglang():
    import importlib.metadata as md

    try:
        dist = md.distribution("sglang")
    except md.PackageNotFoundError:
        pytest.skip("sglang is not installed (bash scripts/test_env.sh sglang installs it)")
    version = dist.version
    if version not in DATA_RELEASES:
        pytest.skip(f"sglang {version} is outside the plugin's range")
    installed = metadata_fields(dist.metadata)
    assert installed == load_data()["releases"][version]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"fetch from PyPI and write {DATA.relative_to(ROOT)}")
    args = parser.parse_args()
    if not args.write:
        parser.error("nothing to do: pass --write (pytest runs the tests)")
    sys.path.insert(0, str(ROOT))
    data = collect(pyproject())
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {DATA}: sglang {', '.join(data['releases'])}")


if __name__ == "__main__":
    main()
