"""``pkvbench run --executor ray``: a local Ray cluster (loopback, 2 CPU workers), a worker killed mid-run."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pkvbench.cli import main
from pkvbench.store.results import read_rows, row_key

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray cluster at a time: these tests run on one xdist worker

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
OUTCOME = (
    "pred",
    "score",
    "kv_kept",
    "kv_bytes",
    "budget_tokens",
    "requested_tokens",
    "context_tokens",
    "answers",
    "new_tokens",
    "policy_options",
    "model",
    "length",
    "depth",
)
# Runs `pkvbench run` and says afterwards whether anything imported Ray.
RUN_AND_REPORT_RAY = (
    "import sys\nfrom pkvbench.cli import main\ntry:\n    main(sys.argv[1:])\n"
    "finally:\n    print('ray imported:', 'ray' in sys.modules)\n"
)


def outcomes(folder):
    return {row_key(r): {c: r.get(c) for c in OUTCOME} for r in read_rows(folder)}


def pkvbench_process(*args, code=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "pkvbench", *args]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def descendants(root: int) -> dict[int, str]:
    """pid → command line (Ray sets it to the process title) of every process below ``root``."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            titles[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier and pid not in found}
        found.update({pid: titles[pid] for pid in frontier})
    return found


@pytest.mark.model
def test_ray_run_with_a_killed_worker_equals_the_local_run(tmp_path, capsys):
    assert importlib.util.find_spec("ray"), "this test needs Ray: pip install -e '.[ray]' (scripts/setup.sh does)"
    local, distributed = tmp_path / "local", tmp_path / "ray"

    process = pkvbench_process("run", *GRID, "--out", str(local), code=RUN_AND_REPORT_RAY)
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err
    assert "9 rows written" in out and "ray imported: False" in out  # the local executor never imports Ray

    # The Ray run resumes a local one: start it from the local run's first two rows.
    distributed.mkdir()
    (distributed / "run.json").write_text((local / "run.json").read_text())
    seeded = (local / "samples.jsonl").read_text().splitlines(keepends=True)[:2]
    (distributed / "samples.jsonl").write_text("".join(seeded))

    process = pkvbench_process("run", *GRID, "--executor", "ray", "--workers", "2", "--out", str(distributed))
    killed, deadline = None, time.monotonic() + 540
    while killed is None and process.poll() is None and time.monotonic() < deadline:
        if len(read_rows(distributed)) > 2:  # the workers are streaming rows: kill one in the middle of a sample
            busy = [pid for pid, title in descendants(process.pid).items() if title.startswith("ray::SampleWorker.run")]
            if busy:
                killed = busy[0]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    out, err = process.communicate(timeout=max(1, deadline - time.monotonic()))
    assert killed is not None, f"no busy worker was found to kill\n{out}\n{err}"
    assert process.returncode == 0, err
    assert "7 rows written, 2 already done" in out and "1 lost worker(s) replaced" in out, out

    rows = read_rows(distributed)
    assert [json.dumps(r) for r in rows[:2]] == [json.dumps(json.loads(line)) for line in seeded]  # kept as they were
    assert len(rows) == 9 == len({row_key(r) for r in rows})  # no duplicates
    assert outcomes(distributed) == outcomes(local)  # row for row what the local executor wrote
    summaries = [sorted((folder / "summary.csv").read_text().splitlines()) for folder in (distributed, local)]
    assert summaries[0] == summaries[1]
    assert json.loads((distributed / "run.json").read_text())["executor"] == "ray"

    # ... and a local run resumes a Ray one: nothing is left to do.
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *GRID, "--out", str(distributed)])
    assert exit_info.value.code == 0
    assert "0 rows written, 9 already done" in capsys.readouterr().out


def test_ray_missing_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # what an install without the extra looks like to an import
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--executor", "ray", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "pkvbench: error: --executor ray needs Ray: pip install 'pkvbench[ray]'\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", [["--workers", "2"], ["--ray-address", "auto"], ["--gpus-per-worker", "1"]])
def test_ray_options_need_the_ray_executor(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *flag, "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "go with --executor ray" in capsys.readouterr().err


def test_a_worker_of_several_gpus_places_its_model_over_them():
    """``--gpus-per-worker 2`` on a cluster of 4 GPUs: two workers, each placing its model over its two GPUs
    (``--device-map auto`` unless a map is given); a fraction of more than one GPU is refused."""
    from dataclasses import replace
    from types import SimpleNamespace

    from pkvbench.errors import PkvError
    from pkvbench.run.ray_executor import ModelSpec, RaySettings, _placement

    cluster = SimpleNamespace(cluster_resources=lambda: {"CPU": 8.0, "GPU": 4.0})
    model = ModelSpec(model="smollm2-135m", device="auto", dtype="auto", attn_implementation="sdpa", seed=0)
    placed, gpus, workers = _placement(cluster, RaySettings(gpus_per_worker=2), model, pending=10)
    assert (placed.device, placed.device_map, gpus, workers) == ("cuda", "auto", 2, 2)
    given = replace(model, device="cuda", device_map="map.json")
    assert _placement(cluster, RaySettings(gpus_per_worker=2), given, pending=10)[0].device_map == "map.json"
    assert _placement(cluster, RaySettings(gpus_per_worker=1), model, pending=10)[0].device_map is None
    with pytest.raises(PkvError, match="--gpus-per-worker 1.5: a worker of more than one GPU takes whole GPUs"):
        _placement(cluster, RaySettings(gpus_per_worker=1.5), model, pending=10)


def test_a_ray_worker_of_two_gpus_writes_the_rows_of_the_local_run(tmp_path, tokenizer, monkeypatch, capsys):
    """A local Ray cluster that says it has 2 GPUs (Ray's own accounting; this machine may have none): a worker
    reserves both (``--gpus-per-worker 2``) and loads the model placed as ``--device-map`` says — on a CPU-only
    machine layers on the CPU and offloaded to the disk — and writes the rows of the local run on one device."""
    assert importlib.util.find_spec("ray"), "this test needs Ray: pip install -e '.[ray]' (scripts/setup.sh does)"
    import ray

    from tests.test_device_map import DEVICE_MAP, tiny_model

    folder = tiny_model(tmp_path, tokenizer)
    start = ray.init
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: start(*args, num_cpus=2, num_gpus=2, **kwargs))
    args = ["run", "--model", str(folder / "model"), "--task", "needle", "--lengths", "100", "--depths", "0,100"]
    args += ["--policy", "full,snapkv,adakv(snapkv):critical=true", "--budget", "32", "--max-new-tokens", "4"]
    args += ["--device", "cpu", "--quiet"]
    placed = ["--executor", "ray", "--gpus-per-worker", "2", "--device-map", str(folder / "map.json")]
    for run, extra in (("local", []), ("ray", placed)):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--out", str(tmp_path / run), *extra])
        assert exit_info.value.code == 0, capsys.readouterr().err
    assert outcomes(tmp_path / "ray") == outcomes(tmp_path / "local") and len(outcomes(tmp_path / "local")) == 6
    model = json.loads((tmp_path / "ray" / "run.json").read_text())["model"]
    assert model["worker_gpus"] == 2 and model["device_map"] == DEVICE_MAP
