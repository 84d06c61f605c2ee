"""Retention API: request priority, retention directives and the mapping between them.

Two notions of priority meet here:

* **request priority** (vLLM): an ``int``, LOWER = MORE important, default 0. It orders scheduling.
* **retention priority** (TensorRT-LLM ``KvCacheRetentionConfig``, vLLM RFC #37003): ``0..100``, HIGHER = kept
  longer, default 35, optionally with a duration (seconds) after which it lapses (TensorRT-LLM: back to 35;
  here back to the request's mapped priority, 35 at vLLM's default priority 0, and under ``unified`` to the
  highest mapped priority among the block's users).

A :class:`RetentionConfig` carries the per-request directives (token ranges of the prompt with a priority and
an optional duration), a decode priority/duration for generated tokens, and an optional retention *scope*
(an owner id such as a session). :class:`PriorityMapping` turns a request priority into the retention priority
that applies where no directive says otherwise. :meth:`RetentionConfig.block_plan` resolves everything into
one ``(priority, duration)`` pair per KV block, which is what the block pool and the policies see.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MIN_RETENTION_PRIORITY = 0
MAX_RETENTION_PRIORITY = 100
DEFAULT_RETENTION_PRIORITY = 35
"""TensorRT-LLM's default retention priority (where a lapsed duration reverts a block there); here what vLLM's
default request priority 0 maps to, where a lapse reverts a block to its users' mapped priority."""
MAX_DIRECTIVES = 1024
"""The most retention directives one request (or trace line) may carry: a trace's ``retention``, the vLLM
plugin's ``retention_directives`` (the engine refuses more) and the access limits' ceiling.

NOTE: a directive's effect is per KV block, so more directives than blocks in a prompt change nothing; 1024
covers a 32k-token prompt at vLLM's 32-token CPU blocks (and 16k at 16). Parsing 10^5 directives costs about a
second of CPU, which a client could repeat at will (real requests carry a handful)."""


class RetentionError(ValueError):
    """Invalid retention input. The message names the field and how to fix it."""


def show_value(value: object) -> str:
    """``repr(value)``, shortened: error messages quote what the user gave without echoing a huge value (nor
    failing on one: an integer of more digits than ``str`` converts, ``sys.get_int_max_str_digits()``)."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"<an integer of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} that cannot be shown>"
    return text if len(text) <= 40 else f"{shortened(text)} ({len(text)} characters)"


def shortened(text: str) -> str:
    """``text``, or its ends around ``...`` when longer than 40 characters (:func:`show_value`'s rule)."""
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]}"


