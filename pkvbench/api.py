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
from pathlib import Path
from typing import Any

import pandas as pd

from pkvbench.cell import budgets as budget_rules
from pkvbench.cell import kv_formats
from pkvbench.cell.budgets import (
    DEFAULT_BUDGET,
    DEFAULT_DECODING_BUDGET,
    Budget,
    parse_budgets,
    parse_decode_budgets,
    parse_memory_budgets,
    rounding_for,
)
from pkvbench.cell.kv_formats import KVFormat
from pkvbench.cell.models import placement_of
from pkvbench.cell.schema import DEFAULT_PROTOCOL, EVERY_TURN, MULTI_TURN
from pkvbench.config import (
    MAX_LAYERS,
    RECORDED,
    TASK,
    as_list,
    list_value,
    options_of,
    options_with,
    pair_values,
    parse_int,
)
from pkvbench.engine.models import (
    ALIASES,
    check_model_name,
    load_tokenizer,
    model_context_window,
    model_slug,
)
from pkvbench.errors import PkvError
from pkvbench.options import FunnelConfig, RunConfig, SampleConfig, model_settings
from pkvbench.policies.base import Policy
from pkvbench.policies.spec import parse_policies
from pkvbench.reports.summary import summarize
from pkvbench.run.provenance import git_commit, make_deterministic, package_version, provenance, versions
from pkvbench.run.runner import Cell, RunSettings, RunStats, Shard, load_run_model, work_items
from pkvbench.store.results import ResultStore, decode_budget_label
from pkvbench.tasks.base import TaskOptions, TaskSpec
from pkvbench.tasks.registry import (
    expand_tasks,
    parse_task_args,
    requested_prompt_tokens,
    unshaped_sample_options,
    with_task_args,
)


def default_out(kind: str, model: str, tasks: list[TaskSpec]) -> Path:
    """``results/<kind>/<model>/<task+task…>``: where a run goes when no folder is given."""
    return Path("results") / kind / model_slug(model) / "+".join(t.name for t in tasks)


def expect_config(config: Any, kind: type[SampleConfig], call: str) -> None:
    """Refuse, in one line, what is no ``kind`` (a dict of options, None): the entry points take configurations."""
    if not isinstance(config, kind):
        given = "None" if config is None else f"a {type(config).__name__}"
        raise PkvError(
            f"{call} takes a pkvbench.{kind.__name__}, not {given}; build one with {kind.__name__}(**options) "
            f"or {kind.__name__}.from_file(path)"
            if kind is RunConfig
            else f"{call} takes a pkvbench.{kind.__name__}, not {given}; build one with {kind.__name__}(**options)"
        )


def checked(config: SampleConfig) -> Any:
    """``config`` with every value checked and parsed as the command line parses it (``"5"`` → 5)."""
    expect_config(config, SampleConfig, "checked")
    return replace(config, **{name: o.parse(getattr(config, name)) for name, o in options_of(type(config)).items()})


# --- what fits the model -------------------------------------------------------------------------------------------


def fit_to_model(
    model: str, tasks: list[TaskSpec], options: TaskOptions, max_new_tokens: int | None, decodes: bool = True
) -> TaskOptions:
    """Refuse, before any sample is built, what the model cannot hold: a requested prompt size (``--lengths``, a
    task's default lengths, ``--max-length``) that with the task's answer (``decodes``) exceeds the model's context
    window. A 10-million-token request fails here in a second instead of tokenizing gigabytes. Returns ``options``
    with the window, which tasks that cut their data to fit read."""
    for option, generators in unshaped_sample_options(tasks, options):
        raise PkvError(
            f"{options_of(SampleConfig)[option].flag} shapes none of the tasks asked for "
            f"({', '.join(t.name for t in tasks)}); it shapes the tasks made by the generators {', '.join(generators)} "
            "(see `pkvbench list`)"
        )
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


