"""Figures: needle heatmaps, score-vs-budget curves, per-layer budget charts (matplotlib/seaborn, headless).

Every function writes PNG files and returns their paths. Titles name the model, task, policy and budget; scores are
0–1 on heatmaps (as in the paper's needle figures) and × 100 on curves (as in its tables).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LinearSegmentedColormap, Normalize
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from pkvbench.cell.schema import EVERY_TURN
from pkvbench.errors import PkvError
from pkvbench.io import atomic_write
from pkvbench.reports.axes import (
    AGNOSTIC_SUFFIX,
    ENTRIES,
    FRACTION,
    NUMBER_LINE,
    SERIES,
    budget_kind,
    is_full,
    of_kind,
    policy_name,
    present,
    with_query_modes,
)
from pkvbench.reports.figures import figure_data  # the numbers both renderers draw: these PNGs and the HTML page
from pkvbench.reports.report import Runs, model_display_name
from pkvbench.reports.stats import mean_interval
from pkvbench.store.outputs import Outputs

NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", figure_data.NEEDLE_COLOURS)
DPI = 100


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", str(text)).strip("-")


def budget_title(label: str) -> str:
    label = str(label)
    kind = budget_kind(label)
    if kind == FRACTION:
        return f"budget {float(label) * 100:g}% of the prompt"
    if kind == ENTRIES:
        return f"budget {int(float(label))}"
    return f"budget {label}"  # "all", a memory budget, kvpress's compression ratio: as written


def _drawn(fig, path: Path) -> bytes:
    """``fig`` drawn into memory (and closed), in the format of ``path``'s suffix (.png, .pdf, .svg), as
    ``savefig`` would take it: written later in one piece, a full disk or a kill never leaves half a figure."""
    drawn = BytesIO()
    try:
        fig.savefig(drawn, format=path.suffix.lstrip(".").lower(), dpi=DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    return drawn.getvalue()


def _save(fig, path: Path, outputs: Outputs) -> Path:
    """Stage the figure for ``path`` under the writing rule (written when ``outputs`` commits)."""
    return outputs.add(path, _drawn(fig, path))


def _save_lines(fig, handles: dict, title: str, top: float, path: Path, outputs: Outputs) -> Path:
    """``_save`` for a figure of one line per policy: its legend (``handles``, label → line) right of the panels and
    its ``title`` above them, the panels laid out below ``top`` (a fraction of the height)."""
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), title="policy")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, top))
    return _save(fig, path, outputs)


@contextmanager
def _under_rule(outputs: Outputs | None, option: str) -> Iterator[Outputs]:
    """The caller's ``outputs`` (the caller commits them with its other files), or this figure's own, committed
    once it is drawn."""
    if outputs is not None:
        yield outputs
        return
    own = Outputs(option)
    yield own
    own.commit()


# --- needle heatmaps -------------------------------------------------------------------------------------------------


def _grid(cell: pd.DataFrame, stat: str = "score") -> pd.DataFrame:
    """A depth × length table of ``cell``'s squares: their mean score, or (``n``) their sample counts."""
    grid = figure_data.needle_cells(cell, []).pivot(index="depth", columns="length", values=stat)
    grid = grid.sort_index().reindex(columns=sorted(grid.columns))
    grid.index = [f"{d:g}" for d in grid.index]
    grid.columns = [f"{int(c)}" for c in grid.columns]
    return grid


def _annotations(cell: pd.DataFrame) -> pd.DataFrame:
    """Each square's mean, and its sample count where the counts differ across the grid (so a square of 1 sample
    is not read as one of 5)."""
    means, counts = _grid(cell), _grid(cell, "n")
    text = means.map(lambda m: "" if pd.isna(m) else f"{m:.2f}")
    if counts.stack().nunique() > 1:
        text = text + counts.map(lambda n: "" if pd.isna(n) else f"\nn={int(n)}")
    return text


def _heatmap(ax, cell: pd.DataFrame, cbar: bool, cbar_ax=None) -> None:
    sns.heatmap(
        _grid(cell),
        ax=ax,
        cmap=NEEDLE_CMAP,
        vmin=0,
        vmax=1,
        annot=_annotations(cell).to_numpy(),
        fmt="",
        annot_kws={"size": 9},
        linewidths=0.5,
        linecolor="white",
        cbar=cbar,
        cbar_ax=cbar_ax,
        cbar_kws={"label": "score (ROUGE-1 F, 0–1)"} if cbar else None,
    )
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    ax.tick_params(axis="y", rotation=0)


