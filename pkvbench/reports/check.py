"""``pkvbench check``: accuracy-at-budget as a CI gate that catches real regressions and ignores noise.

A run's cells (model × task × policy × budget × query mode × storage format × decode budget: ``schema.CELL_KEY``;
sample count, mean score × 100 and its 95% interval) are compared with a committed baseline of the same columns. A cell fails when

- it is missing from the run, or its sample count differs (a different sample set is not a comparison);
- its score fell by more than the tolerance (points; per task if set) *and* below the baseline's interval — a fall
  the baseline's own sampling noise does not explain (a baseline without intervals: the tolerance alone decides);
- or, where the baseline's per-sample scores are at hand (``<baseline>.samples.csv``, written by ``--update``), a
  paired test on the same samples says the fall is real: the paired interval of run − baseline lies below 0 and
  the sign-flip p, Holm-adjusted over every test of the check, is below 0.05.

The paired test also runs per policy over all its cells (every task and budget, each cell weighted equally): a bug
that costs every cell of a policy a little fails there even when no single cell of two samples can show it.
Improvements and new cells are reported, never failed.

Accuracy on a few samples cannot see a bug that changes *which* entries a policy keeps without moving its score
much, so the per-sample file also records each row's prediction and selection fingerprint
(``pkvbench/cell/fingerprints.py``): a cell also fails when any layer keeps another number of entries than the
baseline's (its budget arithmetic changed), or when the share of kept entries in common falls below ``min_overlap``
(set from what a change of thread count, decode batch, sample order and CPU family does, docs/ci-gate.md). Where a
head-wise policy (AdaKV) splits a layer's entries among its heads by one top-k over all of them, a near-tie can move
an entry from one head to another on another CPU; the layer's total stands, and the move is judged by the overlap
like any other changed entry. A baseline is validated whole before it is trusted.
"""

from __future__ import annotations

import codecs
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from pkvbench.cell.fingerprints import Fingerprint, compare
from pkvbench.cell.schema import CELL_DEFAULTS, CELL_KEY
from pkvbench.errors import PkvError
from pkvbench.io import read_yaml
from pkvbench.reports.axes import key_label, sort_rows
from pkvbench.reports.choices import MIN_OVERLAP
from pkvbench.reports.report import load_runs, run_folders
from pkvbench.reports.stats import ALPHA, cell_scores, holm, paired_difference
from pkvbench.store.outputs import Kind, Outputs, csv_with_columns

# A cell: the schema's, so that a storage format, a memory target (a ``mem`` budget) or a decode budget is a cell of
# its own, never pooled with another. A baseline written before a column of it reads as that column's default.
CELL = list(CELL_KEY)
COLUMNS = [*CELL, "n", "score", "ci_low", "ci_high"]
SAMPLE_COLUMNS = [*CELL, "sample_id", "score"]
# What every baseline has had, of every version: the cell's columns that have no default (``CELL_DEFAULTS``).
OLDEST = [c for c in CELL if c not in CELL_DEFAULTS]
OLDEST_COLUMNS, OLDEST_SAMPLE_COLUMNS = [*OLDEST, "n", "score"], [*OLDEST, "sample_id", "score"]
RECORDED = ["pred", "kept_fingerprint"]  # beside the scores when the run's rows have them: what changed, not how much
ALL = "*"  # the task and budget of a policy's pooled row
FAILING = ("REGRESSED", "MISSING", "COUNT")
# What --update may overwrite: files known as baselines by their header (those of older versions too).
BASELINE = Kind("baseline", csv_with_columns(OLDEST_COLUMNS), True)
BASELINE_SAMPLES = Kind("baseline", csv_with_columns(OLDEST_SAMPLE_COLUMNS), True)
# The share of kept entries a cell may lose without failing. Measured on the smoke grid (docs/ci-gate.md): torch
# threads 1 vs 2, --decode-batch 1 and another sample order keep every entry (overlap 1, bit for bit); float noise of
# 1e-6 on every weight (another machine's summation order, and more) moved one layer of one H2O cell (overlap above
# 0.9999). 0.99 leaves a hundredfold margin and still fails a tie order reversed (0.979 at 64 entries).
MAX_TOLERANCE = 100.0  # points: no score can fall by more, so a tolerance this wide could fail nothing
_TOO_WIDE = "no score can fall by 100 points or more, so nothing could fail; give a tolerance below 100"


