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
from pkvbench.cell.models import ALIASES
from pkvbench.cell.schema import FORMATS
from pkvbench.config import (
    FLAG,
    LIST,
    MIN_POWER,
    PAIR,
    REPEATED,
    Bounds,
    Option,
    number,
    options_of,
    path_list,
    path_value,
    whole,
)
from pkvbench.engine.architecture import FAMILIES
from pkvbench.errors import PkvError
from pkvbench.lm_eval import BOOTSTRAP_ITERS
from pkvbench.lm_eval import POLICY as LM_EVAL_POLICY
from pkvbench.options import (
    BudgetsConfig,
    FunnelConfig,
    RunConfig,
    SampleConfig,
)
from pkvbench.reports.choices import EXPORT_FORMATS, MIN_OVERLAP, PAPER_REFERENCE, SELECTION, TOLERANCE, VIEWS


def _options(*options):
    """Apply several Click options in the order they are listed (as --help shows them)."""

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


class Number(click.ParamType):
    """An integer or a number, parsed by the check configs and the Python API use (``config.Bounds``): 1.7 is no
    integer, true is no number, nan and inf are refused, bounds say the same words."""

    def __init__(self, bounds: Bounds):
        self.bounds = bounds
        self.name = "integer" if bounds.kind is int else "number"

    def convert(self, value, param, ctx):
        return self.bounds(value, param.opts[0] if param is not None and param.opts else self.name)


class Choice(click.Choice):
    """``click.Choice`` whose refusal is the option's own check (``Option.check``): the words the Python API and a
    config file get for the same value."""

    def __init__(self, declared: Option):
        super().__init__(declared.choices)
        self.declared = declared

    def convert(self, value, param, ctx):
        return self.declared.check(value, self.declared.flag)


class PathType(click.Path):
    """``click.Path`` that refuses an empty path: '' would mean the current folder, never what was meant."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            what = param.opts[0] if isinstance(param, click.Option) else f"{param.human_readable_name}"
            raise PkvError(f"{what} '': an empty path would mean the current folder; give a name")
        return super().convert(value, param, ctx)


def _refuse_repeated_options(command: click.Command, ctx: click.Context, args: list[str]) -> None:
    """An option given twice is refused, naming both values: Click keeps the last one without a word, and
    ``check --tolerance 2 --tolerance 999`` would then gate at 999. Repeatable options (``multiple``) may repeat."""
    options = {}
    for param in command.get_params(ctx):
        if isinstance(param, click.Option) and param.name != "help":
            options.update(dict.fromkeys((*param.opts, *param.secondary_opts), param))
    seen: dict[str, str] = {}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        name, equals, value = token.partition("=")
        param = options.get(name)
        if param is None:
            continue
        if not param.is_flag and not param.count and not equals:
            value = next(tokens, "")
        if param.multiple or param.count:
            continue
        given = name if param.is_flag else f"{name} {value}"
        if param.name in seen:
            raise PkvError(f"{seen[param.name]} and {given}: the option is given twice; give it once")
        seen[param.name] = given


class StrictCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        _refuse_repeated_options(self, ctx, args)
        return super().parse_args(ctx, args)


class StrictGroup(click.Group):
    command_class = StrictCommand


def config_option(declared: Option, **differences):
    """The command line's option of a configuration field (``options.py``), as the field declares it;
    ``differences``: the Click settings a command other than the field's own takes otherwise (``LM_EVAL_DIFFERENCES``)."""
    if declared.kind == FLAG:
        settings = {
            "is_flag": True,
            "flag_value": not declared.default,
            "default": declared.default,
            "help": declared.help,
        }
        return click.option(declared.flag, declared.name, **{**settings, **differences})
    if declared.choices:
        kind = Choice(declared)
    elif isinstance(declared.check, Bounds):
        kind = Number(declared.check)
    elif declared.check in (path_value, path_list):
        kind = PathType(file_okay=False)
    else:
        kind = click.STRING
    default = declared.default
    if declared.kind == LIST and isinstance(default, tuple):
        default = ",".join(default)  # typed as a comma string
    implied = declared.implied  # what None means, once it is used
    implied = ",".join(implied) if isinstance(implied, tuple) else str(implied) if implied is not None else None
    settings = {
        "type": kind,
        "default": default,
        "show_default": declared.show_default or implied or default not in (None, ()),
        "multiple": declared.kind in (PAIR, REPEATED),
        "metavar": "NAME=VALUE" if declared.kind == PAIR else None,
        "help": declared.help or None,
    }
    if differences.get("required"):
        del settings["default"]  # Click (8.3) takes a default, even None, as the value given: a required one has none
    return click.option(declared.flag, declared.name, **{**settings, **differences})


