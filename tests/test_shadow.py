"""The controller's fast paths equal the straightforward ones: spatial sampling of a lookup
(:func:`~kvretain.core.policies.protection.spatial_sample`, C-level over digests) against ``spatial_key`` block by
block, and the shadow directories (:mod:`kvretain.core.policies.shadow`, C-level iterators) against one Python
loop per block, on random lookups (repeated identities included)."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.lfu import GhostTable
from kvretain.core.policies.protection import (
    BALANCE_SAMPLE,
    SHARDS_SAMPLE,
    ProtectionController,
    SpatialCut,
    sampled_hits,
    spatial_key,
    spatial_mask,
    spatial_sample,
)
from kvretain.core.policies.shadow import GDShadow, LRUShadow, TieredShadow, _remember
from kvretain.core.policy import PolicyConfig


def _reference_sample(
    hashes: Sequence[BlockHash], num_hits: int, cut: int | None, sub_cut: int | None
) -> tuple[list[BlockHash], int, list[BlockHash] | None]:
    picked = [i for i, h in enumerate(hashes) if cut is None or spatial_key(h) < cut]
    sampled = [hashes[i] for i in picked]
    # (a lookup hits between none and all of its blocks: a count outside is clamped, sampled or not)
    hits = min(max(num_hits, 0), len(hashes)) if cut is None else sum(1 for i in picked if i < num_hits)
    sub = None if sub_cut is None else [h for h in sampled if spatial_key(h) < sub_cut]
    return sampled, hits, sub


CUTS = st.one_of(st.none(), st.integers(1, 1 << 16), st.sampled_from([256, 512, 8192, 2048, 26844, 300]))
DIGESTS = st.lists(st.binary(min_size=2, max_size=40), min_size=1, max_size=60)
SAME_LENGTH = st.integers(2, 32).flatmap(
    lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=1, max_size=60)
)
INTS = st.lists(st.integers(-(1 << 127), (1 << 127) - 1) | st.integers(0, 5000), min_size=1, max_size=60)
MIXED = st.lists(st.integers(0, 1 << 40) | st.binary(min_size=2, max_size=8), min_size=1, max_size=30)


@settings(max_examples=400, deadline=None)
@given(
    hashes=st.one_of(DIGESTS, SAME_LENGTH, INTS, MIXED),
    num_hits=st.integers(-3, 70),
    cut=CUTS,
    sub=CUTS,
)
def test_spatial_sample_equals_spatial_key_block_by_block(
    hashes: list[BlockHash], num_hits: int, cut: int | None, sub: int | None
) -> None:
    if sub is not None and cut is not None:
        sub = min(sub, cut)  # (the balance's cut never exceeds the controller's)
    sampled, hits, got_sub = spatial_sample(
        hashes, num_hits, None if cut is None else SpatialCut(cut), None if sub is None else SpatialCut(sub)
    )
    want = _reference_sample(hashes, num_hits, cut, sub)
    assert (list(sampled), hits, got_sub) == want


@settings(max_examples=300, deadline=None)
@given(hashes=st.one_of(SAME_LENGTH, INTS), num_hits=st.integers(-3, 70), cut=CUTS, sub=CUTS)
def test_spatial_sample_of_one_size_digests_skips_only_the_length_check(
    hashes: list[BlockHash], num_hits: int, cut: int | None, sub: int | None
) -> None:
    """``one_size``: the caller's digests have one length (vLLM's); the sample is the same block by block."""
    if sub is not None and cut is not None:
        sub = min(sub, cut)
    sampled, hits, got_sub = spatial_sample(
        hashes,
        num_hits,
        None if cut is None else SpatialCut(cut),
        None if sub is None else SpatialCut(sub),
        one_size=True,
    )
    assert (list(sampled), hits, got_sub) == _reference_sample(hashes, num_hits, cut, sub)


@settings(max_examples=300, deadline=None)
@given(hashes=st.one_of(DIGESTS, SAME_LENGTH, INTS, MIXED), cut=CUTS, sub=CUTS)
def test_spatial_mask_samples_as_spatial_sample_for_every_number_of_hits(
    hashes: list[BlockHash], cut: int | None, sub: int | None
) -> None:
    """At a request's arrival its hits are not known yet: the mask then counts the sampled hits of any lookup."""
    if sub is not None and cut is not None:
        sub = min(sub, cut)
    one_size = len(set(map(type, hashes))) == 1 and len({len(h) for h in hashes if isinstance(h, bytes)}) <= 1
    sampled, mask, got_sub = spatial_mask(
        hashes, None if cut is None else SpatialCut(cut), None if sub is None else SpatialCut(sub), one_size
    )
    for k in range(-1, len(hashes) + 2):
        want = _reference_sample(hashes, k, cut, sub)
        assert (list(sampled), sampled_hits(mask, len(hashes), k), got_sub) == (
            want[0],
            min(max(k, 0), len(hashes)) if cut is None else want[1],
            want[2],
        )


