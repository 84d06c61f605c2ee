"""Compact, lazily materialized token sequences for synthetic and trace-derived prompts.

A trace like Mooncake's holds ~147M prompt tokens (12k requests, ~12k tokens each); as Python lists that is
several GB. A ``TokenSeq`` instead keeps a tuple of shared *chunks* and materializes tokens on demand::

    TokenSeq(chunks=(SeededChunk(seed=0, length=512), SeededChunk(seed=17, length=512), SeededChunk(17, 90)))
                     \\______ block 0 of the trace _____/ \\______ hash id 17 ______/  \\_ truncated _/

A ``SeededChunk`` stands for the first ``length`` tokens of an endless pseudo-random stream determined only
by its seed (SHAKE-128 of the seed, read as little-endian uint16, so token ids lie in ``[0, 65536)``).
Equal seeds give equal tokens, and a shorter chunk of a seed is a prefix of a longer one, so two prompts built
from the same leading chunks share exactly those tokens: prefix sharing survives any engine block size.
A ``LiteralChunk`` holds explicit tokens (tests, user-provided prompts).

Requests built from the same chunk objects share them in memory; one request costs a tuple of pointers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

TOKEN_ID_BOUND = 1 << 16
"""Seeded tokens lie in ``[0, TOKEN_ID_BOUND)``; map them (e.g. modulo) onto a smaller vocabulary."""


@dataclass(frozen=True, slots=True)
class SeededChunk:
    """The first ``length`` tokens of the deterministic stream of ``seed``."""

    seed: int
    length: int

    def materialize(self) -> tuple[int, ...]:
        digest = hashlib.shake_128(self.seed.to_bytes(16, "little", signed=True)).digest(2 * self.length)
        return tuple(memoryview(digest).cast("H"))


@dataclass(frozen=True, slots=True)
class LiteralChunk:
    """Explicit token ids."""

    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)

    def materialize(self) -> tuple[int, ...]:
        return self.tokens


Chunk = SeededChunk | LiteralChunk


@dataclass(frozen=True, slots=True)
class TokenSeq:
    """An immutable token sequence: the concatenation of ``chunks``. ``len()`` is O(1), tokens are lazy."""

    chunks: tuple[Chunk, ...]
    length: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", sum(c.length for c in self.chunks))

    @classmethod
    def of(cls, tokens: Iterable[int]) -> TokenSeq:
        """A sequence of explicit tokens."""
        toks = tuple(tokens)
        return cls((LiteralChunk(toks),) if toks else ())

    @classmethod
    def seeded(cls, seed: int, length: int) -> TokenSeq:
        """``length`` deterministic pseudo-random tokens from ``seed``."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        return cls((SeededChunk(seed, length),) if length else ())

    def __len__(self) -> int:
        return self.length

    def __add__(self, other: TokenSeq) -> TokenSeq:
        return TokenSeq(self.chunks + other.chunks)

    def materialize(self) -> list[int]:
        """All token ids as a list (allocates; prefer ``blocks`` for hashing)."""
        out: list[int] = []
        for c in self.chunks:
            out.extend(c.materialize())
        return out

    def blocks(self, block_size: int, *, partial: bool = False) -> Iterator[tuple[int, ...]]:
        """Consecutive ``block_size``-token tuples; the trailing partial block only when ``partial``."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        buf: tuple[int, ...] = ()
        for c in self.chunks:
            toks = c.materialize()
            if buf:
                need = block_size - len(buf)
                buf += toks[:need]
                if len(buf) < block_size:
                    continue
                yield buf
                toks = toks[need:]
            full = len(toks) - len(toks) % block_size
            for i in range(0, full, block_size):
                yield toks[i : i + block_size]
            buf = toks[full:]
        if partial and buf:
            yield buf
