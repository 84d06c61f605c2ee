"""Machine instructions per block operation of ``bench/pool_ops.py``'s pools, this checkout against a revision.

Time per block operation (``bench/pool_ops.py``) depends on the host: two hosts of this project read 1.12x and
0.90x vLLM's ``BlockPool`` for the same code (docs/results.md, "Speed of the replay", session 29). Instructions do
not: ``valgrind --tool=callgrind`` counts every instruction the process executes, the C work the bytecode count
(``pool_ops.py --count-opcodes``) does not see included (a ``min()`` over a request's ids is one bytecode and ~180
instructions per id). Each pool runs ``pool_ops.py --repeats 1`` twice under callgrind, with ``--ops`` and with
``--ops`` + ``--span`` timed operations; the difference over ``--span`` is the cost of one block operation (the
interpreter's start, the imports and the warm-up cancel). ``PYTHONHASHSEED=0``: the figure repeats to within a
few instructions. Cache misses are not counted, so this measures the code's work, not its memory behaviour.

    python bench/pool_instructions.py --against a82c326            # unified, this checkout and that revision
    .venv-vllm/bin/python bench/pool_instructions.py --pools unified vllm   # vllm: ~8 min (its import)

Needs ``valgrind`` and, for ``--against``, git. Last line: JSON ``{"instructions_per_op": {tree: {pool: n}},
"vs_first": {tree: {pool: ratio}}}`` (ratios against this checkout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvretain.cli_args import DefaultsHelpFormatter, Parser, fail, integer, summary_of

ROOT = Path(__file__).resolve().parents[1]
PROG = "pool_instructions"
POOLS = ["lru", "lfu", "priority", "unified", "s3fifo", "arc", "vllm"]


def callgrind_total(text: str) -> int:
    """The total instruction count of a callgrind output file (its ``summary:`` or ``totals:`` line)."""
    m = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.MULTILINE)
    if m is None:
        raise ValueError("no summary line in the callgrind output")
    return int(m.group(1))


def instructions(tree: Path, pool: str, size: int, ops: int) -> int:
    """Instructions of one ``pool_ops.py`` process of ``tree`` running ``pool`` for ``ops`` timed operations."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable]
        cmd += [
            str(tree / "bench" / "pool_ops.py"),
            "--pools",
            pool,
            "--repeats",
            "1",
            "--command-capacities",
        ]
        cmd += ["--sizes", str(size), "--ops", str(ops)]
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(tree / "src")}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"pool_ops.py of {tree} failed under valgrind ({pool}): {tail}")
        return callgrind_total(out.read_text(errors="replace"))


def export_revision(rev: str, into: Path) -> Path:
    """``rev`` of this repository's ``src`` and ``bench`` as plain files in a new folder under ``into`` (``git
    archive`` of the commit ``rev`` names, resolved first: a ``rev`` that starts with ``-`` is not an option)."""
    if rev.startswith("-"):
        raise ValueError(f"argument --against: {rev!r} is not a revision (it starts with '-')")
    found = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    sha = found.stdout.strip()
    if found.returncode != 0 or not sha:
        raise ValueError(f"argument --against: {rev!r} is not a revision of this repository")
    dest = Path(tempfile.mkdtemp(prefix=sha[:12] + "-", dir=into))
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", sha], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    script = dest / "bench" / "pool_ops.py"
    if not script.is_file():
        raise ValueError(f"argument --against: {rev} has no bench/pool_ops.py")
    usage = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, check=False
    )
    if "--command-capacities" not in usage.stdout:
        raise ValueError(
            f"argument --against: {rev}'s bench/pool_ops.py is too old (no --command-capacities)"
        )
    return dest


def build_parser() -> Parser:
    """The command line (``--help`` shows every option's default)."""
    ap = Parser(prog=PROG, description=summary_of(__doc__), formatter_class=DefaultsHelpFormatter)
    ap.add_argument(
        "--pools", nargs="+", choices=POOLS, default=["unified"], help="pools to count (default unified)"
    )
    ap.add_argument(
        "--against",
        nargs="*",
        default=[],
        metavar="REV",
        help="git revisions to count side by side (default: this checkout alone)",
    )
    ap.add_argument(
        "--size", type=integer(1, what=" (blocks)"), default=2000, help="pool size in blocks (default 2,000)"
    )
    ap.add_argument(
        "--ops", type=integer(1), default=1000, help="timed operations of the base run (default 1,000)"
    )
    ap.add_argument(
        "--span",
        type=integer(1000),
        default=30_000,
        help="further timed operations of the second run, >= 1,000 (default 30,000)",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if shutil.which("valgrind") is None:
        return fail(PROG, "valgrind is not installed (Debian: apt-get install valgrind)")
    if "vllm" in args.pools:
        try:
            import vllm.v1.core.block_pool  # noqa: F401
        except Exception:
            return fail(
                PROG, "argument --pools: vllm is not importable by this python (use .venv-vllm/bin/python)"
            )
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this checkout": ROOT}
        try:
            for rev in dict.fromkeys(args.against):  # (each once)
                trees[rev] = export_revision(rev, Path(tmp))
        except ValueError as e:
            return fail(PROG, str(e))
        per_op: dict[str, dict[str, float]] = {t: {} for t in trees}
        print(f"{'tree':>16} " + " ".join(f"{p:>10}" for p in args.pools) + "   (instructions per block op)")
        for name, tree in trees.items():
            for pool in args.pools:
                print(
                    f"  counting {pool} in {name} (two runs under valgrind) ...", file=sys.stderr, flush=True
                )
                try:
                    base = instructions(tree, pool, args.size, args.ops)
                    more = instructions(tree, pool, args.size, args.ops + args.span)
                except RuntimeError as e:  # (a revision's pool_ops.py that does not know this pool...)
                    return fail(PROG, str(e))
                per_op[name][pool] = round((more - base) / args.span, 1)
            print(f"{name:>16} " + " ".join(f"{per_op[name][p]:>10.1f}" for p in args.pools), flush=True)
    first = per_op["this checkout"]
    ratios = {t: {p: round(v[p] / first[p], 4) for p in v} for t, v in per_op.items()}
    print(json.dumps({"instructions_per_op": per_op, "vs_first": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
