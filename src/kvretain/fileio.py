"""Outputs written whole or not at all: a Ctrl-C, a full disk or an error half-way leaves no half-written file
or report folder behind (and an earlier output of the same name as it was).

:func:`replaced` writes one file through a temporary name in the same folder, renamed onto the target on
success; :func:`output_file` opens one that way, or writes a standard stream named as a file
(``--out /dev/stdout``) through its own descriptor; :class:`StagedFolder` collects a report's files in a
temporary folder (inside the target when it exists), moved into place on success. They remove what they wrote otherwise.
"""

from __future__ import annotations

import errno
import io
import os
import secrets
import shutil
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TextIO


def as_written(value: Any) -> str:
    """A value read from a JSON or TOML file, for an error message, as the file spells it: ``true``, ``false``,
    ``null`` (Python's ``True`` and ``None`` are nobody's spelling there); anything else as ``repr``."""
    if value is None or type(value) is bool:
        return "null" if value is None else ("true" if value else "false")
    return repr(value)


def not_utf8(e: UnicodeDecodeError) -> str:
    """Why a file that should be UTF-8 text is not, for a one-line error: the first bad byte and its offset (or,
    for a file that starts with gzip's magic bytes, that it is compressed)."""
    if e.start < 2 and bytes(e.object[:2]) == b"\x1f\x8b":
        return "gzip-compressed, not text (decompress it first: gunzip)"
    return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})"


def standard_stream(path: str | Path) -> TextIO | None:
    """``sys.stdout`` or ``sys.stderr`` when ``path`` names the file, pipe or terminal it writes to
    (``/dev/stdout``, ``/dev/fd/2``, or the file the shell redirected it to), else ``None``; never for
    ``/dev/null`` (a command silenced with ``> /dev/null`` and writing ``--out /dev/null`` is not writing to its
    own output)."""
    try:
        st = os.stat(path)
        if os.path.samestat(st, os.stat(os.devnull)):
            return None
    except (OSError, ValueError):
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.path.samestat(st, os.fstat(stream.fileno())):
                return stream
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # (closed, or not a real file)
            continue
    return None


def written_in_place(path: str | Path) -> bool:
    """Whether ``path`` is written where it is rather than replaced (:func:`replaced`): it exists and is
    neither a regular file nor a folder (``/dev/stdout``, a pipe, a device). Tested on ``path`` itself: stat
    follows ``/dev/stdout`` to its pipe, whose resolved name (``/proc/PID/fd/pipe:[N]``) is no file's."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


@contextmanager
def output_file(path: str | Path, binary: bool = False) -> Iterator[IO[Any]]:
    """An open file (text in UTF-8, or ``binary``) whose content becomes ``path``'s, whole or not at all
    (:func:`replaced`). A ``path`` that names this process's standard output or error
    (:func:`standard_stream`) is written through that stream's own descriptor, in place: reopening
    ``/dev/stdout`` would truncate a file the shell opened for appending (``>>``), and renaming onto it would
    replace the file under the shell's descriptor and lose what else the shell writes there. Such an output
    cannot be taken back: what was written before an error stays."""
    stream = standard_stream(path)
    if stream is not None:
        stream.flush()
        buf = stream.buffer
        if binary:
            yield buf
        else:
            text = io.TextIOWrapper(buf, encoding="utf-8", newline="\n", write_through=True)
            try:
                yield text
            finally:
                text.flush()
                text.detach()  # (the stream's buffer stays open)
        buf.flush()
        return
    with replaced(path) as tmp, tmp.open("wb" if binary else "w", encoding=None if binary else "utf-8") as fh:
        yield fh


def _is_link_loop(path: Path) -> bool:
    """Whether following the links of ``path`` comes back round (ELOOP) rather than to nothing."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def _partial_name(folder: Path, name: str) -> Path:
    return folder / f".{name or 'out'}.{secrets.token_hex(4)}.partial"


