"""The Python API: one typed run configuration and one function that runs it.

``evaluate(RunConfig(...))`` is what ``pkvbench run`` does, and ``measure_funnel(FunnelConfig(...))`` what
``pkvbench funnel`` does; the command line only parses its options into these configurations and prints. Run
configs in YAML (``configs/``) build the same ``RunConfig`` (``RunConfig.from_file``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd

from pkvbench import budgets as budget_rules
from pkvbench.budgets import Budget, KVFormat, parse_budgets, parse_memory_budgets
from pkvbench.config import MAX_LAYERS, SEED_MAX, option_name, parse_bool, parse_float, parse_int, shown
from pkvbench.engine.models import (
    ALIASES,
    DEFAULT_MODEL,
    DEVICES,
    DTYPES,
    cached_float_copy,
    check_architecture,
    check_model_name,
    is_gguf_file,
    load_tokenizer,
    locate_gguf,
)
from pkvbench.errors import PkvError
from pkvbench.io import parse_yaml, read_json
from pkvbench.policies.base import Policy
from pkvbench.policies.registry import default_grid
from pkvbench.policies.spec import check_shared_options, parse_option_pairs, parse_policy
from pkvbench.provenance import git_commit, make_deterministic, package_version, provenance, versions
from pkvbench.results import ResultStore, decode_budget_label
from pkvbench.runner import Cell, RunSettings, RunStats, Shard, work_items
from pkvbench.schema import DEFAULT_QUERY_MODE, QUERY_MODES
from pkvbench.tasks.base import TaskOptions, TaskSpec
from pkvbench.tasks.registry import check_sample_options, expand_tasks, requested_prompt_tokens, validate

EXECUTORS = ("local", "ray")


# --- parsing the loose values a user writes ------------------------------------------------------------------------


def as_list(value: Any, what: str) -> list[str]:
    """A comma string or a sequence → a list of non-empty strings; an empty list or item is an error."""
    items = str(value).split(",") if isinstance(value, (str, int, float)) else [str(v) for v in value]
    items = [item.strip() for item in items]
    if not any(items):
        raise PkvError(f"{what} is empty; give a comma-separated list")
    if not all(items):
        raise PkvError(f"{what} {','.join(items)!r} has an empty item; remove the extra comma")
    return items


def parse_numbers(value: Any, what: str, kind: type) -> tuple | None:
    """``--lengths`` / ``--depths``: positive integers or non-negative numbers, each once, in the order given (``-0``
    and ``0`` are one depth)."""
    if value is None:
        return None
    if kind is int:
        values = [parse_int(item, what, minimum=1) for item in as_list(value, what)]
    else:
        values = [parse_float(item, what, minimum=0) for item in as_list(value, what)]
    return tuple(dict.fromkeys(values))


def parse_policies(
    specs: Any, policy_args: Mapping[str, Any] | Sequence[str] = (), protocol: str = "exact"
) -> list[Policy]:
    """Policy specs (``snapkv:window=32``) plus options shared by every policy that has them; each label once."""
    if isinstance(policy_args, Mapping):
        shared = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in policy_args.items()}
    else:
        shared = parse_option_pairs(list(policy_args))
    names = default_grid() if specs is None else as_list(specs, "--policy")
    policies = [parse_policy(spec, shared, protocol) for spec in names]
    check_shared_options(shared, policies)
    return list({p.label: p for p in policies}.values())


def model_slug(model: str) -> str:
    """A model as one folder name: an alias as it is, a hub id ``org/name`` as ``org--name``, a local folder or
    GGUF file by its name."""
    if is_gguf_file(model) or Path(model).is_dir():
        return Path(model).name.removesuffix(".gguf") or "model"
    return model.replace("/", "--")


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


def default_out(kind: str, model: str, tasks: list[TaskSpec]) -> Path:
    """``results/<kind>/<model>/<task+task…>``: where a run goes when no folder is given."""
    return Path("results") / kind / model_slug(model) / "+".join(t.name for t in tasks)


# --- checking a configuration's values ----------------------------------------------------------------------------
# A ``RunConfig`` or ``FunnelConfig`` built in Python gets the checks the command line gives: every number through
# the one parser (``config.parse_int`` / ``parse_float``), flags only true or false, paths and lists of the right
# shape. A wrong type is one ``PkvError`` naming the option, never a TypeError from deep inside.

Check = Callable[[Any, str], Any]


def _whole(minimum: int | None = None, maximum: int | None = None) -> Check:
    return lambda value, what: parse_int(value, what, minimum, maximum)


def _optional(check: Check) -> Check:
    return lambda value, what: None if value is None else check(value, what)


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PkvError(f"{what}: expected a name, got {shown(value)}")
    return value


def _path(value: Any, what: str) -> str | os.PathLike:
    if not isinstance(value, (str, os.PathLike)):
        raise PkvError(f"{what}: expected a path, got {shown(value)}")
    if not os.fspath(value).strip():
        raise PkvError(f"{what} '': an empty path would mean the current folder; give a name")
    return value


def _one_of(choices: Sequence[str]) -> Check:
    def check(value: Any, what: str) -> str:
        if value not in choices:
            raise PkvError(f"{what} {shown(value)}: valid: {', '.join(choices)}")
        return value

    return check


def _single(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _listing(value: Any, what: str) -> Any:
    """A list option: a comma string, one number, or a list of single values."""
    if _single(value) or (isinstance(value, (list, tuple)) and all(_single(item) for item in value)):
        return value
    raise PkvError(f"{what}: expected a comma string or a list of values, got {shown(value)}")


def _paths(value: Any, what: str) -> tuple[str, ...]:
    """Folders: a list of paths, or one comma string (``"a,b"``; one path is one folder, not its characters)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise PkvError(f"{what}: expected a list of folders or a comma string, got {shown(value)}")
    return tuple(os.fspath(_path(item.strip() if isinstance(item, str) else item, what)) for item in items)


