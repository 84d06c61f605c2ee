"""``unified``: one policy for request priority, retention directives, reuse frequency, recompute cost and a
protection budget.

Each cached block carries an *effective retention priority* ``r``: the highest priority any request asked for
it (request priority through :class:`~kvretain.core.retention.PriorityMapping`, or an explicit directive),
except that the request scope that set it may also lower it (RFC #37003: anyone may raise, only the owner
may lower). NOTE: the highest-wins rule (not TensorRT-LLM's last-writer-wins) keeps a prefix shared by
important and unimportant traffic from being downgraded by whoever touched it last. A directive's duration
runs from the release; when it lapses ``r`` falls back to the highest *mapped* request priority of the
block's users.

Blocks with ``r >= protect_threshold`` are *protected*. Evictable blocks sit in two GreedyDual queues
(protected, unprotected; key buckets (:func:`~kvretain.core.policies.rules.buckets_per_key`), in release order
inside) keyed by ``H = L + value``, where::

    value = priority_weight ** ((r - 35) / 10)      # retention weight: +10 points doubles it by default
          * min(uses, frequency_cap) ** frequency_exponent   # reuse frequency (remembered across eviction)
          * (1 + depth_tokens / cost_scale_tokens)  # recompute cost: attention over the prefix

and ``L`` rises to the key of each victim, so blocks that stop being used age out (GreedyDual-Size-Frequency).
When the controller changes the weights or the frequency exponent, every cached block is keyed again from the
``L`` of its release with the new tables (:func:`~kvretain.core.policies.rules.gd_key`: keys from other tables
are not comparable).
Unprotected blocks are evicted first while protected blocks hold at most ``target`` blocks; above it the two
tiers compete on ``H``'s bucket, then on release order (the order one queue of both would have, so that with
flat weights, recency and no protected share the policy is LRU:
:data:`~kvretain.core.policies.rules.RELEASE_ORDER_WALK`). A lapsed directive re-keys its block from the ``L``
of its release at the fallen retention (as if released at it, not at the lapse). ``target`` is the protection
budget (``budget`` x pool), or, with ``isolation_goal``, it adapts inside that budget (:class:`~kvretain.core.policies.protection.ProtectionController`): it grows while
protected traffic hits less than ``isolation_goal`` of what it would hit alone in the pool *and* overall reuse
stays above ``1 - max_reuse_loss`` of what plain LRU would hit, both measured online on sampled shadows. Below
a target of 0 the same controller softens the retention weights, down to none (its *protection level*), so the
reuse floor holds as far as the base order holds it.

Leaves only: a block never goes before its cached descendants. A chain is evicted as a unit, tail first: a
parent exposed by its child's eviction goes at its release's place in its key bucket (``expose``; released with
that child, right after it: first), and ``pop_exposed`` evicts it at once when it is next in line. Use counts
are remembered across eviction in a ghost table that keeps one block per 256 tokens (exact for blocks of 256
tokens or more), once the content leaves the cache with its last copy (:class:`~kvretain.core.policies.lfu.GhostTable`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import cast

from kvretain.core.hashing import BlockHash
from kvretain.core.policies import rules
from kvretain.core.policies.lfu import GhostTable
from kvretain.core.policies.protection import ProtectionController, Sighting
from kvretain.core.policy import INF, POLICIES, BlockState, EvictionPolicy, PolicyConfig
from kvretain.core.retention import DEFAULT_RETENTION_PRIORITY

_UNSET = rules.UNSET
SAMPLE_TOKENS = 256
"""The shadow directory and the ghost table keep one block per this many tokens (exact for larger blocks)."""


class _Meta(BlockState):
    """Per-block state of the unified policy, in the same object as the pool's state of the block
    (:meth:`UnifiedPolicy.block_states`)."""

    __slots__ = (
        "base",
        "block_id",
        "content",
        "depth",
        "expiry",
        "next",
        "owner",
        "prev",
        "protected",
        "r",
        "since",
        "stamp",
        "tier",
        "uses",
        "value",
    )

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.block_id = block_id
        self.content: BlockHash | None = None  # the hash the policy knows (the pool's block_hash is separate)
        self.uses = 0
        self.depth = 0
        self.r = (
            _UNSET  # retention asked for (highest wins, owner may lower); _UNSET before the first release
        )
        self.base = _UNSET  # highest mapped request priority of the block's users (where a lapse falls back)
        self.expiry = INF
        self.owner: str | None = None
        # its GreedyDual key is ``since + value`` (rules.gd_key): ``since`` the aging floor L at its last release,
        # ``value`` what the tables then gave it (set again from them when they change: _rekey)
        # NOTE: the two parts, not the sum: a float stored per release frees the previous release's, a cold object
        # at 10^5-10^6 blocks; a value is one of a few shared table entries (UnifiedPolicy._values) and ``since``
        # the floor shared by every block released at it (docs/history.md, session 51)
        self.since = 0.0
        self.value = 0.0
        self.protected = 0
        # neighbours in its bucket of the evictable queue; ``prev is None``: not evictable
        self.prev: _Link | _Meta | None = None
        self.next: _Link | _Meta | None = None
        self.tier = 1
        self.stamp = (
            0  # its last release's place in the release order (a bucket keeps its blocks in this order)
        )


def _before(s: int, stamp: int, q: _Queue) -> bool:
    """Whether a block in bucket ``s`` released at ``stamp`` goes before the head of the non-empty ``q``."""
    s1, m1 = q.head()
    return s < s1 or (s == s1 and stamp < m1.stamp)


def sample_stride(block_size: int) -> int:
    """Blocks per sampled block of the shadow directory and the ghost table (one per ``SAMPLE_TOKENS``)."""
    return max(1, SAMPLE_TOKENS // max(1, block_size))


class _Link:
    """A bucket's sentinel in :class:`_Queue` (blocks link to each other and to it through ``prev``/``next``)."""

    __slots__ = ("next", "prev")

    def __init__(self) -> None:
        self.prev: _Link | _Meta = self
        self.next: _Link | _Meta = self


