"""The Mooncake (FAST'25) JSONL trace format: the one schema and parser of ``kvretain replay`` and
``kvretain simulate``.

One JSON object a line (blank lines are skipped), in a file or a pipe, plain or gzip-compressed (``.gz``, told
by its first bytes)::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...],   # required
     "priority": int, "retention": [...] or {...}, "retention_directives": [...], "retention_scope": str,
     "session_id": str, "cache_salt": str}                                                     # optional

* ``hash_ids``: one id per ``block_tokens``-token block of the prompt (512 in the published traces), in
  ``[0, 2**64)``, chained to its prefix: a block is the same block only under the same leading ids (and the
  same ``cache_salt``). ``len(hash_ids)`` must equal ``ceil(input_length / block_tokens)``.
* ``timestamp``: arrival in milliseconds, finite, in ``[0, 2**53]``. Lines are replayed in timestamp order:
  out-of-order lines are sorted stably (equal timestamps keep the file's order), in both commands.
* ``priority``: request priority, an int64, lower = more important (vLLM), default 0.
* ``retention``: a list of RFC #37003 directives ``{start, end, priority, duration_s}`` (the core's
  :meth:`RetentionDirective.from_dict` spellings), or an object ``{directives, scope, decode_priority,
  decode_duration_s}``. ``retention_directives`` / ``retention_scope`` are RFC #37003's names for the list
  and the scope (one spelling per line). Overlapping ranges are rejected.
* ``session_id``, ``cache_salt``: non-empty strings; requests with different salts never share a block.
* ``null`` means "absent" for an optional field. Any other field is an error (a typo'd ``"prio"`` must not
  fall back to the default silently), and so is a field given twice, NaN or Infinity.

Every error is a :class:`TraceError` naming ``file:line`` and the field. What one line may carry is capped
(``MAX_LINE_BYTES``, ``MAX_HASH_IDS``, ``MAX_DIRECTIVES``, ``MAX_TOKENS``, ``MAX_STRING_BYTES``). A file with
no request line is an error too (nothing to replay).

For the simulator, hash id ``k`` becomes ``SeededChunk(seed=k, length=block_tokens)``: its tokens depend on
``k`` alone, so two requests sharing their first k hash ids share their first ``k*block_tokens`` tokens
exactly, at any engine block size (and the simulator's hashes chain them, as the replay's do). The last
chunk is truncated so that the prompt has exactly ``input_length`` tokens.
"""

from __future__ import annotations

import difflib
import gzip
import io
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

