"""A fixed pool of KV cache blocks with reference counts, a hash index and a pluggable eviction policy.

Every block is in exactly one of three states::

    in use    ref_cnt > 0                      (hashed or not)
    cached    ref_cnt == 0 and hashed          (reusable until evicted; counts as free, as in vLLM)
    empty     ref_cnt == 0 and not hashed      (reused first)

Eviction happens only when an allocation needs a block and no empty block is left: the policy chooses
among the *evictable* cached blocks (for ``leaf_only`` policies, those without a cached child). Blocks of a
request are released deepest first, as vLLM does, so recency-based orders drop the tail of a chain before
its head.

Running out of blocks is a return value (``None``); misuse (double free, touching an empty block, an id out of
range or a bool, a hash of ``None``, a clock that is not a finite number...) is an exception, and the call that
raises it changes nothing.

A holder normally holds a block's whole prefix, but a free block may have an in-use descendant (a request
that dropped the head of its prefix and kept the tail, as vLLM's sliding window does; hits that are not a
prefix). For ``leaf_only`` policies such a block cannot be evicted until its descendants are, although it counts
as free: an allocation that needs it gets ``None`` (the blocks it evicted on the way are left empty, counted as
evictions; nothing is allocated).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.policy import NO_PARENT, BlockState, EvictionPolicy
from kvretain.core.retention import DEFAULT_RETENTION_PRIORITY, BlockRetention, show_value


def _position(block_ids: Sequence[int], bid: object) -> int:
    """Where ``touch`` stopped: the first occurrence of the refused id (an earlier occurrence would have been
    refused there: a block taken once is in use, and only a block taken from the free ones is checked). Equal
    values of another type are other ids (``0.0 == 0``, but ``0.0`` is refused where ``0`` is taken)."""
    kind = type(bid)
    for j, b in enumerate(block_ids):
        if b is bid or (type(b) is kind and b == bid):
            return j
    return len(block_ids)  # pragma: no cover - bid comes from block_ids


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Increasing ``indices`` as runs ``[a, b)`` of consecutive ones."""
    out: list[tuple[int, int]] = []
    a = b = indices[0]
    for i in indices:
        if i != b:
            out.append((a, b))
            a = i
        b = i + 1
    out.append((a, b))
    return out


def _clock_error(now: object) -> ValueError:
    """The error for a clock reading that is not a finite number (a NaN would make every expiry comparison false:
    directives would never lapse)."""
    return ValueError(
        f"the pool's clock returned {show_value(now)}; it must return a finite number of seconds"
    )


def _clock_reading(now: object) -> float:
    """A clock reading that is not a finite ``float`` (the callers test ``now.__class__ is not float or now - now
    != 0.0``: NaN for both NaN and +-inf, no call on the hot path) as a ``float``, or :func:`_clock_error`.

    An int, a numpy float or a ``Decimal`` is converted: the policies add durations (floats) to it, which a
    ``Decimal`` refused, and a complex or an int past a float's range failed there, after the pool had changed."""
    if isinstance(now, bool | str | bytes):
        raise _clock_error(now)
    try:
        f = float(now)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        raise _clock_error(now) from None
    if f - f != 0.0:  # (NaN and +-inf)
        raise _clock_error(now)
    return f


def _not_an_id(b: object, n: int) -> bool:
    """``b`` cannot stand for a block of a pool of ``n`` (not an integer index, a bool, or outside ``0..n-1``)."""
    if b is True or b is False:  # (an int to Python: True indexed block 1)
        return True
    try:
        i = operator.index(b)  # type: ignore[arg-type]  # (an int, a numpy integer...)
    except TypeError:
        return True
    return not 0 <= i < n


def _out_of_range(op: str, block_ids: Sequence[int], n: int) -> ValueError:
    """The error for ``block_ids`` that hold an id outside ``0..n-1`` (or one that is not an integer, or a bool)."""
    bad = next((b for b in block_ids if _not_an_id(b, n)), None)
    if bad is True or bad is False:
        return ValueError(f"{op}: block id {bad!r} is a bool, not a block of this pool (ids are 0..{n - 1})")
    return ValueError(f"{op}: block id {bad!r} is not a block of this pool (ids are 0..{n - 1})")


