"""Suite-wide fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

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