def _check_int(value: object, where: str, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetentionError(f"{where}: {name} must be {what}, got {show_value(value)}")
    return value


def check_request_priority(value: object, where: str = "request priority") -> int:
    """``value`` as a request priority (an integer, lower = more important; a bool is refused): a
    ``TypeError`` that starts with ``where`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{where} must be an integer (lower = more important, default 0), got {show_value(value)}"
        )
    return value


def check_priority(value: object, where: str, name: str = "priority") -> int:
    """``value`` as a retention priority (an integer in [0, 100]); errors start with ``where``, and their
    example names the field ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RetentionError(
            f"{where}: priority must be an integer in [0, 100], got {show_value(value)}; pass e.g. {name}=80"
        )
    if not MIN_RETENTION_PRIORITY <= value <= MAX_RETENTION_PRIORITY:
        raise RetentionError(
            f"{where}: priority {show_value(value)} is out of range; use an integer in [0, 100]"
        )
    return value


def check_duration(value: object, where: str, name: str = "duration_s", per_second: int = 1) -> float | None:
    """Seconds from a duration given as ``name`` in units of ``1 / per_second`` s; errors quote ``name`` and
    the value as given."""
    if value is None:
        return None
    unit = "seconds" if per_second == 1 else "milliseconds"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RetentionError(
            f"{where}: {name} must be a number of {unit} or null, got {show_value(value)}; "
            f"pass e.g. {name}={30 * per_second} or omit it to retain without expiry"
        )
    try:
        v = float(value) / per_second
    except OverflowError:
        raise RetentionError(
            f"{where}: {name} {show_value(value)} is too large for a number of {unit}; "
            "omit it (null) to retain without expiry"
        ) from None
    if math.isnan(v) or v < 0:
        raise RetentionError(
            f"{where}: {name} must be >= 0 {unit}, got {show_value(value)}; use a non-negative number"
        )
    return v


@dataclass(frozen=True, slots=True)
class RetentionDirective:
    """Retention priority for prompt tokens ``[start, end)`` (``end=None``: to the end of the prompt).

    Compatible with RFC #37003 ``{start, end, priority, duration}`` and TensorRT-LLM's
    ``TokenRangeRetentionConfig(token_start, token_end, priority, duration_ms)``.
    """

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        where = "retention directive"
        start = _check_int(self.start, where, "start", "a non-negative token index")
        if start < 0:
            raise RetentionError(
                f"{where}: start must be a non-negative token index, got {show_value(start)}"
            )
        if self.end is not None:
            end = _check_int(self.end, where, "end", "a token index or null")
            if end <= start:
                raise RetentionError(
                    f"{where}: start ({show_value(start)}) must be before end ({show_value(end)}); "
                    "use end > start, or end=null for 'to the end of the prompt'"
                )
        check_priority(self.priority, where)
        object.__setattr__(self, "duration_s", check_duration(self.duration_s, where))

    def covers(self, lo: int, hi: int) -> bool:
        """True when the directive overlaps tokens ``[lo, hi)``."""
        return self.start < hi and (self.end is None or self.end > lo)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], index: int = 0) -> RetentionDirective:
        """Parse one directive; accepts RFC (``duration``), kvretain (``duration_s``) and TRT-LLM
        (``token_start``/``token_end``/``duration_ms``) spellings."""
        where = f"retention_directives[{index}]"
        if not isinstance(raw, Mapping):
            raise RetentionError(
                f"{where}: expected an object {{start, end, priority, duration_s}}, got {show_value(raw)}"
            )
        unknown = [k for k in raw if k not in _DIRECTIVE_FIELDS]
        if unknown:
            names = sorted(show_value(k) for k in unknown)
            raise RetentionError(
                f"{where}: unknown field(s) [{', '.join(names)}]; allowed: start, end, priority, duration_s "
                "(or RFC #37003's duration, TensorRT-LLM's token_start, token_end, duration_ms)"
            )
        for spellings in _ALIASES:
            given = [k for k in spellings if k in raw]
            if len(given) > 1:
                raise RetentionError(
                    f"{where}: {' and '.join(given)} are two spellings of one field; give only one"
                )
        if "priority" not in raw:
            raise RetentionError(f"{where}: missing field 'priority' (an integer in [0, 100])")
        start = raw.get("start", raw.get("token_start", 0))
        end = raw.get("end", raw.get("token_end"))
        name = next((k for k in _ALIASES[2] if k in raw), "duration_s")
        try:
            duration = check_duration(raw.get(name), where, name, 1000 if name == "duration_ms" else 1)
            return cls(start=start, end=end, priority=raw["priority"], duration_s=duration)
        except RetentionError as exc:
            msg = str(exc).replace("retention directive", where, 1)
            if "token_start" in raw:
                msg = msg.replace(": start ", ": token_start ", 1)
            if "token_end" in raw:
                msg = msg.replace(": end ", ": token_end ", 1).replace(
                    " before end (", " before token_end (", 1
                )
            raise RetentionError(msg) from None

    def to_dict(self) -> dict[str, Any]:
        """The raw form :meth:`from_dict` reads back (a trace line's directive, RFC #37003's fields)."""
        return {
            "start": self.start,
            "end": self.end,
            "priority": self.priority,
            "duration_s": self.duration_s,
        }


_ALIASES = (("start", "token_start"), ("end", "token_end"), ("duration_s", "duration", "duration_ms"))
"""The spellings of each directive field: kvretain's, RFC #37003's, TensorRT-LLM's."""
_DIRECTIVE_FIELDS = frozenset({"priority", *(k for names in _ALIASES for k in names)})


