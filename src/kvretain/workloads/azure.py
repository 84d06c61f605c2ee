"""Loader for the Azure LLM inference trace 2023 (Splitwise, ISCA'24): arrivals and lengths only.

CSV with header ``TIMESTAMP,ContextTokens,GeneratedTokens`` and timestamps like
``2023-11-16 18:15:46.6805900``. The trace carries no prefix information, so every prompt is synthetic and
unique: ``TokenSeq.seeded(rng.getrandbits(63), ContextTokens)``.
"""

from __future__ import annotations

import csv
import random
from datetime import datetime
from pathlib import Path

from kvretain.workloads.request import WorkloadError, WorkloadRequest, check_scale_and_limit
from kvretain.workloads.tokens import TokenSeq

_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]


def load_azure(
    path: str | Path, rng: random.Random, limit: int | None = None, time_scale: float = 1.0
) -> list[WorkloadRequest]:
    """Requests of the first ``limit`` rows, arrivals relative to the earliest row times ``time_scale``.

    Request ids are ``azure-<row index>`` (0-based, header excluded). Raises ``WorkloadError`` for a missing
    file, a wrong header or a bad row (naming the line number and the column).
    """
    check_scale_and_limit(time_scale, limit)
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"Azure trace not found: {p}")
    rows: list[tuple[datetime, int, int]] = []
    with p.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != _HEADER:
            raise WorkloadError(f"{p}:1: expected header {','.join(_HEADER)}, got {header!r}")
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
                raise WorkloadError(f"{where}: column 'TIMESTAMP': bad timestamp {row[0]!r}") from None
            n_in = _int(row[1], where, "ContextTokens", minimum=1)
            n_out = _int(row[2], where, "GeneratedTokens", minimum=0)
            rows.append((t, n_in, n_out))
    if not rows:
        return []
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


def _int(text: str, where: str, column: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise WorkloadError(f"{where}: column {column!r}: expected an integer, got {text!r}") from None
    if value < minimum:
        raise WorkloadError(f"{where}: column {column!r}: must be >= {minimum}, got {value}")
    return value
