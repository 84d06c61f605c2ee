"""The eviction-policy contract and its registry.

A policy ranks the *evictable* blocks of a :class:`~kvretain.core.block_pool.BlockPool`: blocks that are free
(reference count 0), carry a hash (their content is reusable) and, for ``leaf_only`` policies, have no cached
child. The pool owns reference counts, the hash index and the parent/child links; the policy owns its order
and any per-block metadata, indexed by block id (so the same policy object can rank a foreign pool's blocks,
e.g. vLLM's, by id).

Life of a hashed block, as the policy sees it::

    on_cached(id, hash, depth)      new content registered under a hash (metadata starts fresh; a pool
                                    announces a request's registrations in one on_cached_run)
    on_release(id, retention...)    a request stopped using it (one "use"; may still be in use by others)
    push(id) / remove(id)           it became evictable / stopped being evictable (hit, or gained a child)
    pop(now) -> id | None           choose and remove a victim; the pool then calls on_evicted(id, hash)
    expose(parent, now)             a victim's parent lost its last cached child: it is evictable now
    pop_exposed(parent, now)        expose(parent) + pop(now) in one call

and, for a policy that asks for it (``hears_allocations``), ``on_allocate(n, empty)`` at the start of each
allocation of a :class:`~kvretain.core.block_pool.BlockPool` (the pops that follow are that allocation's).

Every method must be O(1) or O(log n) in the pool size.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvretain.core.hashing import BlockHash
from kvretain.core.retention import (
    DEFAULT_RETENTION_PRIORITY,
    MAX_RETENTION_PRIORITY,
    MIN_RETENTION_PRIORITY,
    show_value,
)
from kvretain.registry import Registry

INF = float("inf")
DEFAULT_BLOCK_SIZE = 16
"""``PolicyConfig.block_size``'s default: vLLM's default KV block of 16 tokens."""
NO_PARENT = -1


class BlockState:
    """A block's pool state (reference count, hash, parent link, evictable flag), one slotted object per block.

    NOTE: a policy may subclass it to keep its own per-block fields in the same object (see
    :meth:`EvictionPolicy.block_states`): the pool and the policy then touch one object per block instead of
    two, which at 10^5-10^6 blocks saves a cache miss per block on every hot path.
    """

    __slots__ = ("block_hash", "evictable", "num_children", "parent", "ref_cnt")

    def __init__(self) -> None:
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.parent = NO_PARENT
        self.num_children = 0
        self.evictable = False


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Options of every policy (each policy reads the ones it understands).

    Attributes:
        budget: unified: the largest share of the pool that protected blocks may hold (0..1).
        isolation_goal: unified: when set, the protected share adapts (up to ``budget``) so that protected
            traffic keeps this fraction of the hits it would get alone in the pool (measured online, see
            :mod:`kvretain.core.policies.protection`), as far as ``max_reuse_loss`` allows; ``None`` (or ``0``,
            stored as ``None``: the command line's and the plugin's spelling too) keeps the protected share fixed
            at ``budget``.
        max_reuse_loss: unified: the controller keeps overall reuse at least ``1 - max_reuse_loss`` of what plain
            LRU would hit in this pool (estimated online), whatever the isolation goal asks.
        protect_threshold: unified: blocks whose effective retention priority is at least this are protected.
        priority_weight: unified: a block's value is multiplied by this for every 10 retention-priority points
            above 35 (divided below); 1 disables the soft bias and leaves only the protected/unprotected tiers.
        frequency_exponent: unified: value grows as ``uses ** frequency_exponent``.
        frequency_cap: unified/lfu: uses counted up to this many.
        adapt_frequency: unified: the exponent moves between 0 (recency) and ``frequency_exponent`` times one of
            ``FREQUENCY_RUNGS`` (1, 2 or 4), by which hits most on a sample of the traffic
            (:mod:`kvretain.core.policies.balance`); False keeps ``frequency_exponent``.
        cost_scale_tokens: unified: recompute cost of a block at token depth p is ``1 + p / cost_scale_tokens``
            (attention over the prefix against the linear FLOPs; ~28.6k tokens for Llama-3-8B). ``0`` (default)
            disables it: on the Mooncake trace the depth term lowered the block hit ratio (deep blocks are
            reused less often than their recompute cost suggests).
        ghost_factor: unified/lfu: evicted hashes whose use counts are remembered, as a multiple of the pool.
        block_size: tokens per block (for the cost term and unified's sampling stride). A
            :class:`~kvretain.core.kv_cache_manager.KVCacheManager` building its policy by name adopts its own
            block size when this is the default (``DEFAULT_BLOCK_SIZE``, 16) and refuses any other value that
            differs from it.
        next_use: belady only: ``next_use(block_hash) -> time of the next request that uses it`` (inf: never), a
            number (belady refuses ``None``, a string, a bool or NaN when it asks).
    """

    budget: float = 0.95
    isolation_goal: float | None = 0.9
    max_reuse_loss: float = 0.02
    protect_threshold: int = DEFAULT_RETENTION_PRIORITY
    priority_weight: float = 2.0
    frequency_exponent: float = 1.0
    frequency_cap: int = 64
    adapt_frequency: bool = True
    cost_scale_tokens: float = 0.0
    ghost_factor: float = 4.0
    block_size: int = DEFAULT_BLOCK_SIZE
    next_use: Callable[[BlockHash], float] | None = None

    def __post_init__(self) -> None:
        _number("budget", self.budget, 0.0, 1.0, "a share of the pool")
        if type(self.isolation_goal) in (int, float) and self.isolation_goal == 0:
            object.__setattr__(self, "isolation_goal", None)  # a goal of nothing: the fixed share
        if self.isolation_goal is not None:
            _number(
                "isolation_goal",
                self.isolation_goal,
                0.0,
                1.0,
                "a fraction of the isolated hits; 0 or None: a fixed budget",
            )
        _number(
            "max_reuse_loss",
            self.max_reuse_loss,
            0.0,
            1.0,
            "a share of plain LRU's hits that the isolation controller may give up",
        )
        _integer(
            "protect_threshold",
            self.protect_threshold,
            MIN_RETENTION_PRIORITY,
            MAX_RETENTION_PRIORITY,
            "a retention priority",
        )
        _number(
            "priority_weight",
            self.priority_weight,
            1.0,
            INF,
            "below 1 it would rank lower retention priorities above higher ones; 1 turns the bias off",
        )
        _number(
            "frequency_exponent",
            self.frequency_exponent,
            0.0,
            INF,
            "below 0 more uses would make a block worth less; 0 turns frequency off",
        )
        _integer(
            "frequency_cap", self.frequency_cap, 1, MAX_FREQUENCY_CAP, "a count of uses; MAX_FREQUENCY_CAP"
        )
        if self.cost_scale_tokens != 0 or isinstance(self.cost_scale_tokens, bool):  # (False == 0)
            _number(
                "cost_scale_tokens", self.cost_scale_tokens, 1.0, INF, "tokens; 0 turns the cost term off"
            )
        if not isinstance(self.adapt_frequency, bool):  # ("false" is truthy: it would turn the balance on)
            raise ValueError(f"adapt_frequency must be True or False, got {show_value(self.adapt_frequency)}")
        _number("ghost_factor", self.ghost_factor, 0.0, MAX_GHOST_FACTOR, "a multiple of the pool size")
        _integer("block_size", self.block_size, 1, None, "tokens per block")
        if self.next_use is not None and not callable(self.next_use):
            raise ValueError(f"next_use must be a function of a block hash or None, got {self.next_use!r}")
        # value = priority_weight ** ((r - 35) / 10) * min(uses, cap) ** exponent (x a depth term >= 1): its
        # largest value must leave GreedyDual keys finite. L rises to each victim's key, so after n
        # evictions L <= n * max value; MAX_VALUE keeps that finite for far more evictions than any run makes.
        # (with adapt_frequency the exponent may reach frequency_exponent x the top rung)
        top = (MAX_RETENTION_PRIORITY - DEFAULT_RETENTION_PRIORITY) / 10.0
        rung = max(FREQUENCY_RUNGS) if self.adapt_frequency else 1.0
        exponent = self.frequency_exponent * rung
        try:
            largest = self.priority_weight**top * float(self.frequency_cap) ** exponent
        except OverflowError:
            largest = INF
        if not largest <= MAX_VALUE:
            scaled = f" (x {rung:g}, the balance's top rung)" if rung != 1.0 else ""
            raise ValueError(
                f"priority_weight and frequency_exponent: the largest block value, priority_weight ** {top:g} x "
                f"frequency_cap ** frequency_exponent{scaled} = {self.priority_weight!r} ** {top:g} x "
                f"{self.frequency_cap} ** {exponent!r}, exceeds {MAX_VALUE:g}; use smaller values"
            )


