"""Chained content hashes of full KV blocks.

``hash(block i) = H(hash(block i-1), token ids of block i, extra keys)``, full blocks only. Extra keys carry
the LoRA adapter id (every block) and the ``cache_salt`` (first block only; it is inherited through the chain,
as in vLLM). Two requests therefore share block ``i`` only when their whole prefix up to it is equal and their
salts and adapters are equal.

``sha256`` is the default (collision resistant, safe across tenants); ``xxhash`` (xxh3-128) is faster and
needs the ``xxhash`` package (from a clone: ``pip install -e '.[xxhash]'``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

BlockHash = bytes | int
"""A block's identity in the cache. Engines use ``bytes`` digests; trace replay uses the trace's ints."""

_ROOT_SEED = b"kvretain/v1/root"
MAX_EXTRA_BYTES = 2**16 - 1
"""Extra keys are framed by a 2-byte length in every block hash."""
MAX_SALT_BYTES = MAX_EXTRA_BYTES - 24
"""What a ``cache_salt`` may take of the extra keys: the rest holds the LoRA id (``L`` + up to 19 digits) and
the separators."""


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Per-request keys mixed into block hashes (vLLM's ``extra_keys``)."""

    cache_salt: str | None = None
    lora_id: int | None = None

    def __post_init__(self) -> None:
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str):
                raise ValueError(f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}")
            try:
                size = len(self.cache_salt.encode())
            except UnicodeEncodeError as exc:
                raise ValueError(f"cache_salt is not valid Unicode text ({exc.reason})") from None
            if size > MAX_SALT_BYTES:
                raise ValueError(
                    f"cache_salt is {size:,} UTF-8 bytes; at most {MAX_SALT_BYTES:,} are allowed "
                    "(pass a digest of a longer secret)"
                )
        if self.lora_id is not None and (
            isinstance(self.lora_id, bool)
            or not isinstance(self.lora_id, int)
            or not -(2**63) <= self.lora_id < 2**63
        ):
            raise ValueError(f"lora_id must be a 64-bit integer or None, got {str(self.lora_id)[:40]}")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash_fn() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "hash algorithm 'xxhash' needs the xxhash package: pip install xxhash (or, from a clone, "
            "pip install -e '.[xxhash]')"
        ) from exc
    fn: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return fn


HASH_ALGORITHMS = ("sha256", "xxhash")


def _bad_block(tokens: Sequence[int], extra: bytes) -> str:
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int):
            return f"token ids must be integers, got {type(t).__name__} {str(t)[:40]!r}"
        if not -(2**63) <= t < 2**63:
            return f"token id {str(t)[:40]} does not fit in a signed 64-bit integer ([-2**63, 2**63))"
    return f"extra keys are {len(extra):,} bytes; at most {MAX_EXTRA_BYTES:,} are allowed"


class BlockHasher:
    """Computes chained hashes of the full blocks of a token sequence."""

    def __init__(self, block_size: int = 16, algorithm: str = "sha256") -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if algorithm == "sha256":
            self._fn: Callable[[bytes], bytes] = _sha256
        elif algorithm == "xxhash":
            self._fn = _xxhash_fn()
        else:
            raise ValueError(
                f"unknown hash algorithm {algorithm!r}; choose one of: {', '.join(HASH_ALGORITHMS)}"
            )
        self.block_size = block_size
        self.algorithm = algorithm
        self.root = self._fn(_ROOT_SEED)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
        """Hash one full block given its parent's hash (``None`` for the first block)."""
        if len(tokens) != self.block_size:
            raise ValueError(
                f"only full blocks are hashed: got {len(tokens)} tokens, block size {self.block_size}"
            )
        try:
            body = array("q", tokens).tobytes()
            framed = len(extra).to_bytes(2, "little") + extra
        except (OverflowError, TypeError):
            raise ValueError(_bad_block(tokens, extra)) from None
        return self._fn((self.root if parent is None else parent) + framed + body)

    @staticmethod
    def encode_extra(extra: ExtraKeys, first_block: bool) -> bytes:
        parts: list[bytes] = []
        if extra.lora_id is not None:
            parts.append(b"L" + str(extra.lora_id).encode())
        if first_block and extra.cache_salt is not None:
            parts.append(b"S" + extra.cache_salt.encode())
        return b"|".join(parts)

    def hash_blocks(
        self,
        tokens: Sequence[int],
        extra: ExtraKeys | None = None,
        prefix: Sequence[bytes] = (),
    ) -> list[bytes]:
        """Hashes of every full block of ``tokens``; ``prefix`` holds already-known leading hashes.

        Incremental: with ``prefix`` of length k, only blocks k.. are hashed (decode appends cheaply).
        """
        extra = extra or ExtraKeys()
        bs = self.block_size
        out = list(prefix)
        n_full = len(tokens) // bs
        if len(out) > n_full:
            raise ValueError(f"prefix has {len(out)} hashes but tokens hold only {n_full} full blocks")
        mid = self.encode_extra(extra, False)
        first = self.encode_extra(extra, True)
        parent = out[-1] if out else None
        for i in range(len(out), n_full):
            parent = self.hash_block(parent, tokens[i * bs : (i + 1) * bs], first if i == 0 else mid)
            out.append(parent)
        return out
