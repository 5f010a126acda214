"""The ``pkvbench`` command line: parse options, call the API, print. Every error a user can cause is one line on
stderr and exit code 2; an internal error is one line and exit code 1."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import click

from pkvbench._version import __version__
from pkvbench.engine.models import ALIASES, DEFAULT_MODEL, DEVICES, DTYPES, SUPPORTED_ARCHITECTURES
from pkvbench.errors import PkvError
from pkvbench.io import atomic_write, make_dir


def _options(*options):
    """Apply several Click options in the order they are listed (as --help shows them)."""

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


sample_options = _options(
    click.option(
        "--lengths", help="Context lengths in prompt tokens, comma-separated (needle, RULER default: 1000,2000,4000)."
    ),
    click.option("--depths", help="Needle depths in percent, comma-separated (default: 0,25,50,75,100)."),
    click.option(
        "--limit",
        type=click.IntRange(min=1),
        help="At most this many samples per task (RULER, trec-fewshot: per task and length).",
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="Seed for generated tasks and torch."),
    click.option(
        "--data-dir",
        type=click.Path(file_okay=False),
        help="Folder with a task's data files (e.g. LongBench <name>.jsonl).",
    ),
    click.option(
        "--no-verify",
        "verify",
        is_flag=True,
        flag_value=False,
        default=True,
        help="Do not check data files against their known checksums.",
    ),
    click.option(
        "--max-length", type=click.IntRange(min=1), help="Truncate longer prompts to this many tokens (tasks that do)."
    ),
    click.option("--sample-id", "sample_ids", help="Only these sample ids, comma-separated."),
    click.option(
        "--include-path",
        "include_paths",
        multiple=True,
        type=click.Path(file_okay=False),
        help="A folder of your own task YAML files (repeatable; $PKVBENCH_TASKS works too).",
    ),
)
model_options = _options(
    click.option(
        "--model",
        default=DEFAULT_MODEL,
        show_default=True,
        help=f"Alias ({', '.join(ALIASES)}), Hugging Face model id, local folder, or a .gguf file.",
    ),
    click.option("--device", default="auto", show_default=True, type=click.Choice(DEVICES)),
    click.option(
        "--dtype",
        default="auto",
        show_default=True,
        type=click.Choice(DTYPES),
        help="auto = float32 on CPU, bfloat16 on CUDA.",
    ),
    click.option(
        "--attn-implementation",
        default="sdpa",
        show_default=True,
        help="transformers attention kernel (sdpa, eager, flash_attention_2, ...).",
    ),
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="pkvbench")
def cli() -> None:
    """What KV-cache compression costs in accuracy, at what budget.

    Runs PyramidKV and its baselines (full cache, StreamingLLM, H2O, SnapKV) on long-context tasks at the budgets
    you give and writes per-sample results and a summary table.
    """


def _click_default(option: str, value):
    """A config value as Click expects a default: lists of a comma option as one comma string, mappings as
    ``name=value`` pairs (task settings' values written as JSON, which their parser reads back as YAML)."""
    if isinstance(value, dict):
        if option == "task_args":
            return tuple(f"{k}={json.dumps(v)}" for k, v in value.items())
        return tuple(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(str(v).lower() if isinstance(v, bool) else str(v) for v in value)
    return value


def _load_config(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--config FILE``: the file's options become this command's defaults, so flags on the line still win."""
    if value is not None:
        from dataclasses import fields

        from pkvbench.api import RunConfig
        from pkvbench.config import read_run_config

        values = read_run_config(value, [f.name for f in fields(RunConfig)])
        multiple = {p.name for p in ctx.command.params if getattr(p, "multiple", False)}
        defaults = {
            k: (tuple(v) if k in multiple and isinstance(v, list) else _click_default(k, v)) for k, v in values.items()
        }
        ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _default_policies() -> str:
    from pkvbench.policies.registry import default_grid

    return ",".join(default_grid())


@cli.command()
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    is_eager=True,
    expose_value=False,
    callback=_load_config,
    help="YAML file of run options (keys as the long options: task, policy, budget, max-length, ...; "
    "see configs/). Options given on the command line override it.",
)
@click.option(
    "--task", "tasks", default="needle", show_default=True, help="Task name(s), comma-separated (see `pkvbench list`)."
)
@click.option(
    "--policy",
    "policies",
    default=_default_policies,
    show_default="full and the paper's four",
    help="Policies, comma-separated; options inline as name:opt=value, e.g. snapkv:window=32.",
)
@click.option(
    "--budget",
    "budgets",
    show_default="128; with --decode-budget cr0, nothing cut at the prefill",
    help="Budgets, comma-separated: below 1 a fraction of the prompt (0.007 = 0.7%), else entries per KV head per layer "
    "(cr0: the whole prompt).",
)
@click.option(
    "--policy-arg",
    "policy_args",
    multiple=True,
    metavar="NAME=VALUE",
    help="Option for every policy that has it (window, sink, kernel, pooling, beta, gqa, scores, normalize). Repeatable.",
)
@click.option(
    "--protocol",
    type=click.Choice(["exact", "reference"]),
    default="exact",
    show_default=True,
    help="exact: every policy keeps exactly L·k entries per KV head; reference: select as the PyramidKV paper's code "
    "did (one set per query head, its PyramidKV budgets, topk ties; docs/protocol.md).",
)
@click.option(
    "--query-mode",
    "query_modes",
    default="aware",
    show_default=True,
    help="Where the question is: aware (inside the compressed prompt, the paper's protocol), agnostic (added after "
    "the context is compressed; one compressed context answers every question), or aware,agnostic.",
)
@click.option(
    "--task-arg",
    "task_args",
    multiple=True,
    metavar="NAME=VALUE",
    help="Task setting for every task (chat_template=false, min_new_tokens=1, stop_strings=[]). Repeatable.",
)
@sample_options
@model_options
@click.option("--max-new-tokens", type=int, help="Override the task's answer length.")
@click.option(
    "--decode-batch",
    type=click.IntRange(min=1),
    help="At most this many configurations of a sample decode together (default: no cap; a batch pads its caches "
    "by at most one full cache of the prompt, or half what they keep if more); 1 decodes one configuration at a time.",
)
@click.option(
    "--decode-budget",
    "decode_budgets",
    help="Also cut the cache while the answer is written, back to this many entries per KV head per layer "
    "(comma-separated, an axis of the grid; none = never; docs/decoding.md).",
)
@click.option(
    "--decode-interval",
    type=int,
    default=16,
    show_default=True,
    help="With --decode-budget: cut every this many new tokens.",
)
@click.option(
    "--decode-buffer",
    type=int,
    default=8,
    show_default=True,
    help="With --decode-budget: the newest entries a cut always keeps.",
)
@click.option("--out", type=click.Path(file_okay=False), help="Result folder (default: results/runs/<model>/<tasks>).")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Start afresh in --out: its pkvbench files go once the model has loaded (a pkvbench run folder only; "
    "other files stay).",
)
@click.option(
    "--shard",
    help="Run only shard i of n (i/n, 1-based): every n-th sample, each with its whole grid. "
    "Give each shard its own --out and combine them with `pkvbench merge`.",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    help="At the end, also write the run's report as one self-contained HTML page (as `report --html`).",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where the samples run: this process, or Ray workers that each load the model once "
    "(pip install 'pkvbench[ray]'). Results and resume are the same.",
)
@click.option(
    "--ray-address",
    help="With --executor ray: 'auto' or HOST:PORT of an existing Ray cluster "
    "(default: start one on this machine, loopback only).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="With --executor ray: how many workers (default: as many as the cluster's CPUs and GPUs fit).",
)
@click.option(
    "--gpus-per-worker",
    type=click.FloatRange(min=0),
    help="With --executor ray: GPUs each worker reserves (default: 1 if the cluster has GPUs, else 0; "
    "0.5 puts two workers on a GPU).",
)
def run(**options) -> None:
    """Run policies × budgets over a task's samples; write samples.jsonl, summary.csv and run.json.

    Each sample is prefilled once; every policy × budget derives its cache from that prefill. Rerunning the same
    command with the same --out does only what is missing.

    \b
    Example:
      pkvbench run --task needle --policy full,snapkv,pyramidkv --budget 128,0.12 --lengths 1000,2000 --depths 0,50,100
    """
    from pkvbench.api import RunConfig, evaluate

    html_file = options.pop("html_file")
    if html_file:
        from pkvbench.html_report import check_html_target

        check_html_target(html_file)  # before the run: a bad path must not cost the run
    result = evaluate(RunConfig(**options))
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if not options["quiet"]:
        table = result.summary
        click.echo(table.to_string(index=False) if len(table) else "(no rows)")
    stats, out = result.stats, result.out
    lost = f", {stats.workers_lost} lost worker(s) replaced" if stats.workers_lost else ""
    click.echo(
        f"{stats.written} rows written, {stats.skipped} already done, {stats.prefills} prefills{lost}, "
        f"{stats.seconds:.1f} s → {out}/samples.jsonl, {out}/summary.csv"
    )
    if html_file:
        _write_html_report([out], html_file)


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="New (or empty) folder for the merged run."
)
def merge(folders, out) -> None:
    """Combine run folders (the shards of one run) into one, without duplicate rows."""
    from pkvbench.results import merge_runs

    written, duplicates = merge_runs(list(folders), out)
    click.echo(f"{written} rows from {len(folders)} folders → {out}/samples.jsonl ({duplicates} duplicates dropped)")


@cli.command()
@click.option(
    "--policy", default="pyramidkv", show_default=True, help="Policies, comma-separated (options as in `run`)."
)
@click.option(
    "--budget", default="128", show_default=True, help="Budgets, comma-separated (fractions or entry counts)."
)
@click.option(
    "--policy-arg", "policy_args", multiple=True, metavar="NAME=VALUE", help="Option for every policy that has it."
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="Number of layers (30 = the embedded model).",
)
@click.option(
    "--context", type=click.IntRange(min=1), default=8192, show_default=True, help="Prompt length T in tokens."
)
@click.option(
    "--protocol",
    type=click.Choice(["exact", "reference"]),
    default="exact",
    show_default=True,
    help="reference: the budgets the PyramidKV paper's code computes (docs/protocol.md).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False),
    help="Also draw entries kept per layer (one panel per budget, uniform as a reference) to this PNG.",
)
def budgets(policy, budget, policy_args, layers, context, protocol, as_json, plot_file) -> None:
    """Per-layer budgets (entries per KV head) a policy would keep: the function the engine uses."""
    from pkvbench.api import layer_budget_table
    from pkvbench.budgets import budget_label

    entries = layer_budget_table(policy, budget, policy_args, context, layers, protocol)
    if plot_file:
        from pkvbench.plots import plot_layer_budgets

        plot_layer_budgets(entries, plot_file)
    if as_json:
        click.echo(json.dumps(entries if len(entries) > 1 else entries[0], indent=2))
        return
    for e in entries:
        click.echo(
            f"{e['policy']} at budget {budget_label(e['budget'])} (T={context}, L={layers}): mean {e['mean']:g}, "
            f"total {e['total']}, requested {e['requested']}, {'compressed' if e['compressed'] else 'not compressed'}"
        )
        click.echo("  per layer (0 = bottom): " + " ".join(map(str, e["per_layer"])))


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["markdown", "csv", "latex"]), default="markdown", show_default=True)
@click.option(
    "--out", "out_file", type=click.Path(dir_okay=False), help="Write the table to this file instead of stdout."
)
@click.option(
    "--intervals/--no-intervals",
    default=True,
    show_default=True,
    help="Each score with its 95%% bootstrap interval over samples (Markdown/LaTeX: in the cell; CSV: columns).",
)
@click.option(
    "--power",
    type=float,
    metavar="POINTS",
    help="Also say, for every pair of policies, how many samples would resolve a difference of POINTS.",
)
@click.option(
    "--drift/--no-drift",
    default=None,
    help="Also the answers' length against the full cache's and the largest cache while decoding, per policy "
    "(default: when any row cut its cache while decoding).",
)
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    help="Write one self-contained HTML page instead of the table (tables, figures, every sample's predictions, "
    "run metadata; opens offline). With --out the table is written too.",
)
def report(folders, fmt, out_file, html_file, intervals, power, drift) -> None:
    """One table from run folders: rows model × policy × budget (× query mode), a column per task (score × 100,
    with its 95% interval), LongBench-E length buckets, avg (mean over tasks, its interval resampled within tasks;
    missing if a task is), tasks filled and n samples. Missing cells stay missing. A folder above run folders is
    searched for them."""
    from pkvbench.report import load_runs, render, report_table, uneven_counts

    if html_file:
        _write_html_report(list(folders), html_file)
        if out_file is None:
            return
    runs = load_runs(list(folders))
    _refuse_overwriting_inputs(out_file, runs.folders)
    text = render(report_table(runs.rows, intervals=intervals), fmt)
    if power is not None:
        from pkvbench.paired import pairwise, power_table

        needed = power_table(pairwise(runs.rows), power)
        heading = f"\nSamples needed to resolve {power:g} points (paired, alpha 0.05, power 0.8):\n\n"
        text += (heading if fmt == "markdown" else "\n") + render(needed, fmt)
    if drift or (drift is None and (runs.rows["decode_budget"] != "none").any()):
        from pkvbench.drift import length_table

        lengths = length_table(runs.rows)
        if lengths is not None:
            heading = (
                "\nAnswer length and the largest cache while decoding (mean [95% interval]; length_ratio: over the "
                "full cache's answer to the same sample; peak_kv_entries: over layers and heads):\n\n"
            )
            text += (heading if fmt == "markdown" else "\n") + render(lengths, fmt)
    _write_or_echo(text, out_file)
    for note in runs.notes + uneven_counts(runs.rows):
        click.echo(f"note: {note}", err=True)


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the PNG files.")
def plot(folders, out_dir) -> None:
    """Figures from run folders: needle heatmaps (depth × length, one per model × policy × budget, and one grid of
    policies side by side per budget) and score-vs-budget curves (a panel per task and for the average)."""
    from pkvbench.plots import plot_runs
    from pkvbench.report import load_runs

    runs = load_runs(list(folders))
    make_dir(out_dir, "--out")
    paths = plot_runs(runs, out_dir)
    for note in runs.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"{len(paths)} figures → {out_dir}/")


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["kvpress"]),
    default="kvpress",
    show_default=True,
    help="kvpress: its evaluation folders (predictions.csv, metrics.json, config.yaml per press and ratio).",
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write into.")
def export(folders, fmt, out_dir) -> None:
    """Results in another harness's layout, from run folders alone."""
    from pkvbench.export import export_kvpress, write_ranking
    from pkvbench.report import load_runs, to_markdown

    runs = load_runs(list(folders))
    written = export_kvpress(runs, out_dir)
    ranking = write_ranking(runs, out_dir)
    for note in runs.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(to_markdown(ranking))
    click.echo(f"{len(written)} kvpress result folders, ranking.md and ranking.csv → {out_dir}/")


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path())
@click.option("--reference", default="pyramidkv-table1", show_default=True, help="Reference name or CSV file.")
@click.option(
    "--paper-model",
    help="The paper's model to compare with when the run's model is not one of them "
    "(default: the reference's first, Llama-3-8B-Instruct).",
)
@click.option("--format", "fmt", type=click.Choice(["markdown", "csv", "latex"]), default="markdown", show_default=True)
def compare(folders, reference, paper_model, fmt) -> None:
    """Measured vs the paper per task and average (score × 100, delta = measured − paper), for the cells both have."""
    from pkvbench.report import compare as compare_runs
    from pkvbench.report import load_reference, load_runs, render

    result = compare_runs(load_runs(list(folders)), load_reference(reference), paper_model)
    for statement in result.statements:  # before the table, so nobody reads the deltas without them
        click.echo(f"note: {statement}", err=fmt != "markdown")
    click.echo(render(result.table, fmt), nl=False)


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=click.Path())
@click.option("--policy", "policies", help="Compare only these policies (comma list; default: every policy).")
@click.option("--against", help="Compare every policy with this one only (e.g. full) instead of every pair.")
@click.option("--format", "fmt", type=click.Choice(["markdown", "csv", "latex"]), default="markdown", show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False), help="Write to this file instead of stdout.")
def diff(folders, policies, against, fmt, out_file) -> None:
    """Paired policy comparisons on the same samples: per budget, per task and over all tasks, A − B in points with
    its 95% paired-bootstrap interval, a sign-flip p-value and Holm's adjustment over every comparison shown.
    Markdown shows one matrix per budget and task (row − column); CSV and LaTeX the long table. A pair is called
    only where its interval excludes 0 and the adjusted p is below 0.05."""
    from pkvbench.api import as_list
    from pkvbench.paired import matrix_markdown, pairwise
    from pkvbench.report import load_runs, render

    runs = load_runs(list(folders))
    _refuse_overwriting_inputs(out_file, runs.folders)
    chosen = as_list(policies, "--policy") if policies is not None else None
    table = pairwise(runs.rows, chosen, against)
    _write_or_echo(matrix_markdown(table) if fmt == "markdown" else render(table, fmt), out_file)
    for note in runs.notes:
        click.echo(f"note: {note}", err=True)


