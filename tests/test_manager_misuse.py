"""KVCacheManager, PriorityMapping, BlockRetention and make_policy under misuse: bad input is a clear
exception, and a call that raises changes nothing (no leaked blocks, no counted statistics)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvretain.core.block_pool import BlockPool
from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.core.policy import PolicyConfig, make_policy, policy_names
from kvretain.core.retention import BlockRetention, PriorityMapping, RetentionConfig, RetentionDirective

BS = 2


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    priority: object = 0
    retention: object = None
    extra_keys: object = None
    num_preemptions: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def admit(m: KVCacheManager, r: Req) -> list[int]:
    hits, n = m.get_computed_blocks(r)  # type: ignore[arg-type]
    out = m.allocate_slots(r, len(r.all_token_ids) - n, n, hits)  # type: ignore[arg-type]
    assert out is not None
    return out


def counted(m: KVCacheManager) -> dict[int, tuple[int, int, int]]:
    return {c: (s.requests, s.query_tokens, s.hit_tokens) for c, s in m.stats.items() if s.requests}


# ---------------------------------------------------------------- 1: free keeps what it cannot release


@pytest.mark.parametrize("priority", [1.5, "x", None, True])
def test_a_bad_priority_is_refused_at_the_request_s_first_call(priority: object) -> None:
    for first in ("on_arrival", "get_computed_blocks", "allocate_slots"):
        m = KVCacheManager(8, block_size=BS, policy="unified")
        r = Req("a", list(range(6)), priority=priority)
        with pytest.raises(TypeError, match=r"request 'a': priority must be an integer"):
            if first == "allocate_slots":
                m.allocate_slots(r, 6, 0)  # type: ignore[arg-type]
            else:
                getattr(m, first)(r)
        assert m.get_num_free_blocks() == 8 and not m._reqs and not counted(m)
        m.check_integrity()


def test_a_retention_that_is_not_a_retention_config_is_refused() -> None:
    m = KVCacheManager(8, block_size=BS)
    r = Req("b", list(range(6)), retention={"scope": "x"})
    with pytest.raises(TypeError, match=r"request 'b': retention must be a RetentionConfig or None, got \{"):
        m.get_computed_blocks(r)  # type: ignore[arg-type]
    assert not m._reqs


@pytest.mark.parametrize(("attr", "bad"), [("priority", 1.5), ("retention", {"scope": "x"})])
def test_a_free_that_raises_keeps_the_request_and_its_blocks(attr: str, bad: object) -> None:
    m = KVCacheManager(8, block_size=BS, policy="unified")
    ret = RetentionConfig((RetentionDirective(0, None, 80),))
    r = Req("a", list(range(6)), retention=ret)
    admit(m, r)
    good = getattr(r, attr)
    setattr(r, attr, bad)  # changed after its first call
    with pytest.raises(TypeError, match=f"request 'a': {attr}"):
        m.free(r)  # type: ignore[arg-type]
    assert m.num_blocks_of(r) == 3 and m.get_num_free_blocks() == 5  # type: ignore[arg-type]
    released = sum(s.released_blocks for s in m.stats.values())
    assert released == 0
    m.check_integrity()
    setattr(r, attr, good)
    m.free(r)  # type: ignore[arg-type]
    assert m.get_num_free_blocks() == 8 and not m._reqs
    m.check_integrity()


# ---------------------------------------------------------------- 2: one live request per id


def test_another_request_under_a_live_id_is_refused() -> None:
    m = KVCacheManager(8, block_size=BS)
    a = Req("x", [1, 2, 3, 4, 5])
    admit(m, a)
    b = Req("x", [7, 7, 7, 7, 7])  # another request object reusing the id
    for call in (m.on_arrival, m.get_computed_blocks, m.free):
        with pytest.raises(ValueError, match=r"request id 'x' belongs to another live request"):
            call(b)  # type: ignore[operator]
    with pytest.raises(ValueError, match=r"request id 'x' belongs to another live request"):
        m.allocate_slots(b, 5, 0)  # type: ignore[arg-type]
    assert m.num_blocks_of(a) == 3 and m.get_num_free_blocks() == 5  # type: ignore[arg-type]
    m.check_integrity()
    # the same object again is the same request; once freed, the id is free for another
    assert m.get_computed_blocks(a) == ([0, 1], 4)  # type: ignore[arg-type]
    m.free(a)  # type: ignore[arg-type]
    assert m.get_computed_blocks(b) == ([], 0)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 3: allocate_slots checks before counting


def test_refused_hits_count_nothing() -> None:
    m = KVCacheManager(8, block_size=BS)
    r = Req("a", list(range(6)))
    m.get_computed_blocks(r)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"request 'a': new_computed_blocks must be a prefix"):
        m.allocate_slots(r, 2, 4, [5, 6])  # type: ignore[arg-type]
    assert not counted(m) and m.get_num_free_blocks() == 8
    assert admit(m, r) == [0, 1, 2]
    assert counted(m) == {0: (1, 6, 0)}
    m.free(r)  # type: ignore[arg-type]
    m.check_integrity()


def test_hits_that_are_bools_are_refused_and_count_nothing() -> None:
    # [False, True] == [0, 1]: the hits passed the prefix check, were touched as blocks 0 and 1 and kept in the
    # request's blocks as bools; fits_after_freeing's set {0, 1, True} dropped the bool unseen
    m = KVCacheManager(8, block_size=BS)
    a = Req("a", list(range(6)))
    admit(m, a)
    m.free(a)  # type: ignore[arg-type]  # its 3 full blocks stay cached
    base = counted(m)
    b = Req("b", list(range(6)))
    hits, n = m.get_computed_blocks(b)  # type: ignore[arg-type]
    assert (hits, n) == ([0, 1], 4)
    for bad in ([False, True], [0, True], [False]):
        with pytest.raises(ValueError, match=r"request 'b': new_computed_blocks must be a prefix"):
            m.allocate_slots(b, 2, 2 * len(bad), bad)  # type: ignore[arg-type]
        with pytest.raises(
            ValueError, match=r"request 'b': new_computed_blocks holds a bool, not a block id"
        ):
            m.fits_after_freeing(b, 2, 2 * len(bad), [*bad, *hits], 0, [])  # type: ignore[arg-type]
        assert counted(m) == base and m.get_num_free_blocks() == 8 and m.num_blocks_of(b) == 0  # type: ignore[arg-type]
        m.check_integrity()
    assert m.allocate_slots(b, 2, 4, hits) is not None  # type: ignore[arg-type]
    m.free(b)  # type: ignore[arg-type]
    m.check_integrity()


def test_hits_passed_after_the_first_allocation_are_refused_and_change_nothing() -> None:
    m = KVCacheManager(8, block_size=BS)
    a = Req("a", list(range(6)))
    admit(m, a)
    m.free(a)  # type: ignore[arg-type]  # its 3 full blocks stay cached
    b = Req("b", list(range(6)))
    hits, n = m.get_computed_blocks(b)  # type: ignore[arg-type]
    assert (hits, n) == ([0, 1], 4)
    assert m.allocate_slots(b, 2, 0) is not None  # type: ignore[arg-type]  # b's first allocation takes no hits
    free = m.get_num_free_blocks()
    with pytest.raises(
        ValueError, match=r"request 'b': prefix hits can only be added on the first allocation"
    ):
        m.allocate_slots(b, 2, 4, hits)  # type: ignore[arg-type]
    assert m.get_num_free_blocks() == free and m.num_blocks_of(b) == 1  # type: ignore[arg-type]
    m.check_integrity()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((2.5, 0, 0), TypeError, r"num_new_tokens must be an integer number of tokens, got 2\.5"),
        ((True, 0, 0), TypeError, r"num_new_tokens must be an integer number of tokens, got True"),
        ((3, 0.0, 0), TypeError, r"num_computed_tokens must be an integer number of tokens, got 0\.0"),
        ((3, 0, 1.5), TypeError, r"reserve_tokens must be an integer number of tokens, got 1\.5"),
        ((-1, 0, 0), ValueError, r"num_new_tokens must be >= 0, got -1"),
        ((3, 0, -4), ValueError, r"reserve_tokens must be >= 0, got -4"),
    ],
)
def test_bad_token_counts_are_refused_before_counting(
    args: tuple[object, object, object], error: type[Exception], match: str
) -> None:
    m = KVCacheManager(8, block_size=BS, policy="unified")
    r = Req("a", [1, 2, 3])
    hits, _ = m.get_computed_blocks(r)  # type: ignore[arg-type]
    new, computed, reserve = args
    with pytest.raises(error, match=match):
        m.allocate_slots(r, new, computed, hits, reserve)  # type: ignore[arg-type]
    assert not counted(m) and m.get_num_free_blocks() == 8 and m.num_blocks_of(r) == 0  # type: ignore[arg-type]


# ---------------------------------------------------------------- 4: PriorityMapping and BlockRetention


@pytest.mark.parametrize("priority", [1.5, "x", None, True])
def test_retention_for_takes_an_int_request_priority(priority: object) -> None:
    with pytest.raises(TypeError, match="request priority must be an integer"):
        PriorityMapping().retention_for(priority)  # type: ignore[arg-type]
    assert PriorityMapping().retention_for(1) == 25


def test_block_retention_refuses_bool_priorities_as_it_refuses_a_bool_base() -> None:
    for prios in ([True], [35, False], [0, 1, True]):
        with pytest.raises(ValueError, match=r"priorities\[\d\]: priority must be an integer in \[0, 100\]"):
            BlockRetention(prios, [None] * len(prios))
    with pytest.raises(ValueError, match="base_priority"):
        BlockRetention([], [], base_priority=True)
    assert BlockRetention([0, 1, 100], [None] * 3).priorities == (0, 1, 100)


# ---------------------------------------------------------------- 5: make_policy's num_blocks


@pytest.mark.parametrize("num_blocks", [0, -1, 1.5, True, "4", None])
def test_make_policy_refuses_a_num_blocks_that_is_not_a_positive_int(num_blocks: object) -> None:
    for name in policy_names():
        cfg = PolicyConfig(next_use=lambda h: 1.0) if name == "belady" else None
        with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
            make_policy(name, num_blocks, cfg)  # type: ignore[arg-type]


# ---------------------------------------------------------------- 6: one block size


def test_a_config_block_size_that_contradicts_the_manager_s_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"config\.block_size \(32\) differs from the manager's block_size \(4\)"
    ):
        KVCacheManager(4, block_size=4, policy="unified", config=PolicyConfig(block_size=32))
    # the default (16) stands for "the pool's": the manager's block size is adopted
    m = KVCacheManager(4, block_size=4, policy="unified", config=PolicyConfig())
    assert m.pool.policy.config.block_size == 4
    m = KVCacheManager(4, block_size=4, policy="unified", config=PolicyConfig(block_size=4, budget=0.5))
    assert (m.pool.policy.config.block_size, m.pool.policy.config.budget) == (4, 0.5)


# ---------------------------------------------------------------- room made by freeing other requests


def test_fits_after_freeing_counts_a_block_once_every_holder_is_freed_and_a_freed_hit_as_taken_back() -> None:
    m = KVCacheManager(8, block_size=BS, policy="lru")
    a = Req("a", [1, 2, 3, 4, 5, 6, 7, 8])  # 4 blocks
    b = Req("b", [1, 2, 3, 4, 20, 21])  # shares a's first 2, 1 of its own
    admit(m, a)
    admit(m, b)
    assert m.get_num_free_blocks() == 3
    w = Req("w", [1, 2, 3, 4, 5, 6, *range(30, 40)])  # 8 blocks: hits a's first 3, needs 5 more
    hits, n = m.get_computed_blocks(w)  # type: ignore[arg-type]
    assert len(hits) == 3
    args = (w, len(w.all_token_ids) - n, n, hits, 0)
    assert m.fits_after_freeing(*args, []) is None  # type: ignore[arg-type]
    # b alone frees its own block (the shared two are a's too): 4 < 5; a alone frees its last block (its third
    # is a hit of w: free again, and taken back): 4 < 5; both: the shared two are hits, b's own block: 5
    assert m.fits_after_freeing(*args, [b]) is None  # type: ignore[arg-type]
    assert m.fits_after_freeing(*args, [a]) is None  # type: ignore[arg-type]
    assert m.fits_after_freeing(*args, [a, b]) == 2  # type: ignore[arg-type]
    assert m.fits_after_freeing(*args, [b, a, Req("gone", [9])]) == 2  # type: ignore[arg-type]
    m.free(b)  # type: ignore[arg-type]
    assert m.allocate_slots(*args) is None  # type: ignore[arg-type]
    m.free(a)  # type: ignore[arg-type]
    assert m.allocate_slots(*args) is not None  # type: ignore[arg-type]
    m.check_integrity()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((-100, 0, 0), ValueError, r"num_new_tokens must be >= 0, got -100"),
        ((2.5, 0, 0), TypeError, r"num_new_tokens must be an integer number of tokens, got 2\.5"),
        (("3", 0, 0), TypeError, r"num_new_tokens must be an integer number of tokens, got '3'"),
        ((True, 0, 0), TypeError, r"num_new_tokens must be an integer number of tokens, got True"),
        ((2, -1, 0), ValueError, r"num_computed_tokens must be >= 0, got -1"),
        ((2, 0, -(10**9)), ValueError, r"reserve_tokens must be >= 0, got -1000000000"),
    ],
)
def test_fits_after_freeing_refuses_the_token_counts_allocate_slots_refuses(
    args: tuple[object, object, object], error: type[Exception], match: str
) -> None:
    """The question "does it fit after freeing these?" takes the arguments of ``allocate_slots``, and refuses
    what it refuses: a negative count answered 0 ("fits now"), 2.5 answered None, "3" failed deep inside."""
    m = KVCacheManager(4, block_size=BS, policy="lru")
    a = Req("a", [1, 2, 3, 4, 5])
    admit(m, a)
    r = Req("b", [7, 7, 7])
    new, computed, reserve = args
    with pytest.raises(error, match=match):
        m.fits_after_freeing(r, new, computed, (), reserve, [a])  # type: ignore[arg-type]
    assert m.fits_after_freeing(r, 3, 0, (), 0, [a]) == 1  # type: ignore[arg-type]


@pytest.mark.parametrize("extra", [{"cache_salt": "t"}, "t", 3])
def test_extra_keys_that_are_not_extra_keys_are_refused_before_anything_is_allocated(extra: object) -> None:
    """A request's ``extra_keys`` must be an ``ExtraKeys`` (or None): a dict or a string failed with an
    ``AttributeError`` from the hasher, and ``allocate_slots`` failed after taking the request's blocks."""
    for first in ("get_computed_blocks", "allocate_slots"):
        m = KVCacheManager(4, block_size=BS, policy="lru")
        r = Req("a", [1, 2, 3, 4, 5], extra_keys=extra)
        with pytest.raises(TypeError, match=r"request 'a': extra_keys must be an ExtraKeys or None, got "):
            if first == "allocate_slots":
                m.allocate_slots(r, 5, 0)  # type: ignore[arg-type]
            else:
                m.get_computed_blocks(r)  # type: ignore[arg-type]
        assert m.get_num_free_blocks() == 4 and m.num_blocks_of(r) == 0 and not counted(m)  # type: ignore[arg-type]
        m.check_integrity()


