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
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import altair as alt
import pandas as pd
import vl_convert
from altair.utils.html import vl_version_for_vl_convert

from pkvbench import frontier
from pkvbench._version import __version__
from pkvbench.budgets import ALL, MEMORY_PREFIX, Budget
from pkvbench.errors import PkvError
from pkvbench.figure_data import NEEDLE_COLOURS, full_reference, is_full, needle_cells, needle_rows, policy_colour
from pkvbench.paper_compare import compare, load_reference
from pkvbench.report import (
    Runs,
    budget_sort_key,
    load_runs,
    model_display_name,
    policy_sort_key,
    report_table,
    task_order,
    uneven_counts,
    with_bits_in_policy,
    with_decode_in_policy,
)
from pkvbench.results import ROWS, RUN, bits_sort_key, read_run_record, summarize
from pkvbench.schema import DEFAULT_QUERY_MODE, FIELDS, LOADED, SAMPLE, TEXT, fields_of

ASSETS = "html_assets"  # inside the pkvbench package: the page's skeleton, style sheet and script
PAPER_REFERENCE = "pyramidkv-table1"
FULL_CACHE = "full cache"  # the reference line of the curves
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
    from pkvbench.outputs import Outputs

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
    from pkvbench.outputs import Outputs

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
    return importlib.resources.files("pkvbench").joinpath(ASSETS, name).read_text(encoding="utf-8")


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
    figures = budget_curve_figures(with_bits_in_policy(summary), rows)
    if frontier.has_frontier(rows):  # runs with --kv-bits or --memory: accuracy per byte (docs/memory.md)
        points = frontier.points(rows)
        tables["frontier"] = table_json(points)
        compared = frontier.comparisons(rows)
        if not compared.empty:
            tables["memory_diff"] = table_json(compared)
        figures += frontier_figures(points)
    labelled = with_bits_in_policy(rows)
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
    return f"pkvbench · {models} · {', '.join(task_order(rows['task'].unique()))}"


def sort_ranks(rows: pd.DataFrame) -> dict[str, dict[str, int]]:
    """The report's order of policies, budgets and tasks, for the page's sortable tables (not alphabetical)."""
    return {
        "policy": _ranks(sorted(rows["policy"].unique(), key=policy_sort_key)),
        "budget": _ranks(sorted(rows["budget"].unique(), key=budget_sort_key)),
        "task": _ranks(task_order(rows["task"].unique())),
    }


def _ranks(values: list[str]) -> dict[str, int]:
    return {str(value): rank for rank, value in enumerate(values)}


def _query_modes(rows: pd.DataFrame) -> pd.Series:
    if "query_mode" not in rows.columns:
        return pd.Series(DEFAULT_QUERY_MODE, index=rows.index)
    return rows["query_mode"].fillna(DEFAULT_QUERY_MODE)