@dataclass
class ResolvedRun:
    """A ``RunConfig`` checked and parsed: what the executors run."""

    config: RunConfig
    tasks: list[TaskSpec]
    policies: list[Policy]
    budgets: list[Budget]
    options: TaskOptions
    shard: Shard | None
    out: Path | None  # None: a grid alone (``resolve_grid``)
    query_modes: list[str]
    formats: list[KVFormat | None] = field(default_factory=lambda: [None])  # None: the model's own cache
    decode_budgets: list[int | None] = field(default_factory=lambda: [None])  # None: never cut while decoding
    turn_compressions: list[str] = field(default_factory=list)  # a conversation's cuts (with --query-mode multi-turn)

    @property
    def memory(self) -> bool:
        return any(b.memory for b in self.budgets)

    @property
    def cells(self) -> list[Cell]:
        """The grid: every policy × budget × query mode × storage format × decode budget. Under memory budgets a policy that keeps a
        fixed set (the full cache) is one cell per format, whatever the budgets: it keeps ``all``."""
        keep_all = [Budget.parse(budget_rules.ALL)]
        return [
            Cell(p, b, m, f, d, t)
            for p in self.policies
            for b in (keep_all if self.memory and budget_rules.keeps_fixed_set(p) else self.budgets)
            for m in self.query_modes
            for t in (self.turn_compressions if m == MULTI_TURN else [None])
            for f in self.formats
            for d in self.decode_budgets
        ]

    @property
    def settings(self) -> RunSettings:
        return RunSettings(**{f.name: getattr(self.config, f.name) for f in fields(RunSettings)})

    @property
    def recorded_options(self) -> dict[str, Any]:
        """``run.json``'s ``options``: what makes two runs the same run (resuming under others is refused). The
        executor and its settings are not among them: another executor may resume a run."""
        c = self.config
        # an option that shapes another is recorded only where that one is used, decode budgets only where they cut,
        # conversations' options only for conversations: a run folder of an earlier version, which had none of them,
        # resumes as the same run
        groups = dependent_options(self.formats, self.decode_budgets, self.query_modes)
        unused = [name for names, used, *_ in groups if not used for name in names]
        cutting = self.decode_budgets != [None]
        return recorded(
            c,
            self.tasks,
            self.options,
            {
                "policies": [p.label for p in self.policies],
                "budgets": [b.recorded for b in self.budgets],  # memory budgets among them (``mem0.05``)
                "shard": str(self.shard) if self.shard else None,
                "query_modes": self.query_modes,
                "kv_bits": [recorded_format(f, c) for f in self.formats] if c.kv_bits is not None else None,
                "decode_budgets": [decode_budget_label(d) for d in self.decode_budgets] if cutting else UNUSED,
                "turn_compressions": self.turn_compressions or UNUSED,
                "turns": c.turns if c.turns is not None else UNUSED,
                **dict.fromkeys(unused, UNUSED),
            },
        )


UNUSED = object()  # a recorded option this run leaves out of its record


def recorded(
    config: SampleConfig, tasks: list[TaskSpec], options: TaskOptions, resolved: dict[str, Any]
) -> dict[str, Any]:
    """What ``run.json`` / ``funnel.json`` record as the options: each field marked ``RECORDED``, as the run
    resolved it (``resolved``; the samples' options as ``options`` holds them; else the field's value; ``UNUSED``:
    left out), and each task's version. As JSON reads them back (tuples are lists)."""
    values = {"tasks": [t.name for t in tasks], **{o.name: getattr(options, o.name) for o in task_fields(config)}}
    values.update(resolved)
    record = {o.name: values.get(o.name, getattr(config, o.name)) for o in options_with(type(config), RECORDED)}
    record = {name: value for name, value in record.items() if value is not UNUSED}
    return json.loads(json.dumps({**record, "task_versions": {t.name: t.identity for t in tasks}}))


def task_fields(config: SampleConfig) -> list:
    return options_with(type(config), TASK)


def task_options(config: SampleConfig) -> TaskOptions:
    """How the samples are chosen: the (checked) fields marked ``TASK``."""
    return TaskOptions(**{o.name: getattr(config, o.name) for o in task_fields(config)})


