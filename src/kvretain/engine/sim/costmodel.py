"""Step-time cost models for the simulator: how long one engine step takes on given hardware.

The ``roofline`` model is the first-order model of the field notes, for a dense decoder in bf16::

    P      = d*h*(n_q + 2*n_kv) + n_q*h*d + 3*d*ffn        weights per layer (QKV, O, SwiGLU MLP)
    F_L    = 2*L*P                                         layer FLOPs per token
    F_V    = 2*V*d                                         LM-head FLOPs per sampled token
    A      = 4*L*n_q*h                                     attention FLOPs per (query, key) pair
    prefill of n new tokens after p cached:  F_L*n + A*(n*p + n*(n+1)/2) + F_V*s
    decode of one token with context C:      F_L + F_V + A*C     (C counts the new token itself)
    KV bytes per token = 2*L*n_kv*h*bytes

Only sampled positions go through the LM head: ``s`` is 1 when the chunk reaches the end of the request's
known tokens (its prefill completes in the step) and 0 for a chunk that does not finish the prompt. Every
decode token is sampled. (The field notes' ``F = F_L + F_V`` per token charged the LM head for every prompt
token: ~7% extra linear FLOPs on Llama-3-8B. vLLM 0.33's GPU runner also computes logits at the last
position of a partial chunk and discards them; that is one LM-head row per partial chunk, not modelled.)

One step of continuous batching with chunked prefill runs all its prefill chunks and decode tokens in one
forward pass, so one roofline covers the whole step::

    t = max(FLOPs / (tp*peak*eff_c), bytes / (tp*bw*eff_b)) + overhead + all-reduce
    bytes = layer weights + LM head (when the step samples) + one embedding row per token
            + kv_bytes * (sum of decode contexts + cached prefixes read + new tokens written)

The input embedding is a lookup: a step reads the rows of its tokens (``tokens*d*bytes``), not the whole
``V*d`` table (+1.05 of 16.06 GB per decode step on Llama-3-8B when counted whole). The LM head matrix is
read once per step that samples anything. With tied embeddings both are the same matrix; it is read whole
only for the LM head. A cached prefix saves its linear FLOPs (its tokens are not in ``n``) but attention
over it is still paid (the ``n*p`` term) and its KV is read. Weights are read once per step however many
tokens it holds, which is what makes large decode batches cheap.

Tensor parallelism splits FLOPs, weights and KV heads evenly over ``tp`` GPUs (``tp`` divides ``n_q`` and
divides ``n_kv`` or is a multiple of it, each KV head then replicated ``tp/n_kv`` times, as vLLM) and adds two ring
all-reduces per layer of the step's activations (``tokens*d*bytes``), each costing
``allreduce_latency + 2*(tp-1)/tp * message / link_bandwidth``, not overlapped with compute. A replicated KV
head is stored on each of its GPUs, its KV cache and its K and V projection weights alike (vLLM's
``QKVParallelLinear`` sizes every rank's K and V for ``max(1, n_kv/tp)`` heads): at ``tp > n_kv`` the KV capacity
is what the replica's memory leaves after ``2*L*d*h*(tp - n_kv)*bytes`` more weights than the model has, over
``2*L*tp*h*bytes`` a token, and every step reads those weights and computes their K and V
(``F_L`` grows by ``4*L*d*h*(tp - n_kv)`` a token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvretain.engine.sim.catalog import GPUSpec, ModelSpec
from kvretain.registry import Registry


def chunk_pairs(n_new: int, n_cached: int) -> int:
    """Attention (query, key) pairs of ``n_new`` tokens computed after ``n_cached`` whose KV is there (causal:
    each new token attends to the cached ones, the new ones before it and itself); a decode token with
    context ``C`` so far is ``chunk_pairs(1, C)`` = ``C + 1``."""
    return n_new * n_cached + n_new * (n_new + 1) // 2


def chunk_counts(chunks: Iterable[tuple[int, int, bool]]) -> tuple[int, int, int, int]:
    """``(tokens, attention pairs, KV tokens read or written, sampled)`` of a step's chunks ``(n_new, n_cached,
    samples)``: what :meth:`CostModel.step_work` prices (a decode with context ``C``, the token being generated
    included, is the chunk ``(1, C - 1, True)``)."""
    tokens = pairs = kv_tokens = sampled = 0
    for n, p, s in chunks:
        tokens += n
        pairs += chunk_pairs(n, p)
        kv_tokens += n + p
        sampled += s
    return tokens, pairs, kv_tokens, sampled


class CostModel:
    """Roofline step-time model of one replica (``tp`` GPUs) serving ``model`` on ``gpu``.

    Pure Python and called once per simulated step, so every constant is precomputed here.
    """

    def __init__(self, model: ModelSpec, gpu: GPUSpec, tp: int | None = None) -> None:
        tp = model.tp if tp is None else tp
        if tp < 1 or model.n_q_heads % tp:
            raise ValueError(f"tp={tp} must be >= 1 and divide n_q_heads={model.n_q_heads}")
        if model.n_kv_heads % tp and tp % model.n_kv_heads:  # (vLLM refuses such a tp)
            raise ValueError(
                f"tp={tp} must divide n_kv_heads={model.n_kv_heads} or be a multiple of it: each GPU holds "
                "whole KV heads, split evenly or replicated"
            )
        self.model, self.gpu, self.tp = model, gpu, tp
        m = model
        d, h = m.d_model, m.head_dim
        self.params_per_layer = (
            d * h * (m.n_q_heads + 2 * m.n_kv_heads) + m.n_q_heads * h * d + 3 * d * m.ffn_dim
        )
        # With tp > n_kv the KV heads are replicated (each GPU holds one, vLLM's QKVParallelLinear), and with
        # them their K and V projection weights: one replica stores tp heads' worth of both, not n_kv.
        kv_heads_per_gpu = max(1, m.n_kv_heads // tp)
        kv_heads_stored = tp * kv_heads_per_gpu
        self.params_per_layer_stored = self.params_per_layer + 2 * d * h * (kv_heads_stored - m.n_kv_heads)
        """Weights of one layer summed over the replica's ``tp`` GPUs, replicated K/V projections included."""
        self.layer_flops_per_token = 2 * m.n_layers * self.params_per_layer_stored
        """``F_L``: FLOPs of the transformer layers' matmuls per token, summed over the ``tp`` GPUs (each GPU
        computes the K and V of the heads it holds, replicated ones included)."""
        self.head_flops_per_sample = 2 * m.vocab_size * d
        """``F_V``: FLOPs of the LM head per sampled token."""
        self.linear_flops_per_token = self.layer_flops_per_token + self.head_flops_per_sample
        """Linear FLOPs of one decode token (layers and LM head): the field notes' ``F``."""
        self.attn_flops_per_pair = 4 * m.n_layers * m.n_q_heads * h
        embeddings = m.vocab_size * d * (1 if m.tied_embeddings else 2)
        self._weight_bytes = (m.n_layers * self.params_per_layer_stored + embeddings) * m.bytes_per_param
        self._layer_bytes = m.n_layers * self.params_per_layer_stored * m.bytes_per_param
        self._head_bytes = m.vocab_size * d * m.bytes_per_param
        self._embed_row_bytes = d * m.bytes_per_param
        self._kv_bytes = 2 * m.n_layers * m.n_kv_heads * h * m.bytes_per_param
        self._kv_bytes_stored = 2 * m.n_layers * kv_heads_stored * h * m.bytes_per_param
        # Per-GPU rates; the work is split evenly over tp GPUs.
        self._sec_per_flop = 1.0 / (tp * gpu.peak_flops * gpu.compute_efficiency)
        self._sec_per_byte = 1.0 / (tp * gpu.mem_bandwidth * gpu.bandwidth_efficiency)
        if tp > 1:
            n_allreduce = 2 * m.n_layers
            self._ar_fixed = n_allreduce * gpu.allreduce_latency_s
            ring = 2 * (tp - 1) / tp
            self._ar_per_token = n_allreduce * ring * d * m.bytes_per_param / gpu.link_bandwidth
        else:
            self._ar_fixed = self._ar_per_token = 0.0
        self._overhead = gpu.step_overhead_s

    # --- sizes ---------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Logical KV bytes per token: ``2*L*n_kv*h*bytes`` (K and V, every layer)."""
        return self._kv_bytes

    def weight_bytes(self) -> int:
        """Bytes of all weights of one replica (layers, input embedding, LM head): what the replica stores,
        the K and V projections of KV heads replicated over ``tp > n_kv`` GPUs once per copy; not what a step
        reads (see :meth:`step_work`)."""
        return self._weight_bytes

    def kv_capacity_tokens(self, gpu_mem_utilization: float = 0.9) -> int:
        """Tokens of KV one replica holds: ``tp * mem * utilization`` minus the weights it stores, over the KV
        bytes a token takes on its ``tp`` GPUs (both with the copies of replicated KV heads, ``tp > n_kv``).

        Activations, CUDA graphs and fragmentation are not modelled (vLLM reserves a further ~1-3 GiB), nor
        vLLM's null block (one of the blocks it counts holds no content: a pool one block smaller; the
        benches that compare with a vLLM server, ``sim_fidelity.py`` and ``sched_equivalence.py``, take it off).
        Raises ``ValueError`` when the weights alone do not fit.
        """
        if not 0 < gpu_mem_utilization <= 1:
            raise ValueError(f"gpu_mem_utilization must be in (0, 1], got {gpu_mem_utilization}")
        free = self.tp * self.gpu.mem_bytes * gpu_mem_utilization - self._weight_bytes
        if free < self._kv_bytes_stored:
            raise ValueError(
                f"{self.model.name} weights ({self._weight_bytes / 1e9:.1f} GB) leave no KV room on "
                f"{self.tp} x {self.gpu.name} at utilization {gpu_mem_utilization}"
            )
        return int(free // self._kv_bytes_stored)

    def kv_capacity_blocks(self, block_size: int, gpu_mem_utilization: float = 0.9) -> int:
        """Whole KV blocks of ``block_size`` tokens one replica holds."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return self.kv_capacity_tokens(gpu_mem_utilization) // block_size

    # --- FLOPs ----------------------------------------------------------------------------------------
    def prefill_flops(self, n_new: int, n_cached: int = 0, samples: bool = True) -> int:
        """FLOPs to prefill ``n_new`` tokens after ``n_cached`` cached ones (whole replica); ``samples``: the
        chunk completes the prompt, so its last token goes through the LM head."""
        pairs = chunk_pairs(n_new, n_cached)
        return self.step_work(n_new, pairs, n_new + n_cached, int(samples))[0]

    def step_work(self, tokens: int, pairs: int, kv_tokens: int, sampled: int) -> tuple[int, int]:
        """``(FLOPs, bytes read or written)`` of one step of ``tokens`` tokens, ``pairs`` attention (query,
        key) pairs, ``kv_tokens`` KV tokens read or written and ``sampled`` tokens through the LM head."""
        flops = (
            self.layer_flops_per_token * tokens
            + self.head_flops_per_sample * sampled
            + self.attn_flops_per_pair * pairs
        )
        nbytes = (
            self._layer_bytes
            + (self._head_bytes if sampled else 0)
            + self._embed_row_bytes * tokens
            + self._kv_bytes_stored * kv_tokens
        )
        return flops, nbytes

    # --- times ----------------------------------------------------------------------------------------
    def step_time(
        self, prefill_chunks: Sequence[tuple[int, int, bool]], decode_contexts: Sequence[int]
    ) -> float:
        """Seconds for one mixed step: prefill chunks ``(n_new, n_cached, samples)`` plus one sampled token
        per decode context.

        ``n_cached`` counts every token before the chunk whose KV is already there (a prefix-cache hit or an
        earlier chunk of the same prompt); ``samples`` is True when the chunk completes the request's known
        tokens (its last token is sampled). A decode context counts the token being generated. An empty step
        takes 0 seconds.
        """
        tokens, pairs, kv_tokens, sampled = chunk_counts(prefill_chunks)
        ctx = sum(decode_contexts)  # a decode's pairs and KV tokens are both its context (chunk_counts' rule)
        n = len(decode_contexts)
        return self._roofline(tokens + n, pairs + ctx, kv_tokens + ctx, sampled + n)

    def decode_step_time(self, n: int, ctx_sum: int) -> float:
        """``step_time((), contexts)`` for ``n`` decode contexts summing to ``ctx_sum``, in O(1) (the same
        integer work, so the result is bit-identical)."""
        return self._roofline(n, ctx_sum, ctx_sum, n)

    def _roofline(self, tokens: int, pairs: int, kv_tokens: int, sampled: int) -> float:
        """One step: the slower of compute and memory, plus fixed overhead and all-reduce (0 for no tokens)."""
        if tokens == 0:
            return 0.0
        flops, nbytes = self.step_work(tokens, pairs, kv_tokens, sampled)
        t_compute = flops * self._sec_per_flop
        t_memory = nbytes * self._sec_per_byte
        return (
            (t_compute if t_compute > t_memory else t_memory)
            + self._overhead
            + self._ar_fixed
            + self._ar_per_token * tokens
        )

    def prefill_time(self, n_new: int, n_cached: int = 0, samples: bool = True) -> float:
        """Seconds to prefill ``n_new`` tokens after ``n_cached`` cached ones, alone in a step (``samples``:
        the chunk completes the prompt)."""
        return self.step_time(((n_new, n_cached, samples),), ())

    def decode_time(self, contexts: Sequence[int]) -> float:
        """Seconds for one decode step of a batch with these context lengths."""
        return self.step_time((), contexts)


COST_MODELS: Registry[CostModel] = Registry("cost model")
COST_MODELS.add(
    "roofline", CostModel, "roofline over the step's FLOPs and bytes, derated by GPU efficiencies"
)


@COST_MODELS.register("ideal", "roofline at 100% of peak with no step overhead")
def ideal_cost_model(model: ModelSpec, gpu: GPUSpec, tp: int | None = None) -> CostModel:
    """Pure roofline at 100% of peak with no step overhead (the field notes' ideal numbers)."""
    return CostModel(model, gpu.ideal(), tp)


@COST_MODELS.register("profiled")
def profiled_cost_model(
    model: ModelSpec, gpu: GPUSpec, tp: int | None = None, path: str | None = None
) -> CostModel:
    """step times fitted to a real engine's steps: pass the file, --cost-model FILE.toml (kvretain profile)"""
    from kvretain.engine.sim.profiled import ProfiledCostModel, load_profile

    if path is None:
        raise ValueError(
            "cost model 'profiled' needs its file: pass --cost-model FILE.toml (kvretain profile)"
        )
    return ProfiledCostModel(model, gpu, tp, load_profile(path))


def is_cost_model_file(spec: str) -> bool:
    """Whether a ``--cost-model`` value names a file (a profile) rather than a registered model."""
    return spec not in COST_MODELS and (spec.lower().endswith(".toml") or "/" in spec or "\\" in spec)


def make_cost_model(spec: str, model: ModelSpec, gpu: GPUSpec, tp: int | None = None) -> CostModel:
    """The cost model ``spec`` names: a registered name, or the path of a profile file (``profiled``)."""
    if is_cost_model_file(spec):
        return COST_MODELS.create("profiled", model, gpu, tp, path=spec)
    return COST_MODELS.create(spec, model, gpu, tp)
