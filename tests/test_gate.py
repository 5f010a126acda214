"""The CI gate catches a planted bug on the smoke grid (issue 16). The unchanged code's rerun passing the same gate
is ``.ci/run``'s last step; ``scripts/planted_bugs.py`` measures every planted bug (docs/ci-gate.md)."""

from pathlib import Path

import pytest
from planted import BUGS_BY_NAME, check_with_bug

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.yaml"
BASELINE = ROOT / "results" / "baselines" / "smollm2-smoke.csv"


@pytest.mark.model
def test_the_gate_fails_on_an_inverted_selection(tmp_path):
    """SnapKV keeping its *lowest*-scoring positions, on the smoke grid's needle prompts and budgets: the check
    fails. (scripts/planted_bugs.py measures every planted bug on the whole grid.)"""
    bug = BUGS_BY_NAME["inverted"]
    only_snapkv = type(bug)(bug.name, bug.what, ("snapkv",), bug.plant)  # one policy's rows are enough, and quicker
    # one task's 5 prompts × 3 budgets, a quarter of the grid's prefills: each cell's verdict needs only its own rows
    result = check_with_bug(only_snapkv, SMOKE, BASELINE, tmp_path, tasks=("needle",))
    assert not result.passed
    assert set(result.failures["policy"]) == {"snapkv"}
    pooled = result.pooled.set_index("policy")
    assert pooled.loc["snapkv", "status"] == "REGRESSED" and pooled.loc["snapkv", "paired_high"] < 0
    # and every cell's kept sets are seen to have changed: counts the same, entries in common far below the rule
    cells = result.cells
    assert (cells["selection"] == "CHANGED").all() and (cells["counts_changed"] == 0).all()
    assert (cells["overlap"] < 0.5).all()
