"""Results in other harnesses' layouts: kvpress's evaluation folders, and a leaderboard-style ranking.

kvpress (NVIDIA/kvpress ``evaluation/``) writes one folder per press and compression ratio,
``<dataset>__<data_dir>__<model>__<press>__<ratio:.2f>[__query_aware]``, holding ``predictions.csv`` (one row per
sample: its columns, the prediction as ``predicted_answer``, ``compression_ratio``), ``metrics.json`` (``{task:
{"string_match": score × 100, 2 decimals}}``) and ``config.yaml``. ``export_kvpress`` writes the same from a pkvbench
run, so kvpress users' scripts read it:

- ``<press>`` is kvpress's name where the policy is one of its presses with kvpress's settings — the ``kvpress``
  preset, ``--protocol kvpress`` (``no_press``, ``streaming_llm``, ``snapkv`` for SnapKV with window 64 and average
  pooling of 5, ``expected_attention`` for ``adakv(expected_attention:epsilon=0.01)``, ``adakv_snapkv``, ``chunkkv``,
  ``critical_adakv_snapkv``, …: ``KVPRESS_PRESSES``) — else pkvbench's label (e.g. ``snapkv`` with pkvbench's window
  8 and max-pooling is not kvpress's ``snapkv``), followed by ``-kv4`` (``-kv4-g64-r32``) for a cache stored in another
  format than the model's own: each storage format is a folder of its own;
- the ratio is the budget's compression ratio (``cr0.5`` → 0.50), or for other budgets 1 − the share of the prompt the
  rows kept on average (1 − a fraction budget where rows do not record ``budget_tokens`` and ``context_tokens``;
  ``budget<label>`` in the name where the ratio cannot be known); two budgets of one ratio are refused rather than
  written into one folder; ``__query_aware`` marks query-aware rows (kvpress's default is agnostic);
- ``predictions.csv`` has ``task, sample_id, question, answer, predicted_answer, compression_ratio, query_mode,
  context_tokens`` (``question`` from the rows' ``question_text``, empty for runs older than that column), and a
  conversation's ``turn`` (``--query-mode multi-turn``: a folder per turn compression, ``__turns-every-turn``); kvpress's
  ``context`` and ``answer_prefix`` columns are absent (rows keep only the context's head and tail);
- ``metrics.json`` holds each task's mean score × 100 under ``string_match`` (RULER's string match, the same
  definition as kvpress's), whatever the task's metric.

Beside the folders, ``ranking.md`` and ``ranking.csv`` (``leaderboard_ranking``): kvpress's leaderboard as a table —
per query mode, each policy's score at each compression ratio (the mean of the task means, as the leaderboard
averages RULER's tasks) and over all ratios, with 95% intervals (bootstrap within each task × ratio), policies ranked
by that average; the full cache is the line they are read against (rank 0).
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import pandas as pd
import yaml

from pkvbench.cell.schema import AWARE, CELL_KEY, DEFAULT_QUERY_MODE, NO_TURNS
from pkvbench.errors import PkvError
from pkvbench.reports.axes import FRACTION, REMOVED, budget_kind, budget_point, key_label, present
from pkvbench.reports.report import (
    Runs,
    interval_columns,
    model_display_name,
    refuse_decode_budgets,
    to_csv,
    to_markdown,
)
from pkvbench.reports.stats import group_interval
from pkvbench.store.outputs import Outputs

# kvpress's presses (the names of its evaluation/evaluate_registry.py) and the pkvbench policy that is each one under
# the ``kvpress`` preset (``--protocol kvpress``; the pairs ``docs/kvpress-crosscheck.md`` compares, kept sets
# identical or their difference explained). ``random`` is ``RandomPress(seed=0)``: kvpress's leaderboard entry is
# unseeded, so its draws cannot be reproduced.
KVPRESS_PRESSES = {
    "no_press": "full",
    "random": "random",
    "knorm": "knorm",
    "streaming_llm": "streamingllm",
    "tova": "tova",
    "keydiff": "keydiff",
    "snapkv": "snapkv",
    "pyramidkv": "pyramidkv",
    "kvzip": "kvzip",
    "expected_attention": "adakv(expected_attention:epsilon=0.01)",
    "adakv_snapkv": "adakv(snapkv)",
    "chunkkv": "chunkkv(snapkv)",
    "critical_adakv_snapkv": "adakv(snapkv):critical=true",
    "critical_adakv_expected_attention": "adakv(expected_attention:vnorm=false):critical=true",
}


@cache
def _presses() -> dict:
    """Each press's pkvbench policy under the kvpress preset → the press's name."""
    from pkvbench.policies import parse_policy

    return {parse_policy(spec, protocol="kvpress"): name for name, spec in KVPRESS_PRESSES.items()}


@cache
def kvpress_name(policy: str) -> str:
    """kvpress's name for the press a pkvbench policy label is — the policy with exactly the options of the kvpress
    preset — or the label made safe for a folder name, prefixed ``pkvbench_`` where it would read as a press's name
    (``knorm`` with pkvbench's tie rule is not kvpress's ``knorm``)."""
    from pkvbench.policies import parse_policy

    try:
        name = _presses().get(parse_policy(policy))
    except PkvError:  # a plugin's policy that is not installed here
        name = None
    if name:
        return name
    label = re.sub(r"[^A-Za-z0-9._=-]+", "-", policy).strip("-")
    return f"pkvbench_{label}" if label in KVPRESS_PRESSES else label


def compression_ratio(budget: str, rows: pd.DataFrame) -> float | None:
    """The share of the prompt removed: a ``cr`` budget's own, else 1 − the mean share the rows kept (of their
    conversation so far, a conversation's turns), else (rows that
    do not say: ``budget_tokens`` and ``context_tokens`` are not required of a row) 1 − a fraction budget; None for a
    budget of tokens or bytes whose rows do not say."""
    kind, value = budget_point(str(budget))
    if kind == REMOVED:
        return value
    kept = pd.to_numeric(_column(rows, "budget_tokens"), errors="coerce")
    # of the prompt: the context, or a conversation's turn's whole conversation so far
    prompt = pd.to_numeric(_column(rows, "conversation_tokens"), errors="coerce")
    prompt = prompt.fillna(pd.to_numeric(_column(rows, "context_tokens"), errors="coerce"))
    kept = (kept / prompt).clip(upper=1.0).dropna()
    if len(kept):
        return float(1 - kept.mean())
    return 1 - value if kind == FRACTION else None


def _column(rows: pd.DataFrame, name: str, missing=None) -> pd.Series:
    """A column of the rows, or ``missing`` in every row where they lack it (a field the schema does not require)."""
    return rows[name] if name in rows.columns else pd.Series(missing, index=rows.index, dtype=object)


def dataset_name(tasks: list[str]) -> str:
    """kvpress's dataset name: ``ruler`` for RULER tasks (the task group), else the tasks joined."""
    from pkvbench.tasks.registry import task_groups

    return "ruler" if set(tasks) <= set(task_groups()["ruler"]) else "+".join(sorted(set(tasks)))


