"""The discrete-event simulator: invariants, determinism, cost-model timing, closed loop, routing, metrics."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from kvretain.core.kv_cache_manager import KVCacheManager
from kvretain.core.policy import PolicyConfig
from kvretain.core.retention import PriorityMapping
from kvretain.engine.sim.catalog import builtin_catalog
from kvretain.engine.sim.costmodel import CostModel
from kvretain.engine.sim.metrics import SLO, latency_summary, meets_slo, parse_slos, percentile, slo_for
from kvretain.engine.sim.replica import Replica, leading_in
from kvretain.engine.sim.request import SimRequest
from kvretain.engine.sim.router import ROUTERS
from kvretain.engine.sim.simulator import SimConfig, Simulation, simulate
from kvretain.sched import Request, RequestStatus, SchedulerConfig
from kvretain.workloads import MultiTenantConfig, TokenSeq, WorkloadRequest, generate_multi_tenant
from kvretain.workloads.tokens import SeededChunk

SMALL = MultiTenantConfig(
    duration_s=40.0,
    chat_session_rate=0.3,
    chat_attachment_tokens=(500, 3_000),
    chat_rag_tokens=(200, 1_500),
    chat_think_s=5.0,
    agent_rate=0.1,
    agent_tool_result_tokens=(50, 500),
    batch_documents=2,
    batch_document_tokens=(2_000, 4_000),
    batch_job_rate=0.05,
)


def small_workload(seed: int = 0) -> list[WorkloadRequest]:
    return generate_multi_tenant(SMALL, random.Random(seed))


def wr(rid: str, prompt: TokenSeq, out: int, t: float = 0.0, **kw: Any) -> WorkloadRequest:
    return WorkloadRequest(rid, t, prompt, out, **kw)


def cost() -> CostModel:
    cat = builtin_catalog()
    return CostModel(cat.model("llama-3-8b"), cat.gpu("h100-sxm"))


@pytest.mark.parametrize("policy", ["lru", "unified"])
def test_small_multi_tenant_run_keeps_every_invariant(policy: str) -> None:
    wl = small_workload()
    sim = Simulation(SimConfig(policy=policy, kv_blocks=1_500), wl)
    sim.run()  # raises unless every request finished, every block is free and the pools are consistent
    s = sim.summary()
    assert s["requests"] == len(wl) and sorted(s["classes"]) == ["0", "1", "2"]
    assert s["evictions"] > 0 and 0 < s["hit_rate"] < 1
    assert sum(c["requests"] for c in s["classes"].values()) == len(wl)
    for r in sim.finished:
        assert r.num_output_tokens == r.max_tokens and r.ttft is not None and r.e2e is not None
        assert 0 <= r.queueing_time <= r.ttft <= r.e2e  # type: ignore[operator]


def test_two_runs_give_identical_json_except_wall_time() -> None:
    cfg = SimConfig(policy="unified", kv_blocks=1_200, replicas=2, router="prefix-affinity")
    a, b = (simulate(cfg, small_workload(3)) for _ in range(2))
    a.pop("wall_s")
    b.pop("wall_s")
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_timing_of_a_lone_request_follows_the_cost_model() -> None:
    cm = cost()
    prompt = TokenSeq.seeded(1, 1000)
    sim = Simulation(SimConfig(), [wr("a", prompt, 3, t=2.0)]).run()
    (r,) = sim.finished
    t_prefill = cm.prefill_time(1000)
    t1, t2 = cm.decode_time([1001]), cm.decode_time([1002])
    assert r.ttft == pytest.approx(t_prefill)
    assert r.token_times == pytest.approx([2.0 + t_prefill, 2.0 + t_prefill + t1, 2.0 + t_prefill + t1 + t2])
    assert r.tpot == pytest.approx((t1 + t2) / 2) and r.queueing_time == 0.0
    # a 2k-token prompt prefills more slowly than twice a 1k one (attention grows quadratically)
    assert cm.prefill_time(2000) > 2 * cm.prefill_time(1000) - cm.gpu.step_overhead_s


def test_a_follow_up_turn_hits_its_predecessors_prompt_and_decode_blocks() -> None:
    p1 = TokenSeq.seeded(10, 100)
    out1 = TokenSeq.seeded(11, 40)
    p2 = p1 + out1 + TokenSeq.seeded(12, 30)
    a = SimRequest(wr("a", p1, 40, output=out1))
    b = SimRequest(wr("b", p2, 5))
    ha = list(a.block_hashes(16, (100 + 40) // 16))
    hb = list(b.block_hashes(16, 170 // 16))
    assert ha == hb[: len(ha)]  # prompt blocks and the decode blocks a generated
    # a different block size gives other hashes but the same sharing
    assert (
        list(SimRequest(wr("a", p1, 40, output=out1)).block_hashes(32, 4))
        == list(SimRequest(wr("b", p2, 5)).block_hashes(32, 5))[:4]
    )
    with pytest.raises(ValueError, match="block size 16"):
        a.block_hashes(32, 100)
    # the cache manager takes the fast path: b hits the 6 full prompt blocks that a left cached (a's
    # outputs were never generated here, so its decode blocks were not registered)
    kv = KVCacheManager(64, block_size=16)
    assert kv.allocate_slots(a, 140, 0) is not None
    kv.free(a)
    hits, n = kv.get_computed_blocks(b)
    assert n == 96 and len(hits) == 6


def test_closed_loop_follow_up_arrives_think_time_after_its_predecessor() -> None:
    out1 = TokenSeq.seeded(2, 20)
    first = wr("t0", TokenSeq.seeded(1, 200), 20, output=out1)
    second = wr(
        "t1", TokenSeq.seeded(1, 200) + out1 + TokenSeq.seeded(3, 10), 5, t=0.1, after="t0", think_s=3.0
    )
    sim = Simulation(SimConfig(), [first, second]).run()
    a, b = sorted(sim.finished, key=lambda r: r.request_id)
    assert b.arrival_time == pytest.approx(a.finish_time + 3.0)  # type: ignore[operator]
    assert sim.replicas[0].kv.stats[0].hit_tokens == 208  # 13 of its 14 blocks: prompt and decode blocks
    open_loop = Simulation(SimConfig(closed_loop=False), [first, second]).run()
    assert min(r.arrival_time for r in open_loop.finished if r.request_id == "t1") == 0.1


def test_the_front_end_delays_the_engine_and_the_client() -> None:
    """With a front end (frontend_in_s 10 ms, frontend_out_s 3 ms): each request reaches the engine 10 ms after
    its send, the client sees each token 3 ms after its step, and the follow-up is sent think_s after the client
    got the last token; the engine's steps and TPOT are those of the run without it."""
    out1 = TokenSeq.seeded(2, 20)
    first = wr("t0", TokenSeq.seeded(1, 200), 20, t=1.0, output=out1)
    second = wr(
        "t1", TokenSeq.seeded(1, 200) + out1 + TokenSeq.seeded(3, 10), 5, t=1.1, after="t0", think_s=3.0
    )
    bare = {r.request_id: r for r in Simulation(SimConfig(), [first, second]).run().finished}
    sim = Simulation(SimConfig(frontend_in_s=0.010, frontend_out_s=0.003), [first, second]).run()
    got = {r.request_id: r for r in sim.finished}
    a, b = got["t0"], got["t1"]
    assert a.arrival_time == pytest.approx(1.0)  # the client's send
    assert a.first_scheduled_time == pytest.approx(1.010)  # the engine sees it 10 ms later
    assert a.ttft == pytest.approx(bare["t0"].ttft + 0.013)  # type: ignore[operator]
    assert a.e2e == pytest.approx(bare["t0"].e2e + 0.013)  # type: ignore[operator]
    assert a.tpot == pytest.approx(bare["t0"].tpot)
    # the client got t0's last token at its engine finish + 3 ms, thought 3 s, sent t1
    assert b.arrival_time == pytest.approx(a.finish_time + 0.003 + 3.0)  # type: ignore[operator]
    assert b.first_scheduled_time == pytest.approx(b.arrival_time + 0.010)
    assert b.ttft == pytest.approx(bare["t1"].ttft + 0.013)  # type: ignore[operator]
    assert a.queueing_time == pytest.approx(bare["t0"].queueing_time)  # the engine's queue, as vLLM's
    # the span is the client's: first send to the last token at its client
    assert sim.summary()["simulated_s"] == pytest.approx(b.finish_time + 0.003 - 1.0)  # type: ignore[operator]
    assert (sim.summary()["frontend_in_s"], sim.summary()["frontend_out_s"]) == (0.010, 0.003)
    for bad in (-0.001, float("inf"), float("nan"), 1e308, 3600.5):  # 1e308 made the summary's means inf
        with pytest.raises(ValueError, match="frontend_in_s must be a finite number"):
            SimConfig(frontend_in_s=bad)


