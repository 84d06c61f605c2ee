"""The request a workload hands to a simulator or engine; its retention is the core's
(:class:`kvretain.core.retention.RetentionDirective` ranges, plus the rest of a
:class:`~kvretain.core.retention.RetentionConfig`). Trace lines are parsed in
:mod:`kvretain.workloads.mooncake`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvretain.core.retention import RetentionConfig, RetentionDirective, RetentionError
from kvretain.workloads.tokens import TokenSeq

MAX_TOKENS = 1 << 24
"""A request's prompt (``input_length``) and output bound: 16.8M tokens, above the longest context served (10M);
the trace format's bound (:mod:`kvretain.workloads.mooncake`), so that what a generator makes can be written and
read back, and one setting cannot take the process's memory."""
PRIORITY_BOUND = 1 << 63
"""Request priorities are int64: ``-2**63 <= priority < 2**63``."""
MAX_TIME_S = float(2**36)
"""Latest arrival and longest think time, in seconds (2**36 s, ~2,177 years; Unix-epoch timestamps are ~1.7e9 s):
below it a double resolves 2**-17 s (7.6 us) or better, finer than any step a simulator prices; beyond it a
step's microseconds are rounded away (at ``--time-scale 1e16`` every latency read 0). The trace format allows
timestamps up to 2**53 ms; ``replay`` reads them all, ``simulate`` those below this."""

Range = tuple[int, int]
"""An inclusive uniform range of a generator's setting (``(lo, hi)``)."""


class WorkloadError(ValueError):
    """A workload file or configuration is malformed; the message names the place and the field."""


