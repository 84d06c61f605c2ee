"""vLLM's free-block queue with the ``unified`` policy at *run* granularity (the plugin's default for ``unified``).

Imported only when the plugin is enabled (it imports vLLM).

Why runs: vLLM frees a finished request's blocks in one call, deepest first, and evicts blocks a hundred at a
time. Ranking every 16-token block on its own costs the scheduler a Python call per block on each of three
paths (cache, release, evict) -- several times what vLLM's own free list costs. :class:`RunFreeQueue` ranks
*runs* instead: the blocks one release makes evictable, deepest first, split where the retention priority or
the use count's power of two changes. A run is keyed and queued as :class:`~kvretain.core.policies.unified.
UnifiedPolicy` keys a block (GreedyDual ``H = L + value`` with the value of the run's tail, the block evicted
first; protected and unprotected tiers; the protection budget with the same
:class:`~kvretain.core.policies.protection.ProtectionController`) and is evicted tail first, so a chain goes as a
unit, as under ``unified``'s chain order. Per block there is only flat-list bookkeeping (content, remembered
retention, use count), done in the release loop; there is no per-block hook at caching. On a plain
full-attention group that loop also does vLLM's ``free_blocks`` (:meth:`RunFreeQueue.free_request`: reference
counts, placing), so freeing a request walks its blocks once, as stock vLLM does.

Rules kept from ``unified``: the highest retention any request asked for a block wins (its owner scope may
lower it); a directive's duration lapses to the highest mapped request priority of its users; use counts are
remembered across eviction for one block per 256 tokens (the ghost table), and the blocks of a 256-token
segment cached together share its count; when the controller changes the tables, every run is keyed again
from the ``L`` of its release (:meth:`RunFreeQueue._rekey`). What differs: there are no per-block parent/child
links. The pool evicts leaves only (a parent waits for its cached child); here a run is evicted tail first, and
within one release a run is ranked at least at its deeper run's key, in that run's tier when it is protected (``_Run.floor``
and ``_Run.up``; ranked again when the deeper run lapses or is evicted from the protected tier). A parent freed
by another request than its child's (one still holding it) sits in a later run with a later key, so it normally
outlives its children, but nothing forbids the opposite (stock vLLM's LRU has the same property).
``KVRETAIN_GRANULARITY=block`` selects the exact per-block ``unified``
(:class:`~kvretain.integrations.vllm._queue.RetentionFreeQueue`).

A run holds its block ids; a block belongs to the run ``_run_of[id]`` names, so a cache hit (``remove``) is
O(1) and the run skips the block lazily when it is evicted. ``num_free_blocks`` stays the total (unhashed
list + runs): cached blocks count as free, and eviction still happens in vLLM's ``BlockPool.get_new_blocks``
(KV events and metrics unchanged).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from operator import attrgetter
from typing import Any

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from kvretain.core.policies import rules
from kvretain.core.policies.lfu import GhostTable
from kvretain.core.policies.protection import ProtectionController, Sighting
from kvretain.core.policies.unified import sample_stride
from kvretain.core.policy import INF, PolicyConfig
from kvretain.core.retention import (
    PriorityMapping,
)
from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm._base import HookedFreeQueue, _priority
from kvretain.integrations.vllm.config import RUN_MAX_USES

NEW = -1
"""Remembered retention of content that no request has released yet."""

_Lapse = tuple[float, int]
"""A block's pending lapse: (expiry, the retention it falls back to: the highest mapped priority of its users)."""


def _retention(
    r: int,
    ent: _Lapse | None,
    owner: str | None,
    ask: int,
    duration_s: float | None,
    scope: str | None,
    now: float,
    mapped: int,
) -> tuple[int, _Lapse | None, str | None, bool]:
    """A block's retention state after one release asking for ``ask`` (:func:`rules.release` on the run queue's
    storage): ``(retention, lapse entry (None: none), owner scope, whether the entry's expiry is new and must be
    scheduled)``. ``r``: its retention before (``NEW``: content no release registered, ``rules.UNSET``), ``ent``
    its lapse entry (None: no directive holds it, its retention is the highest mapped priority of its users). The
    entry returned is ``ent`` itself when unchanged. A function of its arguments only: the release loop reuses
    its result for the next block when the arguments are the same."""
    expiry, base = ent if ent is not None else (INF, r)
    cur, base, expiry, owner = rules.release(r, base, expiry, owner, ask, duration_s, scope, now, mapped)
    if cur == base:
        return cur, None, owner, False
    if ent is not None and ent[0] == expiry and ent[1] == base:
        return cur, ent, owner, False
    return cur, (expiry, base), owner, rules.lapses(cur, base, expiry) and (ent is None or ent[0] != expiry)


class _Run:
    """Blocks that became evictable together, deepest first. ``ids[i:]`` are the ones not yet passed by
    eviction; a block is still in the run while ``_run_of[id] is run`` (``live`` counts those)."""

    __slots__ = (
        "cls",
        "depth",
        "floor",
        "i",
        "ids",
        "key",
        "live",
        "own",
        "r",
        "since",
        "stamp",
        "tier",
        "u",
        "up",
    )

    def __init__(
        self,
        ids: list[int],
        own: float,
        r: int,
        tier: int,
        cls: int,
        depth: int = 0,
        floor: float = 0.0,
        since: float = 0.0,
        u: int = 0,
        stamp: int = 0,
    ) -> None:
        self.ids = ids
        self.i = 0
        self.live = len(ids)  # (a run built in place sets it when it is queued)
        self.own = own  # its own key: ``L`` at its release + the value of its tail (rules.gd_key)
        self.since = since  # that ``L``
        # its tail's use count then (the value's frequency term), for keying it again when the tables change
        self.u = u
        self.key = own if own > floor else floor
        self.r = r
        # 0: protected, 1: not. A run whose deeper run (``floor``) is protected is queued with it, whatever its
        # own retention: the pool evicts leaves only, so a parent is not evictable while its child is cached
        self.tier = tier
        self.cls = cls
        self.depth = depth  # its tail's depth, which ``key`` was valued at (a lapsed block is re-keyed there)
        # the key of the deeper run it must not go before (the pool evicts leaves only: a parent waits for its
        # child, whatever its own key; 0: none): ``key`` is at least this, and so is a lapsed block's new key
        self.floor = floor
        # the shallower run whose key or tier this run lifted (None: none): when this run's blocks lapse or it
        # is evicted from the protected tier, that run is ranked again (:meth:`RunFreeQueue._relift`)
        self.up: _Run | None = None
        # its release's place in the release order (0: not yet stamped; ``_RunQueue.push`` stamps it): a bucket
        # keeps its runs in this order and the tiers compete on (bucket, stamp) (rules.RELEASE_ORDER_WALK); a
        # run re-ranked (a lapse, a lift) keeps its release's stamp
        self.stamp = stamp