def config_options(config: type):
    """Every option of a configuration class, in the order of its fields."""
    return _options(*(config_option(declared) for declared in options_of(config).values()))


class TableOption(click.Option):
    """An option that shapes ``report``'s table (with --html and no --out there is no table for it to shape)."""


# The options several commands share, each declared once: the table's format, a file or folder to write (--out), the
# HTML page (--html); each command says in its own words what goes there.
OUT, HTML = "--out", "--html"
table_format = click.option(
    "--format", "fmt", cls=TableOption, type=click.Choice(FORMATS), default=FORMATS[0], show_default=True
)


def out_file_option(help: str):
    return click.option(OUT, "out_file", type=PathType(dir_okay=False), help=help)


def out_folder_option(help: str):
    return click.option(OUT, "out_dir", required=True, type=PathType(file_okay=False), help=help)


def html_option(help: str):
    return click.option(HTML, "html_file", type=PathType(dir_okay=False), help=help)


# ``run --config``'s key for --html (not a RunConfig field): read as the option is
HTML_KEY = Option(None, "", path_value, flag=HTML)


@click.group(cls=StrictGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="pkvbench")
def cli() -> None:
    """What KV-cache compression costs in accuracy, at what budget.

    Runs PyramidKV and its baselines (full cache, StreamingLLM, H2O, SnapKV) on long-context tasks at the budgets
    you give and writes per-sample results and a summary table.
    """


def _run_config(options: dict) -> tuple:
    """The ``RunConfig`` and ``--html`` file of a ``run`` command line. With ``--config FILE`` the file's values are
    taken as they are (the Python API checks them, as it checks any ``RunConfig``) and the options given on the
    command line win over them; without it, Click's values."""
    from click.core import ParameterSource

    from pkvbench.config import read_run_config

    config_file, html_file = options.pop("config_file"), options.pop("html_file")
    if config_file is None:
        return RunConfig(**options), html_file
    context = click.get_current_context()
    given = {k: v for k, v in options.items() if context.get_parameter_source(k) is not ParameterSource.DEFAULT}
    from_file = read_run_config(config_file, {**options_of(RunConfig), "html_file": HTML_KEY})
    html_in_file = from_file.pop("html_file", None)
    return RunConfig(**{**from_file, **given}), html_file if html_file is not None else html_in_file


@cli.command()
@click.option(
    "--config",
    "config_file",
    type=PathType(dir_okay=False),
    help="YAML file of run options (keys as the long options: task, policy, budget, max-length, ...; "
    "see configs/). Options given on the command line override it.",
)
@config_options(RunConfig)
@html_option("At the end, also write the run's report as one self-contained HTML page (as `report --html`).")
def run(**options) -> None:
    """Run policies × budgets over a task's samples; write samples.jsonl, summary.csv and run.json.

    Each sample is prefilled once; every policy × budget derives its cache from that prefill. Rerunning the same
    command with the same --out does only what is missing.

    \b
    Example:
      pkvbench run --task needle --policy full,snapkv,pyramidkv --budget 128,0.12 --lengths 1000,2000 --depths 0,50,100
    """
    from pkvbench.api import evaluate, resolve

    config, html_file = _run_config(options)
    run = resolve(config)  # once: the page's path is checked against the run's folder before the run starts
    if html_file is not None:
        from pkvbench.reports.html_report import check_html_target

        check_html_target(html_file, [run.out])  # before the run: a bad path must not cost the run
    result = evaluate(run)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    if not config.quiet:
        table = result.summary
        click.echo(table.to_string(index=False) if len(table) else "(no rows)")
    stats, out = result.stats, result.out
    lost = f", {stats.workers_lost} lost worker(s) replaced" if stats.workers_lost else ""
    click.echo(
        f"{stats.written} rows written, {stats.skipped} already done, {stats.prefills} prefills{lost}, "
        f"{stats.seconds:.1f} s → {out}/samples.jsonl, {out}/summary.csv"
    )
    if html_file is not None:
        _write_html_report([out], html_file)


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=PathType(exists=True, file_okay=False))
@out_folder_option("New (or empty) folder for the merged run.")
def merge(folders, out_dir) -> None:
    """Combine run folders (the shards of one run) into one, without duplicate rows."""
    from pkvbench.run.merge import merge_runs

    written, duplicates, missing = merge_runs(list(folders), out_dir)
    click.echo(
        f"{written} rows from {len(folders)} folders → {out_dir}/samples.jsonl ({duplicates} duplicates dropped)"
    )
    if missing:
        click.echo(
            f"note: shards {missing} are missing: {out_dir} is not the whole run (recorded in its run.json)", err=True
        )


