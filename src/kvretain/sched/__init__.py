"""kvretain.sched: request lifecycle, waiting-queue policies and continuous batching. Plain Python, no torch.

Public contract::

    Request                   tokens, priority, retention, lifecycle and times (a core CacheRequest)
    QUEUE_POLICIES            fcfs, priority
    SchedulerConfig           token budget, max running requests, chunked prefill, waiting-preempts-running,
                              max_model_len (check_pool: the KV cache holds one request of it, else ValueError)
    Scheduler                 Scheduler(kv, config) (ValueError: config.check_pool fails on kv's pool)
                              add_request(req) -> bool (False: REJECTED, it can never fit; req.rejection says why)
                              schedule() -> SchedulerOutput; update_from_output(out, RunnerOutput)
"""

from kvretain.sched.config import SchedulerConfig
from kvretain.sched.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from kvretain.sched.queue import QUEUE_POLICIES, FCFSQueue, PriorityQueue, WaitingQueue, make_queue
from kvretain.sched.request import Request, RequestStatus
from kvretain.sched.scheduler import Scheduler

__all__ = [
    "QUEUE_POLICIES",
    "FCFSQueue",
    "PriorityQueue",
    "Request",
    "RequestStatus",
    "RunnerOutput",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "WaitingQueue",
    "make_queue",
]
