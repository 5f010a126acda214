"""``pkvbench check``: the CI gate fails on real regressions, missing cells and changed sample counts, nothing else:
a fall beyond the tolerance *and* the baseline's interval, or one a paired test on the same samples calls real."""

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
    assert path.read_text().splitlines()[0] == "model,task,policy,budget,query_mode,n,score,ci_low,ci_high"
    samples = (tmp_path / "baseline.samples.csv").read_text().splitlines()
    assert samples[0] == "model,task,policy,budget,query_mode,sample_id,score" and len(samples) == 1 + 7
    return str(path)


def test_identical_results_pass(tmp_path, capsys, baseline):
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "same", BASE))
    assert code == 0
    assert out.startswith("check passed: 3 cells (3 ok)")


def test_an_injected_regression_fails_with_a_readable_line(tmp_path, capsys, baseline):
    worse = {**BASE, ("needle", "pyramidkv", 0.007): [0.25, 0.15]}  # 25.00 → 20.00
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "worse", worse))
    assert code == 1
    assert err.splitlines()[0].startswith("check FAILED: 1 failing; 3 cells (2 ok, 1 regressed)")
    failing = [line for line in err.splitlines() if line.startswith("REGRESSED")]
    assert len(failing) == 1 and "pyramidkv" in failing[0] and "0.007" in failing[0] and "-5.00" in failing[0]


def test_a_fall_within_tolerance_passes_and_per_task_tolerance_applies(tmp_path, capsys, baseline):
    slightly = {**BASE, ("needle", "pyramidkv", 0.007): [0.25, 0.235]}  # 25.00 → 24.25, baseline interval [25, 25]
    folder = make_run(tmp_path / "slight", slightly)
    assert run_check(capsys, "--baseline", baseline, "--results", folder)[0] == 0
    strict = tmp_path / "tolerances.yaml"
    strict.write_text("needle: 0.5\n")
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", folder, "--per-cell", str(strict))
    assert code == 1 and "REGRESSED" in err


def test_a_fall_the_baseline_noise_explains_passes(tmp_path, capsys, baseline):
    # 75.00 (interval [50, 100]) → 62.50: beyond the 2-point tolerance, inside the interval, and a paired test on
    # two samples cannot call it
    noisy = {**BASE, ("needle", "snapkv", 128): [1.0, 0.25]}
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "noisy", noisy))
    assert code == 0 and "paired tests on" in out


def test_a_small_fall_in_every_sample_fails_the_paired_test(tmp_path, capsys):
    """One point off each of 40 samples: no cell's interval shows it, the paired test over the policy does."""
    rng = __import__("random").Random(0)
    many = {("needle", "snapkv", budget): [rng.choice([0.3, 0.6, 0.9]) for _ in range(10)] for budget in (32, 64)}
    many |= {("ruler", "snapkv", budget): [rng.choice([0.2, 0.5, 1.0]) for _ in range(10)] for budget in (32, 64)}
    path = tmp_path / "baseline.csv"
    assert run_check(capsys, "--baseline", str(path), "--results", make_run(tmp_path / "b", many), "--update")[0] == 0
    worse = {key: [max(0.0, v - 0.03) for v in values] for key, values in many.items()}
    code, _, err = run_check(capsys, "--baseline", str(path), "--results", make_run(tmp_path / "w", worse))
    assert code == 1
    failing = [line.split() for line in err.splitlines() if line.startswith("REGRESSED")]
    assert any(line[1] == "*" and line[2] == "snapkv" for line in failing)  # the policy's pooled row
    # without the samples file only the tolerance and intervals decide: 3 points inside every interval passes
    (tmp_path / "baseline.samples.csv").unlink()
    code, out, _ = run_check(capsys, "--baseline", str(path), "--results", make_run(tmp_path / "w2", worse))
    assert code == 0 and "no baseline samples" in out


def test_an_old_baseline_without_intervals_uses_the_tolerance(tmp_path, capsys):
    old = tmp_path / "old.csv"
    old.write_text("model,task,policy,budget,n,score\nsmollm2-135m,needle,snapkv,128,2,75.0\n")
    run = make_run(tmp_path / "r", {("needle", "snapkv", 128): [1.0, 0.25]})
    code, _, err = run_check(capsys, "--baseline", str(old), "--results", run)
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


@pytest.mark.parametrize(
    ("baseline_text", "extra", "message"),
    [
        # issue 14, case 5: a typo must not switch the gate off
        ("model,task,policy,budget,n,score\nsmollm2-135m,needle,snapkv,128,2,99\n", ["--tolerance", "nan"],
         "--tolerance nan: expected a finite number"),
        ("model,task,policy,budget,n,score\nsmollm2-135m,needle,snapkv,128,2,99\n", ["--tolerance", "-1"],
         "--tolerance -1.0: give a finite, non-negative number"),
        ("model,task,policy,budget,n,score\n", [], "has no cells: a gate over nothing would pass anything"),
        ("model,task,policy,budget,n,score\nsmollm2-135m,needle,snapkv,128,2,high\n", [],
         "score 'high' is not a number"),
        ("model,task,policy,budget,n,score\nsmollm2-135m,needle,snapkv,128,two,99\n", [], "n 'two' is not a number"),
    ],
)  # fmt: skip
def test_a_gate_that_cannot_gate_is_refused(tmp_path, capsys, baseline_text, extra, message):
    path = tmp_path / "baseline.csv"
    path.write_text(baseline_text)
    run = make_run(tmp_path / "r", {("needle", "snapkv", 128): [0.25, 0.25]})
    code, _, err = run_check(capsys, "--baseline", str(path), "--results", run, *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_a_misspelled_task_in_per_cell_tolerances_is_refused(tmp_path, capsys, baseline):
    tolerances = tmp_path / "tolerances.yaml"
    tolerances.write_text("neddle: 50\n")
    run = make_run(tmp_path / "r", BASE)
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run, "--per-cell", str(tolerances))
    assert code == 2 and "neddle is not a task of the baseline (needle, trec-fewshot)" in err
