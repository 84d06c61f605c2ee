"""The built-in ``multi-tenant`` workload: interactive chat, tool-using agents and batch document jobs.

Three classes share one replica, each with its own Poisson arrivals (drawn from a child of the caller's rng,
so changing one class's settings does not reshuffle the others):

* priority 0, chat: multi-turn sessions on a shared system prompt. A turn may add retrieved passages (RAG)
  to the conversation; turn k+1's prompt = turn k's prompt + turn k's output + new passages + a new user
  message, after a think time. The reusable context grows turn by turn (to ~20-50k tokens), while a first
  turn is modest (system prompt + passages + message; a pasted document only in 10% of sessions).
* priority 1, agents: a shared tool-description prompt plus a task; each step's output is a tool call, the
  next step's prompt adds that call and the tool result after a tool pause. Every agent request carries an
  RFC #37003 retention directive ``{start: 0, end: None, priority: 80, duration_s: 12}`` covering its whole
  context for just longer than the longest tool pause (10 s).
* priority 2, batch: jobs over a corpus of long documents, each job a few questions on one document,
  submitted together (within a few seconds).

All tokens (prompts and outputs) are seeded chunks drawn at generation time, so a follow-up turn contains the
exact tokens its predecessor generated (``WorkloadRequest.output``) and a simulator need not invent them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvretain.core.retention import RetentionDirective, RetentionError
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
class MultiTenantConfig:
    """Settings of the ``multi-tenant`` workload; ranges are inclusive uniform draws, means exponential.

    What the defaults are for. The acceptance question is whether letting request priority govern retention
    lowers the TTFT tail of important requests *through the cache*. That needs (1) a replica that is loaded
    but stable, so TTFT is not queueing behind an ever-growing backlog; (2) important requests whose TTFT
    tail is set by recomputing reusable context that was evicted, not by compulsory misses; (3) a working set
    well above the KV capacity, so eviction decisions matter. The defaults, for one Llama-3-8B replica on an
    H100-SXM (29,206 blocks = 467,296 tokens of KV at 0.9 memory utilization, roofline cost model):

    * Load: one hour of traffic; seed 0 gives 6,282 requests (592 chat turns, 1,267 agent steps, 4,423 batch
      questions). Under ``lru`` the replica is busy 86% of the time (a step is in flight; decode of a few
      requests keeps it stepping), finishes the last request at 3,600 s and the queueing-time p99 is 0.9 s:
      stable, no backlog (the earlier defaults needed 1,133 s to serve 600 s of arrivals).
    * Chat (0): 0.02 sessions/s of 4-12 turns with a 60 s mean think time (~10 live sessions: 10.6 on average over seeds 0-9); each turn adds
      2-5k tokens of retrieved passages with probability 0.7, a 20-400-token message and a 100-800-token
      answer to the context. Losing a session's context between turns costs a 10-50k-token prefill
      (0.4-2 s on this replica) against ~0.1-0.3 s for a turn that hits; a first turn costs about as much as
      a hit (~2-5k new tokens after the cached system prompt). Chat's own reuse working set averages ~0.3x
      the KV capacity, so it fits a protected share of the cache.
    * Batch (2): 0.3 jobs/s, each 2-6 questions (10-100-token answers) submitted within 4 s on one of 200
      documents of 8-20k tokens: ~4k new document tokens/s flow through the cache, enough for a recency
      order to evict a chat context within a typical think time. A document is revisited every ~11 minutes
      on average, so no policy can keep the corpus; within a job the questions reuse the document.
    * Agents (1): 0.03/s, 4-16 steps with 1-10 s tool pauses, context kept at retention 80 for 12 s after
      each step (a small protected footprint: ~3 live agents, 2.5 on average over seeds 0-9, 2.9 counting the
      12 s each one's context is kept after its last step).
    * Working set (``working_set(...)``, seed 0): peak 6.6x, time-average 4.7x the KV capacity (dominated by
      the document corpus; chat alone averages ~0.3x).

    ``duration_s`` bounds session starts, job submissions and follow-up turns; turns that would start later are
    dropped (a job's questions, spread over up to 4 s after its submission, may arrive just after it).
    """

    duration_s: float = 3600.0
    # Open-loop timing: a follow-up turn arrives after its predecessor's estimated service time
    # (output tokens x this) plus the think / tool pause.
    est_s_per_output_token: float = 0.02

    chat_priority: int = 0
    chat_session_rate: float = 0.02  # sessions per second
    chat_system_tokens: int = 2_048
    chat_turns: Range = (4, 12)
    chat_attachment_prob: float = 0.1  # a first turn with a pasted document (a cold, compulsory miss)
    chat_attachment_tokens: Range = (2_000, 8_000)
    chat_rag_prob: float = 0.7  # a turn adds retrieved passages to the conversation
    chat_rag_tokens: Range = (2_000, 5_000)
    chat_user_tokens: Range = (20, 400)
    chat_output_tokens: Range = (100, 800)
    chat_think_s: float = 60.0  # mean: reading the answer, typing the next

    agent_priority: int = 1
    agent_rate: float = 0.03  # agents per second
    agent_system_tokens: int = 3_000
    agent_task_tokens: Range = (200, 2_000)
    agent_steps: Range = (4, 16)
    agent_output_tokens: Range = (20, 300)
    agent_tool_result_tokens: Range = (100, 3_000)
    agent_tool_pause_s: tuple[float, float] = (1.0, 10.0)  # uniform
    agent_retention_priority: int = 80
    agent_retention_duration_s: float = 12.0

    batch_priority: int = 2
    batch_documents: int = 200
    batch_document_tokens: Range = (8_000, 20_000)
    batch_system_tokens: int = 256
    batch_job_rate: float = 0.3  # jobs per second
    batch_questions_per_job: Range = (2, 6)
    batch_question_tokens: Range = (20, 200)
    batch_output_tokens: Range = (10, 100)
    batch_job_spread_s: float = 4.0

    def __post_init__(self) -> None:
        check_config(
            self,
            "multi-tenant",
            non_negative=(
                "duration_s",
                "est_s_per_output_token",
                "chat_session_rate",
                "chat_think_s",
                "agent_rate",
                "agent_retention_duration_s",
                "batch_job_rate",
                "batch_job_spread_s",
            ),
            probabilities=("chat_attachment_prob", "chat_rag_prob"),
            at_least_one=("batch_documents",),
        )
        try:
            RetentionDirective(0, None, self.agent_retention_priority, self.agent_retention_duration_s)
        except RetentionError as e:
            raise WorkloadError(f"multi-tenant config: agent_retention_priority: {e}") from None

    def expected_size(self) -> WorkloadSize:
        """The workload's expected size (:class:`~kvretain.workloads.request.WorkloadSize`), before generating."""
        est = self.est_s_per_output_token
        chat = sessions_size(
            self.chat_session_rate,
            self.duration_s,
            self.chat_turns,
            mean(self.chat_output_tokens) * est + self.chat_think_s,
            2 + self.chat_attachment_prob + self.chat_rag_prob,  # system, attachment, passages, message
            2 + self.chat_rag_prob,  # the answer, passages, the next message
        )
        gap = mean(self.agent_output_tokens) * est + mean(self.agent_tool_pause_s)
        agents = sessions_size(self.agent_rate, self.duration_s, self.agent_steps, gap, 2, 2)
        batch = sessions_size(self.batch_job_rate, self.duration_s, self.batch_questions_per_job, 0.0, 3, 0)
        documents = WorkloadSize(0, 2 * self.batch_documents, self.batch_documents)
        return chat + agents + batch + documents


def generate_multi_tenant(
    config: MultiTenantConfig | None = None,
    rng: random.Random | None = None,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[WorkloadRequest]:
    """The multi-tenant workload, sorted by arrival; deterministic given ``rng``'s state (default seed 0)."""
    cfg = config or MultiTenantConfig()
    rng = rng or random.Random(0)
    chat_rng, agent_rng, batch_rng = (random.Random(rng.getrandbits(64)) for _ in range(3))
    requests = _chat(cfg, chat_rng) + _agents(cfg, agent_rng) + _batch(cfg, batch_rng)
    return scale_and_limit(requests, time_scale, limit)


def seeded_span(rng: random.Random, bounds: Range) -> TokenSeq:
    """A fresh seeded token span whose length is drawn uniformly from the inclusive range ``bounds``."""
    return TokenSeq.seeded(rng.getrandbits(63), rng.randint(*bounds))


def poisson_times(rng: random.Random, rate: float, duration: float) -> list[float]:
    """Arrival times of a Poisson process of ``rate`` per second in ``[0, duration)``."""
    times: list[float] = []
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        times.append(t)
    return times


def _chat(cfg: MultiTenantConfig, rng: random.Random) -> list[WorkloadRequest]:
    system = TokenSeq.seeded(rng.getrandbits(63), cfg.chat_system_tokens)
    out: list[WorkloadRequest] = []
    for s, start in enumerate(poisson_times(rng, cfg.chat_session_rate, cfg.duration_s)):
        sid = f"chat-{s}"
        context = system
        if rng.random() < cfg.chat_attachment_prob:
            context = context + seeded_span(rng, cfg.chat_attachment_tokens)
        t, think, prev = start, 0.0, None
        for k in range(rng.randint(*cfg.chat_turns)):
            if rng.random() < cfg.chat_rag_prob:
                context = context + seeded_span(rng, cfg.chat_rag_tokens)
            prompt = context + seeded_span(rng, cfg.chat_user_tokens)
            output = seeded_span(rng, cfg.chat_output_tokens)
            rid = f"{sid}-turn-{k}"
            out.append(
                WorkloadRequest(
                    request_id=rid,
                    arrival_s=t,
                    prompt=prompt,
                    output_len=len(output),
                    priority=cfg.chat_priority,
                    session_id=sid,
                    output=output,
                    after=prev,
                    think_s=think,
                )
            )
            context, prev = prompt + output, rid
            think = rng.expovariate(1.0 / cfg.chat_think_s) if cfg.chat_think_s > 0 else 0.0
            t += len(output) * cfg.est_s_per_output_token + think
            if t >= cfg.duration_s:
                break
    return out


def _agents(cfg: MultiTenantConfig, rng: random.Random) -> list[WorkloadRequest]:
    system = TokenSeq.seeded(rng.getrandbits(63), cfg.agent_system_tokens)
    keep = (RetentionDirective(0, None, cfg.agent_retention_priority, cfg.agent_retention_duration_s),)
    out: list[WorkloadRequest] = []
    for a, start in enumerate(poisson_times(rng, cfg.agent_rate, cfg.duration_s)):
        sid = f"agent-{a}"
        prompt = system + seeded_span(rng, cfg.agent_task_tokens)
        t, pause, prev = start, 0.0, None
        for k in range(rng.randint(*cfg.agent_steps)):
            output = seeded_span(rng, cfg.agent_output_tokens)
            rid = f"{sid}-step-{k}"
            out.append(
                WorkloadRequest(
                    request_id=rid,
                    arrival_s=t,
                    prompt=prompt,
                    output_len=len(output),
                    priority=cfg.agent_priority,
                    retention=keep,
                    session_id=sid,
                    output=output,
                    after=prev,
                    think_s=pause,
                )
            )
            prompt, prev = prompt + output + seeded_span(rng, cfg.agent_tool_result_tokens), rid
            pause = rng.uniform(*cfg.agent_tool_pause_s)
            t += len(output) * cfg.est_s_per_output_token + pause
            if t >= cfg.duration_s:
                break
    return out


def _batch(cfg: MultiTenantConfig, rng: random.Random) -> list[WorkloadRequest]:
    system = TokenSeq.seeded(rng.getrandbits(63), cfg.batch_system_tokens)
    documents = [system + seeded_span(rng, cfg.batch_document_tokens) for _ in range(cfg.batch_documents)]
    out: list[WorkloadRequest] = []
    for j, start in enumerate(poisson_times(rng, cfg.batch_job_rate, cfg.duration_s)):
        doc = rng.randrange(len(documents))
        sid = f"batch-{j}"
        for q in range(rng.randint(*cfg.batch_questions_per_job)):
            output = seeded_span(rng, cfg.batch_output_tokens)
            out.append(
                WorkloadRequest(
                    f"{sid}-doc-{doc}-q-{q}",
                    start + rng.uniform(0.0, cfg.batch_job_spread_s),
                    documents[doc] + seeded_span(rng, cfg.batch_question_tokens),
                    len(output),
                    cfg.batch_priority,
                    session_id=sid,
                    output=output,
                )
            )
    return out
