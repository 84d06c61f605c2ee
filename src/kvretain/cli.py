"""The ``kvretain`` command line: ``kvretain replay``, ``kvretain policies``; ``simulate`` and ``compare``
live in :mod:`kvretain.cli_sim`, ``workload export`` / ``workload list`` in :mod:`kvretain.cli_workload`,
``profile`` in :mod:`kvretain.cli_profile`.

Choices (policies, priority rules) are listed from the registries.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

from kvretain import __version__
from kvretain.cli_args import (
    STDIN_PATH,
    Parser,
    SubcommandParser,
    add_block_tokens_option,
    add_limit_option,
    add_policy_options,
    add_priority_mapping_option,
    check_policy_options_used,
    fail,
    integer,
    json_text,
    option_error,
    policy_config,
    stdin_named,
    stdout_closed,
    trace_arg,
)
from kvretain.core.memory import UNMEASURED_MULTIPLE, check_fits, check_pool_fits, human_count
from kvretain.core.policy import POLICIES, PolicyConfig, policy_names
from kvretain.core.retention import RetentionError
from kvretain.replay import (
    SAMPLE_SESSIONS,
    ReplayRequest,
    ReplayResult,
    TraceError,
    replay,
    replay_requests,
    synthetic_bytes_per_session,
    synthetic_conversations,
)
from kvretain.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, read_trace
from kvretain.workloads.priority import KEEP, check_seed_read, make_rule, rule_choices, tag_priorities
from kvretain.workloads.request import check_scale_and_limit

DEFAULT_SESSIONS = 400
"""Sessions of ``replay``'s built-in workload (``--sessions``)."""


