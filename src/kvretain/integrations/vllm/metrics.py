"""Per-priority series in vLLM's own ``/metrics``, with the engine core in its own process or in-process.

vLLM serves ``/metrics`` from the API server process (prometheus_client's default registry, unless
``PROMETHEUS_MULTIPROC_DIR`` is set for several API servers), while the KV cache and so the plugin's counters
live in the engine core, a child process by default. vLLM ships the engine core's own statistics to the front
end inside its output messages (``SchedulerStats``), a fixed dataclass with no room for a plugin's. So the side
channel is a directory: every process that holds a retention queue writes a JSON snapshot of its counters and
queue state there twice a second (atomic rename), and a collector on the API server's registry reads those
snapshots, plus its own process's state when the engine runs in-process, at each scrape.

The directory is ``KVRETAIN_METRICS_DIR``; unset, the first process that loads the plugin (vLLM's API server,
which loads plugins before it starts the engine core) makes a temporary one and sets the variable, which the
engine core inherits. Series (tokens, like vLLM's ``vllm:prefix_cache_*``; ``priority`` is vLLM's request
priority, lower = more important; the first 64 priorities seen get their own label, later ones share
``priority="other"``, so that clients cannot grow the series without bound):

``kvretain:prefix_cache_queries_total{priority}`` / ``kvretain:prefix_cache_hits_total{priority}``
    prompt tokens looked up / served from the prefix cache at a request's first admission;
``kvretain:prefix_cache_requests_total{priority}``, ``kvretain:preempted_requests_total{priority}``;
``kvretain:preempted_queries_total{priority}`` / ``kvretain:preempted_hits_total{priority}``
    the same tokens for admissions that resume a preempted request (counted apart, as vLLM's
    ``PrefixCacheStats.preempted_*`` are; not in the hit ratio);
``kvretain:evicted_blocks_total{priority}`` / ``kvretain:released_blocks_total{priority}``
    cached blocks evicted / released, by the priority of their last releasing request;
``kvretain:pool_blocks``, ``kvretain:protected_blocks``, ``kvretain:protected_block_share``
    blocks whose retention is at or above the protection threshold, and their share of the pool;
``kvretain:protected_target_blocks`` / ``kvretain:protected_budget_blocks``
    the protection controller's target and its ceiling (``budget`` x pool);
``kvretain:protection_level``, ``kvretain:hit_ratio_window`` / ``kvretain:lru_hit_ratio_estimate``,
``kvretain:protected_hit_ratio_window`` / ``kvretain:isolated_hit_ratio_estimate``, ``kvretain:reuse_floor_binds``,
``kvretain:isolation_goal`` (the goal set; 0: a fixed share),
``kvretain:lru_protected_hit_ratio_estimate`` / ``kvretain:top_protected_hit_ratio_estimate``,
``kvretain:lookups_seen_at_arrival``, ``kvretain:start_level``, ``kvretain:balance_start``
    the controller's state: its level, both sides of the reuse floor and of the isolation goal, which binds,
    what protected traffic would hit at either end of the level (plain LRU, protection at its top: which way
    the level moves while protected traffic is short), the share of first lookups whose shadows saw the
    request at vLLM's input processing and where the level and the recency/frequency balance started (the
    warm-up's choice at the first eviction);
``kvretain:frequency_exponent_now``, ``kvretain:balance_one_class``
    the recency/frequency balance: its exponent now (0: LRU order) and whether its one-class rule holds.

:class:`ClassLatency` (ASGI, for ``--middleware``) adds per-priority latency histograms, which vLLM's own
``vllm:time_to_first_token_seconds`` lacks: ``kvretain:time_to_first_token_seconds{priority}`` (streaming
requests, from arrival at the API server to the first streamed token, by
:mod:`~kvretain.integrations.vllm.firsttoken`'s rule, the client loop's) and
``kvretain:e2e_request_latency_seconds{priority}`` (to the end of a response sent in full: a stream its client
left is not observed, as vLLM's own e2e histogram leaves an aborted request out); responses other than 200 are
not observed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm.config import ENV_METRICS_DIR, load_json, route_path
from kvretain.integrations.vllm.firsttoken import SSEFirstToken

PUBLISH_INTERVAL_S = 0.5
"""NOTE: Prometheus scrapes every 15-60 s; half a second keeps a scrape at most that stale at one small file
write per engine process per interval."""

logger = logging.getLogger(f"{_runtime.LOGGER_NAME}.metrics")
"""Under vLLM's own logger, as the plugin's (:data:`_runtime.LOGGER_NAME`): the lines reach the server's log."""

