"""The Python API: one typed run configuration and one function that runs it.

``evaluate(RunConfig(...))`` is what ``pkvbench run`` does, and ``measure_funnel(FunnelConfig(...))`` what
``pkvbench funnel`` does; the command line only parses its options into these configurations and prints. Run
configs in YAML (``configs/``) build the same ``RunConfig`` (``RunConfig.from_file``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from pkvbench.budgets import Budget, parse_budgets
from pkvbench.engine.models import ALIASES, DEFAULT_MODEL, check_model_name, is_gguf_file, locate_gguf
from pkvbench.errors import PkvError
from pkvbench.io import read_json
from pkvbench.policies.base import Policy
from pkvbench.policies.registry import default_grid
from pkvbench.policies.spec import check_shared_options, parse_option_pairs, parse_policy
from pkvbench.provenance import make_deterministic, provenance
from pkvbench.results import ResultStore, decode_budget_label
from pkvbench.runner import QUERY_MODES, Cell, RunSettings, RunStats, Shard
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
    """``--lengths`` / ``--depths``: positive integers or non-negative numbers, each once, in the order given."""
    if value is None:
        return None
    values = []
    for item in as_list(value, what):
        try:
            number = kind(item)
        except ValueError:
            raise PkvError(f"{what}: {item!r} is not {'an integer' if kind is int else 'a number'}") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise PkvError(f"{what}: {item!r} is not a finite number")
        if number < 0 or (kind is int and number == 0):
            raise PkvError(f"{what}: {item!r} must be positive")
        values.append(number)
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
    mapping → checked ``{setting: value}``."""
    if isinstance(task_args, Mapping):
        raw = dict(task_args)
    else:
        raw = {}
        for pair in task_args:
            key, sep, text = str(pair).partition("=")
            if not sep or not key.strip():
                raise PkvError(f"--task-arg {pair!r} is not of the form name=value (e.g. chat_template=false)")
            try:
                raw[key.strip()] = yaml.safe_load(text) if text.strip() else []
            except yaml.YAMLError:
                raise PkvError(f"--task-arg {pair!r}: the value is not valid YAML") from None
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
    """The positions ``model`` was made for, read from its GGUF header or ``config.json`` without loading it; None
    when that cannot be told (the model load then reports what is wrong with the model)."""
    if model in ALIASES or is_gguf_file(model):
        path = locate_gguf(ALIASES[model]) if model in ALIASES else Path(model)
        stat = path.stat()
        return _gguf_context_length(str(path), stat.st_size, stat.st_mtime_ns)
    path = _config_file(model)
    config = read_json(path, "model config") if path is not None else None
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
        if answer >= window:  # the reasoning sets' answers (up to 32k tokens) are for models with the room
            raise PkvError(
                f"{task.name}'s answers of up to {answer} tokens exceed the context window of {model} ({window} "
                "tokens); pass --max-new-tokens below it, or use a model with a longer window"
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
    # None: 128, or with a decode budget cr0 (the prefill keeps everything: compression only while decoding)
    budgets: Sequence[str | int | float] | str | None = None
    policy_args: Mapping[str, Any] | Sequence[str] = ()
    # "exact": pkvbench's protocol; "reference": every policy selects as the PyramidKV paper's code (docs/protocol.md)
    protocol: str = "exact"
    # where the question is: "aware" (inside the compressed prompt, the paper's protocol), "agnostic" (added after
    # the context is compressed; one compressed context answers every question), or both
    query_modes: Sequence[str] | str = ("aware",)
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

    def with_(self, **changes: Any) -> RunConfig:
        return replace(self, **changes)


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
    decode_budgets: list[int | None] = field(default_factory=lambda: [None])

    @property
    def cells(self) -> list[Cell]:
        """The grid: every policy × budget × query mode × decode budget."""
        return [
            Cell(p, b, m, d)
            for p in self.policies
            for b in self.budgets
            for m in self.query_modes
            for d in self.decode_budgets
        ]

    @property
    def settings(self) -> RunSettings:
        c = self.config
        return RunSettings(
            max_new_tokens=c.max_new_tokens,
            decode_batch=c.decode_batch,
            protocol=c.protocol,
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
    tasks = expand_tasks(list(dict.fromkeys(as_list(config.tasks, "--task"))), tuple(config.include_paths))
    tasks = [with_task_args(task, parse_task_args(config.task_args)) for task in tasks]
    policies = parse_policies(config.policies, config.policy_args, config.protocol)
    rounding = "half-even" if config.protocol == "reference" else "half-up"
    decode_budgets = parse_decode_budgets(config.decode_budgets)
    check_decoding(policies, decode_budgets, config.decode_interval, config.decode_buffer)
    budget_given = config.budgets if config.budgets is not None else ("cr0" if decode_budgets != [None] else "128")
    budget_texts = budget_given if isinstance(budget_given, str) else [str(b) for b in budget_given]
    budgets = parse_budgets(budget_texts, rounding)
    shard = Shard.parse(config.shard) if config.shard is not None else None
    options = task_options(config)
    if config.max_new_tokens is not None and config.max_new_tokens < 1:
        raise PkvError("--max-new-tokens must be at least 1")
    if config.decode_batch is not None and config.decode_batch < 1:
        raise PkvError("--decode-batch must be at least 1")
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
    return ResolvedRun(config, tasks, policies, budgets, options, shard, out, modes, decode_budgets)


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
    if config.executor == "ray":
        from pkvbench.ray_executor import check_ray

        check_ray()
    run.options = fit_to_model(config.model, run.tasks, run.options, config.max_new_tokens)
    store = ResultStore(run.out)
    info: dict[str, Any] = {}

    def record(model_info: dict) -> None:
        info.update(
            {
                "options": run.recorded_options,
                "model": model_info,
                "policies": {p.label: p.options for p in run.policies},
                "executor": config.executor,
                **provenance(config.seed),
            }
        )
        store.record(info)

    # The folder is checked and locked before the slow model load; it changes only once the model has loaded
    # (``record``), so a run that fails before that leaves it as it was.
    with store.claim(run.recorded_options, overwrite=config.overwrite):
        make_deterministic(config.seed)
        try:
            stats = _execute(run, store, record, on_row)
        except BaseException:
            if store.started:  # the finished rows still get their summary; the error is what is reported
                with contextlib.suppress(PkvError):
                    store.write_summary()
            raise
        summary = store.write_summary()
        rows = store.rows()
    notes = [note] if (note := store.duplicate_note()) else []
    return EvalResult(run.out, pd.DataFrame(rows), summary, stats, info, notes)


def _execute(
    run: ResolvedRun, store: ResultStore, record: Callable[[dict], None], on_row: Callable[[dict], None] | None
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
    )


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
    from pkvbench.runner import work_items

    tasks = expand_tasks(list(dict.fromkeys(as_list(config.tasks, "--task"))), tuple(config.include_paths))
    options = task_options(config)
    overlay = parse_budgets([str(config.budget)] if not isinstance(config.budget, str) else config.budget)
    if len(overlay) != 1:
        raise PkvError("--budget takes one budget here (the one drawn over the curves)")
    for name in ("window", "top_k"):
        if getattr(config, name) < 1:
            raise PkvError(f"--{name.replace('_', '-')} must be at least 1")
    if config.sink < 0:
        raise PkvError("--sink must not be negative")
    check_model_name(config.model)
    options = fit_to_model(config.model, tasks, options, None, decodes=False)
    out = Path(config.out) if config.out is not None else default_out("funnel", config.model, tasks)
    record = recorded(config, tasks, options, {"window": config.window, "sink": config.sink, "top_k": config.top_k})
    store = funnel.funnel_store(out)
    with store.claim(record, overwrite=config.overwrite):  # as evaluate: checked now, changed after the load
        make_deterministic(config.seed)
        loaded = load_model(
            config.model, device=config.device, dtype=config.dtype, attn_implementation=config.attn_implementation
        )
        store.record({"options": record, "model": loaded.describe(), **provenance(config.seed)})
        engine = Engine(loaded)
        items = work_items(tasks, engine.tokenizer, options)
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

    entries = []
    rounding = "half-even" if protocol == "reference" else "half-up"
    for policy in parse_policies(policies, policy_args, protocol):
        for budget in parse_budgets(budgets, rounding):
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
