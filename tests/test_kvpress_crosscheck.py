"""Every policy against NVIDIA kvpress's press of the same rule (``scripts/kvpress_crosscheck.py``), on a short
needle prompt with a system message: kept positions per layer and KV head at compression ratios 0.5 / 0.75 / 0.9.

Runs where kvpress's own environment exists (``scripts/kvpress_env.sh`` builds ``.venv-kvpress``; or
``$KVPRESS_PYTHON``); skipped elsewhere, since kvpress pins a transformers older than pkvbench's.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvpress_python() -> str | None:
    candidate = os.environ.get("KVPRESS_PYTHON") or str(ROOT / ".venv-kvpress" / "bin" / "python")
    if not Path(candidate).exists():
        return None
    found = subprocess.run([candidate, "-c", "import kvpress"], capture_output=True)
    return candidate if found.returncode == 0 else None


PYTHON = kvpress_python()
pytestmark = pytest.mark.skipif(
    PYTHON is None, reason="kvpress is not installed: build its environment with scripts/kvpress_env.sh"
)


@pytest.fixture(scope="module")
def crosscheck(engine):
    spec = importlib.util.spec_from_file_location("kvpress_crosscheck", ROOT / "scripts" / "kvpress_crosscheck.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there (its annotations are strings)
    spec.loader.exec_module(module)
    return module.crosscheck(engine, PYTHON, length=700, max_new_tokens=4)  # 0.1·T above SnapKV's window 64


def test_every_pair_keeps_the_same_sets_or_differs_as_its_docstring_says(crosscheck):
    rows = crosscheck["rows"]
    assert {row["ratio"] for row in rows} == {0.5, 0.75, 0.9}
    failed = [(row["policy"], row["press"], row["ratio"], row["expect"]) for row in rows if not row["holds"]]
    assert failed == []
    identical = {row["press"] for row in rows if row["expect"] == "identical"}
    assert {"critical_adakv_snapkv", "snapkv", "chunkkv", "random_seed0", "knorm"} <= identical


def test_kvzip_scores_equal_kvpress_s_on_a_prompt_with_a_system_message(crosscheck):
    assert crosscheck["system"] in crosscheck["prefix_text"]  # the task's system message, not SmolLM2's default
    kvzip = crosscheck["kvzip"]
    np.testing.assert_allclose(kvzip["mine"], kvzip["theirs"], rtol=1e-4, atol=1e-7)
