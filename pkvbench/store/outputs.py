"""The one rule for every file pkvbench writes.

A results folder (a run's, a funnel's, a merge's) is written only by the store that holds it (``results.ResultStore``:
checked, locked, its own files only). Every other file — a report, a table, a page, a figure, an export, a baseline —
is written through ``Outputs``, which writes a file only

- at a path that names a file: not empty (that would be the current folder), not a folder;
- never over a results folder's own files (``samples.jsonl``, ``run.json``, ``summary.csv``, the funnel's, the lock);
- never inside a results folder the command does not read (symlinks resolved): a report may go beside the runs it
  reads, never into another run; a baseline (``check --update``) goes inside none of the folders it is made from;
- where no file is yet, or over a file pkvbench wrote there itself that nobody has changed since. Each file written is
  recorded with its SHA-256 in ``.pkvbench-outputs.json`` beside it (a record that cannot be written, a folder of
  that name, refuses the file before it is written); a file is pkvbench's while its content still has
  that hash (a baseline is also recognised by its header, as baselines written before that record are). A user's
  file of the same name is never replaced, nor a pkvbench file the user has edited.

All of a command's files are checked before the first is written, then each is written atomically
(``io.atomic_write``: a kill or a full disk leaves the previous version). A refusal is one line naming the path.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pkvbench.errors import PkvError
from pkvbench.io import atomic_write, os_error
from pkvbench.store.lock import command_line
from pkvbench.store.results import RUN_FOLDER_FILES

MANIFEST = ".pkvbench-outputs.json"
# A folder holding one of these is a results folder (a run's or a funnel's).
RECORDS = ("run.json", "samples.jsonl", "funnel.json", "funnel_samples.jsonl")
# A results folder's own files: only the store that holds the folder writes them (``funnel.funnel_store`` names the
# funnel's; a test checks the two lists agree).
RESULTS_FILES = frozenset(
    {*RUN_FOLDER_FILES, *RECORDS, "funnel.csv", "funnel_heads.csv", "verdict.txt", "funnel.png", MANIFEST}
)


def is_results_folder(folder: Path) -> bool:
    return any((folder / name).is_file() for name in RECORDS)


def _sha256(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None
    return digest.hexdigest()


def _record(folder: Path) -> dict[str, dict]:
    """``.pkvbench-outputs.json`` of ``folder``: file name → what pkvbench wrote there. A missing or damaged record
    recognises nothing (a file it cannot vouch for is left alone)."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    return {k: v for k, v in files.items() if isinstance(v, dict)} if isinstance(files, dict) else {}


def csv_with_columns(columns: Iterable[str]) -> Callable[[Path], bool]:
    """A recogniser of CSV files whose header line holds ``columns`` (how a baseline is known by its header)."""
    wanted = set(columns)

    def recognise(path: Path) -> bool:
        try:
            with open(path, encoding="utf-8") as handle:
                header = handle.readline().strip()
        except (OSError, UnicodeDecodeError):
            return False
        return wanted <= set(header.split(","))

    return recognise


@dataclass(frozen=True)
class Kind:
    """What a file is: ``recognise`` knows one pkvbench wrote by its content (for files written before they were
    recorded); ``apart_from_inputs``: never inside a folder the command reads (a baseline made from runs)."""

    name: str
    recognise: Callable[[Path], bool] | None = None
    apart_from_inputs: bool = False


REPORT = Kind("report")


@dataclass
class _Staged:
    given: str
    target: Path
    data: bytes
    kind: Kind