def _pairs(value: Any, what: str) -> Mapping[str, Any] | list[str]:
    """Options as a mapping or a list of ``name=value`` (one string: one pair)."""
    if isinstance(value, Mapping):
        return value
    items = [value] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and all(isinstance(item, str) for item in items):
        return list(items)
    raise PkvError(f"{what}: expected a mapping or a list of name=value, got {shown(value)}")


_COMMON_CHECKS: dict[str, Check] = {
    "model": _name,
    "tasks": _listing,
    "lengths": _optional(_listing),
    "depths": _optional(_listing),
    "limit": _optional(_whole(1)),
    "seed": _whole(0, SEED_MAX),
    "data_dir": _optional(_path),
    "verify": parse_bool,
    "max_length": _optional(_whole(1)),
    "sample_ids": _optional(_listing),
    "include_paths": _paths,
    "device": _one_of(DEVICES),
    "dtype": _one_of(DTYPES),
    "attn_implementation": _name,
    "out": _optional(_path),
    "overwrite": parse_bool,
    "quiet": parse_bool,
}
RUN_CHECKS: dict[str, Check] = {
    **_COMMON_CHECKS,
    "policies": _optional(_listing),
    "budgets": _optional(_listing),
    "memory": _optional(_listing),
    "kv_bits": _optional(_listing),
    "kv_group": _whole(1),
    "kv_residual": _whole(0),
    "decode_budgets": _optional(_listing),
    "decode_interval": _whole(1),
    "decode_buffer": _whole(0),
    "policy_args": _pairs,
    "protocol": _name,
    "query_modes": _listing,
    "task_args": _pairs,
    "max_new_tokens": _optional(_whole(1)),
    "decode_batch": _optional(_whole(1)),
    "shard": _optional(_name),
    "executor": _name,
    "ray_address": _optional(_name),
    "workers": _optional(_whole(1)),
    "gpus_per_worker": _optional(lambda value, what: parse_float(value, what, minimum=0)),
}
FUNNEL_CHECKS: dict[str, Check] = {
    **_COMMON_CHECKS,
    "window": _whole(1),
    "sink": _whole(0),
    "top_k": _whole(1),
    "budget": _listing,
}


def checked(config: RunConfig | FunnelConfig) -> Any:
    """``config`` with every value checked and parsed as the command line parses it (``"5"`` → 5)."""
    checks = RUN_CHECKS if isinstance(config, RunConfig) else FUNNEL_CHECKS
    return replace(config, **{name: check(getattr(config, name), option_name(name)) for name, check in checks.items()})


# --- what fits the model -------------------------------------------------------------------------------------------


