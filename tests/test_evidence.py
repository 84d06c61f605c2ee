"""The paired-difference rule of the protection controller's window (kvretain.core.policies.evidence), pinned to
hand computations."""

from __future__ import annotations

import pytest

from kvretain.core.policies.evidence import MIN_TOLERANCE, confidence, needed_refs


def test_needed_window_is_refs_times_paired_noise_over_the_squared_tolerance() -> None:
    # 1,000 references, pool 100 hits against 101: a 1% difference, below a 2% margin, so the margin is resolved:
    # 1000 * 50 / (101**2 * 0.02**2) = 12,253.7
    assert needed_refs(1000.0, 50.0, 100.0, 101.0, 0.02) == pytest.approx(1000 * 50 / (101**2 * 0.02**2))


def test_a_large_difference_is_resolved_as_soon_as_it_stands_above_the_noise() -> None:
    # 80 against 100: the measured 20% is the tolerance, not the 2% margin
    assert needed_refs(1000.0, 50.0, 80.0, 100.0, 0.02) == pytest.approx(1000 * 50 / (100**2 * 0.2**2))


def test_the_tolerance_never_falls_below_one_percent() -> None:
    got = needed_refs(1000.0, 50.0, 100.0, 100.0, 0.001)
    assert got == pytest.approx(1000 * 50 / (100**2 * MIN_TOLERANCE**2))


def test_no_evidence_asks_for_no_window_and_full_confidence() -> None:
    assert needed_refs(1000.0, 0.0, 10.0, 12.0, 0.02) == 0.0
    assert needed_refs(1000.0, 5.0, 0.0, 0.0, 0.02) == 0.0
    assert confidence(0.0, 10.0, 12.0, 0.02) == 1.0


def test_confidence_is_the_share_of_the_needed_window_held_capped_at_one() -> None:
    # noise sqrt(50) / 101 = 7% of the count against a 2% tolerance: the sums hold (0.02 * 101)**2 / 50 of it
    assert confidence(50.0, 100.0, 101.0, 0.02) == pytest.approx((0.02 * 101) ** 2 / 50)
    assert confidence(0.5, 100.0, 101.0, 0.02) == 1.0
