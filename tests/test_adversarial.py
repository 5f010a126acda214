"""pkvbench used as an adversarial but realistic user would: a table of (command, expected outcome) the suite runs.

Every way found to break a command becomes a row: the command line (``{tmp}`` is the case's own folder), the exit
code, a text the one line on stderr must hold (exit 2: ``pkvbench: error: …``, never a traceback), and an optional
setup that makes the folders and files the case needs. A case that fails must also leave every file as it found it:
nothing written, nothing deleted (checked on the whole of ``{tmp}``). Cases that get past a model load are marked
``model``; the rest fail before any model is loaded and run in a second or two each.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from pkvbench.cli import main
from pkvbench.lock import FolderLock

# --- folders as pkvbench writes them -----------------------------------------------------------------------------

OPTIONS = {"model": "smollm2-135m", "tasks": ["needle"], "policies": ["full", "snapkv"], "budgets": [64]}


def result_row(sample: str, policy: str = "full", budget=64, score: float = 1.0, **more) -> dict:
    return {
        "task": "needle",
        "sample_id": sample,
        "policy": policy,
        "budget": budget,
        "model": "smollm2-135m",
        "pred": "eat a sandwich",
        "score": score,
        **more,
    }


ROWS = [result_row("len500_depth0"), result_row("len500_depth0", "snapkv", score=0.5), result_row("len500_depth50")]


def make_run(folder: Path, rows: list[dict] = ROWS, options: dict = OPTIONS, extra: str = "") -> Path:
    """A run folder as ``pkvbench run`` leaves it: run.json, samples.jsonl (plus ``extra`` raw text), summary.csv."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.json").write_text(json.dumps({"options": options, "model": {"name": options["model"]}}))
    (folder / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + extra)
    (folder / "summary.csv").write_text("task,policy,budget,n,score\nneedle,full,64,2,100.0\n")
    return folder


