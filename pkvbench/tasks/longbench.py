"""LongBench (v1, 21 datasets) and LongBench-E (13 ``<name>_e`` variants): data, prompts, truncation.

Data: ``--data-dir DIR`` reads ``DIR/<name>.jsonl`` (the layout of the official ``data.zip``), checked against the
official sha256 list carried in each task's YAML; without it, the Hugging Face hub through ``datasets``.

Prompts follow the official ``pred.py``: the task's template is formatted with the row; the result is tokenized
(with the tokenizer's special tokens, as ``tokenizer(prompt)`` does); if it is longer than the max length, the first
and last ``int(max_length / 2)`` tokens are kept, each half decoded without special tokens, and the two texts
concatenated; then the chat template is applied (one user turn), except for the tasks whose YAML says
``chat_template: false`` (trec, triviaqa, samsum, lsht, lcc, repobench-p), which are tokenized as they are.
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
    chat_messages,
    chat_prompt_ids,
    context_length,
    with_unique_ids,
)
from pkvbench.tasks.files import file_sha256

HUB_REPOS = ("zai-org/LongBench", "THUDM/LongBench")  # the second is the old name of the first
DATA_HINT = (
    "download data.zip from https://huggingface.co/datasets/zai-org/LongBench (file data.zip), unzip it and pass "
    "--data-dir with the folder that holds the <name>.jsonl files"
)
REQUIRED_FIELDS = ("input", "context", "answers", "_id")


def is_string_list(value: Any) -> bool:
    """A list of strings, or nothing (null): LongBench's ``all_classes`` and ``answers``."""
    return value is None or (isinstance(value, list) and all(isinstance(item, str) for item in value))


def _note(message: str) -> None:
    print(f"pkvbench: note: {message}", file=sys.stderr)


# --- data -----------------------------------------------------------------------------------------------------


def verify_file(path: Path, expected: str | None) -> None:
    """Raise if ``path``'s sha256 is not the official one; note it when no official value is known."""
    if not expected:
        _note(
            f"{path.name} has no official checksum (the official list covers the 21 LongBench v1 files); not verified"
        )
        return
    actual = file_sha256(path)
    if actual != expected:
        raise PkvError(
            f"{path}: sha256 {actual} is not the official {expected}; the file is damaged or not LongBench's "
            f"(re-download data.zip, or pass --no-verify to use it anyway)"
        )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a LongBench jsonl file; a malformed line is an error naming the file and line."""
    return read_json_lines(path, "LongBench file", check=with_unique_ids(check_row, _row_id))


def _row_id(row: dict[str, Any], number: int) -> str:
    return str(row["_id"])


def check_row(row: Any, where: str) -> None:
    if not isinstance(row, dict):
        raise PkvError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [name for name in REQUIRED_FIELDS if name not in row]
    if missing:
        raise PkvError(
            f"{where}: missing field(s) {', '.join(missing)} (LongBench rows have {', '.join(REQUIRED_FIELDS)}, length, all_classes)"
        )
    if not isinstance(row["answers"], list):
        raise PkvError(f"{where}: 'answers' must be a list of strings")
    if not is_string_list(row.get("all_classes")):
        raise PkvError(f"{where}: 'all_classes' must be a list of strings (or null)")


def local_rows(spec: TaskSpec, data_dir: str, verify: bool) -> list[dict[str, Any]]:
    folder = Path(data_dir)
    path = folder / f"{spec.config['dataset']}.jsonl"
    if not path.is_file():
        where = "does not exist" if not folder.is_dir() else "has no such file"
        raise PkvError(f"{path} not found: {folder} {where}; {DATA_HINT}")
    if verify:
        verify_file(path, spec.config.get("sha256"))
    return read_jsonl(path)


def hub_rows(spec: TaskSpec) -> list[dict[str, Any]]:
    """The test split of one dataset from the hub (cached as ``datasets`` caches), as plain dicts."""
    name = spec.config["dataset"]
    try:
        import datasets
    except ImportError:
        raise PkvError(
            f"loading {name} from the Hugging Face hub needs the package datasets (pip install datasets); or {DATA_HINT}"
        ) from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    reasons = []
    for repo in HUB_REPOS:
        # The per-dataset parquet configs first; then the hub's own parquet conversion of the old script dataset.
        attempts = (
            lambda: datasets.load_dataset(repo, name, split="test"),
            lambda: datasets.load_dataset(
                "parquet",
                data_files=f"hf://datasets/{repo}@refs%2Fconvert%2Fparquet/{name}/test/*.parquet",
                split="train",
            ),
        )
        for attempt in attempts:
            try:
                table = attempt()
            except Exception as exc:  # offline, missing, or an unsupported layout: try the next, report them all
                reasons.append(f"{repo}: {first_line(exc)}")
                continue
            rows = [dict(row) for row in table]
            check = with_unique_ids(check_row, _row_id)
            for number, row in enumerate(rows, start=1):
                check(row, f"{repo} {name}, row {number}")
            return rows
    raise PkvError(f"could not load LongBench {name} from the Hugging Face hub ({reasons[0]}); {DATA_HINT}")


def load_rows(spec: TaskSpec, options: TaskOptions) -> list[dict[str, Any]]:
    """The rows to run: by ``--sample-id`` if given, without rows that have no answer (noted), at most ``--limit``."""
    rows = local_rows(spec, options.data_dir, options.verify) if options.data_dir else hub_rows(spec)
    if options.sample_ids is not None:
        wanted = set(options.sample_ids)
        rows = [row for row in rows if str(row["_id"]) in wanted]
        if not rows:
            _note(f"{spec.name}: none of the --sample-id values is in this dataset")
    answered = [row for row in rows if any(isinstance(a, str) and a for a in row["answers"])]
    if len(answered) < len(rows):
        skipped = [str(row["_id"]) for row in rows if row not in answered]
        _note(
            f"{spec.name}: skipped {len(skipped)} sample(s) with no answer: {', '.join(skipped[:5])}{' …' if len(skipped) > 5 else ''}"
        )
    return answered[: options.limit] if options.limit else answered


# --- prompts --------------------------------------------------------------------------------------------------


def format_prompt(spec: TaskSpec, row: dict[str, Any]) -> str:
    """The official template filled with the row's fields (``template.format(**row)``)."""
    return spec.config["prompt"].format(**row)


