"""The paired-difference rule of the protection controller's window (kvretain.core.policies.evidence), pinned to
hand computations."""

from __future__ import annotations

import pytest

from kvretain.core.policies.evidence import MIN_TOLERANCE, confidence, needed_refs, paired_difference


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


def test_a_paired_difference_is_the_sum_of_per_request_differences_with_its_standard_error() -> None:
    # differences 0, -2, +4: sum 2, mean 2/3, sample variance ((2/3)^2 + (8/3)^2 + (10/3)^2) / 2 = 28/3,
    # standard error of the sum sqrt(3 * 28/3) = sqrt(28)
    p = paired_difference([3, 0, 5], [3, 2, 1])
    assert (p.requests, p.differ, p.base, p.diff) == (3, 2, 6, 2)
    assert p.se == pytest.approx(28**0.5) and p.z == pytest.approx(2 / 28**0.5)
    assert p.relative == pytest.approx(2 / 6)
    assert p.to_json() == {
        "requests": 3,
        "differ": 2,
        "base_hits": 6,
        "diff_hits": 2,
        "se_hits": round(28**0.5, 3),
        "z": round(2 / 28**0.5, 3),
        "z_bound": round((2 * 2 / 1) ** 0.5, 3),  # (sqrt(k (n - 1) / (n - k)), k = 2 of n = 3)
    }


def test_a_shortfall_on_one_request_of_many_is_not_resolved_and_one_on_every_request_is() -> None:
    # 500 requests: one loses 40 hit blocks (z -1: all of it on one request), or every request loses 1 or 2
    one = paired_difference([10] * 499 + [0], [10] * 499 + [40])
    assert one.diff == -40 and one.differ == 1 and -1.01 < one.z < -0.99
    every = paired_difference([9, 8] * 250, [10] * 500)
    assert every.diff == -750 and every.differ == 500 and every.z < -10


def test_identical_runs_differ_by_nothing_and_unequal_runs_are_refused() -> None:
    p = paired_difference([1, 2, 3], [1, 2, 3])
    assert (p.diff, p.differ, p.se, p.z) == (0, 0, 0.0, 0.0)
    assert paired_difference([], []).z == 0.0
    with pytest.raises(ValueError, match="same requests: 2 against 3"):
        paired_difference([1, 2], [1, 2, 3])
