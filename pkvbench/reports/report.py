"""Results people read: merge run folders into one tidy table (the comparison with the paper's Table 1 is
``paper_compare``).

A *cell* is one model × policy × budget × task; its score is the mean of the sample scores × 100 (two decimals,
LongBench's convention; the needle task's cell is the mean over its whole length × depth grid). ``avg`` is the plain
mean over the table's tasks, as the paper reports it, and is missing when any of those tasks is: an average over
fewer tasks would not be comparable with the others. Missing cells stay missing (NaN; ``—`` in Markdown, empty in
CSV, ``--`` in LaTeX), never 0.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from pkvbench.cell.budgets import budget_label
from pkvbench.cell.schema import AWARE, DEFAULT_QUERY_MODE, FORMATS, NO_TURNS, REQUIRED, TABLE_KEY
from pkvbench.errors import PkvError
from pkvbench.reports.axes import ROW_AXES, cell_label, order_axes, present
from pkvbench.reports.stats import group_interval, mean_interval
from pkvbench.store.lock import FolderLock
from pkvbench.store.results import (
    ROWS,
    RUN,
    bits_label,
    decode_budget_label,
    missing_shards,
    read_rows,
    repeated_rows_note,
    stored_as,
    unique_rows,
)

# LongBench-E buckets of the sample's ``length`` field, as LongBench's own eval.py cuts them.
LENGTH_BUCKETS = (("0-4k", 0, 4000), ("4-8k", 4000, 8000), ("8k+", 8000, math.inf))


# --- loading ---------------------------------------------------------------------------------------------------------


def run_folders(paths: list[str | os.PathLike]) -> list[Path]:
    """Each path is a run folder (with samples.jsonl) or a folder above run folders (searched recursively)."""
    if not paths:
        raise PkvError("give one or more run folders (each with a samples.jsonl)")
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise PkvError(f"{path}: no such folder")
        if (path / ROWS).is_file():
            found.append(path)
            continue
        below = sorted(p.parent for p in path.rglob(ROWS))
        if not below:
            raise PkvError(f"{path}: not a run folder (no {ROWS} in it or below it)")
        found.extend(below)
    return list(dict.fromkeys(found))


def model_display_name(model: str) -> str:
    """A readable model name for titles: the alias's real name, or the last part of a Hugging Face id."""
    from pkvbench.cell.models import ALIASES

    if model in ALIASES:
        return ALIASES[model].filename.split(".")[0]
    return model.rstrip("/").split("/")[-1].removesuffix(".gguf")


@dataclass
class Runs:
    """Every result row of some run folders, merged, plus what was noticed on the way."""

    rows: pd.DataFrame
    folders: list[Path]
    notes: list[str] = field(default_factory=list)


