"""The result store: ``samples.jsonl`` (one line per sample × policy × budget), ``summary.csv``, ``run.json``.

Rows are appended one at a time, flushed and fsynced, so a run killed at any point keeps every finished row; a
partial last line (a kill mid-write) is cut off when the folder is opened again. Rerunning into the same folder
skips the rows already there.

A store touches nothing it did not write. ``claim`` checks the folder before anything slow and locks it for one
writer (``pkvbench.store.lock``); the folder changes only when the run's first row is written (or the run ends with
nothing left to compute): a folder being replaced (``--overwrite``) loses its previous pkvbench files then, never a
file of anyone else's, and a run refused or failed before its first row leaves the folder as it was (a folder it
made is removed again). A store may own folders too (``pkvbench lm-eval``'s ``lm_eval/``): they go with its files.
``run.json`` and ``summary.csv`` are replaced atomically (``io.atomic_write``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pkvbench.cell.budgets import ALL, MEMORY_PREFIX, REMOVED_PREFIX, Budget, budget_label
from pkvbench.cell.kv_formats import format_of_row
from pkvbench.cell.schema import DEFAULT_QUERY_MODE, NO_TURNS, QUERY_MODES, TURN_COMPRESSIONS
from pkvbench.errors import PkvError
from pkvbench.io import (
    atomic_write,
    is_staging_file,
    make_dir,
    os_error,
    read_json,
    read_json_lines,
    remove_file,
    remove_tree,
)
from pkvbench.store.lock import LOCK_NAME, FolderLock

ROWS = "samples.jsonl"
SUMMARY = "summary.csv"
RUN = "run.json"
RUN_FOLDER_FILES = (ROWS, SUMMARY, RUN, LOCK_NAME)  # what pkvbench keeps in a run folder (nothing else is its own)
# Options whose order carries no meaning: the same policies or budgets in another order are the same grid. Tasks,
# lengths, depths and sample ids too, unless the run is sharded: then their order decides which shard takes a sample.
ORDERLESS = ("policies", "budgets", "query_modes", "kv_bits")
ORDERLESS_UNLESS_SHARDED = ("tasks", "lengths", "depths", "sample_ids")
# The recorded versions under which rows may come out otherwise (kernels, model code, weights, pkvbench's own rules):
# a folder's rows are not resumed or merged across a change of one. Others (python) are noted.
DECISIVE_VERSIONS = ("pkvbench", "torch", "transformers", "model_package")

Row = dict[str, Any]


def row_key(row: Row) -> tuple[str, ...]:
    """What makes a row unique: task, sample, policy, budget, query mode, decode budget and, for a cache not stored
    as the model's own, how it was stored (rows written before the query mode was recorded are query-aware; rows
    without a decode budget never cut their cache while decoding; before storage formats, the model's own cache)."""
    stored, decode = stored_as(row), decode_budget_label(row.get("decode_budget"))
    turns = row.get("turn_compression")
    return (
        row["task"],
        str(row["sample_id"]),
        row["policy"],
        budget_label(row["budget"]),
        row.get("query_mode", DEFAULT_QUERY_MODE),
        # only where the row has them: the keys of rows of earlier versions keep their shape
        *((f"decode {decode}",) if decode != "none" else ()),
        *((stored,) if stored else ()),
        *((f"turns {turns}",) if turns and turns != NO_TURNS else ()),
    )


def decode_budget_label(value: Any) -> str:
    """How a row's decode budget is written in keys and tables: its entry count, or ``none``."""
    if value is None or (isinstance(value, float) and value != value) or value == "none":  # a label read back
        return "none"
    return str(int(value))


def _given(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def stored_as(row: Row) -> str:
    """How a row's cache was stored, as keys name it: "" for the model's own cache, else its ``KVFormat``: ``16``,
    ``4``, ``4 g64 r32``, ``fp8``, ``tq3:qjl=true``."""
    if "kv_stored" in row:  # a row as report.load_runs reads it: already said
        return row["kv_stored"] or ""
    native = row.get("kv_native")
    if not _given(row.get("kv_bits")) or not _given(native) or native:
        return ""
    return str(format_of_row(row["kv_bits"], row.get("kv_group"), row.get("kv_residual"), row.get("kv_format")))


def bits_label(row: Row) -> str:
    """How tables name a row's storage: its format (``4``, ``16``), the width of the model's own cache (``32``), or
    ``native`` where a row written before storage formats does not say."""
    label = stored_as(row)
    if label or isinstance(row.get("kv_bits"), str):  # report.load_runs's rows carry the label already
        return label or row["kv_bits"]
    return str(int(row["kv_bits"])) if _given(row.get("kv_bits")) else "native"


def differing_keys(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k))


