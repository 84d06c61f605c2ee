"""Suite-wide fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def _ray_keeps_its_sessions_in_a_private_folder() -> Iterator[None]:
    """The benches' ``--ray local`` starts a Ray cluster, which leaves its session folder under ``RAY_TMPDIR``
    (default /tmp/ray) when it stops: two per run of this suite, kept forever. The suite gives Ray a short
    private folder (Ray's socket paths must fit 107 characters) and removes it at the end."""
    folder = tempfile.mkdtemp(prefix="kvr-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def savefig_fails_half_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib's ``Figure.savefig`` writes the start of a PNG to its target (a path or an open file) and then
    fails as a full disk does: a plot written straight into its file would leave it truncated."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    def half(self: Any, fname: Any, *args: Any, **kwargs: Any) -> None:
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG half")
        else:
            Path(fname).write_bytes(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", half)
