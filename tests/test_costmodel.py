"""Cost model and catalogs: field-notes numbers, formula shape, TOML catalogs and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvretain.engine.sim.catalog import CatalogError, builtin_catalog, load_catalog
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
    assert CAT.gpu("l40s").mem_bytes == 48 * 2**30
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


def test_llama3_8b_sizes() -> None:
    cm = ideal()
    assert cm.kv_bytes_per_token() == 128 * 1024
    assert cm.linear_flops_per_token == pytest.approx(15e9, rel=0.01)
    assert cm.weight_bytes() == pytest.approx(2 * 8.03e9, rel=0.01)  # 8.03B params incl. untied embeddings


def test_decode_matches_field_notes() -> None:
    batch = [2048] * 32
    assert ideal().decode_time(batch) == pytest.approx(7.4e-3, rel=0.02)
    assert ideal(gpu_name="h200").decode_time(batch) == pytest.approx(5.1e-3, rel=0.02)
    # The derated model: ideal roofline / bandwidth efficiency, plus a small step overhead.
    real = CostModel(LLAMA8, H100)
    assert real.decode_time(batch) == pytest.approx(7.4e-3 / H100.bandwidth_efficiency, rel=0.2)
    assert CostModel(LLAMA8, H200).decode_time(batch) < real.decode_time(batch)


def test_prefill_matches_field_notes_and_formula() -> None:
    cm = ideal()
    assert cm.prefill_time(8192) == pytest.approx(142e-3, rel=0.02)
    m = LLAMA8
    f_lin = cm.linear_flops_per_token
    a = 4 * m.n_layers * m.n_q_heads * m.head_dim
    for n in (1024, 4096, 16384, 32768):
        flops = f_lin * n + a * n * (n + 1) / 2
        nbytes = cm.weight_bytes() + n * cm.kv_bytes_per_token()
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
    mixed = cm.step_time([(512, 0)], decode)
    # One forward pass: weights are read once, so mixing costs less than two separate steps.
    assert max(cm.decode_time(decode), cm.prefill_time(512)) <= mixed
    assert mixed < cm.decode_time(decode) + cm.prefill_time(512)
    assert cm.step_time([(256, 0), (256, 256)], []) == pytest.approx(
        cm.step_time([(512, 0)], []), rel=1e-12
    )  # same tokens, same causal pairs


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
