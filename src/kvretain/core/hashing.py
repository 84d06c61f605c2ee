"""Chained content hashes of full KV blocks.

``hash(block i) = H(hash(block i-1), token ids of block i, extra keys)``, full blocks only. Extra keys carry
the LoRA adapter id (every block) and the ``cache_salt`` (first block only; it is inherited through the chain,
as in vLLM). Two requests therefore share block ``i`` only when their whole prefix up to it is equal and their
salts and adapters are equal.

``sha256`` is the default (collision resistant, safe across tenants); ``xxhash`` (xxh3-128) is faster and
needs the ``xxhash`` package (from a clone: ``pip install -e '.[xxhash]'``).

One chain step serves every path (:meth:`ContentHasher.chain`): :class:`BlockHasher` feeds it token ids,
:class:`BlockIdHasher` a trace's block ids (each id stands for its block's tokens), the simulator its chunk
pieces. Each kind of content has its own root, so chains of different kinds never meet.
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


class ContentHasher:
    """The chain step of every cache path: ``H(parent or root, len(extra), extra, content)``.

    ``root_seed`` names the kind of content (token ids, trace block ids, simulator pieces); the chain of a
    kind starts from ``H(root_seed)``, so two kinds never produce the same chain.
    """

    def __init__(self, algorithm: str = "sha256", root_seed: bytes = _ROOT_SEED) -> None:
        if algorithm == "sha256":
            self._fn: Callable[[bytes], bytes] = _sha256
        elif algorithm == "xxhash":
            self._fn = _xxhash_fn()
        else:
            raise ValueError(
                f"unknown hash algorithm {algorithm!r}; choose one of: {', '.join(HASH_ALGORITHMS)}"
            )
        self.algorithm = algorithm
        self.root = self._fn(root_seed)

    def chain(self, parent: bytes | None, content: bytes, extra: bytes = b"") -> bytes:
        """The hash of a block holding ``content`` after ``parent`` (``None``: the first block).

        ``extra`` (at most ``MAX_EXTRA_BYTES``; see :meth:`BlockHasher.encode_extra`) carries the extra keys.
        """
        return self._fn(
            (self.root if parent is None else parent) + len(extra).to_bytes(2, "little") + extra + content
        )


class BlockHasher(ContentHasher):
    """Computes chained hashes of the full blocks of a token sequence."""

    def __init__(self, block_size: int = 16, algorithm: str = "sha256") -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        super().__init__(algorithm)
        self.block_size = block_size

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
        """Hash one full block given its parent's hash (``None`` for the first block)."""
        if len(tokens) != self.block_size:
            raise ValueError(
                f"only full blocks are hashed: got {len(tokens)} tokens, block size {self.block_size}"
            )
        try:
            body = array("q", tokens).tobytes()
        except (OverflowError, TypeError):
            raise ValueError(_bad_block(tokens, extra)) from None
        if len(extra) > MAX_EXTRA_BYTES:
            raise ValueError(_bad_block(tokens, extra))
        return self.chain(parent, body, extra)

    @staticmethod
    def encode_extra(extra: ExtraKeys, first_block: bool) -> bytes:
        """The extra-key bytes of a block; a ``cache_salt`` that cannot be one raises ``ValueError``."""
        parts: list[bytes] = []
        if extra.lora_id is not None:
            parts.append(b"L" + str(extra.lora_id).encode())
        if first_block and extra.cache_salt is not None:
            salt = extra.cache_salt
            if not isinstance(salt, str):
                raise ValueError(f"cache_salt must be a string, got {salt!r}")
            try:
                parts.append(b"S" + salt.encode("utf-8"))
            except UnicodeEncodeError:
                raise ValueError("cache_salt is not valid Unicode (it holds a lone surrogate)") from None
        out = b"|".join(parts)
        if len(out) > MAX_EXTRA_BYTES:
            raise ValueError(
                f"cache_salt is too long: the extra keys of a block hash hold at most {MAX_EXTRA_BYTES} "
                f"bytes, got {len(out)}"
            )
        return out

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


