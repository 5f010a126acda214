"""Runs a grid: tasks × samples × policies × budgets, one prefill per sample.

The unit of work is a sample with its whole policy × budget grid (so the prefill is shared); ``--shard i/n`` takes
every n-th unit, and ``run_sample`` is all an executor needs to run one.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tqdm import tqdm

from pkvbench.budgets import Budget
from pkvbench.engine.generation import Engine
from pkvbench.errors import PkvError
from pkvbench.metrics import METRICS, prepare_prediction
from pkvbench.policies.base import Policy
from pkvbench.results import ResultStore, row_key
from pkvbench.tasks.base import Sample, TaskOptions, TaskSpec
from pkvbench.tasks.registry import build_samples, check_selection

Config = tuple[Policy, Budget]


@dataclass
class RunStats:
    written: int = 0
    skipped: int = 0
    prefills: int = 0
    seconds: float = 0.0
    workers_lost: int = 0  # distributed executors: workers that died mid-run (their samples were redone)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based, as written on the command line: ``--shard 2/4``)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = str(text).partition("/")
        try:
            shard = cls(int(index), int(count))
        except ValueError:
            shard = None
        if not sep or shard is None or not 1 <= shard.index <= shard.count:
            raise PkvError(f"--shard {text!r}: write i/n with 1 <= i <= n, e.g. 1/4")
        return shard

    def takes(self, position: int) -> bool:
        return position % self.count == self.index - 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def work_items(
    tasks: list[TaskSpec], tokenizer, options: TaskOptions, shard: Shard | None = None
) -> list[tuple[TaskSpec, Sample]]:
    """Every (task, sample) of the run in a fixed order; a shard keeps every n-th one."""
    samples = {task.name: build_samples(task, tokenizer, options) for task in tasks}
    check_selection(tasks, samples, options)
    items = [(task, sample) for task in tasks for sample in samples[task.name]]
    if shard is not None and shard.index > len(items):
        raise PkvError(f"--shard {shard}: the run has {len(items)} sample(s), none of them for this shard")
    return [item for position, item in enumerate(items) if shard is None or shard.takes(position)]


def row_identity(task: TaskSpec, sample_id: str, policy: Policy, budget: Budget) -> dict:
    return {"task": task.name, "sample_id": sample_id, "policy": policy.label, "budget": budget.value}


def run_sample(
    engine: Engine, task: TaskSpec, sample: Sample, configs: list[Config], max_new_tokens: int | None = None
) -> Iterator[dict]:
    """Prefill ``sample`` once, then yield one result row per configuration as soon as it is decoded."""
    metric = METRICS[task.metric]
    new_tokens = max_new_tokens or task.max_new_tokens
    prefill = engine.prefill(_as_tensor(sample.input_ids), [policy for policy, _ in configs])
    full_cache_decode = None  # every config that keeps the whole prompt decodes to the same tokens
    for policy, budget in configs:
        selection_started = time.perf_counter()
        cache = engine.compress(prefill, policy, budget)
        selection_s = time.perf_counter() - selection_started
        if cache.plan.compressed:
            decoded = engine.decode(prefill, cache, new_tokens, task.stop_strings, task.min_new_tokens)
        else:
            full_cache_decode = full_cache_decode or engine.decode(
                prefill, cache, new_tokens, task.stop_strings, task.min_new_tokens
            )
            decoded = full_cache_decode
        yield {
            **row_identity(task, sample.sample_id, policy, budget),
            "model": engine.loaded.name,
            **task.identity,
            "policy_options": policy.options,
            "budget_tokens": round(sum(cache.kept_per_layer) / len(cache.kept_per_layer), 3),
            "requested_tokens": cache.plan.requested,
            "context_tokens": prefill.context_len,
            "kv_kept": cache.kept_per_layer,
            "kv_bytes": cache.nbytes,
            "pred": decoded.text,
            "answers": sample.answers,
            "score": metric(prepare_prediction(decoded.text, task.postprocess), sample.answers, sample.meta),
            "new_tokens": len(decoded.tokens),
            "prefill_s": round(prefill.seconds, 4),
            "selection_s": round(selection_s, 4),
            "decode_s": round(decoded.seconds, 4),
            **sample.extras,
        }


@dataclass
class GridPlan:
    """What a run still has to do: each (task, sample) with the configurations not yet in the store, in run order."""

    pending: list[tuple[TaskSpec, Sample, list[Config]]]
    total: int  # rows of the whole grid (of this shard)
    skipped: int  # rows the store already holds


def pending_configs(task: TaskSpec, sample: Sample, configs: list[Config], done: set) -> list[Config]:
    return [(p, b) for p, b in configs if row_key(row_identity(task, sample.sample_id, p, b)) not in done]


def plan_grid(
    tasks: list[TaskSpec],
    tokenizer,
    policies: list[Policy],
    budgets: list[Budget],
    options: TaskOptions,
    store: ResultStore,
    shard: Shard | None = None,
) -> GridPlan:
    done = store.done_keys()
    items = work_items(tasks, tokenizer, options, shard)
    configs = [(policy, budget) for policy in policies for budget in budgets]
    pending = [(task, sample, pending_configs(task, sample, configs, done)) for task, sample in items]
    total = len(items) * len(configs)
    left = [(task, sample, todo) for task, sample, todo in pending if todo]
    return GridPlan(left, total, total - sum(len(todo) for _, _, todo in left))


class RowWriter:
    """Where every executor's finished rows go: appended to the store by this one writer, counted, on the bar."""

    def __init__(
        self,
        store: ResultStore,
        plan: GridPlan,
        *,
        started: float,
        quiet: bool = False,
        on_row: Callable[[dict], None] | None = None,
    ):
        self.store = store
        self.on_row = on_row
        self.started = started
        self.stats = RunStats(skipped=plan.skipped)
        self.written: set[tuple[str, str, str, str]] = set()
        # Rows already done start the bar (initial=) instead of being counted as progress: a resumed run's rate and
        # ETA then come from the rows it really computes.
        self.bar = tqdm(
            total=plan.total,
            initial=plan.skipped,
            disable=quiet or not sys.stderr.isatty(),
            unit="run",
            dynamic_ncols=True,
            desc="samples × configs",
        )

    def write(self, row: dict) -> None:
        self.store.append(row)
        self.written.add(row_key(row))
        self.stats.written += 1
        if self.on_row:
            self.on_row(row)
        self.bar.update(1)

    def close(self) -> RunStats:
        self.bar.close()
        self.stats.seconds = time.perf_counter() - self.started
        return self.stats


def run_grid(
    engine: Engine,
    tasks: list[TaskSpec],
    policies: list[Policy],
    budgets: list[Budget],
    options: TaskOptions,
    store: ResultStore,
    *,
    shard: Shard | None = None,
    max_new_tokens: int | None = None,
    quiet: bool = False,
    on_row: Callable[[dict], None] | None = None,
) -> RunStats:
    """The local executor: every pending sample in order, in this process."""
    started = time.perf_counter()
    plan = plan_grid(tasks, engine.tokenizer, policies, budgets, options, store, shard)
    writer = RowWriter(store, plan, started=started, quiet=quiet, on_row=on_row)
    try:
        for task, sample, pending in plan.pending:
            writer.stats.prefills += 1
            for row in run_sample(engine, task, sample, pending, max_new_tokens):
                writer.write(row)
    finally:
        writer.close()
    return writer.stats


def _as_tensor(ids: list[int]):
    import torch

    return torch.tensor([ids], dtype=torch.long)
