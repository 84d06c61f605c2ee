"""Fast-forward of decode-only runs: k engine steps of one replica planned at once, exactly as step by step.

When every running request of a replica is decoding (one token to compute each) and no waiting request can
be admitted (the queue is empty, or ``max_num_seqs`` requests already run), the next steps are fully
determined until one of: a request finishes, a request arrives at this replica, or an allocation would fail.
Between those events a step's only effects are:

* its duration: a decode-only roofline over ``batch`` tokens whose contexts sum to ``C + batch*(s-1)`` at step ``s``
  (:meth:`CostModel.decode_step_time`, the same float expression as the step-by-step pricing);
* one sampled token per request, at the step's end time;
* cache events at block boundaries: a request whose step computes token ``total - 1`` allocates a new block
  when ``(total - 1) % block_size == 0`` and registers a full block when ``total % block_size == 0``;
  at every other step ``allocate_slots(req, 1, ...)`` changes nothing (no block needed, none becomes full).

A :class:`DecodeRun` plans ``k`` steps (``k`` = the fewest tokens any request still has to generate, its
``max_tokens`` or, with ``SchedulerConfig.max_model_len``, what takes it to ``max_model_len`` tokens; cut
before the first step whose allocations exceed the pool's allocatable blocks: allocations are the only
thing that consumes them during the run, since nothing is freed before the last step). It performs the cache
events of step ``s`` at the step's start time ``T[s-1]``, in running order, through the manager's own
``allocate_slots``; tokens and times of the other steps are written lazily, as list slices, when a request
is next touched. The run is advanced *lazily*: :meth:`DecodeRun.advance` executes the steps that start at or
before a given time, which the simulator calls before any arrival is routed (routers read every replica's
cache and load), so whatever another part of the simulation observes is the step-by-step state. An arrival
routed to this replica cuts the run after the step in flight. The last step goes through the scheduler's
``update_from_output`` with an ordinary :class:`SchedulerOutput` / :class:`RunnerOutput` pair, so finishing,
freeing and follow-ups are the normal code paths. ``tests/test_sim_fastforward.py`` checks that results
(summaries, every token time) are identical to ``SimConfig(fast_forward=False)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvretain.engine.sim.request import SimRequest
from kvretain.sched.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kvretain.sched.request import Request

if TYPE_CHECKING:
    from kvretain.engine.sim.replica import Replica

MIN_RUN_STEPS = 2
"""Shorter runs are left to the ordinary scheduler (nothing to gain)."""


class DecodeRun:
    """``k`` decode-only steps of one replica starting at ``T[0]``; step ``s`` ends at ``T[s]``."""

    __slots__ = ("T", "applied", "events", "k", "kv", "rep", "reqs", "scheduled", "ts")

    def __init__(
        self,
        rep: Replica,
        reqs: list[SimRequest],
        events: list[list[int]],
        times: list[float],
        durations: list[float],
    ) -> None:
        self.rep = rep
        self.kv = rep.kv
        self.reqs = reqs
        self.events = events  # step s touches reqs[i] for i in events[s % block_size], in running order
        self.T = times  # T[0] = start, T[s] = end of step s
        self.ts = durations  # ts[s-1] = duration of step s
        self.k = len(durations)
        self.applied = [0] * len(reqs)  # steps whose token has been written into reqs[i]
        self.scheduled = 0  # steps whose cache events have been performed

    @property
    def end_time(self) -> float:
        return self.T[self.k]

    def _materialize(self, i: int, upto: int) -> None:
        """Write the tokens of steps ``applied[i]+1 .. upto`` into ``reqs[i]``."""
        a = self.applied[i]
        if upto > a:
            r = self.reqs[i]
            r.extend_planned_output(upto - a, self.T[a + 1 : upto + 1])
            self.applied[i] = upto

    def advance(self, t: float, set_now: Callable[[float], None], before: bool = False) -> None:
        """Perform the cache events of every step that starts at or before ``t`` (``before``: strictly before,
        for an arrival at ``t``, which the step-by-step loop takes in ahead of the steps that start at its
        instant); ``set_now`` sets the simulation clock the cache reads; the caller restores it."""
        T, k, events, kv = self.T, self.k, self.events, self.kv
        bs = len(events)
        s = self.scheduled
        while s < k and (T[s] < t if before else T[s] <= t):
            s += 1
            idx = events[s % bs]
            if idx:
                set_now(T[s - 1])
                for i in idx:
                    self._materialize(i, s - 1)
                    r = self.reqs[i]
                    if kv.allocate_slots(r, 1, r.num_computed_tokens) is None:  # pragma: no cover
                        raise RuntimeError("fast-forward: an allocation failed inside a planned run")
            self.scheduled = s

    def cut(self) -> bool:
        """End the run after the step in flight (an arrival joined this replica); True when it got shorter."""
        if self.scheduled < self.k:
            self.k = self.scheduled
            return True
        return False

    def finish(self, set_now: Callable[[float], None], now: float) -> list[Request]:
        """At ``T[k]``: write every token, run the last step through ``update_from_output``; the finished."""
        self.advance(now, set_now)
        set_now(now)
        k = self.k
        for i in range(len(self.reqs)):
            self._materialize(i, k - 1)
        rep = self.rep
        sched = rep.scheduler
        chunks = tuple(ScheduledChunk(r.request_id, 1, r.num_computed_tokens, True) for r in self.reqs)
        ids = tuple(r.request_id for r in self.reqs)
        toks = tuple(r.output_token(len(r.output_token_ids)) for r in self.reqs)
        sched.num_steps += k
        rep.num_steps += k
        ex = rep.executor
        for t in self.ts[:k]:
            ex.busy_s += t  # one addition per step, in order: the same float as step by step
        out = SchedulerOutput(sched.num_steps, chunks, (), len(chunks))
        return sched.update_from_output(out, RunnerOutput(ids, toks))


def plan_decode_run(rep: Replica, now: float) -> DecodeRun | None:
    """A run of at least :data:`MIN_RUN_STEPS` decode-only steps starting now, or None (schedule normally).

    Its first step's cache events are not performed yet (call :meth:`DecodeRun.advance` with ``now``).
    """
    sched = rep.scheduler
    running = sched.running
    batch = len(running)
    if not batch:
        return None
    cfg = sched.config
    if (len(sched.waiting) and batch < cfg.max_num_seqs) or batch > cfg.max_num_batched_tokens:
        return None
    ctx = 0
    k = 1 << 62
    limit = cfg.max_model_len
    for r in running:
        n = r.num_tokens
        if n - r.num_computed_tokens != 1:
            return None
        ctx += n  # decode context of step 1 = computed + 1
        rem = r.max_tokens - len(r.output_token_ids)
        if limit is not None and limit - n < rem:  # (it finishes holding max_model_len tokens)
            rem = limit - n
        if rem < k:
            k = rem
    if k < MIN_RUN_STEPS:
        return None
    bs = rep.kv.block_size
    events: list[list[int]] = [[] for _ in range(bs)]
    allocs = [0] * bs
    for i, r in enumerate(running):
        n = r.num_tokens  # at step s the request's total is n + s - 1
        a = (2 - n) % bs  # (total - 1) % bs == 0: a new block
        g = (1 - n) % bs  # total % bs == 0: a block becomes full
        events[a].append(i)
        allocs[a] += 1
        if g != a:
            events[g].append(i)
    free = rep.kv.pool.get_num_free_blocks()
    if sum(allocs) * (k // bs + 1) > free:
        used = 0
        for s in range(1, k + 1):
            used += allocs[s % bs]
            if used > free:
                k = s - 1
                break
        if k < MIN_RUN_STEPS:
            return None
    step_time = rep.executor.cost.decode_step_time
    times = [now]
    durations: list[float] = []
    t = now
    for _ in range(k):
        d = step_time(batch, ctx)
        durations.append(d)
        t = t + d
        times.append(t)
        ctx += batch
    reqs: list[SimRequest] = list(running)  # type: ignore[arg-type]
    return DecodeRun(rep, reqs, events, times, durations)