from kvretain.core.jsonkeys import DuplicateKeyError, unique_pairs
from kvretain.core.retention import MAX_DIRECTIVES, RetentionConfig
from kvretain.fileio import as_written
from kvretain.workloads.request import (
    MAX_TOKENS,
    PRIORITY_BOUND,
    WorkloadError,
    WorkloadRequest,
    check_scale_and_limit,
    scaled_directives,
    scaled_duration,
)
from kvretain.workloads.tokens import Chunk, SeededChunk, TokenSeq

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per hash id in the published Mooncake traces."""

# Caps on one line. Generous bounds, not fitted to a figure: each is far above what a real request carries
# and low enough that one line cannot take the process's memory or minutes to parse.
MAX_HASH_IDS = 1 << 16
"""Hash ids per line: a 1M-token prompt at 16-token blocks (32M tokens at Mooncake's 512)."""
HASH_ID_BOUND = 1 << 64
"""Hash ids lie in ``[0, 2**64)`` (64-bit unsigned hashes, as trace generators write them)."""
MAX_LINE_BYTES = 2 << 20
"""2 MiB: ``MAX_HASH_IDS`` ids of 20 digits each (every id < 2**64) with separators, plus the rest."""
MAX_STRING_BYTES = 4096
"""``session_id`` / ``cache_salt`` / scope in UTF-8 bytes (ids and tenant names are tens of bytes)."""
BLOCK_TOKENS_HINT = "see --block-tokens"
"""Where a hash-id count that does not match ``input_length`` points (a command that sets the tokens per hash id
of the trace it reads with another option says so in its place)."""
MAX_TIMESTAMP_MS = 1 << 53
"""Timestamps beyond 2**53 ms (285,000 years) are no longer exact as floats."""

REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
OPTIONAL_FIELDS = (
    "priority",
    "retention",
    "retention_directives",
    "retention_scope",
    "session_id",
    "cache_salt",
)
FIELDS = frozenset(REQUIRED_FIELDS + OPTIONAL_FIELDS)
_RETENTION_OBJECT_FIELDS = ("directives", "scope", "decode_priority", "decode_duration_s")


class TraceError(WorkloadError):
    """A trace file that cannot be read; the message names the file, the line and the field."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One validated line of a trace (see the module docstring for the fields)."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    priority: int = 0
    retention: RetentionConfig | None = None
    session_id: str | None = None
    cache_salt: str | None = None

    # NOTE: the scalar fields of a WorkloadRequest under its names, so that a priority rule
    # (kvretain.workloads.priority) applies to a trace record as it does to a simulator request.
    @property
    def request_id(self) -> str:
        return f"mooncake-{self.line}"

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.hash_ids

    @property
    def arrival_s(self) -> float:
        return self.timestamp_ms / 1000.0

    @property
    def prompt_len(self) -> int:
        return self.input_length

    @property
    def output_len(self) -> int:
        return self.output_length


GZIP_MAGIC = b"\x1f\x8b"
"""The first two bytes of a gzip stream: such a trace is read through gzip (published traces ship as ``.gz``)."""


class _LineError(ValueError):
    """Raised inside the JSON hooks and field checks; becomes a ``TraceError`` with ``file:line``."""


def read_trace(
    path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS, limit: int | None = None
) -> list[TraceRecord]:
    """The first ``limit`` request lines of the trace at ``path`` (all when ``None``), validated and sorted
    stably by timestamp. ``block_tokens`` is the trace's tokens per hash id. Raises :class:`TraceError`."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise TraceError(
            f"tokens per trace block (--block-tokens) must be an integer >= 1, got {block_tokens!r}"
        )
    check_scale_and_limit(1.0, limit)
    p = Path(path)
    try:
        is_dir, exists, readable = p.is_dir(), p.exists(), p.is_file() or p.is_fifo()
    except OSError as e:  # (a name the system cannot look up: too long, ...; a missing one is exists() False)
        raise TraceError(f"{p}: cannot read the trace: {e.strerror or e}") from None
    if is_dir:
        raise TraceError(f"{p} is a directory, not a trace file (pass a Mooncake-format JSONL file)")
    if not exists:
        raise TraceError(f"trace file not found: {p} (pass the path of a Mooncake-format JSONL file)")
    if not readable:  # (not a device: /dev/zero never ends, a terminal waits for input)
        raise TraceError(f"{p} is not a regular file or a pipe (pass a Mooncake-format JSONL file)")
    out: list[TraceRecord] = []
    try:
        with p.open("rb") as f, _decompressed(f) as fh:
            lineno = 0
            while limit is None or len(out) < limit:
                raw = fh.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                lineno += 1
                rec = parse_trace_line(raw, lineno, str(p), block_tokens)
                if rec is not None:
                    out.append(rec)
    except (
        OSError,
        EOFError,
        zlib.error,
    ) as e:  # (gzip: BadGzipFile is an OSError; a cut stream an EOFError)
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise TraceError(f"{p}: cannot read the trace: {why}") from None
    if not out:
        raise TraceError(f"{p}: no requests in the trace (the file is empty or holds only blank lines)")
    out.sort(key=lambda r: r.timestamp_ms)  # stable: equal timestamps keep the file's order
    return out


def _decompressed(raw: io.BufferedReader) -> BinaryIO:
    """The trace's bytes from ``raw`` (a file or a pipe: ``/dev/stdin``, ``<(zcat T.gz)``), through gzip when it
    is gzip-compressed, told by its first two bytes. The caller closes ``raw`` (a ``GzipFile`` does not close the
    file it reads).

    A file's first bytes are peeked. A pipe is read once and may hand its first bytes over one at a time (a peek
    can return one byte): its first two are read, then put back in front of the rest."""
    stream: io.BufferedReader = raw
    if len(head := raw.peek(2)[:2]) < 2:  # (a pipe's first write was one byte, or the stream is that short)
        head = raw.read(2)
        stream = io.BufferedReader(_Prefixed(head, raw))
    if head == GZIP_MAGIC:
        return cast(BinaryIO, gzip.GzipFile(fileobj=stream, mode="rb"))
    return stream


class _Prefixed(io.RawIOBase):
    """``head``, then the rest of ``rest``: bytes read ahead, put back."""

    def __init__(self, head: bytes, rest: io.BufferedReader) -> None:
        self._head = head
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        if self._head:
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        data = self._rest.read1(len(view))
        view[: len(data)] = data
        return len(data)


