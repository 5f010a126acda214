"""``pkvbench lm-eval``: lm-eval tasks under every configuration of a grid, from one prefill per request.

The model loads once (``grid.Grid``); lm-eval then evaluates one view per configuration (``backend.PkvbenchLM``):
the first computes every request under every configuration, the others find their answers computed. Each
configuration gets lm-eval's own output (``OUT/lm_eval/<configuration>/<model>/results_*.json`` and
``samples_<task>_*.jsonl``, as ``lm_eval --output_path OUT/lm_eval/<configuration> --log_samples`` writes them), and
pkvbench's ``samples.jsonl`` gets a row per document and configuration (lm-eval's per-document score), so that
``pkvbench report / diff / check`` read the run. Each configuration's rows are written last, once its lm-eval files
are: rerunning an interrupted run into its folder skips the configurations it finished.
"""

from __future__ import annotations

import difflib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pkvbench.errors import PkvError, first_line
from pkvbench.lm_eval import BOOTSTRAP_ITERS, require_lm_eval
from pkvbench.lm_eval.grid import Grid, GridSpec, cell_key, result_row
from pkvbench.reports.summary import summarize
from pkvbench.store.results import ResultStore

LM_EVAL_FOLDER = "lm_eval"  # under --out: one folder per configuration


@dataclass
class GridRun:
    """What a run wrote: lm-eval's results per configuration, pkvbench's rows, the time each configuration took."""

    out: Path
    results: dict[str, dict] = field(default_factory=dict)  # configuration → lm-eval's results (samples left out)
    seconds: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    resumed: list[str] = field(default_factory=list)  # configurations found done in the folder, not run again
    notes: list[str] = field(default_factory=list)
    summary: Any = None


def task_manager(tasks: Sequence[str], include_paths: Sequence[str], include_defaults: bool = True):
    """lm-eval's task index with the user's folders (and lm-eval's own tasks, unless ``include_defaults`` is off:
    indexing them takes seconds), every task checked to be in it."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(p) for p in include_paths] or None, include_defaults=include_defaults)
    known = {*manager.all_tasks, *manager.all_groups, *manager.all_tags}
    for name in tasks:
        if name not in known and not Path(name).is_file():
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise PkvError(
                f"lm-eval has no task {name!r}{hint}; list them with `lm_eval ls tasks`, or give the folder of your "
                "task YAML with --include-path"
            )
    return manager


def check_data(manager, tasks: Sequence[str]) -> None:
    """Load the tasks' data before the model: a task whose data is on the hub, offline, is one line here."""
    try:
        manager.load(list(tasks))
    except Exception as exc:  # datasets' and the hub's errors have no common base
        raise PkvError(
            f"lm-eval could not load the data of {', '.join(tasks)}: {first_line(exc)}; offline (HF_HUB_OFFLINE=1) "
            "a task whose data is on the hub needs a local copy: a task YAML with dataset_path: json and "
            "dataset_kwargs: data_files: pointing at local files, given with --include-path (docs/lm-eval.md)"
        ) from None


def evaluate_grid(
    tasks: Sequence[str],
    model_args: dict[str, Any],
    out: str | Path,
    *,
    limit: int | float | None = None,
    include_paths: Sequence[str] = (),
    num_fewshot: int | None = None,
    bootstrap_iters: int = BOOTSTRAP_ITERS,
    overwrite: bool = False,
    grid: Grid | None = None,
    include_defaults: bool = True,
) -> GridRun:
    """Evaluate ``tasks`` under every configuration the model args name. ``grid``: one already loaded (tests);
    ``include_defaults``: whether lm-eval's own tasks are looked up too."""
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    from pkvbench import api
    from pkvbench.lm_eval.backend import PkvbenchLM
    from pkvbench.run.provenance import provenance

    spec = grid.spec if grid is not None else GridSpec.parse(model_args)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines per task and configuration bury ours
    manager = task_manager(tasks, include_paths, include_defaults)
    check_data(manager, tasks)
    run = GridRun(Path(out))
    options = {
        "lm_eval_tasks": list(tasks),
        "model_args": spec.args,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "include_paths": [str(p) for p in include_paths],
    }
    store = ResultStore(run.out)
    with store.claim(options, overwrite, session=api.session(spec.config.model)):
        done = {cell_key(row) for row in store.rows()}  # configurations a run into this folder finished
        grid = grid or Grid(spec)
        engine = grid.engine
        store.record({"options": options, "model": engine.loaded.describe(), **provenance(0)})
        for index, (label, cell) in enumerate(zip(grid.labels, spec.cells)):
            if cell_key(cell) in done:
                run.resumed.append(label)
                continue
            started = time.perf_counter()
            view = PkvbenchLM(grid=grid, configuration=index)
            tracker = EvaluationTracker(output_path=str(run.out / LM_EVAL_FOLDER / label))
            results = simple_evaluate(
                model=view,
                model_args={"pretrained": spec.config.model, "pkvbench": label},
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                log_samples=True,
                evaluation_tracker=tracker,
                bootstrap_iters=bootstrap_iters,
            )
            run.seconds[label] = time.perf_counter() - started
            samples = results.pop("samples")
            rows = [
                result_row(spec, engine.loaded.name, cell, *document)
                for document in documents(samples, view.answered, run.notes)
            ]
            tracker.save_results_aggregated(results=results, samples=samples)
            for task_name in results["configs"]:
                tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
            run.results[label] = results
            store.extend(rows)  # last, in one write: a configuration with rows is done, and a rerun skips it
            run.rows += len(rows)
        run.summary = store.write_summary(summarize(store.rows()))
    run.notes = list(dict.fromkeys(run.notes))
    return run


def documents(samples: dict[str, list[dict]], answered: dict[str, dict], notes: list[str]):
    """``(task, doc_id, values)`` for each document lm-eval logged: its score (the task's first metric), prediction
    and target, and what the backend measured answering it (``answered``, by the document's context). A task with
    several filters (gsm8k's strict and flexible matches) is one task per filter, ``task:filter``."""
    for task, logged in samples.items():
        for sample in logged:
            metric = sample["metrics"][0] if sample.get("metrics") else None
            score = sample.get(metric)
            if isinstance(score, bool):
                score = float(score)
            if not isinstance(score, (int, float)) or not 0 <= score <= 1:
                notes.append(
                    f"{task}: its metric {metric} is not a score from 0 to 1; its rows are left out of "
                    "samples.jsonl (lm-eval's own files have them)"
                )
                continue
            name = task if sample.get("filter", "none") == "none" else f"{task}:{sample['filter']}"
            arguments = sample["arguments"]
            measured = answered.get(arguments[0][0], {}) if arguments else {}
            values = {**measured, "pred": prediction(sample["filtered_resps"]), "answers": [str(sample["target"])]}
            yield name, sample["doc_id"], {**values, "score": float(score)}


def prediction(filtered: list) -> str:
    """A generation's text; for choices scored by log-likelihood, the index of the most likely one."""
    if filtered and isinstance(filtered[0], str):
        return filtered[0]
    logprobs = [choice[0] if isinstance(choice, (list, tuple)) else choice for choice in filtered]
    return str(max(range(len(logprobs)), key=logprobs.__getitem__)) if logprobs else ""
