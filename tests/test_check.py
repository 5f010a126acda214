"""``pkvbench check``: the CI gate fails on regressions, missing cells and changed sample counts, nothing else."""

import pytest

from pkvbench.cli import main
from pkvbench.results import ResultStore


def make_run(folder, scores):
    """``scores``: {(task, policy, budget): [sample scores]}"""
    store = ResultStore(folder)
    store.open({"options": {"model": "smollm2-135m"}}, overwrite=True)
    for (task, policy, budget), values in scores.items():
        for i, value in enumerate(values):
            store.append(
                {
                    "task": task,
                    "sample_id": f"s{i}",
                    "model": "smollm2-135m",
                    "policy": policy,
                    "budget": budget,
                    "score": value,
                    "pred": "",
                }
            )
    return str(folder)


BASE = {
    ("needle", "snapkv", 128): [1.0, 0.5],
    ("needle", "pyramidkv", 0.007): [0.25, 0.25],
    ("trec-fewshot", "snapkv", 128): [1.0, 0.0, 1.0],
}


def run_check(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["check", *args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.fixture
def baseline(tmp_path, capsys):
    path = tmp_path / "baseline.csv"
    code, out, _ = run_check(
        capsys, "--baseline", str(path), "--results", make_run(tmp_path / "base", BASE), "--update"
    )
    assert code == 0 and "3 cells" in out
    assert path.read_text().splitlines()[0] == "model,task,policy,budget,n,score"
    return str(path)


def test_identical_results_pass(tmp_path, capsys, baseline):
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "same", BASE))
    assert code == 0
    assert out.startswith("check passed: 3 cells (3 ok)")


def test_an_injected_regression_fails_with_a_readable_line(tmp_path, capsys, baseline):
    worse = {**BASE, ("needle", "pyramidkv", 0.007): [0.25, 0.15]}  # 25.00 → 20.00
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "worse", worse))
    assert code == 1
    assert err.splitlines()[0].startswith("check FAILED: 1 of 3 cells")
    failing = [line for line in err.splitlines() if line.startswith("REGRESSED")]
    assert len(failing) == 1 and "pyramidkv" in failing[0] and "0.007" in failing[0] and "-5.00" in failing[0]


def test_a_fall_within_tolerance_passes_and_per_task_tolerance_applies(tmp_path, capsys, baseline):
    slightly = {**BASE, ("needle", "snapkv", 128): [1.0, 0.47]}  # 75.00 → 73.50
    folder = make_run(tmp_path / "slight", slightly)
    assert run_check(capsys, "--baseline", baseline, "--results", folder)[0] == 0
    strict = tmp_path / "tolerances.yaml"
    strict.write_text("needle: 1.0\n")
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", folder, "--per-cell", str(strict))
    assert code == 1 and "REGRESSED" in err


def test_a_missing_cell_fails(tmp_path, capsys, baseline):
    partial = {k: v for k, v in BASE.items() if k[0] != "trec-fewshot"}
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "partial", partial))
    assert code == 1
    assert [line.split()[:2] for line in err.splitlines() if line.startswith("MISSING")] == [
        ["MISSING", "trec-fewshot"]
    ]


def test_a_changed_sample_count_fails(tmp_path, capsys, baseline):
    fewer = {**BASE, ("needle", "snapkv", 128): [1.0]}
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "fewer", fewer))
    assert code == 1 and "COUNT" in err


def test_improvements_and_new_cells_pass(tmp_path, capsys, baseline):
    better = {**BASE, ("needle", "snapkv", 128): [1.0, 1.0], ("needle", "h2o", 64): [0.1]}
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "better", better))
    assert code == 0
    assert "1 improved" in out and "1 new" in out


def test_bad_baseline_is_one_line(tmp_path, capsys):
    run = make_run(tmp_path / "r", BASE)
    code, _, err = run_check(capsys, "--baseline", str(tmp_path / "nope.csv"), "--results", run)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    code, _, err = run_check(capsys, "--baseline", str(tmp_path / "bad.csv"), "--results", run)
    assert code == 2 and "lacks the columns" in err
