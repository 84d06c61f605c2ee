"""The two storages of ``unified`` decide alike: kvretain's pool (one object per block) and the vLLM plugin's run
queue (compact arrays, blocks grouped into runs), driven by the same events (admissions with hits and
eviction, releases with request priorities, directives with durations, scopes, a moving clock).

The per-block queue (``KVRETAIN_GRANULARITY=block``) ranks every block with kvretain's own ``UnifiedPolicy``, so
it must match the pool exactly: same hits, same victims, event by event. The run queue ranks *runs* (the blocks
one release freed, split where retention or the use count's power of two changes) and has no parent links, so
its order is allowed to differ; the test measures how far (hit blocks over the sequence, and the overlap of each
eviction's victims with the pool's) and bounds it.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.kv_cache_utils", reason="vLLM 0.33 is tested in .venv-vllm (scripts/test_vllm.sh)"
)

from vllm.v1.core.kv_cache_utils import KVCacheBlock

from _switching import SwitchingController
from kvretain.core import BlockPool, BlockRetention, PolicyConfig, make_policy
from kvretain.core.policies import rules
from kvretain.core.policy import INF
from kvretain.core.retention import PriorityMapping
from kvretain.integrations.vllm import _runtime
from kvretain.integrations.vllm._queue import RetentionFreeQueue
from kvretain.integrations.vllm._runs import RunFreeQueue
from kvretain.integrations.vllm.config import retention_from_extra_args

BLOCK = 16
MAPPING = PriorityMapping()


class _Request:
    """What the plugin reads from a vLLM request."""

    def __init__(
        self, rid: str, priority: int, extra: dict[str, Any] | None, hashes: list[bytes], generated: int = 0
    ) -> None:
        self.request_id = rid
        self.priority = priority
        self.sampling_params = type("SP", (), {"extra_args": extra})()
        self.num_tokens = len(hashes) * BLOCK
        self.num_prompt_tokens = self.num_tokens - generated  # (its last blocks hold generated tokens)
        self.num_preemptions = 0
        self.block_hashes = hashes


class VllmSide:
    """What vLLM's ``BlockPool`` / ``KVCacheManager`` do to the free queue (no null block here, so that both
    sides size their policy, and so its protection budget, to the same ``n`` blocks)."""

    def __init__(self, n: int, cfg: PolicyConfig, granularity: str) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(n)]
        if granularity == "run":
            self.q: Any = RunFreeQueue(list(self.blocks), self.blocks, cfg, MAPPING)
        else:
            self.q = RetentionFreeQueue(
                list(self.blocks), self.blocks, lambda c: make_policy("unified", n, cfg, capacity=c), MAPPING
            )
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.victims: list[bytes] = []

    def admit(self, req: _Request) -> tuple[int, list[KVCacheBlock]] | None:
        hashes = req.block_hashes
        hits: list[KVCacheBlock] = []
        for h in hashes[:-1]:  # never the whole prompt
            b = self.cached.get(h)
            if b is None:
                break
            hits.append(b)
        self.q.on_lookup(req, len(hits) * BLOCK, BLOCK)
        need = len(hashes) - len(hits)
        if need + sum(1 for b in hits if b.ref_cnt == 0) > self.q.num_free_blocks:
            return None
        for b in hits:
            if b.ref_cnt == 0:
                self.q.remove(b)
            b.ref_cnt += 1
        new = self.q.popleft_n(need) if need else []
        for b in new:
            h = b._block_hash
            if h is not None:
                self.victims.append(h)
                if self.cached.get(h) is b:
                    del self.cached[h]
                b._block_hash = None
            b.ref_cnt = 1
        blocks = hits + new
        for i in range(len(hits), len(hashes)):
            blocks[i]._block_hash = hashes[i]
            self.cached.setdefault(hashes[i], blocks[i])
        if isinstance(self.q, RetentionFreeQueue):  # the patched cache_full_blocks' hook
            self.q.on_blocks_cached(blocks, len(hits), len(hashes), None)
        return len(hits), blocks

    def free(self, req: _Request, blocks: list[KVCacheBlock]) -> None:
        self.q.on_request_release(req, (blocks,), [BLOCK], freeing_now=True, num_cached=[len(blocks)])
        self._free_blocks(list(reversed(blocks)))
        if hasattr(self.q, "_expect"):
            self.q._expect = -1

    def free_fused(self, req: _Request, blocks: list[KVCacheBlock]) -> None:
        """``KVCacheManager.free`` on a full-attention group with the run queue: release and free in one pass."""
        self.q.free_request(req, blocks, BLOCK, len(blocks), self._free_blocks)

    def free_deferred(self, req: _Request, blocks: list[KVCacheBlock]) -> None:
        """``pop_blocks_for_free``: the release hook first, vLLM's free (``append_n`` places the blocks) later."""
        self.q.on_request_release(req, (blocks,), [BLOCK])
        self._free_blocks(list(reversed(blocks)))

    def _free_blocks(self, ordered: list[KVCacheBlock]) -> None:
        """vLLM's ``BlockPool.free_blocks``: unhashed blocks whose last reference went first, cached ones queued."""
        for b in ordered:
            b.ref_cnt -= 1
        self.q.prepend_n([b for b in ordered if b.ref_cnt == 0 and b._block_hash is None])
        self.q.append_n([b for b in ordered if b.ref_cnt == 0 and b._block_hash is not None])

    def retention(self, block: KVCacheBlock) -> tuple[int, int, float, str | None]:
        """The block's retention state ``(level, base, expiry, owner)`` as the queue keeps it."""
        q = self.q
        bid = block.block_id
        if isinstance(q, RunFreeQueue):
            expiry, base = q._lapse.get(bid, (INF, q._r[bid]))
            return q._r[bid], base, expiry, q._owner.get(bid)
        m = q.policy._meta[bid]
        return m.r, m.base, m.expiry, m.owner


