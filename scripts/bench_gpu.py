"""pkvbench's engine on a GPU: models with random weights built on the device from configurations in the repository.

    python scripts/bench_gpu.py                       # Llama-3.1-8B's and Llama-3.2-1B's shapes, bfloat16, sdpa, CUDA
    python scripts/bench_gpu.py --tiny                # a 2-layer model on CPU in seconds (the test suite runs this)
    bash scripts/bench_gpu.sh                         # the entry for a GPU machine (writes results/bench/gpu/)

Nothing is downloaded: each model is built from its configuration (``configs/gpu/*.json``, written by hand from the
published architectures) with random weights directly on the device, the prompts are random token ids and the
tokenizer is a synthetic word-level one (ids only need to exist; a random model's text means nothing). What is
measured is the engine's cost, which depends on the shapes, not on the weights. In order:

- exactness, on the tiny model on the same device: the full cache's tokens = the stock model's ``generate``, a
  compressed cache's (StreamingLLM) = the stock model over the full cache with the dropped positions masked
  (``pkvbench/engine/exactness.py``), batched = sequential decoding (FlexAttention for ragged rows on CUDA); in
  float32 and bfloat16, a prefill recording H2O's statistics through the kernel's log-sum-exp leaves the model's
  output bit for bit; H2O's sums from the log-sum-exp against the chunked float32 ones (and the entries kept at 128),
  KVzip's fused pass against its unfused one; a decode step makes no host–device sync but reading its tokens;
- per model, the device's copy bandwidth (the floor of every decode row: bytes a step reads — weights and the
  cache's keys and values — divided by it);
- statistics: a plain prefill vs a prefill recording each policy's statistics plus its selection at budget 128 (KVzip:
  its repeat passes), at each length (8k and 32k tokens);
- grid: a 20-configuration grid (5 policies × 4 budgets) decoded from one prefill, one configuration at a time vs
  batched: the step of the batch against one row's step, the rows whose tokens differ (bfloat16; float32 too for the
  first model), and the batched decoding run again with ``torch.cuda.set_sync_debug_mode("error")`` after its first
  step (with caches stored in 8 and 4 bits too);
- decode per token at each length (and 128k for the 1B shape): the full cache, SnapKV at budget 128 and
  AdaKV(SnapKV) at 128, each beside its floor and, as the grid's batched step, with its kernel share (whether the
  step is launch-bound: ``kernel_share``);
- peak GPU memory of each (``torch.cuda.max_memory_allocated``, reset before it).

- the peer, per model once it is freed: NVIDIA kvpress's pipeline, a call per configuration of the grid
  (``scripts/bench_gpu_peer.py``, a process of its own, kvpress from ``--kvpress-path``), against pkvbench's whole
  grid (its one prefill, the selections and the batched decoding); the tokens compared cell by cell. Skipped, with
  the reason, where kvpress is not installed.

Writes ``OUT/bench_gpu.csv`` and ``OUT/bench_gpu.md``. A measurement that fails is a row saying why; the others run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.machinery
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import click
import pandas as pd
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.cell.kv_formats import KVFormat
from pkvbench.engine import attention
from pkvbench.engine.decoding import plan_batches
from pkvbench.engine.exactness import generate_reference, masked_reference
from pkvbench.engine.generation import Engine
from pkvbench.engine.models import LoadedModel
from pkvbench.policies import parse_policy

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "gpu"
STATISTICS = [
    "streamingllm",
    "snapkv",
    "pyramidkv",
    "h2o",
    "tova",
    "knorm",
    "keydiff",
    "expected_attention",
    "adakv(snapkv)",
    "kvzip",
]
GRID_POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]
GRID_BUDGETS = [64, 128, 256, 512]
DECODE_POLICIES = {"full": "full", "128": "snapkv", "adakv 128": "adakv(snapkv)"}
LONGER = {"llama-3.2-1b": 131072}  # a decode length beyond the statistics' for a model whose cache fits it


def decode_alone(engine: Engine, prefill, cache, new_tokens: int):
    """One compressed cache decoded greedily, alone (a batch of one)."""
    return engine.decode_many([engine.request(prefill, cache, new_tokens)])[0]


def synthetic_tokenizer(size: int = 1000):
    """A word-level tokenizer of ``size`` words ``w0`` … (no chat template): what the engine asks of a tokenizer —
    end ids, decoding, KVzip's repeat request — without a file or a download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"w{i}": i for i in range(1, size)} | {"[UNK]": 0}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def read_config(config_file: Path) -> dict:
    """A configuration file's settings (its ``_comment`` left out)."""
    return {k: v for k, v in json.loads(config_file.read_text()).items() if not k.startswith("_")}


