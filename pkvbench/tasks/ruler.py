"""RULER-style synthetic tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", arXiv 2404.06654), generated at any prompt length.

Every task follows RULER's construction (its prompt templates, answer prefixes, needle sentence and task parameters
live in the task's YAML under ``tasks/ruler/``); the code here is written for pkvbench. What differs from RULER:

- The length is the whole prompt in tokens of the model's own tokenizer, chat template and answer prefix included,
  within ±2% of the request (RULER counts prompt + answer tokens against a maximum). Each sample's haystack size is
  found by search; if no size lands within ±2% the sample is drawn afresh (next attempt, still deterministic).
- Randomness: each sample has its own ``random.Random`` seeded from ``seed/task/length/index/attempt``, so a sample
  never depends on which other samples or lengths were asked for.
- Sentences of the essay haystack are split by a regular expression (RULER uses nltk's punkt model, which needs a
  download); keys are adjective-noun pairs drawn as a random adjective and a random noun from wonderwords' lists
  (RULER draws from the sorted set of all pairs: the same distribution up to the rare duplicate pair).
- The prompt goes through the model's chat template as the user turn; the answer prefix starts the assistant turn
  (RULER appends it after the model's template, which is the same thing), with its leading space removed.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import TypeVar

from pkvbench.errors import PkvError
from pkvbench.tasks.base import (
    Generator,
    Sample,
    TaskOptions,
    TaskSpec,
    chat_ids,
    chat_messages,
    context_length,
    format_at_context,
    turn_question,
)

TOLERANCE = 0.02  # a prompt is within ±2% of its requested length
ATTEMPTS = 200  # fresh draws tried per sample before giving up (all but the first cost 3 tokenizations)
T = TypeVar("T")
NUMBERED_IDS = "len<length>_<n>"  # the sample ids of tasks drawn per length (RULER's, trec-fewshot's)
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's needle depths (percent): 40 evenly spaced


# ----------------------------------------------------------------------------------------------------------- words


@cache
def _wonderwords(*categories: str) -> tuple[str, ...]:
    try:
        from wonderwords import RandomWord
    except ImportError:
        raise PkvError("the RULER tasks need the PyPI package wonderwords: pip install wonderwords") from None
    return tuple(sorted(set(RandomWord().filter(include_categories=list(categories)))))


def random_key_word(rng: random.Random) -> str:
    """An adjective-noun key such as ``abashed-aardvark``."""
    return f"{rng.choice(_wonderwords('adjective'))}-{rng.choice(_wonderwords('noun'))}"


def random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # seven digits
    if kind == "words":
        return random_key_word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise PkvError(f"unknown needle type {kind!r} (numbers, words, uuids)")


@cache
def _essay_words(distribution: str, folder: str) -> tuple[str, ...]:
    from pkvbench.tasks.needle import haystack_text

    return tuple(re.sub(r"\s+", " ", haystack_text(distribution, folder)).strip().split(" "))


def split_sentences(text: str) -> list[str]:
    """Sentences: cut at whitespace that follows '.', '!' or '?'."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


# ----------------------------------------------------------------------------------------------- prompt assembly


@dataclass(frozen=True)
class Asked:
    """A question about the drawn context: the rest of the last user turn, the answer prefix, the answers."""

    text: str
    answer_prefix: str
    answers: tuple[str, ...]
    extras: dict = field(default_factory=dict)  # result columns of the question

    @property
    def reply(self) -> str:
        """The reference answer as the model would say it after the answer prefix: a conversation's teacher-forced
        turn (the answers joined, a space after a prefix that ends without one)."""
        text = ", ".join(self.answers)
        return " " + text if self.answer_prefix and not self.answer_prefix[-1].isspace() else text


@dataclass(frozen=True)
class Built:
    """One drawn sample before tokenization: earlier chat turns (user, assistant, …), the last user turn up to the
    end of its context, and the questions asked (usually one)."""

    turns: tuple[str, ...]
    head: str
    asked: tuple[Asked, ...]

    @classmethod
    def one(cls, turns: tuple[str, ...], last_turn: str, context_end: int, answer_prefix: str, answers) -> Built:
        return cls(turns, last_turn[:context_end], (Asked(last_turn[context_end:], answer_prefix, tuple(answers)),))