def test_queueing_time_behind_a_front_end_is_never_below_zero() -> None:
    # scheduled the moment it reached the engine: (scheduled - sent) - frontend_in_s rounded to -5.2e-18, and the
    # summary printed "queue_mean_s": -0.0
    wl = [wr("a", TokenSeq.seeded(1, 32), 4, t=0.1)]
    sim = Simulation(SimConfig(kv_blocks=100, frontend_in_s=0.01), wl).run()
    assert sim.finished[0].queueing_time == 0.0
    assert "-0.0" not in json.dumps(sim.summary())


@pytest.mark.parametrize(
    ("links", "cycle"),
    [
        ({"a": "b", "b": "a"}, "a -> b -> a"),
        ({"a": "a"}, "a -> a"),
        ({"c": "a", "a": "b", "b": "d", "d": "a", "e": None}, "a -> b -> d -> a"),  # reached from c's chain
    ],
)
def test_a_follow_up_cycle_is_refused_by_name(links: dict[str, str | None], cycle: str) -> None:
    # each request waited for the other: both were lost and run() ended blaming the scheduler (RuntimeError)
    wl = [wr(k, TokenSeq.seeded(i, 10), 2, after=v) for i, (k, v) in enumerate(links.items())]
    with pytest.raises(ValueError, match=rf"follow-ups form a cycle of \d request\(s\): {cycle} \("):
        Simulation(SimConfig(kv_blocks=100), wl)
    # open loop: `after` is not followed, every request arrives at its own time
    assert len(Simulation(SimConfig(kv_blocks=100, closed_loop=False), wl).run().finished) == len(wl)
    # a chain (and a link to a request outside the workload) is no cycle
    chain = [wr("x", TokenSeq.seeded(1, 10), 2, after="gone"), wr("y", TokenSeq.seeded(2, 10), 2, after="x")]
    assert len(Simulation(SimConfig(kv_blocks=100), chain).run().finished) == 2


