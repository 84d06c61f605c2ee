"""kvretain's scheduler and cache against vLLM 0.33's, step for step, on the same request sequence.

    .venv-vllm/bin/python bench/sched_equivalence.py [--trace T] [--requests 1000] [--policy lru|unified]
        [--queue fcfs|priority|both] [--block-size 16 --pool-blocks 2048 --max-batched-tokens 2048 ...]

The first ``--requests`` requests of the Mooncake conversation trace, tagged with the reference priority rule
(``kvretain.workloads``); every trace hash id expands into 512 deterministic tokens, so equal hash ids give
equal tokens and both engines find the same prefixes with their own block hashing. Prompts are cut to
``--max-prompt`` tokens and outputs to ``--max-output`` so that every request fits the pool (a request
larger than the pool would stall vLLM's queue for ever). Arrivals: one scheduler step per ``--step-ms`` of
trace time (idle engines jump to the next arrival); ``arrival_time`` is the trace time on both sides.

Both sides run the same loop (add the step's arrivals, ``schedule()``, a runner that samples one token for
every request whose prefill completes or that decodes, ``update_from_output``):

* kvretain: ``kvretain.sched.Scheduler`` over ``kvretain.core.KVCacheManager`` (``--policy``; pool of
  ``--pool-blocks - 1`` blocks, as vLLM keeps one of its blocks as the null block);
* vLLM: its v1 ``Scheduler`` + ``KVCacheManager`` (``bench/_vllm_harness.py``), stock for ``lru``, with the
  kvretain plugin's ``unified`` for ``unified`` (``KVRETAIN_POLICY=unified``, the plugin's default options
  and granularity; kvretain's side gets the same ``PolicyConfig``).

A request may also be added between a step's ``schedule()`` and its ``update_from_output`` (``Spec.mid_step``),
or aborted (``Spec.abort_step``): the tests' generated workloads do both; the trace does neither.

``max_model_len``: vLLM's side always has one (``--max-prompt + --max-output`` by default, which no request
reaches; kvretain's side then has none, its default). With ``--max-model-len N`` both sides have N: a prompt of N
tokens or more is refused on both sides (kvretain's admission; on vLLM's side the driver refuses it as vLLM's
input processor would, before its scheduler, which never sees it), a request ends when it holds N tokens (vLLM's
``check_stop``), and the JSON lines add ``refused`` and ``same_refusals_and_lengths`` (the same requests refused,
each finished one as long, on both sides).

Per step both record the scheduled requests and their token counts, the preempted requests, and each
admission's prefix hit (``num_computed_tokens`` when a waiting or preempted request is scheduled). The
report gives the first divergent step with both sides' records around it, and per queue policy a JSON line
``{"steps", "identical_steps", "first_divergence", "hit_tokens_vs_vllm", "preemptions_vs_vllm", ...}``
(``hit_tokens``: prefix-hit tokens over all admissions, resumes included). With ``--queue both`` the last
line sums both runs (steps, identical steps, hit tokens and preemptions of each side; the earliest first
divergence) and holds each run's line under ``by_queue``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _vllm_harness as harness
from kvretain.cli_args import Parser, RawDefaultsHelpFormatter, fail, integer, missing_module
from kvretain.sched.config import pool_too_small

PROG = "sched_equivalence"

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


@dataclass(frozen=True)
class Spec:
    """One request of the sequence, replayed afresh on each side."""

    rid: str
    prompt: list[int]
    max_tokens: int
    priority: int
    arrival_s: float
    arrival_step: int
    mid_step: bool = False  # added between the step's schedule() and update_from_output, not before
    abort_step: int | None = None  # aborted at the start of this step, if still live


def load_workload(path: Path, limit: int, step_ms: float, max_prompt: int, max_output: int) -> list[Spec]:
    from kvretain.workloads import PRIORITY_RULES, load_mooncake, tag_priorities

    reqs = tag_priorities(load_mooncake(path, limit=limit), PRIORITY_RULES.create("reference"))
    chunk_tokens: dict[Any, tuple[int, ...]] = {}  # one materialization per chunk (the int objects shared)
    out = []
    for r in reqs:
        toks: list[int] = []
        for c in r.prompt.chunks:
            if len(toks) >= max_prompt:
                break
            m = chunk_tokens.get(c)
            if m is None:
                m = chunk_tokens[c] = tuple(c.materialize())
            toks.extend(m)
        del toks[max_prompt:]
        out.append(
            Spec(
                rid=r.request_id,
                prompt=toks,
                max_tokens=max(1, min(r.output_len, max_output)),
                priority=r.priority,
                arrival_s=r.arrival_s,
                arrival_step=int(r.arrival_s * 1000.0 / step_ms),
            )
        )
    return out


@dataclass
class StepRecord:
    """What one ``schedule()`` decided."""

    step: int  # trace step (arrival clock)
    scheduled: dict[str, int]  # request id -> tokens scheduled
    preempted: list[str]  # sorted
    admitted: dict[str, int]  # request id -> prefix-hit tokens at its (re)admission

    def key(self) -> tuple[Any, ...]:
        return (self.step, sorted(self.scheduled.items()), self.preempted, sorted(self.admitted.items()))


@dataclass
class Trace:
    name: str
    records: list[StepRecord] = field(default_factory=list)
    first_hits: dict[str, int] = field(default_factory=dict)  # first admission's hit per request
    wall_s: float = 0.0
    refused: list[str] = field(
        default_factory=list
    )  # requests refused on arrival (a prompt over max_model_len)
    lengths: dict[str, int] = field(
        default_factory=dict
    )  # tokens (prompt and output) of each finished request

    @property
    def hit_tokens(self) -> int:
        return sum(sum(r.admitted.values()) for r in self.records)

    @property
    def first_hit_tokens(self) -> int:
        return sum(self.first_hits.values())

    @property
    def preemptions(self) -> int:
        return sum(len(r.preempted) for r in self.records)


class Clock:
    """Trace time of the current step (seconds), shared by the scheduler and the cache of a side."""

    def __init__(self, step_ms: float) -> None:
        self.step_s = step_ms / 1000.0
        self.t = 0.0

    def set_step(self, step: int) -> None:
        self.t = step * self.step_s

    def __call__(self) -> float:
        return self.t


def kvretain_max_model_len(args: argparse.Namespace) -> int | None:
    """kvretain's ``max_model_len``: vLLM's (``args.max_model_len``) when the namespace's ``limit_model_len`` is
    True (``--max-model-len``, or a test), else None (kvretain's default; vLLM's side keeps its own)."""
    return args.max_model_len if getattr(args, "limit_model_len", False) else None


def drive(
    name: str,
    specs: list[Spec],
    clock: Clock,
    add: Callable[[Spec], None],
    has_unfinished: Callable[[], bool],
    one_step: Callable[[int, Callable[[], None]], StepRecord],
    max_steps: int,
    abort: Callable[[str], None] | None = None,
    trace: Trace | None = None,
) -> Trace:
    """The loop both sides share: the step's aborts (``Spec.abort_step``), its arrivals, then one engine step
    (``one_step(step, mid)`` calls ``mid`` between ``schedule()`` and ``update_from_output``: the arrivals
    marked ``Spec.mid_step`` are added there). ``trace``: the trace to fill (the sides' ``add`` and
    ``one_step`` record in it the requests refused and the lengths of those that finish)."""
    tr = Trace(name) if trace is None else trace
    t0 = time.perf_counter()
    aborts: dict[int, list[str]] = {}
    for s in specs:
        if s.abort_step is not None:
            aborts.setdefault(s.abort_step, []).append(s.rid)
    added: set[str] = set()
    pos = 0
    step = 0
    while pos < len(specs) or has_unfinished():
        if not has_unfinished() and pos < len(specs):
            step = max(step, specs[pos].arrival_step)  # idle: jump to the next arrival
        clock.set_step(step)
        if abort is not None:
            for rid in aborts.get(step, ()):
                if rid in added:
                    abort(rid)
        mid: list[Spec] = []
        while pos < len(specs) and specs[pos].arrival_step <= step:
            if specs[pos].mid_step:
                mid.append(specs[pos])
            else:
                add(specs[pos])
            added.add(specs[pos].rid)
            pos += 1

        def add_mid(mid: list[Spec] = mid) -> None:
            for s in mid:
                add(s)

        rec = one_step(step, add_mid)
        tr.records.append(rec)
        for rid, hit in rec.admitted.items():
            tr.first_hits.setdefault(rid, hit)
        step += 1
        if len(tr.records) > max_steps:
            raise SystemExit(f"{name}: no end after {max_steps} steps (a request that never fits?)")
    tr.wall_s = time.perf_counter() - t0
    return tr


def run_kvretain(specs: list[Spec], args: argparse.Namespace, queue: str) -> Trace:
    from kvretain.core.kv_cache_manager import KVCacheManager
    from kvretain.sched.config import SchedulerConfig
    from kvretain.sched.output import RunnerOutput
    from kvretain.sched.request import Request
    from kvretain.sched.scheduler import Scheduler

    clock = Clock(args.step_ms)
    kv = KVCacheManager(
        args.pool_blocks - 1,  # vLLM's pool keeps one block as its null block
        args.block_size,
        policy=args.policy,
        config=plugin_config(args).policy_config(args.block_size),
        clock=clock,
        enable_caching=getattr(args, "enable_caching", True),
    )
    sched = Scheduler(
        kv,
        SchedulerConfig(
            policy=queue,
            max_num_batched_tokens=args.max_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_chunked_prefill=chunked_prefill(args),
            reserve_full_prompt=getattr(args, "reserve_full_prompt", True),
            max_model_len=kvretain_max_model_len(args),
        ),
        clock=clock,
    )
    tr = Trace("kvretain")

    def add(s: Spec) -> None:
        if not sched.add_request(Request(s.rid, s.prompt, s.max_tokens, s.arrival_s, s.priority)):
            tr.refused.append(s.rid)

    def one_step(step: int, mid: Callable[[], None]) -> StepRecord:
        before = {r.request_id for r in sched.running}
        out = sched.schedule()
        mid()
        sampled = [c.request_id for c in out.chunks if c.samples]
        done = sched.update_from_output(
            out, RunnerOutput(tuple(sampled), (harness.SAMPLED_TOKEN,) * len(sampled))
        )
        tr.lengths.update((r.request_id, r.num_tokens) for r in done)
        return StepRecord(
            step,
            {c.request_id: c.num_new_tokens for c in out.chunks},
            sorted(out.preempted),
            {c.request_id: c.num_computed_tokens for c in out.chunks if c.request_id not in before},
        )

    def abort(rid: str) -> None:
        sched.abort(rid)

    return drive("kvretain", specs, clock, add, sched.has_unfinished, one_step, args.max_steps, abort, tr)


def run_vllm(specs: list[Spec], args: argparse.Namespace, queue: str, model_dir: str) -> Trace:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    import kvretain.integrations.vllm as plugin

    engine: dict[str, Any] = {
        "num_blocks": args.pool_blocks,
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_batched_tokens": args.max_batched_tokens,
        "max_model_len": args.max_model_len,
        "policy": queue,
        "enable_chunked_prefill": chunked_prefill(args),
        "reserve_full_isl": getattr(args, "reserve_full_prompt", True),
        "enable_prefix_caching": getattr(args, "enable_caching", True),
    }
    # (the harness builds the scheduler directly, past vLLM's start-up checks: an engine vLLM would not start,
    # a KV cache too small for one request of max_model_len, would be compared all the same)
    refusal = harness.start_up_refusal(model_dir, **engine)
    if refusal is not None:
        raise ValueError(f"vLLM 0.33 refuses to start this engine: {refusal}")
    clock = Clock(args.step_ms)
    if args.policy != "lru":
        plugin.set_clock(clock)
        plugin.enable(plugin_config(args))
    try:
        sched = harness.build_scheduler(model_dir, **engine)
        hasher = harness.block_hasher(args.block_size)
        queue_cls = type(sched.kv_cache_manager.block_pool.free_block_queue).__name__
        if (queue_cls == "FreeKVCacheBlockQueue") != (args.policy == "lru"):
            raise SystemExit(f"vLLM's free queue is {queue_cls}: the plugin is not (or wrongly) installed")

        tr = Trace("vllm")

        def add(s: Spec) -> None:
            if len(s.prompt) >= args.max_model_len:
                # vLLM's front end refuses it (its input processor's prompt length check: a prompt of
                # max_model_len tokens or more leaves no room for an output token); its scheduler, which does
                # not check, never sees it. A max_tokens beyond max_model_len - prompt is not clamped here (the
                # API server would): check_stop ends the request at max_model_len tokens all the same.
                tr.refused.append(s.rid)
                return
            harness.add_request(
                sched,
                Request(
                    request_id=s.rid,
                    prompt_token_ids=list(s.prompt),
                    sampling_params=SamplingParams(max_tokens=s.max_tokens, ignore_eos=True),
                    pooling_params=None,
                    arrival_time=s.arrival_s,
                    priority=s.priority,
                    block_hasher=hasher,
                ),
            )

        def one_step(step: int, mid: Callable[[], None]) -> StepRecord:
            before = {r.request_id for r in sched.running}
            out = sched.schedule()
            reqs = sched.requests
            n_sched = dict(out.num_scheduled_tokens)
            # num_computed_tokens already counts this step's tokens (vLLM advances it in schedule())
            admitted = {
                rid: reqs[rid].num_computed_tokens - n for rid, n in n_sched.items() if rid not in before
            }
            mid()
            live = {rid: reqs[rid] for rid in n_sched}  # (finished requests leave sched.requests)
            sched.update_from_output(out, harness.runner_output(sched, out))
            tr.lengths.update((rid, q.num_tokens) for rid, q in live.items() if q.is_finished())
            return StepRecord(step, n_sched, sorted(out.preempted_req_ids or ()), admitted)

        def abort(rid: str) -> None:
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

        tr = drive(
            "vllm", specs, clock, add, sched.has_unfinished_requests, one_step, args.max_steps, abort, tr
        )
        tr.name = f"vllm ({queue_cls})"
        return tr
    finally:
        if args.policy != "lru":
            plugin.disable()
            plugin.set_clock(None)


def chunked_prefill(args: argparse.Namespace) -> bool:
    """Whether both sides chunk prefills: the namespace's ``chunked_prefill``, True without it (the command
    line always chunks; ``tests/test_sched_equivalence.py`` turns it off, and ``reserve_full_prompt`` and
    ``enable_caching`` likewise)."""
    return bool(getattr(args, "chunked_prefill", True))


def plugin_config(args: argparse.Namespace) -> Any:
    """The plugin's configuration for ``--policy``; kvretain's side takes its ``PolicyConfig`` too."""
    from kvretain.integrations.vllm.config import PluginConfig

    return PluginConfig(policy=args.policy, granularity=args.granularity)


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else (1.0 if a == b else None)


def _fmt(rec: StepRecord | None) -> str:
    if rec is None:
        return "(no such step: this side had finished)"
    sched = ", ".join(f"{rid}:{n}" for rid, n in rec.scheduled.items())
    adm = ", ".join(f"{rid}:{n}" for rid, n in rec.admitted.items())
    return (
        f"trace step {rec.step}; scheduled {len(rec.scheduled)} [{sched}]; preempted {rec.preempted}; "
        f"admitted (hit tokens) [{adm}]"
    )


def compare(k: Trace, v: Trace) -> dict[str, Any]:
    n = max(len(k.records), len(v.records))
    identical = 0
    first: int | None = None
    for i in range(n):
        a = k.records[i] if i < len(k.records) else None
        b = v.records[i] if i < len(v.records) else None
        if a is not None and b is not None and a.key() == b.key():
            identical += 1
        elif first is None:
            first = i
    if first is not None:
        print(f"  first divergence at step {first}:")
        for j in range(max(0, first - 1), first + 1):
            a = k.records[j] if j < len(k.records) else None
            b = v.records[j] if j < len(v.records) else None
            print(f"    step {j} kvretain: {_fmt(a)}")
            print(f"    step {j} vLLM    : {_fmt(b)}")
        a = k.records[first] if first < len(k.records) else None
        b = v.records[first] if first < len(v.records) else None
        if a is not None and b is not None:
            only_k = sorted(set(a.scheduled.items()) - set(b.scheduled.items()))
            only_v = sorted(set(b.scheduled.items()) - set(a.scheduled.items()))
            print(f"    scheduled only by kvretain: {only_k}; only by vLLM: {only_v}")
            hit_k = sorted(set(a.admitted.items()) - set(b.admitted.items()))
            hit_v = sorted(set(b.admitted.items()) - set(a.admitted.items()))
            print(f"    admissions differing: kvretain {hit_k}; vLLM {hit_v}")
    per_req = [rid for rid in v.first_hits if k.first_hits.get(rid) != v.first_hits[rid]]
    return {
        "steps": n,
        "identical_steps": identical,
        "first_divergence": first,
        "hit_tokens_vs_vllm": ratio(k.hit_tokens, v.hit_tokens),
        "preemptions_vs_vllm": ratio(k.preemptions, v.preemptions),
        "first_hit_tokens_vs_vllm": ratio(k.first_hit_tokens, v.first_hit_tokens),
        "requests_first_hit_differs": len(per_req),
        "kvretain": {"steps": len(k.records), "hit_tokens": k.hit_tokens, "preemptions": k.preemptions},
        "vllm": {"steps": len(v.records), "hit_tokens": v.hit_tokens, "preemptions": v.preemptions},
    }


def build_parser() -> Parser:
    """The command line (``--help``: the whole docstring, then every option with its default)."""
    ap = Parser(prog=PROG, description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="a Mooncake-format JSONL trace (default: ../shared/traces/mooncake_conversation.jsonl)",
    )
    ap.add_argument(
        "--requests", type=integer(1), default=1000, help="the trace's first N requests are replayed, >= 1"
    )
    ap.add_argument(
        "--policy", default="lru", choices=["lru", "unified"], help="eviction policy of both sides"
    )
    ap.add_argument(
        "--granularity",
        default="run",
        choices=["run", "block"],
        help="with --policy unified: what the plugin ranks inside vLLM (KVRETAIN_GRANULARITY), runs or single blocks",
    )
    ap.add_argument(
        "--queue",
        default="both",
        choices=["fcfs", "priority", "both"],
        help="scheduling queue policy of both sides (both: one run each)",
    )
    harness.add_engine_options(
        ap, pool_blocks=2048, max_num_seqs=32, max_batched_tokens=2048, step_ms=250.0, max_output=64
    )
    ap.add_argument(
        "--max-prompt", type=integer(1), default=16384, help="prompt tokens kept per request, >= 1"
    )
    ap.add_argument(
        "--max-model-len",
        type=integer(1),
        default=None,
        metavar="N",
        help="max_model_len of both sides, >= 1, at most what the pool holds: a prompt of N tokens or more is "
        "refused, a request ends holding N tokens (default: none for kvretain, its default; vLLM's side "
        "--max-prompt + --max-output, which no request reaches)",
    )
    ap.add_argument(
        "--max-steps",
        type=integer(1),
        default=200_000,
        help="scheduler steps after which a side that has not finished is an error, >= 1",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    from kvretain.workloads.mooncake import TraceError

    args = build_parser().parse_args(argv)
    refusal = harness.engine_options_error(args)
    if refusal is not None:
        return fail(PROG, refusal)
    args.limit_model_len = args.max_model_len is not None
    usable = args.pool_blocks - 1  # (vLLM's pool keeps one block as its null block)
    pool = "the pool (less vLLM's null block)"
    if (
        args.limit_model_len
    ):  # (vLLM's engine refuses to start with a KV cache that cannot hold max_model_len)
        reason = pool_too_small(args.max_model_len, usable, args.block_size, pool)
        if reason is not None:
            return fail(PROG, f"argument --max-model-len: {reason}")
    else:
        args.max_model_len = args.max_prompt + args.max_output
        reason = pool_too_small(args.max_model_len, usable, args.block_size, pool)
        if reason is not None:
            return fail(
                PROG,
                f"argument --max-prompt/--max-output: --max-prompt + --max-output ({args.max_model_len:,}): {reason}",
            )
    os.environ.pop("KVRETAIN_POLICY", None)

    try:  # (the trace parser's message names a missing file, a folder, the file's line and field)
        specs = load_workload(args.trace, args.requests, args.step_ms, args.max_prompt, args.max_output)
    except TraceError as exc:
        return fail(PROG, f"argument --trace: {exc}")
    # before the kvretain side runs: without vLLM its run would end in a traceback at the vLLM side
    missing = missing_module(["torch", "vllm"], "the vLLM side")
    if missing:
        return fail(PROG, missing)
    if args.limit_model_len:
        refused = sum(len(s.prompt) >= args.max_model_len for s in specs)
        cut = sum(len(s.prompt) + s.max_tokens > args.max_model_len > len(s.prompt) for s in specs)
        print(
            f"max_model_len {args.max_model_len} on both sides: {refused} prompts refused, {cut} outputs cut"
        )
    print(
        f"{len(specs)} requests of {args.trace.name} (class 0: {sum(s.priority == 0 for s in specs)}), "
        f"{sum(len(s.prompt) for s in specs):,} prompt tokens; policy {args.policy}"
        f"{' (plugin granularity ' + args.granularity + ')' if args.policy == 'unified' else ''}, "
        f"block size {args.block_size}, pool {args.pool_blocks} blocks, max_num_seqs {args.max_num_seqs}, "
        f"{args.max_batched_tokens} tokens/step, {args.step_ms:g} ms of trace per step"
    )
    model_dir = harness.temp_tiny_model(max_len=args.max_model_len)
    queues = ["fcfs", "priority"] if args.queue == "both" else [args.queue]
    results: dict[str, Any] = {}
    for q in queues:
        k = run_kvretain(specs, args, q)
        v = run_vllm(specs, args, q, model_dir)
        print(
            f"{q}: kvretain {len(k.records)} steps ({k.wall_s:.1f} s), {v.name} {len(v.records)} steps "
            f"({v.wall_s:.1f} s)"
        )
        res = compare(k, v)
        res.update(policy=args.policy, queue=q, requests=len(specs))
        if args.limit_model_len:  # (the same requests refused, and each finished one as long, on both sides)
            res.update(
                refused=len(v.refused),
                same_refusals_and_lengths=(k.refused, k.lengths) == (v.refused, v.lengths),
            )
        print(json.dumps(res))
        results[q] = res
    if len(queues) == 1:
        print(json.dumps(results[queues[0]]))
        return 0
    firsts = [r["first_divergence"] for r in results.values() if r["first_divergence"] is not None]
    tot = {
        side: {key: sum(r[side][key] for r in results.values()) for key in ("hit_tokens", "preemptions")}
        for side in ("kvretain", "vllm")
    }
    print(
        json.dumps(
            {
                "steps": sum(r["steps"] for r in results.values()),
                "identical_steps": sum(r["identical_steps"] for r in results.values()),
                "first_divergence": min(firsts) if firsts else None,
                "hit_tokens_vs_vllm": ratio(tot["kvretain"]["hit_tokens"], tot["vllm"]["hit_tokens"]),
                "preemptions_vs_vllm": ratio(tot["kvretain"]["preemptions"], tot["vllm"]["preemptions"]),
                "policy": args.policy,
                "by_queue": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
