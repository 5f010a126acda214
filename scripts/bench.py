"""Speed and memory of pkvbench's grid engine on the embedded model, as ratios measured in one run.

    python scripts/bench.py                      # everything; writes results/bench/bench.csv and bench.md
    python scripts/bench.py --lengths 2000 --decode-length 4000 --skip-rss   # a quicker look

1. grid speed: 5 policies × 4 budgets on a needle sample, one shared prefill vs. each configuration run alone
   (its own prefill and decode), per context length. Goal ≥ 4×.
2. selection overhead: prefill with the statistics SnapKV/PyramidKV (window) or H2O (accumulated) need, plus
   selection, vs. a plain full-cache prefill. Goals ≤ 5% and ≤ 30%.
3. decode time per token at a long context, budget 128 vs. full cache. Goal ≥ 2×.
4. physical KV bytes kept vs. the nominal budget (layers × KV heads × head dim × 2 × dtype size × entries), and
   peak RSS of a grid vs. a single configuration (each in a fresh process).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import click
import pandas as pd
import torch

from pkvbench.budgets import Budget
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model
from pkvbench.policies import parse_policy
from pkvbench.runner import Cell, run_sample
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]
BUDGETS = ["32", "64", "128", "0.05"]


def needle_sample(engine: Engine, length: int):
    task = get_task("needle")
    return task, build_samples(task, engine.tokenizer, TaskOptions(lengths=(length,), depths=(50,)))[0]


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def grid_speed(engine: Engine, length: int) -> list[dict]:
    task, sample = needle_sample(engine, length)
    configs = [Cell(parse_policy(p), Budget.parse(b)) for p in POLICIES for b in BUDGETS]
    shared, shared_s = timed(lambda: list(run_sample(engine, task, sample, configs)))
    alone, alone_s = timed(lambda: [r for c in configs for r in run_sample(engine, task, sample, [c])])
    same = [r["pred"] for r in shared] == [r["pred"] for r in alone]
    return [
        {
            "measure": "grid speed (shared vs alone)",
            "context": length,
            "baseline_s": round(alone_s, 2),
            "ours_s": round(shared_s, 2),
            "ratio": round(alone_s / shared_s, 2),
            "goal": ">= 4x",
            "note": f"{len(configs)} configs; identical predictions: {same}",
        }
    ]


def selection_overhead(engine: Engine, length: int, repeats: int = 2) -> list[dict]:
    _, sample = needle_sample(engine, length)
    ids = torch.tensor([sample.input_ids])
    plain = min(engine.prefill(ids, []).seconds for _ in range(repeats))
    rows = []
    for spec, goal in (("snapkv", 0.05), ("pyramidkv", 0.05), ("h2o", 0.30)):
        policy = parse_policy(spec)
        best = float("inf")
        for _ in range(repeats):
            prefill = engine.prefill(ids, [policy])
            _, select_s = timed(lambda: engine.compress(prefill, policy, Budget(128)))
            best = min(best, prefill.seconds + select_s)
        rows.append(
            {
                "measure": f"selection overhead ({spec})",
                "context": length,
                "baseline_s": round(plain, 3),
                "ours_s": round(best, 3),
                "ratio": round(best / plain, 3),
                "goal": f"<= {1 + goal:.2f}x",
                "note": f"overhead {100 * (best / plain - 1):.1f}%",
            }
        )
    return rows


def decode_speed(engine: Engine, length: int, new_tokens: int = 32) -> list[dict]:
    _, sample = needle_sample(engine, length)
    policy = parse_policy("snapkv")
    prefill = engine.prefill(torch.tensor([sample.input_ids]), [policy])
    per_token = {}
    for label, pol in (("full", parse_policy("full")), ("128", policy)):
        cache = engine.compress(prefill, pol, Budget(128))
        decoded = min((engine.decode(prefill, cache, new_tokens) for _ in range(2)), key=lambda d: d.seconds)
        per_token[label] = decoded.seconds / max(1, len(decoded.tokens) - 1)
    return [
        {
            "measure": "decode per token (budget 128 vs full)",
            "context": length,
            "baseline_s": round(per_token["full"], 4),
            "ours_s": round(per_token["128"], 4),
            "ratio": round(per_token["full"] / per_token["128"], 2),
            "goal": ">= 2x",
            "note": "seconds per token",
        }
    ]


def kv_bytes(engine: Engine, length: int) -> list[dict]:
    _, sample = needle_sample(engine, length)
    policies = [parse_policy(p) for p in POLICIES[1:]]
    prefill = engine.prefill(torch.tensor([sample.input_ids]), policies)
    loaded = engine.loaded
    entry_bytes = loaded.num_kv_heads * loaded.head_dim * 2 * prefill.keys[0].element_size()
    rows = []
    for policy in policies:
        cache = engine.compress(prefill, policy, Budget(128))
        nominal = loaded.num_layers * 128 * entry_bytes
        rows.append(
            {
                "measure": f"KV bytes kept vs nominal ({policy.label})",
                "context": length,
                "baseline_s": None,
                "ours_s": None,
                "ratio": round(cache.nbytes / nominal, 4),
                "goal": "= 1",
                "note": f"{cache.nbytes} B kept, nominal {nominal} B",
            }
        )
    return rows


def peak_rss(length: int) -> list[dict]:
    """Peak RSS of a grid vs. a single configuration, each in a fresh process."""
    peaks = {}
    for mode in ("single", "grid"):
        out = subprocess.run(
            [sys.executable, __file__, "--rss-probe", mode, "--lengths", str(length)],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[mode] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    return [
        {
            "measure": "peak RSS (grid vs single config)",
            "context": length,
            "baseline_s": None,
            "ours_s": None,
            "ratio": round(peaks["grid"] / peaks["single"], 3),
            "goal": "",
            "note": f"grid {peaks['grid']:.0f} MB, single {peaks['single']:.0f} MB",
        }
    ]


@click.command()
@click.option("--lengths", default="2000,4000", show_default=True, help="Context lengths for grid speed and overhead.")
@click.option("--decode-length", default=8000, show_default=True, help="Context length for the decode measurement.")
@click.option("--out", default="results/bench", show_default=True, type=click.Path(file_okay=False))
@click.option("--skip-rss", is_flag=True)
@click.option("--rss-probe", type=click.Choice(["single", "grid"]), hidden=True)
def main(lengths, decode_length, out, skip_rss, rss_probe):
    torch.manual_seed(0)
    lengths = [int(x) for x in lengths.split(",")]
    engine = Engine(load_model())
    if rss_probe:
        task, sample = needle_sample(engine, lengths[0])
        policies = POLICIES if rss_probe == "grid" else ["pyramidkv"]
        budgets = BUDGETS if rss_probe == "grid" else ["128"]
        list(
            run_sample(
                engine, task, sample, [Cell(parse_policy(p), Budget.parse(b)) for p in policies for b in budgets]
            )
        )
        print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    rows = []
    for length in lengths:
        rows += grid_speed(engine, length)
        rows += selection_overhead(engine, length)
    rows += decode_speed(engine, decode_length)
    rows += kv_bytes(engine, lengths[0])
    if not skip_rss:
        rows += peak_rss(lengths[0])
    table = pd.DataFrame(rows)
    Path(out).mkdir(parents=True, exist_ok=True)
    table.to_csv(Path(out) / "bench.csv", index=False)
    (Path(out) / "bench.md").write_text(table.to_markdown(index=False) + "\n")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