def test_recomputed_tokens_count_misses_on_evicted_blocks() -> None:
    doc = TokenSeq.seeded(5, 320)  # 20 blocks
    reqs = [
        wr("a", doc + TokenSeq.seeded(6, 8), 1, t=0.0),
        wr("flood", TokenSeq.seeded(7, 480), 1, t=1.0),  # 30 blocks: evicts most of a's cache in 40
        wr("b", doc + TokenSeq.seeded(8, 8), 1, t=2.0),
    ]
    small = simulate(SimConfig(kv_blocks=40), reqs)
    big = simulate(SimConfig(kv_blocks=400), reqs)
    assert big["recomputed_tokens"] == 0 and big["classes"]["0"]["hit_rate"] > 0
    assert small["recomputed_tokens"] > 0 and small["recomputed_tokens"] % 16 == 0
    assert small["evictions"] > 0


def test_recomputed_tokens_leave_out_the_block_of_the_last_prompt_token() -> None:
    # a lookup never reaches the block of a prompt's last token: of a 20-block prompt evicted whole and sent
    # again, 19 blocks count as recomputed
    doc = TokenSeq.seeded(5, 320)
    reqs = [
        wr("a", doc, 1, t=0.0),
        wr("flood", TokenSeq.seeded(7, 639), 1, t=1.0),  # 40 blocks: evicts every block of a
        wr("b", doc, 1, t=2.0),
    ]
    assert simulate(SimConfig(kv_blocks=40), reqs)["recomputed_tokens"] == 19 * 16


def _replica() -> Replica:
    """A replica of 64 blocks of 16 tokens, its clock stopped at 0."""
    return Replica(
        0, cost(), 64, 16, "lru", PolicyConfig(), PriorityMapping(), SchedulerConfig(), lambda: 0.0, {}
    )


def test_an_evicted_block_counts_as_recomputed_at_its_first_miss_only() -> None:
    # a resume after preemption misses again what its admission missed (and may not have computed): counted once
    rep = _replica()
    req = SimRequest(wr("x", TokenSeq.seeded(1, 96), 1, priority=2))
    hashes = req.block_hashes(16, 6)
    rep.kv.evicted.update(hashes)
    rep.kv.on_admitted(req, 2)  # 2 blocks hit; the lookup stops before block 5, the last prompt token's
    assert rep.kv.recomputed_tokens == {2: 3 * 16}
    rep.kv.on_admitted(req, 2)
    assert rep.kv.recomputed_tokens == {2: 3 * 16}
    assert rep.kv.evicted == {hashes[0], hashes[1], hashes[5]}


def test_a_child_cached_behind_an_evicted_parent_is_recomputed_once_per_miss_and_an_evicted_copy_is_no_loss() -> (
    None
):
    # s3fifo may evict a parent before its child: the child's content stays cached but out of a prefix lookup's
    # reach, so a request computes it again behind a new parent, held twice then (a copy). That is recomputed
    # work, counted as such; evicting the copy while the first block stays cached loses no content (the hash is
    # not remembered as evicted), and each later miss behind the evicted parent computes the child once more.
    rep = Replica(
        0, cost(), 6, 16, "s3fifo", PolicyConfig(), PriorityMapping(), SchedulerConfig(), lambda: 0.0, {}
    )
    kv = rep.kv
    head, child, tail = TokenSeq.seeded(1, 16), TokenSeq.seeded(2, 16), TokenSeq.seeded(3, 1)

    def serve(rid: str, prompt: TokenSeq) -> int:
        """Admit a request with its whole prompt, release it; the blocks it hit."""
        req = SimRequest(wr(rid, prompt, 1))
        hits, n = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, req.num_prompt_tokens - n, n, hits) is not None
        kv.free(req)
        return n // 16

    hp, hc = SimRequest(wr("hashes", head + child + tail, 1)).block_hashes(16, 2)[:2]
    # the parent enters the small queue alone, first; two requests hit it, the second hits the child too:
    # both move to the main queue in that order, and the next eviction takes the parent
    hits = [serve("a", head + tail), serve("b", head + child + tail), serve("c", head + child + tail)]
    assert hits == [0, 1, 2]
    assert serve("fill1", TokenSeq.seeded(10, 65)) == 0  # 5 blocks: the 4 empty ones and the parent
    assert hp not in kv.pool.cached and hc in kv.pool.cached and kv.evicted == {hp}
    # computed again behind a new parent (the parent evicted, the child cached out of reach: both recomputed);
    # the child's content is registered a second time, a copy
    assert serve("d", head + child + tail) == 0
    assert kv.recomputed_tokens == {0: 32} and len(kv.pool.copies[hc]) == 1
    # 5 blocks: the empty one and the small queue's four (fill1's other two, the copy, the new parent)
    assert serve("fill2", TokenSeq.seeded(11, 65)) == 0
    assert hp not in kv.pool.cached and hc in kv.pool.cached and hc not in kv.pool.copies
    assert hp in kv.evicted and hc not in kv.evicted
    # the parent's miss is recomputed again, and the child's content behind it (its first block still holds it)
    assert serve("e", head + child + tail) == 0
    assert kv.recomputed_tokens == {0: 64}


