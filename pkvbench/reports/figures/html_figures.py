"""The HTML page's figures (``pkvbench report --html``): Vega-Lite specs built with altair, the twin of ``plots.py``
(the PNG files). Both draw the numbers ``figure_data.py`` computes once: the budget curves' points
(``curve_table``), the needle grids' squares, the full cache's reference line, the colours.

Each function returns the page's figures as ``{"kind", "title", "caption", "spec"}``; ``html_report.py`` lays
them out with the tables and the samples.
"""

from __future__ import annotations

import math
from typing import Any

import altair as alt
import pandas as pd

from pkvbench.cell.schema import DEFAULT_QUERY_MODE
from pkvbench.reports.axes import (
    LABELLED,
    LINE_KEY,
    SERIES,
    budget_point,
    cell_label,
    full_rows,
    is_full,
    present,
)
from pkvbench.reports.figures.figure_data import (
    NEEDLE_COLOURS,
    curve_table,
    full_reference,
    needle_cells,
    needle_rows,
    policy_colour,
)
from pkvbench.reports.report import model_display_name

FULL_CACHE = "full cache"  # the reference line of the curves


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


def rounded(value: Any, digits: int) -> float | None:
    value = json_value(value)
    return round(float(value), digits) if isinstance(value, (int, float)) else None


def query_modes(rows: pd.DataFrame) -> pd.Series:
    if "query_mode" not in rows.columns:
        return pd.Series(DEFAULT_QUERY_MODE, index=rows.index)
    return rows["query_mode"].fillna(DEFAULT_QUERY_MODE)


def _policy_scale(policies: pd.Series, drawn=None):
    """A colour per policy, in the axis's order (``policies``: an ordered categorical), of those ``drawn``."""
    drawn = set(policies.astype(str) if drawn is None else drawn)
    domain = [p for p in present(policies) if p in drawn]
    return alt.Scale(domain=domain, range=[policy_colour(i) for i in range(len(domain))])


def _figure(kind: str, title: str, caption: str, chart) -> dict[str, Any]:
    return {"kind": kind, "title": title, "caption": caption, "spec": chart.to_dict()}


def _mode_suffix(mode: str, several: bool) -> str:
    return f" · query-{mode}" if several else ""


def budget_panels(budgets: pd.Series, modes: pd.Series, several: bool) -> tuple[list[str], list[str]]:
    """Each point's panel label (``budget 64``, with the query mode when a run has several) and the labels in
    budget order (``budgets``, ``modes``: the axes' ordered categoricals)."""
    pairs = pd.DataFrame({"budget": budgets.reset_index(drop=True), "mode": modes.reset_index(drop=True)})
    labels = [f"budget {b}{_mode_suffix(m, several)}" for b, m in zip(pairs["budget"], pairs["mode"])]
    ordered = pairs.assign(label=labels).sort_values(["budget", "mode"], kind="stable")["label"]
    return labels, list(dict.fromkeys(ordered))


def curve_points(rows: pd.DataFrame) -> pd.DataFrame:
    """The curves' points (``figure_data.curve_table``) as the page draws them: a line per policy with its bits and
    decode budget, per query mode, two decimals, in the report's order."""
    points = curve_table(rows.assign(policy=rows[SERIES]), by=tuple(LINE_KEY), average=False)
    points[["score", "ci_low", "ci_high"]] = points[["score", "ci_low", "ci_high"]].round(2)
    models = {model: rank for rank, model in enumerate(dict.fromkeys(rows["model"]))}
    ordered = points.assign(rank=points["model"].map(models))
    ordered = ordered.sort_values(["rank", "task", *LINE_KEY[1:]], kind="stable")
    return ordered.drop(columns="rank").reset_index(drop=True)


def budget_curve_figures(points: pd.DataFrame, rows: pd.DataFrame) -> list[dict]:
    """Per model, score vs budget (``points``: ``curve_points``): a panel per task and budget kind, a line per
    policy, the full cache dashed (from the ``rows`` the points were made of); whiskers for the interval when the
    points have one (``ci_low``, ``ci_high``). Hover shows n and the interval."""
    interval = {"ci_low", "ci_high"} <= set(points.columns)
    figures = []
    for model, table in points.groupby("model", sort=False):
        modes = (
            table["query_mode"] if "query_mode" in table.columns else pd.Series(DEFAULT_QUERY_MODE, index=table.index)
        )
        several = modes.nunique() > 1
        points, panels = [], {}
        for row, mode in zip(table.to_dict("records"), modes):
            if is_full(row["policy"]):
                continue
            kind, value = budget_point(str(row["budget"]))  # each kind its own panels
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
        chart = _curve_chart(points, list(panels), interval, table[~full_rows(table["policy"])])
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


