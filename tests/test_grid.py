"""One prefill per sample, resumable and shardable runs (real model)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pkvbench.cell.budgets import Budget
from pkvbench.cli import main
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, RunSettings, run_sample
from pkvbench.store.results import read_rows
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

pytestmark = pytest.mark.model
GRID = [
    "--task",
    "needle",
    "--policy",
    "streamingllm,snapkv",
    "--budget",
    "32",
    "--lengths",
    "500",
    "--depths",
    "0,50,100",
    "--max-new-tokens",
    "8",
    "--quiet",
]
OUTCOME = ("pred", "score", "kv_kept", "kv_bytes", "budget_tokens", "context_tokens")


def cli(*args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 0


def outcomes(folder):
    return {
        (r["sample_id"], r["policy"], str(r["budget"])): tuple(json.dumps(r[c]) for c in OUTCOME)
        for r in read_rows(folder)
    }


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, loaded):
    out = tmp_path_factory.mktemp("grid") / "whole"
    cli("run", *GRID, "--out", str(out))
    return out


def test_shared_prefill_equals_each_configuration_alone(engine, loaded):
    task = get_task("needle")
    sample = build_samples(task, loaded.tokenizer, TaskOptions(lengths=(400,), depths=(50,)))[0]
    configs = [
        Cell(parse_policy(p), Budget.parse(b), mode)
        for p in ("full", "streamingllm", "h2o", "snapkv", "pyramidkv")
        for b in ("64", "0.1")
        for mode in ("aware", "agnostic")
    ]
    settings = RunSettings(max_new_tokens=12)
    shared = list(run_sample(engine, task, sample, configs, settings))
    alone = [row for config in configs for row in run_sample(engine, task, sample, [config], settings)]
    assert len(shared) == len(alone) == 20
    for together, single in zip(shared, alone):
        assert {c: together[c] for c in OUTCOME} == {c: single[c] for c in OUTCOME}, together["policy"]
    assert len({r["pred"] for r in shared if r["policy"] != "full"}) > 1  # the policies really differ


def test_shards_merge_into_the_whole_run(tmp_path, reference_run):
    cli("run", *GRID, "--shard", "1/2", "--out", str(tmp_path / "s1"))
    cli("run", *GRID, "--shard", "2/2", "--out", str(tmp_path / "s2"))
    assert len(read_rows(tmp_path / "s1")) == 4 and len(read_rows(tmp_path / "s2")) == 2
    cli("merge", str(tmp_path / "s1"), str(tmp_path / "s2"), str(tmp_path / "s1"), "--out", str(tmp_path / "merged"))
    merged = read_rows(tmp_path / "merged")
    assert len(merged) == 6 == len({(r["sample_id"], r["policy"], r["budget"]) for r in merged})
    assert outcomes(tmp_path / "merged") == outcomes(reference_run)
    assert (tmp_path / "merged" / "summary.csv").exists()


def test_merge_refuses_runs_with_other_options(tmp_path, reference_run, capsys):
    cli("run", *GRID[:-3], "--max-new-tokens", "4", "--quiet", "--shard", "1/3", "--out", str(tmp_path / "other"))
    with pytest.raises(SystemExit) as exit_info:
        main(["merge", str(reference_run), str(tmp_path / "other"), "--out", str(tmp_path / "m")])
    assert exit_info.value.code == 2
    assert "max_new_tokens differ" in capsys.readouterr().err


def test_a_killed_run_resumes_without_loss_or_duplicates(tmp_path, reference_run):
    out = tmp_path / "killed"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "pkvbench", "run", *GRID, "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None and len(read_rows(out)) < 1:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = read_rows(out)
    assert 1 <= len(before) < 6, "the run should have been killed part-way"
    with open(out / "samples.jsonl", "a") as handle:  # what a kill in the middle of a write leaves
        handle.write('{"task": "needle", "sample_id": "len500_dep')
    cli("run", *GRID, "--out", str(out))
    after = read_rows(out)
    assert after[: len(before)] == before  # finished rows are kept as they were
    assert outcomes(out) == outcomes(reference_run)
    assert len(after) == 6