def _s3fifo_replica() -> tuple[Any, TokenSeq, TokenSeq, TokenSeq, Any, Any]:
    rep = Replica(
        0, cost(), 6, 16, "s3fifo", PolicyConfig(), PriorityMapping(), SchedulerConfig(), lambda: 0.0, {}
    )
    head, child, tail = TokenSeq.seeded(1, 16), TokenSeq.seeded(2, 16), TokenSeq.seeded(3, 1)
    hp, hc = SimRequest(wr("hashes", head + child + tail, 1)).block_hashes(16, 2)[:2]
    return rep.kv, head, child, tail, hp, hc


def _serve(kv: Any, rid: str, prompt: TokenSeq, tokens: int | None = None) -> int:
    """Admit a request with its whole prompt (or its first ``tokens`` past the hits), release it; the blocks it
    hit."""
    req = SimRequest(wr(rid, prompt, 1))
    hits, n = kv.get_computed_blocks(req)
    todo = req.num_prompt_tokens - n if tokens is None else tokens
    assert kv.allocate_slots(req, todo, n, hits) is not None
    kv.free(req)
    return n // 16


def test_content_both_evicted_earlier_and_cached_out_of_reach_is_recomputed_once() -> None:
    # the child's content is evicted (remembered), then cached again by a request whose last prompt block it is
    # (never looked up: still remembered); the parent is then evicted ahead of it (s3fifo). A miss behind the
    # parent recomputes the child's block once, not once as evicted and once more as cached out of reach
    kv, head, child, tail, hp, hc = _s3fifo_replica()
    assert _serve(kv, "x", head + child + tail) == 0
    assert _serve(kv, "fill1", TokenSeq.seeded(10, 65)) == 0  # evicts the child, keeps the parent
    assert hp in kv.pool.cached and hc not in kv.pool.cached and kv.evicted == {hc}
    assert _serve(kv, "a", head + tail) == 1
    assert _serve(kv, "p", head + child) == 1  # 2 blocks: the child's is its last prompt block, not looked up
    assert _serve(kv, "c", head + child + tail) == 2
    assert sum(kv.recomputed_tokens.values()) == 0
    assert _serve(kv, "fill2", TokenSeq.seeded(11, 65)) == 0  # evicts the parent, keeps the child
    assert hp not in kv.pool.cached and hc in kv.pool.cached and kv.evicted >= {hp, hc}
    assert _serve(kv, "q", head + child + tail) == 0
    assert kv.recomputed_tokens == {0: 32}


def test_a_child_cached_out_of_reach_is_recomputed_when_no_evicted_hash_is_remembered() -> None:
    # the evicted parent's first miss (a request admitted for part of a block and then freed) forgets the
    # parent's hash; the child stays cached behind it, and the next miss computes it again: recomputed, although
    # the replica remembers no evicted hash then
    kv, head, child, tail, hp, hc = _s3fifo_replica()
    hits = [
        _serve(kv, "a", head + tail),
        _serve(kv, "b", head + child + tail),
        _serve(kv, "c", head + child + tail),
    ]
    assert hits == [0, 1, 2]
    assert _serve(kv, "fill1", TokenSeq.seeded(10, 65)) == 0  # evicts the parent, keeps the child
    assert hp not in kv.pool.cached and hc in kv.pool.cached and kv.evicted == {hp}
    assert _serve(kv, "x", head + child + tail, tokens=8) == 0  # admitted, no block computed
    assert kv.recomputed_tokens == {0: 32} and kv.evicted == set() and hc in kv.pool.cached
    assert _serve(kv, "y", head + child + tail) == 0
    assert kv.recomputed_tokens == {0: 48}


def test_a_class_counts_the_evictions_of_the_blocks_its_requests_released() -> None:
    doc = TokenSeq.seeded(5, 320)
    reqs = [
        wr("a", doc, 1, t=0.0, priority=1),
        wr("flood", TokenSeq.seeded(7, 639), 1, t=1.0),  # evicts the 20 blocks a released
        wr("b", doc, 1, t=2.0, priority=2),  # evicts 19 of flood's
    ]
    s = simulate(SimConfig(kv_blocks=40), reqs)
    assert {c: v["evicted_blocks"] for c, v in s["classes"].items()} == {"0": 19, "1": 20, "2": 0}
    assert s["evictions"] == 39


def test_a_request_without_output_tokens_is_simulated_with_one() -> None:
    reqs = [
        wr("none", TokenSeq.seeded(1, 40), 0),
        wr("empty", TokenSeq.seeded(2, 40), 0, output=TokenSeq.of([])),
    ]
    sim = Simulation(SimConfig(kv_blocks=100), reqs).run()
    outputs = {r.request_id: len(r.output_token_ids) for r in sim.finished}
    assert outputs == {"empty": 1, "none": 1}