# Options that only shape another (KIVI's group and residual, the decode-time schedule): None in a RunConfig, their
# ``implied`` value once the option they shape is given; given without it they would be ignored, so they are refused
# (as --workers without --executor ray).
def dependent_options(
    formats: list[KVFormat | None], decode_budgets: list[int | None], modes: Sequence[str] = ()
) -> tuple:
    """(the fields, whether this run uses what they shape, what they set, what they need) of each group of options
    that only shapes another."""
    return (
        (("kv_group", "kv_residual"), any(f and f.kivi for f in formats), "KIVI's formats", "--kv-bits 8, 4 or 2"),
        (
            ("decode_interval", "decode_buffer"),
            decode_budgets != [None],
            "the cuts while decoding",
            "a --decode-budget (not none)",
        ),
        (("turn_compressions", "turn_answers"), MULTI_TURN in modes, "conversations", f"--query-mode {MULTI_TURN}"),
    )


def with_dependent_options(
    config: RunConfig, formats: list[KVFormat | None], decode_budgets: list[int | None], modes: list[str] = ()
) -> RunConfig:
    """Refuse ``--kv-group``/``--kv-residual`` where no format of the run is KIVI's (8, 4 or 2 bits),
    ``--decode-interval``/``--decode-buffer`` where no decode budget cuts and ``--turn-compression``/
    ``--turn-answers`` where no question is asked in turn; return ``config`` with their defaults filled in."""
    options = options_of(RunConfig)
    for names, used, purpose, needed in dependent_options(formats, decode_budgets, modes):
        given = [options[name].flag for name in names if getattr(config, name) is not None]
        if given and not used:
            one = len(given) == 1
            raise PkvError(
                f"{' and '.join(given)} only {'sets' if one else 'set'} {purpose}, which this run has none of: "
                f"give {needed} with {'it' if one else 'them'}, or leave {'it' if one else 'them'} out "
                f"(alone {'it' if one else 'they'} would be ignored)"
            )
    defaults = {
        name: o.implied for name, o in options.items() if o.implied is not None and getattr(config, name) is None
    }
    return replace(config, **defaults)


def resolve(config: RunConfig) -> ResolvedRun:
    """Check every option and parse it; nothing slow happens here."""
    expect_config(config, RunConfig, "resolve")
    config = checked(config)
    tasks = expand_tasks(list(dict.fromkeys(as_list(config.tasks, "--task"))), tuple(config.include_paths))
    tasks = [with_task_args(task, parse_task_args(config.task_args)) for task in tasks]
    run = _resolve_grid(config)
    config = run.config
    shard = Shard.parse(config.shard) if config.shard is not None else None
    if config.executor != "ray" and (config.ray_address, config.workers, config.gpus_per_worker) != (None, None, None):
        raise PkvError("--ray-address, --workers and --gpus-per-worker go with --executor ray")
    out = Path(config.out) if config.out is not None else default_out("runs", config.model, tasks)
    return replace(run, tasks=tasks, options=task_options(config), shard=shard, out=out)


def resolve_grid(config: RunConfig) -> ResolvedRun:
    """The grid ``config`` names (policies × budgets × query modes × storage formats × decode budgets) and how its
    cells run, checked and parsed by ``pkvbench run``'s rules and in its words, without tasks: what lm-eval's backend
    runs (``lm_eval.grid.GridSpec``). Nothing slow happens here."""
    expect_config(config, RunConfig, "resolve_grid")
    return _resolve_grid(checked(config))


