"""Helpers shared by the PNGs the project draws (``compare``, ``profile``, bench/sim_fidelity.py). Matplotlib is
imported by the caller (it is optional); these take its objects."""

from __future__ import annotations

from typing import Any


def plain_log_ticks(axis: Any) -> None:
    """Plain-number tick labels on a log ``axis`` (``0.3``, ``20``; not ``3x10^-1``), the minor ticks labelled
    too where the axis spans under a decade (all of them under 0.6 of one).

    NOTE: matplotlib's default labels a log axis spanning one decade at every minor tick in scientific notation,
    wide enough to run into each other (``3x10^-1`` over ``4x10^-1``); a span of half a decade read as one label."""
    from matplotlib.ticker import LogFormatter

    class _Plain(LogFormatter):
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    axis.set_major_formatter(_Plain(labelOnlyBase=False, minor_thresholds=(1, 0.6)))
    axis.set_minor_formatter(_Plain(labelOnlyBase=False, minor_thresholds=(1, 0.6)))
