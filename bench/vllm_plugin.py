"""Stock vLLM 0.33 against vLLM with the kvretain plugin, on the Mooncake conversation trace.

Replays the first N requests (default 2,000) through vLLM's real v1 ``Scheduler`` and ``KVCacheManager`` on
CPU with a fake model runner (one sampled token per request whose prefill completes in the step or that is
decoding), stock and with the plugin enabled (``unified``, default options), and prints per-class prefix hit
tokens, preemptions and the scheduler's time per step. The last line is JSON.

Workload: the trace read by ``kvretain.workloads.mooncake.read_trace``, priorities by the ``reference`` rule
of ``kvretain.workloads.priority`` (0 when ``hash_ids[1] % 4 == 0``, ``hash_ids[0]`` for one-block requests,
else 1); every trace hash id stands for 512 deterministic tokens (``SeededChunk(hash_id, 512)``,
truncated to the request's ``input_length``), so requests sharing hash ids share exactly those tokens and
vLLM's own block hashing finds the reuse. Arrivals follow the trace timestamps, ``--step-ms`` of trace time
per scheduler step. The KV cache holds ``--pool-blocks`` blocks of ``--block-size`` tokens.

Step time: what one engine step costs the scheduler, i.e. ``Scheduler.schedule()`` plus
``Scheduler.update_from_output()`` (KV cache allocation, prefix-cache lookups and eviction, caching of full
blocks, freeing of finished requests); building requests (tokens, block hashes) and the fake runner are
outside the timed region. It is measured as *process CPU time* (``time.process_time_ns``, so time the shared
machine gives to other jobs does not count; wall time is reported too) and averaged over all steps of a run.
Every run is a fresh process (the first replay in a process runs faster than later ones, on a fresh heap), on a
freshly built scheduler whose startup heap is frozen for the garbage collector as vLLM's ``EngineCore`` does
(``gc.freeze()`` after start-up).

Pairing (default: lockstep): the stock and the plugin process of a repeat take turns, ``--turn-steps`` (64)
scheduler steps a turn (each waits for the parent's go; the two alternate which goes first), so both are timed
through the same seconds of the shared host, and ``step_time_vs_stock`` is the median over the ``--repeats``
pairs of the plugin's mean step over stock's. Why: separate runs a few seconds apart (``--sequential``: stock,
plugin, plugin, stock, ..., the fastest run of each compared) moved the ratio of the same code from 1.06x to
1.58x as the host's speed changed between runs (docs/history.md); in lockstep the pairs of one invocation
agree to a few percent. A turn of 64 steps (~40-80 ms) is short against the host's changes of speed (seconds)
and long enough that the one step of each turn that starts on caches the other process used is ~2% of the
steps; ``--turn-steps 1`` times every step on such caches (as on a CPU backend, where the model's forward pass
runs on the same cores between two scheduler steps).
Hit tokens and step counts are deterministic and must agree across repeats (and across pairings).

Input processing (``input processing ... us a step`` in each run's line; ``stock_input_us_per_step``,
``plugin_input_us_per_step``): what vLLM's ``EngineCore.preprocess_add_request`` does for each request before
the scheduler sees it, timed apart from the step: building the ``Request`` with its block hashes and, with the
plugin, its arrival hook (the protection controller's shadows see the request's blocks there; vLLM runs this
on its input thread, alongside the model's forward pass when the engine core runs in its own process). The work
the plugin moved there still costs CPU: ``step_plus_input_vs_stock`` sets the whole cost per step, step plus
input processing, beside the step alone.

``--stock-arrival-work``: the stock run also does the plugin's arrival work (a protection controller of the
plugin's configuration sees every request, its results discarded; stock's decisions and its step code are
untouched). The ratio then says what the plugin's own step code costs, apart from what that work between two
steps does to the step after it in this single-threaded harness (session 14, five pairs in two invocations:
1.085-1.173x, median 1.14x, against 1.15-1.21x, median 1.20x, without it; the plugin without its controller
1.10-1.15x).

``--hook-times``: one more plugin run, after the timed ones, with a process-CPU-time counter around each
method of the plugin's free queue that vLLM's ``BlockPool`` or the plugin's patches call in a step (``HOOKS``:
the arrival hook at input processing (not in the step), the release at ``free``, the lookup at admission (with
the policy's part where the admission's first eviction gives it, inside the pop), the protection controller
inside the arrival and lookup hooks, the queue's pops,
appends and removals, the caching hook, the strip of evicted hashes), and around the controller's parts
(its spatial sample, its LRU shadows, the frequency candidate's GreedyDual shadow): where
the plugin's time per step goes. Not counted: the patches' own wrapper code around vLLM's methods and the queue's small helpers they call
(``put_unhashed``, ``drain``). The counted run must replay exactly what the timed runs did. The counters cost
time themselves, so that run's step time is not compared with stock's; its breakdown is printed and in the
JSON (``hook_us_per_step``).

    .venv-vllm/bin/python bench/vllm_plugin.py [--trace ../shared/traces/mooncake_conversation.jsonl]
        [--block-size 16 --pool-blocks 65536 | --block-size 256 --pool-blocks 4096] [--repeats 3] [--hook-times]
        [--sequential | --turn-steps 64]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _vllm_harness as harness
from _timing import time_calls
from kvretain.cli_args import Parser, RawDefaultsHelpFormatter, fail, integer, missing_module

PROG = "vllm_plugin"

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parent.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
TRACE_BLOCK = 512
"""Tokens per trace hash id (``MOONCAKE_BLOCK_TOKENS``)."""
ARRIVAL = "arrival (input processing, not in the step)"
CONTROLLER = "of arrival and lookup: the protection controller"
HOOKS = (
    (ARRIVAL, "on_arrival"),
    ("release", "on_request_release"),
    (
        "release",
        "free_request",
    ),  # (the run queue's release fused with vLLM's free: reference counts included)
    ("lookup", "on_lookup"),
    ("pop (eviction)", "popleft_n"),
    ("append", "append_n"),
    ("remove (hit on a free block)", "remove"),
    ("caching", "on_blocks_cached"),
    ("strip (evict_blocks)", "forget"),
)
"""``--hook-times``: (label, method of the plugin's free queue). Not ``popleft``: it calls ``popleft_n`` (and
vLLM calls it only before the plugin's queue is installed). The release is ``free_request`` where the run queue
frees a request in one pass with vLLM's ``free_blocks`` (then it includes that work: stock's free loop is not
counted anywhere), ``on_request_release`` elsewhere."""


@dataclass
class TraceRequest:
    rid: str
    arrival_step: int
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int
    priority: int
    extra_args: dict[str, Any] | None = None
    """The trace line's retention as the request's ``vllm_xargs`` (None: it asks none)."""


def load_trace(
    path: Path, limit: int, step_ms: float, max_output: int, priority_rule: str = "reference"
) -> list[TraceRequest]:
    """The first ``limit`` requests, read by the project's one trace parser and tagged by ``priority_rule``
    (``keep``: the trace's own priorities), each with its line's retention (directives, scope, decode priority),
    which both runs send and only the plugin reads."""
    from kvretain.integrations.vllm.config import extra_args_for
    from kvretain.workloads.mooncake import read_trace
    from kvretain.workloads.priority import make_rule, tag_priorities

    records = read_trace(path, TRACE_BLOCK, limit)
    # (a drawing rule draws as `kvretain replay` does at its default seed: the replays beside it are comparable)
    rule = make_rule(priority_rule, records, random.Random(1))
    if rule is not None:
        records = tag_priorities(records, rule)
    # NOTE: read_trace sorts by timestamp (stably), so the requests are in arrival-step order already; the
    # request id is the 0-based line number (vLLM's waiting queue breaks priority and arrival ties on it)
    return [
        TraceRequest(
            rid=f"m{rec.line - 1:05d}",
            arrival_step=int(rec.timestamp_ms / step_ms),
            hash_ids=rec.hash_ids,
            input_length=rec.input_length,
            output_length=max(1, min(rec.output_length, max_output)),
            priority=rec.priority,
            extra_args=extra_args_for(rec.retention),
        )
        for rec in records
    ]


def prompt_tokens(req: TraceRequest) -> list[int]:
    from kvretain.workloads import SeededChunk

    toks: list[int] = []
    for k, hid in enumerate(req.hash_ids):
        n = min(TRACE_BLOCK, req.input_length - TRACE_BLOCK * k)
        if n <= 0:
            break
        toks.extend(SeededChunk(hid, TRACE_BLOCK).materialize()[:n])
    return toks


def build_scheduler(model_dir: str, args: argparse.Namespace) -> Any:
    return harness.build_scheduler(
        model_dir,
        num_blocks=args.pool_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=131072,
    )


@dataclass
class Result:
    name: str
    steps: int = 0
    step_times: list[float] = field(default_factory=list)
    """Process CPU seconds of each step."""
    step_wall: list[float] = field(default_factory=list)
    """Wall seconds of each step."""
    hit_tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    prompt_tokens: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    requests: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    preemptions: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    vllm_queries: int = 0
    vllm_hits: int = 0
    wall_s: float = 0.0
    input_s: float = 0.0
    """Process CPU seconds of input processing, all requests: vLLM's ``Request`` with its block hashes, and the
    plugin's arrival hook (``request_arrived``), as ``EngineCore.preprocess_add_request`` does them."""

    @property
    def mean_step_ms(self) -> float:
        return 1000.0 * statistics.fmean(self.step_times) if self.step_times else 0.0

    @property
    def input_us_per_step(self) -> float:
        """Input processing per scheduler step (to set beside the step time: the whole CPU cost a step)."""
        return 1e6 * self.input_s / self.steps if self.steps else 0.0

    @property
    def mean_step_wall_ms(self) -> float:
        return 1000.0 * statistics.fmean(self.step_wall) if self.step_wall else 0.0

    def outcome(self) -> tuple[Any, ...]:
        """Everything that must not depend on timing (compared across repeats)."""
        return (
            self.steps,
            sorted(self.hit_tokens.items()),
            sorted(self.prompt_tokens.items()),
            sorted(self.preemptions.items()),
            self.vllm_hits,
        )


STEP_DONE = b"d"
REPLAY_DONE = b"e"


class Gate:
    """A lockstep child's turn-taking with the parent, ``steps`` scheduler steps a turn: :meth:`wait` before a
    step reads the parent's go (one byte on ``go``) when a turn starts, :meth:`done` after it writes one byte to
    ``fd`` when the turn ends, :meth:`end` says the replay is over."""

    def __init__(self, go: Any, fd: int, steps: int) -> None:
        self._go = go
        self._fd = fd
        self._steps = max(1, steps)
        self._i = 0

    def wait(self) -> None:
        if self._i % self._steps == 0 and not self._go.read(1):
            raise SystemExit("lockstep: the parent went away")

    def done(self) -> None:
        self._i += 1
        if self._i % self._steps == 0:
            os.write(self._fd, STEP_DONE)

    def end(self) -> None:
        os.write(self._fd, REPLAY_DONE)


def replay(
    name: str, model_dir: str, reqs: list[TraceRequest], args: argparse.Namespace, gate: Gate | None = None
) -> Result:
    from kvretain.integrations.vllm import _runtime

    hasher = harness.block_hasher(args.block_size)
    sched = build_scheduler(model_dir, args)
    res = Result(name)
    # as vLLM's EngineCore after start-up: collect, then keep the startup heap out of later collections
    gc.collect()
    gc.freeze()
    try:
        extra = (
            _arrival_work(args, len(sched.kv_cache_manager.block_pool.blocks))
            if args.stock_arrival_work and name == "stock"
            else None
        )
        # the plugin's clock (retention durations) is the trace's
        clock = [0.0]
        _runtime.set_clock(lambda: clock[0])
        _drive(sched, hasher, res, reqs, gate, args.step_ms, clock, extra)
    finally:
        _runtime.set_clock(None)
        gc.unfreeze()
        if gate is not None:
            gate.end()
    return res


def _arrival_work(args: argparse.Namespace, num_blocks: int) -> Any:
    """``--stock-arrival-work``: the work the plugin does at a request's arrival (its protection controller's
    shadow references, with the plugin's configuration), for a stock run to do and discard: a request ->
    None."""
    from kvretain.core.policies.protection import ProtectionController
    from kvretain.core.retention import PriorityMapping
    from kvretain.integrations.vllm.config import PluginConfig, parse_options

    cfg = PluginConfig(policy=args.policy, options=parse_options(args.options), mapping=PriorityMapping())
    ctl = ProtectionController(num_blocks, cfg.policy_config(args.block_size))
    mapping = cfg.mapping

    def work(request: Any) -> None:
        ctl.on_arrival(request.block_hashes, mapping.retention_for(request.priority), True)

    return work


def _drive(
    sched: Any,
    hasher: Any,
    res: Result,
    reqs: list[TraceRequest],
    gate: Gate | None,
    step_ms: float,
    clock: list[float],
    extra_arrival: Any = None,
) -> None:
    """Replay ``reqs``, ``step_ms`` of trace time a step, kept in ``clock[0]`` (seconds)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvretain.integrations.vllm._patches import request_arrived

    manager = sched.kv_cache_manager
    prio_of = {r.rid: r.priority for r in reqs}
    seen: set[str] = set()
    pending = list(reqs)
    pos = 0
    step = 0
    perf = time.perf_counter
    cpu = time.process_time_ns
    t_start = perf()
    while pos < len(pending) or sched.has_unfinished_requests():
        if gate is not None:
            gate.wait()
        if not sched.has_unfinished_requests() and pos < len(pending):
            step = max(step, pending[pos].arrival_step)  # idle: jump to the next arrival
        clock[0] = step * step_ms / 1000.0
        while pos < len(pending) and pending[pos].arrival_step <= step:
            r = pending[pos]
            pos += 1
            tokens = prompt_tokens(r)
            params = SamplingParams(max_tokens=r.output_length, ignore_eos=True, extra_args=r.extra_args)
            # input processing, as EngineCore.preprocess_add_request (off the scheduler's step: vLLM runs it on
            # its input thread); stock: a no-op hook
            c0 = cpu()
            request = Request(
                request_id=r.rid,
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(r.arrival_step),
                priority=r.priority,
                block_hasher=hasher,
            )
            request_arrived(manager, request)
            if extra_arrival is not None:
                extra_arrival(request)
            res.input_s += (cpu() - c0) * 1e-9
            sched.add_request(request)
        w0 = perf()
        c0 = cpu()
        out = sched.schedule()
        c1 = cpu()
        w1 = perf()
        mro = harness.runner_output(sched, out)
        w2 = perf()
        c2 = cpu()
        outs = sched.update_from_output(out, mro)
        c3 = cpu()
        res.step_times.append((c1 - c0 + c3 - c2) * 1e-9)
        res.step_wall.append(w1 - w0 + perf() - w2)
        for nr in out.scheduled_new_reqs:
            if nr.req_id not in seen:  # first schedule (resumes after preemption are not new lookups)
                seen.add(nr.req_id)
                p = prio_of[nr.req_id]
                res.hit_tokens[p] += nr.num_computed_tokens
                res.prompt_tokens[p] += len(nr.prompt_token_ids or ())
                res.requests[p] += 1
        for rid in out.preempted_req_ids or ():
            res.preemptions[prio_of[rid]] += 1
        for eco in outs.values():
            st = eco.scheduler_stats
            if st is not None and st.prefix_cache_stats is not None:
                res.vllm_queries += st.prefix_cache_stats.queries
                res.vllm_hits += st.prefix_cache_stats.hits
        step += 1
        if gate is not None:
            gate.done()
    res.steps = len(res.step_times)
    res.wall_s = perf() - t_start


def report(res: Result) -> None:
    total_hits = sum(res.hit_tokens.values())
    total_prompt = sum(res.prompt_tokens.values())
    print(
        f"{res.name:>7}: steps {res.steps}, scheduler time per step {res.mean_step_ms:.3f} ms CPU "
        f"(median {1000 * statistics.median(res.step_times):.3f} ms; wall {res.mean_step_wall_ms:.3f} ms), "
        f"run {res.wall_s:.1f} s; input processing {res.input_us_per_step:.1f} us a step "
        f"({1e6 * res.input_s / max(1, sum(res.requests.values())):.0f} us a request)"
    )
    for p in sorted(res.requests):
        print(
            f"         class {p}: {res.requests[p]:5d} requests, prefix hit tokens {res.hit_tokens[p]:>10,} "
            f"of {res.prompt_tokens[p]:>11,} ({res.hit_tokens[p] / max(1, res.prompt_tokens[p]):.4f}), "
            f"preemptions {res.preemptions.get(p, 0)}"
        )
    print(
        f"         all    : hit tokens {total_hits:,} of {total_prompt:,} ({total_hits / max(1, total_prompt):.4f}); "
        f"vLLM PrefixCacheStats hits {res.vllm_hits:,} / queries {res.vllm_queries:,}"
    )


def result_to_json(res: Result, counters: dict[Any, Any]) -> str:
    return json.dumps(
        {
            "name": res.name,
            "steps": res.steps,
            "step_times": res.step_times,
            "step_wall": res.step_wall,
            "hit_tokens": res.hit_tokens,
            "prompt_tokens": res.prompt_tokens,
            "requests": res.requests,
            "preemptions": res.preemptions,
            "vllm_queries": res.vllm_queries,
            "vllm_hits": res.vllm_hits,
            "wall_s": res.wall_s,
            "input_s": res.input_s,
            "counters": counters,
        }
    )


def result_from_json(text: str) -> tuple[Result, dict[str, Any]]:
    d = json.loads(text)
    res = Result(d["name"], steps=d["steps"], step_times=d["step_times"], step_wall=d["step_wall"])
    for key in ("hit_tokens", "prompt_tokens", "requests", "preemptions"):
        getattr(res, key).update({int(k): v for k, v in d[key].items()})
    res.vllm_queries, res.vllm_hits, res.wall_s = d["vllm_queries"], d["vllm_hits"], d["wall_s"]
    res.input_s = d["input_s"]
    return res, d["counters"]


def count_hook_times(totals: dict[str, int]) -> None:
    """Wrap each of ``HOOKS`` on both free-queue classes, the protection controller's lookup and its parts,
    with a process-CPU-time counter adding to ``totals`` (ns, by label). For
    ``--hook-times`` runs only."""
    from kvretain.core.policies import protection, shadow
    from kvretain.integrations.vllm._queue import RetentionFreeQueue
    from kvretain.integrations.vllm._runs import RunFreeQueue

    clock = time.process_time_ns

    def wrap(cls: Any, name: str, label: str) -> None:
        if getattr(cls, name, None) is not None:
            time_calls(cls, name, totals, label, clock)

    for cls in (RunFreeQueue, RetentionFreeQueue):
        for label, name in HOOKS:
            wrap(cls, name, label)
        _count_early_lookup(cls, totals, clock)
    # the controller works at a request's arrival (its shadows) and at its lookup (the control law); its parts
    # are counted wherever they run
    for name in ("on_arrival", "on_lookup"):
        wrap(protection.ProtectionController, name, CONTROLLER)
    # the LRU shadows: all traffic, protected traffic, the recency candidate; the GreedyDual one: the frequency
    # candidate
    for owner, name, label in (
        (protection, "spatial_sample", "controller: spatial sample"),
        (protection, "spatial_mask", "controller: spatial sample"),
        (shadow.LRUShadow, "reference", "controller: LRU shadows"),
        (shadow.GDShadow, "reference", "controller: GreedyDual shadow"),
    ):
        wrap(owner, name, label)


def _count_early_lookup(cls: Any, totals: dict[str, int], clock: Callable[[], int]) -> None:
    """An admission's lookup given to the policy at its first eviction (``feed_pending``, inside ``popleft_n``)
    is the lookup hook's work: counted under ``lookup``, and taken out of the pop's."""
    inner = cls.feed_pending

    def feed_pending(self: Any) -> None:
        t0 = clock()
        try:
            inner(self)
        finally:
            dt = clock() - t0
            totals["lookup"] += dt
            totals["pop (eviction)"] -= dt

    cls.feed_pending = feed_pending


def run_child(args: argparse.Namespace) -> None:
    """One replay (``--child stock|plugin``) in this fresh process; the result is the last stdout line."""
    import kvretain.integrations.vllm as plugin
    from kvretain.core.retention import PriorityMapping
    from kvretain.integrations.vllm.config import PluginConfig, parse_options

    reqs = load_trace(args.trace, args.requests, args.step_ms, args.max_output, args.priority_rule)
    model_dir = harness.temp_tiny_model()
    build_scheduler(model_dir, args)  # warm-up: vLLM inspects the model architecture once per process
    counters: dict[Any, Any] = {}
    hooks: dict[str, int] = {}
    if args.child == "plugin":
        if args.hook_times:
            count_hook_times(hooks)
        cfg = PluginConfig(
            policy=args.policy,
            options=parse_options(args.options),
            mapping=PriorityMapping(),
            granularity=args.granularity,
        )
        plugin.reset_stats()
        plugin.enable(cfg)
    gate = Gate(sys.stdin.buffer, args.gate_fd, args.turn_steps) if args.gate_fd is not None else None
    try:
        res = replay(args.child, model_dir, reqs, args, gate)
    finally:
        if args.child == "plugin":
            plugin.disable()
            counters = plugin.stats()["by_priority"]
    if args.hook_times:
        counters = {
            **counters,
            "hook_us_per_step": {k: v / 1000 / max(1, res.steps) for k, v in hooks.items()},
        }
    print(result_to_json(res, counters))


def child_command(argv: list[str], name: str, *extra: str) -> list[str]:
    """The command line of a ``--child name`` replay with the parent's ``argv`` and ``extra``."""
    return [sys.executable, __file__, *argv, *extra, "--child", name]


def child_result(stdout: str) -> tuple[Result, dict[str, Any]]:
    """A child's result and plugin counters: the last line of its output."""
    return result_from_json(stdout.strip().splitlines()[-1])


def run_child_process(argv: list[str], name: str, *extra: str) -> tuple[Result, dict[str, Any]]:
    """``--child name`` (with ``argv`` and ``extra``) in a fresh process: its result and plugin counters."""
    cmd = child_command(argv, name, *extra)
    return child_result(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def run_lockstep(argv: list[str]) -> dict[str, tuple[Result, dict[str, Any]]]:
    """Stock and plugin replays in two fresh processes that take turns of ``--turn-steps`` scheduler steps: each
    waits for the parent's go before a turn and reports after it, the two alternating which goes first. Both run
    through the same seconds of the host's time, so a change of the shared machine's speed reaches both alike."""
    names = ("stock", "plugin")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    done_r: dict[str, int] = {}
    errs: dict[str, Any] = {}
    # (output to files, not pipes: a child must never block on a full pipe while the other one has its turn)
    outs: dict[str, Any] = {}
    out: dict[str, tuple[Result, dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        for name in names:
            r, w = os.pipe()
            stack.callback(os.close, r)
            done_r[name] = r
            errs[name] = stack.enter_context(tempfile.TemporaryFile())
            outs[name] = stack.enter_context(tempfile.TemporaryFile())
            procs[name] = subprocess.Popen(
                child_command(argv, name, "--gate-fd", str(w)),
                stdin=subprocess.PIPE,
                bufsize=0,  # (the go byte is written through, never left in a buffer)
                stdout=outs[name],
                stderr=errs[name],
                pass_fds=(w,),
            )
            stack.callback(lambda p=procs[name]: p.poll() is None and p.kill())
            os.close(w)
        active = list(names)
        turn = 0
        while active:
            for name in active if turn % 2 == 0 else active[::-1]:
                p = procs[name]
                assert p.stdin is not None
                with contextlib.suppress(BrokenPipeError):  # (it has ended: its end byte or EOF follows)
                    p.stdin.write(b"g")
                msg = os.read(done_r[name], 1)
                if msg != STEP_DONE:  # the replay is over (REPLAY_DONE), or the child died (EOF)
                    with contextlib.suppress(BrokenPipeError):
                        p.stdin.close()
                    p.wait()
                    if p.returncode:
                        errs[name].seek(0)
                        sys.stderr.write(errs[name].read().decode(errors="replace")[-4000:])
                        sys.exit(f"lockstep: the {name} replay failed (exit {p.returncode})")
                    outs[name].seek(0)
                    out[name] = child_result(outs[name].read().decode())
                    active.remove(name)
            turn += 1
    return out


def build_parser() -> Parser:
    """The command line (``--help``: the whole docstring, then every option with its default)."""
    from kvretain.workloads.priority import rule_choices

    ap = Parser(prog=PROG, description=__doc__, formatter_class=RawDefaultsHelpFormatter, allow_abbrev=False)
    ap.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="a Mooncake-format JSONL trace (default: ../shared/traces/mooncake_conversation.jsonl)",
    )
    ap.add_argument(
        "--requests", type=integer(1), default=2000, help="the trace's first N requests are replayed, >= 1"
    )

    ap.add_argument(
        "--priority-rule",
        default="reference",
        choices=rule_choices(),
        help="how requests get their priority: a rule of kvretain.workloads.priority, or keep (the trace's own, "
        "e.g. a `kvretain workload export` file's; default: reference)",
    )
    harness.add_engine_options(
        ap, pool_blocks=65536, max_num_seqs=64, max_batched_tokens=8192, step_ms=100.0, max_output=32
    )
    ap.add_argument(
        "--options",
        default="",
        help="KVRETAIN_POLICY_OPTIONS for the plugin run (default: none, the defaults)",
    )
    ap.add_argument("--policy", default="unified", help="the plugin run's eviction policy (KVRETAIN_POLICY)")
    ap.add_argument(
        "--granularity",
        default="run",
        choices=["run", "block"],
        help="what unified ranks inside vLLM (KVRETAIN_GRANULARITY): runs (default) or single blocks",
    )
    ap.add_argument(
        "--repeats",
        type=integer(1),
        default=3,
        help="pairs of runs (lockstep: the median pair counts; --sequential: interleaved, the fastest of each)",
    )
    ap.add_argument(
        "--hook-times",
        action="store_true",
        help="one more plugin run with a CPU-time counter on each plugin hook: where its time per step goes",
    )
    ap.add_argument(
        "--stock-arrival-work",
        action="store_true",
        help="stock also does the plugin's arrival work (its controller's shadows), results discarded: what the "
        "plugin's step code costs, apart from what that work between steps does to the next step",
    )
    ap.add_argument(
        "--sequential",
        action="store_true",
        help="time stock and plugin in separate runs one after the other (default: in lockstep, taking turns)",
    )
    ap.add_argument(
        "--turn-steps",
        type=integer(1),
        default=64,
        help="lockstep: scheduler steps a process runs before the other takes its turn, >= 1 (default 64)",
    )
    ap.add_argument("--child", choices=["stock", "plugin"], help=argparse.SUPPRESS)
    ap.add_argument("--gate-fd", type=int, help=argparse.SUPPRESS)
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()

    os.environ.pop("KVRETAIN_POLICY", None)
    if args.child:
        run_child(args)
        return

    from kvretain.core.retention import PriorityMapping
    from kvretain.integrations.vllm.config import PluginConfig, PluginConfigError, parse_options
    from kvretain.workloads.mooncake import TraceError

    # checked here, before any child starts (a child's traceback came after the stock run)
    refusal = harness.engine_options_error(args)
    if refusal is not None:
        raise SystemExit(fail(PROG, refusal))
    try:
        options = parse_options(args.options)
    except PluginConfigError as e:
        ap.error(f"argument --options: {e}")
    try:  # the policy, and the options against it (frequency_cap at run granularity)
        PluginConfig(args.policy, options, PriorityMapping(), args.granularity)
    except PluginConfigError as e:
        ap.error(f"argument --policy/--options: {e}")
    try:
        reqs = load_trace(args.trace, args.requests, args.step_ms, args.max_output, args.priority_rule)
    except TraceError as e:  # the parser's message names a missing file, a folder, the line and field
        raise SystemExit(fail(PROG, f"argument --trace: {e}")) from None
    missing = missing_module(["torch", "vllm"], "each run")
    if missing:
        raise SystemExit(fail(PROG, missing))
    print(
        f"{len(reqs)} requests of {args.trace.name} (class 0: {sum(r.priority == 0 for r in reqs)}), "
        f"block size {args.block_size}, pool {args.pool_blocks} blocks "
        f"({args.pool_blocks * args.block_size / TRACE_BLOCK:.0f} trace blocks), max_num_seqs {args.max_num_seqs}, "
        f"{args.max_batched_tokens} tokens/step, {args.step_ms:g} ms of trace per step, output <= {args.max_output}"
    )
    # NOTE: every run in a fresh process: the first replay in a process ran 4-9% faster than later ones (a fresh
    # heap), which favoured whichever variant went first
    runs: dict[str, list[Result]] = {"stock": [], "plugin": []}
    counters: dict[str, Any] = {}
    passed = [a for a in sys.argv[1:] if a not in ("--hook-times", "--sequential")]
    pair_ratios: list[float] = []
    for rep in range(max(1, args.repeats)):
        if args.sequential:
            order = ("stock", "plugin") if rep % 2 == 0 else ("plugin", "stock")
            pair = {name: run_child_process(passed, name) for name in order}
        else:
            pair = run_lockstep(passed)
        for name in ("stock", "plugin"):
            res, got = pair[name]
            if name == "plugin":
                counters = got
            report(res)
            if runs[name] and res.outcome() != runs[name][0].outcome():
                sys.exit(
                    f"{name}: repeat {rep} differs from the first run (the replay must be deterministic)"
                )
            runs[name].append(res)
        pair_ratios.append(runs["plugin"][-1].mean_step_ms / max(1e-9, runs["stock"][-1].mean_step_ms))
        if not args.sequential:
            print(f"   pair {rep}: plugin / stock step time {pair_ratios[-1]:.3f}x (in lockstep)")
    stock = min(runs["stock"], key=lambda r: r.mean_step_ms)
    plug = min(runs["plugin"], key=lambda r: r.mean_step_ms)
    print(f"plugin counters: {json.dumps(counters)}")
    hook_us: dict[str, float] = {}
    if args.hook_times:
        counted, got = run_child_process(passed, "plugin", "--hook-times")
        if counted.outcome() != runs["plugin"][0].outcome():
            sys.exit(
                "plugin: the --hook-times run differs from the timed runs (the counters changed a decision)"
            )
        hook_us = {k: round(v, 2) for k, v in got["hook_us_per_step"].items()}
        print(
            f"plugin hooks, CPU us per step (an extra run with the counters on: {counted.mean_step_ms:.3f} ms a "
            f"step; stock's fastest {stock.mean_step_ms:.3f} ms):"
        )
        width = max(map(len, hook_us))
        for label, us in hook_us.items():
            print(f"    {label:<{width}} {us:8.1f}")

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 4) if b else None  # (0/0 or a/0: no ratio; inf is not JSON)

    result = {
        "class0_hit_tokens_vs_stock": ratio(plug.hit_tokens[0], stock.hit_tokens[0]),
        "class1_hit_tokens_vs_stock": ratio(plug.hit_tokens[1], stock.hit_tokens[1]),
        "overall_hit_tokens_vs_stock": ratio(sum(plug.hit_tokens.values()), sum(stock.hit_tokens.values())),
        "step_time_vs_stock": round(statistics.median(pair_ratios), 4)
        if not args.sequential
        else ratio(plug.mean_step_ms, stock.mean_step_ms),
        "step_time_vs_stock_pairs": [round(x, 4) for x in pair_ratios],
        "step_time_vs_stock_fastest_runs": ratio(plug.mean_step_ms, stock.mean_step_ms),
        "step_time_vs_stock_median_run": ratio(
            statistics.median(r.mean_step_ms for r in runs["plugin"]),
            statistics.median(r.mean_step_ms for r in runs["stock"]),
        ),
        "step_wall_vs_stock": ratio(
            min(r.mean_step_wall_ms for r in runs["plugin"]), min(r.mean_step_wall_ms for r in runs["stock"])
        ),
        # the work moved off the step (the controller's shadows at input processing) still costs CPU: the whole
        # cost a step, step plus input processing, beside the step alone
        "stock_input_us_per_step": round(stock.input_us_per_step, 2),
        "plugin_input_us_per_step": round(plug.input_us_per_step, 2),
        "step_plus_input_vs_stock": ratio(
            plug.mean_step_ms + plug.input_us_per_step / 1000,
            stock.mean_step_ms + stock.input_us_per_step / 1000,
        ),
        "stock_hit_tokens": dict(sorted(stock.hit_tokens.items())),
        "plugin_hit_tokens": dict(sorted(plug.hit_tokens.items())),
        "stock_preemptions": sum(stock.preemptions.values()),
        "plugin_preemptions": sum(plug.preemptions.values()),
        "stock_step_ms": round(stock.mean_step_ms, 4),
        "plugin_step_ms": round(plug.mean_step_ms, 4),
        "stock_step_ms_runs": [round(r.mean_step_ms, 4) for r in runs["stock"]],
        "plugin_step_ms_runs": [round(r.mean_step_ms, 4) for r in runs["plugin"]],
        "step_time": "process CPU time of schedule() + update_from_output() per step, mean over a run; "
        + ("fastest of the interleaved repeats" if args.sequential else "median over the lockstep pairs"),
        "pairing": "sequential" if args.sequential else "lockstep",
        "stock_arrival_work": args.stock_arrival_work,
        "stock_steps": stock.steps,
        "plugin_steps": plug.steps,
        "policy": args.policy,
        "granularity": args.granularity if args.policy == "unified" else "block",
        "requests": len(reqs),
        "block_size": args.block_size,
        "pool_blocks": args.pool_blocks,
        "repeats": max(1, args.repeats),
    }
    if args.hook_times:
        result["hook_us_per_step"] = hook_us
    print(json.dumps(result))


if __name__ == "__main__":
    main()
