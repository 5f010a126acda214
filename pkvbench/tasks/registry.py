"""Find task definitions (``tasks/**/*.yaml``) and build their samples."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import yaml

from pkvbench.errors import PkvError
from pkvbench.metrics import METRICS
from pkvbench.tasks.base import Sample, TaskOptions, TaskSpec
from pkvbench.tasks.needle import needle_samples

GENERATORS = {"needle": needle_samples}


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
        specs[raw["name"]] = TaskSpec(
            name=raw["name"],
            description=raw.get("description", ""),
            generator=raw["generator"],
            metric=raw["metric"],
            max_new_tokens=int(raw["max_new_tokens"]),
            chat_template=bool(raw.get("chat_template", True)),
            stop_strings=tuple(raw.get("stop_strings", ())),
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


def build_samples(spec: TaskSpec, tokenizer, options: TaskOptions) -> list[Sample]:
    return GENERATORS[spec.generator](tokenizer, spec, options)