def summary_table(rows: pd.DataFrame) -> pd.DataFrame:
    """summary.csv's table (task, policy, budget, [query_mode,] n, score and whatever ``results.summarize`` adds,
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
    tasks = task_order(table["task"].unique())
    models = list(dict.fromkeys(table["model"]))
    order = sorted(
        range(len(table)),
        key=lambda i: (
            models.index(table["model"].iat[i]),
            tasks.index(table["task"].iat[i]),
            policy_sort_key(table["policy"].iat[i]),
            budget_sort_key(table["budget"].iat[i]),
            str(table["query_mode"].iat[i]) if "query_mode" in table.columns else "",
        ),
    )
    return table.iloc[order].reset_index(drop=True)


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


def json_value(value: Any) -> Any:
    """A cell as JSON: missing values (NaN, None, pandas' NA) are null, numpy scalars plain numbers."""
    if isinstance(value, (list, dict)):
        return value
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


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
    rows = rows.assign(query_mode=_query_modes(rows), budget=_budget_and_decode(rows))
    configs = sorted(
        set(zip(rows["model"], rows["policy"], rows["budget"], rows["query_mode"])),
        key=lambda c: (c[0], policy_sort_key(c[1]), budget_sort_key(c[2].split(",")[0]), c[2], c[3]),
    )
    config_index = {config: i for i, config in enumerate(configs)}
    by_sample: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for row in rows.to_dict("records"):
        by_sample[(row["task"], row["sample_id"])].append(row)
    tasks = task_order(rows["task"].unique())
    samples = []
    for task, sample_id in sorted(by_sample, key=lambda key: tasks.index(key[0])):  # stable: run order within a task
        members = by_sample[(task, sample_id)]
        entries = sorted(
            (
                [
                    config_index[(r["model"], r["policy"], r["budget"], r["query_mode"])],
                    _string_or_empty(r.get("pred")),
                    _rounded(r.get("score"), 4),
                    _rounded(r.get("budget_tokens"), 1),
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


def _budget_and_decode(rows: pd.DataFrame) -> pd.Series:
    """A configuration's budget as the sample view names it: with its decode budget where the row had one."""
    if "decode_budget" not in rows.columns:
        return rows["budget"]
    return pd.Series(
        [b if d == "none" else f"{b}, decode {d}" for b, d in zip(rows["budget"], rows["decode_budget"])],
        index=rows.index,
    )


def sample_flags(members: list[dict]) -> dict[str, bool]:
    """Whether a sample's policies disagree (different predictions within one model and query mode) and whether
    one of them lost points against the full cache."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in members:
        groups[(row["model"], row.get("query_mode", DEFAULT_QUERY_MODE))].append(row)
    disagree = lost = False
    for group in groups.values():
        disagree |= len({_string_or_empty(r.get("pred")).strip() for r in group}) > 1
        scored = [r for r in group if _rounded(r.get("score"), 6) is not None]
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


def _rounded(value: Any, digits: int) -> float | None:
    value = json_value(value)
    return round(float(value), digits) if isinstance(value, (int, float)) else None


# --- figures ---------------------------------------------------------------------------------------------------------


def budget_axis(label: str) -> tuple[str, float]:
    """A budget's kind (each gets its own panels) and its value: entries per KV head, a fraction of the prompt kept,
    or kvpress's compression ratio (the fraction removed)."""
    label = str(label)
    if label.startswith("cr"):
        return "compression ratio", float(label[2:])
    if label == ALL:
        return "every entry", 1.0
    if label.startswith(MEMORY_PREFIX):
        memory = Budget.parse(label)
        return ("memory share", memory.value) if isinstance(memory.value, float) else ("memory bytes", memory.value)
    value = float(label)
    return ("entries per head", value) if value >= 1 else ("fraction of the prompt", value)


def _policy_scale(policies):
    domain = sorted(dict.fromkeys(policies), key=policy_sort_key)
    return alt.Scale(domain=domain, range=[policy_colour(i) for i in range(len(domain))])


def _figure(kind: str, title: str, caption: str, chart) -> dict[str, Any]:
    return {"kind": kind, "title": title, "caption": caption, "spec": chart.to_dict()}


def _mode_suffix(mode: str, several: bool) -> str:
    return f" · query-{mode}" if several else ""


def budget_panels(budgets, modes, several: bool) -> tuple[list[str], list[str]]:
    """Each point's panel label (``budget 64``, with the query mode when a run has several) and the labels in
    budget order."""
    pairs = list(zip(budgets, modes))
    label = {pair: f"budget {pair[0]}{_mode_suffix(pair[1], several)}" for pair in pairs}
    ordered = sorted(set(pairs), key=lambda pair: (budget_sort_key(pair[0]), pair[1]))
    return [label[pair] for pair in pairs], [label[pair] for pair in ordered]


def budget_curve_figures(summary: pd.DataFrame, rows: pd.DataFrame) -> list[dict]:
    """Per model, score vs budget (``summary``'s cells): a panel per task and budget kind, a line per policy, the
    full cache dashed (from the ``rows`` the summary was made of); whiskers for the interval when the summary has one
    (``ci_low``, ``ci_high``). Hover shows n and the interval."""
    interval = {"ci_low", "ci_high"} <= set(summary.columns)
    summary = with_decode_in_policy(summary)
    figures = []
    for model, table in summary.groupby("model", sort=False):
        modes = (
            table["query_mode"] if "query_mode" in table.columns else pd.Series(DEFAULT_QUERY_MODE, index=table.index)
        )
        several = modes.nunique() > 1
        points, panels = [], {}
        for row, mode in zip(table.to_dict("records"), modes):
            if is_full(row["policy"]):
                continue
            kind, value = budget_axis(row["budget"])
            panel = f"{row['task']} · {kind}{_mode_suffix(mode, several)}"
            panels.setdefault(panel, (row["task"], mode))
            points.append({**_point(row, interval), "panel": panel, "x": value, "series": row["policy"]})
        model_rows = rows[rows["model"] == model]
        for panel, (task, mode) in panels.items():
            reference = full_reference(model_rows, task, mode)
            if reference is not None:
                score, n = reference
                points.append(
                    {"panel": panel, "series": FULL_CACHE, "policy": FULL_CACHE, "score": round(score, 2), "n": n}
                )
        if not panels:
            continue
        chart = _curve_chart(points, list(panels), interval)
        figures.append(
            _figure(
                "curves",
                f"Score vs KV budget · {model_display_name(model)}",
                "Mean score × 100 per task; a line per policy, the full cache dashed. Hover a point for n"
                + (" and the interval; whiskers show it." if interval else ".")
                + " Click a policy in the legend to pick it out.",
                chart,
            )
        )
    return figures


def _point(row: dict, interval: bool) -> dict[str, Any]:
    point = {"policy": row["policy"], "budget": row["budget"], "score": json_value(row["score"]), "n": row["n"]}
    if interval:
        point.update(ci_low=json_value(row["ci_low"]), ci_high=json_value(row["ci_high"]))
    return point


def _curve_chart(points: list[dict], panels: list[str], interval: bool):
    budgets = sorted({p["budget"] for p in points if "budget" in p}, key=budget_sort_key)
    policies = [p["policy"] for p in points if p["series"] != FULL_CACHE]
    pick = alt.selection_point(fields=["policy"], bind="legend")
    base = alt.Chart(alt.Data(values=points))
    is_policy = f"datum.series !== '{FULL_CACHE}'"
    tooltip = [
        alt.Tooltip("policy:N"),
        alt.Tooltip("budget:N"),
        alt.Tooltip("score:Q", format=".2f"),
        alt.Tooltip("n:Q"),
    ]
    if interval:
        tooltip += [alt.Tooltip("ci_low:Q", format=".2f"), alt.Tooltip("ci_high:Q", format=".2f")]
    x = alt.X("budget:O", sort=budgets, title="KV budget", axis=alt.Axis(labelAngle=0))
    y = alt.Y("score:Q", scale=alt.Scale(domain=[0, 100]), title="score (× 100)")
    colour = alt.Color("policy:N", scale=_policy_scale(policies), title="policy")
    fade = alt.condition(pick, alt.value(1), alt.value(0.15))
    layers = [
        base.transform_filter(f"!({is_policy})")
        .mark_rule(strokeDash=[6, 4], color="black")
        .encode(y="score:Q", tooltip=[alt.Tooltip("policy:N"), alt.Tooltip("score:Q", format=".2f"), "n:Q"]),
        base.transform_filter(is_policy)
        .mark_line(point=alt.OverlayMarkDef(size=60, filled=True))
        .encode(x=x, y=y, color=colour, opacity=fade, tooltip=tooltip)
        .add_params(pick),
    ]
    if interval:
        layers.insert(
            1,
            base.transform_filter(is_policy)
            .mark_rule(strokeWidth=1.5)
            .encode(x=x, y="ci_low:Q", y2="ci_high:Q", color=colour, opacity=fade),
        )
    return (
        alt.layer(*layers, width=220, height=170)
        .facet(facet=alt.Facet("panel:N", sort=panels, title=None), columns=3)
        .resolve_scale(x="independent")
    )


def frontier_figures(points: pd.DataFrame) -> list[dict]:
    """Per model (and query mode): score (the mean over tasks) vs bytes on a log axis, a line per policy × bits
    through its budgets, whiskers for the interval, the Pareto front's points ringed."""
    figures = []
    groups = [c for c in ("model", "query_mode") if c in points.columns]
    for key, table in points.groupby(groups, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        records = [
            {
                "policy": row["policy"],
                "bits": str(row["kv_bits"]),
                "series": f"{row['policy']} · {row['kv_bits']} bits",
                "budget": row["budget"],
                "bytes": json_value(row["kv_bytes"]),
                "memory": json_value(row["memory"]),
                "score": json_value(row["avg"]),
                "ci_low": json_value(row["avg ci_low"]),
                "ci_high": json_value(row["avg ci_high"]),
                "front": row["front"] == "*",
                "n": int(row["n"]),
            }
            for row in table.to_dict("records")
            if row["kv_bytes"] == row["kv_bytes"] and row["avg"] == row["avg"]
        ]
        if not records:
            continue
        base = alt.Chart(alt.Data(values=records))
        x = alt.X("bytes:Q", scale=alt.Scale(type="log", nice=False, padding=16), title="KV cache bytes (log)")
        y = alt.Y("score:Q", scale=alt.Scale(domain=[0, 100]), title="score (× 100, mean over tasks)")
        colour = alt.Color("policy:N", scale=_policy_scale(r["policy"] for r in records), title="policy")
        dash = alt.StrokeDash("bits:N", sort=sorted({r["bits"] for r in records}, key=bits_sort_key), title="bits")
        tooltip = [
            "policy:N",
            "bits:N",
            "budget:N",
            alt.Tooltip("bytes:Q", format=",.0f"),
            alt.Tooltip("memory:Q", format=".2f", title="memory %"),
            alt.Tooltip("score:Q", format=".2f"),
            alt.Tooltip("ci_low:Q", format=".2f"),
            alt.Tooltip("ci_high:Q", format=".2f"),
            "n:Q",
        ]
        shape = alt.Shape("bits:N", sort=sorted({r["bits"] for r in records}, key=bits_sort_key), title="bits")
        chart = alt.layer(
            base.mark_rule(strokeWidth=1, opacity=0.5).encode(x=x, y="ci_low:Q", y2="ci_high:Q", color=colour),
            base.mark_line().encode(x=x, y=y, color=colour, strokeDash=dash, detail="series:N", order="bytes:Q"),
            base.mark_point(size=60, filled=True).encode(x=x, y=y, color=colour, shape=shape, tooltip=tooltip),
            base.transform_filter("datum.front")
            .mark_point(size=220, shape="circle", filled=False, strokeWidth=2, color="black")
            .encode(x=x, y=y, tooltip=tooltip),
            width=560,
            height=320,
        )
        where = " · ".join([model_display_name(key[0]), *(f"query-{m}" for m in key[1:])])
        figures.append(
            _figure(
                "frontier",
                f"Accuracy per byte · {where}",
                "Mean score over tasks × 100 against the mean bytes of the cells' caches (log axis); a line per policy "
                "× bits through its budgets (dashes and marks: bits), whiskers for the 95% interval, black rings on the Pareto "
                "front (no cell smaller and at least as good). Hover a point for its memory share and n.",
                chart,
            )
        )
    return figures


def needle_heatmap_figures(rows: pd.DataFrame) -> list[dict]:
    """Per model and needle-grid task: depth × length heatmaps (score 0–1), a row per budget, a column per policy."""
    grid = needle_rows(rows[rows["score"].notna()])
    if grid.empty:
        return []
    grid = grid.assign(query_mode=_query_modes(grid))
    several = grid["query_mode"].nunique() > 1
    figures = []
    for (model, task), per_task in grid.groupby(["model", "task"], sort=False):
        cells = needle_cells(per_task, ["policy", "budget", "query_mode"])
        cells["row"], row_order = budget_panels(cells["budget"], cells["query_mode"], several)
        cells["score"] = cells["score"].round(3)
        lengths, depths = sorted(cells["length"].unique()), sorted(cells["depth"].unique())
        records = [{k: json_value(v) for k, v in r.items()} for r in cells.to_dict("records")]
        base = alt.Chart(alt.Data(values=records + _not_run(records, lengths[0], depths[0])))
        base = base.encode(
            x=alt.X("length:O", sort=[json_value(v) for v in lengths], title="length", axis=alt.Axis(labelAngle=0)),
            y=alt.Y("depth:O", sort=[json_value(v) for v in depths], title="depth %"),
        )
        rect = base.mark_rect().encode(
            color=alt.Color(
                "score:Q", scale=alt.Scale(domain=[0, 0.5, 1], range=list(NEEDLE_COLOURS)), title="score (0–1)"
            ),
            tooltip=["policy:N", "budget:N", "length:O", "depth:O", alt.Tooltip("score:Q", format=".2f"), "n:Q"],
        )
        text = (
            base.transform_filter("datum.score !== null")
            .mark_text(fontSize=10)
            .encode(text=alt.Text("score:Q", format=".2f"))
        )
        chart = alt.layer(rect, text, width=max(120, 48 * len(lengths)), height=max(70, 24 * len(depths))).facet(
            row=alt.Row("row:N", sort=row_order, title=None),
            column=alt.Column("policy:N", sort=sorted(cells["policy"].unique(), key=policy_sort_key), title=None),
        )
        figures.append(
            _figure(
                "heatmap",
                f"{task} · {model_display_name(model)}: needle depth × context length",
                "Mean score (0–1) per cell of needle depth (% of the context) × context length (tokens), red → yellow "
                "→ green; a row per budget, a column per policy. Hover a cell for n.",
                chart,
            )
        )
    return figures


def _not_run(records: list[dict], length, depth) -> list[dict]:
    """A scoreless square for each budget row × policy that has no rows: Vega-Lite lays out a row × column facet
    with sorted headers wrongly when a combination is missing (cells shift under the wrong headers)."""
    present = {(r["row"], r["policy"]) for r in records}
    rows, policies = dict.fromkeys(r["row"] for r in records), dict.fromkeys(r["policy"] for r in records)
    return [
        {"row": row, "policy": policy, "length": json_value(length), "depth": json_value(depth), "score": None, "n": 0}
        for row in rows
        for policy in policies
        if (row, policy) not in present
    ]


def layer_budget_figures(rows: pd.DataFrame) -> list[dict]:
    """Per model: entries kept per layer (the rows' ``kv_kept``, mean over samples), a line per policy, a panel per
    budget. The full cache is left out: it keeps the whole prompt, which would flatten every other line."""
    if "kv_kept" not in rows.columns:
        return []
    recorded = rows["kv_kept"].map(lambda v: isinstance(v, list) and len(v) > 0)
    kept = rows[recorded & ~rows["policy"].map(is_full)]
    kept = kept.assign(query_mode=_query_modes(kept))
    several = kept["query_mode"].nunique() > 1
    figures = []
    for model, per_model in kept.groupby("model", sort=False):
        points = []
        for (policy, budget, mode), cell in per_model.groupby(["policy", "budget", "query_mode"], sort=False):
            layers = pd.DataFrame(cell["kv_kept"].tolist())  # a column per layer (rows of one model: same count)
            for layer, mean in layers.mean().items():
                points.append(
                    {
                        "policy": policy,
                        "budget": budget,
                        "mode": mode,
                        "layer": int(layer),
                        "kept": _rounded(mean, 1),
                        "n": int(layers[layer].notna().sum()),
                    }
                )
        labels, panels = budget_panels([p["budget"] for p in points], [p["mode"] for p in points], several)
        for point, label in zip(points, labels):
            point["panel"] = label
        chart = (
            alt.Chart(alt.Data(values=points), width=260, height=170)
            .mark_line(point=alt.OverlayMarkDef(size=25, filled=True))
            .encode(
                x=alt.X("layer:Q", title="layer (0 = bottom)", axis=alt.Axis(tickMinStep=1, format="d")),
                y=alt.Y("kept:Q", title="entries kept per KV head"),
                color=alt.Color("policy:N", scale=_policy_scale(p["policy"] for p in points), title="policy"),
                tooltip=["policy:N", "budget:N", "layer:Q", alt.Tooltip("kept:Q", format=".1f"), "n:Q"],
            )
            .facet(facet=alt.Facet("panel:N", sort=panels, title=None), columns=3)
        )
        figures.append(
            _figure(
                "layers",
                f"Entries kept per layer · {model_display_name(model)}",
                "Mean over samples of the entries each layer kept per KV head (the rows' kv_kept); the full cache, "
                "which keeps the whole prompt, is left out. Hover a point for the layer and n.",
                chart,
            )
        )
    return figures


def decode_memory_figures(rows: pd.DataFrame) -> list[dict]:
    """Per model and task, for one sample (the first with rows cut while decoding): the cache's entries (over layers
    and heads) as the answer is written, a line per policy, a panel per budget and decode budget, from the rows'
    ``kv_trace`` (the start, before and after each cut, the end: the cache grows one entry per head and layer per
    token in between, so straight lines join the points)."""
    if "kv_trace" not in rows.columns:
        return []
    traced = rows[rows["kv_trace"].map(lambda v: isinstance(v, list) and len(v) > 1)]
    figures = []
    for (model, task), per_task in traced.groupby(["model", "task"], sort=False):
        cut = per_task[per_task["decode_budget"] != "none"]
        if cut.empty:
            continue
        sample_id = cut["sample_id"].iloc[0]
        points = []
        for row in per_task[per_task["sample_id"] == sample_id].to_dict("records"):
            panel = f"budget {row['budget']} · decode {row['decode_budget']}"
            points += [
                {"policy": row["policy"], "panel": panel, "token": step, "entries": entries, "order": i}
                for i, (step, entries) in enumerate(row["kv_trace"])
            ]
        panels = sorted({p["panel"] for p in points}, key=lambda label: (len(label), label))
        chart = (
            alt.Chart(alt.Data(values=points), width=300, height=170)
            .mark_line(point=alt.OverlayMarkDef(size=12, filled=True))
            .encode(
                x=alt.X("token:Q", title="answer tokens written"),
                y=alt.Y("entries:Q", title="cache entries (all layers and heads)"),
                color=alt.Color("policy:N", scale=_policy_scale(p["policy"] for p in points), title="policy"),
                order="order:Q",
                tooltip=["policy:N", "panel:N", "token:Q", "entries:Q"],
            )
            .facet(facet=alt.Facet("panel:N", sort=panels, title=None), columns=3)
        )
        figures.append(
            _figure(
                "memory",
                f"Cache size while the answer is written · {task} · sample {sample_id} · {model_display_name(model)}",
                "Entries in the cache (summed over layers and KV heads) against the answer's tokens: each cut "
                "brings it back to the decode budget; the full cache grows by one entry per head and layer per token.",
                chart,
            )
        )
    return figures
