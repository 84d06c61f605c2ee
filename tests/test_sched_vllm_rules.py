"""kvretain.sched follows vLLM 0.33's scheduler where ``bench/sched_equivalence.py`` found it did not.

Each test pins one rule of vLLM 0.33's ``vllm/v1/core/sched/scheduler.py`` on a small hand-built case.
"""

from __future__ import annotations

from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.sched import Request, RunnerOutput, Scheduler, SchedulerConfig, SchedulerOutput

BS = 4


def make(num_blocks: int, **cfg: object) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size=BS, policy="lru"), SchedulerConfig(**cfg))  # type: ignore[arg-type]


def req(rid: str, n: int, out: int = 8, prio: int = 0, t: float = 0.0) -> Request:
    start = sum(map(ord, rid)) * 1000
    return Request(rid, list(range(start, start + n)), out, arrival_time=t, priority=prio)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = tuple(c.request_id for c in out.chunks if c.samples)
    s.update_from_output(out, RunnerOutput(sampled, tuple(7 for _ in sampled)))
    s.kv.check_integrity()
    return out


def chunks(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request_id, c.num_new_tokens) for c in out.chunks]


def test_admission_reserves_the_whole_prompt_by_default() -> None:
    """vLLM 0.33 ``scheduler_reserve_full_isl=True``: a waiting request is admitted only when the free blocks
    could hold all its tokens, not just its first chunk."""
    assert SchedulerConfig().reserve_full_prompt
    # 12 blocks of 4 tokens, 24 tokens per step, two prompts of 32 tokens (8 blocks each)
    s = make(12, policy="fcfs", max_num_batched_tokens=24)
    s.add_request(req("a", 32))
    s.add_request(req("b", 32))
    assert chunks(step(s)) == [("a", 24)]
    # a's last chunk leaves 16 tokens of budget; b's first chunk (4 blocks) would fit the 4 free blocks,
    # but its whole prompt (8 blocks) does not: b waits
    assert chunks(step(s)) == [("a", 8)]
    out = step(s)
    assert chunks(out) == [("a", 1)] and not out.preempted


def test_without_the_reservation_the_first_chunk_is_enough() -> None:
    s = make(12, policy="fcfs", max_num_batched_tokens=24, reserve_full_prompt=False)
    s.add_request(req("a", 32))
    s.add_request(req("b", 32))
    assert chunks(step(s)) == [("a", 24)]
    assert chunks(step(s)) == [("a", 8), ("b", 16)]  # over-admitted
    out = step(s)  # a's decode needs a 9th block: none is free, so b (the last running) is preempted
    assert out.preempted == ("b",) and chunks(out) == [("a", 1)]


def test_allocate_slots_reserve_counts_free_hits_and_allocates_only_the_chunk() -> None:
    kv = KVCacheManager(8, block_size=BS, policy="lru")
    a = req("a", 16)
    assert kv.allocate_slots(a, 16, 0) is not None
    kv.free(a)  # 4 cached-free blocks
    b = Request("b", [*a.prompt_token_ids, *range(100, 112)], 1)  # 28 tokens: 7 blocks, 4 of them hits
    hits, n_cached = kv.get_computed_blocks(b)
    assert n_cached == 16
    # the whole request needs 3 new blocks + 4 free hits = 7 <= 8 free
    assert kv.allocate_slots(b, 4, n_cached, hits, reserve_tokens=28) == [4]
    c = req("c", 20)
    assert kv.allocate_slots(c, 4, 0, reserve_tokens=20) is None  # 5 blocks wanted, 3 free: nothing changes
    assert kv.get_num_free_blocks() == 3
    assert kv.allocate_slots(c, 4, 0) is not None  # the chunk alone fits


def test_preemption_ties_on_priority_and_arrival_go_to_the_first_running() -> None:
    """vLLM 0.33 preempts ``max(running, key=(priority, arrival_time))``: no request-id tie-break, so of
    requests tied on both the first in running order is the victim (not the largest id)."""
    # 5 blocks of 4 tokens: a and b (8 tokens, 2 blocks each) are admitted; their first decode tokens need a
    # third block each, and only one is free
    s = make(5, policy="priority", max_num_batched_tokens=64)
    s.add_request(req("a", 8, t=1.0))
    s.add_request(req("b", 8, t=1.0))
    assert chunks(step(s)) == [("a", 8), ("b", 8)]
    out = step(s)
    assert out.preempted == ("a",)  # a got the free block, then b's allocation preempted a (tied, first)
    assert chunks(out) == [("b", 1)]
