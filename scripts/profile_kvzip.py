"""Where KVzip's time goes: its repeat passes against a plain prefill, timed and profiled in one process.

    .venv/bin/python scripts/profile_kvzip.py --lengths 2000,4000      # a few minutes on 2 cores

For each length, the needle prompt is prefilled plainly and with KVzip's statistics (prefill + repeat passes +
selection at 128 entries, as ``scripts/bench.py``'s KVzip row times it) in alternating pairs, ``--repeats`` times; the
best of each gives the ratio; the unfused path (the model's kernel plus the recorder's softmax, as before the fused one)
is timed in the same rounds. Then one plain prefill and one KVzip prefill run under ``torch.profiler``, and the
operators' self time is grouped: the model's attention kernel, the recorder's own attention (the repeat pass's
scores), the linear layers, cache copies, the rest. Writes a Markdown table to stdout (``docs/benchmark.md`` quotes
it). Run it alone if the seconds matter; the ratios inside one process are less sensitive to other load, and on a
shared machine ``--cpu-time --threads 1`` times each step by the CPU seconds it used (its work, nearly whatever else
runs).
"""

from __future__ import annotations

import time
from collections import defaultdict

import click
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pkvbench.cell.budgets import Budget
from pkvbench.engine import reconstruction
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model
from pkvbench.policies import parse_policy
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task


def needle_ids(engine: Engine, length: int) -> torch.Tensor:
    task = get_task("needle")
    sample = build_samples(task, engine.tokenizer, TaskOptions(lengths=(length,), depths=(50,)))[0]
    return torch.tensor([sample.input_ids])


def clock() -> float:
    """Wall seconds, or this process's CPU seconds under ``--cpu-time`` (other processes' load then counts far less)."""
    return time.process_time() if CPU_TIME else time.perf_counter()


CPU_TIME = False


def kvzip_seconds(engine: Engine, ids: torch.Tensor) -> float:
    policy = parse_policy("kvzip")
    started = clock()
    prefill = engine.prefill(ids, [policy])
    engine.compress(prefill, policy, Budget(128))
    return clock() - started


def unfused_seconds(engine: Engine, ids: torch.Tensor) -> float:
    """``kvzip_seconds`` on the unfused path (the model's kernel and the recorder's own softmax), as before."""
    fusable = reconstruction.fusable
    reconstruction.fusable = lambda query: False
    try:
        return kvzip_seconds(engine, ids)
    finally:
        reconstruction.fusable = fusable


def plain_seconds(engine: Engine, ids: torch.Tensor) -> float:
    started = clock()
    engine.prefill(ids, [])
    return clock() - started


def grouped(events) -> dict[str, float]:
    """Self CPU seconds per kind, the recorder's kernels counted apart from the model's."""
    totals: dict[str, float] = defaultdict(float)
    for event in events:
        seconds = event.self_cpu_time_total / 1e6
        if event.key.startswith("pkvbench::"):
            continue  # labels: their operators are counted below
        totals["all"] += seconds
    for event in events:
        if event.key == "pkvbench::kvzip scores":
            totals["KVzip scores (recorder)"] += event.cpu_time_total / 1e6
    return dict(totals)


def label_recorder() -> None:
    """Wrap the recorder's entry points in a profiler label (what the scores cost, whatever operators they use)."""
    recorder = reconstruction.ReconstructionRecorder
    for name in ("observe", "attend"):
        original = getattr(recorder, name, None)
        if original is None:
            continue

        def wrapped(self, *args, _original=original, **kwargs):
            with record_function("pkvbench::kvzip scores"):
                return _original(self, *args, **kwargs)

        setattr(recorder, name, wrapped)


def by_operator(events, top: int = 12) -> list[tuple[str, float]]:
    rows = sorted(
        ((e.key, e.self_cpu_time_total / 1e6) for e in events if not e.key.startswith("pkvbench::")),
        key=lambda r: -r[1],
    )
    return rows[:top]


@click.command()
@click.option("--lengths", default="2000,4000", show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Alternating plain/KVzip pairs per length.")
@click.option("--unfused/--no-unfused", "with_unfused", default=True, help="Also time the unfused path.")
@click.option("--profile/--no-profile", "with_profile", default=True, help="Also the torch.profiler breakdown.")
@click.option(
    "--cpu-time", is_flag=True, help="Time by this process's CPU seconds, not wall seconds (on a shared machine)."
)
@click.option("--threads", type=int, help="torch threads (1 with --cpu-time: the CPU seconds are then the work).")
def main(lengths, repeats, with_unfused, with_profile, cpu_time, threads):
    global CPU_TIME
    CPU_TIME = cpu_time
    if threads:
        torch.set_num_threads(threads)
    engine = Engine(load_model())
    label_recorder()
    print("| context | plain prefill s | prefill + KVzip's passes + selection s | ratio | unfused path s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    profiles = {}
    for length in (int(n) for n in lengths.split(",")):
        ids = needle_ids(engine, length)
        kvzip_seconds(engine, ids)  # warm-up
        plain, kvzip, unfused = float("inf"), float("inf"), float("inf")
        for _ in range(repeats):
            plain = min(plain, plain_seconds(engine, ids))
            kvzip = min(kvzip, kvzip_seconds(engine, ids))
            if with_unfused:
                unfused = min(unfused, unfused_seconds(engine, ids))
        print(
            f"| {length} | {plain:.2f} | {kvzip:.2f} | {kvzip / plain:.2f}× | "
            + (f"{unfused:.2f} | {unfused / plain:.2f}× |" if with_unfused else " | |")
        )
        if not with_profile:
            continue
        with profile(activities=[ProfilerActivity.CPU]) as plain_profile:
            plain_seconds(engine, ids)
        with profile(activities=[ProfilerActivity.CPU]) as kvzip_profile:
            kvzip_seconds(engine, ids)
        profiles[length] = (plain_profile.key_averages(), kvzip_profile.key_averages())
    for length, (plain_events, kvzip_events) in profiles.items():
        print(f"\nSelf CPU seconds by operator at {length} tokens (profiled; the profiler adds its own cost):\n")
        plain_ops, kvzip_ops = dict(by_operator(plain_events, 1000)), by_operator(kvzip_events)
        print("| operator | plain prefill | prefill + KVzip |")
        print("|---|---:|---:|")
        for name, seconds in kvzip_ops:
            print(f"| {name} | {plain_ops.get(name, 0.0):.2f} | {seconds:.2f} |")
        totals = grouped(kvzip_events)
        print(
            f"| total | {grouped(plain_events)['all']:.2f} | {totals['all']:.2f} |\n\n"
            f"Inside the recorder (the repeat passes' scores, all its operators): "
            f"{totals.get('KVzip scores (recorder)', 0.0):.2f} s."
        )


if __name__ == "__main__":
    main()
