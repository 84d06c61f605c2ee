"""Process-wide plugin state that needs no vLLM import: the logger, the clock, the per-priority counters and
the count of hook errors."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvretain.core.stats import ClassStats

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


STATS_KEYS = (
    ("requests", "requests"),
    ("query_tokens", "query_tokens"),
    ("hit_tokens", "hit_tokens"),
    ("resumes", "preempted_requests"),
    ("resume_query_tokens", "preempted_query_tokens"),
    ("resume_hit_tokens", "preempted_hit_tokens"),
    ("released_blocks", "released_blocks"),
    ("evicted_blocks", "evicted_blocks"),
)
"""``(ClassStats field, name in stats() and /metrics)``: the plugin's public names, vLLM's ``preempted_*``
spelling for the core's ``resume*`` counters (a resume after preemption is counted apart, as vLLM does)."""


MAX_PRIORITY_CLASSES = 64
"""The most request priorities counted apart; later new ones share :data:`OTHER_PRIORITY`.

NOTE: a client picks its request priority (vLLM takes any 64-bit integer), and each distinct one counted apart is
state in the engine, a key in every metrics snapshot and six series in ``/metrics``: one request per priority
grew them without bound. Deployments use a handful of priorities."""
OTHER_PRIORITY = "other"
"""The key (and ``priority`` label) of the priorities past :data:`MAX_PRIORITY_CLASSES`."""


class PriorityLabels:
    """Which request priorities are counted apart: the first ``limit`` seen (:data:`MAX_PRIORITY_CLASSES`), each
    under its own label; any later one under :data:`OTHER_PRIORITY`. The engine's counters and the API server's
    latency histograms each keep one (they live in different processes)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = MAX_PRIORITY_CLASSES if limit is None else limit
        self.seen: set[str] = set()
        self._lock = threading.Lock()

    def of(self, priority: object) -> str:
        label = str(priority)
        if label in self.seen:
            return label
        with self._lock:
            if label in self.seen:  # (another thread labelled it between the test above and the lock)
                return label
            if len(self.seen) >= self.limit:
                return OTHER_PRIORITY
            self.seen.add(label)
        return label


class Counters:
    """Per-priority statistics shared by every retention queue of the process: one
    :class:`~kvretain.core.stats.ClassStats` per request priority (vLLM ``priority``, lower = more important),
    counted by the core's rules (first lookups and resumes apart; an eviction charged to the block's last
    releaser, whose class the queues keep per block). The first :data:`MAX_PRIORITY_CLASSES` priorities seen
    are counted apart, any later one in one shared :data:`OTHER_PRIORITY` class."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_priority: dict[int, ClassStats] = {}
        self.other = ClassStats()
        self._other_used = False
        self._labels = PriorityLabels()

    def get(self, priority: int) -> ClassStats:
        c = self.by_priority.get(priority)
        if c is None:
            with self._lock:
                c = self.by_priority.get(priority)
                if c is None:
                    if self._labels.of(priority) == OTHER_PRIORITY:
                        self._other_used = True
                        return self.other
                    c = self.by_priority[priority] = ClassStats()
        return c

    def snapshot(self) -> dict[int | str, dict[str, int]]:
        """``{priority: {name: count}}`` under the :data:`STATS_KEYS` names (priorities in order, then
        :data:`OTHER_PRIORITY` once used)."""
        # NOTE: copied under the lock: the engine thread inserts new priorities while a Prometheus scrape of an
        # in-process engine iterates (a dict changing size during iteration raises)
        with self._lock:
            out: dict[int | str, dict[str, int]] = {
                p: {name: getattr(c, f) for f, name in STATS_KEYS}
                for p, c in sorted(self.by_priority.items())
            }
            if self._other_used:
                out[OTHER_PRIORITY] = {name: getattr(self.other, f) for f, name in STATS_KEYS}
            return out

    def reset(self) -> None:
        with self._lock:
            self.by_priority = {}
            self.other = ClassStats()
            self._other_used = False
            self._labels = PriorityLabels()


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
