"""Accuracy per byte: the frontier between dropping entries and spending fewer bits on each (docs/memory.md).

Every cell of a run (policy × storage bits × budget) is a point: the bytes its caches took (``kv_bytes``, a mean
over samples; ``memory``: as a share of the full cache at 16 bits per value) against its score with its 95%
interval (``report.report_table``: per task and ``avg``, the mean over tasks). A point is on the Pareto front when
no other point of its model (and query mode) is at most as large and scores at least as well, one of them strictly.

Per memory target (``--memory``), every cell that fits it — the target's own cells, and a full cache stored in so
few bits that every one of its caches fits the target's bytes — is compared with the best of them on the same
samples (``paired.pairwise``: paired-bootstrap interval, sign-flip p, Holm over all the comparisons shown), so
"4-bit SnapKV beats 16-bit SnapKV at 5%" is either decided or "no decision".
"""

from __future__ import annotations

import math

import pandas as pd

from pkvbench.cell.schema import AWARE, SAMPLE_KEY
from pkvbench.reports.axes import MEMORY_KINDS, budget_kind, cell_label, of_kind, present
from pkvbench.reports.paired import ALL_TASKS, pairwise
from pkvbench.reports.report import report_table, row_axes, stores_formats

TARGET = "target"  # the memory target a comparison is made at
CELL = ["policy", "kv_bits", "budget"]  # a stored cell: what its bytes depend on (not the question or the turns)


def has_frontier(rows: pd.DataFrame) -> bool:
    """Whether the rows span storage formats or memory budgets: the view has something to show."""
    return "kv_bytes" in rows.columns and (stores_formats(rows) or of_kind(rows["budget"], *MEMORY_KINDS).any())


def _with_bits(rows: pd.DataFrame) -> pd.DataFrame:
    return rows if "kv_bits" in rows.columns else rows.assign(kv_bits="native")


