"""Speed and memory of pkvbench's grid engine on the embedded model, as ratios measured in one run.

    python scripts/bench.py                 # everything; writes results/bench/bench.csv and bench.md (~30 min, 2 cores)
    python scripts/bench.py --lengths 2000 --skip-memory --skip-decode   # a quicker look

Run it alone: timings taken while other model jobs share the cores mean nothing.

1. grid: 5 policies × 4 budgets on a needle prompt, per context length — each configuration run alone (its own
   prefill and decode: how a one-configuration-per-call harness runs a grid) vs. one prefill and batched decoding
   (goal ≥ 10×); one prefill and configurations decoded one after another (``--decode-batch 1``) vs. batched
   (goal ≥ 2.5×); rows whose tokens differ between the three (goal 0).
2. statistics overhead: prefill + selection with SnapKV's or H2O's statistics vs. a plain prefill (goal ≤ 1.30×
   for H2O, ≤ 1.05× for SnapKV); KVzip's repeat passes vs. a plain prefill (its cost, no goal).
3. query modes: the same grid query-aware, query-agnostic, and both from one prefill.
4. memory: the growth of peak resident memory while the grid decodes (the peak reset after the prefill), batched vs.
   one at a time, and with decode-batch caps; the cap that keeps it within 1.5×.
5. KV bytes kept vs. the nominal budget; decode time per token at a long context, budget 128 vs. full cache; decode
   time per token of a cache stored in KIVI's 4 and 2 bits (dequantized at every step) vs. the same cache in 16 bits
   (``--quantized-only`` runs this row alone, at ``--decode-length``, and writes nothing).
6. optional: NVIDIA kvpress on the same prompt, when ``--kvpress-python`` names an interpreter with kvpress installed
   (``bash scripts/kvpress_env.sh`` builds one in .venv-kvpress): 9 configurations (full; SnapKV and StreamingLLM at
   the 4 budgets), one kvpress pipeline call each (``scripts/kvpress_grid.py``, in kvpress's environment), vs the same
   9 cells in pkvbench from one prefill, batched — query-agnostic on both sides, as kvpress compresses the context
   alone. The note says whether kvpress's tokens are pkvbench's prompt, and how many kept counts and answers agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click
import pandas as pd
import torch

from pkvbench.budgets import Budget, KVFormat
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model
from pkvbench.policies import parse_policy
from pkvbench.runner import Cell, RunSettings, run_sample
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]
BUDGETS = ["64", "128", "256", "512"]


def needle_sample(engine: Engine, length: int):
    task = get_task("needle")
    return task, build_samples(task, engine.tokenizer, TaskOptions(lengths=(length,), depths=(50,)))[0]


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def row(measure, context, baseline, ours, goal, note="", ratio=None):
    return {
        "measure": measure,
        "context": context,
        "baseline_s": None if baseline is None else round(baseline, 3),
        "ours_s": None if ours is None else round(ours, 3),
        "ratio": ratio if ratio is not None else round(baseline / ours, 2),
        "goal": goal,
        "note": note,
    }


def cells(modes=("aware",)) -> list[Cell]:
    return [Cell(parse_policy(p), Budget.parse(b), m) for p in POLICIES for b in BUDGETS for m in modes]


def grid_speed(engine: Engine, length: int) -> list[dict]:
    task, sample = needle_sample(engine, length)
    grid = cells()
    batched, batched_s = timed(lambda: list(run_sample(engine, task, sample, grid, RunSettings())))
    one_by_one, sequential_s = timed(lambda: list(run_sample(engine, task, sample, grid, RunSettings(decode_batch=1))))
    alone, alone_s = timed(lambda: [r for c in grid for r in run_sample(engine, task, sample, [c], RunSettings())])
    differ_sequential = sum(a["pred"] != b["pred"] for a, b in zip(batched, one_by_one))
    differ_alone = sum(a["pred"] != b["pred"] for a, b in zip(batched, alone))
    note = f"{len(grid)} configs; rows that differ from batched: sequential {differ_sequential}, alone {differ_alone}"
    return [
        row(
            "grid: each configuration alone vs one prefill + batched decoding",
            length,
            alone_s,
            batched_s,
            ">= 10x",
            note,
        ),
        row(
            "grid: one prefill + sequential decoding vs + batched decoding",
            length,
            sequential_s,
            batched_s,
            ">= 2.5x",
            f"decode-batch 1 vs auto; {differ_sequential} rows differ",
        ),
    ]


def statistics_overhead(engine: Engine, length: int, repeats: int = 2) -> list[dict]:
    _, sample = needle_sample(engine, length)
    ids = torch.tensor([sample.input_ids])
    plain = min(engine.prefill(ids, []).seconds for _ in range(repeats))
    rows = []
    for spec, goal in (("snapkv", "<= 1.05x"), ("pyramidkv", "<= 1.05x"), ("h2o", "<= 1.30x"), ("kvzip", "")):
        policy = parse_policy(spec)
        best = float("inf")
        for _ in range(repeats):
            prefill = engine.prefill(ids, [policy])
            _, select_s = timed(lambda: engine.compress(prefill, policy, Budget(128)))
            best = min(best, prefill.seconds + prefill.extra_seconds + select_s)
        what = "repeat passes" if spec == "kvzip" else "statistics"
        rows.append(
            row(
                f"prefill + {what} + selection vs plain prefill ({spec})",
                length,
                plain,
                best,
                goal,
                f"overhead {100 * (best / plain - 1):.0f}%",
                ratio=round(best / plain, 3),
            )
        )
    return rows


def query_modes(engine: Engine, length: int) -> list[dict]:
    task, sample = needle_sample(engine, length)
    times = {}
    for label, modes in (("aware", ("aware",)), ("agnostic", ("agnostic",)), ("both", ("aware", "agnostic"))):
        _, times[label] = timed(lambda m=modes: list(run_sample(engine, task, sample, cells(m), RunSettings())))
    return [
        row(
            "query modes: aware + agnostic run apart vs both from one prefill",
            length,
            times["aware"] + times["agnostic"],
            times["both"],
            "> 1x",
            f"aware {times['aware']:.1f} s, agnostic {times['agnostic']:.1f} s, both {times['both']:.1f} s",
        ),
    ]


def memory(length: int, python: str) -> list[dict]:
    """Peak memory growth while the grid decodes, per decode-batch cap, each in a fresh process."""
    growth = {}
    for cap in ("1", "2", "4", "8", "auto"):
        out = subprocess.run(
            [python, __file__, "--memory-probe", cap, "--lengths", str(length)],
            capture_output=True,
            text=True,
            check=True,
        )
        growth[cap] = json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"]
    within = [cap for cap in ("auto", "8", "4", "2") if growth[cap] <= 1.5 * growth["1"]]
    notes = ", ".join(f"cap {cap}: {growth[cap]:.0f} MB" for cap in growth)
    return [
        row(
            "peak memory growth while decoding: batched (auto) vs one at a time",
            length,
            None,
            None,
            "<= 1.5x",
            f"{notes}; largest cap within 1.5x: {within[0] if within else 'none'}",
            ratio=round(growth["auto"] / max(growth["1"], 1e-9), 2),
        )
    ]


def decode_memory(engine: Engine, length: int, cap: str) -> dict:
    """Run the grid with the peak resident set reset after the prefill; report its growth."""
    task, sample = needle_sample(engine, length)
    grid = cells()
    settings = RunSettings(decode_batch=None if cap == "auto" else int(cap))
    original = engine.decode_many

    def reset_then_decode(requests, max_rows=None):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak) to the current resident set
        baseline = _status_mb("VmRSS")
        decoded = original(requests, max_rows)
        probe["growth_mb"] = _status_mb("VmHWM") - baseline
        return decoded

    probe = {}
    engine.decode_many = reset_then_decode
    list(run_sample(engine, task, sample, grid, settings))
    return probe


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


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
            row(
                f"KV bytes kept vs nominal ({policy.label})",
                length,
                None,
                None,
                "= 1",
                f"{cache.nbytes} B kept, nominal {nominal} B",
                ratio=round(cache.nbytes / nominal, 4),
            )
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
        row(
            "decode per token (full cache vs budget 128)",
            length,
            per_token["full"],
            per_token["128"],
            ">= 2x",
            "seconds per token",
        )
    ]


def quantized_decode_speed(engine: Engine, length: int, new_tokens: int = 32, budget: str = "all") -> list[dict]:
    """Decode time per token of one cache (the full prompt's, by default) stored in KIVI's 4 and 2 bits against the
    same cache in 16 bits: the price of dequantizing the packed entries at every step (docs/memory.md)."""
    _, sample = needle_sample(engine, length)
    policy = parse_policy("full" if budget == "all" else "snapkv")
    prefill = engine.prefill(torch.tensor([sample.input_ids]), [policy])
    per_token, stored = {}, {}
    for bits in (16, 4, 2):
        cache = engine.compress(prefill, policy, Budget.parse(budget), fmt=KVFormat(bits))
        decoded = min((engine.decode(prefill, cache, new_tokens) for _ in range(2)), key=lambda d: d.seconds)
        per_token[bits] = decoded.seconds / max(1, len(decoded.tokens) - 1)
        stored[bits] = cache.nbytes
    return [
        row(
            f"decode per token, {bits}-bit vs 16-bit cache ({policy.label} @ {budget})",
            length,
            per_token[16],
            per_token[bits],
            "report",
            f"seconds per token; {stored[bits]} B vs {stored[16]} B stored",
        )
        for bits in (4, 2)
    ]


def kvpress_prompt(engine: Engine, length: int) -> dict:
    """The needle prompt as kvpress's pipeline takes it (scripts/kvpress_grid.py's ``--prompt`` file): the context
    as text without the chat template (kvpress applies it), the question as the text after the context in the user
    message (up to the template's closing tokens, leading blank line kept), the system prompt, and pkvbench's token
    ids of the whole prompt, which kvpress's tokens are checked against."""
    task, sample = needle_sample(engine, length)
    tokenizer, question = engine.tokenizer, sample.questions[0]
    marker = "\u2063"  # where the user's message starts in the rendered template
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": task.config["system"]}, {"role": "user", "content": marker}],
        add_generation_prompt=True,
        tokenize=False,
    )
    header = rendered[: rendered.index(marker)]
    context = tokenizer.decode(sample.context_ids)
    if not context.startswith(header):
        raise RuntimeError(f"the needle context does not start with the chat template's header {header!r}")
    special = set(tokenizer.all_special_ids)
    end = next((i for i, token in enumerate(question.ids) if token in special), len(question.ids))
    snapkv, streamingllm = parse_policy("snapkv"), parse_policy("streamingllm")
    return {
        "context": context[len(header) :],
        "question": tokenizer.decode(question.ids[:end]),
        "system": task.config["system"],
        "prompt_ids": sample.input_ids,
        "max_new_tokens": task.max_new_tokens,
        "budgets": [int(b) for b in BUDGETS],
        # pkvbench's SnapKV window and pooling kernel (kvpress's defaults are 64 and 5); kvpress pools by average,
        # pkvbench by max. StreamingLLM: the same 4 sinks.
        "snapkv": {"window_size": snapkv.window, "kernel_size": snapkv.kernel},
        "streamingllm": {"n_sink": streamingllm.sink},
    }


