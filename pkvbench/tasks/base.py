"""Tasks: a YAML definition (``tasks/*.yaml``) plus a generator or loader that turns it into samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pkvbench.errors import PkvError


@dataclass(frozen=True)
class Question:
    """One question about a sample's context: the tokens that follow the context (the question, the rest of the
    instruction, the chat template's closing tokens, an answer prefix) and what scores the answer."""

    ids: list[int]
    answers: list[str]
    question_id: str = ""  # "" for a sample's only question; otherwise part of its rows' sample_id
    extras: dict[str, Any] = field(default_factory=dict)  # result columns of this question (e.g. its needle's depth)
    # As a later turn of a conversation (``--query-mode multi-turn``): the tokens that ask it right after an answer
    # (the end of the assistant's turn, the question's own user turn, the template's closing tokens, an answer
    # prefix: ``follow_up_ids``), and what a teacher-forced conversation puts in the model's mouth as its answer
    # (the reference answer's tokens). None: the question cannot follow another.
    follow_ids: list[int] | None = None
    reply_ids: list[int] | None = None


@dataclass(frozen=True)
class Sample:
    """One context, tokenized, with the questions asked about it and what scoring needs.

    The prompt of question q is ``context_ids + q.ids``: with the question inside the compressed prompt (query-aware,
    the paper's protocol) all of it is prefilled and compressed; query-agnostic, only the context is, and the
    question's tokens go on top of the compressed cache. Most tasks ask one question per context.
    """

    sample_id: str
    context_ids: list[int]
    questions: tuple[Question, ...]
    extras: dict[str, Any] = field(default_factory=dict)  # task-specific result columns (length, depth)
    meta: dict[str, Any] = field(default_factory=dict)  # what scoring needs besides the answers (all_classes)

    @classmethod
    def one_question(
        cls,
        sample_id: str,
        input_ids: list[int],
        context_len: int,
        answers: list[str],
        extras: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Sample:
        """A prompt whose first ``context_len`` tokens are the context and the rest its one question."""
        if not 0 < context_len <= len(input_ids):
            raise PkvError(f"sample {sample_id}: no context/question split ({context_len} of {len(input_ids)} tokens)")
        return cls(
            sample_id,
            list(input_ids[:context_len]),
            (Question(list(input_ids[context_len:]), answers),),
            extras or {},
            meta or {},
        )

    def prompt(self, question: Question) -> list[int]:
        return self.context_ids + question.ids

    @property
    def input_ids(self) -> list[int]:
        """The prompt of the first question."""
        return self.prompt(self.questions[0])

    @property
    def answers(self) -> list[str]:
        return self.questions[0].answers

    @property
    def conversable(self) -> bool:
        """Whether its questions can be asked in turn, as one conversation: every question after the first knows how
        it follows an answer, and every question but the last what its reference answer says."""
        later, earlier = self.questions[1:], self.questions[:-1]
        return all(q.follow_ids is not None for q in later) and all(q.reply_ids is not None for q in earlier)

    def row_id(self, question: Question) -> str:
        """A row's ``sample_id``: the sample's own, or ``<sample>/<question>`` when it asks several."""
        return f"{self.sample_id}/{question.question_id}" if question.question_id else self.sample_id


@dataclass(frozen=True)
class TaskOptions:
    """Sample-selection options shared by the generators."""

    lengths: tuple[int, ...] | None = None
    depths: tuple[float, ...] | None = None
    limit: int | None = None
    seed: int = 0
    data_dir: str | None = None  # local copies of a task's data files
    verify: bool = True  # check data files against known checksums
    max_length: int | None = None  # prompt tokens, for tasks that truncate long inputs
    sample_ids: tuple[str, ...] | None = None  # select samples by id
    context_window: int | None = None  # model positions for default truncation (else read from the model config)
    turns: int | None = None  # questions asked in turn per context (conversations: SCBench's tasks)

    def __post_init__(self) -> None:
        for depth in self.depths or ():
            if not 0 <= depth <= 100:
                raise PkvError(f"depth {depth:g} is outside 0..100 (percent)")
        if self.limit is not None and self.limit < 1:
            raise PkvError("--limit must be at least 1")
        if self.turns is not None and self.turns < 1:
            raise PkvError("--turns must be at least 1")


@dataclass(frozen=True)
class TaskSpec:
    """A task definition as read from YAML."""

    name: str
    description: str
    generator: str
    metric: str
    max_new_tokens: int
    chat_template: bool
    config: dict[str, Any]
    stop_strings: tuple[str, ...] = ()
    min_new_tokens: int = 0  # tokens generated before an end or stop token may be chosen
    postprocess: tuple[str, ...] = ()  # rules applied to a prediction before scoring (metrics.PREDICTION_RULES)
    version: str = "1"  # the YAML's ``version``: bump it when the task's samples change
    prompt_hash: str = ""  # hash of the definition's prompt-shaping keys (``registry.prompt_hash``)
    source: str = ""  # the file it was read from

    @property
    def identity(self) -> dict[str, str]:
        """What a result row records of its task's definition; resuming under another one is refused."""
        return {"task_version": self.version, "task_hash": self.prompt_hash}


@dataclass(frozen=True)
class Generator:
    """How a task's samples are made, the keys its YAML must have for that (and those it may have), the sample
    options that shape its prompts (``TaskOptions`` fields: ``lengths`` and ``depths`` for generated prompts,
    ``max_length`` for data whose prompts are cut to fit, ``data_dir`` for data read from files), what its sample ids
    look like, and its prompt template: the key that holds it and the fields it may name (None: any, as LongBench's
    fill theirs from the data row).

    A task YAML's ``generator:`` names one: the built-in ones are listed in ``pkvbench.tasks.registry``; another
    package registers its own through the entry point group ``pkvbench.tasks`` (see CONTRIBUTING.md)."""

    build: Callable[[Any, TaskSpec, TaskOptions], list[Sample]]
    keys: tuple[str | tuple[str, ...], ...]  # a tuple entry: one of these keys
    shaped_by: tuple[str, ...]
    ids: str
    optional: tuple[str, ...] = ()
    template: str = "template"
    fields: frozenset[str] | None = None
    context: bool = True  # the template names {context} (a reasoning problem has none: the question is all)


RowCheck = Callable[[Any, str], None]  # refuses a data row (raises PkvError) naming ``where``: its file and line


def with_unique_ids(check: RowCheck, sample_id: Callable[[dict[str, Any], int], str]) -> RowCheck:
    """``check`` that also refuses a data row whose sample id an earlier row of the set had
    (``sample_id(row, index)``, ``index`` the row's place from 0): the store keeps one result per id, so the
    second sample would run and then vanish from the results."""
    seen: dict[str, str] = {}

    def checked(row: Any, where: str) -> None:
        check(row, where)
        identity = sample_id(row, len(seen))
        if identity in seen:
            raise PkvError(
                f"{where}: the sample id {identity!r} again ({seen[identity]} has it); give each row its own"
            )
        seen[identity] = where

    return checked


def refuse_repeated_samples(task: str, samples: list[Sample]) -> list[Sample]:
    """``samples`` as they are, unless two share an id (a generator's or a plugin's data with an id twice)."""
    seen: set[str] = set()
    for sample in samples:
        if sample.sample_id in seen:
            raise PkvError(f"{task}: two samples have the id {sample.sample_id!r}; each sample needs its own")
        seen.add(sample.sample_id)
    return samples


def chat_prompt_ids(tokenizer, system: str | None, user: str) -> list[int]:
    """Token ids of a one-turn chat prompt, ready for the assistant's answer."""
    return chat_ids(tokenizer, chat_messages(system, [user]))


def split_chat_prompt(tokenizer, system: str | None, user: str, context_end: int) -> tuple[list[int], int]:
    """A one-turn chat prompt's ids and how many of them are its context: ``user`` up to ``context_end``."""
    messages = chat_messages(system, [user])
    ids = chat_ids(tokenizer, messages)
    return ids, context_length(tokenizer, ids, messages, None, context_end)


def split_prompt(tokenizer, spec: TaskSpec, user: str, context_end: int) -> tuple[list[int], int]:
    """``split_chat_prompt`` with the task's system prompt, or, for a task without a chat template, ``user`` as
    plain text."""
    if spec.chat_template:
        return split_chat_prompt(tokenizer, spec.config.get("system"), user, context_end)
    ids = list(tokenizer(user)["input_ids"])
    return ids, context_length(tokenizer, ids, None, user, context_end)


def chat_messages(system: str | None, turns: list[str]) -> list[dict[str, str]]:
    """Chat messages: an optional system prompt, then turns alternating user, assistant, …, user."""
    roles = ("user", "assistant")
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": roles[i % 2], "content": turn} for i, turn in enumerate(turns)
    ]