def _resolve_grid(config: RunConfig) -> ResolvedRun:
    policies = parse_policies(config.policies, config.policy_args, config.protocol)
    decode_budgets = parse_decode_budgets(config.decode_budgets)
    formats = resolve_formats(config)
    modes = list(config.query_modes)
    config = with_dependent_options(config, formats, decode_budgets, modes)
    turn_compressions = check_turns(config, policies, formats, decode_budgets) if MULTI_TURN in modes else []
    formats = [replace(f, group=config.kv_group, residual=config.kv_residual) if f and f.kivi else f for f in formats]
    check_decoding(policies, decode_budgets, config.decode_interval, config.decode_buffer)
    default = DEFAULT_DECODING_BUDGET if decode_budgets != [None] else DEFAULT_BUDGET
    budgets = resolve_budgets(config, policies, default)
    if decode_budgets != [None] and formats != [None]:
        raise PkvError("--decode-budget with --kv-bits: a cache stored in fewer bits is not cut while decoding yet")
    check_model_name(config.model)
    placement_of(config.device_map, config.max_memory, config.offload_folder)
    return ResolvedRun(
        config, [], policies, budgets, TaskOptions(), None, None, modes, formats, decode_budgets, turn_compressions
    )


def check_turns(
    config: RunConfig, policies: list[Policy], formats: list[KVFormat | None], decode_budgets: list[int | None]
) -> list[str]:
    """``--turn-compression``'s values, and a refusal of what a conversation cannot carry yet: a cache stored in
    fewer bits, cuts while the answer is written, and — compressed every turn — a policy with no rule for a cache
    that is not a prompt (its cut is the one ``--decode-budget`` makes, between turns)."""
    compressions = list(config.turn_compressions)
    if formats != [None]:
        raise PkvError(
            f"--query-mode {MULTI_TURN} with --kv-bits: a cache stored in fewer bits is not carried across turns yet"
        )
    if decode_budgets != [None]:
        raise PkvError(
            f"--query-mode {MULTI_TURN} with --decode-budget: a conversation's cache is not cut while an answer is "
            "written yet"
        )
    if EVERY_TURN in compressions:
        for policy in policies:
            refusal = policy.decoding_refusal()
            if refusal:
                raise PkvError(
                    f"--turn-compression {EVERY_TURN} cuts by the policy's rule on the cache between turns: {refusal}"
                )
    return compressions


def resolve_budgets(config: RunConfig, policies: list[Policy], default: str = DEFAULT_BUDGET) -> list[Budget]:
    """``--budget`` (entries, fractions of the prompt; ``default`` if not given), or ``--memory`` (bytes), never
    both."""
    if config.memory is None:
        budgets = as_list(config.budgets if config.budgets is not None else default, "--budget")
        return parse_budgets(budgets, rounding_for(config.protocol))
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


def recorded_format(fmt: KVFormat | None, config: RunConfig) -> int | str:
    """A ``--kv-bits`` value as ``run.json`` records it: bits as a number (as runs before named formats did), a named
    format as its label (``fp8``, ``tq3:qjl=true``)."""
    if fmt is None:
        return native_bits(config)
    return fmt.bits if fmt.codec == kv_formats.KIVI else str(fmt)


def native_bits(config: RunConfig) -> int:
    """The width of the model's own cache values: its dtype's (``auto``: float32 on a CPU, bfloat16 on CUDA)."""
    from pkvbench.engine.models import resolve_device, resolve_dtype

    device = config.device
    if device == "auto" and config.dtype == "auto":
        device = resolve_device(device)  # imports torch: only here, where the answer depends on the machine
    dtype = resolve_dtype(config.dtype, device if device != "auto" else "cpu")
    return 32 if dtype == "float32" else 16


def resolve_formats(config: RunConfig) -> list[KVFormat | None]:
    """``--kv-bits``: each value's storage format (``kv_formats.parse_format``); the model's own width is its own
    cache (None), token for token."""
    if config.kv_bits is None:
        return [None]
    native = native_bits(config)
    formats: list[KVFormat | None] = []
    for item in as_list(config.kv_bits, "--kv-bits"):
        fmt = kv_formats.parse_format(item)  # KIVI's group and residual: with_dependent_options
        if fmt.codec == kv_formats.KIVI and fmt.bits > native:
            raise PkvError(
                f"--kv-bits {fmt.bits}: the model computes in {native} bits; its own cache is --kv-bits {native}"
            )
        formats.append(None if fmt == KVFormat(native) else fmt)
    return list(dict.fromkeys(formats))


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