_KINDS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("arrival_s", (int, float)),
    ("think_s", (int, float)),
    ("output_len", int),
    ("priority", int),
)
_KIND_NAMES: dict[type | tuple[type, ...], str] = {(int, float): "a number", int: "an integer"}


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload. Lower ``priority`` = more important (vLLM's convention, default 0).

    ``prompt`` is a lazy ``TokenSeq``; ``output``, when known (synthetic workloads), holds the tokens the
    request will generate, so that a follow-up turn whose prompt contains them can hit the cached decode
    blocks. ``block_ids`` keeps a trace's per-block hash ids (Mooncake) for priority-tagging rules.
    ``retention`` (prompt token ranges), ``retention_scope``, ``decode_priority`` and ``decode_duration_s``
    are the fields of the core's :class:`~kvretain.core.retention.RetentionConfig` (see
    :meth:`retention_config`); they are checked together when the request is built (ranges may not overlap).

    Arrivals are open-loop (``arrival_s``). A closed-loop replay may instead release a follow-up turn
    ``think_s`` seconds after the request ``after`` completes; ``arrival_s`` already includes an estimate of
    that service time, so both replays agree when the server keeps up.
    """

    request_id: str
    arrival_s: float
    prompt: TokenSeq
    output_len: int
    priority: int = 0
    retention: tuple[RetentionDirective, ...] | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    block_ids: tuple[int, ...] | None = None
    output: TokenSeq | None = None
    after: str | None = None
    think_s: float = 0.0
    retention_scope: str | None = None
    decode_priority: int | None = None
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        # the kinds first (a simulator run refused a bad request only when it arrived, after the ones before it)
        if not isinstance(self.request_id, str):
            raise WorkloadError(
                f"request_id must be a str, got {type(self.request_id).__name__} {self.request_id!r}"
            )
        for name, kinds in _KINDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise WorkloadError(
                    f"request {self.request_id}: {name} must be {_KIND_NAMES[kinds]}, got {v!r}"
                )
        if len(self.prompt) < 1:
            raise WorkloadError(f"request {self.request_id}: the prompt must hold at least one token")
        if not (0 <= self.arrival_s < math.inf and 0 <= self.think_s < math.inf and self.output_len >= 0):
            raise WorkloadError(
                f"request {self.request_id}: arrival_s and think_s must be finite and >= 0, output_len >= 0"
            )
        if self.arrival_s > MAX_TIME_S or self.think_s > MAX_TIME_S:
            raise WorkloadError(
                f"request {self.request_id}: arrival_s {self.arrival_s:.4g} / think_s {self.think_s:.4g} s beyond "
                f"{MAX_TIME_S:.4g} s (2**36), where a double's clock rounds a step's microseconds away; scale the "
                "times down (--time-scale)"
            )
        if len(self.prompt) > MAX_TOKENS or self.output_len > MAX_TOKENS:
            raise WorkloadError(
                f"request {self.request_id}: {len(self.prompt):,} prompt and {self.output_len:,} output tokens; "
                f"each must be at most {MAX_TOKENS:,}"
            )
        if not -PRIORITY_BOUND <= self.priority < PRIORITY_BOUND:
            raise WorkloadError(f"request {self.request_id}: priority {self.priority} is not an int64")
        if self.output is not None and len(self.output) != self.output_len:
            raise WorkloadError(
                f"request {self.request_id}: output has {len(self.output)} tokens, not output_len"
            )
        if self.retention or self.retention_scope is not None or self.decode_priority is not None:
            try:
                self.retention_config()
            except RetentionError as e:
                raise WorkloadError(f"request {self.request_id}: {e}") from None

    def retention_config(self) -> RetentionConfig | None:
        """The request's retention as the core's ``RetentionConfig`` (``None`` when it says nothing)."""
        if (
            not self.retention
            and self.retention_scope is None
            and self.decode_priority is None
            and self.decode_duration_s is None
        ):
            return None
        return RetentionConfig(
            self.retention or (), self.decode_priority, self.decode_duration_s, self.retention_scope
        )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def time_scaled(self, scale: float) -> WorkloadRequest:
        """This request with its times multiplied by ``scale`` (``--time-scale``): its arrival and think time, and
        its retention durations with them, so that a directive sized to outlast a pause still does (the shape of
        the workload kept; only its pace against the engine changes)."""
        if scale == 1.0:
            return self
        return dataclasses.replace(
            self,
            arrival_s=self.arrival_s * scale,
            think_s=self.think_s * scale,
            retention=scaled_directives(self.retention, scale),
            decode_duration_s=scaled_duration(self.decode_duration_s, scale),
        )


def scaled_duration(duration_s: float | None, scale: float) -> float | None:
    """A retention duration at ``--time-scale`` ``scale`` (None, no expiry, stays None)."""
    return None if duration_s is None else duration_s * scale


def scaled_directives(
    ranges: tuple[RetentionDirective, ...] | None, scale: float
) -> tuple[RetentionDirective, ...] | None:
    """Retention directives whose durations are at ``--time-scale`` ``scale``."""
    if ranges is None or scale == 1.0:
        return ranges
    return tuple(dataclasses.replace(d, duration_s=scaled_duration(d.duration_s, scale)) for d in ranges)


def check_config(
    config: Any,
    label: str,
    *,
    non_negative: Iterable[str] = (),
    probabilities: Iterable[str] = (),
    at_least_one: Iterable[str] = (),
) -> None:
    """The checks every generator's settings share (``label``: the workload's name in the message). Each field
    takes the kind of value its default is: an int field a whole number, a float field any finite number, a
    pair a ``(lo, hi)`` of such numbers with ``0 <= lo <= hi`` (a bool is not a number); a token count
    (``*_tokens``) at most ``MAX_TOKENS`` and, a single one too, ``>= 0``; then the named fields are ``>= 0``, in
    ``[0, 1]`` or ``>= 1``. Raises :class:`WorkloadError` naming the field and the value."""

    def bad(name: str, what: str, value: object) -> WorkloadError:
        return WorkloadError(f"{label} config: {name} must be {what}, got {value!r}")

    def number(name: str, value: object, whole: bool, shown: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
            raise bad(name, "a whole number" if whole else "a number", shown)
        if not math.isfinite(value):
            raise bad(name, "a finite number", shown)

    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        default = f.default
        if isinstance(default, tuple):
            if not isinstance(value, tuple) or len(value) != len(default):
                raise bad(f.name, f"a range [lo, hi] of {len(default)} numbers", value)
            for v, d in zip(value, default, strict=True):
                number(f.name, v, isinstance(d, int), value)
            if not 0 <= value[0] <= value[1]:
                raise bad(f.name, "a range lo <= hi of numbers >= 0", value)
            top = value[1]
        elif isinstance(default, (int, float)) and not isinstance(default, bool):
            number(f.name, value, isinstance(default, int), value)
            top = value
        else:
            continue
        # token counts and request priorities: the bounds every request has (checked before generating; a
        # range's lo >= 0 is checked above, and a single count, e.g. a system prompt's, is >= 0 too: a negative
        # one failed only when generating, as TokenSeq's ValueError naming no setting)
        if f.name.endswith("_tokens") and top > MAX_TOKENS:
            raise bad(f.name, f"at most {MAX_TOKENS:,} tokens", value)
        if f.name.endswith("_tokens") and not isinstance(default, tuple) and value < 0:
            raise bad(f.name, ">= 0 tokens", value)
        request_priority = f.name.endswith("_priority") and not f.name.endswith("retention_priority")
        if request_priority and not -PRIORITY_BOUND <= value < PRIORITY_BOUND:
            raise bad(f.name, "an int64 request priority", value)
    for name in non_negative:
        if getattr(config, name) < 0:
            raise bad(name, ">= 0", getattr(config, name))
    for name in probabilities:
        if not 0.0 <= getattr(config, name) <= 1.0:
            raise bad(name, "a probability in [0, 1]", getattr(config, name))
    for name in at_least_one:
        if getattr(config, name) < 1:
            raise bad(name, ">= 1", getattr(config, name))


def scale_and_limit(
    requests: Iterable[WorkloadRequest], time_scale: float = 1.0, limit: int | None = None
) -> list[WorkloadRequest]:
    """Requests sorted by arrival, the first ``limit`` kept, their times times ``time_scale``
    (:meth:`WorkloadRequest.time_scaled`: arrivals, think times and retention durations).

    ``time_scale < 1`` compresses the trace (higher load), ``> 1`` stretches it.
    """
    check_scale_and_limit(time_scale, limit)
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    if limit is not None:
        ordered = ordered[:limit]
    if time_scale == 1.0:
        return ordered
    return [r.time_scaled(time_scale) for r in ordered]


@dataclass(frozen=True, slots=True)
class WorkloadSize:
    """What a generated workload will hold, expected from its settings before generating it (a config's
    ``expected_size()``): its ``requests``; the references to prompt chunks over all of them (``chunk_refs``: a
    prompt is a tuple of chunks, and a session's context grows by a chunk or two a turn, so long sessions hold
    many); and the ``spans`` (documents) built up front that requests share. Means of the random draws, so an
    estimate, not a bound; ``--limit`` keeps the first requests of the whole workload, generated first."""

    requests: float
    chunk_refs: float
    spans: float = 0.0

    def __add__(self, other: WorkloadSize) -> WorkloadSize:
        return WorkloadSize(
            self.requests + other.requests, self.chunk_refs + other.chunk_refs, self.spans + other.spans
        )


def sessions_size(
    rate: float,
    duration_s: float,
    steps: tuple[float, float],
    gap_s: float,
    first_chunks: float,
    chunks_per_step: float,
) -> WorkloadSize:
    """The expected size of a Poisson stream of ``rate`` sessions per second over ``duration_s``, each of
    ``steps`` (an inclusive uniform range of integers) requests ``gap_s`` apart on average and cut at
    ``duration_s`` (a session starts uniformly in the window); a session's first prompt has ``first_chunks``
    chunks and each following one ``chunks_per_step`` more, so a session of n requests holds
    ``n * first_chunks + chunks_per_step * n * (n - 1) / 2`` references."""
    lo, hi = steps
    m = (lo + hi) / 2
    pairs = m * m + ((hi - lo + 1) ** 2 - 1) / 12 - m  # E[n (n - 1)] of the uniform draw
    x = duration_s / gap_s if gap_s > 0 else math.inf  # the window in gaps
    k = m - 1  # a session starting within k gaps of the end is cut (1 + gaps left requests)
    if k <= 0 or x == math.inf:  # no session is cut
        n, nn = m, pairs
    elif k >= x:  # every session can be cut: n = 1 + u, u uniform in [0, x]
        n, nn = 1 + x / 2, x / 2 + x * x / 3
    else:  # within k gaps of the end: cut; before: drawn
        n = (k + k * k / 2) / x + (1 - k / x) * m
        nn = (k * k / 2 + k**3 / 3) / x + (1 - k / x) * pairs
    sessions = rate * duration_s
    return WorkloadSize(sessions * n, sessions * (n * first_chunks + chunks_per_step * nn / 2))


def mean(bounds: tuple[float, float]) -> float:
    """The mean of a uniform draw from ``bounds``."""
    return (bounds[0] + bounds[1]) / 2


def check_scale_and_limit(time_scale: float, limit: int | None) -> None:
    """``time_scale`` finite and > 0; ``limit`` (a number of requests) ``None`` or >= 1."""
    if not 0 < time_scale < math.inf:
        raise WorkloadError(f"time scale (--time-scale) must be a finite number > 0, got {time_scale}")
    if limit is not None and (not is_int(limit) or limit < 1):
        raise WorkloadError(f"limit (--limit) must be a positive number of requests, got {limit!r}")


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON true/false parse as bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