@cache
def _gguf_context_length(path: str, size: int, mtime_ns: int) -> int | None:
    """``<architecture>.context_length`` from a GGUF file's header (the weights are not read; parsing the header
    still takes a second or two, so it is done once per file version)."""
    import gguf

    reader = gguf.GGUFReader(path)

    def value(name: str):
        field = reader.fields.get(name)
        return field.parts[field.data[0]] if field is not None and field.data else None

    architecture = value("general.architecture")
    length = (
        value(f"{bytes(architecture).decode('utf-8', 'replace')}.context_length") if architecture is not None else None
    )
    return int(length[0]) if length is not None else None


def _config_file(model: str) -> Path | None:
    """A local folder's or a hub model's ``config.json`` (the hub's from its cache, or fetched: a few kB)."""
    if Path(model).is_dir():
        return Path(model) / "config.json" if (Path(model) / "config.json").is_file() else None
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, "config.json"))
    except Exception:  # offline and not cached, no such model, no access: the model load says which, in one line
        return None


def model_context_window(model: str) -> int | None:
    """The positions ``model`` was made for, read from its ``config.json`` or GGUF header without loading it; None
    when that cannot be told (the model load then reports what is wrong with the model).

    A GGUF model's float copy, once made, carries the header's ``context_length`` as ``max_position_embeddings``
    (transformers' GGUF conversion): its ``config.json`` is read instead of the header, which takes seconds to parse
    (gguf-py reads every field, the tokenizer's vocabulary included)."""
    float_copy = cached_float_copy(model)
    if float_copy is None and (model in ALIASES or is_gguf_file(model)):
        path = locate_gguf(ALIASES[model]) if model in ALIASES else Path(model)
        stat = path.stat()
        return _gguf_context_length(str(path), stat.st_size, stat.st_mtime_ns)
    path = _config_file(str(float_copy or model))
    config = read_json(path, "model config") if path is not None else None
    if isinstance(config, dict):  # an architecture pkvbench cannot run is refused before its tokenizer is used
        check_architecture(SimpleNamespace(model_type=config.get("model_type")), model)
    window = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return window if isinstance(window, int) and window > 0 else None


def fit_to_model(
    model: str, tasks: list[TaskSpec], options: TaskOptions, max_new_tokens: int | None, decodes: bool = True
) -> TaskOptions:
    """Refuse, before any sample is built, what the model cannot hold: a requested prompt size (``--lengths``, a
    task's default lengths, ``--max-length``) that with the task's answer (``decodes``) exceeds the model's context
    window. A 10-million-token request fails here in a second instead of tokenizing gigabytes. Returns ``options``
    with the window, which tasks that cut their data to fit read."""
    check_sample_options(tasks, options)
    window = model_context_window(model)
    if window is None:
        return options
    for task in tasks:
        answer = (max_new_tokens or task.max_new_tokens) if decodes else 0
        if answer >= window:
            asked = f"--max-new-tokens {max_new_tokens}" if max_new_tokens else f"{task.name}'s max_new_tokens"
            raise PkvError(
                f"{asked}: an answer of {answer} tokens leaves no room for a prompt in the context window of {model} "
                f"({window} tokens); pass --max-new-tokens below it, or use a model with a longer window"
            )
        for tokens, asked_by in requested_prompt_tokens(task, options):
            if tokens + answer > window:
                room = f"its {answer}-token answer" if answer else "nothing else"
                raise PkvError(
                    f"{asked_by} {tokens}: {task.name}'s prompt with {room} exceeds the context window of {model} "
                    f"({window} tokens); the most a prompt can have is {window - answer}"
                )
    return replace(options, context_window=window)