def load_runs(paths: list[str | os.PathLike], strict: bool = False) -> Runs:
    """Read and merge run folders. The same sample × policy × budget of the same model found twice is kept once
    (the first folder given wins) and counted in a note, so merging overlapping runs never double-counts. Two rows of
    one key that disagree (another score or prediction: an older run beside a newer one) are named in a note; with
    ``strict`` (the CI gate) they are refused, as is a folder a run is still writing: a stale good row must never
    stand in for a regressed one, nor a partial run for a whole one."""
    folders = run_folders(paths)
    frames, notes = [], []
    for folder in folders:
        if strict and (holder := FolderLock(folder).holder()):
            raise PkvError(f"{folder} is being written by a running pkvbench ({holder}); use it once that run ends")
        raw = read_rows(folder)
        missing_shards = _missing_shards(folder)
        if missing_shards:
            notes.append(f"{folder}: a merge without shards {missing_shards}: not the whole run")
        repeated = unique_rows(raw)[1]
        if repeated:
            notes.append(repeated_rows_note(folder / ROWS, repeated))
        if not raw:
            notes.append(f"{folder}: no result rows yet")
            continue
        frame = pd.DataFrame(raw)
        missing = [c for c in REQUIRED if c not in frame.columns]
        if missing:
            raise PkvError(f"{folder / ROWS}: rows lack {', '.join(missing)}; not a pkvbench result file")
        if "model" not in frame.columns:
            frame["model"] = _run_model(folder)
        frame["model"] = frame["model"].fillna(_run_model(folder))
        frame["folder"] = str(folder)
        # How each row's cache was stored (docs/memory.md): "" for the model's own, and the bits tables show; a row
        # written before storage formats is the model's own cache, at the width of the run's dtype.
        native = _run_native_bits(folder)
        frame["kv_stored"] = [stored_as(row) for row in raw]
        frame["kv_bits"] = [
            bits_label(row) if stored_as(row) or "kv_bits" in row or native is None else str(native) for row in raw
        ]
        frames.append(frame)
    if not frames:
        raise PkvError(f"no result rows in {', '.join(map(str, folders))}")
    merged = pd.concat(frames, ignore_index=True)
    merged["budget"] = [budget_label(b) for b in merged["budget"]]
    merged["sample_id"] = merged["sample_id"].astype(str)
    merged["score"] = pd.to_numeric(merged["score"], errors="coerce")
    # rows written before the query mode was recorded are query-aware
    merged["query_mode"] = (
        merged["query_mode"].fillna(DEFAULT_QUERY_MODE) if "query_mode" in merged else DEFAULT_QUERY_MODE
    )
    # rows written before decode budgets existed never cut their cache while decoding
    raw = merged["decode_budget"] if "decode_budget" in merged else [None] * len(merged)
    merged["decode_budget"] = [decode_budget_label(v) for v in raw]
    # rows that are no conversation's turn (every row before conversations) have no turn compression
    turns = merged["turn_compression"] if "turn_compression" in merged else pd.Series(None, index=merged.index)
    merged["turn_compression"] = turns.astype(object).fillna(NO_TURNS)  # all-missing reads as float64
    keys = list(TABLE_KEY)
    conflict = _disagreement(merged, keys)
    if conflict:
        if strict:
            raise PkvError(f"{conflict}; give one run of each configuration")
        notes.append(f"{conflict}; the first is counted")
    within = merged.duplicated([*keys, "folder"], keep="first")
    duplicated = merged.duplicated(keys, keep="first")
    across = int((duplicated & ~within).sum())
    if across:
        notes.append(f"{across} rows found in more than one folder were counted once (first folder wins)")
    merged = merged[~duplicated].reset_index(drop=True)
    return Runs(order_axes(merged), folders, notes)


def _disagreement(rows: pd.DataFrame, keys: list[str]) -> str | None:
    """A sentence on the keys whose rows disagree (another score, or another prediction), naming the first and where
    its two rows are; None if every repeated key repeats the same result."""
    repeated = rows[rows.duplicated(keys, keep=False)]
    if repeated.empty:
        return None
    compared = ["score"] + (["pred"] if "pred" in repeated.columns else [])
    as_text = repeated.assign(**{column: repeated[column].astype(str) for column in compared})  # lists, NaN: comparable
    differs = as_text.groupby(keys, sort=False)[compared].nunique().gt(1).any(axis=1)
    if not differs.any():
        return None
    first = differs[differs].index[0]
    versions = repeated.set_index(keys).loc[[first]]
    where = " and ".join(f"{row.folder} (score {row.score:g})" for row in versions.head(2).itertuples())
    label = " ".join(str(part) for part in first[1:5])
    return f"{int(differs.sum())} result(s) appear twice with another score or prediction, e.g. {label} in {where}"


def refuse_decode_budgets(rows: pd.DataFrame, what: str) -> None:
    """``what`` has no decode-budget axis yet: refuse rows that cut their cache while decoding rather than pool them
    with the rows that did not."""
    if "decode_budget" in rows.columns and (rows["decode_budget"] != "none").any():
        raise PkvError(f"{what} does not handle rows with a decode budget yet; run it on a run without --decode-budget")


