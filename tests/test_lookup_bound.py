"""The lookup oracle's step count (freespec.bench.lookup_bound) against a plain twin and worked examples."""

import json

import numpy as np
import pytest

from freespec.bench import lookup_bound
from freespec.bench.lookup_bound import oracle_steps


def _naive_steps(prompt, output, k, min_match=1):
    text = list(prompt) + list(output)
    position, steps = len(prompt), 0
    while position < len(text):
        future = text[position:len(text) - 1]
        anchor = text[position - min_match:position] if position >= min_match else None
        best = 0
        for d in range(min(k, len(future)), 0, -1):  # the longest d with an occurrence followed by future[:d]
            if anchor is not None and any(text[end - min_match:end] == anchor and text[end:end + d] == future[:d]
                                          for end in range(min_match, position)):
                best = d
                break
        position += best + 1
        steps += 1
    return steps


def test_worked_examples():
    assert oracle_steps([1, 2, 3], [4, 1, 2, 3, 4], k=8) == 3  # the module docstring's
    assert oracle_steps([1, 2, 3], [1, 2, 3, 1, 2, 3], k=2) == 3
    assert oracle_steps([5], [7] * 6, k=8) == 3  # a repeat copies from itself once two 7s are there
    assert oracle_steps([1, 2, 3], [], k=8) == 0
    assert oracle_steps([], [9], k=8) == 1
    assert oracle_steps([], [1, 2, 3], k=8) == 3  # nothing seen: every token the target's
    assert oracle_steps([], [1, 2, 3], k=8, history=[1, 2, 3]) == 2  # 1 new, then 2 copied from an earlier request
    with pytest.raises(ValueError, match="k and min_match"):
        oracle_steps([1], [2], k=0)


@pytest.mark.parametrize("seed", range(30))
def test_matches_its_naive_twin(seed):
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 6))
    prompt = rng.integers(0, vocab, int(rng.integers(0, 30))).tolist()
    output = rng.integers(0, vocab, int(rng.integers(1, 30))).tolist()
    for k in (1, 3, 8):
        for min_match in (1, 2):
            steps = oracle_steps(prompt, output, k, min_match)
            assert steps == _naive_steps(prompt, output, k, min_match)
            assert 1 <= steps <= len(output)
        assert oracle_steps(prompt, output, k, 2) >= oracle_steps(prompt, output, k, 1)  # a longer anchor: fewer copies
        assert oracle_steps(prompt, output, k + 1) <= oracle_steps(prompt, output, k)


def test_reads_a_serving_benchmarks_outputs(tmp_path, capsys):
    prompts = {"code-edit": {"1": [["rename", [1, 2, 3, 4]]]}}
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "run0-vanilla.json").write_text(json.dumps({"code-edit@1": {"outputs": [[1, 2, 3, 4, 9]]}}))
    assert lookup_bound.main([str(tmp_path), "--k", "2,8"]) == 0
    out = capsys.readouterr().out
    assert "| code-edit | 1 | 2 | 5 | 3 | 1.67 |" in out  # 1 (new), 2 3 copied + 4, 9 (new)
    assert "| code-edit | 1 | 8 | 5 | 2 | 2.50 |" in out  # 1, then 2 3 4 copied + 9