@contextmanager
def replaced(path: str | Path) -> Iterator[Path]:
    """The path to write ``path``'s new content to: a new file beside it, renamed onto ``path`` when the block
    ends without an error and removed when it does not. ``path`` itself is replaced in one step (a reader sees
    the old file or the new one); a symbolic link keeps pointing at the new file. A ``path`` that exists and is
    not a regular file (``/dev/stdout``, a pipe) is written in place."""
    if written_in_place(path):
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


def _not_a_folder(path: Path) -> str:
    """What ``path``, which is there and no folder, is instead: ``'x' is a file``, ``'/dev/null' is a device,
    not a folder`` (a device, a named pipe or a socket was called a file)."""
    if path.is_file():
        return f"{str(path)!r} is a file"
    kinds = [
        (path.is_char_device() or path.is_block_device(), "a device"),
        (path.is_fifo(), "a named pipe"),
        (path.is_socket(), "a socket"),
    ]
    kind = next((k for found, k in kinds if found), None)
    return f"{str(path)!r} is {kind}, not a folder" if kind else f"{str(path)!r} is not a folder"


class StagedFolder:
    """A folder of outputs built under a temporary name (:attr:`path`) and moved into place by :meth:`commit`:
    staged in the nearest folder of ``path`` that exists and renamed to ``path`` when there is none yet (its
    missing parents made then), else staged inside the existing folder and its files moved there one by one,
    and any of ``names`` it does not hold removed there (an earlier output's, which would pass for this one's).
    :meth:`discard` (a no-op after :meth:`commit`) removes it.

    Raises ``OSError`` when the folder cannot be made: ``path`` is a file, a parent is a file, ``path`` or a
    parent is a link to nothing (or a loop of links), no permission, or one of ``names`` (the files the folder
    will hold) is a folder in ``path`` already. :meth:`commit` checks every file against ``path`` before it
    moves any, so an existing folder is updated whole or not at all."""

    def __init__(self, path: str | Path, names: Sequence[str] = ()) -> None:
        self.target = Path(path)
        if self.target.exists() and not self.target.is_dir():
            raise FileExistsError(_not_a_folder(self.target))
        if self.target.is_dir() and not os.access(self.target, os.W_OK | os.X_OK):
            raise PermissionError(f"{str(self.target)!r}: permission denied")
        anchor = self.target
        while not anchor.exists() and anchor != anchor.parent:  # the nearest folder that exists
            if anchor.is_symlink():
                if _is_link_loop(anchor):  # (its link is there: "which is not there" would be untrue)
                    raise NotADirectoryError(f"{str(anchor)!r} is a loop of links")
                raise NotADirectoryError(
                    f"{str(anchor)!r} is a link to {os.readlink(anchor)!r}, which is not there"
                )
            anchor = anchor.parent
        if not anchor.is_dir():
            raise NotADirectoryError(_not_a_folder(anchor))
        self.names = tuple(names)
        self._check_names(self.names)
        # in the nearest folder that exists: ``path`` itself when it does, so that the files are moved within one
        # filesystem also when ``path`` is a mount point or a link to another disk (a stage beside it would be on
        # its parent's filesystem, and the moves fail there after every run)
        self.path = _partial_name(anchor, self.target.resolve().name)
        self.path.mkdir()
        self._done = False

    def _check_names(self, names: Iterable[str]) -> None:
        """None of ``names`` is a folder in an existing :attr:`target` (a file cannot replace it)."""
        if self.target.is_dir():
            for name in names:
                if (self.target / name).is_dir():
                    raise IsADirectoryError(
                        f"{str(self.target / name)!r} is a folder where a file of this report goes"
                    )

    def commit(self) -> None:
        if not self.target.exists():
            self.target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path, self.target)
        else:
            files = sorted(self.path.iterdir())
            self._check_names(f.name for f in files)  # (before any moves: whole or not at all)
            for f in files:
                os.replace(f, self.target / f.name)
            self.path.rmdir()
            for name in set(self.names) - {f.name for f in files}:  # an earlier output's, not this one's
                (self.target / name).unlink(missing_ok=True)
        self._done = True

    def discard(self) -> None:
        if not self._done:
            shutil.rmtree(self.path, ignore_errors=True)
            self._done = True