class _Queue:
    """Evictable blocks of one tier by key: buckets ``1 / scale`` of a key unit wide (:func:`~kvretain.core.policies.rules.buckets_per_key`), each a circular doubly linked list
    in release order (``stamp``: FIFO, as LRU orders blocks of one key) through the blocks' own ``prev``/``next``,
    and the bucket indices in a small heap. O(1) push, removal and pop (plus O(log buckets) when a bucket opens
    or closes).

    NOTE: linked in place rather than lazy entries in per-bucket deques: removing a touched block and evicting a
    block then allocate and free nothing, which keeps the cost per operation flat as the pool outgrows the CPU
    caches (a lazy entry and its stamp were cold objects by the time they were dropped). A bucket emptied by a
    removal stays in the heap until :meth:`head` passes it or, when such buckets outnumber the others (a queue
    that is rarely popped while keys keep rising), a compaction drops them all: amortized O(1).
    """

    __slots__ = ("_buckets", "_empty", "_slots", "late", "n", "scale")

    def __init__(self, scale: float) -> None:
        self.scale = scale  # buckets per key unit (rules.buckets_per_key)
        self._buckets: dict[int, _Link] = {}
        self._slots: list[int] = []
        self._empty = 0  # buckets in the heap whose list is empty
        self.n = 0
        # buckets out of release order: a push's walk ran out and left a block behind a later release (until the
        # bucket is dropped); where ``push`` puts a block there depends on the walk, so ``pop_exposed`` asks it
        self.late: set[int] = set()

    def push(self, m: _Meta) -> None:
        """Queue ``m`` at its place in its bucket's release order.

        NOTE: O(1): at the back, at the front, or a walk of at most :data:`rules.RELEASE_ORDER_WALK` links
        from the back (see there)."""
        s = int((m.since + m.value) * self.scale)
        h = self._buckets.get(s)
        if h is None:
            h = self._buckets[s] = _Link()
            heapq.heappush(self._slots, s)
        elif h.next is h:
            self._empty -= 1
        stamp = m.stamp
        # NOTE: ``pv is h`` before reading ``stamp``: the attribute is read from blocks only (one type at each
        # site keeps CPython's specialized attribute access)
        pv = h.prev
        # an empty bucket, or the newest release: the back
        if pv is h or pv.stamp < stamp:  # type: ignore[union-attr]
            m.prev = pv
            m.next = h
            pv.next = m
            h.prev = m
        else:
            if h.next.stamp > stamp:  # type: ignore[union-attr]
                pv = h  # the first
            else:
                for _ in range(rules.RELEASE_ORDER_WALK):
                    pv = pv.prev  # type: ignore[assignment]
                    if pv is h or pv.stamp < stamp:  # type: ignore[union-attr]
                        break
                else:
                    self.late.add(s)
            nx = pv.next
            m.prev = pv
            m.next = nx
            pv.next = m
            nx.prev = m  # type: ignore[union-attr]
        self.n += 1

    def unlink(self, m: _Meta) -> None:
        """Take the queued ``m`` out (its bucket may stay in the heap, empty)."""
        pv = m.prev
        nx = m.next
        assert pv is not None and nx is not None
        pv.next = nx
        nx.prev = pv
        m.prev = m.next = None
        self.n -= 1
        if pv is nx:  # its bucket is empty now
            self._empty += 1
            if self._empty > 64 + len(self._buckets) // 2:
                self._buckets = {s: h for s, h in self._buckets.items() if h.next is not h}
                self._slots = sorted(self._buckets)
                self._empty = 0
                if self.late:
                    self.late.intersection_update(self._buckets)

    def drain(self) -> list[_Meta]:
        """Take every block out, in queue order (bucket, then FIFO); the queue is empty after."""
        out: list[_Meta] = []
        for s in sorted(self._buckets):
            h = self._buckets[s]
            m = h.next
            while m is not h:
                b = cast(_Meta, m)
                nx = b.next
                assert nx is not None
                b.prev = b.next = None
                out.append(b)
                m = nx
        self._buckets = {}
        self._slots = []
        self._empty = 0
        self.n = 0
        self.late.clear()
        return out

    def head(self) -> tuple[int, _Meta]:
        """``(bucket, meta)`` of the first block; the queue must not be empty."""
        buckets = self._buckets
        slots = self._slots
        while True:
            s = slots[0]
            h = buckets[s]
            m = h.next
            if m is not h:
                return s, m  # type: ignore[return-value]
            del buckets[s]
            heapq.heappop(slots)
            self._empty -= 1
            if self.late:
                self.late.discard(s)

    def pop(self) -> _Meta:
        """Remove and return the first block; the queue must not be empty."""
        s, m = self.head()
        return self.pop_head(s, m)

    def pop_head(self, s: int, m: _Meta) -> _Meta:
        """Remove the head ``m`` found by :meth:`head` in bucket ``s``."""
        # unlink's pointer surgery, inlined (once per eviction); an emptied bucket goes at once (it is the first)
        h = m.prev
        nx = m.next
        assert h is not None and nx is not None
        h.next = nx
        nx.prev = h
        m.prev = m.next = None
        self.n -= 1
        if nx is h:
            del self._buckets[s]
            heapq.heappop(self._slots)
            if self.late:
                self.late.discard(s)
        return m