_BLOCK_ID_SEED = b"kvretain/v1/block-ids"
BLOCK_ID_BOUND = 1 << 127
"""Block ids are hashed as 16-byte signed integers: ``-BLOCK_ID_BOUND <= id < BLOCK_ID_BOUND``."""


class BlockIdHasher(ContentHasher):
    """Chained hashes of blocks named by integer ids instead of tokens (a Mooncake trace's ``hash_ids``).

    An id stands for its block's tokens, so block ``i`` of a request hashes as
    ``chain(hash(block i-1), id_i, extra)`` exactly as :class:`BlockHasher` chains token blocks, the
    ``cache_salt`` in the first block's extra keys: an id reused under a different parent, or under another
    salt, is a different block.

    :meth:`block_keys` names each distinct chain by a small int, its rank of first appearance in this hasher,
    from a table over ``(parent key, id)`` (``(salt, id)`` for first blocks): equal keys mean equal chains,
    exactly, and :meth:`digest` gives the chained hash a key stands for, computed when first asked. A
    replay needs only the keys; they cost a dict probe per block where hashing costs a digest (0.1 s instead
    of 0.3 s for the Mooncake conversation trace), and its pool probes small ints faster than digests.
    """

    def __init__(self, algorithm: str = "sha256") -> None:
        super().__init__(algorithm, _BLOCK_ID_SEED)
        self._first: dict[tuple[str | None, int], int] = {}  # (salt, id) -> key of a first block
        self._next: dict[tuple[int, int], int] = {}  # (parent key, id) -> key
        self._nodes: list[tuple[int, int, str | None]] = []  # key -> (parent key or -1, id, salt)
        self._digests: dict[int, bytes] = {}  # key -> its chained hash, once asked for

    def __len__(self) -> int:
        """The number of distinct blocks named so far."""
        return len(self._nodes)

    def block_keys(self, ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The keys of a request's blocks (see the class docstring); ``cache_salt``: its tenant, if any."""
        if not ids:
            return []
        if set(map(type, ids)) != {int} or min(ids) < -BLOCK_ID_BOUND or max(ids) >= BLOCK_ID_BOUND:
            bad = next(h for h in ids if type(h) is not int or not -BLOCK_ID_BOUND <= h < BLOCK_ID_BOUND)
            raise ValueError(f"block id {bad!r} is not an integer that fits 128 signed bits")
        nodes = self._nodes
        first = (cache_salt, ids[0])
        parent = self._first.get(first)
        if parent is None:
            # a salt that cannot be hashed fails here, not when a digest is first asked for
            BlockHasher.encode_extra(ExtraKeys(cache_salt=cache_salt), True)
            parent = self._first[first] = len(nodes)
            nodes.append((-1, ids[0], cache_salt))
        out = [parent]
        table = self._next
        for h in ids[1:]:
            k = (parent, h)
            key = table.get(k)
            if key is None:
                key = table[k] = len(nodes)
                nodes.append((parent, h, None))
            parent = key
            out.append(key)
        return out

    def digest(self, key: int) -> bytes:
        """The chained hash (``chain(parent, id as 16 bytes signed, extra)``) that ``key`` stands for."""
        digests = self._digests
        nodes = self._nodes
        todo: list[int] = []
        k = key
        while k >= 0 and k not in digests:
            todo.append(k)
            k = nodes[k][0]
        for k in reversed(todo):
            parent_key, block_id, salt = nodes[k]
            content = block_id.to_bytes(16, "little", signed=True)
            if parent_key < 0:
                extra = BlockHasher.encode_extra(ExtraKeys(cache_salt=salt), True)
                digests[k] = self.chain(None, content, extra)
            else:
                digests[k] = self.chain(digests[parent_key], content)
        return digests[key]

    def hash_ids(self, ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of a request's block ids."""
        return [self.digest(k) for k in self.block_keys(ids, cache_salt)]
