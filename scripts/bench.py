"""Speed and memory of pkvbench's grid engine on the embedded model, as ratios measured in one run.

    python scripts/bench.py --kvpress-python .venv-kvpress/bin/python   # every row; results/bench/bench.{csv,md}
    python scripts/bench.py --only startup,process      # some row groups; their rows replace those in bench.csv
    python scripts/bench.py --lengths 2000 --skip-memory --skip-decode  # a quicker look

Run it alone: timings taken while other model jobs share the cores mean nothing.

Row groups (``--only``):

1. grid: 5 policies × 4 budgets on a needle prompt, per context length — each configuration run alone (its own
   prefill and decode: how a one-configuration-per-call harness runs a grid) vs. one prefill and batched decoding
   (goal ≥ 10×); one prefill and configurations decoded one after another (``--decode-batch 1``) vs. batched
   (goal ≥ 2.5×); rows whose tokens differ between the three (goal 0).
2. stats: prefill + selection with SnapKV's or H2O's statistics vs. a plain prefill (goal ≤ 1.30× for H2O,
   ≤ 1.05× for SnapKV); KVzip's repeat passes vs. a plain prefill (goal ≤ 2.5×: its authors report 2×).
3. modes: the same grid query-aware, query-agnostic, and both from one prefill.
4. bytes: KV bytes kept vs. the nominal budget. decode: decode time per token at a long context, budget 128 vs.
   full cache, and of a cache stored in KIVI's 4 and 2 bits (dequantized at every step) vs. the same cache in 16 bits
   (``--quantized-only`` runs this row alone, at ``--decode-length``, and writes nothing). memory: the growth of peak resident memory while the grid decodes (the peak reset after the
   prefill), batched vs. one at a time, and with decode-batch caps; the cap that keeps it within 1.5×.
5. startup: the README's demo ``pkvbench run`` from launch to its first prefill, by phase (``scripts/startup_probe.py``:
   imports, checks, model config / tokenizer / weights, task build), best of 3, against a bare transformers load of
   the same model folder in a fresh process (the floor any transformers harness pays); goal ≤ 5 s.
6. process: the grid of 1. at the first length as two whole ``pkvbench run`` processes, ``--decode-batch 1`` vs.
   batched, model load and start-up included (goal ≥ 1.8×).
7. kvpress (needs ``--kvpress-python``, an interpreter with NVIDIA kvpress: ``bash scripts/kvpress_env.sh`` builds
   .venv-kvpress): 9 configurations (full; SnapKV and StreamingLLM at the 4 budgets) on the needle prompt, one
   kvpress pipeline call each (``scripts/kvpress_grid.py``), vs the same 9 cells in pkvbench from one prefill,
   batched — query-agnostic on both sides, as kvpress compresses the context alone.
8. leaderboard (needs ``--kvpress-python``): kvpress's leaderboard on RULER prompts at 4000 tokens
   (``--leaderboard-tasks``, ``--leaderboard-limit``), run as its ``evaluation/leaderboard.sh`` runs it — a process per
   press and query mode (``scripts/kvpress_leaderboard.py``), a pipeline call per prompt × compression ratio — vs.
   one ``pkvbench run`` of the same policies at kvpress's settings × ``cr0.25 … cr0.875`` in both query modes; whole
   processes on both sides. Kept counts and answers are compared cell by cell (``OUT/leaderboard.csv``).
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

from pkvbench.cell.budgets import Budget
from pkvbench.cell.kv_formats import KVFormat
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import load_model
from pkvbench.engine.reconstruction import repeat_inputs
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, RunSettings, run_sample
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]
BUDGETS = ["64", "128", "256", "512"]


def decode_alone(engine: Engine, prefill, cache, new_tokens: int):
    """One compressed cache decoded greedily, alone (a batch of one)."""
    return engine.decode_many([engine.request(prefill, cache, new_tokens)])[0]


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


def kvzip_floor(config, length: int, passes: list[tuple[int, int]]) -> tuple[float, float]:
    """The least KVzip's prefill + repeat passes can cost over a plain prefill of ``length`` tokens, counting FLOPs at
    equal throughput, for a model of ``config`` (a transformers config): ``(floor, floor with the scores' own q·k
    product)``. ``passes``: (the pass's tokens, the chunk entries it scores) per repeat pass. A pass's tokens run the
    same projections and MLP as the prompt's and attend over the whole prompt as well as causally over themselves;
    the scores need each query's q·k against its chunk's keys once more. Above this floor is time lost to kernels."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    query_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    projections = 2 * config.hidden_size * dim * (2 * query_heads + 2 * kv_heads)
    per_token = config.num_hidden_layers * (projections + 2 * 3 * config.hidden_size * config.intermediate_size)
    per_pair = 2 * 2 * query_heads * dim * config.num_hidden_layers  # q·k and the weighted sum of values
    last_logits = 2 * config.hidden_size * config.vocab_size  # every forward computes the last position's only

    def forward(tokens: int, cached: int) -> int:
        return tokens * per_token + (tokens * cached + tokens * (tokens + 1) // 2) * per_pair + last_logits

    prefill = forward(length, 0)
    floor = (prefill + sum(forward(tokens, length) for tokens, _ in passes)) / prefill
    return floor, floor + sum(tokens * scored for tokens, scored in passes) * per_pair / 2 / prefill


def statistics_overhead(engine: Engine, length: int, repeats: int = 2) -> list[dict]:
    _, sample = needle_sample(engine, length)
    ids = torch.tensor([sample.input_ids])
    plain = min(engine.prefill(ids, []).seconds for _ in range(repeats))
    rows = []
    for spec, goal in (("snapkv", "<= 1.05x"), ("pyramidkv", "<= 1.05x"), ("h2o", "<= 1.30x"), ("kvzip", "<= 2.5x")):
        policy = parse_policy(spec)
        best = float("inf")
        for _ in range(repeats):
            prefill = engine.prefill(ids, [policy])
            _, select_s = timed(lambda: engine.compress(prefill, policy, Budget(128)))
            best = min(best, prefill.seconds + prefill.extra_seconds + select_s)
        what = "repeat passes" if spec == "kvzip" else "statistics"
        note = f"overhead {100 * (best / plain - 1):.0f}%"
        if spec == "kvzip":
            _, inputs = repeat_inputs(engine.tokenizer, sample.input_ids, policy.chunk)
            passes = [(len(tokens), end - start) for start, end, tokens in inputs]
            floor, with_scores = kvzip_floor(engine.model.config, len(sample.input_ids), passes)
            note += f"; arithmetic floor {floor:.2f}x, {with_scores:.2f}x with the scores' q.k product"
        rows.append(
            row(
                f"prefill + {what} + selection vs plain prefill ({spec})",
                length,
                plain,
                best,
                goal,
                note,
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
        decoded = min((decode_alone(engine, prefill, cache, new_tokens) for _ in range(2)), key=lambda d: d.seconds)
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
        decoded = min((decode_alone(engine, prefill, cache, new_tokens) for _ in range(2)), key=lambda d: d.seconds)
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


def kvpress_texts(tokenizer, system: str | None, sample, question) -> dict:
    """One pkvbench prompt as kvpress's pipeline takes it: the context as text without the chat template (kvpress
    applies it), the question as the text after the context in the user message (up to the template's closing
    tokens, leading blank line kept), the answer prefix (the text after the template's generation prompt), the
    system message, and pkvbench's token ids of the whole prompt, which kvpress's tokens are checked against."""
    marker = "\u2063"  # where the user's message goes in the rendered template
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": marker}]
    header, suffix = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).split(marker)
    context = tokenizer.decode(sample.context_ids)
    if not context.startswith(header):
        raise RuntimeError(f"{sample.sample_id}: the context does not start with the chat template's header {header!r}")
    special = set(tokenizer.all_special_ids)
    end = next((i for i, token in enumerate(question.ids) if token in special), len(question.ids))
    rest = tokenizer.decode(question.ids[end:])
    if not rest.startswith(suffix):
        raise RuntimeError(f"{sample.sample_id}: the question does not end with the chat template's {suffix!r}")
    return {
        "context": context[len(header) :],
        "question": tokenizer.decode(question.ids[:end]),
        "answer_prefix": rest[len(suffix) :],
        "system": system,
        "prompt_ids": sample.context_ids + question.ids,
    }


def kvpress_prompt(engine: Engine, length: int) -> dict:
    """The needle prompt as scripts/kvpress_grid.py's ``--prompt`` file (``kvpress_texts``), with the grid."""
    task, sample = needle_sample(engine, length)
    snapkv, streamingllm = parse_policy("snapkv"), parse_policy("streamingllm")
    return {
        **kvpress_texts(engine.tokenizer, task.config["system"], sample, sample.questions[0]),
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


# --- whole processes: start-up, the grid as a user runs it, kvpress's leaderboard ----------------------------------

# The README's demo command (its --out replaced): what a user's first run looks like.
DEMO = ["--task", "needle", "--policy", "full,streamingllm,h2o,snapkv,pyramidkv", "--budget", "64,128"]
DEMO += ["--lengths", "1000,2000", "--depths", "0,50,100"]
SCRIPTS = Path(__file__).parent


def pkvbench_process(arguments: list[str]) -> tuple[float, str, list[dict]]:
    """``pkvbench run ARGUMENTS --out <fresh folder> --quiet`` as its own process: wall seconds, stdout, rows."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        command = [sys.executable, "-m", "pkvbench", "run", *arguments, "--out", f"{folder}/run", "--quiet"]
        started = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} exited {out.returncode}: {out.stderr.strip()[-500:]}")
        rows = (Path(folder) / "run" / "samples.jsonl").read_text().splitlines()
    return seconds, out.stdout, [json.loads(line) for line in rows]


def grid_seconds(stdout: str) -> float:
    """The seconds ``pkvbench run`` reports for its grid (its last line: "..., 12.3 s → ...")."""
    return float(stdout.strip().splitlines()[-1].split(" s → ")[0].rsplit(", ", 1)[1])


def startup_phases(arguments: list[str]) -> dict:
    """One ``pkvbench run`` stopped at its first prefill by scripts/startup_probe.py: its phases in seconds."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "startup.json"
        command = [sys.executable, str(SCRIPTS / "startup_probe.py"), "--out-json", str(report)]
        command += ["--launched", repr(time.time()), "--", "run", *arguments, "--out", f"{folder}/run", "--quiet"]
        out = subprocess.run(command, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"startup_probe.py exited {out.returncode}: {out.stderr.strip()[-500:]}")
        return json.loads(report.read_text())


# What every transformers-based harness pays before its first prefill: the interpreter, torch, transformers and the
# model's code, the tokenizer and the weights, from the same float copy pkvbench loads.
BARE_LOAD = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1])
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="float32", attn_implementation="sdpa").eval()
"""


def startup(repeats: int = 3) -> list[dict]:
    """The demo command's start-up (best of ``repeats``) against a bare transformers load of the same model."""
    from pkvbench.engine.models import model_path

    folder = model_path("smollm2-135m")[0]
    probes = [startup_phases(DEMO) for _ in range(repeats)]
    best = min(probes, key=lambda probe: probe["total_s"])
    floor = float("inf")
    for _ in range(repeats):
        _, seconds = timed(
            lambda: subprocess.run([sys.executable, "-c", BARE_LOAD, folder], check=True, capture_output=True)
        )
        floor = min(floor, seconds)
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in best["phases_s"].items())
    unneeded = {"altair", "vl_convert", "matplotlib", "seaborn", "ray", "datasets", "gguf"}
    heavy = sorted({m.split(".")[0] for m in best["modules"]} & unneeded)
    return [
        row(
            "start-up: the demo `pkvbench run` to its first prefill vs a bare transformers load of the model",
            None,
            floor,
            best["total_s"],
            "<= 5 s",
            f"best of {repeats}; s: {phases}; report/plot/GGUF libraries imported: {', '.join(heavy) or 'none'}",
            ratio=round(best["total_s"] / floor, 2),
        )
    ]