QUEUES: weakref.WeakSet[Any] = weakref.WeakSet()
"""The retention queues of this process (registered by the plugin when it installs one)."""

COUNTER_KEYS = (
    ("requests", "prefix_cache_requests", "requests admitted (first schedule) by request priority"),
    (
        "query_tokens",
        "prefix_cache_queries",
        "prompt tokens looked up in the prefix cache, by request priority",
    ),
    ("hit_tokens", "prefix_cache_hits", "prompt tokens served from the prefix cache, by request priority"),
    ("preempted_requests", "preempted_requests", "admissions of requests resumed after a preemption"),
    (
        "preempted_query_tokens",
        "preempted_queries",
        "prompt tokens looked up by requests resumed after a preemption, by request priority",
    ),
    (
        "preempted_hit_tokens",
        "preempted_hits",
        "prompt tokens of resumed requests served from the prefix cache, by request priority",
    ),
    (
        "released_blocks",
        "released_blocks",
        "cached blocks released, by the priority of the releasing request",
    ),
    ("evicted_blocks", "evicted_blocks", "cached blocks evicted, by the priority of their last user"),
)
GAUGE_KEYS = (
    ("pool_blocks", "blocks in the prefix-cached pools"),
    ("protected_blocks", "cached blocks whose retention is at or above the protection threshold"),
    ("protected_block_share", "protected blocks over pool blocks"),
    ("protected_target_blocks", "the protection controller's target for protected blocks"),
    ("protected_budget_blocks", "the most blocks protected traffic may hold (budget x pool)"),
    (
        "protection_level",
        "the controller's level: 0..1 protected target share of the budget, -1..0 softened weights",
    ),
    ("hit_ratio_window", "the pool's hit ratio over the controller's window (sampled blocks)"),
    ("lru_hit_ratio_estimate", "what plain LRU would hit on the same traffic (the reuse floor's reference)"),
    ("protected_hit_ratio_window", "protected traffic's hit ratio over the window"),
    (
        "isolated_hit_ratio_estimate",
        "what protected traffic would hit alone in the pool (the goal's reference)",
    ),
    (
        "lru_protected_hit_ratio_estimate",
        "what protected traffic would hit under plain LRU in the shared pool (the level's bottom end, recency)",
    ),
    (
        "top_protected_hit_ratio_estimate",
        "what protected traffic would hit with protection's tier at its top (the level's top end, weights aside)",
    ),
    ("reuse_floor_binds", "1 when the overall-reuse floor is what holds protection back"),
    ("isolation_goal", "the isolation goal set (0: a fixed protected share, no goal and no reuse floor)"),
    (
        "frequency_exponent_now",
        "the recency/frequency balance's frequency exponent now: 0 is LRU order (-1: no balance)",
    ),
    (
        "balance_one_class",
        "1 while every lookup so far asked for one retention priority (the order leaves LRU only on evidence)",
    ),
    (
        "lookups_seen_at_arrival",
        "share of first lookups whose controller shadows saw the request at input processing (off the step)",
    ),
    (
        "start_level",
        "the level the warm-up shadows chose at the pool's first eviction: 1 the top, -1 the bottom (0: not yet)",
    ),
    (
        "balance_start",
        "the recency share the warm-up started the balance at: 1 recency, 0 frequency, 0.5 midpoint (-1: not yet)",
    ),
)
_CONTROLLER_KEYS = (
    "protection_level",
    "hit_ratio_window",
    "lru_hit_ratio_estimate",
    "protected_hit_ratio_window",
    "isolated_hit_ratio_estimate",
    "lru_protected_hit_ratio_estimate",
    "top_protected_hit_ratio_estimate",
    "reuse_floor_binds",
    "isolation_goal",
    "frequency_exponent_now",
    "balance_one_class",
    "lookups_seen_at_arrival",
    "start_level",
    "balance_start",
)


def register_queue(queue: Any) -> None:
    QUEUES.add(queue)


def _queue_stats(q: Any) -> dict[str, Any]:
    """A queue's state: its own (the run queue) or its policy's (the per-block queue, ``KVRETAIN_GRANULARITY=
    block``: any policy of the registry)."""
    if hasattr(q, "stats"):
        return dict(q.stats())
    policy = getattr(q, "policy", None)
    return dict(policy.stats()) if policy is not None and hasattr(policy, "stats") else {}


_NOT_THERE = {"frequency_exponent_now": -1.0, "balance_start": -1.0}
"""The gauges whose 0 is a value (recency; a start at frequency): -1 until a queue with a balance reports them."""


