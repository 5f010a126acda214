"""Each option of `pkvbench run` and `pkvbench funnel` is declared once, as a field of ``RunConfig`` /
``FunnelConfig`` (``pkvbench/options.py``): the command line's options are built from the fields, so neither a flag
nor a default nor a choice is written a second time."""

from dataclasses import fields

import click
import pytest

from pkvbench import cli
from pkvbench.config import LIST, options_of, read_run_config
from pkvbench.options import FunnelConfig, RunConfig, SampleConfig
from pkvbench.runner import RunSettings

# The command's own options, which are no configuration field.
COMMAND_ONLY = {"run": {"config_file", "html_file"}, "funnel": set()}


@pytest.mark.parametrize(("command", "config"), [("run", RunConfig), ("funnel", FunnelConfig)])
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
