"""Find task definitions (``tasks/**/*.yaml``) and build their samples."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import yaml

from pkvbench.errors import PkvError
from pkvbench.metrics import METRICS, PREDICTION_RULES
from pkvbench.tasks.base import Sample, TaskOptions, TaskSpec
from pkvbench.tasks.longbench import longbench_samples
from pkvbench.tasks.needle import needle_samples
from pkvbench.tasks.ruler import cwe_samples, fwe_samples, niah_samples, vt_samples
from pkvbench.tasks.trec import trec_samples

GENERATORS = {
    "needle": needle_samples,
    "longbench": longbench_samples,
    "ruler_niah": niah_samples,
    "ruler_vt": vt_samples,
    "ruler_cwe": cwe_samples,
    "ruler_fwe": fwe_samples,
    "trec_fewshot": trec_samples,
}


def tasks_dir() -> Path:
    """The project's ``tasks/`` folder (next to the package in a source checkout), or ``$PKVBENCH_TASKS``."""
    return Path(os.environ.get("PKVBENCH_TASKS") or Path(__file__).resolve().parents[2] / "tasks")


@cache
def all_tasks() -> dict[str, TaskSpec]:
    specs = {}
    for path in sorted(tasks_dir().glob("**/*.yaml")):
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        if raw["generator"] not in GENERATORS or raw["metric"] not in METRICS:
            raise PkvError(f"{path}: unknown generator or metric ({raw['generator']}, {raw['metric']})")
        if not set(raw.get("postprocess") or ()) <= set(PREDICTION_RULES):
            raise PkvError(f"{path}: unknown postprocess rule in {raw['postprocess']}; valid: {', '.join(PREDICTION_RULES)}")
        specs[raw["name"]] = TaskSpec(
            name=raw["name"],
            description=raw.get("description", ""),
            generator=raw["generator"],
            metric=raw["metric"],
            max_new_tokens=int(raw["max_new_tokens"]),
            chat_template=bool(raw.get("chat_template", True)),
            stop_strings=tuple(raw.get("stop_strings", ())),
            min_new_tokens=int(raw.get("min_new_tokens", 0)),
            postprocess=tuple(raw.get("postprocess") or ()),
            config=raw,
        )
    if not specs:
        raise PkvError(f"no task definitions found under {tasks_dir()} (set PKVBENCH_TASKS to the project's tasks/ folder)")
    return specs


def get_task(name: str) -> TaskSpec:
    tasks = all_tasks()
    if name not in tasks:
        raise PkvError(f"unknown task {name!r}; valid tasks: {', '.join(tasks)}")
    return tasks[name]


def task_groups() -> dict[str, list[str]]:
    """Groups named by the tasks' ``groups`` lists (``longbench``, ``longbench-zh``, ``longbench-e``), tasks in
    definition order."""
    groups: dict[str, list[str]] = {}
    for spec in all_tasks().values():
        for group in spec.config.get("groups") or ():
            groups.setdefault(group, []).append(spec.name)
    return groups


def expand_tasks(names: list[str]) -> list[TaskSpec]:
    """Task and group names (a group stands for its tasks) → task definitions, each once, in the order given."""
    tasks, groups = all_tasks(), task_groups()
    selected: dict[str, TaskSpec] = {}
    for name in names:
        if name in tasks:
            selected.setdefault(name, tasks[name])
        elif name in groups:
            for member in groups[name]:
                selected.setdefault(member, tasks[member])
        else:
            raise PkvError(f"unknown task {name!r}; valid groups: {', '.join(groups)}; valid tasks: {', '.join(tasks)}")
    return list(selected.values())


def build_samples(spec: TaskSpec, tokenizer, options: TaskOptions) -> list[Sample]:
    return GENERATORS[spec.generator](tokenizer, spec, options)
