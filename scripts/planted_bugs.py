"""Which planted bugs does the CI gate catch? Run the smoke grid with each bug of ``pkvbench.planted`` (only the
policies a bug touches, so a bug costs a fraction of the grid) and check it against the committed baseline.

    .venv/bin/python scripts/planted_bugs.py                       # every bug; writes results/bench/planted_bugs.md
    .venv/bin/python scripts/planted_bugs.py --bug inverted --bug no-pooling

A bug is caught when ``pkvbench check`` fails on its rows; the table says which cells and pooled policy rows failed,
and the run time. The unchanged code's rerun is ``.ci/run``'s own gate (it must pass).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pkvbench.planted import BUGS, BUGS_BY_NAME, PlantedBug, check_with_bug  # noqa: E402

CONFIG = ROOT / "configs" / "smoke.yaml"
BASELINE = ROOT / "results" / "baselines" / "smollm2-smoke.csv"


def try_bug(bug: PlantedBug, folder: Path, tolerance: float) -> dict:
    started = time.perf_counter()
    result = check_with_bug(bug, CONFIG, BASELINE, folder, tolerance)
    failing = result.failures
    return {
        "bug": bug.name,
        "what": bug.what,
        "policies": ", ".join(bug.policies),
        "caught": "yes" if not result.passed else "no",
        "cells failed": f"{int((failing['task'] != '*').sum())} of {len(result.cells)}",
        "pooled policies failed": ", ".join(failing.loc[failing["task"] == "*", "policy"]) or "-",
        "cells changed": int((result.cells["delta"] != 0).sum()),
        "worst / best cell Δ": f"{result.cells['delta'].min():+.2f} / {result.cells['delta'].max():+.2f}",
        "seconds": round(time.perf_counter() - started),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bug", action="append", choices=sorted(BUGS_BY_NAME), help="Only these bugs (repeatable).")
    parser.add_argument("--tolerance", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "planted_bugs.md")
    args = parser.parse_args()
    bugs = [BUGS_BY_NAME[name] for name in args.bug] if args.bug else list(BUGS)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for bug in bugs:
            rows.append(try_bug(bug, Path(tmp), args.tolerance))
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows).to_markdown(index=False)
    text = (
        f"# Planted bugs against the CI gate\n\n`.venv/bin/python scripts/planted_bugs.py` (grid: "
        f"`configs/smoke.yaml`, baseline: `{BASELINE.relative_to(ROOT)}`, tolerance {args.tolerance:g} points)\n\n"
        f"{table}\n"
    )
    if not args.bug:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
