"""The ``agent-pauses`` workload: tool-using agent sessions with long tool-call pauses between steps.

Shape (the defaults; one hour, seed 0: 7,597 steps of ~900 agents, 226k block lookups, 33k distinct
512-token blocks):

* Agents start as a Poisson process (``agent_rate`` per second). Every agent shares one tool-description
  prompt (``system_tokens``, 8 blocks of 512 tokens) and adds its own task.
* Each step's prompt is the whole context so far; the model's output is a tool call, and the next step's
  prompt appends that call and the tool's result. The context grows every step (to ~10-50k tokens by the
  last one), so a step that finds its context evicted recomputes all of it.
* Between steps the agent waits for its tool: with probability ``long_pause_prob`` (0.4) a long call
  (``long_pause_s``, 1-15 minutes uniform: code execution, a web search, a human approval), else a short one
  (``short_pause_s``, 1-10 s). The long pauses are long against the cache's turnover: the workload writes
  ~9 new 512-token blocks a second, so a recency-ordered pool of 1,000-4,000 blocks replaces its content
  within 2-7 minutes (sooner when misses re-insert evicted blocks), and a context left alone for a long
  call is evicted at the small and middle capacities unless the policy keeps sessions that will come back
  (TTL pinning, Continuum).
* A share ``important_share`` of agents (drawn per agent) is priority 0, the rest priority 1. No request
  carries a retention directive: the policy must keep the paused contexts without being told.

Steps that would start after ``duration_s`` are dropped, so near the end of the window a long pause ends a
session early (in the default hour, seed 0, 34% of the realized pauses are long, not 40%). Session ids are
``agent-<k>``. Deterministic given the caller's seeded ``random.Random``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvretain.workloads.multi_tenant import poisson_times, seeded_span
from kvretain.workloads.request import (
    Range,
    WorkloadError,
    WorkloadRequest,
    WorkloadSize,
    check_config,
    mean,
    scale_and_limit,
    sessions_size,
)
from kvretain.workloads.tokens import TokenSeq


@dataclass(frozen=True, slots=True)
class AgentPausesConfig:
    """Settings of the ``agent-pauses`` workload (see the module docstring); ranges are inclusive uniform."""

    duration_s: float = 3600.0
    agent_rate: float = 0.25  # agents per second
    system_tokens: int = 4_096
    task_tokens: Range = (500, 3_000)
    steps: Range = (4, 24)
    call_tokens: Range = (30, 300)  # the model's output: a tool call
    result_tokens: Range = (200, 3_000)  # the tool's result, appended to the context
    short_pause_s: tuple[float, float] = (1.0, 10.0)
    long_pause_prob: float = 0.4
    long_pause_s: tuple[float, float] = (60.0, 900.0)
    important_share: float = 0.25
    important_priority: int = 0
    other_priority: int = 1
    # Open-loop timing: a step arrives after its predecessor's estimated service time plus the pause.
    est_s_per_output_token: float = 0.02

    def __post_init__(self) -> None:
        check_config(
            self,
            "agent-pauses",
            non_negative=("duration_s", "agent_rate", "est_s_per_output_token"),
            probabilities=("long_pause_prob", "important_share"),
        )
        if self.system_tokens + self.task_tokens[0] < 1:
            raise WorkloadError("agent-pauses config: a first prompt needs at least one token")

    def expected_size(self) -> WorkloadSize:
        """The workload's expected size (:class:`~kvretain.workloads.request.WorkloadSize`), before generating."""
        p = self.long_pause_prob
        pause = p * mean(self.long_pause_s) + (1 - p) * mean(self.short_pause_s)
        gap = mean(self.call_tokens) * self.est_s_per_output_token + pause
        # a first prompt: system + task; each step adds its call and the tool's result
        return sessions_size(self.agent_rate, self.duration_s, self.steps, gap, 2, 2)


def generate_agent_pauses(
    config: AgentPausesConfig | None = None,
    rng: random.Random | None = None,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[WorkloadRequest]:
    """The ``agent-pauses`` workload sorted by arrival; deterministic given ``rng`` (default seed 0)."""
    cfg = config or AgentPausesConfig()
    rng = rng or random.Random(0)
    arrivals_rng, agents_rng = (random.Random(rng.getrandbits(64)) for _ in range(2))
    system = seeded_span(agents_rng, (cfg.system_tokens, cfg.system_tokens))
    out: list[WorkloadRequest] = []
    for a, start in enumerate(poisson_times(arrivals_rng, cfg.agent_rate, cfg.duration_s)):
        out += _agent(cfg, agents_rng, system, f"agent-{a}", start)
    return scale_and_limit(out, time_scale, limit)


def _agent(
    cfg: AgentPausesConfig, rng: random.Random, system: TokenSeq, sid: str, start: float
) -> list[WorkloadRequest]:
    important = rng.random() < cfg.important_share
    priority = cfg.important_priority if important else cfg.other_priority
    prompt = system + seeded_span(rng, cfg.task_tokens)
    out: list[WorkloadRequest] = []
    t, pause, prev = start, 0.0, None
    for k in range(rng.randint(*cfg.steps)):
        call = seeded_span(rng, cfg.call_tokens)
        rid = f"{sid}-step-{k}"
        out.append(
            WorkloadRequest(
                request_id=rid,
                arrival_s=t,
                prompt=prompt,
                output_len=len(call),
                priority=priority,
                session_id=sid,
                output=call,
                after=prev,
                think_s=pause,
            )
        )
        prompt, prev = prompt + call + seeded_span(rng, cfg.result_tokens), rid
        long = rng.random() < cfg.long_pause_prob
        pause = rng.uniform(*(cfg.long_pause_s if long else cfg.short_pause_s))
        t += len(call) * cfg.est_s_per_output_token + pause
        if t >= cfg.duration_s:
            break
    return out
