"""Does attention funnel? PyramidKV's premise, measured for any model.

During the prefill of each sample, the last ``window`` queries of every layer (the observation window SnapKV and
PyramidKV select with) each attend over the keys they can see. Per query head we measure how that attention is
spread — normalised entropy, the mass on the top 1% and the top k keys, the mass on the first ``sink`` tokens, the
keys that hold 90% of the mass — averaged over the window's queries. Samples are written one line each as they
finish (``funnel_samples.jsonl``, so an interrupted run resumes), then averaged into ``funnel.csv`` (per layer, with
spread over samples and heads) and ``funnel_heads.csv`` (per layer and head), and judged in plain words.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from pkvbench.cell.budgets import Budget, plan
from pkvbench.cell.schema import FUNNEL_STATISTICS
from pkvbench.engine.attention import Recorder, window_attention_probs
from pkvbench.errors import PkvError
from pkvbench.io import atomic_write
from pkvbench.policies.spec import parse_policy
from pkvbench.store.results import ResultStore

SAMPLES = "funnel_samples.jsonl"
INFO = "funnel.json"
TABLE = "funnel.csv"
HEAD_TABLE = "funnel_heads.csv"
VERDICT = "verdict.txt"
FIGURE = "funnel.png"

# What each statistic means, in the order tables and plots show them. All lie in [0, 1] except keys_for_90.
MASS_TARGET = 0.9


def sample_key(record: dict) -> tuple[str, str]:
    return (record["task"], str(record["sample_id"]))


def check_record(record: dict, where: str) -> None:
    """A line of funnel_samples.jsonl as ``run_funnel`` writes it."""
    if not isinstance(record.get("task"), str) or not isinstance(record.get("sample_id"), (str, int)):
        raise PkvError(f"{where}: not a funnel record (needs task and sample_id)")
    if not isinstance(record.get("stats"), dict) or not set(FUNNEL_STATISTICS) <= set(record["stats"]):
        raise PkvError(f"{where}: not a funnel record (needs stats with {', '.join(FUNNEL_STATISTICS)})")


def funnel_store(out: str | Path) -> ResultStore:
    """The funnel's folder: a line per sample, funnel.json, and the tables, verdict and figure made from them."""
    return ResultStore(
        out,
        rows_name=SAMPLES,
        info_name=INFO,
        outputs=(TABLE, HEAD_TABLE, VERDICT, FIGURE),
        key=sample_key,
        check=check_record,
    )


def attention_statistics(probs: torch.Tensor, visible: torch.Tensor, sink: int, top_k: int) -> dict[str, torch.Tensor]:
    """Per head, each statistic of ``FUNNEL_STATISTICS`` averaged over the rows of ``probs``.

    ``probs`` is ``[H, R, T]``: R attention distributions per head over T keys, row r non-zero only on its first
    ``visible[r]`` keys (a causal query sees the keys up to itself). Returns ``{statistic: [H]}``.
    """
    probs = probs.double()  # sums of thousands of small terms: float32 cumsums drift by ~1e-5
    seen = visible.to(probs.device, torch.float64)
    counts = visible.to(probs.device, torch.long)
    plogp = torch.where(probs > 0, probs * probs.log(), torch.zeros_like(probs))
    # A query that sees one key has nothing to spread: its entropy is 0 by definition (log 1 = 0).
    entropy = -plogp.sum(-1) / seen.log().clamp_min(1e-12)
    ranked = probs.sort(dim=-1, descending=True).values.cumsum(dim=-1)  # [H, R, T]: mass of the top n+1 keys

    def mass_of_top(n: torch.Tensor) -> torch.Tensor:
        index = (n.clamp(min=1).minimum(counts) - 1).expand(probs.shape[0], -1)[..., None]
        return ranked.gather(-1, index)[..., 0]

    one_percent = torch.ceil(seen * 0.01).long()
    # Fewest keys reaching 90%: the keys before the cumulative mass gets there, plus the one that gets it there.
    # Float32 attention sums carry ~1e-7 relative error per term, so "there" is 90% less 1e-6 (else 180 keys of
    # 1/200 could count as short of 90%); no row needs more keys than it sees.
    for_90 = ((ranked < MASS_TARGET - 1e-6).sum(-1) + 1).minimum(counts)
    values = {
        "entropy": entropy,
        "top1pct_mass": mass_of_top(one_percent),
        "topk_mass": mass_of_top(torch.full_like(counts, top_k)),
        "sink_mass": probs[..., :sink].sum(-1),
        "keys_for_90_frac": for_90 / seen,
        "keys_for_90": for_90.double(),
    }
    return {name: values[name].mean(dim=1).float() for name in FUNNEL_STATISTICS}


