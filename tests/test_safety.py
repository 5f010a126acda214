"""Never lose a user's files: overwrite and merge rules, one writer per folder (two real processes), atomic rewrites,
duplicate rows counted once, and prompts that cannot fit the model refused before any work."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from pkvbench.cli import main
from pkvbench.errors import PkvError
from pkvbench.reports.summary import summarize
from pkvbench.run import merge
from pkvbench.store.lock import LOCK_NAME, FolderLock
from pkvbench.store.results import ResultStore, differing_options, read_rows, row_key
from tests.test_adversarial import OPTIONS, ROWS, make_run, snapshot, write

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def users_files(folder: Path) -> None:
    """What people keep beside results: a note, a report, figures in a subfolder."""
    write(folder / "NOTES.md", "why this run exists")
    write(folder / "report.md", "| a table |")
    write(folder / "figures" / "mine.png", b"\x89PNG not really")


# --- merge -------------------------------------------------------------------------------------------------------


def test_merge_never_touches_an_existing_folder_or_the_inputs_folder(tmp_path, capsys):
    """Issue cases 1 and 2: a merge into a folder with a user's file, or into the folder holding its inputs (with a
    README beside them), deleted them. Now both are refused and every file stays; a merge into a new folder works."""
    shards = tmp_path / "dir"
    make_run(shards / "sh1", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(shards / "sh2", ROWS[2:], {**OPTIONS, "shard": "2/2"})
    write(shards / "README", "what these shards are")
    write(tmp_path / "existing" / "keep.txt", "a user's file")
    before = snapshot(tmp_path)

    for out, message in ((tmp_path / "existing", "is not empty"), (shards, "contains the input")):
        code, _, err = cli(capsys, "merge", str(shards / "sh1"), str(shards / "sh2"), "--out", str(out))
        assert code == 2 and message in err
        assert snapshot(tmp_path) == before

    code, out, _ = cli(capsys, "merge", str(shards / "sh1"), str(shards / "sh2"), "--out", str(tmp_path / "merged"))
    assert code == 0 and "3 rows from 2 folders" in out
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("merged")} == before
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == ["run.json", "samples.jsonl", "summary.csv"]
    assert len(read_rows(tmp_path / "merged")) == 3


def test_a_merge_that_fails_part_way_leaves_no_files(tmp_path, monkeypatch, capsys):
    make_run(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    real_replace = os.replace

    def fail_on_summary(source, target):
        if str(target).endswith("summary.csv"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", fail_on_summary)
    code, _, err = cli(capsys, "merge", str(tmp_path / "a"), "--out", str(tmp_path / "empty"))
    assert code == 2 and "summary.csv: No space left on device" in err
    assert list((tmp_path / "empty").iterdir()) == []  # the folder it was given stays, empty
    code, _, err = cli(capsys, "merge", str(tmp_path / "a"), "--out", str(tmp_path / "new"))
    assert code == 2 and not (tmp_path / "new").exists()  # the folder it made goes again


# --- --overwrite ---------------------------------------------------------------------------------------------------


def test_overwrite_refuses_a_folder_that_is_not_a_run_before_any_model_load(tmp_path, capsys):
    """Issue case 3: `--overwrite` deleted a user's folder whole, then failed on the model anyway."""
    users_files(tmp_path / "mine")
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, "run", "--model", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "mine"),
                       "--overwrite")  # fmt: skip
    assert code == 2 and "is not a pkvbench run folder (no run.json)" in err and "deleted nothing" in err
    assert snapshot(tmp_path) == before


def test_overwrite_changes_nothing_when_the_model_fails_to_load(tmp_path, capsys):
    """The old results go only once the new run's model has loaded: an unloadable model leaves them all."""
    run = make_run(tmp_path / "run")
    users_files(run)
    write(tmp_path / "gpt2" / "config.json", json.dumps({"model_type": "gpt2", "n_layer": 2}))
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, "run", "--model", str(tmp_path / "gpt2"), "--out", str(run), "--overwrite", "--quiet")
    assert code == 2 and "supported architectures" in err and len(err.strip().splitlines()) == 1
    assert snapshot(tmp_path) == before


def test_a_model_that_fails_to_load_leaves_no_folder_behind(tmp_path, capsys):
    """It used to leave a run.json that refused the corrected rerun ("other options")."""
    write(tmp_path / "gpt2" / "config.json", json.dumps({"model_type": "gpt2", "n_layer": 2}))
    code, _, _ = cli(capsys, "run", "--model", str(tmp_path / "gpt2"), "--out", str(tmp_path / "new"), "--quiet")
    assert code == 2 and not (tmp_path / "new").exists()


