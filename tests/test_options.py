"""Each option of `pkvbench run`, `funnel` and `budgets` is declared once, as a field of ``RunConfig`` /
``FunnelConfig`` / ``BudgetsConfig`` (``pkvbench/options.py``): the command line's options are built from the fields,
so neither a flag nor a default nor a choice is written a second time; `lm-eval` takes run's; the other commands read
their defaults and choices from constants."""

import ast
from dataclasses import MISSING, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pkvbench import cli
from pkvbench.cell.models import DEVICES
from pkvbench.cell.schema import PROTOCOLS, QUERY_MODES
from pkvbench.config import LIST, options_of, read_run_config
from pkvbench.options import EXECUTORS, BudgetsConfig, FunnelConfig, RunConfig, SampleConfig
from pkvbench.run.runner import RunSettings

# The command's own options, which are no configuration field.
COMMAND_ONLY = {"run": {"config_file", "html_file"}, "funnel": set(), "budgets": {"as_json", "plot_file"}}


@pytest.mark.parametrize(
    ("command", "config"), [("run", RunConfig), ("funnel", FunnelConfig), ("budgets", BudgetsConfig)]
)
def test_each_field_is_one_option_with_the_field_s_default_and_choices(command, config):
    declared = options_of(config)
    assert list(declared) == [f.name for f in fields(config)], "every field declares its option (config.option)"
    params = [p for p in cli.cli.commands[command].params if isinstance(p, click.Option) and p.name != "help"]
    names = [p.name for p in params]
    assert sorted(names) == sorted([*declared, *COMMAND_ONLY[command]]), "each field exactly one option"
    for param in params:
        if param.name in COMMAND_ONLY[command]:
            continue
        option = declared[param.name]
        assert [*param.opts, *param.secondary_opts] == [option.flag]
        listed = option.kind == LIST and isinstance(option.default, tuple)  # a comma string on the command line
        assert param.default == (",".join(option.default) if listed else option.default), param.name
        assert tuple(getattr(param.type, "choices", ())) == (option.choices or ()), param.name
        if option.implied is not None and option.show_default is None:  # what a None becomes once it is used
            implied = option.implied
            assert param.show_default == (",".join(implied) if isinstance(implied, tuple) else str(implied))
        if option.show_default is not None:
            assert param.show_default == option.show_default


def test_the_api_and_the_runner_take_what_the_fields_declare():
    """A field's check is the API's (the same words as the command line), an option that shapes another fills in
    its declared value, and the runner's settings default to the same values."""
    from pkvbench.api import resolve
    from pkvbench.errors import PkvError

    with pytest.raises(PkvError, match="^--decode-interval 0: must be at least 1$"):
        resolve(RunConfig(decode_budgets="32", decode_interval=0))
    settings = resolve(RunConfig(decode_budgets="32", policies="snapkv")).settings
    run = options_of(RunConfig)
    assert (settings.decode_interval, settings.decode_buffer) == (
        run["decode_interval"].implied,
        run["decode_buffer"].implied,
    )
    assert RunSettings() == RunSettings(**{name: run[name].implied for name in ("kv_group", "kv_residual")})


def test_a_config_file_takes_each_field_s_name_and_flag(tmp_path):
    """Every option's flag (and its field's name) is a key of a run config; ``--no-X`` flags read negated."""
    path = tmp_path / "c.yaml"
    path.write_text("no-verify: true\nsample-id: a\nsample_ids_x: 1\n")
    with pytest.raises(Exception, match="unknown key 'sample_ids_x'; valid keys: .*sample-id, sample-ids,"):
        read_run_config(path, options_of(SampleConfig))
    path.write_text("no-verify: true\nsample-id: a\n")
    assert read_run_config(path, options_of(SampleConfig)) == {"verify": False, "sample_ids": "a"}


