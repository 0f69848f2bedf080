#!/usr/bin/env bash
# Install (cached venv) and start the OpenAI-compatible server; no MODEL argument = the default model.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh"
exec tpuserve serve "$@"
