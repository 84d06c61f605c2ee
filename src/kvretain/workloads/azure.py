"""Loader for the Azure LLM inference trace 2023 (Splitwise, ISCA'24): arrivals and lengths only.

CSV with header ``TIMESTAMP,ContextTokens,GeneratedTokens`` and timestamps like
``2023-11-16 18:15:46.6805900``. The trace carries no prefix information, so every prompt is synthetic and
unique: ``TokenSeq.seeded(rng.getrandbits(63), ContextTokens)``.
"""

from __future__ import annotations

import csv
import random
import re
from datetime import datetime
from pathlib import Path

from kvretain.fileio import not_utf8
from kvretain.workloads.request import MAX_TOKENS, WorkloadError, WorkloadRequest, check_scale_and_limit
from kvretain.workloads.tokens import TokenSeq

_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def load_azure(
    path: str | Path, rng: random.Random, limit: int | None = None, time_scale: float = 1.0
) -> list[WorkloadRequest]:
    """Requests of the first ``limit`` rows, arrivals relative to the earliest row times ``time_scale``.

    Request ids are ``azure-<row index>`` (0-based, header excluded). Raises ``WorkloadError`` for a missing
    file, a wrong header, no row, or a bad row (naming the line number and the column): a length beyond
    ``MAX_TOKENS`` (Mooncake's bound), timestamps with and without a time zone in one file, a field beyond
    csv's size limit.
    """
    check_scale_and_limit(time_scale, limit)
    p = Path(path)
    try:
        is_dir, exists, readable = p.is_dir(), p.exists(), p.is_file() or p.is_fifo()
    except OSError as e:  # (a name the system cannot look up: too long, ...; a missing one is exists() False)
        raise WorkloadError(f"Azure trace {p}: cannot read the trace: {e.strerror or e}") from None
    if is_dir:
        raise WorkloadError(f"Azure trace {p} is a folder (pass the CSV file)")
    if not exists:
        raise WorkloadError(f"Azure trace not found: {p}")
    if not readable:  # (a pipe is read once, as a file: ``-`` / /dev/stdin, <(...))
        raise WorkloadError(f"Azure trace {p} is not a regular file or a pipe (pass the CSV file)")
    rows: list[tuple[datetime, int, int]] = []
    zoned: tuple[bool, int] | None = None  # whether the first row's time has a zone, and its line
    with p.open(encoding="utf-8-sig", newline="") as f:  # (a byte-order mark, as spreadsheets write, skipped)
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            while header == []:  # blank lines before the header, skipped as blank rows are
                header = next(reader, None)
            if header is None:
                raise WorkloadError(
                    f"{p}: the file is empty (expected a header {','.join(_HEADER)} and rows)"
                )
            if [h.strip() for h in header] != _HEADER:
                raise WorkloadError(
                    f"{p}:{reader.line_num}: expected header {','.join(_HEADER)}, got {_short(header)}"
                )
            for row in reader:
                if limit is not None and len(rows) >= limit:
                    break
                if not row:
                    continue
                where = f"{p}:{reader.line_num}"
                if len(row) != 3:
                    raise WorkloadError(f"{where}: expected 3 columns, got {len(row)}")
                try:
                    t = datetime.fromisoformat(row[0].strip())
                except ValueError:
                    raise WorkloadError(
                        f"{where}: column 'TIMESTAMP': bad timestamp {_short(row[0])}"
                    ) from None
                # NOTE: times with and without a zone cannot be compared (or subtracted): one kind per file
                has_zone = t.tzinfo is not None
                if zoned is None:
                    zoned = (has_zone, reader.line_num)
                elif has_zone != zoned[0]:
                    this, first = ("has a", "none") if has_zone else ("has no", "one")
                    raise WorkloadError(
                        f"{where}: column 'TIMESTAMP': {_short(row[0].strip())} {this} time zone but line "
                        f"{zoned[1]}'s has {first} (give every timestamp a zone, or none)"
                    )
                n_in = _int(row[1], where, "ContextTokens", minimum=1)
                n_out = _int(row[2], where, "GeneratedTokens", minimum=0)
                rows.append((t, n_in, n_out))
        except csv.Error as e:  # a field over csv's size limit, a NUL byte...
            raise WorkloadError(f"{p}:{reader.line_num}: not a CSV row of the trace ({e})") from None
        except UnicodeDecodeError as e:
            raise WorkloadError(f"{p}: {not_utf8(e)}") from None
    if not rows:
        raise WorkloadError(f"{p}: no requests in the trace (the header alone, or only blank lines)")
    t0 = min(r[0] for r in rows)
    out = [
        WorkloadRequest(
            request_id=f"azure-{i}",
            arrival_s=(t - t0).total_seconds() * time_scale,
            prompt=TokenSeq.seeded(rng.getrandbits(63), n_in),
            output_len=n_out,
        )
        for i, (t, n_in, n_out) in enumerate(rows)
    ]
    out.sort(key=lambda r: r.arrival_s)
    return out


def _short(v: object, n: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


_DECIMAL = re.compile(r"-?[0-9]+")
"""A length cell: plain ASCII decimal digits (a sign only to say it is negative, which the bound refuses)."""


def _int(text: str, where: str, column: str, minimum: int) -> int:
    if _DECIMAL.fullmatch(text.strip(" \t")) is None:  # (int() also reads "1_000", "+5", full-width digits)
        raise WorkloadError(f"{where}: column {column!r}: expected an integer, got {_short(text)}")
    digits = text.strip(" \t").lstrip("-").lstrip("0")
    if len(digits) > 100:  # (int() refuses over 4,300 digits with its own error, naming no line)
        raise WorkloadError(
            f"{where}: column {column!r}: must be an integer in [{minimum}, {MAX_TOKENS}] (MAX_TOKENS), "
            f"got a number of {len(digits)} digits"
        )
    value = int(text)
    if not minimum <= value <= MAX_TOKENS:  # the trace format's bound on a length, as Mooncake's
        raise WorkloadError(
            f"{where}: column {column!r}: must be an integer in [{minimum}, {MAX_TOKENS}] (MAX_TOKENS), "
            f"got {_short(value)}"
        )
    return value
