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
        ``max_model_len - 1`` tokens. vLLM's default is the model's context length; kvretain's is None. A KV
        cache too small for one request of ``max_model_len`` tokens is refused (:meth:`check_pool`, which
        ``Scheduler`` calls), as vLLM refuses to start on one; so are the settings vLLM's
        ``SchedulerConfig.verify_max_model_len`` refuses: a budget below ``max_model_len`` without chunked prefill,
        and a budget below ``max_num_seqs`` (checked only with ``max_model_len`` set: without it the scheduler is
        not held to vLLM's start-up rules).
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
        # vLLM 0.33's start-up checks of the budget against the context (verify_max_model_len)
        if m is not None:
            if self.max_num_batched_tokens < m and not self.enable_chunked_prefill:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens:,}) is smaller than max_model_len "
                    f"({m:,}) without chunked prefill: vLLM refuses to start (it would reject every longer prompt); "
                    "raise the budget, lower max_model_len or enable chunked prefill"
                )
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens:,}) must be at least max_num_seqs "
                    f"({self.max_num_seqs:,}): vLLM refuses to start"
                )

    def check_pool(self, num_blocks: int, block_size: int) -> None:
        """``ValueError`` when ``max_model_len`` is set and a pool of ``num_blocks`` blocks of ``block_size``
        tokens cannot hold one request of ``max_model_len`` tokens (:func:`pool_too_small`); vLLM 0.33 refuses
        to start on such a KV cache. Nothing to check without ``max_model_len``."""
        if self.max_model_len is not None:
            reason = pool_too_small(self.max_model_len, num_blocks, block_size)
            if reason is not None:
                raise ValueError(f"max_model_len {self.max_model_len:,}: {reason}")


def pool_too_small(
    max_model_len: int, num_blocks: int, block_size: int, pool: str = "the KV cache"
) -> str | None:
    """Why ``num_blocks`` usable KV blocks of ``block_size`` tokens cannot serve ``max_model_len``, or None.

    vLLM 0.33's start-up check (``vllm/v1/core/kv_cache_planning.py``: ``get_kv_cache_configs`` ->
    ``_check_enough_kv_cache_memory``, "To serve at least one request with the model's max seq len ..."): the KV
    memory of one request of ``max_model_len`` tokens, ``cdiv(max_model_len, block_size)`` blocks
    (``FullAttentionSpec.max_memory_usage_bytes``: all ``max_model_len`` tokens, though a request stops holding
    ``max_model_len - 1`` of KV), must fit the cache's memory less one block (the null block its ``BlockPool``
    holds back). A kvretain pool's blocks are the usable ones, vLLM's null block apart
    (``bench/sched_equivalence.py`` gives vLLM one block more), so the rule here is ``cdiv(max_model_len,
    block_size) <= num_blocks``, and the largest ``max_model_len`` it holds, ``num_blocks * block_size``, is
    vLLM's estimate in its message ("the estimated maximum model length is ...": a binary search over the same
    condition). ``pool`` names the cache in the reason. (The simulator's pool sized by its cost model counts
    the null block as usable: one block more than vLLM's from the same memory, ``costmodel``'s docstring.)"""
    need = -(-max_model_len // block_size)
    if need <= num_blocks:
        return None
    return (
        f"one request of {max_model_len:,} tokens needs {need:,} KV blocks of {block_size:,} tokens, but "
        f"{pool} has {num_blocks:,}: the largest max_model_len it holds is {num_blocks * block_size:,} "
        "(vLLM refuses to start with a KV cache that cannot hold one request of max_model_len tokens)"
    )