def test_an_empty_chunk_changes_no_block_hash() -> None:
    doc = TokenSeq.seeded(3, 40)
    padded = TokenSeq((SeededChunk(9, 0),)) + doc + TokenSeq((SeededChunk(4, 0),))
    hashes = [
        SimRequest(wr(rid, prompt, 1)).block_hashes(16, 2) for rid, prompt in (("x", padded), ("y", doc))
    ]
    assert hashes[0] == hashes[1]


def test_a_replicas_prefix_match_counts_leading_cached_blocks_but_not_the_last_prompt_tokens() -> None:
    # a prefix: c, past the missing b, does not count
    assert leading_in([b"a", b"b", b"c"], {b"a", b"c"}) == 1
    long, five = TokenSeq.seeded(1, 1_600), TokenSeq.seeded(2, 80)  # 100 blocks; 5 blocks
    sim = Simulation(SimConfig(kv_blocks=200), [wr("a", long, 1), wr("f", five, 1, t=1.0)]).run()
    kv = sim.replicas[0].kv
    assert kv.prefix_match(SimRequest(wr("x", long, 1))) == 64  # at most 64 blocks by default
    assert kv.prefix_match(SimRequest(wr("y", five, 1))) == 4  # (all 5 cached; the 5th holds the last token)
    assert kv.prefix_match(SimRequest(wr("z", five + TokenSeq.seeded(3, 1), 1))) == 5


def test_a_replicas_load_counts_its_waiting_requests() -> None:
    rep = _replica()
    for i in range(2):
        rep.scheduler.add_request(SimRequest(wr(f"r{i}", TokenSeq.seeded(i, 20), 2)))
    assert rep.load == 2 and not rep.scheduler.running


def test_routers() -> None:
    assert ROUTERS.names() == ["least-loaded", "prefix-affinity", "prefix-memory", "round-robin"]
    wl = small_workload(1)
    base = dict(policy="lru", kv_blocks=2_000, replicas=3)
    rr_steps = [r.num_steps for r in Simulation(SimConfig(router="round-robin", **base), wl).run().replicas]  # type: ignore[arg-type]
    assert all(s > 0 for s in rr_steps)
    rr = Simulation(SimConfig(router="round-robin", **base), wl).run()  # type: ignore[arg-type]
    pa = Simulation(SimConfig(router="prefix-affinity", **base), wl).run()  # type: ignore[arg-type]
    assert pa.summary()["hit_rate"] > rr.summary()["hit_rate"]
    pm = Simulation(SimConfig(router="prefix-memory", **base), wl).run()  # type: ignore[arg-type]
    assert pm.summary()["hit_rate"] > rr.summary()["hit_rate"] and len(pm.finished) == len(wl)


class _Req:
    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = hashes
        self.num_prompt_tokens = 16 * len(hashes) + 1  # (every block full, one token beyond)

    def block_hashes(self, block_size: int, n: int) -> list[bytes]:
        return self.hashes[:n]


def _replicas(loads: list[int], pool_blocks: int) -> list[Any]:
    from types import SimpleNamespace

    kv = [
        SimpleNamespace(
            block_size=16, pool=SimpleNamespace(num_blocks=pool_blocks), prefix_match=lambda req: 0
        )
        for _ in loads
    ]  # (caches that hold nothing: every prefix evicted)
    return [
        SimpleNamespace(index=i, load=load, kv=k) for i, (load, k) in enumerate(zip(loads, kv, strict=True))
    ]


def test_prefix_memory_routes_by_what_it_sent_not_by_what_the_caches_kept() -> None:
    # with prefix-affinity an evicted prefix sends the conversation's next turn to another replica; the router's
    # own record (SGLang's and vLLM production stack's prefix-aware routers keep one) keeps it where it was sent
    first, other, again = _Req([b"a", b"b", b"c"]), _Req([b"x", b"y"]), _Req([b"a", b"b", b"c", b"d"])
    pm, pa = ROUTERS.create("prefix-memory"), ROUTERS.create("prefix-affinity")
    reps = _replicas([0, 0], pool_blocks=4)
    assert pm.route(first, reps) == 0  # (no match anywhere: the least loaded, the lower index)
    reps[0].load = 1
    assert pm.route(other, reps) == 1
    reps[1].load = 2
    # (its prefix was sent to 0, and 0 is the least loaded)
    assert pm.route(again, reps) == 0 and pa.route(again, reps) == 0
    reps[0].load, reps[1].load = 3, 1
    assert pm.route(again, reps) == 0  # the record still holds its prefix, though replica 0's cache does not
    assert pa.route(again, reps) == 1  # the cache-aware router follows the eviction to the least loaded
    # the record holds at most the replica's pool in blocks, least recently routed dropped first
    reps[0].load = reps[1].load = 0
    assert pm.route(_Req([b"p", b"q", b"r", b"s"]), reps) == 0  # (a b c d leave replica 0's record)
    reps[0].load = 1
    assert pm.route(first, reps) == 1  # no match left: the least loaded
    # a match loses to load beyond the slack (8 requests, as prefix-affinity)
    reps[0].load, reps[1].load = 9, 0
    assert pm.route(_Req([b"p", b"q"]), reps) == 1
    assert pm.route(first, _replicas([5], pool_blocks=4)) == 0  # (one replica: always it)
    # the simulator offers only the replicas that can hold a request: the record follows each replica's index
    pm = ROUTERS.create("prefix-memory")
    reps = _replicas([0, 0, 0], pool_blocks=8)
    assert pm.route(first, reps) == 0
    reps[0].load = 1
    assert pm.route(other, reps) == 1  # (x y on replica 1)
    reps[1].load = 1
    assert pm.route(_Req([b"big"]), [reps[1], reps[2]]) == 1  # (two of three fit it: position 1 is replica 2)
    assert pm.route(other, reps) == 1  # still replica 1's conversation
    assert pm.route(first, [reps[2], reps[0]]) == 1  # position 1 of this offer: replica 0, where it was sent
    # a prompt's first blocks are dropped last: a shorter prompt of a longer one's prefix still matches
    pm = ROUTERS.create("prefix-memory")
    reps = _replicas([0, 0], pool_blocks=3)
    assert pm.route(_Req([b"s", b"t", b"u", b"v"]), reps) == 0  # (4 blocks into a record of 3: v goes)
    reps[0].load = 1
    assert pm.route(_Req([b"s", b"t"]), reps) == 0


