"""Per-block cost of a block pool's allocate/free/touch mix, per policy and pool size, against vLLM 0.33.

The same operation sequence drives every pool: requests whose block chains share prefixes (conversations
that come back, a shared system prompt) look up their cached prefix, touch the hits, allocate the misses
(evicting when the pool is full), register them in the prefix cache and release everything deepest first.
The pool is filled first (untimed), then a fixed number of block operations is timed in process CPU time
(robust to other jobs on the machine); every pool runs ``--repeats`` times, interleaved, and the fastest run
counts. vLLM's own
``BlockPool`` runs the same sequence in the same process when vLLM is importable (see
``shared/docs/vllm-on-cpu.md``; run this script with that environment's python).

    python bench/pool_ops.py [--sizes 10000 100000 1000000] [--ops 300000] [--pools unified vllm]
    python bench/pool_ops.py --count-opcodes     # bytecodes per block op instead of time (deterministic)
    python bench/pool_ops.py --phases            # and where each pool's time goes, by kind of operation

Last line: JSON ``{"ns_per_op": {policy: {blocks: ns}}, "ratio_vs_vllm": {policy: r}, "flatness": {...},
"replay_command_s": {blocks: s}}``. ``ratio_vs_vllm`` is the policy's ns/op over vLLM's, averaged over sizes.

``--phases`` adds one run per pool and size, after the timed ones, that splits the time by what the bench asks of
the pool (wall time, ns per block operation): ``touch`` (a reference on each hit), ``allocate`` (new blocks,
evicting), ``register`` (the newly full blocks into the prefix cache) and ``free`` (the release, deepest first), each
timed around the pool's method, and ``lookup`` (the prefix lookup and the bench's own loop: what is left of the
run's wall time). Timing the calls costs time of its own, mostly counted in ``lookup`` (the table's ``sum`` less
the timed figure: 50-90 ns per block operation on the 2-core host of session 51, alike for every pool); the split
locates a difference between pools, the timed figure measures it. JSON key
``"phases_ns_per_op": {policy: {blocks: {phase: ns}}}``.

``replay_command_s`` is the other half of issue 10's acceptance 6 (the whole conversation trace replayed in under
2 s): the wall time of the whole command ``kvretain replay TRACE --policy unified --capacity-blocks C --json``
in a fresh process (interpreter start, imports, reading and keying the trace, the replay), the median of
``--command-repeats`` runs (3) at each of ``--command-capacities`` (500 5000 32000); wall time, so run it on a
quiet machine. The runs read kvretain's modules from a bytecode cache, as an installed package does (pip
byte-compiles at install, and a checkout writes ``__pycache__`` on its first run): an untimed first run writes
the cache into a temporary folder (``PYTHONPYCACHEPREFIX``), even where ``PYTHONDONTWRITEBYTECODE`` is set (the
project's host sets it: every run then compiled kvretain's modules again, 0.06 s of each, session 58).
``--command-capacities`` with no value skips it; so does a missing default trace (a ``--trace`` that is not
there is an error, before anything runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType, SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _timing import time_calls
from kvretain.cli_args import DefaultsHelpFormatter, Parser, fail, integer, path_arg, script_main, summary_of
from kvretain.core.block_pool import BlockPool
from kvretain.core.memory import check_pool_fits
from kvretain.core.policy import PolicyConfig, make_policy
from kvretain.core.retention import BlockRetention
from kvretain.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, TraceError, read_trace

POLICIES = ["lru", "lfu", "priority", "unified", "s3fifo", "arc"]
SRC = Path(__file__).resolve().parents[1] / "src"
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def make_sequence(num_requests: int, seed: int, num_blocks: int) -> list[tuple[list[bytes], int]]:
    """Requests as (chain of block hashes, request priority), with a hit/miss pattern no policy can change.

    Half the requests replay one of a few hot sessions (a shared system prompt plus a fixed chain, reused
    far more often than the pool turns over, ~10% of the pool in all) and add a fresh tail; the other half
    are one-shot chains under the system prompt. Every policy keeps the hot chains and misses the fresh
    blocks, so all pools run the same operations: the ratio compares bookkeeping, not hit ratios.
    """
    rng = random.Random(seed)
    counter = 0

    def fresh(n: int) -> list[bytes]:
        nonlocal counter
        counter += n
        return [b"b-%d" % (counter - n + i) for i in range(n)]

    system = [b"sys-%d" % i for i in range(4)]
    hot = [system + fresh(rng.randint(12, 28)) for _ in range(max(4, num_blocks // 10 // 24))]
    out = []
    for _ in range(num_requests):
        if rng.random() < 0.5:
            out.append((rng.choice(hot) + fresh(rng.randint(2, 8)), 0))
        else:
            out.append((system + fresh(rng.randint(8, 40)), 1))
    return out


Probe = Callable[[str], None]
"""Called with ``"enable"`` right before a pool's timed operations and ``"disable"`` right after them."""


