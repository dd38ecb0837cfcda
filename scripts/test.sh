#!/usr/bin/env bash
# Install freespec with its test extras (torch pinned to the CPU wheel, the newest transformers) and run
# the test suite. CI also runs parts of it in two more environments: scripts/test_env.sh.
#   bash scripts/test.sh                 # the whole suite
#   bash scripts/test.sh -m "not slow"   # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt torch==2.13.0
# not the langchain extra: langchain-huggingface (1.2.3, the newest) pins huggingface-hub<2, which transformers 5.25
# needs >=2.4; its test runs in the lowest environment (scripts/test_env.sh lowest)
"$PY" -m pip install --quiet --disable-pip-version-check -c scripts/constraints.txt -e ".[test,bench,rag]"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # no busy-waiting OpenMP threads on a shared machine
exec "$PY" -m pytest "$@"