def _write_html_report(folders: list, html_file: str) -> None:
    from pkvbench.html_report import write_html_report
    from pkvbench.report import uneven_counts

    page = write_html_report(folders, html_file)
    for note in page.runs.notes + uneven_counts(page.runs.rows):
        click.echo(f"note: {note}", err=True)
    click.echo(f"html report → {page.path} ({page.bytes / 1e6:.1f} MB, opens offline)", err=True)


def _refuse_overwriting_inputs(out_file: str | None, inputs: list[Path]) -> None:
    """An output may go beside the inputs (a report in a run folder), never over pkvbench's own files there."""
    from pkvbench.results import RUN_FOLDER_FILES

    if out_file is None:
        return
    target = Path(out_file).resolve()
    for folder in inputs:
        if target.parent == Path(folder).resolve() and target.name in RUN_FOLDER_FILES:
            raise PkvError(f"--out {out_file} would overwrite the {target.name} of the input folder {folder}")


def _write_or_echo(text: str, out_file: str | None) -> None:
    """Print ``text``, or write it to ``out_file`` (atomically: a failed write leaves the previous file)."""
    if out_file is None:
        click.echo(text, nl=False)
        return
    atomic_write(out_file, text)
    click.echo(f"table → {out_file}", err=True)


@cli.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--out", "out_file", type=click.Path(dir_okay=False), help="Write the scored lines here (default: stdout)."
)
@click.option("--dataset", help="Dataset of lines that name none (an official pred/<model>/<dataset>.jsonl file).")
def score(file, out_file, dataset) -> None:
    """Score LongBench predictions as the official eval.py does.

    FILE.jsonl has one prediction a line: dataset, pred, answers, all_classes (and length for the LongBench-E
    `<name>_e` datasets); pkvbench's own samples.jsonl works too (task instead of dataset; trec and lsht need
    all_classes). The lines come back with score (0-1); per-dataset scores (round(100 × mean, 2), and the
    0-4k / 4-8k / 8k+ buckets for LongBench-E) are printed, on stderr when the lines go to stdout.
    """
    from pkvbench.io import read_json_lines
    from pkvbench.tasks.scoring import score_rows

    if out_file is not None and Path(out_file).resolve() == Path(file).resolve():
        raise PkvError("--out must not be the input file")
    _refuse_overwriting_inputs(out_file, [Path(file).parent])
    rows = read_json_lines(file, "predictions file")
    if not rows:
        raise PkvError(f"{file} has no predictions")
    scored, summary = score_rows(rows, dataset, where=file)
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in scored)
    if out_file:
        _write_or_echo(lines, out_file)
    else:
        click.echo(lines, nl=False)
    for entry in summary:
        labels = " ".join(str(entry[k]) for k in ("dataset", "policy", "budget") if k in entry)
        buckets = "".join(f"  {b} {entry[b]}" for b in ("0-4k", "4-8k", "8k+") if b in entry)
        click.echo(f"{labels}: {entry['score']} (n={entry['n']}){buckets}", err=not out_file)