class _RunQueue:
    """Runs of one tier by key: buckets ``1 / scale`` of a key unit wide (:func:`rules.buckets_per_key`; in release
    order inside: a run's ``stamp``, from a counter both tiers share), non-empty bucket indices in a heap.
    ``n`` counts live blocks; runs whose blocks all left are dropped lazily, and the buckets are rebuilt when
    dead runs outnumber live ones."""

    __slots__ = ("_buckets", "_slots", "_stamps", "live_runs", "n", "runs", "scale")

    def __init__(self, scale: float, stamps: Iterator[int]) -> None:
        self.scale = scale
        self._stamps = stamps
        self._buckets: dict[int, deque[_Run]] = {}
        self._slots: list[int] = []
        self.n = 0
        self.runs = 0
        self.live_runs = 0

    def push(self, run: _Run) -> None:
        """Queue ``run`` at its release's place in its bucket (a new run: stamped now, the back; O(1), see
        :data:`rules.RELEASE_ORDER_WALK`)."""
        stamp = run.stamp
        if not stamp:
            run.stamp = stamp = next(self._stamps)
        s = int(run.key * self.scale)
        q = self._buckets.get(s)
        if q is None:
            q = self._buckets[s] = deque()
            heapq.heappush(self._slots, s)
            q.append(run)
        elif not q or q[-1].stamp < stamp:
            q.append(run)
        else:
            q.insert(rules.release_order_place(len(q), stamp, lambda i: q[i].stamp), run)
        self.n += run.live
        self.runs += 1
        self.live_runs += 1

    def died(self) -> None:
        """A run of this queue lost its last block."""
        self.live_runs -= 1
        if self.runs > 2 * self.live_runs + 1024:
            kept: dict[int, deque[_Run]] = {}
            for s, q in self._buckets.items():
                live = deque(r for r in q if r.live)
                if live:
                    kept[s] = live
            self._buckets = kept
            self._slots = sorted(kept)
            self.runs = self.live_runs

    def head(self) -> _Run:
        """The first run with live blocks; the queue must not be empty (``n > 0``)."""
        buckets = self._buckets
        slots = self._slots
        while True:
            s = slots[0]
            q = buckets[s]
            while q:
                run = q[0]
                if run.live:
                    return run
                q.popleft()
                self.runs -= 1
            del buckets[s]
            heapq.heappop(slots)

    def ordered(self) -> list[_Run]:
        """The runs with live blocks in the order :meth:`head` would return them (bucket, then FIFO)."""
        buckets = self._buckets
        return [run for s in sorted(buckets) for run in buckets[s] if run.live]

    def live(self) -> Iterator[_Run]:
        for q in self._buckets.values():
            for run in q:
                if run.live:
                    yield run


class _Release:
    """What one request's release carries across its groups: who releases (``prio``, its class; ``mapped``, its
    retention), how (``scope``; ``slow``: directives or a scope, the full rules per block; ``freeing_now``;
    ``fused``: the release also does vLLM's ``free_blocks``, see :meth:`RunFreeQueue.free_request`), the runs it
    built, the unhashed blocks whose last reference went (``first``, fused only), and its counts (blocks seen,
    skipped as unhashed, ``other``: not new content on the fast path, newly protected ones among those). On an
    error, ``group`` and ``pending`` say where it stopped: blocks ``pending`` down to 0 of that group, and every
    later group, were not freed; ``pushed``: how many of its runs were queued."""

    __slots__ = (
        "first",
        "freeing_now",
        "fused",
        "group",
        "mapped",
        "new_protected",
        "now",
        "other",
        "pending",
        "prio",
        "pushed",
        "runs",
        "scope",
        "skipped",
        "slow",
        "total",
    )

    def __init__(
        self,
        prio: int,
        mapped: int,
        scope: str | None,
        slow: bool,
        freeing_now: bool,
        now: float,
        fused: bool = False,
    ) -> None:
        self.prio = prio
        self.mapped = mapped
        self.scope = scope
        self.slow = slow
        self.freeing_now = freeing_now
        self.fused = fused
        self.now = now
        self.runs: list[_Run] = []
        self.first: list[KVCacheBlock] = []
        self.total = 0
        self.skipped = 0
        self.other = 0
        self.new_protected = 0
        self.group = 0
        self.pending = -1
        self.pushed = 0  # runs _place has queued (or skipped as empty)


class _Building:
    """A group's release in progress, handed from the new-content path to the general one: the run being built
    (``cur``, its split ``tag`` = retention * 16 + log2 of the use count) and the 256-token segment of the last
    new block (first depth ``seg``, use count ``su``, the tag of new content in it ``stag``)."""

    __slots__ = ("cur", "linked", "seg", "stag", "su", "tag")

    def __init__(self, n: int, stag: int) -> None:
        self.seg = n
        self.su = 1
        self.stag = stag
        self.tag = -1
        self.cur: _Run | None = None
        self.linked = True  # (a parent's run is lifted to its child's: see RunFreeQueue._release_group)


class _Directed:
    """The full retention rules (:func:`_retention`) per block of a release with directives or a scope, writing
    the run queue's arrays: retention, lapse entries (and the lapses to schedule), owner scopes; counts the
    blocks it makes protected or unprotected (``new_protected``, placed with the release). The blocks of one
    directive's range mostly share their state (their lapse entry is one object, set by one earlier release),
    so the rules' outcome for the block before is reused when the inputs are the same."""

    __slots__ = (
        "_asks",
        "_due_at",
        "_durs",
        "_lapse",
        "_mapped",
        "_memo",
        "_now",
        "_out",
        "_owners",
        "_rr",
        "_scope",
        "_thr",
        "new_protected",
    )

    def __init__(
        self, queue: RunFreeQueue, rel: _Release, plan: tuple[list[int], list[float | None]] | None
    ) -> None:
        self._rr, self._lapse, self._owners, self._due_at = (
            queue._r,
            queue._lapse,
            queue._owner,
            queue._due_at,
        )
        self._thr = queue._threshold
        self._asks: list[int] | None = plan[0] if plan is not None else None
        self._durs: list[float | None] | None = plan[1] if plan is not None else None
        self._mapped, self._scope, self._now = rel.mapped, rel.scope, rel.now
        # the last inputs (retention, lapse entry, ask, duration, owner) and their outcome (retention, lapse
        # entry, owner, the protected count's change, the list its lapse is due in)
        self._memo: tuple[int, _Lapse | None, int, float | None, str | None] = (NEW - 1, None, -1, None, None)
        self._out: tuple[int, _Lapse | None, str | None, int, list[int] | None] = (NEW, None, None, 0, None)
        self.new_protected = 0

    def __call__(self, bid: int, i: int, r: int) -> int:
        """Block ``bid`` (``i``: its position in the group, for the plan's ask) at retention ``r`` released:
        its retention after."""
        asks, durs = self._asks, self._durs
        ask, dur = (self._mapped, None) if asks is None or durs is None else (asks[i], durs[i])
        lapse, owners = self._lapse, self._owners
        ent = lapse.get(bid)
        own = owners.get(bid) if owners else None
        m_r, m_ent, m_ask, m_dur, m_own = self._memo
        if (
            r != m_r or ent is not m_ent or ask != m_ask or dur != m_dur or own != m_own
        ):  # (the entry: by identity)
            self._memo = (r, ent, ask, dur, own)
            nr, nent, nown, due = _retention(r, ent, own, ask, dur, self._scope, self._now, self._mapped)
            thr = self._thr
            dp = 0 if (r >= thr) == (nr >= thr) else 1 if nr >= thr else -1
            self._out = (nr, nent, nown, dp, self._due_at(nent[0]) if due and nent is not None else None)
        nr, nent, nown, dp, due_list = self._out
        if nown is not None:
            owners[bid] = nown
        elif own is not None:  # an unscoped request set the level: no owner any more
            del owners[bid]
        if nent is not None:
            if nent is not ent:
                lapse[bid] = nent
                if due_list is not None:
                    due_list.append(bid)
        elif ent is not None:
            del lapse[bid]
        self.new_protected += dp
        self._rr[bid] = nr
        return nr


