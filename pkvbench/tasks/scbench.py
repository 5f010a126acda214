"""SCBench's conversations: one context, then questions asked in turn (Li et al., "SCBench: A KV Cache-Centric Analysis
of Long-Context Methods", ICLR 2025; microsoft/MInference ``scbench/``).

Two sources of samples, both a context with an ordered list of turns (question, reference answers):

- **Generated here** (``scbench_kv``, ``scbench_prefix_suffix``, ``scbench_vt``, ``scbench_needles``): SCBench's
  synthetic string-retrieval tasks built afresh, reproducibly, at any prompt length (``--lengths``: the first turn's
  prompt, within ±2%, as RULER's tasks) and any number of turns (``--turns``). Each sample draws from its own
  ``random.Random`` (``seed/task/length/index/attempt``), so it never depends on which others were asked for. These are
  SCBench's task designs, not its released samples: the haystacks, keys and wording are drawn here.
- **SCBench's released files** (``scbench_data_*``, with ``--data-dir``): the JSON lines of SCBench's data set
  (``microsoft/SCBench``; each a ``context`` — or ``input`` — and ``multi_turns``, a list of ``{"input", "answer"}``),
  read as they are: the first turn's prompt is the task's ``template`` with the context and the first question, each
  later turn its ``follow_up`` with the turn's question, as SCBench's chat-template prompts are. ``--turns`` keeps the
  first turns (SCBench's ``--max_turns``); ``--max-length`` cuts the context in the middle so that the first prompt
  fits (SCBench's ``truncate_by_tokens``).

Every question after the first knows how it follows an answer (``Question.follow_ids``) and every reference answer
what it says in a teacher-forced turn (``Question.reply_ids``), so that ``--query-mode multi-turn`` can carry one
cache through the conversation. In the other query modes the turns are independent questions about the context.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pkvbench.errors import PkvError
from pkvbench.io import read_json_lines
from pkvbench.tasks.base import (
    Generator,
    Sample,
    TaskOptions,
    TaskSpec,
    format_at_context,
    reply_tokens,
    shared_context,
    split_prompt,
    turn_question,
    with_unique_ids,
)
from pkvbench.tasks.ruler import (
    DEPTHS,
    NUMBERED_IDS,
    Asked,
    Built,
    _chains,
    _vt_context,
    generate,
    random_key_word,
    random_value,
)

# --- generated conversations --------------------------------------------------------------------------------------


def turn_count(spec: TaskSpec, options: TaskOptions) -> int:
    """``--turns``, else the task's default."""
    return options.turns or int(spec.config["defaults"]["turns"])


def _filled(spec: TaskSpec, key: str, fields: dict[str, Any]) -> str:
    try:
        return spec.config.get(key, "").format(**fields)
    except (KeyError, IndexError, ValueError) as exc:
        raise PkvError(
            f"{spec.name}: its {key!r} names a field it does not fill ({exc}); it fills {', '.join(fields)}"
        ) from None


def _asked(spec: TaskSpec, fields: dict[str, Any], answers: list[str], extras: dict | None = None) -> Asked:
    """One turn: the task's ``question`` after a blank line (SCBench's ``{context}\n\n{input}``) and its answer
    prefix, filled with ``fields``."""
    return Asked(
        "\n\n" + _filled(spec, "question", fields), _filled(spec, "answer_prefix", fields), tuple(answers), extras or {}
    )


def _conversation(spec: TaskSpec, context: str, turns: list[Asked]) -> Built:
    """A drawn conversation: the task's ``template`` with the context (it ends there), then the turns."""
    text, context_end = format_at_context(spec.config["template"], context=context)
    if context_end != len(text):
        raise PkvError(f"{spec.name}: its template must end with {{context}} (each turn's question follows it)")
    return Built((), text, tuple(turns))


def _distinct(rng: random.Random, count: int, draw: Callable[[random.Random], str], taken=()) -> list[str]:
    seen, found = set(taken), []
    while len(found) < count:
        value = draw(rng)
        if value not in seen:
            seen.add(value)
            found.append(value)
    return found


def _uuid(rng: random.Random) -> str:
    return random_value(rng, "uuids")


def kv_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    """Key-value retrieval (SCBench's ``scbench_kv``, InfiniteBench's kv_retrieval): a JSON object of n random UUID
    keys and values; each turn asks the value of another of its keys."""
    turns = turn_count(spec, options)

    def draw(rng: random.Random, length: int, n: int) -> Built:
        keys = _distinct(rng, n, _uuid)
        values = [_uuid(rng) for _ in keys]
        context = json.dumps(dict(zip(keys, values)), ensure_ascii=False)
        asked = rng.sample(range(n), turns)
        return _conversation(
            spec,
            context,
            [_asked(spec, {"key": keys[i]}, [values[i]], {"depth": round(100 * i / max(n - 1, 1))}) for i in asked],
        )

    return generate(tokenizer, spec, options, draw, low=turns)


