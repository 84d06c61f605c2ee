"""Scheduler settings (frozen; validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

from kvretain.sched.queue import QUEUE_POLICIES


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Attributes:
    policy: waiting-queue policy from ``QUEUE_POLICIES`` (``fcfs`` or ``priority``).
    max_num_batched_tokens: token budget of one step (prefill chunks plus decode tokens).
    max_num_seqs: most requests running at once.
    enable_chunked_prefill: split a prompt over steps to fit the budget; without it a prompt that does not
        fit the remaining budget waits for a step where it does (and must fit ``max_num_batched_tokens``).
    waiting_preempts_running: when a waiting request cannot get blocks, preempt running requests that are
        strictly less important than it, least important first, only those needed to make room and none when
        they cannot make it; never one admitted in the same step or whose chunk of the step completes a block
        (it is cached before the step computes it) (vLLM issue #40004; vLLM itself never does this).
    reserve_full_prompt: admit a waiting request only when the free blocks could hold all its tokens, not
        just its first chunk (vLLM 0.33's ``scheduler_reserve_full_isl``, on by default: without it chunked
        prefill over-admits and the running requests' later chunks preempt each other).
    max_model_len: the context length, prompt and output together, or None (unbounded: every request runs to
        its ``max_tokens``). When set, as vLLM 0.33: a prompt of ``max_model_len`` tokens or more is rejected at
        admission (vLLM's input processor refuses it), and a request ends when it holds ``max_model_len``
        tokens (``check_stop``: finished by length, as at ``max_tokens``), so its KV never exceeds
        ``max_model_len - 1`` tokens. vLLM's default is the model's context length; kvretain's is None.
    """

    policy: str = "priority"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    waiting_preempts_running: bool = False
    reserve_full_prompt: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(
                f"unknown queue policy {self.policy!r}; choose one of: {', '.join(QUEUE_POLICIES.names())}"
            )
        for name in ("max_num_batched_tokens", "max_num_seqs"):  # (a NaN budget scheduled nothing, forever)
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        m = self.max_model_len
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_model_len must be an integer >= 1 or None, got {m!r}")
        for name in ("enable_chunked_prefill", "waiting_preempts_running", "reserve_full_prompt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
