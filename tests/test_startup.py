"""A run's start-up, as ``scripts/startup_probe.py`` reads it off a real ``pkvbench run`` stopped at its first
prefill: every phase accounted for, and nothing imported that a run does not need."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pkvbench.engine.models import DEFAULT_MODEL, model_path

PROBE = Path(__file__).parents[1] / "scripts" / "startup_probe.py"
# Report, plotting and distribution libraries (a run writes rows and a summary, nothing else), and gguf: once the
# float copy exists, the model's context window comes from its config.json, not from parsing the GGUF file.
NOT_IMPORTED = {"altair", "vl_convert", "matplotlib", "seaborn", "ray", "datasets", "gguf"}
PHASES = [
    "python start",
    "imports",
    "checks",
    "task build",
    "model: config",
    "model: tokenizer",
    "model: weights",
    "model: other",
    "to first prefill",
]


@pytest.mark.model
def test_a_run_reaches_its_first_prefill_without_report_plot_or_gguf_libraries(tmp_path):
    model_path(DEFAULT_MODEL)  # the float copy exists (the first run ever makes it, from the GGUF file)
    report = tmp_path / "startup.json"
    command = [sys.executable, str(PROBE), "--out-json", str(report), "--launched", repr(time.time()), "--", "run"]
    command += ["--task", "needle", "--policy", "full,snapkv", "--budget", "64", "--lengths", "300", "--depths", "50"]
    subprocess.run([*command, "--out", str(tmp_path / "run"), "--quiet"], check=True, capture_output=True)
    startup = json.loads(report.read_text())
    imported = {module.split(".")[0] for module in startup["modules"]}
    assert not imported & NOT_IMPORTED
    assert {"torch", "transformers", "pkvbench"} <= imported
    phases = startup["phases_s"]
    assert list(phases) == PHASES
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["model: weights"] > 0 and phases["task build"] > 0
    assert sum(phases.values()) == pytest.approx(startup["total_s"], abs=0.05)  # the phases cover the whole start-up
    assert not (tmp_path / "run" / "samples.jsonl").exists() or not (tmp_path / "run" / "samples.jsonl").read_text()


def test_deterministic_kernels_are_asked_for_without_importing_the_compiler():
    # torch.use_deterministic_algorithms imports torch._inductor to set its flag: about a second of every run that
    # never compiles. make_deterministic sets the same switches without it.
    script = (
        "import os, sys, torch\n"
        "from pkvbench.run.provenance import make_deterministic\n"
        "make_deterministic(0)\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "assert torch.is_deterministic_algorithms_warn_only_enabled()\n"
        "assert 'torch._inductor' not in sys.modules, 'the compiler was imported'\n"
        "import torch._inductor.config as inductor\n"
        "assert inductor.deterministic, 'a compiler imported later is not deterministic'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
