"""Routers: which replica serves a new request. All live in ``ROUTERS``; deterministic (ties -> lowest index).

* ``round-robin``: replicas in turn.
* ``least-loaded``: fewest unfinished requests.
* ``prefix-affinity``: the replica caching the longest prefix of the prompt (first 64 blocks), unless its
  load exceeds the least-loaded replica's by more than ``slack`` requests; no match: least-loaded.
* ``prefix-memory``: the same rule on the router's own record of the prompts it sent each replica, not on the
  replicas' caches, as SGLang's cache-aware router (an approximate radix tree per worker) and vLLM production
  stack's prefix-aware router keep one. An eviction then does not move a conversation to another replica: with
  ``prefix-affinity`` a prefix evicted by the policy sends the next turn elsewhere, where it is cached again, so
  the eviction policy also decides the routing (docs/results.md, "A public trace no session had").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

from kvretain.core.hashing import BlockHash
from kvretain.engine.sim.replica import Replica, leading_in, routing_blocks
from kvretain.engine.sim.request import SimRequest
from kvretain.registry import Registry


class Router(ABC):
    @abstractmethod
    def route(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        """Index of the replica that gets ``req``."""


ROUTERS: Registry[Router] = Registry("router")


def _least_loaded(replicas: Sequence[Replica]) -> int:
    return min(range(len(replicas)), key=lambda i: (replicas[i].load, i))


@ROUTERS.register("round-robin", "replicas in turn")
class RoundRobin(Router):
    def __init__(self) -> None:
        self._next = 0

    def route(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


@ROUTERS.register("least-loaded", "fewest unfinished requests")
class LeastLoaded(Router):
    def route(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        return _least_loaded(replicas)


@ROUTERS.register("prefix-affinity", "longest cached prefix, bounded by load")
class PrefixAffinity(Router):
    def __init__(self, slack: int = 8) -> None:
        self.slack = slack

    def route(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        if len(replicas) == 1:
            return 0
        return _longest_match([r.kv.prefix_match(req) for r in replicas], replicas, self.slack)


def _longest_match(match: Sequence[int], replicas: Sequence[Replica], slack: int) -> int:
    """The replica of the longest ``match`` (ties: the less loaded, then the lower index), unless its load
    exceeds the least-loaded replica's by more than ``slack`` requests; then the least-loaded."""
    low = _least_loaded(replicas)
    best = min(range(len(replicas)), key=lambda i: (-match[i], replicas[i].load, i))
    if replicas[best].load > replicas[low].load + slack:
        return low
    return best


@ROUTERS.register("prefix-memory", "longest prefix this router sent there (its own record), bounded by load")
class PrefixMemory(Router):
    """``prefix-affinity``'s rule on a record of what was routed where: per replica (by its ``index``: the
    simulator offers only the replicas that can hold a request), the hashes of the first ``max_blocks`` blocks of
    the prompts sent there, least recently routed dropped first beyond the replica's pool size in blocks (what
    the replica could hold at most); a prompt is recorded deepest first, so its first blocks are dropped last."""

    def __init__(self, slack: int = 8, max_blocks: int = 64) -> None:
        self.slack = slack
        self.max_blocks = max_blocks
        self._sent: dict[int, OrderedDict[BlockHash, None]] = {}

    def route(self, req: SimRequest, replicas: Sequence[Replica]) -> int:
        hashes = routing_blocks(req, replicas[0].kv.block_size, self.max_blocks)
        records = [self._sent.setdefault(r.index, OrderedDict()) for r in replicas]
        i = _longest_match([leading_in(hashes, sent) for sent in records], replicas, self.slack)
        sent = records[i]
        for h in reversed(hashes):
            sent[h] = None
            sent.move_to_end(h)
        over = len(sent) - replicas[i].kv.pool.num_blocks
        for _ in range(over):
            sent.popitem(last=False)
        return i
