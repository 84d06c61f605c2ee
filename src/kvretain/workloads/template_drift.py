"""The ``template-drift`` workload: API traffic over few-shot prompt templates whose popularity drifts.

Shape (the defaults; one hour, seed 0: 16,762 requests in 14,299 sessions, 244k block lookups, 34k distinct
512-token blocks; 258 templates, whose 3,014 full blocks take 86% of the lookups):

* API tenants send every call on a prompt template (a few-shot or function-calling prompt, 1-12k tokens,
  ``template_tokens``) followed by the call's own input (50-800 tokens): the template's blocks are shared by
  all the calls on it, the input is new.
* ``active`` templates (60) are in use at any time, with Zipf popularity over their ranks (the template of
  rank r is chosen with weight ``r ** -zipf_s``; with 60 templates and s = 1 the top 5 get 49% of the calls).
  The calls that open a session arrive as a Poisson process (``rate``: 4 per second).
* Popularity drifts: every ``drift_s`` seconds (300) a share ``drift_share`` (0.3: 18 of 60, chosen at random)
  of the active templates retire and as many templates never used before are launched, each in the rank of
  the one it replaces, so the popular slots turn over too. The reuse is in the templates, and which ones are
  reused moves: a template that was popular retires and no new call asks for it again (a session already under way keeps
  its template for its follow-up turns: 0.35% of the requests at seed 0), while a new one starts with
  no history, so what a template's past frequency says of its future goes stale within a few drifts.
  Templates are made as they enter (60 at the start, 18 a drift), not up front.
* A share ``premium_share`` (0.2, drawn per template) of the templates belongs to premium tenants: their calls
  are priority 0, the others priority 1. No request carries a retention directive.
* With probability ``followup_prob`` (0.15) a call has a follow-up turn in the same session: the previous
  prompt, its output and a new input, ``followup_s`` (2-30 s uniform) after the previous call's estimated
  service end; a follow-up may have one of its own, up to ``max_turns`` (4) turns. Follow-ups that would
  start after ``duration_s`` are dropped.

Session ids are ``tpl-<k>`` (the k-th call that opens a session), request ids ``tpl-<k>-turn-<j>``.
Deterministic given the caller's seeded ``random.Random``, with one child rng each for the arrivals, the
templates (their tokens, premium draw and drifts), the choice of a template per call, and the sessions
(inputs, outputs, follow-ups), so changing the settings of one (the rate, the follow-ups) leaves the draws of
the others as they were.
"""

from __future__ import annotations

import itertools
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
)
from kvretain.workloads.tokens import TokenSeq

_MAX_TERMS = 1_000_000
"""Turns summed by :meth:`TemplateDriftConfig.expected_size` at most (a million turns a session is beyond any
memory already)."""


