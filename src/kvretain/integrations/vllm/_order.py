"""The eviction order of the per-block queue (:class:`~._queue.RetentionFreeQueue`), walked without evicting.

vLLM lists its free blocks in eviction order (``get_all_free_blocks``, in its tests) and its lazy CPU offload walks
them in that order (``iter_blocks_after``) to store the blocks about to be evicted. A kvretain policy only pops
its victims, so the order is replayed here on a scratch copy of the policy's order structure: what
``RetentionFreeQueue._evict`` would return if asked for every cached free block at once, including the parents a
victim exposes (leaf-only policies) and the blocked blocks taken last. The real policy is untouched, except that
retention lapsed by now is applied first (as the next eviction would do; keys fixed at release do not change).

NOTE: each view below mirrors its policy's ``pop``/``expose`` on a copy; ``tests/test_vllm_order.py`` checks
every view against the real eviction (``popleft_n``) on random sequences, so a change to a policy's order that
is not made here fails there.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvretain.core.policies import rules
from kvretain.core.policies._lazyheap import HeapOrderedPolicy
from kvretain.core.policies.lru import LRUPolicy
from kvretain.core.policies.unified import UnifiedPolicy
from kvretain.core.policy import EvictionPolicy

if TYPE_CHECKING:
    from kvretain.integrations.vllm._queue import RetentionFreeQueue

NO_PARENT = -1


class _View:
    """A scratch copy of a policy's order: ``pop`` the next victim, ``pop_exposed`` after exposing a parent."""

    def pop(self) -> int | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def pop_exposed(self, bid: int) -> int | None:  # pragma: no cover - overridden
        raise NotImplementedError


class _LRUView(_View):
    def __init__(self, policy: LRUPolicy) -> None:
        self._it = iter(list(policy._queue))

    def pop(self) -> int | None:
        return next(self._it, None)

    def pop_exposed(self, bid: int) -> int | None:  # (lru is not leaf-only: nothing is ever exposed)
        raise AssertionError("lru exposes no parent")


class _HeapView(_View):
    """``HeapOrderedPolicy``: the live heap entries; an exposed parent is pushed with its key now."""

    def __init__(self, policy: HeapOrderedPolicy, now: float) -> None:
        heap = policy._heap
        stamp = heap.stamp
        self._heap = [e for e in heap._heap if stamp[e[2]] == e[1]]
        heapq.heapify(self._heap)
        self._seq = heap._seq
        self._key = policy._key
        self._now = now

    def pop(self) -> int | None:
        return heapq.heappop(self._heap)[2] if self._heap else None

    def pop_exposed(self, bid: int) -> int | None:
        self._seq += 1
        heapq.heappush(self._heap, (self._key(bid, self._now), self._seq, bid))
        return self.pop()


class _UnifiedView(_View):
    """``UnifiedPolicy``: both tiers' buckets (in release order) and the protected count."""

    def __init__(self, policy: UnifiedPolicy) -> None:
        self._policy = policy
        self._meta = policy._meta
        self._scale = policy._queues[0].scale
        self._tiers: list[tuple[dict[int, deque[int]], list[int]]] = []
        for q in policy._queues:
            buckets: dict[int, deque[int]] = {}
            for s, head in q._buckets.items():
                ids: deque[int] = deque()
                m = head.next
                while m is not head:
                    ids.append(m.block_id)  # type: ignore[union-attr]
                    m = m.next  # type: ignore[assignment]
                if ids:
                    buckets[s] = ids
            slots = list(buckets)
            heapq.heapify(slots)
            self._tiers.append((buckets, slots))
        self._protected = policy._num_protected
        self._target = policy._ctl.target

    def _head(self, t: int) -> tuple[int, int] | None:
        buckets, slots = self._tiers[t]
        while slots and not buckets[slots[0]]:
            del buckets[heapq.heappop(slots)]
        return (slots[0], buckets[slots[0]][0]) if slots else None

    def pop(self) -> int | None:
        h0 = self._head(0)
        h1 = self._head(1)
        if h1 is not None and (self._protected <= self._target or h0 is None):
            t = 1
        elif h0 is not None and h1 is not None:  # over the protected target: by bucket, then release order
            s0, b0 = h0
            s1, b1 = h1
            t = 0 if s0 < s1 or (s0 == s1 and self._meta[b0].stamp < self._meta[b1].stamp) else 1
        elif h0 is not None:
            t = 0
        else:
            return None
        buckets, slots = self._tiers[t]
        bid = buckets[slots[0]].popleft()
        if self._meta[bid].protected:
            self._protected -= 1
        return bid

    def pop_exposed(self, bid: int) -> int | None:
        m = self._meta[bid]
        # no release keyed it: the policy releases it now (``UnifiedPolicy.expose``)
        unkeyed = m.r == rules.UNSET
        policy = self._policy
        key, tier = policy.default_release_place(bid) if unkeyed else (policy.key_of(bid), 1 - m.protected)
        buckets, slots = self._tiers[tier]
        s = int(key * self._scale)
        ids = buckets.get(s)
        if ids is None:
            ids = buckets[s] = deque()
            heapq.heappush(slots, s)
        if unkeyed:
            ids.append(bid)  # (the newest release)
        else:
            meta = self._meta
            ids.insert(rules.release_order_place(len(ids), m.stamp, lambda i: meta[ids[i]].stamp), bid)
        return self.pop()


def _view(policy: EvictionPolicy, now: float) -> _View:
    exp: Any = getattr(policy, "_expiries", None)
    if exp and exp[0][0] <= now:
        policy._expire(now)  # type: ignore[attr-defined]
    if isinstance(policy, LRUPolicy):
        return _LRUView(policy)
    if isinstance(policy, UnifiedPolicy):
        return _UnifiedView(policy)
    if isinstance(policy, HeapOrderedPolicy):
        return _HeapView(policy, now)
    raise TypeError(f"no eviction-order view for policy {policy.name!r}")


def eviction_order(q: RetentionFreeQueue, now: float) -> Iterator[int]:
    """The cached free blocks of ``q`` in the order ``q._evict(all of them)`` would return them (the same
    loop: pop, or pop the parent the last victim exposed, or else the first blocked block)."""
    view = _view(q.policy, now)
    parent = q._parent
    pgen = q._pgen
    gen = q._gen
    children = q._children
    blocked = list(q._blocked)  # (evicted anyway in this order when the policy has nothing left)
    gone: set[int] = set()  # blocked blocks already taken (exposed or evicted anyway)
    stale: set[int] = set()  # blocks evicted while blocked: their children's links went stale
    left: dict[int, int] = {}  # children counts changed by the walk
    nxt = 0
    exposed = NO_PARENT
    while True:
        bid = view.pop() if exposed == NO_PARENT else view.pop_exposed(exposed)
        exposed = NO_PARENT
        if bid is None:
            while nxt < len(blocked) and blocked[nxt] in gone:
                nxt += 1
            if nxt == len(blocked):
                return
            bid = blocked[nxt]
            gone.add(bid)
            stale.add(bid)
        yield bid
        p = parent[bid]
        if p >= 0 and gen[p] == pgen[bid] and p not in stale:
            c = left.get(p, children[p]) - 1
            left[p] = c
            if c == 0 and p in q._blocked and p not in gone:
                gone.add(p)
                exposed = p
