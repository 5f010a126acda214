"""``pkvbench check``: accuracy-at-budget as a CI gate.

A run's cells (model × task × policy × budget: sample count and mean score × 100) are compared with a committed
baseline of the same columns. A cell fails when its score fell by more than the tolerance (score points, per task if
set), when it is missing from the run, or when its sample count differs (a different sample set is not a
comparison). Improvements and new cells are reported, never failed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from pkvbench.errors import PkvError
from pkvbench.report import load_runs, sort_rows

CELL = ["model", "task", "policy", "budget"]
COLUMNS = [*CELL, "n", "score"]


def cell_table(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per model × task × policy × budget: ``n`` samples and ``score`` (mean × 100, two decimals)."""
    cells = rows.groupby(CELL, sort=False)["score"].agg(n="count", score="mean").reset_index()
    cells["score"] = (cells["score"] * 100).round(2)
    return sort_rows(cells[COLUMNS], columns=["model", "task", "policy", "budget"])


def read_baseline(path: str | os.PathLike) -> pd.DataFrame:
    try:
        baseline = pd.read_csv(path, dtype={"budget": str, "model": str, "task": str, "policy": str})
    except FileNotFoundError:
        raise PkvError(f"baseline {path} does not exist (write one with --update)") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PkvError(f"baseline {path} is not a CSV file: {exc}") from None
    missing = [c for c in COLUMNS if c not in baseline.columns]
    if missing:
        raise PkvError(f"baseline {path} lacks the columns {', '.join(missing)} (expected {','.join(COLUMNS)})")
    return baseline[COLUMNS]


def read_tolerances(path: str | os.PathLike | None, default: float) -> dict[str, float]:
    """``--per-cell FILE.yaml``: ``{task: tolerance}``, with an optional ``default`` key."""
    if path is None:
        return {"default": default}
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise PkvError(f"--per-cell {path}: {exc}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, (int, float)) and v >= 0 for v in raw.values()):
        raise PkvError(f"--per-cell {path}: expected a mapping of task name to a non-negative tolerance in points")
    return {"default": default, **{str(k): float(v) for k, v in raw.items()}}


@dataclass
class CheckResult:
    table: pd.DataFrame  # every cell: baseline and run score/n, delta, status
    tolerances: dict[str, float]

    @property
    def failures(self) -> pd.DataFrame:
        return self.table[self.table["status"].isin(["REGRESSED", "MISSING", "COUNT"])]

    @property
    def passed(self) -> bool:
        return self.failures.empty


def compare_cells(baseline: pd.DataFrame, run: pd.DataFrame, tolerances: dict[str, float]) -> CheckResult:
    merged = baseline.merge(run, on=CELL, how="outer", suffixes=("_baseline", "_run"), indicator=True)
    merged["delta"] = (merged["score_run"] - merged["score_baseline"]).round(2)
    merged["tolerance"] = [tolerances.get(task, tolerances["default"]) for task in merged["task"]]

    def status(row) -> str:
        if row["_merge"] == "left_only":
            return "MISSING"
        if row["_merge"] == "right_only":
            return "new"
        if int(row["n_run"]) != int(row["n_baseline"]):
            return "COUNT"
        if row["delta"] < -row["tolerance"]:
            return "REGRESSED"
        return "improved" if row["delta"] > row["tolerance"] else "ok"

    merged["status"] = [status(row) for _, row in merged.iterrows()]
    table = merged.drop(columns="_merge")
    return CheckResult(table=sort_rows(table, columns=["model", "task", "policy", "budget"]), tolerances=tolerances)


def check_run(results: list[str], baseline_path: str, tolerance: float, per_cell: str | None) -> CheckResult:
    run = cell_table(load_runs(results).rows)
    return compare_cells(read_baseline(baseline_path), run, read_tolerances(per_cell, tolerance))


def write_baseline(results: list[str], baseline_path: str) -> pd.DataFrame:
    cells = cell_table(load_runs(results).rows)
    Path(baseline_path).parent.mkdir(parents=True, exist_ok=True)
    cells.to_csv(baseline_path, index=False)
    return cells


def format_failures(result: CheckResult) -> str:
    """The lines a person reads in a CI log: one per failing cell, worst first."""
    failures = result.failures.copy()
    order = {"MISSING": 0, "COUNT": 1, "REGRESSED": 2}
    failures["rank"] = [order[s] for s in failures["status"]]
    failures = failures.sort_values(["rank", "delta"], na_position="first")
    lines = [f"{'status':9} {'task':16} {'policy':20} {'budget':>7} {'baseline':>8} {'run':>8} {'delta':>7} {'n':>9}"]
    for _, row in failures.iterrows():
        run_score = "-" if pd.isna(row["score_run"]) else f"{row['score_run']:.2f}"
        delta = "-" if pd.isna(row["delta"]) else f"{row['delta']:+.2f}"
        n_run = "-" if pd.isna(row["n_run"]) else int(row["n_run"])
        lines.append(
            f"{row['status']:9} {row['task']:16} {row['policy']:20} {row['budget']:>7} {row['score_baseline']:8.2f} "
            f"{run_score:>8} {delta:>7} {int(row['n_baseline']):>4}→{n_run!s:<4}"
        )
    return "\n".join(lines)
