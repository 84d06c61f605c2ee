"""``unified``: one policy for request priority, retention directives, reuse frequency, recompute cost and a
protection budget.

Each cached block carries an *effective retention priority* ``r``: the highest priority any request asked for
it (request priority through :class:`~kvretain.core.retention.PriorityMapping`, or an explicit directive),
except that the request scope that set it may also lower it (RFC #37003: anyone may raise, only the owner
may lower). NOTE: the highest-wins rule (not TensorRT-LLM's last-writer-wins) keeps a prefix shared by
important and unimportant traffic from being downgraded by whoever touched it last. A directive's duration
runs from the release; when it lapses ``r`` falls back to the highest *mapped* request priority of the
block's users.

Blocks with ``r >= protect_threshold`` are *protected*. Evictable blocks sit in two GreedyDual heaps
(protected, unprotected) keyed by ``H = L + value``, where::

    value = priority_weight ** ((r - 35) / 10)      # retention weight: +10 points doubles it by default
          * min(uses, frequency_cap) ** frequency_exponent   # reuse frequency (remembered across eviction)
          * (1 + depth_tokens / cost_scale_tokens)  # recompute cost: attention over the prefix

and ``L`` rises to the key of each victim, so blocks that stop being used age out (GreedyDual-Size-Frequency).
Unprotected blocks are evicted first while protected blocks hold at most ``target`` blocks; above it the two
heaps compete on ``H``. ``target`` is the protection budget (``budget`` x pool), or, with ``isolation_goal``,
it adapts inside that budget: a shadow LRU directory of the protected requests' lookups measures the hit
ratio they would get alone in the pool, and the target grows while they get less than ``isolation_goal`` of
it and shrinks otherwise, so protection is spent only where it buys important traffic its isolated hit ratio
and the rest of the pool serves overall reuse. Leaves only: a block never goes before its cached descendants.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.policies._lazyheap import BucketQueue
from kvretain.core.policies.lfu import GhostTable
from kvretain.core.policy import INF, POLICIES, EvictionPolicy, PolicyConfig
from kvretain.core.retention import DEFAULT_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY

_UNSET = -1
_KEY_UNIT = 1.0 / 16.0  # key resolution of the bucket queues (the smallest value is ~0.09)


@POLICIES.register(
    "unified", "priority x frequency x recompute cost with a protection budget (kvretain's policy)"
)
class UnifiedPolicy(EvictionPolicy):
    name = "unified"

    def __init__(self, num_blocks: int, config: PolicyConfig | None = None) -> None:
        super().__init__(num_blocks, config)
        cfg = self.config
        # Two bucket queues keyed by H (0 protected, 1 unprotected), exact to _KEY_UNIT and FIFO within it.
        # ``_stamp[b]`` is the stamp of b's live entry (0: not evictable); older entries are skipped.
        self._stamp = [0] * num_blocks
        self._queues = (BucketQueue(self._stamp, _KEY_UNIT), BucketQueue(self._stamp, _KEY_UNIT))
        self._seq = 0
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._tier = [1] * num_blocks
        self._r = [_UNSET] * num_blocks
        self._base = [_UNSET] * num_blocks
        self._expiry = [INF] * num_blocks
        self._owner: list[str | None] = [None] * num_blocks
        self._uses = [0] * num_blocks
        self._depth = [0] * num_blocks
        self._key = [0.0] * num_blocks  # H fixed at the last release (a parent that becomes a leaf keeps it)
        self._protected = bytearray(num_blocks)
        self._num_protected = 0
        self._expiries: list[tuple[float, int]] = []
        self._ghost = GhostTable(int(cfg.ghost_factor * num_blocks))
        self._ghost_pop = self._ghost.table.pop
        self._L = 0.0
        self._threshold = cfg.protect_threshold
        self._cap = cfg.frequency_cap
        self._exp = cfg.frequency_exponent
        self._weight: list[float] = [
            cfg.priority_weight ** ((r - DEFAULT_RETENTION_PRIORITY) / 10.0)
            for r in range(MAX_RETENTION_PRIORITY + 1)
        ]
        scale = cfg.cost_scale_tokens
        self._cost_per_block = (cfg.block_size / scale) if scale > 0 else 0.0
        self._max_target = cfg.budget * num_blocks
        self._goal = cfg.isolation_goal
        self._target = self._max_target if self._goal is None else 0.5 * self._max_target
        self._shadow: OrderedDict[BlockHash, None] = OrderedDict()
        self._acc_hits = 0.0
        self._acc_shadow = 0.0
        self._step = 0.002 * num_blocks
        self._decay = 0.999

    # ----------------------------------------------------------------- metadata
    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        self._uses[block_id] = self._ghost_pop(block_hash, 0)
        self._hash[block_id] = block_hash
        self._depth[block_id] = depth
        self._r[block_id] = _UNSET
        self._base[block_id] = _UNSET
        self._expiry[block_id] = INF
        self._owner[block_id] = None

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
        # NOTE: hot path (once per released block): retention_of/_set_protected/_value/push are inlined here.
        r = self._r[block_id]
        if (
            r == retention
            and duration_s is None
            and self._expiry[block_id] == INF
            and base <= self._base[block_id]
        ):
            # steady state: the same priority again, nothing to expire; only uses and the key change
            uses = self._uses[block_id]
            if uses < self._cap:
                uses += 1
                self._uses[block_id] = uses
            f = float(uses) if self._exp == 1.0 else float(uses**self._exp)
            key = self._L + self._weight[r] * f * (1.0 + self._depth[block_id] * self._cost_per_block)
            self._key[block_id] = key
            if evictable:
                self._push(block_id, 1 - self._protected[block_id], key)
            return
        uses = self._uses[block_id]
        if uses < self._cap:
            uses += 1
            self._uses[block_id] = uses
        b = self._base[block_id]
        if base > b:
            self._base[block_id] = b = base
        expiry = self._expiry[block_id]
        if r == _UNSET:
            cur = b
        elif expiry <= now:
            cur = b if b > 0 else 0
        else:
            cur = r
        exp = INF if duration_s is None else now + duration_s
        if retention > cur or (retention < cur and scope is not None and scope == self._owner[block_id]):
            self._r[block_id] = cur = retention
            self._expiry[block_id] = exp
            if scope is not None:
                self._owner[block_id] = scope
            if exp != INF and retention > b:
                heapq.heappush(self._expiries, (exp, block_id))
        elif retention == cur and exp > expiry:
            self._expiry[block_id] = exp  # refresh on reuse at the same priority
            if exp != INF:
                heapq.heappush(self._expiries, (exp, block_id))
        p = 1 if cur >= self._threshold else 0
        if p != self._protected[block_id]:
            self._protected[block_id] = p
            self._num_protected += 1 if p else -1
        f = float(uses) if self._exp == 1.0 else float(uses**self._exp)
        key = self._L + self._weight[cur] * f * (1.0 + self._depth[block_id] * self._cost_per_block)
        self._key[block_id] = key
        if evictable:
            self._push(block_id, 1 - p, key)

    def retention_of(self, block_id: int, now: float) -> int:
        r = self._r[block_id]
        if r == _UNSET:
            return DEFAULT_RETENTION_PRIORITY if self._base[block_id] == _UNSET else self._base[block_id]
        if self._expiry[block_id] <= now:
            return max(self._base[block_id], 0)
        return r

    def _set_protected(self, block_id: int, now: float) -> None:
        p = 1 if self.retention_of(block_id, now) >= self._threshold else 0
        if p != self._protected[block_id]:
            self._protected[block_id] = p
            self._num_protected += 1 if p else -1

    def on_lookup(self, hashes: Sequence[BlockHash], num_hits: int, retention: int) -> None:
        if self._goal is None or retention < self._threshold or not hashes:
            return
        shadow = self._shadow
        k = 0
        n = len(hashes)
        while k < n and hashes[k] in shadow:
            k += 1
        for i in range(n - 1, -1, -1):  # deepest first, as a release would order them
            h = hashes[i]
            shadow[h] = None
            shadow.move_to_end(h)
        while len(shadow) > self.num_blocks:
            shadow.popitem(last=False)
        self._acc_hits = self._acc_hits * self._decay + num_hits
        self._acc_shadow = self._acc_shadow * self._decay + k
        if self._acc_hits < self._goal * self._acc_shadow:
            self._target = min(self._max_target, self._target + self._step)
        else:
            self._target = max(0.0, self._target - self._step)

    # ----------------------------------------------------------------- order
    def _value(self, block_id: int, now: float) -> float:
        u = self._uses[block_id]
        f = float(u) if self._exp == 1.0 else float(u**self._exp)
        return (
            self._weight[self.retention_of(block_id, now)]
            * (f if f > 0.0 else 0.5)
            * (1.0 + self._depth[block_id] * self._cost_per_block)
        )

    def _push(self, block_id: int, tier: int, key: float) -> None:
        self._seq += 1
        seq = self._seq
        if self._stamp[block_id]:
            self._queues[self._tier[block_id]].removed()
        self._stamp[block_id] = seq
        self._tier[block_id] = tier
        self._queues[tier].push(block_id, key, seq)

    def push(self, block_id: int, now: float) -> None:
        self._push(block_id, 0 if self._protected[block_id] else 1, self._key[block_id])

    def remove(self, block_id: int) -> None:
        if not self._stamp[block_id]:
            raise KeyError(block_id)
        self._stamp[block_id] = 0
        self._queues[self._tier[block_id]].removed()

    def _expire(self, now: float) -> None:
        exp = self._expiries
        while exp and exp[0][0] <= now:
            t, bid = heapq.heappop(exp)
            if self._expiry[bid] != t:
                continue
            self._expiry[bid] = INF
            self._r[bid] = self._base[bid]
            self._set_protected(bid, now)
            self._key[bid] = self._L + self._value(bid, now)
            if self._stamp[bid]:
                self.push(bid, now)

    def pop(self, now: float) -> int | None:
        if self._expiries and self._expiries[0][0] <= now:
            self._expire(now)
        q0, q1 = self._queues
        if q1.n and (self._num_protected <= self._target or not q0.n):
            bid = q1.pop()
        elif q0.n and q1.n:
            # over the protected target: the two tiers compete on their keys
            s0, b0 = q0.head()
            s1, b1 = q1.head()
            bid = q0.pop() if (s0, self._key[b0]) < (s1, self._key[b1]) else q1.pop()
        elif q0.n:
            bid = q0.pop()
        else:
            return None
        key = self._key[bid]
        if key > self._L:
            self._L = key
        # eviction bookkeeping fused here (hot path); on_evicted only handles blocks dropped without a pop
        h = self._hash[bid]
        if h is not None:
            self._hash[bid] = None
            self._ghost.put(h, self._uses[bid])
        if self._protected[bid]:
            self._protected[bid] = 0
            self._num_protected -= 1
        return bid

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        # per-block metadata is reset in on_cached when the block gets new content
        if self._hash[block_id] is not None:
            self._hash[block_id] = None
            self._ghost.put(block_hash, self._uses[block_id])
            if self._protected[block_id]:
                self._protected[block_id] = 0
                self._num_protected -= 1

    def __len__(self) -> int:
        return self._queues[0].n + self._queues[1].n

    def evictable_ids(self) -> set[int]:
        return {b for b, st in enumerate(self._stamp) if st}

    def stats(self) -> dict[str, float]:
        return {
            "protected_blocks": float(self._num_protected),
            "protected_target": self._target,
            "protected_budget": self._max_target,
        }
