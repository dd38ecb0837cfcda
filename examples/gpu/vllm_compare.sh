#!/usr/bin/env bash
# The serving comparison on one GPU: plain vLLM, vLLM ngram, vLLM suffix and vLLM with freespec's proposer,
# the same model, dtype and engine settings, the same prompts (code edits and Spec-Bench), engines in the
# order A B C D D C B A, concurrency 1 and 8; prints one table (integrations/vllm/bench.py). About 8 engine
# starts of a 0.5B model plus the runs: within 10 minutes on one recent GPU.
#   bash examples/gpu/vllm_compare.sh [extra bench arguments]
#   bash examples/gpu/vllm_compare.sh --batch 32 --code-edit 1 --spec-bench 1 --out runs/gpu-vllm-32
#     (32 requests at once: steps of more than the cost curve's 129 tokens, where a GPU's cost bends)
# Needs the official vLLM build and a CUDA device: pip install ".[vllm]" (0.34: examples/gpu/vllm034_compare.py runs
# the same benchmark with method freespec and vLLM's own device-side suffix; 0.32-0.33 also need arctic-inference
# for suffix).
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "vllm_compare: no CUDA device on this machine (nvidia-smi finds none); nothing to run" >&2
  exit 0
fi
version=$(python -c "import vllm; print(vllm.__version__)" 2>/dev/null) \
  || { echo "vllm_compare: vLLM is not installed: pip install \".[vllm]\"" >&2; exit 2; }
case $version in
  0.34.*) runner=(python examples/gpu/vllm034_compare.py) ;;  # method freespec, vLLM's own device-side suffix
  *) runner=(python -m freespec.integrations.vllm.bench) ;;    # 0.32-0.33: method custom_class
esac
echo "vllm_compare: vllm $version: ${runner[*]}"
exec "${runner[@]}" --model qwen2.5-coder-0.5b --dtype bfloat16 --compile \
  --code-edit 8 --spec-bench 16 --out runs/gpu-vllm "$@"
