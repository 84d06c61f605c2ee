"""One model replica: a KV cache manager, a scheduler and an executor sharing a virtual clock.

:class:`TrackingKVCacheManager` adds the simulator's cache metrics on top of the core manager without
changing its behaviour: *recomputed tokens* are prompt tokens a lookup misses although this pool had computed
and cached their content before: content evicted since (every evicted hash is remembered until a lookup misses
on it), or content still cached but out of the lookup's reach behind an evicted block (a policy that may evict a
parent before its child, such as ``s3fifo``, leaves such blocks; a prefix lookup stops at the first miss). Unlike the hit
ratio, which counts first lookups only (:mod:`kvretain.core.stats`), a resume after preemption counts here
too: recomputing an evicted block is work whichever lookup finds it missing.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.kv_cache_manager import CacheRequest, KVCacheManager
from kvretain.core.policy import PolicyConfig
from kvretain.core.retention import PriorityMapping
from kvretain.engine.sim.costmodel import CostModel
from kvretain.engine.sim.executor import SimExecutor
from kvretain.engine.sim.request import SimRequest
from kvretain.sched.config import SchedulerConfig
from kvretain.sched.scheduler import Scheduler


class TrackingKVCacheManager(KVCacheManager):
    """A :class:`KVCacheManager` that also counts recomputed tokens per request-priority class."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        policy: str,
        config: PolicyConfig,
        mapping: PriorityMapping,
        clock: Callable[[], float],
    ) -> None:
        super().__init__(num_blocks, block_size, policy, config, mapping, clock=clock)
        self.evicted: set[BlockHash] = set()
        self.recomputed_tokens: dict[int, int] = {}
        inner = self.pool.on_evict_batch

        cached = self.pool.cached

        def on_evict(block_ids: list[int], block_hashes: list[BlockHash]) -> None:
            # (a copy of content another block still holds is no loss: lookups find that block)
            self.evicted.update(h for h in block_hashes if h not in cached)
            if inner is not None:
                inner(block_ids, block_hashes)

        self.pool.on_evict_batch = on_evict

    def on_admitted(self, req: CacheRequest, hit_blocks: int) -> None:
        """At admission: the blocks past its hits whose content this pool evicted earlier, or holds behind a block
        the lookup missed, are recomputed."""
        if not isinstance(req, SimRequest):
            return
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        ev, cached = self.evicted, self.pool.cached
        if max_blocks > hit_blocks:
            hashes: Sequence[BlockHash] = req.block_hashes(bs, max_blocks)
            past = hashes[hit_blocks:max_blocks]
            missed = ev.intersection(past)
            if missed:
                ev.difference_update(missed)
            n = len(missed) + sum(1 for h in past if h in cached and h not in missed)
            if n:
                c = req.priority
                self.recomputed_tokens[c] = self.recomputed_tokens.get(c, 0) + n * bs

    def prefix_match(self, req: SimRequest, max_blocks: int = 64) -> int:
        """Leading blocks of ``req`` cached here (no statistics; for routing)."""
        return leading_in(routing_blocks(req, self.block_size, max_blocks), self.pool.cached)


def routing_blocks(req: SimRequest, block_size: int, max_blocks: int = 64) -> Sequence[BlockHash]:
    """The hashes a router matches ``req`` by: its first full prompt blocks, at most ``max_blocks``, never the
    block of its last prompt token (as vLLM's prefix lookup)."""
    n = min(max_blocks, (req.num_prompt_tokens - 1) // block_size)
    return req.block_hashes(block_size, n)[:n] if n > 0 else ()


def leading_in(hashes: Sequence[BlockHash], held: Container[BlockHash]) -> int:
    """How many of ``hashes``, from the first, are in ``held`` (a prefix match)."""
    k = 0
    for h in hashes:
        if h not in held:
            break
        k += 1
    return k


class Replica:
    """Scheduler + cache + executor of one replica; ``busy`` while a step is in flight."""

    def __init__(
        self,
        index: int,
        cost: CostModel,
        num_blocks: int,
        block_size: int,
        policy: str,
        policy_config: PolicyConfig,
        mapping: PriorityMapping,
        sched_config: SchedulerConfig,
        clock: Callable[[], float],
        requests: dict[str, SimRequest],
    ) -> None:
        self.index = index
        self.kv = TrackingKVCacheManager(num_blocks, block_size, policy, policy_config, mapping, clock)
        self.scheduler = Scheduler(self.kv, sched_config, clock)
        self.executor = SimExecutor(cost, requests)
        self.busy = False
        self.num_steps = 0

    @property
    def load(self) -> int:
        """Requests assigned and not finished (waiting or running)."""
        return self.scheduler.num_unfinished