FREQUENCY_RUNGS = (1.0, 2.0, 4.0)
"""``unified``'s frequency candidates, as multiples of ``frequency_exponent`` (the reasons:
:mod:`kvretain.core.policies.balance`)."""
MAX_VALUE = 1e100
"""The largest block value ``unified`` accepts: keys are ``L + value`` with ``L`` at most (evictions x largest
value), so 1e100 leaves 10^200 evictions before a key could overflow a float (1.8e308)."""
MAX_FREQUENCY_CAP = 1 << 16
"""The largest ``frequency_cap``: 65,536 uses. ``unified`` keeps a table of ``uses ** exponent`` for 0..cap
(:func:`kvretain.core.policies.rules.frequency_terms`, rebuilt whenever the balance moves the exponent), so the
cap is a list's length: 65,536 entries are 0.5 MiB and milliseconds to build, while ``1e18`` asked for a list
that never finished. Counting further changes nothing in practice: the default is 64, and a block's value
grows with ``uses ** exponent`` only up to the cap (the vLLM run queue counts at most 255)."""
MAX_GHOST_FACTOR = 1e3
"""The ghost table holds ``ghost_factor`` x pool entries: 1,000 x the pool already needs far more memory than
the pool itself (defaults: 4)."""


def _number(name: str, value: object, lo: float, hi: float, what: str, lo_open: bool = False) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if number and (lo < value if lo_open else lo <= value) and value <= hi:  # type: ignore[operator]
        return
    lo_s = f"({lo:g}" if lo_open else f"[{lo:g}"
    rng = f">= {lo:g}" if hi == INF else f"in {lo_s}, {hi:g}]"
    raise ValueError(f"{name} must be a finite number {rng} ({what}), got {show_value(value)}")