class RunFreeQueue(HookedFreeQueue):
    """A drop-in ``FreeKVCacheBlockQueue`` whose hashed blocks are ordered by ``unified`` over runs."""

    __slots__ = (  # (see HookedFreeQueue)
        "_F",
        "_L",
        "_cap",
        "_cls",
        "_cost_per_block",
        "_ctl",
        "_due",
        "_expiries",
        "_ghost",
        "_gone",
        "_index",
        "_lapse",
        "_lapse_limit",
        "_news",
        "_nones",
        "_num_protected",
        "_owner",
        "_pending",
        "_queues",
        "_r",
        "_rekeys",
        "_run_of",
        "_sampled",
        "_seq",
        "_stamps",
        "_stride",
        "_stripped",
        "_threshold",
        "_ub",
        "_uses",
        "_wait",
        "_weight",
        "config",
    )

    def __init__(
        self,
        free_blocks: list[KVCacheBlock],
        pool_blocks: Sequence[KVCacheBlock],
        config: PolicyConfig,
        mapping: PriorityMapping,
    ) -> None:
        super().__init__(free_blocks, pool_blocks, mapping)
        self.config = config
        cfg = config
        self._threshold = cfg.protect_threshold
        # (use counts are bytes here: the plugin's config refuses a larger frequency_cap)
        self._cap = min(cfg.frequency_cap, RUN_MAX_USES)
        self._cost_per_block = rules.cost_per_block(cfg)
        self._stride = sample_stride(cfg.block_size)
        self._ub = [u.bit_length() for u in range(self._cap + 1)]  # runs split where this changes
        # vLLM's hash index entry of a key (see :meth:`set_index`); None: unknown (every sampled victim writes
        # its ghost entry)
        self._index: Callable[[Any], Any] | None = None
        # the blocks one ``evict_blocks`` call has taken so far (:meth:`forget`, only with an index): vLLM's index
        # lists them until the call ends, but they no longer hold their content (:meth:`end_forget` clears it)
        self._gone: set[int] = set()
        self._reset_state()

    def set_index(self, entry: Callable[[Any], Any] | None) -> None:
        """``entry(key)``: what vLLM's hash index (``BlockPool.cached_block_hash_to_block``, a
        ``BlockHashToBlockMap``) holds under ``key`` now: None, a block, or a dict of blocks by id (vLLM registers
        content that two requests computed at once twice). Read only where a sampled block's use count would go to
        the ghost table, so that a copy evicted while another block still holds its content leaves no entry (the
        content leaves with its last copy, as core's ``GhostTable.enter`` / ``leave``)."""
        self._index = entry

    def _held_elsewhere(self, h: Any, bid: int) -> bool:
        """Whether a block other than ``bid`` still holds content ``h`` in vLLM's index and keeps it past this
        eviction: in use, or queued. vLLM strips a victim's hash after the queue let it go (``popleft_n``
        returns, ``evict_blocks`` calls :meth:`forget` first), so the index still lists ``bid`` and the blocks
        taken before it in the same eviction: ``popleft_n``'s are neither in use nor queued any more (their run
        is cleared before this is asked); ``evict_blocks`` also strips blocks in use, so the blocks its call has
        taken so far are excluded by id (``_gone``): of the copies one call takes, the last one taken writes the
        entry, in use or not."""
        entry = self._index(h) if self._index is not None else None
        if entry is None:
            return False
        run_of = self._run_of
        gone = self._gone
        for b in entry.values() if isinstance(entry, dict) else (entry,):
            o = b.block_id
            if o != bid and (b.ref_cnt > 0 or run_of[o] is not None) and o not in gone:
                return True
        return False

    def _reset_state(self) -> None:
        n = len(self.pool_blocks)
        cfg = self.config
        self._run_of: list[_Run | None] = [None] * n
        # remembered retention priority (highest wins); NEW while the queue knows no content in the block (it
        # registers content at its first release and forgets it when the block is evicted). NOTE: no hash per
        # block: holding the hash object would touch its reference count, a cache miss per block on every
        # path; the ghost reads the hash from vLLM's block when a sampled block is evicted.
        # NOTE: lists, not byte arrays: CPython's specialized list subscripts make the release and eviction loops
        # 10-15% faster in vLLM's scheduler step (measured), for 8 bytes per block instead of 1
        self._r = [NEW] * n
        self._news = [NEW] * n  # (slices of these clear the state of an evicted id range)
        self._nones: list[_Run | None] = [None] * n
        # a block another request still held when a release queued its child: that child's run and the block's
        # hash then (the entry is stale once the hash differs), so that the release that frees the block ranks it
        # behind its child (the pool evicts leaves only; this is the only link across releases)
        self._wait: list[tuple[_Run, Any] | None] = [None] * n
        self._uses = [0] * n
        self._sampled = bytearray(n)  # the ghost keeps this block's count (one block per 256 tokens)
        # request priority of the block's last releaser (set by each release that does not queue the block), for
        # blocks placed by append_n and blocks in use (queued blocks count evictions under their run's class; a hit
        # takes that class out of the run with the block)
        self._cls = [0] * n
        # blocks whose retention a directive set away from the highest mapped priority of their users:
        # id -> (expiry (INF: none), that mapped priority (what a lapse falls back to))
        self._lapse: dict[int, _Lapse] = {}
        self._owner: dict[int, str] = {}
        # pending lapses, one entry per release and expiry time: (time, sequence, the ids it set to lapse then);
        # an id whose lapse entry no longer names that time is skipped (a later release moved or ended it).
        # NOTE: one heap entry per block cost a push and a pop of a ~100k-entry heap per block a directive holds
        # (a directive on a whole agent prompt: most of the plugin's step time on the multi-tenant traces)
        self._expiries: list[tuple[float, int, list[int]]] = []
        self._pending = 0  # ids in _expiries' lists (live or stale)
        self._lapse_limit = rules.lapse_limit(0)  # compact _expiries past this many ids
        self._seq = 0
        self._due: dict[float, list[int]] = {}  # the lapses the release in progress set, by time (see _post)
        scale = rules.buckets_per_key(cfg)
        self._stamps = stamps = itertools.count(1)
        self._queues = (_RunQueue(scale, stamps), _RunQueue(scale, stamps))  # 0: protected, 1: unprotected
        self._held = 0  # blocks in runs (the rest of num_free_blocks is vLLM's list of unhashed blocks)
        self._num_protected = 0  # cached blocks whose retention is protected
        self._L = 0.0
        self._ghost = GhostTable(math.ceil(cfg.ghost_factor * self.capacity / self._stride))
        self._ctl = ProtectionController(self.capacity, cfg)
        self._weight = self._ctl.weights
        self._F = self._ctl.frequency
        self._rekeys = 0  # times the tables changed and every run was keyed again (stats)
        self._expect = -1  # blocks the fused release placed for the next append_n (-1: none)
        self._stripped = False  # evict_blocks took a hash from a block in use: num_cached is not trusted

    # ------------------------------------------------------------ runs
    def _value(self, r: int, uses: int, depth: int) -> float:
        return rules.value(self._weight[r], self._F[uses], depth, self._cost_per_block)

    def _push_run(
        self,
        ids: list[int],
        r: int,
        depth: int,
        cls: int,
        floor: float = 0.0,
        below: int = 1,
        since: float | None = None,
        stamp: int = 0,
    ) -> _Run:
        """Queue ``ids`` (deepest first, all at retention ``r``) as one run keyed by its tail at ``depth``, at
        least at ``floor``, the key of a deeper run in tier ``below`` (see :meth:`_lifted`), from the ``L`` of
        their release (``since``; None: released now) and at its place in the release order (``stamp``; 0: now)."""
        tier, floor = self._lifted(r, floor, below)
        u = self._uses[ids[0]]
        L = self._L if since is None else since
        run = _Run(ids, L + self._value(r, u, depth), r, tier, cls, depth, floor, L, u, stamp)
        run_of = self._run_of
        for bid in ids:
            run_of[bid] = run
        self._queues[tier].push(run)
        return run

    def _lifted(self, r: int, floor: float, below: int) -> tuple[int, float]:
        """The tier and floor of a run at retention ``r`` above a deeper run keyed ``floor`` in tier ``below``
        (``floor`` 0: none). The pool evicts leaves only: a parent waits for its cached child, so it is ranked
        at least at the child's key in the child's tier when that tier is evicted after its own (a protected
        child lifts an unprotected parent into the protected tier); a child in a tier evicted before its
        parent's constrains nothing."""
        tier = 0 if r >= self._threshold else 1
        if floor > 0.0 and below <= tier:
            return below, floor
        return tier, 0.0

    def _relift(self, run: _Run | None, floor: float, below: int) -> _Run | None:
        """Rank ``run`` (and the runs it lifted in turn) again now that its deeper run is keyed ``floor`` in tier
        ``below`` (``floor`` 0: gone): at its own key, at least at that floor where :meth:`_lifted` says so. Its
        blocks move to a new run (a run's key is fixed while it is queued, but for :meth:`_rekey`, which rebuilds
        the queues), which is returned (``run`` itself when its rank stands; None when it has no blocks left)."""
        run_of = self._run_of
        first: _Run | None = None
        while run is not None and run.live:
            tier, fl = self._lifted(run.r, floor, below)
            key = run.own if run.own > fl else fl
            if key == run.key and tier == run.tier:
                return first or run
            ids = [bid for bid in run.ids[run.i :] if run_of[bid] is run]
            q = self._queues[run.tier]
            q.n -= run.live
            run.live = 0
            q.died()
            new = _Run(ids, run.own, run.r, tier, run.cls, run.depth, fl, run.since, run.u, run.stamp)
            new.up = run.up
            for bid in ids:
                run_of[bid] = new
            self._queues[tier].push(new)
            if first is None:
                first = new
            floor, below, run = new.key, tier, run.up
        return first

    def _open_run(
        self, r: int, u: int, depth: int, cls: int, deeper: _Run | None, waiting: _Run | None
    ) -> _Run:
        """The run a release opens at retention ``r`` for its block at ``depth`` with use count ``u``, above the
        run it just built (``deeper``; None: none), or above ``waiting``, the run of a child an earlier release
        queued behind this block. A parent never goes before the deeper blocks it leads to (the pool evicts
        leaves only: their chain goes at the deepest one's key), nor after its own lapse: the deeper run's key is
        its floor, in its tier (:meth:`_lifted`); each of those runs ranks it again when it is re-ranked."""
        tier, floor = (
            self._lifted(r, deeper.key, deeper.tier) if deeper is not None else self._lifted(r, 0.0, 1)
        )
        if waiting is not None and (waiting.tier < tier or (waiting.tier == tier and waiting.key > floor)):
            tier, floor = waiting.tier, waiting.key
        L = self._L
        run = _Run([], L + self._value(r, u, depth), r, tier, cls, depth, floor, L, u)
        if deeper is not None:
            deeper.up = run  # (ranked again when its blocks lapse or it leaves tier 0)
        if waiting is not None:
            waiting.up = run
        return run

    def _enqueue(self, ids: list[int]) -> None:
        """Queue blocks (deepest first) from their per-block state: one run per stretch of equal retention,
        use-count power of two and releasing class. (The slow path: ``append_n`` without a fused release,
        lapses.)"""
        if not ids:
            return
        rr = self._r
        uses = self._uses
        ub = self._ub
        cls = self._cls
        start = 0
        first = ids[0]
        cur = (rr[first], ub[uses[first]], cls[first])
        for j in range(1, len(ids)):
            bid = ids[j]
            key = (rr[bid], ub[uses[bid]], cls[bid])
            if key != cur:
                self._push_run(ids[start:j], cur[0], 0, cur[2])
                start = j
                cur = key
        self._push_run(ids[start:], cur[0], 0, cur[2])

    def _take_from_list(self, run: _Run) -> None:
        """``run`` lost one block that is still counted in its queue (the caller cleared ``_run_of``)."""
        run.live -= 1
        q = self._queues[run.tier]
        q.n -= 1
        if not run.live:
            q.died()

    # ------------------------------------------------------------ queue interface
    def _next_run(self) -> tuple[_RunQueue, _Run]:
        """The run eviction takes from next, and its queue: the unprotected tier's head while the protected tier
        holds at most its target (or nothing else is queued); over the target the two tiers compete on their
        heads' key buckets, then on release order (:data:`rules.RELEASE_ORDER_WALK`)."""
        q0, q1 = self._queues
        if q1.n and (self._num_protected <= self._ctl.target or not q0.n):
            return q1, q1.head()
        if q0.n and q1.n:
            r0 = q0.head()
            r1 = q1.head()
            s0 = int(r0.key * q0.scale)
            s1 = int(r1.key * q0.scale)
            return (q0, r0) if s0 < s1 or (s0 == s1 and r0.stamp < r1.stamp) else (q1, r1)
        return q0, q0.head()

    def _evict(self, k: int, now: float) -> list[int]:
        """Take ``k`` blocks from the heads of the run queues (their ids, in eviction order), after lapsing the
        directives due by ``now``: each block's state is cleared, its use count kept in the ghost table."""
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)
        ids: list[int] = []
        run_of = self._run_of
        rr = self._r
        sampled = self._sampled
        uses = self._uses
        put = self._ghost.put
        ghost = self._ghost.capacity > 0  # (else ``put`` keeps nothing)
        elsewhere = self._held_elsewhere
        nones = self._nones
        news = self._news
        blocks = self.pool_blocks
        lapse = self._lapse
        owner = self._owner
        get = self.counters.get
        thr = self._threshold
        next_run = self._next_run
        while k:
            q, run = next_run()
            # NOTE: hot path (one iteration per evicted block): locals only
            rids = run.ids
            i = run.i
            m = len(rids)
            if run.live == m - i:  # no block left the rest of the run: take the next ones as they are
                taken = k if k < run.live else run.live
                chunk = rids[i : i + taken] if i or taken < m else rids
                i += taken
            else:  # skip the blocks that left it (cache hits)
                chunk = []
                while i < m and len(chunk) < k:
                    bid = rids[i]
                    i += 1
                    if run_of[bid] is run:
                        chunk.append(bid)
                taken = len(chunk)
            if ghost:
                for bid in chunk:
                    run_of[bid] = None
                    if sampled[bid]:
                        # (a copy evicted while another block keeps the content leaves no entry; the last
                        # copy writes its own count)
                        h = blocks[bid]._block_hash
                        if not elsewhere(h, bid):
                            put(h, uses[bid])
                        sampled[bid] = 0
                    rr[bid] = NEW
            elif taken and max(chunk) - min(chunk) + 1 == taken:
                # NOTE: a run's blocks are distinct, so a chunk that spans ``taken`` ids is exactly the id range
                # (38% of the chunks of bench/vllm_plugin.py's pops with the ghost off); its per-block state is
                # cleared by two slice assignments (without a ghost, ``_sampled`` is unused)
                lo = min(chunk)
                run_of[lo : lo + taken] = nones[:taken]
                rr[lo : lo + taken] = news[:taken]
            else:
                for bid in chunk:
                    run_of[bid] = None
                    rr[bid] = NEW
            ids.extend(chunk)
            if lapse or owner:
                for bid in chunk:
                    lapse.pop(bid, None)
                    owner.pop(bid, None)
            run.i = i
            run.live -= taken
            q.n -= taken
            k -= taken
            if run.key > self._L:
                self._L = run.key
            if run.r >= thr:
                self._num_protected -= taken
            get(run.cls).evicted_blocks += taken
            if not run.live:
                q.died()
                up = run.up
                if up is not None and run.tier == 0 and up.live and up.tier < (0 if up.r >= thr else 1):
                    # the protected child it waited for is gone: the pool now exposes the parent in its own
                    # tier, at its own key
                    self._relift(up, 0.0, 1)
        return ids

    def remove(self, block: KVCacheBlock) -> None:
        """A free block leaves the queue (a cache hit): ``_leave`` and ``_take_from_list`` inlined (hot: every
        hit block of every admission)."""
        bid = block.block_id
        run = self._run_of[bid]
        if run is None:
            super(HookedFreeQueue, self).remove(block)
            return
        self._run_of[bid] = None
        self._cls[bid] = run.cls  # (its last releaser, should evict_blocks take it while in use)
        self._held -= 1
        self.num_free_blocks -= 1
        run.live -= 1
        q = self._queues[run.tier]
        q.n -= 1
        if not run.live:
            q.died()

    def _take_out(self, bid: int) -> bool:
        run = self._run_of[bid]
        if run is None:
            return False
        self._run_of[bid] = None
        self._take_from_list(run)
        return True

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        if self._placed_by_release(len(blocks)):
            return
        plain: list[KVCacheBlock] = []
        todo: list[int] = []
        run_of = self._run_of
        rr = self._r
        held = 0
        for b in blocks:
            bid = b.block_id
            if run_of[bid] is not None:  # placed by the fused release in on_request_release
                held += 1
                continue
            if b._block_hash is None:
                plain.append(b)
                continue
            held += 1
            if rr[bid] == NEW:  # never released: register it at the default retention of its class
                self._register(bid)
                self._set_retention(bid, self._mapped_for(self._cls[bid]))
            todo.append(bid)
        self._enqueue(todo)
        self._held += held
        self.num_free_blocks += held
        if plain:
            super().append_n(plain)

    def _eviction_order(self) -> Iterator[int]:
        # what _evict takes when asked for every block at once (a whole run per choice), without taking it
        now = _runtime.now()
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)  # (what the next eviction would do first; L is unchanged until then)
        run_of = self._run_of
        tiers = [q.ordered() for q in self._queues]  # 0: protected, 1: unprotected
        pos = [0, 0]
        protected = self._num_protected
        target = self._ctl.target
        while True:
            r0 = tiers[0][pos[0]] if pos[0] < len(tiers[0]) else None
            r1 = tiers[1][pos[1]] if pos[1] < len(tiers[1]) else None
            if r1 is not None and (protected <= target or r0 is None):
                t = 1
            elif r0 is not None and r1 is not None:
                # over the protected target: the tiers compete on their keys' buckets, then their FIFO place
                s0 = int(r0.key * self._queues[0].scale)
                s1 = int(r1.key * self._queues[0].scale)
                t = 0 if s0 < s1 or (s0 == s1 and r0.stamp < r1.stamp) else 1
            elif r0 is not None:
                t = 0
            else:
                return
            run = r0 if t == 0 else r1
            assert run is not None
            pos[t] += 1
            if run.r >= self._threshold:
                protected -= run.live
            for bid in run.ids[run.i :]:
                if run_of[bid] is run:
                    yield bid

    def _holds(self, bid: int) -> bool:
        return self._run_of[bid] is not None

    def _held_ids(self) -> set[int]:
        run_of = self._run_of
        return {
            bid for q in self._queues for run in q.live() for bid in run.ids[run.i :] if run_of[bid] is run
        }

    # ------------------------------------------------------------ per-block state
    def _segment_uses(self, blocks: Sequence[KVCacheBlock], seg: int) -> int:
        """The use count, after this release, of new content in the 256-token segment that starts at depth
        ``seg``: the count the ghost remembers for the segment's head (when the head is new content too, which
        makes it the segment's sampled block), plus this use."""
        head = blocks[seg]
        hh = head._block_hash
        hid = head.block_id
        if hh is None or self._r[hid] != NEW:
            return 1
        self._sampled[hid] = 1
        return min(1 + self._ghost.take(hh), self._cap)

    def _register(self, bid: int) -> None:
        """New content in ``bid`` that no release registered (placed by ``append_n``; its depth is unknown, so it
        counts as a segment head for the ghost), not used yet."""
        self._uses[bid] = 0
        self._sampled[bid] = 1

    def _set_retention(self, bid: int, r: int) -> None:
        old = self._r[bid]
        thr = self._threshold
        if (old >= thr) != (r >= thr):
            self._num_protected += 1 if r >= thr else -1
        self._r[bid] = r

    def _retain(
        self, bid: int, retention: int, duration_s: float | None, scope: str | None, now: float, mapped: int
    ) -> int:
        """One release of ``bid`` asking for ``retention`` (a directive, or the mapped request priority) for
        ``duration_s``; returns the block's retention after it. The rules of ``UnifiedPolicy.release``."""
        rr = self._r
        r = rr[bid]
        lapse = self._lapse
        ent = lapse.get(bid)
        owners = self._owner
        cur, nent, owner, due = _retention(
            r, ent, owners.get(bid) if owners else None, retention, duration_s, scope, now, mapped
        )
        if owner is not None:
            owners[bid] = owner
        elif owners:
            owners.pop(bid, None)
        if nent is not None:
            lapse[bid] = nent
            if due:
                self._due_at(nent[0]).append(bid)
        elif ent is not None:
            del lapse[bid]
        self._set_retention(bid, cur)
        return cur

    def _due_at(self, t: float) -> list[int]:
        """The list of ids whose lapse the release in progress set at time ``t``."""
        due = self._due.get(t)
        if due is None:
            due = self._due[t] = []
        return due

    def _post(self) -> None:
        """Schedule the lapses the release just done set: one heap entry per expiry time."""
        exp = self._expiries
        for t, ids in self._due.items():
            self._seq += 1
            heapq.heappush(exp, (t, self._seq, ids))
            self._pending += len(ids)
        self._due.clear()
        if self._pending > self._lapse_limit:
            self._compact_lapses()

    def _compact_lapses(self) -> None:
        """Drop the ids of scheduled lapses that would lapse nothing (a later release moved the block's expiry,
        or the block was evicted), and the entries left empty: see :func:`rules.lapse_limit`. What is kept keeps
        its order (entries by time and sequence, ids within one as they were)."""
        lapse = self._lapse
        kept: list[tuple[float, int, list[int]]] = []
        n = 0
        for t, seq, ids in self._expiries:
            live = [bid for bid in ids if (ent := lapse.get(bid)) is not None and ent[0] == t]
            if live:
                kept.append((t, seq, live))
                n += len(live)
        heapq.heapify(kept)
        self._expiries[:] = kept
        self._pending = n
        self._lapse_limit = rules.lapse_limit(n)

    def _expire(self, now: float) -> None:
        """Lapse the directives whose duration ran out by ``now``: each block falls back to the highest mapped
        priority of its users and, where that moves it, leaves its run for one at its new retention."""
        exp = self._expiries
        lapse = self._lapse
        # queued blocks that fell, by run, new retention and use-count bucket (what a run's blocks share)
        moved: dict[tuple[_Run, int, int], list[int]] = {}
        # NOTE: one iteration per lapsing block (a directive on a whole prompt: hundreds at once): _set_retention
        # and _take_from_list inlined, and the group of the block before reused (a run's blocks lapse together)
        rr = self._r
        run_of = self._run_of
        ub = self._ub
        uses = self._uses
        queues = self._queues
        thr = self._threshold
        protected = 0
        last: tuple[_Run, int, int] | None = None
        group: list[int] = []
        try:
            while exp and exp[0][0] <= now:
                t, _, ids = heapq.heappop(exp)
                self._pending -= len(ids)
                for bid in ids:
                    ent = lapse.get(bid)
                    if ent is None or ent[0] != t:
                        continue
                    del lapse[bid]
                    base = ent[1]
                    if (rr[bid] >= thr) != (base >= thr):
                        protected += 1 if base >= thr else -1
                    rr[bid] = base
                    run = run_of[bid]
                    if run is not None and run.r != base:  # requeue it at its fallen retention
                        run_of[bid] = None
                        run.live -= 1
                        q = queues[run.tier]
                        q.n -= 1
                        if not run.live:
                            q.died()
                        key = (run, base, ub[uses[bid]])
                        if key != last:
                            last = key
                            group = moved.setdefault(key, [])
                        group.append(bid)
        finally:
            self._num_protected += protected
        if moved:
            self._requeue_lapsed(moved)

    def _requeue_lapsed(self, moved: dict[tuple[_Run, int, int], list[int]]) -> None:
        """Queue the blocks that just lapsed out of their runs (by run, new retention and use-count bucket) as new
        runs at their fallen retention, children before parents, and rank again the runs they lifted."""
        # per run, its lapsed blocks by new retention and use bucket
        groups: dict[_Run, list[list[int]]] = {}
        for (run, _, _), ids in moved.items():
            groups.setdefault(run, []).append(ids)
        # children before parents (a run's parent is shallower), so that a parent whose child lapsed with it is
        # ranked behind the child's new runs, not behind the key and tier the child had before its lapse
        # a run's lapsed child's highest new key and its tier; that child's new runs (linked to this run's first)
        below_of: dict[_Run, tuple[float, int]] = {}
        ups_of: dict[_Run, list[_Run]] = {}
        for run in sorted(groups, key=lambda x: -x.depth):
            floor, below = below_of.get(run, (run.floor, run.tier))
            news: list[_Run] = []
            ordered = groups[run]
            if len(ordered) > 1 or len(ordered[0]) > 1:
                # deepest first, as they were in their run (a parent never before its child)
                position = {b: k for k, b in enumerate(run.ids)}
                for ids in ordered:
                    ids.sort(key=position.__getitem__)
                ordered.sort(key=lambda g: position[g[0]])
            for ids in ordered:
                # keyed from its release's L, as if released at its fallen retention (rules.gd_key)
                new = self._push_run(
                    ids, self._r[ids[0]], run.depth, run.cls, floor, below, run.since, run.stamp
                )
                news.append(new)
                floor, below = new.key, new.tier  # (the run's shallower blocks wait for its deeper ones)
            for child in ups_of.pop(run, ()):
                child.up = news[0]
            up = run.up
            if not run.live and up is not None:
                # every block of the run lapsed: the run it lifted is ranked above them again (a lapse that
                # lowers a child lowers the parent waiting for it; one that raises it raises the parent)
                top = max(news, key=lambda x: (x.key, -x.tier))
                if up in groups:  # (it lapsed too: its new runs take this floor)
                    below_of[up] = (top.key, top.tier)
                    ups_of[up] = news
                parent = self._relift(up, top.key, top.tier)  # (what is left of it)
                for new in news:
                    new.up = parent

    def _drop(self, bid: int, cls: int | None = None) -> None:
        """``bid``'s content goes without a ``popleft`` (``evict_blocks``: vLLM removes its hash, a ``BlockRemoved``
        event), counted as evicted under ``cls`` (its run's class) or else its last releaser's. Content no release
        registered (in use since vLLM cached it: a KV connector's failed load) is counted too, as the per-block
        queue counts it: under the class that last released that block id (no request has released it yet)."""
        self.counters.get(self._cls[bid] if cls is None else cls).evicted_blocks += 1
        self._let_go(bid, self.pool_blocks[bid]._block_hash)

    def _let_go(self, bid: int, h: Any) -> None:
        """Content ``h`` leaves ``bid``: its use count to the ghost (a sampled block, the content's last copy), its
        retention, lapse and owner forgotten; the block is unknown (``NEW``) until a release registers new content."""
        if self._r[bid] == NEW:
            return
        if self._sampled[bid]:
            if h is not None and not self._held_elsewhere(h, bid):
                self._ghost.put(h, self._uses[bid])
            self._sampled[bid] = 0
        if self._r[bid] >= self._threshold:
            self._num_protected -= 1
        self._r[bid] = NEW
        self._lapse.pop(bid, None)
        self._owner.pop(bid, None)

    def content_replaced(self, block: KVCacheBlock, old: Any) -> None:
        """vLLM gave ``block`` (in use by a running request) a new hash in place of ``old`` without evicting it: a
        partial prefix-cache entry grown or promoted to the full block (``BlockPool.cache_partial_block`` /
        ``cache_full_blocks``, hybrid layouts that hash inside a block). The entries for ``old`` are gone from
        vLLM's index, so the old content leaves the block as a drop (no eviction counted), as the per-block queue
        lets it go: its use count and the retention its releasers gave it do not pass to the new content."""
        bid = block.block_id
        if self._run_of[bid] is None:  # (a queued block gets no new hash: vLLM writes blocks in use)
            self._let_go(bid, old)

    # ------------------------------------------------------------ hooks called by the patches
    def _release(
        self,
        request: Any,
        groups: Sequence[Sequence[KVCacheBlock]],
        block_sizes: Sequence[int] | None,
        freeing_now: bool,
        num_cached: Sequence[int] | None,
        free_blocks: Callable[[list[KVCacheBlock]], None] | None = None,
        *,
        first: Sequence[int] | None = None,
        group_ids: Sequence[int] | None = None,
    ) -> None:
        """``free_blocks`` (fused, see :meth:`free_request`): vLLM's ``BlockPool.free_blocks`` of this pool;
        ``first``, ``group_ids``: see :meth:`on_request_release`."""
        if freeing_now:
            self._expect = -1
        prio = _priority(request)
        fused = free_blocks is not None
        rel = _Release(prio, self._mapped_for(prio), None, False, freeing_now, _runtime.now(), fused)
        rel.pending = len(groups[0]) - 1 if groups else -1  # (nothing freed yet)
        completed = False
        try:
            _, _, ret, rel.scope, use_plan = self._request_retention(request, block_sizes)
            rel.slow = use_plan or rel.scope is not None
            for g, blocks in enumerate(groups):
                rel.group = g
                rel.pending = len(blocks) - 1
                if not blocks:
                    continue
                plan = None
                if use_plan:
                    assert ret is not None and block_sizes is not None
                    plan = ret.block_plan(len(blocks), block_sizes[g], request.num_prompt_tokens, rel.mapped)
                nc = 0 if num_cached is None or self._stripped else min(len(blocks), num_cached[g])
                unlinked = (g if group_ids is None else group_ids[g]) in self.unlinked_groups
                self._release_group(blocks, nc, plan, rel, 0 if first is None else first[g], not unlinked)
            completed = True
        finally:  # (also on an error: every block that names a run is in a queued run)
            self._post()
            try:
                placed = self._place(rel, completed)
            finally:
                if free_blocks is not None:
                    self._settle(groups, rel, completed, free_blocks)
        if freeing_now and not fused:
            self._expect = placed
        released = rel.total - rel.skipped
        if released:
            self.counters.get(prio).released_blocks += released

    def free_request(
        self,
        request: Any,
        blocks: Sequence[KVCacheBlock],
        block_size: int,
        num_cached: int,
        free_blocks: Callable[[list[KVCacheBlock]], None],
    ) -> None:
        """``KVCacheManager.free`` of a request whose blocks (``blocks``, allocation order, one full-attention group
        of this pool; ``num_cached`` of them cached by vLLM) are freed now: the release of
        :meth:`on_request_release` and what vLLM's ``BlockPool.free_blocks(reversed(blocks))`` does, in one pass,
        deepest block first. A hashed block's reference count drops in the release loop, and the block joins its
        run if that was its last reference; unhashed blocks (the partial last one, the null block) go to
        ``free_blocks`` (vLLM's, of this pool) after the loop, in the same order, so vLLM's own rules place them
        (reused first). Same state as the release followed by vLLM's free, one loop over the blocks fewer.

        On an error (reading the request's retention, in the loop, or queueing its runs) every block is still
        freed before it propagates: the blocks the loop had not reached by ``free_blocks`` (hashed ones join the
        queue at their class's default retention, as when the release hook fails before vLLM's free; the protected
        count is recounted), a run that could not be queued through ``append_n`` (:meth:`_settle`)."""
        self._release(request, (blocks,), (block_size,), True, (num_cached,), free_blocks)

    def _unplace(self, request: Any, groups: Sequence[Sequence[KVCacheBlock]]) -> None:
        """As the base class; the ``append_n`` that places the blocks then counts them under the releasing
        request's class and registers new content at its retention (as a failed fused release does)."""
        super()._unplace(request, groups)
        prio = _priority(request)
        for blocks in groups:
            self._charge(blocks, prio)

    def _charge(self, blocks: Sequence[KVCacheBlock], prio: int) -> None:
        """The class of ``blocks``' releaser, for the ``append_n`` that places the hashed ones (it queues them
        under that class and registers new content at its retention)."""
        cls = self._cls
        for b in blocks:
            if b._block_hash is not None:
                cls[b.block_id] = prio

    def _settle(
        self,
        groups: Sequence[Sequence[KVCacheBlock]],
        rel: _Release,
        completed: bool,
        free_blocks: Callable[[list[KVCacheBlock]], None],
    ) -> None:
        """The end of a fused release, also after an error: the blocks its queued runs hold count as free, a run
        it could not queue goes through ``append_n``, the unhashed blocks and (after an error in the loop) the
        blocks it had not reached are freed by vLLM's ``free_blocks``."""
        runs = rel.runs
        placed = sum(run.live for run in runs[: rel.pushed])
        self._held += placed
        self.num_free_blocks += placed
        try:
            stray = [bid for run in runs[rel.pushed :] for bid in run.ids]
            if stray:  # (queueing failed part-way: these blocks are free, in no queued run)
                run_of = self._run_of
                for bid in stray:
                    run_of[bid] = None
                blocks = [self.pool_blocks[bid] for bid in stray]
                self._charge(blocks, rel.prio)  # (a run holds hashed blocks only)
                self.append_n(blocks)
            if rel.first:  # (unhashed blocks, the null block: vLLM's own rules, reused first)
                free_blocks(rel.first)
        finally:
            if not completed:
                self._free_rest(groups, rel, free_blocks)

    def _free_rest(
        self,
        groups: Sequence[Sequence[KVCacheBlock]],
        rel: _Release,
        free_blocks: Callable[[list[KVCacheBlock]], None],
    ) -> None:
        """After a fused release failed: vLLM's free of the blocks it had not freed (see :class:`_Release`)."""
        for g in range(rel.group, len(groups)):
            blocks = groups[g]
            rest = blocks[: rel.pending + 1] if g == rel.group else blocks
            self._charge(rest, rel.prio)
            free_blocks(list(reversed(rest)))
        rr = self._r
        thr = self._threshold
        self._num_protected = sum(1 for r in rr if r >= thr)

    def _release_group(
        self,
        blocks: Sequence[KVCacheBlock],
        nc: int,
        plan: tuple[list[int], list[float | None]] | None,
        rel: _Release,
        lo: int = 0,
        linked: bool = True,
    ) -> None:
        """One KV cache group's blocks of a release, deepest first, down to position ``lo`` (``nc``: how many
        leading ones are known to be cached; ``plan``: the per-block retention and duration of directives;
        ``linked``: a hit in the group needs every earlier block, so a parent's run ranks at least at its child's;
        not in :attr:`unlinked_groups`, as the per-block queue links no blocks there)."""
        n = len(blocks)
        rel.total += n - lo
        # the run being built and the 256-token segment of the last new block (seg: its first depth)
        st = _Building(n, rel.mapped * 16 + self._ub[1])
        st.linked = linked
        start = n - 1
        if rel.freeing_now and not rel.slow and not lo:
            start = self._release_new(blocks, nc, rel, st)
        if start >= lo:
            self._release_known(blocks, start, nc, plan, rel, st, lo)

    def _release_new(self, blocks: Sequence[KVCacheBlock], nc: int, rel: _Release, st: _Building) -> int:
        """The hottest path: the request's own new blocks, deepest first, up to the first block whose content is
        known (the prefix it hit); per block only the flat-list writes, the run split decided once per 256-token
        segment. Returns the depth where known content starts (-1: none)."""
        rr = self._r
        uses = self._uses
        run_of = self._run_of
        ub = self._ub
        stride = self._stride
        segment_uses = self._segment_uses
        ghost = self._ghost.capacity > 0
        mapped = rel.mapped
        prio = rel.prio
        cls = self._cls
        runs = rel.runs
        open_run = self._open_run
        fused = rel.fused
        first = rel.first.append
        seg, su, stag, run_tag, cur = st.seg, st.su, st.stag, st.tag, st.cur
        linked = st.linked
        add = cur.ids.append if cur is not None else None
        skipped = 0
        start = -1
        i = len(blocks)
        try:
            for i in range(len(blocks) - 1, -1, -1):
                b = blocks[i]
                if i >= nc and b._block_hash is None:
                    if (
                        cur is not None
                    ):  # a gap above a run (align-mode Mamba's null blocks): the general path
                        start = i
                        break
                    skipped += 1
                    if fused:
                        first(b)
                    continue
                bid = b.block_id
                if rr[bid] != NEW:
                    start = i
                    break
                if i < seg:  # a new 256-token segment: its head's count from the ghost, + this use
                    seg = i - i % stride
                    su = segment_uses(blocks, seg) if ghost else 1
                    stag = mapped * 16 + ub[su]
                    if stag != run_tag:
                        cur = open_run(mapped, su, i, prio, cur if linked else None, None)
                        runs.append(cur)
                        add = cur.ids.append
                        run_tag = stag
                rr[bid] = mapped
                uses[bid] = su
                c = b.ref_cnt
                if c == 1:  # its last reference goes now
                    add(bid)  # type: ignore[misc]
                    run_of[bid] = cur
                else:  # still held (another request, a copy's endpoint): placed later under this class
                    cls[bid] = prio
                if fused:  # (vLLM's free_blocks, fused: see free_request)
                    b.ref_cnt = c - 1
        except BaseException:
            rel.pending = i  # (blocks i down to 0 are not freed)
            raise
        finally:
            rel.skipped += skipped
            st.seg, st.su, st.stag, st.tag, st.cur = seg, su, stag, run_tag, cur
        return start

    def _release_known(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        nc: int,
        plan: tuple[list[int], list[float | None]] | None,
        rel: _Release,
        st: _Building,
        lo: int = 0,
    ) -> None:
        """Blocks ``start`` down to ``lo``: every case (known content, other retentions, directives, a scope).
        NOTE: hot path (one iteration per released block): flat lists only, and the common cases (new content,
        the same priority again) without calls."""
        rr = self._r
        uses = self._uses
        run_of = self._run_of
        lapse = self._lapse
        ub = self._ub
        cap = self._cap
        stride = self._stride
        thr = self._threshold
        segment_uses = self._segment_uses
        ghost = self._ghost.capacity > 0
        mapped, prio, now = rel.mapped, rel.prio, rel.now
        cls = self._cls
        slow = rel.slow
        directed = _Directed(self, rel, plan) if slow else None
        freeing_now = rel.freeing_now
        fused = rel.fused
        first = rel.first.append
        runs = rel.runs
        owners = self._owner
        seg, su, stag, run_tag, cur = st.seg, st.su, st.stag, st.tag, st.cur
        add = cur.ids.append if cur is not None else None
        skipped = other = new_protected = 0
        wait = self._wait
        open_run = self._open_run
        # the block below (one deeper) joined ``cur`` in this release (a parent there waits for it: linked groups)
        linked = st.linked
        below = (
            linked
            and cur is not None
            and start + 1 < len(blocks)
            and run_of[blocks[start + 1].block_id] is cur
        )
        i = start + 1
        try:
            for i in range(start, lo - 1, -1):
                b = blocks[i]
                c = b.ref_cnt
                if c > 1 and i < nc and not slow:
                    # NOTE: the common case of a shared prefix: cached content another running request still holds,
                    # at least at this release's priority, no directive on it: a use, and the reference goes
                    bid = b.block_id
                    r = rr[bid]
                    if r >= mapped and not (lapse and bid in lapse):  # (NEW is below any mapped priority)
                        u = uses[bid] + 1
                        uses[bid] = u if u <= cap else cap
                        cls[bid] = prio  # (the last releaser's class, whoever frees the block)
                        other += 1
                        if below:  # its child's run waits for the release that frees it
                            if cur is not None:
                                wait[bid] = (cur, b._block_hash)
                            below = False
                        if fused:
                            b.ref_cnt = c - 1
                        continue
                # NOTE: below nc the hash is known to be there: not reading it saves a cache miss per block (the
                # hash object's reference count)
                if i >= nc and b._block_hash is None:  # (also the null block)
                    skipped += 1
                    if fused:
                        first(b)
                    # a gap (align-mode Mamba keeps a state block every few positions, null between): no chain
                    # across it, so the run above starts afresh, lifted by nothing below (the per-block queue
                    # links no parent across a null block either)
                    cur = None
                    run_tag = -1
                    below = False
                    continue
                bid = b.block_id
                r = rr[bid]
                if r == NEW:  # new content: registered here, not when vLLM cached it
                    if i < seg:  # a new 256-token segment: its head's count from the ghost, + this use
                        seg = i - i % stride
                        su = segment_uses(blocks, seg) if ghost else 1
                        stag = mapped * 16 + ub[su]
                    u = su
                else:
                    u = uses[bid] + 1
                    if u > cap:
                        u = cap
                if directed is not None:  # directives or a scope: the full rules, per block
                    other += 1
                    r = directed(bid, i, r)
                    tag = r * 16 + ub[u]
                elif r == NEW:
                    rr[bid] = r = mapped
                    tag = stag
                else:
                    other += 1
                    if lapse and bid in lapse:
                        # a directive holds it away from its users' mapped priority: the full rules (it may have
                        # lapsed to a fallback above ``mapped``; an equal ask ends its expiry; the fallback rises)
                        r = self._retain(bid, mapped, None, None, now, mapped)
                    elif r < mapped:  # highest wins
                        if r < thr <= mapped:
                            new_protected += 1
                        rr[bid] = r = mapped
                        if owners:  # an unscoped release set the level: no owner any more (rules.release)
                            owners.pop(bid, None)
                    tag = r * 16 + ub[u]
                uses[bid] = u
                if freeing_now and c == 1 and run_of[bid] is None:  # its last reference goes now
                    w = wait[bid]
                    if w is not None:  # an earlier release queued its child
                        wait[bid] = None
                        if w[0].live and b._block_hash is w[1]:
                            run_tag = -1  # (a run starts here, behind that child)
                        else:
                            w = None
                    if tag != run_tag:  # (once per run, not per block)
                        cur = open_run(
                            r, u, i, prio, cur if linked else None, w[0] if w is not None else None
                        )
                        runs.append(cur)
                        add = cur.ids.append
                        run_tag = tag
                    add(bid)  # type: ignore[misc]
                    run_of[bid] = cur
                    below = linked
                else:  # placed when vLLM frees it (append_n), under this last releaser's class
                    cls[bid] = prio
                    if below:  # held by another request: its child's run waits for the release that frees it
                        if c > 1 and cur is not None:
                            wait[bid] = (cur, b._block_hash)
                        below = False
                if fused:  # (vLLM's free_blocks, fused: see free_request)
                    b.ref_cnt = c - 1
        except BaseException:
            rel.pending = i  # (blocks i down to 0 are not freed)
            raise
        finally:
            rel.skipped += skipped
            rel.other += other
            rel.new_protected += new_protected + (directed.new_protected if directed is not None else 0)
            st.seg, st.su, st.stag, st.tag, st.cur = seg, su, stag, run_tag, cur

    def _place(self, rel: _Release, completed: bool) -> int:
        """Queue the runs a release built and count its newly protected blocks; returns the blocks placed."""
        new_protected = rel.new_protected
        if completed and rel.mapped >= self._threshold:  # new content at a protected mapped priority
            new_protected += rel.total - rel.skipped - rel.other
        self._num_protected += new_protected
        placed = 0
        queues = self._queues
        for run in rel.runs:
            if run.ids:  # (empty: opened at a segment whose new blocks were all still shared)
                run.live = len(run.ids)
                queues[run.tier].push(run)
                placed += run.live
            rel.pushed += 1
        return placed

    def on_arrival(self, request: Any) -> None:
        """At input processing (``EngineCore.preprocess_add_request``, once vLLM has hashed the request's
        blocks): the protection controller's shadows see them now, off the scheduler's step."""
        hashes = request.block_hashes
        if hashes:  # (vLLM's block hashes are one hash function's digests: one length)
            self._sighted(request, self._ctl.on_arrival(hashes, self._arrival_retention(request), True))

    def _policy_lookup(self, request: Any, mapped: int, held_blocks: int) -> None:
        """The protection controller's lookup (vLLM's block hashes are one hash function's digests: one
        length); where it changes the tables, every queued run is keyed again."""
        if self._ctl.on_lookup(
            request.block_hashes,
            held_blocks,
            mapped,
            True,
            seen if isinstance(seen := self._take_sighting(request), Sighting) else None,
            self._num_protected if self._L > 0.0 else None,
        ):
            self._weight = self._ctl.weights
            self._F = self._ctl.frequency
            self._rekey()

    def _rekey(self) -> None:
        """The order's tables changed: every queued run is keyed again from the ``L`` of its release with the new
        tables (:func:`rules.gd_key`, as the pool keys every block again), its floor and tier recomputed from
        the deeper runs that lift it (children first; a floor whose child is gone lapses, as the pool then
        exposes the parent at its own key), and the queues rebuilt in their old order within each new bucket."""
        W = self._weight
        F = self._F
        cost = self._cost_per_block
        thr = self._threshold
        runs = [run for q in self._queues for run in q.ordered()]
        for run in runs:
            run.own = own = rules.gd_key(run.since, W[run.r], F[run.u], run.depth, cost)
            run.floor = 0.0
            run.tier = 0 if run.r >= thr else 1
            run.key = own
        lifted = self._lifted
        for run in sorted(runs, key=lambda x: -x.depth):  # (stable: equal depths keep the queue order)
            up = run.up
            if up is not None and up.live:
                tier, fl = lifted(up.r, run.key, run.tier)
                if fl > 0.0 and (tier < up.tier or (tier == up.tier and fl > up.floor)):
                    up.tier = tier
                    up.floor = fl
                    up.key = up.own if up.own > fl else fl
        scale = self._queues[0].scale
        queues = (_RunQueue(scale, self._stamps), _RunQueue(scale, self._stamps))
        runs.sort(key=attrgetter("stamp"))  # (each new bucket in release order: each push goes to the back)
        for run in runs:
            queues[run.tier].push(run)
        self._queues = queues
        self._rekeys += 1

    def forget(self, block: KVCacheBlock) -> bool:
        """Before ``BlockPool.evict_blocks`` strips ``block``'s hash: take it out of its run. Returns True
        when the block was free (the caller then puts it on the unhashed list)."""
        bid = block.block_id
        run = self._run_of[bid]
        queued = self._leave(bid)
        if not queued and block.ref_cnt > 0:
            self._stripped = True
        self._drop(bid, run.cls if run is not None else None)
        if self._index is not None:
            self._gone.add(bid)
        return queued

    def end_forget(self) -> None:
        """``evict_blocks`` has stripped the hashes of the blocks it named: vLLM's index lists none of them now."""
        self._gone.clear()

    def stats(self) -> dict[str, float]:
        return {
            "protected_blocks": float(self._num_protected),
            "rekeys": float(self._rekeys),
            **self._ctl.stats(),
        }

    def check(self) -> None:
        """Consistency check for tests: counts, run membership and retention bookkeeping agree. O(n)."""
        held = self._held_ids()
        listed = self.unhashed_blocks()
        assert self._held == len(held), "held count"
        assert sum(q.n for q in self._queues) == len(held), "queue counts"
        assert self.num_free_blocks == len(listed) + self._held, "free count"
        for q in self._queues:
            runs = list(q.live())
            assert q.live_runs == len(runs), "live runs"
            for run in runs:
                members = [b for b in run.ids[run.i :] if self._run_of[b] is run]
                assert run.live == len(members), "run live count"
                natural = 0 if run.r >= self._threshold else 1
                assert run.tier == natural or (run.tier < natural and run.floor > 0.0), "run tier"
                assert run.key == max(run.own, run.floor), "run key"
                for b in members:
                    assert self._r[b] == run.r, f"block {b} retention differs from its run's"
        for b in listed:
            assert self._run_of[b.block_id] is None and b.block_hash is None, f"listed {b.block_id}"
            assert b.ref_cnt == 0
        for bid in held:
            b = self.pool_blocks[bid]
            assert b.ref_cnt == 0 and b.block_hash is not None, f"queued block {bid} not cached-free"
            assert self._r[bid] != NEW
        for i in range(len(self._r)):
            if self._r[i] != NEW:
                assert self.pool_blocks[i].block_hash is not None, (
                    f"block {i}: content known, no hash in vLLM"
                )
        pending = {(t, bid) for t, _, ids in self._expiries for bid in ids}
        assert self._pending == sum(len(ids) for _, _, ids in self._expiries), "pending lapse count"
        for bid, (t, base) in self._lapse.items():
            assert self._r[bid] != NEW and self._r[bid] != base, (
                f"block {bid}: lapse entry without a directive"
            )
            assert t == INF or (t, bid) in pending, f"block {bid}: its lapse at {t} is not scheduled"
        assert not self._due, "lapses set outside a release"
        known = [i for i in range(len(self._r)) if self._r[i] != NEW]
        assert self._num_protected == sum(1 for i in known if self._r[i] >= self._threshold), (
            "protected count"
        )