def plot_needle_heatmaps(rows: pd.DataFrame, out_dir: str | Path, outputs: Outputs | None = None) -> list[Path]:
    """One PNG per task × model × policy × budget, and per task × model one grid (rows budgets, columns policies)."""
    with _under_rule(outputs, "--out") as outputs:
        return _needle_heatmaps(rows, Path(out_dir), outputs)


def _needle_heatmaps(rows: pd.DataFrame, out_dir: Path, outputs: Outputs) -> list[Path]:
    rows = figure_data.needle_rows(rows)
    paths: list[Path] = []
    for (task, model), per_model in rows.groupby(["task", "model"], sort=False):
        name = model_display_name(model)
        policies, budgets = present(per_model["policy"]), present(per_model["budget"])
        for policy in policies:
            for budget in budgets:
                cell = per_model[(per_model["policy"] == policy) & (per_model["budget"] == budget)]
                if cell.empty:
                    continue
                grid = _grid(cell)
                fig, ax = plt.subplots(figsize=(1.0 * grid.shape[1] + 3.2, 0.45 * grid.shape[0] + 2.2))
                _heatmap(ax, cell, cbar=True)
                ax.set_title(
                    f"{task} · {name}\n{policy} · {budget_title(budget)} · mean {cell['score'].mean():.2f}", fontsize=10
                )
                paths.append(
                    _save(
                        fig, out_dir / f"{slug(task)}_heatmap_{slug(name)}_{slug(policy)}_{slug(budget)}.png", outputs
                    )
                )
        # The combined figure: each row a budget, the policies side by side.
        n_rows, n_cols = len(budgets), len(policies)
        sample = _grid(per_model)
        width = n_cols * (0.75 * sample.shape[1] + 1.6) + 1.2
        height = n_rows * (0.35 * sample.shape[0] + 1.3) + 0.8
        fig, axes = plt.subplots(n_rows, n_cols, figsize=(width, height), squeeze=False, sharex=True, sharey=True)
        for i, budget in enumerate(budgets):
            for j, policy in enumerate(policies):
                ax = axes[i][j]
                cell = per_model[(per_model["policy"] == policy) & (per_model["budget"] == budget)]
                if cell.empty:
                    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes, color="grey")
                    ax.set_xticks([])
                    ax.set_yticks([])
                    ax.set_title(f"{policy} · {budget_title(budget)}", fontsize=9)
                    continue
                _heatmap(ax, cell, cbar=False)
                ax.set_title(f"{policy} · {budget_title(budget)}\nmean {cell['score'].mean():.2f}", fontsize=9)
                if i < n_rows - 1:
                    ax.set_xlabel("")
                if j > 0:
                    ax.set_ylabel("")
        fig.suptitle(f"{task} · {name}: policies side by side at each budget (score 0–1)", fontsize=12)
        fig.tight_layout(rect=(0, 0, 0.93, 0.97))
        cbar_ax = fig.add_axes((0.94, 0.15, 0.012, 0.7))
        fig.colorbar(ScalarMappable(Normalize(0, 1), NEEDLE_CMAP), cax=cbar_ax, label="score (ROUGE-1 F, 0–1)")
        paths.append(_save(fig, out_dir / f"{slug(task)}_heatmaps_{slug(name)}_all.png", outputs))
    return paths


# --- score-vs-budget curves ------------------------------------------------------------------------------------------


def plot_budget_curves(rows: pd.DataFrame, out_dir: str | Path, outputs: Outputs | None = None) -> list[Path]:
    """Per model one figure: a row of panels per task (and one for the average over tasks), a column per budget
    kind (token budgets, fractions of the prompt), each on its own log axis; a line per policy; the full cache as
    a horizontal reference line."""
    with _under_rule(outputs, "--out") as outputs:
        return _budget_curves(rows, Path(out_dir), outputs)


# The x axis of each budget kind's panels: its title, and how a tick writes a budget.
CURVE_AXES = {
    ENTRIES: ("KV budget (entries per head per layer, log)", lambda x, _: f"{x:g}"),
    FRACTION: ("KV budget (fraction of the prompt, log)", lambda x, _: f"{x * 100:g}%"),
}


