"""Process-wide plugin state that needs no vLLM import: the logger, the clock, the per-priority counters and
the count of hook errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

LOGGER_NAME = "vllm.kvretain"
"""The plugin logs under vLLM's own ``vllm`` logger (the one ``vllm.logger.init_logger`` names hang under):
vLLM configures that logger's handler, format and level in every process it starts (API server, engine core),
so the plugin's lines appear in the server's own log. A ``kvretain`` logger would be unconfigured there and its
INFO lines lost. Outside vLLM (before it configures logging) records propagate to the root logger as usual."""
logger = logging.getLogger(LOGGER_NAME)

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
        # NOTE: copied under the lock: the engine thread inserts new priorities while a Prometheus scrape of an
        # in-process engine iterates (a dict changing size during iteration raises)
        with self._lock:
            items = sorted(self.by_priority.items())
        return {p: asdict(c) for p, c in items}

    def reset(self) -> None:
        with self._lock:
            self.by_priority = {}


COUNTERS = Counters()


class HookErrors:
    """Errors raised inside the plugin's hooks, by hook. A hook never raises into vLLM: its error is logged
    with the traceback the first time, counted every time (:func:`kvretain.integrations.vllm.stats`), and
    logged again with the count at 10, 100, 1000, ... occurrences, so a recurring failure is never silent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_hook: dict[str, int] = {}

    def record(self, hook: str, msg: str) -> None:
        """Call from an ``except`` block: count the error of ``hook`` and log it as described above."""
        with self._lock:
            n = self.by_hook[hook] = self.by_hook.get(hook, 0) + 1
        if n == 1:
            logger.exception("%s", msg)
        elif n >= 10 and str(n).rstrip("0") == "1":  # 10, 100, 1000, ...
            logger.error("%s (%d times so far; the first traceback was logged)", msg, n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self.by_hook.items()))

    def reset(self) -> None:
        with self._lock:
            self.by_hook = {}


HOOK_ERRORS = HookErrors()