def evaluate(config: RunConfig | ResolvedRun, *, on_row: Callable[[dict], None] | None = None) -> EvalResult:
    """Run ``config``: each sample is prefilled once, every policy × budget decoded from that prefill; rows are
    appended to ``<out>/samples.jsonl`` as they finish, then ``summary.csv`` is written. Rerunning the same config into
    the same folder does only what is missing; one process at a time writes a folder (a second is refused).

    Returns the folder's rows and summary as pandas tables. Raises ``PkvError`` (one line: what is wrong) for bad
    options, data or models; ``on_row`` (if given) sees each row as it is written. A config already resolved
    (``resolve``) is not checked again.
    """
    if not isinstance(config, ResolvedRun):
        expect_config(config, RunConfig, "evaluate")
    run = config if isinstance(config, ResolvedRun) else resolve(config)
    config = run.config
    if config.executor == "ray":
        from pkvbench.run.ray_executor import check_ray

        check_ray()
    run.options = fit_to_model(config.model, run.tasks, run.options, config.max_new_tokens)
    store = ResultStore(run.out)
    with RunFolder(store, run.recorded_options, config.model, config.seed, config.overwrite) as folder:
        # Every sample is built now, before the model loads and before --overwrite deletes anything: a --sample-id
        # that names no sample, a length too short for a task's prompt, a shard without samples stop the run here.
        items = samples_of(run.tasks, config.model, run.options, run.shard)
        check_model_fit(run, items)

        def record(model_info: dict) -> None:
            policies = {p.label: p.options for p in run.policies}
            folder.record(model_info, policies=policies, executor=config.executor)

        stats = _execute(run, store, record, on_row, items)
    notes = [*store.notes, *([note] if (note := store.duplicate_note()) else [])]
    return EvalResult(run.out, pd.DataFrame(folder.rows), folder.summary, stats, folder.info, notes)


class RunFolder:
    """A run's folder from start to end, as every command that writes rows keeps it (``with RunFolder(...)``): checked
    and locked before anything slow (``ResultStore.claim``: a folder of other options, or in use, is refused), the
    run seeded; ``record`` hands over the run's record once the model has loaded, which the store writes with the
    first row (only then does a folder being replaced, ``overwrite``, lose its previous files); at the end the
    summary of every row — also when the run fails part-way, for the rows it finished (the error is what is
    reported). ``tabulate``: the summary of the rows (None: the run writes its own tables, as the funnel)."""

    def __init__(
        self,
        store: ResultStore,
        options: dict[str, Any],
        model: str,
        seed: int,
        overwrite: bool,
        tabulate: Callable[[list[dict]], pd.DataFrame] | None = summarize,
    ):
        self.store, self.options, self.seed, self.overwrite, self.tabulate = store, options, seed, overwrite, tabulate
        self.session = session(model)
        self.info: dict[str, Any] = {}  # the run's record
        self.summary: pd.DataFrame | None = None
        self.rows: list[dict] = []

    def __enter__(self) -> RunFolder:
        self.store.claim(self.options, overwrite=self.overwrite, session=self.session)
        make_deterministic(self.seed)
        return self

    def record(self, model_info: dict[str, Any], **more: Any) -> None:
        """The run's record (its options, the model loaded, ``more``, provenance), written with the first row."""
        self.info = {"options": self.options, "model": model_info, **more, **provenance(self.seed), **self.session}
        self.store.record_with_first_row(self.info)

    def __exit__(self, kind, error, traceback) -> None:
        store = self.store
        try:
            if self.tabulate is None:
                return
            if error is None:
                self.summary = store.write_summary(self.tabulate(store.rows()))
                self.rows = store.rows()
            elif store.started:  # the finished rows still get their summary; the error is what is reported
                with contextlib.suppress(PkvError):
                    store.write_summary(self.tabulate(store.rows()))
        finally:
            store.close()


