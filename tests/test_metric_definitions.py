"""The latency statistics' definitions, one rule wherever kvretain reports them (the simulator's
:mod:`kvretain.engine.sim.metrics`, the serve bench's client-side figures, the plugin's histograms), checked
against vLLM 0.33's (``vllm/benchmarks/serve.py``'s ``calculate_metrics``, ``vllm/v1/metrics``)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from kvretain.engine.sim.metrics import percentile

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _vllm_serve():  # type: ignore[no-untyped-def]
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("vllm_serve")


def test_serve_bench_percentiles_are_the_simulators() -> None:
    """The serve bench's p99 read the sorted values at ``int(0.99 n)`` (the largest of 15 TTFTs), where the
    simulator's (and vLLM's benchmark's, numpy's) interpolates between order statistics: the same quantity, two
    rules."""
    vs = _vllm_serve()
    # 15 class-0 requests, as the bench's default 3 sessions x 5 turns
    ttfts = [0.1 * i for i in range(1, 16)]
    results = [vs.Result(0, 100, 0, 16, t, t + 1.0) for t in ttfts]
    got = vs.summarize(results, 10.0)["class0"]
    assert got["ttft_p99"] == percentile(sorted(ttfts), 99)
    assert got["ttft_p50"] == percentile(sorted(ttfts), 50)
    assert got["e2e_p99"] == percentile(sorted(t + 1.0 for t in ttfts), 99)


def test_serve_bench_json_has_no_nan_for_a_class_without_requests() -> None:
    """A class that finished no request has no percentile: ``null``, not ``NaN`` (no JSON parser reads it)."""
    vs = _vllm_serve()
    figures = vs.summarize([vs.Result(0, 100, 0, 16, 0.5, 1.5)], 10.0)
    text = json.dumps(figures, allow_nan=False)
    assert json.loads(text)["class1"]["ttft_p50"] is None
    assert vs.ratio(figures["class1"]["ttft_p50"], figures["class1"]["ttft_p50"]) is None
    # the table's cell (a format of None raised)
    assert vs._cell(figures["class1"]["ttft_p99"], 8) == "       -"


def test_per_priority_histograms_have_vllms_buckets() -> None:
    """``kvretain:time_to_first_token_seconds`` / ``kvretain:e2e_request_latency_seconds`` beside vLLM's
    ``vllm:time_to_first_token_seconds`` / ``vllm:e2e_request_latency_seconds``: a ``histogram_quantile`` of each
    is comparable only on the same bucket bounds. The TTFT buckets lacked vLLM's 1 ms and everything past 80 s,
    the e2e ones everything past 240 s (a 5-minute batch request fell in ``+Inf``, read as 240 s)."""
    from kvretain.integrations.vllm import metrics

    buckets = pytest.importorskip("vllm.v1.metrics.buckets")
    assert metrics.TTFT_BUCKETS == buckets.TIME_TO_FIRST_TOKEN_BUCKETS
    assert metrics.E2E_BUCKETS == buckets.REQUEST_LATENCY_BUCKETS
