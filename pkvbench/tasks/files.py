"""Data files on disk: checksums that are computed once per file version."""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from pkvbench.io import os_error


@cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:  # size and mtime key the cache: a changed file is rehashed
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    try:
        stat = path.stat()
        return _sha256(str(path), stat.st_size, stat.st_mtime_ns)
    except OSError as exc:  # unreadable (permissions), or gone since it was found
        raise os_error(path, exc, "read") from None