def random_model(config_file: Path, device: str, dtype: torch.dtype, **settings):
    """The configuration's transformers model with random weights (seeded: the same weights in every process),
    created on ``device`` with sdpa attention, and the seconds that took; ``settings`` change the configuration's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**read_config(config_file), **settings})
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    sync(device)
    return model, time.perf_counter() - started


def build_model(config_file: Path, device: str, dtype: torch.dtype) -> LoadedModel:
    """``random_model``, ready for the engine."""
    model, seconds = random_model(config_file, device, dtype)
    return ready(model, config_file, device, seconds)


def ready(model, config_file: Path, device: str, seconds: float = 0.0) -> LoadedModel:
    """A random model (on ``device``, or placed by accelerate with its inputs on ``device``), ready for the engine."""
    from pkvbench.engine.attention import install_recording_attention

    install_recording_attention(model)
    return LoadedModel(
        model=model,
        tokenizer=synthetic_tokenizer(),
        name=config_file.stem,
        device=device,
        dtype=str(model.dtype).removeprefix("torch."),
        attn_implementation="sdpa",
        load_s=seconds,
        source=f"random weights: {config_file.name}",
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def random_prompt(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=generator)


class Peak:
    """Peak GPU memory (GB) of what runs inside, from a reset; None off CUDA."""

    def __init__(self, device: str):
        self.device, self.gb = device, None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            self.gb = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def timed(device: str, fn):
    sync(device)
    started = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - started


def row(model, measure, context, baseline, ours, peak=None, note="", ratio=None, floor=None):
    """A table row; ``floor``: the hardware's floor for ``ours`` (bytes read ÷ copy bandwidth), beside its ratio."""
    return {
        "model": model,
        "measure": measure,
        "context": context,
        "baseline_s": None if baseline is None else round(baseline, 4),
        "ours_s": None if ours is None else round(ours, 6),
        "ratio": ratio if ratio is not None else (round(baseline / ours, 2) if baseline and ours else None),
        "floor_s": None if floor is None else round(floor, 6),
        "vs_floor": round(ours / floor, 2) if floor and ours else None,
        "peak_gb": peak,
        "note": note,
    }