def _curve_chart(points: list[dict], panels: list[str], interval: bool, drawn: pd.DataFrame):
    """``drawn``: the points' rows, whose axes give the order of the budgets and the policies' colours."""
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
    x = alt.X("budget:O", sort=present(drawn["budget"]), title="KV budget", axis=alt.Axis(labelAngle=0))
    y = alt.Y("score:Q", scale=alt.Scale(domain=[0, 100]), title="score (× 100)")
    colour = alt.Color("policy:N", scale=_policy_scale(drawn["policy"]), title="policy")
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
                "series": cell_label(row),
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
        drawn = table[table["kv_bytes"].notna() & table["avg"].notna()]
        colour = alt.Color("policy:N", scale=_policy_scale(drawn["policy"]), title="policy")
        bits = [str(b) for b in present(drawn["kv_bits"])]
        dash = alt.StrokeDash("bits:N", sort=bits, title="bits")
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
        shape = alt.Shape("bits:N", sort=bits, title="bits")
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
    grid = grid.assign(query_mode=query_modes(grid))
    several = grid["query_mode"].nunique() > 1
    figures = []
    for (model, task), per_task in grid.groupby(["model", "task"], sort=False):
        cells = needle_cells(per_task, LINE_KEY[1:])
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
            column=alt.Column("policy:N", sort=present(cells["policy"]), title=None),
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
    kept = rows[recorded & ~full_rows(rows["policy"])]
    kept = kept.assign(query_mode=query_modes(kept))
    several = kept["query_mode"].nunique() > 1
    figures = []
    for model, per_model in kept.groupby("model", sort=False):
        points = []
        for (policy, budget, mode), cell in per_model.groupby(LINE_KEY[1:], sort=False):
            layers = pd.DataFrame(cell["kv_kept"].tolist())  # a column per layer (rows of one model: same count)
            for layer, mean in layers.mean().items():
                points.append(
                    {
                        "policy": policy,
                        "budget": budget,
                        "mode": mode,
                        "layer": int(layer),
                        "kept": rounded(mean, 1),
                        "n": int(layers[layer].notna().sum()),
                    }
                )
        budgets = pd.Series([p["budget"] for p in points], dtype=per_model["budget"].dtype)
        labels, panels = budget_panels(
            budgets, pd.Series([p["mode"] for p in points], dtype=per_model["query_mode"].dtype), several
        )
        for point, label in zip(points, labels):
            point["panel"] = label
        chart = (
            alt.Chart(alt.Data(values=points), width=260, height=170)
            .mark_line(point=alt.OverlayMarkDef(size=25, filled=True))
            .encode(
                x=alt.X("layer:Q", title="layer (0 = bottom)", axis=alt.Axis(tickMinStep=1, format="d")),
                y=alt.Y("kept:Q", title="entries kept per KV head"),
                color=alt.Color("policy:N", scale=_policy_scale(per_model["policy"]), title="policy"),
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
            panel = f"budget {row['budget']} · {LABELLED['decode_budget'].words(str(row['decode_budget']))}"
            points += [
                {"policy": row["policy"], "panel": panel, "token": step, "entries": entries, "order": i}
                for i, (step, entries) in enumerate(row["kv_trace"])
            ]
        panels = sorted({p["panel"] for p in points}, key=lambda label: (len(label), label))
        drawn = {p["policy"] for p in points}
        chart = (
            alt.Chart(alt.Data(values=points), width=300, height=170)
            .mark_line(point=alt.OverlayMarkDef(size=12, filled=True))
            .encode(
                x=alt.X("token:Q", title="answer tokens written"),
                y=alt.Y("entries:Q", title="cache entries (all layers and heads)"),
                color=alt.Color("policy:N", scale=_policy_scale(per_task["policy"], drawn), title="policy"),
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
