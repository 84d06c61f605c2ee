"""Process-wide plugin state that needs no vLLM import: the clock and the per-priority counters."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

_clock: Callable[[], float] = time.monotonic


def now() -> float:
    """The plugin's clock (``time.monotonic`` unless replaced with :func:`set_clock`)."""
    return _clock()


def set_clock(clock: Callable[[], float] | None) -> None:
    """Replace the clock that retention durations are measured with (``None``: ``time.monotonic``)."""
    global _clock
    _clock = clock if clock is not None else time.monotonic


@dataclass(slots=True)
class PriorityCounters:
    """Counters of one request-priority class (vLLM ``priority``, lower = more important)."""

    requests: int = 0
    """Admissions that looked up the prefix cache (first schedule; resumes after preemption excluded)."""
    query_tokens: int = 0
    hit_tokens: int = 0
    preempted_requests: int = 0
    """Admissions of requests resumed after a preemption (their hits are counted apart, as vLLM does)."""
    preempted_hit_tokens: int = 0
    released_blocks: int = 0
    evicted_blocks: int = 0
    """Cached blocks evicted whose last releasing request had this priority."""


class Counters:
    """Per-priority counters shared by every retention queue of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_priority: dict[int, PriorityCounters] = {}

    def get(self, priority: int) -> PriorityCounters:
        c = self.by_priority.get(priority)
        if c is None:
            with self._lock:
                c = self.by_priority.setdefault(priority, PriorityCounters())
        return c

    def snapshot(self) -> dict[int, dict[str, int]]:
        return {p: asdict(c) for p, c in sorted(self.by_priority.items())}

    def reset(self) -> None:
        with self._lock:
            self.by_priority = {}


COUNTERS = Counters()
