"""The documents run: README.md and docs/*.md.

- Every ```python block runs, in order, the blocks of one file sharing one namespace (as a reader who
  pastes them one after another). A block that cannot run here is marked on the line right above it with
  ``<!-- not run: the reason -->``; a marker without a reason fails.
- Every relative link and image resolves to a file of the checkout.
- Every command of a ```bash block that names one of ours (``freespec bench|replay|demo``, ``bash
  scripts/*.sh``, ``python scripts/*.py`` or ``examples/*.py``, ``pip install .``) exists: the script is
  there and ``freespec``'s parser accepts the command's arguments, flags and values alike.
- The plots of docs/results.md are drawn from its tables, and every plot file there is one the docs show.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from freespec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:(.*?)-->\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def code_blocks(path: Path) -> list[tuple[str, int, str, str | None]]:
    """``(language, first line number, code, not-run reason or None)`` of every fenced block.

    ``"<!-- not run: needs a GPU -->\\n```python\\nx = 1\\n```"`` -> ``[("python", 3, "x = 1\\n", "needs a GPU")]``
    """
    lines, blocks, i = path.read_text(encoding="utf-8").splitlines(), [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        marker = NOT_RUN.match(lines[i - 1].strip()) if i else None
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        reason = marker.group(1).strip() if marker else None
        blocks.append((match.group(1), i + 2, "\n".join(lines[i + 1:end]) + "\n", reason))
        i = end + 1
    return blocks


def test_code_blocks_parse(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n```bash\nls\n```\n")
    assert code_blocks(doc) == [("python", 4, "x = 1\n", "needs a GPU"), ("bash", 7, "ls\n", None)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, monkeypatch):
    blocks = [b for b in code_blocks(path) if b[0] == "python"]
    for _, line, _, reason in blocks:
        assert reason != "", f"{path.name}:{line}: a '<!-- not run: ... -->' marker must give its reason"
    runnable = [(line, code) for _, line, code, reason in blocks if reason is None]
    if not runnable:
        pytest.skip("no Python block to run")
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": f"docs_{path.stem}"}
    for line, code in runnable:
        exec(compile(code, f"{path.relative_to(ROOT)}:{line}", "exec"), namespace)  # noqa: S102


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)  # links, not code
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of this page
        if not (path.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{path.name}: links to missing files: {broken}"


def commands(code: str) -> list[list[str]]:
    """The commands of a shell block as words, continuations joined and comments dropped."""
    joined = code.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def check_command(words: list[str], extras: set[str]) -> str | None:
    """Why ``words`` is not a command of ours that exists (None: it is, or it is not one of ours)."""
    if words[:2] in (["python", "-m"], ["python3", "-m"]) or "=" in words[0]:
        return None  # another package's module, or a shell variable
    if words[0] == "freespec":
        argv = words[1:]
    elif words[0] == "bash" and words[1].startswith("scripts/"):
        if not (ROOT / words[1]).exists():
            return f"no {words[1]}"
        argv = ["demo", *words[2:]] if words[1] == "scripts/demo.sh" else None  # demo.sh: freespec demo "$@"
    elif words[0] in ("python", "python3") and words[1].endswith(".py"):
        if not (ROOT / words[1]).exists():
            return f"no {words[1]}"
        argv = words[2:] if words[1] == "scripts/draft_coverage.py" and words[2:3] == ["bench"] else None
    elif words[:2] == ["pip", "install"] and words[2].startswith("."):
        extra = re.fullmatch(r"\.(?:\[(\w+)\])?", words[2])
        return None if extra and (extra.group(1) is None or extra.group(1) in extras) else f"no extra {words[2]}"
    else:
        return None
    if argv is None:
        return None
    try:
        build_parser().parse_args(argv)
    except SystemExit:
        return "freespec's parser refuses it"
    return None


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_commands_exist(path, capsys):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    failures = []
    for language, line, code, _ in code_blocks(path):
        if language not in ("bash", "sh", "shell"):
            continue
        for words in commands(code):
            if (why := check_command(words, extras)) is not None:
                failures.append(f"{path.name}:{line}: {shlex.join(words)[:120]}...: {why}")
    assert not failures, "\n".join(failures + [capsys.readouterr().err[-2000:]])


def test_check_command_refuses_what_does_not_exist():
    extras = {"bench"}
    assert check_command(["freespec", "bench", "--model", "m", "--dataset", "d", "--out", "o"], extras) is None
    assert check_command(["freespec", "bench", "--model", "m", "--dataset", "d", "--out", "o", "--fast"], extras)
    assert check_command(["freespec", "replay", "t.jsonl", "--drafters", "suffix", "--one-token-ms", "x"], extras)
    assert check_command(["bash", "scripts/no_such.sh"], extras) == "no scripts/no_such.sh"
    assert check_command(["bash", "scripts/demo.sh", "--model", "qwen2.5-coder-0.5b"], extras) is None
    assert check_command(["pip", "install", ".[bench]"], extras) is None
    assert check_command(["pip", "install", ".[nothing]"], extras) == "no extra .[nothing]"


def _plots_module():
    spec = importlib.util.spec_from_file_location("docs_plots", ROOT / "docs" / "results" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_plots_are_drawn_from_their_tables(tmp_path):
    pytest.importorskip("matplotlib")
    plots = _plots_module()
    written = plots.main(tmp_path)
    names = {p.name for p in written}
    assert names and all(p.stat().st_size > 1000 for p in written)
    shipped = {p.name for p in (ROOT / "docs" / "results").glob("*.png")}
    assert shipped == names, "every plot in docs/results is drawn from a marked table of docs/results.md"
    shown = set()
    for path in DOCS:
        shown |= {Path(target).name for target in LINK.findall(path.read_text(encoding="utf-8"))
                  if target.endswith(".png")}
    assert shipped <= shown, f"plots no document shows: {sorted(shipped - shown)}"
    assert plots.number("2.39x") == 2.39 and plots.number("1.00 (163.6 ms)") == 1.0 and plots.number("-") is None


def test_plots_read_at_a_glance(tmp_path):
    """Horizontal bars at a normal aspect ratio, fixed method colours, the regime in the title."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    from freespec.bench.report import (METHOD_COLOURS, method_colour, plot_category_bars, plot_cost_curves,
                                       regime_title)

    values = {f"category {i}": {"hf-pld": 1.2 + i, "freespec": 8.0 if i == 0 else 1.5, "freespec:x": None}
              for i in range(14)}
    path = plot_category_bars(plt, values, ["hf-pld", "freespec", "freespec:x"], tmp_path / "bars.png", "t", "x")
    height, width, _ = matplotlib.image.imread(path).shape
    assert 0.6 <= width / height <= 2.0
    path = plot_cost_curves(plt, {"a": ([1, 2, 16, 17], [1.0, 1.1, 1.15, 1.22]), "b": ([1, 4], [1.0, 1.7])},
                            tmp_path / "cost.png", "c(k)")
    height, width, _ = matplotlib.image.imread(path).shape
    assert 0.6 <= width / height <= 2.0
    assert method_colour("freespec") == METHOD_COLOURS["freespec"]
    assert method_colour("freespec:mixture{ngram=true}") == method_colour("freespec:mixture{ngram=true}")
    results = {"config": {"model": "m", "dtype": "bfloat16"}, "environment": {"cpu_model": "Xeon"}}
    assert regime_title(results) == "m, bfloat16, Xeon"
    assert regime_title({**results, "simulated": {"one_token_ms": 1.0}}).endswith("SIMULATED forward costs")
