"""A tiny random-weight Llama with a byte-level BPE tokenizer trained in code, saved as a Hugging Face directory.

Deterministic for a seed: the tokenizer is trained on a seeded synthetic corpus and the weights are drawn from
a seeded generator, so every run of the serve tests sees the same model. The corpus is plain ASCII and the BPE
alphabet only what the corpus contains, so every token decodes to whole characters: streamed and non-streamed
text then agree token by token (no partial UTF-8 sequences held back by an incremental detokenizer).

    python -m kvretain.models.tiny_llama DIR [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 1024
MAX_POSITIONS = 2048
MARKER = "kvretain-tiny-llama.json"
"""Written last: a directory with it is complete (and records the seed it was built with)."""


def _corpus(rng: random.Random, num_lines: int = 4000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(num_lines)]


def build(out: Path, seed: int = 0) -> Path:
    """Build the model into ``out`` (skipped when ``out`` already holds one built with ``seed``)."""
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("seed") == seed:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(_corpus(rng), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        model_max_length=MAX_POSITIONS,
    )
    fast.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        # NOTE: 10x Llama's 0.02: random logits then have wide top-1 margins, so greedy decoding does not flip
        # between batch shapes on numerical noise (the serve tests compare streamed and non-streamed text).
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    marker.write_text(json.dumps({"seed": seed, "vocab_size": len(fast)}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    build(args.out, args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
