"""Where a benchmark ran: CPU, threads, library versions, date, command line."""

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


def environment(argv: list[str] | None = None) -> dict:
    import torch
    import transformers

    import freespec

    return {
        "cpu_model": cpu_model(),
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