def queue_gauges(queues: Any) -> dict[str, float]:
    """Sum of the queues' state (the controller's fields read where the queue has one)."""
    g = dict.fromkeys((k for k, _ in GAUGE_KEYS), 0.0) | _NOT_THERE
    for q in list(queues):
        g["pool_blocks"] += len(getattr(q, "pool_blocks", ()))
        stats = _queue_stats(q)
        g["protected_blocks"] += float(stats.get("protected_blocks", 0.0))
        g["protected_target_blocks"] += float(stats.get("protected_target", 0.0))
        g["protected_budget_blocks"] += float(stats.get("protected_budget", 0.0))
        for key in _CONTROLLER_KEYS:  # (one controlled queue per engine process: its values as they are)
            if key in stats:
                g[key] = float(stats[key])
    if g["pool_blocks"]:
        g["protected_block_share"] = g["protected_blocks"] / g["pool_blocks"]
    return g


def local_snapshot() -> dict[str, Any] | None:
    """This process's counters and queue state; ``None`` when it holds no retention queue."""
    if not QUEUES:
        return None
    return {
        "pid": os.getpid(),
        "time": time.time(),
        "by_priority": {str(p): c for p, c in _runtime.COUNTERS.snapshot().items()},
        "gauges": queue_gauges(QUEUES),
    }


def merge(
    snaps: list[dict[str, Any]], labels: _runtime.PriorityLabels | None = None
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """The engine processes' snapshots as one: counters and block counts summed; the controller's ratios,
    levels and flags (``_CONTROLLER_KEYS``, one controller per process) averaged over the processes that
    report them (a sum of hit ratios or levels is no ratio: two engines at 0.7 read 1.4).

    Each engine labels the first :data:`~._runtime.MAX_PRIORITY_CLASSES` priorities it sees and counts the rest
    under ``other``, so one priority can be a label in one engine and inside another's ``other``: a label an
    engine that has counted under ``other`` does not have is merged into ``other`` (which priorities that
    engine's ``other`` holds is not known), so that a priority's counts are under one label. The engines'
    labels together can still be more than the cap (two engines, 40 priorities each): ``labels`` (the
    collector's, kept across scrapes; default a new one, which takes them in numeric order) keeps the first
    :data:`~._runtime.MAX_PRIORITY_CLASSES` and merges the others into ``other``."""
    by_prio: dict[str, dict[str, float]] = {}
    gauges = dict.fromkeys((k for k, _ in GAUGE_KEYS), 0.0)
    means: dict[str, list[float]] = {}
    other = _runtime.OTHER_PRIORITY
    labels = _runtime.PriorityLabels() if labels is None else labels
    closed = [s["by_priority"].keys() for s in snaps if other in s.get("by_priority", {})]
    label_of: dict[str, str] = {}
    for prio in sorted({p for s in snaps for p in s.get("by_priority", {})}, key=_label_order):
        closed_out = prio == other or any(prio not in seen for seen in closed)
        label_of[prio] = other if closed_out else labels.of(prio)
    for s in snaps:
        for prio, c in s.get("by_priority", {}).items():
            acc = by_prio.setdefault(label_of[prio], {})
            for k, v in c.items():
                acc[k] = acc.get(k, 0.0) + float(v)
        for k, v in s.get("gauges", {}).items():
            if k in _CONTROLLER_KEYS:
                means.setdefault(k, []).append(float(v))
            elif k in gauges:
                gauges[k] += float(v)
    gauges |= _NOT_THERE
    for k, vs in means.items():
        gauges[k] = sum(vs) / len(vs)
    if gauges["pool_blocks"]:
        gauges["protected_block_share"] = gauges["protected_blocks"] / gauges["pool_blocks"]
    return by_prio, gauges


def _snapshot_ok(snap: Any) -> bool:
    """Whether a snapshot file holds what :func:`local_snapshot` writes (a foreign or damaged file in a shared
    ``KVRETAIN_METRICS_DIR`` is skipped, not allowed to break ``/metrics``)."""
    if not isinstance(snap, dict) or type(snap.get("pid")) is not int or snap["pid"] <= 0:
        return False
    by_prio, gauges = snap.get("by_priority", {}), snap.get("gauges", {})
    if not isinstance(by_prio, dict) or not isinstance(gauges, dict):
        return False
    numbers = [*gauges.values()]
    for c in by_prio.values():
        if not isinstance(c, dict):
            return False
        numbers += c.values()
    # (finite, and an int a float holds: json.loads reads 1e999 as inf and 10**400 as an int that no float
    # holds, which raised OverflowError; a label is a priority as str() writes it, or OTHER_PRIORITY: a lone
    # surrogate in one made prometheus_client's UTF-8 encoding raise)
    return all(type(v) in (int, float) and abs(v) < _MAX_VALUE for v in numbers) and all(
        map(_is_label, by_prio)
    )


_MAX_VALUE = 2.0**63
"""Above any count (and any sum of a few)."""


def _is_label(label: str) -> bool:
    if label == _runtime.OTHER_PRIORITY:
        return True
    try:
        return str(int(label)) == label
    except ValueError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (no such process; a pid past the kernel's type)
        return False
    except PermissionError:
        return True
    return True


STALE_AFTER_S = 60 * PUBLISH_INTERVAL_S
"""A snapshot not rewritten for this long is skipped: its process is gone (killed before its ``atexit`` removed
the file, as the OOM killer does) even when a process alive now has its pid (pids are reused, soonest in a
container's pid namespace after a restart), whose counts and blocks were summed in for good."""


def read_snapshots(directory: Path, skip_pid: int | None = None) -> list[dict[str, Any]]:
    out = []
    now = time.time()
    for f in sorted(directory.glob("engine-*.json")):
        try:
            if now - f.stat().st_mtime > STALE_AFTER_S:
                continue
            snap = load_json(f.read_text())
        except (OSError, ValueError):
            continue  # a file being replaced, or a foreign one (nested past the parser's depth too)
        if not _snapshot_ok(snap):
            continue
        pid = snap["pid"]
        if pid != skip_pid and _alive(pid):
            out.append(snap)
    return out


class _Publisher(threading.Thread):
    def __init__(self, directory: Path) -> None:
        super().__init__(name="kvretain-metrics", daemon=True)
        self.directory = directory
        self.path = directory / f"engine-{os.getpid()}.json"
        self.stop_event = threading.Event()

    def publish(self) -> None:
        snap = local_snapshot()
        if snap is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snap))
        os.replace(tmp, self.path)

    def run(self) -> None:
        while not self.stop_event.wait(PUBLISH_INTERVAL_S):
            try:
                self.publish()
            except Exception:
                logger.debug("kvretain: metrics snapshot not written", exc_info=True)

    def close(self) -> None:
        self.stop_event.set()
        with contextlib.suppress(OSError):
            self.path.unlink()


