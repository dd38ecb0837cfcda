#!/usr/bin/env bash
# Create a virtualenv and pip install into it, or reuse it while nothing it was built from changed.
#   bash scripts/make_venv.sh VENV PIP_INSTALL_ARGS...
# torch is the CPU wheel 2.13.0 (an unpinned torch pulls a multi-GB CUDA build). The venv is reused
# while the arguments, pyproject.toml and the files the arguments name are unchanged; otherwise it
# is built from scratch, so pip resolves every requirement anew, as for a user's fresh install.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: make_venv.sh VENV PIP_INSTALL_ARGS...}
shift
stamp=$({ printf '%s\n' "$@"; cat pyproject.toml; for arg in "$@"; do if [ -f "$arg" ]; then cat "$arg"; fi; done; } \
  | sha256sum | cut -d' ' -f1)
if [ -f "$venv/.freespec-stamp" ] && [ "$(cat "$venv/.freespec-stamp")" = "$stamp" ]; then
  echo "make_venv: $venv is up to date"
  exit 0
fi
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 "$@"
echo "$stamp" >"$venv/.freespec-stamp"
echo "make_venv: built $venv"