def export_kvpress(runs: Runs, out: str | Path, outputs: Outputs | None = None) -> list[Path]:
    """One kvpress folder per cell of ``runs`` but its task (model × policy × budget × query mode × storage format:
    ``schema.CELL_KEY``); returns the folders written. The
    files go through ``outputs`` (the caller commits them) or, without it, are written here under the writing
    rule."""
    own = outputs is None
    outputs = Outputs("--out") if own else outputs
    refuse_decode_budgets(runs.rows, "the kvpress export")
    rows = runs.rows.copy()
    if "query_mode" not in rows.columns:
        rows["query_mode"] = DEFAULT_QUERY_MODE
    rows["query_mode"] = rows["query_mode"].fillna(DEFAULT_QUERY_MODE)
    out = Path(out)
    written: dict[Path, str] = {}  # each folder → the cell it holds
    folder_key = [name for name in CELL_KEY if name != "task"]  # a kvpress folder holds all tasks of one cell
    for key, group in rows.groupby(folder_key, sort=False):
        cell = dict(zip(folder_key, key))
        ratio = compression_ratio(cell["budget"], group)
        lengths = sorted({int(n) for n in group.get("length", pd.Series(dtype=float)).dropna()})
        data_dir = "+".join(map(str, lengths)) or "data"
        name = "__".join(
            [
                dataset_name(list(group["task"])),
                data_dir,
                model_display_name(cell["model"]).replace("/", "--"),
                kvpress_name(cell["policy"])
                + (f"-kv{cell['kv_stored']}".replace(" ", "-") if cell["kv_stored"] else ""),  # another format
                f"{ratio:.2f}"
                if ratio is not None
                else f"budget{cell['budget']}",  # kvpress's ratio, where it is known
            ]
        ) + ("__query_aware" if cell["query_mode"] == AWARE else "")
        turns = cell.get("turn_compression", NO_TURNS)
        name += f"__turns-{turns}" if turns != NO_TURNS else ""  # a conversation's: compressed once or every turn
        folder = out / name
        label = key_label(cell, at_budget=True)
        if folder in written:  # two budgets of one ratio: one folder would hold both, kvpress would read one
            raise PkvError(
                f"{written[folder]} and {label} would both be kvpress's {folder.name}; export them from separate runs"
            )
        written[folder] = label
        predictions = pd.DataFrame(
            {
                "task": group["task"],
                "sample_id": group["sample_id"],
                "question": _column(group, "question_text", ""),
                "answer": [
                    json.dumps(a, ensure_ascii=False) if isinstance(a, list) else "" for a in _column(group, "answers")
                ],
                "predicted_answer": _column(group, "pred", ""),
                "compression_ratio": ratio,
                "query_mode": cell["query_mode"],
                "context_tokens": _column(group, "context_tokens"),
                **({"turn": group["turn"].astype("Int64")} if turns != NO_TURNS else {}),
            }
        )
        metrics = {
            task: {"string_match": round(100 * float(scores.mean()), 2)}
            for task, scores in group.groupby("task", sort=False)["score"]
        }
        config = {
            "model": cell["model"],
            "press": kvpress_name(cell["policy"]),
            "pkvbench_policy": cell["policy"],
            "compression_ratio": ratio,
            "pkvbench_budget": str(cell["budget"]),
            **({"pkvbench_kv_bits": cell["kv_stored"]} if cell["kv_stored"] else {}),
            "query_aware": cell["query_mode"] == AWARE,
            **({"pkvbench_turn_compression": turns} if turns != NO_TURNS else {}),
            "samples": int(len(group)),
        }
        outputs.add(folder / "predictions.csv", predictions.to_csv(index=False))
        outputs.add(folder / "metrics.json", json.dumps(metrics, indent=4) + "\n")
        outputs.add(folder / "config.yaml", yaml.safe_dump(config, sort_keys=False))
    if own:
        outputs.commit()
    return list(written)


