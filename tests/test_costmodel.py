"""Cost model and catalogs: field-notes numbers, formula shape, TOML catalogs and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvretain.engine.sim.catalog import CatalogError, GPUSpec, ModelSpec, builtin_catalog, load_catalog
from kvretain.engine.sim.costmodel import COST_MODELS, CostModel

CAT = builtin_catalog()
LLAMA8 = CAT.model("llama-3-8b")
H100 = CAT.gpu("h100-sxm")
H200 = CAT.gpu("h200")


def ideal(model_name: str = "llama-3-8b", gpu_name: str = "h100-sxm", tp: int | None = None) -> CostModel:
    return COST_MODELS.create("ideal", CAT.model(model_name), CAT.gpu(gpu_name), tp)


def test_builtin_catalog_entries() -> None:
    assert {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "tiny"} <= set(CAT.models)
    assert {"a100-80gb", "h100-sxm", "h200", "l40s"} <= set(CAT.gpus)
    assert CAT.model("Llama-3-8B") is LLAMA8  # case-insensitive
    assert H100.peak_flops == 989e12 and H100.mem_bandwidth == 3.35e12 and H100.mem_bytes == 80 * 2**30
    assert CAT.gpu("l40s").mem_bytes == 45 * 2**30  # 48 GiB less ECC's 1/16
    q = CAT.model("qwen2.5-7b")
    assert (q.n_layers, q.d_model, q.n_q_heads, q.n_kv_heads, q.ffn_dim, q.vocab_size) == (
        28,
        3584,
        28,
        4,
        18944,
        152064,
    )
    with pytest.raises(KeyError, match="known"):
        CAT.model("gpt-5")


# The memory each GPU reports (nvidia-smi's total, MiB; what vLLM's gpu_memory_utilization is a share of, less the
# driver's own ~0.5-1%). NVIDIA's "80GB" and "141GB" are binary: the catalog's nominal GiB sit within 0.5% of these.
# The L40S's "48GB GDDR6 with ECC": ECC, on by default, keeps 1/16 of GDDR6 (not HBM) memory for its check bits,
# so the device reports 46068 MiB (48,305,799,168 bytes), 45 GiB, not 48.
REPORTED_MIB = {"a100-80gb": 81920, "h100-sxm": 81559, "h200": 143771, "l40s": 46068}


@pytest.mark.parametrize("name", sorted(REPORTED_MIB))
def test_gpu_memory_is_the_devices_own(name: str) -> None:
    assert CAT.gpu(name).mem_bytes == pytest.approx(REPORTED_MIB[name] * 2**20, rel=0.005)


def test_h200_memory_is_141_gib_and_holds_8_percent_more_kv_than_141_gb() -> None:
    assert H200.mem_bytes == 141 * 2**30  # (was 141e9 bytes, 131.3 GiB: 6.5% short of the device)
    tokens = CostModel(LLAMA8, H200).kv_capacity_tokens()
    assert tokens == (141 * 2**30 * 0.9 - 16_059_990_016) // KV_TOKEN == 917_036
    assert tokens / ((141e9 * 0.9 - 16_059_990_016) // KV_TOKEN) == pytest.approx(1.084, abs=0.001)


# Llama-3-8B by hand (field notes, "First-order cost model"): L=32, d=4096, n_q=32, n_kv=8, h=128,
# ffn=14336, V=128256, bf16.
P_LAYER = 4096 * 128 * (32 + 2 * 8) + 32 * 128 * 4096 + 3 * 4096 * 14336  # 218,103,808 weights per layer
F_LAYERS = 2 * 32 * P_LAYER  # 13,958,643,712 FLOPs per token in the layers
F_HEAD = 2 * 128256 * 4096  # 1,050,673,152 FLOPs per sampled token in the LM head
A_PAIR = 4 * 32 * 32 * 128  # 524,288 attention FLOPs per (query, key) pair
LAYER_BYTES = 32 * P_LAYER * 2  # 13.96 GB
TABLE_BYTES = 128256 * 4096 * 2  # 1.05 GB: the input embedding, and the (untied) LM head
ROW_BYTES = 4096 * 2  # one embedding row
KV_TOKEN = 2 * 32 * 8 * 128 * 2  # 128 KiB


def test_llama3_8b_sizes() -> None:
    cm = ideal()
    assert cm.kv_bytes_per_token() == KV_TOKEN == 128 * 1024
    assert (cm.layer_flops_per_token, cm.head_flops_per_sample) == (F_LAYERS, F_HEAD)
    assert cm.linear_flops_per_token == F_LAYERS + F_HEAD == pytest.approx(15e9, rel=0.01)
    head_share = F_HEAD / (F_LAYERS + F_HEAD)
    assert head_share == pytest.approx(0.07, abs=0.001)  # the LM head: 7% of F
    assert cm.weight_bytes() == LAYER_BYTES + 2 * TABLE_BYTES == 16_059_990_016  # 16.06 GB stored
    assert cm.weight_bytes() - LAYER_BYTES - TABLE_BYTES == pytest.approx(1.05e9, rel=0.001)


def test_prefill_samples_only_its_last_token() -> None:
    cm = ideal()
    n, p = 8192, 0
    pairs = n * (n + 1) // 2
    assert cm.prefill_flops(n) == F_LAYERS * n + F_HEAD + A_PAIR * pairs
    # the old formula charged the LM head for every prompt token: 8191 rows too many, ~7% of linear FLOPs
    old = (F_LAYERS + F_HEAD) * n + A_PAIR * pairs
    assert (old - cm.prefill_flops(n)) == F_HEAD * (n - 1)
    assert (F_LAYERS + F_HEAD) * n / (F_LAYERS * n + F_HEAD) == pytest.approx(1.075, abs=0.001)
    # a chunk that does not finish the prompt samples nothing
    assert cm.prefill_flops(512, 1024, samples=False) == F_LAYERS * 512 + A_PAIR * (
        512 * 1024 + 512 * 513 // 2
    )
    assert cm.prefill_flops(512, 1024) - cm.prefill_flops(512, 1024, samples=False) == F_HEAD
    # the ideal roofline of an 8k prefill (compute-bound): 133.4 ms on H100 (142 ms with the head on every token)
    flops = F_LAYERS * n + F_HEAD + A_PAIR * pairs
    assert cm.prefill_time(n, p) == pytest.approx(flops / 989e12, rel=1e-12)
    assert cm.prefill_time(n) == pytest.approx(133.4e-3, rel=0.001)
    assert old / 989e12 == pytest.approx(142e-3, rel=0.002)  # the field notes' figure


def test_step_work_by_hand() -> None:
    cm = ideal()
    # a step reads the layers, the LM head when it samples, one embedding row per token, and the KV
    assert cm.step_work(3, 10, 7, 1) == (
        F_LAYERS * 3 + F_HEAD + A_PAIR * 10,
        LAYER_BYTES + TABLE_BYTES + 3 * ROW_BYTES + 7 * KV_TOKEN,
    )
    assert cm.step_work(512, 1000, 512, 0) == (
        F_LAYERS * 512 + A_PAIR * 1000,
        LAYER_BYTES + 512 * ROW_BYTES + 512 * KV_TOKEN,
    )  # a partial chunk alone: no LM head at all


def test_decode_step_reads_embedding_rows_not_the_table() -> None:
    cm = ideal()
    batch = [2048] * 32
    nbytes = LAYER_BYTES + TABLE_BYTES + 32 * ROW_BYTES + 32 * 2048 * KV_TOKEN  # 23.60 GB
    flops = 32 * (F_LAYERS + F_HEAD) + A_PAIR * 32 * 2048
    assert cm.step_work(32, 32 * 2048, 32 * 2048, 32) == (flops, nbytes)
    assert cm.decode_time(batch) == pytest.approx(nbytes / 3.35e12, rel=1e-12)  # memory-bound: 7.04 ms
    # the old count read all 16.06 GB of weights, the whole embedding table included: +1.05 GB per step
    old = cm.weight_bytes() + 32 * 2048 * KV_TOKEN
    assert old - nbytes == TABLE_BYTES - 32 * ROW_BYTES
    assert (old - nbytes) / 1e9 == pytest.approx(1.05, abs=0.005)
    assert old / 3.35e12 == pytest.approx(7.4e-3, rel=0.01)  # the field notes' 7.4 ms counted the table
    assert ideal(gpu_name="h200").decode_time(batch) == pytest.approx(nbytes / 4.8e12, rel=1e-12)  # 4.92 ms
    # The derated model: ideal roofline / bandwidth efficiency, plus a small step overhead.
    real = CostModel(LLAMA8, H100)
    assert real.decode_time(batch) == pytest.approx(
        nbytes / (3.35e12 * H100.bandwidth_efficiency) + H100.step_overhead_s, rel=1e-12
    )
    assert CostModel(LLAMA8, H200).decode_time(batch) < real.decode_time(batch)


def test_tied_embeddings_store_one_table_and_read_it_for_the_head() -> None:
    from dataclasses import replace

    tied = COST_MODELS.create("ideal", replace(LLAMA8, tied_embeddings=True), H100)
    assert tied.weight_bytes() == LAYER_BYTES + TABLE_BYTES
    assert tied.step_work(1, 100, 100, 1)[1] == LAYER_BYTES + TABLE_BYTES + ROW_BYTES + 100 * KV_TOKEN


def test_prefill_formula_shape() -> None:
    cm = ideal()
    for n in (1024, 4096, 16384, 32768):
        flops = F_LAYERS * n + F_HEAD + A_PAIR * n * (n + 1) / 2
        nbytes = LAYER_BYTES + TABLE_BYTES + n * ROW_BYTES + n * KV_TOKEN
        expect = max(flops / H100.peak_flops, nbytes / H100.mem_bandwidth)
        assert cm.prefill_time(n) == pytest.approx(expect, rel=1e-9)
    # Quadratic attention: doubling n more than doubles the time at long context.
    assert cm.prefill_time(32768) > 2 * cm.prefill_time(16384)


def test_cached_prefix_reduces_time_but_attention_is_paid() -> None:
    cm = CostModel(LLAMA8, H100)
    full = cm.prefill_time(8192)
    hit = cm.prefill_time(1024, 7168)
    assert hit < full / 4
    assert hit > cm.prefill_time(1024, 0)  # attention over the cached prefix still costs
    assert cm.prefill_flops(1024, 7168) - cm.prefill_flops(1024, 0) == (cm.attn_flops_per_pair * 1024 * 7168)


def test_mixed_step_is_one_roofline() -> None:
    cm = CostModel(LLAMA8, H100)
    assert cm.step_time([], []) == 0.0
    decode = [2048] * 32
    mixed = cm.step_time([(512, 0, True)], decode)
    # One forward pass: weights are read once, so mixing costs less than two separate steps.
    assert max(cm.decode_time(decode), cm.prefill_time(512)) <= mixed
    assert mixed < cm.decode_time(decode) + cm.prefill_time(512)
    # same tokens, same causal pairs; the first chunk of the two does not sample
    assert cm.step_time([(256, 0, False), (256, 256, True)], []) == pytest.approx(
        cm.step_time([(512, 0, True)], []), rel=1e-12
    )
    # a one-token chunk that samples costs what a decode token of the same context costs
    assert cm.step_time([(1, 99, True)], decode) == cm.step_time([], [*decode, 100])
    assert cm.step_time([(1, 99, False)], []) < cm.step_time([], [100])


def test_kv_capacity() -> None:
    cm = CostModel(LLAMA8, H100)
    expect = (80 * 2**30 * 0.9 - cm.weight_bytes()) // (128 * 1024)
    assert cm.kv_capacity_tokens() == expect
    assert cm.kv_capacity_blocks(16) == expect // 16
    assert CostModel(LLAMA8, H100).kv_capacity_tokens(0.5) < expect
    big = CAT.model("llama-3-70b")
    assert big.tp in (4, 8)
    assert CostModel(big, H100).kv_capacity_tokens() > 100_000
    with pytest.raises(ValueError, match="no KV room"):
        CostModel(big, H100, tp=1).kv_capacity_tokens()


def test_tensor_parallel_speeds_up_and_costs_allreduce() -> None:
    big = CAT.model("llama-3-70b")
    t4 = CostModel(big, H100, tp=4).decode_time([2048] * 32)
    t8 = CostModel(big, H100, tp=8).decode_time([2048] * 32)
    assert t8 < t4
    assert t8 > t4 / 2  # the all-reduce and fixed overhead do not shrink
    with pytest.raises(ValueError, match="tp"):
        CostModel(big, H100, tp=3)


def test_registry() -> None:
    assert {"roofline", "ideal"} <= set(COST_MODELS.names())
    with pytest.raises(ValueError, match="roofline"):
        COST_MODELS.create("nope", LLAMA8, H100)


USER_TOML = """
[models.my-13b]
n_layers = 40
d_model = 5120
n_q_heads = 40
n_kv_heads = 40
head_dim = 128
ffn_dim = 13824
vocab_size = 32000