def whole_process(length: int) -> list[dict]:
    """The bench grid (5 policies × 4 budgets, one needle prompt) as two whole ``pkvbench run`` processes, model load
    and start-up included: decoded one configuration at a time vs batched."""
    grid = ["--task", "needle", "--policy", ",".join(POLICIES), "--budget", ",".join(BUDGETS)]
    grid += ["--lengths", str(length), "--depths", "50"]
    sequential_s, sequential_out, sequential_rows = pkvbench_process([*grid, "--decode-batch", "1"])
    batched_s, batched_out, batched_rows = pkvbench_process(grid)
    differ = sum(a["pred"] != b["pred"] for a, b in zip(sequential_rows, batched_rows))
    inside = grid_seconds(sequential_out), grid_seconds(batched_out)
    return [
        row(
            "grid as whole processes: `pkvbench run --decode-batch 1` vs `pkvbench run`",
            length,
            sequential_s,
            batched_s,
            ">= 1.8x",
            f"{len(batched_rows)} configs, {differ} rows differ; the grid (prefill, selection, decoding) "
            f"{inside[0]:.1f} / {inside[1]:.1f} s, the rest of the process (start-up, summary, exit) "
            f"{sequential_s - inside[0]:.1f} / {batched_s - inside[1]:.1f} s",
        )
    ]


