"""``pkvbench score``: score LongBench prediction files as the official ``eval.py`` does."""

from __future__ import annotations

import json
from typing import Any

from pkvbench.errors import PkvError
from pkvbench.metrics.functions import LENGTH_BUCKETS, dataset_score, length_bucket, prepare_prediction
from pkvbench.metrics.registry import METRICS
from pkvbench.tasks.longbench import is_string_list
from pkvbench.tasks.registry import all_tasks


def _check_fields(row: dict[str, Any], where: str) -> None:
    """The fields scoring reads, of the types it reads them as."""
    if not isinstance(row.get("pred"), str) or row.get("answers") is None or not is_string_list(row["answers"]):
        raise PkvError(f"{where}: needs 'pred' (a string) and 'answers' (a list of strings)")
    if not is_string_list(row.get("all_classes")):
        raise PkvError(f"{where}: 'all_classes' must be a list of strings, got {row['all_classes']!r}")
    if not isinstance(row.get("policy", ""), str):
        raise PkvError(f"{where}: 'policy' must be a string, got {row['policy']!r}")
    budget = row.get("budget", 0)
    if not isinstance(budget, (int, float, str)) or isinstance(budget, bool):
        raise PkvError(f"{where}: 'budget' must be a number or a label, got {budget!r}")


def score_rows(
    rows: list[dict[str, Any]], default_dataset: str | None = None, where: str = "input"
) -> tuple[list[dict], list[dict]]:
    """Score prediction rows as the official ``eval.py`` does.

    Each row needs ``pred`` and ``answers``, ``all_classes`` for trec/lsht, ``length`` for LongBench-E, and its
    dataset as ``dataset`` (or ``task``, as in pkvbench's samples.jsonl, or ``default_dataset``). Returns the rows
    with ``score`` (0–1) and a summary: one entry per dataset (and policy × budget where the rows have them) with
    n, score (round(100·mean, 2)) and, for LongBench-E datasets, the 0-4k / 4-8k / 8k+ buckets by ``length``.
    """
    tasks = {name: spec for name, spec in all_tasks().items() if spec.generator == "longbench"}
    scored, groups = [], {}
    for number, row in enumerate(rows, start=1):
        name = row.get("dataset") or row.get("task") or default_dataset
        if not name:
            raise PkvError(f"{where}, line {number}: no dataset (give each line a 'dataset' field, or pass --dataset)")
        if not isinstance(name, str):
            raise PkvError(f"{where}, line {number}: the dataset must be a name (a string), got {name!r}")
        spec = tasks.get(name)
        if spec is None:
            raise PkvError(f"{where}, line {number}: unknown dataset {name!r}; valid: {', '.join(tasks)}")
        _check_fields(row, f"{where}, line {number}")
        meta = {"all_classes": list(row.get("all_classes") or [])}
        score = METRICS[spec.metric](prepare_prediction(row["pred"], spec.postprocess), row["answers"], meta)
        scored.append({**row, "score": score})
        key = (name, row.get("policy"), json.dumps(row.get("budget")))
        group = groups.setdefault(
            key,
            {
                "dataset": name,
                **({"policy": row["policy"]} if "policy" in row else {}),
                **({"budget": row["budget"]} if "budget" in row else {}),
                "scores": [],
                "buckets": {b: [] for b in LENGTH_BUCKETS} if name.endswith("_e") else None,
            },
        )
        group["scores"].append(score)
        if group["buckets"] is not None:
            if not isinstance(row.get("length"), (int, float)):
                raise PkvError(f"{where}, line {number}: LongBench-E dataset {name} needs a numeric 'length'")
            group["buckets"][length_bucket(row["length"])].append(score)
    summary = []
    for group in groups.values():
        entry = {k: v for k, v in group.items() if k not in ("scores", "buckets")}
        entry.update(n=len(group["scores"]), score=dataset_score(group["scores"]))
        if group["buckets"] is not None:
            entry.update({b: dataset_score(s) if s else float("nan") for b, s in group["buckets"].items()})
        summary.append(entry)
    return scored, summary