class CoreSide:
    """The same events through kvretain's pool."""

    def __init__(self, n: int, cfg: PolicyConfig, clock: list[float]) -> None:
        self.pool = BlockPool(n, make_policy("unified", n, cfg), clock=lambda: clock[0])
        self.victims: list[bytes] = []
        self.pool.on_evict = lambda bid, h: self.victims.append(h)  # type: ignore[arg-type,return-value]

    def admit(self, req: _Request) -> tuple[int, list[int]] | None:
        pool = self.pool
        hashes = req.block_hashes
        k = 0
        while k < len(hashes) - 1 and hashes[k] in pool.cached:
            k += 1
        pool.policy.on_lookup(hashes, k, MAPPING.retention_for(req.priority))
        hit_ids = [pool.cached[hashes[i]] for i in range(k)]
        need = len(hashes) - k
        if need + sum(1 for b in hit_ids if pool.ref_cnt[b] == 0) > pool.get_num_free_blocks():
            return None
        pool.touch(hit_ids)
        new = pool.get_new_blocks(need)
        assert new is not None
        ids = hit_ids + new
        pool.cache_blocks(ids, hashes, k, len(hashes))
        return k, ids

    def free(self, req: _Request, ids: list[int]) -> None:
        base = MAPPING.retention_for(req.priority)
        extra = req.sampling_params.extra_args
        if extra:
            ret = retention_from_extra_args(extra)
            assert ret is not None
            prios, durs = ret.block_plan(len(ids), BLOCK, req.num_prompt_tokens, base)
            plan = BlockRetention(prios, durs, ret.scope, req.priority, base)
        else:
            plan = BlockRetention([], [], None, req.priority, base)
        self.pool.free_blocks(ids, plan)

    def retention(self, bid: int) -> tuple[int, int, float, str | None]:
        m = self.pool.policy._meta[bid]  # type: ignore[attr-defined]
        return m.r, m.base, m.expiry, m.owner


def _events(seed: int, steps: int) -> list[tuple[str, Any]]:
    """Sessions re-reading growing prefixes at two priorities, some with directives (with durations and
    scopes), finishing in a random order, with the clock moving."""
    rng = random.Random(seed)
    out: list[tuple[str, Any]] = []
    for i in range(steps):
        r = rng.random()
        if r < 0.55:
            s = rng.randrange(12)
            shared, tail = rng.randint(0, 10), rng.randint(1, 5)
            hashes = [b"s%d-%d" % (s, j) for j in range(shared)] + [b"r%d-%d" % (i, j) for j in range(tail)]
            prio = 0 if s % 4 == 0 else 1
            extra: dict[str, Any] | None = None
            d = rng.random()
            if d < 0.1:
                extra = {
                    "retention_directives": [{"start": 0, "end": 4 * BLOCK, "priority": 90, "duration": 5}]
                }
            elif d < 0.15:
                extra = {
                    "retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": 10}],
                    "retention_scope": f"s{s}",
                }
            elif d < 0.2:  # its generated tokens' blocks (the last of its tail) kept at 80 for 3 s
                extra = {"retention_decode_priority": 80, "retention_decode_duration": 3}
            generated = (
                (tail * BLOCK) // 2 if extra is not None and "retention_decode_priority" in extra else 0
            )
            out.append(("admit", _Request(f"r{i}", prio, extra, hashes, generated)))
        elif r < 0.95:
            out.append(("finish", rng.random()))
        else:
            out.append(("tick", rng.choice([0.5, 3.0, 10.0])))
    return out


