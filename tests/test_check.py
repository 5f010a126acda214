"""``pkvbench check``: the CI gate fails on real regressions, missing cells and changed sample counts, nothing else:
a fall beyond the tolerance *and* the baseline's interval, or one a paired test on the same samples calls real."""

import numpy as np
import pytest

from pkvbench.cell.fingerprints import fingerprint
from pkvbench.cli import check, main
from pkvbench.reports.check import MIN_OVERLAP
from pkvbench.store.results import ResultStore

LAYERS, POOL = 3, 200


def kept_sets(seed: int, moved: int = 0, counts=(8, 8), layers: int = LAYERS, split: int = 0):
    """A row's kept positions: per layer, each head keeps ``counts[head]`` positions drawn from the first 200 (the
    same for a seed); ``moved`` of each head's are then swapped for positions no unchanged row keeps. ``split``:
    that many entries go from the first head to the second (a head-wise top-k's near-tie on another CPU): the first
    drops its last ones, the second gains positions no unchanged row keeps, the layer's total stays."""
    rng = np.random.default_rng(seed)
    sets = []
    for _ in range(layers):
        heads = []
        for count in counts:
            chosen = rng.choice(POOL, size=count, replace=False)
            chosen[:moved] = POOL + np.arange(moved)
            heads.append(chosen)
        if split:
            heads[0], heads[1] = heads[0][:-split], np.concatenate([heads[1], POOL + np.arange(split)])
        sets.append(heads)
    return sets


def make_run(folder, scores, moved=None, counts=None, preds=None, fingerprints=True, split=None):
    """``scores``: {(task, policy, budget): [sample scores]}; ``moved``, ``counts``, ``split``: {cell: kept_sets'
    argument} for the cells whose kept sets differ from the baseline's; ``preds``: {cell: [predictions]}."""
    store = ResultStore(folder)
    store.open({"options": {"model": "smollm2-135m"}}, overwrite=True)
    for number, (cell, values) in enumerate(scores.items()):
        for i, value in enumerate(values):
            row = {
                "task": cell[0],
                "sample_id": f"s{i}",
                "model": "smollm2-135m",
                "policy": cell[1],
                "budget": cell[2],
                "score": value,
                "pred": (preds or {}).get(cell, [f"answer {value}"] * len(values))[i],
            }
            if fingerprints:
                where = {
                    "moved": (moved or {}).get(cell, 0),
                    "counts": (counts or {}).get(cell, (8, 8)),
                    "split": (split or {}).get(cell, 0),
                }
                row["kept_fingerprint"] = fingerprint(kept_sets(100 * number + i, **where))
            store.append(row)
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
    assert samples[0] == "model,task,policy,budget,query_mode,sample_id,score,pred,kept_fingerprint"
    assert len(samples) == 1 + 7
    return str(path)


def test_identical_results_pass(tmp_path, capsys, baseline):
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "same", BASE))
    assert code == 0
    assert out.startswith("check passed: 3 cells (3 ok), 1 policies pooled (ok); ")
    assert f"; kept sets of 7 samples in 3 cells (2 to 3 a cell): 3 identical (fails below {MIN_OVERLAP:g}); " in out
    assert "predictions: 0 of 7 changed" in out


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


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("neddle: 50\n", "neddle is not a task of the baseline (needle, trec-fewshot)"),
        ("needle: 100\n", "needle: 100 points: no score can fall by 100 points or more"),  # issue 26
    ],
)
def test_a_bad_per_cell_tolerance_is_refused(tmp_path, capsys, baseline, text, message):
    tolerances = tmp_path / "tolerances.yaml"
    tolerances.write_text(text)
    run = make_run(tmp_path / "r", BASE)
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run, "--per-cell", str(tolerances))
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err


# --- selection: the gate sees what changed, even when accuracy did not move (issue 26) ------------------------------


def test_a_changed_selection_fails_with_the_policy_layers_and_overlap(tmp_path, capsys, baseline):
    """Half of each head's entries swapped for others in every layer, scores unchanged: the cell fails."""
    run = make_run(tmp_path / "moved", BASE, moved={("needle", "snapkv", 128): 4})
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run)
    assert code == 1
    assert err.startswith("check FAILED: 1 failing; 3 cells (3 ok)")
    lines = [line for line in err.splitlines() if line.startswith("SELECTION")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"SELECTION snapkv @ 128 (needle, aware): kept sets changed in {LAYERS} of {LAYERS}")
    overlap = float(lines[0].rsplit("overlap ", 1)[1])
    assert 0.3 < overlap < 0.7  # the truth is 0.5: 4 of 8 entries per head kept


