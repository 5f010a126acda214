"""Long-output tasks: answers of hundreds of tokens whose every line depends on tokens far back in the prompt (and
on the answer's own previous line), for measuring compression while the answer is written (``--decode-budget``).

- ``list_recall``: the prompt holds a numbered list of ``items`` distinct words; the answer is the whole list again,
  in order, one numbered word per line. Each line's word can only be copied from the list in the prompt.
- ``passage_copy``: the prompt holds a passage of the needle task's essays (from a paragraph start, whole sentences
  until the answer holds ``answer_tokens`` tokens), one sentence a line; the assistant's turn starts with its first
  sentence and the answer repeats the rest word for word. Each word can only be copied from the prompt, the answer's
  own last words saying where.
- ``chain_trace``: the prompt holds ``steps`` facts "After X comes Y." over distinct words, in a random order; the
  assistant's turn starts with the chain's first fact and the answer walks on, one fact per line in the facts' own
  words. Each line starts with the previous line's last word (the answer's own tokens) and ends with a word found only
  by looking that fact up.

The lists are scored by ``line_sequence`` (metrics/functions.py): the longest common subsequence of the answer's lines and the
prediction's, over the answer's lines, so a skipped or repeated line costs one line, not the rest of the list; the
passage by ``word_sequence``, the same over words. The words are wonderwords' nouns, passages' starts drawn per sample
from a generator seeded by ``--seed`` and the sample's number.
"""

from __future__ import annotations

import itertools
import random
import re

from pkvbench.tasks.base import Generator, Sample, TaskOptions, TaskSpec, split_chat_prompt
from pkvbench.tasks.ruler import _wonderwords


def _words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct lower-case one-word nouns."""
    vocabulary = [w for w in _wonderwords("noun") if w.isalpha() and w.islower() and 3 <= len(w) <= 9]
    return rng.sample(vocabulary, count)


def _sample(tokenizer, spec: TaskSpec, sample_id: str, context: str, answer: str, prefix: str = "", **fields) -> Sample:
    """A one-turn chat prompt (the task's ``prompt`` with the context and ``fields``) and its one answer; ``prefix``
    starts the assistant's turn (RULER's answer prefix: the model goes on from it)."""
    config = spec.config
    template = config["prompt"]
    head = template[: template.index("{context}")].format(**fields)
    user = head + context + template[template.index("{context}") + len("{context}") :].format(**fields)
    ids, context_len = split_chat_prompt(tokenizer, config.get("system"), user, len(head) + len(context))
    ids += tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    return Sample.one_question(sample_id, ids, context_len, [answer], extras={"answer_lines": answer.count("\n") + 1})


def _continued(tokenizer, spec: TaskSpec, sample_id: str, context: list[str], answer: list[str], **fields) -> Sample:
    """A prompt of ``context`` lines whose answer is ``answer``'s lines, the first of which starts the assistant's turn
    (asked only to repeat, the model paraphrases; given the first line it goes on as it reads): the rest is scored."""
    return _sample(
        tokenizer, spec, sample_id, "\n".join(context), "\n".join(answer[1:]), prefix=answer[0] + "\n", **fields
    )


def _count(spec: TaskSpec, options: TaskOptions) -> int:
    samples = int(spec.config["defaults"]["samples"])
    return min(samples, options.limit) if options.limit else samples


def list_recall_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    items = int(spec.config["items"])
    samples = []
    for number in range(_count(spec, options)):
        rng = random.Random(f"{options.seed}/{spec.name}/{number}")
        lines = [f"{i + 1}. {word}" for i, word in enumerate(_words(rng, items))]
        listing = "\n".join(lines)
        samples.append(_sample(tokenizer, spec, f"n{number}", listing, listing, items=items))
    return _selected(samples, options)


def chain_trace_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    steps = int(spec.config["steps"])
    samples = []
    for number in range(_count(spec, options)):
        rng = random.Random(f"{options.seed}/{spec.name}/{number}")
        chain = _words(rng, steps + 1)
        facts = [f"After {a} comes {b}." for a, b in itertools.pairwise(chain)]
        shuffled = facts[:]
        rng.shuffle(shuffled)
        # the first fact starts the assistant's turn (how a line reads)
        samples.append(_continued(tokenizer, spec, f"n{number}", shuffled, facts, start=chain[0], steps=steps))
    return _selected(samples, options)


def passage_copy_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    from pkvbench.tasks.needle import haystack_text

    config = spec.config
    text = haystack_text(config["haystack"]["distribution"], config["haystack"]["folder"])
    paragraphs = [i + 2 for i in range(len(text) - 2) if text[i : i + 2] == "\n\n" and text[i + 2 : i + 3].isupper()]
    samples = []
    for number in range(_count(spec, options)):
        rng = random.Random(f"{options.seed}/{spec.name}/{number}")
        start = rng.choice(paragraphs[:-20])
        # one sentence a line (the essays' paragraphs are glued: "startup.If"), whole sentences until the answer (all
        # but the first, which starts the assistant's turn) holds answer_tokens
        text_ahead = " ".join(text[start : start + 8 * config["answer_tokens"]].split())
        sentences = []
        for sentence in re.split(r"(?<=[.!?])\s*(?=[A-Z\"\[])", text_ahead)[:-1]:
            sentences.append(sentence)
            answer_ids = tokenizer("\n".join(sentences[1:]), add_special_tokens=False)["input_ids"]
            if len(answer_ids) >= config["answer_tokens"]:
                break
        samples.append(_continued(tokenizer, spec, f"n{number}", sentences, sentences))
    return _selected(samples, options)


def _selected(samples: list[Sample], options: TaskOptions) -> list[Sample]:
    if options.sample_ids is None:
        return samples
    wanted = set(options.sample_ids)
    return [s for s in samples if s.sample_id in wanted]


def _long_output_generator(build, keys: tuple[str, ...], fields: set[str]) -> Generator:
    """A long-output task's generator: its own ``keys`` besides the prompt and its defaults, and the ``fields`` its
    prompt may name; an optional system prompt, sample ids ``n<number>``, nothing shaped by the sample options."""
    return Generator(
        build,
        (*keys, "prompt", "defaults"),
        (),
        "n<number>",
        optional=("system",),
        template="prompt",
        fields=frozenset(fields),
    )


LIST_RECALL_GENERATOR = _long_output_generator(list_recall_samples, ("items",), {"context", "items"})
CHAIN_TRACE_GENERATOR = _long_output_generator(chain_trace_samples, ("steps",), {"context", "start", "steps"})
PASSAGE_COPY_GENERATOR = _long_output_generator(passage_copy_samples, ("haystack", "answer_tokens"), {"context"})