def samples_path(baseline: str | os.PathLike) -> Path:
    """Where a baseline's per-sample scores live: ``name.csv`` → ``name.samples.csv``."""
    path = Path(baseline)
    return path.with_name(path.name.removesuffix(".csv") + ".samples.csv")


def run_samples(results: list[str]) -> pd.DataFrame:
    """The run's rows as the gate reads them: one per model × cell × sample, score in [0, 1], with the prediction
    (escaped to one line, as the baseline stores it) and the selection fingerprint where the rows have them."""
    rows = load_runs(results, strict=True).rows  # no run still being written, no two rows of a key that disagree
    samples = rows[SAMPLE_COLUMNS + [c for c in RECORDED if c in rows]].reset_index(drop=True)
    if "pred" in samples:
        samples["pred"] = [one_line(p) for p in samples["pred"]]
    return samples


def one_line(text) -> str:
    """A prediction as one CSV line (newlines and backslashes escaped; a reviewer reads a diff of them)."""
    if not isinstance(text, str):
        return ""
    return codecs.encode(text, "unicode_escape").decode("ascii")


def cell_table(samples: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: ``n`` samples, ``score`` (mean × 100) and its bootstrap interval, two decimals."""
    return sort_rows(cell_scores(samples, CELL), columns=CELL)


def _read_csv(path: Path, what: str, required: list[str]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path, dtype=dict.fromkeys((*CELL, "sample_id", *RECORDED), str))
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
    for column, default in CELL_DEFAULTS.items():  # baselines written before the column: what rows then were
        frame[column] = frame[column].fillna(default) if column in frame.columns else default
    return frame


def _numbers(frame: pd.DataFrame, columns: list[str], path: Path, what: str) -> None:
    for column in columns:
        values = pd.to_numeric(frame[column], errors="coerce")
        bad = frame.loc[~values.map(math.isfinite), column]
        if len(bad):
            raise PkvError(f"{what} {path}: {column} {bad.iloc[0]!r} is not a number")
        frame[column] = values


def _where(path: Path, row: int, record: dict, sample: bool = True) -> str:
    """``baseline X, row 3 (needle snapkv 64 aware [s1])``: rows counted from 1 after the header."""
    return f"{path}, row {row + 1} ({cell_words(record, sample)})"


def cell_words(record: dict, sample: bool = False) -> str:
    """``needle snapkv 64 aware`` (and the sample's id), the policy named with its storage format and decode budget
    where it has them (``needle snapkv · 4 bits 64 aware``), in the order of the result lines."""
    parts = [record["task"], key_label(record), record["budget"], record["query_mode"]]
    parts += [record["sample_id"]] if sample and "sample_id" in record else []
    return " ".join(map(str, parts))


def read_baseline(path: str | os.PathLike) -> pd.DataFrame:
    """The baseline's cells, each checked before it is trusted: a score outside its own interval or outside
    [0, 100], a count below 1 or a cell written twice would let a regressed run pass against it."""
    path = Path(path)
    baseline = _read_csv(path, "baseline", OLDEST_COLUMNS)
    _numbers(baseline, ["n", "score"], path, "baseline")
    for column in ("ci_low", "ci_high"):  # absent in old baselines: the tolerance alone decides there
        baseline[column] = pd.to_numeric(baseline[column], errors="coerce") if column in baseline else math.nan
    duplicated = baseline.duplicated(CELL)
    for row, record in enumerate(baseline.to_dict("records")):
        problem = _cell_problem(record) or ("a cell written twice" if duplicated.iloc[row] else None)
        if problem:
            raise PkvError(f"baseline {_where(path, row, record)}: {problem}")
    return baseline[COLUMNS]


def _cell_problem(cell: dict) -> str | None:
    n, score, low, high = cell["n"], cell["score"], cell["ci_low"], cell["ci_high"]
    if n != int(n) or n < 1:
        return f"n {n:g} is not a count of samples (a whole number, at least 1)"
    if not 0 <= score <= 100:
        return f"score {score:g} is outside [0, 100]"
    if math.isnan(low) and math.isnan(high):
        return None  # a baseline from before intervals: the tolerance alone decides
    if math.isnan(low) or math.isnan(high):
        return "an interval needs both ci_low and ci_high"
    if not (0 <= low <= 100 and 0 <= high <= 100):
        return f"interval [{low:g}, {high:g}] is outside [0, 100]"
    if not low <= score <= high:
        return f"score {score:g} lies outside its own interval [{low:g}, {high:g}]"
    return None


def read_baseline_samples(path: Path, cells: pd.DataFrame) -> pd.DataFrame | None:
    """The per-sample file beside the baseline (None where there is none), checked against ``cells``: every score
    in [0, 1], no sample twice, each cell's n and mean the baseline's, fingerprints readable."""
    if not path.exists():
        return None
    samples = _read_csv(path, "baseline samples", OLDEST_SAMPLE_COLUMNS)
    _numbers(samples, ["score"], path, "baseline samples")
    samples["sample_id"] = samples["sample_id"].astype(str)
    if "pred" in samples:
        samples["pred"] = samples["pred"].fillna("")
    keys, records = [*CELL, "sample_id"], samples.to_dict("records")
    duplicated = samples.duplicated(keys)
    for row, record in enumerate(records):
        problem = None
        if not 0 <= record["score"] <= 1:
            problem = f"score {record['score']:g} is outside [0, 1]"
        elif duplicated.iloc[row]:
            problem = "a sample written twice"
        elif "kept_fingerprint" in record:
            try:
                Fingerprint.parse(record["kept_fingerprint"])
            except ValueError as exc:
                problem = str(exc)
        if problem:
            raise PkvError(f"baseline samples {_where(path, row, record)}: {problem}")
    cell_of = {tuple(c[k] for k in CELL): c for c in cells.to_dict("records")}
    for key, group in samples.groupby(CELL, sort=False):
        cell = cell_of.get(key)
        where = _where(path, int(group.index[0]), group.iloc[0].to_dict(), sample=False)
        if cell is None:
            raise PkvError(f"baseline samples {where}: a cell the baseline {path.name.removesuffix('.samples.csv')}"
                           ".csv does not have")  # fmt: skip
        if len(group) != cell["n"] or abs(group["score"].mean() * 100 - cell["score"]) > 0.0051:
            raise PkvError(
                f"baseline samples {where}: {len(group)} samples with mean {group['score'].mean() * 100:.2f}, the "
                f"baseline's cell says n {cell['n']:g} and score {cell['score']:g}"
            )
    listed = set(samples.groupby(CELL, sort=False).groups)
    absent = [key for key in cell_of if key not in listed]
    if absent:
        raise PkvError(
            f"baseline samples {path}: no samples for the baseline's cell {cell_words(dict(zip(CELL, absent[0])))}"
        )
    return samples


def read_tolerances(path: str | os.PathLike | None, default: float, tasks: set[str]) -> dict[str, float]:
    """``--per-cell FILE.yaml``: ``{task: tolerance}``, with an optional ``default`` key; every task named must be
    one of the baseline's (a misspelled task would silently keep the default). A tolerance of 100 points or more
    is refused: no score can fall that far, so such a gate could fail nothing."""
    if not math.isfinite(default) or default < 0:
        raise PkvError(f"--tolerance {default}: give a finite, non-negative number of points")
    if default >= MAX_TOLERANCE:
        raise PkvError(f"--tolerance {default:g}: {_TOO_WIDE}")
    if path is None:
        return {"default": default}
    raw = read_yaml(path, "--per-cell") or {}  # one line for bad YAML; a task given twice is refused
    valid = isinstance(raw, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in raw.values()
    )
    if not valid:
        raise PkvError(f"--per-cell {path}: expected a mapping of task name to a finite, non-negative tolerance")
    wide = [k for k, v in raw.items() if v >= MAX_TOLERANCE]
    if wide:
        raise PkvError(f"--per-cell {path}: {wide[0]}: {raw[wide[0]]:g} points: {_TOO_WIDE}")
    unknown = sorted(str(k) for k in raw if str(k) != "default" and str(k) not in tasks)
    if unknown:
        raise PkvError(f"--per-cell {path}: {unknown[0]} is not a task of the baseline ({', '.join(sorted(tasks))})")
    return {"default": default, **{str(k): float(v) for k, v in raw.items()}}


@dataclass(frozen=True)
class SelectionRule:
    """How the gate judges kept sets and predictions: ``check`` compares kept sets (``on``) or not (``--selection
    off``, for a deliberate comparison across machines); ``exact`` fails on any changed kept set or prediction."""

    check: bool = True
    min_overlap: float = MIN_OVERLAP
    exact: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.min_overlap <= 1:
            raise PkvError(f"--min-overlap {self.min_overlap:g}: give a share of kept entries, above 0 and at most 1")


@dataclass
class CheckResult:
    table: pd.DataFrame  # every cell (and pooled policy row): baseline and run score/n, delta, paired test, status,
    # and (where the baseline has them) the kept sets' comparison and the predictions changed
    tolerances: dict[str, float]
    paired: bool  # whether the baseline's samples were there for the paired tests
    rule: SelectionRule = field(default_factory=SelectionRule)
    selection: str = "off"  # "on": kept sets compared; "off": --selection off; "absent": the baseline has none
    changed_predictions: pd.DataFrame | None = None  # the samples whose prediction changed: cell, sample, before, after
    predictions_compared: int = 0

    @property
    def failures(self) -> pd.DataFrame:
        return self.table[self.table["failing"]]

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
        """``3 cells (2 ok, 1 regressed), 2 policies pooled (ok); kept sets ...; predictions ...`` and how the
        check was made."""
        counts = self.cells["status"].value_counts().to_dict()
        states = ("ok", "improved", "new", "REGRESSED", "MISSING", "COUNT")
        text = f"{len(self.cells)} cells ({', '.join(f'{counts[s]} {s.lower()}' for s in states if s in counts)})"
        if len(self.pooled):
            fell = int((self.pooled["status"] == "REGRESSED").sum())
            text += f", {len(self.pooled)} policies pooled ({f'{fell} regressed' if fell else 'ok'})"
        text += f"; {self._describe_selection()}"
        if self.predictions_compared:
            changed = 0 if self.changed_predictions is None else len(self.changed_predictions)
            text += f"; predictions: {changed} of {self.predictions_compared} changed"
        tolerance = self.tolerances["default"]
        text += f"; tolerance {tolerance:g} points; " + self._describe_paired()
        return text + ("; --exact" if self.rule.exact else "")

    def _describe_paired(self) -> str:
        if not self.paired:
            return "no baseline samples"
        counted = compared(self.cells.get("paired_n"))
        return f"paired tests on {counted}" if counted else "paired tests: none made (no sample of the baseline's ran)"

    def _describe_selection(self) -> str:
        if self.selection == "off":
            return "kept sets not compared (--selection off)"
        if self.selection == "absent":
            return "kept sets not compared (the baseline has no selection fingerprints)"
        states = self.cells["selection"].value_counts().to_dict()
        words = {"identical": "identical", "changed": "changed within the rule", "CHANGED": "CHANGED (failing)"}
        parts = [f"{states[s]} {word}" for s, word in words.items() if s in states]
        changed = self.cells[self.cells["selection"].isin(["changed", "CHANGED"])]
        lowest = f", lowest overlap {changed['overlap'].min():.4f}" if len(changed) else ""
        counted = compared(self.cells.get("kept_n"))
        if not counted:
            return "kept sets: none compared (no sample of the baseline's ran)"
        return f"kept sets of {counted}: {', '.join(parts)}{lowest} (fails below {self.rule.min_overlap:g})"


def compared(counts: pd.Series | None) -> str:
    """``7 samples in 3 cells (2 to 3 a cell)``: what one of the gate's comparisons compared; "" for nothing (a
    comparison over nothing is never said to be on)."""
    counts = pd.Series(dtype=float) if counts is None else counts.dropna()
    counts = counts[counts > 0]
    if counts.empty:
        return ""
    low, high = int(counts.min()), int(counts.max())
    each = f"{low}" if low == high else f"{low} to {high}"
    return f"{int(counts.sum())} samples in {len(counts)} cells ({each} a cell)"


def _paired_tests(baseline_samples: pd.DataFrame, run: pd.DataFrame) -> pd.DataFrame:
    """Run − baseline on the same samples, per cell and per policy pooled over its cells; Holm over all of them."""
    both = baseline_samples[SAMPLE_COLUMNS].merge(
        run[SAMPLE_COLUMNS], on=[*CELL, "sample_id"], suffixes=("_baseline", "_run")
    )
    tests = []
    for key, cell in both.groupby(CELL, sort=False):
        result = paired_difference(cell["score_run"].to_numpy(), cell["score_baseline"].to_numpy())
        tests.append({**dict(zip(CELL, key)), "paired": result, "paired_n": len(cell)})
    policy = [c for c in CELL if c not in ("task", "budget")]  # a policy's cells: over tasks and budgets
    for key, pooled in both.groupby(policy, sort=False):
        strata = pooled["task"] + " @ " + pooled["budget"]
        if strata.nunique() < 2:
            continue  # one cell: its own test already
        result = paired_difference(pooled["score_run"].to_numpy(), pooled["score_baseline"].to_numpy(), strata)
        tests.append({**dict(zip(policy, key)), "task": ALL, "budget": ALL, "paired": result, "paired_n": len(pooled)})
    table = pd.DataFrame(tests, columns=[*CELL, "paired", "paired_n"])
    table["paired_diff"] = [t.mean * 100 for t in table["paired"]]
    table["paired_low"] = [t.low * 100 for t in table["paired"]]
    table["paired_high"] = [t.high * 100 for t in table["paired"]]
    table["p_holm"] = holm([t.p for t in table["paired"]])
    return table.drop(columns="paired")


def compare_selection(baseline_samples: pd.DataFrame, run: pd.DataFrame, rule: SelectionRule) -> pd.DataFrame:
    """Per cell, the run's kept sets against the baseline's, sample by sample: ``layers`` of the model,
    ``layers_changed`` (a layer any sample kept other entries in), ``counts_changed`` (layers that kept another
    number of entries over their heads), ``split_moved`` (layers that kept as many, split otherwise among their
    heads), ``counts_example`` (the first such layer's counts, before → after; a changed total first), ``overlap``
    (entries in common over the larger kept set, summed over samples and layers) and ``selection``: identical,
    changed (within the rule) or CHANGED (fails)."""
    both = baseline_samples.merge(run, on=[*CELL, "sample_id"], suffixes=("_baseline", "_run"))
    lacking = both["kept_fingerprint_run"].isna()
    if lacking.any():
        first = both[lacking].iloc[0]
        raise PkvError(
            f"the run's row {first['task']} {first['sample_id']} {first['policy']} @ {first['budget']} has no kept "
            "fingerprint (written by an older pkvbench): rerun it, or check with --selection off"
        )
    cells = []
    for key, group in both.groupby(CELL, sort=False):
        layers = 0
        changed: set[int] = set()
        counts_changed: set[int] = set()
        split_moved: set[int] = set()
        examples: dict[str, str] = {}  # "total" and "split": the first layer of each kind, before → after
        common, larger = 0.0, 0.0
        for before, after in zip(group["kept_fingerprint_baseline"], group["kept_fingerprint_run"]):
            a, b = Fingerprint.parse(before), _parse_run(after, key)
            result = compare(a, b)
            layers = max(layers, len(result.changed))
            changed.update(np.flatnonzero(result.changed).tolist())
            totals = np.flatnonzero(result.totals_differ).tolist()
            split = np.flatnonzero(result.counts_differ & ~result.totals_differ).tolist()
            for kind, differ in (("total", totals), ("split", split)):
                if differ and kind not in examples:
                    examples[kind] = _counts_change(a, b, differ[0])
            counts_changed.update(totals)
            split_moved.update(split)
            common += float(result.common.sum())
            larger += float(result.larger.sum())
        overlap = common / larger if larger else 1.0
        if counts_changed or (changed and (overlap < rule.min_overlap or rule.exact)):
            state = "CHANGED"
        else:
            state = "changed" if changed else "identical"
        example = examples.get("total", examples.get("split", ""))
        cells.append(
            [
                *key,
                *(layers, len(changed), len(counts_changed), len(split_moved), example, round(overlap, 4), state),
                len(group),  # kept sets compared
            ]
        )
    columns = [*CELL, "layers", "layers_changed", "counts_changed", "split_moved", "counts_example", "overlap"]
    return pd.DataFrame(cells, columns=[*columns, "selection", "kept_n"])


def _counts_change(before: Fingerprint, after: Fingerprint, layer: int) -> str:
    if len(before.counts) != len(after.counts):
        return f"{len(before.counts)} → {len(after.counts)} layers"
    return f"layer {layer}: {_heads(before.counts, layer)} → {_heads(after.counts, layer)}"


def _heads(counts: list[tuple[int, ...]], layer: int) -> str:
    heads = counts[layer]
    return f"{len(heads)}x{heads[0]}" if len(set(heads)) == 1 else "/".join(map(str, heads))


def _parse_run(text: str, cell: tuple) -> Fingerprint:
    try:
        return Fingerprint.parse(text)
    except ValueError as exc:
        raise PkvError(f"the run's rows of {' '.join(map(str, cell[1:]))}: {exc}") from None


def changed_predictions(baseline_samples: pd.DataFrame, run: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The samples whose prediction differs from the baseline's (cell, sample, before, after), and how many
    predictions were compared."""
    if "pred" not in baseline_samples or "pred" not in run:
        return pd.DataFrame(columns=[*CELL, "sample_id", "pred_baseline", "pred_run"]), 0
    keys = [*CELL, "sample_id"]
    both = baseline_samples[[*keys, "pred"]].merge(run[[*keys, "pred"]], on=keys, suffixes=("_baseline", "_run"))
    return both[both["pred_baseline"] != both["pred_run"]].reset_index(drop=True), len(both)


def compare_cells(
    baseline: pd.DataFrame,
    run: pd.DataFrame,
    tolerances: dict[str, float],
    paired: pd.DataFrame | None = None,
    selection: pd.DataFrame | None = None,
    rule: SelectionRule | None = None,
) -> pd.DataFrame:
    """The gate's table: one row per cell (and pooled policy row) with its accuracy ``status``, the kept sets'
    ``selection`` (where compared) and whether it is ``failing``."""
    rule = rule or SelectionRule()
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
    if selection is not None:
        table = table.merge(selection, on=CELL, how="left")
    table["selection"] = table["selection"].fillna("-") if "selection" in table else "-"
    table["failing"] = table["status"].isin(FAILING) | (table["selection"] == "CHANGED")
    return sort_rows(table, columns=CELL)


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


def check_run(
    results: list[str], baseline_path: str, tolerance: float, per_cell: str | None, rule: SelectionRule | None = None
) -> CheckResult:
    rule = rule or SelectionRule()
    baseline = read_baseline(baseline_path)
    tolerances = read_tolerances(per_cell, tolerance, set(baseline["task"]))
    run = run_samples(results)
    baseline_samples = read_baseline_samples(samples_path(baseline_path), baseline)
    paired = selection = None
    state, changed, compared = "off", None, 0
    if baseline_samples is not None:
        refuse_other_samples(baseline_samples, run, samples_path(baseline_path))
        paired = _paired_tests(baseline_samples, run)
        changed, compared = changed_predictions(baseline_samples, run)
        if rule.check and "kept_fingerprint" not in baseline_samples:
            state = "absent"
        elif rule.check:
            if "kept_fingerprint" not in run:
                raise PkvError(
                    f"the run's rows ({', '.join(results)}) have no kept fingerprints (written by an older pkvbench): "
                    "rerun them, or check with --selection off"
                )
            selection, state = compare_selection(baseline_samples, run, rule), "on"
    elif rule.check:
        state = "absent"
    table = compare_cells(baseline, cell_table(run), tolerances, paired, selection, rule)
    if rule.exact and changed is not None and len(changed):
        fails = table.merge(changed[CELL].drop_duplicates(), on=CELL, how="left", indicator=True)["_merge"] == "both"
        table["failing"] = table["failing"] | fails.to_numpy()
    return CheckResult(table, tolerances, paired is not None, rule, state, changed, compared)


def refuse_other_samples(baseline_samples: pd.DataFrame, run: pd.DataFrame, path: Path) -> None:
    """Every cell the run has with the baseline's sample count must be the baseline's samples: a samples file that
    names others (its counts and means may still agree with the baseline's cells) would make the paired tests and the
    kept-set comparison compare nothing, and a gate that compared nothing would pass anything."""
    run_ids = run.groupby(CELL, sort=False)["sample_id"].agg(set).to_dict()
    for key, group in baseline_samples.groupby(CELL, sort=False):
        ran = run_ids.get(key)
        listed = set(group["sample_id"])
        if ran is None or len(ran) != len(listed) or ran == listed:
            continue  # missing, or another count: the cell fails as such
        other = sorted(listed - ran)
        record = group[group["sample_id"] == other[0]].iloc[0]
        raise PkvError(
            f"baseline samples {_where(path, int(record.name), record.to_dict())}: the run's cell has {len(ran)} "
            f"samples, as the baseline's, but not this one ({len(other)} of {len(listed)} differ): the samples file "
            "does not cover the baseline's cells sample for sample; rewrite the baseline with --update"
        )


def write_baseline(results: list[str], baseline_path: str) -> pd.DataFrame:
    """The run's cells as the baseline, and beside them its per-sample scores (for the paired tests), predictions
    and selection fingerprints (what changed), where every row has them."""
    samples = run_samples(results)
    for column in RECORDED:
        if column in samples and samples[column].isna().any():
            samples = samples.drop(columns=column)  # rows of an older pkvbench among them: not recorded at all
    cells = cell_table(samples)
    ordered = sort_rows(samples, columns=[*CELL, "sample_id"])
    # A column of the cell that every row has at its default is left out, as it reads back: a run of the model's own
    # cache without decode budgets writes the baseline earlier versions wrote, and they can read.
    unused = [c for c, default in CELL_DEFAULTS.items() if c != "query_mode" and (cells[c] == default).all()]
    # Under the writing rule: only over a baseline (known by its header) and never inside the runs it is made from.
    outputs = Outputs("--baseline", [*results, *run_folders(results)])
    outputs.add(baseline_path, cells.drop(columns=unused).to_csv(index=False), BASELINE)
    outputs.add(samples_path(baseline_path), ordered.drop(columns=unused).to_csv(index=False), BASELINE_SAMPLES)
    outputs.commit()
    return cells


def _number(value, fmt: str) -> str:
    return "-" if pd.isna(value) else format(value, fmt)


def format_failures(result: CheckResult) -> str:
    """The lines a person reads in a CI log: one per cell whose accuracy failed, worst first (``*`` for a policy's
    pooled row); then one per cell whose kept sets changed beyond the rule; then the changed predictions."""
    failures = result.failures.copy()
    order = {"MISSING": 0, "COUNT": 1, "REGRESSED": 2}
    accuracy = failures[failures["status"].isin(FAILING)].copy()
    accuracy["rank"] = [order[s] for s in accuracy["status"]]
    accuracy = accuracy.sort_values(["rank", "delta"], na_position="first")
    lines = []
    if len(accuracy):
        lines.append(
            f"{'status':9} {'task':16} {'policy':20} {'budget':>7} {'mode':8} {'baseline':>8} {'run':>8} "
            f"{'delta':>7} {'n':>9} {'paired Δ [95% interval], Holm p':>34}"
        )
    for row in accuracy.to_dict("records"):
        n_run = "-" if pd.isna(row.get("n_run")) else int(row["n_run"])
        n_base = "-" if pd.isna(row.get("n_baseline")) else int(row["n_baseline"])
        paired = ""
        if not pd.isna(row.get("paired_diff", math.nan)):
            paired = (
                f"{row['paired_diff']:+.2f} [{row['paired_low']:.2f}, {row['paired_high']:.2f}], p {row['p_holm']:.3g}"
            )
        lines.append(
            f"{row['status']:9} {row['task']:16} {key_label(row):20} {row['budget']:>7} {row['query_mode']:8} "
            f"{_number(row['score_baseline'], '8.2f'):>8} {_number(row['score_run'], '.2f'):>8} "
            f"{_number(row['delta'], '+.2f'):>7} {n_base!s:>4}→{n_run!s:<4} {paired:>34}"
        )
    selection = failures[failures["selection"] == "CHANGED"]
    if len(selection):
        lines += [f"SELECTION {selection_line(row)}" for row in selection.sort_values("overlap").to_dict("records")]
    lines += prediction_lines(result)
    return "\n".join(lines)


def selection_line(row: dict) -> str:
    """``snapkv @ 64 (needle, aware): kept sets changed in 30 of 30 layers, overlap 0.810``"""
    cell = f"{key_label(row)} @ {row['budget']} ({row['task']}, {row['query_mode']})"
    layers = int(row["layers"])
    text = f"{cell}: kept sets changed in {int(row['layers_changed'])} of {layers} layers, overlap {row['overlap']:.3f}"
    if row["counts_changed"]:
        text += f"; kept counts differ in {int(row['counts_changed'])} of {layers} layers ({row['counts_example']})"
    elif row.get("split_moved"):
        text += (
            f"; the heads' split of a layer's entries moved in {int(row['split_moved'])} of {layers} layers "
            f"({row['counts_example']})"
        )
    return text


def prediction_lines(result: CheckResult, limit: int = 10) -> list[str]:
    """The changed predictions, at most ``limit`` of them (before → after, as one-line text)."""
    changed = result.changed_predictions
    if changed is None or not len(changed):
        return []
    lines = [
        f"PREDICTION {r['task']} {r['sample_id']} {key_label(r)} @ {r['budget']} ({r['query_mode']}): "
        f"{_clip(r['pred_baseline'])!r} → {_clip(r['pred_run'])!r}"
        for r in changed.head(limit).to_dict("records")
    ]
    if len(changed) > limit:
        lines.append(f"PREDICTION ... and {len(changed) - limit} more")
    return lines


def _clip(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
