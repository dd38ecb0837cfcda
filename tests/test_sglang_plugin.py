"""The SGLang plugin against a real (CPU-installed) SGLang: discovery, hooks, flags, worker, C++ corpus.

Importing sglang patches transformers and sets cache env vars process-wide, so
the checks run in one child process (``python tests/test_sglang_plugin.py
--json OUT``) that imports sglang once; each pytest test below reports one
check. ``tests/sglang_stubs`` (import-only ``sgl_kernel`` and ``torchvision``)
is put on the child's ``sys.path`` only. Install SGLang for these tests with
``bash scripts/install_sglang.sh``; without it they skip.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from array import array
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
STUBS = HERE / "sglang_stubs"
CHECKS: dict[str, callable] = {}


class Skip(Exception):
    """A check that cannot run here; the reason is reported as a pytest skip."""


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


# ============================================================ pytest side
pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("sglang") / "results.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FREESPEC_", "SGLANG_PLUGINS"))}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    if not out.exists():
        pytest.fail(f"the SGLang check process died (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    data = json.loads(out.read_text())
    if "unavailable" in data:
        pytest.skip(f"sglang is not importable here ({data['unavailable']}); "
                    f"install it with: bash scripts/install_sglang.sh")
    return data


def _report(results, name):
    outcome, detail = results[name]
    if outcome == "skip":
        pytest.skip(detail)
    if outcome == "fail":
        pytest.fail(detail, pytrace=False)


def test_entry_point_is_discovered(results):
    _report(results, "entry_point_is_discovered")


def test_disabled_plugin_changes_nothing(results):
    _report(results, "disabled_plugin_changes_nothing")


def test_incompatible_sglang_fails_loudly(results):
    _report(results, "incompatible_sglang_fails_loudly")


def test_load_plugins_applies_hooks(results):
    _report(results, "load_plugins_applies_hooks")


def test_cli_flags_parse_and_export(results):
    _report(results, "cli_flags_parse_and_export")


def test_worker_prepares_drafts_through_the_plugin(results):
    _report(results, "worker_prepares_drafts_through_the_plugin")


def test_worker_overlap_mode_keeps_contexts_in_sync(results):
    _report(results, "worker_overlap_mode_keeps_contexts_in_sync")


def test_worker_never_drafts_image_padding(results):
    _report(results, "worker_never_drafts_image_padding")


def test_same_format_as_sglang_cpp_corpus(results):
    _report(results, "same_format_as_sglang_cpp_corpus")


def test_bench_runs_beside_the_cpp_corpus(results):
    _report(results, "bench_runs_beside_the_cpp_corpus")


def test_unregister_restores_sglang(results):
    _report(results, "unregister_restores_sglang")


# ============================================================ child side
# Run in order, in one process that imported sglang; each leaves the plugin as
# the next expects (hooks installed from load_plugins_applies_hooks on).

def _plugin():
    import freespec.integrations.sglang as plugin

    return plugin


def _reset_plugin_loader():
    import sglang.srt.plugins as sgl_plugins

    sgl_plugins._plugins_loaded = False


def _original_corpus():
    from freespec.integrations.sglang import hooks

    if hooks.installed():
        return hooks.original(hooks.NGRAM_CORPUS)
    from sglang.srt.speculative import ngram_worker

    return ngram_worker.NgramCorpus


@check
def entry_point_is_discovered():
    from importlib.metadata import entry_points

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "freespec"]
    assert ep.value == "freespec.integrations.sglang:register", ep.value
    assert ep.load() is _plugin().register
    os.environ["SGLANG_PLUGINS"] = "freespec"  # SGLang's allow-list
    try:
        found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    finally:
        del os.environ["SGLANG_PLUGINS"]
    assert found["freespec"][0] is _plugin().register, found


@check
def disabled_plugin_changes_nothing():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative import ngram_worker

    from freespec.integrations.sglang import hooks

    original = ngram_worker.NgramCorpus
    _reset_plugin_loader()
    os.environ["SGLANG_PLUGINS"] = "freespec"
    try:
        load_plugins()
    finally:
        del os.environ["SGLANG_PLUGINS"]
    assert ngram_worker.NgramCorpus is original
    assert not hooks.installed() and not any(t in HookRegistry._hooks for t in hooks.TARGETS)


@check
def incompatible_sglang_fails_loudly():
    import sglang

    from freespec.integrations.sglang import hooks

    plugin = _plugin()
    os.environ["FREESPEC_SGLANG"] = "1"
    version = sglang.__version__
    try:
        sglang.__version__ = "0.6.0"
        try:
            plugin.register()
            raise AssertionError("register() accepted sglang 0.6.0")
        except SystemExit as exc:
            assert "0.6.0" in str(exc) and "FREESPEC_SGLANG_ALLOW_UNTESTED" in str(exc), str(exc)
        sglang.__version__ = version
        missing = "sglang.srt.speculative.ngram_worker.NGRAMWorker._no_such_method"
        targets = hooks.TARGETS
        hooks.TARGETS = targets + (missing,)
        try:
            plugin.register()
            raise AssertionError("register() accepted a missing target")
        except SystemExit as exc:
            assert missing in str(exc), str(exc)
        finally:
            hooks.TARGETS = targets

        class ChangedCorpus:
            def __init__(self, max_trie_depth=18, new_knob=1):
                pass

        try:
            hooks.check_corpus_interface(ChangedCorpus)
            raise AssertionError("a changed corpus constructor passed")
        except hooks.IncompatibleSGLang as exc:
            assert "new_knob" in str(exc) and hooks.NGRAM_CORPUS in str(exc), str(exc)
        hooks.check_corpus_interface(_original_corpus())  # the real one passes
        assert not hooks.installed()
    finally:
        sglang.__version__ = version
        del os.environ["FREESPEC_SGLANG"]


@check
def load_plugins_applies_hooks():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative import ngram_worker
    from sglang.srt.speculative.cpp_ngram import ngram_corpus as cpp_module

    from freespec.integrations.sglang import DraftServer, hooks

    original = ngram_worker.NgramCorpus
    _reset_plugin_loader()
    os.environ["SGLANG_PLUGINS"] = "freespec"
    os.environ["FREESPEC_SGLANG"] = "1"
    try:
        load_plugins()
    finally:
        del os.environ["SGLANG_PLUGINS"]
        del os.environ["FREESPEC_SGLANG"]
    assert hooks.installed()
    assert ngram_worker.NgramCorpus is DraftServer and hooks.original(hooks.NGRAM_CORPUS) is original
    assert cpp_module.NgramCorpus is DraftServer  # SGLang propagates a class REPLACE to importers
    assert ServerArgs.add_cli_args.__wrapped__ is not None and ServerArgs.from_cli_args.__wrapped__ is not None
    assert ngram_worker.NGRAMWorker._prepare_draft_tokens.__wrapped__ is not None
    hooks.install()  # a second install registers nothing twice
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert sum(a.dest == "freespec_drafter" for a in parser._actions) == 1


@check
def cli_flags_parse_and_export():
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    from sglang.srt.speculative import ngram_worker

    for key in ("FREESPEC_SGLANG", "FREESPEC_SGLANG_DRAFTER", "FREESPEC_SGLANG_CONFIG"):
        os.environ.pop(key, None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "cfg.json"
        cfg.write_text(json.dumps({"drafter": "suffix", "drafter_options": {"prompt_lookup": {"max_match": 7}}}))
        argv = ["--model-path", "/nonexistent/model", "--device", "cpu", "--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", "8", "--freespec-drafter", "prompt_lookup",
                "--freespec-config", str(cfg)]
        server_args = prepare_server_args(argv)  # what launch_server does: argparse + from_cli_args
        assert isinstance(server_args, ServerArgs) and server_args.speculative_algorithm == "NGRAM"
        assert server_args.speculative_num_draft_tokens == 8
        assert not hasattr(server_args, "freespec_drafter")
        assert os.environ["FREESPEC_SGLANG"] == "1"
        assert os.environ["FREESPEC_SGLANG_DRAFTER"] == "prompt_lookup"
        assert os.environ["FREESPEC_SGLANG_CONFIG"] == str(cfg.resolve())
        # what a spawned scheduler builds: the worker's constructor keywords, drafter from the env
        corpus = ngram_worker.NgramCorpus(min_bfs_breadth=1, max_bfs_breadth=10, match_type="BFS",
                                          capacity=1000, max_trie_depth=18, draft_token_num=8,
                                          external_sam_budget=0, external_corpus_max_tokens=100)
        assert corpus.drafter_name == "prompt_lookup" and corpus.drafter.max_match == 7
        for options, message in (({"prompt_lookup": {"no_such_option": 1}}, "has no option 'no_such_option'"),
                                 ({"mixture": {"max_match": 16}}, "drafter 'mixture' has no option 'max_match'"),
                                 ({"max_match": 16}, "'max_match' is not a drafter")):
            cfg.write_text(json.dumps({"drafter_options": options}))
            try:
                prepare_server_args(argv)  # a section of another drafter than the one served is checked too
                raise AssertionError(f"bad drafter options were accepted: {options}")
            except ValueError as exc:
                assert message in str(exc) and str(cfg) in str(exc), str(exc)
        # launch.sh mixture: the example file with another drafter on the command line
        example = HERE.parent / "examples" / "sglang" / "freespec.json"
        for drafter in ("mixture", "suffix", "corpus"):
            prepare_server_args(argv[:-4] + ["--freespec-drafter", drafter, "--freespec-config", str(example)])
            corpus = ngram_worker.NgramCorpus(max_trie_depth=18, draft_token_num=8)
            assert corpus.drafter_name == drafter, corpus.drafter_name
            assert getattr(corpus.drafter, "adaptive", False) is False
    for key in ("FREESPEC_SGLANG", "FREESPEC_SGLANG_DRAFTER", "FREESPEC_SGLANG_CONFIG"):
        os.environ.pop(key, None)


def _fake_batch(requests, spec_info=None):
    """Requests as SGLang's Req holds them: (rid, prompt, output[, unpadded prompt of a multimodal request])."""
    reqs = []
    for rid, prompt, output, *unpadded in requests:
        padded = array("q", prompt)
        reqs.append(SimpleNamespace(rid=rid, origin_input_ids=padded, output_ids=array("q", output),
                                    origin_input_ids_unpadded=array("q", unpadded[0]) if unpadded else padded))
    return SimpleNamespace(reqs=reqs, spec_info=spec_info, grammar_needs_sync=lambda: False)


