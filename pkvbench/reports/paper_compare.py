"""A run beside the PyramidKV paper's Table 1 (``pkvbench compare``): the reference table, and the comparison in
three steps: ``match`` finds the run's samples in cells the paper has too, ``comparison_rows`` puts each cell's
measured score beside the paper's, ``statements`` says what a reader must know before reading the deltas.

Scores are the report's (``report``): the mean of the sample scores × 100, rounded to two decimals for display.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from pkvbench.config import option_text
from pkvbench.errors import PkvError
from pkvbench.reports.axes import KEY, present, task_order
from pkvbench.reports.choices import PAPER_REFERENCE
from pkvbench.reports.report import Runs, model_display_name
from pkvbench.reports.stats import group_interval, mean_interval

REFERENCE_PACKAGE = "pkvbench.reference_tables"  # the project's results/reference/, installed as package data
REFERENCES = {PAPER_REFERENCE: "pyramidkv_table1.csv"}
# What the paper's policies are in pkvbench's terms (arXiv 2406.02069, Table 1; the PyramidKV code's defaults).
PAPER_POLICY_OPTIONS = {
    "full": {},
    "streamingllm": {},
    "h2o": {"window": 8, "scores": "window"},
    "snapkv": {"window": 8, "kernel": 7, "pooling": "max"},
    "pyramidkv": {"window": 8, "kernel": 7, "pooling": "max", "beta": 20.0},
}
# Run model names (aliases, Hugging Face ids) that are the paper's models.
PAPER_MODELS = {
    "meta-llama/Meta-Llama-3-8B-Instruct": "Llama-3-8B-Instruct",
    "mistralai/Mistral-7B-Instruct-v0.2": "Mistral-7B-Instruct",
}
COMPARISON_COLUMNS = [
    "model",
    "paper_model",
    "policy",
    "budget",
    "task",
    "measured",
    "ci_low",
    "ci_high",
    "paper",
    "delta",
    "paper_in_ci",
    "n",
]


# --- the reference table ---------------------------------------------------------------------------------------------


@dataclass
class Reference:
    """A reference table: per-task scores, the printed averages, and the models it covers."""

    name: str
    scores: pd.DataFrame  # model, policy, budget, task, score (tasks only)
    printed_average: pd.DataFrame  # model, policy, budget, average

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(self.scores["model"]))

    def row_means(self) -> pd.DataFrame:
        """model, policy, budget, row_mean (the mean of the row's task scores, unrounded), average (printed)."""
        means = self.scores.groupby(KEY, sort=False)["score"].mean().rename("row_mean").reset_index()
        return means.merge(self.printed_average, on=KEY, how="left")

    def average_mismatches(self, tolerance: float = 0.01) -> pd.DataFrame:
        """Rows whose printed average is not the mean of their task scores up to rounding or truncation to two
        decimals (the paper's four Mistral rows; two Llama-3 H2O averages are truncated, e.g. 35.379 → 35.37)."""
        means = self.row_means()
        return means[(means["average"] - means["row_mean"]).abs() > tolerance].reset_index(drop=True)


def load_reference(name_or_path: str) -> Reference:
    if name_or_path in REFERENCES:
        path = importlib.resources.files(REFERENCE_PACKAGE).joinpath(REFERENCES[name_or_path])
    elif Path(name_or_path).is_file():
        path = Path(name_or_path)
    else:
        raise PkvError(f"unknown reference {name_or_path!r}; valid references: {', '.join(REFERENCES)} (or a CSV file)")
    try:
        frame = pd.read_csv(path, dtype={"budget": str}, comment="#")
    except (OSError, ValueError) as exc:
        raise PkvError(f"{path}: cannot read the reference table ({exc})") from None
    expected = {"model", "policy", "budget", "task", "score"}
    if not expected <= set(frame.columns):
        raise PkvError(f"{path}: a reference table needs the columns {', '.join(sorted(expected))}")
    frame["score"] = frame["score"].astype(float)
    is_avg = frame["task"] == "average"
    printed = frame[is_avg].rename(columns={"score": "average"}).drop(columns="task")[[*KEY, "average"]]
    return Reference(
        name_or_path, frame[~is_avg][[*KEY, "task", "score"]].reset_index(drop=True), printed.reset_index(drop=True)
    )


# --- the comparison --------------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    table: pd.DataFrame  # COMPARISON_COLUMNS: one row per task and cell, an average row per cell
    statements: list[str]  # to print before the table


def compare(runs: Runs, reference: Reference, paper_model: str | None = None) -> Comparison:
    """Measured vs paper for the cells both have: the run's policies matched by name (options that differ from the
    paper's are stated), token budgets matched exactly, ``full`` at any budget matched with the paper's full cache.
    Per model × policy × budget an ``average`` row compares the means over the tasks in common (so a partial run is
    compared with the paper's mean over the same tasks, not with its 16-task average)."""
    samples = match(runs.rows, reference, paper_model)
    table = comparison_rows(samples, reference)
    return Comparison(table, statements(samples, reference, paper_model, table))


FULL_BUDGET = "full"  # a full-cache row's budget in the comparison: the same at every budget


# --- match: the run's samples in the paper's cells -------------------------------------------------------------------


def match(rows: pd.DataFrame, reference: Reference, paper_model: str | None) -> pd.DataFrame:
    """The run's sample rows in cells ``reference`` has too, each with the cell it is compared with:
    ``paper_model`` and ``paper_policy`` (the policy's name without its options); a full-cache row's budget is
    ``full``, whatever budget it ran at. Refuses a run with nothing in common with the reference."""
    ref_tasks = set(reference.scores["task"])
    common_tasks = [t for t in present(rows["task"]) if t in ref_tasks]
    if not common_tasks:
        others = [
            model_display_name(m) for m in rows["model"].unique() if m not in PAPER_MODELS and m not in reference.models
        ]
        raise PkvError(
            f"nothing to compare: the run's tasks ({', '.join(present(rows['task']))}) are not in "
            f"{reference.name} ({', '.join(task_order(ref_tasks))})"
            + (f"; and the run's model ({', '.join(others)}) is not the paper's" if others else "")
        )
    if paper_model is not None and paper_model not in reference.models:
        raise PkvError(f"unknown paper model {paper_model!r}; {reference.name} has {', '.join(reference.models)}")
    rows = rows[rows["task"].isin(common_tasks)].copy()
    rows["paper_policy"] = [p.split(":")[0] for p in rows["policy"]]
    rows = rows[rows["paper_policy"].isin(set(reference.scores["policy"]))]
    ref_budgets = set(reference.scores["budget"])
    rows["paper_budget"] = ["full" if p == "full" else b for p, b in zip(rows["paper_policy"], rows["budget"])]
    rows = rows[rows["paper_budget"].isin(ref_budgets)]
    if rows.empty:
        raise PkvError(
            f"nothing to compare: none of the run's policy × budget cells is in {reference.name} "
            f"(its budgets: {', '.join(sorted(ref_budgets - {'full'}, key=float))} entries, and full)"
        )
    # The full cache is the same at every budget: one full row per model, the budget column says "full".
    full = rows["paper_policy"] == FULL_BUDGET
    budgets = pd.CategoricalDtype([FULL_BUDGET, *rows["budget"].cat.categories], ordered=True)
    rows = rows.astype({"budget": budgets})  # the full cache's "budget" first, then the axis's order
    rows.loc[full, "budget"] = FULL_BUDGET
    rows = rows.drop_duplicates([*KEY, "task", "sample_id"])
    targets = {model: paired_model(model, reference, paper_model)[0] for model in rows["model"].unique()}
    return rows.assign(paper_model=rows["model"].map(targets))


def paired_model(model: str, reference: Reference, paper_model: str | None) -> tuple[str, str | None]:
    """The paper's model that the run's ``model`` is compared with, and a sentence when it is not the run's own: the
    paper's model of the same name, else ``paper_model`` or the reference's first; ``paper_model`` wins over a
    paper's model too."""
    target = PAPER_MODELS.get(model) or (model if model in reference.models else None)
    if target is None:
        target = paper_model or reference.models[0]
        return target, (
            f"The run's model ({model_display_name(model)}) is not the paper's: its numbers are compared with "
            f"{target}'s, so the deltas show how the two models differ, not whether the paper is reproduced."
        )
    if paper_model is not None and paper_model != target:
        return paper_model, f"The run's model is {target}; compared with {paper_model} as asked (--paper-model)."
    return target, None


def _scores_by_cell(samples: pd.DataFrame) -> dict[tuple, pd.Series]:
    """policy × budget × task → the sample scores of one model's cell."""
    return {key: cell["score"] for key, cell in samples.groupby([*KEY[1:], "task"], sort=False)}


def paired_cells(samples: pd.DataFrame, reference: Reference) -> pd.DataFrame:
    """One model's cells: per policy × budget × task, the measured mean with its 95% interval (× 100) and sample
    count beside the paper's score, for the cells the paper has."""
    measured = (
        samples.groupby(["policy", "paper_policy", "budget", "task"], sort=False)["score"]
        .agg(measured="mean", n="count")
        .reset_index()
    )
    measured["measured"] *= 100
    scores = _scores_by_cell(samples)
    ends = [mean_interval(scores[key]) for key in zip(measured["policy"], measured["budget"], measured["task"])]
    measured["ci_low"] = [low * 100 for low, _ in ends]
    measured["ci_high"] = [high * 100 for _, high in ends]
    ref = reference.scores[reference.scores["model"] == samples["paper_model"].iloc[0]]
    return measured.merge(
        ref.rename(columns={"policy": "paper_policy", "score": "paper"})[["paper_policy", "budget", "task", "paper"]],
        on=["paper_policy", "budget", "task"],
        how="inner",
    )


# --- rows: the comparison table --------------------------------------------------------------------------------------


def comparison_rows(samples: pd.DataFrame, reference: Reference) -> pd.DataFrame:
    """The table: per model × policy × budget, a row per task both have and an ``average`` row; the delta
    (measured − paper) and whether the paper's score lies inside the measured interval; sorted by model, budget,
    policy, with the average after its tasks."""
    ref_task_count = len(set(reference.scores["task"]))
    out = []
    for model, per_model in samples.groupby("model", sort=False):
        scores = _scores_by_cell(per_model)
        for (policy, budget), cell in paired_cells(per_model, reference).groupby(KEY[1:], sort=False):
            cell = cell.astype({"task": samples["task"].dtype}).sort_values("task", kind="stable").set_index("task")
            names = {
                "model": model_display_name(model),
                "paper_model": per_model["paper_model"].iloc[0],
                "policy": policy,
                "budget": budget,
            }
            for task, r in cell.iterrows():
                measured = {column: r[column] for column in ("measured", "ci_low", "ci_high", "paper")}
                out.append({**names, "task": task, **measured, "n": int(r["n"])})
            tasks_done = len(cell)
            average = "average" if tasks_done == ref_task_count else f"average ({tasks_done} of {ref_task_count} tasks)"
            low, high = (100 * end for end in group_interval([scores[policy, budget, task] for task in cell.index]))
            out.append(
                {
                    **names,
                    "task": average,
                    "measured": cell["measured"].mean(),
                    "ci_low": low,
                    "ci_high": high,
                    "paper": cell["paper"].mean(),
                    "n": int(cell["n"].sum()),
                }
            )
    table = pd.DataFrame(out)
    table["delta"] = table["measured"] - table["paper"]
    # Is the paper's number one our samples could have given? "outside" when it lies beyond our 95% interval.
    # One sample has no interval to speak of ("-").
    table["paper_in_ci"] = [
        "-" if n < 2 else "inside" if low <= paper <= high else "outside"
        for paper, low, high, n in zip(table["paper"], table["ci_low"], table["ci_high"], table["n"])
    ]
    for column in ("measured", "ci_low", "ci_high", "paper", "delta"):
        table[column] = table[column].astype(float).round(2)
    # by model, budget (the full cache's first), policy, the average after its tasks (which keep their order)
    order = table.astype({"budget": samples["budget"].dtype, "policy": samples["policy"].dtype})
    order = order.assign(is_avg=order["task"].str.startswith("average"))
    order = order.sort_values(["model", "budget", "policy", "is_avg"], kind="stable")
    return table.loc[order.index].reset_index(drop=True)[COMPARISON_COLUMNS]


# --- statements: what to know before reading the deltas --------------------------------------------------------------


def statements(samples: pd.DataFrame, reference: Reference, paper_model: str | None, table: pd.DataFrame) -> list[str]:
    """Per model: whether it is compared with another model than its own, and each policy whose options are not
    the paper's; then each compared paper model's printed average that is not its row mean."""
    said: list[str] = []
    for model, per_model in samples.groupby("model", sort=False):
        note = paired_model(model, reference, paper_model)[1]
        if note:
            said.append(note)
        options = per_model.drop_duplicates("policy").set_index("policy")
        for policy in options.index:
            differ = _options_differ(
                policy, options.loc[policy].get("policy_options") if "policy_options" in options else None
            )
            if differ:
                said.append(f"{policy}: {'; '.join(differ)}: not the paper's setting.")
    for r in reference.average_mismatches().itertuples(index=False):
        if r.model in set(table["paper_model"]):
            said.append(
                f"{reference.name}: {r.model} {r.policy} @ {r.budget} prints average {r.average:.2f} but its 16 task "
                f"scores average {r.row_mean:.2f}; the paper column uses the row mean."
            )
    return said


def _options_differ(policy_label: str, options: dict | None) -> list[str]:
    name = policy_label.split(":")[0]
    wanted = PAPER_POLICY_OPTIONS.get(name, {})
    options = options if isinstance(options, dict) else {}
    return [
        f"run has {k}={_format_option_value(options.get(k))}, the paper {k}={_format_option_value(v)}"
        for k, v in wanted.items()
        if k in options and options.get(k) != v
    ]


def _format_option_value(value) -> str:
    """An option's value as a policy label writes it (booleans lower-case), floats without trailing zeros."""
    return f"{value:g}" if isinstance(value, float) else option_text(value)
