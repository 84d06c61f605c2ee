"""Chained block hashes: prefix sharing, divergence, salts and adapters, incremental hashing, algorithms."""

from __future__ import annotations

import pytest

from kvretain.core.hashing import HASH_ALGORITHMS, BlockHasher, ExtraKeys

BS = 4
TOKENS = list(range(100, 116))  # 4 full blocks of 4


@pytest.fixture(params=HASH_ALGORITHMS)
def hasher(request: pytest.FixtureRequest) -> BlockHasher:
    return BlockHasher(BS, request.param)


def test_same_prefix_same_hashes(hasher: BlockHasher) -> None:
    a = hasher.hash_blocks(TOKENS)
    b = hasher.hash_blocks([*TOKENS[:8], 1, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 4 and len(set(a)) == 4
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]
    assert hasher.hash_blocks(list(TOKENS)) == a  # deterministic


def test_divergence_propagates_to_every_later_block(hasher: BlockHasher) -> None:
    base = hasher.hash_blocks(TOKENS)
    changed = list(TOKENS)
    changed[5] = 999  # a token of block 1
    out = hasher.hash_blocks(changed)
    assert out[0] == base[0]
    assert all(x != y for x, y in zip(out[1:], base[1:], strict=True))


def test_chaining_not_just_content(hasher: BlockHasher) -> None:
    # block 1 holds the same tokens in both sequences but follows a different block 0
    a = hasher.hash_blocks([1, 1, 1, 1, 7, 7, 7, 7])
    b = hasher.hash_blocks([2, 2, 2, 2, 7, 7, 7, 7])
    assert a[1] != b[1]
    # and a block's hash is not its content hash at another depth
    c = hasher.hash_blocks([7, 7, 7, 7])
    assert c[0] not in (a[1], b[1])


def test_cache_salt_changes_the_first_and_therefore_all_blocks(hasher: BlockHasher) -> None:
    plain = hasher.hash_blocks(TOKENS)
    salted = hasher.hash_blocks(TOKENS, ExtraKeys(cache_salt="tenant-a"))
    other = hasher.hash_blocks(TOKENS, ExtraKeys(cache_salt="tenant-b"))
    assert all(x != y for x, y in zip(plain, salted, strict=True))
    assert all(x != y for x, y in zip(salted, other, strict=True))
    assert hasher.hash_blocks(TOKENS, ExtraKeys(cache_salt="tenant-a")) == salted
    # the salt enters the first block only: later blocks chain from a salted parent with no extra key
    assert salted[1] == hasher.hash_block(salted[0], TOKENS[4:8])


def test_lora_id_changes_every_block(hasher: BlockHasher) -> None:
    plain = hasher.hash_blocks(TOKENS)
    lora1 = hasher.hash_blocks(TOKENS, ExtraKeys(lora_id=1))
    lora2 = hasher.hash_blocks(TOKENS, ExtraKeys(lora_id=2))
    assert all(x != y for x, y in zip(plain, lora1, strict=True))
    assert all(x != y for x, y in zip(lora1, lora2, strict=True))
    # the adapter id is mixed into every block, not only inherited from the first
    assert lora1[1] != hasher.hash_block(lora1[0], TOKENS[4:8])
    assert lora1[1] == hasher.hash_block(lora1[0], TOKENS[4:8], b"L1")


def test_lora_id_zero_is_an_adapter_not_the_base_model(hasher: BlockHasher) -> None:
    # 0 is a valid adapter id (ExtraKeys takes any 64-bit int): its blocks must not be shared with requests
    # that use no adapter
    plain = hasher.hash_blocks(TOKENS)
    lora0 = hasher.hash_blocks(TOKENS, ExtraKeys(lora_id=0))
    assert all(x != y for x, y in zip(plain, lora0, strict=True))
    assert BlockHasher.encode_extra(ExtraKeys(lora_id=0), False) == b"L0"


def test_encode_extra() -> None:
    both = ExtraKeys(cache_salt="s", lora_id=3)
    assert BlockHasher.encode_extra(both, True) == b"L3|Ss"
    assert BlockHasher.encode_extra(both, False) == b"L3"
    assert BlockHasher.encode_extra(ExtraKeys(), True) == b""


def test_partial_blocks_are_not_hashed(hasher: BlockHasher) -> None:
    full = hasher.hash_blocks(TOKENS[:8])
    assert hasher.hash_blocks(TOKENS[:11]) == full
    assert hasher.hash_blocks(TOKENS[:3]) == []
    assert hasher.hash_blocks([]) == []
    with pytest.raises(ValueError, match=r"only full blocks are hashed: got 3 tokens, block size 4"):
        hasher.hash_block(None, [1, 2, 3])


def test_incremental_prefix_gives_the_same_result(hasher: BlockHasher) -> None:
    extra = ExtraKeys(cache_salt="x", lora_id=9)
    whole = hasher.hash_blocks(TOKENS, extra)
    for k in range(len(whole) + 1):
        assert hasher.hash_blocks(TOKENS, extra, prefix=whole[:k]) == whole
    # decode: append tokens to a sequence one at a time, hashing only the newly full blocks
    seq: list[int] = []
    known: list[bytes] = []
    for t in TOKENS:
        seq.append(t)
        known = hasher.hash_blocks(seq, extra, prefix=known)
    assert known == whole


def test_prefix_longer_than_the_tokens_is_an_error(hasher: BlockHasher) -> None:
    hashes = hasher.hash_blocks(TOKENS)
    with pytest.raises(ValueError, match="prefix has 4 hashes but tokens hold only 2 full blocks"):
        hasher.hash_blocks(TOKENS[:10], prefix=hashes)


def test_sha256_and_xxhash_differ() -> None:
    sha = BlockHasher(BS, "sha256")
    xx = BlockHasher(BS, "xxhash")
    a = sha.hash_blocks(TOKENS)
    b = xx.hash_blocks(TOKENS)
    assert all(len(h) == 32 for h in a)
    assert all(len(h) == 16 for h in b)
    assert set(a).isdisjoint(b)
    assert sha.algorithm == "sha256" and xx.algorithm == "xxhash"


def test_block_size_matters() -> None:
    assert BlockHasher(4).hash_blocks(TOKENS[:8]) != BlockHasher(8).hash_blocks(TOKENS[:8])[:2]
    assert len(BlockHasher(8).hash_blocks(TOKENS)) == 2


def test_negative_and_large_token_ids() -> None:
    h = BlockHasher(2)
    assert len(h.hash_blocks([-1, 2**63 - 1])) == 1
    assert h.hash_blocks([-1, 0]) != h.hash_blocks([0, -1])


@pytest.mark.parametrize("size", [0, -4, 1.5, "16", None])
def test_bad_block_size(size: object) -> None:
    with pytest.raises(ValueError, match=r"block_size must be a positive integer, got"):
        BlockHasher(size)  # type: ignore[arg-type]


def test_unknown_algorithm_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown hash algorithm 'md5'; choose one of: sha256, xxhash"):
        BlockHasher(16, "md5")