def _run_model(folder: Path) -> str:
    try:
        return json.loads((folder / RUN).read_text())["options"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown"


def _missing_shards(folder: Path) -> str | None:
    try:
        return missing_shards(json.loads((folder / RUN).read_text()))
    except (OSError, ValueError):
        return None


def _run_native_bits(folder: Path) -> int | None:
    """The width of the model's own cache values in a run (its dtype, from run.json), or None if it does not say."""
    try:
        dtype = json.loads((folder / RUN).read_text())["model"]["dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"float32": 32, "bfloat16": 16, "float16": 16}.get(dtype)


# --- the table -------------------------------------------------------------------------------------------------------


def length_bucket(length) -> str | None:
    try:
        value = float(length)
    except (TypeError, ValueError):
        return None
    if math.isnan(value):
        return None
    for name, low, high in LENGTH_BUCKETS:
        if low <= value < high:
            return name
    return None


def stores_formats(rows: pd.DataFrame) -> bool:
    """Whether any row's cache was stored in other bits than the model's own (``--kv-bits``)."""
    return "kv_stored" in rows.columns and bool((rows["kv_stored"] != "").any())


def row_axes(rows: pd.DataFrame) -> list[str]:
    """A table row's key: model × policy × budget; the bits its values were stored in when any row's were not the
    model's own (``kv_bits``); the query mode when any row's question came after compression (``agnostic``; a
    query-aware-only table, the paper's protocol, keeps the paper's shape); and the decode budget when any row cut
    its cache while decoding."""
    shown = {
        "kv_bits": stores_formats(rows),
        "query_mode": "query_mode" in rows.columns and (rows["query_mode"] != AWARE).any(),
        "decode_budget": "decode_budget" in rows.columns and (rows["decode_budget"] != "none").any(),
        "turn_compression": "turn_compression" in rows.columns and (rows["turn_compression"] != NO_TURNS).any(),
    }
    return ["model", *(axis for axis in ROW_AXES if shown.get(axis, True))]


def interval_columns(column: str) -> tuple[str, str]:
    return f"{column} ci_low", f"{column} ci_high"


def report_table(rows: pd.DataFrame, intervals: bool = False) -> pd.DataFrame:
    """Rows model × policy × budget (× query mode, ``row_axes``); columns: each task, LongBench-E buckets
    (``task 0-4k`` ...) for ``*_e`` tasks whose rows carry ``length``, ``avg`` (mean over the model's tasks, missing
    if any of them is), ``tasks`` (how many task cells are filled) and ``n`` (samples behind the row).

    With ``intervals``, each score column is followed by ``<column> ci_low`` and ``<column> ci_high``: its 95%
    bootstrap interval over samples (``stats``); ``avg``'s resamples within each task."""
    key = row_axes(rows)
    tasks = present(rows["task"])
    frame = rows.assign(column=rows["task"].astype(str))
    bucket_columns = []
    if "length" in rows.columns:
        is_e = rows["task"].str.endswith("_e")
        buckets = rows[is_e].assign(bucket=[length_bucket(v) for v in rows.loc[is_e, "length"]])
        buckets = buckets[buckets["bucket"].notna()]
        order = {name: i for i, (name, _, _) in enumerate(LENGTH_BUCKETS)}
        for task in tasks:
            found = sorted(set(buckets.loc[buckets["task"] == task, "bucket"]), key=order.get)
            bucket_columns += [f"{task} {b}" for b in found]
        named = [f"{task} {bucket}" for task, bucket in zip(buckets["task"], buckets["bucket"])]
        frame = pd.concat([frame, buckets.assign(column=named)])
    ordered = []
    for task in tasks:  # each task's buckets right after the task
        ordered += [task, *(c for c in bucket_columns if c.startswith(f"{task} "))]
    scores = frame.groupby([*key, "column"], sort=False)["score"]
    table = scores.mean().mul(100).unstack("column").reindex(columns=ordered)
    # The average runs over the tasks of the row's model (those any of its rows has): merging a needle run of one
    # model with a LongBench run of another must not blank both averages; a task missing in one row of a model does.
    model_tasks = {
        model: [t for t in tasks if per_model[t].notna().any()]
        for model, per_model in table.groupby(level="model", sort=False)
    }
    table["avg"] = [table.loc[index, model_tasks[index[0]]].mean(skipna=False) for index in table.index]
    table["tasks"] = table[tasks].notna().sum(axis=1)
    table["n"] = rows.groupby(key, sort=False).size()
    numeric = [*ordered, "avg"]
    if intervals:
        table = _with_intervals(table, scores, rows, key, model_tasks)
        numeric = [c for c in table.columns if c not in ("tasks", "n")]
    table = table.reset_index()
    table[numeric] = table[numeric].astype(float).round(2)
    return table.sort_values(key, kind="stable").reset_index(drop=True)  # the axes' order (load_runs)


def _with_intervals(table: pd.DataFrame, scores, rows: pd.DataFrame, key: list[str], model_tasks) -> pd.DataFrame:
    """``table`` with each score column's interval columns after it (× 100, as the scores)."""
    bounds: dict[tuple, tuple[float, float]] = {
        index: mean_interval(values)
        for index, values in scores  # index: (*key, column)
    }
    by_row = dict(iter(rows.groupby(key, sort=False)))
    columns = []
    for column in [c for c in table.columns if c not in ("avg", "tasks", "n")] + ["avg"]:
        low_name, high_name = interval_columns(column)
        if column == "avg":
            ends = []
            for index in table.index:
                cell, wanted = by_row[index], model_tasks[index[0]]
                groups = [cell.loc[cell["task"] == task, "score"] for task in wanted]
                ends.append(group_interval(groups) if all(len(g) for g in groups) else (math.nan, math.nan))
        else:
            ends = [bounds.get((*index, column), (math.nan, math.nan)) for index in table.index]
        table[low_name] = [low * 100 for low, _ in ends]
        table[high_name] = [high * 100 for _, high in ends]
        columns += [column, low_name, high_name]
    return table[[*columns, "tasks", "n"]]


def uneven_counts(rows: pd.DataFrame) -> list[str]:
    """Cells with fewer samples than the fullest cell of their task (a run stopped early, a --limit): worth a note."""
    axes = row_axes(rows)
    counts = rows.groupby(["task", *axes]).size()
    notes = []
    for task, per_task in counts.groupby(level="task"):
        most = per_task.max()
        for key, n in per_task.items():
            if n < most:
                cell = dict(zip(["task", *axes], key))
                mode = f" ({cell['query_mode']})" if "query_mode" in cell else ""
                where = cell_label(cell, at_budget=True) + mode
                notes.append(f"{task}: {cell['model']} {where} has {n} samples, others up to {most}")
    return notes


# --- formats ---------------------------------------------------------------------------------------------------------


# Columns whose small values matter: p-values print with three significant digits, not two decimals.
PVALUE_COLUMNS = ("p", "p_holm")


def _cell(value, missing: str, column: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    if isinstance(value, float):
        return f"{value:.3g}" if column in PVALUE_COLUMNS else f"{value:.2f}"
    return str(value)


def _display(table: pd.DataFrame, missing: str) -> tuple[list[str], list[list[str]], list[bool]]:
    """Header, body and which columns are numeric, as a reader sees them: a score's interval columns folded into
    the score's cell, ``48.00 [36.10, 59.90]``."""
    folded = {name for column in table.columns for name in interval_columns(str(column)) if name in table.columns}
    header = [str(c) for c in table.columns if c not in folded]
    numeric = [pd.api.types.is_numeric_dtype(table[c]) for c in table.columns if c not in folded]
    body = []
    for row in table.to_dict("records"):  # keeps each column's type (iterrows would make counts floats)
        cells = []
        for column in header:
            text = _cell(row[column], missing, column)
            low, high = interval_columns(column)
            if low in folded and text != missing and not pd.isna(row[low]):
                text += f" [{row[low]:.2f}, {row[high]:.2f}]"
            cells.append(text)
        body.append(cells)
    return header, body, numeric


def to_markdown(table: pd.DataFrame, missing: str = "—") -> str:
    header, body, numeric = _display(table, missing)
    lines = [
        "| " + " | ".join(map(markdown_escape, header)) + " |",
        "|" + "|".join("---:" if num else "---" for num in numeric) + "|",
    ]
    lines += ["| " + " | ".join(markdown_escape(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines) + "\n"


def markdown_escape(text: str) -> str:
    """A cell's ``|`` (a model or policy name may have one) escaped: unescaped it would end the cell."""
    return text.replace("|", "\\|")


def to_csv(table: pd.DataFrame) -> str:
    precise = {c: [_cell(v, "", c) for v in table[c]] for c in PVALUE_COLUMNS if c in table.columns}
    return table.assign(**precise).to_csv(index=False, float_format="%.2f", na_rep="")


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\^{}",
    "|": r"\textbar{}",  # in OT1 text a bare | prints as an em dash
    "<": r"\textless{}",
    ">": r"\textgreater{}",
}
_LATEX_CHARS = re.compile("|".join(map(re.escape, _LATEX_SPECIAL)))


def _latex_escape(text: str) -> str:
    """Each special character replaced once, in one pass: an escape's own braces are never escaped again (one pass
    after another turned a backslash into ``\\textbackslash\\{\\}``, which prints ``\\{}``)."""
    return _LATEX_CHARS.sub(lambda match: _LATEX_SPECIAL[match.group()], text)


def to_latex(table: pd.DataFrame, missing: str = "--") -> str:
    header, body, numeric = _display(table, missing)
    lines = [
        r"\begin{tabular}{" + "".join("r" if num else "l" for num in numeric) + "}",
        r"\toprule",
        " & ".join(_latex_escape(c) for c in header) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(_latex_escape(c) for c in row) + r" \\" for row in body]
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def render(table: pd.DataFrame, fmt: str) -> str:
    if fmt == "markdown":
        return to_markdown(table)
    if fmt == "csv":
        return to_csv(table)
    if fmt == "latex":
        return to_latex(table)
    raise PkvError(f"unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
