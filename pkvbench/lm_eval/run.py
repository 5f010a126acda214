"""``pkvbench lm-eval``: lm-eval tasks under every configuration of a grid, from one prefill per request.

The model loads once (``grid.Grid``); lm-eval then evaluates one view per configuration (``backend.PkvbenchLM``):
the first computes every request under every configuration, the others find their answers computed. Each
configuration gets lm-eval's own output (``OUT/lm_eval/<configuration>/<model>/results_*.json`` and
``samples_<task>_*.jsonl``, as ``lm_eval --output_path OUT/lm_eval/<configuration> --log_samples`` writes them), and
pkvbench's ``samples.jsonl`` gets a row per document and configuration (lm-eval's per-document score), so that
``pkvbench report / diff / check`` read the run. Each configuration's rows are written last, once its lm-eval files
are: rerunning an interrupted run into its folder skips the configurations it finished, and writes anew what an
interrupted configuration left of its files. The folder's lifecycle is ``pkvbench run``'s (``api.RunFolder``).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pkvbench.cell.schema import AGNOSTIC
from pkvbench.errors import PkvError, first_line
from pkvbench.io import remove_tree
from pkvbench.lm_eval import BOOTSTRAP_ITERS, require_lm_eval
from pkvbench.lm_eval.grid import Grid, GridSpec, cell_key, result_row
from pkvbench.store.results import ResultStore

LM_EVAL_FOLDER = "lm_eval"  # under --out: one folder per configuration
# What to do with a task that samples, said to a user of ``pkvbench lm-eval`` (which has no --gen_kwargs)
GREEDY_TASK = (
    "run a copy of the task whose generation_kwargs say do_sample: false (its YAML in a folder given with "
    "--include-path)"
)


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


@contextlib.contextmanager
def quiet_lm_eval(level: int = logging.ERROR) -> Iterator[None]:
    """lm-eval's log lines at ``level`` and above only, and no progress bar (while its tasks are checked): a
    refusal is one line, not lm-eval's notes on a task's YAML and then the line."""
    logger = logging.getLogger("lm_eval")
    before = logger.level
    logger.setLevel(level)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(before)


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


def check_data(manager, tasks: Sequence[str]) -> dict[str, Any]:
    """Load the tasks and their data before the model: a task whose data is on the hub, offline, is one line here.
    Returns lm-eval's tasks (``TaskManager.load``)."""
    try:
        return manager.load(list(tasks))
    except Exception as exc:  # datasets' and the hub's errors have no common base
        raise PkvError(
            f"lm-eval could not load the data of {', '.join(tasks)}: {first_line(exc)}; offline (HF_HUB_OFFLINE=1) "
            "a task whose data is on the hub needs a local copy: a task YAML with dataset_path: json and "
            "dataset_kwargs: data_files: pointing at local files, given with --include-path (docs/lm-eval.md)"
        ) from None


def check_requests(loaded: dict[str, Any], spec: GridSpec, limit: int | float | None, num_fewshot: int | None) -> None:
    """Build every request lm-eval will send, as ``simple_evaluate`` builds them but without a model, and refuse now
    what the backend would refuse once they run: a perplexity task, a task that samples, a context without the
    question split (query mode agnostic), and whatever lm-eval cannot build (a few-shot setting its task cannot
    meet, a template that fails). A run refused here has loaded nothing and changed no file."""
    from pkvbench.lm_eval.backend import ROLLING_REFUSAL, greedy_settings

    for name, task in loaded["tasks"].items():
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:  # a task's own 0 stays (simple_evaluate)
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        try:
            task.build_all_requests(limit=limit, rank=0, world_size=1)
        except Exception as exc:  # a task's templates and samplers raise what they raise
            raise PkvError(f"lm-eval could not build the requests of task {name}: {first_line(exc)}") from None
        for request in task.instances:
            if request.request_type == "loglikelihood_rolling":
                raise PkvError(f"task {name}: {ROLLING_REFUSAL}")
            if request.request_type == "generate_until":
                greedy_settings(name, request.args[1], GREEDY_TASK)
            if AGNOSTIC in spec.resolved.query_modes and spec.split_at(request.args[0]) is None:
                raise spec.missing_split()


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
    ``include_defaults``: whether lm-eval's own tasks are looked up too.

    Everything that can be checked is, before the model loads: the model args (as ``pkvbench run`` checks its
    options), the model's config, the tasks, their data and every request they make. The folder's lifecycle is
    ``pkvbench run``'s (``api.RunFolder``): a folder being replaced (``overwrite``) keeps its previous run — rows and
    lm-eval's files — until the first configuration's files are written."""
    require_lm_eval()
    from pkvbench import api

    spec = grid.spec if grid is not None else GridSpec.parse(model_args)
    spec.check_model()
    with quiet_lm_eval():
        manager = task_manager(tasks, include_paths, include_defaults)
        check_requests(check_data(manager, tasks), spec, limit, num_fewshot)
    run = GridRun(Path(out))
    options = {
        "lm_eval_tasks": list(tasks),
        "model_args": spec.args,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "include_paths": [str(p) for p in include_paths],
    }
    store = ResultStore(run.out, folders=(LM_EVAL_FOLDER,))
    evaluation = {"tasks": list(tasks), "num_fewshot": num_fewshot, "limit": limit, "bootstrap_iters": bootstrap_iters}
    with api.RunFolder(store, options, spec.config.model, spec.config.seed, overwrite) as folder:
        done = {cell_key(row) for row in store.rows()}  # configurations a run into this folder finished
        grid = grid or Grid(spec)
        folder.record(grid.engine.loaded.describe())
        for index, (label, cell) in enumerate(zip(grid.labels, spec.cells)):
            if cell_key(cell) in done:
                run.resumed.append(label)
                continue
            run.rows += evaluate_configuration(grid, index, manager, evaluation, store, run)
    run.summary = folder.summary
    run.notes = list(dict.fromkeys(run.notes))
    return run


def evaluate_configuration(grid: Grid, index: int, manager, evaluation: dict, store: ResultStore, run: GridRun) -> int:
    """One configuration of the grid through lm-eval (``simple_evaluate`` with ``evaluation``'s settings): its files
    in ``lm_eval/<configuration>/``, then its rows, last and in one write — a configuration with rows is done, and a
    rerun skips it. Returns how many rows it wrote."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker

    from pkvbench.lm_eval.backend import PkvbenchLM

    spec, label, cell = grid.spec, grid.labels[index], grid.spec.cells[index]
    started = time.perf_counter()
    view = PkvbenchLM(grid=grid, configuration=index)
    folder = run.out / LM_EVAL_FOLDER / label
    tracker = EvaluationTracker(output_path=str(folder))
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines per task and configuration bury ours
    model_args = {"pretrained": spec.config.model, "pkvbench": label}
    results = simple_evaluate(
        model=view,
        model_args=model_args,
        task_manager=manager,
        log_samples=True,
        evaluation_tracker=tracker,
        **evaluation,
    )
    run.seconds[label] = time.perf_counter() - started
    samples = results.pop("samples")
    engine_name = grid.engine.loaded.name
    rows = [result_row(spec, engine_name, cell, *document) for document in documents(samples, view.answered, run.notes)]
    store.begin()  # the run's first output: a folder being replaced loses its previous run here, not before
    remove_tree(folder)  # what an interrupted run left of this configuration (it has no rows): written anew
    tracker.save_results_aggregated(results=results, samples=samples)
    for task_name in results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    run.results[label] = results
    store.extend(rows)
    return len(rows)


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