# kvpress's leaderboard presses (evaluation/leaderboard.sh; built as its evaluate_registry.py builds them) that
# pkvbench has, each with pkvbench's policy at kvpress's settings (configs/leaderboard.yaml), and the query modes
# kvpress runs it in (leaderboard.sh: every press query-agnostic, SnapKV query-aware too).
LEADERBOARD = [
    ("no_press", "full", ("agnostic",)),
    ("snapkv", "snapkv:window=64:kernel=5:pooling=avg", ("agnostic", "aware")),
    ("streaming_llm", "streamingllm", ("agnostic",)),
    ("tova", "tova", ("agnostic",)),
    ("knorm", "knorm", ("agnostic",)),
    ("keydiff", "keydiff", ("agnostic",)),
    ("expected_attention", "adakv(expected_attention:epsilon=0.01)", ("agnostic",)),
    ("kvzip", "kvzip", ("agnostic",)),
]
LEADERBOARD_RATIOS = ("0.25", "0.5", "0.75", "0.875")


def leaderboard_prompts(tasks: str, length: int, limit: int) -> list[dict]:
    """The RULER samples ``pkvbench run --task TASKS --lengths LENGTH --limit LIMIT`` builds, as kvpress's prompts."""
    from pkvbench.api import RunConfig, fit_to_model, resolve
    from pkvbench.engine.models import load_tokenizer
    from pkvbench.run.runner import work_items

    run = resolve(RunConfig(tasks=tasks, lengths=(length,), limit=limit))
    options = fit_to_model(run.config.model, run.tasks, run.options, None)
    tokenizer = load_tokenizer(run.config.model)
    items = work_items(run.tasks, tokenizer, options)
    prompts = []
    for task, sample in items:
        for question in sample.questions:
            prompt = kvpress_texts(tokenizer, task.config.get("system"), sample, question)
            prompts.append({"id": f"{task.name}/{sample.row_id(question)}", **prompt})
            prompts[-1]["max_new_tokens"] = task.max_new_tokens
    return prompts