def _perf_control(fifo: str | None) -> Probe:
    """A probe that sends its commands to ``perf record --control fifo:FIFO`` (nothing without a fifo)."""

    def send(cmd: str) -> None:
        if fifo is not None:
            with open(fifo, "w") as f:
                f.write(cmd + "\n")

    return send


class OpcodeCounter:
    """A probe that counts the bytecodes the interpreter executes between ``enable`` and ``disable``.

    Deterministic, unlike time: bytecodes per block operation measure the pool's Python-level work alone, so a
    figure flat across pool sizes shows the operations are O(1) there and any growth in ns per operation is the
    memory hierarchy (work done in C, such as a dict probe or a heap sift, counts as the one bytecode that calls
    it).
    """

    def __init__(self) -> None:
        self.count = 0

    def _local(self, frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        if event == "opcode":
            self.count += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return self._local

    def __call__(self, cmd: str) -> None:
        if cmd == "enable":
            self.count = 0
            sys.settrace(self._global)
        else:
            sys.settrace(None)


PHASES = ("lookup", "touch", "allocate", "register", "free")
"""``--phases``' kinds of operation (see the module docstring)."""
VLLM_METHODS = {
    "touch": "touch",
    "allocate": "get_new_blocks",
    "register": "cache_full_blocks",
    "free": "free_blocks",
}
"""The methods of vLLM's ``BlockPool`` timed for the phases but ``lookup`` (kvretain's pool registers by
``cache_blocks``)."""


def _split_phases(
    pool: object, methods: dict[str, str], spent: dict[str, int], ops: Callable[[], int]
) -> Callable[[], int]:
    """Time every call of ``pool``'s methods from now on: ``methods`` maps a phase to the method's name, whose wall
    time (ns) each call adds to ``spent[phase]`` (the wrapper is an instance attribute: the pool's class is
    untouched). Returns ``ops`` made to add its own wall time to ``spent["wall"]``."""
    clock = time.perf_counter_ns
    for phase, name in methods.items():
        spent[phase] = 0
        time_calls(pool, name, spent, phase, clock)

    def walled() -> int:
        t0 = clock()
        n = ops()
        spent["wall"] = clock() - t0
        return n

    return walled


def phases_per_op(spent: dict[str, int], ops: int) -> dict[str, float]:
    """One ``--phases`` run's ``spent`` (ns) per block operation: each phase's, ``lookup`` the rest of the wall."""
    parts = {p: spent[p] / ops for p in PHASES[1:]}
    return {"lookup": (spent["wall"] - sum(spent[p] for p in PHASES[1:])) / ops, **parts}


def _timed(ops: Callable[[], int], probe: Probe | None) -> tuple[float, int]:
    """Process CPU time of ``ops()`` (which returns the block operations it did), with the GC off and ``probe``
    enabled around it only."""
    probe = probe or _perf_control(None)
    gc.collect()
    gc.disable()
    probe("enable")
    t0 = time.process_time()
    try:
        n = ops()
    finally:
        dt = time.process_time() - t0
        probe("disable")
        gc.enable()
    return dt, n


def run_kvretain(
    policy: str,
    num_blocks: int,
    warm: list,
    timed: list,
    perf: Probe | None = None,
    phases: dict[str, int] | None = None,
) -> tuple[float, int]:
    pol = make_policy(policy, num_blocks, PolicyConfig())
    now = [0.0]
    pool = BlockPool(num_blocks, pol, clock=lambda: now[0])
    plans = {}

    def one(chain: list[bytes], prio: int) -> int:
        cached = pool.cached
        n = len(chain)
        hits = []
        for h in chain:
            b = cached.get(h)
            if b is None:
                break
            hits.append(b)
        pool.touch(hits)
        new = pool.get_new_blocks(n - len(hits))
        assert new is not None
        ids = hits + new
        pool.cache_blocks(ids, chain, len(hits), n)
        key = (n, prio)
        plan = plans.get(key)
        if plan is None:
            r = 35 - 10 * prio
            plan = plans[key] = BlockRetention([], [], None, prio, r)  # uniform, as KVCacheManager builds it
        pool.free_blocks(ids, plan)
        return n

    for chain, prio in warm:
        one(chain, prio)

    def timed_ops() -> int:
        ops = 0
        for chain, prio in timed:
            now[0] += 0.001
            ops += one(chain, prio)
        return ops

    if phases is not None:
        return _timed(
            _split_phases(pool, {**VLLM_METHODS, "register": "cache_blocks"}, phases, timed_ops), perf
        )
    return _timed(timed_ops, perf)


def run_vllm(
    num_blocks: int, warm: list, timed: list, perf: Probe | None = None, phases: dict[str, int] | None = None
) -> tuple[float, int]:
    from vllm.v1.core.block_pool import BlockPool as VBlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash

    pool = VBlockPool(num_gpu_blocks=num_blocks + 1, enable_caching=True, hash_block_size=1)
    conv: dict[bytes, object] = {}

    def vh(h: bytes) -> object:
        x = conv.get(h)
        if x is None:
            x = conv[h] = BlockHash(h)
        return x

    warm_v = [[vh(h) for h in c] for c, _ in warm]
    timed_v = [[vh(h) for h in c] for c, _ in timed]

    def one(bh: list) -> int:
        hits = []
        for h in bh:
            got = pool.get_cached_block(h, [0])
            if got is None:
                break
            hits.append(got[0])
        pool.touch(hits)
        new = pool.get_new_blocks(len(bh) - len(hits))
        blocks = hits + new
        pool.cache_full_blocks(
            request=SimpleNamespace(block_hashes=bh),
            blocks=blocks,
            num_cached_blocks=len(hits),
            num_full_blocks=len(bh),
            block_size=1,
            kv_cache_group_id=0,
        )
        pool.free_blocks(reversed(blocks))
        return len(bh)

    for bh in warm_v:
        one(bh)

    def timed_ops() -> int:
        ops = 0
        for bh in timed_v:
            ops += one(bh)
        return ops

    if phases is not None:
        return _timed(_split_phases(pool, VLLM_METHODS, phases, timed_ops), perf)
    return _timed(timed_ops, perf)


def replay_command_seconds(trace: Path, capacity: int, repeats: int) -> float:
    """The median wall time of ``kvretain replay TRACE --policy unified --capacity-blocks C --json``, each run
    in a fresh interpreter (this checkout's ``src`` first on the path), with its bytecode cached by an untimed
    first run (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="kvretain-pycache-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
        env["PYTHONPYCACHEPREFIX"] = cache
        cmd = [sys.executable, "-m", "kvretain", "replay", str(trace), "--policy", "unified"]
        cmd += ["--capacity-blocks", str(capacity), "--json"]
        walls = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
            if i:  # (the first run writes the cache)
                walls.append(time.perf_counter() - t0)
        return statistics.median(walls)


PROG = "pool_ops"


def fifo_arg(text: str) -> str:
    """``--perf-fifo``: an existing named pipe (``mkfifo``), checked as the command line is read: each timed part
    writes ``enable``/``disable`` into it, which would overwrite a regular file and fail (after runs) on a path
    that is not there."""
    path_arg("a fifo made by mkfifo")(text)
    try:
        mode = os.stat(text).st_mode
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text} not found (pass a fifo made by mkfifo)") from None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot use {text}: {exc.strerror}") from None
    if not stat.S_ISFIFO(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "not a fifo"
        raise argparse.ArgumentTypeError(f"{text} is {what} (pass a fifo made by mkfifo)")
    if not os.access(text, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--sizes",
        type=integer(1, what=" (blocks)"),
        nargs="+",
        default=[10_000, 100_000, 1_000_000],
        help="pool sizes to run, in blocks",
    )
    ap.add_argument(
        "--ops",
        type=integer(1),
        help="timed block operations per run (default 300,000; 20,000 with --count-opcodes)",
    )
    ap.add_argument(
        "--seed",
        type=integer(0),
        default=0,
        help="seed of the generated operation sequence (an integer >= 0)",
    )
    ap.add_argument(
        "--repeats",
        type=integer(1),
        default=3,
        help="interleaved runs per pool; the fastest counts (1 with --count-opcodes)",
    )
    ap.add_argument(
        "--pools",
        nargs="*",
        choices=[*POLICIES, "vllm"],
        help="pools to run (default: all; vllm only where it is importable)",
    )
    ap.add_argument(
        "--perf-fifo",
        type=fifo_arg,
        help="control fifo of `perf record -D -1 --control fifo:PATH`: sample only the timed parts "
        "(a path; bench/pool_ops_perf.py drives it; default: none)",
    )
    ap.add_argument(
        "--count-opcodes",
        action="store_true",
        help="instead of timing, count the bytecodes each pool executes per block operation (one run each; "
        "deterministic: flat across sizes = O(1) Python-level work)",
    )
    ap.add_argument(
        "--phases",
        action="store_true",
        help="also split each pool's time by kind of operation (lookup, touch, allocate, register, free): one more "
        "run per pool and size, wall time (not with --count-opcodes)",
    )
    ap.add_argument(
        "--trace",
        type=path_arg("a Mooncake-format JSONL file"),
        default=None,
        help=f"trace of the replay-command figure (default {DEFAULT_TRACE}; the figure is skipped when that is "
        "missing)",
    )
    ap.add_argument(
        "--command-capacities",
        type=integer(1, what=" (blocks)"),
        nargs="*",
        default=[500, 5000, 32000],
        help="pool sizes of the replay-command figure, in blocks (none: skip it)",
    )
    ap.add_argument(
        "--command-repeats",
        type=integer(1),
        default=3,
        help="runs per size of that figure, the median counts (a count)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    trace = DEFAULT_TRACE if args.trace is None else Path(args.trace)
    if args.trace is not None:
        try:
            found = trace.is_file()
        except OSError as exc:  # (a name the system cannot look up: too long)
            return fail(PROG, f"argument --trace: {args.trace}: cannot read the trace: {exc.strerror}")
        if not found:
            why = "is a folder" if trace.is_dir() else "not found"
            return fail(PROG, f"argument --trace: {args.trace} {why} (pass a Mooncake-format JSONL file)")
    pools = args.pools or [*POLICIES, "vllm"]
    try:  # before anything runs: a pool past the memory, a trace that the replay command would refuse at the end
        check_pool_fits(
            max(args.sizes), [p for p in pools if p != "vllm"] or ["lru"], what="argument --sizes"
        )
        if args.command_capacities and trace.is_file():
            cfg = PolicyConfig(block_size=MOONCAKE_BLOCK_TOKENS)
            check_pool_fits(
                max(args.command_capacities), ["unified"], cfg, what="argument --command-capacities"
            )
            read_trace(trace, MOONCAKE_BLOCK_TOKENS)
    except TraceError as exc:
        return fail(PROG, f"argument --trace: {exc}")
    except ValueError as exc:
        return fail(PROG, str(exc))
    if args.phases and args.count_opcodes:
        return fail(PROG, "argument --phases: not with --count-opcodes (bytecodes are counted, not timed)")
    if args.ops is None:
        args.ops = 20_000 if args.count_opcodes else 300_000
    if args.count_opcodes:
        args.repeats = 1
    perf = _perf_control(args.perf_fifo)
    try:
        import vllm.v1.core.block_pool  # noqa: F401

        have_vllm = True
    except Exception:
        have_vllm = False
        print("vLLM not importable: comparing kvretain policies only", file=sys.stderr)
    if "vllm" in pools and not have_vllm:
        pools.remove("vllm")
        if not pools:
            return fail(PROG, "argument --pools: vllm is not importable here and no other pool was asked for")
    ns: dict[str, dict[str, float]] = {p: {} for p in pools}
    split: dict[str, dict[str, dict[str, float]]] = {p: {} for p in pools}  # --phases
    unit = "bytecodes per block op" if args.count_opcodes else "ns per block op"
    print(f"{'blocks':>9} " + " ".join(f"{p:>10}" for p in ns) + f"   ({unit})")
    for size in args.sizes:
        avg_len = 25
        seq = make_sequence(int(2.5 * size / avg_len) + args.ops // avg_len + 10, args.seed, size)
        # warm until the pool has been filled twice over, then time ~args.ops block operations
        n_warm = int(2.5 * size / avg_len)
        warm, timed = seq[:n_warm], seq[n_warm:]
        row: dict[str, float] = {}
        for _ in range(args.repeats):
            for p in ns:
                probe: Probe = OpcodeCounter() if args.count_opcodes else perf
                if p == "vllm":
                    dt, ops = run_vllm(size, warm, timed, probe)
                else:
                    dt, ops = run_kvretain(p, size, warm, timed, probe)
                value = probe.count / ops if isinstance(probe, OpcodeCounter) else dt / ops * 1e9
                row[p] = min(row.get(p, float("inf")), value)
        for p in ns:
            ns[p][str(size)] = row[p]
        print(f"{size:>9} " + " ".join(f"{row[p]:>10.1f}" for p in ns), flush=True)
        for p in ns if args.phases else ():
            spent: dict[str, int] = {}
            if p == "vllm":
                _, ops = run_vllm(size, warm, timed, None, spent)
            else:
                _, ops = run_kvretain(p, size, warm, timed, None, spent)
            split[p][str(size)] = phases_per_op(spent, ops)
    if args.phases:
        print(
            "where the time goes (ns per block op, wall, one more run each; sum less the timed figure: what"
        )
        print("timing the calls cost, mostly counted in lookup, the rest of the wall time):")
        print(f"{'blocks':>9} {'pool':>10} " + " ".join(f"{k:>9}" for k in (*PHASES, "sum")))
        for size in args.sizes:
            for p in ns:
                cells = split[p][str(size)]
                row_ = [cells[k] for k in PHASES]
                print(f"{size:>9} {p:>10} " + " ".join(f"{v:>9.1f}" for v in (*row_, sum(row_))))
    flat = {p: round(max(v.values()) / min(v.values()), 3) for p, v in ns.items()}
    if args.count_opcodes:
        print(json.dumps({"opcodes_per_op": {p: {s: round(v, 2) for s, v in d.items()} for p, d in ns.items()},
                          "flatness": flat}))  # fmt: skip
        return 0
    ratio = {}
    if "vllm" in ns:
        for p in ns:
            if p == "vllm":
                continue
            ratio[p] = round(sum(ns[p][s] / ns["vllm"][s] for s in ns[p]) / len(ns[p]), 3)
    command: dict[str, float] = {}
    if args.command_capacities and trace.is_file():
        for cap in args.command_capacities:
            command[str(cap)] = round(replay_command_seconds(trace, cap, args.command_repeats), 3)
            print(f"kvretain replay (whole command, unified, {cap} blocks): {command[str(cap)]:.2f} s wall")
    elif args.command_capacities:
        print(f"no trace at {trace}: no replay-command figure", file=sys.stderr)
    out = {
        "ns_per_op": {p: {s: round(v, 1) for s, v in d.items()} for p, d in ns.items()},
        "ratio_vs_vllm": ratio,
        "flatness": flat,
        "replay_command_s": command,
    }
    if args.phases:
        out["phases_ns_per_op"] = {
            p: {s: {k: round(v, 1) for k, v in d.items()} for s, d in by.items()} for p, by in split.items()
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))