@dataclass(frozen=True, slots=True)
class PriorityMapping:
    """Maps a request priority (lower = more important) to a retention priority (higher = kept longer).

    ``retention = clamp(base + step * (normal - priority), 0, 100)`` unless ``table`` names the priority.
    With the defaults (``normal=0``, ``step=10``, ``base=35``), vLLM's default priority 0 gets TensorRT-LLM's
    default retention 35; priority 1 gets 25, 2 gets 15, -1 gets 45, and so on. Workloads whose "normal"
    traffic is not priority 0 (e.g. classes 0 = important, 1 = the rest) set ``normal`` to that class.
    """

    normal: int = 0
    step: int = 10
    base: int = DEFAULT_RETENTION_PRIORITY
    table: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        where = "priority mapping"
        _check_int(self.normal, where, "normal", "an integer (the request priority that maps to base)")
        _check_int(self.step, where, "step", "an integer (retention points per request-priority level)")
        check_priority(self.base, "priority mapping base")
        if self.step < 0:
            raise RetentionError(
                "priority mapping step must be >= 0 (lower request priority = more important)"
            )
        raw = self.table
        if isinstance(raw, Mapping):
            raw = tuple(raw.items())
        if isinstance(raw, str | bytes) or not isinstance(raw, Iterable):
            raise RetentionError(
                f"{where}: table must be (request_priority, retention) pairs, got {show_value(raw)}"
            )
        table: list[tuple[int, int]] = []
        for entry in raw:
            if not isinstance(entry, tuple | list) or len(entry) != 2:
                raise RetentionError(
                    f"{where}: table entry {show_value(entry)} must be a (request_priority, retention) pair"
                )
            prio = _check_int(entry[0], where, "a table's request priority", "an integer")
            if not -(2**63) <= prio < 2**63:
                raise RetentionError(
                    f"{where}: request priority {show_value(prio)} is outside the 64-bit integers request "
                    "priorities are (vLLM's, a trace's): no request could have it"
                )
            if any(prio == p for p, _ in table):
                raise RetentionError(
                    f"{where}: request priority {show_value(prio)} appears twice in the table"
                )
            ret = check_priority(
                entry[1], f"priority mapping table entry for request priority {show_value(prio)}"
            )
            table.append((prio, ret))
        object.__setattr__(self, "table", tuple(table))

    def retention_for(self, request_priority: int) -> int:
        """The retention priority of requests of ``request_priority`` (an ``int``; a bool or anything else is a
        ``TypeError``)."""
        if type(request_priority) is not int:
            check_request_priority(request_priority)
        for prio, ret in self.table:
            if prio == request_priority:
                return ret
        value = self.base + self.step * (self.normal - request_priority)
        return max(MIN_RETENTION_PRIORITY, min(MAX_RETENTION_PRIORITY, value))

    def _linear_within_from(self, cap: int) -> float:
        """Where the formula's retentions (priorities the table does not name) are within ``cap``: from this
        priority up (``-inf``: all of them, ``inf``: none). The formula does not increase with the priority."""
        if self.step == 0:
            within = max(MIN_RETENTION_PRIORITY, min(MAX_RETENTION_PRIORITY, self.base)) <= cap
            return -math.inf if within else math.inf
        if cap >= MAX_RETENTION_PRIORITY:
            return -math.inf
        # base + step * (normal - p) <= cap  <=>  p >= normal - floor((cap - base) / step)
        return self.normal - (cap - self.base) // self.step

    def most_important_within(self, cap: int, at_least: int | None = None) -> int | None:
        """The most important (lowest) request priority, ``at_least`` or less important when given, whose
        retention is at most ``cap`` (an API key's retention cap); ``None`` when there is none below which
        every priority fails (no ``at_least`` and the formula is within ``cap`` all the way down). Raises
        :class:`RetentionError` when no such priority exists. Exact: the formula's threshold, then the table's
        finitely many exceptions."""
        table = dict(self.table)
        lin = self._linear_within_from(cap)
        found: list[int] = [p for p, r in table.items() if r <= cap and (at_least is None or p >= at_least)]
        if lin == -math.inf and at_least is None:
            return None
        if lin != math.inf:
            p = int(lin) if at_least is None else max(at_least, int(lin) if lin != -math.inf else at_least)
            while p in table:  # (the table's own entries are in ``found`` when within)
                p += 1
            found.append(p)
        if not found:
            at = "" if at_least is None else f" at {at_least} or above"
            raise RetentionError(f"no request priority{at} maps to a retention priority of at most {cap}")
        return min(found)

    def nearest_within(self, cap: int, request_priority: int, at_least: int | None = None) -> int:
        """The request priority nearest ``request_priority`` (``at_least`` or above when given; the less
        important one on a tie) whose retention is at most ``cap``: where a retention cap moves a request it
        does not allow. Raises :class:`RetentionError` when there is none."""
        prio = request_priority if at_least is None else max(request_priority, at_least)
        try:
            up: int | None = self.most_important_within(cap, prio)
        except RetentionError:
            up = None
        if up == prio:
            return prio
        table = dict(self.table)
        lowest = -math.inf if at_least is None else at_least
        downs = [p for p, r in table.items() if r <= cap and lowest <= p < prio]
        start = max(lowest, self._linear_within_from(cap))
        p = prio - 1
        while p >= start and p in table:
            p -= 1
        if p >= start:
            downs.append(p)
        down = max(downs) if downs else None
        if up is None and down is None:
            raise RetentionError(f"no request priority maps to a retention priority of at most {cap}")
        if down is None or (up is not None and up - prio <= prio - down):
            return up  # type: ignore[return-value]
        return down

    @classmethod
    def parse(cls, spec: str) -> PriorityMapping:
        """Parse ``"normal=1,step=10,base=35"``, a table ``"0:80,1:35,2:10"``, or both (the formula then gives
        the priorities the table does not list), in any order (``""``: the default)."""
        if not isinstance(spec, str):
            raise RetentionError(
                f"priority mapping must be a string such as 'normal=0,step=10,base=35' or '0:80,1:35', "
                f"got {show_value(spec)}"
            )
        if not spec.strip():
            return cls()
        entries: list[tuple[int, int]] = []
        kwargs: dict[str, int] = {}
        for part in spec.split(","):
            if ":" in part:
                k, _, v = part.partition(":")
                try:
                    entries.append((int(k), int(v)))
                except ValueError:
                    raise RetentionError(
                        f"priority mapping entry {show_value(part)}: expected 'request_priority:retention_priority' "
                        "(integers)"
                    ) from None
                continue
            k, _, v = part.partition("=")
            if k.strip() not in ("normal", "step", "base"):
                raise RetentionError(
                    f"priority mapping key {show_value(k)}: use normal=, step=, base= or a table entry "
                    "'request_priority:retention_priority'"
                )
            if k.strip() in kwargs:
                raise RetentionError(f"priority mapping key {k.strip()!r} appears twice")
            try:
                kwargs[k.strip()] = int(v)
            except ValueError:
                raise RetentionError(
                    f"priority mapping {k.strip()}={show_value(v)}: expected an integer"
                ) from None
        return cls(
            normal=kwargs.get("normal", 0),
            step=kwargs.get("step", 10),
            base=kwargs.get("base", DEFAULT_RETENTION_PRIORITY),
            table=tuple(entries),
        )


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Per-request retention: prompt ranges, decode priority/duration and an optional owner scope.

    ``decode_priority=None`` means "as the request priority maps"; TensorRT-LLM's default would be 35.
    Ranges may not overlap. Where no directive covers a block, the request priority's mapping applies.
    """

    directives: tuple[RetentionDirective, ...] = ()
    decode_priority: int | None = None
    decode_duration_s: float | None = None
    scope: str | None = None

    def __post_init__(self) -> None:
        raw = self.directives
        if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Iterable):
            raise RetentionError(
                f"retention directives must be a list of RetentionDirective or objects, got {show_value(raw)}"
            )
        directives = tuple(
            d if isinstance(d, RetentionDirective) else RetentionDirective.from_dict(d, i)
            for i, d in enumerate(raw)
        )
        if self.decode_priority is not None:
            check_priority(self.decode_priority, "decode_priority", "decode_priority")
        object.__setattr__(
            self,
            "decode_duration_s",
            check_duration(self.decode_duration_s, "retention config", "decode_duration_s"),
        )
        if self.scope is not None and not isinstance(self.scope, str):
            raise RetentionError(f"retention_scope must be a string, got {show_value(self.scope)}")
        if self.scope == "":  # (an owner id every request sending it would share: any could lower another's)
            raise RetentionError(
                "retention_scope must be a non-empty string (an owner id such as a session), got ''; "
                "omit it for no scope"
            )
        ordered = sorted(directives, key=lambda d: d.start)
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.end is None or a.end > b.start:
                raise RetentionError(
                    f"retention directives overlap: [{a.start}, {a.end}) and [{b.start}, {b.end}); "
                    "make the ranges disjoint (end of one <= start of the next)"
                )
        object.__setattr__(self, "directives", tuple(ordered))

    @classmethod
    def from_request_fields(
        cls,
        directives: Iterable[Mapping[str, Any]] | None = None,
        scope: str | None = None,
        decode_priority: int | None = None,
        decode_duration_s: float | None = None,
    ) -> RetentionConfig:
        """Build from the JSON fields of a request (``retention_directives``, ``retention_scope``...)."""
        if directives is not None and (
            isinstance(directives, str | bytes | Mapping) or not isinstance(directives, Iterable)
        ):
            raise RetentionError(
                f"retention_directives must be a list of objects, got {show_value(directives)}"
            )
        parsed = tuple(RetentionDirective.from_dict(d, i) for i, d in enumerate(directives or ()))
        return cls(parsed, decode_priority, decode_duration_s, scope)

    @property
    def is_default(self) -> bool:
        return not self.directives and self.decode_priority is None and self.decode_duration_s is None

    @property
    def needs_plan(self) -> bool:
        """Whether a release of its blocks asks anything but its request's mapped priority (a per-block plan):
        a decode duration without a decode priority asks the mapped priority for a while, which every release
        asks anyway, so it needs none."""
        return bool(self.directives) or self.decode_priority is not None

    def block_plan(
        self,
        num_blocks: int,
        block_size: int,
        num_prompt_tokens: int,
        mapped_priority: int,
    ) -> tuple[list[int], list[float | None]]:
        """Resolve retention for blocks ``0..num_blocks-1``: one priority and one duration per block.

        A prompt block takes the highest priority among the directives overlapping it (its longest duration
        among those; TensorRT-LLM gives a block the range holding its first token, so a range starting inside
        a block covers that block here and not there, as RFC #37003's reference implementation does); a block with no directive takes ``mapped_priority`` without expiry. Blocks that start at
        or after ``num_prompt_tokens`` hold generated tokens and take the decode priority and duration (without a
        decode priority, the mapped one and no duration).
        """
        if block_size <= 0 or num_blocks < 0 or num_prompt_tokens < 0:
            raise RetentionError(
                f"block_plan: block_size must be > 0 and the counts >= 0, got block_size={block_size}, "
                f"num_blocks={num_blocks}, num_prompt_tokens={num_prompt_tokens}"
            )
        prios: list[int] = [mapped_priority] * num_blocks
        durs: list[float | None] = [None] * num_blocks
        covered = [False] * num_blocks
        first_decode = min(num_blocks, -(-num_prompt_tokens // block_size))
        # NOTE: an explicit directive replaces the mapped priority even when lower ("this range may go").
        # A block straddling two directives takes the higher one; on a tie the longer duration (None = forever).
        for d in self.directives:
            hi_tok = num_prompt_tokens if d.end is None else min(d.end, num_prompt_tokens)
            if hi_tok <= d.start:
                continue  # no prompt token in its range (a prompt ending inside a block: that block is not its)
            lo, hi = d.start // block_size, min(first_decode, -(-hi_tok // block_size))
            if lo < hi and not any(covered[lo:hi]):  # (the common case, no overlap: slices, not a loop)
                prios[lo:hi] = [d.priority] * (hi - lo)
                durs[lo:hi] = [d.duration_s] * (hi - lo)
                covered[lo:hi] = [True] * (hi - lo)
                continue
            for i in range(lo, hi):
                if (
                    not covered[i]
                    or d.priority > prios[i]
                    or (d.priority == prios[i] and _longer(d.duration_s, durs[i]))
                ):
                    prios[i] = d.priority
                    durs[i] = d.duration_s
                    covered[i] = True
        if first_decode < num_blocks and self.decode_priority is not None:
            # (without a decode priority they ask the mapped priority, for any duration: as a block without any)
            for i in range(first_decode, num_blocks):
                prios[i] = self.decode_priority
                durs[i] = self.decode_duration_s
        return prios, durs


def _longer(a: float | None, b: float | None) -> bool:
    """True when duration ``a`` outlasts ``b`` (None = no expiry)."""
    if a is None:
        return b is not None
    return b is not None and a > b


def validate_directive_list(raw: Sequence[Mapping[str, Any]]) -> tuple[RetentionDirective, ...]:
    """Parse and validate a JSON list of directives (errors name the index and field)."""
    return RetentionConfig.from_request_fields(raw).directives


@dataclass(frozen=True, slots=True)
class BlockRetention:
    """What a request says about its blocks when it releases them (computed once per request).

    Empty ``priorities`` means every block at ``base_priority`` without expiry (the common case, which the
    pool releases in one batched policy call). Priorities and ``base_priority`` are integers in [0, 100];
    durations are None (no expiry) or seconds >= 0 (``inf``: no expiry, as a directive's); anything else is a
    :class:`RetentionError` naming the entry. The two lists are per block index and of one length (blocks past
    them are at ``base_priority``); ``durations`` left empty beside ``priorities`` means no expiry for each.
    Both are stored as tuples: the checks hold for the plan's life (a list changed after them would reach the
    policies unchecked).
    """

    priorities: Sequence[int] = ()
    durations: Sequence[float | None] = ()
    scope: str | None = None
    request_priority: int = 0
    base_priority: int = DEFAULT_RETENTION_PRIORITY
    """The retention priority the request priority maps to (where a lapsed duration falls back)."""

    def __post_init__(self) -> None:
        # Checked here, not in the policies (an out-of-range priority indexed unified's weights from the end,
        # a NaN duration never lapsed). Built per release: a plan's lists are checked in C (no Python per
        # block); only a refused one is walked to name its first bad entry.
        base = self.base_priority
        if type(base) is not int or not MIN_RETENTION_PRIORITY <= base <= MAX_RETENTION_PRIORITY:
            check_priority(base, "BlockRetention: base_priority", "base_priority")
        prios = self.priorities
        if prios.__class__ is not tuple or self.durations.__class__ is not tuple:
            self._freeze()
            prios = self.priorities
        if prios:
            try:
                raw = bytes(prios)
                ok = not raw.translate(None, _PRIORITY_BYTES)  # ints in [0, 100]
                if ok and (b"\x00" in raw or b"\x01" in raw):  # bytes() takes False and True as 0 and 1
                    ok = bool not in set(map(type, prios))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                _refuse_priorities(prios)
        durs = self.durations
        if len(durs) != len(prios):
            if durs:  # (a plan's entries were dropped past the shorter list, without a word)
                raise RetentionError(
                    f"BlockRetention: priorities and durations are per block, one each: got {len(prios)} "
                    f"priorities and {len(durs)} durations"
                )
            object.__setattr__(self, "durations", durs := (None,) * len(prios))  # (no expiry for each)
        if durs and durs.count(None) != len(durs):
            try:
                distinct = set(durs)  # (a plan holds a few durations, repeated per block)
            except TypeError:
                _refuse_durations(durs)
            else:
                for d in distinct:
                    if d is not None and (type(d) is not float or not d >= 0.0) and not _duration_ok(d):
                        _refuse_durations(durs)

    def _freeze(self) -> None:
        """Store both lists as tuples (the plan is checked once, then read for its life)."""
        for name in ("priorities", "durations"):
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
                raise RetentionError(
                    f"BlockRetention: {name} must be a list of per-block values, got {type(v).__name__}"
                )
            object.__setattr__(self, name, tuple(v))


_PRIORITY_BYTES = bytes(range(MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY + 1))


def _duration_ok(d: object) -> bool:
    try:
        check_duration(d, "BlockRetention")
    except RetentionError:
        return False
    return True


def _refuse_priorities(prios: Sequence[Any]) -> None:
    """Raise naming the first entry of ``prios`` that is not an integer in [0, 100] (a bool is not one, as for
    ``base_priority``)."""
    for i, p in enumerate(prios):
        try:
            ok = not isinstance(p, bool) and not bytes((p,)).translate(None, _PRIORITY_BYTES)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            check_priority(p, f"BlockRetention: priorities[{i}]", "priorities")
            raise RetentionError(f"BlockRetention: priorities[{i}] must be an integer in [0, 100]")
    raise AssertionError("no bad priority found")  # pragma: no cover


def _refuse_durations(durs: Sequence[object]) -> None:
    """Raise naming the first entry of ``durs`` that is not None or a number of seconds >= 0."""
    for i, d in enumerate(durs):
        check_duration(d, "BlockRetention", f"durations[{i}]")
    raise AssertionError("no bad duration found")  # pragma: no cover