class Collector:
    """prometheus_client collector: this process's state plus the other processes' snapshots."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.labels = _runtime.PriorityLabels()
        """The merged series' labels, kept across scrapes (a label never moves into ``other`` and back)."""

    def snapshots(self) -> list[dict[str, Any]]:
        snaps = []
        local = local_snapshot()
        if local is not None:
            snaps.append(local)
        if self.directory is not None and self.directory.is_dir():
            snaps.extend(read_snapshots(self.directory, skip_pid=os.getpid()))
        return snaps

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snaps = self.snapshots()
        if not snaps:
            return
        by_prio, gauges = merge(snaps, self.labels)
        for key, name, doc in COUNTER_KEYS:
            fam = CounterMetricFamily(f"kvretain:{name}", doc, labels=["priority"])
            for prio in sorted(by_prio, key=_label_order):
                fam.add_metric([prio], by_prio[prio].get(key, 0.0))
            yield fam
        for key, doc in GAUGE_KEYS:
            yield GaugeMetricFamily(f"kvretain:{key}", doc, value=gauges[key])


def _label_order(label: str) -> tuple[int, int, str]:
    """Priorities in numeric order, then anything else (:data:`_runtime.OTHER_PRIORITY`)."""
    try:
        return (0, int(label), "")
    except ValueError:
        return (1, 0, label)


_installed: dict[str, Any] = {}


def metrics_dir() -> Path:
    """The side-channel directory (made, and named in the environment for child processes, when unset)."""
    raw = os.environ.get(ENV_METRICS_DIR)
    if raw:
        path = Path(raw)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix="kvretain-metrics-"))
    os.environ[ENV_METRICS_DIR] = str(path)
    atexit.register(shutil.rmtree, path, True)
    return path


def install() -> None:
    """Start publishing this process's snapshots and register the collector (idempotent; never raises)."""
    if _installed:
        return
    directory: Path | None = None
    try:
        directory = metrics_dir()
        pub = _Publisher(directory)
        pub.start()
        atexit.register(pub.close)
        _installed["publisher"] = pub
    except Exception:
        logger.warning("kvretain: per-priority metrics side channel unavailable", exc_info=True)
        directory = None
    try:
        from prometheus_client.core import REGISTRY

        collector = Collector(directory)
        REGISTRY.register(collector)
        _installed["collector"] = collector
    except Exception:
        logger.debug("kvretain: prometheus collector not registered", exc_info=True)
    _installed.setdefault("done", True)