def _progress(enabled: bool, desc: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    def wrap(it: Iterable[int]) -> Iterable[int]:
        # disable=None: no bar when stderr is not a terminal (a log file, a pipe)
        return tqdm(it, desc=desc, unit="req", leave=False, mininterval=0.5, file=sys.stderr, disable=None)

    return wrap


def policy_config_error(exc: ValueError) -> ValueError:
    """A ``PolicyConfig`` error found after parsing, reworded to name the option(s) (``argument --x: ...``)."""
    return ValueError(option_error(exc, (f.name for f in fields(PolicyConfig))))


def check_replay(args: argparse.Namespace) -> None:
    """Checks that need several options, before anything runs: the policy settings together, and a pool
    that fits in memory."""
    try:
        cfg = policy_config(args, PolicyConfig(), args.block_tokens)
    except ValueError as exc:
        raise policy_config_error(exc) from None
    policies = policy_names() if args.policy == "all" else [args.policy]
    check_policy_options_used(args, policies, "--policy")
    check_pool_fits(args.capacity_blocks, policies, cfg, what="argument --capacity-blocks")
    if args.trace is not None:
        if args.sessions is not None:
            raise ValueError("argument --sessions: sets the built-in workload's size; a trace has its own")
        check_seed_read(args.seed, args.priority_rule)
        return
    # the built-in workload
    if args.priority_rule != KEEP:
        raise ValueError(
            "argument --priority-rule: applies to a trace file (the built-in workload sets its own priorities)"
        )
    sessions = args.sessions or DEFAULT_SESSIONS
    if sessions > UNMEASURED_MULTIPLE * SAMPLE_SESSIONS:
        per = synthetic_bytes_per_session(args.seed)
        count, each = f"{human_count(sessions)} sessions", f"{per:,.0f} bytes per session"
        check_fits(per * sessions, "argument --sessions", count, each, "sessions")


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [
        max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    line = "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join([line, sep, *body])


def controller_line(stats: dict[str, float]) -> str | None:
    """Two lines of ``unified``'s protection controller's state (``stats``: the policy's ``stats()``), or None
    for a policy without one: the level and target and which constraint binds; both sides' estimates. With a
    fixed share (no isolation goal) the share, and the window the recency/frequency balance measures."""
    if "protection_level" not in stats:
        return None
    g = stats.get
    alpha = g("frequency_exponent_now", -1.0)
    exponent = f"; frequency exponent {alpha:.3f}" if alpha >= 0.0 else ""
    window = f"  window hit ratio {g('hit_ratio_window', 0.0):.4f} (LRU estimate {g('lru_hit_ratio_estimate', 0.0):.4f})"
    if not g("isolation_goal", 1.0):  # a fixed share: no goal, no floor, no protected estimates kept
        fixed = (
            f"controller: fixed protected share, {g('protected_target', 0.0):,.0f} of "
            f"{g('protected_budget', 0.0):,.0f} blocks (no isolation goal, no reuse floor)"
        )  # (the window is measured for the recency/frequency balance only)
        return fixed + (f"\n{window}{exponent}" if alpha >= 0.0 else "")
    binds = "the reuse floor binds" if g("reuse_floor_binds") else "the reuse floor has room"
    protected = (
        "protected_hit_ratio_window",
        "isolated_hit_ratio_estimate",
        "lru_protected_hit_ratio_estimate",
    )
    if g("isolation_goal_met"):
        goal = "isolation goal met"
    elif not any(g(k) for k in protected):
        goal = "no protected hits measured yet"
    else:
        goal = "short of the isolation goal"
    start = {1.0: " (started at the top)", -1.0: " (started at the bottom)"}.get(g("start_level", 0.0), "")
    line = (
        f"controller: protection level {g('protection_level', 0.0):+.3f}{start}, target "
        f"{g('protected_target', 0.0):,.0f} of {g('protected_budget', 0.0):,.0f} blocks; {binds}, {goal}\n"
        f"{window}, protected {g('protected_hit_ratio_window', 0.0):.4f} (alone "
        f"{g('isolated_hit_ratio_estimate', 0.0):.4f}, LRU {g('lru_protected_hit_ratio_estimate', 0.0):.4f}, full "
        f"protection {g('top_protected_hit_ratio_estimate', 0.0):.4f})"
    )
    return line + exponent


def _result_rows(results: Sequence[ReplayResult]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        row: dict[str, Any] = {
            "policy": r.policy,
            "capacity": r.capacity_blocks,
            "requests": r.requests,
            "hit_rate": f"{r.hit_rate:.4f}",
        }
        for c, st in sorted(r.classes.items()):
            row[f"class {c} hit"] = f"{st.hit_rate:.4f}"
            row[f"class {c} evicted"] = st.evicted_blocks
        rows.append(row)
    return rows


def load_replay_requests(args: argparse.Namespace) -> tuple[list[ReplayRequest], str]:
    """The requests ``kvretain replay`` replays (a trace through the one trace schema, or the built-in
    workload) and a description of their source."""
    check_scale_and_limit(1.0, args.limit)
    if args.trace is None:
        sessions = args.sessions or DEFAULT_SESSIONS
        requests = synthetic_conversations(num_sessions=sessions, seed=args.seed)
        if args.limit is not None:
            requests = requests[: args.limit]
        return requests, f"built-in synthetic conversations ({sessions} sessions, seed {args.seed})"
    records = read_trace(args.trace, args.block_tokens, args.limit)
    # the rule sees the whole trace (a session rule such as ``longest`` ranks its conversations)
    rule = make_rule(args.priority_rule, records, random.Random(args.seed + 1))
    if rule is not None:
        records = tag_priorities(records, rule)
    return replay_requests(records), str(args.trace)


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector off for the block (restored after).

    NOTE: loading a trace builds hundreds of thousands of small objects that form no cycles (records, block
    keys, the hasher's tables); each collection would traverse them again (0.06-0.08 s of CPU on the
    conversation trace). Reference counting still frees everything as usual."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def cmd_replay(args: argparse.Namespace) -> int:
    with _no_cycle_collection():
        requests, source = load_replay_requests(args)
    # NOTE: and the loaded objects are left out of the collections the replays trigger (gc.freeze: they live as
    # long as the command; traversing them cost the replay another ~30 ms at 5,000 blocks)
    gc.freeze()
    try:
        return _replay_all(args, requests, source)
    finally:
        gc.unfreeze()


def _replay_all(args: argparse.Namespace, requests: Sequence[ReplayRequest], source: str) -> int:
    policies = policy_names() if args.policy == "all" else [args.policy]
    mapping = args.priority_mapping
    results = []
    for name in policies:
        t0 = time.perf_counter()
        res = replay(
            requests,
            args.capacity_blocks,
            name,
            policy_config(args, PolicyConfig(), args.block_tokens),
            mapping,
            args.block_tokens,
            progress=_progress(not args.json and not args.no_progress and sys.stderr.isatty(), name),
        )
        wall = time.perf_counter() - t0
        results.append((res, wall))
    if args.json:  # one object per line (JSON Lines), the same object whether one policy ran or all
        for res, wall in results:
            obj = res.to_json()
            obj["wall_s"] = round(wall, 3)
            print(json_text(obj))
    else:
        print(f"replay of {source}: {len(requests)} requests, {args.capacity_blocks} blocks")
        rows = _result_rows([r for r, _ in results])
        for row, (_, wall) in zip(rows, results, strict=True):
            row["wall_s"] = f"{wall:.2f}"
        cols = list(dict.fromkeys(k for row in rows for k in row))
        print(format_table(rows, cols))
        for res, _ in results:
            line = controller_line(res.policy_stats)
            if line is not None:
                print(f"{res.policy} {line}")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    policy_names()
    # (in one write, as `workload list`: a reader leaving after the first line must not race a later write)
    sys.stdout.write("".join(f"{name:10s} {doc}\n" for name, doc in POLICIES.describe().items()))
    return 0


CORE_COMMANDS = ("replay", "policies")
"""The commands this module defines; the others come from the modules named in the module docstring."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``command`` one of :data:`CORE_COMMANDS`, only those (the simulator's
    modules, which the other commands import, are not loaded: a replay starts faster)."""
    p = Parser(prog="kvretain", description="Priority-aware KV cache retention for LLM serving.")
    p.add_argument("--version", action="version", version=f"kvretain {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)

    r = sub.add_parser(
        "replay", help="block-level cache replay of a Mooncake-format trace (or a built-in workload)"
    )
    r.add_argument(
        "trace",
        nargs="?",
        type=trace_arg("a trace file, or omit it for the built-in workload"),
        help="Mooncake-format JSONL ('-': standard input; omit for the built-in synthetic workload)",
    )
    r.add_argument(
        "--capacity-blocks", type=integer(1), default=600, help="pool size in trace blocks (default 600)"
    )
    r.add_argument(
        "--policy", default="all", choices=[*policy_names(), "all"], help="eviction policy (default all)"
    )
    r.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per policy, one a line (JSON Lines; one object with one --policy)",
    )
    add_limit_option(r, "replay only the first N requests")
    r.add_argument(
        "--priority-rule",
        default="keep",
        choices=rule_choices(),
        help="how trace requests get a priority (keep: the trace's own field, default 0; the built-in "
        "workload sets its own)",
    )
    add_priority_mapping_option(r)
    add_block_tokens_option(r, MOONCAKE_BLOCK_TOKENS, "; the built-in workload: tokens per block")
    r.add_argument(
        "--sessions",
        type=integer(1),
        default=None,
        help=f"built-in workload (no TRACE): number of sessions (default {DEFAULT_SESSIONS})",
    )
    r.add_argument(
        "--seed",
        type=int,
        default=0,
        help="built-in workload: random seed (with a TRACE: the priority rule's, drawn from Random(seed + 1); "
        "default 0)",
    )
    r.add_argument(
        "--no-progress", action="store_true", help="no progress bar (none either when not a terminal)"
    )
    add_policy_options(
        r.add_argument_group(
            "unified's settings (core's PolicyConfig defaults, as simulate and the plugin; the plugin's run queue "
            "keeps no ghost table)"
        ),
        PolicyConfig(),
    )
    r.set_defaults(func=cmd_replay, check=check_replay)

    pol = sub.add_parser("policies", help="list the eviction policies")
    pol.set_defaults(func=cmd_policies)
    if command in CORE_COMMANDS:
        return p

    from kvretain.cli_profile import add_subcommands as add_profile_subcommands
    from kvretain.cli_sim import add_subcommands
    from kvretain.cli_workload import add_subcommands as add_workload_subcommands

    add_subcommands(sub)
    add_workload_subcommands(sub)
    add_profile_subcommands(sub)
    return p


class Terminated(BaseException):
    """SIGTERM (``kill``, ``timeout``, a CI job cancelled), raised like Ctrl-C's ``KeyboardInterrupt`` so that
    the same clean-up runs: no half-written output is left (:mod:`kvretain.fileio`)."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` within the block (the main thread only; the handler restored)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    with _sigterm_raises():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = "kvretain"
    args: argparse.Namespace | None = None

    def error(message: str) -> int:
        if getattr(args, "trace", None) == STDIN_PATH:  # (a trace of ``-``: "standard input", not /dev/stdin)
            message = stdin_named(message)
        return fail(prog, message)

    try:
        parser = build_parser(argv[0] if argv else None)
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version, or a bad option (already reported on one line)
            return exc.code if isinstance(exc.code, int) else 2
        # the words of the command, as argparse names them in its own errors ("kvretain workload export")
        words = [parser.prog, args.command, *filter(None, [getattr(args, "workload_command", None)])]
        prog = " ".join(words)
        check = getattr(args, "check", None)
        if check is not None:
            check(args)
        status = int(args.func(args))
        sys.stdout.flush()  # here, not at exit: a reader gone away is handled below, not reported by Python
        return status
    except BrokenPipeError:
        return stdout_closed()
    except (TraceError, RetentionError, ValueError, KeyError) as exc:
        return error(str(exc))
    except OSError as exc:  # a write that failed: a full disk, standard output on /dev/full, an I/O error
        if exc.filename is None:  # (standard output: the interpreter's last flush at exit would fail again)
            stdout_closed()
            return fail(prog, f"cannot write to standard output: {exc.strerror or exc}")
        return error(f"{exc.strerror or exc}: {exc.filename}")
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Terminated:  # SIGTERM: the same, the shell's status for it
        print(f"{prog}: terminated", file=sys.stderr)
        return 143


if __name__ == "__main__":
    raise SystemExit(main())