def truncate_middle(tokenizer, prompt: str, max_length: int) -> tuple[str, int]:
    """``pred.py``'s middle truncation: (the prompt, possibly cut, and its token count before the cut)."""
    ids = list(tokenizer(prompt, truncation=False)["input_ids"])
    if len(ids) <= max_length:
        return prompt, len(ids)
    half = int(max_length / 2)
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail, len(ids)


def prompt_ids(tokenizer, spec: TaskSpec, prompt: str) -> list[int]:
    if spec.chat_template:
        return chat_prompt_ids(tokenizer, None, prompt)
    return list(tokenizer(prompt, truncation=False)["input_ids"])


def question_text(spec: TaskSpec, row: dict[str, Any]) -> str:
    """What the official template puts after the context: the question and the answer instruction, or for the
    datasets without a per-sample question (gov_report, multi_news, vcsum, passage_count, lcc) only the instruction."""
    template = spec.config["prompt"]
    return template[template.index("{context}") + len("{context}") :].format(**row)


def split_ids(tokenizer, spec: TaskSpec, prompt: str, question: str) -> tuple[list[int], int]:
    """The prompt's ids and how many are context. Middle truncation keeps the prompt's end, so the question is
    whole at its end unless it alone is longer than half the max length; then the context ends where the kept
    tail starts (what could be kept of the context), and the rest counts as question."""
    ids = prompt_ids(tokenizer, spec, prompt)
    context_end = len(prompt) - len(question) if prompt.endswith(question) else len(prompt) // 2
    messages = chat_messages(None, [prompt]) if spec.chat_template else None
    return ids, context_length(tokenizer, ids, messages, None if messages else prompt, context_end)


def model_context_window(tokenizer) -> int | None:
    """The model's maximum positions, from the config beside its tokenizer (or the tokenizer's own limit)."""
    path = getattr(tokenizer, "name_or_path", None)
    if path:
        try:
            from transformers import AutoConfig

            window = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
            if window:
                return int(window)
        except Exception:  # no config to be had: fall back on the tokenizer
            pass
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if limit and limit < 10**7 else None  # transformers' "no limit" is a huge sentinel


def default_max_length(tokenizer, spec: TaskSpec, options: TaskOptions) -> int:
    """The context window less the task's answer and what the chat template adds around the prompt."""
    window = options.context_window or model_context_window(tokenizer)
    if not window:
        raise PkvError(f"{spec.name}: cannot tell the model's context window; pass --max-length")
    overhead = len(prompt_ids(tokenizer, spec, ""))
    max_length = window - spec.max_new_tokens - overhead
    if max_length < 2:
        raise PkvError(
            f"{spec.name}: the model's context window ({window}) leaves no room for a prompt; pass --max-length"
        )
    return max_length


def longbench_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    rows = load_rows(spec, options)
    if not rows:
        return []
    max_length = options.max_length or default_max_length(tokenizer, spec, options)
    if max_length < 2:
        raise PkvError("--max-length must be at least 2 (half of it is kept from each end)")
    samples = []
    for row in rows:
        prompt, untruncated = truncate_middle(tokenizer, format_prompt(spec, row), max_length)
        ids, context_len = split_ids(tokenizer, spec, prompt, question_text(spec, row))
        samples.append(
            Sample.one_question(
                str(row["_id"]),
                ids,
                context_len,
                [a for a in row["answers"] if isinstance(a, str)],
                extras={
                    "length": row.get("length"),
                    "untruncated_tokens": untruncated,
                    "truncated": untruncated > max_length,
                    # written for the classification tasks too, so `pkvbench score` can rescore the rows
                    **({"all_classes": list(row.get("all_classes") or [])} if spec.metric == "classification" else {}),
                },
                meta={"all_classes": list(row.get("all_classes") or [])},
            )
        )
    return samples


LONGBENCH_GENERATOR = Generator(
    longbench_samples,
    ("dataset", "prompt"),
    ("max_length", "data_dir"),
    "the _id of a data row",
    optional=("sha256", "language", "question_part"),
    template="prompt",
)
