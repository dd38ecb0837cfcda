#!/usr/bin/env bash
# SGLang server whose NGRAM drafts come from a freespec drafter.
#   MODEL=/path/to/Qwen2.5-0.5B-Instruct bash examples/sglang/launch.sh [DRAFTER]
# The drafter on the command line overrides the config file's "drafter" and takes that
# drafter's own section of its "drafter_options" (its defaults when the file has none).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${MODEL:?set MODEL to a local model path}"
DRAFTER=${1:-prompt_lookup}

exec python -m sglang.launch_server \
  --model-path "$MODEL" \
  --port "${PORT:-30000}" \
  --speculative-algorithm NGRAM \
  --speculative-num-draft-tokens 16 \
  --freespec-drafter "$DRAFTER" \
  --freespec-config "$here/freespec.json"
