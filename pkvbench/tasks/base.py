"""Tasks: a YAML definition (``tasks/*.yaml``) plus a generator or loader that turns it into samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pkvbench.errors import PkvError


@dataclass(frozen=True)
class Sample:
    """One prompt, tokenized, with what scoring needs."""

    sample_id: str
    input_ids: list[int]
    answers: list[str]
    extras: dict[str, Any] = field(default_factory=dict)  # task-specific result columns (length, depth)
    meta: dict[str, Any] = field(
        default_factory=dict
    )  # what scoring needs besides the answers (all_classes); not written


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

    def __post_init__(self) -> None:
        for depth in self.depths or ():
            if not 0 <= depth <= 100:
                raise PkvError(f"depth {depth:g} is outside 0..100 (percent)")
        if self.limit is not None and self.limit < 1:
            raise PkvError("--limit must be at least 1")


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


def chat_prompt_ids(tokenizer, system: str | None, user: str) -> list[int]:
    """Token ids of a one-turn chat prompt, ready for the assistant's answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])