@dataclass(frozen=True)
class CurvePlan:
    """One model's curve figure: its panels (task × budget kind, a task's kinds side by side, the average last) and
    a colour per policy drawn as a line (the full cache is the dashed reference line instead: in either query mode
    it decodes the same tokens)."""

    panels: list[tuple[str, str]]
    colours: dict[str, str]


def curve_plan(points: pd.DataFrame) -> CurvePlan:
    kinds = [kind for kind in NUMBER_LINE if of_kind(points["budget"], kind).any()]
    policies = [p for p in present(points["policy"]) if not is_full(p)]
    return CurvePlan(
        panels=[(task, kind) for task in present(points["task"]) for kind in kinds],
        colours={p: figure_data.policy_colour(i) for i, p in enumerate(policies)},
    )


def _budget_curves(rows: pd.DataFrame, out_dir: Path, outputs: Outputs) -> list[Path]:
    paths = []
    for model, per_model in figure_data.curve_table(rows).groupby("model", sort=False):
        name = model_display_name(model)
        plan = curve_plan(per_model)
        n_cols = min(len(plan.panels), 4)
        n_rows = math.ceil(len(plan.panels) / n_cols)
        fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.4 * n_cols + 1.8, 3.3 * n_rows), squeeze=False)
        for ax in axes.flat[len(plan.panels) :]:
            ax.set_visible(False)
        handles = {}  # the legend: each line once, in the order the panels first draw it
        for (task, kind), ax in zip(plan.panels, axes.flat):
            panel = per_model[(per_model["task"] == task) & of_kind(per_model["budget"], kind)]
            for policy, handle in _policy_lines(ax, panel, plan.colours).items():
                handles.setdefault(policy, handle)
            reference = figure_data.full_reference(rows[rows["model"] == model], task)
            if reference is not None:
                handle = ax.axhline(reference[0], color="black", linestyle="--", linewidth=1.2, label="full cache")
                handles.setdefault("full cache", handle)
            _budget_axis(ax, kind, sorted({float(b) for b in panel["budget"]}))
            title = "average over tasks" if task == "avg" else task
            ax.set_title(f"{title} · {name}", fontsize=10)
        title = f"{name}: score vs KV budget, one line per policy (full cache dashed)"
        paths.append(_save_lines(fig, handles, title, 0.98, out_dir / f"curves_{slug(name)}.png", outputs))
    return paths


def _policy_lines(ax, panel: pd.DataFrame, colours: dict[str, str]) -> dict:
    """Each policy's points of one panel as a line (dotted: query-agnostic) with its interval as a band, or, for a
    lone point, an error bar; returns the lines drawn by policy."""
    handles = {}
    for policy, colour in colours.items():
        line = panel[panel["policy"] == policy].copy()
        if line.empty:
            continue
        line["x"] = line["budget"].astype(str).astype(float)
        line = line.sort_values("x")
        style = ":" if policy.endswith(AGNOSTIC_SUFFIX) else "-"
        (handles[policy],) = ax.plot(
            line["x"], line["score"], marker="o", color=colour, label=policy, linewidth=1.8, ls=style
        )
        if len(line) > 1:  # the interval as a band along the line
            ax.fill_between(line["x"], line["ci_low"], line["ci_high"], color=colour, alpha=0.12, lw=0)
        else:  # a lone point has no band to draw: an error bar
            # (clipped: float noise can put a bound a hair beyond the mean it was resampled around)
            spread = [(line["score"] - line["ci_low"]).clip(lower=0), (line["ci_high"] - line["score"]).clip(lower=0)]
            ax.errorbar(line["x"], line["score"], yerr=spread, fmt="none", ecolor=colour, capsize=3)
    return handles


def _budget_axis(ax, kind: str, ticks: list[float]) -> None:
    """A panel's axes: the budgets of ``kind`` on a log axis, ticked where there are points; the score 0–105."""
    title, tick_text = CURVE_AXES[kind]
    if ticks:
        ax.set_xscale("log")
        low, high = min(ticks), max(ticks)
        pad = 1.25 if high > low else 1.6
        ax.set_xlim(low / pad, high * pad)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(tick_text))
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel(title, fontsize=9)
    ax.set_ylabel("score (× 100)")


def plot_turn_curves(rows: pd.DataFrame, out_dir: str | Path, outputs: Outputs | None = None) -> list[Path]:
    """Per model and task one figure of its conversations: a panel per budget, score over the turns, a line per
    policy (compressed every turn: a line of its own, dotted), its 95% interval as a band; the full cache dashed."""
    with _under_rule(outputs, "--out") as outputs:
        return _turn_curves(rows[rows["turn"].notna()], Path(out_dir), outputs)


