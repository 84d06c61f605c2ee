"""Simulated requests: a workload request as a scheduler :class:`~kvretain.sched.Request` that hashes its
own blocks cheaply from its token structure (the cache manager's ``block_hashes`` fast path).

A request's full token sequence is its prompt's chunks followed by its output chunk (the workload's
``output`` when given, else a seeded stream derived from the request id). Block ``i`` covers tokens
``[i*B, (i+1)*B)`` of that sequence, which is a list of *pieces* ``(chunk key, offset, length)``; its hash is
the core's chain step (:meth:`~kvretain.core.hashing.ContentHasher.chain`, sha256) over its parent's hash
and its pieces, the ``cache_salt`` in the first block's extra keys as in
:class:`~kvretain.core.hashing.BlockHasher`. A seeded chunk's key is its 128-bit seed and its tokens depend
on the seed alone, so equal pieces mean equal tokens at any block size, and a follow-up turn whose prompt
repeats the previous turn's prompt and output chunks gets the same hashes for those blocks, decode blocks
included; a literal chunk's key is 128 bits of the sha256 of its tokens. No token is materialized to hash
(the Mooncake trace holds 145M prompt tokens). Two requests share a block only when their salts, every
earlier piece and the block's own pieces are equal.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Iterator, Sequence
from typing import overload

from kvretain.core.hashing import BlockHash, BlockHasher, ContentHasher, ExtraKeys
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


_PIECES = ContentHasher("sha256", b"kvretain/v1/sim-pieces")
"""The chain of simulated blocks (its own root: never equal to a chain of token or trace-id blocks)."""
_PIECE = struct.Struct("<17sQQ")
"""One piece of a block: chunk key, offset in the chunk, length; a block's content is its pieces."""
_STEP = struct.Struct("<32sH17sQQ")
"""``ContentHasher.chain``'s input for a non-first block of one piece: parent, ``len(extra) == 0``, piece."""


def _chunk_key(c: SeededChunk | LiteralChunk) -> bytes:
    # 17 bytes: b"s" + the seed as SeededChunk.materialize reads it; b"l" + 128 bits of the tokens' sha256
    if isinstance(c, SeededChunk):
        return b"s" + c.seed.to_bytes(16, "little", signed=True)
    try:
        body = array("q", c.tokens).tobytes()
    except OverflowError:
        body = ",".join(map(str, c.tokens)).encode()
    return b"l" + hashlib.sha256(body).digest()[:16]


def output_seed(request_id: str) -> int:
    """Seed of the output stream of a request whose workload does not give its output tokens."""
    return int.from_bytes(hashlib.sha256(b"kvretain/output/" + request_id.encode()).digest()[:8], "little")


class SimRequest(Request):
    """A :class:`Request` built from a :class:`WorkloadRequest`; see the module docstring."""

    __slots__ = (
        "_bs",
        "_chunks",
        "_ci",
        "_extra",
        "_hashes",
        "_off",
        "_out_tokens",
        "_output",
        "after",
        "client_delay_s",
        "engine_delay_s",
        "session_id",
        "think_s",
    )

    def __init__(
        self,
        wr: WorkloadRequest,
        arrival_time: float | None = None,
        client_delay_s: float = 0.0,
        engine_delay_s: float = 0.0,
    ) -> None:
        # NOTE: vLLM needs max_tokens >= 1 (the prefill samples a token); a trace line with 0 output
        # tokens is simulated with 1.
        out = wr.output if wr.output is not None and wr.output_len > 0 else None
        n_out = max(1, wr.output_len)
        if out is None:
            out = TokenSeq.seeded(output_seed(wr.request_id), n_out)
        retention = wr.retention_config()
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
        # a token reaches the client this long after the step that sampled it (SimConfig.frontend_out_s): TTFT
        # and e2e are the client's, TPOT (token to token) is unchanged; the engine saw the request this long
        # after its arrival (the client's send; SimConfig.frontend_in_s): the queueing time is the engine's
        self.client_delay_s = client_delay_s
        self.engine_delay_s = engine_delay_s
        self.think_s = wr.think_s
        self.session_id = wr.session_id
        self._chunks = [(_chunk_key(c), c.length) for c in (*wr.prompt.chunks, *out.chunks) if c.length]
        self._extra = BlockHasher.encode_extra(ExtraKeys(cache_salt=wr.cache_salt), True)
        self._hashes: list[BlockHash] = []
        self._ci = 0
        self._off = 0

    @property
    def ttft(self) -> float | None:
        t = super().ttft
        return None if t is None else t + self.client_delay_s

    @property
    def e2e(self) -> float | None:
        t = super().e2e
        return None if t is None else t + self.client_delay_s

    @property
    def queueing_time(self) -> float | None:
        # from the engine's receipt, the same sum the simulator scheduled it at (``(s - a) - d`` rounds to -5e-18
        # where ``s == a + d``)
        s = self.first_scheduled_time
        return None if s is None else s - (self.arrival_time + self.engine_delay_s)

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
        parent: bytes | None = h[-1] if h else None  # type: ignore[assignment]
        # NOTE: the common case inlines ContentHasher.chain (sha256 of _STEP: one C call to build its input)
        sha = hashlib.sha256
        step = _STEP.pack
        append = h.append
        while len(h) < num_blocks:
            key, length = chunks[ci]
            if parent is not None and length - off >= block_size:  # inside one chunk: the common case
                parent = sha(step(parent, 0, key, off, block_size)).digest()
                off += block_size
                if off == length:
                    ci += 1
                    off = 0
            else:
                pieces: list[bytes] = []
                need = block_size
                while need:
                    key, length = chunks[ci]
                    n = min(need, length - off)
                    pieces.append(_PIECE.pack(key, off, n))
                    need -= n
                    off += n
                    if off == length:
                        ci += 1
                        off = 0
                parent = _PIECES.chain(parent, b"".join(pieces), self._extra if parent is None else b"")
            append(parent)
        self._ci, self._off = ci, off
        return h