@dataclass(frozen=True, slots=True)
class TemplateDriftConfig:
    """Settings of the ``template-drift`` workload (see the module docstring); ranges are inclusive uniform."""

    duration_s: float = 3600.0
    rate: float = 4.0  # calls that open a session, per second
    active: int = 60  # templates in use at any time
    template_tokens: Range = (1_000, 12_000)
    zipf_s: float = 1.0
    drift_s: float = 300.0  # seconds between drifts (> 0; drift_share = 0 turns drift off)
    drift_share: float = 0.3  # share of the active templates replaced at each drift (to the nearest template)
    premium_share: float = 0.2  # share of the templates whose calls are important
    input_tokens: Range = (50, 800)  # a call's own input, appended to the template (or to the previous turn)
    output_tokens: Range = (20, 400)
    followup_prob: float = 0.15  # a call has a follow-up turn
    followup_s: tuple[float, float] = (2.0, 30.0)  # pause after the previous turn's estimated end
    max_turns: int = 4  # turns per session at most
    important_priority: int = 0
    other_priority: int = 1
    # Open-loop timing: a follow-up arrives after its predecessor's estimated service time plus the pause.
    est_s_per_output_token: float = 0.02

    def __post_init__(self) -> None:
        check_config(
            self,
            "template-drift",
            non_negative=("duration_s", "rate", "zipf_s", "est_s_per_output_token"),
            probabilities=("drift_share", "premium_share", "followup_prob"),
            at_least_one=("active", "max_turns"),
        )
        if not self.drift_s > 0:
            raise WorkloadError(
                "template-drift config: drift_s must be > 0 (drift_share=0 turns drift off), "
                f"got {self.drift_s!r}"
            )
        if self.template_tokens[0] + self.input_tokens[0] < 1:
            raise WorkloadError("template-drift config: a first prompt needs at least one token")

    @property
    def retired_per_drift(self) -> int:
        """Templates replaced at each drift: ``drift_share`` of ``active``, to the nearest whole template."""
        return int(self.drift_share * self.active + 0.5)

    def expected_size(self) -> WorkloadSize:
        """The workload's expected size (:class:`~kvretain.workloads.request.WorkloadSize`), before generating."""
        gap = mean(self.output_tokens) * self.est_s_per_output_token + mean(self.followup_s)
        # turn j (from 0) follows with probability followup_prob ** j, and only while it starts in the window
        # (the session starting uniformly in it: 1 - j * gap / duration); its prompt holds 2 + 2j chunks (the
        # template and an input, then each turn's output and a new input)
        turns = refs = 0.0
        for j in range(min(self.max_turns, _MAX_TERMS)):
            reach = self.followup_prob**j * (1.0 - j * gap / self.duration_s if self.duration_s > 0 else 1.0)
            if reach <= 1e-12:
                break
            turns, refs = turns + reach, refs + reach * (2 + 2 * j)
        sessions = self.rate * self.duration_s
        # The templates are spans that calls share, like retrieval-scan's documents, but made as they
        # enter: `active` at the start, then `retired_per_drift` at each drift, each one chunk (one
        # reference). All of them are counted, though a retired template no call used is freed: an upper
        # bound of the memory (about 2x with 20,000 active templates; exact for the defaults' 258, a small
        # share of the size) that also refuses settings which would make more templates than memory holds
        # (a tiny drift_s).
        drifts = max(0.0, -(-self.duration_s // self.drift_s) - 1) if self.retired_per_drift else 0.0
        templates = self.active + self.retired_per_drift * drifts
        return WorkloadSize(sessions * turns, sessions * refs + templates, templates)


def generate_template_drift(
    config: TemplateDriftConfig | None = None,
    rng: random.Random | None = None,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[WorkloadRequest]:
    """The ``template-drift`` workload sorted by arrival; deterministic given ``rng`` (default seed 0)."""
    cfg = config or TemplateDriftConfig()
    rng = rng or random.Random(0)
    arrivals_rng, templates_rng, choice_rng, sessions_rng = (
        random.Random(rng.getrandbits(64)) for _ in range(4)
    )
    active = [_template(cfg, templates_rng) for _ in range(cfg.active)]  # by rank
    cum = list(itertools.accumulate((r + 1) ** -cfg.zipf_s for r in range(cfg.active)))
    retire, drifts = cfg.retired_per_drift, 0
    out: list[WorkloadRequest] = []
    for k, start in enumerate(poisson_times(arrivals_rng, cfg.rate, cfg.duration_s)):
        while retire and (drifts + 1) * cfg.drift_s <= start:  # the drifts since the previous call
            for rank in templates_rng.sample(range(cfg.active), retire):
                active[rank] = _template(cfg, templates_rng)
            drifts += 1
        template, priority = active[choice_rng.choices(range(cfg.active), cum_weights=cum)[0]]
        out += _session(cfg, sessions_rng, template, priority, f"tpl-{k}", start)
    return scale_and_limit(out, time_scale, limit)


def _template(cfg: TemplateDriftConfig, rng: random.Random) -> tuple[TokenSeq, int]:
    """A new template's tokens and the priority of its calls (premium or not)."""
    tokens = seeded_span(rng, cfg.template_tokens)
    premium = rng.random() < cfg.premium_share
    return tokens, cfg.important_priority if premium else cfg.other_priority


def _session(
    cfg: TemplateDriftConfig, rng: random.Random, template: TokenSeq, priority: int, sid: str, start: float
) -> list[WorkloadRequest]:
    prompt = template + seeded_span(rng, cfg.input_tokens)
    out: list[WorkloadRequest] = []
    t, pause, prev = start, 0.0, None
    for j in range(cfg.max_turns):
        output = seeded_span(rng, cfg.output_tokens)
        rid = f"{sid}-turn-{j}"
        out.append(
            WorkloadRequest(
                request_id=rid,
                arrival_s=t,
                prompt=prompt,
                output_len=len(output),
                priority=priority,
                session_id=sid,
                output=output,
                after=prev,
                think_s=pause,
            )
        )
        if rng.random() >= cfg.followup_prob:
            break
        pause = rng.uniform(*cfg.followup_s)
        t += len(output) * cfg.est_s_per_output_token + pause
        if t >= cfg.duration_s:
            break
        prompt, prev = prompt + output + seeded_span(rng, cfg.input_tokens), rid
    return out
