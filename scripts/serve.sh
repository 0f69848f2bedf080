#!/usr/bin/env bash
# Install (the cached serve venv: what serving needs, no test tools) and start the OpenAI-compatible
# server; no MODEL argument = the default model.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/scripts/env.sh" serve
exec tpuserve serve "$@"
