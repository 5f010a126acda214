"""Policies compared on the same samples: ``pkvbench diff`` and the report's "how many samples" section.

Every policy of a run answers the same samples, so two policies are compared *paired*: per sample, the score of A
minus the score of B. Per task × budget (× query mode) and over all tasks of a model (each task weighted equally,
resampled within itself), a comparison gives the mean difference in points, its 95% paired-bootstrap interval, a
sign-flip p-value, and Holm's adjustment over every comparison in the table. A says it beats B only when the
interval excludes 0 *and* the Holm-adjusted p is below 0.05: with dozens of pairs, some unadjusted intervals exclude 0
by chance.
"""

from __future__ import annotations

import itertools
import math

import pandas as pd

from pkvbench.errors import PkvError
from pkvbench.reports.axes import ROW_AXES
from pkvbench.reports.report import markdown_escape, row_axes
from pkvbench.reports.stats import ALPHA, holm, paired_difference, samples_needed

ALL_TASKS = "all tasks"  # the group row: every task of the model, each weighted equally
COLUMNS = [
    "model",
    "task",
    "budget",
    "policy_a",
    "policy_b",
    "n",
    "a",
    "b",
    "diff",
    "ci_low",
    "ci_high",
    "p",
    "p_holm",
    "verdict",
    "sd_diff",
]


def _pairs(ordered: list[str], against: str | None) -> list[tuple[str, str]]:
    """Pairs of ``ordered`` (policies in the axis's order)."""
    if against is not None:
        if against not in ordered:
            raise PkvError(f"--against {against}: no such policy in the rows ({', '.join(ordered)})")
        return [(p, against) for p in ordered if p != against]
    return list(itertools.combinations(ordered, 2))


def pairwise(rows: pd.DataFrame, policies: list[str] | None = None, against: str | None = None) -> pd.DataFrame:
    """Every pair of policies (or each against ``against``) at every budget, per task and over all tasks.

    ``diff``, its interval and ``sd_diff`` are in score points (× 100); ``verdict`` names the better policy only
    when the interval excludes 0 and ``p_holm`` < 0.05, else "no decision"."""
    if policies is not None:
        unknown = [p for p in policies if p not in set(rows["policy"])]
        if unknown:
            raise PkvError(f"--policy {unknown[0]}: not in the rows ({', '.join(sorted(set(rows['policy'])))})")
        rows = rows[rows["policy"].isin(policies)]
    key = row_axes(rows)  # model, policy, budget (, query_mode)
    cell = [c for c in key if c != "policy"]
    sample = ["task", "sample_id"]
    # samples by task name within a cell: the bootstrap resamples them in this order (the tasks' groups below)
    by_name = rows.assign(task=rows["task"].astype(str))
    wide = by_name.pivot_table(index=[*cell, *sample], columns="policy", values="score", aggfunc="first")
    out = []
    for where, block in wide.groupby(level=cell, sort=False):
        where = dict(zip(cell, where if isinstance(where, tuple) else (where,)))
        present = [p for p in block.columns if block[p].notna().any()]
        found = set(block.index.get_level_values("task"))
        tasks = [task for task in rows["task"].cat.categories if task in found]
        for first, second in _pairs(present, against):
            both = block[[first, second]].dropna()
            if both.empty:
                continue
            task_of = both.index.get_level_values("task")
            groups = [(t, both[task_of == t]) for t in tasks if (task_of == t).any()]
            if len(groups) > 1:
                groups.append((ALL_TASKS, both))
            for task, part in groups:
                strata = part.index.get_level_values("task") if task == ALL_TASKS else None
                result = paired_difference(part[first].to_numpy(), part[second].to_numpy(), strata)
                differences = part[first] - part[second]
                out.append(
                    {
                        **where,
                        "task": task,
                        "policy_a": first,
                        "policy_b": second,
                        "n": result.n,
                        "a": _points(part[first], strata),
                        "b": _points(part[second], strata),
                        "diff": result.mean * 100,
                        "ci_low": result.low * 100,
                        "ci_high": result.high * 100,
                        "p": result.p,
                        "sd_diff": float(differences.std(ddof=1)) * 100 if len(part) > 1 else math.nan,
                    }
                )
    table = pd.DataFrame(out, columns=[*cell, *(c for c in COLUMNS if c not in cell)])
    if table.empty:
        raise PkvError("nothing to compare: no two policies answered the same samples")
    table["p_holm"] = holm(table["p"])
    table["verdict"] = [_verdict(r) for r in table.to_dict("records")]
    points = ["a", "b", "diff", "ci_low", "ci_high", "sd_diff"]
    table[points] = table[points].astype(float).round(2) + 0.0  # + 0.0: no "-0.00"
    table[["p", "p_holm"]] = table[["p", "p_holm"]].astype(float).round(4)
    order = [c for c in ("model", *ROW_AXES) if c != "policy" and c in table.columns]
    tasks = pd.CategoricalDtype([*rows["task"].cat.categories, ALL_TASKS], ordered=True)  # the group after its tasks
    policies = dict.fromkeys(("policy_a", "policy_b"), rows["policy"].dtype)
    table = table.astype({**{c: rows[c].dtype for c in order if c != "model"}, "task": tasks, **policies})
    by_name = lambda column: column.astype(str) if column.name in policies else column  # noqa: E731
    return table.sort_values([*order, "task", "policy_a", "policy_b"], key=by_name, kind="stable").reset_index(
        drop=True
    )


