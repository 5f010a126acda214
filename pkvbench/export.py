"""Results in other harnesses' layouts: kvpress's evaluation folders, and a leaderboard-style ranking.

kvpress (NVIDIA/kvpress ``evaluation/``) writes one folder per press and compression ratio,
``<dataset>__<data_dir>__<model>__<press>__<ratio:.2f>[__query_aware]``, holding ``predictions.csv`` (one row per
sample: its columns, the prediction as ``predicted_answer``, ``compression_ratio``), ``metrics.json`` (``{task:
{"string_match": score × 100, 2 decimals}}``) and ``config.yaml``. ``export_kvpress`` writes the same from a pkvbench
run, so kvpress users' scripts read it:

- ``<press>`` is kvpress's name where the method is one of its presses (``no_press``, ``streaming_llm``,
  ``expected_attention`` for ``adakv(expected_attention…)``, ``adakv_snapkv``, ``chunkkv``, …), else pkvbench's label;
- the ratio is the budget's compression ratio (``cr0.5`` → 0.50), or for other budgets 1 − the share of the prompt the
  rows kept on average; ``__query_aware`` marks query-aware rows (kvpress's default is agnostic);
- ``predictions.csv`` has ``task, sample_id, answer, predicted_answer, compression_ratio, query_mode,
  context_tokens`` — pkvbench keeps no question text in its rows, so kvpress's ``question`` and ``answer_prefix``
  columns are absent;
- ``metrics.json`` holds each task's mean score × 100 under ``string_match`` (RULER's string match, the same
  definition as kvpress's), whatever the task's metric.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import yaml

from pkvbench.io import atomic_write
from pkvbench.report import Runs, model_display_name

KVPRESS_NAMES = {
    "full": "no_press",
    "streamingllm": "streaming_llm",
    "random": "random",
    "knorm": "knorm",
    "tova": "tova",
    "keydiff": "keydiff",
    "snapkv": "snapkv",
    "pyramidkv": "pyramidkv",
    "kvzip": "kvzip",
    "expected_attention": "expected_attention",
}
WRAPPED = {"adakv(expected_attention": "expected_attention", "adakv(snapkv": "adakv_snapkv", "chunkkv(": "chunkkv"}


def kvpress_name(policy: str) -> str:
    for prefix, name in WRAPPED.items():
        if policy.startswith(prefix):
            return name
    base = policy.split(":")[0]
    return KVPRESS_NAMES.get(base, re.sub(r"[^A-Za-z0-9._=-]+", "-", policy).strip("-"))


def compression_ratio(budget: str, rows: pd.DataFrame) -> float:
    if str(budget).startswith("cr"):
        return float(str(budget)[2:])
    kept = (rows["budget_tokens"] / rows["context_tokens"]).clip(upper=1.0)
    return float(1 - kept.mean())


def dataset_name(tasks: list[str]) -> str:
    """kvpress's dataset name: ``ruler`` for RULER tasks (the task group), else the tasks joined."""
    from pkvbench.tasks.registry import task_groups

    return "ruler" if set(tasks) <= set(task_groups()["ruler"]) else "+".join(sorted(set(tasks)))


def export_kvpress(runs: Runs, out: str | Path) -> list[Path]:
    """One kvpress folder per model × policy × budget × query mode of ``runs``; returns the folders written."""
    rows = runs.rows.copy()
    if "query_mode" not in rows.columns:
        rows["query_mode"] = "aware"
    rows["query_mode"] = rows["query_mode"].fillna("aware")
    out = Path(out)
    written = []
    for (model, policy, budget, mode), group in rows.groupby(["model", "policy", "budget", "query_mode"], sort=False):
        ratio = compression_ratio(budget, group)
        lengths = sorted({int(n) for n in group.get("length", pd.Series(dtype=float)).dropna()})
        data_dir = "+".join(map(str, lengths)) or "data"
        name = "__".join(
            [
                dataset_name(list(group["task"])),
                data_dir,
                model_display_name(model).replace("/", "--"),
                kvpress_name(policy),
                f"{ratio:.2f}",
            ]
        ) + ("__query_aware" if mode == "aware" else "")
        folder = out / name
        predictions = pd.DataFrame(
            {
                "task": group["task"],
                "sample_id": group["sample_id"],
                "answer": [json.dumps(a, ensure_ascii=False) for a in group["answers"]],
                "predicted_answer": group["pred"],
                "compression_ratio": ratio,
                "query_mode": mode,
                "context_tokens": group["context_tokens"],
            }
        )
        metrics = {
            task: {"string_match": round(100 * float(scores.mean()), 2)}
            for task, scores in group.groupby("task", sort=False)["score"]
        }
        config = {
            "model": model,
            "press": kvpress_name(policy),
            "pkvbench_policy": policy,
            "compression_ratio": ratio,
            "pkvbench_budget": str(budget),
            "query_aware": mode == "aware",
            "samples": int(len(group)),
        }
        atomic_write(folder / "predictions.csv", predictions.to_csv(index=False))
        atomic_write(folder / "metrics.json", json.dumps(metrics, indent=4) + "\n")
        atomic_write(folder / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        written.append(folder)
    return written
