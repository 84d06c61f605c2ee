"""``kvretain workload export`` and ``kvretain workload list``: any registered workload as a Mooncake-format
trace, for ``kvretain replay``, ``bench/robustness.py`` or another tool that reads that format.

``add_subcommands(subparsers)`` is called by :func:`kvretain.cli.build_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

from kvretain.cli_args import (
    add_block_tokens_option,
    add_limit_option,
    check_output_file,
    json_text,
    number,
    trace_arg,
)
from kvretain.core.memory import human_bytes
from kvretain.fileio import standard_stream, written_in_place
from kvretain.workloads import WORKLOADS, WorkloadError, WorkloadRequest, tag_priorities
from kvretain.workloads.export import write_mooncake
from kvretain.workloads.mooncake import BLOCK_TOKENS_HINT, MOONCAKE_BLOCK_TOKENS, TraceError
from kvretain.workloads.priority import check_seed_read, make_rule, rule_choices


def parse_options(items: list[str], what: str) -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: value}``; a value is read as JSON when it parses (numbers, lists as
    tuples, ``null``), else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise WorkloadError(f"{what}: expected key=value, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if key.strip() in out:
            raise WorkloadError(f"{what} {item}: {key.strip()!r} is given twice")
        out[key.strip()] = tuple(value) if isinstance(value, list) else value
    return out


READ_BLOCK_TOKENS_HINT = "the trace read has --option block_size=N tokens per hash id (default 512); --block-tokens sets the written one's"

OWN_OPTIONS = {"rng": "--seed", "path": "--trace", "limit": "--limit", "time_scale": "--time-scale"}
"""The keywords every workload takes from ``workload export``'s own options, not from ``--option``."""


def cmd_export(args: argparse.Namespace) -> int:
    if args.out == "-":  # standard output, as the tools a trace is piped into spell it
        args.out = "/dev/stdout"
    check_output_file(args.out, "--out")
    if args.name == "mooncake":  # (a Mooncake trace draws nothing: the seed is the priority rule's alone)
        check_seed_read(args.seed, args.priority_rule)
    options = parse_options(args.option, "--option")
    own = next((k for k in options if k in OWN_OPTIONS), None)
    if own is not None:
        item = next(i for i in args.option if i.partition("=")[0].strip() == own)
        raise WorkloadError(f"--option {item}: use {OWN_OPTIONS[own]}")
    try:
        reqs = WORKLOADS.create(
            args.name,
            rng=random.Random(args.seed),
            path=args.trace,
            limit=args.limit,
            time_scale=args.time_scale,
            **options,
        )
    except TraceError as e:  # (here --block-tokens is the written trace's; the read one's is an --option)
        msg = str(e).replace(BLOCK_TOKENS_HINT, READ_BLOCK_TOKENS_HINT)
        raise TraceError(msg.replace("(--block-tokens)", "(--option block_size)")) from None
    if not reqs:  # an empty trace is an error to every reader (replay, simulate, compare): not written
        shown = " ".join(f"--option {o}" for o in args.option)
        raise WorkloadError(
            f"workload {args.name!r} {shown + ' ' if shown else ''}has no request: nothing to export (the "
            "trace readers refuse an empty file); use a longer duration_s or higher rates"
        )
    rule = make_rule(args.priority_rule, reqs, random.Random(args.seed + 1))
    if rule is not None:
        reqs = tag_priorities(reqs, rule)
    check_disk(reqs, args.block_tokens, args.out)
    try:
        n = write_mooncake(reqs, args.out, args.block_tokens)
    except BrokenPipeError:
        raise  # the reader of standard output went away: main() ends quietly with 141
    except OSError as exc:
        raise WorkloadError(f"cannot write {args.out}: {exc.strerror}") from None
    summary = {"workload": args.name, "seed": args.seed, "requests": n, "out": args.out}
    # the trace went to standard output (``--out /dev/stdout``): the summary goes beside it, not into it
    where = sys.stderr if standard_stream(args.out) is sys.stdout else sys.stdout
    if args.json:
        print(json_text(summary), file=where)
    else:
        print(f"wrote {n} requests of workload {args.name!r} (seed {args.seed}) to {args.out}", file=where)
    return 0


def check_disk(reqs: list[WorkloadRequest], block_tokens: int, out: str) -> None:
    """Raise a ``ValueError`` naming ``--out`` when the trace cannot fit on its disk: each of its hash ids (one
    per ``block_tokens`` of a prompt, known before writing) takes at least 3 bytes (``", 0"``). A target that
    exists and is not a regular file (``/dev/stdout``, a pipe: written in place) has no disk to check."""
    if written_in_place(out):
        return
    ids = sum(-(-r.prompt_len // block_tokens) for r in reqs)
    free = shutil.disk_usage(Path(os.path.realpath(out)).parent).free
    if free == 0:
        raise ValueError(
            f"argument --out: no free space where {out} would be written (a full or read-only disk?)"
        )
    if 3 * ids > free:
        raise ValueError(
            f"argument --out: the trace holds {ids:,} hash ids (its prompts' tokens / --block-tokens "
            f"{block_tokens}), at least {human_bytes(3 * ids)}, more than the {human_bytes(free)} free "
            "there; use a larger --block-tokens or shorter prompts"
        )


def cmd_list(args: argparse.Namespace) -> int:
    # NOTE: in one write: under PYTHONUNBUFFERED (common in containers) each print() was its own write, and a
    # reader that left after the first line (`kvretain workload list | head -1`) made the next one fail: status
    # 141 or 0 by a race, where a listing that fits in the pipe whole ends with 0
    sys.stdout.write("".join(f"{name:15s} {doc}\n" for name, doc in WORKLOADS.describe().items()))
    return 0


def add_subcommands(sub: Any) -> None:
    w = sub.add_parser("workload", help="list workloads or export one as a Mooncake-format trace")
    # (the metavar names the choices in the error of a bare `kvretain workload`, which named the dest)
    wsub = w.add_subparsers(dest="workload_command", required=True, metavar="{export,list}")
    e = wsub.add_parser(
        "export",
        help="write a workload in the Mooncake replay format (priority, session_id, retention kept)",
        description="Write a workload as Mooncake JSONL: one line per request with hash_ids (one id per "
        "block, the last one partial), priority, session_id and retention directives.",
    )
    e.add_argument("name", choices=WORKLOADS.names(), help="workload")
    e.add_argument(
        "--out",
        required=True,
        help="output JSONL file (a name ending in .gz: gzip-compressed; '-': standard output)",
    )
    e.add_argument(
        "--seed",
        type=int,
        default=0,
        help="random seed of the workload (a Mooncake trace draws none: there, the priority rule's; default 0)",
    )
    e.add_argument(
        "--trace",
        type=trace_arg("a trace file, or leave the option out"),
        default=None,
        help="input trace (for the mooncake / azure loaders; '-': standard input)",
    )
    add_limit_option(e)
    e.add_argument(
        "--time-scale",
        type=number(0.0, lo_open=True),
        default=1.0,
        help="multiply arrival and think times, and retention durations with them (> 0; default 1)",
    )
    e.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a workload setting, e.g. duration_s=600 or steps=[4,8] (repeatable)",
    )
    e.add_argument(
        "--priority-rule",
        default="keep",
        choices=rule_choices(),
        help="re-tag priorities (keep: the workload's own; session rules draw from seed + 1)",
    )
    add_block_tokens_option(e, MOONCAKE_BLOCK_TOKENS, ", in the trace written")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_export)
    ls = wsub.add_parser("list", help="list the workloads")
    ls.set_defaults(func=cmd_list)