class _ReferenceLRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[BlockHash, None] = OrderedDict()

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        hits = sum(1 for h in sampled if h in self.entries)
        for h in reversed(sampled):
            if h in self.entries:
                self.entries.move_to_end(h)
            else:
                self.entries[h] = None
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return hits


class _ReferenceGD:
    def __init__(self, capacity: int, exponent: float, cap: int, ghost: int) -> None:
        self.capacity, self.exp, self.cap = capacity, exponent, cap
        self.entries: dict[BlockHash, tuple[float, int, int]] = {}
        self.heap: list[tuple[float, int, BlockHash]] = []
        self.serial = 0
        self.ghost = GhostTable(ghost)
        self.L = 0.0

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        hits = sum(1 for h in sampled if h in self.entries)
        for h in reversed(sampled):
            got = self.entries.get(h)
            uses = min((got[1] if got is not None else self.ghost.take(h)) + 1, self.cap)
            key = self.L + float(uses) ** self.exp
            self.serial += 1
            self.entries[h] = (key, uses, self.serial)
            heapq.heappush(self.heap, (key, self.serial, h))
        while len(self.entries) > self.capacity:
            key, serial, h = heapq.heappop(self.heap)
            got = self.entries.get(h)
            if got is None or got[2] != serial:
                continue
            del self.entries[h]
            self.ghost.put(h, got[1])
            self.L = max(self.L, key)
        return hits


