"""Scheduler tests in vLLM's style: small pools, hand-built runner outputs, exact scheduling orders."""

from __future__ import annotations

import pytest

from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.sched import (
    QUEUE_POLICIES,
    Request,
    RequestStatus,
    RunnerOutput,
    ScheduledChunk,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

BS = 4


def make(num_blocks: int = 16, **cfg: object) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=BS, policy="lru")
    return Scheduler(kv, SchedulerConfig(**cfg))  # type: ignore[arg-type]


def req(rid: str, n: int, out: int = 4, prio: int = 0, t: float = 0.0, base: int | None = None) -> Request:
    start = (sum(map(ord, rid)) * 1000) if base is None else base
    return Request(rid, list(range(start, start + n)), out, arrival_time=t, priority=prio)


def step(s: Scheduler) -> SchedulerOutput:
    """One step with a hand-built runner output: token 7 for every chunk that samples."""
    out = s.schedule()
    sampled = tuple(c.request_id for c in out.chunks if c.samples)
    s.update_from_output(out, RunnerOutput(sampled, tuple(7 for _ in sampled)))
    s.kv.check_integrity()
    return out


def ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(c.request_id, c.num_new_tokens) for c in out.chunks]


def test_queue_registry_and_config_errors() -> None:
    assert QUEUE_POLICIES.names() == ["fcfs", "priority"]
    with pytest.raises(ValueError, match="unknown queue policy 'lifo'"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("a", [1, 2], 0)
    with pytest.raises(ValueError, match="at least one token"):
        Request("a", [], 1)


def test_request_total_order_priority_arrival_id() -> None:
    a = req("a", 4, prio=1, t=0.0)
    b = req("b", 4, prio=0, t=5.0)
    c = req("c", 4, prio=0, t=5.0)
    d = req("d", 4, prio=0, t=1.0)
    assert sorted([a, b, c, d]) == [d, b, c, a]


def test_a_status_is_finished_from_finished_on() -> None:
    done = [s for s in RequestStatus if s.is_finished]
    assert done == [RequestStatus.FINISHED, RequestStatus.ABORTED, RequestStatus.REJECTED]


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["a", "b", "c", "d"]), ("priority", ["d", "b", "c", "a"])]
)
def test_waiting_order(policy: str, order: list[str]) -> None:
    s = make(64, policy=policy, max_num_seqs=1)
    for r in (
        req("a", 4, 1, prio=1, t=0.0),
        req("b", 4, 1, t=1.0),
        req("c", 4, 1, t=1.0),
        req("d", 4, 1, t=0.5),
    ):
        s.add_request(r)
    got = [step(s).chunks[0].request_id for _ in range(4)]
    assert got == order
    assert not s.has_unfinished()


def test_continuous_batching_running_before_waiting_and_lifecycle() -> None:
    s = make(64, max_num_batched_tokens=10)
    a = req("a", 6, out=3)
    s.add_request(a)
    assert ids(step(s)) == [("a", 6)]
    s.add_request(req("b", 8, out=2))
    # running a decodes first (1 token), then waiting b fits whole (8 of the 9 left)
    out = step(s)
    assert ids(out) == [("a", 1), ("b", 8)]
    assert out.chunks[1] == ScheduledChunk("b", 8, 0, True)
    assert out.num_scheduled_tokens == 9
    assert ids(step(s)) == [("a", 1), ("b", 1)]
    assert a.status is RequestStatus.FINISHED and a.num_output_tokens == 3
    assert not s.has_unfinished()
    assert s.kv.get_num_free_blocks() == 64


