"""When a difference of two hit counts measured on the same lookups is evidence: the rule that sets the protection
controller's window and confidence (:mod:`kvretain.core.policies.protection`: the pool's hits against its LRU
shadow's). NOTE: the recency/frequency balance keeps its fixed window of ``BALANCE_TURNOVERS``: given this rule
too, it moved the grid's worst cell from 0.975x to 0.954x lru and changed no miss count (docs/results.md).

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
  evidence is scaled down by it (a cold start moves slowly instead of acting on noise).
"""

from __future__ import annotations

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