def _points(scores: pd.Series, strata) -> float:
    """A policy's score on the compared samples, as the difference weighs them (mean of task means over a group)."""
    if strata is None:
        return float(scores.mean()) * 100
    return float(scores.groupby(strata).mean().mean()) * 100


def _verdict(row: dict) -> str:
    decided = row["ci_low"] > 0 or row["ci_high"] < 0
    if not decided or not row["p_holm"] < ALPHA:
        return "no decision"
    return f"{row['policy_a']} better" if row["diff"] > 0 else f"{row['policy_b']} better"


def power_table(comparisons: pd.DataFrame, effect: float, power: float = 0.8) -> pd.DataFrame:
    """From each comparison's spread of per-sample differences, the paired samples that would resolve a
    difference of ``effect`` points at ``ALPHA`` (two-sided) with ``power``, beside the n the run has."""
    if not effect > 0 or not math.isfinite(effect):
        raise PkvError(f"--power {effect}: give the difference to resolve, in points (a positive number, e.g. 5)")
    table = comparisons[[c for c in comparisons.columns if c not in ("p", "p_holm", "verdict", "a", "b")]].copy()
    table[f"n_for_{effect:g}_points"] = [samples_needed(sd, effect, ALPHA, power) for sd in table["sd_diff"]]
    return table


def _entry(diff: float, low: float, high: float, mark: str) -> str:
    diff, low, high = (round(x, 2) + 0.0 for x in (diff, low, high))  # + 0.0: a negated 0 prints as 0.00
    return f"{diff:+.2f} [{low:.2f}, {high:.2f}]{mark}"


def matrix_markdown(comparisons: pd.DataFrame) -> str:
    """One matrix per model × budget (× query mode) × task: row policy minus column policy, ``+5.00 [1.2, 9.3]``,
    with ``*`` where the verdict is decided."""
    cell = [c for c in ("model", *ROW_AXES, "task") if c != "policy" and c in comparisons.columns]
    blocks = []
    for where, block in comparisons.groupby(cell, sort=False):
        title = " · ".join(f"{k} {v}" for k, v in zip(cell, where))
        named = set(block["policy_a"]) | set(block["policy_b"])
        policies = [p for p in block["policy_a"].cat.categories if p in named]
        grid = pd.DataFrame("", index=policies, columns=policies)
        for r in block.to_dict("records"):
            mark = " *" if r["verdict"] != "no decision" else ""
            grid.loc[r["policy_a"], r["policy_b"]] = _entry(r["diff"], r["ci_low"], r["ci_high"], mark)
            grid.loc[r["policy_b"], r["policy_a"]] = _entry(-r["diff"], -r["ci_high"], -r["ci_low"], mark)
        lines = [f"**{title}** (n = {int(block['n'].max())}; row − column, points)", ""]
        names = {p: markdown_escape(p) for p in policies}
        lines.append("| | " + " | ".join(names.values()) + " |")
        lines.append("|---|" + "---:|" * len(policies))
        lines += [f"| {names[p]} | " + " | ".join(grid.loc[p, q] or "·" for q in policies) + " |" for p in policies]
        blocks.append("\n".join(lines))
    tested = len(comparisons)
    note = (
        f"{tested} comparisons; * marks a decided one: its 95% interval excludes 0 and its Holm-adjusted p "
        f"(over all {tested}) is below {ALPHA}."
    )
    return "\n\n".join(blocks) + "\n\n" + note + "\n"
