"""The request a workload hands to a simulator or engine; retention directives are the core's
(:class:`kvretain.core.retention.RetentionDirective`), parsed here from trace lines."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvretain.core.retention import RetentionDirective
from kvretain.workloads.tokens import TokenSeq


class WorkloadError(ValueError):
    """A workload file or configuration is malformed; the message names the place and the field."""


def parse_directive(raw: Any, where: str) -> RetentionDirective:
    """Parse one ``{start, end, priority, duration_s}`` directive of a trace line into the core
    :class:`~kvretain.core.retention.RetentionDirective` (RFC #37003 / TensorRT-LLM ranges: prompt tokens
    ``[start, end)``, ``end=None`` to the end, priority 0-100, ``duration_s`` after release, ``None``: no
    expiry). Errors are ``WorkloadError`` naming ``where`` and the bad field."""
    if not isinstance(raw, Mapping):
        raise WorkloadError(f"{where}: retention directive must be an object, got {raw!r}")
    unknown = sorted(set(raw) - {"start", "end", "priority", "duration_s"})
    if unknown:
        raise WorkloadError(f"{where}: unknown retention field {unknown[0]!r}")
    start = raw.get("start", 0)
    end = raw.get("end")
    priority: Any = raw.get("priority")
    duration = raw.get("duration_s")
    if not is_int(start) or start < 0:
        raise WorkloadError(f"{where}: retention field 'start' must be an int >= 0, got {start!r}")
    if end is not None and (not is_int(end) or end <= start):
        raise WorkloadError(f"{where}: retention field 'end' must be null or an int > start, got {end!r}")
    if not is_int(priority) or not 0 <= priority <= 100:
        raise WorkloadError(f"{where}: retention field 'priority' must be an int in 0..100, got {priority!r}")
    if duration is not None and (not is_number(duration) or duration < 0):
        raise WorkloadError(f"{where}: retention field 'duration_s' must be null or >= 0, got {duration!r}")
    return RetentionDirective(start, end, priority, None if duration is None else float(duration))


def directive_to_dict(d: RetentionDirective) -> dict[str, Any]:
    """The raw form of a directive, as in a trace line or ``SamplingParams.extra_args``."""
    return {"start": d.start, "end": d.end, "priority": d.priority, "duration_s": d.duration_s}


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One request of a workload. Lower ``priority`` = more important (vLLM's convention, default 0).

    ``prompt`` is a lazy ``TokenSeq``; ``output``, when known (synthetic workloads), holds the tokens the
    request will generate, so that a follow-up turn whose prompt contains them can hit the cached decode
    blocks. ``block_ids`` keeps a trace's per-block hash ids (Mooncake) for priority-tagging rules.

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

    def __post_init__(self) -> None:
        if self.arrival_s < 0 or self.output_len < 0 or self.think_s < 0:
            raise WorkloadError(f"request {self.request_id}: arrival_s, output_len and think_s must be >= 0")
        if self.output is not None and len(self.output) != self.output_len:
            raise WorkloadError(
                f"request {self.request_id}: output has {len(self.output)} tokens, not output_len"
            )

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def scale_and_limit(
    requests: Iterable[WorkloadRequest], time_scale: float = 1.0, limit: int | None = None
) -> list[WorkloadRequest]:
    """Requests sorted by arrival, the first ``limit`` kept, arrival and think times times ``time_scale``.

    ``time_scale < 1`` compresses the trace (higher load), ``> 1`` stretches it.
    """
    check_scale_and_limit(time_scale, limit)
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    if limit is not None:
        ordered = ordered[:limit]
    if time_scale == 1.0:
        return ordered
    return [
        dataclasses.replace(r, arrival_s=r.arrival_s * time_scale, think_s=r.think_s * time_scale)
        for r in ordered
    ]


def check_scale_and_limit(time_scale: float, limit: int | None) -> None:
    if not time_scale > 0:
        raise WorkloadError(f"time_scale must be > 0, got {time_scale}")
    if limit is not None and limit < 0:
        raise WorkloadError(f"limit must be >= 0, got {limit}")


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON true/false parse as bool)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