class PoolIntegrityError(AssertionError):
    """The pool's invariants do not hold (a bug, never a user error)."""


class BlockPool:
    """Blocks ``0..num_blocks-1``, addressed by int ids."""

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {show_value(num_blocks)}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a function returning seconds or None, got {show_value(clock)}")
        if policy.num_blocks != num_blocks:
            raise ValueError(f"policy was built for {policy.num_blocks} blocks, pool has {num_blocks}")
        if getattr(policy, "in_pool", False):  # (a policy class that skipped EvictionPolicy.__init__)
            raise ValueError(
                f"this {policy.name!r} policy already orders another pool's blocks; make one policy per pool"
            )
        self.num_blocks = num_blocks
        self.policy = policy
        self.clock: Callable[[], float] = clock or time.monotonic
        """Seconds that retention durations are measured in (default ``time.monotonic``; a replay or a simulator
        passes its own clock)."""
        self._blocks: list[BlockState] = policy.block_states()
        if len(self._blocks) != num_blocks:
            raise ValueError(f"policy offered {len(self._blocks)} block states for {num_blocks} blocks")
        self.cached: dict[BlockHash, int] = {}
        """Each cached hash's block: the one lookups find (vLLM's ``get_one_block``, the first registered)."""
        self.copies: dict[BlockHash, list[int]] = {}
        """The other blocks registered under a hash, in registration order (content two running requests both
        computed: vLLM's ``BlockHashToBlockMap`` keeps every copy). Evicting the block of :attr:`cached`
        promotes the first copy."""
        # empty blocks: a stack, so the lowest ids are used first on a fresh pool
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))
        self._num_cached_free = 0
        policy.in_pool = True  # (its per-block state is this pool's now: block_states)
        self._leaf_only = policy.leaf_only
        self._tracks_uses = policy.tracks_uses
        self._hears_allocations = policy.hears_allocations
        self.num_evictions = 0
        self.on_evict: Callable[[int, BlockHash], None] | None = None
        """Optional observer (statistics, KV events) called with each victim's id and hash."""
        self.on_evict_batch: Callable[[list[int], list[BlockHash]], None] | None = None
        """Optional observer called once per allocation (or reset) with the victims' ids and hashes."""

    # ------------------------------------------------------------------ inspection (O(n) snapshots)
    @property
    def ref_cnt(self) -> list[int]:
        return [b.ref_cnt for b in self._blocks]

    @property
    def block_hash(self) -> list[BlockHash | None]:
        return [b.block_hash for b in self._blocks]

    @property
    def parent(self) -> list[int]:
        return [b.parent for b in self._blocks]

    @property
    def num_children(self) -> list[int]:
        return [b.num_children for b in self._blocks]

    @property
    def evictable(self) -> list[bool]:
        return [b.evictable for b in self._blocks]

    def ref_count(self, block_id: int) -> int:
        if _not_an_id(block_id, self.num_blocks):  # (-1 read the last block's)
            raise _out_of_range("ref_count", (block_id,), self.num_blocks)
        return self._blocks[block_id].ref_cnt

    def hash_of(self, block_id: int) -> BlockHash | None:
        if _not_an_id(block_id, self.num_blocks):
            raise _out_of_range("hash_of", (block_id,), self.num_blocks)
        return self._blocks[block_id].block_hash

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        """Empty plus cached-but-unused blocks (both can be handed out)."""
        return len(self._empty) + self._num_cached_free

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, n: int) -> list[int] | None:
        """``n`` blocks with reference count 1 and no hash, evicting cached blocks if needed; ``None`` when
        fewer than ``n`` can be obtained (then nothing is allocated).

        Every cached-free block can be obtained: for leaf-only policies a chain becomes evictable leaf by leaf,
        and no free block has an in-use descendant (a block is registered only under its own request's
        parent block, see :meth:`cache_blocks`).

        The empty blocks come first in the list, then the victims in the order the policy chose them (a caller
        that gives the i-th block to a request's i-th missed block gives the victims to the last ones); a policy
        whose ``hears_allocations`` is True is told how many empty blocks there are before its first pop
        (``on_allocate``).
        """
        if n.__class__ is not int or n < 0:
            try:
                k = operator.index(n)  # (an int subclass, a numpy integer)
            except TypeError:
                k = -1
            if k < 0 or isinstance(n, bool):
                raise ValueError(
                    f"get_new_blocks: cannot allocate a negative number of blocks or a non-int ({n!r})"
                )
            n = k
        empty = self._empty
        if n > len(empty) + self._num_cached_free:
            if self._hears_allocations:
                self.policy.on_allocate(n, len(empty))  # (announced, though nothing follows: policy.py)
            return None
        blocks = self._blocks
        out: list[int] = []
        k = min(n, len(empty))
        if k < n:  # (read before anything is taken: a bad clock changes nothing)
            now = self.clock()
            if now.__class__ is not float or now - now != 0.0:  # (NaN and +-inf)
                now = _clock_reading(now)
        if self._hears_allocations:
            self.policy.on_allocate(n, len(empty))
        for _ in range(k):
            bid = empty.pop()
            blocks[bid].ref_cnt = 1
            out.append(bid)
        if k < n:
            policy = self.policy
            cached = self.cached
            copies = self.copies
            on_evict = self.on_evict
            on_evicted = None if policy.forgets_on_pop else policy.on_evicted
            observed = on_evict is not None or self.on_evict_batch is not None
            victim_hashes: list[BlockHash] = []  # (for the observers, told once the pool is consistent)
            pop = policy.pop
            pop_exposed = policy.pop_exposed
            exposed = NO_PARENT  # the last victim's parent, evictable now and not yet given to the policy
            last = n - k - 1
            for i in range(n - k):
                if exposed == NO_PARENT:
                    victim = pop(now)
                else:
                    victim = pop_exposed(exposed, now)
                    exposed = NO_PARENT
                if victim is None:  # the rest is held behind an in-use descendant (module docstring)
                    self._short(out, k, i, victim_hashes)
                    return None
                bid = victim
                blk = blocks[bid]
                h = blk.block_hash
                assert h is not None
                if copies:
                    self._uncache(h, bid)
                else:
                    del cached[h]
                blk.block_hash = None
                blk.evictable = False
                blk.ref_cnt = 1
                p = blk.parent
                if p != NO_PARENT:
                    blk.parent = NO_PARENT
                    pb = blocks[p]
                    pb.num_children -= 1
                    if pb.num_children == 0 and pb.ref_cnt == 0 and pb.block_hash is not None:
                        pb.evictable = True
                        if i < last:
                            exposed = p  # the next pop_exposed hands it over (or evicts it at once)
                        else:
                            policy.expose(p, now)
                if on_evicted is not None:
                    on_evicted(bid, h)
                if observed:
                    victim_hashes.append(h)
                out.append(bid)
            self._num_cached_free -= n - k
            self.num_evictions += n - k
            if observed:  # (an observer that fails fails the call: nothing allocated, the victims gone)
                try:
                    self._observe(out[k:], victim_hashes)
                except BaseException:
                    self._give_back(out)
                    raise
        return out

    def _observe(self, victims: list[int], hashes: list[BlockHash]) -> None:
        """Tell the observers (:attr:`on_evict`, :attr:`on_evict_batch`) of evictions the pool has completed."""
        if self.on_evict is not None:
            for bid, h in zip(victims, hashes, strict=True):
                self.on_evict(bid, h)
        if self.on_evict_batch is not None and victims:
            self.on_evict_batch(victims, hashes)

    def _give_back(self, out: list[int]) -> None:
        """Return blocks an allocation took (empty, or emptied by eviction) to the empty list."""
        blocks = self._blocks
        for bid in reversed(out):
            blocks[bid].ref_cnt = 0
            self._empty.append(bid)

    def _uncache(self, h: BlockHash, bid: int) -> None:
        """Drop block ``bid``'s registration under ``h``: the first copy takes the index's place (as vLLM's
        ``BlockHashToBlockMap.pop`` leaves the next block of the key)."""
        cached = self.cached
        more = self.copies.get(h)
        if cached[h] == bid:
            if more is None:
                del cached[h]
                return
            cached[h] = more.pop(0)
        else:
            assert more is not None
            more.remove(bid)
        if not more:
            del self.copies[h]

    def _short(self, out: list[int], k: int, evicted: int, hashes: list[BlockHash]) -> None:
        """``get_new_blocks`` found fewer evictable blocks than the free count offered (free blocks held behind an
        in-use descendant): the ``k`` empty blocks taken and the ``evicted`` victims go back to the empty list
        (the victims' content is gone: counted as evictions, and the observers have heard of them)."""
        self._give_back(out)
        self._num_cached_free -= evicted
        self.num_evictions += evicted
        if self.on_evict is not None or self.on_evict_batch is not None:
            self._observe(out[k:], hashes)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cache hits (removing free ones from the eviction order). Every block must be
        hashed or in use: otherwise ``ValueError`` names the first that is not, and nothing changes.

        Hits are normally a prefix of one request's cached blocks (what a lookup finds). Other hits are
        accepted (the module docstring): for ``leaf_only`` policies a free block above a touched one then cannot
        be evicted until its descendants are free again, and an allocation that needs it gets ``None``."""
        if block_ids.__class__ is not list:  # (an iterator or a set: the undo below walks the ids again)
            block_ids = list(block_ids)
        blocks = self._blocks
        # evictable blocks taken out of the policy's order once the whole call is valid
        leaving: list[int] = []
        taken_free = 0
        try:
            for bid in block_ids:
                # a negative id would wrap around to another block, and a bool is an int to Python (True was
                # block 1): both are below 2, so one comparison, the one every id paid for the sign alone, lets
                # ids >= 2 through and only ids 0 and 1 pay for the type test (the same in free_blocks and
                # cache_blocks)
                if bid < 2 and (bid < 0 or bid.__class__ is bool):
                    raise IndexError
                blk = blocks[bid]
                c = blk.ref_cnt
                if c == 0:
                    if blk.block_hash is None:
                        raise ValueError(f"block {bid} is empty; only cached blocks can be touched")
                    if blk.evictable:
                        blk.evictable = False
                        leaving.append(bid)
                    taken_free += 1
                blk.ref_cnt = c + 1
        except (ValueError, IndexError, TypeError) as e:
            # refused (an empty block, or an id out of range): undo the references taken before it
            for b in block_ids[: _position(block_ids, bid)]:
                blocks[b].ref_cnt -= 1
            for b in leaving:
                blocks[b].evictable = True
            if isinstance(e, ValueError):
                raise
            raise _out_of_range("touch", block_ids, self.num_blocks) from None
        if taken_free:
            self._num_cached_free -= taken_free
            remove = self.policy.remove
            for bid in leaving:
                remove(bid)

    def cache_blocks(
        self, block_ids: Sequence[int], hashes: Sequence[BlockHash], start: int, end: int
    ) -> None:
        """Register ``block_ids[i]`` under ``hashes[i]`` for ``start <= i < end`` (a request's newly full blocks).

        A block whose hash is already cached in another block (content two running requests both computed) is
        registered too, as a copy (:attr:`copies`; lookups find the first block, as vLLM's), and so are the blocks
        after it, as vLLM registers them. A block after one of its request's that holds no hash stays unhashed.
        For ``leaf_only`` policies a block's parent link is its request's own previous block, which must be the
        block lookups find for that hash: a block after a copy stays unhashed there (a lookup would reach it
        through the other copy, and the requests holding it would not hold its parent). So the invariant that a
        request that holds a block holds its parent stands, and a request that frees its blocks together leaves
        no free block behind an in-use descendant. A refused call (a block not in use, a hash of ``None``, a block that
        holds another hash, an id out of range) registers nothing: the policy hears of the registrations after
        the loop.
        """
        if end > len(hashes) or end > len(block_ids):
            raise ValueError(f"cache_blocks: end={end} beyond {len(block_ids)} blocks / {len(hashes)} hashes")
        if start.__class__ is not int or end.__class__ is not int or start < 0:
            raise ValueError(
                f"cache_blocks: start and end must be ints with 0 <= start, got {start!r}, {end!r}"
            )
        if start >= end:
            return  # (nothing newly full: vLLM's cache_full_blocks returns too)
        if start > 0:  # (the id before start is read as the first one's parent)
            p = block_ids[start - 1]
            if (p.__class__ is not int or not 0 <= p < self.num_blocks) and _not_an_id(p, self.num_blocks):
                raise _out_of_range("cache_blocks", block_ids[start - 1 : start], self.num_blocks)
        now = self.clock()
        if now.__class__ is not float or now - now != 0.0:  # (NaN and +-inf)
            now = _clock_reading(now)
        cached = self.cached
        blocks = self._blocks
        leaf_only = self._leaf_only
        # the indices this call registers (one run of them, unless the request holds an already cached block
        # after a new one) and the free parents a registered child takes out of the order
        reg: list[int] = []
        taken: list[int] = []
        copies = self.copies
        try:
            # ``linked``: the block before block i holds its request's hash there and, for leaf_only policies, is
            # the block lookups find for it (a parent link to a copy would be reached through another parent):
            # else block i stays unhashed. Read from the pool before the loop, then carried from each iteration.
            linked = start == 0 or self._linkable(block_ids[start - 1], hashes[start - 1])
            for i in range(start, end):
                bid = block_ids[i]
                if bid < 2 and (bid < 0 or bid.__class__ is bool):  # (negative or a bool: see touch)
                    raise IndexError
                blk = blocks[bid]
                if blk.ref_cnt <= 0:
                    raise ValueError(f"cache_blocks: block {bid} is not in use")
                h = hashes[i]
                if h is None:
                    raise ValueError(f"cache_blocks: the hash of block index {i} is None")
                cur = blk.block_hash
                if cur is not None:
                    if cur != h:
                        raise ValueError(f"cache_blocks: block {bid} already holds a different hash")
                    linked = not leaf_only or cached[h] == bid
                    continue
                if not linked:
                    continue  # (it stays unhashed, and so does the next block)
                if h in cached:
                    more = copies.get(h)
                    if more is None:
                        copies[h] = [bid]
                    else:
                        more.append(bid)
                    linked = not leaf_only
                else:
                    cached[h] = bid
                blk.block_hash = h
                reg.append(i)
                if leaf_only and i > 0:
                    parent = block_ids[i - 1]
                    blk.parent = parent
                    pb = blocks[parent]
                    pb.num_children += 1
                    if pb.evictable:  # (a free parent: see the module docstring)
                        pb.evictable = False
                        taken.append(parent)
        except (ValueError, IndexError, TypeError) as e:
            # undo the registrations (nothing else changed; the policy has heard of none of them)
            for i in reversed(reg):
                bid = block_ids[i]
                blk = blocks[bid]
                self._uncache(hashes[i], bid)  # (the last registration of its hash: undone first)
                blk.block_hash = None
                p = blk.parent
                if p != NO_PARENT:
                    blk.parent = NO_PARENT
                    blocks[p].num_children -= 1
            for p in taken:
                blocks[p].evictable = True
            ids = block_ids[start:end]
            if isinstance(e, ValueError) or not any(_not_an_id(b, self.num_blocks) for b in ids):
                raise  # (a TypeError of a hash that cannot be a dict key, for one)
            raise _out_of_range("cache_blocks", ids, self.num_blocks) from None
        for p in taken:
            self.policy.remove(p)
        if reg:
            on_cached_run = self.policy.on_cached_run
            a = reg[0]
            if reg[-1] - a + 1 == len(reg):  # (the usual case: one run of the request's blocks)
                on_cached_run(block_ids, hashes, a, a + len(reg), now)
            else:
                for a, b in _runs(reg):
                    on_cached_run(block_ids, hashes, a, b, now)

    def _linkable(self, parent: int, h: BlockHash | None) -> bool:
        """Whether block ``parent`` can be the parent of a block :meth:`cache_blocks` registers: it holds ``h`` (not
        ``None``) and, for ``leaf_only`` policies, lookups of ``h`` find it."""
        return (
            h is not None
            and self._blocks[parent].block_hash == h
            and (not self._leaf_only or self.cached.get(h) == parent)
        )

    def free_blocks(self, block_ids: Sequence[int], retention: BlockRetention | None = None) -> None:
        """Release one reference on each block of a request, deepest first (``block_ids`` in request order).

        ``retention`` gives, per block index of the request, the retention priority and duration that the
        releasing request asks for; without it blocks are released at the default priority (35).

        A block freed more times than it is held (its repeats in ``block_ids`` counted) is a double free:
        ``ValueError``, and nothing changes. The loop below changes only the pool's own counts, and undoes them
        when it meets a refused block; the policy hears of the release after it (in release order).
        """
        if block_ids.__class__ is not list:  # (an iterator or a set: the loop indexes the ids, deepest first)
            block_ids = list(block_ids)
        if retention is not None and not isinstance(retention, BlockRetention):
            raise TypeError(
                f"free_blocks: retention must be a BlockRetention or None, got {type(retention).__name__}"
            )
        now = self.clock()
        if now.__class__ is not float or now - now != 0.0:  # (NaN and +-inf)
            now = _clock_reading(now)
        blocks = self._blocks
        policy = self.policy
        track = self._tracks_uses
        prios = retention.priorities if retention is not None else None
        durs = retention.durations if retention is not None else None
        scope = retention.scope if retention is not None else None
        base = retention.base_priority if retention is not None else DEFAULT_RETENTION_PRIORITY
        n_plan = min(len(prios), len(durs)) if prios is not None and durs is not None else 0
        # uniform retention (or a policy that counts no uses): one batched policy call after the loop
        batch = n_plan == 0 or not track
        run_ids: list[int] = []  # the hashed blocks released, for a policy that tracks uses (batch)
        run_evs: list[int] = []  # the blocks of run_ids that became evictable (batch)
        run_idx: list[int] = []  # the hashed blocks' indices (a plan's, not batch)
        leaf_only = self._leaf_only
        empty = self._empty
        freed_cached = 0
        i = len(block_ids)
        try:
            for i in range(len(block_ids) - 1, -1, -1):
                bid = block_ids[i]
                if bid < 2 and (bid < 0 or bid.__class__ is bool):  # (negative or a bool: see touch)
                    raise IndexError
                blk = blocks[bid]
                c = blk.ref_cnt
                if c <= 0:
                    raise ValueError(f"block {bid} freed more times than it was taken (double free)")
                blk.ref_cnt = c - 1
                if blk.block_hash is None:
                    if c == 1:
                        empty.append(bid)
                    continue
                ev = False
                if c == 1:
                    freed_cached += 1
                    if not leaf_only or blk.num_children == 0:
                        blk.evictable = ev = True
                if batch:
                    if track:
                        run_ids.append(bid)
                    if ev:
                        run_evs.append(bid)
                else:
                    run_idx.append(~i if ev else i)  # (negative: the release makes it evictable)
        except (ValueError, IndexError, TypeError) as e:
            self._undo_free(block_ids, i + 1)  # (block i is unchanged)
            if isinstance(e, ValueError):
                raise
            raise _out_of_range("free_blocks", block_ids, self.num_blocks) from None
        self._num_cached_free += freed_cached
        if batch:
            if run_evs or run_ids:
                policy.release_run(run_ids, run_evs, base, scope, now, base)
            return
        release = policy.release
        for i in run_idx:
            ev = i < 0
            if ev:
                i = ~i
            if i < n_plan:
                release(block_ids[i], prios[i], durs[i], scope, now, base, ev)  # type: ignore[index]
            else:
                release(block_ids[i], base, None, scope, now, base, ev)

    def _undo_free(self, block_ids: Sequence[int], start: int) -> None:
        """Undo what :meth:`free_blocks`'s loop did to ``block_ids[start:]`` (it went deepest first: undone in the
        reverse order, each step restores the state before it)."""
        blocks = self._blocks
        empty = self._empty
        for j in range(start, len(block_ids)):
            blk = blocks[block_ids[j]]
            blk.ref_cnt += 1
            if blk.ref_cnt == 1:  # this step had freed it
                if blk.block_hash is None:
                    empty.pop()  # (the last one the loop appended)
                else:
                    blk.evictable = False

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block's hash (only when no block is in use, as vLLM); returns success."""
        blocks = self._blocks
        if any(b.ref_cnt for b in blocks):
            return False
        # the evictable blocks leave the order as a hit takes a block out (``remove``), not as victims (``pop``):
        # nothing is evicted, so a policy whose pop remembers its victims (s3fifo's and arc's ghosts) must not
        # remember these; every dropped block is then told to ``on_evicted`` ("dropped other than by pop")
        policy = self.policy
        for bid in sorted(policy.evictable_ids()):
            policy.remove(bid)
            blocks[bid].evictable = False
        dropped = [(h, bid) for h, bid in self.cached.items()]
        dropped += [(h, bid) for h, more in self.copies.items() for bid in more]
        for h, bid in dropped:
            self.policy.on_evicted(bid, h)
        self.num_evictions += len(dropped)
        self.cached.clear()
        self.copies.clear()
        for b in blocks:  # in place: the objects may be shared with the policy (block_states)
            b.ref_cnt = 0
            b.block_hash = None
            b.parent = NO_PARENT
            b.num_children = 0
            b.evictable = False
        self._empty = list(range(self.num_blocks - 1, -1, -1))
        self._num_cached_free = 0
        # (dropped from the cache: the observers hear each as an eviction, once the pool is consistent)
        if dropped and (self.on_evict is not None or self.on_evict_batch is not None):
            self._observe([bid for _, bid in dropped], [h for h, _ in dropped])
        return True

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Verify every invariant; raises :class:`PoolIntegrityError` on the first violation. O(n)."""

        def fail(msg: str) -> None:
            raise PoolIntegrityError(msg)

        n = self.num_blocks
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        parent, num_children, evictable = self.parent, self.num_children, self.evictable
        empty = set(self._empty)
        if len(empty) != len(self._empty):
            fail("a block appears twice in the empty list")
        in_use = {b for b in range(n) if ref_cnt[b] > 0}
        if any(ref_cnt[b] < 0 for b in range(n)):
            fail("negative reference count")
        cached_free = {b for b in range(n) if ref_cnt[b] == 0 and block_hash[b] is not None}
        if len(empty) + len(cached_free) + len(in_use) != n:
            fail(f"empty {len(empty)} + cached {len(cached_free)} + in use {len(in_use)} != total {n}")
        if empty & (in_use | cached_free):
            fail("an empty block is in use or hashed")
        if self._num_cached_free != len(cached_free):
            fail(f"cached-free counter {self._num_cached_free} != {len(cached_free)}")
        if self.get_num_free_blocks() != len(empty) + len(cached_free):
            fail("free count mismatch")
        for h, b in self.cached.items():
            if block_hash[b] != h:
                fail(f"hash index points to block {b} which holds another hash")
        for h, more in self.copies.items():
            if not more or h not in self.cached:
                fail(f"copies of hash {h!r} without a block in the hash index, or an empty list")
            if any(block_hash[b] != h for b in more) or len(set(more) | {self.cached[h]}) != len(more) + 1:
                fail(f"a copy of hash {h!r} holds another hash, or a block is listed twice")
        indexed = len(self.cached) + sum(len(more) for more in self.copies.values())
        if sum(1 for b in range(n) if block_hash[b] is not None) != indexed:
            fail("a hashed block is missing from the hash index")
        children = [0] * n
        for b in range(n):
            p = parent[b]
            if p != NO_PARENT:
                if block_hash[b] is None or block_hash[p] is None:
                    fail(f"parent link {b}->{p} on an unhashed block")
                children[p] += 1
        if children != num_children:
            fail("child counts disagree with parent links")
        expect = {b for b in cached_free if not self._leaf_only or num_children[b] == 0}
        flags = {b for b in range(n) if evictable[b]}
        if flags != expect:
            fail(f"evictable flags wrong: {sorted(flags ^ expect)[:10]}")
        got = self.policy.evictable_ids()
        if got != expect or len(self.policy) != len(expect):
            fail(f"policy order holds {len(got)} blocks (len {len(self.policy)}), expected {len(expect)}")