# Stands for an answer's text in a rendered conversation: what follows it is how the template goes on after an answer.
_ANSWER_MARK = "\u2063answer\u2063"


def follow_up_ids(tokenizer, chat_template: bool, text: str, answer_prefix: str = "") -> list[int]:
    """The tokens that ask ``text`` as a later turn of a conversation, right after the assistant's answer: with a
    chat template, the end of the assistant's turn and a user turn of ``text`` ready for the next answer (as the
    template renders them after an answer); without one, a blank line and ``text`` (SCBench's follow-up). An answer
    prefix starts the next answer, as in the first turn."""
    if chat_template:
        messages = [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": _ANSWER_MARK},
            {"role": "user", "content": text},
        ]
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        after = rendered[rendered.index(_ANSWER_MARK) + len(_ANSWER_MARK) :]
        return reply_tokens(tokenizer, after) + (
            reply_tokens(tokenizer, answer_prefix.lstrip(" ")) if answer_prefix else []
        )
    return reply_tokens(tokenizer, "\n\n" + text + answer_prefix)


def turn_question(
    tokenizer,
    spec: TaskSpec,
    ids: list[int],
    answers: list[str],
    question_id: str,
    extras: dict[str, Any],
    follow_up: str,
    reply: str,
    answer_prefix: str = "",
) -> Question:
    """A question that can also be asked as a later turn of a conversation: ``follow_up`` is its text after an
    answer (``follow_up_ids``), ``reply`` the text of its reference answer (what a teacher-forced conversation puts in
    the model's mouth)."""
    follow_ids = follow_up_ids(tokenizer, spec.chat_template, follow_up, answer_prefix)
    return Question(ids, answers, question_id, extras, follow_ids, reply_tokens(tokenizer, reply))


