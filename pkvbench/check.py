"""``pkvbench check``: accuracy-at-budget as a CI gate that catches real regressions and ignores noise.

A run's cells (model × task × policy × budget [× query mode]: sample count, mean score × 100 and its 95% interval)
are compared with a committed baseline of the same columns. A cell fails when

- it is missing from the run, or its sample count differs (a different sample set is not a comparison);
- its score fell by more than the tolerance (points; per task if set) *and* below the baseline's interval — a fall
  the baseline's own sampling noise does not explain (a baseline without intervals: the tolerance alone decides);
- or, where the baseline's per-sample scores are at hand (``<baseline>.samples.csv``, written by ``--update``), a
  paired test on the same samples says the fall is real: the paired interval of run − baseline lies below 0 and
  the sign-flip p, Holm-adjusted over every test of the check, is below 0.05.

The paired test also runs per policy over all its cells (every task and budget, each cell weighted equally): a bug
that costs every cell of a policy a little fails there even when no single cell of two samples can show it.
Improvements and new cells are reported, never failed.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from pkvbench.errors import PkvError
from pkvbench.io import atomic_write
from pkvbench.report import load_runs, refuse_decode_budgets, sort_rows
from pkvbench.stats import ALPHA, cell_scores, holm, paired_difference

CELL = ["model", "task", "policy", "budget", "query_mode"]
COLUMNS = [*CELL, "n", "score", "ci_low", "ci_high"]
SAMPLE_COLUMNS = [*CELL, "sample_id", "score"]
ALL = "*"  # the task and budget of a policy's pooled row
FAILING = ("REGRESSED", "MISSING", "COUNT")


def samples_path(baseline: str | os.PathLike) -> Path:
    """Where a baseline's per-sample scores live: ``name.csv`` → ``name.samples.csv``."""
    path = Path(baseline)
    return path.with_name(path.name.removesuffix(".csv") + ".samples.csv")


def run_samples(results: list[str]) -> pd.DataFrame:
    """The run's rows as the gate reads them: one per model × cell × sample, score in [0, 1]."""
    rows = load_runs(results).rows
    refuse_decode_budgets(rows, "the CI gate")
    return rows[SAMPLE_COLUMNS].reset_index(drop=True)