[gpus.my-gpu]
peak_flops = 400e12
mem_bandwidth = 2e12
mem_bytes = 68719476736
bandwidth_efficiency = 0.8
"""


def test_user_catalog(tmp_path: Path) -> None:
    path = tmp_path / "cat.toml"
    path.write_text(USER_TOML)
    cat = load_catalog(path)
    assert "llama-3-8b" in cat.models  # built-ins kept
    gpu = cat.gpu("my-gpu")
    assert gpu.bandwidth_efficiency == 0.8 and gpu.compute_efficiency == 0.6  # default
    cm = CostModel(cat.model("my-13b"), gpu)
    assert cm.kv_bytes_per_token() == 2 * 40 * 40 * 128 * 2
    assert cm.decode_time([100]) > 0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[models.x]\nn_layers = 2\n", r"model 'x': missing field 'd_model'"),
        (
            USER_TOML.replace("n_layers = 40", 'n_layers = "40"'),
            r"model 'my-13b': field 'n_layers' must be int",
        ),
        (USER_TOML.replace("n_layers = 40", "n_layers = -1"), r"field 'n_layers' must be > 0"),
        (
            USER_TOML + "\n[gpus.g]\npeak_flops = 1e12\nmem_bandwidth = 1e12\n",
            r"GPU 'g': missing field 'mem_bytes'",
        ),
        (USER_TOML.replace("bandwidth_efficiency = 0.8", "bandwidth_efficiency = 1.5"), r"in \(0, 1\]"),
        (USER_TOML.replace("vocab_size", "vocab"), r"unknown field 'vocab'"),
        (USER_TOML.replace("n_kv_heads = 40", "n_kv_heads = 7"), r"multiple of n_kv_heads"),
        ("[modles.x]\n", r"unknown top-level table 'modles'"),
        ("[models.x\n", r"invalid TOML"),
    ],
)
def test_user_catalog_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(CatalogError, match=match) as info:
        load_catalog(path)
    assert str(path) in str(info.value)


def test_missing_catalog_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="not found"):
        load_catalog(tmp_path / "nope.toml")


def test_executor_charges_the_lm_head_only_for_chunks_that_sample() -> None:
    from kvretain.engine.sim.executor import SimExecutor
    from kvretain.sched.output import ScheduledChunk, SchedulerOutput

    cm = ideal()
    ex = SimExecutor(cm, {})
    chunks = (
        ScheduledChunk("decode", 1, 2047, True),
        ScheduledChunk("partial", 1, 511, False),  # a one-token chunk that does not finish its prompt
        ScheduledChunk("last", 300, 512, True),
    )
    t = ex.step_time(SchedulerOutput(1, chunks))
    tokens, pairs = 302, 2048 + 512 + (300 * 512 + 300 * 301 // 2)
    flops, nbytes = cm.step_work(tokens, pairs, 2048 + 512 + 812, 2)
    assert flops == F_LAYERS * tokens + 2 * F_HEAD + A_PAIR * pairs
    assert t == max(flops / 989e12, nbytes / 3.35e12)
    assert ex.busy_s == t


def test_executor_prices_a_one_token_chunk_that_does_not_sample_without_the_lm_head() -> None:
    # beside a large prefill the step is compute-bound, so an LM head charged to the one-token chunk shows
    from kvretain.engine.sim.executor import SimExecutor
    from kvretain.sched.output import ScheduledChunk, SchedulerOutput

    cm = ideal()
    chunks = (ScheduledChunk("partial", 1, 511, False), ScheduledChunk("big", 4096, 0, True))
    t = SimExecutor(cm, {}).step_time(SchedulerOutput(1, chunks))
    assert t == cm.step_time([(1, 511, False), (4096, 0, True)], [])
    assert t < cm.step_time([(4096, 0, True)], [512])  # (as a decode it would sample: one more LM head)


# A toy model small enough to price by hand: L=2, d=8, n_q=4, n_kv=2, h=2, ffn=16, V=10, bf16.
TOY = ModelSpec(
    "toy", n_layers=2, d_model=8, n_q_heads=4, n_kv_heads=2, head_dim=2, ffn_dim=16, vocab_size=10
)
TOY_P = 8 * 2 * (4 + 2 * 2) + 4 * 2 * 8 + 3 * 8 * 16  # 576 weights per layer
TOY_FL = 2 * 2 * TOY_P  # 2,304 layer FLOPs per token
TOY_FV = 2 * 10 * 8  # 160 LM-head FLOPs per sampled token
TOY_A = 4 * 2 * 4 * 2  # 64 attention FLOPs per pair
TOY_KV = 2 * 2 * 2 * 2 * 2  # 32 KV bytes per token
TOY_WEIGHTS = (2 * TOY_P + 2 * 10 * 8) * 2  # 2,624 bytes: layers, embedding and (untied) LM head
# tp=4 over n_kv=2: vLLM's QKVParallelLinear gives each GPU one KV head (num_kv_heads = 1, replicated tp/n_kv
# times), so the replica stores 4 GPUs x (K and V: 2 x d x h) = 128 K/V projection weights a layer where the
# model has 2 x d x h x n_kv = 64: 64 more a layer, x 2 layers x 2 bytes
TOY_KV_REPLICAS = (4 * 2 * 8 * 2 - 2 * 8 * 2 * 2) * 2 * 2  # 256 bytes


def toy_gpu(**kw: float) -> GPUSpec:
    """An ideal GPU (no derating, no step overhead) with the given rates."""
    base = {"peak_flops": 1e30, "mem_bandwidth": 1e30, "mem_bytes": 2**30}
    base.update(kw)
    return GPUSpec("toy-gpu", **base).ideal()  # type: ignore[arg-type]


def test_decode_prices_its_context_as_pairs_and_kv_by_hand() -> None:
    # contexts 5 and 7 count the tokens being generated: 12 pairs and 12 KV tokens, two sampled tokens
    compute = CostModel(TOY, toy_gpu(peak_flops=1e3))
    flops = 2 * (TOY_FL + TOY_FV) + TOY_A * 12  # 5,696
    assert compute.decode_time([5, 7]) == pytest.approx(flops / 1e3, rel=1e-12)
    assert compute.decode_step_time(2, 12) == compute.decode_time([5, 7])
    memory = CostModel(TOY, toy_gpu(mem_bandwidth=1e3))
    nbytes = 2 * TOY_P * 2 + 10 * 8 * 2 + 2 * 8 * 2 + TOY_KV * 12  # layers, LM head, 2 rows, KV: 2,880
    assert memory.decode_time([5, 7]) == pytest.approx(nbytes / 1e3, rel=1e-12)
    assert memory.decode_step_time(2, 12) == memory.decode_time([5, 7])


def test_tensor_parallel_splits_flops_and_adds_two_ring_allreduces_per_layer() -> None:
    # tp=4: FLOPs over 4 GPUs (with the K and V of the 2 replicated heads computed on each of their GPUs: 2 FLOPs
    # a copied weight a token); 2*L = 4 all-reduces of tokens*d*bytes = 16 bytes a token, each
    # latency + 2*(tp-1)/tp * message / link = 0.25 s + 1.5 * 16 / 96 s a token
    gpu = toy_gpu(peak_flops=1e3, link_bandwidth=96.0, allreduce_latency_s=0.25)
    cm = CostModel(TOY, gpu, tp=4)
    flops = 2 * (TOY_FL + TOY_FV) + TOY_A * 12
    kv_copies = 2 * 2 * (TOY_KV_REPLICAS // 2)  # 2 tokens x 2 FLOPs x 128 copied weights
    assert cm.decode_time([5, 7]) == pytest.approx(
        (flops + kv_copies) / 4e3 + 4 * 0.25 + 2 * 4 * 1.5 * 16 / 96, rel=1e-12
    )
    assert CostModel(TOY, gpu, tp=1).decode_time([5, 7]) == pytest.approx(flops / 1e3, rel=1e-12)


def test_kv_capacity_by_hand_replicates_kv_heads_beyond_n_kv() -> None:
    gpu = toy_gpu(mem_bytes=10_000)
    # tp=2 splits the 2 KV heads, one a GPU: a token stores its logical 32 bytes
    assert CostModel(TOY, gpu, tp=2).kv_capacity_tokens(1.0) == (2 * 10_000 - TOY_WEIGHTS) // TOY_KV
    # tp=4 > n_kv=2: each GPU holds a whole KV head, so a token takes 4 x 16 = 64 bytes of the replica, and
    # each GPU holds that head's K and V projections too (TOY_KV_REPLICAS bytes more weights in the replica)
    assert CostModel(TOY, gpu, tp=4).kv_capacity_tokens(1.0) == (
        4 * 10_000 - TOY_WEIGHTS - TOY_KV_REPLICAS
    ) // (2 * TOY_KV)


def test_weights_count_the_kv_projections_each_gpu_holds_beyond_n_kv() -> None:
    """vLLM replicates the K/V projection weights with the KV heads when tp > n_kv (each rank sizes its K and V
    projections for one head): the replica's weight memory, which the KV capacity is what is left of, grows
    by those copies. tp <= n_kv splits them without copies."""
    assert CostModel(TOY, toy_gpu(), tp=1).weight_bytes() == TOY_WEIGHTS
    assert CostModel(TOY, toy_gpu(), tp=2).weight_bytes() == TOY_WEIGHTS
    assert CostModel(TOY, toy_gpu(), tp=4).weight_bytes() == TOY_WEIGHTS + TOY_KV_REPLICAS
    # Llama-3-70B at tp 16 (8 KV heads, each on 2 GPUs): 80 layers x 2 x 8192 x 128 x 8 more bf16 weights, 2.68 GB
    big = CAT.model("llama-3-70b")
    extra = CostModel(big, H100, tp=16).weight_bytes() - CostModel(big, H100, tp=8).weight_bytes()
    assert extra == 80 * 2 * 8192 * 128 * 8 * 2 == 2_684_354_560


def test_a_step_reads_and_computes_the_kv_projections_each_gpu_holds_beyond_n_kv() -> None:
    """At tp=4 over n_kv=2 each GPU reads its replicated head's K and V projection weights every step and
    computes that head's K and V for every token, so the replica's work is the stored weights', not the model's."""
    free_links = {"link_bandwidth": 1e30, "allreduce_latency_s": 0.0}
    memory = CostModel(TOY, toy_gpu(mem_bandwidth=1e3, **free_links), tp=4)
    # layers with the replicated K/V, LM head, 2 embedding rows, 12 KV tokens of 2 x 32 bytes (replicated heads)
    nbytes = 2 * TOY_P * 2 + TOY_KV_REPLICAS + 10 * 8 * 2 + 2 * 8 * 2 + 2 * TOY_KV * 12
    assert memory.decode_time([5, 7]) == pytest.approx(nbytes / 4e3, rel=1e-12)
    compute = CostModel(TOY, toy_gpu(peak_flops=1e3, **free_links), tp=4)
    kv_copies_fl = 2 * (TOY_KV_REPLICAS // 2)  # 2 FLOPs a copied weight (128 of them) a token: 256
    flops = 2 * (TOY_FL + kv_copies_fl + TOY_FV) + TOY_A * 12
    assert compute.decode_time([5, 7]) == pytest.approx(flops / 4e3, rel=1e-12)
    assert compute.layer_flops_per_token == TOY_FL + kv_copies_fl
    assert CostModel(TOY, toy_gpu(), tp=2).layer_flops_per_token == TOY_FL  # split, no copies


def test_kv_capacity_utilization_range_and_room_for_one_token() -> None:
    cm = CostModel(TOY, toy_gpu(mem_bytes=TOY_WEIGHTS + TOY_KV))
    assert cm.kv_capacity_tokens(1.0) == 1  # utilization 1 is in (0, 1]
    for bad in (0.0, 1.01, -0.5):
        with pytest.raises(ValueError, match=r"gpu_mem_utilization must be in \(0, 1\]"):
            cm.kv_capacity_tokens(bad)
    # weights that leave less than one token's KV: no room, not a pool of 0 tokens
    tight = CostModel(TOY, toy_gpu(mem_bytes=TOY_WEIGHTS + TOY_KV - 1))
    with pytest.raises(ValueError, match="no KV room"):
        tight.kv_capacity_tokens(1.0)


def test_tp_must_split_or_replicate_whole_kv_heads() -> None:
    """vLLM gives each GPU n_kv/tp KV heads (tp dividing n_kv) or one head replicated tp/n_kv times (n_kv
    dividing tp), and refuses any other tp. n_q=24, n_kv=8 at tp=3 stored 3 x (8 // 3) = 6 heads a token, fewer
    than the model's 8: a KV capacity 33% above what the weights leave room for."""
    m = ModelSpec(
        "m24", n_layers=2, d_model=48, n_q_heads=24, n_kv_heads=8, head_dim=2, ffn_dim=16, vocab_size=10
    )
    for tp in (3, 6, 12):  # 12: 12 % 8 and 8 % 12 are both nonzero
        with pytest.raises(ValueError, match=rf"tp={tp} must divide n_kv_heads=8 or be a multiple of it"):
            CostModel(m, toy_gpu(), tp)
    for tp in (1, 2, 4, 8, 24):  # 24: each of the 8 heads replicated 3 times
        assert CostModel(m, toy_gpu(), tp)._kv_bytes_stored >= CostModel(m, toy_gpu(), 1)._kv_bytes_stored
    with pytest.raises(ValueError, match="n_kv_heads=4"):  # qwen2.5-7b: 28 query heads, 4 KV heads
        CostModel(CAT.model("qwen2.5-7b"), H100, tp=7)


@pytest.mark.parametrize("table", ["models", "gpus"])
def test_user_catalog_refuses_two_entries_that_differ_only_in_case(tmp_path: Path, table: str) -> None:
    """Names are matched case-insensitively, so [models.Foo] and [models.foo] in one file name one entry: the
    last silently replaced the first (``--model Foo`` ran the other one's 200 layers)."""
    models, gpus = USER_TOML.split("[gpus.my-gpu]")
    body = models.split("[models.my-13b]")[1] if table == "models" else gpus
    path = tmp_path / "dup.toml"
    path.write_text(f"[{table}.Foo]\n{body}\n[{table}.foo]\n{body}\n")
    with pytest.raises(CatalogError, match=r"'Foo' and 'foo' name the same entry") as info:
        load_catalog(path)
    assert str(path) in str(info.value)
