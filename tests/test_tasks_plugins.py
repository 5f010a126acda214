"""Task generators and metrics register like policies: built-in ones by name, those of other packages through the
entry point groups ``pkvbench.tasks`` and ``pkvbench.metrics.functions``, each imported when a task names it; a broken plugin
is one line that names it."""

import importlib.metadata
import json
from pathlib import Path

import pytest
from plugin_package import install_plugin, pkvbench_with

from pkvbench import plugins
from pkvbench.errors import PkvError
from pkvbench.metrics.functions import rouge1
from pkvbench.metrics.registry import BUILTIN as BUILTIN_METRICS
from pkvbench.metrics.registry import METRICS
from pkvbench.tasks.needle import NEEDLE_GENERATOR
from pkvbench.tasks.registry import GENERATORS, catalog

PLUGIN = '''
"""A task generator and a metric from outside pkvbench: which word follows another in a short list."""
import string

from pkvbench.tasks.base import Generator, Sample, context_length, format_at_context


def next_word_samples(tokenizer, spec, options):
    """One sample per word of the task's ``words`` but the last: the list, then which word comes after that one."""
    words = spec.config["words"]
    samples = []
    for number, word in enumerate(words[:-1]):
        text, context_end = format_at_context(spec.config["prompt"], context=" ".join(words), word=word)
        ids = tokenizer(text)["input_ids"]
        context_len = context_length(tokenizer, ids, None, text, context_end)
        samples.append(Sample.one_question(f"n{number}", ids, context_len, [words[number + 1]]))
    return samples[: options.limit]


NEXT_WORD = Generator(
    next_word_samples,
    keys=("words", "prompt"),
    shaped_by=(),
    ids="n<number>",
    template="prompt",
    fields=frozenset({"context", "word"}),
)


def first_word(prediction, answers, meta=None):
    """1 if the prediction's first word, lower-cased and without punctuation, is one of the answers."""
    words = prediction.lower().split()
    return float(bool(words) and words[0].strip(string.punctuation) in {a.lower() for a in answers})
'''
# The package also registers two entries that cannot load: a task naming neither is untouched by them.
ENTRY_POINTS = {
    "pkvbench.tasks": {
        "next_word": "pkvbench_wordtasks:NEXT_WORD",
        "broken_next_word": "pkvbench_wordtasks:NO_SUCH_GENERATOR",
    },
    "pkvbench.metrics": {"first_word": "pkvbench_wordtasks:first_word", "not_a_metric": "pkvbench_wordtasks:NEXT_WORD"},
}
TASK = """name: {name}
version: 1
description: which word follows another (a plugin's task)
generator: {generator}
metric: {metric}
max_new_tokens: 3
chat_template: false
words: [apple, river, candle, mountain, violin]
prompt: "Words: {{context}}.\\nThe word after {{word}} is"
"""


def task_folder(path, name="next-word", generator="next_word", metric="first_word"):
    path.mkdir(exist_ok=True)
    (path / f"{name}.yaml").write_text(TASK.format(name=name, generator=generator, metric=metric))
    return path


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    return install_plugin(tmp_path_factory.mktemp("wordtasks"), "pkvbench_wordtasks", PLUGIN, ENTRY_POINTS)