def parse_trace_line(
    raw: bytes | str, lineno: int, path: str = "<trace>", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> TraceRecord | None:
    """One line of a trace (``None`` for a blank line); errors name ``path:lineno``."""
    where = f"{path}:{lineno}"
    try:
        if isinstance(raw, bytes):
            body = len(raw) - (1 if raw.endswith(b"\n") else 0)
            if body > MAX_LINE_BYTES:
                raise _LineError(f"line longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _LineError(
                    f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                ) from None
        else:
            text = raw
        if lineno == 1:
            text = text.lstrip("\ufeff")
        elif text.startswith("\ufeff"):  # (invisible: JSON's error was "Expecting value at column 1")
            raise _LineError(
                "a byte-order mark (U+FEFF) starts the line; only the file's first line may have one "
                "(two files joined?)"
            )
        if not text.strip(" \t\r\n"):  # JSON's whitespace only: a line of U+00A0 is no blank line
            return None
        try:
            obj = _loads(text)
        except _LineError as e:
            if lineno == 1 and str(e).startswith("not valid JSON") and _looks_like_csv(text):
                raise _LineError(f"{e}; {CSV_HINT}") from None
            raise
        return _record(obj, lineno, block_tokens)
    except _LineError as e:
        raise TraceError(f"{where}: {e}") from None


CSV_HINT = (
    "line 1 looks like a CSV header, and this reads Mooncake-format JSONL: an Azure LLM trace (CSV) runs with "
    "`kvretain simulate TRACE --workload azure`, or `kvretain workload export azure --trace TRACE --out "
    "TRACE.jsonl` writes it as JSONL"
)
"""What a first line that is no JSON but looks like CSV adds to the error: ``kvretain replay az.csv`` (an Azure
trace) said only "not valid JSON (Expecting value at column 1)"."""


def _looks_like_csv(text: str) -> bool:
    """Whether a line that is no JSON looks like a CSV header: it has commas and does not start as JSON's object
    or array does (a cut JSON line has commas too)."""
    line = text.strip()
    return "," in line and not line.startswith(("{", "["))


# ---------------------------------------------------------------------------------------------- JSON
def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    try:
        return unique_pairs(pairs)
    except DuplicateKeyError as e:
        raise _LineError(f"field {e.key!r} is given twice") from None


class _Unusable:
    """What JSON's NaN, Infinity, an overflowing float or a huge integer parse as: no field accepts it, so the
    field's own check rejects it by name (``repr`` shows the literal)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = _short(text, 24) if len(text) < 100 else f"a number of {len(text)} digits"

    def __repr__(self) -> str:
        return self.text


def _float(text: str) -> float | _Unusable:
    v = float(text)
    return v if math.isfinite(v) else _Unusable(text)


def _int(text: str) -> int | _Unusable:
    return int(text) if len(text) <= 40 else _Unusable(text)


# Stateless decoders, built once (json.loads with hooks builds one per call). The second names an integer
# too long to parse: a parse_int hook on every line would slow the common case down.
_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_Unusable, parse_float=_float)
_NAMING_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs, parse_constant=_Unusable, parse_float=_float, parse_int=_int
)


def _loads(text: str, decoder: json.JSONDecoder = _DECODER) -> Any:
    try:
        return decoder.decode(text)
    except json.JSONDecodeError as e:
        err = e
        line = text.rstrip("\r\n")
        if line != text:  # (a truncated line's error is past its newline: column 1 of the next line)
            try:
                decoder.decode(line)
            except json.JSONDecodeError as on_line:
                err = on_line
            except ValueError:
                pass
        raise _LineError(f"not valid JSON ({err.msg.removesuffix(' at')} at column {err.colno})") from None
    except RecursionError:
        raise _LineError("JSON nested too deeply (a trace line is an object of plain fields)") from None
    except _LineError:
        raise
    except ValueError:  # an integer beyond Python's int-string conversion limit: parse again to name it
        if decoder is _DECODER:
            return _loads(text, _NAMING_DECODER)
        raise _LineError("not valid JSON (a number out of range)") from None


# ---------------------------------------------------------------------------------------------- fields
def _short(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _show(v: Any) -> str:
    if v is None or type(v) is bool:  # as the file spells them
        return as_written(v)
    if isinstance(v, list | dict | str) and len(v) > 8:
        return f"a {type(v).__name__} of {len(v)} items" if not isinstance(v, str) else repr(_short(v, 40))
    return _short(repr(v))


def _is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float


def _beyond_int64(v: Any) -> bool:
    return type(v) is int and not -PRIORITY_BOUND <= v < PRIORITY_BOUND


def _record(obj: Any, lineno: int, block_tokens: int) -> TraceRecord:
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object per line, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(k, sorted(FIELDS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise _LineError(
            f"unknown field {_short(k, 40)!r}{hint}; fields: {', '.join(REQUIRED_FIELDS + OPTIONAL_FIELDS)}"
        )
    for name in REQUIRED_FIELDS:
        if obj.get(name) is None:
            what = "missing field" if name not in obj else "null in field"
            raise _LineError(f"{what} {name!r} (required: {', '.join(REQUIRED_FIELDS)})")
    ts = obj["timestamp"]
    if not (_is_int(ts) or type(ts) is float) or not 0 <= ts <= MAX_TIMESTAMP_MS:
        raise _LineError(f"field 'timestamp' must be a number of milliseconds in [0, 2**53], got {_show(ts)}")
    n_in = obj["input_length"]
    if not _is_int(n_in) or not 1 <= n_in <= MAX_TOKENS:
        raise _LineError(f"field 'input_length' must be an integer in [1, {MAX_TOKENS}], got {_show(n_in)}")
    n_out = obj["output_length"]
    if not _is_int(n_out) or not 0 <= n_out <= MAX_TOKENS:
        raise _LineError(f"field 'output_length' must be an integer in [0, {MAX_TOKENS}], got {_show(n_out)}")
    ids = obj["hash_ids"]
    if type(ids) is not list or not ids:
        raise _LineError(f"field 'hash_ids' must be a non-empty list of integers, got {_show(ids)}")
    if len(ids) > MAX_HASH_IDS:
        raise _LineError(f"field 'hash_ids' holds {len(ids)} ids; at most {MAX_HASH_IDS} (MAX_HASH_IDS)")
    if set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= HASH_ID_BOUND:
        i, bad = next((i, h) for i, h in enumerate(ids) if not (_is_int(h) and 0 <= h < HASH_ID_BOUND))
        raise _LineError(f"field 'hash_ids' item {i} must be an integer in [0, 2**64), got {_show(bad)}")
    need = -(-n_in // block_tokens)
    if len(ids) != need:
        raise _LineError(
            f"field 'hash_ids' has {len(ids)} ids but input_length {n_in} needs {need} "
            f"(one per {block_tokens}-token block; {BLOCK_TOKENS_HINT})"
        )
    priority = obj.get("priority")
    if priority is None:
        priority = 0
    elif not _is_int(priority) or not -PRIORITY_BOUND <= priority < PRIORITY_BOUND:
        raise _LineError(f"field 'priority' must be an int64 (lower = more important), got {_show(priority)}")
    return TraceRecord(
        line=lineno,
        timestamp_ms=float(ts),
        input_length=n_in,
        output_length=n_out,
        hash_ids=tuple(ids),
        priority=priority,
        retention=_retention(obj),
        session_id=_string("session_id", obj.get("session_id")),
        cache_salt=_string("cache_salt", obj.get("cache_salt")),
    )


def refusal(obj: dict[str, Any], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> str | None:
    """Why :func:`read_trace` would refuse ``obj`` as a line of a trace of ``block_tokens`` tokens per hash id
    (``None``: it reads it). A writer of traces (``kvretain workload export``) checks each line with it."""
    try:
        _record(obj, 0, block_tokens)
    except _LineError as e:
        return str(e)
    return None


def _string(name: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _LineError(f"field {name!r} must be a non-empty string, got {_show(v)}")
    try:
        n = len(v.encode("utf-8"))
    except UnicodeEncodeError:
        raise _LineError(f"field {name!r} is not valid Unicode (it holds a lone surrogate)") from None
    if n > MAX_STRING_BYTES:
        raise _LineError(f"field {name!r} is {n} UTF-8 bytes; at most {MAX_STRING_BYTES} (MAX_STRING_BYTES)")
    return v


def _retention(obj: dict[str, Any]) -> RetentionConfig | None:
    ret = obj.get("retention")
    rfc = obj.get("retention_directives")
    scope_rfc = obj.get("retention_scope")
    if ret is not None and rfc is not None:
        raise _LineError("give 'retention' or its RFC #37003 spelling 'retention_directives', not both")
    name = "retention" if ret is not None else "retention_directives"
    raw = ret if ret is not None else rfc
    if raw is None and scope_rfc is None:
        return None
    fields: dict[str, Any] = {}
    if isinstance(raw, dict):
        if name == "retention_directives":
            raise _LineError("field 'retention_directives' must be a list of directives")
        unknown = [k for k in raw if k not in _RETENTION_OBJECT_FIELDS]
        if unknown:
            raise _LineError(
                f"field 'retention': unknown field {_short(unknown[0], 40)!r}; "
                f"fields: {', '.join(_RETENTION_OBJECT_FIELDS)}"
            )
        fields = dict(raw)
        if fields.get("scope") is not None and scope_rfc is not None:
            raise _LineError("give the scope as 'retention_scope' or as 'retention.scope', not both")
    elif raw is None or isinstance(raw, list):
        fields = {"directives": raw}
    else:
        raise _LineError(
            f"field {name!r} must be a list of directives or an object "
            f"{{{', '.join(_RETENTION_OBJECT_FIELDS)}}}, got {_show(raw)}"
        )
    if scope_rfc is not None:
        fields["scope"] = scope_rfc
    where = name if raw is not None else "retention_scope"
    directives = fields.get("directives")
    if directives is not None:
        if not isinstance(directives, list):
            raise _LineError(f"field {name!r}: 'directives' must be a list, got {_show(directives)}")
        if len(directives) > MAX_DIRECTIVES:
            raise _LineError(f"field {name!r} holds {len(directives)} directives; at most {MAX_DIRECTIVES}")
        for i, d in enumerate(directives):
            if isinstance(d, dict):
                for k, v in d.items():
                    if _beyond_int64(v):
                        raise _LineError(f"field {name!r}: directive {i}: {k!r} {_show(v)} is out of range")
    for k in ("decode_priority", "decode_duration_s"):
        v = fields.get(k)
        if _beyond_int64(v):
            raise _LineError(f"field {name!r}: {k!r} {_show(v)} is out of range")
    scope = _string("retention_scope" if scope_rfc is not None else "retention.scope", fields.get("scope"))
    try:
        cfg = RetentionConfig.from_request_fields(
            directives, scope, fields.get("decode_priority"), fields.get("decode_duration_s")
        )
    except (ValueError, TypeError, OverflowError) as e:  # RetentionError names the directive and field
        raise _LineError(f"field {where!r}: {e}") from None
    return None if cfg.is_default and cfg.scope is None else cfg


# ---------------------------------------------------------------------------------------------- workload
def load_mooncake(
    path: str | Path,
    block_size: int = MOONCAKE_BLOCK_TOKENS,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> list[WorkloadRequest]:
    """Requests of the first ``limit`` lines of the trace at ``path``, sorted by arrival.

    ``block_size`` is the trace's tokens per hash id (not the engine's block size). ``arrival_s`` is
    ``timestamp / 1000 * time_scale``. Request ids are ``mooncake-<line number>``. Raises ``TraceError``
    (a ``WorkloadError``) naming the file, line and field.
    """
    check_scale_and_limit(time_scale, limit)
    records = read_trace(path, block_size, limit)
    full: dict[int, SeededChunk] = {}  # hash id -> its whole-block chunk, shared by every request
    return [to_workload_request(r, block_size, time_scale, full, str(path)) for r in records]


def to_workload_request(
    rec: TraceRecord,
    block_size: int = MOONCAKE_BLOCK_TOKENS,
    time_scale: float = 1.0,
    full: dict[int, SeededChunk] | None = None,
    path: str = "<trace>",
) -> WorkloadRequest:
    """The simulator's request for one trace line (``full`` shares whole-block chunks across calls)."""
    full = {} if full is None else full
    chunks: list[Chunk] = []
    for h in rec.hash_ids:
        c = full.get(h)
        if c is None:
            c = full[h] = SeededChunk(h, block_size)
        chunks.append(c)
    tail = rec.input_length - (len(chunks) - 1) * block_size
    if tail != block_size:
        chunks[-1] = SeededChunk(rec.hash_ids[-1], tail)
    arrival = rec.timestamp_ms / 1000.0 * time_scale
    if not math.isfinite(arrival):
        raise TraceError(f"{path}:{rec.line}: field 'timestamp' times --time-scale {time_scale} overflows")
    ret = rec.retention
    return WorkloadRequest(  # (times, and retention durations with them, at time_scale: as time_scaled)
        request_id=rec.request_id,
        arrival_s=arrival,
        prompt=TokenSeq(tuple(chunks)),
        output_len=rec.output_length,
        priority=rec.priority,
        retention=scaled_directives(ret.directives or None, time_scale) if ret is not None else None,
        session_id=rec.session_id,
        cache_salt=rec.cache_salt,
        block_ids=rec.hash_ids,
        retention_scope=None if ret is None else ret.scope,
        decode_priority=None if ret is None else ret.decode_priority,
        decode_duration_s=None if ret is None else scaled_duration(ret.decode_duration_s, time_scale),
    )
