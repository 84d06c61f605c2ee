"""The scheduler's, the simulator's and the replay's inputs checked when they are built, as an adversarial pass
found them unchecked (session 45): a refused call changes nothing, and a bad value is named at once, not after the
requests before it have run (or after the whole run). Each test fails on the code before its fix."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.engine.sim.metrics import SLO, parse_slos, percentile
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.replay import ReplayRequest, synthetic_conversations
from kvretain.sched import SchedulerConfig
from kvretain.sched.request import Request
from kvretain.sched.scheduler import Scheduler
from kvretain.workloads import TokenSeq, WorkloadError, WorkloadRequest


def test_a_request_id_is_a_string() -> None:
    # an int id beside a str one broke the priority queue's order: a bare TypeError from the heap, after the
    # request was registered and queued
    s = Scheduler(KVCacheManager(8, block_size=4), SchedulerConfig(policy="priority"), clock=lambda: 0.0)
    assert s.add_request(Request("1", [1, 2, 3], 1))
    with pytest.raises(TypeError, match="request_id must be a str, got int 1"):
        Request(1, [4, 5, 6], 1)  # type: ignore[arg-type]
    assert list(s.requests) == ["1"]
    s.kv.check_integrity()


def _w(**kw: Any) -> WorkloadRequest:
    fields: dict[str, Any] = {
        "request_id": "r",
        "arrival_s": 0.0,
        "prompt": TokenSeq.seeded(1, 8),
        "output_len": 2,
    }
    return WorkloadRequest(**{**fields, **kw})


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"request_id": 7}, "request_id must be a str, got int 7"),
        ({"prompt": TokenSeq.seeded(2, 0)}, "the prompt must hold at least one token"),
        ({"priority": True}, "priority must be an integer, got True"),
        ({"priority": 1.5}, "priority must be an integer, got 1.5"),
        ({"output_len": 2.5}, "output_len must be an integer, got 2.5"),
        ({"arrival_s": "1"}, "arrival_s must be a number, got '1'"),
    ],
)
def test_a_workload_request_is_checked_when_built(kw: dict[str, Any], says: str) -> None:
    # each was refused by the simulator only when the request arrived (after the requests before it had run),
    # some with the wrong field's name (max_tokens for output_len) or none
    with pytest.raises(WorkloadError, match=says):
        _w(**kw)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"slos": {}}, "slos: at least one class"),  # (ran to the end, then min() of nothing in summary())
        ({"replicas": 1.5}, "replicas must be an integer, got 1.5"),
        ({"replicas": True}, "replicas must be an integer, got True"),
        ({"tp": 1.0}, "tp must be an integer, got 1.0"),
        ({"closed_loop": "no"}, "closed_loop must be True or False, got 'no'"),
        ({"sched": None}, "sched must be a SchedulerConfig, got None"),
        ({"frontend_in_s": "1"}, "frontend_in_s must be a finite number"),
    ],
)
def test_a_sim_config_is_checked_when_built(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SimConfig(kv_blocks=64, **kw)


def test_slo_targets_are_positive_wherever_they_are_built() -> None:
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="ttft_s must be > 0 seconds"):
            SLO(bad, 0.1)
    assert SLO(math.inf, 0.1).ttft_s == math.inf  # (no target)
    with pytest.raises(ValueError, match="class 0: tpot_s must be > 0 seconds"):
        parse_slos("0=2:-1")


def test_a_block_larger_than_the_kv_room_names_block_size() -> None:
    # 'num_blocks must be a positive integer, got 0' from the block pool, naming neither
    with pytest.raises(ValueError, match="block_size 10,000,000: larger than the KV room"):
        Simulation(SimConfig(block_size=10**7), [_w()])


def test_percentile_q_is_in_0_100() -> None:
    assert percentile([1.0, 2.0], 50) == 1.5
    for q in (200, -5, math.nan):  # (IndexError; 1.05, below the minimum)
        with pytest.raises(ValueError, match="q must be in"):
            percentile([1.0, 2.0], q)


def test_a_replay_request_is_checked_when_built() -> None:
    with pytest.raises(ValueError, match="timestamp_s must be a finite number"):
        ReplayRequest((b"a",), math.nan)
    with pytest.raises(TypeError, match="retention must be a RetentionConfig or None, got dict"):
        ReplayRequest((b"a",), 0.0, 16, 0, {"directives": []})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="priority must be an integer"):
        ReplayRequest((b"a",), 0.0, 16, True)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"mean_think_s": 0}, "mean_think_s must be > 0"),  # (ZeroDivisionError)
        ({"mean_interarrival_s": -1}, "mean_interarrival_s must be > 0"),  # (negative timestamps)
        ({"important_share": -1}, "important_share must be in"),
        ({"num_sessions": -5}, "num_sessions must be >= 0"),
    ],
)
def test_synthetic_conversations_refuse_settings_that_make_no_workload(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        synthetic_conversations(**kw)
    assert len(synthetic_conversations(num_sessions=3)) >= 3
