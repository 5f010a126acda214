"""``pkvbench report --html``: one self-contained HTML page of run folders, opened offline in any browser.

The page holds the summary tables (sortable), interactive figures (Vega-Lite specs built with altair, drawn by the
Vega bundle that vl-convert ships, inlined once), a per-sample view of every policy × budget's prediction and score,
and the runs' metadata. It is built from the run folders alone (never a model), and nothing is fetched when it is
viewed. The data travels as one JSON document that the page's own script renders, predictions always as text, never
as HTML; samples are drawn only when picked, so a 10,000-row run stays a page of a few megabytes that opens at once.
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import vl_convert
from altair.utils.html import vl_version_for_vl_convert

from pkvbench._version import __version__
from pkvbench.cell.schema import DEFAULT_QUERY_MODE, FIELDS, LOADED, SAMPLE, TEXT, fields_of
from pkvbench.errors import PkvError
from pkvbench.reports import frontier
from pkvbench.reports.axes import LINE_KEY, ROW_AXES, SERIES, is_full, present
from pkvbench.reports.choices import PAPER_REFERENCE
from pkvbench.reports.figures.figure_data import full_reference
from pkvbench.reports.figures.html_figures import (
    budget_curve_figures,
    curve_points,
    decode_memory_figures,
    frontier_figures,
    json_value,
    layer_budget_figures,
    needle_heatmap_figures,
    query_modes,
    rounded,
)
from pkvbench.reports.paper_compare import compare, load_reference
from pkvbench.reports.report import Runs, load_runs, model_display_name, report_table, uneven_counts
from pkvbench.reports.summary import summarize
from pkvbench.reports.turns import has_turns, turn_table
from pkvbench.store.results import ROWS, RUN, read_run_record

ASSETS = "html_assets"  # beside this module, in its package: the page's skeleton, style sheet and script
# Row fields that name or measure one policy × budget, not the sample: every field of the schema but the sample's and
# the texts shown on their own, and what report.load_runs adds; the sample's own fields (context_tokens, length,
# depth, ...) are what is left of its first row.
CONFIG_FIELDS = (set(FIELDS) - {*fields_of(SAMPLE), *fields_of(TEXT)}) | set(LOADED)
# Where a row carries the text asked and the text read, shown in the per-sample view: pkvbench's rows have the
# question's text and the context's first and last tokens (runner.sample_texts); rows of other tools may have a
# question or a context under one of the other names (the first name found wins).
QUESTION_FIELDS = ("question_text", "question", "query", "input")
CONTEXT_HEAD, CONTEXT_TAIL = "context_head", "context_tail"
CONTEXT_FIELDS = ("context", "context_excerpt", "prompt", "prompt_excerpt")
TEXT_FIELDS = {*QUESTION_FIELDS, CONTEXT_HEAD, CONTEXT_TAIL, *CONTEXT_FIELDS}
CONTEXT_EXCERPT_CHARS = 3000  # head and tail of a long context: enough to see where the needle went
SCORE_TOLERANCE = 1e-9  # a policy "lost points" when its score is below the full cache's by more than rounding


@dataclass
class HtmlReport:
    path: Path
    bytes: int
    runs: Runs


# --- writing ---------------------------------------------------------------------------------------------------------


def check_html_target(path: str | os.PathLike, reads: list[str | os.PathLike] = ()) -> Path:
    """Refuse, before any work, a page path that cannot be written or may not be: it must end in .html (so it is
    never a run's samples.jsonl, run.json or summary.csv), sit under a folder that exists, or can be made, and is
    writable, and pass the writing rule (``outputs.py``: no file pkvbench did not write is replaced)."""
    from pkvbench.store.outputs import Outputs

    if not str(path).lower().endswith((".html", ".htm")):
        raise PkvError(f"--html {path or repr('')}: give a file name ending in .html")
    target = Outputs("--html", reads).check(path)
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PkvError(f"cannot write {path}: {parent} is not writable")
    return Path(path)


def write_html_report(
    folders: list[str | os.PathLike], path: str | os.PathLike, runs: Runs | None = None
) -> HtmlReport:
    """Read the run folders (or folders above them; or take ``runs`` read from them) and write their page to
    ``path`` under the writing rule (atomically)."""
    from pkvbench.store.outputs import Outputs

    runs = runs if runs is not None else load_runs(folders)
    reads = [*folders, *runs.folders]
    check_html_target(path, reads)
    page = build_page(runs)
    outputs = Outputs("--html", reads)
    outputs.add(path, page)
    outputs.commit()
    return HtmlReport(Path(path), len(page.encode("utf-8")), runs)


def build_page(runs: Runs) -> str:
    data = page_data(runs)
    parts = {
        "title": html.escape(data["title"]),
        "style": _asset("report.css"),
        "data": _script_json(data),
        "vega": _script_text(vega_bundle()),
        "script": _script_text(_asset("report.js")),
    }
    # One pass over the skeleton, so a placeholder-like string inside the data or a library is never replaced.
    return re.sub(r"{{(\w+)}}", lambda match: parts[match.group(1)], _asset("report.html"))


def _asset(name: str) -> str:
    return importlib.resources.files(__package__).joinpath(ASSETS, name).read_text(encoding="utf-8")


@functools.cache
def vega_bundle() -> str:
    """Vega, Vega-Lite and vega-embed in one script (about 0.9 MB), for the Vega-Lite version altair writes."""
    return vl_convert.javascript_bundle(vl_version=vl_version_for_vl_convert())


def _script_json(data: dict) -> str:
    # "<" only occurs inside JSON strings, where \u003c reads back the same: no "</script>" in a prediction can end
    # the script element early.
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def _script_text(code: str) -> str:
    if re.search(r"</script|<!--", code, re.IGNORECASE):
        raise PkvError("a script of the page contains '</script' or '<!--' and cannot be inlined")  # never expected
    return code


# --- the page's data -------------------------------------------------------------------------------------------------


def page_data(runs: Runs) -> dict[str, Any]:
    rows = runs.rows
    summary = summary_table(rows)
    tables = {"summary": table_json(summary), "report": table_json(report_table(rows, intervals=True))}
    figures = budget_curve_figures(curve_points(rows), rows)
    if frontier.has_frontier(rows):  # runs with --kv-bits or --memory: accuracy per byte (docs/memory.md)
        points = frontier.points(rows)
        tables["frontier"] = table_json(points)
        compared = frontier.comparisons(rows)
        if not compared.empty:
            tables["memory_diff"] = table_json(compared)
        figures += frontier_figures(points)
    if has_turns(rows):  # conversations (--query-mode multi-turn): each cell's score turn by turn
        tables["turns"] = table_json(turn_table(rows, intervals=True))
    labelled = rows.assign(policy=rows[SERIES])  # a policy with its bits and decode budget: each line its own
    return {
        "title": page_title(rows),
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "pkvbench": __version__,
        "notes": runs.notes + uneven_counts(rows),
        "runs": [run_metadata(folder) for folder in runs.folders],
        "tables": tables,
        "comparison": paper_comparison(runs),
        "ranks": sort_ranks(rows),
        "figures": figures
        + needle_heatmap_figures(labelled)
        + layer_budget_figures(labelled)
        + decode_memory_figures(labelled),
        "samples": sample_view(labelled),
    }


def page_title(rows: pd.DataFrame) -> str:
    models = ", ".join(model_display_name(m) for m in rows["model"].unique())
    return f"pkvbench · {models} · {', '.join(present(rows['task']))}"


def sort_ranks(rows: pd.DataFrame) -> dict[str, dict[str, int]]:
    """The report's order of policies, budgets and tasks, for the page's sortable tables (not alphabetical)."""
    return {
        "policy": _ranks(present(rows["policy"])),
        "budget": _ranks(present(rows["budget"])),
        "task": _ranks(present(rows["task"])),
    }


def _ranks(values: list[str]) -> dict[str, int]:
    return {str(value): rank for rank, value in enumerate(values)}


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """summary.csv's table (task, policy, budget, [query_mode,] n, score and whatever ``summary.summarize`` adds,
    such as intervals) per model, in the report's order, with ``vs full``: the score minus the full cache's on the
    same task and query mode."""
    parts = []
    for model, per_model in rows.groupby("model", sort=False):
        table = summarize(per_model.to_dict("records"))
        table.insert(0, "model", model)
        parts.append(table)
    table = pd.concat(parts, ignore_index=True)
    modes = table["query_mode"] if "query_mode" in table.columns else [None] * len(table)
    references = {
        key: full_reference(rows[rows["model"] == key[0]], key[1], key[2])
        for key in set(zip(table["model"], table["task"], modes))
    }
    full_scores = [references[key] for key in zip(table["model"], table["task"], modes)]
    full_scores = [round(reference[0], 2) if reference else float("nan") for reference in full_scores]
    table["vs full"] = (table["score"] - pd.Series(full_scores, index=table.index)).round(2)
    axes = ["task", *(c for c in ROW_AXES if c in table.columns)]
    models = {model: rank for rank, model in enumerate(dict.fromkeys(table["model"]))}
    table = table.astype({c: rows[c].dtype for c in axes}).assign(rank=table["model"].map(models))
    return table.sort_values(["rank", *axes], kind="stable").drop(columns="rank").reset_index(drop=True)


def table_json(frame: pd.DataFrame) -> dict[str, list]:
    """A table as the page's script reads it: column names, their kinds (int, number, text) and the rows."""
    kinds = [
        "int"
        if pd.api.types.is_integer_dtype(frame[c])
        else "number"
        if pd.api.types.is_numeric_dtype(frame[c])
        else "text"
        for c in frame.columns
    ]
    rows = [[json_value(v) for v in row] for row in frame.itertuples(index=False)]
    return {"columns": [str(c) for c in frame.columns], "kinds": kinds, "rows": rows}


