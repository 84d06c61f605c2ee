"""Continuous batching with chunked prefill, priority queues and preemption by recompute.

One step (``schedule``), in vLLM v1's order but split by concern:

1. Running requests, in their running order, each get ``min(remaining tokens, budget)`` tokens. When the
   cache has no blocks for one, the least important running request (largest ``(priority, arrival)``
   under ``priority``, the first in running order on ties; the latest started under ``fcfs``) is preempted
   by recompute and the allocation is retried; the request may preempt itself. NOTE: as in vLLM, the victim
   may be one already given a chunk in this step, whose allocation registered the blocks that chunk completes
   before any step computed them (vLLM's ``allocate_slots`` caches up to ``num_computed + num_new`` tokens);
   they stay cached after the preemption, so a later lookup may hit blocks whose KV was never computed. Kept
   here to match vLLM 0.33 step for step (``bench/sched_equivalence.py``); step 2 below never does it.
2. Waiting requests, in queue order, while budget and ``max_num_seqs`` allow and no request was preempted
   this step: prefix hits from ``get_computed_blocks``, then ``allocate_slots`` (which, with
   ``reserve_full_prompt``, also asks that the free blocks could hold the whole request). When blocks run out the
   queue stops, unless ``waiting_preempts_running`` lets the request preempt strictly less important
   running requests: least important first, up to the first with which it fits, less any of them it fits
   without, and none when all of them would not make room (``_room_for``, ``KVCacheManager.fits_after_freeing``);
   never one admitted in this step or whose chunk of this step completes a block (``_waiting_victims``); the
   request is then the last one admitted this step (as in 1., a step that preempts admits no one else, so a
   victim never runs again in the step that preempted it).

Admission (``add_request``) rejects a request that could never be scheduled: with ``max_model_len`` set, a
prompt of ``max_model_len`` tokens or more (vLLM 0.33's input processor refuses it: no room for one output
token); one whose prompt and output need more KV blocks than the replica has, or, without chunked prefill, more
tokens than one step's budget. Such a request would otherwise preempt itself forever at the head of the queue.

``max_model_len`` (``SchedulerConfig``; None by default: no context length, a request runs to its
``max_tokens``): when set, as in vLLM 0.33, a request ends when it holds ``max_model_len`` tokens, prompt and
output (``check_stop``'s ``FINISHED_LENGTH_CAPPED``, the same finish as at ``max_tokens``; vLLM's API server
clamps ``max_tokens`` to ``max_model_len - prompt``, to the same effect), so the block and budget checks above
count at most ``max_model_len - 1`` tokens of KV. As vLLM's engine refuses to start when its KV cache cannot
hold one request of ``max_model_len`` tokens, a ``Scheduler`` is refused (``ValueError``,
``SchedulerConfig.check_pool``) on a pool of fewer than ``cdiv(max_model_len, block_size)`` blocks, so that with
the limit set no request is ever refused for blocks; and ``SchedulerConfig`` refuses what vLLM's
``verify_max_model_len`` refuses at start-up (a budget below ``max_model_len`` without chunked prefill, a budget
below ``max_num_seqs``), so none is refused for the budget either. Without ``max_model_len`` the refusal differs
from vLLM on purpose: a request whose ``max_tokens`` the pool cannot hold is refused whole, where vLLM would run
it cut short at its ``max_model_len``.

What is modelled is vLLM 0.33's scheduler at its defaults, matched step for step by ``bench/sched_equivalence.py``
and ``tests/test_sched_equivalence.py`` (``max_num_batched_tokens``, ``max_num_seqs``, chunked prefill on or off,
``scheduler_reserve_full_isl`` as ``reserve_full_prompt``, prefix caching on or off, ``fcfs`` / ``priority``,
``max_model_len`` when set (the long prompt refused, the request cut at it), arrivals between a step's
``schedule()`` and ``update_from_output``, aborts). Not modelled, each at vLLM's
default there: ``long_prefill_token_threshold`` (0: no cap on a chunk; vLLM 0.33 has no
``max_num_partial_prefills``), ``watermark`` (0), ``max_num_scheduled_tokens`` and ``max_num_active_seqs``
(``max_num_batched_tokens`` and ``max_num_seqs``), ``prefill_schedule_interval`` (1), speculative decoding and
its ``num_lookahead_tokens`` (0), encoder inputs and their compute budget and cache (text-only requests), LoRA's
``max_loras``, requests waiting for a grammar or for remote KV (KV connectors), async scheduling and pipeline
parallelism.

Preemption frees the request's blocks through ``KVCacheManager.free`` (they stay cached with its retention,
so a resume can hit them), resets its computed tokens and puts it back in the waiting queue.
The scheduler reaches the cache only through the manager's contract and the executor only through
:class:`~kvretain.sched.output.SchedulerOutput` / :class:`~kvretain.sched.output.RunnerOutput`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.sched.config import SchedulerConfig
from kvretain.sched.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kvretain.sched.queue import make_queue
from kvretain.sched.request import Request, RequestStatus


class Scheduler:
    """Schedules the requests of one model replica over one :class:`KVCacheManager`."""

    def __init__(
        self,
        kv: KVCacheManager,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.kv = kv
        self.config = config or SchedulerConfig()
        self.config.check_pool(
            kv.num_blocks, kv.block_size
        )  # (vLLM's start-up refusal; none without a limit)
        self.clock: Callable[[], float] = clock or kv.pool.clock
        """The times stamped on requests (first scheduled, tokens, finish): the cache's clock unless given."""
        self.waiting = make_queue(self.config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_rejected = 0
        self._by_priority = self.config.policy == "priority"

    # ------------------------------------------------------------------ requests
    def admission_error(self, req: Request) -> str | None:
        """Why ``req`` can never be scheduled here (see the module docstring), or None when it can."""
        cfg = self.config
        limit = cfg.max_model_len
        kv_tokens = req.max_kv_tokens
        if limit is not None:
            if req.num_prompt_tokens >= limit:  # (vLLM's input processor: no room for one output token)
                return (
                    f"request {req.request_id!r}: its {req.num_prompt_tokens:,} prompt tokens reach "
                    f"max_model_len ({limit:,}), leaving no room for an output token"
                )
            kv_tokens = min(kv_tokens, limit - 1)  # (it ends holding max_model_len tokens)
        outputs = kv_tokens + 1 - req.num_prompt_tokens  # (max_tokens, or fewer when cut at max_model_len)
        bs = self.kv.block_size
        need = -(-kv_tokens // bs)
        if need > self.kv.num_blocks:
            return (
                f"request {req.request_id!r} needs {need:,} KV blocks of {bs} tokens for its "
                f"{req.num_prompt_tokens:,} prompt and {outputs:,} output tokens, but the replica has "
                f"only {self.kv.num_blocks:,}"
            )
        if not cfg.enable_chunked_prefill and kv_tokens > cfg.max_num_batched_tokens:
            return (
                f"request {req.request_id!r}: its {req.num_prompt_tokens:,} prompt and "
                f"{outputs:,} output tokens exceed max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens:,}) without chunked prefill"
            )
        return None

    def add_request(self, req: Request) -> bool:
        """Admit ``req`` (True), or reject it (False) when it can never be scheduled here: its status is then
        ``REJECTED``, ``req.rejection`` says why and ``num_rejected`` counts it. A request id already live
        or a request that is not ``WAITING`` raises ``ValueError``."""
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already scheduled")
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"request {req.request_id!r} is {req.status.name}, expected WAITING")
        error = self.admission_error(req)
        if error is not None:
            req.status = RequestStatus.REJECTED
            req.rejection = error
            req.finish_time = self.clock()
            self.num_rejected += 1
            return False
        try:  # (before the request is queued: one the manager refuses leaves no trace to fail every step)
            self.kv.on_arrival(req)
        except (ValueError, TypeError) as e:
            self.kv.free(req)  # (whatever state the manager began for it)
            said = str(e)
            raise type(e)(
                said if repr(req.request_id) in said else f"request {req.request_id!r}: {said}"
            ) from None
        self.requests[req.request_id] = req
        self.waiting.add(req)
        return True

    def abort(self, request_id: str) -> Request | None:
        """Abort a live request (frees its blocks); returns it, or None if unknown or already done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.ABORTED
        req.finish_time = self.clock()
        return req

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Choose this step's work. Empty when nothing can run."""
        self.num_steps += 1
        st = _Step(self.config.max_num_batched_tokens)
        self._schedule_running(st)
        if not st.preempted:
            self._schedule_waiting(st)
        chunks = tuple(st.chunks[r.request_id] for r in st.order if r.request_id in st.chunks)
        return SchedulerOutput(self.num_steps, chunks, tuple(st.preempted), st.used)

    def _schedule_running(self, st: _Step) -> None:
        chunked = self.config.enable_chunked_prefill
        i = 0
        while i < len(self.running) and st.budget > 0:
            req = self.running[i]
            need = req.num_tokens - req.num_computed_tokens
            n = need if need <= st.budget else (st.budget if chunked else 0)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, n, req.num_computed_tokens) is None:
                victim = self._victim(self.running)
                before = self.running.index(victim) < i
                self._preempt(victim, st)
                if victim is req:
                    break
                if before:
                    i -= 1
            else:
                st.add(req, n, need)
                i += 1
                continue
            # req preempted itself: the list shrank, index i now holds the next request

    def _schedule_waiting(self, st: _Step) -> None:
        cfg = self.config
        waiting = self.waiting
        kv = self.kv
        while len(waiting) and st.budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = waiting.peek()
            hits, n_cached = kv.get_computed_blocks(req)
            need = req.num_tokens - n_cached
            if need > st.budget:
                if not cfg.enable_chunked_prefill:
                    break
                n = st.budget
            else:
                n = need
            reserve = req.num_tokens if cfg.reserve_full_prompt else 0
            if kv.allocate_slots(req, n, n_cached, hits, reserve) is not None:
                waiting.pop()
                self._admit(req, n, n_cached, need, st)
                continue
            if not cfg.waiting_preempts_running:
                return
            victims = self._room_for(req, n, n_cached, hits, reserve, st)
            if not victims:  # (preempting every candidate would not make room: preempt none)
                return
            # out of the queue before its victims go in (under fcfs they go to the front)
            waiting.pop()
            for victim in victims:
                self._preempt(victim, st)
            if kv.allocate_slots(req, n, n_cached, hits, reserve) is None:  # pragma: no cover - checked above
                raise RuntimeError(f"request {req.request_id!r}: no room after preempting {len(victims)}")
            self._admit(req, n, n_cached, need, st)
            return  # a step that preempted admits no one else

    def _admit(self, req: Request, n: int, n_cached: int, need: int, st: _Step) -> None:
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = n_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
            req.num_cached_tokens = n_cached
        self.running.append(req)
        st.add(req, n, need)
        st.admitted.add(req.request_id)

    # ------------------------------------------------------------------ preemption
    def _victim(self, candidates: list[Request]) -> Request:
        """vLLM's rule: the least important, latest arriving request (priority); the last started (fcfs).

        Under ``priority`` the key is ``(priority, arrival_time)`` without the request id, as vLLM 0.33's
        ``max(self.running, key=lambda r: (r.priority, r.arrival_time))``: of requests tied on both, the
        first in running order is preempted."""
        if self._by_priority:
            return max(candidates, key=_preemption_key)
        return candidates[-1]

    def _room_for(
        self, req: Request, n: int, n_cached: int, hits: list[int], reserve: int, st: _Step
    ) -> list[Request]:
        """The requests ``req`` preempts to fit (empty: none can make room): the least important candidates
        (:meth:`_waiting_victims`) up to the first with which it fits, less those of them it fits without
        (a small request taken first may not be needed once a larger one is freed)."""
        fits = self.kv.fits_after_freeing
        candidates = self._waiting_victims(req, st)
        k = fits(req, n, n_cached, hits, reserve, candidates)
        if not k:
            return []
        chosen = candidates[:k]
        i = 0
        while i < len(chosen) - 1:  # (the last one is needed: without it the prefix did not fit)
            rest = chosen[:i] + chosen[i + 1 :]
            k = fits(req, n, n_cached, hits, reserve, rest)
            if k is None:
                i += 1
            else:
                chosen = rest[:k]
        return chosen

    def _waiting_victims(self, req: Request, st: _Step) -> list[Request]:
        """The running requests strictly less important than ``req`` (by priority alone under both queue
        policies), least important first: the order ``req`` may preempt them in. Not one admitted in this step
        (under ``fcfs`` the queue admits less important requests before ``req``: it would be counted as preempted
        without having run), nor one whose chunk of this step completes a block: ``allocate_slots`` registers a
        block in the prefix cache when it is allocated, before the step computes it, so preempting the request
        would leave a cached block whose KV no step computed (a later lookup would hit it)."""
        bs = self.kv.block_size
        chunks = st.chunks
        out = []
        for r in self.running:
            if r.priority <= req.priority or r.request_id in st.admitted:
                continue
            c = chunks.get(r.request_id)
            if (
                c is not None
                and (c.num_computed_tokens + c.num_new_tokens) // bs > c.num_computed_tokens // bs
            ):
                continue
            out.append(r)
        return sorted(out, reverse=True)

    def _preempt(self, victim: Request, st: _Step) -> None:
        self.running.remove(victim)
        st.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        st.preempted.append(victim.request_id)
        self.waiting.add_preempted(victim)

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests (at ``max_tokens`` output tokens, or at
        ``max_model_len`` tokens in all when set); returns the finished ones. Each step's output is applied once,
        in order, with tokens for the chunks that sample only (the executor's contract, not checked here: a
        second application would advance the computed tokens again)."""
        now = self.clock()
        reqs = self.requests
        for c in out.chunks:
            req = reqs.get(c.request_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.num_computed_tokens += c.num_new_tokens
        finished: list[Request] = []
        limit = self.config.max_model_len
        for rid, tok in zip(result.req_ids, result.token_ids, strict=True):
            req = reqs.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            # (vLLM's check_stop: its max_tokens, or max_model_len tokens in all; both finish it by length)
            if req.append_output(tok, now) or (limit is not None and req.num_tokens >= limit):
                finished.append(req)
        for req in finished:
            self._finish(req, now)
        return finished

    def _finish(self, req: Request, now: float) -> None:
        self.running.remove(req)
        del self.requests[req.request_id]
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_time = now


def _preemption_key(r: Request) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


class _Step:
    """Book-keeping of one ``schedule()`` call."""

    __slots__ = ("admitted", "budget", "chunks", "order", "preempted", "used")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.admitted: set[str] = set()  # taken from the waiting queue in this step
        self.chunks: dict[str, ScheduledChunk] = {}
        self.order: list[Request] = []
        self.preempted: list[str] = []

    def add(self, req: Request, n: int, need: int) -> None:
        self.chunks[req.request_id] = ScheduledChunk(req.request_id, n, req.num_computed_tokens, n == need)
        self.order.append(req)
        self.budget -= n
        self.used += n

    def remove(self, req: Request) -> None:
        c = self.chunks.pop(req.request_id, None)
        if c is not None:
            self.budget += c.num_new_tokens
            self.used -= c.num_new_tokens
