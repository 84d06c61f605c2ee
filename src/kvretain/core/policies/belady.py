"""``belady``: the offline oracle, for trace replay only.

Evicts the evictable block whose next use is farthest in the future (never used again first). It needs
``PolicyConfig.next_use``, a function from a block hash to the time (e.g. request index) of its next use,
which a replay can answer because it knows the whole trace. A block's next use can only change when it is
used again, and then it is pushed again, so the key computed at push time stays valid (the replay releases
every hit, a request longer than the pool's included). An answer that is not a number (``None``, a string, a
bool, NaN) is a ``ValueError`` naming the oracle and the value (:func:`_next_use_time`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvretain.core.hashing import BlockHash
from kvretain.core.policies._lazyheap import HeapOrderedPolicy
from kvretain.core.policy import POLICIES, PolicyConfig
from kvretain.core.retention import show_value

_NEVER = 1e9  # next-use times (request indices, seconds) stay below this; keeps depth exact in the key
_DEPTHS = 1 << 20
"""Depths the tie-break orders (deeper ones tie): ``_NEVER * _DEPTHS`` < 2**53, so the key is exact in a float.

NOTE: the key was ``next use * 4096 + depth``: a chain of 4,096 blocks or more mixed its depth into the next use
(a leaf at depth 4,100 used at request j sorted as if used after j + 1)."""


_NEG_INF = -float("inf")


def _oracle_name(oracle: object) -> str:
    """How an error names the oracle: its qualified name (``replay.<locals>.next_use``), else its repr."""
    name = getattr(oracle, "__qualname__", None)
    return name if isinstance(name, str) else show_value(oracle)


def _next_use_time(oracle: Callable[[BlockHash], float], h: BlockHash, t: object) -> float:
    """The oracle's answer ``t`` for hash ``h`` that is not a float above -inf, as a float, or a ``ValueError``
    naming the oracle and what it returned (a ``None`` or a string failed inside the key's arithmetic with
    "'<' not supported between instances of 'float' and 'NoneType'").

    An int (one past a float's range: inf), a numpy float or a ``Decimal`` is converted; a bool, a string
    (``float("3")`` reads one) and anything ``float`` refuses are refused, and so are NaN (every comparison
    false: the heap's order undone) and -inf (no time; every such block would tie at +inf, its depth lost).

    The key is computed as a block becomes evictable, inside the pool's release or eviction: the error comes
    from there and the pool is left mid-operation (as by any exception of the oracle's own). A replay's oracle
    answers for every hash of its trace."""
    if not isinstance(t, bool | str | bytes | bytearray):
        try:
            f = float(t)  # type: ignore[arg-type]
        except OverflowError:  # (an int past a float's range: min(t, _NEVER) took one above it as never)
            if t > 0:  # type: ignore[operator]
                return float("inf")
        except (TypeError, ValueError):
            pass
        else:
            if f > _NEG_INF:  # (not NaN, not -inf)
                return f
    raise ValueError(
        f"policy 'belady': its next_use oracle {_oracle_name(oracle)} returned {show_value(t)} for block hash "
        f"{show_value(h)}; it must return a number, the time of the block's next use (inf: never used again)"
    )


@POLICIES.register("belady", "offline oracle: evict the block whose next use is farthest (replay only)")
class BeladyPolicy(HeapOrderedPolicy):
    name = "belady"
    tracks_uses = False

    def __init__(
        self, num_blocks: int, config: PolicyConfig | None = None, *, capacity: int | None = None
    ) -> None:
        super().__init__(num_blocks, config, capacity=capacity)
        if self.config.next_use is None:
            raise ValueError(
                "policy 'belady' is an offline oracle: it needs PolicyConfig(next_use=...) and works only in "
                "trace replay (kvretain replay), not in online serving"
            )
        self._next_use = self.config.next_use
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._depth = [0] * num_blocks

    def on_cached(self, block_id: int, block_hash: BlockHash, depth: int, now: float) -> None:
        self._hash[block_id] = block_hash
        self._depth[block_id] = depth

    def _key(self, block_id: int, now: float) -> float:
        h = self._hash[block_id]
        assert h is not None
        t = self._next_use(h)
        if t.__class__ is not float or not t > _NEG_INF:  # (NaN and -inf; an int is converted)
            t = _next_use_time(self._next_use, h, t)
        # farthest next use first; among blocks never used again (next use capped to a finite horizon so the
        # tie-break survives), the deepest first
        return -min(t, _NEVER) * _DEPTHS - min(self._depth[block_id], _DEPTHS - 1)

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self._hash[block_id] = None
