"""Block-level cache replay of a Mooncake-format trace.

Each request, in order, looks up its longest run of leading cached blocks and counts those as hits; then
all its blocks are resident (hits touched, misses allocated and cached) and released deepest first. A
request with more blocks than the pool counts its lookups, uses its hits (touched and released) and caches
none of its new blocks. This is the replay behind the
anchors of ``shared/traces/README.md`` (vLLM 0.33's ``BlockPool`` replayed the same way), driven through
kvretain's own :class:`~kvretain.core.block_pool.BlockPool`.

Trace lines follow the one schema of :mod:`kvretain.workloads.mooncake` (shared with ``kvretain
simulate``). A block's identity is its chained hash (:class:`~kvretain.core.hashing.BlockIdHasher`): the
request's hash ids up to it and its ``cache_salt``, hashed as the core chains token blocks, so a hash id
reused under a different parent, or by another tenant, is a different block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvretain.core.block_pool import BlockPool
from kvretain.core.hashing import BlockHash, BlockIdHasher
from kvretain.core.policy import INF, PolicyConfig, make_policy
from kvretain.core.retention import BlockRetention, PriorityMapping, RetentionConfig, check_request_priority
from kvretain.core.stats import CacheStats, ClassStats
from kvretain.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceError, TraceRecord, read_trace
from kvretain.workloads.priority import PriorityRule, tag_priorities

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "ClassStats",
    "ReplayRequest",
    "ReplayResult",
    "TraceError",
    "load_trace",
    "replay",
    "replay_requests",
    "synthetic_conversations",
]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a replay: its blocks' chained hashes (see the module docstring), in order."""

    hashes: tuple[BlockHash, ...]
    timestamp_s: float = 0.0
    input_length: int = 0
    priority: int = 0
    retention: RetentionConfig | None = None

    def __post_init__(self) -> None:
        # (checked when built: a NaN time failed mid-replay as the pool's clock, a dict of retention as an
        # AttributeError)
        t = self.timestamp_s
        if isinstance(t, bool) or not isinstance(t, int | float) or t - t != 0.0:
            raise ValueError(f"ReplayRequest: timestamp_s must be a finite number of seconds, got {t!r}")
        check_request_priority(self.priority, "ReplayRequest: priority")
        if self.retention is not None and not isinstance(self.retention, RetentionConfig):
            raise TypeError(
                f"ReplayRequest: retention must be a RetentionConfig or None, got {type(self.retention).__name__}"
            )


def replay_requests(
    records: Iterable[TraceRecord], hasher: BlockIdHasher | None = None
) -> list[ReplayRequest]:
    """Replay requests of trace records: hash ids chained under each record's ``cache_salt``, each block
    named by its chained hash's key (:meth:`~kvretain.core.hashing.BlockIdHasher.block_keys`)."""
    hasher = hasher or BlockIdHasher()
    keys = hasher.block_keys
    return [
        ReplayRequest(
            tuple(keys(r.hash_ids, r.cache_salt)),
            r.timestamp_ms / 1000.0,
            r.input_length,
            r.priority,
            r.retention,
        )
        for r in records
    ]


def load_trace(
    path: str | Path,
    limit: int | None = None,
    rule: PriorityRule | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> list[ReplayRequest]:
    """Read a Mooncake-format JSONL trace (:func:`~kvretain.workloads.mooncake.read_trace`: the first
    ``limit`` lines, sorted stably by timestamp); ``rule`` (a priority rule) overrides priorities."""
    records = read_trace(path, block_tokens, limit)
    if rule is not None:
        records = tag_priorities(records, rule)
    return replay_requests(records)


@dataclass(slots=True)
class ReplayResult:
    """Totals and per-class statistics (:class:`~kvretain.core.stats.ClassStats`; each hash id is one block
    of ``block_tokens`` tokens, so token counts are block counts times ``block_tokens``). A replay has no
    preemption: every lookup is a first lookup."""

    policy: str
    capacity_blocks: int
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    classes: dict[int, ClassStats] = field(default_factory=dict)
    policy_stats: dict[str, float] = field(default_factory=dict)
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    request_hits: list[int] | None = None
    """Hit blocks of each request, in replay order (``replay(..., record_hits=True)``; else None)."""

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "hit_rate": round(self.hit_rate, 6) if self.blocks else None,  # (no lookup: no ratio)
            "classes": {
                str(k): {
                    **v.to_json(),
                    "blocks": v.query_tokens // self.block_tokens,
                    "hit_blocks": v.hit_tokens // self.block_tokens,
                }
                for k, v in sorted(self.classes.items())
            },
            # the policy's own state at the end (``unified``: its controller's level, target and estimates)
            "policy_stats": {k: round(v, 6) for k, v in self.policy_stats.items()},
        }


