#!/usr/bin/env bash
# Issue 35 as a newcomer meets it: the seconds from `bash scripts/serve.sh` to the first answered
# chat completion (16 tokens), polling every 0.2 s; then the server is stopped.
#   bash benchmarks/first_answer.sh [CHECKOUT] [LOG]      (CHECKOUT: a fresh clone; default: this one)
# Empty ~/.cache/tpuserve first for a cold run (venv included); run it again for a restart.
set -uo pipefail
dir=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
log=${2:-/tmp/first_answer.log}
port=${PORT:-8000}
body=$(mktemp)
cd "$dir"
t0=$(date +%s.%N)
bash scripts/serve.sh --port "$port" > "$log" 2>&1 &
pid=$!
until [ "$(curl -s -m 60 -o "$body" -w '%{http_code}' "http://127.0.0.1:$port/v1/chat/completions" \
    -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":16}' 2>/dev/null)" = 200 ]; do
  kill -0 $pid 2>/dev/null || { echo "the server exited; see $log"; exit 1; }
  sleep 0.2
done
t1=$(date +%s.%N)
echo "first answer after $(python3 -c "print(round($t1 - $t0, 1))") s: $(head -c 300 "$body")"
kill $pid; wait $pid 2>/dev/null
rm -f "$body"