def _worker(draft_token_num, max_trie_depth, enable_overlap=False):
    from sglang.srt.speculative import ngram_worker

    worker = ngram_worker.NGRAMWorker.__new__(ngram_worker.NGRAMWorker)  # no model, no GPU
    worker.draft_token_num = draft_token_num
    worker.max_trie_depth = max_trie_depth
    worker.enable_overlap = enable_overlap
    worker.ngram_corpus = ngram_worker.NgramCorpus(max_trie_depth=max_trie_depth, draft_token_num=draft_token_num,
                                                   drafter="prompt_lookup")
    return worker


@check
def worker_prepares_drafts_through_the_plugin():
    import torch
    from sgl_kernel.speculative import reconstruct_indices_from_tree_mask
    from sglang.srt.speculative import ngram_worker
    from test_sglang_adapter import check_sglang_tree

    from freespec.integrations.sglang import DraftServer

    d, depth = 6, 4
    worker = _worker(d, depth)
    assert isinstance(worker.ngram_corpus, DraftServer)
    phrase = [50, 51, 52, 53, 54, 55, 56, 57]
    prompt_a = phrase + list(range(100, 130)) + [50]  # the match is far before the last `depth` tokens
    prompt_b = list(range(200, 210))
    batch = _fake_batch([("a", prompt_a, [51]), ("b", prompt_b, [])])
    tokens, mask = worker._prepare_draft_tokens(batch)
    (tree_a, parents_a), (tree_b, _) = check_sglang_tree(tokens, mask, [51, 209], d)
    assert tree_a == [52, 53, 54, 55, 56] and parents_a == [-1, 0, 1, 2, 3], tree_a  # from the full prompt
    assert tree_b == []
    corpus = worker.ngram_corpus
    assert corpus.drafter.context("a").tolist() == prompt_a + [51]

    # SGLang reads the tree back from the mask alone: first child / next sibling
    next_token, next_sibling = ngram_worker._derive_tree_links(mask.astype(bool), 2, d)
    assert next_token[0].tolist() == [1, 2, 3, 4, 5, -1] and next_sibling[0].tolist() == [-1] * d
    assert next_token[1].tolist() == [1] + [-1] * (d - 1) and next_sibling[1].tolist() == [-1, 2, 3, 4, 5, -1]
    positions = torch.empty(2 * d, dtype=torch.int64)
    index, first_child, sibling = (torch.empty((2, d), dtype=torch.int64) for _ in range(3))
    reconstruct_indices_from_tree_mask(torch.from_numpy(mask).bool(), torch.tensor([40, 10]), positions, index,
                                       first_child, sibling, 2, d)
    assert positions[:d].tolist() == [40, 41, 42, 43, 44, 45] and positions[d:].tolist() == [10] + [11] * 5

    # next step: three tokens accepted for a, one for b; b leaves after it
    batch.reqs[0].output_ids.extend([52, 53, 54])
    batch.reqs[1].output_ids.extend([7])
    worker._update_ngram_corpus(batch)  # batch_put of the tails: accepted
    tokens, mask = worker._prepare_draft_tokens(batch)
    check_sglang_tree(tokens, mask, [54, 7], d)
    assert corpus.drafter.context("a").tolist() == prompt_a + [51, 52, 53, 54]
    assert corpus.drafter.context("b").tolist() == prompt_b + [7]
    assert corpus.num_restarts == 0
    corpus.erase_match_state(["b"])
    assert "b" not in corpus.drafter._contexts and "a" in corpus.drafter._contexts
    corpus.reset()
    assert not corpus.drafter._contexts