@POLICIES.register(
    "unified", "priority x frequency x recompute cost with a protection budget (kvretain's policy)"
)
class UnifiedPolicy(EvictionPolicy):
    name = "unified"
    forgets_on_pop = True

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        cfg = self.config
        self._meta = [_Meta(b) for b in range(num_blocks)]
        scale = rules.buckets_per_key(cfg)
        self._queues = (_Queue(scale), _Queue(scale))  # 0: protected, 1: unprotected
        self._num_protected = 0
        self._expiries: list[tuple[float, int]] = []
        self._lapse_limit = rules.lapse_limit(0)  # compact _expiries past this many entries
        # NOTE: the shadow directory and the ghost table track one block in ``stride`` (by depth, so a block
        # is always or never sampled): one per 256 tokens, exact for blocks of 256 tokens or more and 16x
        # cheaper at 16. A block inside a 256-token segment that is cached right after its predecessor takes
        # the predecessor's restored use count (a segment's blocks are used together).
        self._stride = stride = sample_stride(cfg.block_size)
        self._ghost = GhostTable(math.ceil(cfg.ghost_factor * self.capacity / stride))
        self._last_depth = -2  # depth and restored use count of the block cached last
        self._last_uses = 0
        self._L = 0.0
        self._threshold = cfg.protect_threshold
        self._cap = cfg.frequency_cap
        self._ctl = ProtectionController(self.capacity, cfg)
        self._weight = self._ctl.weights  # the controller's retention weights (its level may soften them)
        self._F = self._ctl.frequency  # uses -> uses ** alpha (the controller's balance sets alpha)
        self._values: dict[int, list[float]] = {}  # retention -> values by use count (_value_row)
        self._cost_per_block = rules.cost_per_block(cfg)
        self._victim = _Meta(
            -1
        )  # the last block evicted (pop_exposed's parent is often released right after it)
        self._released = 0  # releases so far (a block's ``stamp``: its last release's place)
        self._rekeys = 0  # times the tables changed and every key was set again (stats)

    # ----------------------------------------------------------------- metadata
    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        self.on_cached_run({depth: block_id}, {depth: block_hash}, depth, depth + 1, now)

    def on_cached_run(
        self,
        block_ids: Sequence[int] | Mapping[int, int],
        hashes: Sequence[BlockHash] | Mapping[int, BlockHash],
        start: int,
        end: int,
        now: float,
    ) -> None:
        # NOTE: hot path (one iteration per newly cached block): locals only
        meta = self._meta
        stride = self._stride
        take_or = self._ghost.take_or
        held = self._ghost.held  # (GhostTable.enter, inline)
        last_depth = self._last_depth
        uses = self._last_uses
        for depth in range(start, end):
            h = hashes[depth]
            if depth % stride == 0:
                uses = take_or(h, 0)
                held[h] = held.get(h, 0) + 1
            elif depth != last_depth + 1:
                uses = 0  # (otherwise the previous block of its segment, cached just before: its count)
            last_depth = depth
            m = meta[block_ids[depth]]
            m.uses = uses
            m.content = h
            m.depth = depth
            m.r = _UNSET
            m.base = _UNSET
            m.expiry = INF
            m.owner = None
            m.stamp = 0  # (no release yet: its previous content's place must not look like one)
        self._last_depth = last_depth  # depth and restored use count of the block cached last
        self._last_uses = uses

    def on_release(
        self,
        block_id: int,
        retention: int,
        duration_s: float | None,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        self.release(block_id, retention, duration_s, scope, now, base, False)

    def release(
        self,
        block_id: int,
        retention: int,
        duration_s: float | None,
        scope: str | None,
        now: float,
        base: int,
        evictable: bool,
    ) -> None:
        # NOTE: hot path (once per released block): retention_of, protection and the key are inlined here.
        m = self._meta[block_id]
        uses = m.uses
        if uses < self._cap:
            uses += 1
            m.uses = uses
        r = m.r
        if r == retention and duration_s is None and m.expiry == INF and base <= m.base:
            cur = (
                r  # steady state: the same priority again, nothing to expire (rules.release changes nothing)
            )
        else:
            cur, m.base, expiry, m.owner = rules.release(
                r, m.base, m.expiry, m.owner, retention, duration_s, scope, now, base
            )
            m.r = cur
            if expiry != m.expiry:
                m.expiry = expiry
                if rules.lapses(cur, m.base, expiry):
                    heapq.heappush(self._expiries, (expiry, block_id))
                    if len(self._expiries) > self._lapse_limit:
                        self._compact_lapses()
            p = 1 if cur >= self._threshold else 0
            if p != m.protected:
                m.protected = p
                self._num_protected += 1 if p else -1
        m.since = self._L
        self._released = m.stamp = self._released + 1
        v = self._values.get(cur) or self._value_row(cur)
        m.value = v[uses] * (1.0 + m.depth * self._cost_per_block) if self._cost_per_block else v[uses]
        if evictable:
            self._push(m)

    def release_run(
        self,
        block_ids: Sequence[int],
        evictable_ids: Sequence[int],
        retention: int,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        # NOTE: the steady state of ``release`` (same priority again, no expiry) as one loop; anything else
        # goes through ``release``.
        meta = self._meta
        cap = self._cap
        L = self._L
        cost = self._cost_per_block
        v = self._values.get(retention) or self._value_row(retention)
        protect = 1 if retention >= self._threshold else 0
        c = self._released
        for bid in block_ids:
            m = meta[bid]
            if m.r == _UNSET and m.base == _UNSET and retention == base:
                # first release of new content at its request's mapped priority
                m.r = m.base = retention
                if protect != m.protected:
                    m.protected = protect
                    self._num_protected += 1 if protect else -1
            elif m.r != retention or m.expiry != INF or base > m.base:
                self._released = c
                self.release(bid, retention, None, scope, now, base, False)
                c = self._released
                continue
            uses = m.uses
            if uses < cap:
                uses += 1
                m.uses = uses
            m.since = L
            c += 1
            m.stamp = c
            m.value = v[uses] * (1.0 + m.depth * cost) if cost else v[uses]
        self._released = c
        push = self._push
        for bid in evictable_ids:
            push(meta[bid])

    def retention_of(self, block_id: int, now: float) -> int:
        m = self._meta[block_id]
        return rules.effective(m.r, m.base, m.expiry, now)

    def _set_protected(self, m: _Meta, now: float) -> None:
        p = 1 if self.retention_of(m.block_id, now) >= self._threshold else 0
        if p != m.protected:
            m.protected = p
            self._num_protected += 1 if p else -1

    def on_arrival(self, hashes: Sequence[BlockHash], retention: int) -> object | None:
        return self._ctl.on_arrival(hashes, retention)

    def on_lookup(
        self, hashes: Sequence[BlockHash], num_hits: int, retention: int, seen: object | None = None
    ) -> None:
        if self._ctl.on_lookup(
            hashes,
            num_hits,
            retention,
            False,
            seen if isinstance(seen, Sighting) else None,
            self._num_protected if self._L > 0.0 else None,
        ):
            self._weight = self._ctl.weights
            self._F = self._ctl.frequency
            self._rekey()

    def _rekey(self) -> None:
        """The order's tables changed (the controller's level moved the retention weights, or its balance the
        frequency exponent): every cached block's key becomes what the new tables give it at the ``L`` of its
        release (:func:`rules.gd_key`), and the queues are rebuilt, each new bucket in release order."""
        cost = self._cost_per_block
        queued: list[_Meta] = []
        for q in self._queues:
            queued += q.drain()
        # NOTE: rules.value from the new rows, as a release sets it (once per cached block at every change)
        values = self._values
        values.clear()
        for m in self._meta:
            if m.content is not None and m.r != _UNSET:
                v = (values.get(m.r) or self._value_row(m.r))[m.uses]
                m.value = v * (1.0 + m.depth * cost) if cost else v
        self._rekeys += 1
        queued.sort(key=attrgetter("stamp"))
        for m in queued:
            self._queues[m.tier].push(m)

    # ----------------------------------------------------------------- order
    def _value(self, m: _Meta, now: float) -> float:
        return rules.value(
            self._weight[self.retention_of(m.block_id, now)], self._F[m.uses], m.depth, self._cost_per_block
        )

    def _value_row(self, r: int) -> list[float]:
        """The values of retention ``r`` by use count under the current tables, ``weight[r] * frequency[uses]``
        (:func:`rules.value` without the cost term): shared by the blocks released at ``r`` until the tables change
        (:meth:`_rekey` clears them)."""
        w = self._weight[r]
        row = self._values[r] = [w * f for f in self._F]
        return row

    def key_of(self, block_id: int) -> float:
        """Block ``block_id``'s GreedyDual key (its place in the order: :func:`rules.gd_key`)."""
        m = self._meta[block_id]
        return m.since + m.value

    def _push(self, m: _Meta) -> None:
        if m.prev is not None:
            self._queues[m.tier].unlink(m)
        tier = m.tier = 1 - m.protected
        self._queues[tier].push(m)

    def push(self, block_id: int, now: float) -> None:
        # a block made evictable from outside (the vLLM plugin's per-block queue, after its release hooks; a pool
        # that frees blocks without a request: vLLM's CPU offload pool) is queued as of now: the newest in the
        # release order, keyed from ``L`` now at its retention (after a release hook: what that release set; a
        # block freed again without one: not its last release's key, which ``L`` has passed since; the run
        # queue's ``_enqueue`` keys such blocks the same way)
        m = self._meta[block_id]
        if m.r == _UNSET:
            self._default_release(m, now)
            return
        if m.since != self._L:  # (released at this L: its release hook just set its value)
            m.since = self._L
            m.value = self._value(m, now)
        self._released = m.stamp = self._released + 1
        self._push(m)

    def _default_release(self, m: _Meta, now: float) -> None:
        """Content that no release keyed (the offload pool's) is released now, at the default retention, as a
        pool's release without a plan is (else its key is its previous content's, or 0: first to go)."""
        d = DEFAULT_RETENTION_PRIORITY
        self.release(m.block_id, d, None, None, now, d, True)

    def default_release_place(self, block_id: int) -> tuple[float, int]:
        """``(key, tier)`` that :meth:`_default_release` would give the block now (it goes at the back of its
        bucket: the newest release); for the plugin's read-only view of the order."""
        m = self._meta[block_id]
        d = DEFAULT_RETENTION_PRIORITY
        uses = m.uses + 1 if m.uses < self._cap else m.uses
        key = rules.gd_key(self._L, self._weight[d], self._F[uses], m.depth, self._cost_per_block)
        return key, 0 if rules.protected(d, self._threshold) else 1

    def expose(self, block_id: int, now: float) -> None:
        # an exposed parent goes at its release's place in its key bucket: released with its child, right after
        # it, so a chain is evicted as a unit, tail first (as vLLM evicts a request's blocks back to back)
        m = self._meta[block_id]
        if m.r == _UNSET:  # (a parent no release keyed: see push)
            self._default_release(m, now)
        else:
            self._push(m)

    def remove(self, block_id: int) -> None:
        m = self._meta[block_id]
        if m.prev is None:
            raise KeyError(block_id)
        self._queues[m.tier].unlink(m)

    def _compact_lapses(self) -> None:
        """Drop the scheduled lapses that would lapse nothing (their block's expiry moved since): see
        :func:`rules.lapse_limit`. The live ones keep their order (a heap of the same ``(time, block)`` keys)."""
        exp = self._expiries
        meta = self._meta
        exp[:] = [e for e in exp if meta[e[1]].expiry == e[0]]
        heapq.heapify(exp)
        self._lapse_limit = rules.lapse_limit(len(exp))

    def _expire(self, now: float) -> None:
        exp = self._expiries
        while exp and exp[0][0] <= now:
            t, bid = heapq.heappop(exp)
            m = self._meta[bid]
            if m.expiry != t:
                continue
            m.expiry = INF
            m.r = m.base
            was = m.protected
            self._set_protected(m, now)
            old = m.since + m.value
            m.value = self._value(m, now)
            scale = self._queues[0].scale
            moved = int((m.since + m.value) * scale) != int(old * scale)
            if m.prev is not None and (was != m.protected or moved):
                self._push(m)  # (same tier and bucket: it keeps its place)

    def pop(self, now: float) -> int | None:
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)
        q0, q1 = self._queues
        if q1.n and (self._num_protected <= self._ctl.target or not q0.n):
            m = q1.pop()
        elif q0.n and q1.n:
            # over the protected target: the two tiers compete on their keys (bucket, then release order)
            s0, m0 = q0.head()
            s1, m1 = q1.head()
            if s0 < s1 or (s0 == s1 and m0.stamp < m1.stamp):
                m = q0.pop_head(s0, m0)
            else:
                m = q1.pop_head(s1, m1)
        elif q0.n:
            m = q0.pop()
        else:
            return None
        key = m.since + m.value
        if key > self._L:
            self._L = key
        self._forget(m)  # eviction bookkeeping here, so the pool skips on_evicted (forgets_on_pop)
        self._victim = m
        return m.block_id

    def pop_exposed(self, block_id: int, now: float) -> int | None:
        # NOTE: hot path (chains are evicted tail first, so most victims expose their parent): ``expose`` then
        # ``pop`` without queueing the parent when it would be the victim, i.e. when its tier is the one being
        # evicted and it would be that queue's head (by bucket, then release order).
        m = self._meta[block_id]
        if not (self._expiries and self._expiries[0][0] <= now):
            v = self._victim
            key = m.since + m.value
            p = m.protected
            if m.stamp == v.stamp + 1 and key == v.since + v.value and v.tier != p:
                # released right after the child just evicted (the head of this tier's queue), with the same key,
                # into the same tier: nothing can come between them in the queue (the rest of the bucket was
                # released later, unless a walk ran out there: ``late``; nothing was queued since), nor in the
                # other tier (its head came after the child); only the tier's turn can change: an evicted
                # protected child leaves the protected tier one block smaller
                late = self._queues[1 - p].late
                if late and int(key * self._queues[0].scale) in late:
                    take = False
                else:
                    take = not p or not self._queues[1].n or self._num_protected > self._ctl.target
            else:
                take = m.r != _UNSET and self._first_in_line(m, key, p)
            if take:
                if key > self._L:
                    self._L = key
                m.tier = 1 - p  # (the queue it would have been in: the next exposure reads it)
                self._forget(m)
                self._victim = m
                return block_id
        self.expose(block_id, now)
        return self.pop(now)

    def _first_in_line(self, m: _Meta, key: float, p: int) -> bool:
        """Whether the exposed, unqueued ``m`` (of key ``key``, protected ``p``) would be the next victim.

        ``_slots[0]`` bounds a queue's first live bucket from below (its bucket may hold only dead entries)."""
        q0, q1 = self._queues
        s = int(key * q0.scale)
        own = q0 if p else q1
        if s in own.late:
            return False  # (where ``push`` would put it depends on the walk)
        if own.n:
            # first in its own queue: below its first bucket, or in it and released before its first block (or
            # the bucket holds only dead entries: its sentinel's ``next`` is itself)
            first = own._slots[0]
            if s > first:
                return False
            if s == first:
                h = own._buckets[s]
                b = h.next
                if b is not h and b.stamp < m.stamp:  # type: ignore[union-attr]
                    return False
        if p:
            return not q1.n or (
                self._num_protected > self._ctl.target and (s < q1._slots[0] or _before(s, m.stamp, q1))
            )
        return (
            not (q0.n and self._num_protected > self._ctl.target)
            or s < q0._slots[0]
            or _before(s, m.stamp, q0)
        )

    def _forget(self, m: _Meta) -> None:
        h = m.content
        if h is None:
            return
        m.content = None
        m.expiry = INF  # (its pending lapse goes with its content: a lapse must not protect an evicted block)
        if m.depth % self._stride == 0:  # the ghost keeps one count per 256-token segment
            self._ghost.leave(h, m.uses)  # (only once its last copy goes)
        if m.protected:
            m.protected = 0
            self._num_protected -= 1

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        # per-block metadata is reset in on_cached when the block gets new content
        self._forget(self._meta[block_id])

    def block_states(self) -> list[BlockState]:
        # NOTE: the list itself, not a copy: the pool indexes it by block id and then calls the policy, which
        # indexes it again; one list keeps the second lookup in cache at 10^6 blocks. The pool never mutates it.
        return cast(list[BlockState], self._meta)

    def __len__(self) -> int:
        return self._queues[0].n + self._queues[1].n

    def evictable_ids(self) -> set[int]:
        return {m.block_id for m in self._meta if m.prev is not None}

    def stats(self) -> dict[str, float]:
        return {
            "protected_blocks": float(self._num_protected),
            "rekeys": float(self._rekeys),
            **self._ctl.stats(),
        }
