"""Waiting queues: ``fcfs`` (arrival order; a preempted request goes back to the front, as in vLLM) and
``priority`` (a heap on the request's total order ``(priority, arrival_time, request_id)``).

Both live in ``QUEUE_POLICIES``; the CLI lists the names from it.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from kvretain.registry import Registry
from kvretain.sched.request import Request


class WaitingQueue(ABC):
    """The requests waiting for a first (or, after preemption, another) schedule."""

    @abstractmethod
    def add(self, req: Request) -> None:
        """A new arrival."""

    @abstractmethod
    def add_preempted(self, req: Request) -> None:
        """A request just preempted (it resumes before later arrivals of its rank)."""

    @abstractmethod
    def peek(self) -> Request:
        """The next request to schedule (raises ``IndexError`` when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return :meth:`peek`."""

    @abstractmethod
    def remove(self, req: Request) -> None:
        """Remove ``req`` (abort); ``ValueError`` when absent."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in scheduling order."""


QUEUE_POLICIES: Registry[WaitingQueue] = Registry("queue policy")


@QUEUE_POLICIES.register("fcfs", "first come, first served (vLLM's default)")
class FCFSQueue(WaitingQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_preempted(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._q))


@QUEUE_POLICIES.register("priority", "lowest (priority, arrival, id) first, as vLLM's priority policy")
class PriorityQueue(WaitingQueue):
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, req)

    def add_preempted(self, req: Request) -> None:
        heapq.heappush(self._heap, req)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, req: Request) -> None:
        self._heap.remove(req)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def make_queue(name: str) -> WaitingQueue:
    return QUEUE_POLICIES.create(name)