def _random_string(rng: random.Random, length: int) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=length))


def prefix_suffix_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    """Prefix-suffix retrieval (SCBench's ``scbench_prefix_suffix``): a list of random strings; each turn asks for the
    one string that starts with one given prefix and ends with one given suffix. Beside each asked string the list
    holds one with its prefix and another suffix and one with its suffix and another prefix, so that neither end
    alone finds it."""
    turns = turn_count(spec, options)
    size, affix = int(spec.config["string_length"]), int(spec.config["affix_length"])
    if not 2 * affix < size:
        raise PkvError(f"{spec.name}: affix_length {affix} must be below half of string_length {size}")

    def draw(rng: random.Random, length: int, n: int) -> Built:
        strings = _distinct(rng, n + 3 * turns, lambda r: _random_string(r, size))
        targets, others = strings[:turns], strings[turns:]
        decoys = []
        for target in targets:  # the same prefix with another suffix, the same suffix with another prefix
            middle = _random_string(rng, size - 2 * affix)
            decoys += [
                target[:affix] + middle + _random_string(rng, affix),
                _random_string(rng, affix) + middle + target[-affix:],
            ]
        lines = others[:n] + decoys + targets
        rng.shuffle(lines)
        context = "\n".join(lines)
        asked = [
            _asked(
                spec,
                {"prefix": t[:affix], "suffix": t[-affix:]},
                [t],
                {"depth": round(100 * lines.index(t) / max(len(lines) - 1, 1))},
            )
            for t in targets
        ]
        return _conversation(spec, context, asked)

    return generate(tokenizer, spec, options, draw)


def vt_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    """Multi-hop variable tracking (SCBench's ``scbench_vt``, RULER's vt with one chain per turn): chains of
    ``num_hops`` assignments hidden in noise; each turn asks for every variable of another chain by its value."""
    turns = turn_count(spec, options)
    config = spec.config
    hops = int(config["num_hops"])

    def draw(rng: random.Random, length: int, n: int) -> Built:
        groups, chains = _chains(rng, turns, hops, 5)
        context = _vt_context(rng, config["noise"], n, chains)
        asked = []
        for group, chain in zip(groups, chains):
            value = chain[0].split("=")[-1].strip()
            asked.append(_asked(spec, {"value": value, "num_v": len(group)}, list(group)))
        return _conversation(spec, context, asked)

    return generate(tokenizer, spec, options, draw)


def needles_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    """Several needles asked in turn (SCBench's pass-key retrieval, one key per turn): ``--turns`` pass keys, each
    of its own name, hidden at random depths of a repeated noise text; each turn asks one of them."""
    turns = turn_count(spec, options)
    config = spec.config

    def draw(rng: random.Random, length: int, n: int) -> Built:
        names = _distinct(rng, turns, random_key_word)
        keys = [str(rng.randint(10**6, 10**7 - 1)) for _ in names]
        depths = sorted(rng.sample(DEPTHS, turns))
        lines = [config["noise"]] * n
        order = list(range(turns))
        rng.shuffle(order)  # which needle sits at which depth
        placed = {}
        for depth, which in sorted(zip(depths, order), reverse=True):  # deepest first: no shifts
            lines.insert(round(n * depth / 100), config["needle"].format(name=names[which], key=keys[which]))
            placed[which] = depth
        context = " ".join(lines)
        asked = [_asked(spec, {"name": names[i]}, [keys[i]], {"depth": placed[i]}) for i in range(turns)]
        return _conversation(spec, context, asked)

    return generate(tokenizer, spec, options, draw)


def _generated(build, *keys: str) -> Generator:
    """A generated SCBench task's generator: its template, question and defaults plus its own ``keys``; its prompts
    shaped by ``--lengths`` and ``--turns``."""
    return Generator(
        build,
        ("template", "question", "defaults", *keys),
        ("lengths", "turns"),
        NUMBERED_IDS,
        optional=("system", "answer_prefix"),
        fields=frozenset({"context"}),
    )


SCBENCH_KV_GENERATOR = _generated(kv_samples)
SCBENCH_PREFIX_SUFFIX_GENERATOR = _generated(prefix_suffix_samples, "string_length", "affix_length")
SCBENCH_VT_GENERATOR = _generated(vt_samples, "noise", "num_hops")
SCBENCH_NEEDLES_GENERATOR = _generated(needles_samples, "noise", "needle")


# --- SCBench's released files ----------------------------------------------------------------------------------------

DATA_HINT = (
    "download the task's <name>.jsonl from https://huggingface.co/datasets/microsoft/SCBench (folder data/) and pass "
    "--data-dir with the folder that holds it"
)


def _answers(answer: Any) -> list[str] | None:
    """A turn's reference answers as text: SCBench's ``answer`` is a string, a number or a list of them."""
    items = answer if isinstance(answer, list) else [answer]
    if not items or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in items):
        return None
    return [str(a) for a in items]


