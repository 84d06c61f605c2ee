"""When a difference of two hit counts measured on the same lookups is evidence: the rule that sets the protection
controller's window and confidence (:mod:`kvretain.core.policies.protection`: the pool's hits against its LRU
shadow's) and the window of the recency/frequency balance's one-class test (:mod:`kvretain.core.policies.balance`,
"One class", since session 47). NOTE: the balance's mixed-traffic rule keeps its fixed window of
``BALANCE_TURNOVERS``: given this rule too, it moved the grid's worst cell from 0.975x to 0.954x lru and changed
no miss count (docs/history.md).

Two counts ``a`` and ``b`` of hits on the same sampled blocks of the same lookups are *paired*: a lookup's
blocks hit or miss together (a request's prefix hits up to a point, then misses), so ``N`` hits of a few
lookups carry the information of a few, not of ``N``. Keep, over the same decayed window as the counts,
``d2 = sum over lookups of (a_lookup - b_lookup) ** 2``. The relative noise of ``a - b`` is then
``sqrt(d2) / max(a, b)`` (the paired-difference estimate; lookups are the independent units), and a window
resolves a relative difference ``tol`` when that noise is below it. The difference to resolve is the margin the
caller is built to act on, or the measured ``|a - b| / max(a, b)`` when that is larger (a large difference is
acted on as soon as it stands above the noise; a small one waits for the evidence that resolves it), and never
below ``MIN_TOLERANCE``.

- :func:`needed_refs`: the window (in sampled references) that resolves the difference, from the references
  ``refs`` the sums now hold: ``refs * d2 / (max(a, b) ** 2 * tol ** 2)`` (the noise falls as the square root
  of the window);
- :func:`confidence`: the share of that window the sums already hold, capped at 1: a step taken on less
  evidence is scaled down by it (a cold start moves slowly instead of acting on noise);
- :func:`paired_difference`: the same pairing over a whole run, for a report: two policies' hit blocks per
  request on the same requests, the difference of their sums and its standard error with requests as the
  independent units (``bench/robustness.py`` states with it whether a cell's class-0 shortfall against LRU is
  resolved or inside the noise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_TOLERANCE = 0.01
"""The smallest relative difference a window is asked to resolve (1%: a margin set below it is not resolved
faster than 1% would be; the windows it asks for are already many turnovers at small pools)."""


def _tolerance_sq(a: float, b: float, margin: float) -> float:
    m = a if a > b else b
    err = abs(a - b) / m if m > 0.0 else 0.0
    tol = margin if margin > err else err
    if tol < MIN_TOLERANCE:
        tol = MIN_TOLERANCE
    return tol * tol


def needed_refs(refs: float, d2: float, a: float, b: float, margin: float) -> float:
    """The sampled references a window must hold to resolve ``a - b`` (module docstring); 0 without evidence."""
    m = a if a > b else b
    if d2 <= 0.0 or m <= 0.0:
        return 0.0
    return refs * d2 / (m * m * _tolerance_sq(a, b, margin))


def confidence(d2: float, a: float, b: float, margin: float) -> float:
    """The share of the needed window the sums hold, in [0, 1] (1 when nothing has differed yet)."""
    if d2 <= 0.0:
        return 1.0
    m = a if a > b else b
    c = m * m * _tolerance_sq(a, b, margin) / d2
    return 1.0 if c > 1.0 else c


@dataclass(frozen=True, slots=True)
class PairedDifference:
    """Two runs' hits on the same requests, compared request by request (:func:`paired_difference`)."""

    requests: int
    """Requests compared."""
    differ: int
    """Requests whose hits differ."""
    base: int
    """Hits of the second run (the reference: LRU's)."""
    diff: int
    """Hits of the first run minus the second's."""
    se: float
    """Standard error of ``diff`` (requests independent: ``sqrt(n * sample variance of the differences)``)."""

    @property
    def z(self) -> float:
        """``diff / se`` (0 when no request differs): beyond about 2 in size, the difference is resolved."""
        return self.diff / self.se if self.se > 0.0 else 0.0

    @property
    def z_bound(self) -> float:
        """The largest ``|z|`` any differences on ``differ`` of ``requests`` requests can give, whatever their size:
        ``sqrt(k (n - 1) / (n - k))``, reached when the ``k`` differences are equal (inf when all differ). With
        few requests differing the test has no power: 3 of hundreds bound ``|z|`` near 1.73, so a loss there can
        never read as resolved, however many blocks it is."""
        n, k = self.requests, self.differ
        return math.sqrt(k * (n - 1) / (n - k)) if k < n else math.inf

    @property
    def relative(self) -> float:
        """``diff / base`` (0 without hits)."""
        return self.diff / self.base if self.base else 0.0

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "requests": self.requests,
            "differ": self.differ,
            "base_hits": self.base,
            "diff_hits": self.diff,
            "se_hits": round(self.se, 3),
            "z": round(self.z, 3),
            "z_bound": round(self.z_bound, 3) if self.z_bound < math.inf else None,
        }


def paired_difference(a: Sequence[int], b: Sequence[int]) -> PairedDifference:
    """``a`` against ``b``: hit blocks per request of two runs over the same requests, in the same order (a
    request's blocks hit or miss together, so requests, not blocks, are the independent units)."""
    if len(a) != len(b):
        raise ValueError(f"paired runs must cover the same requests: {len(a)} against {len(b)}")
    n = len(a)
    d = [x - y for x, y in zip(a, b, strict=True)]
    total = sum(d)
    se = 0.0
    if n > 1:
        mean = total / n
        var = sum((x - mean) * (x - mean) for x in d) / (n - 1)
        se = math.sqrt(n * var)
    return PairedDifference(n, sum(1 for x in d if x), sum(b), total, se)
