"""Where the time goes: one decode step against the batch size, and H2O's statistics against a plain prefill.

    python scripts/profile_decode.py            # ~5 minutes on 2 cores; writes results/bench/profile.md and .json

Run it alone (other model jobs on the same cores make every number meaningless). It answers the benchmark's two
open questions (docs/benchmark.md):

1. Why batching the grid's decoding saves less than the batch size suggests. A decode step is timed at batch sizes
   1 … 20 on the grid's real compressed caches (5 policies × 4 budgets of a needle prompt), and profiled with
   ``torch.profiler`` at batch 1 and 20 (time per operator kind: the linear layers, the output layer, attention, the
   cache writes and masks, everything else). Then the grid's actual decoding is replayed from its rows' token counts:
   sequential decoding costs Σ rows' tokens × t(1); batched decoding Σ over steps of t(rows still running).
2. What H2O's accumulated attention costs beyond a plain prefill: the prefill profiled with and without it, the
   second flash-attention call and the tensors built for it timed apart.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import click
import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from pkvbench.cell.budgets import Budget
from pkvbench.engine.attention import decoding
from pkvbench.engine.decoding import plan_batches
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, RunSettings, run_sample
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]
BUDGETS = ["64", "128", "256", "512"]
BATCH_SIZES = [1, 2, 4, 8, 12, 16]  # the grid has 16 compressed configurations


def needle(engine: Engine, length: int):
    task = get_task("needle")
    return task, build_samples(task, engine.tokenizer, TaskOptions(lengths=(length,), depths=(50,)))[0]


def grid_requests(engine: Engine, sample):
    ids = torch.tensor([sample.input_ids])
    policies = [parse_policy(p) for p in POLICIES]
    prefill = engine.prefill(ids, policies)
    caches = [engine.compress(prefill, p, Budget.parse(b)) for p in policies[1:] for b in BUDGETS]
    return [engine.request(prefill, c, max_new_tokens=64) for c in caches]


def kind(name: str) -> str:
    """Operator families of a decode step or a prefill."""
    if name in ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear"):
        return "matmul"
    if "attention" in name or "sdpa" in name or "flash" in name:
        return "attention"
    if name in ("aten::scatter_", "aten::copy_", "aten::index", "aten::cat", "aten::pad", "aten::zeros", "aten::lt"):
        return "cache writes, masks, copies"
    return "other"


def op_table(prof) -> dict[str, float]:
    """Self CPU time per operator family, in ms, of top-level-relevant ops (self time: no double counting)."""
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        totals[kind(event.key)] += event.self_cpu_time_total / 1000
    return dict(totals)


def top_ops(prof, n: int = 8) -> list[tuple[str, float, int]]:
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [(e.key, round(e.self_cpu_time_total / 1000, 2), e.count) for e in events]


@torch.inference_mode()
def step_seconds(engine: Engine, requests, steps: int = 8) -> float:
    """Median seconds of one decode step of these requests as one batch (cache built beforehand, not counted)."""
    cache = engine.decoder.cache_for(requests, room=steps + 2)
    position = requests[0].position
    token = torch.full((len(requests), 1), 100)
    times = []
    with decoding(cache):
        for step in range(steps + 1):
            positions = torch.full((len(requests), 1), position + step)
            started = time.perf_counter()
            engine._forward(token, cache, positions)
            times.append(time.perf_counter() - started)
    times = sorted(times[1:])  # the first step warms up
    return times[len(times) // 2]


@torch.inference_mode()
def profile_step(engine: Engine, requests) -> tuple[dict, list]:
    cache = engine.decoder.cache_for(requests, room=8)
    position = requests[0].position
    token = torch.full((len(requests), 1), 100)
    with decoding(cache):
        engine._forward(token, cache, torch.full((len(requests), 1), position))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(1, 5):
                engine._forward(token, cache, torch.full((len(requests), 1), position + step))
    return {k: round(v / 4, 2) for k, v in op_table(prof).items()}, top_ops(prof)


def replay(rows: list[dict], t: dict[int, float], planned: list[list[int]]) -> dict:
    """Decode time predicted from step times (of the smallest caches first: an upper bound on padding's cost is not
    modelled): sequential Σ tokens × t(1); one batch Σ over steps of t(live rows); as ``plan_batches`` plans, the
    same per planned batch."""
    compressed = [r for r in rows if r["policy"] != "full"]
    tokens = [r["new_tokens"] for r in compressed]
    sequential = sum(tokens) * t[1]
    sizes = sorted(t)

    def at(b):  # step time at batch b, interpolated
        lower = max(s for s in sizes if s <= b)
        upper = min(s for s in sizes if s >= b)
        if lower == upper:
            return t[lower]
        return t[lower] + (t[upper] - t[lower]) * (b - lower) / (upper - lower)

    def batch_seconds(members):
        counts = [tokens[i] for i in members]
        return sum(at(sum(n > step for n in counts)) for step in range(max(counts)))

    batched = batch_seconds(range(len(tokens)))
    as_planned = sum(batch_seconds(members) for members in planned)
    return {
        "rows": len(tokens),
        "tokens": sum(tokens),
        "longest": max(tokens),
        "batches": sorted({r["decode_batch"] for r in compressed}),
        "sequential_s": round(sequential, 2),
        "batched_s": round(batched, 2),
        "ratio": round(sequential / batched, 2),
        "planned_batches": [len(m) for m in planned],
        "planned_s": round(as_planned, 2),
        "planned_ratio": round(sequential / as_planned, 2),
    }


@torch.inference_mode()
def h2o_profile(engine: Engine, sample) -> dict:
    ids = torch.tensor([sample.input_ids])
    h2o = parse_policy("h2o")
    engine.prefill(ids, [])  # warm up
    plain = min(engine.prefill(ids, []).seconds for _ in range(2))
    with_stats = min(engine.prefill(ids, [h2o]).seconds for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof_plain:
        engine.prefill(ids, [])
    with profile(activities=[ProfilerActivity.CPU]) as prof_h2o:
        engine.prefill(ids, [h2o])
    flash = "aten::_scaled_dot_product_flash_attention_for_cpu"

    def flash_ms(prof):
        return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == flash) / 1000

    return {
        "plain_s": round(plain, 3),
        "h2o_s": round(with_stats, 3),
        "ratio": round(with_stats / plain, 3),
        "plain_ops_ms": {k: round(v, 1) for k, v in op_table(prof_plain).items()},
        "h2o_ops_ms": {k: round(v, 1) for k, v in op_table(prof_h2o).items()},
        "flash_ms_plain": round(flash_ms(prof_plain), 1),
        "flash_ms_h2o": round(flash_ms(prof_h2o), 1),
        "top_h2o": top_ops(prof_h2o, 10),
    }


@click.command()
@click.option("--lengths", default="2000,4000")
@click.option("--out", default="results/bench/profile", type=click.Path())
def main(lengths, out):
    torch.manual_seed(0)
    engine = Engine(load_model())
    report = {"threads": torch.get_num_threads(), "lengths": {}}
    for length in [int(x) for x in lengths.split(",")]:
        task, sample = needle(engine, length)
        in_grid_order = grid_requests(engine, sample)
        planned = plan_batches(in_grid_order, None)
        requests = sorted(in_grid_order, key=lambda r: r.kept.entries)
        steps = {b: step_seconds(engine, requests[:b]) for b in BATCH_SIZES}
        full = step_seconds(engine, [engine.request(*_full(engine, sample), max_new_tokens=64)])
        ops = {b: profile_step(engine, requests[:b]) for b in (1, 16)}
        grid = [Cell(parse_policy(p), Budget.parse(b), "aware") for p in POLICIES for b in BUDGETS]
        rows = list(run_sample(engine, task, sample, grid, RunSettings()))
        report["lengths"][length] = {
            "step_ms": {b: round(1000 * s, 2) for b, s in steps.items()},
            "full_cache_step_ms": round(1000 * full, 2),
            "ops_ms_per_step": {b: o[0] for b, o in ops.items()},
            "top_ops": {b: o[1] for b, o in ops.items()},
            "replay": replay(rows, steps, planned),
            "h2o": h2o_profile(engine, sample),
        }
        print(json.dumps(report["lengths"][length], indent=1), flush=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def markdown(report: dict) -> str:
    """The profile as the tables docs/benchmark.md quotes (pandas' Markdown)."""
    lengths = report["lengths"]
    steps = pd.DataFrame(
        {f"{n} tokens: ms per step": [_at(d["step_ms"], b) for b in BATCH_SIZES] for n, d in lengths.items()}
        | {
            f"{n} tokens: × one row": [_at(d["step_ms"], b) / _at(d["step_ms"], 1) for b in BATCH_SIZES]
            for n, d in lengths.items()
        },
        index=pd.Index(BATCH_SIZES, name="rows"),
    )
    ops = pd.DataFrame(
        [{"context": n, "rows": b, **o} for n, d in lengths.items() for b, o in d["ops_ms_per_step"].items()]
    )
    replays = pd.DataFrame([{"context": n, **d["replay"]} for n, d in lengths.items()])
    h2o = pd.DataFrame(
        [
            {
                "context": n,
                "plain s": h["plain_s"],
                "with H2O's statistics s": h["h2o_s"],
                "ratio": h["ratio"],
                **{f"{family} ms, plain": h["plain_ops_ms"].get(family, 0) for family in FAMILIES},
                **{f"{family} ms, H2O": h["h2o_ops_ms"].get(family, 0) for family in FAMILIES},
            }
            for n, d in lengths.items()
            for h in [d["h2o"]]
        ]
    )
    return (
        "\n\n".join(
            [
                "# Profile of a decode step and of H2O's statistics",
                f"`python scripts/profile_decode.py` (CPU, float32, {report['threads']} threads; `profile.json` has all).",
                "## One decode step against the batch size (the grid's compressed caches, smallest first)",
                steps.to_markdown(floatfmt=".2f"),
                "Time per step by operator family (torch.profiler, self CPU time, ms):",
                ops.to_markdown(index=False, floatfmt=".1f"),
                "The grid's decoding replayed from its rows' token counts and the step times above (seconds):",
                replays.to_markdown(index=False),
                "## H2O's statistics against a plain prefill (operator families' self CPU time)",
                h2o.to_markdown(index=False, floatfmt=".2f"),
            ]
        )
        + "\n"
    )


FAMILIES = ["matmul", "attention", "cache writes, masks, copies", "other"]


def _at(steps: dict, b: int) -> float:
    return steps[str(b)] if str(b) in steps else steps[b]


def _full(engine: Engine, sample):
    prefill = engine.prefill(torch.tensor([sample.input_ids]), [])
    return prefill, engine.compress(prefill, parse_policy("full"), Budget.parse("64"))


if __name__ == "__main__":
    main()
