"""Fast-forward of decode-only runs gives exactly the step-by-step results (summaries and every token time)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvretain.engine.sim.catalog import builtin_catalog
from kvretain.engine.sim.costmodel import CostModel
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.sched import SchedulerConfig
from kvretain.workloads import MultiTenantConfig, TokenSeq, WorkloadRequest, generate_multi_tenant

SMALL = MultiTenantConfig(
    duration_s=40.0,
    chat_session_rate=0.3,
    chat_think_s=5.0,
    chat_rag_tokens=(200, 1_500),
    chat_attachment_tokens=(500, 3_000),
    agent_rate=0.1,
    agent_tool_result_tokens=(50, 500),
    batch_documents=2,
    batch_document_tokens=(2_000, 4_000),
    batch_job_rate=0.1,
)


def multi_tenant(seed: int = 1) -> list[WorkloadRequest]:
    return generate_multi_tenant(SMALL, random.Random(seed))


def contended() -> list[WorkloadRequest]:
    """Long outputs in a small pool: decode allocations fail mid-run and preempt."""
    return [
        WorkloadRequest(
            f"r{i}",
            0.1 * i,
            TokenSeq.seeded(i % 3, 500) + TokenSeq.seeded(100 + i, 30 * i + 1),
            700 + 37 * i,
            priority=i % 3,
        )
        for i in range(8)
    ]


def run(cfg: SimConfig, wl: list[WorkloadRequest]) -> tuple[dict[str, Any], dict[str, Any]]:
    sim = Simulation(cfg, wl).run()
    s = sim.summary()
    s.pop("wall_s")
    per = {r.request_id: (tuple(r.token_times), r.num_preemptions, r.finish_time) for r in sim.finished}
    return s, per


CASES: list[tuple[str, dict[str, Any]]] = [
    ("multi-tenant", {"kv_blocks": 1_500}),
    ("multi-tenant", {"kv_blocks": 900, "replicas": 2, "router": "prefix-affinity"}),
    ("multi-tenant", {"kv_blocks": 3_000, "replicas": 3, "router": "least-loaded"}),
    ("multi-tenant", {"kv_blocks": 700, "sched": SchedulerConfig(max_num_seqs=4)}),
    ("contended", {"kv_blocks": 300}),
    ("contended", {"kv_blocks": 260, "sched": SchedulerConfig(waiting_preempts_running=True)}),
    ("contended", {"kv_blocks": 300, "sched": SchedulerConfig(policy="fcfs")}),
    ("contended", {"kv_blocks": 520, "block_size": 4, "replicas": 2, "router": "prefix-affinity"}),
    ("contended", {"kv_blocks": 2_000, "block_size": 1}),
    ("contended", {"kv_blocks": 1_000, "block_size": 2}),
    # max_model_len: runs cut where a request reaches it (and, at 700, a prompt of 700 tokens or more rejected)
    ("multi-tenant", {"kv_blocks": 1_500, "sched": SchedulerConfig(max_model_len=2_000)}),
    ("contended", {"kv_blocks": 300, "sched": SchedulerConfig(max_model_len=1_000)}),
    ("contended", {"kv_blocks": 400, "block_size": 2, "sched": SchedulerConfig(max_model_len=700)}),
    ("contended", {"kv_blocks": 260, "block_size": 4, "sched": SchedulerConfig(max_model_len=1_003)}),
]


@pytest.mark.parametrize("policy", ["lru", "unified"])
@pytest.mark.parametrize(("workload", "kw"), CASES)
def test_fast_forward_equals_step_by_step(policy: str, workload: str, kw: dict[str, Any]) -> None:
    wl = multi_tenant() if workload == "multi-tenant" else contended()
    slow, slow_reqs = run(SimConfig(policy=policy, fast_forward=False, **kw), wl)
    fast, fast_reqs = run(SimConfig(policy=policy, fast_forward=True, **kw), wl)
    assert fast == slow
    assert fast_reqs == slow_reqs
    if workload == "contended":
        assert slow["preemptions"] > 0  # the runs really were cut by failing allocations


def test_fast_forward_covers_most_decode_steps() -> None:
    wl = contended()
    slow, fast = (Simulation(SimConfig(kv_blocks=2_000, fast_forward=ff), wl).run() for ff in (False, True))
    steps = slow.summary()["steps"]
    assert fast.summary()["steps"] == steps
    assert slow.fast_forwarded_steps == 0 and fast.fast_forwarded_steps > 0.9 * steps


def test_fast_forward_counts_its_steps_in_each_replicas_scheduler_too() -> None:
    kw: dict[str, Any] = {"kv_blocks": 2_000, "replicas": 2, "router": "round-robin"}
    slow, fast = (Simulation(SimConfig(fast_forward=ff, **kw), contended()).run() for ff in (False, True))
    assert fast.fast_forwarded_steps > 0
    steps = [rep.scheduler.num_steps for rep in slow.replicas]
    assert [rep.scheduler.num_steps for rep in fast.replicas] == steps and min(steps) > 0


def test_decode_step_time_is_bit_identical_to_step_time() -> None:
    cat = builtin_catalog()
    for model, gpu, tp in (("llama-3-8b", "h100-sxm", 1), ("llama-3-70b", "a100-80gb", 4)):
        cm = CostModel(cat.model(model), cat.gpu(gpu), tp)
        rng = random.Random(7)
        for _ in range(200):
            ctxs = [rng.randint(2, 40_000) for _ in range(rng.randint(1, 64))]
            assert cm.decode_step_time(len(ctxs), sum(ctxs)) == cm.step_time((), ctxs)
        assert cm.decode_step_time(0, 0) == 0.0


@pytest.mark.parametrize("replicas", [1, 2])
def test_an_arrival_on_a_step_boundary_joins_that_steps_schedule(tmp_path: Any, replicas: int) -> None:
    # with steps of exactly 0.25 s, b arrives at 1.0 and c at 2.5, each where a planned decode step starts: the
    # fast-forward started that step before the arrival cut the run, so b waited one step (TTFT 0.5, not 0.25)
    model = tmp_path / "quarter.toml"
    model.write_text(
        "[coefficients]\nstep_overhead_s = 0.25\nper_token_s = 0.0\nper_pair_s = 0.0\nper_sequence_s = 0.0\n"
    )
    wl = [
        WorkloadRequest("a", 0.0, TokenSeq.seeded(1, 100), 20),
        WorkloadRequest("b", 1.0, TokenSeq.seeded(2, 100), 5),
        WorkloadRequest("c", 2.5, TokenSeq.seeded(3, 100), 5),
    ]
    kw: dict[str, Any] = {"cost_model": str(model), "kv_blocks": 1_000, "replicas": replicas}
    slow, slow_reqs = run(SimConfig(fast_forward=False, **kw), wl)
    fast, fast_reqs = run(SimConfig(fast_forward=True, **kw), wl)
    assert fast_reqs == slow_reqs and fast == slow
    assert slow_reqs["b"][0][0] == 1.25  # (its first token at the end of the step that starts at its arrival)


def test_fast_forward_runs_while_max_num_seqs_requests_run_and_others_wait() -> None:
    # two of three requests run (max_num_seqs 2), the third waits: no admission is possible, so the decode steps
    # are fast-forwarded anyway, with the step-by-step results
    wl = [WorkloadRequest(f"r{i}", 0.0, TokenSeq.seeded(i, 40), 200) for i in range(3)]
    kw: dict[str, Any] = {"kv_blocks": 2_000, "sched": SchedulerConfig(max_num_seqs=2)}
    slow, fast = (Simulation(SimConfig(fast_forward=ff, **kw), wl).run() for ff in (False, True))
    steps = slow.summary()["steps"]
    assert fast.summary()["steps"] == steps and steps >= 400
    assert fast.fast_forwarded_steps > 0.9 * steps
    assert run(SimConfig(fast_forward=True, **kw), wl) == run(SimConfig(fast_forward=False, **kw), wl)


@pytest.mark.parametrize("limit", [None, 1, 2, 600, 1_000, 1_201, 10_000])
def test_fast_forward_stops_each_request_at_max_model_len(limit: int | None) -> None:
    """A request ends holding ``min(prompt + max_tokens, max_model_len)`` tokens, fast-forwarded or not; a prompt
    of ``max_model_len`` tokens or more is rejected. (Before the run was capped at the limit, a run planned to the
    fewest remaining ``max_tokens`` went past it: the requests came back longer than step by step.)"""
    wl = contended()
    kw: dict[str, Any] = {"kv_blocks": 2_000, "sched": SchedulerConfig(max_model_len=limit)}
    slow, fast = (Simulation(SimConfig(fast_forward=ff, **kw), wl).run() for ff in (False, True))
    for sim in (slow, fast):
        cap = limit or 1 << 62
        want = {w.request_id: min(len(w.prompt) + w.output_len, cap) for w in wl if len(w.prompt) < cap}
        assert {r.request_id: r.num_tokens for r in sim.finished} == want
        assert sorted(r.request_id for r in sim.rejected) == sorted(
            w.request_id for w in wl if w.request_id not in want
        )
    assert run(SimConfig(fast_forward=True, **kw), wl) == run(SimConfig(fast_forward=False, **kw), wl)
    if limit is None or limit > 1_000:
        assert fast.fast_forwarded_steps > 0