def paper_comparison(runs: Runs) -> dict | None:
    """``pkvbench compare``'s table against the paper's Table 1, when the run shares tasks and cells with it."""
    try:
        result = compare(runs, load_reference(PAPER_REFERENCE))
    except PkvError:
        return None  # nothing in common with the paper (a needle run, another budget): no comparison to show
    return {"reference": PAPER_REFERENCE, "statements": result.statements, "table": table_json(result.table)}


# --- run metadata ----------------------------------------------------------------------------------------------------


def run_metadata(folder: Path) -> dict[str, Any]:
    """What the page says about one run folder: a few facts in words, its options and policies, and the whole
    run.json (collapsed) for anything else."""
    try:
        record = read_run_record(folder / RUN)
    except PkvError as exc:
        return {"folder": str(folder), "facts": [["run.json", str(exc)]], "options": {}, "policies": {}, "record": None}
    options = record.get("options", {})
    last_row = _modified(folder / ROWS)
    facts = [
        ["model", _describe_model(record.get("model"), options.get("model"))],
        ["protocol", options.get("protocol")],
        ["query modes", _joined(options.get("query_modes"))],
        ["executor", record.get("executor")],
        ["versions", _joined(f"{k} {v}" for k, v in (record.get("versions") or {}).items() if v)],
        ["commit", record.get("commit")],
        ["started", record.get("started")],
        ["last row written", last_row.isoformat(timespec="seconds") if last_row else None],
        ["elapsed (start → last row)", _elapsed(record.get("started"), last_row)],
        ["merged from", _joined(record.get("merged_from"))],
    ]
    return {
        "folder": str(folder),
        "facts": [[label, str(value)] for label, value in facts if value not in (None, "")],
        "options": {k: json_value(v) for k, v in options.items()},
        "policies": record.get("policies") or {},
        "record": record,
    }


