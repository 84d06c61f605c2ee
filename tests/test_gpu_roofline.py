"""bench/gpu_roofline.py: the steps it plans, how it sets a measurement beside the roofline, and
(where PyTorch is importable) that its decoder computes what a decoder with a KV cache computes: one prefill, a
prefill after a cached prefix and a decode step give the same last-token logits, batched or not."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

from kvretain.engine.sim.catalog import GPUSpec, builtin_catalog, load_catalog
from kvretain.engine.sim.costmodel import CostModel, chunk_pairs

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import gpu_roofline as gr  # noqa: E402

TINY = """
[models.tiny]
n_layers = 2
d_model = 64
n_q_heads = 4
n_kv_heads = 2
head_dim = 16
ffn_dim = 96
vocab_size = 128
"""


def test_plan_times_prefills_prefix_hits_decodes_and_mixed_steps_within_the_memory_bound() -> None:
    steps = gr.plan([256, 1024, 4096], [0, 2048], [1, 64, 1024], [1024, 4096], mixed=[16])
    assert steps[:3] == [gr.Step(n, 0) for n in (256, 1024, 4096)]
    assert steps[3] == gr.Step(1024, 2048)  # the middle size after each cached length > 0
    decodes = [(s.decodes, s.context) for s in steps if s.kind == "decode"]
    assert decodes == [(1, 1024), (1, 4096), (64, 1024), (64, 4096)]  # 1024 x 1024 > MAX_KV_TOKENS: left out
    mixed = [s for s in steps if s.kind == "mixed"]
    assert mixed == [gr.Step(256, 0, 16, 1024), gr.Step(1024, 0, 16, 1024)]  # smallest and middle chunk
    assert all(s.counts()[2] <= gr.MAX_KV_TOKENS for s in steps)


def test_a_step_counts_as_the_cost_model_counts() -> None:
    cat = builtin_catalog()
    cm = CostModel(cat.model("llama-3-8b"), cat.gpu("h200"), tp=1)
    step = gr.Step(512, 1024, 8, 2048)
    tokens, pairs, kv, sampled = step.counts()
    assert (tokens, sampled) == (512 + 8, 9)
    assert pairs == chunk_pairs(512, 1024) + 8 * 2048 and kv == 512 + 1024 + 8 * 2048
    # the same work as the simulator's step of that prefill chunk and those decode contexts
    flops, nbytes = cm.step_work(tokens, pairs, kv, sampled)
    t = max(flops * cm._sec_per_flop, nbytes * cm._sec_per_byte) + cm.gpu.step_overhead_s
    assert cm.step_time([(512, 1024, True)], [2048] * 8) == pytest.approx(t)


def _at_catalog_rates(step: gr.Step, cm: CostModel, gpu: GPUSpec) -> float:
    flops, nbytes = cm.step_work(*step.counts())
    return max(
        flops / gpu.peak_flops / gpu.compute_efficiency, nbytes / gpu.mem_bandwidth / gpu.bandwidth_efficiency
    )


def test_a_step_at_the_catalogs_rates_reads_the_catalogs_efficiencies() -> None:
    cat = builtin_catalog()
    model, gpu = cat.model("llama-3-8b"), cat.gpu("h200")
    cm = CostModel(model, gpu, tp=1)
    steps = [gr.Step(8192, 0), gr.Step(4096, 4096), gr.Step(0, 0, 1, 1024)]
    seconds = [_at_catalog_rates(s, cm, gpu) for s in steps]
    rows = gr.analyse(steps, seconds, model, gpu)
    assert [r.bound for r in rows] == ["compute", "compute", "memory"]
    for r in rows:
        assert r.roofline_s == pytest.approx(r.seconds)
    assert rows[0].reached == pytest.approx(gpu.compute_efficiency)
    assert rows[2].reached == pytest.approx(gpu.bandwidth_efficiency)
    # twice as slow: half the peak, and the roofline reads half the measured time
    slow = gr.analyse(steps, [2 * s for s in seconds], model, gpu)
    assert slow[0].reached == pytest.approx(gpu.compute_efficiency / 2)
    assert slow[2].roofline_s / slow[2].seconds == pytest.approx(0.5)
    summ = gr.summary(rows + slow[2:], gpu)
    assert summ["points"] == 4
    assert summ["compute_efficiency"] == pytest.approx(gpu.compute_efficiency, abs=1e-4)
    assert summ["bandwidth_efficiency"] == pytest.approx(0.75 * gpu.bandwidth_efficiency, abs=1e-4)
    assert summ["roofline_over_measured_min"] == pytest.approx(0.5, abs=1e-4)


def test_a_mixed_step_is_set_beside_its_parts_timed_alone() -> None:
    cat = builtin_catalog()
    model, gpu = cat.model("llama-3-8b"), cat.gpu("h200")
    steps = [gr.Step(512, 0), gr.Step(0, 0, 16, 1024), gr.Step(512, 0, 16, 1024), gr.Step(256, 0, 16, 1024)]
    rows = gr.analyse(steps, [0.010, 0.005, 0.012, 0.009], model, gpu)
    gains = gr.batching_gains(rows)
    assert gains == [(gr.Step(512, 0, 16, 1024), pytest.approx(0.012 / 0.015))]  # (256 alone was not timed)
    assert gr.summary(rows, gpu)["mixed_over_parts"] == [round(0.012 / 0.015, 4)]


def test_the_decoder_computes_what_a_kv_cache_decoder_computes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    cat = tmp_path / "tiny.toml"
    cat.write_text(TINY, encoding="utf-8")
    model = load_catalog(cat).model("tiny")
    dec = gr.Decoder(model, torch, "cpu", torch.float32, seed=0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.vocab_size, (3, 12), generator=gen)

    def whole(row: int) -> object:
        return dec.forward(ids[row], [dec.group(1, 12, 0)])

    cache = dec.kv_cache(1, 12)  # (room for the whole sequence; the chunks fill it)
    dec.forward(ids[0, :5], [gr.Group(1, 5, 0, cache)])
    after_prefix = dec.forward(ids[0, 5:], [gr.Group(1, 7, 5, cache, dec.group(1, 7, 5).mask)])
    # one step of a prefill chunk (row 2 after 6 cached) and two decodes (rows 0 and 1 at their 12th token)
    pre, dcd = dec.kv_cache(1, 12), dec.kv_cache(2, 12)
    dec.forward(ids[2, :6], [gr.Group(1, 6, 0, pre)])
    dec.forward(ids[:2, :11].reshape(-1), [gr.Group(2, 11, 0, dcd)])
    step_ids = torch.cat([ids[2, 6:], ids[:2, 11]])
    mixed = dec.forward(step_ids, [gr.Group(1, 6, 6, pre, dec.group(1, 6, 6).mask), gr.Group(2, 1, 11, dcd)])
    torch.testing.assert_close(after_prefix, whole(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[0:1], whole(2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[1:2], whole(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mixed[2:3], whole(1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(
        whole(0), whole(1)
    )  # (the sequences differ: the checks above could tell them apart)


def test_the_summary_reports_the_fits_leave_one_out_error() -> None:
    # the fit's error on its own points read 0.0 for four points (the fit passes through all four) and flatters it
    # otherwise: kvretain profile reports leave-one-out (session 59), and so does the summary beside it
    from kvretain.engine.sim.profiled import cross_validated_errors

    cat = builtin_catalog()
    model, gpu = cat.model("llama-3-8b"), cat.gpu("h200")
    steps = [gr.Step(512, 0), gr.Step(0, 0, 16, 1024), gr.Step(512, 0, 16, 1024), gr.Step(256, 0, 16, 1024)]
    steps += [gr.Step(2048, 2048), gr.Step(0, 0, 64, 4096)]
    seconds = [0.010, 0.005, 0.0135, 0.009, 0.061, 0.0072]
    four = gr.summary(gr.analyse(steps[:4], seconds[:4], model, gpu), gpu)
    assert four["fit_median_abs_rel_error"] is None and four["fit_loo_median_abs_rel_error"] is None
    rows = gr.analyse(steps, seconds, model, gpu)
    summ = gr.summary(rows, gpu)
    points, _ = gr.fitted(rows)
    loo = cross_validated_errors(points)
    assert loo is not None
    assert summ["fit_loo_median_abs_rel_error"] == round(statistics.median(loo), 4)
    assert summ["fit_loo_median_abs_rel_error"] > summ["fit_median_abs_rel_error"]
