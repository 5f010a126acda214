"""``pkvbench run --executor ray``: a grid's samples run on Ray workers that each load the model once.

The driver (the ``pkvbench run`` process) loads only the tokenizer, builds the samples exactly as the local executor
does and stays the one writer of ``samples.jsonl``. Each worker is a Ray actor holding one model; it takes one sample
at a time with that sample's pending policy × budget grid (so the prefill is still shared) and streams each row back
as soon as it is decoded. A worker that dies loses only the rows it had not sent: a fresh worker takes over and redoes
what is still missing of that sample. Ray is imported here only, and only when asked for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pkvbench.errors import PkvError, first_line
from pkvbench.run.runner import (
    RowWriter,
    RunSettings,
    RunStats,
    load_run_model,
    pending_cells,
    plan_grid,
    run_sample,
)

RAY_HINT = "--executor ray needs Ray: pip install 'pkvbench[ray]'"
CPUS_PER_WORKER = 1  # also the worker's torch threads
MAX_ATTEMPTS = 3  # a sample whose worker dies this many times stops the run
# Environment the workers get from the driver (offline mode, caches, tokens for gated models, log levels).
FORWARDED_ENV_PREFIXES = ("HF_", "TRANSFORMERS_", "TOKENIZERS_", "PKVBENCH_")


@dataclass(frozen=True)
class RaySettings:
    address: str | None = None  # None: a cluster of this machine alone; "auto" or HOST:PORT: an existing one
    workers: int | None = None  # None: as many as the cluster's resources fit (never more than pending samples)
    gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs, else 0


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to load the same model the local executor would, seeded the same way: the run's model
    options (``options.model_settings``) and its seed."""

    model: str
    device: str
    dtype: str
    attn_implementation: str
    seed: int
    # Placed over the devices Ray gives the worker (``--device-map``; a worker of several GPUs: auto unless given).
    device_map: str | Mapping | None = None
    max_memory: Mapping | Sequence[str] = ()
    offload_folder: str | None = None


def check_ray() -> None:
    """Fail with one line, before anything slow, when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise PkvError(RAY_HINT)


class SampleWorker:
    """One model, loaded once, run on sample after sample (a Ray actor)."""

    def __init__(self, spec: ModelSpec, threads: int):
        import torch

        from pkvbench.engine.generation import Engine
        from pkvbench.run.provenance import make_deterministic

        torch.set_num_threads(threads)
        make_deterministic(spec.seed)
        self.loaded = load_run_model(spec)
        self.engine = Engine(self.loaded)

    def describe(self) -> dict:
        """The model's run.json record, with the GPUs Ray gave this worker (its model is placed over them)."""
        import ray

        return {**self.loaded.describe(), "worker_gpus": len(ray.get_gpu_ids())}

    def pid(self) -> int:
        return os.getpid()

    def run(self, task, sample, configs, settings):
        yield from run_sample(self.engine, task, sample, configs, settings)


def run_grid_on_ray(
    cluster: RaySettings,
    model: ModelSpec,
    tasks,
    cells,
    options,
    store,
    *,
    shard=None,
    settings: RunSettings | None = None,
    quiet: bool = False,
    on_model: Callable[[dict], None] | None = None,
    on_row: Callable[[dict], None] | None = None,
    items=None,
) -> RunStats:
    """``run_grid`` on a Ray cluster: same rows, same store, same resume. ``on_model`` receives the model's run.json
    record once the first worker has loaded it; ``items`` are the samples, if already built."""
    from pkvbench.engine.models import load_tokenizer

    started = time.perf_counter()
    check_ray()
    if model.device == "cuda" and cluster.gpus_per_worker == 0:
        raise PkvError("--device cuda with --gpus-per-worker 0: a worker has a GPU only when it reserves one")
    plan = plan_grid(
        tasks, None if items is not None else load_tokenizer(model.model), cells, options, store, shard, items
    )
    ray = _connect(cluster)
    try:
        pool = _Pool(ray, *_placement(ray, cluster, model, len(plan.pending)))
        if on_model:
            on_model(pool.describe())
        writer = RowWriter(store, plan, started=started, quiet=quiet, on_row=on_row)
        try:
            _drive(ray, pool, plan.pending, writer, settings or RunSettings())
        finally:
            writer.close()
    finally:
        ray.shutdown()
    return writer.stats


def _connect(settings: RaySettings):
    if settings.address is None:
        # A cluster started here serves this machine alone: Ray's switch for binding it to 127.0.0.1 (read when ray is
        # first imported), and no usage reports sent out from it (unless the environment asks for them).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError as exc:
        raise PkvError(f"{RAY_HINT} ({first_line(exc)})") from None
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    common = {"log_to_driver": False, "logging_level": logging.WARNING, "runtime_env": {"env_vars": env}}
    try:
        if settings.address is None:
            ray.init(address="local", include_dashboard=False, **common)
        else:
            ray.init(address=settings.address, **common)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        where = f"--ray-address {settings.address}" if settings.address else "starting a local Ray cluster"
        raise PkvError(f"{where}: {first_line(exc)}") from None
    return ray