def test_a_small_selection_change_is_reported_and_passes_unless_exact(tmp_path, capsys, baseline):
    """One entry of 16 moved in one cell's layers: within the overlap threshold it passes (said in the result line);
    --exact fails on it."""
    run = make_run(tmp_path / "nudged", BASE, moved={("needle", "pyramidkv", 0.007): 1}, counts=None)
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", run, "--min-overlap", "0.8")
    assert (
        code == 0
        and "kept sets of 7 samples in 3 cells (2 to 3 a cell): 2 identical, 1 changed within the rule, lowest overlap"
        in out
    )
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run, "--min-overlap", "0.8", "--exact")
    assert code == 1 and "SELECTION pyramidkv @ 0.007 (needle, aware)" in err


def test_changed_kept_counts_fail(tmp_path, capsys, baseline):
    run = make_run(tmp_path / "counts", BASE, counts={("trec-fewshot", "snapkv", 128): (8, 7)})
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run)
    assert code == 1
    line = next(line for line in err.splitlines() if line.startswith("SELECTION"))
    assert f"kept counts differ in {LAYERS} of {LAYERS} layers (layer 0: 2x8 → 8/7)" in line


def test_an_entry_moved_between_heads_is_judged_by_the_overlap_not_failed_as_a_count(tmp_path, capsys):
    """AdaKV splits a layer's entries among its heads by one top-k over all of them: on another CPU family a near-tie
    moved an entry from one head to another (measured: 184/123/449 → 183/123/450, AMD EPYC against Intel Xeon). The
    layer's total stands; the move is a changed entry like any other, within the overlap rule."""
    cell = ("needle", "adakv(snapkv)", 0.25)
    grid, wide = {cell: [1.0, 0.5]}, {cell: (64, 64)}
    path = str(tmp_path / "baseline.csv")
    assert (
        run_check(capsys, "--baseline", path, "--results", make_run(tmp_path / "b", grid, counts=wide), "--update")[0]
        == 0
    )
    run = make_run(tmp_path / "moved", grid, counts=wide, split={cell: 1})
    code, out, _ = run_check(capsys, "--baseline", path, "--results", run, "--min-overlap", "0.9")
    assert code == 0 and "kept sets of 2 samples in 1 cells (2 a cell): 1 changed within the rule" in out
    code, _, err = run_check(capsys, "--baseline", path, "--results", run, "--exact")
    line = next(line for line in err.splitlines() if line.startswith("SELECTION"))
    assert code == 1 and f"the heads' split of a layer's entries moved in {LAYERS} of {LAYERS} layers" in line
    assert "(layer 0: 2x64 → 63/65)" in line


def test_selection_off_is_said_in_the_result_line(tmp_path, capsys, baseline):
    run = make_run(tmp_path / "moved", BASE, moved={("needle", "snapkv", 128): 4})
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", run, "--selection", "off")
    assert code == 0 and "kept sets not compared (--selection off)" in out


def test_changed_predictions_are_counted_and_shown_and_fail_only_when_exact(tmp_path, capsys, baseline):
    preds = {("needle", "snapkv", 128): ["answer 1.0", "a new\nanswer"]}
    run = make_run(tmp_path / "preds", BASE, preds=preds)
    code, out, _ = run_check(capsys, "--baseline", baseline, "--results", run)
    assert code == 0 and "predictions: 1 of 7 changed" in out
    assert "PREDICTION needle s1 snapkv @ 128 (aware): 'answer 0.5' → 'a new\\\\nanswer'" in out
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run, "--exact")
    assert code == 1 and "check FAILED: 1 failing" in err and "PREDICTION needle s1" in err


def test_a_run_without_fingerprints_is_refused_unless_selection_is_off(tmp_path, capsys, baseline):
    run = make_run(tmp_path / "old", BASE, fingerprints=False)
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", run)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "have no kept fingerprints" in err
    assert run_check(capsys, "--baseline", baseline, "--results", run, "--selection", "off")[0] == 0


def test_a_baseline_without_fingerprints_says_so(tmp_path, capsys):
    path = tmp_path / "b.csv"
    run = make_run(tmp_path / "old", BASE, fingerprints=False)
    assert run_check(capsys, "--baseline", str(path), "--results", run, "--update")[0] == 0
    assert "kept_fingerprint" not in (tmp_path / "b.samples.csv").read_text()
    code, out, _ = run_check(capsys, "--baseline", str(path), "--results", make_run(tmp_path / "new", BASE))
    assert code == 0 and "kept sets not compared (the baseline has no selection fingerprints)" in out


