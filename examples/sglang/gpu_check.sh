#!/usr/bin/env bash
# GPU check of the freespec SGLang plugin: one GPU, under 10 minutes.
#
#   MODEL=/path/to/Qwen2.5-0.5B-Instruct bash examples/sglang/gpu_check.sh
#
# Starts one SGLang server after another, on the same GPU and port:
#   baseline                 no speculation (also logs the top-2 logprobs of its batch-1 outputs)
#   ngram                    --speculative-algorithm NGRAM with SGLang's own corpus
#   freespec-mixture         NGRAM with drafts from freespec, plus the server checks: aborted
#                            streams, /abort_request, /flush_cache, flat scheduler memory
#   freespec-prompt_lookup   NGRAM with drafts from freespec
#   freespec-suffix          NGRAM with drafts from freespec
# Each serves code-edit and open-chat workloads (up to 320 new tokens, greedy) at concurrency
# 1, 8 and 32 (gpu_check.py client). A freespec server fails unless its log shows freespec
# serving drafts (gpu_check.py log-check). After each server the script waits until the GPU's
# memory is back to what it was before the first one (gpu_check.py wait-gpu-free).
# gpu_check.py report then prints one table (tokens/s, speedup, accept length per workload)
# and the batch-1 greedy comparison with no speculation (equal, or first different at a
# near-tie: see gpu_check.py). Exit status 0 only if everything passed.
#
# Settings (env): PYTHON, PORT (30111), GPU (0), NUM_DRAFT_TOKENS (16), SERVER_START_S (150),
# TOTAL_S (570, the whole script), OUT (a new temp dir: logs and JSON results), EXTRA_ARGS
# (more server flags, split on spaces).
set -euo pipefail

: "${MODEL:?set MODEL to a local model path (e.g. Qwen2.5-0.5B-Instruct)}"
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
PORT=${PORT:-30111}
GPU=${GPU:-0}
NUM_DRAFT_TOKENS=${NUM_DRAFT_TOKENS:-16}
SERVER_START_S=${SERVER_START_S:-150}
TOTAL_S=${TOTAL_S:-570}
OUT=${OUT:-$(mktemp -d)}
read -r -a extra_args <<<"${EXTRA_ARGS:-}"
deadline=$((SECONDS + TOTAL_S))
server_pid=""
gpu_baseline=""
failed=0

check() { "$PYTHON" "$here/gpu_check.py" "$@"; }

stop_server() {  # the server's whole process group, then wait for the GPU memory to come back
  [ -n "$server_pid" ] || return 0
  kill -- "-$server_pid" 2>/dev/null || true
  for _ in $(seq 30); do
    kill -0 -- "-$server_pid" 2>/dev/null || break
    sleep 1
  done
  kill -9 -- "-$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
  if ! check wait-gpu-free --baseline-mib "$gpu_baseline" --gpu "$GPU"; then
    echo "gpu_check: GPU memory was not released after the server stopped" >&2
    failed=1
  fi
}
trap stop_server EXIT

start_server() {  # name, then server flags; returns 1 if it does not come up
  local name=$1
  shift
  # setsid: the server and the scheduler processes it spawns form one group, stopped together
  setsid "$PYTHON" -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --mem-fraction-static 0.6 \
    --max-running-requests 32 --cuda-graph-max-bs 32 ${extra_args[@]+"${extra_args[@]}"} "$@" \
    >"$OUT/$name.log" 2>&1 &
  server_pid=$!
  local waited=0
  until curl -sf "http://127.0.0.1:$PORT/health_generate" >/dev/null 2>&1; do
    sleep 2
    waited=$((waited + 2))
    if ! kill -0 "$server_pid" 2>/dev/null || [ "$waited" -ge "$SERVER_START_S" ]; then
      echo "gpu_check: $name did not come up; last log lines:" >&2
      tail -30 "$OUT/$name.log" >&2
      return 1
    fi
  done
}

run_config() {  # name, client flags, --, server flags
  local name=$1
  shift
  local client_args=()
  while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
    client_args+=("$1")
    shift
  done
  shift
  if [ $((deadline - SECONDS)) -lt 90 ]; then
    echo "gpu_check: skip $name: the time budget is spent" >&2
    return 0
  fi
  echo "== $name" >&2
  if start_server "$name" "$@"; then
    if ! timeout "$((deadline - SECONDS > 1 ? deadline - SECONDS : 1))" "$PYTHON" "$here/gpu_check.py" client \
        "$name" --port "$PORT" --out "$OUT" --model "$MODEL" --server-pid "$server_pid" \
        ${client_args[@]+"${client_args[@]}"}; then
      echo "gpu_check: the $name client failed (see $OUT/$name.log)" >&2
      failed=1
    fi
  else
    failed=1
  fi
  stop_server
  if [[ $name == freespec-* ]] && ! check log-check "$OUT/$name.log" --drafter "${name#freespec-}"; then
    failed=1
  fi
}

mkdir -p "$OUT"
rm -f "$OUT"/baseline.json "$OUT"/ngram.json "$OUT"/freespec-*.json  # no stale results from an earlier run
gpu_baseline=$(check gpu-memory --gpu "$GPU")
ngram=(--speculative-algorithm NGRAM --speculative-num-draft-tokens "$NUM_DRAFT_TOKENS")
freespec=("${ngram[@]}" --freespec-config "$here/freespec.json")
run_config baseline --logprobs --
run_config ngram -- "${ngram[@]}"
run_config freespec-mixture --checks -- "${freespec[@]}" --freespec-drafter mixture
run_config freespec-prompt_lookup -- "${freespec[@]}" --freespec-drafter prompt_lookup
run_config freespec-suffix -- "${freespec[@]}" --freespec-drafter suffix
check report "$OUT" || failed=1
echo "gpu_check: logs and raw results in $OUT" >&2
exit "$failed"