@cli.command()
@config_options(BudgetsConfig)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option(
    "--plot",
    "plot_file",
    type=PathType(dir_okay=False),
    help="Also draw entries kept per layer (one panel per budget, uniform as a reference) to this PNG.",
)
def budgets(policies, budgets, policy_args, layers, context, protocol, as_json, plot_file) -> None:
    """Per-layer budgets (entries per KV head) a policy would keep: the function the engine uses."""
    from pkvbench.api import layer_budget_table
    from pkvbench.cell.budgets import budget_label

    entries = layer_budget_table(policies, budgets, policy_args, context, layers, protocol)
    if plot_file:
        from pkvbench.reports.figures.plots import plot_layer_budgets

        plot_layer_budgets(entries, plot_file)  # under the writing rule (outputs.py), as every file
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
@click.argument("folders", nargs=-1, required=True, type=PathType())
@table_format
@out_file_option("Write the table to this file instead of stdout.")
@click.option(
    "--intervals/--no-intervals",
    cls=TableOption,
    default=True,
    show_default=True,
    help="Each score with its 95%% bootstrap interval over samples (Markdown/LaTeX: in the cell; CSV: columns).",
)
@click.option(
    "--power",
    cls=TableOption,
    type=Number(number(MIN_POWER, 100)),
    metavar="POINTS",
    help="Also say, for every pair of policies, how many samples would resolve a difference of POINTS.",
)
@click.option(
    "--drift/--no-drift",
    cls=TableOption,
    default=None,
    help="Also the answers' length against the full cache's and the largest cache while decoding, per policy "
    "(default: when any row cut its cache while decoding).",
)
@html_option(
    "Write one self-contained HTML page instead of the table (tables, figures, every sample's predictions, run "
    "metadata; opens offline). With --out the table is written too."
)
@click.option(
    "--view",
    cls=TableOption,
    type=click.Choice(VIEWS),
    default=VIEWS[0],
    show_default=True,
    help="frontier: each cell's bytes and score, the Pareto front marked (runs with --kv-bits or --memory); "
    "memory-diff: per memory target, its best cell against every other, paired; memory: per storage format and "
    "budget, the entries kept and the bytes as stored.",
)
def report(folders, fmt, out_file, html_file, intervals, power, view, drift) -> None:
    """One table from run folders: rows model × policy × budget (× the bits values were stored in, × query mode),
    a column per task (score × 100, with its 95% interval), LongBench-E length buckets, avg (mean over tasks, its
    interval resampled within tasks; missing if a task is), tasks filled and n samples. Missing cells stay
    missing. A folder above run folders is searched for them.

    Runs with --kv-bits or --memory also get the frontier (Markdown: after the table; --view frontier alone): each
    cell's bytes against its score, the Pareto front marked, and per memory target its best cell against every
    other (--view memory-diff: that comparison as a table). Runs with --decode-budget also get each policy's answer
    length and largest cache while decoding, against the full cache's (--drift)."""
    from pkvbench.reports.report import load_runs, render, report_table, uneven_counts

    if html_file is not None:
        _check_html_with_table(html_file, out_file)
    runs = load_runs(list(folders))
    outputs = _outputs_for(out_file, [*folders, *runs.folders])  # both paths checked before either is written
    if html_file is not None:
        _write_html_report(list(folders), html_file, runs)
        if out_file is None:
            return
    if view != "table":
        from pkvbench.reports import frontier

        if not frontier.has_frontier(runs.rows):
            raise PkvError(f"--view {view}: the runs have no storage bits or memory budgets (--kv-bits, --memory)")
        views = {"frontier": frontier.points, "memory-diff": frontier.comparisons, "memory": frontier.storage}
        table = views[view](runs.rows)
        if table.empty:
            raise PkvError(f"--view {view}: no memory target with two cells to compare")
        _write_or_echo(
            frontier.frontier_markdown(runs.rows) if fmt == "markdown" and view == "frontier" else render(table, fmt),
            out_file,
            outputs,
        )
        return
    text = render(report_table(runs.rows, intervals=intervals), fmt)
    if fmt == "markdown":
        from pkvbench.reports import frontier

        if frontier.has_frontier(runs.rows):
            text += "\n" + frontier.frontier_markdown(runs.rows)
    if power is not None:
        from pkvbench.reports.paired import pairwise, power_table

        needed = power_table(pairwise(runs.rows), power)
        heading = f"\nSamples needed to resolve {power:g} points (paired, alpha 0.05, power 0.8):\n\n"
        text += (heading if fmt == "markdown" else "\n") + render(needed, fmt)
    from pkvbench.reports.turns import has_turns, turn_table

    if has_turns(runs.rows):
        heading = (
            "\nAccuracy by turn (the conversations' rows; score × 100 [95% interval]; curve: the means from the first "
            "turn on, 0 to 100):\n\n"
        )
        text += (heading if fmt == "markdown" else "\n") + render(turn_table(runs.rows, intervals), fmt)
    if drift or (drift is None and (runs.rows["decode_budget"] != "none").any()):
        from pkvbench.reports.drift import length_table

        lengths = length_table(runs.rows)
        if lengths is not None:
            heading = (
                "\nAnswer length and the largest cache while decoding (mean [95% interval]; length_ratio: over the "
                "full cache's answer to the same sample; peak_kv_entries: over layers and heads):\n\n"
            )
            text += (heading if fmt == "markdown" else "\n") + render(lengths, fmt)
    _write_or_echo(text, out_file, outputs)
    for note in runs.notes + uneven_counts(runs.rows):
        click.echo(f"note: {note}", err=True)


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=PathType())
@out_folder_option("Folder for the PNG files.")
def plot(folders, out_dir) -> None:
    """Figures from run folders: needle heatmaps (depth × length, one per model × policy × budget, and one grid of
    policies side by side per budget) and score-vs-budget curves (a panel per task and for the average)."""
    from pkvbench.reports.figures.plots import plot_runs
    from pkvbench.reports.report import load_runs
    from pkvbench.store.outputs import Outputs

    runs = load_runs(list(folders))
    outputs = Outputs(OUT, [*folders, *runs.folders])
    outputs.check_folder(out_dir)
    paths = plot_runs(runs, out_dir, outputs)
    outputs.commit()
    for note in runs.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"{len(paths)} figures → {out_dir}/")


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=PathType())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(EXPORT_FORMATS),
    default=EXPORT_FORMATS[0],
    show_default=True,
    help="kvpress: its evaluation folders (predictions.csv, metrics.json, config.yaml per press and ratio).",
)
@out_folder_option("Folder to write into.")
def export(folders, fmt, out_dir) -> None:
    """Results in another harness's layout, from run folders alone."""
    from pkvbench.reports.export import export_kvpress, write_ranking
    from pkvbench.reports.report import load_runs, to_markdown
    from pkvbench.store.outputs import Outputs

    runs = load_runs(list(folders))
    outputs = Outputs(OUT, [*folders, *runs.folders])
    outputs.check_folder(out_dir)
    written = export_kvpress(runs, out_dir, outputs)
    ranking = write_ranking(runs, out_dir, outputs)
    outputs.commit()
    for note in runs.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(to_markdown(ranking))
    click.echo(f"{len(written)} kvpress result folders, ranking.md and ranking.csv → {out_dir}/")


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=PathType())
@click.option("--reference", default=PAPER_REFERENCE, show_default=True, help="Reference name or CSV file.")
@click.option(
    "--paper-model",
    help="The paper's model to compare with when the run's model is not one of them "
    "(default: the reference's first, Llama-3-8B-Instruct).",
)
@table_format
def compare(folders, reference, paper_model, fmt) -> None:
    """Measured vs the paper per task and average (score × 100, delta = measured − paper), for the cells both have."""
    from pkvbench.reports.paper_compare import compare as compare_runs
    from pkvbench.reports.paper_compare import load_reference
    from pkvbench.reports.report import load_runs, render

    result = compare_runs(load_runs(list(folders)), load_reference(reference), paper_model)
    for statement in result.statements:  # before the table, so nobody reads the deltas without them
        click.echo(f"note: {statement}", err=fmt != "markdown")
    click.echo(render(result.table, fmt), nl=False)