def test_the_cli_default_overlap_is_the_gates():
    assert next(p for p in check.params if p.name == "min_overlap").default == MIN_OVERLAP


# --- a baseline is checked before it is trusted (issue 26) ----------------------------------------------------------

CELLS = "model,task,policy,budget,query_mode,n,score,ci_low,ci_high\n"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        # the example: a score above its own stale interval passed a run that regressed
        ("smollm2-135m,needle,snapkv,128,aware,2,105.5,93.33,97.67", "row 1 (needle snapkv 128 aware): score 105.5 is outside [0, 100]"),
        ("smollm2-135m,needle,snapkv,128,aware,2,-1,0,10", "score -1 is outside [0, 100]"),
        ("smollm2-135m,needle,snapkv,128,aware,2,95,96,98", "score 95 lies outside its own interval [96, 98]"),
        ("smollm2-135m,needle,snapkv,128,aware,2,95,-inf,98", "interval [-inf, 98] is outside [0, 100]"),
        ("smollm2-135m,needle,snapkv,128,aware,2,95,90,", "an interval needs both ci_low and ci_high"),
        ("smollm2-135m,needle,snapkv,128,aware,0,95,90,99", "n 0 is not a count of samples"),
        ("smollm2-135m,needle,snapkv,128,aware,1.5,95,90,99", "n 1.5 is not a count of samples"),
        ("smollm2-135m,needle,snapkv,128,aware,2,95,90,99\nsmollm2-135m,needle,snapkv,128,aware,2,96,90,99",
         "row 2 (needle snapkv 128 aware): a cell written twice"),
    ],
)  # fmt: skip
def test_an_inconsistent_baseline_is_refused(tmp_path, capsys, row, message):
    path = tmp_path / "baseline.csv"
    path.write_text(CELLS + row + "\n")
    run = make_run(tmp_path / "r", {("needle", "snapkv", 128): [0.955, 0.955]})
    code, _, err = run_check(capsys, "--baseline", str(path), "--results", run)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"baseline {path}" in err and message in err, err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda lines: lines[:-1], "row 1 (needle snapkv 128 aware): 1 samples with mean 100.00, the baseline's cell says n 2 and score 75"),
        (lambda lines: [*lines, lines[-1]], "row 3 (needle snapkv 128 aware s1): a sample written twice"),
        (lambda lines: [lines[0], lines[1].replace(",1.0,", ",0.9,")], "1 samples with mean 90.00"),
        (lambda lines: [*lines[:2], lines[2].replace(",0.5,", ",1.5,")], "row 2 (needle snapkv 128 aware s1): score 1.5 is outside [0, 1]"),
        (lambda lines: [*lines[:2], lines[2].rsplit(",", 1)[0] + ",1 3x8 AAAA AAAA"], "row 2 (needle snapkv 128 aware s1): kept fingerprint of 1 layers"),
        (lambda lines: [*lines, lines[2].replace("snapkv", "h2o")], "row 3 (needle h2o 128 aware): a cell the baseline baseline.csv does not have"),
        (lambda lines: [lines[0]], "has no cells"),
    ],
)  # fmt: skip
def test_a_samples_file_that_disagrees_with_its_baseline_is_refused(tmp_path, capsys, edit, message):
    path = tmp_path / "baseline.csv"
    one_cell = {("needle", "snapkv", 128): [1.0, 0.5]}
    assert (
        run_check(capsys, "--baseline", str(path), "--results", make_run(tmp_path / "b", one_cell), "--update")[0] == 0
    )
    samples = tmp_path / "baseline.samples.csv"
    samples.write_text("\n".join(edit(samples.read_text().splitlines())) + "\n")
    code, _, err = run_check(capsys, "--baseline", str(path), "--results", make_run(tmp_path / "r", one_cell))
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tolerance", "100"], "--tolerance 100: no score can fall by 100 points or more, so nothing could fail"),
        (["--tolerance", "1e308"], "--tolerance 1e+308: no score can fall by 100 points or more"),
        (["--min-overlap", "0"], "--min-overlap 0: give a share of kept entries, above 0 and at most 1"),
        (["--min-overlap", "1.5"], "--min-overlap 1.5: give a share"),
    ],
)
def test_a_gate_that_could_fail_nothing_is_refused(tmp_path, capsys, baseline, extra, message):
    code, _, err = run_check(capsys, "--baseline", baseline, "--results", make_run(tmp_path / "r", BASE), *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