def prompt_ids(tokenizer, spec: TaskSpec, built: Built, question: int = 0) -> tuple[list[int], int]:
    """Token ids of question ``question``'s prompt and how many of them are the context."""
    asked = built.asked[question]
    if spec.chat_template:
        messages = chat_messages(spec.config.get("system"), [*built.turns, built.head + asked.text])
        prefix = asked.answer_prefix.lstrip(" ")
        ids = chat_ids(tokenizer, messages) + (
            tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
        )
        return ids, context_length(tokenizer, ids, messages, None, len(built.head))
    before = "\n".join([*built.turns, built.head])
    text = before + asked.text + asked.answer_prefix
    ids = list(tokenizer(text)["input_ids"])
    return ids, context_length(tokenizer, ids, None, text, len(before))


def built_sample(tokenizer, spec: TaskSpec, sample_id: str, built: Built, extras: dict) -> Sample:
    prompts = [prompt_ids(tokenizer, spec, built, i) for i in range(len(built.asked))]
    context_len = min(split for _, split in prompts)
    if len(prompts) == 1:
        return Sample.one_question(sample_id, prompts[0][0], context_len, list(built.asked[0].answers), extras)
    questions = tuple(
        turn_question(
            tokenizer,
            spec,
            ids[context_len:],
            list(asked.answers),
            f"q{i}",
            asked.extras,
            asked.text.lstrip(),
            asked.reply,
            asked.answer_prefix,
        )
        for i, ((ids, _), asked) in enumerate(zip(prompts, built.asked))
    )
    return Sample(sample_id, prompts[0][0][:context_len], questions, extras)


def fit_length(build: Callable[[int], list[int]], length: int, low: int, high: int = 1 << 22) -> tuple[int, list[int]]:
    """The haystack size n in [low, high] whose prompt length is closest to ``length`` (length grows with n)."""
    memo: dict[int, list[int]] = {}

    def at(n: int) -> list[int]:
        if n not in memo:
            memo[n] = build(n)
        return memo[n]

    if len(at(low)) >= length or low >= high:
        return low, at(low)
    lo, hi = low, min(max(low + 1, 2 * low, 8), high)
    while len(at(hi)) <= length:
        if hi >= high:
            return hi, at(hi)
        lo, hi = hi, min(hi * 2, high)
    while hi - lo > 1:  # len(at(lo)) <= length < len(at(hi))
        mid = (lo + hi) // 2
        if len(at(mid)) <= length:
            lo = mid
        else:
            hi = mid
    n = min((lo, hi), key=lambda m: abs(len(at(m)) - length))
    return n, at(n)


def within_tolerance(n_tokens: int, length: int) -> bool:
    return abs(n_tokens - length) <= TOLERANCE * length


def fit_drawn(
    build: Callable[[int, int], tuple[list[int], T]],
    length: int,
    low: int = 0,
    high: int = 1 << 22,
    what: str = "prompt",
) -> tuple[list[int], T]:
    """Token ids (and whatever ``build`` returns with them) of the draw closest to ``length``, within ±2%.

    ``build(attempt, n)`` draws a sample with haystack size n from the attempt's own random stream. Attempt 0
    searches n; when the closest size still misses (a haystack of coarse units, such as UUID lines, can step over
    the ±2% window), later attempts draw afresh and try the sizes next to it, whose lengths vary with the draw.
    """
    best: tuple[list[int], T] | None = None
    center = low
    for attempt in range(ATTEMPTS):
        memo: dict[int, tuple[list[int], T]] = {}

        def at(n: int) -> list[int]:
            if n not in memo:
                memo[n] = build(attempt, n)
            return memo[n][0]

        if attempt == 0:
            center, _ = fit_length(at, length, low, high)
            if len(at(center)) > (1 + TOLERANCE) * length and center == low:
                raise PkvError(
                    f"{what}: --lengths {length} is too short; the prompt needs at least {len(at(low))} tokens"
                )
            if len(at(center)) < (1 - TOLERANCE) * length and center == high:
                raise PkvError(
                    f"{what}: --lengths {length} is more than its material can fill; all of it makes a prompt of "
                    f"{len(at(high))} tokens"
                )
        for n in (center, center - 1, center + 1):
            if low <= n <= high:
                ids = at(n)
                if best is None or abs(len(ids) - length) < abs(len(best[0]) - length):
                    best = memo[n]
        if within_tolerance(len(best[0]), length):
            return best
    raise PkvError(f"{what}: could not build a {length}-token prompt within ±2% (closest: {len(best[0])} tokens)")