def _turn_curves(rows: pd.DataFrame, out_dir: Path, outputs: Outputs) -> list[Path]:
    paths = []
    for (model, task), cell in rows.groupby(["model", "task"], sort=True, observed=True):
        name = model_display_name(model)
        budgets = present(cell["budget"])
        lines = [p for p in present(cell["policy"]) if not is_full(p)]
        colours = {p: figure_data.policy_colour(i) for i, p in enumerate(dict.fromkeys(map(policy_name, lines)))}
        fig, axes = plt.subplots(1, len(budgets), figsize=(4.6 * len(budgets) + 1.8, 3.4), squeeze=False)
        handles = {}
        for budget, ax in zip(budgets, axes.flat):
            for policy in present(cell["policy"]):
                line = cell[(cell["policy"] == policy) & (cell["budget"] == budget)]
                if line.empty:
                    continue
                by_turn = line.groupby("turn")["score"]
                turns = sorted(by_turn.groups)
                means = [100 * by_turn.get_group(t).mean() for t in turns]
                bounds = [mean_interval(by_turn.get_group(t)) for t in turns]
                full = is_full(policy)
                colour = "black" if full else colours[policy_name(policy)]
                style = "--" if full else (":" if EVERY_TURN in policy else "-")
                label = "full cache" if full else policy
                (handle,) = ax.plot(turns, means, marker="o", color=colour, ls=style, lw=1.8, label=label)
                ax.fill_between(
                    turns, [100 * lo for lo, _ in bounds], [100 * hi for _, hi in bounds], color=colour, alpha=0.1, lw=0
                )
                handles.setdefault(label, handle)
            ax.set_xticks(sorted(cell["turn"].dropna().astype(int).unique()))
            ax.set_ylim(0, 105)
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("turn")
            ax.set_ylabel("score (× 100)")
            ax.set_title(f"{budget_title(str(budget))} · {name}", fontsize=10)
        title = f"{task}: score turn by turn, one line per policy (full cache dashed)"
        paths.append(_save_lines(fig, handles, title, 0.96, out_dir / f"{slug(task)}_turns_{slug(name)}.png", outputs))
    return paths


def plot_runs(runs: Runs, out_dir: str | Path, outputs: Outputs | None = None) -> list[Path]:
    """Every figure of ``runs`` into ``out_dir``: all checked before the first is written."""
    rows = runs.rows[runs.rows["score"].notna()]
    if rows.empty:
        raise PkvError("no scored rows to plot")
    # a line (and a heatmap) per policy × bits × decode budget × query mode
    rows = with_query_modes(rows)
    rows = rows.assign(policy=rows[SERIES])
    # score-vs-budget curves need budgets on a number line: entries and fractions of the prompt (the frontier of
    # memory budgets is the report's and the HTML page's)
    numbered = rows[of_kind(rows["budget"], *NUMBER_LINE)]
    with _under_rule(outputs, "--out") as outputs:
        curves = plot_budget_curves(numbered, out_dir, outputs) if len(numbered) else []
        turns = plot_turn_curves(rows, out_dir, outputs) if "turn" in rows.columns else []
        return plot_needle_heatmaps(rows, out_dir, outputs) + curves + turns


# --- per-layer budgets -----------------------------------------------------------------------------------------------


