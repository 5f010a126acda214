"""Which planted bugs does the CI gate catch, and by what? Run the smoke grid with each bug of ``tests/planted.py``
(only the policies a bug touches, so a bug costs a fraction of the grid) and check it against the committed
baseline; check reruns of the unchanged code (another thread count, decode batch, sample order) the same way: those
are false alarms if they fail.

    .venv/bin/python scripts/planted_bugs.py                       # every bug; writes results/bench/planted_bugs.md
    .venv/bin/python scripts/planted_bugs.py --bug inverted --bug no-pooling
    .venv/bin/python scripts/planted_bugs.py --runs results/runs/planted --rerun "threads 1=results/runs/threads1"

A bug is caught when ``pkvbench check`` fails on its rows. The table says by what: a cell's fall beyond the
tolerance and its interval (``accuracy``), a paired test on a cell or a policy's pooled cells (``paired``), kept
sets that changed beyond the gate's rule (``selection``), with the lowest overlap of kept entries of any cell.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from planted import BUGS, BUGS_BY_NAME, baseline_for, check_with_bug  # noqa: E402

from pkvbench.reports.check import MIN_OVERLAP, CheckResult, SelectionRule, check_run  # noqa: E402
from pkvbench.reports.stats import ALPHA  # noqa: E402

CONFIG = ROOT / "configs" / "smoke.yaml"
BASELINE = ROOT / "results" / "baselines" / "smollm2-smoke.csv"


def caught_by(result: CheckResult) -> dict:
    """What failed, by kind of evidence (a cell may fail on more than one)."""
    table = result.table
    cells, pooled = table[table["task"] != "*"], table[table["task"] == "*"]
    paired = (table["paired_high"] < 0) & (table["p_holm"] < ALPHA)
    fell = (cells["delta"] < -cells["tolerance"]) & (
        cells["ci_low_baseline"].isna() | (cells["score_run"] < cells["ci_low_baseline"])
    )
    changed = cells[cells["selection"].isin(["changed", "CHANGED"])]
    by = {
        "accuracy": int(fell.sum()),
        "paired": int(paired[cells.index].sum()) + int(paired[pooled.index].sum()),
        "selection": int((cells["selection"] == "CHANGED").sum()),
    }
    return {
        "caught": "yes" if not result.passed else "no",
        "by": ", ".join(kind for kind, count in by.items() if count) or "-",
        "cells failed": f"{int(cells['failing'].sum())} of {len(cells)}",
        "accuracy": f"{by['accuracy']} cells",
        "paired": f"{int(paired[cells.index].sum())} cells, {int(paired[pooled.index].sum())} pooled",
        "selection": f"{by['selection']} cells",
        "kept sets changed": f"{len(changed)} of {len(cells)}" if result.selection == "on" else "not compared",
        "lowest overlap": f"{changed['overlap'].min():.4f}"
        if len(changed)
        else "1 (identical)"
        if result.selection == "on"
        else "-",
        "score Δ worst / best": f"{cells['delta'].min():+.2f} / {cells['delta'].max():+.2f}",
        "predictions changed": f"{len(result.changed_predictions)} of {result.predictions_compared}",
    }


def try_bug(name: str, folder: Path, tolerance: float, rule: SelectionRule) -> dict:
    bug = BUGS_BY_NAME[name]
    result = check_with_bug(bug, CONFIG, BASELINE, folder, tolerance, rule)
    return {"run": f"bug: {bug.name}", "what": bug.what, "policies": ", ".join(bug.policies), **caught_by(result)}


def try_rerun(label: str, folder: Path, scratch: Path, tolerance: float, rule: SelectionRule) -> dict:
    """An unchanged-code rerun against the whole baseline (cut to the policies it ran)."""
    from pkvbench.reports.report import load_runs

    policies = tuple(load_runs([str(folder)]).rows["policy"].unique())
    scratch.mkdir(parents=True, exist_ok=True)
    cut = baseline_for(BASELINE, policies, scratch / f"{folder.name}-baseline.csv")
    result = check_run([str(folder)], str(cut), tolerance, None, rule)
    return {"run": f"rerun: {label}", "what": "unchanged code", "policies": ", ".join(policies), **caught_by(result)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", action="append", choices=sorted(BUGS_BY_NAME), help="Only these bugs (repeatable).")
    parser.add_argument("--no-bugs", action="store_true", help="Check only the --rerun folders.")
    parser.add_argument("--rerun", action="append", default=[], metavar="LABEL=DIR",
                        help="A run folder of the unchanged code to check too (a false alarm if it fails).")  # fmt: skip
    parser.add_argument("--runs", type=Path, help="Keep the bugs' runs here (rerunning resumes them).")
    parser.add_argument("--tolerance", type=float, default=2.0)
    parser.add_argument("--min-overlap", type=float, default=MIN_OVERLAP)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "planted_bugs.md")
    args = parser.parse_args()
    rule = SelectionRule(min_overlap=args.min_overlap)
    names = [] if args.no_bugs else args.bug or [bug.name for bug in BUGS]
    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs or Path(tmp)
        runs.mkdir(parents=True, exist_ok=True)
        rows = []
        for name in names:
            rows.append(try_bug(name, runs, args.tolerance, rule))
            print(rows[-1], flush=True)
        for item in args.rerun:
            label, _, folder = item.partition("=")
            rows.append(try_rerun(label, Path(folder), Path(tmp) / "rerun", args.tolerance, rule))
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows).to_markdown(index=False)
    text = (
        f"# Planted bugs against the CI gate\n\n`.venv/bin/python scripts/planted_bugs.py` (grid: "
        f"`configs/smoke.yaml`, baseline: `{BASELINE.relative_to(ROOT)}`, tolerance {args.tolerance:g} points, "
        f"kept sets fail below an overlap of {args.min_overlap:g})\n\n{table}\n"
    )
    if not args.bug and not args.no_bugs:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
