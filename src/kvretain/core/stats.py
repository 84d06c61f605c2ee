"""Per request-priority-class cache statistics: the one type that the core :class:`KVCacheManager`, the
block replay (:mod:`kvretain.replay`), the simulator and the vLLM plugin (:mod:`kvretain.integrations.vllm`)
count with.

Counting rules (each written here once):

* **First lookups.** A request's hit ratio counts its *first* prefix-cache lookup only: ``requests``,
  ``query_tokens`` (the tokens it asked for) and ``hit_tokens`` (the cached prefix it got). This is vLLM's
  ``requests`` / ``queries`` / ``hits`` (``PrefixCacheStats.record`` with ``preempted=False``). As in vLLM
  0.33, a lookup counts when the request is *admitted*, with the hits it was admitted with: a request that
  waits for blocks is looked up again at every step, and those lookups do not count.
* **Resumes.** A lookup by a request resumed after a preemption (``num_preemptions > 0``) is counted apart, in
  ``resumes`` / ``resume_query_tokens`` / ``resume_hit_tokens`` (vLLM's ``preempted_*``). Its hits are mostly
  the request's own blocks, freed a moment ago: counting them as lookups would credit the cache with the
  scheduler's recompute, once per preemption (on the multi-tenant workload it doubled class 0's hit ratio).
* **Evictions** are attributed to the class of the block's *last releaser*: the last request that released the
  block (whether that release freed it, or something other than a request, such as a copy-on-write source held
  until the copy has run, freed it later). That release set the block's retention (vLLM-style
  retention is what the releasing request asks for), so an eviction is charged to the class whose retention
  the policy weighed when it chose the victim. A block's first allocator is not used: a system prompt
  allocated once by a batch request and re-used (and released) by chat requests is chat's to lose.
* **Releases.** ``released_blocks`` counts the cached blocks (holding content: hashed) a request of the class
  released, at every release (a block held by several requests counts once per releasing request); a partial
  last block, which no lookup can find, is no cached block (the vLLM plugin counts the blocks its queue is told
  of, the hashed ones).

:class:`CacheStats` holds one :class:`ClassStats` per class and the per-block releaser classes that the
eviction rule needs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class ClassStats:
    """Counters of one request-priority class (lower priority = more important)."""

    requests: int = 0
    """First lookups: one per request that looked the cache up."""
    query_tokens: int = 0
    hit_tokens: int = 0
    resumes: int = 0
    """Lookups of requests resumed after a preemption (counted apart from ``requests``)."""
    resume_query_tokens: int = 0
    resume_hit_tokens: int = 0
    released_blocks: int = 0
    """Blocks released by requests of this class (each release counts)."""
    evicted_blocks: int = 0
    """Cached blocks evicted whose last releaser had this class."""

    @property
    def hit_rate(self) -> float:
        """Hit tokens over query tokens of first lookups."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def resume_hit_rate(self) -> float:
        return self.resume_hit_tokens / self.resume_query_tokens if self.resume_query_tokens else 0.0

    def record_lookup(self, query_tokens: int, hit_tokens: int, resumed: bool) -> None:
        if resumed:
            self.resumes += 1
            self.resume_query_tokens += query_tokens
            self.resume_hit_tokens += hit_tokens
        else:
            self.requests += 1
            self.query_tokens += query_tokens
            self.hit_tokens += hit_tokens

    def add(self, other: ClassStats) -> None:
        """Add ``other``'s counters to these (replicas of a cluster)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        # (no lookup, or no resume: no ratio, null rather than a 0 that reads as "missed everything")
        out["hit_rate"] = round(self.hit_rate, 6) if self.query_tokens else None
        out["resume_hit_rate"] = round(self.resume_hit_rate, 6) if self.resume_query_tokens else None
        return out


def merge_class_stats(tables: Iterable[Mapping[int, ClassStats]]) -> dict[int, ClassStats]:
    """The per-class sums of several tables (one per replica)."""
    out: dict[int, ClassStats] = {}
    for t in tables:
        for c, st in t.items():
            acc = out.get(c)
            if acc is None:
                acc = out[c] = ClassStats()
            acc.add(st)
    return out


class CacheStats:
    """The per-class statistics of one block pool of ``num_blocks`` blocks (see the module docstring)."""

    __slots__ = ("_releaser", "by_class")

    def __init__(self, num_blocks: int) -> None:
        self.by_class: dict[int, ClassStats] = {}
        self._releaser: list[int | None] = [None] * num_blocks

    def of(self, priority: int) -> ClassStats:
        st = self.by_class.get(priority)
        if st is None:
            st = self.by_class[priority] = ClassStats()
        return st

    def record_lookup(self, priority: int, query_tokens: int, hit_tokens: int, resumed: bool) -> None:
        self.of(priority).record_lookup(query_tokens, hit_tokens, resumed)

    def released(self, block_ids: Sequence[int], priority: int, cached: int | None = None) -> None:
        """A request of class ``priority`` releases ``block_ids`` (call it for every release), of which ``cached``
        hold cached content (default: all)."""
        rel = self._releaser
        for b in block_ids:
            rel[b] = priority
        self.of(priority).released_blocks += len(block_ids) if cached is None else cached

    def evicted(self, block_ids: Sequence[int], block_hashes: object = None) -> None:
        """``block_ids`` were evicted (the signature of ``BlockPool.on_evict_batch``)."""
        classes = list(map(self._releaser.__getitem__, block_ids))
        if not classes:
            return
        first = classes[0]
        if classes.count(first) == len(classes):  # one class (a Counter costs more than the count)
            if first is not None:
                self.of(first).evicted_blocks += len(classes)
            return
        for c, k in Counter(classes).items():
            if c is not None:
                self.of(c).evicted_blocks += k