@cli.command()
@click.option(
    "--baseline",
    required=True,
    type=click.Path(dir_okay=False),
    help="Baseline CSV (model,task,policy,budget,query_mode,n,score,ci_low,ci_high); its per-sample scores, for the "
    "paired tests, are read from NAME.samples.csv beside it.",
)
@click.option(
    "--results",
    "results",
    required=True,
    multiple=True,
    type=click.Path(exists=True, file_okay=False),
    help="Run folder(s) to check (repeatable).",
)
@click.option(
    "--tolerance",
    type=float,
    default=2.0,
    show_default=True,
    help="Allowed fall in score points (× 100 scale) before a cell may fail.",
)
@click.option("--per-cell", type=click.Path(exists=True, dir_okay=False), help="YAML of task: tolerance overrides.")
@click.option("--update", is_flag=True, help="Write the run's cells (and samples) as the new baseline instead.")
def check(baseline, results, tolerance, per_cell, update) -> None:
    """Fail (exit 1) if accuracy at any budget fell for real: a CI gate.

    Every cell of the baseline must be in the run with the same sample count. A cell fails when its score fell by
    more than the tolerance and below the baseline's 95% interval, or when a paired test on the same samples (per
    cell, and per policy over all its cells; Holm-adjusted) says it fell. Improvements and new cells pass.
    """
    from pkvbench.check import check_run, format_failures, samples_path, write_baseline

    if update:
        cells = write_baseline(list(results), baseline)
        click.echo(
            f"baseline {baseline} written: {len(cells)} cells from {', '.join(results)} "
            f"(per-sample scores in {samples_path(baseline)})"
        )
        return
    result = check_run(list(results), baseline, tolerance, per_cell)
    if result.passed:
        click.echo(f"check passed: {result.describe()}")
        return
    click.echo(f"check FAILED: {len(result.failures)} failing; {result.describe()}", err=True)
    click.echo(format_failures(result), err=True)
    raise SystemExit(1)