@cli.command()
@click.argument("folders", nargs=-1, required=True, type=PathType())
@click.option("--policy", "policies", help="Compare only these policies (comma list; default: every policy).")
@click.option("--against", help="Compare every policy with this one only (e.g. full) instead of every pair.")
@table_format
@out_file_option("Write to this file instead of stdout.")
def diff(folders, policies, against, fmt, out_file) -> None:
    """Paired policy comparisons on the same samples: per budget, per task and over all tasks, A − B in points with
    its 95% paired-bootstrap interval, a sign-flip p-value and Holm's adjustment over every comparison shown.
    Markdown shows one matrix per budget and task (row − column); CSV and LaTeX the long table. A pair is called
    only where its interval excludes 0 and the adjusted p is below 0.05."""
    from pkvbench.api import as_list
    from pkvbench.reports.paired import matrix_markdown, pairwise
    from pkvbench.reports.report import load_runs, render

    runs = load_runs(list(folders))
    outputs = _outputs_for(out_file, [*folders, *runs.folders])
    chosen = as_list(policies, "--policy") if policies is not None else None
    table = pairwise(runs.rows, chosen, against)
    _write_or_echo(matrix_markdown(table) if fmt == "markdown" else render(table, fmt), out_file, outputs)
    for note in runs.notes:
        click.echo(f"note: {note}", err=True)


