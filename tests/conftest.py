"""Fixtures shared by test modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A seeded random-weight tiny Llama written to disk (vLLM tests only: the harness needs vLLM's deps)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import _vllm_harness as harness

    return harness.write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), vocab_size=1000, max_len=4096)