# ---------------------------------------------------------------- per-class latency (ASGI)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
"""vLLM's own TTFT buckets (0.33's ``TIME_TO_FIRST_TOKEN_BUCKETS``, of ``vllm:time_to_first_token_seconds``): a
``histogram_quantile`` of a class's series and of vLLM's own compare only on the same bounds."""
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
"""vLLM's own end-to-end latency buckets (0.33's ``REQUEST_LATENCY_BUCKETS``, of
``vllm:e2e_request_latency_seconds``)."""
_histograms: dict[str, Any] = {}
_hist_lock = threading.Lock()


def latency_histograms() -> dict[str, Any]:
    with _hist_lock:
        if not _histograms:
            from prometheus_client import Histogram

            _histograms["ttft"] = Histogram(
                "kvretain:time_to_first_token_seconds",
                "time from arrival at the API server to the first streamed token, by request priority",
                ["priority"],
                buckets=TTFT_BUCKETS,
            )
            _histograms["e2e"] = Histogram(
                "kvretain:e2e_request_latency_seconds",
                "time from arrival at the API server to the end of the response, by request priority",
                ["priority"],
                buckets=E2E_BUCKETS,
            )
    return _histograms


_GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


PriorityLabels = _runtime.PriorityLabels  # (the rule lives with the engine's counters)
_LABELS = PriorityLabels()  # the histograms' labels, in the API server


class ClassLatency:
    """ASGI middleware: per-priority TTFT and end-to-end histograms of completions and chat completions.

    Put it before :class:`~kvretain.integrations.vllm.middleware.AccessLimits` on the command line (vLLM adds
    each ``--middleware`` outside the previous ones), so it sees the priority the request runs at."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or route_path(scope) not in _GENERATE_PATHS  # (behind --root-path too, as the access limits)
        ):
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        state: dict[str, Any] = {"priority": None, "first": None, "status": 0, "watch": None, "done": False}
        chunks: list[bytes] = []

        async def recv() -> Any:
            msg = await receive()
            if msg.get("type") == "http.request" and state["priority"] is None:
                chunks.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    state["priority"] = _priority_of(b"".join(chunks), scope)
            return msg

        async def snd(msg: Any) -> None:
            if msg["type"] == "http.response.start":
                state["status"] = int(msg.get("status", 0))
                for k, v in msg.get("headers", []):
                    if k.lower() == b"content-type" and b"event-stream" in v:
                        state["watch"] = SSEFirstToken()
            elif (
                msg["type"] == "http.response.body"
                and state["first"] is None
                and state["watch"] is not None
                and state["watch"].feed(msg.get("body", b""))
            ):
                state["first"] = time.monotonic()
            await send(msg)
            # (sent in full: a client gone makes the server's send raise, or cancels the app before its last body)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                state["done"] = True

        try:
            await self.app(scope, recv, snd)
        finally:
            if state["status"] == 200 and state["priority"] is not None:
                h = latency_histograms()
                label = _LABELS.of(state["priority"])
                if state["first"] is not None:
                    h["ttft"].labels(label).observe(state["first"] - t0)
                # NOTE: a response sent in full only: a stream its client left (a client's timeout) is no request's
                # latency; vLLM's own e2e histogram leaves such an aborted request out too (its TTFT, once
                # streamed, counts in both)
                if state["done"]:
                    h["e2e"].labels(label).observe(time.monotonic() - t0)


def _priority_of(raw: bytes, scope: Any) -> int:
    for k, v in scope.get("headers", []):
        if k.lower() == b"x-vllm-priority":
            with contextlib.suppress(ValueError):
                return int(v)
    try:
        body = load_json(raw)  # (a body nested past the parser's depth is one more invalid body: priority 0)
    except ValueError:
        return 0
    return _int_of(body.get("priority", 0)) if isinstance(body, dict) else 0


def _int_of(p: Any) -> int:
    """``p`` as vLLM's request models read their ``priority: int`` (pydantic's lax mode: ``true``, ``3.0`` and
    ``"3"`` run at 1, 3 and 3, and were observed under priority 0); 0 for anything else (vLLM refuses those
    requests, and only a 200 is observed)."""
    if isinstance(p, str):
        with contextlib.suppress(ValueError):
            return int(p)
        with contextlib.suppress(ValueError):
            p = float(p)
    if isinstance(p, float):
        return int(p) if p.is_integer() else 0
    return int(p) if isinstance(p, int) else 0