def test_a_plugin_task_is_listed(plugin_site, tmp_path):
    out = pkvbench_with(plugin_site, "list", "--include-path", str(task_folder(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert "next-word" in out.stdout and "which word follows another (a plugin's task)" in out.stdout
    generators, metrics = (
        out.stdout.split(f"{what} (a task file's")[1].splitlines()[1] for what in ("Task generators", "Metrics")
    )
    assert "needle" in generators and "next_word" in generators and "first_word" in metrics  # the plugins' beside ours


@pytest.mark.model
def test_a_plugin_generator_and_metric_run(plugin_site, tmp_path):
    out = pkvbench_with(
        plugin_site,
        "run",
        "--task",
        "next-word",
        "--include-path",
        str(task_folder(tmp_path / "tasks")),
        "--limit",
        "2",
        "--policy",
        "full,streamingllm",
        "--budget",
        "8",
        "--out",
        str(tmp_path / "run"),
        "--quiet",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [(r["task"], r["sample_id"], r["policy"]) for r in rows] == [
        ("next-word", sample, policy) for sample in ("n0", "n1") for policy in ("full", "streamingllm")
    ]
    assert [r["answers"] for r in rows] == [["river"]] * 2 + [["candle"]] * 2
    for row in rows:  # scored by the plugin's metric: its first word against the answer
        words = row["pred"].lower().split()
        expected = bool(words) and words[0].strip(".,;:!?\"'") == row["answers"][0]
        assert row["score"] == float(expected), row["pred"]
    assert rows[1]["kv_kept"] == [8] * 30


@pytest.mark.parametrize(
    "generator,metric,message",
    [
        (
            "broken_next_word",
            "first_word",
            "task generator plugin 'broken_next_word' (pkvbench_wordtasks:NO_SUCH_GENERATOR) failed to load: "
            "AttributeError: module 'pkvbench_wordtasks' has no attribute 'NO_SUCH_GENERATOR'",
        ),
        (
            "next_word",
            "not_a_metric",
            "metric plugin 'not_a_metric' (pkvbench_wordtasks:NEXT_WORD) is not a function",
        ),
    ],
)
def test_a_broken_plugin_is_one_line_that_names_it(plugin_site, tmp_path, generator, metric, message):
    tasks = task_folder(tmp_path, generator=generator, metric=metric)
    out = pkvbench_with(plugin_site, "list", "--include-path", str(tasks))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


# --- the registries themselves, with entry points made up in this process -----------------------------------------


@pytest.fixture
def installed(monkeypatch):
    """Pretend these entry points are installed: ``installed(group, name=target, ...)``; each registry starts
    empty-handed (nothing loaded yet), and all is undone after the test."""
    found: dict[str, tuple] = {}
    monkeypatch.setattr(plugins, "entry_points", lambda group: found.get(group, ()))
    monkeypatch.setattr(GENERATORS, "_loaded", {})
    monkeypatch.setattr(METRICS, "_loaded", {})

    def install(group: str, **targets: str) -> None:
        found[group] = tuple(importlib.metadata.EntryPoint(n, t, group) for n, t in sorted(targets.items()))

    return install


def test_plugins_follow_the_built_ins_and_load_when_asked_for(installed):
    installed("pkvbench.metrics", zz_rouge="pkvbench.metrics.functions:rouge1", broken="no_such_module:metric")
    assert list(METRICS) == [*BUILTIN_METRICS, "broken", "zz_rouge"]
    assert "broken" in METRICS and "bleu" not in METRICS
    assert METRICS["zz_rouge"] is rouge1  # the broken one, never asked for, stops nothing
    with pytest.raises(PkvError, match=r"^metric plugin 'broken' \(no_such_module:metric\) failed to load: "):
        METRICS["broken"]


def test_a_plugin_cannot_take_a_name_already_taken(installed):
    installed("pkvbench.tasks", needle="pkvbench.tasks.needle:NEEDLE_GENERATOR")
    with pytest.raises(PkvError, match="task generator plugin 'needle' .*: a task generator named 'needle' exists"):
        GENERATORS["needle"]
    assert list(GENERATORS).count("needle") == 1


def test_a_task_file_names_a_plugin_generator_and_metric(installed, tmp_path):
    installed("pkvbench.tasks", needle_again="pkvbench.tasks.needle:NEEDLE_GENERATOR")
    installed("pkvbench.metrics", rouge_again="pkvbench.metrics.functions:rouge1")
    (tmp_path / "mine.yaml").write_text(
        Path(catalog().get("needle").source)
        .read_text()
        .replace("name: needle\n", "name: my-needle\n")
        .replace("generator: needle\n", "generator: needle_again\n")
        .replace("metric: rouge1\n", "metric: rouge_again\n")
    )
    spec = catalog((str(tmp_path),)).get("my-needle")
    assert (spec.generator, spec.metric) == ("needle_again", "rouge_again")
    assert GENERATORS[spec.generator] is NEEDLE_GENERATOR and METRICS[spec.metric] is rouge1
