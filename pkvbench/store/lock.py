"""One writer per folder: an advisory lock on ``<folder>/.pkvbench.store.lock``, held for as long as a process writes there.

The lock is ``flock`` on the file: it belongs to the open file and goes with the process, so a run killed by SIGKILL
never leaves a stale lock behind. The file says who holds it (pid, host, command, since when), so a second process
that is refused can name the first. The holder removes the file as it lets go; a process that opened the file just
before that and then got the lock sees that the path no longer names its file, and starts over on a new one.
POSIX only (``fcntl``), like the rest of pkvbench's process handling.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path

from pkvbench.errors import PkvError
from pkvbench.io import os_error

LOCK_NAME = ".pkvbench.lock"
COMMAND_LIMIT = 120  # characters of the holder's command line kept in the lock file


def _describe(raw: bytes) -> str:
    """The holder as one phrase: ``pid 123 on host, since 2025-01-01T10:00:00+00:00: pkvbench run …``."""
    try:
        holder = json.loads(raw.decode("utf-8"))
        return f"pid {holder['pid']} on {holder['host']}, since {holder['since']}: {holder['command']}"
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"  # between taking the lock and writing the file


def _read(fd: int) -> bytes:
    return os.pread(fd, 1 << 16, 0)  # a few hundred bytes of JSON


def command_line() -> str:
    """This process's command line, ``python -m pkvbench`` and the console script both shown as ``pkvbench``."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    if program in ("__main__.py", "pkvbench"):
        program = "pkvbench"
    return " ".join([program, *sys.argv[1:]])[:COMMAND_LIMIT]


class FolderLock:
    """The lock of one folder (which must exist to be locked)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise ``PkvError`` naming the process that has it; never waits."""
        if self._fd is not None:
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise os_error(self.path, exc, "lock") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read(fd))
                os.close(fd)
                raise self._in_use(holder) from None
            except OSError as exc:  # e.g. a file system without locks
                os.close(fd)
                raise os_error(self.path, exc, "lock") from None
            try:
                same_file = os.path.samestat(os.stat(self.path), os.fstat(fd))
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)  # the previous holder removed the file as it let go: lock the one that is there now
        self._fd = fd
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": command_line(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode("utf-8"), 0)
        except OSError as exc:
            self.release()
            raise os_error(self.path, exc) from None

    def release(self) -> None:
        """Let go (and remove the file, while still holding it, so nobody locks a file that is going away)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # gone already, or a read-only folder: the lock itself goes with the close
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def _in_use(self, holder: str) -> PkvError:
        return PkvError(
            f"{self.folder} is in use by another pkvbench process ({holder}); wait for it to end, or use another --out"
        )

    def check_free(self) -> None:
        """Refuse a folder another process holds, without creating anything (``acquire`` still decides)."""
        holder = self.holder()
        if holder is not None:
            raise self._in_use(holder)

    def holder(self) -> str | None:
        """Who holds the lock now, or None if nobody does. Creates nothing (a folder being read stays as it is)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None  # no lock file: nobody is writing
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _describe(_read(fd))
            except OSError:
                return None
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