def cell_table(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: ``n`` samples, ``score`` (mean × 100) and its bootstrap interval, two decimals."""
    return sort_rows(cell_scores(samples, CELL), columns=CELL)


def _read_csv(path: Path, what: str, required: list[str]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path, dtype=dict.fromkeys(("model", "task", "policy", "budget", "query_mode"), str))
    except FileNotFoundError:
        raise PkvError(f"{what} {path} does not exist (write one with --update)") from None
    except IsADirectoryError:
        raise PkvError(f"{what} {path} is a folder, not a CSV file") from None
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PkvError(f"{what} {path} is not a readable CSV file: {exc}") from None
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise PkvError(f"{what} {path} lacks the columns {', '.join(missing)} (expected {','.join(required)})")
    if frame.empty:
        raise PkvError(f"{what} {path} has no cells: a gate over nothing would pass anything")
    if "query_mode" not in frame.columns:  # baselines written before the query mode was an axis are query-aware
        frame["query_mode"] = "aware"
    return frame


def _numbers(frame: pd.DataFrame, columns: list[str], path: Path, what: str) -> None:
    for column in columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = frame.loc[~values.map(math.isfinite), column]
        if len(bad):
            raise PkvError(f"{what} {path}: {column} {bad.iloc[0]!r} is not a number")
        frame[column] = values


def read_baseline(path: str | os.PathLike) -> pd.DataFrame:
    baseline = _read_csv(Path(path), "baseline", ["model", "task", "policy", "budget", "n", "score"])
    _numbers(baseline, ["n", "score"], Path(path), "baseline")
    for column in ("ci_low", "ci_high"):  # absent in old baselines: the tolerance alone decides there
        baseline[column] = pd.to_numeric(baseline[column], errors="coerce") if column in baseline else math.nan
    return baseline[COLUMNS]


def read_baseline_samples(path: Path) -> pd.DataFrame | None:
    if not path.exists():
        return None
    samples = _read_csv(path, "baseline samples", ["model", "task", "policy", "budget", "sample_id", "score"])
    _numbers(samples, ["score"], path, "baseline samples")
    samples["sample_id"] = samples["sample_id"].astype(str)
    return samples[SAMPLE_COLUMNS]


def read_tolerances(path: str | os.PathLike | None, default: float, tasks: set[str]) -> dict[str, float]:
    """``--per-cell FILE.yaml``: ``{task: tolerance}``, with an optional ``default`` key; every task named must be
    one of the baseline's (a misspelled task would silently keep the default)."""
    if not math.isfinite(default) or default < 0:
        raise PkvError(f"--tolerance {default}: give a finite, non-negative number of points")
    if path is None:
        return {"default": default}
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PkvError(f"--per-cell {path}: {exc}") from None
    valid = isinstance(raw, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in raw.values()
    )
    if not valid:
        raise PkvError(f"--per-cell {path}: expected a mapping of task name to a finite, non-negative tolerance")
    unknown = sorted(str(k) for k in raw if str(k) != "default" and str(k) not in tasks)
    if unknown:
        raise PkvError(f"--per-cell {path}: {unknown[0]} is not a task of the baseline ({', '.join(sorted(tasks))})")
    return {"default": default, **{str(k): float(v) for k, v in raw.items()}}


@dataclass
class CheckResult:
    table: pd.DataFrame  # every cell (and pooled policy row): baseline and run score/n, delta, paired test, status
    tolerances: dict[str, float]
    paired: bool  # whether the baseline's samples were there for the paired tests

    @property
    def failures(self) -> pd.DataFrame:
        return self.table[self.table["status"].isin(FAILING)]

    @property
    def passed(self) -> bool:
        return self.failures.empty

    @property
    def cells(self) -> pd.DataFrame:
        return self.table[self.table["task"] != ALL]

    @property
    def pooled(self) -> pd.DataFrame:
        """The per-policy paired tests over all of a policy's cells."""
        return self.table[self.table["task"] == ALL]

    def describe(self) -> str:
        """``3 cells (2 ok, 1 regressed), 2 policies pooled (ok)`` and how the check was made."""
        counts = self.cells["status"].value_counts().to_dict()
        states = ("ok", "improved", "new", "REGRESSED", "MISSING", "COUNT")
        text = f"{len(self.cells)} cells ({', '.join(f'{counts[s]} {s.lower()}' for s in states if s in counts)})"
        if len(self.pooled):
            fell = int((self.pooled["status"] == "REGRESSED").sum())
            text += f", {len(self.pooled)} policies pooled ({f'{fell} regressed' if fell else 'ok'})"
        tolerance = self.tolerances["default"]
        return (
            text + f"; tolerance {tolerance:g} points; " + ("paired tests on" if self.paired else "no baseline samples")
        )


def _paired_tests(baseline_samples: pd.DataFrame, run: pd.DataFrame) -> pd.DataFrame:
    """Run − baseline on the same samples, per cell and per policy pooled over its cells; Holm over all of them."""
    both = baseline_samples.merge(run, on=[*CELL, "sample_id"], suffixes=("_baseline", "_run"))
    tests = []
    for key, cell in both.groupby(CELL, sort=False):
        result = paired_difference(cell["score_run"].to_numpy(), cell["score_baseline"].to_numpy())
        tests.append({**dict(zip(CELL, key)), "paired": result})
    for key, pooled in both.groupby(["model", "policy", "query_mode"], sort=False):
        strata = pooled["task"] + " @ " + pooled["budget"]
        if strata.nunique() < 2:
            continue  # one cell: its own test already
        result = paired_difference(pooled["score_run"].to_numpy(), pooled["score_baseline"].to_numpy(), strata)
        tests.append({"model": key[0], "task": ALL, "policy": key[1], "budget": ALL, "query_mode": key[2],
                      "paired": result})  # fmt: skip
    table = pd.DataFrame(tests, columns=[*CELL, "paired"])
    table["paired_diff"] = [t.mean * 100 for t in table["paired"]]
    table["paired_low"] = [t.low * 100 for t in table["paired"]]
    table["paired_high"] = [t.high * 100 for t in table["paired"]]
    table["p_holm"] = holm([t.p for t in table["paired"]])
    return table.drop(columns="paired")


def compare_cells(
    baseline: pd.DataFrame, run: pd.DataFrame, tolerances: dict[str, float], paired: pd.DataFrame | None = None
) -> CheckResult:
    merged = baseline.merge(run, on=CELL, how="outer", suffixes=("_baseline", "_run"), indicator=True)
    if paired is not None:
        merged = merged.merge(paired, on=CELL, how="outer")
        merged["_merge"] = merged["_merge"].astype(object).fillna("pooled")
    merged["delta"] = (merged["score_run"] - merged["score_baseline"]).round(2)
    merged["tolerance"] = [tolerances.get(task, tolerances["default"]) for task in merged["task"]]
    table = merged.drop(columns="_merge").assign(status=[_status(r) for r in merged.to_dict("records")])
    if paired is not None:
        table[["paired_diff", "paired_low", "paired_high"]] = table[["paired_diff", "paired_low", "paired_high"]].round(
            2
        )
    return CheckResult(sort_rows(table, columns=CELL), tolerances, paired is not None)


def _status(row: dict) -> str:
    paired_fall = row.get("paired_high", math.nan) < 0 and row.get("p_holm", math.nan) < ALPHA
    if row["_merge"] == "pooled":
        return "REGRESSED" if paired_fall else "ok"
    if row["_merge"] == "left_only":
        return "MISSING"
    if row["_merge"] == "right_only":
        return "new"
    if int(row["n_run"]) != int(row["n_baseline"]):
        return "COUNT"
    beyond_noise = math.isnan(row["ci_low_baseline"]) or row["score_run"] < row["ci_low_baseline"]
    if (row["delta"] < -row["tolerance"] and beyond_noise) or paired_fall:
        return "REGRESSED"
    return "improved" if row["delta"] > row["tolerance"] else "ok"


def check_run(results: list[str], baseline_path: str, tolerance: float, per_cell: str | None) -> CheckResult:
    baseline = read_baseline(baseline_path)
    tolerances = read_tolerances(per_cell, tolerance, set(baseline["task"]))
    run = run_samples(results)
    baseline_samples = read_baseline_samples(samples_path(baseline_path))
    paired = _paired_tests(baseline_samples, run) if baseline_samples is not None else None
    return compare_cells(baseline, cell_table(run), tolerances, paired)


def write_baseline(results: list[str], baseline_path: str) -> pd.DataFrame:
    """The run's cells as the baseline, and its per-sample scores beside it for the paired tests."""
    samples = run_samples(results)
    cells = cell_table(samples)
    ordered = sort_rows(samples, columns=[*CELL, "sample_id"])
    atomic_write(baseline_path, cells.to_csv(index=False))
    atomic_write(samples_path(baseline_path), ordered.to_csv(index=False))
    return cells


def format_failures(result: CheckResult) -> str:
    """The lines a person reads in a CI log: one per failing cell, worst first; ``*`` for a policy's pooled row."""
    failures = result.failures.copy()
    order = {"MISSING": 0, "COUNT": 1, "REGRESSED": 2}
    failures["rank"] = [order[s] for s in failures["status"]]
    failures = failures.sort_values(["rank", "delta"], na_position="first")

    def number(value, fmt: str) -> str:
        return "-" if pd.isna(value) else format(value, fmt)

    lines = [
        f"{'status':9} {'task':16} {'policy':20} {'budget':>7} {'mode':8} {'baseline':>8} {'run':>8} {'delta':>7} "
        f"{'n':>9} {'paired Δ [95% interval], Holm p':>34}"
    ]
    for row in failures.to_dict("records"):
        n_run = "-" if pd.isna(row.get("n_run")) else int(row["n_run"])
        n_base = "-" if pd.isna(row.get("n_baseline")) else int(row["n_baseline"])
        paired = ""
        if not pd.isna(row.get("paired_diff", math.nan)):
            paired = (
                f"{row['paired_diff']:+.2f} [{row['paired_low']:.2f}, {row['paired_high']:.2f}], p {row['p_holm']:.3g}"
            )
        lines.append(
            f"{row['status']:9} {row['task']:16} {row['policy']:20} {row['budget']:>7} {row['query_mode']:8} "
            f"{number(row['score_baseline'], '8.2f'):>8} {number(row['score_run'], '.2f'):>8} "
            f"{number(row['delta'], '+.2f'):>7} {n_base!s:>4}→{n_run!s:<4} {paired:>34}"
        )
    return "\n".join(lines)
