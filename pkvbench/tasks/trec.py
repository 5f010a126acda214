"""TREC few-shot classification rebuilt the way LongBench builds its ``trec`` task, at any prompt length.

From the TREC question-classification files (Li & Roth 2002: ``train_5500.label``, ``TREC_10.label``; one
``COARSE:fine question`` per line, Latin-1): the context is random training questions with their class names,
``Question: …\\nType: <class name>\\n`` each, as many as fit the requested prompt length; the input is one test question
``Question: …\\nType:``; the answer is its class name; ``all_classes`` (for the metric) the 50 LongBench class names.
The prompt is LongBench's trec template, without a chat template; the metric is LongBench's classification score on
the first line of the prediction.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path

from pkvbench.errors import PkvError
from pkvbench.io import os_error
from pkvbench.tasks.base import Generator, Sample, TaskOptions, TaskSpec, context_length, format_at_context
from pkvbench.tasks.files import file_sha256
from pkvbench.tasks.ruler import NUMBERED_IDS, fit_drawn


@cache
def read_trec(path: str) -> tuple[tuple[str, str], ...]:
    """(fine label, question) pairs of a TREC ``.label`` file."""
    try:
        text = Path(path).read_text(encoding="latin-1")  # every byte is a Latin-1 character: no decoding error
    except OSError as exc:
        raise os_error(path, exc, "read") from None
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        label, _, question = line.strip().partition(" ")
        if ":" not in label or not question:
            raise PkvError(f"{path}:{number}: not a TREC line (COARSE:fine question): {line[:60]!r}")
        pairs.append((label, question.strip()))
    return tuple(pairs)


def load_trec(spec: TaskSpec, options: TaskOptions) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    config = spec.config
    if not options.data_dir:
        raise PkvError(
            f"{spec.name} needs --data-dir: a folder with the TREC files {config['train_file']} and {config['test_file']}"
        )
    folder = Path(options.data_dir)
    files = []
    for name in (config["train_file"], config["test_file"]):
        path = folder / name
        if not path.is_file():
            raise PkvError(
                f"{spec.name}: {path} not found (--data-dir must hold {config['train_file']} and {config['test_file']})"
            )
        expected = (config.get("sha256") or {}).get(name)
        if options.verify and expected and file_sha256(path) != expected:
            raise PkvError(
                f"{spec.name}: {path} is not the known TREC file (sha256 differs); --no-verify to use it anyway"
            )
        files.append(read_trec(str(path)))
    classes = config["classes"]
    for label, question in files[0] + files[1]:
        if label not in classes:
            raise PkvError(f"{spec.name}: label {label!r} of {question[:40]!r} has no LongBench class name")
    return files[0], files[1]


def trec_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    train, test = load_trec(spec, options)
    classes: dict[str, str] = config["classes"]
    all_classes = list(classes.values())
    template, example, query = config["prompt"], config["example"], config["input"]
    lengths = options.lengths or tuple(config["defaults"]["lengths"])
    count = min(options.limit or int(config["defaults"]["samples"]), len(test))
    # The test questions, in an order drawn once per seed: sample i asks the same question at every length.
    order = random.Random(f"{options.seed}/{spec.name}/test").sample(range(len(test)), len(test))

    samples = []
    for length in lengths:
        for index in range(len(test)):
            sample_id = f"len{length}_{index}"
            if options.sample_ids is not None and sample_id not in options.sample_ids:
                continue
            if options.sample_ids is None and index >= count:
                break
            label, question = test[order[index]]

            def build(attempt: int, n: int) -> tuple[list[int], tuple[str, int]]:
                shots = random.Random(f"{options.seed}/{spec.name}/{length}/{index}/{attempt}").sample(
                    train, len(train)
                )
                context = "".join(example.format(question=q, type=classes[lab]) for lab, q in shots[:n])
                text, context_end = format_at_context(template, context=context, input=query.format(question=question))
                return list(tokenizer(text)["input_ids"]), (text, context_end)

            ids, (text, context_end) = fit_drawn(
                build, length, 0, len(train), f"{spec.name} ({len(train)} training questions)"
            )
            context_len = context_length(tokenizer, ids, None, text, context_end)
            samples.append(
                Sample.one_question(
                    sample_id, ids, context_len, [classes[label]], {"length": length}, {"all_classes": all_classes}
                )
            )
    return samples


TREC_FEWSHOT_GENERATOR = Generator(
    trec_samples,
    ("train_file", "test_file", "prompt", "example", "input", "classes", "defaults"),
    ("lengths", "data_dir"),
    NUMBERED_IDS,
    optional=("sha256",),
    template="prompt",
    fields=frozenset({"context", "input"}),
)