def copy_bandwidth(device: str) -> float:
    """Bytes per second the device moves in a plain copy (each byte read and written: 2× the tensor), best of 5."""
    elements = (2**30 if device == "cuda" else 2**25) // 2
    source = torch.empty(elements, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(timed(device, lambda: target.copy_(source))[1] for _ in range(5))
    return 2 * source.nbytes / best


def weight_bytes(model) -> int:
    """What a decode step reads of the weights: all but the input embeddings' table (one row per token), which the
    output layer reads whole where it is tied."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight
    tied = embeddings is model.get_output_embeddings().weight
    return total if tied else total - embeddings.numel() * embeddings.element_size()


def cache_bytes(kept, new_tokens: int) -> int:
    """Keys and values a step of one row reads on average over ``new_tokens`` tokens: each head's entries, padding
    not counted."""
    total = 0
    for index, keys in enumerate(kept.keys):
        heads, stored, dim = keys.shape
        entries = int(kept.lengths[index].sum()) if kept.lengths is not None else heads * stored
        total += (entries + heads * new_tokens / 2) * 2 * dim * keys.element_size()
    return int(total)


def kernel_share(device: str, fn, wall_s: float) -> str:
    """How much of ``wall_s`` (``fn``'s time, measured unprofiled) the device spends running kernels and copies
    while ``fn`` runs again under torch.profiler. Far below 1, the GPU waits for the host to launch work: the step is
    launch-bound and capturing it in a CUDA graph (issue 43, item 3) would pay; near 1, it would not."""
    if device != "cuda":
        return "kernel share n/a off CUDA"
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiled:
            fn()
            sync(device)
        busy = sum(e.self_device_time_total for e in profiled.events() if e.device_type == DeviceType.CUDA) / 1e6
    except Exception as exc:  # a diagnosis, not a measurement: its failure must not lose the row
        return f"kernel share unknown ({type(exc).__name__}: {str(exc)[:100]})"
    if not busy:
        return "kernel share unknown (the profiler recorded no device time)"
    share = busy / wall_s
    verdict = "launch-bound: a CUDA graph would pay" if share < 0.6 else "not launch-bound"
    return f"kernels busy {share:.0%} of the wall time ({busy:.3g} of {wall_s:.3g} s): {verdict}"


@contextlib.contextmanager
def no_sync(device: str):
    """A host–device synchronisation is an error while active (``torch.cuda.set_sync_debug_mode``); on a CPU, any
    tensor read back as a Python number is (what would be a sync on a GPU)."""
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return
    names = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise RuntimeError(f"a decode step read a tensor back (Tensor.{name})")

        return read

    for name in names:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def statistics(engine: Engine, ids: torch.Tensor, repeats: int, policies: list[str]) -> list[dict]:
    """Prefill + each policy's statistics + its selection at budget 128, vs a plain prefill (best of ``repeats``)."""
    device, name, length = engine.loaded.device, engine.loaded.name, ids.shape[1]
    with Peak(device) as peak:
        plain = min(timed(device, lambda: engine.prefill(ids, []))[1] for _ in range(repeats))
    rows = [row(name, "plain prefill", length, None, plain, peak.gb)]
    for spec in policies:
        policy = parse_policy(spec)

        def prefill_and_select(policy=policy):
            prefill = engine.prefill(ids, [policy])
            return engine.compress(prefill, policy, Budget(128))

        with Peak(device) as peak:
            best = min(timed(device, prefill_and_select)[1] for _ in range(repeats))
        rows.append(
            row(
                name,
                f"prefill + statistics + selection vs plain prefill ({spec})",
                length,
                plain,
                best,
                peak.gb,
                f"overhead {100 * (best / plain - 1):.0f}%",
                ratio=round(best / plain, 3),
            )
        )
    return rows


class GridRun(NamedTuple):
    """What the peer row compares with: pkvbench's seconds for the grid (its one prefill and the selections, then
    the decoding one configuration at a time and batched) and each configuration's tokens, one at a time."""

    prepare_s: float
    sequential_s: float
    batched_s: float
    tokens: list[list[int]]


def grid_requests(engine: Engine, ids: torch.Tensor, new_tokens: int):
    policies = [parse_policy(p) for p in GRID_POLICIES]
    prefill = engine.prefill(ids, policies)
    caches = [engine.compress(prefill, p, Budget(b)) for p in policies for b in GRID_BUDGETS]
    return prefill, [engine.request(prefill, cache, new_tokens) for cache in caches]


def grid(engine: Engine, ids: torch.Tensor, new_tokens: int, label: str = "", runs: dict | None = None) -> list[dict]:
    """The 20-configuration grid's decoding from one prefill: one configuration at a time vs batched, a step of the
    batch against one row's; then the batched decoding again with every sync after its first step an error.
    ``runs[model]``: the ``GridRun``, for the peer row."""
    device, name, length = engine.loaded.device, engine.loaded.name, ids.shape[1]
    (prefill, requests), prepare_s = timed(device, lambda: grid_requests(engine, ids, new_tokens))
    engine.decode_many(requests[:2], 1)  # warm-up: one row's kernels
    if device == "cuda":
        engine.decode_many(requests)  # warm-up: the batches' kernels (FlexAttention compiles per shape class)
    with Peak(device) as sequential_peak:
        sequential, sequential_s = timed(device, lambda: engine.decode_many(requests, 1))
    with Peak(device) as batched_peak:
        batched, batched_s = timed(device, lambda: engine.decode_many(requests))
    differ = sum(a.tokens != b.tokens for a, b in zip(sequential, batched))
    if runs is not None:
        runs[name] = GridRun(prepare_s, sequential_s, batched_s, [d.tokens for d in sequential])
    batches = plan_batches(requests, None)
    one_step = sequential_s / sum(len(d.tokens) for d in sequential)
    batched_steps = sum(max(len(batched[i].tokens) for i in batch) for batch in batches)
    rows = [
        row(
            name + label,
            "grid of 20 configurations: sequential vs batched decoding",
            length,
            sequential_s,
            batched_s,
            batched_peak.gb,
            f"{new_tokens} new tokens each; {differ} rows differ; batch sizes {[len(b) for b in batches]}; peak GB "
            f"sequential {sequential_peak.gb}",
        ),
        row(
            name + label,
            "grid: a batched step vs one row's step (goal ≤ 2)",
            length,
            one_step,
            batched_s / batched_steps,
            note=f"{batched_steps} batched steps, {sum(len(d.tokens) for d in sequential)} one-row steps; "
            + kernel_share(device, lambda: engine.decode_many(requests), batched_s),
            ratio=round(batched_s / batched_steps / one_step, 2),
        ),
    ]
    if label:
        return rows
    # and caches stored in KIVI's 8 and 4 bits (uniform and per-layer budgets; a group of 16 divides every head)
    stored = [
        engine.request(prefill, engine.compress(prefill, parse_policy(p), Budget(256), fmt=KVFormat(b, 16, 32)), 8)
        for p in ("snapkv", "pyramidkv")
        for b in (8, 4)
    ]
    guard, engine.decoder.step_guard = engine.decoder.step_guard, lambda: no_sync(device)
    try:
        engine.decode_many(requests)
        engine.decode_many(stored)
        verdict = "pass: no sync after the first step but the tokens' read (and 8/4-bit stored caches)"
    except RuntimeError as exc:
        verdict = f"FAIL: {str(exc).splitlines()[0][:200]}"
    finally:
        engine.decoder.step_guard = guard
    flex = attention.FLEX_FAILURE
    note = verdict + (f"; FlexAttention unavailable, masked instead: {flex}" if flex else "")
    rows.append(row(name, "grid: batched decoding under set_sync_debug_mode('error')", length, None, None, note=note))
    return rows


def decode_per_token(engine: Engine, ids: torch.Tensor, new_tokens: int, bandwidth: float) -> list[dict]:
    """Seconds per token of one row: the full cache, SnapKV and AdaKV(SnapKV) at budget 128, each beside its floor
    (the weights and the row's keys and values read once per step at the measured copy bandwidth)."""
    device, name, length = engine.loaded.device, engine.loaded.name, ids.shape[1]
    policies = {label: parse_policy(spec) for label, spec in DECODE_POLICIES.items()}
    prefill = engine.prefill(ids, list(policies.values()))
    weights = weight_bytes(engine.model)
    rows, seconds = [], {}
    for label, policy in policies.items():
        cache = engine.compress(prefill, policy, Budget(128))
        decode_alone(engine, prefill, cache, 2)  # warm-up
        with Peak(device) as peak:
            decoded, best = min(
                (timed(device, lambda: decode_alone(engine, prefill, cache, new_tokens)) for _ in range(2)),
                key=lambda pair: pair[1],
            )
        seconds[label] = best / max(1, len(decoded.tokens) - 1)
        share = kernel_share(device, lambda: decode_alone(engine, prefill, cache, new_tokens), best)
        floor = (weights + cache_bytes(cache.kept, new_tokens)) / bandwidth
        rows.append(
            row(
                name,
                f"decode per token: {label} ({policy.label})",
                length,
                None if label == "full" else seconds["full"],
                seconds[label],
                peak.gb,
                f"s per token over {new_tokens} tokens; vs_floor = ours ÷ floor; {share}",
                ratio=None if label == "full" else round(seconds[label] / seconds["full"], 3),
                floor=floor,
            )
        )
    return rows


def exactness(device: str, length: int, new_tokens: int) -> list[dict]:
    """The engine against the stock model on the tiny random model in float32 on ``device``."""
    engine = Engine(build_model(CONFIGS / "tiny.json", device, torch.float32))
    ids = random_prompt(length, engine.loaded.config.vocab_size, seed=1).to(device)
    full, streaming = parse_policy("full"), parse_policy("streamingllm")
    prefill = engine.prefill(ids, [full, streaming])
    checks = {}
    ours = decode_alone(engine, prefill, engine.compress(prefill, full, Budget(64)), new_tokens).tokens
    checks["full cache = model.generate"] = ours == generate_reference(engine.model, ids, new_tokens)
    compressed = engine.compress(prefill, streaming, Budget(64))
    ours = decode_alone(engine, prefill, compressed, new_tokens).tokens
    visible = torch.zeros(length, dtype=torch.bool)
    visible[: streaming.sink] = True
    visible[length - (64 - streaming.sink) :] = True
    reference = masked_reference(
        engine.model, prefill.keys, prefill.values, visible, prefill.first_token, new_tokens, engine.stop_ids
    )
    checks["StreamingLLM at 64 = masked full cache"] = ours == reference
    _, requests = grid_requests(engine, ids, new_tokens)
    one_by_one = engine.decode_many(requests, 1)
    batched = engine.decode_many(requests)
    checks["batched = sequential, 20 configurations"] = all(a.tokens == b.tokens for a, b in zip(one_by_one, batched))
    rows = [
        row("tiny (float32)", f"exactness: {check}", length, None, None, note="pass" if passed else "FAIL", ratio="")
        for check, passed in checks.items()
    ]
    for dtype in (torch.float32, torch.bfloat16):
        tiny = engine if dtype == torch.float32 else Engine(build_model(CONFIGS / "tiny.json", device, dtype))
        rows += statistics_exactness(tiny, ids, dtype)
    return rows


def placed_cells() -> list[tuple[str, object, KVFormat | None, int | None]]:
    """The cross-device check's cells: (label, policy, storage format, decode budget) — every registered policy at
    budget 64 (a wrapper around SnapKV; CriticalKV too, the policy that reads a weight: the output projection), a
    KIVI cell (SnapKV in 4 bits), and caches cut while the answer is written (H2O's running sums, Expected
    Attention's rotated moments)."""
    from pkvbench.policies.registry import registry

    names = [f"{name}(snapkv)" if getattr(cls, "wraps", False) else name for name, cls in registry().items()]
    cells = [(name, parse_policy(name), None, None) for name in [*names, "adakv(snapkv):critical=true"]]
    cells.append(("snapkv, KIVI 4 bits", parse_policy("snapkv"), KVFormat(4, 16, 32), None))
    cells += [
        (f"{name}, cut to 48 while decoding", parse_policy(name), None, 48) for name in ("h2o", "expected_attention")
    ]
    return cells


def placed_run(engine: Engine, ids: torch.Tensor, new_tokens: int, device: str) -> tuple[dict, float, list[str]]:
    """Every ``placed_cells`` cell from one prefill, decoded as one batch: label → (tokens, kept entries) or the
    error that stopped it, the seconds it all took and the devices the prefill's caches are on."""
    cells = placed_cells()
    started = time.perf_counter()
    outcome, requests = {}, {}
    try:
        policies = [policy for _, policy, _, _ in cells]
        prefill = engine.prefill(ids, policies, decoding=[policy for _, policy, _, cut in cells if cut])
    except Exception as exc:  # the prefill on this placement: every cell's error
        return {label: f"{type(exc).__name__}: {exc}".splitlines()[0][:160] for label, *_ in cells}, 0.0, []
    for label, policy, fmt, cut in cells:
        try:
            budget = Budget(64 if cut is None else 96)
            cache = engine.compress(prefill, policy, budget, fmt=fmt)
            schedule = engine.schedule(policy, cut, 4, 8)
            requests[label] = (engine.request(prefill, cache, new_tokens, schedule=schedule), cache)
        except Exception as exc:
            outcome[label] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    try:
        decoded = engine.decode_many([request for request, _ in requests.values()])
        for (label, (_, cache)), answer in zip(requests.items(), decoded):
            outcome[label] = (answer.tokens, [[row.tolist() for row in layer] for layer in cache.kept_positions()])
    except Exception as exc:
        outcome.update(dict.fromkeys(requests, f"batched decoding: {type(exc).__name__}: {exc}".splitlines()[0][:160]))
    sync(device)
    return outcome, time.perf_counter() - started, sorted({str(keys.device) for keys in prefill.keys})


def device_map_check(device: str, length: int, new_tokens: int) -> list[dict]:
    """The engine on a model placed by accelerate over two devices against the model on one, on the tiny model in
    float32 (a spread of weights that keeps greedy tokens clear of float rounding), every ``placed_cells`` cell:

    - CUDA: half the layers on cuda:0, half on the CPU, as ``--device-map`` places them (accelerate offloads the
      CPU's layers: their weights wait on the meta device and run on cuda:0), vs all on cuda:0; then the same map with
      the CPU's layers run on the CPU (accelerate's ``main_device="cpu"``): each layer's cache, statistics and kept
      entries where its layer runs, two devices in one model;
    - CPU (``--tiny``): half the layers on the CPU, half offloaded to the disk (weights on the meta device, loaded by
      accelerate's hooks for each forward), vs all on the CPU.

    A row per placement: pass when every cell's tokens and kept entries equal those on one device, else FAIL naming
    the cells (an error, or what differs); its cost is the placed run's seconds over the one-device run's."""
    import tempfile

    from accelerate import dispatch_model

    config = CONFIGS / "tiny.json"
    spread = {"initializer_range": 0.2}
    ids = random_prompt(length, read_config(config)["vocab_size"], seed=2).to(device)
    reference = Engine(ready(random_model(config, "cpu", torch.float32, **spread)[0].to(device), config, device))
    if device == "cuda":
        placed_run(reference, ids, new_tokens, device)  # warm-up: kernel choices are not measured
    expected, baseline, _ = placed_run(reference, ids, new_tokens, device)
    layers = read_config(config)["num_hidden_layers"]
    half = {f"model.layers.{i}": i < layers // 2 for i in range(layers)}
    if device == "cuda":
        placements = {
            "half the layers on cuda:0, half on the CPU (offloaded: run on cuda:0) vs all on cuda:0": (0, "cpu", None),
            "half the layers on cuda:0, half on the CPU (run there: two devices) vs all on cuda:0": (0, "cpu", "cpu"),
        }
    else:
        placements = {"half the layers on the CPU, half offloaded to the disk vs all on the CPU": ("cpu", "disk", None)}
    rows = []
    for what, (first, second, main_device) in placements.items():
        with tempfile.TemporaryDirectory(prefix="pkvbench-offload-") as folder:
            model = random_model(config, "cpu", torch.float32, **spread)[0]
            device_map = {"model.embed_tokens": first, **{k: first if v else second for k, v in half.items()}}
            device_map |= {"model.norm": first, "model.rotary_emb": first, "lm_head": first}
            model = dispatch_model(model, device_map, main_device=main_device, offload_dir=folder)
            inputs = str(model._hf_hook.execution_device)  # accelerate's main device: inputs in, logits out
            engine = Engine(ready(model, config, inputs))
            if device == "cuda":
                placed_run(engine, ids, new_tokens, device)  # warm-up
            outcome, seconds, devices = placed_run(engine, ids, new_tokens, device)
        wrong = []
        for label, result in outcome.items():
            if isinstance(expected[label], str):
                wrong.append(f"{label}: on one device too: {expected[label]}")
            elif isinstance(result, str):
                wrong.append(f"{label}: {result}")
            elif result[0] != expected[label][0]:
                wrong.append(f"{label}: tokens differ")
            elif result[1] != expected[label][1]:
                wrong.append(f"{label}: kept entries differ")
        note = (
            f"pass: {len(outcome)} cells' tokens and kept entries equal (every policy, KIVI 4 bits, cuts while "
            f"decoding); the caches on {', '.join(devices)}"
            if not wrong
            else f"FAIL: {len(wrong)} of {len(outcome)} cells: {'; '.join(wrong)}"
        )
        cost = round(seconds / baseline, 2) if seconds and baseline else None
        rows.append(
            row("tiny (float32)", f"device map: {what}", length, baseline, seconds or None, note=note, ratio=cost)
        )
    return rows


def statistics_exactness(engine: Engine, ids: torch.Tensor, dtype: torch.dtype) -> list[dict]:
    """The statistics' fused routes in ``dtype``: the prefill's output untouched by H2O's log-sum-exp route; H2O's
    sums against the chunked float32 ones; KVzip's fused pass against its unfused one (the entries kept at 32)."""
    label, length = f"tiny ({str(dtype).removeprefix('torch.')})", ids.shape[1]
    h2o = parse_policy("h2o")
    plain, recorded = engine.prefill(ids, []), engine.prefill(ids, [h2o])
    same = torch.equal(plain.last_logits, recorded.last_logits) and all(
        torch.equal(a, b) for a, b in zip(plain.keys, recorded.keys)
    )
    difference = (plain.last_logits.float() - recorded.last_logits.float()).abs().max().item()
    rows = [
        row(
            label,
            "exactness: a prefill recording H2O (kernel log-sum-exp) = a plain prefill, bit for bit",
            length,
            None,
            None,
            note="pass" if same else f"FAIL: logits differ by up to {difference:.3g}",
            ratio="",
        )
    ]
    queries = {}
    recorder = attention.StatsRecorder(h2o.needs, engine.softmaxes)
    original = recorder.observe

    def observe(layer_idx, query, key, logsumexp=None):
        queries[layer_idx] = (query[0], key[0], engine.softmaxes[layer_idx], logsumexp)
        return original(layer_idx, query, key, logsumexp=logsumexp)

    recorder.observe = observe
    with torch.inference_mode():
        engine.recorded_forward(ids, recorder)
    worst, overlap = 0.0, []
    for layer_idx, (query, key, softmax, _) in queries.items():
        fused = recorder.layers[length, layer_idx].accumulated
        chunked = attention.accumulated_attention(query.float(), key.float(), softmax)
        worst = max(worst, ((fused - chunked).abs() / chunked.clamp(min=1e-6)).max().item())
        overlap.append(top_overlap(fused, chunked, 32))
    fused_route = all(lse is not None for *_, lse in queries.values())
    rows.append(
        row(
            label,
            "exactness: H2O's sums from the kernel's log-sum-exp vs chunked float32",
            length,
            None,
            None,
            note=f"{'fused' if fused_route else 'NOT fused (chunked)'}; largest relative difference {worst:.2g}; "
            f"top-32 entries shared {min(overlap):.3f}",
            ratio="",
        )
    )
    layers = [SimpleNamespace(keys=k, values=v) for k, v in zip(plain.keys, plain.values)]
    prompt = ids[0].tolist()
    fused = engine.reconstruction_scores(layers, prompt, 64, fused=True)
    unfused = engine.reconstruction_scores(layers, prompt, 64, fused=False)
    finite = [(a.nan_to_num(posinf=0.0), b.nan_to_num(posinf=0.0)) for a, b in zip(fused, unfused)]
    worst = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in finite)
    rows.append(
        row(
            label,
            "exactness: KVzip's fused pass vs its unfused one",
            length,
            None,
            None,
            note=f"largest difference {worst:.2g} of the layer's largest score; top-32 entries shared "
            f"{min(top_overlap(a, b, 32) for a, b in finite):.3f}",
            ratio="",
        )
    )
    return rows


def top_overlap(scores: torch.Tensor, reference: torch.Tensor, k: int) -> float:
    """The share of each head's top-k entries of ``reference`` that ``scores`` keeps too (the worst head)."""
    k = min(k, scores.shape[-1])
    ours, theirs = scores.topk(k, dim=-1).indices, reference.topk(k, dim=-1).indices
    shared = (ours[..., :, None] == theirs[..., None, :]).any(-1).float().mean(-1)
    return shared.min().item()


def guarded(rows: list[dict], model: str, what: str, context, fn) -> None:
    """Run one measurement; a failure becomes a row saying why instead of losing the rest."""
    try:
        rows += fn()
    except Exception as exc:  # the benchmark reports it and goes on
        traceback.print_exc()
        rows.append(row(model, what, context, None, None, note=f"failed: {type(exc).__name__}: {exc}", ratio=""))


def measure_model(
    name: str,
    device: str,
    dtype: torch.dtype,
    lengths: list[int],
    grid_length: int,
    new_tokens: int,
    repeats: int,
    policies: list[str],
    float32_grid: bool,
    longer: bool,
    runs: dict,
) -> list[dict]:
    """Every measurement of one model shape (the grid unless ``grid_length`` is 0; its ``GridRun`` in ``runs``)."""
    loaded = build_model(CONFIGS / f"{name}.json", device, dtype)
    engine = Engine(loaded)
    vocab = loaded.config.vocab_size
    bandwidth = copy_bandwidth(device)
    rows = [
        row(name, "model built with random weights", None, None, loaded.load_s, ratio=""),
        row(name, "device copy bandwidth (GB/s)", None, None, None, note=f"{bandwidth / 1e9:.0f} GB/s", ratio=""),
    ]
    engine.prefill(random_prompt(256, vocab), [])  # the first call's kernel choices are not measured
    for length in lengths:
        ids = random_prompt(length, vocab).to(device)
        guarded(rows, name, "statistics", length, lambda ids=ids: statistics(engine, ids, repeats, policies))
    if grid_length:
        ids = random_prompt(grid_length, vocab).to(device)
        guarded(rows, name, "grid", grid_length, lambda: grid(engine, ids, new_tokens, runs=runs))
    decode_lengths = [*lengths, *([LONGER[name]] if longer and name in LONGER else [])]
    if name == "tiny":
        decode_lengths = lengths[-1:]  # the code path once (the test suite runs it)
    for length in decode_lengths:
        ids = random_prompt(length, vocab).to(device)
        guarded(
            rows,
            name,
            "decode per token",
            length,
            lambda ids=ids: decode_per_token(engine, ids, new_tokens, bandwidth),
        )
    if grid_length and float32_grid and dtype != torch.float32:
        del engine, loaded
        if device == "cuda":
            torch.cuda.empty_cache()
        engine = Engine(build_model(CONFIGS / f"{name}.json", device, torch.float32))
        ids = random_prompt(grid_length, vocab).to(device)
        guarded(rows, name, "grid (float32)", grid_length, lambda: grid(engine, ids, new_tokens, " (float32)"))
    return rows


PEER_SCRIPT = Path(__file__).resolve().with_name("bench_gpu_peer.py")


def peer_row(
    name: str,
    device: str,
    dtype: torch.dtype,
    grid_run: GridRun | None,
    kvpress_path: str | None,
    length: int,
    new_tokens: int,
):
    """kvpress's pipeline on the grid's cells (``bench_gpu_peer.py``, in a process of its own) against pkvbench's
    whole grid: its one prefill and the selections, then the batched decoding."""
    measure = "peer: kvpress's pipeline, a call per configuration, vs pkvbench's grid (goal ≥ 5)"
    extra = [kvpress_path] if kvpress_path else []
    if grid_run is None:
        return [row(name, measure, length, None, None, note="skipped: no grid to compare with", ratio="")]
    if importlib.machinery.PathFinder.find_spec("kvpress", [*extra, *sys.path]) is None:
        why = "skipped: kvpress is not installed (scripts/fetch_peer_wheels.sh, then bash scripts/bench_gpu.sh)"
        return [row(name, measure, length, None, None, note=why, ratio="")]
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*extra, root, *filter(None, [os.environ.get("PYTHONPATH")])]))
    arguments = ["--model", name, "--device", device, "--dtype", str(dtype).removeprefix("torch.")]
    arguments += ["--length", str(length), "--new-tokens", str(new_tokens)]
    done = subprocess.run(
        [sys.executable, str(PEER_SCRIPT), *arguments], capture_output=True, text=True, env=env, timeout=600
    )
    if done.returncode:
        raise RuntimeError(f"bench_gpu_peer.py: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    cells = result["cells"]
    theirs = sum(cell["seconds"] for cell in cells)
    ours, one_at_a_time = (grid_run.prepare_s + s for s in (grid_run.batched_s, grid_run.sequential_s))
    same = [cell["tokens"] == tokens for cell, tokens in zip(cells, grid_run.tokens)]
    full = [equal for cell, equal in zip(cells, same) if cell["policy"] == "full"]
    versions = result["versions"]
    note = (
        f"kvpress {versions['kvpress']}, transformers {versions['transformers']}; {len(cells)} calls, "
        f"{min(c['seconds'] for c in cells):.3g}–{max(c['seconds'] for c in cells):.3g} s each; pkvbench = one "
        f"prefill + selections {grid_run.prepare_s:.3g} s + batched decoding {grid_run.batched_s:.3g} s "
        f"(one at a time: {one_at_a_time:.3g} s, {theirs / one_at_a_time:.2f}×); "
        f"tokens equal to pkvbench's: {sum(same)}/{len(cells)} cells, full cache {sum(full)}/{len(full)}"
    )
    return [row(name, measure, length, theirs, ours, note=note)]


@click.command()
@click.option("--tiny", is_flag=True, help="The tiny model on CPU with short prompts: the code path in seconds.")
@click.option("--models", default="llama-3.2-1b,llama-3.1-8b", show_default=True, help="Configurations in configs/gpu.")
@click.option("--lengths", default="8192,32768", show_default=True, help="Prompt lengths: statistics and decoding.")
@click.option(
    "--statistics", default=",".join(STATISTICS), show_default=True, help="Policies whose statistics are timed."
)
@click.option("--grid-length", default=8192, show_default=True, help="Prompt length of the decoding grid (0: none).")
@click.option("--new-tokens", default=32, show_default=True, help="Tokens each grid configuration decodes.")
@click.option("--repeats", default=2, show_default=True, help="Timings are the best of this many.")
@click.option(
    "--float32-grid/--no-float32-grid", default=True, show_default=True, help="The first model's grid in float32 too."
)
@click.option(
    "--longer/--no-longer", default=True, show_default=True, help="Decode per token at 128k for the 1B shape."
)
@click.option(
    "--kvpress-path",
    envvar="PKVBENCH_KVPRESS_PATH",
    type=click.Path(file_okay=False),
    help="A folder kvpress is installed in, for the peer row (bench_gpu.sh installs scripts/wheels/ there).",
)
@click.option("--peer/--no-peer", default=True, show_default=True, help="The peer row: kvpress on the grid's cells.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--out", default="results/bench/gpu", show_default=True, type=click.Path(file_okay=False))
def main(
    tiny,
    models,
    lengths,
    statistics,
    grid_length,
    new_tokens,
    repeats,
    float32_grid,
    longer,
    kvpress_path,
    peer,
    device,
    out,
):
    if device == "auto":
        device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    if tiny:
        models, lengths, grid_length, new_tokens, repeats, longer = "tiny", "256,512", 256, 8, 1, False
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths = [int(x) for x in str(lengths).split(",")]
    started = time.perf_counter()
    rows: list[dict] = []
    runs: dict[str, GridRun] = {}
    guarded(rows, "tiny (float32)", "exactness", 256, lambda: exactness(device, 256, 16))
    guarded(rows, "tiny (float32)", "device map", 256, lambda: device_map_check(device, 256, 8))
    write_tables(rows, out, tiny, device, dtype, started)
    for number, name in enumerate(models.split(",")):
        rows += measure_model(
            name,
            device,
            dtype,
            lengths,
            grid_length,
            new_tokens,
            repeats,
            statistics.split(","),
            float32_grid and number == 0,
            longer,
            runs,
        )
        if device == "cuda":
            torch.cuda.empty_cache()  # the next model's (and the peer's) peak memory starts from its own
        if peer and grid_length:  # after the model is freed: the peer builds its own copy
            measured = functools.partial(
                peer_row, name, device, dtype, runs.get(name), kvpress_path, grid_length, new_tokens
            )
            guarded(rows, name, "peer", grid_length, measured)
        # after every model: a run stopped by a time limit keeps the tables of the models it finished
        write_tables(rows, out, tiny, device, dtype, started)
    print((Path(out) / "bench_gpu.md").read_text())


def write_tables(rows: list[dict], out, tiny: bool, device: str, dtype: torch.dtype, started: float) -> None:
    """``OUT/bench_gpu.csv`` and ``OUT/bench_gpu.md`` of the rows so far."""
    table = pd.DataFrame(rows)
    Path(out).mkdir(parents=True, exist_ok=True)
    table.to_csv(Path(out) / "bench_gpu.csv", index=False)
    where = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU"
    heading = (
        f"`scripts/bench_gpu.py{' --tiny' if tiny else ''}` on {where} ({device}, {str(dtype).removeprefix('torch.')}, "
        f"sdpa; torch {torch.__version__}); {time.perf_counter() - started:.0f} s in all\n\n"
    )
    (Path(out) / "bench_gpu.md").write_text(heading + table.to_markdown(index=False) + "\n")


if __name__ == "__main__":
    main()