@check
def worker_overlap_mode_keeps_contexts_in_sync():
    """Overlap scheduling: the last accepted tokens come from spec_info, not yet in output_ids."""
    import torch
    from test_sglang_adapter import check_sglang_tree

    d, depth = 5, 6
    worker = _worker(d, depth, enable_overlap=True)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, 30, 40)]
    output: list[int] = [int(rng.integers(1, 30))]
    batch = _fake_batch([("r", prompt, output)])
    pending = [int(rng.integers(1, 30))]  # accepted last step, still missing from output_ids
    for _step in range(12):
        accept_tokens = torch.zeros(d, dtype=torch.int64)
        accept_tokens[: len(pending)] = torch.tensor(pending)
        batch.spec_info = SimpleNamespace(accept_tokens=accept_tokens, accept_lens=torch.tensor([len(pending)]))
        batch.reqs[0].output_ids = array("q", output)
        tokens, mask = worker._prepare_draft_tokens(batch)
        check_sglang_tree(tokens, mask, [pending[-1]], d)
        assert worker.ngram_corpus.drafter.context("r").tolist() == prompt + output + pending
        output += pending
        pending = [int(t) for t in rng.integers(1, 30, int(rng.integers(1, d + 1)))]
    assert worker.ngram_corpus.num_restarts == 0


