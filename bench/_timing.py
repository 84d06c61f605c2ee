"""Time a method's calls into a running total: the one wrapper of the benches that split their time by method
(``pool_ops.py --phases``, ``vllm_plugin.py --hook-times``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def time_calls(owner: Any, name: str, totals: dict[str, int], label: str, clock: Callable[[], int]) -> None:
    """Replace ``owner.name`` (a class's method, or an instance's as an instance attribute, the class untouched)
    by a wrapper that adds each call's ``clock()`` difference to ``totals[label]`` (set to 0 if absent), also when
    the call raises."""
    inner = getattr(owner, name)
    totals.setdefault(label, 0)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] += clock() - t0

    setattr(owner, name, timed)