def known_difference(call: dict, mode: str, kv_heads: int, kept_equal: bool) -> str:
    """Why a kvpress cell differs from pkvbench's, when it is one of the two ways the protocols differ; else
    "unexplained". ``call`` is kvpress's cell: its kept entries per layer (mean over heads) and compressed tokens."""
    tokens, ratio, layers = call["context_tokens"], call["ratio"], len(call["kept"])
    entries = layers * kv_heads * tokens
    if mode == "aware" and all(abs(k - int(tokens * (1 - ratio))) <= 1e-3 for k in call["kept"]):
        # evaluate.py --query_aware puts the question into the context and leaves the question empty: the template's
        # closing tokens and the answer prefix then follow the compressed cache uncompressed, where pkvbench
        # compresses the whole prompt (those tokens are inside SnapKV's window there); other kept sets, other answers.
        return f"kvpress compresses {tokens} tokens, not the whole prompt: keeps {int(tokens * (1 - ratio))} of them"
    if not kept_equal and abs(sum(call["kept"]) * kv_heads - (entries - int(entries * ratio))) < 0.5:
        # kvpress's KVzipPress prunes int(L·H·T·r) entries over all layers and heads at once; pkvbench keeps
        # int(T·(1 - r)) per head on average (its cr budget): under one entry per head more on kvpress's side.
        return "kvpress rounds the pruned count over all layers and heads (under 1 entry per head)"
    return "unexplained" + ("" if kept_equal else ": kept counts differ")


