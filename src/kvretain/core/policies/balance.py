"""Recency against frequency: which of the two would hit more on this traffic, measured on the controller's
sample, sets how much ``unified``'s value counts a block's uses.

``unified``'s value grows with a block's use count as ``uses ** alpha``. Frequency keeps re-used content
(shared system prompts, long conversations) through scans of one-off blocks; when the pool holds most of the
working set, or when reuse comes in bursts (agents returning after a pause), old counts keep blocks whose reuse
is over, and plain recency does better. ARC (Megiddo and Modha, FAST'03) adapts its split between a recency and
a frequency list from hits in their ghosts; here the two candidates are simulated side by side on a spatial
sample of the traffic (a sub-sample of the controller's, ``BALANCE_SAMPLE`` blocks: the two are compared on the
same references, so a small sample resolves their difference), each as large as the sampled pool:

- an LRU shadow (``alpha = 0``: GreedyDual with equal values is LRU);
- a GreedyDual-Frequency shadow (``alpha = frequency_exponent``, use counts remembered across eviction as the
  pool remembers them, no priorities).

Their hits ``E`` (LRU) and ``G`` (frequency) are summed over the controller's window, and the recency share
``p`` in [0, 1] (``alpha = frequency_exponent * (1 - p)``) integrates ``(E - G) / max(E, G)``, at a rate that
crosses the range in one window when the two differ by the reuse margin (``max_reuse_loss``: the difference the
controller is built to resolve). ``p`` starts at ``START_SHARE`` (0.5); ``alpha`` is quantized to
``1 / ALPHA_STEPS`` of it so the value table is rebuilt only when it moves a step.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from kvretain.core.hashing import BlockHash
from kvretain.core.policies.lfu import GhostTable
from kvretain.core.policies.rules import HALF_USE

ALPHA_STEPS = 32
"""Quantization of ``alpha`` (the frequency table is rebuilt when it moves by one step)."""
START_SHARE = 0.5
"""The recency share before any evidence: halfway between the two candidates (with nothing known about the
traffic, the midpoint bounds the early loss against whichever of the two turns out better)."""


class _GDShadow:
    """A directory of block identities under GreedyDual-Frequency: key ``L + uses ** exponent``, ``L`` the key
    of the last victim; ``capacity`` entries, use counts of evicted ones remembered (``ghost`` entries)."""

    __slots__ = ("L", "_exp", "_ghost", "_heap", "_serial", "cap", "capacity", "entries")

    def __init__(self, capacity: int, exponent: float, cap: int, ghost: int) -> None:
        self.capacity = max(1, capacity)
        self._exp = exponent
        self.cap = cap
        self.entries: dict[BlockHash, tuple[float, int, int]] = {}  # hash -> (key, uses, serial)
        self._heap: list[tuple[float, int, BlockHash]] = []
        self._serial = 0
        self._ghost = GhostTable(ghost)
        self.L = 0.0

    def reference(self, sampled: Sequence[BlockHash]) -> int:
        """Look up ``sampled`` (prefix order), count those resident, then use them, deepest first."""
        entries = self.entries
        hits = 0
        for h in sampled:
            if h in entries:
                hits += 1
        heap = self._heap
        exp = self._exp
        for i in range(len(sampled) - 1, -1, -1):
            h = sampled[i]
            got = entries.get(h)
            uses = (got[1] if got is not None else self._ghost.take(h)) + 1
            if uses > self.cap:
                uses = self.cap
            key = self.L + float(uses) ** exp
            self._serial += 1
            entries[h] = (key, uses, self._serial)
            heapq.heappush(heap, (key, self._serial, h))  # ties: the older first
        while len(entries) > self.capacity:
            key, serial, h = heapq.heappop(heap)
            got = entries.get(h)
            if got is None or got[2] != serial:
                continue  # a stale entry (the block was used again since)
            del entries[h]
            self._ghost.put(h, got[1])
            if key > self.L:
                self.L = key
        if len(heap) > 4 * self.capacity + 64:  # drop stale entries
            self._heap = [(k, s, h) for k, s, h in heap if h in entries and entries[h][2] == s]
            heapq.heapify(self._heap)
        return hits


class FrequencyBalance:
    """The frequency exponent of a value order, set by which of recency and frequency hits more (module
    docstring)."""

    __slots__ = ("_e", "_exp", "_g", "_gain", "_lru", "_shadow", "_tracked", "level", "share")

    def __init__(self, tracked: int, exponent: float, cap: int, ghost_factor: float, margin: float) -> None:
        self._exp = exponent
        self._shadow = _GDShadow(tracked, exponent, cap, int(ghost_factor * tracked))
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self._tracked = tracked
        self._gain = 1.0 / max(margin, 0.01)
        self._e = 0.0
        self._g = 0.0
        self.share = START_SHARE
        self.level = round(ALPHA_STEPS * (1.0 - START_SHARE))

    @property
    def alpha(self) -> float:
        return self._exp * self.level / ALPHA_STEPS

    def update(self, sampled: Sequence[BlockHash], decay: float, window: float) -> bool:
        """One lookup's ``sampled`` blocks (prefix order); ``decay`` is the controller's for this lookup and
        ``window`` its window in these references. Returns True when ``alpha`` moved a step."""
        lru = self._lru
        e_hits = 0
        for h in sampled:
            if h in lru:
                e_hits += 1
        for i in range(len(sampled) - 1, -1, -1):  # deepest first, as a release orders them
            h = sampled[i]
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self._tracked:
            lru.popitem(last=False)
        g = self._shadow.reference(sampled)
        self._e = e = self._e * decay + e_hits
        self._g = gg = self._g * decay + g
        m = e if e > gg else gg
        if m <= 0.0:
            return False
        p = self.share + self._gain * (e - gg) / m * len(sampled) / window
        self.share = p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        level = round(ALPHA_STEPS * (1.0 - p))
        if level != self.level:
            self.level = level
            return True
        return False

    def table(self, cap: int) -> list[float]:
        """``uses ** alpha`` for uses 0..cap (0 uses count as ``HALF_USE``)."""
        a = self.alpha
        return [HALF_USE if u == 0 else float(u) ** a for u in range(cap + 1)]