@pytest.mark.model
def test_overwrite_replaces_only_pkvbench_files(tmp_path, capsys):
    args = ["run", "--policy", "full", "--lengths", "400", "--depths", "50", "--max-new-tokens", "4", "--quiet"]
    out = tmp_path / "run"
    assert cli(capsys, *args, "--budget", "64", "--out", str(out))[0] == 0
    users_files(out)
    theirs = {k: v for k, v in snapshot(out).items() if k in ("NOTES.md", "report.md", "figures", "figures/mine.png")}
    code, printed, err = cli(capsys, *args, "--budget", "32", "--out", str(out), "--overwrite")
    assert code == 0, err
    assert "1 rows written, 0 already done" in printed
    assert [row["budget"] for row in read_rows(out)] == [32]
    assert {k: v for k, v in snapshot(out).items() if k in theirs} == theirs
    assert not (out / LOCK_NAME).exists()  # let go of, and removed, when the run ended


def test_two_merges_into_one_new_folder_write_each_row_once(tmp_path, monkeypatch, capsys):
    """Issue 30, case 4: two merges into the same new --out at once both succeeded and every row was written twice:
    the "empty --out" check ran before the lock. Here the second merge's early check passes as it did in the race
    (the first had not written yet), and the check under the lock refuses it."""
    make_run(tmp_path / "a", ROWS[:2], {**OPTIONS, "shard": "1/2"})
    make_run(tmp_path / "b", ROWS[2:], {**OPTIONS, "shard": "2/2"})
    merged = tmp_path / "merged"
    assert cli(capsys, "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(merged))[0] == 0
    before = snapshot(tmp_path)
    monkeypatch.setattr(merge, "_check_merge_target", lambda out, folders: None)
    code, _, err = cli(capsys, "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(merged))
    assert code == 2 and "is not empty" in err
    assert snapshot(tmp_path) == before and len(read_rows(merged)) == 3


# --- resuming under other versions ---------------------------------------------------------------------------------


def session(**versions) -> dict:
    return {"versions": {"pkvbench": "1", "torch": "2", "transformers": "5", "python": "3.11", **versions},
            "commit": "a" * 40, "started": "then"}  # fmt: skip


def test_a_resume_under_other_versions_is_refused_or_noted_and_the_record_keeps_its_history(tmp_path):
    """Issue 30, case 6: a folder written under other versions was resumed silently and its provenance overwritten."""
    make_run(tmp_path / "run")
    write(tmp_path / "run" / "run.json", json.dumps({"options": OPTIONS, **session()}))
    for changed in ({"transformers": "4"}, {"torch": "1.9"}, {"pkvbench": "0.9"}, {"model_package": "x==2"}):
        first = session(model_package="x==1")
        write(tmp_path / "run" / "run.json", json.dumps({"options": OPTIONS, **first}))
        name = next(iter(changed))
        with pytest.raises(PkvError, match=f"was run under other versions \\({name} .* → {changed[name]}\\)"):
            ResultStore(tmp_path / "run").claim(
                OPTIONS, session={**first, "versions": {**first["versions"], **changed}}
            )
    write(tmp_path / "run" / "run.json", json.dumps({"options": OPTIONS, **session()}))
    later = {**session(python="3.12"), "commit": "b" * 40, "started": "now"}
    with ResultStore(tmp_path / "run").claim(OPTIONS, session=later) as store:
        assert store.notes == [f"{tmp_path / 'run'}: resumed under python 3.11 → 3.12, commit aaaaaaaaaa → bbbbbbbbbb "
                               "(rows so far from the first)"]  # fmt: skip
        store.record({"options": OPTIONS, **later})
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["versions"]["python"] == "3.11" and record["started"] == "then"  # the first session's
    assert record["resumed"] == [{"versions": later["versions"], "commit": "b" * 40, "started": "now"}]
    # Without rows there is nothing to keep apart; --overwrite starts afresh under the new versions.
    with ResultStore(tmp_path / "run").claim(OPTIONS, overwrite=True, session=session(transformers="4")):
        pass


# --- the writing rule ----------------------------------------------------------------------------------------------


def test_the_writing_rule_recognises_what_pkvbench_wrote_and_nothing_else(tmp_path):
    from pkvbench.run.funnel import funnel_store
    from pkvbench.store.outputs import MANIFEST, RESULTS_FILES, Outputs
    from tests.helpers import write_file

    assert {path.name for path in funnel_store(tmp_path / "f").own_paths} <= RESULTS_FILES
    report = tmp_path / "out" / "report.md"
    write_file(report, "first")
    write_file(report, "second")  # its own file, unchanged since: replaced
    assert report.read_text() == "second" and json.loads((report.parent / MANIFEST).read_text())["files"]["report.md"]
    report.write_text("second, edited by hand")
    with pytest.raises(PkvError, match="report.md exists and pkvbench did not write it \\(or it was changed since\\)"):
        write_file(report, "third")
    # A link to a file is followed: the file it names is what is judged (and written).
    (tmp_path / "link.md").symlink_to(tmp_path / "out" / "other.md")
    write_file(tmp_path / "link.md", "through the link")
    assert (tmp_path / "link.md").is_symlink() and (tmp_path / "out" / "other.md").read_text() == "through the link"
    # Every file of a command is checked before the first is written.
    write(tmp_path / "out" / "b.md", "a user's")
    outputs = Outputs("--out")
    outputs.add(tmp_path / "out" / "a.md", "a")
    with pytest.raises(PkvError, match="b.md exists"):
        outputs.add(tmp_path / "out" / "b.md", "b")
    assert not (tmp_path / "out" / "a.md").exists()


# --- one writer per folder -----------------------------------------------------------------------------------------

HOLD = (
    "import sys, time\nfrom pkvbench.store.lock import FolderLock\n"
    "FolderLock(sys.argv[1]).acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n"
)


def test_a_folder_locked_by_another_process_is_refused_with_its_holder(tmp_path, capsys):
    """A second writer is refused whatever the folder holds, naming the first (pid, host, command, since when);
    a holder killed by SIGKILL leaves no lock behind."""
    make_run(tmp_path / "run", options={**OPTIONS, "shard": "1/2"})
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = cli(capsys, "run", "--out", str(tmp_path / "run"), "--quiet")
        assert code == 2 and f"is in use by another pkvbench process (pid {holder.pid} on " in err
        code, _, err = cli(capsys, "merge", str(tmp_path / "run"), "--out", str(tmp_path / "merged"))
        assert code == 2 and f"is being written by a running pkvbench (pid {holder.pid}" in err
    finally:
        holder.send_signal(signal.SIGKILL)  # as a run killed mid-way: no clean-up of its own
        holder.wait()
    # The lock went with the process; the file it leaves is no obstacle.
    assert (tmp_path / "run" / LOCK_NAME).exists()
    with ResultStore(tmp_path / "run").claim({**OPTIONS, "shard": "1/2"}) as store:
        assert store.lock.held and len(store.rows()) == 3
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_the_lock(tmp_path):
    first, second = FolderLock(tmp_path), FolderLock(tmp_path)
    assert first.holder() is None
    first.acquire()
    with pytest.raises(PkvError, match=rf"in use by another pkvbench process \(pid {os.getpid()} on .*, since 20"):
        second.acquire()
    assert str(os.getpid()) in first.holder()
    first.release()
    assert not first.path.exists() and first.holder() is None
    with second:
        assert second.held
    assert not second.held


@pytest.mark.model
def test_two_runs_into_one_folder_at_once(tmp_path, capsys):
    """Issue case 4: two identical runs into one folder wrote every row twice (summary n = 6 for 3 samples). Now the
    second is refused while the first runs, naming it, and the folder holds one complete, duplicate-free result."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "pkvbench", "run", "--policy", "full,snapkv", "--budget", "64", "--lengths",
               "400", "--depths", "0,25,50,75,100", "--max-new-tokens", "4", "--quiet", "--out", str(out)]  # fmt: skip
    first = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / LOCK_NAME).is_file() or str(first.pid) not in (out / LOCK_NAME).read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.02)
    second = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert second.returncode == 2
    assert second.stderr.startswith(f"pkvbench: error: {out} is in use by another pkvbench process (pid {first.pid} ")
    assert "pkvbench run --policy full,snapkv" in second.stderr and second.stderr.count("\n") == 1
    _, err = first.communicate(timeout=600)
    assert first.returncode == 0, err

    rows = read_rows(out)
    assert len(rows) == 10 == len({row_key(r) for r in rows})
    assert list(pd.read_csv(out / "summary.csv")["n"]) == [5, 5]
    # Rows written twice (what the unlocked runs left) count once, with a note, and a rerun adds none.
    with open(out / "samples.jsonl", "a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    code, printed, err = cli(capsys, *command[3:])
    assert code == 0 and "0 rows written, 10 already done" in printed
    assert "repeat the key of an earlier row; each key is counted once" in err
    assert list(pd.read_csv(out / "summary.csv")["n"]) == [5, 5]


# --- reading a folder -------------------------------------------------------------------------------------------


def test_rows_written_twice_count_once_with_a_note(tmp_path, capsys):
    make_run(tmp_path / "run", ROWS + ROWS)
    store = ResultStore(tmp_path / "run")
    assert store.rows() == ROWS and store.duplicates == 3
    assert list(store.write_summary(summarize(store.rows()))["n"]) == [2, 1]  # not 4 and 2
    code, _, err = cli(capsys, "report", str(tmp_path / "run"))
    assert code == 0 and "samples.jsonl: 3 row(s) repeat the key of an earlier row" in err


def test_options_in_another_order_are_the_same_run(tmp_path):
    """Reordering --policy was refused as "policies differ"; the grid is the same."""
    options = {**OPTIONS, "policies": ["full", "snapkv"], "budgets": [64, 0.1], "tasks": ["needle", "trec"]}
    reordered = {**options, "policies": ["snapkv", "full"], "budgets": [0.1, 64], "tasks": ["trec", "needle"]}
    assert differing_options(options, reordered) == []
    # With a shard, the order of the tasks decides which shard takes a sample: another order is another run.
    assert differing_options({**options, "shard": "1/2"}, {**reordered, "shard": "1/2"}) == ["tasks"]
    make_run(tmp_path / "run", options=options)
    with ResultStore(tmp_path / "run").claim(reordered) as store:
        assert len(store.rows()) == 3  # resumed, not replaced


def test_a_run_without_rows_may_take_other_options(tmp_path):
    make_run(tmp_path / "run", rows=[])
    with ResultStore(tmp_path / "run").claim({**OPTIONS, "budgets": [32]}) as store:
        store.record({"options": {**OPTIONS, "budgets": [32]}})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["options"]["budgets"] == [32]
    assert not (tmp_path / "run" / "summary.csv").exists()  # the previous run's files went with it


def test_leftovers_of_a_killed_run_do_not_make_a_folder_foreign(tmp_path):
    write(tmp_path / "run" / LOCK_NAME, "")  # a SIGKILLed run's lock file
    write(tmp_path / "run" / ".run.json.x1y2.tmp", "{")  # ... and its half-written staging file
    with ResultStore(tmp_path / "run").claim(OPTIONS, overwrite=True) as store:
        store.record({"options": OPTIONS})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["options"] == OPTIONS


# --- atomic rewrites and a full disk -------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_a_failed_rewrite_leaves_the_previous_version(tmp_path, monkeypatch, failing):
    """Issue cases 8 and 12: run.json was rewritten in place (a kill left it empty), and a full disk left summary.csv
    at 0 bytes. Now both are written beside and renamed over: a failure leaves the previous file, and no debris."""
    run = make_run(tmp_path / "run")
    before = snapshot(tmp_path)

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, failing, full)
    store = ResultStore(run)
    with pytest.raises(PkvError, match=r"cannot write .*summary.csv: No space left on device"):
        store.write_summary(summarize(store.rows()))
    with pytest.raises(PkvError, match=r"cannot write .*run.json: No space left on device"):
        store.record({"options": OPTIONS, "model": {"name": "other"}})
    monkeypatch.undo()
    assert snapshot(tmp_path) == before


def test_appending_to_a_full_disk_is_one_line_and_keeps_the_rows(tmp_path, monkeypatch):
    run = make_run(tmp_path / "run")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(PkvError, match=r"cannot write .*samples.jsonl: No space left"):
        ResultStore(run).append(ROWS[0])
    monkeypatch.undo()
    assert read_rows(run) == ROWS


def test_atomic_writes_keep_permissions(tmp_path):
    make_run(tmp_path / "run").joinpath("summary.csv").chmod(0o640)
    ResultStore(tmp_path / "run").write_summary(summarize([]))
    assert (tmp_path / "run" / "summary.csv").stat().st_mode & 0o777 == 0o640
    ResultStore(tmp_path / "new").open({"options": OPTIONS})
    assert (tmp_path / "new" / "run.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.model
def test_a_full_disk_during_a_run_is_one_line_and_keeps_the_summary(tmp_path, monkeypatch, capsys):
    args = ["run", "--policy", "full", "--budget", "64", "--lengths", "400", "--depths", "0,50", "--max-new-tokens",
            "4", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    assert cli(capsys, *args)[0] == 0
    rows = (tmp_path / "run" / "samples.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "run" / "samples.jsonl").write_text(rows[0])  # as if the run had been stopped after a row
    summary = (tmp_path / "run" / "summary.csv").read_bytes()
    real_fsync = os.fsync

    def fills_up(fd):  # the disk is full for the rows and the summary (run.json still fits)
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        if name == "samples.jsonl" or name.startswith(".summary.csv."):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fills_up)
    code, _, err = cli(capsys, *args)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("pkvbench: error: cannot write ") and "samples.jsonl: No space left on device" in err
    assert (tmp_path / "run" / "summary.csv").read_bytes() == summary
    monkeypatch.undo()
    assert cli(capsys, *args)[0] == 0 and len(read_rows(tmp_path / "run")) == 2  # and it resumes


# --- sample selection and sizes --------------------------------------------------------------------------------


def test_needle_takes_sample_ids_and_refuses_unknown_ones(tokenizer):
    from pkvbench.run.runner import work_items
    from pkvbench.tasks.base import TaskOptions
    from pkvbench.tasks.registry import get_task

    needle = get_task("needle")
    picked = work_items(
        [needle], tokenizer, TaskOptions(lengths=(300,), depths=(0, 50), sample_ids=("len300_depth50",))
    )
    assert [sample.sample_id for _, sample in picked] == ["len300_depth50"]
    with pytest.raises(PkvError, match="--sample-id len300_depth7: no such sample"):
        work_items([needle], tokenizer, TaskOptions(lengths=(300,), depths=(0, 50), sample_ids=("len300_depth7",)))


def test_prompts_that_cannot_fit_the_model_are_refused():
    from pkvbench import api
    from pkvbench.tasks.base import TaskOptions
    from pkvbench.tasks.registry import get_task

    needle = get_task("needle")
    assert api.fit_to_model("smollm2-135m", [needle], TaskOptions(lengths=(8160,)), None).context_window == 8192
    with pytest.raises(PkvError, match="--lengths 8161: needle's prompt with its 32-token answer exceeds"):
        api.fit_to_model("smollm2-135m", [needle], TaskOptions(lengths=(8161,)), None)
    with pytest.raises(PkvError, match="the most a prompt can have is 8092"):
        api.fit_to_model("smollm2-135m", [needle], TaskOptions(lengths=(8100,)), 100)
    assert api.fit_to_model("smollm2-135m", [needle], TaskOptions(lengths=(8192,)), None, decodes=False)


def test_material_too_small_for_a_length_is_one_line():
    """trec-fewshot with a training file too small for the length failed with a TypeError."""
    from pkvbench.tasks.ruler import fit_drawn

    def build(attempt: int, n: int) -> tuple[list[int], None]:
        return [0] * (10 + 20 * n), None  # the prompt grows with n, up to the 3 units there are

    assert len(fit_drawn(build, 70, 0, 3)[0]) == 70
    with pytest.raises(PkvError, match="--lengths 2000 is more than its material can fill; all of it makes a prompt "
                                       "of 70 tokens"):  # fmt: skip
        fit_drawn(build, 2000, 0, 3, "trec-fewshot (3 training questions)")


def test_an_unreadable_data_file_is_one_line_naming_it(tmp_path, monkeypatch):
    from pkvbench.tasks.longbench import local_rows
    from pkvbench.tasks.registry import get_task
    from tests.test_adversarial import Context, deny_reading

    path = tmp_path / "narrativeqa.jsonl"
    write(path, '{"input": "q", "context": "c", "answers": ["a"], "_id": "1"}\n')
    ctx = Context(tmp_path, monkeypatch, [], armed=True)
    deny_reading(ctx, path)
    try:
        for verify in (True, False):  # the checksum reads it first, else the rows
            with pytest.raises(PkvError, match=f"cannot read {path}: Permission denied"):
                local_rows(get_task("narrativeqa"), str(tmp_path), verify)
    finally:
        for cleanup in ctx.cleanups:
            cleanup()