LOOKUPS = st.lists(
    st.lists(st.integers(0, 60), max_size=12) | st.lists(st.integers(0, 80), min_size=30, max_size=70),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(lookups=LOOKUPS, capacity=st.integers(1, 90))
def test_lru_shadow_equals_one_loop_per_block(lookups: list[list[int]], capacity: int) -> None:
    fast, ref = LRUShadow(capacity), _ReferenceLRU(capacity)
    for blocks in lookups:
        assert fast.reference(blocks) == ref.reference(blocks)
        assert list(fast.entries) == list(ref.entries)


@settings(max_examples=300, deadline=None)
@given(
    lookups=LOOKUPS,
    capacity=st.integers(1, 30),
    exponent=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    cap=st.integers(1, 8),
    ghost=st.sampled_from([0, 1, 2, 3, 5, 100]),
)
def test_gd_shadow_equals_one_loop_per_block(
    lookups: list[list[int]], capacity: int, exponent: float, cap: int, ghost: int
) -> None:
    # (small ghost tables: the ring wraps inside one eviction's batch, and victims are among the hashes it
    # overwrites, the bulk ghost writes' exceptions)
    _replay_both(lookups, capacity, exponent, cap, ghost)


@settings(max_examples=200, deadline=None)
@given(
    lookups=st.lists(
        st.lists(st.integers(0, 400), min_size=1, max_size=40, unique=True)
        | st.lists(st.integers(0, 40), min_size=1, max_size=6),
        min_size=1,
        max_size=80,
    ),
    capacity=st.integers(1, 40),
    exponent=st.sampled_from([1.0, 2.0, 4.0]),
    ghost=st.sampled_from([0, 4, 40, 160]),
)
def test_gd_shadow_equals_one_loop_per_block_under_churn(
    lookups: list[list[int]], capacity: int, exponent: float, ghost: int
) -> None:
    """Mostly new blocks (a small pool's traffic, the fresh-block path) with some coming back from the ghost."""
    _replay_both(lookups, capacity, exponent, 64, ghost)


def _replay_both(lookups: list[list[int]], capacity: int, exponent: float, cap: int, ghost: int) -> None:
    """The shadow and the reference take the same lookups: the same hits, use counts, ``L`` and ghost table
    (ring and position included) after every one."""
    fast, ref = GDShadow(capacity, exponent, cap, ghost), _ReferenceGD(capacity, exponent, cap, ghost)
    for blocks in lookups:
        assert fast.reference(blocks) == ref.reference(blocks)
        assert _uses(fast) == _ref_uses(ref) and fast.L == ref.L
        assert (fast._ghost.table, fast._ghost.ring, fast._ghost.pos) == (
            ref.ghost.table,
            ref.ghost.ring,
            ref.ghost.pos,
        )


def _uses(fast: GDShadow) -> dict[BlockHash, int]:
    """The shadow's entries as use counts (each entry's bucket holds its count)."""
    return {h: q[h] for h, q in fast.entries.items()}


def _ref_uses(ref: _ReferenceGD) -> dict[BlockHash, int]:
    return {h: uses for h, (_, uses, _) in ref.entries.items()}


@settings(max_examples=400, deadline=None)
@given(
    gcap=st.integers(1, 16),
    puts=st.lists(st.integers(0, 30), max_size=40),
    taken=st.lists(st.integers(0, 30), max_size=10),
    others=st.lists(st.integers(0, 130), max_size=10),
    data=st.data(),
)
def test_remember_equals_puts_one_by_one(
    gcap: int, puts: list[int], taken: list[int], others: list[int], data: st.DataObject
) -> None:
    """The bulk ghost writes of one eviction leave the table and ring the puts one by one would, victims among
    the hashes the ring overwrites included (a victim is resident: it may have been taken back since its
    earlier put)."""
    fast, ref = GhostTable(gcap), GhostTable(gcap)
    for t in (fast, ref):
        for i, h in enumerate(puts):
            t.put(h, i % 5 + 1)
        for h in taken:
            t.take(h)
    in_ring = sorted({h for h in fast.ring if h is not None})
    some = st.integers(100, 130) if not in_ring else st.sampled_from(in_ring) | st.integers(100, 130)
    victims: list[BlockHash] = data.draw(st.lists(some, min_size=1, max_size=gcap + 2, unique=True))
    uses = [i % 3 + 1 for i in range(len(victims))]
    resident: dict[BlockHash, dict[BlockHash, int]] = {h: {} for h in [*victims, *others]}
    _remember(fast, resident, victims, uses)
    for h, u in zip(victims, uses, strict=True):
        ref.put(h, u)
    assert (fast.table, fast.ring, fast.pos) == (ref.table, ref.ring, ref.pos)


def test_gd_shadow_keeps_no_stale_queue_entries() -> None:
    # a working set that fits, used over and over, now and then a scan: the buckets hold the resident entries
    fast, ref = GDShadow(20, 1.0, 64, 10), _ReferenceGD(20, 1.0, 64, 10)
    for i in range(400):
        blocks = list(range(10)) if i % 50 else list(range(100 + i, 130 + i))
        assert fast.reference(blocks) == ref.reference(blocks)
        assert _uses(fast) == _ref_uses(ref) and fast.L == ref.L
        assert sum(len(q) for q in fast._buckets.values()) == len(fast.entries)
        assert all(h in fast.entries[h] for h in fast.entries)


def test_gd_shadow_buckets_stay_bounded_by_the_resident_entries() -> None:
    """A block at its capped use count, used while ``L`` climbs, gets a new key every time and leaves its old
    bucket empty far above ``L``; a long-running server must not keep every such bucket (and its heap key)."""
    fast, ref = GDShadow(8, 4.0, 4, 16), _ReferenceGD(8, 4.0, 4, 16)
    for i in range(3000):
        blocks = [0, 1, 1000 + i]  # two hot blocks, one new block a lookup: each lookup evicts and moves L
        assert fast.reference(blocks) == ref.reference(blocks)
        assert _uses(fast) == _ref_uses(ref) and fast.L == ref.L
        assert len(fast._buckets) <= 2 * len(fast.entries) + 64
        assert len(fast._keys) == len(fast._buckets)


def _controller_state(ctl: ProtectionController) -> tuple[object, ...]:
    return (ctl.level, ctl.target, ctl.binding, list(ctl.weights), list(ctl.frequency), list(ctl._acc))


@settings(max_examples=150, deadline=None)
@given(
    lookups=st.lists(
        st.tuples(
            st.lists(st.integers(0, 60), min_size=1, max_size=12)
            | st.lists(st.integers(0, 300), min_size=30, max_size=50),
            st.integers(0, 12),
            st.booleans(),
        ),
        min_size=1,
        max_size=60,
    ),
    one_class_first=st.integers(0, 60),
    num_blocks=st.sampled_from([3, 40, 3 * BALANCE_SAMPLE, 3 * SHARDS_SAMPLE]),
)
def test_controller_shortcuts_equal_separate_shadows(
    lookups: list[tuple[list[int], int, bool]], one_class_first: int, num_blocks: int
) -> None:
    # the controller's two shortcuts (the isolated shadow taken from the LRU shadow while every lookup was
    # protected; the balance's LRU candidate taken from the controller's when it samples the same blocks)
    # against a controller that keeps every shadow apart
    cfg = PolicyConfig()
    fast, ref = ProtectionController(num_blocks, cfg), ProtectionController(num_blocks, cfg)
    ref._iso_is_lru = False
    ref._balance_takes_lru = False
    for i, (blocks, hits, protected) in enumerate(lookups):
        retention = 80 if protected or i < one_class_first else 25
        hits = min(hits, len(blocks))
        assert fast.on_lookup(blocks, hits, retention) == ref.on_lookup(blocks, hits, retention)
        assert _controller_state(fast) == _controller_state(ref)


def test_tiered_shadow_keeps_protected_blocks_and_evicts_unprotected_first() -> None:
    # 4 entries, at most 3 protected before the tiers compete: a protected request's two blocks, an
    # unprotected one's two (a document), two more protected (each request's blocks used deepest first, so its
    # prefix is its most recent): above the cap the least recent of both tiers leaves (block 2), then, the
    # protected back at the cap, the unprotected document's least recent block goes first (51)
    t = TieredShadow(4, 3.0)
    assert t.reference([1, 2], True) == 0
    assert t.reference([50, 51], False) == 0
    assert t.reference([3, 4], True) == 0
    assert list(t.protected) == [1, 4, 3] and list(t.unprotected) == [50]
    assert t.reference([50, 51], False) == 1
    # plain LRU on the same references keeps the document: it was used after blocks 1 and 2
    lru = LRUShadow(4)
    for blocks in ([1, 2], [50, 51], [3, 4]):
        lru.reference(blocks)
    assert lru.reference([50, 51]) == 2
    # an unprotected use leaves a protected block protected (the highest retention wins); a protected use
    # moves an unprotected block into the protected tier
    assert t.reference([3], False) == 1 and 3 in t.protected
    assert t.reference([50], True) == 1 and 50 in t.protected and 50 not in t.unprotected


@settings(max_examples=200, deadline=None)
@given(lookups=LOOKUPS, capacity=st.integers(1, 90), protected=st.booleans())
def test_tiered_shadow_of_one_class_is_lru(lookups: list[list[int]], capacity: int, protected: bool) -> None:
    # every lookup protected, or none: one tier, plain LRU; ``of`` continues an LRU shadow's state
    tiered, lru = TieredShadow(capacity, 0.5 * capacity), LRUShadow(capacity)
    half = len(lookups) // 2
    for blocks in lookups[:half]:
        lru.reference(blocks)
    if protected:
        tiered = TieredShadow.of(lru, 0.5 * capacity)
    else:
        for blocks in lookups[:half]:
            tiered.reference(blocks, False)
    for blocks in lookups[half:]:
        assert tiered.reference(blocks, protected) == lru.reference(blocks)
        assert list(tiered.protected if protected else tiered.unprotected) == list(lru.entries)


class _ReferenceTiered:
    """:class:`TieredShadow` as one loop per block and one eviction at a time."""

    def __init__(self, capacity: int, cap: float) -> None:
        self.capacity, self.cap, self.t = capacity, cap, 0
        self.protected: OrderedDict[int, int] = OrderedDict()
        self.unprotected: OrderedDict[int, int] = OrderedDict()

    def reference(self, blocks: Sequence[int], protected: bool) -> int:
        prot, unprot = self.protected, self.unprotected
        hits = sum(1 for h in blocks if h in prot or h in unprot)
        for h in reversed(blocks):
            self.t += 1
            if protected or h in prot:
                prot.pop(h, None)
                unprot.pop(h, None)
                prot[h] = self.t
            else:
                unprot.pop(h, None)
                unprot[h] = self.t
        while len(prot) + len(unprot) > self.capacity:
            if unprot and (len(prot) <= self.cap or next(iter(unprot.values())) < next(iter(prot.values()))):
                unprot.popitem(last=False)
            else:
                prot.popitem(last=False)
        return hits


@settings(max_examples=300, deadline=None)
@given(
    lookups=st.lists(st.tuples(LOOKUPS.map(lambda x: x[0]), st.booleans()), min_size=1, max_size=60),
    capacity=st.integers(1, 60),
    share=st.sampled_from([0.0, 0.3, 0.5, 0.95, 1.0]),
)
def test_tiered_shadow_equals_one_loop_per_block(
    lookups: list[tuple[list[int], bool]], capacity: int, share: float
) -> None:
    fast, ref = TieredShadow(capacity, share * capacity), _ReferenceTiered(capacity, share * capacity)
    for blocks, protected in lookups:
        assert fast.reference(blocks, protected) == ref.reference(blocks, protected)
        assert list(fast.protected.items()) == list(ref.protected.items())
        assert list(fast.unprotected.items()) == list(ref.unprotected.items())


def test_a_digest_whose_key_equals_the_cut_is_not_sampled() -> None:
    # the key must be *below* the cut: a digest whose two first bytes spell the cut exactly (second byte equal
    # to the cut's high byte, so the first byte decides) is left out, one a key below it is taken; random
    # digests hit this boundary once in 65,536
    cut = 0x1234
    at = bytes([0x34, 0x12]) + bytes(30)
    below = bytes([0x33, 0x12]) + bytes(30)
    assert spatial_key(at) == cut and spatial_key(below) == cut - 1
    for one_size in (False, True):
        sampled, hits, _ = spatial_sample([at, below], 2, SpatialCut(cut), None, one_size)
        assert (list(sampled), hits) == ([below], 1)
        sampled, mask, _ = spatial_mask([at, below], SpatialCut(cut), None, one_size)
        assert list(sampled) == [below] and sampled_hits(mask, 2, 2) == 1