def _next_use_oracle(
    requests: Sequence[ReplayRequest],
) -> tuple[Callable[[BlockHash], float], Callable[[int], None]]:
    uses: dict[BlockHash, deque[int]] = {}
    for i, r in enumerate(requests):
        for h in r.hashes:
            q = uses.get(h)
            if q is None:
                uses[h] = q = deque()
            if not q or q[-1] != i:
                q.append(i)
    current = [0]

    def advance(i: int) -> None:
        current[0] = i

    def next_use(h: BlockHash) -> float:
        q = uses.get(h)
        if q is None:
            return INF
        while q and q[0] <= current[0]:
            q.popleft()
        return float(q[0]) if q else INF

    return next_use, advance


def replay(
    requests: Sequence[ReplayRequest],
    capacity_blocks: int,
    policy: str = "lru",
    config: PolicyConfig | None = None,
    mapping: PriorityMapping | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    progress: Callable[[Iterable[int]], Iterable[int]] | None = None,
    check_every: int = 0,
    record_hits: bool = False,
) -> ReplayResult:
    """Replay ``requests`` through a pool of ``capacity_blocks`` blocks under ``policy``.

    ``check_every > 0`` runs the pool's integrity check every that many requests (tests); ``record_hits`` keeps
    each request's hit blocks in :attr:`ReplayResult.request_hits` (to compare two policies request by request).
    """
    if capacity_blocks <= 0:
        raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(
            f"tokens per trace block (--block-tokens) must be an integer >= 1, got {block_tokens!r}"
        )
    mapping = mapping or PriorityMapping()
    cfg = config or PolicyConfig(block_size=block_tokens)
    advance: Callable[[int], None] | None = None
    if policy == "belady":
        next_use, advance = _next_use_oracle(requests)
        cfg = PolicyConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "next_use": next_use})
    pol = make_policy(policy, capacity_blocks, cfg)
    now = [0.0]
    pool = BlockPool(capacity_blocks, pol, clock=lambda: now[0])
    stats = CacheStats(capacity_blocks)  # evictions go to the class of the block's last releaser
    result = ReplayResult(policy, capacity_blocks, classes=stats.by_class, block_tokens=block_tokens)
    pool.on_evict_batch = stats.evicted
    of_class = stats.of
    cached = pool.cached
    indices: Iterable[int] = range(len(requests))
    if progress is not None:
        indices = progress(indices)
    plans: dict[tuple[int, int], BlockRetention] = {}
    hits_of = result.request_hits = [] if record_hits else None
    for idx in indices:
        req = requests[idx]
        now[0] = req.timestamp_s
        if advance is not None:
            advance(idx)
        hashes = req.hashes
        n = len(hashes)
        k = 0
        while k < n and hashes[k] in cached:
            k += 1
        of_class(req.priority).record_lookup(n * block_tokens, k * block_tokens, False)
        if hits_of is not None:
            hits_of.append(k)
        base = mapping.retention_for(req.priority)
        pol.on_lookup(hashes, k, base)
        hit_ids = [cached[hashes[i]] for i in range(k)]
        pool.touch(hit_ids)
        new_ids = pool.get_new_blocks(n - k) if n <= capacity_blocks else None
        if new_ids is None:
            # NOTE: a request longer than the pool (or than what eviction can free) caches none of its new
            # blocks, but its hits are uses, released at its retention like any: left untouched, they kept the
            # keys of their previous release (``belady``'s pointing at this request, now past: kept forever)
            ids = hit_ids
            n = k
        else:
            ids = hit_ids + new_ids
            pool.cache_blocks(ids, hashes, k, n)
        if not ids:
            continue
        if req.retention is None:
            key = (base, req.priority)  # (an empty plan: every block at ``base``, whatever the length)
            plan = plans.get(key)
            if plan is None:
                plan = plans[key] = BlockRetention([], [], None, req.priority, base)
        else:
            prios, durs = req.retention.block_plan(
                len(hashes), block_tokens, req.input_length or len(hashes) * block_tokens, base
            )
            plan = BlockRetention(prios[:n], durs[:n], req.retention.scope, req.priority, base)
        stats.released(ids, req.priority)
        pool.free_blocks(ids, plan)
        if check_every and idx % check_every == 0:
            pool.check_integrity()
    for c in stats.by_class.values():
        result.requests += c.requests
        result.blocks += c.query_tokens // block_tokens
        result.hit_blocks += c.hit_tokens // block_tokens
    result.policy_stats = pol.stats()
    return result