# --- the run configuration -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Everything a run is: model, tasks, policies × budgets, which samples, where results go, where it runs.

    List-valued fields take a list or a comma string (``tasks="needle,trec"``); ``policies=None`` is the default grid
    (the full cache and the paper's four policies). Values are checked by ``evaluate`` (``PkvError`` says what is
    wrong), exactly as the command line checks them.
    """

    # what runs
    model: str = DEFAULT_MODEL
    tasks: Sequence[str] | str = ("needle",)
    policies: Sequence[str] | str | None = None
    # None: 128 entries, unless memory is given; with a decode budget cr0 (the prefill keeps everything:
    # compression only while decoding)
    budgets: Sequence[str | int | float] | str | None = None
    # Memory budgets instead of entry budgets: fractions of the full cache's bytes at 16 bits per value (0.05) or
    # sizes ("2MiB"); each policy keeps as many entries as fit, in each of kv_bits' formats (docs/memory.md)
    memory: Sequence[str | float] | str | None = None
    # The bits each kept value is stored in: 16, or KIVI's 8, 4, 2 (None: the model's own cache, in its dtype)
    kv_bits: Sequence[int] | str | None = None
    kv_group: int = budget_rules.DEFAULT_GROUP  # KIVI's G: tokens per key group, channels per value group
    kv_residual: int = budget_rules.DEFAULT_RESIDUAL  # KIVI's R: each head's last R kept entries stay in 16 bits
    policy_args: Mapping[str, Any] | Sequence[str] = ()
    # "exact": pkvbench's protocol; "reference": every policy selects as the PyramidKV paper's code (docs/protocol.md);
    # "kvpress": every policy with the settings of kvpress's press of the same rule (docs/kvpress-crosscheck.md)
    protocol: str = "exact"
    # where the question is: "aware" (inside the compressed prompt, the paper's protocol), "agnostic" (added after
    # the context is compressed; one compressed context answers every question), or both
    query_modes: Sequence[str] | str = (DEFAULT_QUERY_MODE,)
    # Task settings for every task that has them: chat_template, min_new_tokens, stop_strings (e.g. the paper's
    # LongBench script: no chat template, at least one new token, no stop but the end token)
    task_args: Mapping[str, Any] | Sequence[str] = ()
    max_new_tokens: int | None = None
    decode_batch: int | None = None  # at most this many configurations of a sample decode together; 1: one at a time
    # Cut the cache back to this many entries per KV head while the answer is written (an axis: "none" for no cut),
    # every decode_interval new tokens, the newest decode_buffer entries always kept (docs/decoding.md)
    decode_budgets: Sequence[str | int] | str | None = None
    decode_interval: int = 16
    decode_buffer: int = 8
    # which samples
    lengths: Sequence[int] | str | None = None
    depths: Sequence[float] | str | None = None
    limit: int | None = None
    seed: int = 0
    data_dir: str | None = None
    verify: bool = True
    max_length: int | None = None
    sample_ids: Sequence[str] | str | None = None
    include_paths: Sequence[str] = ()
    # how the model runs
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    # where results go
    out: str | Path | None = None
    overwrite: bool = False
    shard: str | None = None
    quiet: bool = False
    # where the samples run
    executor: str = "local"
    ray_address: str | None = None
    workers: int | None = None
    gpus_per_worker: float | None = None

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> RunConfig:
        """A YAML run config (keys as ``pkvbench run``'s long options); ``overrides`` win over the file."""
        from pkvbench.config import read_run_config

        names = [f.name for f in fields(cls)]
        return cls(**{**read_run_config(path, names), **overrides})


@dataclass
class ResolvedRun:
    """A ``RunConfig`` checked and parsed: what the executors run."""

    config: RunConfig
    tasks: list[TaskSpec]
    policies: list[Policy]
    budgets: list[Budget]
    options: TaskOptions
    shard: Shard | None
    out: Path
    query_modes: list[str]
    formats: list[KVFormat | None] = field(default_factory=lambda: [None])  # None: the model's own cache
    decode_budgets: list[int | None] = field(default_factory=lambda: [None])  # None: never cut while decoding

    @property
    def memory(self) -> bool:
        return any(b.memory for b in self.budgets)

    @property
    def cells(self) -> list[Cell]:
        """The grid: every policy × budget × query mode × storage format × decode budget. Under memory budgets a policy that keeps a
        fixed set (the full cache) is one cell per format, whatever the budgets: it keeps ``all``."""
        keep_all = [Budget.parse(budget_rules.ALL)]
        return [
            Cell(p, b, m, f, d)
            for p in self.policies
            for b in (keep_all if self.memory and budget_rules.keeps_fixed_set(p) else self.budgets)
            for m in self.query_modes
            for f in self.formats
            for d in self.decode_budgets
        ]

    @property
    def settings(self) -> RunSettings:
        c = self.config
        return RunSettings(
            max_new_tokens=c.max_new_tokens,
            decode_batch=c.decode_batch,
            protocol=c.protocol,
            kv_group=c.kv_group,
            kv_residual=c.kv_residual,
            decode_interval=c.decode_interval,
            decode_buffer=c.decode_buffer,
        )

    @property
    def recorded_options(self) -> dict[str, Any]:
        """``run.json``'s ``options``: what makes two runs the same run (resuming under others is refused). The
        executor and its settings are not among them: another executor may resume a run."""
        c = self.config
        return recorded(
            c,
            self.tasks,
            self.options,
            {
                "policies": [p.label for p in self.policies],
                "budgets": [b.recorded for b in self.budgets],
                "max_new_tokens": c.max_new_tokens,
                "shard": str(self.shard) if self.shard else None,
                "protocol": c.protocol,
                "query_modes": self.query_modes,
                # only where given: a run folder of an earlier version, which had neither, resumes as the same run
                "kv_bits": [f.bits if f else native_bits(c) for f in self.formats] if c.kv_bits is not None else None,
                **(
                    {"kv_group": c.kv_group, "kv_residual": c.kv_residual}
                    if any(f and f.quantized for f in self.formats)
                    else {}
                ),
                # recorded only when cutting while decoding, so that runs from before the option resume as they were
                **(
                    {
                        "decode_budgets": [decode_budget_label(d) for d in self.decode_budgets],
                        "decode_interval": c.decode_interval,
                        "decode_buffer": c.decode_buffer,
                    }
                    if self.decode_budgets != [None]
                    else {}
                ),
            },
        )


def recorded(
    config: RunConfig | FunnelConfig, tasks: list[TaskSpec], options: TaskOptions, own: dict[str, Any]
) -> dict[str, Any]:
    """What ``run.json`` / ``funnel.json`` record as the options: the model, tasks and samples, and the command's
    ``own`` options. As JSON reads them back (tuples are lists)."""
    common = {
        "model": config.model,
        "device": config.device,
        "dtype": config.dtype,
        "attn_implementation": config.attn_implementation,
        "tasks": [t.name for t in tasks],
        "lengths": options.lengths,
        "depths": options.depths,
        "limit": options.limit,
        "seed": options.seed,
        "data_dir": options.data_dir,
        "max_length": options.max_length,
        "sample_ids": options.sample_ids,
        "task_versions": {t.name: t.identity for t in tasks},
    }
    return json.loads(json.dumps({**common, **own}))


def task_options(config: RunConfig | FunnelConfig) -> TaskOptions:
    return TaskOptions(
        lengths=parse_numbers(config.lengths, "--lengths", int),
        depths=parse_numbers(config.depths, "--depths", float),
        limit=config.limit,
        seed=config.seed,
        data_dir=str(config.data_dir) if config.data_dir is not None else None,
        verify=config.verify,
        max_length=config.max_length,
        sample_ids=tuple(as_list(config.sample_ids, "--sample-id")) if config.sample_ids is not None else None,
    )


def resolve(config: RunConfig) -> ResolvedRun:
    """Check every option and parse it; nothing slow happens here."""
    config = checked(config)
    tasks = expand_tasks(list(dict.fromkeys(as_list(config.tasks, "--task"))), tuple(config.include_paths))
    tasks = [with_task_args(task, parse_task_args(config.task_args)) for task in tasks]
    policies = parse_policies(config.policies, config.policy_args, config.protocol)
    decode_budgets = parse_decode_budgets(config.decode_budgets)
    check_decoding(policies, decode_budgets, config.decode_interval, config.decode_buffer)
    budgets = resolve_budgets(config, policies, "cr0" if decode_budgets != [None] else "128")
    formats = resolve_formats(config)
    if decode_budgets != [None] and formats != [None]:
        raise PkvError("--decode-budget with --kv-bits: a cache stored in fewer bits is not cut while decoding yet")
    shard = Shard.parse(config.shard) if config.shard is not None else None
    options = task_options(config)
    if config.executor not in EXECUTORS:
        raise PkvError(f"unknown executor {config.executor!r}; valid: {', '.join(EXECUTORS)}")
    if config.executor != "ray" and (config.ray_address, config.workers, config.gpus_per_worker) != (None, None, None):
        raise PkvError("--ray-address, --workers and --gpus-per-worker go with --executor ray")
    check_model_name(config.model)
    out = Path(config.out) if config.out is not None else default_out("runs", config.model, tasks)
    modes = list(dict.fromkeys(as_list(config.query_modes, "--query-mode")))
    unknown = [m for m in modes if m not in QUERY_MODES]
    if unknown:
        raise PkvError(f"unknown query mode {unknown[0]!r}; valid: {', '.join(QUERY_MODES)}")
    return ResolvedRun(config, tasks, policies, budgets, options, shard, out, modes, formats, decode_budgets)


def resolve_budgets(config: RunConfig, policies: list[Policy], default: str = "128") -> list[Budget]:
    """``--budget`` (entries, fractions of the prompt; ``default`` if not given), or ``--memory`` (bytes), never
    both."""
    if config.memory is None:
        rounding = "half-even" if config.protocol == "reference" else "half-up"
        return parse_budgets(as_list(config.budgets if config.budgets is not None else default, "--budget"), rounding)
    if config.budgets is not None:
        raise PkvError("--memory and --budget together: give one (--memory in bytes, --budget in entries)")
    budgets = parse_memory_budgets(as_list(config.memory, "--memory"))
    fixed = [p.label for p in policies if budget_rules.keeps_fixed_set(p)]
    if len(fixed) == len(policies):
        raise PkvError(
            f"--memory: {', '.join(fixed)} keeps a fixed set of entries (every one), which no memory budget changes; "
            "add a policy that drops entries, or leave out --memory (the full cache at each --kv-bits is one point)"
        )
    return budgets


def native_bits(config: RunConfig) -> int:
    """The width of the model's own cache values: its dtype's (``auto``: float32 on a CPU, bfloat16 on CUDA)."""
    from pkvbench.engine.models import resolve_device, resolve_dtype

    device = config.device
    if device == "auto" and config.dtype == "auto":
        device = resolve_device(device)  # imports torch: only here, where the answer depends on the machine
    dtype = resolve_dtype(config.dtype, device if device != "auto" else "cpu")
    return 32 if dtype == "float32" else 16


def resolve_formats(config: RunConfig) -> list[KVFormat | None]:
    """``--kv-bits``: each value's storage format; the model's own width is its own cache (None), token for
    token."""
    if config.kv_bits is None:
        return [None]
    native = native_bits(config)
    formats: list[KVFormat | None] = []
    for item in as_list(config.kv_bits, "--kv-bits"):
        try:
            bits = int(item)
        except ValueError:
            bits = None
        if bits not in budget_rules.KV_BITS:
            raise PkvError(f"--kv-bits {item}: supported are 2, 4 and 8 (KIVI's integers), 16, and the model's own 32")
        if bits > native:
            raise PkvError(
                f"--kv-bits {bits}: the model computes in {native} bits; its own cache is --kv-bits {native}"
            )
        formats.append(None if bits == native else KVFormat(bits, config.kv_group, config.kv_residual))
    return list(dict.fromkeys(formats))


def parse_decode_budgets(value: Any) -> list[int | None]:
    """``--decode-budget 128,512`` (entries per KV head; ``none``: no cut while decoding) → each once, in order."""
    if value is None:
        return [None]
    parsed: list[int | None] = []
    for item in as_list(value, "--decode-budget"):
        if item.lower() == "none":
            parsed.append(None)
            continue
        try:
            number = int(item)
        except ValueError:
            number = 0
        if number < 1:
            raise PkvError(f"--decode-budget {item!r}: give entries per KV head (a positive integer) or none")
        parsed.append(number)
    return list(dict.fromkeys(parsed))


def check_decoding(policies: list[Policy], decode_budgets: list[int | None], interval: int, buffer: int) -> None:
    """Refuse a decode-time schedule that cannot run: a policy with no decode-time rule, a non-positive interval, a
    negative buffer, a target below the buffer or the policy's own window."""
    targets = [d for d in decode_budgets if d is not None]
    if not targets:
        return
    if interval < 1:
        raise PkvError(f"--decode-interval {interval}: the cache is cut every N new tokens, N at least 1")
    if buffer < 0:
        raise PkvError(f"--decode-buffer {buffer}: the newest entries always kept cannot be negative")
    for policy in policies:
        refusal = policy.decoding_refusal()
        if refusal:
            raise PkvError(f"--decode-budget: {refusal}")
        floor = max(buffer, policy.min_budget)
        if min(targets) < floor:
            what = f"the buffer ({buffer})" if buffer >= policy.min_budget else f"{policy.label}'s window ({floor})"
            raise PkvError(
                f"--decode-budget {min(targets)} is below {what}: a cut keeps at least that many newest entries"
            )


@dataclass
class EvalResult:
    """What a run left in its folder: every row (resumed ones too) and the summary table."""

    out: Path
    rows: pd.DataFrame
    summary: pd.DataFrame
    stats: RunStats
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the user should know (the CLI prints them on stderr)


def evaluate(config: RunConfig, *, on_row: Callable[[dict], None] | None = None) -> EvalResult:
    """Run ``config``: each sample is prefilled once, every policy × budget decoded from that prefill; rows are
    appended to ``<out>/samples.jsonl`` as they finish, then ``summary.csv`` is written. Rerunning the same config into
    the same folder does only what is missing; one process at a time writes a folder (a second is refused).

    Returns the folder's rows and summary as pandas tables. Raises ``PkvError`` (one line: what is wrong) for bad
    options, data or models; ``on_row`` (if given) sees each row as it is written.
    """
    run = resolve(config)
    config = run.config
    if config.executor == "ray":
        from pkvbench.ray_executor import check_ray

        check_ray()
    run.options = fit_to_model(config.model, run.tasks, run.options, config.max_new_tokens)
    store = ResultStore(run.out)
    info: dict[str, Any] = {}
    this_session = session(config.model)

    def record(model_info: dict) -> None:
        info.update(
            {
                "options": run.recorded_options,
                "model": model_info,
                "policies": {p.label: p.options for p in run.policies},
                "executor": config.executor,
                **provenance(config.seed),
                **this_session,
            }
        )
        store.record(info)

    # The folder is checked and locked before the slow model load; it changes only once the model has loaded
    # (``record``), so a run that fails before that leaves it as it was.
    with store.claim(run.recorded_options, overwrite=config.overwrite, session=this_session):
        make_deterministic(config.seed)
        # Every sample is built now, before the model loads and before --overwrite deletes anything: a --sample-id
        # that names no sample, a length too short for a task's prompt, a shard without samples stop the run here.
        items = samples_of(run.tasks, config.model, run.options, run.shard)
        try:
            stats = _execute(run, store, record, on_row, items)
        except BaseException:
            if store.started:  # the finished rows still get their summary; the error is what is reported
                with contextlib.suppress(PkvError):
                    store.write_summary()
            raise
        summary = store.write_summary()
        rows = store.rows()
    notes = [*store.notes, *([note] if (note := store.duplicate_note()) else [])]
    return EvalResult(run.out, pd.DataFrame(rows), summary, stats, info, notes)


def _execute(
    run: ResolvedRun,
    store: ResultStore,
    record: Callable[[dict], None],
    on_row: Callable[[dict], None] | None,
    items: list,
) -> RunStats:
    config = run.config
    if config.executor == "ray":
        from pkvbench.ray_executor import ModelSpec, RaySettings, run_grid_on_ray

        return run_grid_on_ray(
            RaySettings(config.ray_address, config.workers, config.gpus_per_worker),
            ModelSpec(config.model, config.device, config.dtype, config.attn_implementation, config.seed),
            run.tasks,
            run.cells,
            run.options,
            store,
            shard=run.shard,
            settings=run.settings,
            quiet=config.quiet,
            on_model=record,
            on_row=on_row,
            items=items,
        )
    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model
    from pkvbench.runner import run_grid

    loaded = load_model(
        config.model, device=config.device, dtype=config.dtype, attn_implementation=config.attn_implementation
    )
    record(loaded.describe())
    return run_grid(
        Engine(loaded),
        run.tasks,
        run.cells,
        run.options,
        store,
        shard=run.shard,
        settings=run.settings,
        quiet=config.quiet,
        on_row=on_row,
        items=items,
    )


def samples_of(tasks: list[TaskSpec], model: str, options: TaskOptions, shard: Shard | None = None) -> list:
    """Every (task, sample) of a run, built with the model's tokenizer alone (before the model loads)."""
    try:
        return work_items(tasks, load_tokenizer(model), options, shard)
    except ValueError as exc:
        if "chat_template" not in str(exc) and "chat template" not in str(exc):
            raise
        raise PkvError(
            f"the tokenizer of {model} has no chat template, which the tasks use; run them without it with "
            "--task-arg chat_template=false"
        ) from None


def session(model: str) -> dict[str, Any]:
    """What a run records of the software it runs under, and compares when it resumes a folder (``ResultStore.claim``):
    package versions (with the model's own package, for an alias) and the git commit."""
    found = {**versions()}
    if model in ALIASES:
        found["model_package"] = f"{ALIASES[model].distribution}=={package_version(ALIASES[model].distribution)}"
    return {"versions": found, "commit": git_commit()}


# --- the funnel ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FunnelConfig:
    """``pkvbench funnel``: how concentrated each layer's and head's attention is (PyramidKV's premise)."""

    model: str = DEFAULT_MODEL
    tasks: Sequence[str] | str = ("needle",)
    lengths: Sequence[int] | str | None = None
    depths: Sequence[float] | str | None = None
    limit: int | None = None
    seed: int = 0
    data_dir: str | None = None
    verify: bool = True
    max_length: int | None = None
    sample_ids: Sequence[str] | str | None = None
    include_paths: Sequence[str] = ()
    device: str = "auto"
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    window: int = 8  # the last queries whose attention is measured (SnapKV/PyramidKV's window)
    sink: int = 4  # first tokens counted as the attention sink
    top_k: int = 128  # k of the top-k mass statistic
    budget: str | int | float = 128  # the budget whose PyramidKV per-layer allocation is drawn over the curves
    out: str | Path | None = None
    overwrite: bool = False
    quiet: bool = False


@dataclass
class FunnelResult:
    out: Path
    per_layer: pd.DataFrame
    per_head: pd.DataFrame
    verdicts: list[str]
    written: int
    skipped: int
    seconds: float


def measure_funnel(config: FunnelConfig) -> FunnelResult:
    """Prefill each sample once and measure attention concentration per layer and head; write the tables, the
    figure and the verdict into ``config.out`` (rerunning resumes)."""
    from pkvbench import funnel
    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model
    from pkvbench.plots import plot_funnel

    config = checked(config)
    tasks = expand_tasks(list(dict.fromkeys(as_list(config.tasks, "--task"))), tuple(config.include_paths))
    options = task_options(config)
    overlay = parse_budgets(as_list(config.budget, "--budget"))
    if len(overlay) != 1:
        raise PkvError("--budget takes one budget here (the one drawn over the curves)")
    check_model_name(config.model)
    options = fit_to_model(config.model, tasks, options, None, decodes=False)
    out = Path(config.out) if config.out is not None else default_out("funnel", config.model, tasks)
    record = recorded(config, tasks, options, {"window": config.window, "sink": config.sink, "top_k": config.top_k})
    store = funnel.funnel_store(out)
    this_session = session(config.model)
    # As evaluate: checked now, every sample built before the model loads, the folder changed only after the load.
    with store.claim(record, overwrite=config.overwrite, session=this_session):
        make_deterministic(config.seed)
        items = samples_of(tasks, config.model, options)
        loaded = load_model(
            config.model, device=config.device, dtype=config.dtype, attn_implementation=config.attn_implementation
        )
        store.record({"options": record, "model": loaded.describe(), **provenance(config.seed), **this_session})
        engine = Engine(loaded)
        stats = funnel.run_funnel(engine, items, store, config.window, config.sink, config.top_k, quiet=config.quiet)
        report = funnel.write_reports(out, store.rows(), loaded.name, loaded.num_layers, overlay[0], config.sink)
        plot_funnel(report.per_layer, report.overlays, loaded.name, out / funnel.FIGURE)
    return FunnelResult(
        out, report.per_layer, report.per_head, report.verdicts, stats.written, stats.skipped, stats.seconds
    )


def layer_budget_table(
    policies: Any,
    budgets: Any,
    policy_args: Mapping[str, Any] | Sequence[str],
    context: int,
    layers: int,
    protocol: str = "exact",
) -> list[dict[str, Any]]:
    """``pkvbench budgets``: per policy × budget, the per-layer entries the engine would keep on a T-token prompt."""
    from pkvbench.budgets import plan

    context = parse_int(context, "--context", minimum=1)
    layers = parse_int(layers, "--layers", 1, MAX_LAYERS)
    entries = []
    rounding = "half-even" if protocol == "reference" else "half-up"
    for policy in parse_policies(_listing(policies, "--policy"), _pairs(policy_args, "--policy-arg"), protocol):
        for budget in parse_budgets(as_list(_listing(budgets, "--budget"), "--budget"), rounding):
            layer_plan = plan(policy, budget, context, layers)
            entries.append(
                {
                    "policy": policy.label,
                    "budget": budget.value,
                    "context": context,
                    "layers": layers,
                    "requested": layer_plan.requested,
                    "effective": layer_plan.effective,
                    "compressed": layer_plan.compressed,
                    "total": sum(layer_plan.per_layer),
                    "mean": layer_plan.mean,
                    "per_layer": layer_plan.per_layer,
                }
            )
    return entries


__all__ = [
    "EvalResult",
    "FunnelConfig",
    "FunnelResult",
    "RunConfig",
    "evaluate",
    "layer_budget_table",
    "measure_funnel",
    "resolve",
]