def check_model_fit(run: ResolvedRun, items: list) -> None:
    """What the model's config and the prompts' lengths decide, checked before the model loads and so before
    ``--overwrite`` deletes anything: a KIVI group that does not divide the head size, a memory budget below what a
    cell needs. (A model whose config cannot be read here is checked once loaded, before its first row.)"""
    from pkvbench.engine.models import model_shape
    from pkvbench.run.runner import check_formats, check_memory, check_policies, check_prompts

    shape = model_shape(run.config.model, native_bits(run.config))
    if shape is None:
        return
    cells = run.cells
    check_formats(shape, cells)
    check_policies(shape, cells, run.config.model)
    pending = [(task, sample, cells) for task, sample in items]
    check_memory(shape, pending)
    check_prompts(shape, pending, run.config.max_new_tokens, run.config.model)


def _execute(
    run: ResolvedRun,
    store: ResultStore,
    record: Callable[[dict], None],
    on_row: Callable[[dict], None] | None,
    items: list,
) -> RunStats:
    config = run.config
    grid = (run.tasks, run.cells, run.options, store)
    how = {"shard": run.shard, "settings": run.settings, "quiet": config.quiet, "on_row": on_row, "items": items}
    if config.executor == "ray":
        from pkvbench.run.ray_executor import ModelSpec, RaySettings, run_grid_on_ray

        workers = RaySettings(config.ray_address, config.workers, config.gpus_per_worker)
        model = ModelSpec(**model_settings(config), seed=config.seed)
        return run_grid_on_ray(workers, model, *grid, on_model=record, **how)
    from pkvbench.engine.generation import Engine
    from pkvbench.run.runner import run_grid

    loaded = load_run_model(config)
    record(loaded.describe())
    return run_grid(Engine(loaded), *grid, **how)


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
    from pkvbench.engine.generation import Engine
    from pkvbench.reports.figures.plots import plot_funnel
    from pkvbench.run import funnel

    expect_config(config, FunnelConfig, "measure_funnel")
    config = checked(config)
    tasks = expand_tasks(list(dict.fromkeys(as_list(config.tasks, "--task"))), tuple(config.include_paths))
    options = task_options(config)
    overlay = parse_budgets(as_list(config.budget, "--budget"))
    if len(overlay) != 1:
        raise PkvError("--budget takes one budget here (the one drawn over the curves)")
    check_model_name(config.model)
    placement_of(config.device_map, config.max_memory, config.offload_folder)
    options = fit_to_model(config.model, tasks, options, None, decodes=False)
    out = Path(config.out) if config.out is not None else default_out("funnel", config.model, tasks)
    store = funnel.funnel_store(out)
    # As evaluate: checked now, every sample built before the model loads, the folder changed only after the load.
    with RunFolder(store, recorded(config, tasks, options, {}), config.model, config.seed, config.overwrite, None) as f:
        items = samples_of(tasks, config.model, options)
        loaded = load_run_model(config)
        f.record(loaded.describe())
        engine = Engine(loaded)
        stats = funnel.run_funnel(engine, items, store, config.window, config.sink, config.top_k, quiet=config.quiet)
        report = funnel.write_reports(
            out, store.rows(), loaded.name, engine.geometry.num_layers, overlay[0], config.sink
        )
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
    protocol: str = DEFAULT_PROTOCOL,
) -> list[dict[str, Any]]:
    """``pkvbench budgets``: per policy × budget, the per-layer entries the engine would keep on a T-token prompt."""
    from pkvbench.cell.budgets import plan

    context = parse_int(context, "--context", minimum=1)
    layers = parse_int(layers, "--layers", 1, MAX_LAYERS)
    entries = []
    for policy in parse_policies(list_value(policies, "--policy"), pair_values(policy_args, "--policy-arg"), protocol):
        for budget in parse_budgets(as_list(list_value(budgets, "--budget"), "--budget"), rounding_for(protocol)):
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
    "SampleConfig",
    "evaluate",
    "layer_budget_table",
    "measure_funnel",
    "resolve",
]
