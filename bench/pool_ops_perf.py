"""Where a block pool's time goes as the pool grows: ``perf`` samples of only the timed part of bench/pool_ops.py.

For each pool and size, one ``bench/pool_ops.py --repeats 1`` process runs under ``perf record -e cpu-clock``
(a software clock: works in VMs without hardware counters), started disabled and switched on and off around the
timed operations through perf's control fifo. The table splits each ns/op figure by the interpreter's C
functions: ``_Py_dict_lookup`` (the hash index: lookups, inserts and deletes of block hashes, plus any other
dict) against the rest, so the growth from the smallest to the largest pool can be attributed. Needs
``perf`` (Linux ``linux-perf``) and, for the ``vllm`` pool, the vLLM environment's python.

    .venv-vllm/bin/python bench/pool_ops_perf.py [--pools unified vllm] [--sizes 10000 1000000]
    python bench/pool_ops_perf.py --chase   # the machine's side: ns per dependent read among N objects

``--chase`` measures what one dependent read of a cold object costs at each size, without perf: a pointer chase
through shuffled slotted objects (one object per block, as the pools keep), and an int id resolved through a
list to its object (how a block id is resolved).

Last line: JSON ``{"<pool>": {"<blocks>": {"ns_per_op", "dict_lookup_ns", "other_ns", "top": {symbol: share}}}}``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvretain.cli_args import DefaultsHelpFormatter, Parser, fail, integer, missing_module, summary_of

ROOT = Path(__file__).resolve().parents[1]
PROG = "pool_ops_perf"
POOLS = ["lru", "lfu", "priority", "unified", "s3fifo", "arc", "vllm"]
"""``bench/pool_ops.py``'s pools (``--pools``)."""


def symbol_shares(data: str) -> dict[str, float]:
    """Share of samples per symbol (self time) in a perf data file."""
    out = subprocess.run(
        ["perf", "report", "-i", data, "--no-children", "--sort", "symbol", "--stdio"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    shares: dict[str, float] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith("%") and parts[1] == "[.]":
            shares[parts[2]] = shares.get(parts[2], 0.0) + float(parts[0][:-1]) / 100.0
    return shares


def profile(pool: str, size: int, ops: int, tmp: str) -> dict[str, object]:
    fifo = os.path.join(tmp, f"ctl-{pool}-{size}")
    data = os.path.join(tmp, f"perf-{pool}-{size}.data")
    os.mkfifo(fifo)
    cmd = [
        "perf", "record", "-q", "-e", "cpu-clock", "-F", "4000", "-D", "-1", "--control", f"fifo:{fifo}",
        "-o", data, "--",
        sys.executable, str(ROOT / "bench" / "pool_ops.py"), "--pools", pool, "--sizes", str(size),
        "--repeats", "1", "--ops", str(ops), "--perf-fifo", fifo,
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"perf run failed for {pool} at {size} blocks:\n{res.stderr[-2000:]}")
    ns = json.loads(res.stdout.strip().splitlines()[-1])["ns_per_op"][pool][str(size)]
    shares = symbol_shares(data)
    dict_share = shares.get("_Py_dict_lookup", 0.0)
    top = dict(sorted(shares.items(), key=lambda kv: -kv[1])[:6])
    return {
        "ns_per_op": ns,
        "dict_lookup_ns": round(ns * dict_share, 1),
        "other_ns": round(ns * (1.0 - dict_share), 1),
        "top": {k: round(v, 4) for k, v in top.items()},
    }


class _Obj:
    __slots__ = ("nxt", *(f"f{i}" for i in range(17)))  # about a pool block's object (18 slots)


def chase(sizes: list[int], hops: int = 1_000_000, seed: int = 0) -> dict[str, dict[str, float]]:
    """ns per hop of a pointer chase and per id -> list -> object read, among ``size`` objects (best of 3)."""
    import gc
    import random
    import time

    out: dict[str, dict[str, float]] = {"pointer_chase_ns": {}, "id_to_object_ns": {}}
    for size in sizes:
        rng = random.Random(seed)
        objs = [_Obj() for _ in range(size)]
        for o in objs:
            o.f0 = 0
        order = list(range(size))
        rng.shuffle(order)
        for a, b in zip(order, order[1:] + order[:1], strict=True):
            objs[a].nxt = objs[b]
        ids = (order * (hops // size + 1))[:hops]
        best_chase = best_ids = float("inf")
        gc.disable()
        try:
            for _ in range(3):
                o = objs[0]
                t = time.process_time()
                for _ in range(hops):
                    o = o.nxt
                best_chase = min(best_chase, time.process_time() - t)
                t = time.process_time()
                for i in ids:
                    objs[i].f0  # noqa: B018 - the read is what is timed
                best_ids = min(best_ids, time.process_time() - t)
        finally:
            gc.enable()
        out["pointer_chase_ns"][str(size)] = round(best_chase / hops * 1e9, 1)
        out["id_to_object_ns"][str(size)] = round(best_ids / hops * 1e9, 1)
        print(
            f"{size:>9} objects: pointer chase {best_chase / hops * 1e9:6.1f} ns/hop, "
            f"id -> list -> object {best_ids / hops * 1e9:6.1f} ns/read",
            flush=True,
        )
    return out


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--pools",
        nargs="*",
        choices=POOLS,
        default=["unified", "vllm"],
        help="bench/pool_ops.py pools to profile",
    )
    ap.add_argument(
        "--sizes",
        type=integer(1, what=" (blocks)"),
        nargs="*",
        default=[10_000, 1_000_000],
        help="pool sizes in blocks (--chase: objects chased among)",
    )
    ap.add_argument(
        "--ops",
        type=integer(1),
        default=1_000_000,
        help="timed block operations per profiled run (a count; not used by --chase)",
    )
    ap.add_argument("--chase", action="store_true", help="measure the cost of a dependent cold read instead")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.chase:
        print(json.dumps(chase(args.sizes)))
        return 0
    # before the first profiled run (the vllm pool's run failed under perf after the others)
    missing = missing_module(["vllm"], "argument --pools: the vllm pool") if "vllm" in args.pools else None
    if missing:
        return fail(PROG, missing)
    if shutil.which("perf") is None:
        return fail(PROG, "perf not found: install linux-perf (Debian) to attribute the pool's time")
    result: dict[str, dict[str, dict[str, object]]] = {}
    print(f"{'pool':>9} {'blocks':>9} {'ns/op':>7} {'dict lookups':>13} {'rest':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        for pool in args.pools:
            for size in args.sizes:
                r = profile(pool, size, args.ops, tmp)
                result.setdefault(pool, {})[str(size)] = r
                print(
                    f"{pool:>9} {size:>9} {r['ns_per_op']:>7.0f} {r['dict_lookup_ns']:>13.0f} {r['other_ns']:>7.0f}",
                    flush=True,
                )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
