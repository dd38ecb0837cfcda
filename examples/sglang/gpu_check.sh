#!/usr/bin/env bash
# GPU check of the freespec SGLang plugin (needs a CUDA machine with sglang installed).
#
#   MODEL=/path/to/Qwen2.5-0.5B-Instruct bash examples/sglang/gpu_check.sh
#
# Starts three SGLang servers one after the other on the same prompts:
#   baseline  no speculation
#   ngram     --speculative-algorithm NGRAM with SGLang's own n-gram corpus
#   freespec  the same, drafts from freespec ($DRAFTER, default prompt_lookup)
# and prints, for batch 1/8/32 (concurrent requests), output tokens/s, the mean
# accept length (tokens per verify forward) and how many greedy outputs equal
# the baseline's. Batch 1 must match exactly; at 8/32 batched kernels may
# legitimately flip near-ties, so mismatches there are reported, not failed.
# Kept under 10 minutes: each server start is capped at SERVER_START_S (180 s),
# each run at 64 new tokens per request, the whole script at TOTAL_S (570 s).
set -euo pipefail

: "${MODEL:?set MODEL to a local model path (e.g. Qwen2.5-0.5B-Instruct)}"
here=$(cd "$(dirname "$0")" && pwd)
DRAFTER=${DRAFTER:-prompt_lookup}
PORT=${PORT:-30111}
NUM_DRAFT_TOKENS=${NUM_DRAFT_TOKENS:-16}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
SERVER_START_S=${SERVER_START_S:-180}
TOTAL_S=${TOTAL_S:-570}
EXTRA_ARGS=${EXTRA_ARGS:-}
OUT=${OUT:-$(mktemp -d)}
deadline=$((SECONDS + TOTAL_S))
server_pid=""

stop_server() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -- "-$server_pid" 2>/dev/null || kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  server_pid=""
}
trap stop_server EXIT

run_config() {  # name, then server flags
  local name=$1; shift
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 60 ]; then echo "skip $name: time budget spent" >&2; return 0; fi
  echo "== $name: starting server" >&2
  # setsid: the server and its scheduler processes form one group, stopped together
  setsid python -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --mem-fraction-static 0.6 \
    --max-running-requests 32 $EXTRA_ARGS "$@" >"$OUT/$name.log" 2>&1 &
  server_pid=$!
  local waited=0
  until curl -sf "http://127.0.0.1:$PORT/health_generate" >/dev/null 2>&1; do
    sleep 2; waited=$((waited + 2))
    if ! kill -0 "$server_pid" 2>/dev/null || [ "$waited" -ge "$SERVER_START_S" ]; then
      echo "$name: server did not come up; last log lines:" >&2; tail -30 "$OUT/$name.log" >&2
      stop_server; return 1
    fi
  done
  timeout $((deadline - SECONDS)) python - "$name" "$PORT" "$MAX_NEW_TOKENS" "$OUT" <<'PYEOF'
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor

name, port, max_new, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
passage = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
           "How vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow. ")
code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
prompts = []
for i in range(32):
    if i % 2:
        prompts.append(f"Repeat this text exactly, then stop.\nText {i}: {passage * 2}\nRepeated text {i}:")
    else:
        prompts.append(f"Rename every function in this code by adding the suffix _{i}, keep the rest:\n"
                       f"{code * 2}\nAnswer:\n")

def generate(prompt):
    body = json.dumps({"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new}})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body.encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())

generate(prompts[0])  # warm-up
rows = {}
for batch in (1, 8, 32):
    chosen = prompts[:batch] if batch > 1 else prompts[:4]  # batch 1: four sequential requests
    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(generate, chosen))
    wall = time.perf_counter() - start
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    verify = sum(r["meta_info"].get("spec_verify_ct", 0) for r in results)
    rows[batch] = {"tok_s": tokens / wall, "accept": tokens / verify if verify else 1.0,
                   "texts": [r["text"] for r in results]}
json.dump(rows, open(f"{out}/{name}.json", "w"))
PYEOF
  stop_server
}

run_config baseline
run_config ngram --speculative-algorithm NGRAM --speculative-num-draft-tokens "$NUM_DRAFT_TOKENS"
run_config freespec --speculative-algorithm NGRAM \
  --speculative-num-draft-tokens "$NUM_DRAFT_TOKENS" --freespec-drafter "$DRAFTER" \
  --freespec-config "$here/freespec.json"
grep -h "freespec" "$OUT/freespec.log" | head -3 >&2 || true

python - "$OUT" <<'PYEOF'
import json, os, sys

out = sys.argv[1]
runs = {n: json.load(open(f"{out}/{n}.json")) for n in ("baseline", "ngram", "freespec")
        if os.path.exists(f"{out}/{n}.json")}
if "baseline" not in runs:
    sys.exit("no baseline run: see the logs in " + out)
base = runs["baseline"]
print(f"{'config':<10} {'batch':>5} {'tok/s':>9} {'speedup':>8} {'accept':>7} {'same as baseline':>17}")
failed = False
for name, rows in runs.items():
    for batch, row in rows.items():
        ref = base[batch]
        same = sum(a == b for a, b in zip(row["texts"], ref["texts"]))
        print(f"{name:<10} {batch:>5} {row['tok_s']:>9.1f} {row['tok_s'] / ref['tok_s']:>7.2f}x "
              f"{row['accept']:>7.2f} {same:>8}/{len(ref['texts'])}")
        failed |= batch == "1" and same != len(ref["texts"])
print(f"logs and raw results: {out}")
sys.exit("greedy output at batch 1 differs from no speculation" if failed else 0)
PYEOF