def leaderboard_ranking(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows model × query mode × policy, ranked within model and mode by ``avg`` (see the module docstring): columns
    ``rank``, each budget (the compression ratio's label, ``cr0.5``) and ``avg``, each with its interval columns,
    and ``n`` (samples behind the row)."""
    modes = rows.get("query_mode", pd.Series(DEFAULT_QUERY_MODE, index=rows.index))
    rows = rows.assign(query_mode=modes.fillna(DEFAULT_QUERY_MODE))
    if "kv_stored" in rows.columns:  # a policy at another storage format is another entry, never pooled with it
        rows = rows.assign(
            policy=[key_label({"policy": p, "kv_stored": s}) for p, s in zip(rows["policy"], rows["kv_stored"])]
        )
    budgets = [str(b) for b in present(rows["budget"])]
    if all(budget_kind(b) == REMOVED for b in budgets):  # compression ratios from the least removed, as kvpress's plots
        budgets = sorted(budgets, key=lambda b: budget_point(b)[1])
    records = []
    for (model, mode, policy), group in rows.groupby(["model", "query_mode", "policy"], sort=False):
        record = {"model": model_display_name(model), "query_mode": mode, "policy": policy}
        for column, cells in [(b, group[group["budget"].astype(str) == b]) for b in budgets] + [("avg", group)]:
            strata = [scores for _, scores in cells.groupby(["task", "budget"], sort=False)["score"]]
            low, high = group_interval(strata) if strata else (float("nan"),) * 2
            record[column] = 100 * float(pd.Series([s.mean() for s in strata]).mean()) if strata else float("nan")
            low_name, high_name = interval_columns(column)
            record[low_name], record[high_name] = 100 * low, 100 * high
        record["n"] = int(len(group))
        records.append(record)
    table = pd.DataFrame(records)
    full = table["policy"] == "full"
    table["rank"] = 0
    for _, index in table[~full].groupby(["model", "query_mode"], sort=False).groups.items():
        order = table.loc[index, "avg"].rank(ascending=False, method="min").astype(int)
        table.loc[index, "rank"] = order
    table = table.sort_values(["model", "query_mode", "rank", "policy"], kind="stable").reset_index(drop=True)
    columns = ["model", "query_mode", "rank", "policy"]
    for column in [*budgets, "avg"]:
        columns += [column, *interval_columns(column)]
    table[columns[4:]] = table[columns[4:]].round(2)
    return table[[*columns, "n"]]


def write_ranking(runs: Runs, out: str | Path, outputs: Outputs | None = None) -> pd.DataFrame:
    """``ranking.md`` and ``ranking.csv`` in ``out`` (through ``outputs``, as ``export_kvpress``); returns the
    table."""
    refuse_decode_budgets(runs.rows, "the kvpress ranking")
    table = leaderboard_ranking(runs.rows)
    out = Path(out)
    own = outputs is None
    outputs = Outputs("--out") if own else outputs
    outputs.add(out / "ranking.md", to_markdown(table))
    outputs.add(out / "ranking.csv", to_csv(table))
    if own:
        outputs.commit()
    return table
