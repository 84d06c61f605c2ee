"""Whether a block pool of a given size fits in this machine's memory, checked before anything is allocated.

A pool keeps one slotted object per block (``BlockState``, or the policy's subclass of it), the policy's own
per-block entries and, once blocks are cached, their hashes in the pool's index. :func:`pool_bytes_per_block`
measures all of that (peak traced allocation, ``tracemalloc``) on a small pool of the same policy filled with
cached blocks and released, so the estimate follows the real objects rather than a constant.
:func:`check_pool_fits` compares ``num_blocks`` x that with the memory available now (``MemAvailable`` of
``/proc/meminfo``, or ``os.sysconf`` elsewhere; a lower cgroup limit wins) and raises :class:`PoolTooLargeError`
with the estimate. ``kvretain replay`` and ``kvretain simulate`` / ``compare`` call it before building pools.
"""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from kvretain.core.block_pool import BlockPool
from kvretain.core.policy import INF, PolicyConfig, make_policy

SAMPLE_BLOCKS = 4096
"""Blocks of the pool measured: large enough that per-pool constants are a small share of the figure."""


UNMEASURED_MULTIPLE = 16
"""A user-sized thing (``replay --sessions``, a generator's settings) up to this many times a size known to be
small (the measured sample, a generator's defaults) is not checked: the defaults take 4-8 MiB and the built-in
replay sample 1 MiB, so 16x is 17-125 MiB, under what any machine running kvretain has free, while measuring
the bytes per item costs 0.07-0.1 s on every run. Set from that cost and those sizes, not from a result."""

R = TypeVar("R")


def peak_bytes(run: Callable[[], R]) -> tuple[int, R]:
    """The peak traced allocation (``tracemalloc``) while ``run()`` runs, above what was allocated before, and
    its result: ``run`` builds a sample and returns what is needed of it, so that the sample is freed on return.
    Tracing is started for the call unless it is already on."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = run()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        if not tracing:
            tracemalloc.stop()


class PoolTooLargeError(ValueError):
    """A pool that cannot fit in the memory available; the message gives the estimate."""


def pool_bytes_per_block(policy: str, config: PolicyConfig | None = None) -> float:
    """Bytes one block of a ``policy`` pool takes at its peak (built, every block cached, released)."""
    cfg = config or PolicyConfig()
    if cfg.next_use is None:
        cfg = replace(cfg, next_use=lambda h: INF)  # belady needs an oracle; its own tables are not per block

    def fill() -> None:
        pool = BlockPool(SAMPLE_BLOCKS, make_policy(policy, SAMPLE_BLOCKS, cfg))
        blocks = pool.get_new_blocks(SAMPLE_BLOCKS)
        assert blocks is not None
        hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(SAMPLE_BLOCKS)]
        pool.cache_blocks(blocks, hashes, 0, SAMPLE_BLOCKS)
        pool.free_blocks(blocks)

    peak, _ = peak_bytes(fill)
    return peak / SAMPLE_BLOCKS


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_memory_bytes() -> int | None:
    """Memory this process can still allocate (bytes), or None when the system does not say."""
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        avail = None
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    cg = Path("/sys/fs/cgroup")
    limit, used = _read_int(cg / "memory.max"), _read_int(cg / "memory.current")
    if limit is not None and used is not None:
        avail = limit - used if avail is None else min(avail, limit - used)
    return avail


def human_count(n: float, grouped: bool = True) -> str:
    """A count ``n`` for a message: its digits (with thousands separators when ``grouped``) below 10**15, in powers
    of ten beyond (``"1.00e+300"``): an integer option given as ``1e300`` is a count of 301 digits, which made the
    one-line error that refuses it several hundred characters long."""
    if n < 1e15:
        return f"{n:,.0f}" if grouped else f"{n:.0f}"
    return f"{n:.2e}"


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit under 1,024 of it (``"1.5 GiB"``); a million PiB or more in powers of
    ten (``"1.06e+282 PiB"``, not 282 digits); ``"an unbounded amount"`` for an infinite or NaN ``n`` (a size
    computed from a setting of 1e308)."""
    if n != n or n == float("inf"):
        return "an unbounded amount"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}" if n < 1e6 else f"{n:.2e} {unit}"
        n /= 1024
    return f"{n:,.1f} PiB"  # pragma: no cover - the loop always returns


def check_pool_fits(
    num_blocks: int,
    policies: list[str],
    config: PolicyConfig | None = None,
    what: str = "num_blocks",
    pools: int = 1,
    pools_are: str = "replicas",
    pools_what: str | None = None,
) -> None:
    """Raise :class:`PoolTooLargeError` when ``pools`` pools of ``num_blocks`` blocks (the most demanding of
    ``policies``) would not fit in the memory available. ``what`` names the setting in the message,
    ``pools_are`` what holds the pools (the simulator's replicas, a bench's processes). ``pools_what``, when
    given, names the setting of the number of pools: the message names it instead of ``what`` when one pool
    fits and only all of them do not (``--replicas 1e300`` was told to use fewer blocks)."""
    avail = available_memory_bytes()
    if avail is None or num_blocks * pools <= SAMPLE_BLOCKS:  # all the pools: many small ones add up
        return
    per, name = max((pool_bytes_per_block(p, config), p) for p in policies)
    count = f"{human_count(num_blocks)} blocks"
    count += f" x {human_count(pools, grouped=False)} {pools_are}" if pools > 1 else ""
    unit = "blocks"
    if pools_what is not None and pools > 1 and per * num_blocks <= avail:  # one pool fits: too many pools
        what = pools_what
        unit = pools_are.partition(" (")[0]  # ("replicas (3 simulations at once)": fewer replicas)
    check_fits(per * num_blocks * pools, what, count, f"{per:,.0f} bytes per block under {name!r}", unit)


def check_fits(need: float, what: str, count: str, per: str, unit: str) -> None:
    """Raise :class:`PoolTooLargeError` when ``need`` bytes (``count`` things of ``per`` each) exceed the
    memory available: ``{what}: {count} need about ... ({per}), more than the ... available; use fewer {unit}``."""
    avail = available_memory_bytes()
    if avail is not None and need > avail:
        raise PoolTooLargeError(
            f"{what}: {count} need about {human_bytes(need)} of memory ({per}), more than the {human_bytes(avail)} "
            f"available; use fewer {unit}"
        )