def _check_html_with_table(html_file: str, out_file: str | None) -> None:
    """``report --html``: the page and the table (``--out``) are two files, and an option of the table given without
    one is refused rather than ignored."""
    from click.core import ParameterSource

    if out_file is not None:
        if Path(out_file).resolve() == Path(html_file).resolve():
            raise PkvError(f"--html and --out are both {out_file}: the table would overwrite the page; give two files")
        return
    context = click.get_current_context()
    given = [
        param.opts[0]
        for param in context.command.params
        if isinstance(param, TableOption) and context.get_parameter_source(param.name) is not ParameterSource.DEFAULT
    ]
    if given:
        raise PkvError(
            f"{given[0]} shapes the table, and with --html alone there is none (the page has its own views); "
            "add --out FILE for the table, or leave it out"
        )


def _write_html_report(folders: list, html_file: str, runs=None) -> None:
    from pkvbench.reports.html_report import write_html_report
    from pkvbench.reports.report import uneven_counts

    page = write_html_report(folders, html_file, runs)
    for note in page.runs.notes + uneven_counts(page.runs.rows):
        click.echo(f"note: {note}", err=True)
    click.echo(f"html report → {page.path} ({page.bytes / 1e6:.1f} MB, opens offline)", err=True)


def _outputs_for(out_file: str | None, reads: list):
    """The writing rule (``outputs.py``) for a command's ``--out FILE``, its path checked now, before any work."""
    from pkvbench.store.outputs import Outputs

    if out_file is None:
        return None
    outputs = Outputs(OUT, reads)
    outputs.check(out_file)
    return outputs


def _write_or_echo(text: str, out_file: str | None, outputs) -> None:
    """Print ``text``, or write it to ``out_file`` under the writing rule (atomically)."""
    if out_file is None:
        click.echo(text, nl=False)
        return
    outputs.add(out_file, text)
    outputs.commit()
    click.echo(f"table → {out_file}", err=True)


