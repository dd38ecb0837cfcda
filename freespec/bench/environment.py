"""Where a benchmark ran: CPU (model and matrix features), GPU, threads, library versions, date, command line.

What a forward costs depends on the matrix units more than on the clock: on
a Xeon with AMX a bfloat16 forward over many tokens costs about a one-token
forward, while without it (or in float32) cost grows with the tokens fed.
``cpu_features()`` reads those units from ``/proc/cpuinfo``'s flags.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from importlib.metadata import PackageNotFoundError, version


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


MATRIX_FLAGS = ("amx_bf16", "amx_tile", "amx_int8", "avx512_bf16", "avx512_fp16", "avx512f", "avx_vnni", "avx2")


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> dict[str, bool] | None:
    """Which of ``MATRIX_FLAGS`` the first CPU lists in ``cpuinfo``; None where the file has no flags.

    A ``flags : fpu avx2 amx_tile`` line -> ``{"amx_bf16": False, "amx_tile": True, ..., "avx2": True}``.
    """
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {flag: flag in flags for flag in MATRIX_FLAGS}
    except OSError:
        pass
    return None


def gpu_name() -> str | None:
    """``torch.cuda``'s name of device 0, or None without a usable GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def environment(argv: list[str] | None = None) -> dict:
    import torch
    import transformers

    import freespec

    return {
        "cpu_model": cpu_model(),
        "cpu_features": cpu_features(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "freespec": freespec.__version__,
        "numba": _version("numba"),
        "numpy": _version("numpy"),
        "arctic_inference": _version("arctic-inference"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["freespec"] + list(sys.argv[1:] if argv is None else argv)),
    }
