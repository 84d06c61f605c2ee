"""Discrete-event simulation of a cluster serving a workload, in virtual time.

Events on one heap: at one instant, arrivals first (ties in push order), then steps that complete (ties by
replica index), then an idle replica's first schedule (``_ARRIVAL``, ``_STEP``, ``_START`` below): a request
that arrives at an instant joins the schedule made at that instant. A step starts as soon as its replica is
idle and has work; it is priced by the cost model, and its sampled tokens and finished requests land when it
completes.

Fast-forward (``SimConfig.fast_forward``, on by default): runs of decode-only steps are planned at once
and advanced lazily (:mod:`kvretain.engine.sim.fastforward`); the results are identical to step-by-step
simulation, which ``fast_forward=False`` keeps for checking.

Closed loop: a workload request with ``after`` (a follow-up turn or agent step) is sent ``think_s`` after
the client received the last token of the request it follows (or its rejection), not at its open-loop
``arrival_s``; with ``closed_loop=False`` (or when the predecessor is not part of the run) the open-loop arrival
is used. A request reaches the engine ``SimConfig.frontend_in_s`` after it is sent, and its tokens reach the
client ``frontend_out_s`` after their step (both 0 by default: the engine driven directly).

Admission: a request that no replica could ever schedule (``Scheduler.admission_error``: its prompt and
output need more KV blocks than a replica has, or its prompt reaches ``SchedulerConfig.max_model_len``) is
rejected on arrival, with a reason, and counted in the summary (``rejected``, ``rejections``, per class); the
router only sees the replicas that can hold it.

Deterministic: no wall clock, no global random state, ties broken by sequence numbers.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from kvretain.core.policy import PolicyConfig
from kvretain.core.retention import PriorityMapping
from kvretain.core.stats import ClassStats, merge_class_stats
from kvretain.engine.sim.catalog import Catalog, builtin_catalog
from kvretain.engine.sim.costmodel import CostModel, make_cost_model
from kvretain.engine.sim.fastforward import DecodeRun, plan_decode_run
from kvretain.engine.sim.metrics import DEFAULT_SLOS, SLO, check_slos, itl_gaps, latency_summary
from kvretain.engine.sim.replica import Replica
from kvretain.engine.sim.request import SimRequest
from kvretain.engine.sim.router import ROUTERS
from kvretain.sched.config import SchedulerConfig
from kvretain.workloads.request import WorkloadRequest

_ARRIVAL, _STEP, _START = 0, 1, 2
"""Event kinds, in the order events of one instant are processed: arrivals, then steps that end, then an idle
replica's first schedule.

