#!/usr/bin/env bash
# A virtualenv with SGLang installed the way `pip install "freespec[sglang]"` installs it, for the
# SGLang tests on a CPU machine (run them with `bash scripts/test_env.sh sglang`).
#   bash scripts/install_sglang.sh [VENV]      # default: .ci/venvs/sglang
#
# pip resolves sglang 0.5.21 together with freespec[sglang,test]: sglang's pins (transformers 5.12.1,
# tokenizers 0.22.2, numba 0.65.1, torch 2.13.0, ...) and its pure-Python dependencies come from PyPI.
# Only the CUDA-only packages it requires (sglang-kernel, flashinfer, torchvision, ...) are replaced,
# by empty stand-in wheels (scripts/sglang_stubs.py); the modules the tests import from them are the
# stand-ins in tests/sglang_stubs. Reused while nothing it is built from changed.
#
# It also installs the tests' own SGLang plugin, tests/sglang_cpu (test support, never part of freespec),
# which with tests/sglang_stubs lets a real SGLang engine verify NGRAM drafts on a CPU (see its README).
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.21
venv=${1:-${FREESPEC_VENVS:-.ci/venvs}/sglang}
stubs="$venv.stub-wheels"
"${PYTHON:-python3}" -c "import packaging" 2>/dev/null || "${PYTHON:-python3}" -m pip install --quiet packaging
"${PYTHON:-python3}" scripts/sglang_stubs.py "$SGLANG_VERSION" "$stubs"
built=$(cat "$venv/.freespec-stamp" 2>/dev/null || true)
bash scripts/make_venv.sh "$venv" --find-links "$stubs" -c "$stubs/constraints.txt" \
  "sglang==$SGLANG_VERSION" -e ".[sglang,test]"
if [ "$(cat "$venv/.freespec-stamp")" != "$built" ]; then
  # the modules the plugin hooks import here, or the plugin tests would only skip
  PYTHONPATH="$PWD/tests/sglang_stubs" "$venv/bin/python" -W ignore -c \
    "import sglang.srt.plugins.hook_registry, sglang.srt.server_args, sglang.srt.speculative.ngram_worker"
fi
# the CPU test support (an editable install: a plugin entry point, no dependencies), also into a reused venv
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e tests/sglang_cpu
echo "install_sglang: sglang $SGLANG_VERSION in $venv"