@check
def worker_never_drafts_image_padding():
    """A multimodal prompt: origin_input_ids hold padding values >= 1,000,000 over each image."""
    from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE
    from test_sglang_adapter import check_sglang_tree

    from freespec.integrations.sglang import draft_server, hooks

    assert MM_PAD_SHIFT_VALUE == draft_server.SGLANG_PAD_START
    d, depth, image = 8, 16, 151655
    worker = _worker(d, depth)
    worker.model_runner = SimpleNamespace(model_config=SimpleNamespace(vocab_size=151936))
    phrase = [10, 11, 12, 13]
    unpadded = [image] + phrase + [image] + phrase[:2]
    padded = [MM_PAD_SHIFT_VALUE + 17] * 4 + phrase + [MM_PAD_SHIFT_VALUE + 3001] * 4 + phrase[:2]
    batch = _fake_batch([("mm", padded, [12, 13], unpadded)])
    tokens, mask = worker._prepare_draft_tokens(batch)
    ((drafted, _),) = check_sglang_tree(tokens, mask, [13], d)
    assert drafted == [image, 10, 11, 12, 13], drafted  # from the unpadded prompt
    corpus = worker.ngram_corpus
    assert corpus.vocab_size == 151936 and corpus.drafter.context("mm").tolist() == unpadded + [12, 13]
    assert corpus.num_restarts == 0 and not hooks._worker_reads_unpadded  # 0.5.21 counts padded ids

    # no unpadded prompt at all (a corpus restarted from the tail alone): padding is still never drafted
    corpus.reset()
    tail = (padded + [12, 13])[-depth:]
    tokens, mask = corpus.batch_get(["mm"], [tail], [len(padded) + 2])
    ((drafted, _),) = check_sglang_tree(tokens, mask, [13], d)
    assert all(t < 151936 for t in drafted) and corpus.drafter.context("mm").max() == 151936


