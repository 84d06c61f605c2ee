"""Routers: which replica serves a new request. All live in ``ROUTERS``; deterministic (ties -> lowest index).

* ``round-robin``: replicas in turn.
* ``least-loaded``: fewest unfinished requests.
* ``prefix-affinity``: the replica caching the longest prefix of the prompt (first 64 blocks), unless its
  load exceeds the least-loaded replica's by more than ``slack`` requests; no match: least-loaded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvretain.engine.sim.replica import Replica
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
        low = _least_loaded(replicas)
        match = [r.kv.prefix_match(req) for r in replicas]
        best = min(range(len(replicas)), key=lambda i: (-match[i], replicas[i].load, i))
        if replicas[best].load > replicas[low].load + self.slack:
            return low
        return best
