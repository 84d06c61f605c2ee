"""kvretain: priority-aware KV cache retention for LLM serving.

Layers (one-way): ``core`` <- ``sched`` <- ``engine.sim`` <- ``cli``, benchmarks; ``workloads`` and ``replay``
beside them (see docs/architecture.md).
"""

__version__ = "0.1.0"
"""The package version (pyproject.toml reads it from here)."""