class Outputs:
    """The files one command writes. ``check`` refuses a path now (before any work); ``add`` stages a file;
    ``commit`` checks every staged path again, then writes them all and records them.

    ``option`` names the path in messages (``--out``); ``reads`` are the folders the command reads (its run folders)."""

    def __init__(self, option: str = "--out", reads: Iterable[str | os.PathLike] = ()):
        self.option = option
        self.reads = [_resolved(r, option) for r in reads if str(r)]
        self.command = command_line()
        self._staged: dict[Path, _Staged] = {}

    # --- checking ----------------------------------------------------------------------------------------------

    def check(self, path: str | os.PathLike, kind: Kind = REPORT) -> Path:
        """The resolved target of ``path``, or ``PkvError`` if pkvbench may not write a ``kind`` file there."""
        given = _given(path, self.option)
        target = _resolved(given, self.option)
        if target.is_dir():
            raise PkvError(f"{self.option} {given} is a folder; give a file name")
        if target.name == MANIFEST:
            raise PkvError(f"{self.option} {given}: {MANIFEST} is pkvbench's record of the files it wrote")
        self._check_place(given, target.parent, kind, file_name=target.name)
        record = target.parent / MANIFEST
        if (record.exists() or record.is_symlink()) and not record.is_file():  # checked now, not after the write
            raise PkvError(
                f"{self.option} {given}: {record} is not a file, so pkvbench could not record the file it writes "
                "beside it (and would refuse to overwrite it later); move it away, or write elsewhere"
            )
        if (target.exists() or target.is_symlink()) and not self._recognised(target, kind):
            raise PkvError(
                f"{self.option} {given} exists and pkvbench did not write it (or it was changed since); pkvbench "
                "never overwrites a file it did not write: move it, or give another name"
            )
        return target

    def check_folder(self, path: str | os.PathLike) -> Path:
        """A folder to write files into (``plot --out``, ``export --out``): a folder, or a path one can be made at,
        inside no results folder the command does not read."""
        given = _given(path, self.option)
        folder = _resolved(given, self.option)
        if folder.exists() and not folder.is_dir():
            raise PkvError(f"{self.option} {given} is a file, not a folder")
        self._check_place(given, folder, REPORT)
        return folder

    def _check_place(self, given: str, folder: Path, kind: Kind, file_name: str | None = None) -> None:
        """Whether files may go into ``folder`` (resolved): it can be made, and lies inside no results folder the
        command does not read (and, for a ``kind`` kept apart from its inputs, inside none it reads)."""
        existing = folder
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise PkvError(f"cannot create {given}: {existing} is a file, not a folder")
        if kind.apart_from_inputs:
            for read in self.reads:
                if read == folder or read in folder.parents:
                    raise PkvError(
                        f"{self.option} {given} is inside {read}, which this {kind.name} is made from; write it "
                        "outside the folders it reads"
                    )
        for ancestor in (folder, *folder.parents):
            if not is_results_folder(ancestor):
                continue
            if ancestor == folder and file_name in RESULTS_FILES:
                raise PkvError(
                    f"{self.option} {given}: {file_name} is a file of the results folder {ancestor}, written only "
                    "by the run that holds it"
                )
            if ancestor not in self.reads:
                raise PkvError(
                    f"{self.option} {given} is inside the results folder {ancestor}, which this command does not "
                    "read; pkvbench writes into a run folder only its results, or reports made from it"
                )

    @staticmethod
    def _recognised(target: Path, kind: Kind) -> bool:
        """Whether the file at ``target`` is pkvbench's: what it recorded writing there, unchanged, or a file of
        ``kind`` known by its content."""
        if not target.is_file():
            return False
        entry = _record(target.parent).get(target.name, {})
        if entry.get("sha256") and entry["sha256"] == _sha256(target):
            return True
        return kind.recognise is not None and kind.recognise(target)

    # --- writing -----------------------------------------------------------------------------------------------

    def add(self, path: str | os.PathLike, data: str | bytes, kind: Kind = REPORT) -> Path:
        """Stage ``data`` for ``path`` (checked now and again at ``commit``); returns ``path`` as given."""
        target = self.check(path, kind)
        payload = data.encode("utf-8") if isinstance(data, str) else data
        if target in self._staged:
            raise PkvError(f"{self.option}: two files of this command would both be written to {path}")
        self._staged[target] = _Staged(str(path), target, payload, kind)
        return Path(path)

    def commit(self) -> list[Path]:
        """Check every staged file again (the disk may have changed meanwhile), then write each atomically and
        record it beside itself; returns the paths as given."""
        staged = list(self._staged.values())
        for item in staged:
            self.check(item.given, item.kind)
        written: dict[Path, dict[str, str]] = {}
        try:
            for item in staged:
                _make_folder(item.target.parent, item.given)
                atomic_write(item.target, item.data)
                written.setdefault(item.target.parent, {})[item.target.name] = hashlib.sha256(item.data).hexdigest()
        finally:  # what was written is recorded, even when a later file fails
            for folder, digests in written.items():
                self._remember(folder, digests)
        self._staged.clear()
        return [Path(item.given) for item in staged]

    def _remember(self, folder: Path, digests: dict[str, str]) -> None:
        record = _record(folder)
        when = datetime.now(timezone.utc).isoformat(timespec="seconds")
        for name, digest in digests.items():
            record[name] = {"sha256": digest, "written": when, "by": self.command}
        text = json.dumps({"about": "files pkvbench wrote here; it overwrites only these", "files": record}, indent=1)
        atomic_write(folder / MANIFEST, text + "\n")


def _given(path: str | os.PathLike, option: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise PkvError(f"{option} {path!r}: expected a path")
    given = os.fspath(path)
    if not str(given).strip():
        raise PkvError(f"{option} '': an empty path would mean the current folder; give a name")
    return str(given)


def _resolved(path: str | os.PathLike, option: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise PkvError(f"{option} {path}: cannot follow it ({getattr(exc, 'strerror', None) or exc})") from None


def _make_folder(folder: Path, given: str) -> None:
    if folder.is_dir():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(given, exc) from None
