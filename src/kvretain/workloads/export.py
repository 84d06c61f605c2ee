"""Write any workload in the Mooncake replay format (``kvretain workload export``).

One JSON line per request, in arrival order::

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int, ...],
     "priority": int, "session_id": str, "retention": [{start, end, priority, duration_s}], "cache_salt": str}

``priority`` is always written; ``session_id``, ``retention`` and ``cache_salt`` when the request has them.
``retention`` is the directive list, or, when the request also has a retention scope or decode settings, the
object ``{directives, scope, decode_priority, decode_duration_s}``. These are the fields of the one trace
schema (:func:`kvretain.workloads.mooncake.read_trace`, behind both ``kvretain replay`` and
``kvretain simulate``), and every line is checked against it before it is written (a request the schema would
refuse, e.g. more hash ids than a line may hold, is an error, not a trace that cannot be read back). An export
reads back as the requests it came from for ``kvretain replay`` (the same blocks, priorities, sessions, salts and
retention; timestamps to the microsecond). ``kvretain simulate`` reads it as open-loop traffic: what the format
has no field for is lost, namely follow-up links (a turn sent ``think_s`` after the previous one finished) and a
turn's reuse of the previous turn's generated tokens; at 512-token ids a block shared only in part is a
different id (a smaller ``--block-tokens`` keeps more of it).

Hash ids. Block ``i`` of a prompt covers tokens ``[i*B, min((i+1)*B, n))`` (``B = block_size``, 512 as in
the published traces; the last block may be partial, as in Mooncake). Its content is a list of *pieces*
``(chunk, offset, length)`` of the prompt's chunks: a seeded chunk's tokens depend on its seed alone, so equal
pieces mean equal tokens (the identity :class:`~kvretain.engine.sim.request.SimRequest` hashes, at any block
size). A block's id is the number of the distinct ``(parent id, pieces)`` it is, counted from 0 in order of
first appearance: two requests share their first k ids exactly when they share their first k blocks
(``cache_salt`` keys the first block). Ids are exact (a dict, no hash collisions) and deterministic. A block of a
request read from a trace keeps that trace's identity: its id is the block, whole or partial (as the replay keys
it), so a re-exported trace replays as the trace. Its ids are numbered anew, though: the rules that read an id's
value (``reference``: ``hash_ids[1] % 4``; ``by-session``: a hash of it) pick other conversations on the export
than on the trace (``[0, 8]`` is important to ``reference``, its export ``[0, 1]`` is not); give the rule to the
export (``--priority-rule``), which writes the priorities it picks on the trace.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from kvretain.fileio import output_file, standard_stream
from kvretain.workloads.mooncake import MAX_TIMESTAMP_MS, refusal
from kvretain.workloads.request import WorkloadError, WorkloadRequest
from kvretain.workloads.tokens import SeededChunk, TokenSeq

Piece = tuple[int | tuple[int, ...], int, int]  # (seed or literal tokens, offset, length)


def block_pieces(prompt: TokenSeq, block_size: int) -> Iterator[tuple[Piece, ...]]:
    """The pieces of each ``block_size``-token block of ``prompt``, the trailing partial block included."""
    if block_size < 1:
        raise WorkloadError(f"block_size must be >= 1, got {block_size}")
    pieces: list[Piece] = []
    need = block_size
    for c in prompt.chunks:
        key: int | tuple[int, ...] = c.seed if isinstance(c, SeededChunk) else c.tokens
        off = 0
        while off < c.length:
            take = min(need, c.length - off)
            pieces.append((key, off, take))
            off += take
            need -= take
            if need == 0:
                yield tuple(pieces)
                pieces, need = [], block_size
    if pieces:
        yield tuple(pieces)


class BlockIds:
    """Numbers distinct blocks across requests (see the module docstring)."""

    def __init__(self, trace_block_size: int | None = None) -> None:
        self._ids: dict[tuple[object, ...], int] = {}
        # the block size the trace requests were read at (their longest chunk): a trace's ids are its blocks'
        # identity only when written at that size
        self._trace_block_size = trace_block_size

    def __len__(self) -> int:
        return len(self._ids)

    def of(self, request: WorkloadRequest, block_size: int) -> list[int]:
        parent: object = ("salt", request.cache_salt)
        out: list[int] = []
        ids = self._ids
        trace_ids = (
            request.block_ids
        )  # (a trace's request: its ids, one per chunk, each a block of the trace)
        chunks = request.prompt.chunks
        for i, pieces in enumerate(block_pieces(request.prompt, block_size)):
            key: tuple[object, ...] = (parent, pieces)
            if (
                trace_ids is not None
                and block_size == self._trace_block_size
                and i < len(trace_ids)
                and pieces == ((trace_ids[i], 0, chunks[i].length),)
            ):
                # the trace's block i, exactly, written at the size the trace was read at: its id is the block,
                # whole or partial, as the replay keys it; at another size the pieces are the identity for
                # every request alike (a one-block request's 256 tokens of id 7, read at 512 and written at 256,
                # took id 7's key while the same tokens at the head of a longer request took their pieces')
                key = (parent, ("id", trace_ids[i]))
            bid = ids.get(key)
            if bid is None:
                bid = ids[key] = len(ids)
            out.append(bid)
            parent = bid
        return out


def mooncake_records(requests: Iterable[WorkloadRequest], block_size: int = 512) -> Iterator[dict[str, Any]]:
    """The Mooncake-format record of each request, sorted by arrival (see the module docstring)."""
    ordered = sorted(requests, key=lambda r: r.arrival_s)
    ids = BlockIds(_trace_read_size(ordered, block_size))
    for r in ordered:
        ts = round(r.arrival_s * 1000.0, 3)
        # the format's bound (beyond it: `inf`, which json writes as `Infinity`, not JSON)
        if not ts <= MAX_TIMESTAMP_MS:
            raise WorkloadError(
                f"request {r.request_id}: arrival {r.arrival_s:g} s is beyond the trace format's timestamps "
                f"(at most 2**53 ms, MAX_TIMESTAMP_MS; a smaller --time-scale?)"
            )
        rec: dict[str, Any] = {
            "timestamp": ts,
            "input_length": r.prompt_len,
            "output_length": r.output_len,
            "hash_ids": ids.of(r, block_size),
            "priority": r.priority,
        }
        if r.session_id is not None:
            rec["session_id"] = r.session_id
        retention = _retention_field(r)
        if retention is not None:
            rec["retention"] = retention
        if r.cache_salt is not None:
            rec["cache_salt"] = r.cache_salt
        why = refusal(rec, block_size)  # what the schema refuses is not written (an export must read back)
        if why is not None:
            raise WorkloadError(f"request {r.request_id}: cannot be written in the trace format: {why}")
        yield rec


def _trace_read_size(requests: Iterable[WorkloadRequest], block_size: int) -> int | None:
    """The tokens per hash id the trace requests among ``requests`` were read at (``None``: no trace request).

    A request of two or more ids has it as its first chunk's length. When every request has one id, it is
    unknown but at least the longest prompt; written at a ``block_size`` of at least that, each request is one
    block, its id, so ``block_size`` is taken. (The longest prompt was taken: a trace of one-block requests
    written at 512 keyed its blocks by their tokens, and id 7's 300 and 200 tokens, one block to the replay,
    were two in the export.)"""
    longest = None
    for r in requests:
        if r.block_ids is None:
            continue
        chunks = r.prompt.chunks
        if len(chunks) > 1:
            return chunks[0].length
        longest = max(longest or 0, chunks[0].length)
    if longest is None:
        return None
    return block_size if longest <= block_size else longest


def _retention_field(r: WorkloadRequest) -> list[dict[str, Any]] | dict[str, Any] | None:
    """The trace schema's ``retention`` field of ``r`` (see the module docstring); ``None``: nothing to say."""
    cfg = r.retention_config()
    if cfg is None:
        return None
    for what, seconds in (
        *((f"directive {i}'s duration_s", d.duration_s) for i, d in enumerate(cfg.directives)),
        ("decode_duration_s", cfg.decode_duration_s),
    ):
        if seconds is not None and not math.isfinite(
            seconds
        ):  # (JSON has no Infinity: json.dumps failed naming nothing)
            raise WorkloadError(
                f"request {r.request_id}: retention {what} {seconds} s is beyond the trace format's numbers (null is no "
                "expiry; a smaller --time-scale?)"
            )
    directives = [d.to_dict() for d in cfg.directives]
    extra: dict[str, Any] = {
        "scope": cfg.scope,
        "decode_priority": cfg.decode_priority,
        "decode_duration_s": cfg.decode_duration_s,
    }
    given = {k: v for k, v in extra.items() if v is not None}
    if not given:
        return directives
    return {"directives": directives, **given}


def write_mooncake(requests: Iterable[WorkloadRequest], path: str | Path, block_size: int = 512) -> int:
    """Write ``requests`` to ``path`` as Mooncake JSONL; returns the number of lines written. The file appears
    whole or not at all (:func:`~kvretain.fileio.output_file`): an error or a Ctrl-C half-way leaves no partial
    trace (and an earlier file of that name as it was); standard output is written in place. A name ending in
    ``.gz`` is written gzip-compressed, as the trace readers read it (a standard stream named so is not: its
    reader chose the name of the shell's file, not the format)."""
    n = 0
    gz = str(path).lower().endswith(".gz") and standard_stream(path) is None
    with (
        output_file(path, binary=gz) as out,
        (
            io.TextIOWrapper(
                gzip.GzipFile(Path(path).name[:-3], "wb", fileobj=out, mtime=0),
                encoding="utf-8",
                newline="\n",
            )
            if gz
            else nullcontext(out)
        ) as fh,
    ):
        for rec in mooncake_records(requests, block_size):
            fh.write(json.dumps(rec, separators=(", ", ": "), allow_nan=False) + "\n")
            n += 1
    return n
