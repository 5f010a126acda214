"""An outside package that plugs into pkvbench through entry points, built and installed as a user would do it:
a wheel from a pyproject.toml, installed into a folder of its own that a subprocess gets on its PYTHONPATH (so the
test process's own entry points stay as they are). Used by the policy, task generator and metric plugin tests."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def pyproject(package: str, entry_points: dict[str, dict[str, str]]) -> str:
    """A minimal pyproject.toml for ``package`` registering ``entry_points`` ({group: {name: "module:attr"}})."""
    lines = [
        "[build-system]",
        'requires = ["setuptools>=68"]',
        'build-backend = "setuptools.build_meta"',
        "",
        "[project]",
        f'name = "{package.replace("_", "-")}"',
        'version = "0.1.0"',
    ]
    for group, entries in entry_points.items():
        lines += [
            "",
            f'[project.entry-points."{group}"]',
            *(f'{name} = "{target}"' for name, target in entries.items()),
        ]
    return "\n".join(lines) + "\n"


def install_plugin(root: Path, package: str, source: str, entry_points: dict[str, dict[str, str]]) -> Path:
    """Build ``package`` (one module, ``source``) into a wheel under ``root`` and install it into ``root/site``."""
    project = root / "src"
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text(textwrap.dedent(source))
    (project / "pyproject.toml").write_text(pyproject(package, entry_points))
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(root / "dist"), str(project)], check=True, capture_output=True
    )
    wheels = list((root / "dist").glob("*.whl"))
    assert len(wheels) == 1
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheels[0])], check=True, capture_output=True
    )
    return root / "site"


def pkvbench_with(site: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m pkvbench ARGS`` with the installed plugin importable."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run([sys.executable, "-m", "pkvbench", *args], capture_output=True, text=True, env=env)