def _placement(ray, settings: RaySettings, model: ModelSpec, pending: int) -> tuple[ModelSpec, float, int]:
    """The model as the workers load it, GPUs per worker, and how many workers, from the cluster's resources. A
    worker of several GPUs places its model over them (``--device-map auto``, unless a device map is given): Ray
    shows it those GPUs alone."""
    resources = ray.cluster_resources()
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    gpus_per_worker = settings.gpus_per_worker if settings.gpus_per_worker is not None else float(gpus >= 1)
    if gpus_per_worker > 1 and gpus_per_worker != int(gpus_per_worker):
        raise PkvError(f"--gpus-per-worker {gpus_per_worker:g}: a worker of more than one GPU takes whole GPUs")
    if model.device == "cuda" and not gpus_per_worker:
        raise PkvError("--device cuda: the Ray cluster has no GPUs")
    if model.device == "auto":  # a worker uses a GPU when Ray reserves it one, whatever its node has
        model = replace(model, device="cuda" if gpus_per_worker else "cpu")
    if gpus_per_worker > 1 and model.device == "cuda" and model.device_map is None:
        model = replace(model, device_map="auto")
    fits = int(cpus // CPUS_PER_WORKER)
    if gpus_per_worker:
        fits = min(fits, int(gpus / gpus_per_worker + 1e-9))
    if fits < 1:
        raise PkvError(
            f"the Ray cluster has {cpus:g} CPUs and {gpus:g} GPUs: no room for a worker of {CPUS_PER_WORKER} CPU "
            f"and {gpus_per_worker:g} GPUs (--gpus-per-worker)"
        )
    # More workers than fit now wait for resources (an autoscaling cluster adds them); more than pending samples idle.
    return model, gpus_per_worker, max(1, min(settings.workers or fits, pending))


class _Pool:
    def __init__(self, ray, model: ModelSpec, gpus_per_worker: float, size: int):
        self.ray = ray
        self.model = model
        self.actor_class = ray.remote(SampleWorker).options(
            num_cpus=CPUS_PER_WORKER, num_gpus=gpus_per_worker, max_restarts=0
        )
        self.actors = [self._start() for _ in range(size)]

    def _start(self):
        return self.actor_class.remote(self.model, CPUS_PER_WORKER)

    def replace(self, actor):
        with contextlib.suppress(Exception):  # gone already, or unreachable: make sure it is not half alive
            self.ray.kill(actor, no_restart=True)
        fresh = self._start()
        self.actors[self.actors.index(actor)] = fresh
        return fresh

    def describe(self) -> dict:
        from ray.exceptions import RayActorError

        try:
            return self.ray.get(self.actors[0].describe.remote())
        except RayActorError as exc:
            raise _worker_failed(exc) from None


def _worker_failed(exc) -> PkvError:
    """One line for a worker that could not start: our own error as the local run words it, else the last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    ours = f"{PkvError.__module__}.{PkvError.__name__}: "
    if last.startswith(ours):
        return PkvError(last[len(ours) :])
    return PkvError(f"a Ray worker could not load the model: {last}")


def _drive(ray, pool: _Pool, pending: list, writer: RowWriter, settings: RunSettings) -> None:
    """Hand samples to idle workers, write rows as they arrive, give a dead worker's sample to a fresh worker."""
    from ray.exceptions import RayActorError, RayTaskError

    queue = deque((task, sample, configs, 0) for task, sample, configs in pending)
    idle = deque(pool.actors)
    running = {}  # row stream → (worker, (task, sample, configs, deaths so far))
    while queue or running:
        while idle and queue:
            task, sample, configs, deaths = queue.popleft()
            todo = pending_cells(task, sample, configs, writer.written)
            if not todo:
                continue
            actor = idle.popleft()
            stream = actor.run.options(num_returns="streaming").remote(task, sample, todo, settings)
            running[stream] = (actor, (task, sample, todo, deaths))
            writer.stats.prefills += 1
        ready, _ = ray.wait(list(running), num_returns=1)
        for stream in ready:
            actor, (task, sample, configs, deaths) = running[stream]
            try:
                row = ray.get(next(stream))
            except StopIteration:
                del running[stream]
                idle.append(actor)
                continue
            except RayActorError as exc:
                del running[stream]
                if exc.actor_init_failed:
                    raise _worker_failed(exc) from None
                writer.stats.workers_lost += 1
                if deaths + 1 >= MAX_ATTEMPTS:
                    raise PkvError(
                        f"{task.name} sample {sample.sample_id}: its Ray worker died {deaths + 1} times; giving up "
                        "(the worker logs are under /tmp/ray/session_latest/logs on its node)"
                    ) from None
                queue.appendleft((task, sample, configs, deaths + 1))
                idle.append(pool.replace(actor))
                continue
            except RayTaskError as exc:  # an error in our code on the worker: the same error here
                cause = exc.cause
                if isinstance(cause, PkvError):
                    raise PkvError(str(cause)) from None
                raise (cause or exc) from None
            writer.write(row)