def points(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per cell: ``report_table``'s scores and intervals, with ``kv_bytes`` (mean over its rows),
    ``memory`` (the mean share of the full cache at 16 bits, in percent), ``entries`` (mean entries kept per head
    and layer), ``attention`` (the attention weights the policy needs: none, window, all, repeat pass) and
    ``front`` ("*" on the Pareto front of its model and query mode, by ``avg``)."""
    rows = _with_bits(rows)
    axes = [c for c in row_axes(rows) if c not in CELL] + CELL
    table = report_table(rows, intervals=True)
    if "kv_bits" not in table.columns:
        table.insert(table.columns.get_loc("budget"), "kv_bits", rows["kv_bits"].iloc[0])
    measured = rows.groupby(axes, sort=False).agg(
        kv_bytes=("kv_bytes", "mean"),
        memory=("memory_fraction", "mean") if "memory_fraction" in rows.columns else ("kv_bytes", lambda s: math.nan),
        entries=("budget_tokens", "mean") if "budget_tokens" in rows.columns else ("kv_bytes", lambda s: math.nan),
    )
    table = table.join(measured, on=axes)
    table["memory"] = (table["memory"] * 100).round(2)
    table["kv_bytes"] = table["kv_bytes"].round(0).astype("Int64")
    table["entries"] = table["entries"].round(1)
    if "attention_weights" in rows.columns:  # a cost of its own: what kernels without attention weights cannot run
        needs = rows.dropna(subset=["attention_weights"]).groupby("policy")["attention_weights"].first()
        table["attention"] = table["policy"].astype(str).map(needs).fillna("")  # a str map: never a categorical
    groups = [c for c in ("model", "query_mode") if c in table.columns]
    table["front"] = ""
    for _, group in table.groupby(groups, sort=False):
        for index in _pareto(group["kv_bytes"], group["avg"]):
            table.loc[index, "front"] = "*"
    return table


def storage(rows: pd.DataFrame) -> pd.DataFrame:
    """``--view memory``: one row per storage format (``kv_bits``) × budget, over its policies and samples: the
    entries it kept (mean per KV head and layer), the bytes as stored (``kv_bytes``, mean; ``memory``: % of the full
    cache at 16 bits), ``bytes/entry`` (a head's key and value with their share of scales, norms, codebooks and
    padding) and the target a memory budget allowed (mean bytes)."""
    rows = _with_bits(rows)
    keys = [c for c in ("model", "query_mode") if c in rows.columns and rows[c].nunique() > 1] + ["kv_bits", "budget"]
    columns = {
        "policies": ("policy", "nunique"),
        "n": ("score", "size"),
        "entries": ("budget_tokens", "mean"),
        "kv_bytes": ("kv_bytes", "mean"),
        "memory": ("memory_fraction", "mean"),
        "bytes/entry": ("_per_entry", "mean"),
        "target": ("memory_target", "mean"),
    }
    rows = rows.assign(_per_entry=rows["kv_bytes"] / rows["kv_entries"]) if "kv_entries" in rows.columns else rows
    present_columns = {name: spec for name, spec in columns.items() if spec[0] in rows.columns}
    # the axes are ordered categoricals (report.load_runs): grouped, they come in the axes' order
    table = rows.groupby(keys, sort=True, observed=True).agg(**present_columns).reset_index()
    if "memory" in table.columns:
        table["memory"] = (table["memory"] * 100).round(2)
    for name in ("entries", "bytes/entry"):
        if name in table.columns:
            table[name] = table[name].round(1)
    for name in ("kv_bytes", "target"):
        if name in table.columns:
            table[name] = table[name].round(0).astype("Int64")
    return table


def _pareto(size: pd.Series, score: pd.Series) -> list:
    """Indices of the points that no other point beats: at most as large, at least as good, one of them strictly."""
    front = []
    for index in size.index:
        if pd.isna(score[index]) or pd.isna(size[index]):
            continue
        beaten = (
            (size <= size[index])
            & (score >= score[index])
            & ((size < size[index]) | (score > score[index]))
            & score.notna()
        )
        if not beaten.any():
            front.append(index)
    return front


def target_groups(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows each memory target compares, relabelled for ``paired.pairwise``: ``policy`` is "policy · bits
    bits" and ``budget`` the target. A target's own rows, and every other cell (a full cache) whose rows all fit
    the target's bytes on their samples."""
    rows = _with_bits(rows)
    if "memory_target" not in rows.columns:
        return rows.iloc[:0]
    targets = [b for b in present(rows["budget"]) if budget_kind(b) in MEMORY_KINDS]
    sample = [name for name in SAMPLE_KEY if name in rows.columns]  # rows of old versions have no query mode
    parts = []
    for target in targets:
        own = rows[rows["budget"] == target]
        limit = own.groupby(sample)["memory_target"].min().rename("limit")
        parts.append(own)
        others = rows[~of_kind(rows["budget"], *MEMORY_KINDS)]
        for _, cell in others.groupby(CELL, sort=False):
            bound = cell.join(limit, on=sample)["limit"]
            if bound.notna().all() and (cell["kv_bytes"] <= bound).all():
                parts.append(cell.assign(budget=target))
    if not parts:
        return rows.iloc[:0]
    merged = pd.concat(parts, ignore_index=True).astype({"budget": rows["budget"].dtype})
    # each policy × bits a policy of its own, in the policies' order, then the widest first
    cells = merged[["policy", "kv_bits"]].drop_duplicates().sort_values(["policy", "kv_bits"])
    labels = [cell_label({"policy": p, "kv_bits": b}) for p, b in zip(merged["policy"], merged["kv_bits"])]
    order = [cell_label({"policy": p, "kv_bits": b}) for p, b in cells.itertuples(index=False)]
    labelled = merged.assign(policy=pd.Categorical(labels, categories=order, ordered=True))
    return labelled.drop(columns=[c for c in ("kv_bits", "kv_stored") if c in labelled.columns])


def comparisons(rows: pd.DataFrame) -> pd.DataFrame:
    """Per memory target, its best cell (highest mean over tasks) against every other cell that fits it, paired,
    per task and over all tasks; Holm over every comparison of the table."""
    grouped = target_groups(rows)
    if grouped.empty:
        return pd.DataFrame()
    modes = ["query_mode"] if "query_mode" in grouped.columns and (grouped["query_mode"] != AWARE).any() else []
    tables = []
    for _, block in grouped.groupby(["model", "budget", *modes], sort=False):  # targets come smallest first
        means = block.groupby(["policy", "task"])["score"].mean().groupby("policy").mean()
        if len(means) < 2:
            continue
        size = block.groupby("policy")["kv_bytes"].mean()
        best = min(means.index, key=lambda cell: (-means[cell], size[cell]))  # a tie goes to the smaller cache
        table = pairwise(block, against=best)
        table["_order"] = [-means[cell] for cell in table["policy_a"]]
        tables.append(table)
    if not tables:
        return pd.DataFrame()
    # One family for Holm: every comparison the view shows.
    from pkvbench.reports.stats import holm

    table = pd.concat(tables, ignore_index=True)
    table["p_holm"] = holm(table["p"]).round(4)
    table["verdict"] = [_verdict(r) for r in table.to_dict("records")]
    # each target (smallest first) in one block, its cells best first, each cell's tasks in the order pairwise gave
    block = {key: i for i, key in enumerate(dict.fromkeys(zip(table["model"], table["budget"])))}
    rank = sorted(
        range(len(table)),
        key=lambda i: (block[table["model"].iat[i], table["budget"].iat[i]], table["_order"].iat[i], i),
    )
    table = table.iloc[rank].drop(columns="_order")
    return table.rename(columns={"budget": TARGET, "policy_a": "cell", "policy_b": "best"}).reset_index(drop=True)


def _verdict(row: dict) -> str:
    from pkvbench.reports.stats import ALPHA

    decided = (row["ci_low"] > 0 or row["ci_high"] < 0) and row["p_holm"] < ALPHA
    if not decided:
        return "no decision"
    return f"{row['policy_a']} better" if row["diff"] > 0 else f"{row['policy_b']} better"


def frontier_markdown(rows: pd.DataFrame) -> str:
    """The view as ``pkvbench report`` prints it: the points (Pareto front marked), then each memory target's
    comparisons with its best cell over all tasks (or the one task)."""
    from pkvbench.reports.report import to_markdown

    table = points(rows)
    tasks = present(rows["task"])
    lines = [
        "## Accuracy per byte",
        "",
        "Each cell's mean bytes (`kv_bytes`; `memory`: % of the full cache at 16 bits per value), its scores with "
        "95% intervals, and `*` on the Pareto front (no cell smaller and at least as good).",
        "",
        to_markdown(table).rstrip(),
    ]
    compared = comparisons(rows)
    if not compared.empty:
        group = ALL_TASKS if len(tasks) > 1 else tasks[0]
        shown = compared[compared["task"] == group]
        columns = [c for c in ("model", TARGET, "query_mode") if c in shown.columns]
        shown = shown[[*columns, "best", "cell", "n", "b", "a", "diff", "ci_low", "ci_high", "p_holm", "verdict"]]
        shown = shown.rename(columns={"a": "cell score", "b": "best score", "diff": "cell − best"})
        lines += [
            "",
            f"Per memory target, its best cell against each other cell that fits it ({group}; paired on the same "
            "samples, 95% interval, Holm over every comparison; the full cache counts where all its caches fit):",
            "",
            to_markdown(shown).rstrip(),
        ]
    return "\n".join(lines) + "\n"
