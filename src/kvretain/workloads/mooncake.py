"""Loader for Mooncake (FAST'25) JSONL traces with block-level prefix sharing.

One JSON object a line::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...],
     "priority": int, "retention": [{start, end, priority, duration_s}, ...], "session_id": str,
     "cache_salt": str}                                      # the last four optional

Each hash id stands for one ``block_size``-token block (512 in the published traces) chained to its prefix.
Hash id ``k`` becomes ``SeededChunk(seed=k, length=block_size)``: its tokens depend on ``k`` alone, so two
requests sharing their first k hash ids share their first ``k*block_size`` tokens exactly, at any engine
block size. The last chunk is truncated so that the prompt has exactly ``input_length`` tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvretain.workloads.request import (
    WorkloadError,
    WorkloadRequest,
    check_scale_and_limit,
    is_int,
    is_number,
    parse_directive,
)
from kvretain.workloads.tokens import Chunk, SeededChunk, TokenSeq

_FIELDS = {
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "priority",
    "retention",
    "session_id",
    "cache_salt",
}


def load_mooncake(
    path: str | Path, block_size: int = 512, limit: int | None = None, time_scale: float = 1.0
) -> list[WorkloadRequest]:
    """Requests of the first ``limit`` lines of the trace at ``path``, sorted by arrival.

    ``block_size`` is the trace's tokens per hash id (not the engine's block size). ``arrival_s`` is
    ``timestamp / 1000 * time_scale``. Request ids are ``mooncake-<line number>``. Raises ``WorkloadError``
    for a missing file or a bad line (naming the line number and the field).
    """
    check_scale_and_limit(time_scale, limit)
    if block_size < 1:
        raise WorkloadError(f"block_size must be >= 1, got {block_size}")
    p = Path(path)
    if not p.is_file():
        raise WorkloadError(f"Mooncake trace not found: {p}")
    full: dict[int, SeededChunk] = {}  # hash id -> its whole-block chunk, shared by every request
    out: list[WorkloadRequest] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: invalid JSON: {e}") from None
            out.append(_parse(rec, where, f"mooncake-{lineno}", block_size, time_scale, full))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _parse(
    rec: Any, where: str, rid: str, block_size: int, time_scale: float, full: dict[int, SeededChunk]
) -> WorkloadRequest:
    if not isinstance(rec, dict):
        raise WorkloadError(f"{where}: expected a JSON object")
    unknown = sorted(set(rec) - _FIELDS)
    if unknown:
        raise WorkloadError(f"{where}: unknown field {unknown[0]!r}")
    ts = _field(rec, "timestamp", where)
    if not is_number(ts) or ts < 0:
        raise WorkloadError(f"{where}: field 'timestamp' must be a number >= 0 (ms), got {ts!r}")
    n_in = _field(rec, "input_length", where)
    if not is_int(n_in) or n_in < 1:
        raise WorkloadError(f"{where}: field 'input_length' must be an int >= 1, got {n_in!r}")
    n_out = _field(rec, "output_length", where)
    if not is_int(n_out) or n_out < 0:
        raise WorkloadError(f"{where}: field 'output_length' must be an int >= 0, got {n_out!r}")
    ids = _field(rec, "hash_ids", where)
    if not isinstance(ids, list) or not all(is_int(h) for h in ids):
        raise WorkloadError(f"{where}: field 'hash_ids' must be a list of ints")
    n_blocks = -(-n_in // block_size)
    if len(ids) != n_blocks:
        raise WorkloadError(
            f"{where}: field 'hash_ids' has {len(ids)} ids but input_length {n_in} needs {n_blocks} "
            f"blocks of {block_size}"
        )
    chunks: list[Chunk] = []
    for h in ids:
        c = full.get(h)
        if c is None:
            c = full[h] = SeededChunk(h, block_size)
        chunks.append(c)
    tail = n_in - (n_blocks - 1) * block_size
    if tail != block_size:
        chunks[-1] = SeededChunk(ids[-1], tail)
    priority = rec.get("priority", 0)
    if not is_int(priority):
        raise WorkloadError(f"{where}: field 'priority' must be an int, got {priority!r}")
    retention = None
    if "retention" in rec:
        raw = rec["retention"]
        if not isinstance(raw, list):
            raise WorkloadError(f"{where}: field 'retention' must be a list of directives")
        retention = tuple(parse_directive(d, f"{where}: field 'retention'") for d in raw)
    session = rec.get("session_id")
    salt = rec.get("cache_salt")
    for name, val in (("session_id", session), ("cache_salt", salt)):
        if val is not None and not isinstance(val, str):
            raise WorkloadError(f"{where}: field {name!r} must be a string, got {val!r}")
    return WorkloadRequest(
        request_id=rid,
        arrival_s=ts / 1000.0 * time_scale,
        prompt=TokenSeq(tuple(chunks)),
        output_len=n_out,
        priority=priority,
        retention=retention,
        session_id=session,
        cache_salt=salt,
        block_ids=tuple(ids),
    )


def _field(rec: dict[str, Any], name: str, where: str) -> Any:
    try:
        return rec[name]
    except KeyError:
        raise WorkloadError(f"{where}: missing field {name!r}") from None
