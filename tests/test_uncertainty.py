"""Intervals, paired tests, Holm and sample sizes (pkvbench.reports.stats, pkvbench.reports.paired) on known cases. No model."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from pkvbench.cli import main
from pkvbench.reports import stats
from pkvbench.reports.paired import ALL_TASKS, matrix_markdown, pairwise, power_table
from pkvbench.reports.report import load_runs, render, report_table


def test_identical_columns_differ_by_zero_with_p_one():
    scores = np.random.default_rng(1).random(30)
    result = stats.paired_difference(scores, scores.copy())
    assert (result.n, result.mean, result.low, result.high, result.p) == (30, 0.0, 0.0, 0.0, 1.0)
    assert not result.decided


def test_a_constant_shift_is_the_shift_with_a_small_p():
    base = np.random.default_rng(2).random(12)
    result = stats.paired_difference(base + 0.25, base)
    assert result.mean == pytest.approx(0.25)
    assert result.low == pytest.approx(0.25) and result.high == pytest.approx(0.25)
    # every one of the 2^12 sign flips is enumerated: only "all +" and "all −" are as extreme
    assert result.p == pytest.approx(2 / 2**12)
    assert result.decided


def test_noise_around_zero_is_not_decided():
    rng = np.random.default_rng(3)
    a, b = rng.random(40), rng.random(40)
    result = stats.paired_difference(a, b)
    assert result.low < 0 < result.high and result.p > 0.05


def test_a_mean_interval_is_reproducible_and_covers_the_mean():
    values = np.random.default_rng(4).integers(0, 2, 25).astype(float)
    low, high = stats.mean_interval(values)
    assert low < values.mean() < high and (low, high) == stats.mean_interval(values)
    assert stats.mean_interval([0.4, 0.4, 0.4]) == (0.4, 0.4)  # no spread: the point
    assert stats.mean_interval([0.7]) == (0.7, 0.7)
    assert all(math.isnan(x) for x in stats.mean_interval([]))
    assert stats.mean_interval([1.0, float("nan"), 1.0]) == (1.0, 1.0)  # a missing score is left out


def test_a_group_interval_resamples_within_tasks():
    # task a always 1, task b always 0: every stratified resample has mean 0.5, whatever the counts
    assert stats.group_interval([[1.0] * 3, [0.0] * 17]) == (0.5, 0.5)
    # a one-sample task is a constant of every resample
    low, high = stats.group_interval([[1.0], [0.0, 1.0, 1.0, 0.0]])
    assert 0.5 <= low < 0.75 < high <= 1.0
    # pooled without strata the same samples would have spread widely
    pooled = stats.mean_interval([1.0] * 3 + [0.0] * 17)
    assert pooled[0] < 0.15 and pooled[1] < 0.5


def test_a_stratified_paired_difference_weighs_each_task_equally():
    first = np.r_[np.ones(4), np.zeros(36)]
    second = np.zeros(40)
    strata = ["small"] * 4 + ["large"] * 36
    result = stats.paired_difference(first, second, strata)
    assert result.mean == pytest.approx(0.5)  # (1 + 0) / 2, not 4 / 40
    assert stats.paired_difference(first, second).mean == pytest.approx(0.1)


def test_holm_matches_the_step_down_by_hand():
    adjusted = stats.holm([0.01, 0.04, 0.03, 0.20, float("nan")])
    # sorted 0.01, 0.03, 0.04, 0.20 times 4, 3, 2, 1 → 0.04, 0.09, 0.08→0.09 (monotone), 0.20
    np.testing.assert_allclose(adjusted[:4], [0.04, 0.09, 0.09, 0.20])
    assert math.isnan(adjusted[4])
    assert stats.holm([0.9, 0.8]).tolist() == [1.0, 1.0]  # capped at 1


def test_samples_needed_follows_the_normal_approximation():
    # (1.95996 + 0.84162)^2 * (sd / effect)^2 = 7.849 * 36 = 282.6 → 283
    assert stats.samples_needed(0.30, 0.05) == 283
    assert stats.samples_needed(30, 5) == 283  # units cancel
    assert stats.samples_needed(0.0, 0.05) == 1
    assert stats.samples_needed(0.3, 0.0) == math.inf


def _run(folder, scores):
    """``scores``: {(task, policy, budget): [per-sample scores]} → a run folder."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
        {"task": task, "sample_id": f"s{i}", "model": "m", "policy": policy, "budget": budget, "score": value}
        for (task, policy, budget), values in scores.items()
        for i, value in enumerate(values)
    ]
    (folder / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_pairwise_calls_a_winner_only_when_interval_and_holm_agree(tmp_path):
    rng = np.random.default_rng(5)
    noise = (0.01 + 0.98 * rng.random(30)).round(2).tolist()  # ±0.01 below stays a score, in [0, 1]
    folder = _run(
        tmp_path / "r",
        {
            ("needle", "full", 64): [1.0] * 30,
            ("needle", "snapkv", 64): noise,
            ("needle", "pyramidkv", 64): [v + (0.01 if i % 2 else -0.01) for i, v in enumerate(noise)],
            ("other", "full", 64): [1.0] * 30,
            ("other", "snapkv", 64): [0.0] * 30,
            ("other", "pyramidkv", 64): [0.0] * 30,
        },
    )
    table = pairwise(load_runs([folder]).rows)
    row = table.set_index(["task", "policy_a", "policy_b"])
    assert row.loc[("needle", "full", "snapkv"), "verdict"] == "full better"
    assert row.loc[("needle", "snapkv", "pyramidkv"), "verdict"] == "no decision"  # ±1 point each
    assert row.loc[("other", "snapkv", "pyramidkv"), "p"] == 1.0  # identical
    assert (row["p_holm"] >= row["p"]).all()
    group = row.loc[(ALL_TASKS, "full", "snapkv")]
    assert group["n"] == 60 and group["diff"] == pytest.approx(100 - (np.mean(noise) * 100 + 0) / 2, abs=0.01)
    assert list(table["task"].unique()) == ["needle", "other", ALL_TASKS]
    markdown = matrix_markdown(table)
    assert "| full | · | +" in markdown and "Holm-adjusted p (over all 9)" in markdown
    needed = power_table(table, 5)
    assert needed.set_index(["task", "policy_a", "policy_b"]).loc[("other", "full", "snapkv"), "n_for_5_points"] == 1


def test_pairwise_against_one_policy(tmp_path):
    folder = _run(tmp_path / "r", {("t", p, 64): [0.5, 1.0] for p in ("full", "snapkv", "pyramidkv")})
    table = pairwise(load_runs([folder]).rows, against="full")
    assert sorted(zip(table["policy_a"], table["policy_b"])) == [("pyramidkv", "full"), ("snapkv", "full")]


def test_report_folds_intervals_into_the_cells(tmp_path):
    folder = _run(tmp_path / "r", {("needle", "snapkv", 64): [0.0, 1.0, 1.0, 1.0], ("needle", "full", 64): [1.0] * 4})
    table = report_table(load_runs([folder]).rows, intervals=True)
    assert list(table.columns) == [
        "model", "policy", "budget", "needle", "needle ci_low", "needle ci_high", "avg", "avg ci_low", "avg ci_high",
        "tasks", "n",
    ]  # fmt: skip
    markdown = render(table, "markdown")
    assert "| m | snapkv | 64 | 75.00 [25.00, 100.00] | 75.00 [25.00, 100.00] | 1 | 4 |" in markdown
    assert "| m | full | 64 | 100.00 [100.00, 100.00] |" in markdown
    csv = pd.read_csv(pd.io.common.StringIO(render(table, "csv")))
    assert csv.loc[csv["policy"] == "snapkv", "needle ci_low"].item() == 25.0


def test_diff_and_power_on_the_command_line(tmp_path, capsys):
    folder = _run(tmp_path / "r", {("t", p, 64): [0.5, 1.0, 0.0] for p in ("full", "snapkv")})
    with pytest.raises(SystemExit) as exit_info:
        main(["diff", str(folder)])
    assert exit_info.value.code == 0 and "**model m · budget 64 · task t**" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(folder), "--power", "5"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and "Samples needed to resolve 5 points" in out and "n_for_5_points" in out
    for args, message in (
        (["diff", str(folder), "--against", "h2o"], "--against h2o: no such policy in the rows (full, snapkv)"),
        (["diff", str(folder), "--policy", "full,tova"], "--policy tova: not in the rows"),
        (["report", str(folder), "--power", "0"], "--power 0: must be at least 0.01"),
        (["report", str(folder), "--power", "nan"], "--power nan: expected a finite number"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
