"""Task definitions: found as package data (and in the user's folders), validated, and turned into samples.

The built-in definitions are the YAML files of the project's ``tasks/`` folder, installed with the package as
``pkvbench.task_definitions`` (so a wheel has them). ``$PKVBENCH_TASKS`` (folders separated by ``os.pathsep``) and
``--include-path`` add a user's own folders. Every file is checked when loaded: required keys and their types, a
known generator and metric, the generator's own keys, no name defined twice. An error names the file.

Generators are registered by name like policies (``pkvbench.plugins``): the built-in ones in ``BUILTIN_GENERATORS``,
other packages' through the entry point group ``pkvbench.tasks``; metrics likewise in ``pkvbench.metrics.registry``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from pkvbench.errors import PkvError
from pkvbench.io import parse_yaml
from pkvbench.metrics.functions import PREDICTION_RULES
from pkvbench.metrics.registry import METRICS
from pkvbench.plugins import Registry
from pkvbench.tasks.base import Generator, Sample, TaskOptions, TaskSpec, refuse_repeated_samples

BUILTIN_PACKAGE = "pkvbench.task_definitions"
ENV_VAR = "PKVBENCH_TASKS"
GENERATOR_ENTRY_POINT_GROUP = "pkvbench.tasks"
# A task YAML's ``generator:`` → the ``Generator`` that makes its samples. Other packages add theirs through the
# entry point group above (name = what a task's YAML says, value = ``module:GENERATOR``, a ``Generator``).
BUILTIN_GENERATORS: dict[str, str] = {
    "needle": "pkvbench.tasks.needle:NEEDLE_GENERATOR",
    "longbench": "pkvbench.tasks.longbench:LONGBENCH_GENERATOR",
    "ruler_niah": "pkvbench.tasks.ruler:NIAH_GENERATOR",
    "ruler_vt": "pkvbench.tasks.ruler:VT_GENERATOR",
    "ruler_cwe": "pkvbench.tasks.ruler:CWE_GENERATOR",
    "ruler_fwe": "pkvbench.tasks.ruler:FWE_GENERATOR",
    "list_recall": "pkvbench.tasks.longout:LIST_RECALL_GENERATOR",
    "chain_trace": "pkvbench.tasks.longout:CHAIN_TRACE_GENERATOR",
    "passage_copy": "pkvbench.tasks.longout:PASSAGE_COPY_GENERATOR",
    "reasoning": "pkvbench.tasks.reasoning:REASONING_GENERATOR",
    "trec_fewshot": "pkvbench.tasks.trec:TREC_FEWSHOT_GENERATOR",
    "scbench_kv": "pkvbench.tasks.scbench:SCBENCH_KV_GENERATOR",
    "scbench_prefix_suffix": "pkvbench.tasks.scbench:SCBENCH_PREFIX_SUFFIX_GENERATOR",
    "scbench_vt": "pkvbench.tasks.scbench:SCBENCH_VT_GENERATOR",
    "scbench_needles": "pkvbench.tasks.scbench:SCBENCH_NEEDLES_GENERATOR",
    "scbench_data": "pkvbench.tasks.scbench:SCBENCH_DATA_GENERATOR",
}


def _check_generator(name: str, generator: Any, where: str) -> None:
    if not isinstance(generator, Generator):
        raise PkvError(f"{where} is not a pkvbench.tasks.base.Generator")


GENERATORS = Registry("task generator", GENERATOR_ENTRY_POINT_GROUP, BUILTIN_GENERATORS, _check_generator)

# The sample options (``TaskOptions``, ``SampleConfig``) a generator can be shaped by.
SHAPING_OPTIONS = ("lengths", "depths", "max_length", "data_dir", "turns")
# A task's name becomes part of a folder name (``results/runs/<model>/<task+task>``): letters, digits, ``_ . -``.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

# key: (accepted types, required)
_COMMON_KEYS: dict[str, tuple[tuple[type, ...], bool]] = {
    "name": ((str,), True),
    "version": ((int, str), True),
    "description": ((str,), True),
    "generator": ((str,), True),
    "metric": ((str,), True),
    "max_new_tokens": ((int,), True),
    "chat_template": ((bool,), False),
    "stop_strings": ((list,), False),
    "min_new_tokens": ((int,), False),
    "postprocess": ((list,), False),
    "groups": ((list,), False),
}
# Keys that say what a task is called or how it is listed, not how its prompts are built: outside the hash.
_NOT_HASHED = ("description", "groups")


def prompt_hash(raw: dict[str, Any]) -> str:
    """A short hash of everything in a task definition that shapes its prompts, answers and scores."""
    shaping = {k: v for k, v in raw.items() if k not in _NOT_HASHED}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:12]


def validate(raw: Any, where: str) -> TaskSpec:
    """A task definition as read from YAML, checked; every problem is an error that names the file."""
    if not isinstance(raw, dict):
        raise PkvError(f"task file {where}: expected a mapping of keys at the top level")
    if not isinstance(raw.get("name"), str) or not NAME.fullmatch(raw["name"]):
        raise PkvError(
            f"task file {where}: name {raw.get('name')!r} must be letters, digits and _ . - (it names result folders)"
        )
    for group in raw.get("groups") or ():
        if not isinstance(group, str) or not NAME.fullmatch(group):
            raise PkvError(f"task file {where}: group {group!r} must be letters, digits and _ . -")
    for key, (kinds, required) in _COMMON_KEYS.items():
        if key not in raw or raw[key] is None:
            if required:
                raise PkvError(f"task file {where}: missing required key {key!r}")
            continue
        value = raw[key]
        if not isinstance(value, kinds) or (type(value) is bool and bool not in kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise PkvError(f"task file {where}: {key!r} must be {names}, got {value!r}")
    if raw["generator"] not in GENERATORS:
        raise PkvError(f"task file {where}: unknown generator {raw['generator']!r}; valid: {', '.join(GENERATORS)}")
    if raw["metric"] not in METRICS:
        raise PkvError(f"task file {where}: unknown metric {raw['metric']!r}; valid: {', '.join(METRICS)}")
    # Both are imported now, so that a broken plugin is reported when its task is read, before any model loads.
    generator = GENERATORS[raw["generator"]]
    METRICS[raw["metric"]]
    unknown_rules = [r for r in raw.get("postprocess") or () if r not in PREDICTION_RULES]
    if unknown_rules:
        raise PkvError(
            f"task file {where}: unknown postprocess rule {unknown_rules[0]!r}; valid: {', '.join(PREDICTION_RULES)}"
        )
    missing = [
        key if isinstance(key, str) else " or ".join(key)
        for key in generator.keys
        if not (key in raw if isinstance(key, str) else any(k in raw for k in key))
    ]
    if missing:
        raise PkvError(f"task file {where}: generator {raw['generator']} needs the key(s) {', '.join(missing)}")
    known = {*_COMMON_KEYS, *generator.optional, *(k for key in generator.keys for k in _alternatives(key))}
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        raise PkvError(
            f"task file {where}: unknown key {unknown[0]!r} (a misspelled key would be ignored); generator "
            f"{raw['generator']} takes {', '.join(sorted(known))}"
        )
    _check_template(raw, generator, where)
    if raw["max_new_tokens"] < 1 or raw.get("min_new_tokens", 0) < 0:
        raise PkvError(f"task file {where}: max_new_tokens must be at least 1 and min_new_tokens not negative")
    if not all(isinstance(s, str) for s in raw.get("stop_strings") or ()):
        raise PkvError(f"task file {where}: stop_strings must be a list of strings")
    _check_defaults(raw, generator, where)
    return TaskSpec(
        name=raw["name"],
        description=raw["description"],
        generator=raw["generator"],
        metric=raw["metric"],
        max_new_tokens=raw["max_new_tokens"],
        chat_template=bool(raw.get("chat_template", True)),
        stop_strings=tuple(raw.get("stop_strings") or ()),
        min_new_tokens=int(raw.get("min_new_tokens", 0)),
        postprocess=tuple(raw.get("postprocess") or ()),
        config=raw,
        version=str(raw["version"]),
        prompt_hash=prompt_hash(raw),
        source=where,
    )


def _alternatives(key: str | tuple[str, ...]) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else key


def _check_template(raw: dict[str, Any], generator: Generator, where: str) -> None:
    """The prompt template is text that names ``{context}`` (where the context goes: the rest is the question) and
    no field the generator does not fill, so a bad template is refused when read, not after a model load."""
    template = raw[generator.template]
    if not isinstance(template, str):
        raise PkvError(f"task file {where}: {generator.template!r} must be text")
    try:
        named = {field.split(".")[0].split("[")[0] for _, field, _, _ in string.Formatter().parse(template) if field}
    except ValueError as exc:
        raise PkvError(f"task file {where}: {generator.template!r} is not a valid template ({exc})") from None
    if generator.context and "context" not in named:
        raise PkvError(f"task file {where}: {generator.template!r} must name {{context}}, where the context goes")
    unknown = sorted(named - generator.fields) if generator.fields is not None else []
    if unknown:
        raise PkvError(
            f"task file {where}: {generator.template!r} names {{{unknown[0]}}}, which generator {raw['generator']} "
            f"does not fill (it fills {', '.join(sorted(generator.fields))})"
        )


def _check_defaults(raw: dict[str, Any], generator: Generator, where: str) -> None:
    """The default lengths (prompt tokens) and depths (percent) of a generator shaped by them."""
    defaults = raw.get("defaults")
    if "lengths" not in generator.shaped_by:
        return
    if not isinstance(defaults, dict):
        raise PkvError(f"task file {where}: 'defaults' must be a mapping (lengths: [...], ...)")
    lengths = defaults.get("lengths")
    if not isinstance(lengths, list) or not lengths or not all(type(n) is int and n > 0 for n in lengths):
        raise PkvError(f"task file {where}: defaults.lengths must be a list of positive integers (prompt tokens)")
    turns = defaults.get("turns")
    if "turns" in generator.shaped_by and (type(turns) is not int or turns < 1):
        raise PkvError(f"task file {where}: defaults.turns must be a positive integer (the turns of a conversation)")
    if "depths" in generator.shaped_by:
        # One needle: the default depths; several: one depth (slot) per needle.
        name, depths = ("slots", raw.get("slots")) if "needles" in raw else ("defaults.depths", defaults.get("depths"))
        if (
            not isinstance(depths, list)
            or not depths
            or not all(type(d) in (int, float) and 0 <= d <= 100 for d in depths)
            or ("needles" in raw and len(depths) != len(raw["needles"]))
        ):
            what = "one per needle" if "needles" in raw else "a list"
            raise PkvError(f"task file {where}: {name} must be {what} of numbers from 0 to 100 (percent)")


def _yaml_files(root) -> Iterator:
    """Every ``*.yaml`` below ``root`` (a folder or an importlib.resources Traversable), in name order."""
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.is_dir():
            yield from _yaml_files(entry)
        elif entry.name.endswith(".yaml"):
            yield entry


def _read(entry) -> Any:
    try:
        text = entry.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PkvError(f"task file {entry}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    return parse_yaml(text, f"task file {entry}")  # a key given twice is refused, not the last one kept


def env_include_paths() -> tuple[str, ...]:
    return tuple(p for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p.strip())


@dataclass(frozen=True)
class TaskCatalog:
    """Every known task (built-in first, then each included folder's) and the groups they name."""

    tasks: dict[str, TaskSpec]

    def get(self, name: str) -> TaskSpec:
        if name not in self.tasks:
            raise PkvError(f"unknown task {name!r}; valid tasks: {', '.join(self.tasks)}")
        return self.tasks[name]

    @property
    def groups(self) -> dict[str, list[str]]:
        """Groups named by the tasks' ``groups`` lists (``longbench``, ``ruler``, …), tasks in definition order."""
        groups: dict[str, list[str]] = {}
        for spec in self.tasks.values():
            for group in spec.config.get("groups") or ():
                groups.setdefault(group, []).append(spec.name)
        return groups

    def expand(self, names: list[str]) -> list[TaskSpec]:
        """Task and group names (a group stands for its tasks) → task definitions, each once, in the order given."""
        groups = self.groups
        selected: dict[str, TaskSpec] = {}
        for name in names:
            if name in self.tasks:
                selected.setdefault(name, self.tasks[name])
            elif name in groups:
                for member in groups[name]:
                    selected.setdefault(member, self.tasks[member])
            else:
                raise PkvError(
                    f"unknown task {name!r}; valid groups: {', '.join(groups)}; valid tasks: {', '.join(self.tasks)}"
                )
        return list(selected.values())


@cache
def catalog(include_paths: tuple[str, ...] = ()) -> TaskCatalog:
    """The built-in tasks plus those of ``$PKVBENCH_TASKS`` and ``include_paths`` (folders of YAML files)."""
    roots = [importlib.resources.files(BUILTIN_PACKAGE)]
    for folder in (*env_include_paths(), *include_paths):
        path = Path(folder)
        if not path.is_dir():
            raise PkvError(f"task folder {folder} does not exist (from {ENV_VAR} or --include-path)")
        roots.append(path)
    specs: dict[str, TaskSpec] = {}
    for root in roots:
        for entry in _yaml_files(root):
            spec = validate(_read(entry), str(entry))
            if spec.name in specs:
                raise PkvError(f"task {spec.name!r} is defined twice: in {specs[spec.name].source} and in {entry}")
            specs[spec.name] = spec
    if not specs:
        raise PkvError(f"no task definitions found in the package data {BUILTIN_PACKAGE}; reinstall pkvbench")
    return TaskCatalog(specs)


def all_tasks() -> dict[str, TaskSpec]:
    return catalog().tasks


def get_task(name: str) -> TaskSpec:
    return catalog().get(name)


def task_groups() -> dict[str, list[str]]:
    return catalog().groups


def expand_tasks(names: list[str], include_paths: tuple[str, ...] = ()) -> list[TaskSpec]:
    return catalog(tuple(include_paths)).expand(names)


def build_samples(spec: TaskSpec, tokenizer, options: TaskOptions) -> list[Sample]:
    return refuse_repeated_samples(spec.name, GENERATORS[spec.generator].build(tokenizer, spec, options))


def unshaped_sample_options(tasks: list[TaskSpec], options: TaskOptions) -> list[tuple[str, list[str]]]:
    """The sample options given that shape none of ``tasks`` (they would be ignored without a word), each with the
    generators it does shape: ``(option, generators)``, for the caller to refuse in its own spelling of the option."""
    taken = {option for task in tasks for option in GENERATORS[task.generator].shaped_by}
    return [
        (option, [name for name in GENERATORS if option in _shaped_by(name)])
        for option in SHAPING_OPTIONS
        if getattr(options, option) is not None and option not in taken
    ]


def _shaped_by(generator: str) -> tuple[str, ...]:
    try:
        return GENERATORS[generator].shaped_by
    except PkvError:  # a plugin that fails to load is reported by the tasks that name it, not in another's message
        return ()


def requested_prompt_tokens(spec: TaskSpec, options: TaskOptions) -> list[tuple[int, str]]:
    """The prompt sizes a task's samples are asked for, each with how it was asked: ``--lengths`` (or the task's
    default lengths) for generated prompts, ``--max-length`` for data cut to fit. Data a task reads at its own
    length (LongBench without --max-length) is cut to the model's window by the task itself."""
    shaped_by = GENERATORS[spec.generator].shaped_by
    asked = []
    if "lengths" in shaped_by:
        how = "--lengths" if options.lengths else f"{spec.name}'s default length"
        asked += [(length, how) for length in options.lengths or spec.config["defaults"]["lengths"]]
    if "max_length" in shaped_by and options.max_length is not None:
        asked.append((options.max_length, "--max-length"))
    return asked


def check_selection(tasks: list[TaskSpec], samples: dict[str, list[Sample]], options: TaskOptions) -> None:
    """Every ``--sample-id`` names a sample of one of the tasks, and a task with no sample selection has samples
    (an empty data file runs nothing, which should not pass for a result)."""
    if options.sample_ids is None:
        for task in tasks:
            if not samples[task.name]:
                raise PkvError(f"{task.name} has no samples to run (is its data file empty?)")
        return
    known = {sample.sample_id for found in samples.values() for sample in found}
    unknown = [sample_id for sample_id in options.sample_ids if sample_id not in known]
    if unknown:
        forms = "; ".join(f"{task.name}: {GENERATORS[task.generator].ids}" for task in tasks)
        raise PkvError(f"--sample-id {', '.join(unknown)}: no such sample (sample ids are {forms})")


# The task settings ``task_args`` may change, and the kind of value each takes.
TASK_ARGS = {"chat_template": bool, "min_new_tokens": int, "stop_strings": list}


def parse_task_args(task_args: Mapping[str, Any] | Sequence[str]) -> dict[str, Any]:
    """``--task-arg chat_template=false`` (values read as YAML: ``stop_strings=[]``, ``stop_strings=["\\n"]``) or a
    mapping → checked ``{setting: value}``; a setting given twice is refused."""
    if isinstance(task_args, Mapping):
        raw = dict(task_args)
    else:
        raw = {}
        for pair in task_args:
            key, sep, text = str(pair).partition("=")
            if not sep or not key.strip():
                raise PkvError(f"--task-arg {pair!r} is not of the form name=value (e.g. chat_template=false)")
            if key.strip() in raw:
                raise PkvError(f"--task-arg {key.strip()} is given twice; give it once")
            raw[key.strip()] = parse_yaml(text, f"--task-arg {pair!r}") if text.strip() else []
    for key, value in raw.items():
        kind = TASK_ARGS.get(key)
        if kind is None:
            raise PkvError(f"--task-arg {key}: not a task setting; valid: {', '.join(TASK_ARGS)}")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or (kind is int and value < 0):
            raise PkvError(
                f"--task-arg {key}={value!r}: expected {'a non-negative integer' if kind is int else kind.__name__}"
            )
        if kind is list and not all(isinstance(s, str) and s for s in value):
            raise PkvError(f"--task-arg {key}: expected a list of non-empty strings")
    return raw


def with_task_args(task: TaskSpec, task_args: dict[str, Any]) -> TaskSpec:
    """The task with these settings in its definition (its prompt hash changes with them)."""
    if not task_args:
        return task
    return validate({**task.config, **task_args}, f"{task.source} with --task-arg")
