"""Simulated requests: a workload request as a scheduler :class:`~kvretain.sched.Request` that hashes its
own blocks cheaply from its token structure (the cache manager's ``block_hashes`` fast path).

A request's full token sequence is its prompt's chunks followed by its output chunk (the workload's
``output`` when given, else a seeded stream derived from the request id). Block ``i`` covers tokens
``[i*B, (i+1)*B)`` of that sequence, which is a list of *pieces* ``(chunk key, offset, length)``; its hash is
Python's ``hash((parent, *pieces))``. A seeded chunk's key is its seed and its tokens depend on the seed
alone, so equal pieces mean equal tokens at any block size, and a follow-up turn whose prompt repeats the
previous turn's prompt and output chunks gets the same hashes for those blocks, decode blocks included.
No token is materialized to hash (the Mooncake trace holds 145M prompt tokens). Hashes of ints and tuples
of ints are the same in every process, so runs are reproducible.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator, Sequence
from typing import overload

from kvretain.core.hashing import BlockHash, ExtraKeys
from kvretain.core.retention import RetentionConfig
from kvretain.sched.request import Request
from kvretain.workloads.request import WorkloadRequest
from kvretain.workloads.tokens import LiteralChunk, SeededChunk, TokenSeq


class LazyTokens(Sequence[int]):
    """A ``TokenSeq`` as a read-only sequence; tokens are materialized on the first item access."""

    __slots__ = ("_seq", "_tokens")

    def __init__(self, seq: TokenSeq) -> None:
        self._seq = seq
        self._tokens: list[int] | None = None

    def __len__(self) -> int:
        return self._seq.length

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        if self._tokens is None:
            self._tokens = self._seq.materialize()
        return self._tokens[i]

    def __iter__(self) -> Iterator[int]:
        if self._tokens is None:
            self._tokens = self._seq.materialize()
        return iter(self._tokens)


def _chunk_key(c: SeededChunk | LiteralChunk) -> int:
    # even keys: seeds; odd keys: literal token tuples (ints and tuples of ints hash reproducibly)
    if isinstance(c, SeededChunk):
        return 2 * c.seed
    return 2 * hash(c.tokens) + 1


def output_seed(request_id: str) -> int:
    """Seed of the output stream of a request whose workload does not give its output tokens."""
    return int.from_bytes(hashlib.sha256(b"kvretain/output/" + request_id.encode()).digest()[:8], "little")


class SimRequest(Request):
    """A :class:`Request` built from a :class:`WorkloadRequest`; see the module docstring."""

    __slots__ = (
        "_bs",
        "_chunks",
        "_ci",
        "_hashes",
        "_off",
        "_out_tokens",
        "_output",
        "_root",
        "after",
        "session_id",
        "think_s",
    )

    def __init__(self, wr: WorkloadRequest, arrival_time: float | None = None) -> None:
        # NOTE: vLLM needs max_tokens >= 1 (the prefill samples a token); a trace line with 0 output
        # tokens is simulated with 1.
        out = wr.output if wr.output is not None and wr.output_len > 0 else None
        n_out = max(1, wr.output_len)
        if out is None:
            out = TokenSeq.seeded(output_seed(wr.request_id), n_out)
        retention = RetentionConfig(wr.retention) if wr.retention else None
        super().__init__(
            wr.request_id,
            LazyTokens(wr.prompt),
            n_out,
            arrival_time=wr.arrival_s if arrival_time is None else arrival_time,
            priority=wr.priority,
            retention=retention,
            extra_keys=ExtraKeys(cache_salt=wr.cache_salt),
        )
        self._output = out
        self._out_tokens: list[int] | None = None
        self._bs = 0
        self.after = wr.after
        self.think_s = wr.think_s
        self.session_id = wr.session_id
        self._chunks = [(_chunk_key(c), c.length) for c in (*wr.prompt.chunks, *out.chunks) if c.length]
        salt = -1 if wr.cache_salt is None else zlib.crc32(wr.cache_salt.encode())
        self._root = hash((0x6B76726574, salt))
        self._hashes: list[BlockHash] = []
        self._ci = 0
        self._off = 0

    def output_token(self, index: int) -> int:
        """The ``index``-th generated token (the executor samples these)."""
        if self._out_tokens is None:
            self._out_tokens = self._output.materialize()
        return self._out_tokens[index]

    def extend_planned_output(self, n: int, times: Sequence[float]) -> None:
        """Append the next ``n`` planned output tokens, sampled at ``times``, and count their KV as computed
        (``n`` decode steps at once; see :mod:`kvretain.engine.sim.fastforward`)."""
        if self._out_tokens is None:
            self._out_tokens = self._output.materialize()
        o = len(self.output_token_ids)
        self.output_token_ids.extend(self._out_tokens[o : o + n])
        self.token_times.extend(times)
        self.num_computed_tokens += n

    def block_hashes(self, block_size: int, num_blocks: int) -> Sequence[BlockHash]:
        """Chained hashes of the first ``num_blocks`` full blocks (extends a list it keeps)."""
        h = self._hashes
        if len(h) >= num_blocks:
            return h
        if block_size != self._bs:
            if self._bs:
                raise ValueError(f"request {self.request_id!r} was hashed with block size {self._bs}")
            self._bs = block_size
        chunks = self._chunks
        ci, off = self._ci, self._off
        parent: BlockHash = h[-1] if h else self._root
        append = h.append
        while len(h) < num_blocks:
            key, length = chunks[ci]
            if length - off >= block_size:  # the block lies inside one chunk (the common case)
                parent = hash((parent, key, off))
                off += block_size
                if off == length:
                    ci += 1
                    off = 0
            else:
                pieces: list[int] = [parent]  # type: ignore[list-item]
                need = block_size
                while need:
                    key, length = chunks[ci]
                    take = min(need, length - off)
                    pieces += (key, off, take)
                    need -= take
                    off += take
                    if off == length:
                        ci += 1
                        off = 0
                parent = hash(tuple(pieces))
            append(parent)
        self._ci, self._off = ci, off
        return h