@cli.command(name="list")
@click.option(
    "--include-path",
    "include_paths",
    multiple=True,
    type=click.Path(file_okay=False),
    help="A folder of your own task YAML files (repeatable; $PKVBENCH_TASKS works too).",
)
def list_(include_paths) -> None:
    """Tasks, policies (with their options), model aliases and supported architectures."""
    from pkvbench.policies.registry import registry
    from pkvbench.tasks.registry import catalog

    tasks = catalog(tuple(include_paths))
    click.echo("Tasks:")
    for spec in tasks.tasks.values():
        click.echo(f"  {spec.name:22} {spec.description}")
    click.echo("Task groups (--task GROUP):")
    for group, members in tasks.groups.items():
        click.echo(f"  {group:14} {', '.join(members)}")
    click.echo("Policies (options with defaults):")
    for name, cls in registry().items():
        options = [f for f in dataclasses.fields(cls) if f.name != "inner"]
        defaults = " ".join(f"{f.name}={f.default}" for f in options)
        if getattr(cls, "wraps", False):
            name = f"{name}(policy)"
        click.echo(f"  {name:14} {cls.summary}" + (f"\n  {'':14} [{defaults}]" if defaults else ""))
    click.echo("Models:")
    for name, alias in ALIASES.items():
        click.echo(f"  {name:14} {alias.description} (from {alias.distribution}=={alias.version})")
    click.echo(f"  or any Hugging Face id / local folder / .gguf file of: {', '.join(SUPPORTED_ARCHITECTURES)}")