def shared_context(prompts: list[tuple[list[int], int]], where: str, asked: str = "questions") -> tuple[list[int], int]:
    """The context that the prompts of one sample's questions (each prompt's ids and how many of them are its
    context) share, and its length: the shortest context, refused (naming ``where`` and what ``asked`` them) unless
    every prompt starts with its tokens."""
    context_len = min(split for _, split in prompts)
    context_ids = prompts[0][0][:context_len]
    if any(ids[:context_len] != context_ids for ids, _ in prompts):
        raise PkvError(f"{where}: the {asked} do not share the context's tokens")
    return context_ids, context_len


def reply_tokens(tokenizer, text: str) -> list[int]:
    """``text``'s tokens inside a prompt (no special tokens added): a reference answer, a follow-up turn."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def format_at_context(template: str, **fields: Any) -> tuple[str, int]:
    """``template.format(**fields)`` and where, in the result, its ``{context}`` ends (what follows is the question)."""
    end = template.index("{context}") + len("{context}")
    head = template[:end].format(**fields)
    return head + template[end:].format(**fields), len(head)


# Marks the context's end in a rendered chat prompt; an invisible separator that no chat template alters.
_CONTEXT_END = "\u2063"


def _shared_prefix(first: list[int], second: list[int]) -> int:
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


def context_length(
    tokenizer, ids: list[int], messages: list[dict[str, str]] | None, text: str | None, context_end: int
) -> int:
    """How many of a prompt's ``ids`` are its context: the tokens of the prompt cut where the last message's
    content (``messages``, a chat prompt) or ``text`` (a plain prompt) reaches ``context_end``, as far as they agree
    with ``ids`` (a token that straddles the cut belongs to the question)."""
    if messages is not None:
        last = messages[-1]["content"]
        marked = [*messages[:-1], {**messages[-1], "content": last[:context_end] + _CONTEXT_END + last[context_end:]}]
        rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
        head = list(tokenizer(rendered[: rendered.index(_CONTEXT_END)], add_special_tokens=False)["input_ids"])
    else:
        head = list(tokenizer(text[:context_end])["input_ids"])
    return _shared_prefix(ids, head)
