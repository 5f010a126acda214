"""Reasoning sets for real models, whose memory goes into the answer: GSM8K, MATH-500, AIME 2025.

Data: ``--data-dir DIR`` reads ``DIR/<file>`` (JSON lines, the task YAML's ``file``: e.g. ``gsm8k.jsonl``); without
it, the Hugging Face hub through ``datasets`` (the YAML's ``hub``: repository, configs and split). A row needs its
question (the first of the YAML's ``question_fields`` it has) and its answer (``answer_field``); its id is the
``id_field`` if it has one, else its line number. With neither data nor hub access the run stops with one line
saying where to put the file.

Prompt: the YAML's ``prompt`` with ``{question}`` as the one user turn of the model's chat template (DeepSeek-R1's
recommended instruction: reason step by step and put the final answer in ``\\boxed{}``); the problem is the context,
the instruction after it the question (what ``--query-mode agnostic`` adds after compression). The answer is scored by the task's metric
(metrics/functions.py: ``gsm8k_number``, ``math_equivalence``); the reference answer is extracted as the set's own code does
(GSM8K: the number after ``####``; MATH-500 and AIME: the ``answer`` field).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pkvbench.errors import PkvError, first_line
from pkvbench.io import read_json_lines
from pkvbench.tasks.base import (
    Generator,
    Sample,
    TaskOptions,
    TaskSpec,
    split_chat_prompt,
    with_unique_ids,
)


def _hint(spec: TaskSpec) -> str:
    config = spec.config
    fields = f"{' or '.join(config['question_fields'])} and {config['answer_field']}"
    return (
        f"put {config['file']} (JSON lines with {fields}) in a folder and pass --data-dir FOLDER, "
        f"or give the Hugging Face hub ({config['hub']['repo']}) to reach"
    )


def sample_id(config: dict[str, Any], row: dict[str, Any], number: int) -> str:
    """A row's sample id: its ``id_field`` where the YAML names one and the row has it, else its place from 0."""
    field = config.get("id_field")
    return str(row[field]) if field and field in row else str(number)


def check_row(spec: TaskSpec):
    """Refuses a row without a question or an answer, one whose id is not a string or a whole number (a null would
    read as "None"), and one whose id an earlier row had."""
    config = spec.config
    id_field = config.get("id_field")

    def check(row: Any, where: str) -> None:
        if not isinstance(row, dict):
            raise PkvError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if id_field in row and (not isinstance(row[id_field], (str, int)) or isinstance(row[id_field], bool)):
            raise PkvError(f"{where}: the id {id_field!r} must be a string or a whole number, got {row[id_field]!r}")
        if not any(isinstance(row.get(name), str) for name in config["question_fields"]):
            raise PkvError(f"{where}: no question (a string field {' or '.join(config['question_fields'])})")
        if not isinstance(row.get(config["answer_field"]), (str, int, float)) or isinstance(
            row.get(config["answer_field"]), bool
        ):
            raise PkvError(f"{where}: no answer (field {config['answer_field']!r}, a string or a number)")

    return with_unique_ids(check, lambda row, number: sample_id(config, row, number))


def local_rows(spec: TaskSpec, data_dir: str) -> list[dict[str, Any]]:
    path = Path(data_dir) / spec.config["file"]
    if not path.is_file():
        raise PkvError(f"{path} not found; {_hint(spec)}")
    return read_json_lines(path, f"{spec.name} file", check=check_row(spec))


def hub_rows(spec: TaskSpec) -> list[dict[str, Any]]:
    """The split's rows from the hub (each of the YAML's configs in turn), as ``datasets`` caches them."""
    hub = spec.config["hub"]
    try:
        import datasets
    except ImportError:
        raise PkvError(f"{spec.name}: loading from the hub needs the package datasets; or {_hint(spec)}") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rows: list[dict[str, Any]] = []
    check = check_row(spec)
    for config in hub.get("configs") or [None]:
        try:
            table = datasets.load_dataset(hub["repo"], config, split=hub["split"])
        except Exception as exc:  # offline, gated, renamed: one line that says what to do instead
            raise PkvError(
                f"{spec.name}: could not load {hub['repo']} from the Hugging Face hub ({first_line(exc)}); {_hint(spec)}"
            ) from None
        for number, row in enumerate(table, start=1):
            check(dict(row), f"{hub['repo']} {config or ''} row {number}".replace("  ", " "))
            rows.append(dict(row))
    return rows


def reference_answer(spec: TaskSpec, row: dict[str, Any]) -> str:
    """The gold answer as the set's own evaluation reads it: GSM8K's number after ``####``, else the field."""
    answer = str(row[spec.config["answer_field"]])
    if spec.config.get("answer_after"):
        marker = spec.config["answer_after"]
        if marker not in answer:
            raise PkvError(f"{spec.name}: an answer without {marker!r}: {answer[-60:]!r}")
        answer = answer.rsplit(marker, 1)[1]
    return answer.strip()


def reasoning_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    rows = local_rows(spec, options.data_dir) if options.data_dir else hub_rows(spec)
    samples = []
    for number, row in enumerate(rows):
        identity = sample_id(config, row, number)
        if options.sample_ids is not None and identity not in options.sample_ids:
            continue
        question = next(row[name] for name in config["question_fields"] if isinstance(row.get(name), str))
        template = config["prompt"]
        head = template[: template.index("{question}")] + question
        user = head + template[template.index("{question}") + 10 :]
        ids, context_len = split_chat_prompt(tokenizer, config.get("system"), user, len(head))
        extras = {name: row[name] for name in config.get("extra_fields") or () if name in row}
        samples.append(
            Sample.one_question(
                identity,
                ids,
                context_len,
                [reference_answer(spec, row)],
                extras=extras,
            )
        )
        if options.limit and len(samples) >= options.limit:
            break
    if options.sample_ids is not None and not samples:
        print(f"pkvbench: note: {spec.name}: none of the --sample-id values is in this set", file=sys.stderr)
    return samples


REASONING_GENERATOR = Generator(
    reasoning_samples,
    ("file", "hub", "prompt", "question_fields", "answer_field"),
    ("data_dir",),
    "the row's id field, or its line number from 0",
    optional=("system", "answer_after", "id_field", "extra_fields", "defaults"),
    template="prompt",
    context=False,
)
