"""Tenant isolation and chained block identity (issue 11, defects 3 and 4, acceptance 4).

Two requests with different ``cache_salt`` never share a block, on the core (``KVCacheManager`` hashing
tokens), replay (trace hash ids) and simulator (``SimRequest`` pieces) paths; and a hit needs the whole
chain to match (a hash id reused under a different parent is a different block).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvretain.cli import main
from kvretain.core.hashing import BlockHasher, BlockIdHasher, ExtraKeys
from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.core.retention import RetentionConfig
from kvretain.engine.sim.request import SimRequest
from kvretain.engine.sim.simulator import SimConfig, Simulation
from kvretain.replay import ReplayRequest, load_trace, replay, replay_requests
from kvretain.workloads import SeededChunk, TokenSeq, WorkloadRequest, load_mooncake
from kvretain.workloads.mooncake import read_trace
from kvretain.workloads.tokens import LiteralChunk

ALL = ["lru", "lfu", "priority", "unified", "belady"]
ONLINE = ["lru", "lfu", "priority", "unified"]
COLLIDING = ("tenant-29685295", "tenant-32060020")  # equal CRC-32: the simulator's old salt hash
SALTS = [None, "a", "b", *COLLIDING]


def trace_line(ids: Sequence[int], **kw: Any) -> str:
    return json.dumps(
        {"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": list(ids), **kw}
    )


def write(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(x + "\n" for x in lines))
    return path


def test_the_old_salt_hash_collides() -> None:
    assert zlib.crc32(COLLIDING[0].encode()) == zlib.crc32(COLLIDING[1].encode())


# ---------------------------------------------------------------------------------------------- defect 4
@pytest.mark.parametrize("policy", ALL)
def test_hash_id_reused_under_another_parent_is_another_block(
    tmp_path: Path, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's case: lines [1,2], [3], [3,2,7,8] at 4 blocks. Block 2 of the third line follows 3, not
    1: only block 3 hits (lru counted 2 hits; lfu, priority, unified and belady raised PoolIntegrityError)."""
    path = write(tmp_path / "t.jsonl", [trace_line([1, 2]), trace_line([3]), trace_line([3, 2, 7, 8])])
    assert main(["replay", str(path), "--capacity-blocks", "4", "--policy", policy, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["requests"], out["blocks"], out["hit_blocks"]) == (3, 7, 1)
    res = replay(load_trace(path), 4, policy, check_every=1)
    assert res.hit_blocks == 1


def test_chained_keys_follow_the_whole_prefix() -> None:
    h = BlockIdHasher()
    a = h.block_keys([1, 2, 3])
    b = h.block_keys([1, 2, 4])
    c = h.block_keys([5, 2, 3])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(c) & set(a)  # same ids 2, 3 after another first block: other blocks
    assert h.block_keys([1, 2, 3]) == a
    # the digest a key stands for is the core's chain step over the ids as 16-byte integers
    d0 = h.chain(None, (1).to_bytes(16, "little", signed=True), b"")
    assert h.digest(a[0]) == d0
    assert h.digest(a[1]) == h.chain(d0, (2).to_bytes(16, "little", signed=True))
    assert h.hash_ids([1, 2, 3]) == [h.digest(k) for k in a]
    assert len({h.digest(k) for k in set(a) | set(b) | set(c)}) == len(set(a) | set(b) | set(c))


def test_salted_digest_puts_the_salt_in_the_first_block_only() -> None:
    h = BlockIdHasher()
    plain = h.hash_ids([1, 2])
    salted = h.hash_ids([1, 2], "tenant-a")
    extra = BlockHasher.encode_extra(ExtraKeys(cache_salt="tenant-a"), True)
    assert salted[0] == h.chain(None, (1).to_bytes(16, "little", signed=True), extra)
    assert salted[1] == h.chain(salted[0], (2).to_bytes(16, "little", signed=True))
    assert plain[0] != salted[0] and plain[1] != salted[1]


def test_block_id_hasher_errors() -> None:
    h = BlockIdHasher()
    assert h.block_keys([]) == []
    for bad in ([1, 2.5], [1, True], [2**127]):
        with pytest.raises(ValueError, match=r"block id .* is not an integer that fits 128 signed bits"):
            h.block_keys(bad)
    with pytest.raises(ValueError, match="cache_salt is not valid Unicode"):
        h.block_keys([1], "\ud800")
    with pytest.raises(ValueError, match=r"cache_salt is 70,000 UTF-8 bytes; at most [\d,]+ are allowed"):
        h.block_keys([1], "x" * 70_000)


# ---------------------------------------------------------------------------------------------- defect 3
def test_replay_honours_cache_salt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two tenants sending the same 4 blocks share none of them (the replay ignored salts: 4 of 8 hit)."""
    lines = [
        trace_line([0, 1, 2, 3], cache_salt=COLLIDING[0]),
        trace_line([0, 1, 2, 3], cache_salt=COLLIDING[1]),
    ]
    path = write(tmp_path / "t.jsonl", lines)
    for policy in ALL:
        assert main(["replay", str(path), "--capacity-blocks", "16", "--policy", policy, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["hit_blocks"] == 0, policy
    same = write(tmp_path / "same.jsonl", [trace_line([0, 1, 2, 3], cache_salt="x")] * 2)
    assert replay(load_trace(same), 16).hit_blocks == 4


def wreq(
    rid: str, prompt: TokenSeq, t: float = 0.0, salt: str | None = None, prio: int = 0
) -> WorkloadRequest:
    return WorkloadRequest(rid, t, prompt, 4, priority=prio, cache_salt=salt)


def test_simulator_salts_with_equal_crc32_do_not_share() -> None:
    prompt = TokenSeq.seeded(7, 320)
    a = SimRequest(wreq("a", prompt, salt=COLLIDING[0]))
    b = SimRequest(wreq("b", prompt, salt=COLLIDING[1]))
    assert not set(a.block_hashes(16, 20)) & set(b.block_hashes(16, 20))
    # end to end: tenant 1 sends tenant 0's prompt between tenant 0's two sends; only tenant 0 hits
    reqs = [
        wreq("a1", prompt, 0.0, COLLIDING[0], 0),
        wreq("b1", prompt, 5.0, COLLIDING[1], 1),
        wreq("a2", prompt, 10.0, COLLIDING[0], 0),
    ]
    summary = Simulation(SimConfig(kv_blocks=400), reqs).run().summary()
    assert summary["classes"]["1"]["hit_rate"] == 0.0
    assert summary["classes"]["0"]["hit_rate"] > 0


def test_simulator_hash_ids_that_collide_under_python_hash_are_different_blocks(tmp_path: Path) -> None:
    """Ids k and k + 2**61 - 1 have the same Python hash; their blocks hold different tokens."""
    k = 12345
    lines = [trace_line([k]), trace_line([k + 2**61 - 1])]
    r0, r1 = load_mooncake(write(tmp_path / "t.jsonl", lines))
    assert hash(k) == hash(k + 2**61 - 1)
    assert r0.prompt.materialize() != r1.prompt.materialize()
    assert SimRequest(r0).block_hashes(16, 32)[0] != SimRequest(r1).block_hashes(16, 32)[0]
    summary = Simulation(SimConfig(kv_blocks=400), [r0, r1]).run().summary()
    assert summary["hit_rate"] == 0.0


def test_simulator_hash_chain_is_the_core_chain_step() -> None:
    from kvretain.engine.sim.request import _PIECE, _PIECES, _chunk_key

    c = SeededChunk(3, 40)
    r = SimRequest(wreq("a", TokenSeq((c,)), salt="s"))
    h = r.block_hashes(16, 2)
    extra = BlockHasher.encode_extra(ExtraKeys(cache_salt="s"), True)
    h0 = _PIECES.chain(None, _PIECE.pack(_chunk_key(c), 0, 16), extra)
    assert h[0] == h0
    assert h[1] == _PIECES.chain(h0, _PIECE.pack(_chunk_key(c), 16, 16))


# ---------------------------------------------------------------------------------------------- acceptance 4
@dataclass
class Req:
    """A token request for the core path (what ``KVCacheManager`` reads)."""

    request_id: str
    all_token_ids: list[int]
    extra_keys: ExtraKeys
    priority: int = 0
    retention: RetentionConfig | None = None
    num_preemptions: int = 0
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.all_token_ids)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.sampled_from([1, 2]), min_size=4, max_size=20),
            st.sampled_from(SALTS),
            st.booleans(),
        ),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(ONLINE),
)
def test_core_never_shares_a_block_across_salts(
    ops: list[tuple[list[int], str | None, bool]], policy: str
) -> None:
    """Requests of a two-token alphabet (so equal prefixes are common) under random salts: every hit block
    was filled by a request of the same salt."""
    kv = KVCacheManager(12, block_size=4, policy=policy)
    owner: dict[int, str | None] = {}
    live: list[Req] = []
    for i, (tokens, salt, keep) in enumerate(ops):
        req = Req(f"r{i}", tokens, ExtraKeys(cache_salt=salt))
        hits, n = kv.get_computed_blocks(req)
        assert all(owner[b] == salt for b in hits), (salt, [owner[b] for b in hits])
        new = kv.allocate_slots(req, len(tokens) - n, n, hits)
        if new is None:
            kv.free(req)
            continue
        for b in new:
            owner[b] = salt
        if keep:
            live.append(req)
        else:
            kv.free(req)
        kv.check_integrity()
    for req in live:
        kv.free(req)
    kv.check_integrity()


trace_requests = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.sampled_from(SALTS)),
    min_size=1,
    max_size=10,
)


def _records(tmp: Path, reqs: list[tuple[list[int], str | None]]) -> Path:
    lines = [trace_line(ids, **({} if salt is None else {"cache_salt": salt})) for ids, salt in reqs]
    return write(tmp / "t.jsonl", lines)


@settings(max_examples=60, deadline=None)
@given(trace_requests, st.sampled_from(ONLINE), st.integers(2, 12))
def test_replay_never_shares_a_block_across_salts(
    tmp_path_factory: pytest.TempPathFactory,
    reqs: list[tuple[list[int], str | None]],
    policy: str,
    capacity: int,
) -> None:
    """Per request, the replay's hits never exceed the longest prefix that an earlier request of the SAME
    salt had (a model with no eviction); ids drawn from 0..3, so other tenants send the same ids often."""
    path = _records(tmp_path_factory.mktemp("t"), reqs)
    requests = load_trace(path)
    seen: set[tuple[str | None, tuple[int, ...]]] = set()
    hits_before = 0
    for n, (ids, salt) in enumerate(reqs, 1):
        bound = 0
        while bound < len(ids) and (salt, tuple(ids[: bound + 1])) in seen:
            bound += 1
        seen.update((salt, tuple(ids[: i + 1])) for i in range(len(ids)))
        hits = replay(requests[:n], capacity, policy, check_every=1).hit_blocks  # online: a prefix's replay
        assert hits - hits_before <= bound, (n, ids, salt)
        hits_before = hits
    # with room for every block the replay hits exactly the model's prefixes
    room = len({k for r in requests for k in r.hashes})
    seen.clear()
    expect = 0
    for ids, salt in reqs:
        k = 0
        while k < len(ids) and (salt, tuple(ids[: k + 1])) in seen:
            k += 1
        expect += k
        seen.update((salt, tuple(ids[: i + 1])) for i in range(len(ids)))
    assert replay(requests, room, policy).hit_blocks == expect


@settings(max_examples=100, deadline=None)
@given(trace_requests)
def test_replay_keys_of_different_salts_are_disjoint(reqs: list[tuple[list[int], str | None]]) -> None:
    hasher = BlockIdHasher()
    by_salt: dict[str | None, set[int]] = {}
    for ids, salt in reqs:
        by_salt.setdefault(salt, set()).update(hasher.block_keys(ids, salt))
    salts = list(by_salt)
    for i, a in enumerate(salts):
        for b in salts[i + 1 :]:
            assert not by_salt[a] & by_salt[b]


chunks = st.lists(
    st.one_of(
        st.builds(SeededChunk, st.integers(0, 3), st.integers(1, 40)),
        st.builds(LiteralChunk, st.lists(st.integers(0, 2), min_size=1, max_size=20).map(tuple)),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(chunks, st.sampled_from(SALTS)), min_size=2, max_size=6),
    st.sampled_from([1, 4, 16]),
)
def test_simulator_blocks_share_a_hash_only_with_equal_salt_and_tokens(
    reqs: list[tuple[list[SeededChunk | LiteralChunk], str | None]], block_size: int
) -> None:
    """Simulator path: block i of two requests has one hash only when their salts and first (i+1)*B tokens
    are equal (prompt and output chunks), so different salts never share a block; the same chunks under
    the same salt always share (a literal chunk's key covers all its tokens, so two literal chunks that
    merely start alike do not: a missed hit, never a false one)."""
    built = []
    for i, (cs, salt) in enumerate(reqs):
        out = TokenSeq.seeded(99, 4)
        w = WorkloadRequest(f"r{i}", 0.0, TokenSeq(tuple(cs)), 4, cache_salt=salt, output=out)
        tokens = w.prompt.materialize() + out.materialize()
        n = len(tokens) // block_size
        hashes = list(SimRequest(w).block_hashes(block_size, n))
        again = WorkloadRequest(f"again{i}", 0.0, TokenSeq(tuple(cs)), 4, cache_salt=salt, output=out)
        assert list(SimRequest(again).block_hashes(block_size, n)) == hashes
        other = WorkloadRequest(f"o{i}", 0.0, TokenSeq(tuple(cs)), 4, cache_salt=f"{salt}/other", output=out)
        assert not set(SimRequest(other).block_hashes(block_size, n)) & set(hashes)
        built.append((salt, tokens, hashes))
    for i, (sa, ta, ha) in enumerate(built):
        for sb, tb, hb in built[i + 1 :]:
            for k in range(min(len(ha), len(hb))):
                if ha[k] == hb[k]:
                    assert sa == sb and ta[: (k + 1) * block_size] == tb[: (k + 1) * block_size], (k, sa, sb)


def test_replay_requests_from_records_keep_salts_apart(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [trace_line([1, 2], cache_salt="a"), trace_line([1, 2])])
    a, b = replay_requests(read_trace(path))
    assert isinstance(a, ReplayRequest) and not set(a.hashes) & set(b.hashes)