def test_a_token_that_cannot_be_hashed_fails_allocate_slots_before_it_allocates() -> None:
    """Generated tokens of which one is no int64 (two appended before a step's allocation, as speculative
    decoding does) raise, and the call changes nothing: the block for them was allocated and kept, although the
    caller was told the call failed."""
    m = KVCacheManager(4, block_size=BS, policy="lru")
    r = Req("a", [1, 2, 3])
    admit(m, r)
    r.all_token_ids += [2**70, 5]  # completes block 1 and starts block 2
    with pytest.raises(ValueError, match=r"token id 1180591620717411303424 does not fit in a signed 64-bit"):
        m.allocate_slots(r, 2, 3)  # type: ignore[arg-type]
    assert m.num_blocks_of(r) == 2 and m.get_num_free_blocks() == 2  # type: ignore[arg-type]
    m.check_integrity()
    r.all_token_ids[3] = 4
    assert m.allocate_slots(r, 2, 3) == [2]  # type: ignore[arg-type]
    m.check_integrity()


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: KVCacheManager(4, mapping={"normal": 0}),
            r"mapping must be a PriorityMapping or None, got \{",
        ),
        (lambda: KVCacheManager(4, enable_caching="no"), r"enable_caching must be True or False, got 'no'"),
        (
            lambda: KVCacheManager(4, clock=5.0),
            r"clock must be a function returning seconds or None, got 5\.0",
        ),
        (
            lambda: make_policy("unified", 4, {"budget": 0.5}),
            r"config must be a PolicyConfig or None, got \{",
        ),
        (lambda: make_policy("lru", 4, {"budget": 0.5}), r"config must be a PolicyConfig or None, got \{"),
        (lambda: BlockPool(True, make_policy("lru", 1)), r"num_blocks must be a positive integer, got True"),
    ],
)
def test_constructor_arguments_of_the_wrong_type_are_refused_where_they_are_given(
    build: object, match: str
) -> None:
    """A mapping given as a dict failed with an AttributeError at the first admission, after its lookup was
    counted; a config dict at the first release (unified) or never (lru: ignored); ``enable_caching="no"`` turned
    caching on; a clock that is no function failed at the first eviction."""
    with pytest.raises((TypeError, ValueError), match=match):
        build()  # type: ignore[operator]


def test_a_lookup_by_a_request_that_holds_blocks_is_not_counted_as_its_first() -> None:
    """A request allocated without a lookup, then looked up (a scheduler that looks up running requests): the
    lookup found the request's own blocks, and the next allocation counted them as its first lookup's hits."""
    m = KVCacheManager(8, block_size=BS, policy="lru")
    r = Req("a", [1, 2, 3, 4, 5, 6, 7])
    assert m.allocate_slots(r, 4, 0) == [0, 1]  # type: ignore[arg-type]
    assert m.get_computed_blocks(r) == ([0, 1], 4)  # type: ignore[arg-type]
    assert m.allocate_slots(r, 3, 4) == [2, 3]  # type: ignore[arg-type]
    assert not counted(m)
    m.check_integrity()
