"""Wall time of the Ray test grid (tests/test_ray.py, no kill): local executor vs. 1 and 2 local Ray workers.

    .venv/bin/python scripts/bench_ray.py [--repeat N]     # with nothing else busy on the machine

Each run is a fresh `pkvbench run` process into a fresh folder, timed from start to exit: Ray's runs include starting
the cluster and each worker's model load, as a user would see them. Prints a Markdown table and checks that every run
wrote the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pkvbench.store.results import read_rows, row_key

GRID = [
    "--task",
    "needle",
    "--policy",
    "full,snapkv,pyramidkv",
    "--budget",
    "64",
    "--lengths",
    "1000",
    "--depths",
    "0,50,100",
    "--quiet",
]
SETUPS = {
    "local executor": [],
    "ray, 1 worker": ["--executor", "ray", "--workers", "1"],
    "ray, 2 workers": ["--executor", "ray", "--workers", "2"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    times: dict[str, list[float]] = {name: [] for name in SETUPS}
    outcomes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeat):
            for name, flags in SETUPS.items():
                out = Path(tmp) / f"{round_}-{name.replace(' ', '_').replace(',', '')}"
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "pkvbench", "run", *GRID, *flags, "--out", str(out)],
                    env=env,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                times[name].append(time.perf_counter() - started)
                rows = {row_key(r): (r["pred"], r["score"], r["kv_kept"]) for r in read_rows(out)}
                outcomes[name] = json.dumps(sorted(rows.items()))
                print(f"{name}: {times[name][-1]:.1f} s", file=sys.stderr)
    assert len(set(outcomes.values())) == 1, "the executors wrote different rows"
    base = min(times["local executor"])
    print(f"| setup ({os.cpu_count()} CPU cores) | wall time (s) | speed vs. local |\n|---|---:|---:|")
    for name, values in times.items():
        best = min(values)
        print(f"| {name} | {' / '.join(f'{v:.1f}' for v in values)} | {base / best:.2f}× |")


if __name__ == "__main__":
    main()
