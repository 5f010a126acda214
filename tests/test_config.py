"""`pkvbench run --config FILE`: the file sets defaults, flags win, unknown keys are named. No model is loaded: the
checks fail (or are captured) before the load."""

from pathlib import Path
from unittest import mock

import pytest

from pkvbench.api import RunConfig, resolve
from pkvbench.config import options_of, read_run_config
from pkvbench.errors import PkvError

CONFIGS = Path(__file__).parents[1] / "configs"


def load_run_config(path):
    return read_run_config(path, options_of(RunConfig))


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_keys_lists_and_mappings(tmp_path):
    path = write(
        tmp_path,
        """
tasks: [needle]
policy: [full, "snapkv:window=32"]
budgets: [64, 0.05]
max-length: 7950
max_new_tokens: 16
policy-arg: {window: 8}
depths: [0, 50, 100]
quiet: true
limit:
""",
    )
    assert load_run_config(path) == {
        "tasks": ["needle"],
        "policies": ["full", "snapkv:window=32"],
        "budgets": [64, 0.05],
        "max_length": 7950,
        "max_new_tokens": 16,
        "policy_args": {"window": 8},
        "depths": [0, 50, 100],
        "quiet": True,
    }
    config = RunConfig.from_file(path, out="elsewhere")
    assert config.out == "elsewhere" and config.budgets == [64, 0.05]
    run = resolve(config)
    assert [p.label for p in run.policies] == ["full", "snapkv:window=32"]
    assert [str(b) for b in run.budgets] == ["64", "0.05"] and run.options.depths == (0.0, 50.0, 100.0)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("budget: 128\nbudgte: 64\n", "unknown key 'budgte'; valid keys: "),
        ("config: other.yaml\n", "unknown key 'config'"),
        ("quiet: yes please\n", "config key 'quiet': expected true or false"),
        ("task: needle\ntasks: needle\n", "keys 'task' and 'tasks' set the same option"),
        ("budget: 64\nbudget: 128\n", "the key 'budget' is given twice"),
        ("model: [a, b]\n", "expected a single value, got a list"),
        ("- task\n", "expected a mapping"),
        ("budget: [128\n", "not valid YAML"),
        ("budget: []\n", "the list is empty"),
    ],
)
def test_bad_configs_are_named(tmp_path, text, expected):
    with pytest.raises(PkvError, match=expected.replace("[", r"\[")):
        load_run_config(write(tmp_path, text))


def test_negated_flag(tmp_path):
    assert load_run_config(write(tmp_path, "no-verify: true\n")) == {"verify": False}


class Captured(Exception):
    pass


def invoke_run(args):
    """Run `pkvbench run` up to the point where it would start working, and return the run it resolved (once)."""
    from pkvbench import api, cli

    seen = []

    def capture(run, **_):
        seen.append(run)
        raise Captured

    with mock.patch.object(api, "evaluate", capture), pytest.raises(Captured):
        cli.cli.main(args=["run", *args], prog_name="pkvbench", standalone_mode=False)
    return seen[0]


def invoke(args) -> RunConfig:
    """The ``RunConfig`` `pkvbench run` built from ``args`` (checked: lists as lists)."""
    return invoke_run(args).config


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, "task: needle\nbudget: [64, 128]\nlengths: [1000]\nquiet: true\nmodel: smollm2-135m\n")
    from_file = invoke(["--config", str(path)])
    # the file's values as YAML reads them: no round trip through the command line's strings
    assert from_file.budgets == [64, 128] and from_file.lengths == (1000,) and from_file.quiet is True
    overridden = invoke(["--budget", "32", "--config", str(path), "--lengths", "2000"])
    assert overridden.budgets == "32" and overridden.lengths == (2000,)  # parsed, as every option the resolver reads
    assert overridden.quiet is True and overridden.tasks == "needle"
    assert invoke([]).budgets is None  # no config: the command's own default (128 entries, as api.resolve reads it)
    default = invoke_run([])  # no --policy: RunConfig's None, which is the registry's default grid
    assert default.config.policies is None
    assert [p.label for p in default.policies] == ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]


