"""Seeded stateful tests of the scheduler, for every queue policy with ``waiting_preempts_running`` off and on,
over a small cache where preemption, rejection and eviction are common.

Requests have prompts over a 3-token alphabet (prefixes and blocks are often shared) and some are too large
for the cache; steps run through a fake executor that samples one token per sampling chunk; live and dead
requests are aborted at random. After every step each request is in exactly one of waiting / running /
finished / aborted / rejected, with the matching status; no request runs twice in a step or runs in the
step that preempted it; the cache's reference counts equal the blocks live requests hold. At the end the
scheduler drains: every admitted request that was not aborted finishes with all its tokens, every rejected
one has a reason and really could never be scheduled, every block is free, and each admitted request was
counted once as a first lookup (resumes apart).

Two drivers share :class:`Harness`: a hypothesis state machine (``derandomize``: seeded, shrinks a failure)
and a plain seeded random driver that runs many more lifecycles and asserts that it reached the cases that
matter (preemption, a waiting request preempting a running one, rejection).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import ClassVar

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.sched import (
    QUEUE_POLICIES,
    Request,
    RequestStatus,
    RunnerOutput,
    Scheduler,
    SchedulerConfig,
)

BS = 4
NUM_BLOCKS = 12
MAX_PROMPT = 32  # with up to 24 output tokens some requests never fit in 12 blocks of 4
MAX_OUT = 24
BUDGETS = [4, 9, 16, 64]
DRAIN_STEPS = 5_000


class Harness:
    """A scheduler over a small cache, every request it has seen, and the checks."""

    def __init__(
        self, queue: str, preempts: bool, chunked: bool, budget: int, max_seqs: int, policy: str = "lru"
    ) -> None:
        self.steps = 0
        self.kv = KVCacheManager(NUM_BLOCKS, block_size=BS, policy=policy)
        cfg = SchedulerConfig(
            policy=queue,
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            enable_chunked_prefill=chunked,
            waiting_preempts_running=preempts,
        )
        self.s = Scheduler(self.kv, cfg, clock=lambda: float(self.steps))
        self.all: dict[str, Request] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.rejected: set[str] = set()
        self.admitted: set[str] = set()
        self.events: Counter[str] = Counter()

    def add(self, prompt: list[int], out: int, prio: int) -> None:
        rid = f"r{len(self.all)}"
        r = Request(rid, prompt, out, arrival_time=float(self.steps), priority=prio)
        self.all[rid] = r
        cfg = self.s.config
        kv_tokens = len(prompt) + out - 1  # the last sampled token never gets KV
        never = -(-kv_tokens // BS) > NUM_BLOCKS or (
            not cfg.enable_chunked_prefill and kv_tokens > cfg.max_num_batched_tokens
        )
        if self.s.add_request(r):
            assert not never, f"{rid} admitted although it can never be scheduled"
            self.admitted.add(rid)
        else:
            assert never, f"{rid} rejected although it fits"
            assert r.status is RequestStatus.REJECTED and r.rejection and rid in r.rejection
            self.rejected.add(rid)
            self.events["a request rejected"] += 1
        self.check()

    def abort(self, i: int) -> None:
        """Abort any request by index: a live one ends ABORTED, any other is left alone (None)."""
        if not self.all:
            return
        rid = f"r{i % len(self.all)}"
        live = rid in self.s.requests
        r = self.s.abort(rid)
        if live:
            assert r is not None and r.status is RequestStatus.ABORTED
            self.aborted.add(rid)
        else:
            assert r is None
        self.check()

    def step(self) -> None:
        s = self.s
        was_waiting = {r.request_id for r in s.waiting}
        out = s.schedule()
        ids = [c.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)), f"a request scheduled twice in one step: {ids}"
        assert not set(ids) & set(out.preempted), "a request preempted and scheduled in the same step"
        assert all(s.requests[i].status is RequestStatus.RUNNING for i in ids)
        assert out.num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        if out.preempted:
            self.events["a step preempted"] += 1
            if was_waiting & set(ids):
                self.events["a waiting request preempted a running one"] += 1
        self.steps += 1
        sampled = tuple(c.request_id for c in out.chunks if c.samples)
        toks = tuple((len(self.all[i].output_token_ids) + int(i[1:])) % 3 for i in sampled)
        for r in s.update_from_output(out, RunnerOutput(sampled, toks)):
            assert r.status is RequestStatus.FINISHED and r.num_output_tokens == r.max_tokens
            self.finished.add(r.request_id)
        self.check()

    def check(self) -> None:
        s = self.s
        waiting = [r.request_id for r in s.waiting]
        running = [r.request_id for r in s.running]
        groups = [set(waiting), set(running), self.finished, self.aborted, self.rejected]
        assert len(waiting) == len(groups[0]) and len(running) == len(groups[1]), "a request queued twice"
        assert sum(len(g) for g in groups) == len(self.all), "a request is in no group or in two"
        assert set().union(*groups) == set(self.all), "a request is lost"
        assert set(s.requests) == groups[0] | groups[1]
        want = [
            (RequestStatus.WAITING, RequestStatus.PREEMPTED),
            (RequestStatus.RUNNING,),
            (RequestStatus.FINISHED,),
            (RequestStatus.ABORTED,),
            (RequestStatus.REJECTED,),
        ]
        for g, statuses in zip(groups, want, strict=True):
            for rid in g:
                assert self.all[rid].status in statuses, (rid, self.all[rid].status)
        kv = self.kv
        kv.check_integrity()
        for rid in waiting:
            assert kv.num_blocks_of(self.all[rid]) == 0
        for rid in running:
            r = self.all[rid]
            assert r.num_computed_tokens <= r.num_tokens
            assert kv.num_blocks_of(r) * BS >= r.num_computed_tokens

    def drain(self) -> None:
        s = self.s
        for _ in range(DRAIN_STEPS):
            if not s.has_unfinished():
                break
            self.step()
        assert not s.has_unfinished(), f"requests never finish: {sorted(s.requests)[:5]}"
        assert self.finished == self.admitted - self.aborted
        assert all(self.all[rid].rejection for rid in self.rejected)
        assert self.kv.get_num_free_blocks() == NUM_BLOCKS, "blocks still in use after every request ended"
        stats = self.kv.stats.values()
        first = sum(c.requests for c in stats)
        resumes = sum(c.resumes for c in stats)
        # each admitted request is one first lookup; each preemption is followed by at most one resume
        # (exactly one unless the request was aborted while waiting)
        assert first <= len(self.admitted) and resumes <= s.num_preemptions
        if not self.aborted:
            assert first == len(self.admitted) and resumes == s.num_preemptions
        assert all(c.query_tokens >= c.hit_tokens for c in stats)
        assert all(c.resume_query_tokens >= c.resume_hit_tokens for c in stats)


CASES = [(q, p) for q in QUEUE_POLICIES.names() for p in (False, True)]


# ---------------------------------------------------------------------------------------- seeded driver
@pytest.mark.parametrize(("queue", "preempts"), CASES)
def test_seeded_random_lifecycles(queue: str, preempts: bool) -> None:
    seen: Counter[str] = Counter()
    for seed in range(120):
        rng = random.Random(seed)
        h = Harness(queue, preempts, rng.random() < 0.7, rng.choice(BUDGETS), rng.randint(1, 4))
        for _ in range(50):
            x = rng.random()
            if x < 0.35:
                prompt = [rng.randrange(3) for _ in range(rng.randint(1, MAX_PROMPT))]
                h.add(prompt, rng.randint(1, MAX_OUT), rng.randrange(3))
            elif x < 0.40:
                h.abort(rng.randrange(1_000))
            else:
                h.step()
        h.drain()
        seen += h.events
    assert seen["a step preempted"] and seen["a request rejected"], seen
    if preempts:
        assert seen["a waiting request preempted a running one"], seen


# ---------------------------------------------------------------------------------------- hypothesis
class SchedMachine(RuleBasedStateMachine):
    QUEUE: ClassVar[str] = "fcfs"
    PREEMPTS: ClassVar[bool] = False
    POLICY: ClassVar[str] = "lru"

    @initialize(chunked=st.booleans(), budget=st.sampled_from(BUDGETS), max_seqs=st.integers(1, 4))
    def setup(self, chunked: bool, budget: int, max_seqs: int) -> None:
        self.h = Harness(self.QUEUE, self.PREEMPTS, chunked, budget, max_seqs, self.POLICY)

    @rule(
        reqs=st.lists(
            st.tuples(
                st.lists(st.integers(0, 2), min_size=1, max_size=MAX_PROMPT),
                st.integers(1, MAX_OUT),
                st.integers(0, 2),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add(self, reqs: list[tuple[list[int], int, int]]) -> None:
        for prompt, out, prio in reqs:
            self.h.add(prompt, out, prio)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=16, max_size=MAX_PROMPT), out=st.integers(1, 8))
    def important(self, prompt: list[int], out: int) -> None:
        """A long priority-0 arrival: behind running requests of lower priority it must wait or preempt."""
        self.h.add(prompt, out, 0)

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.h.step()

    @rule(i=st.integers(0, 1_000))
    def abort(self, i: int) -> None:
        self.h.abort(i)

    @invariant()
    def partition(self) -> None:
        if hasattr(self, "h"):
            self.h.check()

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.h.drain()
            for e in self.h.events:
                event(e)


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, database=None, derandomize=True)


def _machine(queue: str, preempts: bool, policy: str = "lru") -> type[SchedMachine]:
    name = f"Sched_{queue}_{'preempts' if preempts else 'plain'}_{policy}"
    return type(name, (SchedMachine,), {"QUEUE": queue, "PREEMPTS": preempts, "POLICY": policy})


# every queue policy of the registry, waiting_preempts_running off and on (plus unified's on_lookup path)
for _queue, _preempts in CASES:
    _case = _machine(_queue, _preempts).TestCase
    _case.settings = SETTINGS
    globals()[f"TestMachine_{_queue}_{'preempts' if _preempts else 'plain'}"] = _case
del _case  # a unittest.TestCase under any name is collected
TestMachinePriorityPreemptsUnified = _machine("priority", True, "unified").TestCase
TestMachinePriorityPreemptsUnified.settings = settings(SETTINGS, max_examples=25)