def plot_layer_budgets(entries: list[dict], path: str | Path, outputs: Outputs | None = None) -> Path:
    """Entries kept per layer for each policy, one panel per budget; pyramid shapes as bars, uniform ones as a
    dashed line (a uniform reference is drawn even when no uniform policy was asked for)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise PkvError(f"--plot {path}: use a .png, .pdf or .svg file name")
    with _under_rule(outputs, "--plot") as outputs:
        outputs.check(path)  # before drawing
        return _save(_layer_budgets_figure(entries), path, outputs)


def _layer_budgets_figure(entries: list[dict]):
    budgets = list(dict.fromkeys(e["budget"] for e in entries))
    fig, axes = plt.subplots(len(budgets), 1, figsize=(9, 3.4 * len(budgets)), squeeze=False)
    for ax, budget in zip(axes[:, 0], budgets):
        panel = [e for e in entries if e["budget"] == budget]
        shaped = [e for e in panel if len(set(e["per_layer"])) > 1]
        flat = [e for e in panel if len(set(e["per_layer"])) <= 1]
        width = 0.8 / max(len(shaped), 1)
        for i, e in enumerate(shaped):
            xs = [layer + (i - (len(shaped) - 1) / 2) * width for layer in range(e["layers"])]
            ax.bar(
                xs,
                e["per_layer"],
                width=width,
                color=figure_data.policy_colour(i),
                label=f"{e['policy']} (mean {e['mean']:g})",
            )
        names = ", ".join(e["policy"] for e in flat)
        k = flat[0]["per_layer"][0] if flat else panel[0]["effective"]
        ax.axhline(
            k, color="black", linestyle="--", linewidth=1.2, label=f"uniform{' (' + names + ')' if names else ''}: {k}"
        )
        layers = panel[0]["layers"]
        ax.set_xlim(-0.7, layers - 0.3)
        step = max(1, math.ceil(layers / 16))
        ax.set_xticks(range(0, layers, step))
        ax.set_xlabel("layer (0 = bottom)")
        ax.set_ylabel("entries kept per KV head")
        policies = ", ".join(e["policy"] for e in panel)
        ax.set_title(
            f"entries kept per layer: {policies} · {budget_title(str(budget))} · prompt T={panel[0]['context']}"
            f", {layers} layers",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_funnel(per_layer: pd.DataFrame, overlays: dict[str, dict], title: str, path: str | Path) -> Path:
    """Per-layer attention statistics (mean, shaded ± one std over samples), one panel per task, with the per-layer
    budget PyramidKV would give that task's prompts as bars on a second axis (``overlays[task]``: ``per_layer``,
    ``uniform``, ``label``)."""
    from pkvbench.cell.schema import FUNNEL_STATISTICS

    shares = [name for name in FUNNEL_STATISTICS if name != "keys_for_90"]  # the ones on a 0–1 scale
    tasks = list(dict.fromkeys(per_layer["task"]))
    fig, axes = plt.subplots(len(tasks), 1, figsize=(10, 4.2 * len(tasks)), squeeze=False)
    palette = {name: figure_data.policy_colour(i) for i, name in enumerate(shares)}
    for ax, task in zip(axes[:, 0], tasks):
        overlay = overlays[task]
        budget_ax = ax.twinx()
        budget_ax.bar(
            range(len(overlay["per_layer"])),
            overlay["per_layer"],
            color="0.85",
            width=0.8,
            label=f"pyramidkv entries kept ({overlay['label']})",
        )
        budget_ax.axhline(
            overlay["uniform"], color="0.5", linestyle="--", linewidth=1, label=f"uniform: {overlay['uniform']}"
        )
        budget_ax.set_ylabel("entries kept per KV head")
        budget_ax.set_ylim(0, max(overlay["per_layer"]) * 1.15)
        ax.set_zorder(budget_ax.get_zorder() + 1)  # curves over the bars
        ax.patch.set_visible(False)
        panel = per_layer[per_layer["task"] == task]
        for name in shares:
            curve = panel[panel["statistic"] == name].sort_values("layer")
            spread = curve["std"].fillna(0)
            ax.plot(curve["layer"], curve["mean"], marker=".", color=palette[name], label=name)
            ax.fill_between(
                curve["layer"],
                (curve["mean"] - spread).clip(lower=0),
                (curve["mean"] + spread).clip(upper=1),
                color=palette[name],
                alpha=0.15,
                linewidth=0,
            )
        layers = int(panel["layer"].max()) + 1
        ax.set_xlim(-0.7, layers - 0.3)
        ax.set_xticks(range(0, layers, max(1, math.ceil(layers / 16))))
        ax.set_ylim(0, 1)
        ax.set_xlabel("layer (0 = bottom)")
        ax.set_ylabel("share (mean over samples, ± std)")
        samples = int(panel["samples"].max())
        ax.set_title(f"{title} · {task} · {samples} samples, last-window queries", fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        more_handles, more_labels = budget_ax.get_legend_handles_labels()
        ax.legend(
            handles + more_handles,
            labels + more_labels,
            fontsize=7,
            loc="upper center",
            ncol=4,
            bbox_to_anchor=(0.5, -0.14),
        )
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, _drawn(fig, path))  # the funnel's own folder, which its store holds
    return path