def kvpress(python: str, length: int, engine: Engine | None = None) -> list[dict]:
    """kvpress on the same prompt and a 9-configuration grid (full; SnapKV and StreamingLLM at the 4 budgets), one
    pipeline call per configuration, vs pkvbench's grid of the same 9 cells from one prefill, decoded batched.

    kvpress compresses the context alone and puts the question on top, so pkvbench's cells run query-agnostic.
    Both sides exclude model loading; each does one untimed warm-up first.
    """
    import tempfile

    from pkvbench.engine.models import model_path

    engine = engine or Engine(load_model())
    prompt = kvpress_prompt(engine, length)
    with tempfile.TemporaryDirectory() as folder:
        prompt_file = Path(folder) / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        out = subprocess.run(
            [
                python,
                str(Path(__file__).with_name("kvpress_grid.py")),
                "--prompt",
                str(prompt_file),
                "--model",
                model_path(engine.loaded.name)[0],
            ],
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:  # a row that says why, rather than losing the rows measured before it
        error = (out.stderr.strip().splitlines() or ["no output"])[-1]
        note = f"skipped: scripts/kvpress_grid.py under {python} exited {out.returncode}: {error}"
        return [row("grid of 9 configurations: kvpress vs pkvbench", length, None, None, "", note, ratio="")]
    result = json.loads(out.stdout.strip().splitlines()[-1])

    task, sample = needle_sample(engine, length)
    grid = [Cell(parse_policy("full"), Budget.parse(BUDGETS[0]), "agnostic")] + [
        Cell(parse_policy(p), Budget.parse(b), "agnostic") for p in ("snapkv", "streamingllm") for b in BUDGETS
    ]
    list(run_sample(engine, task, sample, grid[:1], RunSettings()))  # warm-up
    ours, pkvbench_s = timed(lambda: list(run_sample(engine, task, sample, grid, RunSettings())))
    theirs = result["results"]
    differ = [b["config"] for a, b in zip(ours, theirs) if a["pred"].strip() != b["answer"].strip()]
    same_kept = sum(set(a["kv_kept"]) == {b["kept"]} for a, b in zip(ours, theirs))
    per_config = ", ".join(f"{r['config']} {r['seconds']:.2f}" for r in theirs)
    return [
        row(
            "grid of 9 configurations: kvpress (a pipeline call each) vs pkvbench (one prefill, batched)",
            length,
            result["kvpress_s"],
            pkvbench_s,
            "",
            f"kvpress {result['kvpress_version']} (transformers {result['transformers_version']}); "
            f"{result['configs']} configs, query-agnostic; kvpress prompt == pkvbench's: {result['prompt_matches']}; "
            f"entries kept equal: {same_kept}/{len(grid)}; answers equal: {len(grid) - len(differ)}/{len(grid)}"
            f"{' (differ: ' + ', '.join(differ) + ')' if differ else ''}; "
            f"kvpress s per config: {per_config}",
        )
    ]


@click.command()
@click.option("--lengths", default="2000,4000", show_default=True, help="Context lengths for the grid and overheads.")
@click.option("--decode-length", default=8000, show_default=True, help="Context length for the decode measurement.")
@click.option("--out", default="results/bench", show_default=True, type=click.Path(file_okay=False))
@click.option("--skip-memory", is_flag=True)
@click.option("--skip-decode", is_flag=True)
@click.option("--kvpress-python", help="A Python with kvpress installed (scripts/kvpress_env.sh); adds its row.")
@click.option("--memory-probe", hidden=True)
@click.option(
    "--quantized-only", is_flag=True, help="Only the quantized-cache decode row, at --decode-length; writes nothing."
)
def main(lengths, decode_length, out, skip_memory, skip_decode, kvpress_python, memory_probe, quantized_only):
    torch.manual_seed(0)
    lengths = [int(x) for x in lengths.split(",")]
    engine = Engine(load_model())
    if memory_probe:
        print(json.dumps(decode_memory(engine, lengths[0], memory_probe)))
        return
    if quantized_only:
        print(pd.DataFrame(quantized_decode_speed(engine, decode_length)).to_string(index=False))
        return
    rows = []
    for length in lengths:
        rows += grid_speed(engine, length)
        rows += statistics_overhead(engine, length)
    rows += query_modes(engine, lengths[0])
    rows += kv_bytes(engine, lengths[0])
    if not skip_decode:
        rows += decode_speed(engine, decode_length)
        rows += quantized_decode_speed(engine, decode_length)
    if not skip_memory:
        rows += memory(lengths[0], sys.executable)
    if kvpress_python:
        rows += kvpress(kvpress_python, lengths[0])
    table = pd.DataFrame(rows)
    Path(out).mkdir(parents=True, exist_ok=True)
    table.to_csv(Path(out) / "bench.csv", index=False)
    (Path(out) / "bench.md").write_text(table.to_markdown(index=False) + "\n")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