def _sample_indices(spec: TaskSpec, options: TaskOptions, length: int) -> list[int]:
    if options.sample_ids is not None:
        wanted = []
        for sample_id in options.sample_ids:
            match = re.fullmatch(r"len(\d+)_(\d+)", sample_id)
            if match and int(match.group(1)) == length:
                wanted.append(int(match.group(2)))
        return sorted(set(wanted))
    return list(range(options.limit or int(spec.config["defaults"]["samples"])))


def generate(
    tokenizer,
    spec: TaskSpec,
    options: TaskOptions,
    draw: Callable[[random.Random, int, int], Built],
    low: int = 0,
    high: int = 1 << 22,
) -> list[Sample]:
    """Samples for every requested length: ``draw(rng, length, n)`` builds a sample with haystack size n."""
    lengths = options.lengths or tuple(spec.config["defaults"]["lengths"])
    samples = []
    for length in lengths:
        for index in _sample_indices(spec, options, length):

            def build(attempt: int, n: int) -> tuple[list[int], Built]:
                built = draw(random.Random(f"{options.seed}/{spec.name}/{length}/{index}/{attempt}"), length, n)
                return prompt_ids(tokenizer, spec, built)[0], built

            _, built = fit_drawn(build, length, low, high, spec.name)
            samples.append(built_sample(tokenizer, spec, f"len{length}_{index}", built, {"length": length}))
    return samples


# ------------------------------------------------------------------------------------------------------- niah_*