def _describe_model(model: Any, option: str | None) -> str | None:
    if not isinstance(model, dict):
        return option
    details = [
        f"{model[key]} {label}" if label else str(model[key])
        for key, label in (("source", ""), ("layers", "layers"), ("kv_heads", "KV heads"), ("device", ""))
        if model.get(key) is not None
    ]
    dtype = f" {model['dtype']}" if model.get("dtype") else ""
    return f"{model.get('name') or option} ({', '.join(details)}{dtype})" if details else model.get("name") or option


def _joined(values) -> str | None:
    return ", ".join(map(str, values)) if values else None


def _modified(path: Path) -> datetime | None:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
    except OSError:
        return None


def _elapsed(started: str | None, last_row: datetime | None) -> str | None:
    """From the (last) start recorded in run.json to the last row written; a resumed run counts from its resume."""
    try:
        seconds = (last_row - datetime.fromisoformat(started)).total_seconds()
    except (TypeError, ValueError):
        return None
    if seconds < 0:
        return None
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


# --- the per-sample view ---------------------------------------------------------------------------------------------


def sample_view(rows: pd.DataFrame) -> dict[str, Any]:
    """Every sample once, with each policy × budget's prediction, score and entries kept, compactly: configurations
    (model, policy, budget, query mode) are listed once and a sample's rows refer to them by index.

    A sample's ``disagree`` says some policies of one model and query mode predicted different texts; ``lost`` that
    one scored below the full cache."""
    rows = rows.assign(query_mode=query_modes(rows))
    key = LINE_KEY
    configs = list(rows[key].drop_duplicates().sort_values(key, kind="stable").itertuples(index=False, name=None))
    config_index = {config: i for i, config in enumerate(configs)}
    by_sample: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows.to_dict("records"):
        by_sample[(row["task"], row["sample_id"])].append(row)
    tasks = present(rows["task"])
    samples = []
    for task, sample_id in sorted(by_sample, key=lambda key: tasks.index(key[0])):  # stable: run order within a task
        members = by_sample[(task, sample_id)]
        entries = sorted(
            (
                [
                    config_index[(r["model"], r["policy"], r["budget"], r["query_mode"])],
                    _string_or_empty(r.get("pred")),
                    rounded(r.get("score"), 4),
                    rounded(r.get("budget_tokens"), 1),
                ]
                for r in members
            ),
            key=lambda entry: entry[0],
        )
        samples.append(
            {
                "task": task,
                "id": sample_id,
                "fields": sample_fields(members[0]),
                "answers": _answers(members[0].get("answers")),
                "question": _first_text(members[0], QUESTION_FIELDS),
                "context": context_excerpt(members[0]),
                "rows": entries,
                **sample_flags(members),
            }
        )
    return {
        "tasks": tasks,
        "configs": [{"model": m, "policy": p, "budget": b, "mode": q} for m, p, b, q in configs],
        "samples": samples,
    }


