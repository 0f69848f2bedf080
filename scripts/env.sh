#!/usr/bin/env bash
# Create (once) and activate one of the project's two virtual environments:
#   source scripts/env.sh serve   what serving needs (requirements/serve.txt + serve-nodeps.txt +
#                                 nodeps.txt): no test tools, no oracles;
#   source scripts/env.sh test    the serve pins plus the tests' (requirements/test.txt).
# Each lives under ~/.cache/tpuserve/, keyed by a hash of every file it pins (and the interpreter),
# so a rerun with the same pins reuses it and a change of pins builds a fresh one. TPUSERVE_VENV
# overrides the directory.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
role="${1:-}"
case "$role" in
  serve) pins=("$repo/requirements/serve.txt") ;;
  test) pins=("$repo/requirements/serve.txt" "$repo/requirements/test.txt") ;;
  *)
    echo "[tpuserve] usage: source scripts/env.sh serve|test (got '${role}')" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
nodeps=("$repo/requirements/serve-nodeps.txt" "$repo/requirements/nodeps.txt")
key="$( (cat "${pins[@]}" "${nodeps[@]}"; "$py" --version) | sha256sum | cut -c1-16)"
venv="${TPUSERVE_VENV:-$HOME/.cache/tpuserve/venv-$role-$key}"
if [ ! -f "$venv/.complete" ]; then
  echo "[tpuserve] building the $role venv $venv (first run only)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  # The last pins file of the role (test.txt includes serve.txt itself).
  "$venv/bin/pip" install -q -r "${pins[-1]}" >&2
  # Packages whose declared dependencies we must not install (each file says why).
  for f in "${nodeps[@]}"; do
    "$venv/bin/pip" install -q --no-deps -r "$f" >&2
  done
  touch "$venv/.complete"
fi
# The project itself, editable and without deps (all pinned above), once per checkout and package
# layout: a repeat would cost every start ~2 s of pip for nothing.
layout="$( (echo "$repo"; cat "$repo/setup.py" "$repo/pyproject.toml"; cd "$repo" \
  && find . -name __init__.py -not -path './.*' -not -path './tests/*' -not -path './build/*' | sort) | sha256sum | cut -c1-16)"
if [ ! -f "$venv/.editable-$layout" ]; then
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2 2>/dev/null \
    || "$venv/bin/pip" install -q --no-deps -e "$repo" >&2
  rm -f "$venv"/.editable-*
  touch "$venv/.editable-$layout"
fi
export PATH="$venv/bin:$PATH"
export TPUSERVE_VENV_DIR="$venv"