def test_bad_input_is_reported() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        SimConfig(router="random")
    with pytest.raises(ValueError, match="replicas"):
        SimConfig(replicas=0)
    with pytest.raises(ValueError, match="unknown model"):
        SimConfig(model="gpt-9").cost()
    with pytest.raises(ValueError, match="unique"):
        Simulation(SimConfig(), [wr("x", TokenSeq.seeded(1, 5), 1), wr("x", TokenSeq.seeded(1, 5), 1)])


@pytest.mark.parametrize("queue", ["fcfs", "priority"])
@pytest.mark.parametrize("preempts", [False, True])
def test_waiting_preempts_running_and_fcfs_options_run_clean(queue: str, preempts: bool) -> None:
    # issue 11, defect 1: fcfs with waiting_preempts_running lost and double-scheduled requests
    wl = small_workload(2)
    sched = SchedulerConfig(policy=queue, waiting_preempts_running=preempts)
    s = simulate(SimConfig(kv_blocks=900, sched=sched), wl)
    assert s["requests"] == len(wl) and s["rejected"] == 0
    assert s["preemptions"] > 0 and s["resumes"] == s["preemptions"]


def test_itl_pools_every_gap_between_tokens() -> None:
    # vLLM's benchmark reports inter-token latency: every gap between two tokens of a request, pooled; a stall
    # that TPOT (a request's mean gap) averages away shows in its tail
    wl = small_workload(2)
    sim = Simulation(SimConfig(kv_blocks=900), wl).run()
    s = sim.summary()
    gaps = sorted(b - a for r in sim.finished for a, b in zip(r.token_times, r.token_times[1:], strict=False))
    assert s["preemptions"] > 0 and len(gaps) == sum(len(r.token_times) - 1 for r in sim.finished)
    assert s["itl_mean_s"] == round(sum(gaps) / len(gaps), 6) and s["itl_p99_s"] <= gaps[-1]
    stalled = max(
        sim.finished, key=lambda r: max(b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False))
    )
    assert stalled.tpot is not None and max(gaps) > stalled.tpot
    for c in s["classes"].values():
        assert {"itl_mean_s", "itl_p50_s", "itl_p90_s", "itl_p99_s"} <= set(c)


def test_a_request_no_replica_can_hold_is_rejected_and_the_others_run() -> None:
    # issue 11, defect 2: it blocked the head of its replica's queue forever, the run ended in a RuntimeError
    big = wr("big", TokenSeq.seeded(1, 600), 10)  # 609 tokens of KV: 39 blocks of 16 > 32
    after = wr("after", TokenSeq.seeded(1, 600) + TokenSeq.seeded(2, 8), 2, after="big", think_s=1.0)
    small = [wr(f"s{i}", TokenSeq.seeded(10 + i, 100), 5, t=0.01 * i, priority=i % 2) for i in range(6)]
    sim = Simulation(SimConfig(kv_blocks=32, replicas=2), [big, after, *small]).run()
    s = sim.summary()
    assert s["requests"] == 6 and s["rejected"] == 2  # the follow-up arrives after the rejection, too large
    assert [r["request_id"] for r in s["rejections"]] == ["after", "big"]
    assert s["rejections"][1]["reason"] == (
        "request 'big' needs 39 KV blocks of 16 tokens for its 600 prompt and 10 output tokens, "
        "but the replica has only 32"
    )
    assert s["classes"]["0"]["rejected"] == 2 and s["classes"]["1"]["rejected"] == 0
    assert sum(c["requests"] for c in s["classes"].values()) == 6
    assert all(r.status is RequestStatus.REJECTED for r in sim.rejected)
    json.dumps(s, allow_nan=False)
    none_fit = simulate(SimConfig(kv_blocks=1), small)
    assert none_fit["requests"] == 0 and none_fit["rejected"] == len(small)
    # a rejected request misses its SLO (it was sent and never served): the attainment counted finished ones
    # only, 1.0 with 192 of 200 rejected; no lookup is no hit ratio, not 0.0 (a cache that hit nothing)
    assert s["slo_attainment"] is not None and s["slo_attainment"] <= 6 / 8
    assert s["classes"]["0"]["slo_attainment"] <= 3 / 5  # s0, s2, s4 finished; big, after rejected
    assert none_fit["slo_attainment"] == 0.0 and none_fit["hit_rate"] is None
    assert all(c["hit_rate"] is None and c["slo_attainment"] == 0.0 for c in none_fit["classes"].values())