@cli.command()
@click.option(
    "--task", "tasks", default="needle", show_default=True, help="Task name(s), comma-separated (see `pkvbench list`)."
)
@sample_options
@model_options
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Observation window: the last queries whose attention is measured (SnapKV/PyramidKV's window).",
)
@click.option(
    "--sink",
    type=click.IntRange(min=0),
    default=4,
    show_default=True,
    help="First tokens counted as the attention sink.",
)
@click.option(
    "--top-k", type=click.IntRange(min=1), default=128, show_default=True, help="k of the top-k mass statistic."
)
@click.option(
    "--budget",
    default="128",
    show_default=True,
    help="Budget whose PyramidKV per-layer allocation is drawn over the curves (fraction or entries).",
)
@click.option("--out", type=click.Path(file_okay=False), help="Folder (default: results/funnel/<model>/<tasks>).")
@click.option("--overwrite", is_flag=True, help="Start afresh in --out: its funnel files go once the model has loaded.")
@click.option("--quiet", is_flag=True, help="No progress bar, no verdict on the terminal (it is still written).")
def funnel(**options) -> None:
    """Does attention funnel with depth in this model? PyramidKV's premise, measured.

    Prefills each sample once and, per layer and head, measures the last --window queries' attention: normalised
    entropy, mass on the top 1% and top-k keys, mass on the first --sink tokens, keys holding 90% of the mass.
    Writes funnel_samples.jsonl (a line per sample; rerunning resumes), funnel.csv (per layer, mean and spread over
    samples), funnel_heads.csv (per layer and head), funnel.png (curves with PyramidKV's per-layer budget) and
    verdict.txt (a paragraph per task, also printed).

    \b
    Example:
      pkvbench funnel --task needle,trec-fewshot --data-dir ../shared/data/trec --lengths 2000 --limit 5
    """
    from pkvbench import funnel as measure
    from pkvbench.api import FunnelConfig, measure_funnel

    result = measure_funnel(FunnelConfig(**options))
    if not options["quiet"]:
        click.echo("\n\n".join(result.verdicts))
    click.echo(
        f"{result.written} samples measured, {result.skipped} already done, {result.seconds:.1f} s → "
        f"{result.out}/{measure.TABLE}, {measure.HEAD_TABLE}, {measure.FIGURE}, {measure.VERDICT}"
    )


def _quiet_libraries() -> None:
    """Library chatter (load bars, GGUF notices) would bury our own output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore", module="transformers")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    _quiet_libraries()
    try:
        code = cli.main(args=argv, prog_name="pkvbench", standalone_mode=False)
    except PkvError as exc:
        click.echo(f"pkvbench: error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help())
        sys.exit(2)
    except click.ClickException as exc:
        click.echo(f"pkvbench: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except (KeyboardInterrupt, click.Abort):
        click.echo("pkvbench: interrupted; every finished row is saved, rerun the same command to resume", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug, not bad input: still one line, with a way to see more
        if os.environ.get("PKVBENCH_DEBUG"):
            raise
        click.echo(
            f"pkvbench: internal error: {type(exc).__name__}: {exc} (PKVBENCH_DEBUG=1 shows the traceback)", err=True
        )
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