def leaderboard(python: str, tasks: str, length: int, limit: int, out: Path) -> list[dict]:
    """kvpress's leaderboard as its scripts run it (a process per press and query mode, a pipeline call per prompt ×
    ratio) against one ``pkvbench run`` of the same cells and prompts (every policy in both query modes, from one
    prefill per prompt); both sides whole processes, model loads included. Writes each cell's kept counts and answers
    side by side to ``OUT/leaderboard.csv``."""
    import tempfile

    from pkvbench.engine.models import model_path

    prompts = leaderboard_prompts(tasks, length, limit)
    model = model_path("smollm2-135m")[0]
    theirs, per_press = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "prompts.json").write_text(json.dumps(prompts))
        kvpress_s = 0.0
        for press, _, modes in LEADERBOARD:
            for mode in modes:
                result_file = Path(folder) / f"{press}-{mode}.json"
                command = [python, str(SCRIPTS / "kvpress_leaderboard.py"), "--prompts", f"{folder}/prompts.json"]
                command += ["--model", model, "--press", press, "--ratios", ",".join(LEADERBOARD_RATIOS)]
                command += ["--out", str(result_file)] + (["--query-aware"] if mode == "aware" else [])
                started = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True)
                seconds = time.perf_counter() - started
                if done.returncode != 0:
                    error = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    note = f"skipped: kvpress_leaderboard.py --press {press} exited {done.returncode}: {error}"
                    return [row("leaderboard grid: kvpress vs pkvbench", length, None, None, "", note, ratio="")]
                kvpress_s += seconds
                per_press[f"{press}/{mode}"] = seconds
                result = json.loads(result_file.read_text())
                version = result["kvpress_version"]
                for call in result["calls"]:
                    theirs[(call["id"], press, mode, call["ratio"])] = call

    specs = {press: spec for press, spec, _ in LEADERBOARD}
    budgets = ",".join(f"cr{r}" for r in LEADERBOARD_RATIOS)
    arguments = ["--task", tasks, "--lengths", str(length), "--limit", str(limit), "--policy", ",".join(specs.values())]
    pkvbench_s, _, rows = pkvbench_process([*arguments, "--budget", budgets, "--query-mode", "aware,agnostic"])
    ours = {(f"{r['task']}/{r['sample_id']}", r["policy"], r["query_mode"], r["budget"]): r for r in rows}

    kv_heads = json.loads((Path(model) / "config.json").read_text())["num_key_value_heads"]
    cells = []
    for (prompt_id, press, mode, ratio), call in theirs.items():
        label = parse_policy(specs[press]).label
        budget = f"cr{ratio:g}" if press != "no_press" else f"cr{LEADERBOARD_RATIOS[0]}"
        mine = ours[(prompt_id, label, mode, budget)]
        kept = [round(float(k), 3) for k in mine["kv_kept"]]
        kept_equal = all(abs(a - b) <= 1e-3 for a, b in zip(kept, call["kept"]))
        answer_equal = mine["pred"].strip() == call["answer"].strip()
        cells.append(
            {
                "prompt": prompt_id,
                "press": press,
                "policy": label,
                "mode": mode,
                "ratio": ratio,
                "prompt_matches": call["prompt_matches"],
                "kept_pkvbench": sum(kept) / len(kept),
                "kept_kvpress": sum(call["kept"]) / len(call["kept"]),
                "kept_equal": kept_equal,
                "answer_equal": answer_equal,
                "answer_pkvbench": mine["pred"],
                "answer_kvpress": call["answer"],
                "kvpress_s": call["seconds"],
                "difference": "" if kept_equal and answer_equal else known_difference(call, mode, kv_heads, kept_equal),
            }
        )
    table = pd.DataFrame(cells)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "leaderboard.csv", index=False)
    by_press = table.groupby(["press", "mode"], sort=False).agg(
        kept=("kept_equal", "sum"), answers=("answer_equal", "sum"), n=("prompt", "size")
    )
    agreement = "; ".join(f"{p}/{m} {r.kept}/{r.answers} of {r.n}" for (p, m), r in by_press.iterrows())
    differing = table[table.difference != ""]
    explained = (~differing.difference.str.startswith("unexplained")).sum()
    return [
        row(
            "leaderboard grid: kvpress (a process per press, a pipeline call per prompt × ratio) vs one `pkvbench run`",
            length,
            kvpress_s,
            pkvbench_s,
            "",
            f"kvpress {version}; {len(prompts)} RULER prompts ({tasks}, limit {limit}); {len(cells)} kvpress cells, "
            f"{kvpress_s / len(cells):.1f} s each; {len(rows)} pkvbench rows (every policy in both query modes), "
            f"{pkvbench_s / len(rows):.1f} s each; prompts equal: "
            f"{int(table.prompt_matches.sum())}/{len(cells)}; kept/answers equal per press: {agreement}; cells that "
            f"differ: {len(differing)}, explained: {explained} (the difference column); "
            f"kvpress s per process: {', '.join(f'{k} {v:.0f}' for k, v in per_press.items())}; cells: "
            f"{out / 'leaderboard.csv'}",
        )
    ]


