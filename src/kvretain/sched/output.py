"""The contract between the scheduler and an executor (simulated or real).

One step::

    Scheduler.schedule() -> SchedulerOutput --executor--> RunnerOutput -> Scheduler.update_from_output(...)

A :class:`ScheduledChunk` asks the executor to compute ``num_new_tokens`` tokens of a request whose first
``num_computed_tokens`` tokens already have KV (prefix-cache hits and earlier chunks). When ``samples`` is
True the chunk reaches the end of the request's known tokens, so the executor samples one token for it (a
partial prefill chunk samples nothing). A decode step is a chunk of one token that samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ScheduledChunk(NamedTuple):
    request_id: str
    num_new_tokens: int
    num_computed_tokens: int
    samples: bool


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What to run this step. ``chunks`` lists running requests first, then newly scheduled ones."""

    step: int
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()
    num_scheduled_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """The tokens sampled this step: ``token_ids[i]`` for ``req_ids[i]`` (requests whose chunk samples)."""

    req_ids: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.token_ids):
            raise ValueError(
                f"RunnerOutput: {len(self.req_ids)} request ids but {len(self.token_ids)} token ids"
            )
