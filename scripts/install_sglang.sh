#!/usr/bin/env bash
# Install SGLang for the CPU tests of the SGLang plugin (tests/test_sglang_plugin.py).
#
# sglang's own requirements pull CUDA wheels (flashinfer, sgl-kernel, ...) and pin
# another transformers, so sglang goes in with --no-deps, followed by the few pure
# Python packages that importing its plugin, server_args and ngram_worker modules
# needs on a CPU machine. torch, transformers, numpy, numba and tokenizers are held
# at the installed versions. sgl_kernel and torchvision are NOT installed (their
# wheels need CUDA torch): the tests use import-only stand-ins from tests/sglang_stubs.
# Idempotent: exits at once when everything is already there.
set -euo pipefail

SGLANG_VERSION=0.5.21
PY=${PYTHON:-python}
# pins where sglang 0.5.21 pins them; apache-tvm-ffi also builds its C++ NgramCorpus
PACKAGES=(
  pybase64 triton starlette msgspec pyzmq aiohttp dill einops "compressed-tensors==0.18.0"
  "openai==2.6.1" partial_json_parser setproctitle uvicorn fastapi "apache-tvm-ffi==0.1.11"
  orjson ipython sentencepiece
)

installed() {
  "$PY" - "$SGLANG_VERSION" "${PACKAGES[@]}" <<'PYEOF'
import importlib.metadata as md
import sys

want_sglang, packages = sys.argv[1], sys.argv[2:]
try:
    ok = md.version("sglang") == want_sglang
    for spec in packages:
        name, _, pin = spec.partition("==")
        version = md.version(name)
        ok = ok and (not pin or version == pin)
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

if installed; then
  echo "install_sglang: sglang $SGLANG_VERSION and its test dependencies are installed"
  exit 0
fi

constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'PYEOF'
import importlib.metadata as md

for name in ("torch", "transformers", "numpy", "numba", "tokenizers", "huggingface-hub", "safetensors"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PYEOF

"$PY" -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
"$PY" -m pip install --quiet -c "$constraints" "${PACKAGES[@]}"

here=$(cd "$(dirname "$0")/.." && pwd)
PYTHONPATH="$here/tests/sglang_stubs${PYTHONPATH:+:$PYTHONPATH}" "$PY" -W ignore -c \
  "import sglang.srt.plugins.hook_registry, sglang.srt.server_args, sglang.srt.speculative.ngram_worker"
echo "install_sglang: sglang $SGLANG_VERSION installed"
