"""Option types and the argument parser of the ``kvretain`` command line.

Each type checks one option's value when the command line is parsed, before anything runs: argparse then
names the option (``argument --priority-weight: ...``) and :class:`Parser` prints that as ONE line and exits
with status 2 (no usage block, no traceback). Ranges are the ones the library enforces (``PolicyConfig``,
``PriorityMapping``, ``parse_slos``): the types call those checks instead of repeating them where they can.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from kvretain.core.policy import MAX_FREQUENCY_CAP, MAX_GHOST_FACTOR, PolicyConfig
from kvretain.core.retention import (
    MAX_RETENTION_PRIORITY,
    MIN_RETENTION_PRIORITY,
    PriorityMapping,
    RetentionError,
)
from kvretain.fileio import standard_stream, written_in_place
from kvretain.workloads.mooncake import MOONCAKE_BLOCK_TOKENS


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``kvretain simulate: error: argument --x: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        """argparse ignores an ``OSError`` writing ``--help`` or ``--version``, so ``--help >/dev/full`` printed
        nothing and exited 0. To standard output it is now reported as any command's output is: a reader gone
        away ends it quietly with :data:`STDOUT_CLOSED`, another failure is one line and status 2. Messages to
        standard error (a usage error) stay best effort, as :func:`fail`'s: the status says what happened."""
        if not message or (file is not None and file is not sys.stdout):
            super()._print_message(message, file)
            return
        try:
            sys.stdout.write(message)
            sys.stdout.flush()
        except BrokenPipeError:
            sys.exit(stdout_closed())
        except OSError as exc:
            stdout_closed()
            self.exit(2, f"{self.prog}: error: cannot write to standard output: {exc.strerror or exc}\n")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` that shows each option's default, as ``ArgumentDefaultsHelpFormatter`` does, unless its help
    already says it (the word ``default``) or there is none to show (``None``, a flag): a list as ``a,b,c``,
    a float as ``%g``, an empty list or string as ``none``."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if (
            "default" in text
            or d is None
            or d is argparse.SUPPRESS
            or action.nargs == 0
            or not action.option_strings
        ):
            return text
        shown = (
            ",".join(map(str, d))
            if isinstance(d, list | tuple)
            else f"{d:g}"
            if isinstance(d, float)
            else str(d)
        )
        return f"{text} (default: {shown.replace('%', '%%') or 'none'})"


class RawDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`DefaultsHelpFormatter` that keeps the description's line breaks (a script's whole docstring)."""


def summary_of(doc: str | None) -> str:
    """A script's ``--help`` description: its docstring's first paragraph as one line (a first line cut at the
    docstring's wrap would end mid-sentence)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


class SubcommandParser(Parser):
    """A subcommand's parser (``add_subparsers(parser_class=SubcommandParser)``; theirs are of its class too):
    it refuses the arguments it does not know itself, naming its own command and help (argparse hands them up
    to the top-level parser, whose error named ``kvretain --help``, where the subcommand's options are not)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def integer(lo: int, hi: int | None = None, what: str = "") -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (``hi=None``: no upper bound); ``1e6`` is accepted for 1000000."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            f = _number(text)
            if not (math.isfinite(f) and f.is_integer()):
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
            value = int(f)
        if value < lo or (hi is not None and value > hi):
            rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be an integer {rng}{what}, got {text}")
        return value

    parse.__name__ = "integer"
    return parse


def number(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, what: str = ""
) -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        value = _number(text)
        ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
        if not ok:
            left = "(" if lo_open else "["
            rng = f"> {lo:g}" if lo_open and hi == math.inf else f">= {lo:g}" if hi == math.inf else ""
            rng = rng or f"in {left}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number {rng}{what}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def share(text: str) -> float:
    """A share in [0, 1]."""
    return number(0.0, 1.0)(text)


def goal_share(text: str) -> float | None:
    """``--isolation-goal``: a share in [0, 1], or ``none`` (as ``0``, and as the plugin's ``isolation_goal=none``):
    no goal, the protected share fixed at the budget."""
    if text.strip().lower() in ("none", "null", "off"):
        return None
    return share(text)


def priority_mapping(text: str) -> PriorityMapping:
    """``normal=0,step=10,base=35`` or a table ``0:60,1:35`` (``""``: the default mapping)."""
    try:
        return PriorityMapping.parse(text)
    except RetentionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def slo_spec(text: str) -> str:
    """``class=ttft_s:tpot_s,...``: at least one class, each target a positive number (``inf``: none)."""
    from kvretain.engine.sim.metrics import parse_slos

    try:
        slos = parse_slos(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not slos:
        raise argparse.ArgumentTypeError(f"expected 'class=ttft_s:tpot_s,...' (e.g. '0=2:0.1'), got {text!r}")
    return text


def names_of(
    registry_names: Callable[[], list[str]], kind: str, listed: Callable[[], list[str]] | None = None
) -> Callable[[str], list[str]]:
    """A comma-separated, non-empty list of distinct registered names (checked before anything runs). ``listed``:
    the names an error offers, when not all of them (a name accepted but not offered is refused later, with its
    reason: compare's belady, an offline oracle)."""

    def parse(text: str) -> list[str]:
        names = [p.strip() for p in text.split(",") if p.strip()]
        accepted = registry_names()
        known = accepted if listed is None else listed()
        if not names:
            raise argparse.ArgumentTypeError(
                f"expected at least one {kind} (comma-separated), got {text!r}; choose from: {', '.join(known)}"
            )
        bad = [n for n in names if n not in accepted]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad[0]!r}; choose from: {', '.join(known)}")
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{kind} listed twice in {text!r}")
        return names

    parse.__name__ = "names"
    return parse


def shares(text: str) -> list[float]:
    """A comma-separated, non-empty list of distinct shares in [0, 1]."""
    values = [
        share(p.strip()) + 0.0 for p in text.split(",") if p.strip()
    ]  # (+ 0.0: -0 is 0, as labels print it)
    if not values:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated shares in [0, 1] such as 0.2,0.8, got {text!r}"
        )
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a budget is listed twice in {text!r}")
    return values


def check_distinct(values: Iterable[Any], option: str) -> None:
    """A ``ValueError`` naming ``option`` when a value of a list option (``--capacities 16 16``) is given twice:
    each value is a run whose results are keyed by it, so a repeat would run twice and show (or keep) one."""
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"argument {option}: {v} is given twice")
        seen.add(v)


def path_arg(kind: str) -> Callable[[str], str]:
    """A path option's value, refused when empty: ``Path("")`` is the current folder, so an unset shell variable
    (``--model "$MODEL"``) would quietly mean ``.`` or fall back to a default. ``kind``: what to pass instead."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"an empty path (pass {kind})")
        return text

    parse.__name__ = "path"
    return parse


STDIN_PATH = "/dev/stdin"
"""What a trace argument of ``-`` reads: standard input (a pipe, or the file the shell redirected into it)."""


_STDIN_AT_LINE = re.compile(rf"{re.escape(STDIN_PATH)}:(\d+):")
_STDIN_NAMED = re.compile(rf"'{re.escape(STDIN_PATH)}'|{re.escape(STDIN_PATH)}(?![\w/])")


def stdin_named(message: str) -> str:
    """``message`` (an error about a trace read from standard input) with :data:`STDIN_PATH`, a path the user
    never typed, named "standard input" ("standard input, line 2: ..."): ``cat t.jsonl | kvretain replay -`` said
    "/dev/stdin:2: not valid JSON"."""
    return _STDIN_NAMED.sub("standard input", _STDIN_AT_LINE.sub(r"standard input, line \1:", message))


def trace_arg(kind: str) -> Callable[[str], str]:
    """A trace file argument (:func:`path_arg`), ``-`` being standard input, as ``workload export --out -`` is
    standard output: ``kvretain workload export multi-tenant --out - | kvretain replay -``."""
    path = path_arg(kind)

    def parse(text: str) -> str:
        return STDIN_PATH if text == "-" else path(text)

    parse.__name__ = "trace"
    return parse


def check_output_file(path: str, option: str) -> None:
    """Raise a ``ValueError`` naming ``option`` unless ``path`` can be written as a file: checked before a
    command runs, so that a long run does not end in an error (or a traceback) when it writes its output."""
    if not path:
        raise ValueError(f"argument {option}: an empty path (pass a file name)")
    p = Path(path)
    if standard_stream(p) is not None:
        return  # written through the open descriptor (fileio.output_file): nothing is opened by its name
    if written_in_place(p):
        # written in place (a named pipe, a device: fileio.replaced), not beside it: its folder need not be
        # writable
        if not os.access(p, os.W_OK):
            raise ValueError(f"argument {option}: cannot write {path!r}: permission denied")
        return
    if p.is_dir():
        raise ValueError(f"argument {option}: cannot write {path!r}: it is a folder (pass a file name)")
    folder = p.parent
    if not folder.is_dir():
        why = "is a file" if folder.exists() else "does not exist"
        raise ValueError(f"argument {option}: cannot write {path!r}: folder {str(folder)!r} {why}")
    if not os.access(folder, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"argument {option}: cannot write {path!r}: permission denied")
    try:  # (what the write will do: a file beside it, renamed; /proc and /sys refuse it, root or not)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{p.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise ValueError(f"argument {option}: cannot write {path!r}: {exc.strerror or exc}") from None


def check_other_file(path: str, option: str, other: str, what: str, why: str) -> None:
    """A ``ValueError`` naming ``option`` when ``path`` is the file ``other`` names (``--plot`` and ``--out`` one
    file, by any spelling: ``./x``, a link): one output would replace the other. ``what``: what ``other`` is,
    with its option (``"the cost model's own file (--out)"``); ``why``: what would be lost."""
    if os.path.realpath(path) == os.path.realpath(other):
        raise ValueError(f"argument {option}: {path!r} is {what}: {why}; give one of them another name")


VLLM_PYTHON = ".venv-vllm/bin/python"
"""The interpreter of the environment that has vLLM (and PyTorch), as the bench scripts that need it name it."""


def missing_module(modules: Iterable[str], needed_by: str) -> str | None:
    """``None`` when this python can import each of ``modules`` (top-level names), else the message of the first
    it cannot: ``{needed_by} needs vllm, not importable by this python (...)``. Looked up (``find_spec``), not
    imported: checked before a script's first long step, at no cost (importing vLLM takes seconds)."""
    import importlib.util

    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{needed_by} needs {name}, not importable by this python ({sys.executable}; use {VLLM_PYTHON})"
    return None


STDOUT_CLOSED = 141
"""The exit status when stdout's reader went away (``kvretain workload export multi-tenant --out - | head -1``;
not ``kvretain workload list | head -1``, whose few lines are in the pipe before ``head`` leaves): 128 + SIGPIPE, what
a shell reports for a program SIGPIPE ended (``yes | head -1``), as Ctrl-C's 130 and SIGTERM's 143 are the
shell's statuses for those signals. Not 0: the output was cut short, and ``set -o pipefail`` should see it."""


def stdout_closed() -> int:
    """stdout's reader went away: no message (a shell prints none for SIGPIPE) and stdout pointed at the null
    device, so that the interpreter's last flush at exit does not fail again (Python would print "Exception
    ignored ... BrokenPipeError"); returns :data:`STDOUT_CLOSED`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (
        OSError,
        ValueError,
    ):  # stdout with no file descriptor (captured, replaced): nothing to flush at exit
        pass
    return STDOUT_CLOSED


def script_main(main: Callable[[], int | None]) -> int:
    """A bench script's exit status from its ``main()``, as the ``kvretain`` command ends (``cli.main``): a
    reader of standard output that went away (``bench/draws.py | head -3``) ends it quietly with
    :data:`STDOUT_CLOSED`, no ``BrokenPipeError`` traceback; Ctrl-C with one line and 130, no
    ``KeyboardInterrupt`` traceback. ``raise SystemExit(script_main(main))``."""
    try:
        status = main()
        sys.stdout.flush()  # here, not at exit: a reader gone away is handled below, not reported by Python
    except BrokenPipeError:
        return stdout_closed()
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT, as the kvretain command
        with contextlib.suppress(OSError, ValueError):
            print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr)
        return 130
    return int(status or 0)


def fail(prog: str, message: str) -> int:
    """Print a user error as one line (as :class:`Parser` does) and return the exit status 2 (also when standard
    error cannot be written: the status still says what happened)."""
    with contextlib.suppress(OSError, ValueError):
        print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def printable(text: str) -> str:
    """``text`` safe to write as UTF-8 (a text file, standard output): a file name that is not valid UTF-8 holds
    its undecodable bytes as surrogates (``os.fsdecode``), which strict UTF-8 refuses; each becomes ``\\udcXX``,
    as standard error shows it, instead of a ``UnicodeEncodeError`` after the work is done."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_text(obj: Any, indent: int | None = None) -> str:
    """``obj`` as JSON text for a command's ``--json`` output or a JSON file it writes. A number JSON cannot hold
    (``inf``, ``nan``: ``json.dumps`` would write ``Infinity`` / ``NaN``, which no JSON parser reads) is a
    ``ValueError`` naming the first such field (one line, exit status 2), not invalid output."""
    try:
        return json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError:
        where, value = _non_finite(obj, "")
        raise ValueError(
            f"cannot write the results as JSON: {where or 'a value'} is {value} (not a finite number)"
        ) from None


def _non_finite(obj: Any, where: str) -> tuple[str, str]:
    """The path (``classes.0.ttft_mean_s``) and value of the first non-finite float in ``obj``."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where, repr(obj)
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if where else str(k))
        if found[1]:
            return found
    return where, ""


def option_error(exc: ValueError, fields: Iterable[str]) -> str:
    """``exc``'s message (from a config built after parsing) prefixed by the options of the ``fields`` it names
    first: ``priority_weight and frequency_exponent: ...`` -> ``argument --priority-weight/--frequency-exponent``."""
    msg = str(exc)
    known = set(fields)
    named = ["--" + w.replace("_", "-") for w in msg.replace(":", " ").split()[:3] if w in known]
    return f"argument {'/'.join(named)}: {msg}" if named else msg


def add_limit_option(p: argparse._ActionsContainer, what: str = "only the first N requests") -> None:
    """``--limit``: one option for ``replay``, ``simulate``, ``compare`` and ``workload export`` (a positive
    integer; ``1e3`` reads as 1000 everywhere)."""
    p.add_argument("--limit", type=integer(1), default=None, help=what)


MAX_BLOCK_TOKENS = 65536
"""The largest KV block, in tokens, a command takes (``--block-size``, ``--block-tokens``): 16 is vLLM's
default and hybrid layouts (Mamba in align mode) reach a few thousand; the simulator keeps per-token work per block
(a decode run's cache entries), so a block of 10^8 tokens ran for minutes before this bound."""


def add_block_tokens_option(p: argparse._ActionsContainer, default: int | None, what: str) -> None:
    """``--block-tokens``: tokens per hash id of a Mooncake-format trace (:data:`MOONCAKE_BLOCK_TOKENS` in the
    published traces), one option for ``replay``, ``simulate``, ``compare`` (reading) and ``workload export``
    (writing); the trace reader's errors point at it. ``what``: the rest of its help."""
    p.add_argument(
        "--block-tokens",
        type=integer(1, MAX_BLOCK_TOKENS),
        default=default,
        help=f"tokens per trace hash id (default {MOONCAKE_BLOCK_TOKENS}, as in Mooncake's traces){what}",
    )


POLICY_OPTION_USERS = {
    "frequency_cap": ("unified", "lfu"),
    "ghost_factor": ("unified", "lfu"),
    "priority_mapping": ("unified", "priority"),
}
"""The policies other than ``unified`` that read one of :func:`add_policy_options`' settings or
``--priority-mapping`` (the rest: ``unified`` only; the others order blocks without retention priorities)."""


def add_priority_mapping_option(p: argparse._ActionsContainer) -> None:
    """``--priority-mapping``, one option for ``replay``, ``simulate`` and ``compare``: read by the policies that
    order by retention priority (:data:`POLICY_OPTION_USERS`; refused for the others by
    :func:`check_policy_options_used`)."""
    p.add_argument(
        "--priority-mapping",
        action=_Given,
        type=priority_mapping,
        default="",
        help="unified and priority: request priority -> retention priority, 'normal=0,step=10,base=35' "
        "(default: 0 -> 35, 1 -> 25, 2 -> 15) or a table '0:60,1:35'",
    )


class _Given(argparse.Action):
    """Stores the value and notes that the option was given (:func:`check_policy_options_used`)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        given = dict(getattr(namespace, "policy_options_given", None) or {})
        given[self.dest] = option_string
        namespace.policy_options_given = given


def check_policy_options_used(
    args: argparse.Namespace,
    policies: Iterable[str],
    flag: str,
    only: Iterable[str] | None = None,
    why: str = "",
) -> None:
    """A ``ValueError`` naming the first of :func:`add_policy_options`' options given on the command line that
    none of ``policies`` reads (it would be ignored silently); ``only``: check these settings (dests) alone, the
    others being read anyway (``why`` says by what)."""
    names = list(policies)
    for dest, option in (getattr(args, "policy_options_given", None) or {}).items():
        if only is not None and dest not in only:
            continue
        users = POLICY_OPTION_USERS.get(dest, ("unified",))
        if not any(p in users for p in names):
            raise ValueError(
                f"argument {option}: a setting of {' and '.join(users)}, not read by {flag} {','.join(names)}{why}"
            )


def add_policy_options(group: argparse._ActionsContainer, d: PolicyConfig) -> None:
    """``unified``'s settings as options, one set for ``replay``, ``simulate`` and ``compare`` (defaults from
    ``d``, the core's :class:`~kvretain.core.policy.PolicyConfig`, as the vLLM plugin's
    ``KVRETAIN_POLICY_OPTIONS``); :func:`policy_config` reads them back."""
    group.add_argument(
        "--budget",
        action=_Given,
        type=share,
        default=d.budget,
        help=f"unified: largest protected share of the pool, 0..1 (default {d.budget:g})",
    )
    group.add_argument(
        "--isolation-goal",
        action=_Given,
        type=goal_share,
        default=d.isolation_goal,
        help="unified: adapt the protected share to keep this fraction of the isolated hit ratio, 0..1 "
        f"(0 or none: fixed budget; default {d.isolation_goal or 'none'})",
    )
    group.add_argument(
        "--max-reuse-loss",
        action=_Given,
        type=share,
        default=d.max_reuse_loss,
        help="unified: the adaptive share keeps overall reuse at least 1 - this of what plain LRU would hit "
        f"(measured online), 0..1 (default {d.max_reuse_loss:g})",
    )
    group.add_argument(
        "--protect-threshold",
        action=_Given,
        type=integer(MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY, " (a retention priority)"),
        default=d.protect_threshold,
        help="unified: retention priority from which blocks are protected, 0..100 "
        f"(default {d.protect_threshold}: request priority 0)",
    )
    group.add_argument(
        "--priority-weight",
        action=_Given,
        type=number(1.0, what=" (1: no bias)"),
        default=d.priority_weight,
        help=f"unified: a block's value x this per +10 retention points, >= 1 (default {d.priority_weight:g})",
    )
    group.add_argument(
        "--frequency-exponent",
        action=_Given,
        type=number(0.0, what=" (0: frequency off)"),
        default=d.frequency_exponent,
        help=f"unified: value grows as uses ** this, >= 0 (default {d.frequency_exponent:g})",
    )
    group.add_argument(
        "--frequency-cap",
        action=_Given,
        type=integer(1, MAX_FREQUENCY_CAP, " (a count of uses)"),
        default=d.frequency_cap,
        help=f"unified, lfu: uses counted up to this many, 1..{MAX_FREQUENCY_CAP} (default {d.frequency_cap})",
    )
    group.add_argument(
        "--no-adapt-frequency",
        dest="adapt_frequency",
        action=_Given,
        nargs=0,
        const=False,
        default=d.adapt_frequency,
        help="unified: keep the frequency exponent fixed (default: it moves between recency and frequency by "
        "which would hit more)",
    )
    group.add_argument(
        "--cost-scale-tokens",
        action=_Given,
        type=number(0.0),
        default=d.cost_scale_tokens,
        help=f"unified: recompute-cost depth scale in tokens, 0 (off) or >= 1 (default {d.cost_scale_tokens:g})",
    )
    group.add_argument(
        "--ghost-factor",
        action=_Given,
        type=number(0.0, MAX_GHOST_FACTOR),
        default=d.ghost_factor,
        help="unified, lfu: evicted blocks whose use counts are remembered, x the pool "
        f"(default {d.ghost_factor:g})",
    )


def policy_config(args: argparse.Namespace, d: PolicyConfig, block_size: int) -> PolicyConfig:
    """The :class:`~kvretain.core.policy.PolicyConfig` of :func:`add_policy_options`' options (raises the
    config's ``ValueError`` for settings that are wrong together)."""
    return replace(
        d,
        budget=args.budget,
        isolation_goal=args.isolation_goal,
        max_reuse_loss=args.max_reuse_loss,
        protect_threshold=args.protect_threshold,
        priority_weight=args.priority_weight,
        frequency_exponent=args.frequency_exponent,
        frequency_cap=args.frequency_cap,
        adapt_frequency=args.adapt_frequency,
        cost_scale_tokens=args.cost_scale_tokens,
        ghost_factor=args.ghost_factor,
        block_size=block_size,
    )