@cli.command()
@click.argument("file", type=PathType(dir_okay=False))
@out_file_option("Write the scored lines here (default: stdout).")
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
    outputs = _outputs_for(out_file, [Path(file).parent])
    rows = read_json_lines(file, "predictions file")
    if not rows:
        raise PkvError(f"{file} has no predictions")
    scored, summary = score_rows(rows, dataset, where=file)
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in scored)
    if out_file:
        _write_or_echo(lines, out_file, outputs)
    else:
        click.echo(lines, nl=False)
    for entry in summary:
        labels = " ".join(str(entry[k]) for k in ("dataset", "policy", "budget") if k in entry)
        buckets = "".join(f"  {b} {entry[b]}" for b in ("0-4k", "4-8k", "8k+") if b in entry)
        click.echo(f"{labels}: {entry['score']} (n={entry['n']}){buckets}", err=not out_file)


def threshold_option(flag: str, default: float, help: str):
    """One of the gate's number thresholds (``check``'s ``--tolerance`` and ``--min-overlap``)."""
    return click.option(flag, type=Number(number()), default=default, show_default=True, help=help)


@cli.command()
@click.option(
    "--baseline",
    required=True,
    type=PathType(dir_okay=False),
    help="Baseline CSV (model,task,policy,budget,query_mode,n,score,ci_low,ci_high); its per-sample scores, for the "
    "paired tests, are read from NAME.samples.csv beside it.",
)
@click.option(
    "--results",
    "results",
    required=True,
    multiple=True,
    type=PathType(exists=True, file_okay=False),
    help="Run folder(s) to check (repeatable).",
)
@threshold_option("--tolerance", TOLERANCE, "Allowed fall in score points (× 100 scale) before a cell may fail.")
@click.option("--per-cell", type=PathType(exists=True, dir_okay=False), help="YAML of task: tolerance overrides.")
@click.option(
    "--selection",
    type=click.Choice(SELECTION),
    default=SELECTION[0],
    show_default=True,
    help="Compare what each policy kept with the baseline's selection fingerprints; off for a deliberate comparison "
    "across machines or library versions (said in the result line).",
)
@threshold_option(
    "--min-overlap",
    MIN_OVERLAP,
    "A cell fails when the share of kept entries in common with the baseline falls below this (docs/ci-gate.md).",
)
@click.option(
    "--exact", is_flag=True, help="Fail on any changed prediction or kept set: the run must reproduce the baseline."
)
@click.option("--update", is_flag=True, help="Write the run's cells (and samples) as the new baseline instead.")
def check(baseline, results, tolerance, per_cell, selection, min_overlap, exact, update) -> None:
    """Fail (exit 1) if accuracy at any budget fell for real, or a policy kept other entries: a CI gate.

    Every cell of the baseline must be in the run with the same sample count. A cell fails when its score fell by
    more than the tolerance and below the baseline's 95% interval, or when a paired test on the same samples (per
    cell, and per policy over all its cells; Holm-adjusted) says it fell; or when a layer keeps another number of
    entries than in the baseline, or the kept entries in common fall below --min-overlap. Improvements and new
    cells pass.
    """
    from pkvbench.reports.check import (
        SelectionRule,
        check_run,
        format_failures,
        prediction_lines,
        samples_path,
        write_baseline,
    )

    folders = [Path(folder).resolve() for folder in results]
    twice = next((given for given, folder in zip(results, folders) if folders.count(folder) > 1), None)
    if twice is not None:
        raise PkvError(f"--results {twice} is given twice; give each run folder once")
    if update:
        cells = write_baseline(list(results), baseline)
        click.echo(
            f"baseline {baseline} written: {len(cells)} cells from {', '.join(results)} "
            f"(per-sample scores, predictions and selection fingerprints in {samples_path(baseline)})"
        )
        return
    rule = SelectionRule(selection == "on", min_overlap, exact)
    result = check_run(list(results), baseline, tolerance, per_cell, rule)
    if result.passed:
        click.echo(f"check passed: {result.describe()}")
        for line in prediction_lines(result):
            click.echo(line)
        return
    click.echo(f"check FAILED: {len(result.failures)} failing; {result.describe()}", err=True)
    click.echo(format_failures(result), err=True)
    raise SystemExit(1)