@dataclass
class FunnelRecorder(Recorder):
    """Records ``attention_statistics`` of every layer's last ``window`` queries during one forward pass
    (``softmaxes``: each layer's, ``Engine.softmaxes``)."""

    softmaxes: list
    window: int  # the defaults are ``FunnelConfig``'s
    sink: int
    top_k: int
    layers: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def observe(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, logsumexp: torch.Tensor | None = None
    ) -> None:
        q, k = query[0], key[0]  # batch of one
        probs = window_attention_probs(q, k, self.softmaxes[layer_idx], self.window)
        length, rows = k.shape[1], probs.shape[1]
        visible = torch.arange(length - rows + 1, length + 1)
        self.layers[layer_idx] = attention_statistics(probs, visible, self.sink, self.top_k)


def measure_sample(engine, input_ids: list[int], window: int, sink: int, top_k: int) -> tuple[dict[str, list], float]:
    """``{statistic: [layer][head]}`` for one prompt (its attention layers, in depth order), and the seconds its
    forward pass took."""
    recorder = FunnelRecorder(engine.softmaxes, window=window, sink=sink, top_k=top_k)
    _, seconds = engine.recorded_forward(torch.tensor([input_ids], dtype=torch.long), recorder)
    layers = [recorder.layers[i] for i in engine.architecture.attention_layers]  # a hybrid's state layers have none
    # Six significant digits are far beyond what differs between samples, and keep the per-sample log small.
    return {
        name: [[float(f"{v:.6g}") for v in layer[name].tolist()] for layer in layers] for name in FUNNEL_STATISTICS
    }, seconds


def sample_frame(records: list[dict]) -> pd.DataFrame:
    """One row per task × sample × layer × head, a column per statistic."""
    rows = []
    for record in records:
        stats = record["stats"]
        for layer, heads in enumerate(stats["entropy"]):
            for head in range(len(heads)):
                rows.append(
                    {
                        "task": record["task"],
                        "sample_id": str(record["sample_id"]),
                        "context_tokens": record["context_tokens"],
                        "layer": layer,
                        "head": head,
                        **{name: stats[name][layer][head] for name in FUNNEL_STATISTICS},
                    }
                )
    return pd.DataFrame(rows)