ROW_GROUPS = ("grid", "stats", "modes", "bytes", "decode", "memory", "startup", "process", "kvpress", "leaderboard")
NEEDS_KVPRESS = ("kvpress", "leaderboard")


def write_table(rows: list[dict], out: Path, merge: bool) -> pd.DataFrame:
    """bench.csv and bench.md; with ``merge`` (a run of some row groups) each new row replaces the existing table's
    row of the same measure and context, in its place, and the other rows stay."""
    table = pd.DataFrame(rows)
    if merge and (out / "bench.csv").is_file():

        def key(r: dict) -> tuple:
            return r["measure"], None if pd.isna(r["context"]) else int(r["context"])

        fresh = {key(r): r for r in table.to_dict("records")}
        old = pd.read_csv(out / "bench.csv").to_dict("records")
        table = pd.DataFrame([fresh.pop(key(r), r) for r in old] + list(fresh.values()))
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "bench.csv", index=False)
    (out / "bench.md").write_text(table.to_markdown(index=False) + "\n")
    return table


@click.command()
@click.option("--lengths", default="2000,4000", show_default=True, help="Context lengths for the grid and overheads.")
@click.option("--decode-length", default=8000, show_default=True, help="Context length for the decode measurement.")
@click.option("--out", default="results/bench", show_default=True, type=click.Path(file_okay=False))
@click.option(
    "--only",
    help=f"Only these row groups, comma-separated ({', '.join(ROW_GROUPS)}); their rows replace the same rows of "
    "the existing bench.csv, the others stay.",
)
@click.option("--skip-memory", is_flag=True)
@click.option("--skip-decode", is_flag=True)
@click.option(
    "--kvpress-python",
    help="A Python with kvpress installed (scripts/kvpress_env.sh); adds the kvpress and leaderboard rows.",
)
@click.option(
    "--leaderboard-tasks",
    default="niah_single_2,niah_multikey_1,vt",
    show_default=True,
    help="RULER tasks of the leaderboard row (ruler: all 11; each costs kvpress 33 pipeline calls).",
)
@click.option("--leaderboard-limit", default=1, show_default=True, help="Samples per task of the leaderboard row.")
@click.option("--leaderboard-length", default=4000, show_default=True, help="Prompt tokens of the leaderboard row.")
@click.option("--memory-probe", hidden=True)
@click.option(
    "--quantized-only", is_flag=True, help="Only the quantized-cache decode row, at --decode-length; writes nothing."
)
def main(
    lengths,
    decode_length,
    out,
    only,
    skip_memory,
    skip_decode,
    kvpress_python,
    leaderboard_tasks,
    leaderboard_limit,
    leaderboard_length,
    memory_probe,
    quantized_only,
):
    torch.manual_seed(0)
    lengths = [int(x) for x in lengths.split(",")]
    if memory_probe:
        print(json.dumps(decode_memory(Engine(load_model()), lengths[0], memory_probe)))
        return
    if quantized_only:
        print(pd.DataFrame(quantized_decode_speed(Engine(load_model()), decode_length)).to_string(index=False))
        return
    groups = [g.strip() for g in only.split(",")] if only else list(ROW_GROUPS)
    unknown = sorted(set(groups) - set(ROW_GROUPS))
    if unknown:
        raise click.BadParameter(f"unknown row group(s) {', '.join(unknown)}; valid: {', '.join(ROW_GROUPS)}")
    if only and not kvpress_python and set(groups) & set(NEEDS_KVPRESS):
        raise click.BadParameter("the kvpress and leaderboard rows need --kvpress-python")
    skipped = {"memory"} if skip_memory else set()
    skipped |= {"decode"} if skip_decode else set()
    skipped |= set(NEEDS_KVPRESS) if not kvpress_python else set()
    groups = [g for g in groups if g not in skipped]
    in_process = {"grid", "stats", "modes", "bytes", "decode", "kvpress"}
    engine = Engine(load_model()) if in_process & set(groups) else None
    rows = []
    for length in lengths:
        rows += grid_speed(engine, length) if "grid" in groups else []
        rows += statistics_overhead(engine, length) if "stats" in groups else []
    rows += query_modes(engine, lengths[0]) if "modes" in groups else []
    rows += kv_bytes(engine, lengths[0]) if "bytes" in groups else []
    rows += decode_speed(engine, decode_length) if "decode" in groups else []
    rows += quantized_decode_speed(engine, decode_length) if "decode" in groups else []
    rows += memory(lengths[0], sys.executable) if "memory" in groups else []
    rows += startup() if "startup" in groups else []
    rows += whole_process(lengths[0]) if "process" in groups else []
    rows += kvpress(kvpress_python, lengths[0], engine) if "kvpress" in groups else []
    if "leaderboard" in groups:
        rows += leaderboard(kvpress_python, leaderboard_tasks, leaderboard_length, leaderboard_limit, Path(out))
    table = write_table(rows, Path(out), merge=bool(only))
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