def test_a_file_s_task_settings_reach_the_run_as_written(tmp_path):
    """Mappings and lists stay what YAML read: task settings are not rendered into ``name=value`` strings and parsed
    again."""
    path = write(
        tmp_path, r'task_args: {stop_strings: ["\n", "a,b"], chat_template: false}' + "\npolicy_args: {window: 8}\n"
    )
    config = invoke(["--config", str(path)])
    assert config.task_args == {"stop_strings": ["\n", "a,b"], "chat_template": False}
    assert config.policy_args == {"window": 8}
    overridden = invoke(["--config", str(path), "--task-arg", "chat_template=true"])
    assert list(overridden.task_args) == ["chat_template=true"]


def test_unknown_key_through_the_cli_is_one_line(tmp_path, capsys):
    from pkvbench.cli import main

    path = write(tmp_path, "polciy: snapkv\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--config", str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert "unknown key 'polciy'" in err[0]
    assert not (tmp_path / "o").exists()


def test_missing_config_file(tmp_path, capsys):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "no such file" in err[0].lower()


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_load(name):
    run = resolve(RunConfig.from_file(CONFIGS / name))
    assert run.tasks and run.policies and run.budgets and run.config.out


def test_paper_table1_is_the_papers_setting():
    loaded = load_run_config(CONFIGS / "paper-table1.yaml")
    assert loaded["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert loaded["tasks"] == "longbench"
    assert loaded["budgets"] == [128, 2048]
    assert loaded["max_length"] == 7950
    assert [p.split(":")[0] for p in loaded["policies"]] == ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]
    assert loaded["policy_args"] == {"window": 8}
    assert loaded["protocol"] == "reference" and loaded["dtype"] == "float16"
    assert loaded["task_args"] == {"chat_template": False, "min_new_tokens": 1, "stop_strings": []}
    run = resolve(RunConfig.from_file(CONFIGS / "paper-table1.yaml"))
    samsum = next(t for t in run.tasks if t.name == "samsum")
    assert not samsum.chat_template and samsum.min_new_tokens == 1 and samsum.stop_strings == ()
    labels = [p.label for p in run.policies]
    assert labels[-1] == "pyramidkv:ties=topk:gqa=query:budgets=reference" and "h2o" in labels[2]


def test_paper_needle_is_the_needle_scripts_setting():
    run = resolve(RunConfig.from_file(CONFIGS / "paper-needle.yaml"))
    assert [t.name for t in run.tasks] == ["needle-reference"] and len(run.options.lengths) == 71
    windows = {p.name: getattr(p, "window", None) or getattr(p, "recent", None) for p in run.policies}
    assert windows == {"full": None, "streamingllm": 32, "h2o": 32, "snapkv": 32, "pyramidkv": 8}
    assert all(getattr(p, "gqa", "query") == "query" for p in run.policies if p.name != "full")


def test_smoke_config_parses_as_a_real_run(tmp_path):
    """Every value of the smoke config passes the run command's own checks (policies, budgets, lists)."""
    run = invoke_run(["--config", str(CONFIGS / "smoke.yaml")])
    assert run.config.model == "smollm2-135m"
    assert run.config.tasks == ["needle", "niah_single_1", "niah_single_2", "niah_multivalue"]
    assert [str(b) for b in run.budgets] == ["64", "0.12", "0.25"]
    assert [p.label for p in run.policies][-2:] == ["tova", "adakv(snapkv)"]
    assert len(run.options.lengths) * len(run.options.depths) == run.options.limit == 5


def test_leaderboard_runs_each_policy_as_kvpress_s_press():
    """The leaderboard config passes the run command's checks, and its policies are kvpress's presses (the names
    ``pkvbench export --format kvpress`` gives them)."""
    from pkvbench.reports.export import kvpress_name

    run = invoke_run(["--config", str(CONFIGS / "leaderboard.yaml")])
    assert run.config.protocol == "kvpress"
    assert [kvpress_name(p.label) for p in run.policies] == [
        "no_press",
        "random",
        "knorm",
        "streaming_llm",
        "tova",
        "keydiff",
        "snapkv",
        "pyramidkv",
        "expected_attention",
        "adakv_snapkv",
        "chunkkv",
        "kvzip",
    ]