def funnel_tables(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per layer, per layer × head) long tables: ``statistic, mean, std, min, max, samples`` (+ ``head_*``).

    Per layer, each sample's value is the mean over its heads; ``std``/``min``/``max`` spread over samples, and
    ``head_std``/``head_min``/``head_max`` over heads (each a mean over samples) — PyramidKV sets one budget per
    layer for all its heads, so how far heads differ matters.
    """
    names = list(FUNNEL_STATISTICS)
    long = frame.melt(id_vars=["task", "sample_id", "layer", "head"], value_vars=names, var_name="statistic")
    per_sample = long.groupby(["task", "statistic", "layer", "sample_id"], sort=False)["value"]
    layer_values = per_sample.agg(value="mean", head_std="std", head_min="min", head_max="max").reset_index()
    per_layer = (
        layer_values.groupby(["task", "statistic", "layer"], sort=False)
        .agg(
            mean=("value", "mean"),
            std=("value", "std"),
            min=("value", "min"),
            max=("value", "max"),
            head_std=("head_std", "mean"),
            head_min=("head_min", "mean"),
            head_max=("head_max", "mean"),
            samples=("value", "count"),
        )
        .reset_index()
    )
    per_head = (
        long.groupby(["task", "statistic", "layer", "head"], sort=False)["value"]
        .agg(mean="mean", std="std", min="min", max="max", samples="count")
        .reset_index()
    )
    tasks = list(dict.fromkeys(frame["task"]))

    def in_order(table: pd.DataFrame) -> pd.DataFrame:  # tasks as given, statistics as listed, then layer (and head)
        ranks = pd.DataFrame({"task_rank": table["task"].map(tasks.index), "rank": table["statistic"].map(names.index)})
        keys = ["task_rank", "rank", "layer"] + (["head"] if "head" in table else [])
        return table.join(ranks).sort_values(keys, kind="stable").drop(columns=list(ranks)).reset_index(drop=True)

    return in_order(per_layer), in_order(per_head)


def spearman(x: pd.Series, y: pd.Series) -> float:
    """Rank correlation (Pearson's r of the ranks, ties averaged); nan when either side is constant."""
    return float(x.rank().corr(y.rank()))


def change_point(values: pd.Series) -> int:
    """Where a curve shifts: the split into a lower and an upper block that leaves the least squared error around
    the two block means (one step of binary segmentation; a single outlying layer does not win it)."""

    def squared_error(block: pd.Series) -> float:
        return float(((block - block.mean()) ** 2).sum())

    costs = {s: squared_error(values.iloc[:s]) + squared_error(values.iloc[s:]) for s in range(1, len(values))}
    return min(costs, key=costs.get) if costs else 0


def strength(rho: float) -> str:
    size = abs(rho)
    if math.isnan(rho) or size < 0.2:
        return "no"
    return "a strong" if size >= 0.7 else "a moderate" if size >= 0.4 else "a weak"


def verdict(
    per_layer: pd.DataFrame,
    task: str,
    model: str,
    samples: int,
    context: float,
    sink: int,
    pyramid: list[int] | None = None,
    budget: str | None = None,
) -> str:
    """A paragraph: does attention concentrate with depth on ``task``, how strongly, and where; with ``pyramid``
    (PyramidKV's entries per layer at ``budget``), how those compare with the keys that hold 90% of the attention."""
    rows = per_layer[per_layer["task"] == task]
    curve = rows.pivot(index="layer", columns="statistic", values="mean")
    layers = pd.Series(curve.index, index=curve.index, dtype=float)
    entropy, keys_share, sinks = curve["entropy"], curve["keys_for_90_frac"], curve["sink_mass"]
    rho_entropy, rho_keys = spearman(layers, entropy), spearman(layers, keys_share)
    third = max(1, len(curve) // 3)
    low, high = slice(None, third), slice(len(curve) - third, None)
    split = change_point(entropy)
    if rho_entropy <= -0.2:
        finding = f"attention concentrates with depth: {strength(rho_entropy)} funnel"
    elif rho_entropy >= 0.2:
        finding = f"attention spreads out with depth, the opposite of a funnel ({strength(rho_entropy)} trend)"
    else:
        finding = "attention does not concentrate with depth overall"
    premise = (
        "PyramidKV's premise (larger budgets low, smaller high) fits this model on this task"
        if rho_entropy <= -0.4 and rho_keys <= -0.4
        else "PyramidKV's premise holds only partly here: of the two trends (entropy, keys for 90%), at least one is "
        "weak or absent"
        if rho_entropy <= -0.2 or rho_keys <= -0.2
        else "PyramidKV's premise does not hold here: a pyramid takes budget from layers that spread attention as "
        "widely as the lower ones"
    )
    lowest = ", ".join(str(i) for i in entropy.nsmallest(3).index)
    highest = ", ".join(str(i) for i in entropy.nlargest(3).index)
    return (
        f"{model} on {task} ({samples} samples, {context:.0f} tokens on average, {len(curve)} layers): {finding}. "
        f"Normalised entropy averages {entropy.iloc[low].mean():.2f} in the lowest third of the layers and "
        f"{entropy.iloc[high].mean():.2f} in the top third (Spearman rho against layer index {rho_entropy:+.2f}; "
        f"-1 would be a steady fall); 90% of the attention needs {keys_share.iloc[low].mean():.1%} of the keys in the "
        f"lowest third and {keys_share.iloc[high].mean():.1%} in the top third (rho {rho_keys:+.2f}). "
        + (
            f"Split in two blocks, the entropy curve changes most between layers {split - 1} and {split} (mean "
            f"{entropy.iloc[:split].mean():.2f} below, {entropy.iloc[split:].mean():.2f} from there up). "
            if split
            else ""
        )
        + f"Most concentrated: layers {lowest}; most spread: layers {highest}. The first {sink} tokens hold "
        f"{sinks.iloc[low].mean():.0%} of the attention in the lowest third and {sinks.iloc[high].mean():.0%} in the top "
        f"third. {premise}." + (f" {budget_fit(rows, pyramid, budget, low, high)}" if pyramid else "")
    )


def budget_fit(curves: pd.DataFrame, pyramid: list[int], budget: str, low: slice, high: slice) -> str:
    """How PyramidKV's per-layer entries compare with the keys holding 90% of the attention, on average and in the
    widest head."""
    needed = curves[curves["statistic"] == "keys_for_90"].set_index("layer")
    kept = pd.Series(pyramid, index=needed.index, dtype=float)
    short = [str(layer) for layer in needed.index if kept[layer] < needed["mean"][layer]]
    return (
        f"At budget {budget}, PyramidKV keeps {kept.iloc[low].mean():.0f} entries per head in the lowest third and "
        f"{kept.iloc[high].mean():.0f} in the top third, where 90% of the window's attention lies on "
        f"{needed['mean'].iloc[low].mean():.0f} and {needed['mean'].iloc[high].mean():.0f} keys on average over "
        f"heads ({needed['head_max'].iloc[low].mean():.0f} and {needed['head_max'].iloc[high].mean():.0f} in each "
        f"layer's widest head); "
        + (
            f"it keeps fewer than the average head's in layers {', '.join(short)}."
            if short
            else "it keeps more than the average head's in every layer."
        )
    )


@dataclass
class FunnelStats:
    written: int = 0
    skipped: int = 0
    seconds: float = 0.0


def run_funnel(engine, items, store, window: int, sink: int, top_k: int, quiet: bool = False) -> FunnelStats:
    """Measure every (task, sample) of ``items`` not yet in ``store``, appending one line per sample."""
    started = time.perf_counter()
    done = store.done_keys()
    pending = [(task, sample) for task, sample in items if (task.name, sample.sample_id) not in done]
    stats = FunnelStats(skipped=len(items) - len(pending))
    bar = tqdm(
        total=len(items), initial=stats.skipped, disable=quiet or not sys.stderr.isatty(), unit="sample", desc="funnel"
    )
    for task, sample in pending:
        measured, seconds = measure_sample(engine, sample.input_ids, window, sink, top_k)
        store.append(
            {
                "task": task.name,
                "sample_id": sample.sample_id,
                "context_tokens": len(sample.input_ids),
                **sample.extras,
                "forward_s": round(seconds, 4),
                "stats": measured,
            }
        )
        stats.written += 1
        bar.update(1)
    bar.close()
    stats.seconds = time.perf_counter() - started
    return stats


@dataclass
class FunnelReport:
    per_layer: pd.DataFrame
    per_head: pd.DataFrame
    verdicts: list[str]  # a paragraph per task
    overlays: dict[str, dict]  # per task: PyramidKV's per-layer entries at the budget, for the figure


def write_reports(
    out: Path, records: list[dict], model: str, num_layers: int, budget: Budget, sink: int
) -> FunnelReport:
    """From the per-sample records: ``funnel.csv``, ``funnel_heads.csv`` and ``verdict.txt`` (a paragraph per task),
    and for the figure the per-layer entries PyramidKV keeps at ``budget`` for each task's mean length."""
    frame = sample_frame(records)
    per_layer, per_head = funnel_tables(frame)
    atomic_write(out / TABLE, per_layer.to_csv(index=False))
    atomic_write(out / HEAD_TABLE, per_head.to_csv(index=False))
    verdicts, overlays = [], {}
    pyramid = parse_policy("pyramidkv")
    for task, samples in frame.groupby("task", sort=False)[["sample_id", "context_tokens"]]:
        samples = samples.drop_duplicates("sample_id")
        context = samples["context_tokens"].mean()
        layer_plan = plan(pyramid, budget, round(context), num_layers)
        overlays[task] = {
            "per_layer": layer_plan.per_layer,
            "uniform": layer_plan.effective,
            "label": f"budget {budget} at T={round(context)}",
        }
        verdicts.append(verdict(per_layer, task, model, len(samples), context, sink, layer_plan.per_layer, str(budget)))
    atomic_write(out / VERDICT, "\n\n".join(verdicts) + "\n")
    return FunnelReport(per_layer, per_head, verdicts, overlays)
