"""Outputs written whole or not at all: a Ctrl-C, a full disk or an error half-way leaves no half-written file
or report folder behind (and an earlier output of the same name as it was).

:func:`replaced` writes one file through a temporary name in the same folder, renamed onto the target on
success; :class:`StagedFolder` collects a report's files in a temporary folder beside the target, moved into
place on success. Both remove what they wrote otherwise.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _partial_name(folder: Path, name: str) -> Path:
    return folder / f".{name or 'out'}.{secrets.token_hex(4)}.partial"


@contextmanager
def replaced(path: str | Path) -> Iterator[Path]:
    """The path to write ``path``'s new content to: a new file beside it, renamed onto ``path`` when the block
    ends without an error and removed when it does not. ``path`` itself is replaced in one step (a reader sees
    the old file or the new one); a symbolic link keeps pointing at the new file. A ``path`` that exists and is
    not a regular file (``/dev/stdout``, a pipe) is written in place."""
    if os.path.exists(path) and not os.path.isfile(path):
        # NOTE: tested on ``path`` itself, not its resolved name: ``/dev/stdout`` on a pipe resolves to
        # ``/proc/PID/fd/pipe:[N]``, a name no file has (the link is followed by stat, not by realpath)
        yield Path(path)
        return
    target = Path(os.path.realpath(path))
    while True:
        tmp = _partial_name(target.parent, target.name)
        try:  # the permissions a plain open() would give (0o666 less the umask), not mkstemp's 0o600
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:  # pragma: no cover - 32 random bits taken
            continue
    try:
        if target.is_file():
            shutil.copymode(target, tmp)
        yield tmp
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class StagedFolder:
    """A folder of outputs built under a temporary name beside ``path`` (:attr:`path`) and moved into place by
    :meth:`commit`: renamed to ``path`` when there is none yet (its missing parents made then), else its files
    moved into the existing folder one by one. :meth:`discard` (a no-op after :meth:`commit`) removes it.

    Raises ``OSError`` when the folder cannot be made: ``path`` is a file, a parent is a file, no permission."""

    def __init__(self, path: str | Path) -> None:
        self.target = Path(path)
        if self.target.exists() and not self.target.is_dir():
            raise FileExistsError(f"{str(self.target)!r} is a file")
        if self.target.is_dir() and not os.access(self.target, os.W_OK | os.X_OK):
            raise PermissionError(f"{str(self.target)!r}: permission denied")
        anchor = self.target.parent
        while not anchor.exists() and anchor != anchor.parent:  # the nearest folder that exists
            anchor = anchor.parent
        if not anchor.is_dir():
            raise NotADirectoryError(f"{str(anchor)!r} is a file")
        self.path = _partial_name(anchor, self.target.resolve().name)
        self.path.mkdir()
        self._done = False

    def commit(self) -> None:
        if not self.target.exists():
            self.target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path, self.target)
        else:
            for f in sorted(self.path.iterdir()):
                os.replace(f, self.target / f.name)
            self.path.rmdir()
        self._done = True

    def discard(self) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)
            self._done = True
