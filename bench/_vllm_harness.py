"""vLLM 0.33's real v1 ``Scheduler`` + ``KVCacheManager`` on CPU, driven without a model.

Shared by ``tests/test_vllm_plugin.py``, ``bench/vllm_plugin.py`` and ``bench/sched_equivalence.py`` (import
it with ``bench/`` on ``sys.path``). No model weights and no hub access: a tiny Llama ``config.json`` in a
directory satisfies ``ModelConfig``, and the model runner's output is built by hand each step
(:func:`runner_output`: one sampled token for every request whose prefill completes in the step or that is
decoding, as vLLM's runner reports them). Imports vLLM lazily, so importing this module needs no vLLM.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvretain.cli_args import integer, number

SAMPLED_TOKEN = 7
"""The token every fake runner step samples."""


def tiny_llama(vocab_size: int, max_len: int) -> dict[str, Any]:
    """A two-layer Llama ``config.json`` (float32): enough for ``ModelConfig``; nothing is ever loaded."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }


def write_tiny_model(directory: str | Path, vocab_size: int = 65536, max_len: int = 131072) -> str:
    """Write :func:`tiny_llama`'s ``config.json`` into ``directory``; returns the directory as a string."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(tiny_llama(vocab_size, max_len)))
    return str(d)


def temp_tiny_model(prefix: str = "tiny-llama-", **kwargs: Any) -> str:
    """:func:`write_tiny_model` into a new temporary directory that is removed when this process exits (a bench
    run leaves nothing in the temporary folder)."""
    d = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, d, True)
    return write_tiny_model(d, **kwargs)


def build_scheduler(model_dir: str, *, num_blocks: int, **config: Any) -> Any:
    """vLLM's ``Scheduler`` over a KV cache of ``num_blocks`` blocks (vLLM's null block included) of
    ``block_size`` tokens (``config``: :func:`_vllm_config`'s keyword arguments), one full-attention group,
    prefix caching on unless ``enable_prefix_caching`` is False; ``policy`` is ``fcfs`` or ``priority``;
    ``reserve_full_isl``: ``scheduler_reserve_full_isl``. Every other setting is vLLM 0.33's default. Built directly, as vLLM's own scheduler tests do: vLLM's start-up
    checks do not run (:func:`start_up_refusal` runs its KV cache check)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = _vllm_config(model_dir, **config)
    block_size = config["block_size"]
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([LAYER], _attention_spec(block_size))],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )


LAYER = "model.layers.0.self_attn"
"""The one attention layer of the harness's KV cache."""


def _attention_spec(block_size: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32)


def _vllm_config(
    model_dir: str,
    *,
    block_size: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    max_model_len: int,
    policy: str = "priority",
    enable_chunked_prefill: bool = True,
    kv_events: bool = False,
    reserve_full_isl: bool = True,
    enable_prefix_caching: bool = True,
) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched_tokens,
            max_model_len=max_model_len,
            policy=policy,
            is_encoder_decoder=False,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduler_reserve_full_isl=reserve_full_isl,
        ),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
    )


def start_up_refusal(model_dir: str, *, num_blocks: int, **config: Any) -> str | None:
    """Why vLLM 0.33 would refuse to start :func:`build_scheduler`'s engine (the same keyword arguments) for its
    KV cache, or None: vLLM's own planning (``vllm/v1/core/kv_cache_planning.py``'s ``get_kv_cache_configs``,
    whose ``_check_enough_kv_cache_memory`` raises "To serve at least one request with the model's max seq len
    ...") on the cache ``--num-gpu-blocks-override num_blocks`` gives a real server (the null block included),
    the layout resolved as the engine core resolves it on this machine (the CPU attention backend's)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    vllm_config = _vllm_config(model_dir, **config)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    specs = [{LAYER: _attention_spec(config["block_size"])}]
    layouts = [[layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]]
    resolve_kv_cache_layout(vllm_config, layouts, specs[0].values())
    groups = get_global_kv_cache_groups(vllm_config, specs)
    try:
        (kv_cache_config,) = get_kv_cache_configs(vllm_config, specs, [2**40], groups)
    except ValueError as e:
        return str(e)
    assert kv_cache_config.num_blocks == num_blocks, kv_cache_config.num_blocks
    return None


def block_hasher(block_size: int) -> Any:
    """vLLM's request block hasher (sha256), its ``NONE_HASH`` initialized."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def add_request(sched: Any, request: Any) -> None:
    """Hand ``request`` to ``sched`` as vLLM's engine core does: its input processing first
    (``EngineCore.preprocess_add_request``: the plugin's arrival hook, a no-op without the plugin), then the
    scheduler's ``add_request``."""
    from kvretain.integrations.vllm._patches import request_arrived

    request_arrived(sched.kv_cache_manager, request)
    sched.add_request(request)


def runner_output(sched: Any, out: Any) -> Any:
    """The model runner's output for scheduler output ``out``: :data:`SAMPLED_TOKEN` for every scheduled
    request that has computed all its tokens after this step (prefill completed, or decoding), nothing for
    a partial prefill chunk."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    requests = sched.requests
    sampled = []
    for rid in req_ids:
        q = requests[rid]
        sampled.append([SAMPLED_TOKEN] if q.num_computed_tokens >= q.num_tokens else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def add_engine_options(
    ap: argparse.ArgumentParser,
    *,
    pool_blocks: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    step_ms: float,
    max_output: int,
) -> None:
    """The engine limits and the trace clock that both lockstep benches (sched_equivalence.py, vllm_plugin.py)
    take, each with its own defaults (its workload's)."""
    ap.add_argument("--block-size", type=integer(1), default=16, help="vLLM tokens per KV block, >= 1")
    ap.add_argument(
        "--pool-blocks",
        type=integer(2, what=" (vLLM's count, its null block included)"),
        default=pool_blocks,
        help="KV cache size in vLLM blocks (its null block included), >= 2",
    )
    ap.add_argument(
        "--max-num-seqs",
        type=integer(1),
        default=max_num_seqs,
        help="most requests running at once (max_num_seqs), >= 1",
    )
    ap.add_argument(
        "--max-batched-tokens",
        type=integer(1),
        default=max_batched_tokens,
        help="token budget per scheduler step (max_num_batched_tokens), >= 1",
    )
    ap.add_argument(
        "--step-ms",
        type=number(0.0, lo_open=True),
        default=step_ms,
        help="trace milliseconds per scheduler step, > 0",
    )
    ap.add_argument(
        "--max-output", type=integer(1), default=max_output, help="cap on generated tokens per request, >= 1"
    )


def engine_options_error(args: argparse.Namespace) -> str | None:
    """Why vLLM 0.33 would refuse :func:`add_engine_options`' limits whatever the rest, or None: its
    ``SchedulerConfig.verify_max_model_len`` refuses ``max_num_batched_tokens < max_num_seqs`` (every engine has a
    ``max_model_len``), which was a pydantic traceback from the vLLM side (sched_equivalence, after the kvretain
    side's run; vllm_plugin, from its first child)."""
    if args.max_batched_tokens < args.max_num_seqs:
        return (
            f"argument --max-batched-tokens: {args.max_batched_tokens:,} is below --max-num-seqs "
            f"({args.max_num_seqs:,}): vLLM refuses to start with max_num_batched_tokens below max_num_seqs"
        )
    return None