@cli.command(name="list")
@config_option(options_of(SampleConfig)["include_paths"])
def list_(include_paths) -> None:
    """Tasks, policies (with their options), model aliases and supported architectures."""
    from pkvbench.metrics.registry import METRICS
    from pkvbench.policies.registry import registry
    from pkvbench.tasks.registry import GENERATORS, catalog

    tasks = catalog(tuple(include_paths))
    click.echo("Tasks:")
    for spec in tasks.tasks.values():
        click.echo(f"  {spec.name:22} {spec.description}")
    click.echo("Task groups (--task GROUP):")
    for group, members in tasks.groups.items():
        click.echo(f"  {group:14} {', '.join(members)}")
    # What a task file of one's own can name; other packages add to them through entry points (CONTRIBUTING.md).
    for what, key, names in (("Task generators", "generator", GENERATORS), ("Metrics", "metric", METRICS)):
        click.echo(f"{what} (a task file's `{key}:`; more from other packages' `{names.group}` entry points):")
        click.echo(f"  {', '.join(names)}")
    click.echo(
        "Policies (options with defaults; the attention weights each needs, which kernels such as FlashAttention"
    )
    click.echo("and paged engines do not give: none, a window's, all, a repeat pass's):")
    for name, cls in registry().items():
        options = [f for f in dataclasses.fields(cls) if f.name != "inner"]
        defaults = " ".join(f"{f.name}={f.default}" for f in options)
        attention = "as its policy" if getattr(cls, "wraps", False) else cls().needs.attention_weights
        # a rule that reads the cached keys or values themselves has none per head in an MLA latent cache
        latent = "" if getattr(cls, "wraps", False) or not cls().reads_entries else "; MLA: refused"
        if getattr(cls, "wraps", False):
            name = f"{name}(policy)"
        click.echo(
            f"  {name:14} {cls.summary}"
            + f"\n  {'':14} [{defaults + '; ' if defaults else ''}attention: {attention}{latent}]"
        )
    click.echo("Models:")
    for name, alias in ALIASES.items():
        click.echo(f"  {name:14} {alias.description} (from {alias.distribution}=={alias.version})")
    click.echo("  or any Hugging Face id / local folder / .gguf file of a family below (docs/models.md)")
    click.echo(
        "Model families (config model_type: what is special; its layer kinds; how pkvbench handles it, "
        "or why it refuses it):"
    )
    for name, family in FAMILIES.items():
        click.echo(f"  {name:14} {family.special}\n  {'':14} layers: {family.layers}")
        click.echo(f"  {'':14} {family.handled or 'refused: ' + family.refused}")
    click.echo(
        "Placed over devices (--device-map, docs/big-models.md): the families above that are not refused, by "
        "accelerate\n  (GPUs, the CPU, the disk; each layer's cache where the layer runs); tested placed: llama, "
        "gpt_oss, phi3, qwen2,\n  gemma2, gemma3_text, cohere; tensor parallelism (tp_plan): not yet"
    )


@cli.command()
@config_options(FunnelConfig)
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
    from pkvbench.api import measure_funnel
    from pkvbench.run import funnel as measure

    result = measure_funnel(FunnelConfig(**options))
    if not options["quiet"]:
        click.echo("\n\n".join(result.verdicts))
    click.echo(
        f"{result.written} samples measured, {result.skipped} already done, {result.seconds:.1f} s → "
        f"{result.out}/{measure.TABLE}, {measure.HEAD_TABLE}, {measure.FIGURE}, {measure.VERDICT}"
    )


# --- lm-eval: lm-evaluation-harness tasks under compression (pkvbench/lm_eval, docs/lm-eval.md) ------------------
# What ``pkvbench lm-eval`` says otherwise of the options it shares with ``run`` (Click's settings of each, by field):
# its default policy (pkvbench/lm_eval's POLICY), an --out it needs (there is no default folder), a --quiet that hides
# the summary table only (lm-eval draws its own progress bars), a --limit that counts lm-eval's documents.
LM_EVAL_DIFFERENCES = {
    "policies": {"default": LM_EVAL_POLICY, "show_default": True},
    "out": {"required": True, "help": "Folder for the results."},
    "quiet": {"help": "No summary table."},
    "limit": {"help": "At most this many documents per task."},
}
_RUN_OPTIONS = options_of(RunConfig)
# Where ``lm-eval --help`` lists the run options it takes as model args — every RunConfig field marked MODEL_ARG
# (options.py; tests/test_options.py holds the two together) — the grid's axes before --question-split, the rest after.
LM_EVAL_AXES = (
    *("model", "policies", "policy_args", "budgets", "memory", "kv_bits", "kv_group", "kv_residual"),
    *("decode_budgets", "decode_interval", "decode_buffer", "query_modes"),
)
LM_EVAL_HOW = (
    *("protocol", "decode_batch", "device", "dtype", "attn_implementation"),
    *("device_map", "max_memory", "offload_folder"),
)