@check
def same_format_as_sglang_cpp_corpus():
    from test_sglang_adapter import check_sglang_tree

    from freespec.integrations.sglang import DraftServer

    cpp_class = _original_corpus()
    assert cpp_class is not DraftServer
    d, depth = 8, 18
    try:
        cpp = cpp_class(max_trie_depth=depth, draft_token_num=d, max_bfs_breadth=4, capacity=100000)
    except Exception as exc:  # the C++ JIT build needs a compiler and tvm-ffi
        raise Skip(f"SGLang's C++ NgramCorpus cannot be built here: {type(exc).__name__}: {exc}") from None
    ours = DraftServer(max_trie_depth=depth, draft_token_num=d, drafter="prompt_lookup")

    # repeated text: both propose the same chain, the next d - 1 tokens of the period
    phrase = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    text = phrase * 3 + phrase[:2]
    outputs = []
    for corpus in (cpp, ours):
        corpus.batch_put([text[-depth:]])
        corpus.synchronize()
        outputs.append(corpus.batch_get(["r"], [text[-depth:]], [len(text)]))
    trees = [check_sglang_tree(tokens, mask, [text[-1]], d) for tokens, mask in outputs]
    expected = (phrase * 2)[2:2 + d - 1]
    assert trees[0] == trees[1] == [(expected, list(range(-1, d - 2)))], trees

    # random batches: both satisfy the same contract on the same calls
    rng = np.random.default_rng(0)
    sequences = {f"q{i}": [int(t) for t in rng.integers(1, 12, 30)] for i in range(4)}
    for _step in range(5):
        rids = list(sequences)
        tails = [sequences[rid][-depth:] for rid in rids]
        lens = [len(sequences[rid]) for rid in rids]
        for corpus in (cpp, ours):
            corpus.batch_put(tails)
            corpus.synchronize()
            tokens, mask = corpus.batch_get(rids, tails, lens)
            check_sglang_tree(tokens, mask, [t[-1] for t in tails], d)
        for rid in rids:
            sequences[rid] += [int(t) for t in rng.integers(1, 12, int(rng.integers(1, 4)))]
    for corpus in (cpp, ours):
        corpus.erase_match_state(list(sequences))
        corpus.reset()


@check
def bench_runs_beside_the_cpp_corpus():
    from freespec.integrations.sglang import DraftServer, bench

    try:
        cpp = bench.sglang_corpus(12, 8)
    except Exception as exc:  # the C++ JIT build needs a compiler and tvm-ffi
        raise Skip(f"SGLang's C++ NgramCorpus cannot be built here: {type(exc).__name__}: {exc}") from None
    assert not isinstance(cpp, DraftServer)  # SGLang's own, though the plugin's hooks are installed
    rows = bench.run([2], ["suffix"], steps=3, prompt_len=100, num_draft_tokens=8, depth=12, seed=0, forward_ms=0.0)
    assert [r["corpus"] for r in rows] == ["sglang C++ NgramCorpus", "freespec adapter only", "freespec suffix"]
    assert "| 1.00 |" in bench.table(rows).splitlines()[2]


@check
def unregister_restores_sglang():
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative import ngram_worker
    from sglang.srt.speculative.cpp_ngram import ngram_corpus as cpp_module

    from freespec.integrations.sglang import hooks

    original = hooks.original(hooks.NGRAM_CORPUS)
    _plugin().unregister()
    assert not hooks.installed()
    assert ngram_worker.NgramCorpus is original and cpp_module.NgramCorpus is original
    assert not any(t in HookRegistry._hooks for t in hooks.TARGETS)
    assert not hasattr(ngram_worker.NGRAMWorker._prepare_draft_tokens, "__wrapped__")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert not any(a.dest == "freespec_drafter" for a in parser._actions)


def _run_checks(out_path: str) -> None:
    sys.path.insert(0, str(STUBS))
    sys.path.insert(0, str(HERE))
    results: dict = {}
    try:
        import sglang  # noqa: F401
        import sglang.srt.plugins.hook_registry  # noqa: F401
        import sglang.srt.server_args  # noqa: F401
        import sglang.srt.speculative.ngram_worker  # noqa: F401
    except Exception as exc:
        results["unavailable"] = f"{type(exc).__name__}: {exc}"
    else:
        for name, fn in CHECKS.items():
            try:
                fn()
                results[name] = ("pass", "")
            except Skip as exc:
                results[name] = ("skip", str(exc))
            except BaseException:  # SystemExit included: a check must not end the run
                results[name] = ("fail", traceback.format_exc())
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", required=True, help="where to write {check: [outcome, detail]}")
    _run_checks(parser.parse_args().json)