SAMPLE_SESSIONS = 256
"""Sessions of the built-in workload measured by :func:`synthetic_bytes_per_session`."""


def synthetic_bytes_per_session(seed: int = 0) -> float:
    """Bytes one session of :func:`synthetic_conversations` takes (peak traced allocation over a sample)."""
    from kvretain.core.memory import peak_bytes

    peak, _ = peak_bytes(lambda: len(synthetic_conversations(SAMPLE_SESSIONS, seed)))
    return peak / SAMPLE_SESSIONS


def synthetic_conversations(
    num_sessions: int = 400,
    seed: int = 0,
    important_share: float = 0.25,
    mean_turns: float = 4.0,
    system_blocks: int = 2,
    mean_interarrival_s: float = 0.5,
    mean_think_s: float = 60.0,
) -> list[ReplayRequest]:
    """A built-in block-level workload shaped like the Mooncake conversation trace.

    Sessions share a system prompt (blocks ``0..system_blocks-1``); each turn repeats the session's whole
    context and appends new blocks (the user message and the previous answer); think time between turns
    interleaves sessions, so reuse distances are long and the working set exceeds small pools. A session is
    priority 0 (important) with probability ``important_share``, else priority 1. Deterministic in ``seed``.
    """
    import random

    for name, v, lo, open_lo in (
        ("num_sessions", num_sessions, 0, False),
        ("mean_turns", mean_turns, 1, False),
        ("system_blocks", system_blocks, 0, False),
        ("mean_interarrival_s", mean_interarrival_s, 0, True),
        ("mean_think_s", mean_think_s, 0, True),
    ):
        if not (v > lo if open_lo else v >= lo) or not v < INF:  # (also NaN; 0 divided by zero)
            raise ValueError(
                f"synthetic_conversations: {name} must be {'>' if open_lo else '>='} {lo}, got {v!r}"
            )
    if not 0 <= important_share <= 1:
        raise ValueError(
            f"synthetic_conversations: important_share must be in [0, 1], got {important_share!r}"
        )
    rng = random.Random(seed)
    next_id = system_blocks
    events: list[tuple[float, int, list[int], int]] = []
    t = 0.0
    for s in range(num_sessions):
        t += rng.expovariate(1.0 / mean_interarrival_s)
        prio = 0 if rng.random() < important_share else 1
        context = list(range(system_blocks))
        turns = 1 + int(rng.expovariate(1.0 / max(mean_turns - 1.0, 1e-9)))
        ts = t
        for _ in range(turns):
            grow = rng.randint(1, 6)
            context = context + list(range(next_id, next_id + grow))
            next_id += grow
            events.append((ts, s, list(context), prio))
            ts += rng.expovariate(1.0 / mean_think_s)
    events.sort(key=lambda e: (e[0], e[1]))
    hasher = BlockIdHasher()
    return [
        ReplayRequest(tuple(hasher.block_keys(ids)), ts, len(ids) * MOONCAKE_BLOCK_TOKENS, prio)
        for ts, _, ids, prio in events
    ]