def run_option(name: str):
    """``run``'s option of the field ``name``, as ``lm-eval`` takes it."""
    return config_option(_RUN_OPTIONS[name], **LM_EVAL_DIFFERENCES.get(name, {}))


@cli.command(name="lm-eval")
@click.option("--tasks", required=True, help="lm-eval task names (comma list), as `lm_eval --tasks` takes them.")
@_options(*map(run_option, LM_EVAL_AXES))
@click.option(
    "--question-split",
    help="Needed with --query-mode agnostic: the question starts where this text last occurs in the context.",
)
@_options(*map(run_option, LM_EVAL_HOW), run_option("limit"))
@click.option("--num-fewshot", type=Number(whole(0)), help="Few-shot examples (default: each task's own).")
@click.option(
    "--include-path",
    "include_paths",
    multiple=True,
    type=PathType(exists=True, file_okay=False),
    help="A folder of your own lm-eval task YAML files (repeatable).",
)
@click.option("--bootstrap-iters", type=Number(whole(0)), default=BOOTSTRAP_ITERS, show_default=True)
@_options(run_option("out"), run_option("overwrite"), run_option("quiet"))
def lm_eval_command(tasks, include_paths, limit, num_fewshot, bootstrap_iters, out, overwrite, quiet, **grid) -> None:
    """lm-evaluation-harness tasks under KV-cache compression: every configuration from one prefill per request.

    Writes lm-eval's results and per-sample logs per configuration (OUT/lm_eval/<configuration>/) and pkvbench's
    samples.jsonl and summary.csv (read by report, diff, check). Needs pip install 'pkvbench[lm-eval]'.

    \b
    Example:
      pkvbench lm-eval --tasks arc_easy --policy full,snapkv --budget 64,128 --limit 20 --out results/lm-eval/arc
    """
    from pkvbench.config import as_list
    from pkvbench.lm_eval.grid import model_arg_name
    from pkvbench.lm_eval.run import LM_EVAL_FOLDER, evaluate_grid

    # model args as lm-eval's backend names them (--question-split is the backend's own question_split)
    model_args = {
        model_arg_name(_RUN_OPTIONS[name]) if name in _RUN_OPTIONS else name: value
        for name, value in grid.items()
        if value not in (None, ())
    }
    run = evaluate_grid(
        as_list(tasks, "--tasks"),
        model_args,
        out,
        limit=limit,
        include_paths=include_paths,
        num_fewshot=num_fewshot,
        bootstrap_iters=bootstrap_iters,
        overwrite=overwrite,
    )
    for note in run.notes:
        click.echo(f"note: {note}", err=True)
    if not quiet:
        click.echo(run.summary.to_string(index=False) if len(run.summary) else "(no rows)")
    took = ", ".join(f"{label} {seconds:.1f} s" for label, seconds in run.seconds.items())
    resumed = f", {len(run.resumed)} already done" if run.resumed else ""
    click.echo(
        f"{len(run.seconds)} configurations ({took}){resumed}, {run.rows} rows → {run.out}/samples.jsonl, "
        f"{run.out}/{LM_EVAL_FOLDER}/<configuration>/"
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


MESSAGE_LIMIT = 2000  # characters of an error line: a message that echoes a value is cut, never megabytes


def main(argv: list[str] | None = None) -> None:
    _quiet_libraries()
    try:
        code = cli.main(args=argv, prog_name="pkvbench", standalone_mode=False)
    except PkvError as exc:
        from pkvbench.config import excerpt

        click.echo(f"pkvbench: error: {excerpt(str(exc), MESSAGE_LIMIT)}", err=True)  # one line, whatever it echoes
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
