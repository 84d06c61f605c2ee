"""Per-priority series in vLLM's own /metrics, read from the engine core's process: with its model worker in a
process of its own (vLLM's default) and inside the engine core's (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""

from __future__ import annotations

import time

import pytest
from _client import chat, flood, metric_samples, metric_value, user


@pytest.mark.parametrize("name", ["plugin", "inproc"])
def test_per_priority_series_appear_in_vllm_metrics(servers, text, name):
    srv = servers[name]
    srv.reset_cache()
    # (the counters are the server's whole life's: wait for this test's share of them)
    before = metric_samples(srv)
    prompt = user(text(f"metrics-{name}", 120))
    for _ in range(3):
        chat(srv.client, srv.model, prompt, priority=0)
    flood(srv.client, srv.model, text, f"mflood-{name}", n=12)
    deadline = time.monotonic() + 30
    while True:
        s = metric_samples(srv)
        q0 = metric_value(s, "kvretain:prefix_cache_queries_total", priority="0")
        h0 = metric_value(s, "kvretain:prefix_cache_hits_total", priority="0")
        q1 = metric_value(s, "kvretain:prefix_cache_queries_total", priority="1")
        ev1 = metric_value(s, "kvretain:evicted_blocks_total", priority="1")
        # the counters reach /metrics with a lag (the engine's stats interval): wait for the whole flood
        # and for the engine's snapshot to be one taken after the flood (it is published every half second):
        # the class-1 queries counted since the start, and the balance's one-class rule ended by them
        new_q1 = (q1 or 0) - (metric_value(before, "kvretain:prefix_cache_queries_total", priority="1") or 0)
        done = q0 and q0 >= 3 * 120 and h0 and h0 >= 2 * 96 and q1 and q1 >= 12 * 120 and ev1
        done = done and new_q1 >= 12 * 120 and metric_value(s, "kvretain:balance_one_class") == 0.0
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert q0 and q0 >= 3 * 120, s
    assert h0 and h0 >= 2 * 96
    assert q1 and q1 >= 12 * 120
    assert ev1 and ev1 > 0
    assert metric_value(s, "kvretain:pool_blocks") == 32
    # the protected blocks are the cached class-0 blocks the pool holds now: how many survived the flood depends
    # on the controller's level, which earlier tests' traffic on this server moved (the load test can bring it to
    # or below 0, where nothing is reserved), so only their consistency is asserted here (the protection itself:
    # test_serve_retention)
    share = metric_value(s, "kvretain:protected_block_share")
    protected = metric_value(s, "kvretain:protected_blocks")
    assert share is not None and 0 <= share <= 1
    assert protected is not None and share == pytest.approx(protected / 32)
    # the controller's state, consistent: the target is the level's share of the budget (0 below level 0); its
    # value depends on the traffic the server saw before (the controller is the engine's, not the test's)
    budget = metric_value(s, "kvretain:protected_budget_blocks")
    level = metric_value(s, "kvretain:protection_level")
    assert budget == pytest.approx(0.95 * 31)  # (of the 31 blocks that hold content: vLLM keeps a null block)
    assert -1.0 <= level <= 1.0
    assert metric_value(s, "kvretain:protected_target_blocks") == pytest.approx(
        max(0.0, level) * budget, abs=1e-6
    )
    assert metric_value(s, "kvretain:lru_hit_ratio_estimate") is not None
    # the recency/frequency balance: two request priorities have looked up, so its one-class rule has ended
    assert metric_value(s, "kvretain:balance_one_class") == 0.0
    assert 0.0 <= metric_value(s, "kvretain:frequency_exponent_now") <= 1.0
    # every request came through vLLM's input processing: the controller's shadows saw each one there
    assert metric_value(s, "kvretain:lookups_seen_at_arrival") == 1.0
    # where the level started (0 until the pool's first eviction)
    assert metric_value(s, "kvretain:start_level") in (-1.0, 0.0, 1.0)
    # and the balance (-1 until then; else recency, or the midpoint)
    assert metric_value(s, "kvretain:balance_start") in (-1.0, 0.5, 1.0)
    assert metric_value(s, "vllm:prefix_cache_queries_total", engine="0", model_name=srv.model) is not None


def test_per_class_ttft_histograms(servers, text):
    srv = servers["plugin"]
    for prio in (0, 1):
        stream = srv.client.chat.completions.create(
            model=srv.model,
            messages=user(text(f"ttft-{prio}", 30)),
            max_tokens=4,
            stream=True,
            extra_body={"priority": prio},
        )
        assert sum(1 for _ in stream) > 1
    s = metric_samples(srv)
    for prio in ("0", "1"):
        assert metric_value(s, "kvretain:time_to_first_token_seconds_count", priority=prio) >= 1
        assert metric_value(s, "kvretain:e2e_request_latency_seconds_count", priority=prio) >= 1