def _singular_text(text: str) -> str:
    """RULER's wording for a single answer: 'Some … are all …' becomes 'A … is …'."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(old, new)
    return text


def _singular(config: dict) -> tuple[str, str, str]:
    """The template, answer prefix and value type, put in the singular (and the type losing its 's') when the
    sample has a single answer, as RULER does."""
    template, prefix, kind = config["template"], config["answer_prefix"], config["value_type"]
    if config["num_values"] * config["num_queries"] == 1:
        return _singular_text(template), _singular_text(prefix), kind[:-1]
    return template, prefix, kind


def _join_keys(queries: list[str]) -> str:
    return queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]


def niah_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    num_keys = max(config["num_keys"], config["num_queries"])
    haystack = config["haystack"]
    if haystack not in ("repeat", "essay", "needle"):
        raise PkvError(f"{spec.name}: unknown haystack {haystack!r} (repeat, essay, needle)")
    template, prefix, kind = _singular(config)
    needle = config["needle"]
    words = _essay_words(config["essay"]["distribution"], config["essay"]["folder"]) if haystack == "essay" else ()

    def key(rng: random.Random) -> str:
        return random_key_word(rng) if config["key_type"] == "words" else random_value(rng, config["key_type"])

    def draw(rng: random.Random, length: int, n: int) -> Built:
        keys: list[str] = []
        while len(keys) < num_keys:
            candidate = key(rng)
            if candidate not in keys:
                keys.append(candidate)
        values = [[random_value(rng, config["value_type"]) for _ in range(config["num_values"])] for _ in keys]
        needles = [
            needle.format(type_needle_v=config["value_type"], key=k, value=v) for k, vs in zip(keys, values) for v in vs
        ]
        rng.shuffle(needles)
        asked = rng.sample(range(num_keys), config["num_queries"])
        if haystack == "essay":
            text = " ".join(words[i % len(words)] for i in range(n))
            sentences = split_sentences(text)
            cuts = sorted(int(len(sentences) * depth / 100) for depth in rng.sample(DEPTHS, len(needles)))
            pieces, start = [], 0
            for cut, item in zip(cuts, needles):
                pieces += [" ".join(sentences[start:cut]), item]
                start = cut
            pieces.append(" ".join(sentences[start:]))
            context = " ".join(p for p in pieces if p)
        else:
            if haystack == "repeat":
                lines = [config["noise"]] * n
            else:  # every line a needle for another key (never one of the real keys)
                lines = []
                while len(lines) < n:
                    other = key(rng)
                    if other not in keys:
                        lines.append(
                            needle.format(
                                type_needle_v=config["value_type"],
                                key=other,
                                value=random_value(rng, config["value_type"]),
                            )
                        )
            for index, item in zip(
                sorted(rng.sample(range(max(n, len(needles))), len(needles)), reverse=True), needles
            ):
                lines.insert(index, item)
            context = "\n".join(lines)
        if config.get("ask") == "each":
            # The context as RULER writes it for several keys, then one question per key, in the singular.
            plural = config["value_type"]
            head = config["template"].split("{context}", 1)[0].format(type_needle_v=plural) + context
            singular, tail = plural[:-1], _singular_text(config["template"].split("{context}", 1)[1])
            return Built(
                (),
                head,
                tuple(
                    Asked(
                        tail.format(type_needle_v=singular, query=keys[i]),
                        _singular_text(config["answer_prefix"]).format(type_needle_v=singular, query=keys[i]),
                        tuple(values[i]),
                    )
                    for i in asked
                ),
            )
        query = _join_keys([keys[i] for i in asked])
        user, context_end = format_at_context(template, type_needle_v=kind, context=context, query=query)
        answers = [v for i in asked for v in values[i]]
        return Built.one((), user, context_end, prefix.format(type_needle_v=kind, query=query), answers)

    return generate(tokenizer, spec, options, draw)


# ------------------------------------------------------------------------------------------------------------ vt


def _chains(
    rng: random.Random, num_chains: int, num_hops: int, name_length: int
) -> tuple[list[list[str]], list[list[str]]]:
    """Variable names (distinct, uppercase) and assignment statements of each chain: VAR A = 12345, VAR B = VAR A, …"""
    names: list[str] = []
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_length))
        if name not in names:
            names.append(name)
    groups = [names[i : i + num_hops + 1] for i in range(0, len(names), num_hops + 1)]
    chains = []
    for group in groups:
        chain = [f"VAR {group[0]} = {rng.randint(10000, 99998)}"]
        chain += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)]
        chains.append(chain)
    return groups, chains


def _vt_context(rng: random.Random, noise: str, n: int, chains: list[list[str]]) -> str:
    lines = [noise + "\n"] * n
    for chain in chains:
        positions = sorted(rng.sample(range(max(len(lines), len(chain))), len(chain)))
        for j, (position, statement) in enumerate(zip(positions, chain)):
            lines.insert(position + j, statement)
    return " ".join(lines).replace(". \n", ".\n")


def vt_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    template, prefix, noise = config["template"], config["answer_prefix"], config["noise"]
    num_chains, num_hops = config["num_chains"], config["num_hops"]

    def draw_one(rng: random.Random, n: int, icl: bool) -> tuple[str, int, str, list[str]]:
        groups, chains = _chains(rng, num_chains, min(10, num_hops) if icl else num_hops, 3 if icl else 5)
        context = _vt_context(rng, noise, n, chains)
        value = chains[0][0].split("=")[-1].strip()
        fields = {"context": context, "query": value, "num_v": len(groups[0])}
        if icl:  # the example is one block of text: the template with its whitespace collapsed, prefix, answer
            return " ".join(template.split()).format(**fields) + prefix.format(**fields), 0, "", groups[0]
        user, context_end = format_at_context(template, **fields)
        return user, context_end, prefix.format(**fields), groups[0]

    # One worked example for the whole task (as RULER makes one per data set), at most icl_max_tokens long
    # counting the generated answer's budget, its noise grown in steps of 5 lines.
    icl_block = ""
    if config.get("icl_max_tokens"):

        def icl_text(n: int) -> str:
            text, _, _, answer = draw_one(random.Random(f"{options.seed}/{spec.name}/icl"), n, icl=True)
            return text + " " + " ".join(answer)

        def icl_tokens(n: int) -> int:
            return len(tokenizer(icl_text(n), add_special_tokens=False)["input_ids"]) + spec.max_new_tokens

        n = 5
        while icl_tokens(n + 5) <= config["icl_max_tokens"]:
            n += 5
        icl_block = icl_text(n) + "\n\n\n\n"

    def draw(rng: random.Random, length: int, n: int) -> Built:
        user, context_end, answer_prefix, answer = draw_one(rng, n, icl=False)
        return Built.one((), icl_block + user, len(icl_block) + context_end, answer_prefix, answer)

    return generate(tokenizer, spec, options, draw)


# ----------------------------------------------------------------------------------------------------------- cwe


def cwe_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    template, prefix, num_common = config["template"], config["answer_prefix"], config["num_cw"]
    vocabulary = _wonderwords("noun", "adjective", "verb")

    def numbered(words: list[str]) -> str:
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))

    def word_list(rng: random.Random, pool: list[str], num_words: int, common_repeats: int, uncommon_repeats: int):
        common, uncommon = pool[:num_common], pool[num_common:num_words]
        words = common * common_repeats + uncommon * uncommon_repeats
        rng.shuffle(words)
        return numbered(words), common

    def draw(rng: random.Random, length: int, n: int) -> Built:
        size = config["short"] if length < config["short"]["below"] else config["long"]
        example_words, example_common, example_uncommon = size["example"]
        example_context, example_answer = word_list(
            rng, rng.sample(vocabulary, example_words), example_words, example_common, example_uncommon
        )
        pool = rng.sample(vocabulary, len(vocabulary))
        context, answer = word_list(rng, pool, num_common + n, size["freq_cw"], size["freq_ucw"])
        # RULER shows one solved example first (a whole earlier prompt with its answer), then asks.
        example = (template.format(context=example_context), prefix.lstrip(" ") + numbered(example_answer))
        user, context_end = format_at_context(template, context=context)
        return Built.one(example, user, context_end, prefix, answer)

    return generate(tokenizer, spec, options, draw, high=len(vocabulary) - num_common)


# ----------------------------------------------------------------------------------------------------------- fwe


def zeta(alpha: float, terms: int = 1000) -> float:
    """Riemann zeta for alpha > 1: a partial sum plus its Euler–Maclaurin tail."""
    head = sum(k**-alpha for k in range(1, terms + 1))
    return head + terms ** (1 - alpha) / (alpha - 1) - 0.5 * terms**-alpha + alpha * terms ** (-alpha - 1) / 12


def fwe_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    config = spec.config
    template, prefix, alpha = config["template"], config["answer_prefix"], float(config["alpha"])
    word_length, scale = int(config["coded_wordlen"]), zeta(alpha)

    def draw(rng: random.Random, length: int, n: int) -> Built:
        size = int(config.get("vocab_size") or length // config["vocab_per_tokens"])
        vocab: set[str] = set()
        while len(vocab) < size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=word_length)))
        ranked = sorted(vocab)
        rng.shuffle(ranked)
        ranked[0] = "..."  # the most frequent "word" is noise the question says to ignore
        counts = [int(n * k**-alpha / scale) for k in range(1, len(ranked) + 1)]
        words = [word for word, count in zip(ranked, counts) for _ in range(count)]
        rng.shuffle(words)
        user, context_end = format_at_context(template, context=" ".join(words))
        return Built.one((), user, context_end, prefix, ranked[1:4])

    return generate(tokenizer, spec, options, draw, low=1)


_RULER_KEYS = ("template", "answer_prefix", "defaults")
NIAH_GENERATOR = Generator(
    niah_samples,
    (*_RULER_KEYS, "haystack", "key_type", "value_type", "num_keys", "num_values", "num_queries", "needle"),
    ("lengths",),
    NUMBERED_IDS,
    optional=("system", "essay", "ask", "noise"),
)
VT_GENERATOR = Generator(
    vt_samples,
    (*_RULER_KEYS, "noise", "num_chains", "num_hops"),
    ("lengths",),
    NUMBERED_IDS,
    optional=("system", "icl_max_tokens"),
)
CWE_GENERATOR = Generator(
    cwe_samples, (*_RULER_KEYS, "num_cw", "short", "long"), ("lengths",), NUMBERED_IDS, ("system",)
)
FWE_GENERATOR = Generator(
    fwe_samples,
    (*_RULER_KEYS, "alpha", "coded_wordlen"),
    ("lengths",),
    NUMBERED_IDS,
    optional=("system", "vocab_size", "vocab_per_tokens"),
)
