#!/usr/bin/env bash
# A virtualenv with vLLM 0.34's official wheel and freespec, for the tests of freespec's V2-runner speculator on a
# machine without a GPU (run them with `bash scripts/test_env.sh vllm034`).
#   bash scripts/install_vllm034.sh [VENV]     # default: .ci/venvs/vllm034
#
# What a user runs, pip install ".[vllm]", resolves vLLM 0.34.0 with its CUDA stack: torch==2.14.0 (the CUDA
# build), flashinfer-python==0.7.3 (not on the registry this project reaches: pip stops there), CUTLASS, TileLang
# and other GPU kernel packages. Here the same wheel is installed without them: `--no-deps`, then every
# requirement its METADATA declares except torch and those CUDA-only packages, beside the CPU torch 2.13.0
# (the V2 runner's Python imports with it; its compiled vllm._C does not load, and nothing here calls it).
# About 3.5 minutes and 2 GB with an empty pip cache. Reused while nothing it is built from changed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${FREESPEC_VENVS:-.ci/venvs}/vllm034}
vllm_version=0.34.0
stamp_args=("vllm==$vllm_version" --no-deps)
bash scripts/make_venv.sh "$venv" "${stamp_args[@]}"
if [ ! -f "$venv/.freespec-vllm034-deps" ] || [ "$(cat "$venv/.freespec-stamp")" != "$(cat "$venv/.freespec-vllm034-deps")" ]; then
  "$venv/bin/python" - "$venv/vllm034-requirements.txt" <<'PY'
import re, sys
from importlib.metadata import distribution

cuda_only = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|apache-tvm-ffi|"
                       r"tilelang|nvidia-|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|"
                       r"humming-kernels)\b", re.IGNORECASE)
wanted = [req for req in distribution("vllm").requires or () if "extra ==" not in req and not cuda_only.match(req)]
open(sys.argv[1], "w").write("\n".join(wanted) + "\n")
PY
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 -r "$venv/vllm034-requirements.txt" \
    -e ".[test]"
  cp "$venv/.freespec-stamp" "$venv/.freespec-vllm034-deps"
  "$venv/bin/python" -W ignore -c "import vllm, freespec.integrations.vllm.speculator; print('install_vllm034: vllm', vllm.__version__)" \
    2>&1 | grep -v "vllm._C" || true
fi