@pytest.mark.parametrize("fast_forward", [True, False])
def test_requests_that_arrive_together_are_scheduled_together(fast_forward: bool) -> None:
    # vLLM's engine core drains its input queue before it schedules: four 2,000-token requests sent at one
    # instant fit one 8,192-token step and share a first token; the idle replica used to start at the first
    # arrival and run it alone (TTFT 49 ms), the other three a step later (196 ms)
    reqs = [wr(f"r{i}", TokenSeq.seeded(100 + i, 2_000), 4, t=1.0) for i in range(4)]
    reqs.append(wr("late", TokenSeq.seeded(200, 2_000), 4, t=1.0 + 1e-6))
    sim = Simulation(SimConfig(kv_blocks=2_000, fast_forward=fast_forward), reqs).run()
    ttft = {r.request_id: r.ttft for r in sim.finished}
    assert ttft["r0"] == ttft["r1"] == ttft["r2"] == ttft["r3"]
    assert ttft["late"] is not None and ttft["late"] > ttft["r0"]  # a microsecond later: the next step
    assert sim.replicas[0].num_steps >= 2


def test_a_request_too_large_for_one_replica_is_routed_to_one_that_holds_it() -> None:
    cfg = SimConfig(replicas=2, router="round-robin", kv_blocks=64)
    reqs = [wr("big", TokenSeq.seeded(1, 600), 10), wr("next", TokenSeq.seeded(2, 50), 3, t=0.5)]
    sim = Simulation(cfg, reqs)
    r0 = sim.replicas[0]  # replica 0 gets a cache of 8 blocks: round-robin would send it "big" first
    sim.replicas[0] = Replica(
        0,
        sim.cost,
        8,
        16,
        "lru",
        PolicyConfig(),
        PriorityMapping(),
        SchedulerConfig(),
        lambda: sim.now,
        sim.requests,
    )
    assert r0.index == 0
    sim.run()
    assert sorted(r.request_id for r in sim.finished) == ["big", "next"] and not sim.rejected
    looked_up = [sum(c.query_tokens for c in rep.kv.stats.values()) for rep in sim.replicas]
    assert looked_up[0] < 600 <= looked_up[1]  # "big" was served by replica 1


def test_resumes_are_counted_apart_from_first_lookups() -> None:
    # issue 10, deliverable 5: a resume after preemption hit its own freed blocks and counted as a lookup
    wl = small_workload(2)
    s = simulate(SimConfig(kv_blocks=900), wl)
    assert s["preemptions"] > 0 and s["resumes"] == s["preemptions"] and s["resume_hit_tokens"] > 0
    classes = s["classes"].values()
    assert sum(c["resumes"] for c in classes) == s["resumes"]
    for c in classes:
        assert c["hit_rate"] == round(c["hit_tokens"] / c["query_tokens"], 6)
    q = sum(c["query_tokens"] for c in classes)
    assert s["hit_rate"] == round(sum(c["hit_tokens"] for c in classes) / q, 6)


def test_metrics_helpers() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert parse_slos("0=1:0.05, 2=30:1") == {0: SLO(1.0, 0.05), 2: SLO(30.0, 1.0)}
    with pytest.raises(ValueError, match="class=ttft_s:tpot_s"):
        parse_slos("0=fast")


def _served(rid: str, token_times: list[float], prio: int = 0) -> Request:
    """A finished request sent at 0 with one output token at each of ``token_times``."""
    r = Request(rid, [1], len(token_times), priority=prio)
    r.output_token_ids = [7] * len(token_times)
    r.token_times = list(token_times)
    r.first_scheduled_time = 0.0
    r.finish_time = token_times[-1]
    r.status = RequestStatus.FINISHED
    return r


def test_percentile_interpolates_up_from_the_lower_order_statistic() -> None:
    assert percentile([0.0, 10.0], 90) == 9.0
    assert percentile([0.0, 10.0, 20.0, 30.0], 25) == 7.5
    assert percentile([0.0, 10.0, 20.0, 30.0], 100) == 30.0


def test_a_class_without_an_slo_takes_the_nearest_lower_classes() -> None:
    a, b, c = SLO(1.0, 0.1), SLO(2.0, 0.2), SLO(3.0, 0.3)
    slos = {0: a, 2: b, 5: c}
    assert slo_for(slos, 3) is b and slo_for(slos, 9) is c and slo_for(slos, 2) is b
    assert slo_for({1: a, 3: b}, 0) is a  # (below every class: the most important one's)