def test_chunked_prefill_splits_the_prompt_and_samples_at_the_end() -> None:
    s = make(64, max_num_batched_tokens=4)
    s.add_request(req("a", 10, out=2))
    chunks = [step(s).chunks[0] for _ in range(4)]
    assert chunks == [
        ScheduledChunk("a", 4, 0, False),
        ScheduledChunk("a", 4, 4, False),
        ScheduledChunk("a", 2, 8, True),
        ScheduledChunk("a", 1, 10, True),
    ]
    assert not s.has_unfinished()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    s = make(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add_request(req("a", 6, out=3))
    s.add_request(req("b", 6, out=1))
    assert ids(step(s)) == [("a", 6)]  # b (6) does not fit the 2 tokens left
    assert ids(step(s)) == [("a", 1), ("b", 6)]


def test_max_num_seqs_bounds_running_requests() -> None:
    s = make(64, max_num_seqs=2)
    for r in "abc":
        s.add_request(req(r, 4, out=2))
    assert ids(step(s)) == [("a", 4), ("b", 4)]
    assert ids(step(s)) == [("a", 1), ("b", 1)]
    assert ids(step(s)) == [("c", 4)]


@pytest.mark.parametrize(
    ("policy", "start", "chunks", "victim"),
    [
        # priority: running order a, c, b; c needs a block, the least important running request (b) goes
        ("priority", "acb", [("a", 1), ("c", 1)], "b"),
        # fcfs: b needs a block and the last started request (c) goes, although more important than b
        ("fcfs", "abc", [("a", 1), ("b", 1)], "c"),
    ],
)
def test_preemption_victim(policy: str, start: str, chunks: list[tuple[str, int]], victim: str) -> None:
    s = make(10, policy=policy)
    rs = [req("a", 12, prio=0, t=0.0), req("b", 12, prio=1, t=1.0), req("c", 12, prio=0, t=2.0)]
    for r in rs:
        s.add_request(r)
    assert ids(step(s)) == [(r, 12) for r in start]  # 9 of 10 blocks
    out = step(s)  # every decode needs a 4th block: only one is free
    assert ids(out) == chunks
    assert out.preempted == (victim,)
    v = s.requests[victim]
    assert v.status is RequestStatus.PREEMPTED and v.num_computed_tokens == 0 and v.num_preemptions == 1
    assert s.num_preemptions == 1


def test_preempted_blocks_stay_cached_and_the_resume_hits_them() -> None:
    s = make(8, policy="priority")
    hi = req("hi", 12, out=5, prio=0)
    lo = req("lo", 16, out=4, prio=1, t=1.0)
    s.add_request(hi)
    s.add_request(lo)
    assert ids(step(s)) == [("hi", 12), ("lo", 16)]  # 3 + 4 = 7 blocks
    out = step(s)  # hi takes the 8th block; lo needs a 5th: it preempts itself (least important)
    assert ids(out) == [("hi", 1)] and out.preempted == ("lo",)
    # lo's 4 full blocks are cached-free; the resume (17 known tokens) needs them plus one block: it waits
    # for hi, then hits all 4 (16 tokens) and recomputes one token
    outs = [step(s) for _ in range(4)]
    assert [ids(o) for o in outs] == [[("hi", 1)], [("hi", 1)], [("hi", 1)], [("lo", 1)]]
    assert outs[-1].chunks[0] == ScheduledChunk("lo", 1, 16, True)
    # the resume's hits are counted apart from lo's first lookup (which hit nothing)
    st = s.kv.stats[1]
    assert (st.requests, st.query_tokens, st.hit_tokens) == (1, 16, 0)
    assert (st.resumes, st.resume_query_tokens, st.resume_hit_tokens) == (1, 17, 16)
    while s.has_unfinished():
        step(s)
    assert lo.num_output_tokens == 4 and lo.num_preemptions == 1


def test_waiting_request_preempts_lower_priority_running_only_with_the_option() -> None:
    for option, chunks, preempted in ((False, [("lo", 1)], ()), (True, [("hi", 12)], ("lo",))):
        s = make(6, policy="priority", waiting_preempts_running=option)
        lo = req("lo", 16, out=4, prio=1)
        s.add_request(lo)
        step(s)  # 4 blocks
        s.add_request(req("hi", 12, out=2, prio=0, t=1.0))  # needs 3 blocks; lo's decode takes the 5th
        out = step(s)
        assert ids(out) == chunks and out.preempted == preempted


def test_fcfs_waiting_request_that_preempts_leaves_the_queue_and_its_victim_waits() -> None:
    # issue 11, defect 1: the victim went to the front of the fcfs queue and pop() removed it instead of
    # the request just admitted (the victim was lost, the admitted request RUNNING and still waiting)
    s = make(6, policy="fcfs", waiting_preempts_running=True)
    lo = req("lo", 16, out=4, prio=1)
    s.add_request(lo)
    step(s)
    hi = req("hi", 12, out=2, prio=0, t=1.0)
    s.add_request(hi)
    out = step(s)
    assert ids(out) == [("hi", 12)] and out.preempted == ("lo",)
    assert [r.request_id for r in s.waiting] == ["lo"] and s.running == [hi]
    assert lo.status is RequestStatus.PREEMPTED and hi.status is RequestStatus.RUNNING
    while s.has_unfinished():
        step(s)
    assert hi.num_output_tokens == 2 and lo.num_output_tokens == 4
    assert s.kv.get_num_free_blocks() == 6


def test_a_request_that_can_never_fit_is_rejected_at_admission() -> None:
    # issue 11, defect 2: such a request preempted itself at the head of the queue forever
    s = make(4)  # 16 tokens of KV
    big = req("big", 15, out=3)  # 15 + 3 - 1 = 17 tokens of KV: 5 blocks
    assert s.add_request(big) is False
    assert big.status is RequestStatus.REJECTED and big.is_finished
    assert big.rejection == (
        "request 'big' needs 5 KV blocks of 4 tokens for its 15 prompt and 3 output tokens, "
        "but the replica has only 4"
    )
    assert s.num_rejected == 1 and not s.has_unfinished() and s.abort("big") is None
    exact = req("exact", 15, out=2)  # 16 tokens of KV (the last sampled token gets none): fits exactly
    small = req("small", 2, out=1, t=1.0)
    assert s.add_request(exact) and s.add_request(small)
    while s.has_unfinished():
        step(s)
    assert exact.num_output_tokens == 2 and small.status is RequestStatus.FINISHED
    # without chunked prefill a request longer than one step's budget can never be scheduled either
    s = make(64, max_num_batched_tokens=8, enable_chunked_prefill=False)
    assert s.add_request(req("long", 6, out=4)) is False  # 9 tokens > 8
    assert s.add_request(req("ok", 6, out=3))  # 8 tokens


def test_only_first_lookups_reach_the_policy() -> None:
    # issue 10, deliverable 5: a resume after preemption is not a new lookup for the policy's on_lookup
    s = make(8, policy="priority")
    seen: list[int] = []
    pol = s.kv.pool.policy
    inner = pol.on_lookup
    # (a policy's on_lookup of three arguments, as before on_arrival: called so when nothing arrived ahead)
    pol.on_lookup = lambda hashes, n_hit, retention: (seen.append(n_hit), inner(hashes, n_hit, retention))  # type: ignore[method-assign]
    s.add_request(req("hi", 12, out=5, prio=0))
    s.add_request(req("lo", 16, out=4, prio=1, t=1.0))
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions == 1 and seen == [0, 0]  # one per request; lo's resume (16 hit tokens) not
    assert s.kv.stats[1].resume_hit_tokens == 16


def test_the_policy_sees_a_request_at_arrival_and_its_first_lookup_gets_what_it_saw() -> None:
    # the controller's shadows work at add_request (as the vLLM plugin's at vLLM's input processing); the first
    # lookup takes what they saw, a resume after preemption does not reach the policy
    s = Scheduler(KVCacheManager(8, block_size=BS, policy="unified"), SchedulerConfig(policy="priority"))
    pol = s.kv.pool.policy
    arrived: list[object] = []
    looked: list[object] = []
    inner_arrival, inner_lookup = pol.on_arrival, pol.on_lookup

    def on_arrival(hashes, retention):  # type: ignore[no-untyped-def]
        arrived.append(inner_arrival(hashes, retention))
        return arrived[-1]

    def on_lookup(hashes, n_hit, retention, arrival=None):  # type: ignore[no-untyped-def]
        looked.append(arrival)
        inner_lookup(hashes, n_hit, retention, arrival)

    pol.on_arrival, pol.on_lookup = on_arrival, on_lookup  # type: ignore[method-assign]
    s.add_request(req("hi", 12, out=5, prio=0))
    s.add_request(req("lo", 16, out=4, prio=1, t=1.0))
    assert len(arrived) == 2 and all(a is not None for a in arrived) and looked == []
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions == 1 and looked == arrived  # one lookup each, with its own arrival's work


def test_fcfs_waiting_request_never_preempts_one_admitted_in_the_same_step() -> None:
    # fcfs admits a less important request ahead of a more important one; that one then preempted it in the same
    # step: counted as preempted without having run, and its first lookup filed as a resume hitting 8 tokens of
    # blocks no step computed
    s = make(6, policy="fcfs", waiting_preempts_running=True)
    lo, hi = req("lo", 9, out=1, prio=2), req("hi", 13, out=1, prio=0)
    s.add_request(lo)
    s.add_request(hi)
    out = step(s)
    assert ids(out) == [("lo", 9)] and out.preempted == ()
    assert lo.num_preemptions == 0
    while s.has_unfinished():
        step(s)
    stats = s.kv.stats[2]
    assert (stats.requests, stats.resumes, stats.resume_hit_tokens) == (1, 0, 0)


def test_waiting_request_preempts_only_when_that_makes_room() -> None:
    # 8 blocks: "a" (5 blocks) and "v" (1) run, 1 free; "w" needs 4: preempting v frees 1, not enough. It was
    # preempted anyway and "w" kept waiting (v lost its progress for nothing)
    s = make(8, policy="priority", waiting_preempts_running=True)
    a, v = req("a", 20, out=8, prio=0), req("v", 3, out=8, prio=2)
    s.add_request(a)
    s.add_request(v)
    step(s)
    step(s)
    w = req("w", 16, out=2, prio=1, t=1.0)
    s.add_request(w)
    out = step(s)
    assert out.preempted == () and v.status is RequestStatus.RUNNING and w.status is RequestStatus.WAITING
    assert v.num_preemptions == 0


def test_waiting_request_preempts_the_fewest_least_important_first() -> None:
    # three possible victims (priorities 1, 2, 3; 2 blocks each), 2 blocks free, "w" needs 3: preempting the
    # least important one makes room, so it alone goes
    s = make(8, policy="priority", waiting_preempts_running=True)
    runs = [req(f"r{p}", 6, out=4, prio=p) for p in (1, 2, 3)]
    for r in runs:
        s.add_request(r)
    step(s)
    w = req("w", 12, out=2, prio=0, t=1.0)
    s.add_request(w)
    out = step(s)
    assert out.preempted == ("r3",) and w.status is RequestStatus.RUNNING
    assert [r.status for r in runs[:2]] == [RequestStatus.RUNNING] * 2


def test_waiting_request_never_preempts_one_whose_chunk_of_this_step_completes_a_block() -> None:
    # allocate_slots registers a block in the prefix cache when it is allocated: "lo"'s decode chunk of step 2
    # completes its second block, so preempting lo in that step left a cached block whose KV no step computed,
    # and lo's resume hit it
    s = make(4, policy="priority", waiting_preempts_running=True)
    lo = req("lo", 7, out=6, prio=1)
    s.add_request(lo)
    step(s)  # the prompt's 7 tokens (2 blocks), samples token 8
    hi = req("hi", 12, out=2, prio=0, t=1.0)  # 3 blocks, 2 free
    s.add_request(hi)
    out = step(s)  # lo computes token 8: its chunk completes block 2
    assert out.preempted == () and ids(out) == [("lo", 1)] and hi.status is RequestStatus.WAITING
    out = step(s)  # token 9 completes nothing: lo may go now
    assert out.preempted == ("lo",) and ids(out) == [("hi", 12)]
    while s.has_unfinished():
        step(s)
    assert s.kv.stats[1].resume_hit_tokens <= 8  # what lo had computed when it was preempted


def test_waiting_request_keeps_running_a_less_important_victim_it_fits_without() -> None:
    # "small" (priority 3, 1 block) is taken first, then "big" (priority 2, 9 blocks): freeing big alone makes
    # room, so small's preemption would lose its progress for nothing (it was preempted with big)
    s = make(12, policy="priority", waiting_preempts_running=True)
    big, small = req("big", 9 * BS - 2, out=2, prio=2), req("small", BS - 2, out=2, prio=3)
    s.add_request(big)
    s.add_request(small)
    step(s)
    w = req("w", 4 * BS - 1, out=2, prio=0, t=1.0)
    s.add_request(w)
    out = step(s)
    assert out.preempted == ("big",) and w.status is RequestStatus.RUNNING
    assert "small" in [c.request_id for c in out.chunks] and small.num_preemptions == 0


def test_waiting_request_never_preempts_equal_or_more_important_running() -> None:
    s = make(6, policy="priority", waiting_preempts_running=True)
    s.add_request(req("first", 16, out=4, prio=0))
    step(s)
    s.add_request(req("late", 12, out=2, prio=0, t=1.0))
    out = step(s)
    assert ids(out) == [("first", 1)] and out.preempted == ()


def test_abort_frees_blocks() -> None:
    s = make(16)
    a = req("a", 8, out=5)
    s.add_request(a)
    s.add_request(req("b", 8, out=5))
    step(s)
    assert s.abort("a") is a and a.status is RequestStatus.ABORTED
    assert s.abort("a") is None
    assert s.kv.num_blocks_of(a) == 0
    s.kv.check_integrity()
    with pytest.raises(ValueError, match="already scheduled"):
        s.add_request(s.requests["b"])


def test_times_are_recorded_from_the_clock() -> None:
    now = [0.0]
    kv = KVCacheManager(16, block_size=BS)
    s = Scheduler(kv, SchedulerConfig(), clock=lambda: now[0])
    r = req("a", 5, out=3, t=0.0)
    s.add_request(r)
    for t in (1.0, 2.0, 3.5):
        now[0] = t - 0.5
        out = s.schedule()
        now[0] = t
        s.update_from_output(out, RunnerOutput(("a",), (1,)))
    assert r.first_scheduled_time == 0.5
    assert r.ttft == 1.0 and r.token_times == [1.0, 2.0, 3.5] and r.finish_time == 3.5
    assert r.tpot == pytest.approx(1.25) and r.e2e == 3.5 and r.queueing_time == 0.5


def test_runner_output_must_pair_ids_and_tokens() -> None:
    with pytest.raises(ValueError, match="2 request ids but 1 token ids"):
        RunnerOutput(("a", "b"), (1,))


def test_num_cached_tokens_is_the_first_admissions_hit() -> None:
    s = make(16)
    a = req("a", 9, out=2, base=100)
    s.add_request(a)
    assert a.num_cached_tokens is None
    while not a.is_finished:
        step(s)
    assert a.num_cached_tokens == 0
    b = req("b", 12, out=2, base=100)  # shares a's first two full blocks (8 tokens)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens == 8
    while not b.is_finished:
        step(s)
    assert b.num_cached_tokens == 8


def test_a_lookup_counts_with_the_hits_it_was_admitted_with() -> None:
    # vLLM 0.33 records a lookup at admission ("unscheduled lookups are not counted"): b, looked up while a and c
    # hold the pool, hits a's prompt (2 blocks) but cannot be admitted; it is admitted once both finished, when
    # a's first output block is cached too (3 blocks). The class counts the hit it was admitted with, once
    s = make(8)
    s.add_request(req("a", 8, out=5, base=100))
    s.add_request(req("c", 12, out=8, base=900))
    step(s)
    b = Request("b", [*range(100, 108), 7, 7, 7, 7, *range(500, 508)], 2, arrival_time=1.0, priority=0)
    s.add_request(b)
    step(s)
    assert b.num_cached_tokens is None and s.kv.get_computed_blocks(b)[1] == 8  # (not admitted)
    while s.has_unfinished():
        step(s)
    assert b.num_cached_tokens == 12
    st = s.kv.stats[0]
    assert st.requests == 3 and st.hit_tokens == 12  # (before: 8, the first lookup's)


def test_without_chunked_prefill_a_decode_takes_the_last_token_of_the_budget() -> None:
    # three decodes in a budget of three tokens: the third fits the one token left exactly
    s = make(64, max_num_batched_tokens=3, enable_chunked_prefill=False)
    for r in "abc":
        s.add_request(req(r, 1, out=2))
    assert ids(step(s)) == [("a", 1), ("b", 1), ("c", 1)]
    assert ids(step(s)) == [("a", 1), ("b", 1), ("c", 1)]
    assert not s.has_unfinished()


def test_a_running_victim_ahead_in_running_order_leaves_the_next_request_its_turn() -> None:
    # running order lo, a, b; a's decode needs a block, so lo (least important, ahead of a) goes: b, now at a's
    # old index, still decodes in this step
    s = make(10, policy="priority")
    lo = req("lo", 12, out=8, prio=1)
    s.add_request(lo)
    step(s)  # lo's 3 blocks
    s.add_request(req("a", 12, out=4, t=1.0))
    s.add_request(req("b", 12, out=4, t=2.0))
    assert ids(step(s)) == [("lo", 1), ("a", 12), ("b", 12)]  # 4 + 3 + 3 = 10 blocks
    out = step(s)
    assert out.preempted == ("lo",) and ids(out) == [("a", 1), ("b", 1)]


def test_a_victim_preempted_after_its_chunk_gives_its_tokens_back_to_the_budget() -> None:
    # budget 4, 4 blocks: step 4 gives lo its decode token, then a's decode needs a block and preempts lo; lo's
    # token returns to the budget, so c's prompt chunk is 3 tokens (4 - a's 1), not 2
    s = make(4, policy="priority", max_num_batched_tokens=4, reserve_full_prompt=False)
    s.add_request(req("lo", 4, out=8, prio=1))
    assert ids(step(s)) == [("lo", 4)]
    s.add_request(req("a", 4, out=8, t=1.0))
    s.add_request(req("c", 12, out=2, t=2.0))
    assert ids(step(s)) == [("lo", 1), ("a", 3)]
    assert ids(step(s)) == [("lo", 1), ("a", 1), ("c", 2)]
    out = step(s)
    assert out.preempted == ("lo",) and ids(out) == [("a", 1), ("c", 3)]
    assert out.num_scheduled_tokens == 4


def test_fcfs_waiting_request_never_preempts_one_just_admitted_whose_chunk_completes_no_block() -> None:
    # lo's 3-token prompt completes no block, so only the admitted-in-this-step rule keeps hi from preempting it
    s = make(4, policy="fcfs", waiting_preempts_running=True)
    lo, hi = req("lo", 3, out=1, prio=2), req("hi", 13, out=1, prio=0)
    s.add_request(lo)
    s.add_request(hi)
    out = step(s)
    assert ids(out) == [("lo", 3)] and out.preempted == ()
    assert lo.num_preemptions == 0 and hi.status is RequestStatus.WAITING


def test_a_resume_after_preemption_keeps_the_first_admissions_cached_tokens() -> None:
    # lo's first admission hit nothing; its resume hits its own 4 freed blocks, which is no prefix-cache hit
    s = make(8, policy="priority")
    s.add_request(req("hi", 12, out=5, prio=0))
    lo = req("lo", 16, out=4, prio=1, t=1.0)
    s.add_request(lo)
    step(s)
    assert step(s).preempted == ("lo",) and lo.num_cached_tokens == 0
    while s.has_unfinished():
        step(s)
    assert lo.num_preemptions == 1 and lo.num_cached_tokens == 0


def test_fcfs_puts_a_preempted_request_back_at_the_front_of_the_queue() -> None:
    # c is preempted in a step where d already waits: c resumes before d, as in vLLM
    s = make(10, policy="fcfs")
    for r in "abc":
        s.add_request(req(r, 12, prio=0, t=0.0))
    step(s)  # 9 of 10 blocks
    s.add_request(req("d", 4, t=1.0))
    out = step(s)
    assert out.preempted == ("c",)
    assert [r.request_id for r in s.waiting] == ["c", "d"]


def test_priority_queue_iterates_in_scheduling_order() -> None:
    s = make(64, policy="priority", max_num_seqs=1)
    for rid, prio, t in (("a", 0, 0.0), ("b", 2, 0.0), ("c", 1, 0.0), ("d", 1, 0.5), ("e", 0, 1.0)):
        s.add_request(req(rid, 4, prio=prio, t=t))
    assert [r.request_id for r in s.waiting] == ["a", "e", "c", "d", "b"]


def test_max_model_len_is_an_integer_of_at_least_one_or_none() -> None:
    assert SchedulerConfig().max_model_len is None and SchedulerConfig(max_model_len=1).max_model_len == 1
    for bad in (0, -5, True, 1.5, "32", float("nan")):
        with pytest.raises(ValueError, match=r"max_model_len must be an integer >= 1 or None, got "):
            SchedulerConfig(max_model_len=bad)  # type: ignore[arg-type]


def test_a_request_ends_when_it_holds_max_model_len_tokens() -> None:
    # the review's reproduction: vLLM 0.33 (max_model_len 32) ends a 30-token prompt's request after 2 steps,
    # holding 32 tokens (check_stop: num_tokens >= max_model_len); kvretain took its 10 max_tokens
    for limit, steps in ((None, 10), (32, 2), (31, 1), (40, 10), (64, 10)):  # (64: what 16 blocks of 4 hold)
        s = make(16, max_model_len=limit)
        a = req("a", 30, out=10)
        assert s.add_request(a)
        n = 0
        while s.has_unfinished():
            step(s)
            n += 1
        assert (n, a.status, a.num_tokens) == (steps, RequestStatus.FINISHED, 30 + steps), limit
        assert s.kv.get_num_free_blocks() == 16 and s.num_rejected == 0
    # a resume after preemption keeps the limit (prompt and output count, as in vLLM): 32 tokens of KV, two
    # requests of 19 each
    s = make(8, max_model_len=20)
    lo, hi = req("lo", 12, out=30, prio=1), req("hi", 12, out=30, prio=0, t=1.0)
    s.add_request(lo)
    s.add_request(hi)
    while s.has_unfinished():
        step(s)
    assert lo.num_preemptions >= 1 and (lo.num_tokens, hi.num_tokens) == (20, 20)


def test_a_prompt_of_max_model_len_tokens_or_more_is_rejected_at_admission() -> None:
    s = make(64, max_model_len=32)
    for n in (32, 33, 200):
        r = req(f"p{n}", n, out=1)
        assert s.add_request(r) is False and r.status is RequestStatus.REJECTED
        assert r.rejection == (
            f"request 'p{n}': its {n} prompt tokens reach max_model_len (32), leaving no room for an output token"
        )
    assert s.num_rejected == 3 and not s.has_unfinished()
    ok = req("p31", 31, out=5)  # one output token: it ends holding 32
    assert s.add_request(ok)
    while s.has_unfinished():
        step(s)
    assert ok.num_output_tokens == 1 and ok.status is RequestStatus.FINISHED


def test_a_pool_that_cannot_hold_one_request_of_max_model_len_tokens_is_refused() -> None:
    # vLLM 0.33 refuses to start when its KV cache (less its null block, which kvretain's pool leaves out) cannot
    # hold cdiv(max_model_len, block_size) blocks, and names the largest max_model_len it holds: 4 blocks of 4
    # tokens hold 16 (every one of the 16 counted, though a request stops holding 15 of KV)
    for limit in (1, 13, 16):
        assert make(4, max_model_len=limit).config.max_model_len == limit
    for limit, need in ((17, 5), (20, 5), (21, 6), (10**9, 250_000_000)):
        with pytest.raises(ValueError) as e:
            make(4, max_model_len=limit)
        assert str(e.value) == (
            f"max_model_len {limit:,}: one request of {limit:,} tokens needs {need:,} KV blocks of 4 tokens, "
            "but the KV cache has 4: the largest max_model_len it holds is 16 (vLLM refuses to start with a KV "
            "cache that cannot hold one request of max_model_len tokens)"
        )
    # without max_model_len nothing to check (a request that cannot fit is refused on its own at admission)
    assert make(1).config.max_model_len is None
    SchedulerConfig(max_model_len=16).check_pool(4, 4)
    with pytest.raises(ValueError, match="needs 2 KV blocks of 16 tokens, but the KV cache has 1:"):
        SchedulerConfig(max_model_len=17).check_pool(1, 16)
    SchedulerConfig().check_pool(1, 1)


def test_the_pool_check_counts_the_kv_of_max_model_len_tokens_at_most() -> None:
    # 15 + 10 - 1 = 24 tokens of KV do not fit 16, but the request stops at 16 tokens (15 of KV) with
    # max_model_len 16: it is admitted and runs
    assert make(4).add_request(req("a", 15, out=10)) is False
    s = make(4, max_model_len=16)
    a = req("a", 15, out=10)
    assert s.add_request(a)
    while s.has_unfinished():
        step(s)
    assert a.num_tokens == 16
    # with max_model_len 20 (19 tokens of KV, 5 blocks) a request could need more blocks than the pool has:
    # vLLM does not start on such a pool, and no more does kvretain's scheduler (so that, with the limit set, no
    # request is refused for blocks)
    with pytest.raises(ValueError, match="the largest max_model_len it holds is 16 "):
        make(4, max_model_len=20)
    # without chunked prefill the budget check counts them too: 8 + 4 - 1 = 11 > 10, but at most 9 with 10
    s = make(64, max_num_batched_tokens=10, max_num_seqs=4, enable_chunked_prefill=False, max_model_len=10)
    c = req("c", 8, out=4)
    assert s.add_request(c)
    while s.has_unfinished():
        step(s)
    assert c.num_tokens == 10


def test_max_model_len_holds_the_budget_to_vllms_start_up_rules() -> None:
    """vLLM 0.33 (``SchedulerConfig.verify_max_model_len``) refuses to start with a budget below max_model_len
    without chunked prefill, or below max_num_seqs; with max_model_len set the scheduler refuses them too."""
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(65\)"
    ):
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False, max_model_len=65
        )
    with pytest.raises(ValueError, match=r"must be at least max_num_seqs \(5\)"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=5, max_model_len=4)
    # the edges vLLM accepts: a budget equal to max_model_len without chunking, equal to max_num_seqs with it
    SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=False, max_model_len=64)
    SchedulerConfig(max_num_batched_tokens=5, max_num_seqs=5, max_model_len=4000)
    # without max_model_len the scheduler is not held to vLLM's start-up rules (edge settings stay testable)
    SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=5, enable_chunked_prefill=False)
