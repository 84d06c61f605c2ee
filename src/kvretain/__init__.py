"""kvretain: priority-aware KV cache retention for LLM serving.

Layers (one-way): ``core`` <- ``sched`` <- ``engine.sim`` / ``engine.torch`` <- ``server``, ``cli``, benchmarks.
"""

__version__ = "0.1.0"