def sample_flags(members: list[dict]) -> dict[str, bool]:
    """Whether a sample's policies disagree (different predictions within one model and query mode) and whether
    one of them lost points against the full cache."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in members:
        groups[(row["model"], row.get("query_mode", DEFAULT_QUERY_MODE))].append(row)
    disagree = lost = False
    for group in groups.values():
        disagree |= len({_string_or_empty(r.get("pred")).strip() for r in group}) > 1
        scored = [r for r in group if rounded(r.get("score"), 6) is not None]
        full = [r["score"] for r in scored if is_full(r["policy"])]
        if full:
            reference = sum(full) / len(full)
            lost |= any(r["score"] < reference - SCORE_TOLERANCE for r in scored)
    return {"disagree": disagree, "lost": lost}


def sample_fields(row: dict) -> dict[str, Any]:
    """The sample's own scalar fields (length, depth, context_tokens, ...): what is left of a row without the
    fields of its configuration and the texts shown on their own."""
    fields = {}
    for name, value in row.items():
        if name in CONFIG_FIELDS or name in TEXT_FIELDS or isinstance(value, (list, dict)):
            continue
        value = json_value(value)
        if value is not None:
            fields[name] = value
    return fields


def context_excerpt(row: dict) -> str | None:
    """The context's start and end: the row's own head and tail, or the head and tail of a whole context."""
    head, tail = _first_text(row, (CONTEXT_HEAD,)), _first_text(row, (CONTEXT_TAIL,))
    if head is not None:
        return f"{head}\n\n[…]\n\n{tail}" if tail else head
    return excerpt(_first_text(row, CONTEXT_FIELDS))


def excerpt(text: str | None, limit: int = CONTEXT_EXCERPT_CHARS) -> str | None:
    if text is None or len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n\n[… {len(text) - 2 * half} characters left out …]\n\n{text[-half:]}"


def _first_text(row: dict, names: tuple[str, ...]) -> str | None:
    for name in names:
        if isinstance(row.get(name), str) and row[name]:
            return row[name]
    return None


def _string_or_empty(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _answers(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return []