def _replay(
    granularity: str, seed: int, steps: int = 1500, n: int = 60, controlled: bool = True
) -> dict[str, Any]:
    """``controlled=False``: a fixed protected share (no isolation controller), so that the victims compare the
    two orders alone, not also two controllers that have drifted apart on slightly different hits."""
    cfg = (
        PolicyConfig(block_size=BLOCK, ghost_factor=0.0)
        if granularity == "run"
        else PolicyConfig(block_size=BLOCK)
    )
    if not controlled:
        cfg = dataclasses.replace(cfg, isolation_goal=None)
    clock = [0.0]
    _runtime.set_clock(lambda: clock[0])
    try:
        sides = (CoreSide(n, cfg, clock), VllmSide(n, cfg, granularity))
        running: list[tuple[_Request, Any, Any]] = []
        hits = [0, 0]
        same_hits = admits = refusals_differ = 0
        overlaps: list[float] = []
        for kind, arg in _events(seed, steps):
            if kind == "tick":
                clock[0] += arg
            elif kind == "finish" and running:
                req, a, b = running.pop(int(arg * len(running)))
                sides[0].free(req, a)
                sides[1].free(req, b)
            elif kind == "admit":
                before = (len(sides[0].victims), len(sides[1].victims))
                got = [side.admit(arg) for side in sides]
                if got[0] is None or got[1] is None:
                    # one side may refuse alone where their hits differ (a block in use behind one evicted on
                    # one side only): the other releases what it took
                    for side, g in zip(sides, got, strict=True):
                        if g is not None:
                            side.free(arg, g[1])
                    refusals_differ += (got[0] is None) != (got[1] is None)
                    continue
                admits += 1
                hits[0] += got[0][0]
                hits[1] += got[1][0]
                same_hits += got[0][0] == got[1][0]
                v0 = set(sides[0].victims[before[0] :])
                v1 = set(sides[1].victims[before[1] :])
                if v0 or v1:
                    overlaps.append(len(v0 & v1) / len(v0 | v1))
                running.append((arg, got[0][1], got[1][1]))
        return {
            "hits": hits,
            "same_hits": same_hits / max(1, admits),
            "victim_overlap": sum(overlaps) / max(1, len(overlaps)),
            "evictions": len(overlaps),
            "refusals_differ": refusals_differ,
            # the protected count each storage told its controller (its decayed peak)
            "held": (
                sides[0].pool.policy._ctl._held,
                getattr(getattr(sides[1].q, "_ctl", None), "_held", None),
            ),
        }
    finally:
        _runtime.set_clock(None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_per_block_queue_decides_exactly_as_the_pool(seed: int) -> None:
    got = _replay("block", seed)
    assert got["evictions"] > 100  # the sequence does exercise eviction
    assert got["hits"][0] == got["hits"][1]
    assert got["same_hits"] == 1.0
    assert got["victim_overlap"] == 1.0
    assert got["refusals_differ"] == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_run_queue_stays_close_to_the_pool(seed: int) -> None:
    got = _replay("run", seed)
    assert got["evictions"] > 100
    # measured at seeds 0-5 with the controller: hit blocks 0.994x-1.006x the pool's, the same hits on 97.4-99.2%
    # of admissions (0.991x-1.004x and 97.2-98.6% before a parent was ranked behind a protected or lapsing
    # child, 0.996x-1.006x and 97.4-99.1% at seeds 0-2 before the decode-retention and lowering requests); the
    # bounds leave a margin of a few points over that
    assert abs(got["hits"][1] - got["hits"][0]) <= 0.03 * got["hits"][0]
    assert got["same_hits"] >= 0.95


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_run_queue_orders_close_to_the_pool(seed: int) -> None:
    # the order alone (a fixed protected share): with the controller, two controllers fed slightly different
    # hits drift apart and their victims with them, which says nothing of the order. Measured at seeds 0-5:
    # victim sets overlapping 94.9-97.8%, hit blocks 0.994x-1.010x the pool's. 5% of the requests keep their
    # generated tokens' blocks at 80 for 3 s and 5% lower their head to 10: a child kept above its parent. The
    # pool evicts leaves only, so such a parent waits for its child; the run queue ranks a parent's run at least
    # at its child run's key (the deeper run of its release, or one an earlier release queued below a block
    # another request held), in that run's tier when it is protected, and again when the child lapses or
    # leaves the protected tier (77.9-87.1% before). What still differs: a parent waits for one child run
    # only, and a lapsed block is re-keyed at its run's tail depth where the pool uses its own. The bound
    # leaves a margin under the lowest
    got = _replay("run", seed, controlled=False)
    assert got["evictions"] > 100
    assert got["victim_overlap"] >= 0.88
    assert abs(got["hits"][1] - got["hits"][0]) <= 0.03 * got["hits"][0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_per_block_queue_orders_exactly_as_the_pool_at_a_fixed_share(seed: int) -> None:
    got = _replay("block", seed, controlled=False)
    assert got["evictions"] > 100
    assert got["hits"][0] == got["hits"][1] and got["victim_overlap"] == 1.0


@pytest.mark.parametrize("seed", [0, 1])
def test_the_run_queue_tells_its_controller_the_protected_blocks_it_holds(seed: int) -> None:
    # the controller starts a give-back from the target the protected blocks fill (core/policies/protection.py):
    # the run queue reports its protected count as the pool does, once it has evicted
    got = _replay("run", seed)
    core, runs = got["held"]
    assert core > 0 and runs is not None and runs > 0
    # two storages, slightly different hits and so different protected counts (measured at seeds 0-1: 26.6 / 26.5
    # and 16.9 / 21.6): the same quantity, within a factor that only a different quantity would break
    assert core / 2 <= runs <= 2 * core


# ---------------------------------------------------------------------------- retention, block by block
def _retention_events(seed: int, steps: int, duplicates: bool = True) -> list[tuple[str, Any]]:
    """What decides a block's retention, in every combination: prefixes shared by requests of five priorities,
    directives raising (with and without a duration) or lowering, over part of a run (ranges that start or end
    inside a block, open-ended ones, two per request), scopes that raise and then lower, prompts shorter than the
    blocks (decode blocks), requests preempted and resumed, the three ways vLLM frees, and a clock that moves.

    ``duplicates=False``: every prompt ends in a block of its own and nothing is preempted, so no prompt's last
    block (never a hit) is computed again under a hash already cached (vLLM registers such a duplicate block,
    kvretain's pool does not: the two then hold different blocks)."""
    rng = random.Random(seed)
    out: list[tuple[str, Any]] = []
    for i in range(steps):
        r = rng.random()
        if r < 0.45:
            s = rng.randrange(3)
            shared, tail = rng.randint(1, 10), rng.randint(0 if duplicates else 1, 3)
            hashes = [b"s%d-%d" % (s, j) for j in range(shared)] + [b"r%d-%d" % (i, j) for j in range(tail)]
            extra: dict[str, Any] | None = None
            d = rng.random()
            if d < 0.6:
                a = rng.randint(0, 5 * BLOCK)
                first: dict[str, Any] = {
                    "start": a,
                    "end": rng.choice([a + rng.randint(1, 3 * BLOCK), None]),
                    "priority": rng.choice([0, 10, 35, 45, 60, 90]),
                }
                if rng.random() < 0.6:
                    first["duration"] = rng.choice([0, 0.5, 2, 5])
                directives = [first]
                if first["end"] is not None and rng.random() < 0.3:
                    second = {"start": 9 * BLOCK + 3, "priority": rng.choice([5, 40, 70])}
                    directives.append({**second, "duration": rng.choice([None, 1, 4])})
                extra = {"retention_directives": directives}
                if rng.random() < 0.5:
                    extra["retention_scope"] = rng.choice(["A", "B"])
            elif d < 0.7:
                extra = {"retention_scope": rng.choice(["A", "B"])}
            req = _Request(f"r{i}", rng.choice([-2, -1, 0, 1, 3]), extra, hashes)
            if rng.random() < 0.4:
                req.num_prompt_tokens = rng.randint(1, len(hashes) * BLOCK)  # the rest are generated tokens
            out.append(("admit", req))
        elif r < 0.8:
            out.append(("finish", (rng.random(), rng.choice(["general", "fused", "deferred"]))))
        elif r < 0.88:
            if duplicates:
                out.append(("preempt", rng.random()))
        else:
            out.append(("tick", rng.choice([0.3, 1.0, 3.0, 10.0])))
    return out


@pytest.mark.parametrize("granularity", ["run", "block"])
@pytest.mark.parametrize("seed", range(6))
def test_both_storages_keep_every_blocks_retention_as_the_pool(granularity: str, seed: int) -> None:
    # a pool large enough that nothing is evicted: the two storages then hold the same blocks, and each block's
    # retention (level, the fallback of a lapse, the expiry, the owner scope) follows from the rules alone, so
    # it must equal the pool's after every event, whatever order either storage evicts in
    n = 2000
    cfg = PolicyConfig(block_size=BLOCK, ghost_factor=0.0, isolation_goal=None)
    clock = [0.0]
    _runtime.set_clock(lambda: clock[0])
    try:
        core, vside = CoreSide(n, cfg, clock), VllmSide(n, cfg, granularity)
        running: list[tuple[_Request, Any, Any]] = []
        preempted: list[_Request] = []
        for step, (kind, arg) in enumerate(_retention_events(seed, 400)):
            if kind == "tick":
                clock[0] += arg
            elif kind == "admit" or (kind == "preempt" and preempted and arg < 0.5):
                req = arg if kind == "admit" else preempted.pop(0)  # a preempted request resumes
                got = (core.admit(req), vside.admit(req))
                assert got[0] is not None and got[1] is not None
                running.append((req, got[0][1], got[1][1]))
            elif running and kind in ("finish", "preempt"):
                where, how = (arg, "general") if kind == "preempt" else arg
                req, a, b = running.pop(int(where * len(running)))
                core.free(req, a)  # (a preemption frees the request's blocks as a finish does)
                if how == "fused" and granularity == "run":
                    vside.free_fused(req, b)
                elif how == "deferred":
                    vside.free_deferred(req, b)
                else:
                    vside.free(req, b)
                if kind == "preempt":
                    req.num_preemptions += 1
                    preempted.append(req)
            now = clock[0]
            for h, bid in core.pool.cached.items():
                want = core.retention(bid)
                if want[0] == rules.UNSET:
                    continue  # cached by a running request, never released yet
                got_state = vside.retention(vside.cached[h])
                assert rules.effective(*got_state[:3], now) == rules.effective(*want[:3], now), (step, h)
                assert got_state == want, (step, h, kind)
    finally:
        _runtime.set_clock(None)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_per_block_queue_evicts_exactly_as_the_pool_whatever_the_retention(seed: int) -> None:
    # the retention events above in a pool of 60 blocks: the same hits and the same victims at every admission
    cfg = PolicyConfig(block_size=BLOCK, isolation_goal=None)
    clock = [0.0]
    _runtime.set_clock(lambda: clock[0])
    try:
        core, vside = CoreSide(60, cfg, clock), VllmSide(60, cfg, "block")
        running: list[tuple[_Request, Any, Any]] = []
        evictions = 0
        for kind, arg in _retention_events(seed, 1000, duplicates=False):
            if kind == "tick":
                clock[0] += arg
            elif kind == "admit":
                before = (len(core.victims), len(vside.victims))
                got = (core.admit(arg), vside.admit(arg))
                if got[0] is None or got[1] is None:
                    assert got[0] is None and got[1] is None
                    continue
                assert got[0][0] == got[1][0]
                assert set(core.victims[before[0] :]) == set(vside.victims[before[1] :])
                evictions += len(core.victims) > before[0]
                running.append((arg, got[0][1], got[1][1]))
            elif running:
                where, how = arg
                req, a, b = running.pop(int(where * len(running)))
                core.free(req, a)
                (vside.free_deferred if how == "deferred" else vside.free)(req, b)
        assert evictions > 100
    finally:
        _runtime.set_clock(None)


# ---------------------------------------------------------------------------- a parent behind its child
def _victims_after(script: list[tuple[Any, ...]], n: int = 30, **config: Any) -> tuple[list[str], list[str]]:
    """Run ``script`` (``("req", priority, extra, hashes, generated)``, each admitted and freed at once, or
    ``("tick", seconds)``) on the pool and the run queue, then evict every cached block: each side's victims.
    ``config``: the policy's settings other than these (a fixed share of the whole pool)."""
    cfg = PolicyConfig(
        **{
            "block_size": BLOCK,
            "ghost_factor": 0.0,
            "isolation_goal": None,
            "budget": 1.0,
            "adapt_frequency": False,
            **config,
        }
    )
    clock = [0.0]
    _runtime.set_clock(lambda: clock[0])
    try:
        sides = (CoreSide(n, cfg, clock), VllmSide(n, cfg, "run"))
        for k, ev in enumerate(script):
            if ev[0] == "tick":
                clock[0] += ev[1]
                continue
            req = _Request(f"r{k}", ev[1], ev[2], [h.encode() for h in ev[3]], ev[4])
            for side in sides:
                got = side.admit(req)
                assert got is not None
                side.free(req, got[1])
        flood = _Request("flood", 0, None, [b"flood-%d" % i for i in range(n)])
        for side in sides:
            side.admit(flood)
        return tuple([v.decode() for v in side.victims] for side in sides)  # type: ignore[return-value]
    finally:
        _runtime.set_clock(None)


@pytest.mark.parametrize("head", [10, 34])
def test_a_parent_whose_own_directive_lapses_still_goes_after_its_child(head: int) -> None:
    # a priority-1 request (25) keeps its 2-block prompt at ``head`` for 5 s and its generated tokens' block at 30
    # (all unprotected): the pool evicts leaves only, so the prompt's blocks wait for that block, before and
    # after their lapse (back to 25). The run queue ranked the prompt's run at least at the generated block's
    # key, but requeued its lapsed blocks at their own key, below the child's: they went first (its prefix gone,
    # the child could never be hit again)
    extra = {
        "retention_directives": [{"start": 0, "end": 2 * BLOCK, "priority": head, "duration": 5}],
        "retention_decode_priority": 30,
    }
    pool, runs = _victims_after(
        [("req", 1, extra, ["a0", "a1", "a2"], BLOCK), ("req", 1, None, ["c0", "c1"], 0), ("tick", 6.0)]
    )
    assert pool == ["c1", "c0", "a2", "a1", "a0"]
    assert runs == pool


def _chain(name: str, k: int) -> list[str]:
    return [f"{name}{i}" for i in range(k)]


# (generated tokens' blocks of a priority-1 request, which maps to 25, kept above its prompt; "c": other traffic)
_LIFTS = {
    # protected (90): before, the prompt's run stayed in the unprotected tier and went first, the kept block
    # unreachable behind it
    "a protected child": [
        ("req", 1, {"retention_decode_priority": 90}, _chain("a", 3), BLOCK),
        ("req", 1, None, _chain("c", 2), 0),
    ],
    # the same for 5 s, evicted after the lapse
    "a protected child that lapsed": [
        ("req", 1, {"retention_decode_priority": 90, "retention_decode_duration": 5}, _chain("a", 3), BLOCK),
        ("req", 1, None, _chain("c", 2), 0),
        ("tick", 6.0),
    ],
    # unprotected (30) for 50 s, evicted before it lapses: before, a child with a duration lifted nothing
    "a child whose directive has not lapsed": [
        ("req", 1, {"retention_decode_priority": 30, "retention_decode_duration": 50}, _chain("a", 3), BLOCK),
        ("req", 1, None, _chain("c", 2), 0),
    ],
    # a directive on the prompt's tail (90 for 5 s), lapsed, then more traffic
    "a tail directive that lapsed": [
        (
            "req",
            1,
            {"retention_directives": [{"start": 2 * BLOCK, "priority": 90, "duration": 5}]},
            _chain("a", 4),
            0,
        ),
        ("req", 1, None, _chain("c", 2), 0),
        ("tick", 6.0),
        ("req", 1, None, _chain("d", 2), 0),
    ],
}


@pytest.mark.parametrize("case", sorted(_LIFTS))
def test_a_parent_waits_for_a_child_kept_above_it_as_in_the_pool(case: str) -> None:
    # the pool evicts leaves only: a prompt waits for its generated tokens' blocks, whichever tier they are in and
    # whether or not their directive lapses. The run queue ranks the prompt's run at the child run's key, in the
    # child's tier, and again when the child's blocks lapse (before: the prompt went before its child, first).
    # A lapsed chain is keyed from its release at its fallen retention, as if released at it: it then goes
    # before the later chains at that retention, in release order (before session 25 a lapse re-keyed it as
    # released at the lapse, and it went last)
    pool, runs = _victims_after(_LIFTS[case])
    a = [v for v in pool if v.startswith("a")]
    assert a == sorted(a, reverse=True)  # tail first
    if case.endswith(" that lapsed"):
        assert pool[: len(a)] == a  # as a unit, first: released first, at the same retention as the rest now
    else:
        assert pool[-len(a) :] == a  # as a unit, last: kept
    assert runs == pool


def test_a_prompt_lifted_by_its_protected_child_returns_to_its_tier_when_the_child_is_evicted() -> None:
    # A's and B's generated tokens' blocks are kept at 35 (protected, value 1; their prompts at 25, value 1/2), a
    # protected target of one block; C's prefix, at 34 (unprotected) and used three times, is worth 2.8. Over the
    # target the tiers compete on keys: A's child goes before C's prefix. At the target the unprotected tier goes
    # first, and the pool exposes A's prompt there at its own key, before C's prefix. The run queue had lifted
    # A's prompt into the protected tier with its child; it now moves it back when the child is evicted (before:
    # C's prefix went first)
    decode = {"retention_decode_priority": 35}
    keep = {"retention_directives": [{"start": 0, "priority": 34}]}
    script: list[tuple[Any, ...]] = [
        ("req", 1, decode, _chain("a", 3), BLOCK),
        ("req", 1, decode, _chain("b", 3), BLOCK),
        *[("req", 1, keep, ["c0", "c1", f"t{k}"], 0) for k in range(3)],
    ]
    pool, runs = _victims_after(script, budget=1 / 30)
    assert pool[-8:] == ["a2", "a1", "a0", "c1", "c0", "b2", "b1", "b0"]
    assert runs == pool


def test_a_prefix_another_request_held_waits_for_the_child_queued_before_it() -> None:
    # A and B share a 2-block prefix; B's generated tokens' block is kept at 90 (protected), B finishes first while
    # A still holds the prefix, then A finishes: the pool evicts leaves only, so the prefix waits for B's block.
    # The run queue builds the prefix's run in A's release, which has no link to B's; it now remembers, at B's
    # release, that the prefix's last block held B's child (before: the prefix went first, in the unprotected
    # tier, and B's block was left unreachable)
    cfg = PolicyConfig(
        block_size=BLOCK, ghost_factor=0.0, isolation_goal=None, budget=1.0, adapt_frequency=False
    )
    clock = [0.0]
    _runtime.set_clock(lambda: clock[0])
    try:
        sides = (CoreSide(30, cfg, clock), VllmSide(30, cfg, "run"))
        a = _Request("A", 1, None, [b"p0", b"p1", b"x2"])
        b = _Request("B", 1, {"retention_decode_priority": 90}, [b"p0", b"p1", b"y2"], BLOCK)
        c = _Request("C", 1, None, [b"c0", b"c1"])
        for side in sides:
            got_a, got_b = side.admit(a), side.admit(b)
            assert got_a is not None and got_b is not None
            side.free(b, got_b[1])
            side.free(a, got_a[1])
            got_c = side.admit(c)
            assert got_c is not None
            side.free(c, got_c[1])
            assert side.admit(_Request("flood", 0, None, [b"f%d" % i for i in range(30)])) is not None
        assert sides[0].victims == [b"x2", b"c1", b"c0", b"y2", b"p1", b"p0"]
        assert sides[1].victims == sides[0].victims
        sides[1].q.check()
    finally:
        _runtime.set_clock(None)


def test_a_chain_that_lapses_together_leaves_the_protected_tier_together() -> None:
    # a request keeps its whole prompt at 90 for 5 s: its reused head (two uses) and its new tail (one use) are
    # two runs, the head ranked behind the tail. Both lapse to 25 at once; the pool then ranks them on their own
    # keys (both below C's prefix, used three times). Before, the head's new run was ranked behind the tail's
    # key and tier *before* the lapse: it stayed in the protected tier, after C's prefix (found on vLLM's
    # scheduler with the multi-tenant workload's agents: class 0 1.008x stock instead of 1.049x)
    keep = {"retention_directives": [{"start": 0, "priority": 90, "duration": 5}]}
    script: list[tuple[Any, ...]] = [
        ("req", 1, None, _chain("a", 2), 0),
        ("req", 1, keep, _chain("a", 4), 0),
        *[("req", 1, None, ["c0", "c1", f"t{k}"], 0) for k in range(3)],
        ("tick", 6.0),
    ]
    pool, runs = _victims_after(script)
    assert pool.index("a0") < pool.index("c1")
    assert runs == pool


def test_both_storages_key_again_when_the_tables_change(monkeypatch: pytest.MonkeyPatch) -> None:
    # the frequency exponent falls from 4 to 1 at the 5th lookup (tests/_switching.py): A's prefix, used 4 times
    # before, was keyed at 256, B's, used 6 times after, at 6. Both storages key every block (every run) again
    # from the L of its release with the new tables, so A's prefix goes first; before, both kept A's old keys and
    # evicted B's prefix first
    import kvretain.core.policies.unified as unified_module
    import kvretain.integrations.vllm._runs as runs_module

    monkeypatch.setattr(unified_module, "ProtectionController", SwitchingController)
    monkeypatch.setattr(runs_module, "ProtectionController", SwitchingController)
    script: list[tuple[Any, ...]] = [
        *[("req", 0, None, ["a0", "a1", f"ta{k}"], 0) for k in range(4)],
        *[("req", 0, None, ["b0", "b1", f"tb{k}"], 0) for k in range(6)],
    ]
    pool, runs = _victims_after(script, adapt_frequency=True)
    assert pool[-4:] == ["a1", "a0", "b1", "b0"]
    assert runs == pool


def test_a_blocked_block_evicted_anyway_is_forgotten_by_the_policy() -> None:
    """When the policy has nothing left to offer, the per-block queue evicts a blocked parent (a free block with
    a cached child) anyway; ``unified`` forgets its victims in ``pop``, which that block never went through, so
    the queue tells it (before: the block stayed counted as protected and its use count never reached the ghost
    table, a drift that grew with every such eviction on a long-running server)."""
    n = 4
    side = VllmSide(n, PolicyConfig(protect_threshold=0, isolation_goal=None), "block")
    policy = side.q.policy
    req = _Request("a", 0, None, [b"p" * 32, b"c" * 32])
    got = side.admit(req)
    assert got is not None
    _, blocks = got
    side.free(req, blocks)
    parent, child = blocks
    assert policy._num_protected == 2 and side.q._where[parent.block_id] != side.q._where[child.block_id]
    side.q.remove(
        child
    )  # a hit on the child alone: the parent stays blocked, the policy has nothing to offer
    child.ref_cnt = 1
    taken = side.q.popleft_n(side.q.num_free_blocks)
    assert parent in taken
    assert policy._num_protected == 1  # the child only (before: 2)
    assert policy._meta[parent.block_id].content is None
    side.q.check()


def test_a_reused_block_takes_no_decrement_from_the_child_of_its_old_content() -> None:
    """A blocked parent evicted anyway leaves its in-use child a stale link (the parent's generation moves on):
    once the block holds new content with a child of its own and is blocked again, the old child's eviction must
    not unblock it (before: it did, and the policy offered the block ahead of free blocks without children)."""
    side = VllmSide(4, PolicyConfig(protect_threshold=0, isolation_goal=None), "block")
    q = side.q
    a = _Request("a", 0, None, [b"p" * 32, b"c" * 32])
    z = _Request("z", 0, None, [b"w" * 32])
    v = _Request("v", 0, None, [b"v" * 32])
    got_a, got_z, got_v = side.admit(a), side.admit(z), side.admit(v)
    assert got_a is not None and got_z is not None and got_v is not None
    (parent, child), (w,), (last,) = got_a[1], got_z[1], got_v[1]
    side.free(a, [parent, child])
    q.remove(child)  # a hit on the child alone: the parent stays blocked
    child.ref_cnt = 1
    b1 = _Request("b1", 0, None, [b"x" * 32])
    got = side.admit(b1)  # the policy has nothing to offer: the blocked parent is evicted anyway
    assert got is not None and got[1] == [parent]
    side.free(z, [w])
    b2 = _Request("b2", 0, None, [b"x" * 32, b"y" * 32])
    got = side.admit(b2)  # a hit on x; y goes into w, the new child of the parent's block
    assert got is not None and got[1] == [parent, w]
    side.free(b1, [parent])
    side.free(b2, [parent, w])
    q.remove(w)  # a hit on the new child alone: the parent's block is blocked again
    w.ref_cnt = 1
    side._free_blocks([child])  # the old child's last reference goes
    assert q.popleft_n(1) == [child]
    side.free(v, [last])
    assert q.popleft_n(2) == [last, parent], "the block with a cached child goes after the free leaf"
    q.check()
