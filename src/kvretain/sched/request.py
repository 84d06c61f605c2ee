"""A request as the scheduler sees it: its tokens, priority, retention and lifecycle.

Lifecycle::

    WAITING --schedule--> RUNNING --last token--> FINISHED
       ^                     |
       +----preempt----- PREEMPTED          (any state) --abort--> ABORTED

    (on admission) --can never fit the replica--> REJECTED   (``rejection`` says why; see Scheduler.add_request)

Token accounting follows vLLM: ``num_tokens = num_prompt_tokens + len(output_token_ids)``; the scheduler
computes ``num_tokens - num_computed_tokens`` more tokens (a prompt chunk, or the one token sampled last
step). Requests order totally by ``(priority, arrival_time, request_id)`` (lower priority = more important),
as vLLM's priority queue does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import overload

from kvretain.core.hashing import ExtraKeys
from kvretain.core.retention import RetentionConfig, check_request_priority, show_value

INF = float("inf")


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    ABORTED = 4
    REJECTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


class TokenIds(Sequence[int]):
    """``prompt + output`` of a request as one read-only sequence; ``len`` is O(1), tokens come on demand
    (a lazy prompt is materialized only when an item is read)."""

    __slots__ = ("_req",)

    def __init__(self, req: Request) -> None:
        self._req = req

    def __len__(self) -> int:
        return self._req.num_tokens

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        full = list(self._req.prompt_token_ids) + self._req.output_token_ids
        return full[i]

    def __iter__(self) -> Iterator[int]:
        yield from self._req.prompt_token_ids
        yield from self._req.output_token_ids


class Request:
    """One generation request. Satisfies :class:`kvretain.core.kv_cache_manager.CacheRequest`.

    ``prompt_token_ids`` may be any sequence (a lazy one is fine: only its length is read unless the cache
    manager hashes tokens). ``max_tokens`` >= 1 output tokens are generated. Times are in the caller's clock
    (virtual seconds in the simulator): ``arrival_time`` on construction, ``first_scheduled_time`` when it
    first gets a step, ``token_times`` one per output token, ``finish_time`` at the end.
    ``num_cached_tokens``: the prefix-cache hit of its first admission (``None`` before), what vLLM's API
    reports as ``usage.prompt_tokens_details.cached_tokens`` (the hit of the first scheduled prefill; a
    resume after preemption does not change it).
    """

    __slots__ = (
        "arrival_time",
        "extra_keys",
        "finish_time",
        "first_scheduled_time",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "priority",
        "prompt_token_ids",
        "rejection",
        "request_id",
        "retention",
        "status",
        "token_times",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        arrival_time: float = 0.0,
        priority: int = 0,
        retention: RetentionConfig | None = None,
        extra_keys: ExtraKeys | None = None,
    ) -> None:
        if not isinstance(
            request_id, str
        ):  # (ids order ties in the waiting queue: an int beside a str broke it)
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        n = len(prompt_token_ids)
        if n < 1:
            raise ValueError(f"request {request_id!r}: the prompt must hold at least one token")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(
                f"request {request_id!r}: max_tokens must be an integer >= 1, got {show_value(max_tokens)}"
            )
        if (
            isinstance(arrival_time, bool)
            or not isinstance(arrival_time, int | float)
            or not 0 <= arrival_time < INF
        ):
            # (a NaN arrival broke the waiting queue's order for every request)
            raise ValueError(
                f"request {request_id!r}: arrival_time must be a finite number >= 0, got {show_value(arrival_time)}"
            )
        check_request_priority(priority, f"request {request_id!r}: priority")
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = n
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.priority = priority
        self.retention = retention
        self.extra_keys = extra_keys or ExtraKeys()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.finish_time: float | None = None
        self.rejection: str | None = None  # why it was refused at admission (status REJECTED)

    # --- CacheRequest ---------------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> Sequence[int]:
        return TokenIds(self)

    # --- token accounting -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def max_kv_tokens(self) -> int:
        """The most tokens whose KV the request ever holds: prompt and output, less the last sampled token
        (it is never fed back)."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    def append_output(self, token_id: int, now: float) -> bool:
        """Record a sampled token at time ``now``; returns True when the request has all its tokens."""
        self.output_token_ids.append(token_id)
        self.token_times.append(now)
        return len(self.output_token_ids) >= self.max_tokens

    # --- times ----------------------------------------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds), once known."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, once finished with at least two tokens."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queueing_time(self) -> float | None:
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    # --- order ----------------------------------------------------------------------------------------
    def __lt__(self, other: Request) -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prio={self.priority}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
