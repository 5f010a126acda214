"""Each option of `pkvbench run`, `funnel` and `budgets` is declared once, as a field of ``RunConfig`` /
``FunnelConfig`` / ``BudgetsConfig`` (``pkvbench/options.py``): the command line's options are built from the fields,
so neither a flag nor a default nor a choice is written a second time; `lm-eval` takes run's; the other commands read
their defaults and choices from constants."""

import ast
from dataclasses import fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pkvbench import cli
from pkvbench.config import LIST, options_of, read_run_config
from pkvbench.options import BudgetsConfig, FunnelConfig, RunConfig, SampleConfig
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
        if option.implied is not None:  # what a None becomes once the option it shapes is given: said in --help
            assert param.show_default == str(option.implied)
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
    assert {p.name for p in params} - LM_EVAL_OWN == {
        *("model", "policies", "budgets", "memory", "kv_bits", "decode_budgets", "query_modes"),
        *("device", "dtype", "device_map", "max_memory", "offload_folder", "limit", "out", "overwrite", "quiet"),
    }
    for param in params:
        if param.name in LM_EVAL_OWN:
            continue
        ours, theirs = ({**p.to_info_dict(), "show_default": p.show_default} for p in (param, run[param.name]))
        for setting in cli.LM_EVAL_DIFFERENCES.get(param.name, {}):
            ours.pop(setting), theirs.pop(setting)
        assert ours == theirs, param.name
    result = CliRunner().invoke(cli.cli, ["lm-eval", "--tasks", "arc_easy"])  # before lm-eval is imported
    assert result.exit_code == 2 and "Missing option '--out'" in result.output