def _literal(node: ast.expr) -> bool:
    """A value written out: a number or a text, or a list of them (None and true/false are a flag's or no default)."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return any(_literal(item) for item in node.elts)
    return isinstance(node, ast.Constant) and node.value is not None and not isinstance(node.value, bool)


def test_cli_writes_no_option_default_or_choice_as_a_literal():
    """Every default and choice of a command line option has one home (a configuration field of options.py, or a
    constant of the module that owns what it means): cli.py reads it from there and never writes it a second time."""
    tree = ast.parse(Path(cli.__file__).read_text())
    written = [
        f"cli.py:{node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if (isinstance(node, ast.keyword) and node.arg in ("default", "flag_value") and _literal(node.value))
        or (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("Choice")
            and any(_literal(arg) for arg in node.args)
        )
    ]
    assert not written, "literal defaults or choices in cli.py:\n" + "\n".join(written)


# lm-eval's options that are no run option (--limit and --include-path are, under the same flags: lm-eval's folders hold
# lm-eval's task files, not pkvbench's).
LM_EVAL_OWN = {"tasks", "question_split", "num_fewshot", "include_paths", "bootstrap_iters", "help"}


def test_lm_eval_takes_run_s_options_as_run_declares_them():
    """``pkvbench lm-eval``'s options are its own or ``run``'s, as run declares them but for what
    ``cli.LM_EVAL_DIFFERENCES`` declares otherwise: none is written a second time."""
    run = {p.name: p for p in cli.cli.commands["run"].params}
    params = cli.cli.commands["lm-eval"].params
    from pkvbench.config import MODEL_ARG, options_with

    # every run option the backend takes as a model arg (marked MODEL_ARG), and run's --limit, --out, --overwrite, --quiet
    model_args = {declared.name for declared in options_with(RunConfig, MODEL_ARG)}
    assert {"kv_group", "kv_residual", "decode_interval", "policy_args", "attn_implementation"} <= model_args
    assert {p.name for p in params} - LM_EVAL_OWN == model_args | {"limit", "out", "overwrite", "quiet"}
    for param in params:
        if param.name in LM_EVAL_OWN:
            continue
        ours, theirs = ({**p.to_info_dict(), "show_default": p.show_default} for p in (param, run[param.name]))
        for setting in cli.LM_EVAL_DIFFERENCES.get(param.name, {}):
            ours.pop(setting), theirs.pop(setting)
        assert ours == theirs, param.name
    result = CliRunner().invoke(cli.cli, ["lm-eval", "--tasks", "arc_easy"])  # before lm-eval is imported
    assert result.exit_code == 2 and "Missing option '--out'" in result.output


# --- issue 48, item 2: declared once, below the fields too --------------------------------------------------------


def test_the_tables_below_the_fields_are_the_fields_marked_for_them():
    """What a run records, how its samples are chosen, the runner's settings, how the model loads and lm-eval's model
    args are the fields whose option is marked for them (``Option.roles``), never a list of names written again."""
    import inspect

    from pkvbench.config import MODEL, MODEL_ARG, RECORDED, SETTING, TASK, options_with
    from pkvbench.engine.models import load_model
    from pkvbench.lm_eval.grid import MODEL_ARGS
    from pkvbench.options import model_settings
    from pkvbench.tasks.base import TaskOptions

    def marked(config, role):
        return [declared.name for declared in options_with(config, role)]

    assert [f.name for f in fields(RunSettings)] == marked(RunConfig, SETTING)
    assert {f.name for f in fields(TaskOptions)} - {"context_window"} == set(marked(SampleConfig, TASK))
    assert list(model_settings(RunConfig())) == marked(SampleConfig, MODEL)
    assert [*inspect.signature(load_model).parameters][1:] == marked(SampleConfig, MODEL)[1:]  # the model, then these
    assert {declared.name for declared in MODEL_ARGS.values()} == set(marked(RunConfig, MODEL_ARG))
    assert {"kv_bits", "decode_budget", "policy_arg", "attn_implementation"} <= set(MODEL_ARGS)  # named as the flags
    assert set(marked(FunnelConfig, RECORDED)) == set(marked(SampleConfig, RECORDED)) | {"window", "sink", "top_k"}


@pytest.mark.parametrize(
    ("options", "more"),
    [
        ({}, []),
        ({"kv_bits": "4"}, ["kv_group", "kv_residual"]),
        ({"decode_budgets": "32", "policies": "snapkv"}, ["decode_budgets", "decode_interval", "decode_buffer"]),
    ],
)
def test_a_run_records_the_options_it_always_recorded(options, more):
    """``run.json``'s options keep their keys (a folder of an earlier version resumes as the same run): the options
    that shape another, and decode budgets, only where used."""
    from pkvbench.api import resolve

    recorded = resolve(RunConfig(**options)).recorded_options
    always = {
        *("model", "device", "dtype", "attn_implementation", "tasks", "lengths", "depths", "limit", "seed"),
        *("data_dir", "max_length", "sample_ids", "task_versions", "policies", "budgets", "max_new_tokens", "shard"),
        *("protocol", "query_modes", "kv_bits"),
    }
    assert set(recorded) == always | set(more)
    if "kv_bits" in options:
        assert (recorded["kv_group"], recorded["kv_residual"]) == (32, 128)


def test_each_default_has_one_home():
    """The default budget (128 entries; cr0 with a decode budget) and the default protocol are written once
    (cell/budgets.py, cell/schema.py); the funnel's statistics' defaults are FunnelConfig's alone."""
    from pkvbench import api, cli, options
    from pkvbench.lm_eval import grid
    from pkvbench.run import funnel, runner

    for module in (api, cli, options, grid, runner, funnel):
        tree = ast.parse(Path(module.__file__).read_text())
        literals = [
            f"{module.__name__}:{node.lineno}: {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in ("128", "cr0", "exact")
        ]
        assert not literals, literals
    recorder = {f.name: f.default for f in fields(funnel.FunnelRecorder)}
    assert all(recorder[name] is MISSING for name in ("window", "sink", "top_k"))


@pytest.mark.parametrize(
    ("flag", "field", "value", "choices"),
    [
        ("--protocol", "protocol", "nosuch", PROTOCOLS),
        ("--executor", "executor", "nosuch", EXECUTORS),
        ("--query-mode", "query_modes", "nosuch", QUERY_MODES),
        ("--device", "device", "tpu", DEVICES),
    ],
)
def test_a_choice_is_refused_in_the_same_words_from_the_command_line_and_the_api(
    flag, field, value, choices, capsys, tmp_path
):
    from pkvbench.api import resolve
    from pkvbench.errors import PkvError

    with pytest.raises(PkvError, match=f"^{flag} {value}: valid: {', '.join(choices)}$") as refusal:
        resolve(RunConfig(**{field: value}))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["run", flag, value, "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"pkvbench: error: {refusal.value}\n"


def test_shared_options_are_declared_once():
    """--out and --html are declared once each (a shared option decorator; each command says what goes there), and the
    options that shape report's table are marked as such (refused with --html alone), not listed again."""
    source = Path(cli.__file__).read_text()
    tree = ast.parse(source)
    flags = [
        node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in ("--out", "--html")
    ]
    assert sorted(flags) == ["--html", "--out"]
    report = cli.cli.commands["report"].params
    assert {p.name for p in report if isinstance(p, cli.TableOption)} == {"fmt", "view", "intervals", "power", "drift"}
    result = CliRunner().invoke(cli.cli, ["report", ".", "--html", "page.html", "--no-intervals"])
    assert result.exit_code != 0 and "--intervals shapes the table" in str(result.exception)
