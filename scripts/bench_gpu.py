"""pkvbench's engine on a GPU: models with random weights built on the device from configurations in the repository.

    python scripts/bench_gpu.py                       # Llama-3.1-8B's and Llama-3.2-1B's shapes, bfloat16, sdpa, CUDA
    python scripts/bench_gpu.py --tiny                # a 2-layer model on CPU in seconds (the test suite runs this)
    bash scripts/bench_gpu.sh                         # the entry for a GPU machine (writes results/bench/gpu/)

Nothing is downloaded: each model is built from its configuration (``configs/gpu/*.json``, written by hand from the
published architectures) with random weights directly on the device, the prompts are random token ids and the
tokenizer is a synthetic word-level one (ids only need to exist; a random model's text means nothing). What is
measured is the engine's cost, which depends on the shapes, not on the weights:

- statistics: a plain prefill vs a prefill recording each policy's statistics plus its selection at budget 128 (KVzip:
  its repeat passes), at each length (8k and 32k tokens);
- grid: a 20-configuration grid (5 policies × 4 budgets) decoded from one prefill, one configuration at a time vs
  batched, with the rows whose tokens differ;
- decode per token at budget 128 vs the full cache, at the longest length;
- peak GPU memory of each (``torch.cuda.max_memory_allocated``, reset before it);
- exactness, on the tiny model in float32 on the same device: the full cache's tokens = the stock model's
  ``generate``, a compressed cache's (StreamingLLM) = the stock model over the full cache with the dropped positions
  masked (``pkvbench/engine/exactness.py``), batched = sequential decoding.

Writes ``OUT/bench_gpu.csv`` and ``OUT/bench_gpu.md``. A measurement that fails is a row saying why; the others run.
"""

from __future__ import annotations

import json
import platform
import time
import traceback
from pathlib import Path

import click
import pandas as pd
import torch

from pkvbench.budgets import Budget
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


def build_model(config_file: Path, device: str, dtype: torch.dtype) -> LoadedModel:
    """The configuration's model with random weights (seeded), created on ``device``, sdpa attention, ready for the
    engine."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pkvbench.engine.attention import install_recording_attention

    config = AutoConfig.for_model(**read_config(config_file))
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    install_recording_attention(model)
    sync(device)
    return LoadedModel(
        model=model,
        tokenizer=synthetic_tokenizer(),
        name=config_file.stem,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        attn_implementation="sdpa",
        load_s=time.perf_counter() - started,
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


def row(model, measure, context, baseline, ours, peak=None, note="", ratio=None):
    return {
        "model": model,
        "measure": measure,
        "context": context,
        "baseline_s": None if baseline is None else round(baseline, 4),
        "ours_s": None if ours is None else round(ours, 4),
        "ratio": ratio if ratio is not None else (round(baseline / ours, 2) if baseline and ours else None),
        "peak_gb": peak,
        "note": note,
    }


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


def grid_requests(engine: Engine, ids: torch.Tensor, new_tokens: int):
    policies = [parse_policy(p) for p in GRID_POLICIES]
    prefill = engine.prefill(ids, policies)
    caches = [engine.compress(prefill, p, Budget(b)) for p in policies for b in GRID_BUDGETS]
    return prefill, [engine.request(prefill, cache, new_tokens) for cache in caches]


def grid(engine: Engine, ids: torch.Tensor, new_tokens: int) -> list[dict]:
    """The 20-configuration grid's decoding from one prefill: one configuration at a time vs batched."""
    device, name, length = engine.loaded.device, engine.loaded.name, ids.shape[1]
    _, requests = grid_requests(engine, ids, new_tokens)
    engine.decode_many(requests[:2])  # warm-up
    with Peak(device) as sequential_peak:
        sequential, sequential_s = timed(device, lambda: engine.decode_many(requests, 1))
    with Peak(device) as batched_peak:
        batched, batched_s = timed(device, lambda: engine.decode_many(requests))
    differ = sum(a.tokens != b.tokens for a, b in zip(sequential, batched))
    batches = sorted({d.batch for d in batched}, reverse=True)
    return [
        row(
            name,
            "grid of 20 configurations: sequential vs batched decoding",
            length,
            sequential_s,
            batched_s,
            batched_peak.gb,
            f"{new_tokens} new tokens each; {differ} rows differ; batch sizes {batches}; peak GB sequential "
            f"{sequential_peak.gb}",
        )
    ]