def check_row(row: Any, where: str) -> None:
    """A line of SCBench's file: a context (``context`` or ``input``, text) and ``multi_turns``, a non-empty list of
    turns each with an ``input`` (text) and an ``answer``."""
    if not isinstance(row, dict):
        raise PkvError(f"{where}: expected a JSON object, got {type(row).__name__}")
    context = row.get("context", row.get("input"))
    if not isinstance(context, str):
        raise PkvError(f"{where}: no context (SCBench's rows have a 'context' text, or an 'input' one)")
    turns = row.get("multi_turns")
    if not isinstance(turns, list) or not turns:
        raise PkvError(f'{where}: \'multi_turns\' must be a non-empty list of {{"input": ..., "answer": ...}}')
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("input"), str) or _answers(turn.get("answer")) is None:
            raise PkvError(f"{where}: turn {number} needs an 'input' text and an 'answer' (text, number, or a list)")


def _row_id(row: dict[str, Any], index: int) -> str:
    return str(row.get("id", index))


def data_rows(spec: TaskSpec, options: TaskOptions) -> list[dict[str, Any]]:
    if not options.data_dir:
        raise PkvError(f"{spec.name} reads SCBench's released file {spec.config['file']}; {DATA_HINT}")
    folder = Path(options.data_dir)
    path = folder / spec.config["file"]
    if not path.is_file():
        where = "does not exist" if not folder.is_dir() else "has no such file"
        raise PkvError(f"{path} not found: {folder} {where}; {DATA_HINT}")
    rows = read_json_lines(path, "SCBench file", check=with_unique_ids(check_row, _row_id))
    return [{**row, "id": _row_id(row, index)} for index, row in enumerate(rows)]


def _first_prompt(tokenizer, spec: TaskSpec, context: str, first: str) -> tuple[list[int], int]:
    """The first turn's prompt (the template with the context and the first question) and its context's tokens."""
    user, context_end = format_at_context(spec.config["template"], context=context, input=first)
    return split_prompt(tokenizer, spec, user, context_end)


def _fitted_context(tokenizer, spec: TaskSpec, context: str, first: str, max_length: int | None) -> tuple[str, int]:
    """The context, cut in the middle so that the first prompt has at most ``max_length`` tokens (SCBench cuts its
    first prompt so), and the first prompt's length before the cut."""
    ids, _ = _first_prompt(tokenizer, spec, context, first)
    if max_length is None or len(ids) <= max_length:
        return context, len(ids)
    context_ids = reply_tokens(tokenizer, context)
    keep = max_length - (len(ids) - len(context_ids))
    if keep < 2:
        raise PkvError(f"{spec.name}: --max-length {max_length} leaves no room for the context")
    half = keep // 2
    cut = tokenizer.decode(context_ids[:half], skip_special_tokens=True)
    cut += tokenizer.decode(context_ids[-(keep - half) :], skip_special_tokens=True)
    return cut, len(ids)


def data_samples(tokenizer, spec: TaskSpec, options: TaskOptions) -> list[Sample]:
    """SCBench's released conversations, ``--turns`` of each (all by default), ``--sample-id`` (the row's ``id``)
    and ``--limit`` choosing the rows."""
    rows = data_rows(spec, options)
    if options.sample_ids is not None:
        rows = [row for row in rows if row["id"] in set(options.sample_ids)]
    samples = []
    for row in rows[: options.limit] if options.limit else rows:
        turns = row["multi_turns"][: options.turns] if options.turns else row["multi_turns"]
        context, untruncated = _fitted_context(
            tokenizer, spec, row.get("context", row.get("input")), turns[0]["input"], options.max_length
        )
        # Each turn asked alone (the other query modes) is the first turn's prompt with its own question.
        prompts = [_first_prompt(tokenizer, spec, context, turn["input"]) for turn in turns]
        context_ids, context_len = shared_context(prompts, f"{spec.name} {row['id']}", "turns' prompts")
        questions = []
        for number, (turn, (ids, _)) in enumerate(zip(turns, prompts)):
            answers = _answers(turn["answer"])
            follow_up = _filled(spec, "follow_up", {"input": turn["input"]})
            questions.append(
                turn_question(
                    tokenizer, spec, ids[context_len:], answers, f"t{number + 1}", {}, follow_up, ", ".join(answers)
                )
            )
        truncated = options.max_length is not None and untruncated > options.max_length
        extras = {"untruncated_tokens": untruncated, "truncated": truncated}
        samples.append(Sample(row["id"], context_ids, tuple(questions), extras))
    return samples


SCBENCH_DATA_GENERATOR = Generator(
    data_samples,
    ("file", "template", "follow_up"),
    ("turns", "max_length", "data_dir"),
    "the id of a data row (its line number from 0 where it has none)",
    optional=("system",),
    fields=frozenset({"context", "input"}),
)
