"""Where a result came from: package versions, the git commit, and the settings that make runs repeatable.

``run.json`` (``pkvbench run``) and ``funnel.json`` (``pkvbench funnel``) record the same ``provenance()``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from pkvbench._version import __version__

RECORDED_PACKAGES = ("torch", "transformers")


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "pkvbench": __version__,
        **{p: package_version(p) for p in RECORDED_PACKAGES},
        "python": platform.python_version(),
    }


def git_commit() -> str | None:
    """The commit of the pkvbench checkout this code runs from (None for an installed wheel)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


# cuBLAS needs this before CUDA starts to have deterministic matrix products.
CUBLAS_WORKSPACE = ":4096:8"


def make_deterministic(seed: int) -> None:
    """Same command, same predictions: seed torch and ask for deterministic kernels (kernels with no deterministic
    version warn instead of failing)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    # torch.use_deterministic_algorithms also sets torch._inductor's `deterministic` flag, and importing the compiler
    # for that costs about a second of every run (the start-up's "checks" phase: 1.15 s before, 0.04 s after), which
    # never compiles. So: the same switch without that import; the compiler reads the environment variable if
    # something imports it later, or takes the flag if it is loaded.
    os.environ.setdefault("TORCHINDUCTOR_DETERMINISTIC", "1")
    import torch

    torch.manual_seed(seed)
    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].deterministic = True
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:  # a torch without the private switch: the public call, compiler import and all
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        setter(True, warn_only=True)


def determinism(seed: int) -> dict:
    """The settings ``make_deterministic`` applies, as recorded."""
    import torch

    return {
        "seed": seed,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "torch_threads": torch.get_num_threads(),
    }


def provenance(seed: int) -> dict:
    """What ``run.json`` and ``funnel.json`` record besides the options and the model."""
    return {
        "versions": versions(),
        "commit": git_commit(),
        "determinism": determinism(seed),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
