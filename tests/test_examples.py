"""The pipeline examples run, in a reduced mode (one question or edit, a few tokens), so they cannot rot."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--model", "smollm2-135m", *args],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.skipif(importlib.util.find_spec("bm25s") is None,
                    reason="the RAG example needs bm25s: pip install 'freespec[rag]'")
def test_rag_pipeline_example():
    out = _run("rag_pipeline.py", "--questions", "1", "--max-new-tokens", "16")
    assert "retrieved: textwrap.dedent" in out
    assert "identical to plain decoding: True" in out
    for method in ("plain", "hf prompt lookup", "freespec"):
        assert f"\n{method:20s} tau" in out, out


def test_code_edit_pipeline_example():
    out = _run("code_edit_pipeline.py", "--edits", "1", "--max-new-tokens", "16")
    assert "identical to plain decoding: freespec True, with prediction= True" in out
    for method in ("plain", "hf prompt lookup", "freespec", "freespec+prediction"):
        assert f"\n{method:20s} tau" in out, out
    assert "final code:\ndef split_chunks(" in out