def comparable_options(options: dict[str, Any]) -> dict[str, Any]:
    """Run options as they decide whether two runs are the same run: order-free lists sorted."""
    orderless = ORDERLESS + (() if options.get("shard") else ORDERLESS_UNLESS_SHARDED)
    return {k: sorted(v, key=json.dumps) if k in orderless and isinstance(v, list) else v for k, v in options.items()}


def differing_options(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """The options that make two runs different runs (``policies: a,b`` and ``b,a`` do not)."""
    return differing_keys(comparable_options(first), comparable_options(second))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_result_row(row: Row, where: str) -> None:
    """Refuse a line of samples.jsonl that is not a result row as pkvbench writes it (``where`` names file and line)."""
    for name in ("task", "sample_id", "policy", "budget"):
        if name not in row:
            raise PkvError(f"{where}: not a pkvbench result row (no {name!r})")
    for name, kinds, what in (
        ("task", str, "a string"),
        ("policy", str, "a string"),
        ("sample_id", (str, int), "an id"),
    ):
        if not isinstance(row[name], kinds) or isinstance(row[name], bool):
            raise PkvError(f"{where}: {name} must be {what}, got {row[name]!r}")
    budget = row["budget"]
    spelled = isinstance(budget, str) and (budget.startswith((REMOVED_PREFIX, MEMORY_PREFIX)) or budget == ALL)
    if not _is_number(budget) and not spelled:
        raise PkvError(f"{where}: budget must be a number, got {budget!r}")
    if "query_mode" in row and row["query_mode"] not in QUERY_MODES:
        raise PkvError(f"{where}: query_mode must be {' or '.join(QUERY_MODES)}, got {row['query_mode']!r}")
    if row.get("turn_compression") is not None and row["turn_compression"] not in TURN_COMPRESSIONS:
        raise PkvError(
            f"{where}: turn_compression must be {' or '.join(TURN_COMPRESSIONS)}, got {row['turn_compression']!r}"
        )
    try:
        Budget.parse(str(budget))
    except PkvError as exc:
        raise PkvError(f"{where}: {exc}") from None
    if "score" not in row:
        raise PkvError(f"{where}: not a pkvbench result row (no 'score')")
    if not _is_number(row["score"]):
        raise PkvError(f"{where}: score must be a number, got {row['score']!r}")
    if not 0 <= row["score"] <= 1:  # NaN and infinities too: a score is a share of the answer, from 0 to 1
        raise PkvError(f"{where}: score must be from 0 to 1, got {row['score']!r}")


def read_rows(path: str | os.PathLike, check: Callable[[Row, str], None] | None = check_result_row) -> list[Row]:
    """The rows of a run folder's samples.jsonl (or of the JSON-lines file ``path`` names), as written: a row written
    twice is there twice (``unique_rows``). A partial last line (a run killed mid-write) is left out; any other bad
    line, or a file that cannot be read, is one line naming the file (and the line)."""
    path = Path(path)
    if path.is_dir():
        path = path / ROWS
    if not path.exists():
        return []
    return read_json_lines(path, "result file", partial_tail=True, check=check)


def unique_rows(rows: Iterable[Row], key: Callable[[Row], tuple] = row_key) -> tuple[list[Row], int]:
    """Each key's first row, and how many later rows with a key already seen were left out."""
    seen: dict[tuple, Row] = {}
    duplicates = 0
    for row in rows:
        if key(row) in seen:
            duplicates += 1
        else:
            seen[key(row)] = row
    return list(seen.values()), duplicates


def repeated_rows_note(path: str | os.PathLike, count: int) -> str:
    return f"{path}: {count} row(s) repeat the key of an earlier row; each key is counted once (the first row)"


def version_changes(before: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The versions two records differ in, as ``name A → B``: (those under which rows could differ, the rest).
    A version only one of them records (a record from before it was kept) is not compared."""
    before_versions, now_versions = before.get("versions") or {}, now.get("versions") or {}
    if not isinstance(before_versions, dict) or not isinstance(now_versions, dict):
        return [], []
    changed = [
        name
        for name in now_versions
        if name in before_versions and before_versions[name] != now_versions[name] and now_versions[name] is not None
    ]
    decisive = [f"{n} {before_versions[n]} → {now_versions[n]}" for n in changed if n in DECISIVE_VERSIONS]
    other = [f"{n} {before_versions[n]} → {now_versions[n]}" for n in changed if n not in DECISIVE_VERSIONS]
    if before.get("commit") and now.get("commit") and before["commit"] != now["commit"]:
        other.append(f"commit {str(before['commit'])[:10]} → {str(now['commit'])[:10]}")
    return decisive, other


# What a run's record keeps from the session that started it when another session resumes it (``resumed`` lists
# each later session's).
SESSION_KEYS = ("versions", "commit", "determinism", "started")


def read_run_record(path: str | os.PathLike) -> dict[str, Any]:
    """A run folder's ``run.json``: a JSON object with the run's ``options``; anything else is one line."""
    record = read_json(path, "run record")
    if not isinstance(record, dict) or not isinstance(record.get("options"), dict):
        raise PkvError(f"run record {path} is not pkvbench's: expected a JSON object with the run's options")
    return record


class ResultStore:
    """A result folder: a JSON record of the run (its options first), an append-only JSON-lines file of rows, and
    files made from the rows (``outputs``). ``key`` says which rows are the same; ``check`` refuses a malformed row.

    A run goes ``claim`` (check and lock the folder) → ``record_with_first_row`` (the model has loaded: the record
    to write) → ``append`` … (the first writes the record: ``record``) → ``close`` (let go of the lock);
    ``with store.claim(options): …`` closes it.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        rows_name: str = ROWS,
        info_name: str = RUN,
        outputs: Sequence[str] = (SUMMARY,),
        key: Callable[[Row], tuple] = row_key,
        check: Callable[[Row, str], None] | None = check_result_row,
        folders: Sequence[str] = (),
    ):
        self.dir = Path(out_dir)
        self.rows_path = self.dir / rows_name
        self.info_path = self.dir / info_name
        self.own_paths = [self.info_path, self.rows_path, *(self.dir / name for name in outputs)]
        self.own_folders = [self.dir / name for name in folders]  # the run's own folders (lm-eval's files)
        self.key = key
        self.check = check
        self.lock = FolderLock(self.dir)
        self.started = False  # the run is recorded: the folder is this run's
        self._record: dict[str, Any] | None = None  # the run's record, written with the first row
        self.duplicates = 0  # rows of a key already seen, left out by the last rows()
        self.notes: list[str] = []  # what the user should know about the folder (a resume under other versions)
        self._replacing = False  # the folder's previous files go when the run is recorded
        self._created = False  # this store made the folder, and removes it again if nothing is written

    # --- claiming a folder ------------------------------------------------------------------------------------

    def claim(
        self, options: dict[str, Any], overwrite: bool = False, session: dict[str, Any] | None = None
    ) -> ResultStore:
        """Check that the folder can take a run of ``options`` and lock it for this process (until ``close``);
        nothing in it changes yet. Refused (``PkvError``): a folder in use, one holding files pkvbench did not write
        where it would write its own, a run of other options with rows (unless ``overwrite``), ``overwrite`` of a
        folder that is not a pkvbench run folder, and (given this ``session``'s ``versions`` and ``commit``) rows
        made under versions that could make them differ from new ones; other changes of version become ``notes``."""
        self.lock.check_free()  # a folder in use is refused as such, whatever it holds
        self._inspect(options, overwrite)  # refuse what can be refused without creating anything
        self._created = make_dir(self.dir, "--out")
        try:
            self.lock.acquire()
            self._replacing = self._inspect(options, overwrite)  # again: no other writer can change it now
            self.rows()  # a damaged rows file is refused now, not after a model load
            if session is not None and not self._replacing:
                self._compare_session(session)
        except BaseException:
            self.close()
            raise
        return self

    def _inspect(self, options: dict[str, Any], overwrite: bool) -> bool:
        """Whether the folder's pkvbench files are to be replaced (True) or resumed (False); raises if they may not
        be touched."""
        if not self.dir.exists():
            return False
        if not self.dir.is_dir():
            raise PkvError(f"--out {self.dir} is a file, not a folder")
        for path in self.own_paths:
            if path.is_dir():
                raise PkvError(f"{path} is a folder where pkvbench keeps a file; use another --out")
        for path in self.own_folders:
            if path.exists() and not path.is_dir():
                raise PkvError(f"{path} is a file where pkvbench keeps a folder; use another --out")
        if not self.info_path.exists():
            strangers = [path.name for path in (*self.own_paths, *self.own_folders) if path.exists()]
            if strangers:
                raise PkvError(
                    f"{self.dir} holds {', '.join(strangers)} but no {self.info_path.name}: not a pkvbench run "
                    "folder, and pkvbench will not overwrite files it did not write; use another --out"
                )
            if overwrite and self._foreign_files():
                raise PkvError(
                    f"--overwrite: {self.dir} is not a pkvbench run folder (no {self.info_path.name}); pkvbench "
                    "replaces only its own run folders and deleted nothing; use another --out"
                )
            return False
        try:
            previous = read_run_record(self.info_path)["options"]
        except PkvError as exc:
            raise PkvError(f"{exc}; pkvbench will not resume or replace a folder it cannot recognise") from None
        if overwrite:
            return True
        changed = differing_options(previous, options)
        if not changed:
            return False
        if not read_rows(self.rows_path, self.check):
            return True  # no row finished under the old options: nothing to lose by starting afresh
        raise PkvError(
            f"{self.dir} holds a run with other options ({', '.join(changed)} differ); "
            "use another --out, or --overwrite to start it afresh"
        )

    def _compare_session(self, session: dict[str, Any]) -> None:
        """A resume under other versions: refused where rows could differ (``DECISIVE_VERSIONS``), noted where
        not. A folder without rows has nothing to keep apart."""
        if not self.info_path.exists() or not self.rows():
            return
        decisive, other = version_changes(read_run_record(self.info_path), session)
        if decisive:
            raise PkvError(
                f"{self.dir} was run under other versions ({', '.join(decisive)}): its rows and new ones could "
                "differ; use another --out, or --overwrite to start it afresh"
            )
        if other:
            self.notes.append(f"{self.dir}: resumed under {', '.join(other)} (rows so far from the first)")

    def is_empty(self) -> bool:
        """Whether the folder holds nothing but its lock (what a new folder of this store's own holds)."""
        return not self.dir.is_dir() or all(entry.name == LOCK_NAME for entry in self.dir.iterdir())

    def _foreign_files(self) -> list[str]:
        """Names in the folder that are neither pkvbench's files nor what a killed write of one leaves."""
        own = [path.name for path in self.own_paths]
        folders = [path.name for path in self.own_folders]
        return [
            entry.name
            for entry in self.dir.iterdir()
            if entry.name not in (*own, *folders, LOCK_NAME)
            and not any(is_staging_file(entry.name, name) for name in own)
        ]

    def record_with_first_row(self, run_info: dict[str, Any]) -> None:
        """``record`` the run (its model has loaded) with its first row, or at ``write_summary``, whichever comes
        first: a run refused or failed between the model load and its first row (a check that needs the model, a
        first prefill out of memory) deletes nothing of a folder being replaced and leaves no record behind."""
        self._record = run_info

    def begin(self) -> None:
        """The run's first output is about to be written (a row, a file of the run's own folders): record the run now,
        if it is not yet (``record_with_first_row``)."""
        if self._record is not None:
            self.record(self._record)

    def record(self, run_info: dict[str, Any]) -> None:
        """Write the run's record: the run has started. A folder being replaced loses its previous pkvbench files
        now, not at ``claim``."""
        self._record = None
        if self._replacing:
            for path in self.own_paths:
                remove_file(path)
            for path in self.own_folders:
                remove_tree(path)
            self._replacing = False
        elif self.info_path.exists():  # a resume: the record keeps the first session's provenance, lists this one's
            previous = read_run_record(self.info_path)
            first = {key: previous[key] for key in SESSION_KEYS if key in previous}
            this = {key: run_info[key] for key in SESSION_KEYS if key in run_info}
            if first and this:
                earlier = previous.get("resumed") if isinstance(previous.get("resumed"), list) else []
                run_info = {**run_info, **first, "resumed": [*earlier, this]}
        self._repair_tail()
        atomic_write(self.info_path, json.dumps(run_info, indent=2, default=str) + "\n")
        self.started = True

    def open(self, run_info: dict[str, Any], overwrite: bool = False) -> None:
        """``claim`` and ``record`` at once, then let go of the lock: for a folder written in one go where no other
        process writes (tests, tools). A run holds the lock from ``claim`` to ``close``."""
        with self.claim(run_info["options"], overwrite):
            self.record(run_info)

    def discard(self) -> None:
        """Remove what this store wrote (a merge that failed part-way leaves no half a folder)."""
        for path in self.own_paths:
            with contextlib.suppress(PkvError):  # best effort, on the way out of another error
                remove_file(path)
        self.started = False

    def close(self) -> None:
        """Let go of the folder; a folder this store made and never wrote to is removed again."""
        self.lock.release()
        if self._created:
            with contextlib.suppress(OSError):  # not empty: the run wrote something, which stays
                self.dir.rmdir()
            self._created = False

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _repair_tail(self) -> None:
        """Drop a partial last line left by a run killed mid-write."""
        if not self.rows_path.exists():
            return
        try:
            with open(self.rows_path, "r+b") as handle:
                data = handle.read()
                if data and not data.endswith(b"\n"):
                    handle.truncate(data.rfind(b"\n") + 1)
        except OSError as exc:
            raise os_error(self.rows_path, exc) from None

    # --- rows -------------------------------------------------------------------------------------------------

    def rows(self) -> list[Row]:
        """The folder's rows, each key once (``duplicates``: how many rows repeated a key; two runs writing one
        folder at once, before folders were locked, wrote each row twice). None of a folder being replaced."""
        if self._replacing:
            return []
        rows, self.duplicates = unique_rows(read_rows(self.rows_path, self.check), self.key)
        return rows

    def done_keys(self) -> set[tuple]:
        return {self.key(row) for row in self.rows()}

    def duplicate_note(self) -> str | None:
        return repeated_rows_note(self.rows_path, self.duplicates) if self.duplicates else None

    def append(self, row: Row) -> None:
        self.extend([row])

    def extend(self, rows: list[Row]) -> None:
        """Append ``rows`` in one write and one fsync (a merge of thousands of rows should not pay a sync each)."""
        self.begin()
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        try:
            fd = os.open(self.rows_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise os_error(self.rows_path, exc) from None
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as exc:
            raise os_error(self.rows_path, exc) from None
        finally:
            os.close(fd)

    def write_summary(self, table: pd.DataFrame) -> pd.DataFrame:
        """Write ``table`` (``reports.summary.summarize`` of the rows) as ``summary.csv``, recording the run first
        where nothing has yet."""
        self.begin()
        atomic_write(self.dir / SUMMARY, table.to_csv(index=False))
        return table


# --- merging ---------------------------------------------------------------------------------------------------------


def shards_held(folder: Path, record: dict[str, Any]) -> tuple[int, set[int]] | None:
    """(n, the shards i) of a split into n that a run folder holds: its own ``--shard i/n``, or those an earlier
    merge recorded (``shards``); None for a whole run."""
    merged, shard = record.get("shards"), record["options"].get("shard")
    try:
        if isinstance(merged, dict):
            return int(merged["count"]), {int(i) for i in merged["merged"]}
        if not shard:
            return None
        index, _, count = str(shard).partition("/")
        return int(count), {int(index)}
    except (KeyError, TypeError, ValueError):
        raise PkvError(f"{folder / RUN}: its shard ({merged or shard!r}) is not pkvbench's i/n") from None


def missing_shards(record: dict[str, Any]) -> str | None:
    """``2/3, 3/3``: the shards a merged run's record says it lacks (None for a whole run): its rows are not the whole
    run's."""
    shards = record.get("shards")
    if not isinstance(shards, dict) or not shards.get("missing"):
        return None
    return ", ".join(f"{i}/{shards['count']}" for i in shards["missing"])