def write(path: Path, data: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes, or a mark for one this user may not read) and folder (None) below ``root``."""

    def content(path: Path) -> bytes | None:
        if path.is_dir():
            return None
        try:
            return path.read_bytes()
        except PermissionError:
            return b"<unreadable>"

    return {str(p.relative_to(root)): content(p) for p in sorted(root.rglob("*"))}


@dataclass
class Context:
    """What a setup may use: the case's folder, pytest's monkeypatch, and what to undo after the command."""

    tmp: Path
    monkeypatch: pytest.MonkeyPatch
    cleanups: list[Callable[[], None]]
    armed: bool = False  # the simulated failures act only while the command runs


def deny_reading(ctx: Context, path: Path) -> None:
    """Take away the read permission of ``path``. Root reads such a file anyway, so as root opening it is also made to
    fail as it fails for everyone else."""
    mode = path.stat().st_mode
    path.chmod(0)
    ctx.cleanups.append(lambda: path.chmod(mode))
    if os.geteuid() != 0:
        return
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if ctx.armed and isinstance(file, (str, os.PathLike)) and Path(file).resolve() == path.resolve():
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    ctx.monkeypatch.setattr(builtins, "open", guarded)
    ctx.monkeypatch.setattr(io, "open", guarded)  # pathlib opens through io.open


def disk_full(ctx: Context) -> None:
    """Every fsync fails as on a full disk (where a write's blocks are allocated at the latest)."""
    real_fsync = os.fsync

    def full(fd):
        if ctx.armed:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    ctx.monkeypatch.setattr(os, "fsync", full)


def hold_lock(ctx: Context, folder: Path) -> None:
    """Lock ``folder`` as a run writing it does (the lock is the open file's, so this process's own run is refused)."""
    lock = FolderLock(folder)
    lock.acquire()
    ctx.cleanups.append(lock.release)


# --- setups ---------------------------------------------------------------------------------------------------------


def two_shards_and_a_user_folder(ctx: Context) -> None:
    make_run(ctx.tmp / "a", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(ctx.tmp / "b", ROWS[2:], {**OPTIONS, "shard": "2/2"})
    write(ctx.tmp / "existing" / "keep.txt", "a user's file")


def shards_beside_a_readme(ctx: Context) -> None:
    make_run(ctx.tmp / "dir" / "sh1", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(ctx.tmp / "dir" / "sh2", ROWS[2:], {**OPTIONS, "shard": "2/2"})
    write(ctx.tmp / "dir" / "README", "what these shards are")


def a_users_folder(ctx: Context) -> None:
    write(ctx.tmp / "mine" / "notes.txt", "notes")
    write(ctx.tmp / "mine" / "sub" / "deep.txt", "deeper")


def run_folder(ctx: Context) -> None:
    make_run(ctx.tmp / "run")


def run_folder_in_use(ctx: Context) -> None:
    """The folder a run (with the options of the case's command) has just started to write."""
    (ctx.tmp / "run").mkdir()
    hold_lock(ctx, ctx.tmp / "run")


def damaged(name: str, data: str | bytes) -> Callable[[Context], None]:
    """A run folder whose file ``name`` holds ``data`` instead."""

    def setup(ctx: Context) -> None:
        make_run(ctx.tmp / "run")
        write(ctx.tmp / "run" / name, data)

    return setup


def folder_instead_of(name: str) -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        make_run(ctx.tmp / "run")
        (ctx.tmp / "run" / name).unlink(missing_ok=True)
        (ctx.tmp / "run" / name).mkdir()

    return setup


def with_row(row: dict) -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        make_run(ctx.tmp / "run", [*ROWS, row])

    return setup


BASELINE_CSV = "model,task,policy,budget,n,score\nsmollm2-135m,needle,full,64,2,99.0\n"
CELLS_CSV = "model,task,policy,budget,query_mode,n,score,ci_low,ci_high\n"


def baseline_and_run(baseline: str | bytes, tolerances: str | None = None) -> Callable[[Context], None]:
    """A run folder, a baseline CSV ``b.csv`` beside it and, if given, a ``t.yaml`` of per-task tolerances."""

    def setup(ctx: Context) -> None:
        run_folder(ctx)
        write(ctx.tmp / "b.csv", baseline)
        if tolerances is not None:
            write(ctx.tmp / "t.yaml", tolerances)

    return setup


def unreadable_rows(ctx: Context) -> None:
    make_run(ctx.tmp / "run")
    deny_reading(ctx, ctx.tmp / "run" / "samples.jsonl")


def a_file(ctx: Context) -> None:
    write(ctx.tmp / "file", "a user's file")
    make_run(ctx.tmp / "run")


def predictions(*rows: dict) -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        write(ctx.tmp / "preds.jsonl", "".join(json.dumps(row) + "\n" for row in rows))

    return setup


def config(text: str) -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        write(ctx.tmp / "config.yaml", text)

    return setup


def longbench_file(text: str, unreadable: bool = False) -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        write(ctx.tmp / "data" / "narrativeqa.jsonl", text)
        if unreadable:
            deny_reading(ctx, ctx.tmp / "data" / "narrativeqa.jsonl")

    return setup


def small_trec(ctx: Context) -> None:
    write(ctx.tmp / "trec" / "train_5500.label", "HUM:ind Who wrote Hamlet ?\nHUM:ind Who is it ?\n")
    write(ctx.tmp / "trec" / "TREC_10.label", "LOC:city What city is the Louvre in ?\n")


def disk_full_with_a_report(ctx: Context) -> None:
    make_run(ctx.tmp / "run")
    write(ctx.tmp / "report.md", "the previous report")
    disk_full(ctx)


def disk_full_with_shards(ctx: Context) -> None:
    make_run(ctx.tmp / "a", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(ctx.tmp / "b", ROWS[2:], {**OPTIONS, "shard": "2/2"})
    disk_full(ctx)


def lock_is_a_folder(ctx: Context) -> None:
    (ctx.tmp / "run" / ".pkvbench.lock").mkdir(parents=True)


# --- the table ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    argv: str  # split on spaces after {tmp} is filled in
    code: int
    expected: str  # in the one stderr line (exit 2), or in the output (exit 0)
    setup: Callable[[Context], None] | None = None
    model: bool = False  # gets past a model load


RUN = "run --policy full,snapkv --budget 64 --lengths 500 --depths 0,50 --quiet"
NEEDLE = "run --policy full --budget 64 --lengths 400 --depths 50 --max-new-tokens 4 --quiet"
CASES = [
    # 1-3: nothing pkvbench did not create is ever deleted or overwritten
    Case("merge-into-an-existing-folder", "merge {tmp}/a {tmp}/b --out {tmp}/existing", 2, "is not empty",
         two_shards_and_a_user_folder),
    Case("merge-into-the-inputs-folder", "merge {tmp}/dir/sh1 {tmp}/dir/sh2 --out {tmp}/dir", 2,
         "contains the input", shards_beside_a_readme),
    Case("merge-onto-an-input", "merge {tmp}/dir/sh1 {tmp}/dir/sh2 --out {tmp}/dir/sh2", 2, "is the input",
         shards_beside_a_readme),
    Case("overwrite-a-users-folder", f"{RUN} --out {{tmp}}/mine --overwrite", 2,
         "is not a pkvbench run folder (no run.json); pkvbench replaces only its own run folders", a_users_folder),
    Case("overwrite-a-file", f"{RUN} --out {{tmp}}/file --overwrite", 2, "is a file", a_file),
    Case("run-over-a-users-summary", f"{RUN} --out {{tmp}}/mine", 2,
         "holds summary.csv but no run.json: not a pkvbench run folder",
         lambda ctx: write(ctx.tmp / "mine" / "summary.csv", "a,b\n1,2\n")),
    # 4: one writer per folder
    Case("run-into-a-folder-in-use", f"{RUN} --out {{tmp}}/run", 2,
         "is in use by another pkvbench process (pid ", run_folder_in_use),
    Case("merge-a-folder-in-use", "merge {tmp}/run --out {tmp}/merged", 2, "is being written by a running pkvbench",
         lambda ctx: (make_run(ctx.tmp / "run"), hold_lock(ctx, ctx.tmp / "run"))),
    Case("lock-file-is-a-folder", f"{RUN} --out {{tmp}}/run", 2, "cannot lock", lock_is_a_folder),
    # 6: lengths beyond the model's context, before any work
    Case("ten-million-tokens", "run --lengths 10000000 --out {tmp}/o", 2,
         "--lengths 10000000: needle's prompt with its 32-token answer exceeds the context window of smollm2-135m "
         "(8192 tokens)"),
    Case("ten-million-tokens-funnel", "funnel --lengths 10000000 --out {tmp}/o", 2,
         "needle's prompt with nothing else exceeds the context window"),
    Case("answer-beyond-the-context", "run --lengths 1000 --max-new-tokens 9000 --out {tmp}/o", 2,
         "with its 9000-token answer exceeds the context window"),
    Case("max-length-beyond-the-context", "run --task narrativeqa --max-length 100000 --out {tmp}/o", 2,
         "--max-length 100000: narrativeqa's prompt"),
    Case("default-lengths-beyond-a-small-model", "run --model {tmp}/small --out {tmp}/o", 2,
         "needle's default length 4000: needle's prompt",
         lambda ctx: write(ctx.tmp / "small" / "config.json", '{"model_type": "llama", "max_position_embeddings": 2048}')),
    # 7: policy options checked when parsed
    Case("snapkv-window-0", "run --policy snapkv:window=0 --out {tmp}/o", 2, "snapkv: window must be at least 1"),
    Case("pyramidkv-window-0", "run --policy pyramidkv:window=0 --out {tmp}/o", 2,
         "pyramidkv: window must be at least 1"),
    Case("policy-arg-window-0", "run --policy snapkv,h2o --policy-arg window=0 --out {tmp}/o", 2,
         "window must be at least 1"),
    Case("budgets-window-0", "budgets --policy snapkv:window=0", 2, "snapkv: window must be at least 1"),
    Case("budgets-pyramid-window-0", "budgets --policy pyramidkv:window=0", 2, "pyramidkv: window must be at least 1"),
    # 8: a damaged run folder
    Case("run-json-empty", f"{RUN} --out {{tmp}}/run", 2, "run.json is not valid JSON", damaged("run.json", "")),
    Case("run-json-invalid", f"{RUN} --out {{tmp}}/run", 2, "is not valid JSON", damaged("run.json", "{options")),
    Case("run-json-a-list", f"{RUN} --out {{tmp}}/run", 2, "is not pkvbench's", damaged("run.json", "[]")),
    Case("run-json-options-not-a-mapping", f"{RUN} --out {{tmp}}/run", 2, "is not pkvbench's",
         damaged("run.json", '{"options": 3}')),
    Case("run-json-not-utf8", f"{RUN} --out {{tmp}}/run", 2, "is not UTF-8 text", damaged("run.json", b"\xff\xfe{")),
    Case("overwrite-a-damaged-run", f"{RUN} --out {{tmp}}/run --overwrite", 2,
         "will not resume or replace a folder it cannot recognise", damaged("run.json", "")),
    Case("row-empty-object", f"{RUN} --out {{tmp}}/run", 2, "samples.jsonl, line 4: not a pkvbench result row",
         with_row({})),
    Case("row-not-utf8", f"{RUN} --out {{tmp}}/run", 2, "samples.jsonl is not UTF-8 text",
         damaged("samples.jsonl", b'{"task": "needle\xff"}\n')),
    Case("row-a-list", f"{RUN} --out {{tmp}}/run", 2, "line 1: expected a JSON object, got list",
         damaged("samples.jsonl", "[1, 2]\n")),
    Case("row-half-json", f"{RUN} --out {{tmp}}/run", 2, "line 1: not valid JSON",
         damaged("samples.jsonl", '{"task": \n{}\n')),
    Case("rows-are-a-folder", f"{RUN} --out {{tmp}}/run", 2, "samples.jsonl is a folder where pkvbench keeps a file",
         folder_instead_of("samples.jsonl")),
    Case("run-json-is-a-folder", f"{RUN} --out {{tmp}}/run", 2, "run.json is a folder", folder_instead_of("run.json")),
    Case("summary-is-a-folder", f"{RUN} --out {{tmp}}/run", 2, "summary.csv is a folder",
         folder_instead_of("summary.csv")),
    Case("merge-a-damaged-run", "merge {tmp}/run --out {tmp}/m", 2, "is not valid JSON", damaged("run.json", "")),
    Case("merge-damaged-rows", "merge {tmp}/run --out {tmp}/m", 2, "line 4: budget must be a number",
         with_row(result_row("x", budget="abc"))),
    # 9: report, plot and score on malformed rows and files
    Case("report-budget-abc", "report {tmp}/run", 2, "samples.jsonl, line 4: budget must be a number, got 'abc'",
         with_row(result_row("x", budget="abc"))),
    Case("report-budget-null", "report {tmp}/run", 2, "line 4: budget must be a number, got None",
         with_row(result_row("x", budget=None))),
    Case("report-budget-zero", "report {tmp}/run", 2, "line 4: budget '0' must be positive",
         with_row(result_row("x", budget=0))),
    Case("report-score-text", "report {tmp}/run", 2, "line 4: score must be a number", with_row(result_row("x", score="high"))),
    Case("report-sample-id-list", "report {tmp}/run", 2, "line 4: sample_id must be an id",
         with_row(result_row([1], budget=64))),
    Case("report-rows-not-utf8", "report {tmp}/run", 2, "is not UTF-8 text",
         damaged("samples.jsonl", b"\xff\xfe\n")),
    Case("report-rows-unreadable", "report {tmp}/run", 2, "cannot read", unreadable_rows),
    Case("report-rows-are-a-folder", "report {tmp}/run", 2, "Is a directory", folder_instead_of("samples.jsonl")),
    Case("plot-budget-abc", "plot {tmp}/run --out {tmp}/figs", 2, "budget must be a number",
         with_row(result_row("x", budget="abc"))),
    Case("plot-rows-unreadable", "plot {tmp}/run --out {tmp}/figs", 2, "cannot read", unreadable_rows),
    Case("score-dataset-a-list", "score {tmp}/preds.jsonl", 2, "line 1: the dataset must be a name",
         predictions({"dataset": ["trec"], "pred": "x", "answers": ["x"]})),
    Case("score-all-classes-a-number", "score {tmp}/preds.jsonl", 2, "line 1: 'all_classes' must be a list of strings",
         predictions({"dataset": "trec", "pred": "x", "answers": ["x"], "all_classes": 5})),
    Case("score-all-classes-a-string", "score {tmp}/preds.jsonl", 2, "'all_classes' must be a list of strings",
         predictions({"dataset": "trec", "pred": "x", "answers": ["x"], "all_classes": "Location"})),
    Case("score-answers-numbers", "score {tmp}/preds.jsonl", 2, "line 1: needs 'pred' (a string) and 'answers'",
         predictions({"dataset": "narrativeqa", "pred": "x", "answers": [1, 2]})),
    Case("score-pred-a-number", "score {tmp}/preds.jsonl", 2, "needs 'pred' (a string)",
         predictions({"dataset": "narrativeqa", "pred": 3, "answers": ["x"]})),
    Case("score-policy-a-list", "score {tmp}/preds.jsonl", 2, "'policy' must be a string",
         predictions({"dataset": "narrativeqa", "pred": "x", "answers": ["x"], "policy": ["a"]})),
    Case("score-budget-a-mapping", "score {tmp}/preds.jsonl", 2, "'budget' must be a number",
         predictions({"dataset": "narrativeqa", "pred": "x", "answers": ["x"], "budget": {"k": 1}})),
    # 10: --out below an existing file
    Case("run-out-below-a-file", f"{RUN} --out {{tmp}}/file/sub", 2, "cannot create", a_file),
    Case("run-out-a-file", f"{RUN} --out {{tmp}}/file", 2, "is a file", a_file),
    Case("plot-out-below-a-file", "plot {tmp}/run --out {tmp}/file/sub", 2, "cannot create", a_file),
    Case("plot-out-a-file", "plot {tmp}/run --out {tmp}/file", 2, "is a file", a_file),
    Case("report-out-below-a-file", "report {tmp}/run --out {tmp}/file/report.md", 2, "cannot write", a_file),
    Case("funnel-out-a-file", "funnel --lengths 500 --out {tmp}/file", 2, "is a file", a_file),
    Case("budgets-plot-unknown-format", "budgets --plot {tmp}/budgets.xyz", 2, "use a .png, .pdf or .svg file name"),
    # 12: a full disk is one line, and the previous file survives (checked by the no-change rule)
    Case("report-disk-full", "report {tmp}/run --out {tmp}/report.md", 2, "No space left on device",
         disk_full_with_a_report),
    Case("merge-disk-full", "merge {tmp}/a {tmp}/b --out {tmp}/merged", 2, "No space left on device",
         disk_full_with_shards),
    # 5 and 9: the gate cannot be switched off by a typo, nor pass over nothing
    Case("check-tolerance-nan", "check --baseline {tmp}/b.csv --results {tmp}/run --tolerance nan", 2,
         "--tolerance nan: give a finite, non-negative number of points", baseline_and_run(BASELINE_CSV)),
    Case("check-tolerance-infinite", "check --baseline {tmp}/b.csv --results {tmp}/run --tolerance inf", 2,
         "--tolerance inf: give a finite", baseline_and_run(BASELINE_CSV)),
    Case("check-baseline-header-only", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "has no cells: a gate over nothing would pass anything", baseline_and_run("model,task,policy,budget,n,score\n")),
    Case("check-baseline-not-numeric", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "score 'ninety-nine' is not a number",
         baseline_and_run("model,task,policy,budget,n,score\nsmollm2-135m,needle,full,64,2,ninety-nine\n")),
    Case("check-baseline-not-utf8", "check --baseline {tmp}/b.csv --results {tmp}/run", 2, "is not a readable CSV",
         baseline_and_run(b"model,task\n\xff\xfe,1\n")),
    Case("check-baseline-a-folder", "check --baseline {tmp}/run --results {tmp}/run", 2, "run' is a directory",
         run_folder),
    Case("check-per-cell-misspelled", "check --baseline {tmp}/b.csv --results {tmp}/run --per-cell {tmp}/t.yaml", 2,
         "t.yaml: neddle is not a task of the baseline (needle)",
         baseline_and_run(BASELINE_CSV, tolerances="neddle: 50\n")),
    Case("check-per-cell-nan", "check --baseline {tmp}/b.csv --results {tmp}/run --per-cell {tmp}/t.yaml", 2,
         "expected a mapping of task name to a finite, non-negative tolerance",
         baseline_and_run(BASELINE_CSV, tolerances="needle: .nan\n")),
    Case("check-budget-abc", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "line 4: budget must be a number, got 'abc'",
         lambda ctx: (baseline_and_run(BASELINE_CSV)(ctx), with_row(result_row("x", budget="abc"))(ctx))),
    Case("check-update-below-a-file", "check --baseline {tmp}/file/b.csv --results {tmp}/run --update", 2,
         "file", lambda ctx: (run_folder(ctx), a_file(ctx))),
    # issue 26: an inconsistent baseline is not trusted, and no tolerance so wide that nothing could fail
    Case("check-tolerance-wider-than-any-fall", "check --baseline {tmp}/b.csv --results {tmp}/run --tolerance 1e308", 2,
         "--tolerance 1e+308: no score can fall by 100 points or more", baseline_and_run(BASELINE_CSV)),
    Case("check-baseline-score-above-100", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "b.csv, row 1 (needle full 64 aware): score 105.5 is outside [0, 100]",
         baseline_and_run(CELLS_CSV + "smollm2-135m,needle,full,64,aware,2,105.5,93.33,97.67\n")),
    Case("check-baseline-score-outside-its-interval", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "score 99 lies outside its own interval [93.33, 97.67]",
         baseline_and_run(CELLS_CSV + "smollm2-135m,needle,full,64,aware,2,99,93.33,97.67\n")),
    Case("check-baseline-interval-minus-inf", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "interval [-inf, 97.67] is outside [0, 100]",
         baseline_and_run(CELLS_CSV + "smollm2-135m,needle,full,64,aware,2,95.5,-inf,97.67\n")),
    # silently accepted or misleading, before
    Case("budget-empty-item", "run --budget 128,,64 --out {tmp}/o", 2, "--budget '128,,64' has an empty item"),
    Case("budget-trailing-comma", "run --budget 128, --out {tmp}/o", 2, "has an empty item"),
    Case("policy-empty-item", "run --policy full,,snapkv --out {tmp}/o", 2, "--policy 'full,,snapkv' has an empty item"),
    Case("lengths-empty-item", "run --lengths 1000,,2000 --out {tmp}/o", 2, "--lengths '1000,,2000' has an empty"),
    Case("lengths-for-longbench", "run --task trec --lengths 1000 --out {tmp}/o", 2,
         "--lengths shapes none of the tasks asked for (trec)"),
    Case("depths-for-ruler", "run --task niah_single_1 --depths 50 --out {tmp}/o", 2, "--depths shapes none"),
    Case("max-length-for-needle", "run --max-length 500 --out {tmp}/o", 2, "--max-length shapes none"),
    Case("config-duplicate-key", "run --config {tmp}/config.yaml --out {tmp}/o", 2, "the key 'budget' is given twice",
         config("budget: 64\nbudget: 128\n")),
    Case("report-over-the-rows", "report {tmp}/run --out {tmp}/run/samples.jsonl", 2,
         "would overwrite the samples.jsonl of the input folder", run_folder),
    Case("report-over-run-json", "report {tmp}/run --out {tmp}/run/run.json", 2, "would overwrite the run.json",
         run_folder),
    Case("score-over-a-summary", "score {tmp}/run/samples.jsonl --dataset narrativeqa --out {tmp}/run/summary.csv", 2,
         "would overwrite the summary.csv", run_folder),
    Case("score-over-its-input", "score {tmp}/preds.jsonl --out {tmp}/preds.jsonl", 2, "must not be the input file",
         predictions({"dataset": "narrativeqa", "pred": "x", "answers": ["x"]})),
    Case("budget-nan", "run --budget nan --out {tmp}/o", 2, "must be positive"),
    Case("budget-infinite", "run --budget 1e999 --out {tmp}/o", 2, "must be positive"),
    Case("lengths-nan", "run --lengths nan --out {tmp}/o", 2, "is not an integer"),
    Case("depths-infinite", "run --depths inf --out {tmp}/o", 2, "is not a finite number"),
    Case("shard-beyond", "run --shard 3/2 --out {tmp}/o", 2, "1 <= i <= n"),
    # what is allowed stays allowed
    Case("report-beside-the-rows", "report {tmp}/run --out {tmp}/run/report.md", 0, "table →", run_folder),
    Case("merge-into-an-empty-folder", "merge {tmp}/a {tmp}/b --out {tmp}/empty", 0, "3 rows from 2 folders",
         lambda ctx: (two_shards_and_a_user_folder(ctx), (ctx.tmp / "empty").mkdir())),
    # past the model load: the model is real, the failure still one line
    Case("needle-sample-id-nosuch", f"{NEEDLE} --sample-id nosuch --out {{tmp}}/o", 2,
         "--sample-id nosuch: no such sample (sample ids are needle: len<length>_depth<depth> (several needles: "
         "len<length>_rot<rotation>))", model=True),
    Case("needle-too-short", "run --policy full --lengths 5 --depths 50 --quiet --out {tmp}/o", 2,
         "--lengths 5 is too short; the prompt without any haystack", model=True),
    Case("shard-without-samples", f"{NEEDLE} --shard 2/2 --out {{tmp}}/o", 2,
         "--shard 2/2: the run has 1 sample(s), none of them for this shard", model=True),
    Case("longbench-empty-data-file", "run --task narrativeqa --data-dir {tmp}/data --no-verify --out {tmp}/o", 2,
         "narrativeqa has no samples to run (is its data file empty?)", longbench_file(""), model=True),
    Case("longbench-unreadable-with-checksum", "run --task narrativeqa --data-dir {tmp}/data --out {tmp}/o", 2,
         "cannot read", longbench_file('{"input": "q", "context": "c", "answers": ["a"], "_id": "1"}\n', True),
         model=True),
    Case("trec-training-too-small", "run --task trec-fewshot --data-dir {tmp}/trec --no-verify --lengths 2000 "
         "--limit 1 --policy full --out {tmp}/o", 2, "trec-fewshot (2 training questions): --lengths 2000 is more than",
         small_trec, model=True),
]  # fmt: skip


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.name, marks=[pytest.mark.model] if c.model else []) for c in CASES]
)
def test_adversarial(case: Case, tmp_path, monkeypatch, capsys):
    ctx = Context(tmp_path, monkeypatch, [])
    if case.setup:
        case.setup(ctx)
    before = snapshot(tmp_path)
    try:
        ctx.armed = True
        with pytest.raises(SystemExit) as exit_info:
            main(case.argv.format(tmp=tmp_path).split())
        ctx.armed = False
        monkeypatch.undo()  # the real file functions again, for the checks
        after = snapshot(tmp_path)
    finally:
        for cleanup in ctx.cleanups:
            cleanup()
    out = capsys.readouterr()
    assert exit_info.value.code == case.code, out.err
    assert "Traceback" not in out.err
    if case.code == 0:
        assert case.expected in out.out + out.err
        return
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("pkvbench: error: ") and case.expected in lines[0], lines[0]
    if not case.model:  # refused before anything ran: every file as it was, nothing new
        assert after == before