def test_a_request_exactly_at_its_targets_meets_its_slo() -> None:
    r = _served("r", [2.0, 2.5, 3.0])  # TTFT 2.0, TPOT 0.5
    assert meets_slo(r, SLO(2.0, 0.5))
    assert not meets_slo(r, SLO(1.5, 0.5)) and not meets_slo(r, SLO(2.0, 0.25))


def test_a_one_token_request_meets_its_slo_on_ttft_alone() -> None:
    assert _served("r", [1.0]).tpot is None
    assert meets_slo(_served("r", [1.0]), SLO(2.0, 0.1))
    assert not meets_slo(_served("r", [3.0]), SLO(2.0, 0.1))


def test_latency_summary_reports_mean_p50_p90_p99_and_slo_attainment_over_every_request_sent() -> None:
    reqs = [_served(f"r{k:03}", [float(k)]) for k in range(101)]  # TTFTs 0, 1, ..., 100 s
    out = latency_summary(reqs, {0: SLO(10.0, 1.0)}, simulated_s=100.0, rejected=9)
    assert (out["ttft_mean_s"], out["ttft_p50_s"], out["ttft_p90_s"], out["ttft_p99_s"]) == (
        50.0,
        50.0,
        90.0,
        99.0,
    )
    assert out["e2e_p99_s"] == 99.0 and out["tpot_p99_s"] is None
    assert out["slo_attainment"] == 0.1  # 11 of 110 sent: TTFT 0..10 s
    assert out["goodput_rps"] == 0.11 and out["output_tokens_per_s"] == 1.01


def test_a_simulation_whose_pool_cannot_hold_one_request_of_max_model_len_is_refused() -> None:
    # vLLM 0.33 refuses to start on a KV cache that cannot hold one request of max_model_len tokens (10 blocks of
    # 16 hold 160); so does the simulator, before it runs, and a pool that holds it runs
    wl = [wr("a", TokenSeq.seeded(1, 100), 4)]
    with pytest.raises(
        ValueError, match=r"^max_model_len 161: .* the largest max_model_len it holds is 160 "
    ):
        Simulation(SimConfig(kv_blocks=10, sched=SchedulerConfig(max_model_len=161)), wl)
    sim = Simulation(SimConfig(kv_blocks=10, sched=SchedulerConfig(max_model_len=160)), wl).run()
    assert [r.num_output_tokens for r in sim.finished] == [4]


def test_request_throughput_is_finished_requests_over_the_span_as_vllms_benchmark() -> None:
    """vLLM 0.33's ``calculate_metrics`` (``vllm/benchmarks/serve.py``): ``request_throughput = completed /
    dur_s``, a failed request not completed; here the finished requests over the simulated span, a request
    rejected at admission not counted (it is in the SLO attainment's denominator, not here)."""
    reqs = [_served(f"r{k}", [1.0 + k, 2.0 + k]) for k in range(8)]
    out = latency_summary(reqs, {0: SLO(10.0, 1.0)}, simulated_s=4.0, rejected=3)
    assert out["request_throughput_rps"] == 2.0  # 8 finished in 4 s
    assert (
        latency_summary(reqs[:1], {0: SLO(10.0, 1.0)}, simulated_s=3.0)["request_throughput_rps"] == 0.333333
    )
    assert (
        latency_summary([], {0: SLO(10.0, 1.0)}, simulated_s=0.0, rejected=2)["request_throughput_rps"] == 0.0
    )


def test_the_summary_reports_request_throughput_over_the_same_span_as_output_throughput() -> None:
    """Three requests finish (two of class 0, one of class 1), one is rejected at admission (more blocks than
    the pool has): 3 requests over the span from the first send (t = 1 s) to the last token at its client,
    and each class's own finished requests over that same span."""
    wl = [
        wr("a", TokenSeq.seeded(1, 200), 8, t=1.0),
        wr("b", TokenSeq.seeded(2, 300), 4, t=1.5),
        wr("c", TokenSeq.seeded(3, 100), 6, t=2.0, priority=1),
        wr("huge", TokenSeq.seeded(4, 2_000), 4, t=1.2),  # 126 blocks of 16: rejected
    ]
    sim = Simulation(SimConfig(kv_blocks=64, frontend_out_s=0.002), wl).run()
    s = sim.summary()
    last = max(r.finish_time for r in sim.finished)  # type: ignore[type-var]
    span = last + 0.002 - 1.0  # type: ignore[operator]
    assert (s["requests"], s["rejected"]) == (3, 1) and s["simulated_s"] == pytest.approx(span)
    assert s["request_throughput_rps"] == round(3 / span, 6)
    assert s["output_tokens_per_s"] == round(18 / span, 6)  # (the same span)
    assert s["classes"]["0"]["request_throughput_rps"] == round(2 / span, 6)
    assert s["classes"]["1"]["request_throughput_rps"] == round(1 / span, 6)


def test_a_prefix_match_keeps_its_replica_at_exactly_slack_more_requests_than_the_least_loaded() -> None:
    pm = ROUTERS.create("prefix-memory")
    reps = _replicas([0, 0], pool_blocks=8)
    conv = _Req([b"a", b"b"])
    assert pm.route(conv, reps) == 0
    reps[0].load = 8  # the slack (8): not more than it
    assert pm.route(conv, reps) == 0
    reps[0].load = 9
    assert pm.route(conv, reps) == 1
