"""The result store: ``samples.jsonl`` (one line per sample × policy × budget), ``summary.csv``, ``run.json``.

Rows are appended one at a time, flushed and fsynced, so a run killed at any point keeps every finished row; a
partial last line (a kill mid-write) is cut off when the folder is opened again. Rerunning into the same folder
skips the rows already there.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd

from pkvbench.budgets import budget_label
from pkvbench.errors import PkvError

ROWS = "samples.jsonl"
SUMMARY = "summary.csv"
RUN = "run.json"


def row_key(row: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """What makes a row unique: task, sample, policy, budget and query mode (rows written before the query mode was
    recorded are query-aware)."""
    return (
        row["task"],
        str(row["sample_id"]),
        row["policy"],
        budget_label(row["budget"]),
        row.get("query_mode", "aware"),
    )


def differing_keys(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(first) | set(second) if first.get(k) != second.get(k))


class ResultStore:
    """A result folder: a JSON file of the run's options and an append-only JSON-lines file of rows."""

    def __init__(self, out_dir: str | os.PathLike, rows_name: str = ROWS, info_name: str = RUN):
        self.dir = Path(out_dir)
        self.rows_path = self.dir / rows_name
        self.info_path = self.dir / info_name

    def open(self, run_info: dict[str, Any], overwrite: bool = False) -> None:
        """Create the folder, or check that an existing one was made by the same run options."""
        if overwrite and self.dir.exists():
            shutil.rmtree(self.dir)
        if self.info_path.exists():
            previous = json.loads(self.info_path.read_text())["options"]
            changed = differing_keys(previous, run_info["options"])
            if changed:
                raise PkvError(
                    f"{self.dir} holds a run with other options ({', '.join(changed)} differ); "
                    "use another --out, or --overwrite to start it afresh"
                )
        self.dir.mkdir(parents=True, exist_ok=True)
        self._repair_tail()
        self.info_path.write_text(json.dumps(run_info, indent=2, default=str) + "\n")

    def _repair_tail(self) -> None:
        """Drop a partial last line left by a run killed mid-write."""
        if not self.rows_path.exists():
            return
        data = self.rows_path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.rows_path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)

    def rows(self) -> list[dict[str, Any]]:
        return read_rows(self.rows_path)

    def done_keys(self) -> set[tuple[str, str, str, str]]:
        return {row_key(row) for row in self.rows()}

    def append(self, row: dict[str, Any]) -> None:
        self.extend([row])

    def extend(self, rows: list[dict[str, Any]]) -> None:
        """Append ``rows`` in one write and one fsync (a merge of thousands of rows should not pay a sync each)."""
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        fd = os.open(self.rows_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_summary(self) -> pd.DataFrame:
        table = summarize(self.rows())
        table.to_csv(self.dir / SUMMARY, index=False)
        return table


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run folder's samples.jsonl (or of the JSON-lines file ``path`` names)."""
    path = Path(path)
    if path.is_dir():
        path = path / ROWS
    if not path.exists():
        return []
    rows = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.endswith("\n"):
                break  # partial last line of a killed run: not a result
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise PkvError(f"{path}:{number}: not a JSON line; the file is damaged") from None
    return rows


def summarize(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """``task, policy, budget, [query_mode,] n, score`` with score the mean × 100, two decimals (LongBench's
    convention); ``query_mode`` when the rows record it."""
    axes = ["task", "policy", "budget"] + (["query_mode"] if any("query_mode" in row for row in rows) else [])
    columns = [*axes, "n", "score"]
    if not rows:
        return pd.DataFrame(columns=columns)
    frame = pd.DataFrame(rows)
    frame["budget"] = [budget_label(row["budget"]) for row in rows]
    if "query_mode" in axes:
        frame["query_mode"] = frame["query_mode"].fillna("aware")
    table = frame.groupby(axes, sort=False)["score"].agg(n="count", score="mean").reset_index()
    table["score"] = (table["score"] * 100).round(2)
    return table[columns]


def merge_runs(folders: list[str | os.PathLike], out: str | os.PathLike) -> tuple[int, int]:
    """Combine run folders (typically the shards of one run) into ``out``; returns (rows written, duplicates dropped).

    The folders must come from the same run options, shard aside. A key present in two folders is kept once; if the
    two rows disagree on the prediction the merge is refused, since that means the runs were not the same.
    """
    infos = []
    for folder in folders:
        run_path = Path(folder) / RUN
        if not run_path.exists():
            raise PkvError(f"{folder} is not a run folder (no {RUN})")
        infos.append(json.loads(run_path.read_text()))
    base = {k: v for k, v in infos[0]["options"].items() if k != "shard"}
    for folder, info in zip(folders, infos):
        other = {k: v for k, v in info["options"].items() if k != "shard"}
        if other != base:
            changed = differing_keys(base, other)
            raise PkvError(f"{folder} was run with other options than {folders[0]} ({', '.join(changed)} differ)")
    if Path(out).resolve() in {Path(f).resolve() for f in folders}:
        raise PkvError("--out must be a new folder, not one of the inputs")
    merged: dict[tuple, dict[str, Any]] = {}
    duplicates = 0
    for folder in folders:
        for row in read_rows(folder):
            key = row_key(row)
            if key in merged:
                if merged[key]["pred"] != row["pred"]:
                    raise PkvError(f"{folder}: row {key} disagrees with an earlier folder's; not merging")
                duplicates += 1
                continue
            merged[key] = row
    store = ResultStore(out)
    info = {**infos[0], "options": base, "merged_from": [str(f) for f in folders]}
    store.open(info, overwrite=True)
    store.extend(list(merged.values()))
    store.write_summary()
    return len(merged), duplicates