def decode_per_token(engine: Engine, ids: torch.Tensor, new_tokens: int) -> list[dict]:
    device, name, length = engine.loaded.device, engine.loaded.name, ids.shape[1]
    policy = parse_policy("snapkv")
    prefill = engine.prefill(ids, [policy])
    per_token, peaks = {}, {}
    for label, chosen in (("full", parse_policy("full")), ("128", policy)):
        cache = engine.compress(prefill, chosen, Budget(128))
        engine.decode(prefill, cache, 2)  # warm-up
        with Peak(device) as peak:
            decoded, seconds = min(
                (timed(device, lambda: engine.decode(prefill, cache, new_tokens)) for _ in range(2)),
                key=lambda pair: pair[1],
            )
        per_token[label], peaks[label] = seconds / max(1, len(decoded.tokens) - 1), peak.gb
    return [
        row(
            name,
            "decode per token: full cache vs budget 128 (SnapKV)",
            length,
            per_token["full"],
            per_token["128"],
            peaks["128"],
            f"s per token over {new_tokens} tokens; peak GB full {peaks['full']}",
        )
    ]


def exactness(device: str, length: int, new_tokens: int) -> list[dict]:
    """The engine against the stock model on the tiny random model in float32 on ``device``."""
    engine = Engine(build_model(CONFIGS / "tiny.json", device, torch.float32))
    ids = random_prompt(length, engine.loaded.config.vocab_size, seed=1).to(device)
    full, streaming = parse_policy("full"), parse_policy("streamingllm")
    prefill = engine.prefill(ids, [full, streaming])
    checks = {}
    ours = engine.decode(prefill, engine.compress(prefill, full, Budget(64)), new_tokens).tokens
    checks["full cache = model.generate"] = ours == generate_reference(engine.model, ids, new_tokens)
    compressed = engine.compress(prefill, streaming, Budget(64))
    ours = engine.decode(prefill, compressed, new_tokens).tokens
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
    return [
        row(
            "tiny (float32)",
            f"exactness: {check}",
            length,
            None,
            None,
            note="pass" if passed else "FAIL",
            ratio="",
        )
        for check, passed in checks.items()
    ]


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
) -> list[dict]:
    """Every measurement of one model shape (the grid unless ``grid_length`` is 0)."""
    loaded = build_model(CONFIGS / f"{name}.json", device, dtype)
    engine = Engine(loaded)
    vocab = loaded.config.vocab_size
    rows = [row(name, "model built with random weights", None, None, loaded.load_s, ratio="")]
    engine.prefill(random_prompt(256, vocab), [])  # the first call's kernel choices are not measured
    for length in lengths:
        ids = random_prompt(length, vocab).to(device)
        guarded(rows, name, "statistics", length, lambda ids=ids: statistics(engine, ids, repeats, policies))
    if grid_length:
        ids = random_prompt(grid_length, vocab).to(device)
        guarded(rows, name, "grid", grid_length, lambda: grid(engine, ids, new_tokens))
    longest = random_prompt(max(lengths), vocab).to(device)
    guarded(rows, name, "decode per token", max(lengths), lambda: decode_per_token(engine, longest, 2 * new_tokens))
    return rows


@click.command()
@click.option("--tiny", is_flag=True, help="The tiny model on CPU with short prompts: the code path in seconds.")
@click.option("--models", default="llama-3.2-1b,llama-3.1-8b", show_default=True, help="Configurations in configs/gpu.")
@click.option("--lengths", default="8192,32768", show_default=True, help="Prompt lengths for the statistics.")
@click.option(
    "--statistics", default=",".join(STATISTICS), show_default=True, help="Policies whose statistics are timed."
)
@click.option("--grid-length", default=8192, show_default=True, help="Prompt length of the decoding grid (0: none).")
@click.option("--new-tokens", default=32, show_default=True, help="Tokens each grid configuration decodes.")
@click.option("--repeats", default=2, show_default=True, help="Timings are the best of this many.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--out", default="results/bench/gpu", show_default=True, type=click.Path(file_okay=False))
def main(tiny, models, lengths, statistics, grid_length, new_tokens, repeats, device, out):
    if device == "auto":
        device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    if tiny:
        models, lengths, grid_length, new_tokens, repeats = "tiny", "256,512", 256, 8, 1
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths = [int(x) for x in str(lengths).split(",")]
    started = time.perf_counter()
    rows: list[dict] = []
    guarded(rows, "tiny (float32)", "exactness", 256, lambda: exactness(device, 256, 16))
    write_tables(rows, out, tiny, device, dtype, started)
    for name in models.split(","):
        rows += measure_model(name, device, dtype, lengths, grid_length, new_tokens, repeats, statistics.split(","))
        # after every model: a run stopped by a time limit keeps the tables of the models it finished
        write_tables(rows, out, tiny, device, dtype, started)
        if device == "cuda":
            torch.cuda.empty_cache()  # the next model's peak memory starts from its own
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
