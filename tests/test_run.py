"""``pkvbench run`` end to end on the embedded model."""

import json

import pandas as pd
import pytest

from pkvbench.cli import main

pytestmark = pytest.mark.model


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--quiet", *args])
    out = capsys.readouterr()
    assert exit_info.value.code == 0, out.err
    return out.out


def test_needle_grid_writes_results_and_resumes(tmp_path, capsys, loaded):
    out = tmp_path / "needle"
    args = [
        "--task",
        "needle",
        "--policy",
        "full,streamingllm,pyramidkv",
        "--budget",
        "64,0.1",
        "--lengths",
        "1000",
        "--depths",
        "0,50,100",
        "--out",
        str(out),
    ]
    printed = run_cli(capsys, *args)
    assert "18 rows written, 0 already done, 3 prefills" in printed
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 18
    for row in rows:
        for column in (
            "task",
            "sample_id",
            "policy",
            "budget",
            "budget_tokens",
            "context_tokens",
            "kv_kept",
            "kv_bytes",
            "pred",
            "answers",
            "score",
            "prefill_s",
            "decode_s",
            "length",
            "depth",
        ):
            assert column in row
        assert len(row["kv_kept"]) == 30 and 0 <= row["score"] <= 1
        assert abs(row["context_tokens"] - 1000) <= 2
    full = [r for r in rows if r["policy"] == "full"]
    assert sum(r["score"] for r in full) / len(full) >= 0.9  # the model can do the task with its whole cache
    assert {r["budget_tokens"] for r in full} == {r["context_tokens"] for r in full}
    squeezed = [r for r in rows if r["policy"] == "pyramidkv" and r["budget"] == 0.1]
    assert all(r["budget_tokens"] == round(0.1 * r["context_tokens"]) for r in squeezed)
    summary = pd.read_csv(out / "summary.csv")
    assert list(summary.columns) == ["task", "policy", "budget", "query_mode", "n", "score", "ci_low", "ci_high"]
    assert len(summary) == 6 and (summary["ci_low"] <= summary["score"]).all()
    assert (summary["score"] <= summary["ci_high"]).all()
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["model"]["layers"] == 30 and run_info["options"]["policies"] == [
        "full",
        "streamingllm",
        "pyramidkv",
    ]
    # The same command again does nothing; a different grid into the same folder is refused.
    assert "0 rows written, 18 already done, 0 prefills" in run_cli(capsys, *args)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args[:5], "32", *args[6:]])  # another --budget (given once: a repeated option is refused)
    assert exit_info.value.code == 2
    assert "budgets differ" in capsys.readouterr().err


def test_runs_are_deterministic(tmp_path, capsys, loaded):
    args = ["--task", "needle", "--policy", "h2o,snapkv", "--budget", "48", "--lengths", "600", "--depths", "40"]
    run_cli(capsys, *args, "--out", str(tmp_path / "a"))
    run_cli(capsys, *args, "--out", str(tmp_path / "b"))
    preds = [
        [json.loads(line)["pred"] for line in (tmp_path / d / "samples.jsonl").read_text().splitlines()] for d in "ab"
    ]
    assert preds[0] == preds[1]


def test_the_python_api_runs_what_the_cli_runs(tmp_path, capsys, loaded):
    """``pkvbench.evaluate(RunConfig(...))`` writes the same rows as the command and returns them as pandas."""
    import pkvbench

    config = pkvbench.RunConfig(
        tasks="needle",
        policies=["full", "snapkv"],
        budgets=[64],
        lengths=[600],
        depths=[40],
        out=tmp_path / "api",
        quiet=True,
    )
    result = pkvbench.evaluate(config)
    assert list(result.rows["policy"]) == ["full", "snapkv"] and result.stats.prefills == 1
    assert list(result.summary["policy"]) == ["full", "snapkv"]
    assert result.info["model"]["layers"] == 30 and result.info["versions"]["pkvbench"] == pkvbench.__version__
    assert set(result.info["determinism"]) >= {"seed", "deterministic_algorithms"}
    run_cli(
        capsys,
        "--task",
        "needle",
        "--policy",
        "full,snapkv",
        "--budget",
        "64",
        "--lengths",
        "600",
        "--depths",
        "40",
        "--out",
        str(tmp_path / "cli"),
    )
    cli_rows = [json.loads(line) for line in (tmp_path / "cli" / "samples.jsonl").read_text().splitlines()]
    assert [r["pred"] for r in cli_rows] == list(result.rows["pred"])
    # Every row names its task's definition; resuming under another definition is refused.
    assert {(r["task_version"], len(r["task_hash"])) for r in cli_rows} == {("1", 12)}
    run_json = json.loads((tmp_path / "api" / "run.json").read_text())
    run_json["options"]["task_versions"]["needle"]["task_version"] = "0"
    (tmp_path / "api" / "run.json").write_text(json.dumps(run_json))
    with pytest.raises(pkvbench.api.PkvError, match="task_versions differ"):
        pkvbench.evaluate(config)
