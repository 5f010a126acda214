"""The numbers behind the figures, computed once for both renderers: ``plots.py`` draws them as PNG files
(matplotlib), ``html_figures.py`` as Vega-Lite specs (altair) for the HTML page. The colours live here too, so that a policy has one
colour, and a needle score one shade, in every figure, and the HTML page needs no plotting library to know them.
"""

from __future__ import annotations

import pandas as pd

from pkvbench.cell.schema import DEFAULT_QUERY_MODE
from pkvbench.reports.axes import KEY, full_rows, present
from pkvbench.reports.stats import group_interval, mean_interval

# seaborn's "colorblind" palette, written out: a policy's colour is the same on a PNG and on the HTML page.
POLICY_COLOURS = (
    "#0173b2",
    "#de8f05",
    "#029e73",
    "#d55e00",
    "#cc78bc",
    "#ca9161",
    "#fbafe4",
    "#949494",
    "#ece133",
    "#56b4e9",
)
# Red → yellow → green at scores 0, 0.5 and 1: the colours of Kamradt's needle plots that the paper reuses.
NEEDLE_COLOURS = ("#F0496E", "#EBB839", "#0CD79F")


def policy_colour(index: int) -> str:
    return POLICY_COLOURS[index % len(POLICY_COLOURS)]


# --- needle grids ----------------------------------------------------------------------------------------------------


def needle_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of tasks laid out on a length × depth grid (the needle task)."""
    if not {"length", "depth"} <= set(rows.columns):
        return rows.iloc[0:0]
    grid = rows[rows["length"].notna() & rows["depth"].notna()]
    # A task is a grid task only if all of its rows carry a depth (LongBench rows carry a length, never a depth).
    tasks = [t for t, g in rows.groupby("task") if g["depth"].notna().all()]
    return grid[grid["task"].isin(tasks)].copy()


def needle_cells(rows: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """One square per ``by`` × depth × length of a needle grid: its mean ``score`` (0–1) and sample count ``n``."""
    return rows.groupby([*by, "depth", "length"], sort=False)["score"].agg(score="mean", n="count").reset_index()


# --- score-vs-budget curves ------------------------------------------------------------------------------------------


def curve_table(rows: pd.DataFrame, by: tuple[str, ...] = tuple(KEY), average: bool = True):
    """The curves' points: ``by`` (model first), task, n, score (× 100) with its 95% interval (ci_low, ci_high),
    one point per cell, in the rows' order; with ``average`` also task ``avg`` (mean over the model's tasks, only
    where every task has the cell; resampled within tasks). ``policy`` is what a line stands for: give the rows'
    ``series`` (the policy with its bits and decode budget, ``axes.order_axes``) as ``policy`` to draw those apart."""
    axes = list(by)
    points = []
    for _, per_model in rows.groupby("model", sort=False):
        tasks = list(per_model["task"].unique())
        for key, cell in per_model.groupby(axes, sort=False):
            by_task = {task: part["score"] for task, part in cell.groupby("task", sort=False)}
            for task, scores in by_task.items():
                low, high = mean_interval(scores)
                points.append([*key, task, int(scores.count()), scores.mean() * 100, low * 100, high * 100])
            if average and len(tasks) > 1 and len(by_task) == len(tasks):
                low, high = group_interval(list(by_task.values()))
                mean = sum(s.mean() for s in by_task.values()) / len(by_task)
                count = sum(int(s.count()) for s in by_task.values())
                points.append([*key, "avg", count, mean * 100, low * 100, high * 100])
    table = pd.DataFrame(points, columns=[*axes, "task", "n", "score", "ci_low", "ci_high"])
    # the axes keep their order (report.load_runs: ordered categoricals); ``avg`` after the tasks
    orders = {c: rows[c].dtype for c in [*axes, "task"] if isinstance(rows[c].dtype, pd.CategoricalDtype)}
    if "task" in orders:
        orders["task"] = pd.CategoricalDtype([*orders["task"].categories, "avg"], ordered=True)
    return table.astype(orders)


# --- the full cache's reference line ---------------------------------------------------------------------------------


def full_reference(rows: pd.DataFrame, task: str, query_mode: str | None = None) -> tuple[float, int] | None:
    """The full cache's score × 100 and its sample count on ``task`` among one model's ``rows`` (``avg``: the mean
    over the tasks the rows have, each of which must have the full cache), in ``query_mode`` only if given.

    The full cache keeps every entry whatever the budget, so a sample run at several budgets counts once. Where the
    caches were stored at several widths (``kv_bits``), the reference is the widest: a full cache at 2 bits is
    KIVI, a compressed point of its own."""
    full = rows[full_rows(rows["policy"])]
    if "query_mode" in full.columns:
        if query_mode is None and full["query_mode"].nunique() > 1:
            query_mode = DEFAULT_QUERY_MODE
        if query_mode is not None:
            full = full[full["query_mode"] == query_mode]
    if "kv_bits" in full.columns and full["kv_bits"].nunique() > 1:
        widest = present(full["kv_bits"])[0]
        full = full[full["kv_bits"] == widest]
    tasks = list(rows["task"].unique()) if task == "avg" else [task]
    per_task = [full[full["task"] == t].drop_duplicates("sample_id")["score"] for t in tasks]
    if not per_task or any(scores.empty for scores in per_task):
        return None
    score = sum(scores.mean() for scores in per_task) / len(per_task) * 100
    return float(score), max(len(scores) for scores in per_task)
