"""Empty stand-in wheels for the CUDA-only packages an sglang release requires.

    python scripts/sglang_stubs.py 0.5.21 OUT_DIR
    pip install --find-links OUT_DIR -c OUT_DIR/constraints.txt torch==2.13.0 sglang==0.5.21 ...

sglang's requirements (read from tests/data/sglang_releases.json) include GPU kernels and CUDA
builds that cannot load with the CPU torch; some have no wheel for this platform at all. For each
one on a package named in ``CUDA_ONLY``, OUT_DIR gets ``NAME-VERSION+stub-py3-none-any.whl`` and
``constraints.txt`` pins ``NAME==VERSION+stub``, so pip takes the stand-in for those names and
resolves every other requirement of sglang from PyPI. VERSION is the one sglang pins, or the lower
bound of its range, or ``STUB_VERSIONS``' entry. ``sglang==0.5.21`` requires
``sglang-kernel==0.4.7`` -> ``sglang_kernel-0.4.7+stub-py3-none-any.whl``.

The wheels hold no code: the few modules the SGLang tests import from these packages are
import-only stubs in tests/sglang_stubs, which the tests put on ``sys.path`` themselves.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ROOT / "tests" / "data" / "sglang_releases.json"
CUDA_ONLY = {
    "cuda-python", "cuda-tile", "deepseek-recipe", "flash-attn-4", "flashinfer-cubin", "flashinfer-python", "helion",
    "humming-kernels", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep",
    "sgl-deep-gemm", "sgl-flash-mla", "sgl-kernel", "sglang-kernel", "tilelang", "tokenspeed-mla",
    "torch-memory-saver", "torchao", "torchaudio", "torchcodec", "torchvision",
}
STUB_VERSIONS = {"torchvision": "0.28.0"}  # the release built for torch 2.13; transformers reads the number


def stub_version(requirement: Requirement) -> str:
    """``==0.4.7`` -> ``0.4.7``, ``>=13.0`` -> ``13.0``; unpinned -> ``STUB_VERSIONS`` or ``0``."""
    for spec in requirement.specifier:
        if spec.operator in ("==", "===", ">=", "~="):
            return spec.version
    return STUB_VERSIONS.get(canonicalize_name(requirement.name), "0")


def write_wheel(out_dir: Path, requirement: Requirement) -> str:
    """Write the stand-in wheel; returns its constraint line ``name==version+stub``."""
    version = f"{stub_version(requirement)}+stub"
    dist = re.sub(r"[-_.]+", "_", canonicalize_name(requirement.name))
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": "Metadata-Version: 2.1\n"
                            f"Name: {requirement.name}\nVersion: {version}\n"
                            "Summary: empty stand-in for a CUDA-only package (freespec's SGLang tests on CPU)\n"
                            + "".join(f"Provides-Extra: {extra}\n" for extra in sorted(requirement.extras)),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: freespec sglang_stubs\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(out_dir / f"{dist}-{version}-py3-none-any.whl", "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return f"{canonicalize_name(requirement.name)}=={version}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sglang_version", help="an sglang release listed in tests/data/sglang_releases.json")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    releases = json.loads(RELEASES.read_text())["releases"]
    if args.sglang_version not in releases:
        parser.error(f"sglang_version {args.sglang_version!r} is not in {RELEASES.name}: {', '.join(releases)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for old in args.out_dir.glob("*.whl"):
        old.unlink()
    constraints = []
    for line in releases[args.sglang_version]["requires_dist"]:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) in CUDA_ONLY:
            constraints.append(write_wheel(args.out_dir, requirement))
    (args.out_dir / "constraints.txt").write_text("\n".join(sorted(set(constraints))) + "\n")
    print(f"sglang_stubs: {len(constraints)} stand-in wheels for sglang {args.sglang_version} in {args.out_dir}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