NOTE: as vLLM's engine core drains its input queue before each schedule, every request that reaches a replica at
an instant joins the schedule made at that instant: an idle replica started at the first arrival scheduled it
alone (four 2,000-token requests sent together ran as one, then three), and a step ending at an arrival's
instant scheduled before that arrival."""

MAX_FRONTEND_S = 3600.0
"""Largest ``frontend_in_s`` / ``frontend_out_s``: an hour. A serving front end takes milliseconds (a slow one
seconds); an hour per request is a mistake (milliseconds passed as seconds at most gives 1,000 s), and the
bound keeps every virtual time, and the sums and means of the summary, finite (``1e308`` seconds overflowed
them to ``inf``)."""


DEFAULT_GPU_MEM_UTIL = 0.9
"""The share of GPU memory for weights and KV cache (vLLM's ``gpu_memory_utilization`` default)."""


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulation needs besides the workload.

    ``kv_blocks`` (per replica) defaults to what the cost model leaves after weights at
    ``gpu_mem_utilization``. ``cost_model`` is a registered name or the path of a profile file
    (``kvretain profile``). ``policy`` is the eviction policy, ``sched`` holds the queue policy and
    batching limits. ``fast_forward=False`` simulates every decode step one by one (same results, slower).

    ``frontend_in_s`` / ``frontend_out_s``: the serving front end's own time, outside the engine's steps (0: an
    engine driven directly). A request reaches the engine ``frontend_in_s`` after the client sent it (HTTP, the
    API server's tokenization, the hop to the engine process) and each token reaches the client
    ``frontend_out_s`` after the step that sampled it ends; the client's clock is what TTFT and e2e measure
    (arrival = the send), and a follow-up turn is sent ``think_s`` after the client received the last token.
    """

    model: str = "llama-3-8b"
    gpu: str = "h100-sxm"
    tp: int | None = None
    cost_model: str = "roofline"
    replicas: int = 1
    router: str = "least-loaded"
    kv_blocks: int | None = None
    gpu_mem_utilization: float = DEFAULT_GPU_MEM_UTIL
    block_size: int = 16
    policy: str = "lru"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    mapping: PriorityMapping = field(default_factory=PriorityMapping)
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    closed_loop: bool = True
    fast_forward: bool = True
    slos: Mapping[int, SLO] = field(default_factory=lambda: dict(DEFAULT_SLOS))
    catalog: Catalog | None = None
    frontend_in_s: float = 0.0
    frontend_out_s: float = 0.0

    def __post_init__(self) -> None:
        for name, kinds in (
            ("replicas", int),
            ("block_size", int),
            ("kv_blocks", int | None),
            ("tp", int | None),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):  # (a float reached range() mid-run)
                raise ValueError(f"{name} must be an integer, got {v!r}")
        for name in ("closed_loop", "fast_forward"):
            if not isinstance(getattr(self, name), bool):  # ("no" is true)
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, kind in (
            ("sched", SchedulerConfig),
            ("policy_config", PolicyConfig),
            ("mapping", PriorityMapping),
        ):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        check_slos(self.slos)
        for name in ("frontend_in_s", "frontend_out_s"):
            v = getattr(self, name)
            if (
                isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= v <= MAX_FRONTEND_S
            ):  # also NaN
                raise ValueError(
                    f"{name} must be a finite number of seconds in [0, {MAX_FRONTEND_S:g}] (MAX_FRONTEND_S), got {v}"
                )
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"kv_blocks must be >= 1, got {self.kv_blocks}")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of: {', '.join(ROUTERS.names())}")

    def cost(self) -> CostModel:
        cat = self.catalog or builtin_catalog()
        try:
            model, gpu = cat.model(self.model), cat.gpu(self.gpu)
        except KeyError as e:
            raise ValueError(str(e.args[0])) from None
        return make_cost_model(self.cost_model, model, gpu, self.tp)

    def blocks_per_replica(self, cost: CostModel) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        try:
            return cost.kv_capacity_blocks(self.block_size, self.gpu_mem_utilization)
        except (
            OverflowError
        ):  # (a catalog's sizes each finite, their products beyond a float: 10**300 layers)
            raise ValueError(
                f"model {self.model!r} on GPU {self.gpu!r}: the catalog's sizes are too large to compute a KV "
                "capacity (their products overflow); check the --catalog file's numbers"
            ) from None


def follow_up_cycle(workload: Sequence[WorkloadRequest]) -> list[str] | None:
    """A cycle of ``after`` links among ``workload``'s requests (``[a, b, a]``: ``a`` after ``b``, ``b`` after
    ``a``), or ``None``. In a closed loop a request of a cycle waits for itself: it is never sent (and the run
    would end with it neither finished nor rejected). A link to a request outside the workload ends a chain."""
    after = {w.request_id: w.after for w in workload if w.after is not None}
    done: set[str] = set()
    for start in after:
        path: list[str] = []
        at: dict[str, int] = {}
        node: str | None = start
        while node is not None and node in after and node not in done:
            if node in at:
                return [*path[at[node] :], node]
            at[node] = len(path)
            path.append(node)
            node = after[node]
        done.update(path)
    return None


class Simulation:
    """One run: build with a config and a workload, call :meth:`run`, read :meth:`summary`.

    Raises ``ValueError`` for duplicate request ids and, in a closed loop, for follow-ups that form a cycle
    (:func:`follow_up_cycle`)."""

    def __init__(self, config: SimConfig, workload: Sequence[WorkloadRequest]) -> None:
        self.config = config
        self.now = 0.0
        self.cost = config.cost()
        self.num_blocks = config.blocks_per_replica(self.cost)
        if self.num_blocks < 1:  # (only from the cost model: kv_blocks is >= 1)
            raise ValueError(
                f"block_size {config.block_size:,}: larger than the KV room {config.model} leaves on {config.gpu} at "
                f"gpu_mem_utilization {config.gpu_mem_utilization:g}; use a smaller block_size (or set kv_blocks)"
            )
        self.requests: dict[str, SimRequest] = {}
        clock: Callable[[], float] = lambda: self.now  # noqa: E731
        self.replicas = [
            Replica(
                i,
                self.cost,
                self.num_blocks,
                config.block_size,
                config.policy,
                config.policy_config,
                config.mapping,
                config.sched,
                clock,
                self.requests,
            )
            for i in range(config.replicas)
        ]
        self.router = ROUTERS.create(config.router)
        self._events: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._runs: dict[int, DecodeRun] = {}  # replica index -> its fast-forward run in flight
        self.fast_forwarded_steps = 0  # steps simulated inside decode runs (not part of the summary)
        self._followers: dict[str, list[WorkloadRequest]] = {}
        self.finished: list[SimRequest] = []
        self.rejected: list[SimRequest] = []
        self.wall_s = 0.0
        ids = {w.request_id for w in workload}
        if len(ids) != len(workload):
            raise ValueError("workload request ids must be unique")
        self.num_requests = len(workload)
        if config.closed_loop:
            cycle = follow_up_cycle(workload)
            if cycle is not None:
                shown = cycle if len(cycle) <= 9 else [*cycle[:8], "...", cycle[-1]]
                raise ValueError(
                    f"workload follow-ups form a cycle of {len(cycle) - 1} request(s): {' -> '.join(shown)} "
                    "(each sent after the next finishes): none of them could ever be sent"
                )
        for w in workload:
            if config.closed_loop and w.after is not None and w.after in ids:
                self._followers.setdefault(w.after, []).append(w)
            else:
                self._push_arrival(w, w.arrival_s)

    def _push_arrival(self, w: WorkloadRequest, sent: float) -> None:
        """``w``, sent by its client at ``sent``: it reaches the engine ``frontend_in_s`` later."""
        self._push(sent + self.config.frontend_in_s, _ARRIVAL, (w, sent))

    def _push(self, t: float, kind: int, obj: Any) -> None:
        """An arrival (ties: push order)."""
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, 0, obj))

    def _push_step(self, t: float, rep: Replica, payload: Any) -> None:
        """A step (or run) of ``rep`` completing at ``t`` (ties: replica index, so the order does not
        depend on how many steps were pushed before)."""
        if t - t != 0.0:  # (inf or NaN: x - x is NaN for both) a cost model that prices a step out of range
            raise ValueError(
                f"the simulated clock left the finite numbers at {self.now:.6g} s (a step ends at {t}): the cost "
                f"model prices steps out of range; check the GPU entry {self.config.gpu!r} (peak_flops, "
                "mem_bandwidth) and the model's sizes"
            )
        self._seq += 1
        heapq.heappush(self._events, (t, _STEP, rep.index, self._seq, (rep, payload)))

    def _start_soon(self, rep: Replica) -> None:
        """Start idle ``rep`` once every event of this instant before a start is processed (``_START``)."""
        rep.busy = True  # (a start is pending: later arrivals of this instant only queue)
        self._seq += 1
        heapq.heappush(self._events, (self.now, _START, rep.index, self._seq, rep))

    def _set_now(self, t: float) -> None:
        self.now = t

    # ------------------------------------------------------------------ loop
    def run(self, progress: Callable[[int], None] | None = None) -> Simulation:
        """Process every event; ``progress(n)`` is called with the number of newly finished requests."""
        t0 = time.perf_counter()
        events = self._events
        pop = heapq.heappop
        while events:
            t, kind, _, _, obj = pop(events)
            self.now = t
            if kind == _ARRIVAL:
                self._arrive(obj)
            elif kind == _START:
                self._start(obj)
            else:
                n = self._complete(obj)
                if progress is not None and n:
                    progress(n)
        self.wall_s = time.perf_counter() - t0
        self._check_done()
        return self

    def _arrive(self, event: tuple[WorkloadRequest, float]) -> None:
        now = self.now
        w, sent = event
        cfg = self.config
        # (arrival: the client's send; the engine sees it now; its tokens reach the client frontend_out_s after
        # their step)
        req = SimRequest(
            w, arrival_time=sent, client_delay_s=cfg.frontend_out_s, engine_delay_s=cfg.frontend_in_s
        )
        replicas = self.replicas
        fit = [rep for rep in replicas if rep.scheduler.admission_error(req) is None]
        if not fit:
            replicas[0].scheduler.add_request(req)  # rejects it, with the reason
            self.rejected.append(req)
            self._release_followers(req)
            return
        self.requests[req.request_id] = req
        runs = self._runs
        if runs:  # routers read every replica's cache and load: bring runs in flight up to now
            for r in runs.values():  # (a step starting at this instant starts after the arrival: its schedule
                r.advance(now, self._set_now, before=True)  # takes the request in, as step by step)
            self.now = now
        rep = fit[self.router.route(req, fit)]
        rep.scheduler.add_request(req)
        run = runs.get(rep.index)
        if run is not None:
            if run.cut():  # the next schedule must see the new request: end after the step in flight
                self._push_step(run.end_time, rep, (run, run.k))
        elif not rep.busy:
            self._start_soon(rep)

    def _start(self, rep: Replica) -> None:
        if self.config.fast_forward:
            planned = plan_decode_run(rep, self.now)
            if planned is not None:
                rep.busy = True
                self._runs[rep.index] = planned
                planned.advance(self.now, self._set_now)
                self._push_step(planned.end_time, rep, (planned, planned.k))
                return
        out = rep.scheduler.schedule()
        if out.is_empty:
            rep.busy = False
            return
        rep.busy = True
        rep.num_steps += 1
        self._push_step(self.now + rep.executor.step_time(out), rep, out)

    def _complete(self, payload: tuple[Replica, Any]) -> int:
        rep, out = payload
        if isinstance(out, tuple):
            run: DecodeRun = out[0]
            if run.k != out[1] or self._runs.get(rep.index) is not run:
                return 0  # a run that was cut short: its new end event is elsewhere in the heap
            del self._runs[rep.index]
            self.fast_forwarded_steps += run.k
            done = run.finish(self._set_now, self.now)
        else:
            done = rep.scheduler.update_from_output(out, rep.executor.execute(out))
        for r in done:
            assert isinstance(r, SimRequest)
            self.finished.append(r)
            del self.requests[r.request_id]
            self._release_followers(r)
        self._start(rep)
        return len(done)

    def _release_followers(self, r: SimRequest) -> None:
        for w in self._followers.pop(r.request_id, ()):
            # (the client got the last token frontend_out_s after the step, thinks, sends)
            self._push_arrival(w, self.now + self.config.frontend_out_s + w.think_s)

    def _check_done(self) -> None:
        """End-of-run invariants: every request finished or rejected, every block free, pools consistent."""
        if self.requests or len(self.finished) + len(self.rejected) != self.num_requests:
            stuck = sorted(self.requests)[:5]
            raise RuntimeError(  # a scheduler bug: admission rejects every request that cannot run
                f"simulation ended with {len(self.finished)}/{self.num_requests} requests finished and "
                f"{len(self.rejected)} rejected (stuck: {stuck})"
            )
        for rep in self.replicas:
            rep.kv.check_integrity()
            if rep.kv.get_num_free_blocks() != rep.kv.num_blocks:
                raise RuntimeError(f"replica {rep.index}: blocks still in use after the run")

    # ------------------------------------------------------------------ results
    def _step_times_of(self) -> str:
        """What the step times were measured on: the catalog's model and GPU (a roofline), or a profile's own
        model and device (``--model`` / ``--gpu`` then size the KV cache only: ``ProfiledCostModel``)."""
        from kvretain.engine.sim.profiled import ProfiledCostModel

        if isinstance(self.cost, ProfiledCostModel):
            info = self.cost.profile.info
            return f"profile: {info.get('model', '?')} on {info.get('device', '?')}"
        return f"{self.config.model} on {self.config.gpu}"

    def summary(self) -> dict[str, Any]:
        """One JSON-ready object (see ``kvretain simulate --json``)."""
        cfg = self.config
        reqs = sorted(self.finished, key=lambda r: r.request_id)
        # the client's clock, as the latencies: from the first send to the last token's arrival at its client
        end = max((r.finish_time or 0.0) for r in reqs) + cfg.frontend_out_s if reqs else 0.0
        start = min((r.arrival_time for r in reqs), default=0.0)
        span = end - start
        rejected = sorted(self.rejected, key=lambda r: r.request_id)
        classes = sorted({r.priority for r in reqs} | {r.priority for r in rejected})
        stats = merge_class_stats(rep.kv.stats for rep in self.replicas)
        recomputed: dict[int, int] = {}
        for rep in self.replicas:
            for c, n in rep.kv.recomputed_tokens.items():
                recomputed[c] = recomputed.get(c, 0) + n
        q = sum(s.query_tokens for s in stats.values())
        h = sum(s.hit_tokens for s in stats.values())
        by_class = {c: [r for r in reqs if r.priority == c] for c in classes}
        itls = {c: itl_gaps(creqs) for c, creqs in by_class.items()}
        # (sorted runs, one a class: Timsort merges them in linear time)
        overall = latency_summary(reqs, cfg.slos, span, len(rejected), sorted(chain(*itls.values())))
        obj: dict[str, Any] = {
            "policy": cfg.policy,
            "scheduling": cfg.sched.policy,
            "requests": len(reqs),
            "simulated_s": round(span, 6),
            "wall_s": round(self.wall_s, 3),
            "output_tokens_per_s": overall["output_tokens_per_s"],
            "request_throughput_rps": overall["request_throughput_rps"],
            "rejected": len(rejected),
            "hit_rate": round(h / q, 6) if q else None,  # (no lookup: no ratio)
            "resumes": sum(s.resumes for s in stats.values()),
            "resume_hit_tokens": sum(s.resume_hit_tokens for s in stats.values()),
            "recomputed_tokens": sum(recomputed.values()),
            "preemptions": sum(rep.scheduler.num_preemptions for rep in self.replicas),
            "evictions": sum(rep.kv.pool.num_evictions for rep in self.replicas),
            "model": cfg.model,
            "gpu": cfg.gpu,
            "cost_model": cfg.cost_model,
            "step_times_of": self._step_times_of(),
            "replicas": cfg.replicas,
            "router": cfg.router,
            "kv_blocks_per_replica": self.num_blocks,
            "block_size": cfg.block_size,
            # (steps and busy time summed over the replicas: busy_s is up to replicas x simulated_s)
            "steps": sum(rep.num_steps for rep in self.replicas),
            "busy_s": round(sum(rep.executor.busy_s for rep in self.replicas), 6),
            "frontend_in_s": cfg.frontend_in_s,
            "frontend_out_s": cfg.frontend_out_s,
            **{
                k: v
                for k, v in overall.items()
                if k not in ("requests", "output_tokens_per_s", "request_throughput_rps", "preemptions")
            },
            # each replica's policy state at the end (``unified``: its protection controller's level, target and
            # estimates; one controller a replica)
            "policy_stats": [
                {k: round(v, 6) for k, v in rep.kv.pool.policy.stats().items()} for rep in self.replicas
            ],
            "classes": {},
            "rejections": [
                {"request_id": r.request_id, "priority": r.priority, "reason": r.rejection} for r in rejected
            ],
        }
        for c in classes:
            crejected = sum(1 for r in rejected if r.priority == c)
            lat = latency_summary(by_class[c], cfg.slos, span, crejected, itls[c])
            s = stats.get(c) or ClassStats()
            obj["classes"][str(c)] = {
                **lat,
                "rejected": crejected,
                "hit_rate": round(s.hit_rate, 6) if s.query_tokens else None,
                "query_tokens": s.query_tokens,
                "hit_tokens": s.hit_tokens,
                "resumes": s.resumes,
                "resume_query_tokens": s.resume_query_tokens,
                "resume_hit_tokens": s.resume_hit_tokens,
                "recomputed_tokens": recomputed.get(c, 0),
                "evicted_blocks": s.evicted_blocks,
            }
        return obj


def simulate(
    config: SimConfig,
    workload: Sequence[WorkloadRequest],
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run ``workload`` under ``config``; the summary object."""
    return Simulation(config, workload).run(progress).summary()