def _integer(name: str, value: object, lo: int, hi: int | None, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value and (hi is None or value <= hi):
        return
    rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{name} must be an integer {rng} ({what}), got {show_value(value)}")


class EvictionPolicy(ABC):
    """Orders evictable blocks; see the module docstring for the call protocol."""

    name: ClassVar[str] = ""
    leaf_only: ClassVar[bool] = True
    """When True the pool offers only blocks without cached children (no orphaned descendants)."""
    tracks_uses: ClassVar[bool] = True
    """When False the pool skips ``on_release`` calls (pure-recency policies)."""
    forgets_on_pop: ClassVar[bool] = False
    """When True ``pop`` already does what ``on_evicted`` would for the victim, and the pool skips that call
    after a ``pop`` (it still calls ``on_evicted`` for blocks dropped otherwise, e.g. by a prefix-cache reset)."""
    hears_allocations: ClassVar[bool] = False
    """When True a :class:`~kvretain.core.block_pool.BlockPool` calls :meth:`on_allocate` at each allocation (read
    once, when the pool is built: for the other policies an allocation costs one test of a flag)."""

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        if config is not None and not isinstance(config, PolicyConfig):
            raise TypeError(f"config must be a PolicyConfig or None, got {show_value(config)}")
        self.num_blocks = num_blocks
        self.config = config or PolicyConfig()
        self.capacity = num_blocks if capacity is None else _checked_capacity(capacity, num_blocks)
        """How many of the ``num_blocks`` block ids can hold cached content: what sizes a policy's queues,
        ghosts and shadows (block ids still run over all ``num_blocks``). Every block in kvretain's pool; vLLM's
        keeps one as its null block, which never holds content, so the plugin passes the blocks it was given
        free (``num_blocks - 1``): a policy sized by every id modelled a cache one block larger than the pool
        (the controller's LRU shadow hit more than this pool's LRU could)."""
        self.in_pool = False
        """Set by the :class:`~kvretain.core.block_pool.BlockPool` that hosts it: a policy orders one pool's
        blocks (its per-block state and order are that pool's), so a second pool refuses it."""

    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:  # noqa: B027
        """``block_id`` now holds new content identified by ``block_hash`` at block depth ``depth``."""

    def on_cached_run(
        self,
        block_ids: Sequence[int] | Mapping[int, int],
        hashes: Sequence[BlockHash] | Mapping[int, BlockHash],
        start: int,
        end: int,
        now: float,
    ) -> None:
        """``on_cached(block_ids[i], hashes[i], i, now)`` for ``start <= i < end``, in that order (a run of a
        request's newly registered blocks, parents first). One call per request on the hot path, after the pool
        has checked the whole call; policies may override it with a fused loop."""
        on_cached = self.on_cached
        for i in range(start, end):
            on_cached(block_ids[i], hashes[i], i, now)

    def on_release(  # noqa: B027
        self,
        block_id: int,
        retention: int,
        duration_s: float | None,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        """A request released ``block_id`` (one use) asking for ``retention`` for ``duration_s`` seconds
        (None: no expiry), on behalf of ``scope``; ``base`` is what its request priority maps to (the level a
        lapsed duration may fall back to)."""

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
        """``on_release`` followed by ``push`` when the release made the block evictable (one call on the hot
        path; policies may override it with a fused version)."""
        self.on_release(block_id, retention, duration_s, scope, now, base)
        if evictable:
            self.push(block_id, now)

    def release_run(
        self,
        block_ids: Sequence[int],
        evictable_ids: Sequence[int],
        retention: int,
        scope: str | None,
        now: float,
        base: int,
    ) -> None:
        """``release`` for each block of ``block_ids`` (in release order), all at ``retention`` without expiry;
        ``evictable_ids`` (a subsequence of ``block_ids``) are the blocks the release made evictable, pushed
        in that order after the releases. One call per request on the hot path; policies may override it
        with a fused loop. A pool gives a policy that does not track uses (``tracks_uses`` False) only
        ``evictable_ids`` (``block_ids`` empty), whatever the retention."""
        release = self.release
        for bid in block_ids:
            release(bid, retention, None, scope, now, base, False)
        for bid in evictable_ids:
            self.push(bid, now)

    def on_arrival(self, hashes: Sequence[BlockHash], retention: int) -> object | None:
        """A request whose blocks are ``hashes`` arrived (an engine that hashes requests as it takes them in
        calls this there, before their first lookup); what it returns goes to that lookup's ``on_lookup``.
        ``None`` here: no policy but ``unified`` does work per request ahead of its lookup."""
        return None

    def lookup(
        self, hashes: Sequence[BlockHash], num_hits: int, retention: int, seen: object | None = None
    ) -> None:
        """Hand a first lookup to :meth:`on_lookup`, with what :meth:`on_arrival` returned when there is one (a
        policy written before ``on_arrival`` takes three arguments, and is called so when nothing arrived)."""
        if seen is None:
            self.on_lookup(hashes, num_hits, retention)
        else:
            self.on_lookup(hashes, num_hits, retention, seen)

    def on_lookup(  # noqa: B027
        self, hashes: Sequence[BlockHash], num_hits: int, retention: int, seen: object | None = None
    ) -> None:
        """A request looked up its prefix: ``num_hits`` leading blocks of ``hashes`` were cached. ``seen``: what
        :meth:`on_arrival` returned for this request, if it was called."""

    def on_allocate(self, n: int, empty: int) -> None:  # noqa: B027
        """``BlockPool.get_new_blocks(n)`` begins (only for a policy whose ``hears_allocations`` is True): the pool
        holds ``empty`` empty blocks and hands out ``min(n, empty)`` of them first, then one victim of :meth:`pop`
        (or :meth:`pop_exposed`) for each further block, in the order of the blocks it returns. Every call that
        gets past the checks of ``n`` and of the clock is announced, also one that then fails (``None``: fewer
        free blocks than ``n``, nothing popped), so that a policy can tell the pops of one allocation from the
        next one's. A pool that is not kvretain's (the vLLM plugin's queues) never calls it."""

    @abstractmethod
    def push(self, block_id: int, now: float) -> None:
        """``block_id`` became evictable."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """``block_id`` is no longer evictable (it was hit or gained a cached child)."""

    @abstractmethod
    def pop(self, now: float) -> int | None:
        """Choose a victim among evictable blocks, remove it from the order, return its id (None if empty)."""

    def expose(self, block_id: int, now: float) -> None:
        """``block_id`` became evictable because its last cached child was evicted (default: ``push``)."""
        self.push(block_id, now)

    def pop_exposed(self, block_id: int, now: float) -> int | None:
        """``expose(block_id)`` then ``pop(now)``: the pool's eviction loop calls this when the previous
        victim's parent became evictable and another victim is needed right away. Policies may fuse it (evict
        the parent directly when it is next in line, without queueing it)."""
        self.expose(block_id, now)
        return self.pop(now)

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:  # noqa: B027
        """``block_id``'s content was dropped."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of evictable blocks."""

    @abstractmethod
    def evictable_ids(self) -> set[int]:
        """The evictable block ids (integrity checks; O(n))."""

    def block_states(self) -> list[BlockState]:
        """The per-block objects a :class:`~kvretain.core.block_pool.BlockPool` keeps its state in (called once,
        when the pool is built): fresh :class:`BlockState` objects, or the policy's own per-block objects when
        they subclass it (one object per block for both)."""
        return [BlockState() for _ in range(self.num_blocks)]

    def retention_of(self, block_id: int, now: float) -> int:
        """The block's effective retention priority now (policies without one report the default)."""
        return DEFAULT_RETENTION_PRIORITY

    def stats(self) -> dict[str, float]:
        """Policy-specific figures (e.g. the current protected target)."""
        return {}


POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")


def make_policy(
    name: str, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
) -> EvictionPolicy:
    """Build a registered policy by name, for a pool of ``num_blocks`` blocks (a positive ``int``; anything else
    is a ``ValueError``, checked here once for every policy), of which ``capacity`` (default all) can hold
    cached content (:attr:`EvictionPolicy.capacity`)."""
    import kvretain.core.policies  # noqa: F401  (registers the built-in policies)

    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive integer, got {show_value(num_blocks)}")
    return POLICIES.create(name, num_blocks, config, capacity=capacity)


def _checked_capacity(capacity: int, num_blocks: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= num_blocks:
        raise ValueError(
            f"capacity must be an integer from 1 to num_blocks ({num_blocks}), got {show_value(capacity)}"
        )
    return capacity


def policy_names() -> list[str]:
    import kvretain.core.policies  # noqa: F401

    return POLICIES.names()
