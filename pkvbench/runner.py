"""Runs a grid: tasks × samples × policies × budgets, one prefill per sample."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from pkvbench.budgets import Budget
from pkvbench.engine.generation import Engine
from pkvbench.metrics import METRICS
from pkvbench.policies import Policy
from pkvbench.results import ResultStore, row_key
from pkvbench.tasks.base import TaskOptions, TaskSpec
from pkvbench.tasks.registry import build_samples


@dataclass
class RunStats:
    written: int = 0
    skipped: int = 0
    prefills: int = 0
    seconds: float = 0.0


def run_grid(
    engine: Engine,
    tasks: list[TaskSpec],
    policies: list[Policy],
    budgets: list[Budget],
    options: TaskOptions,
    store: ResultStore,
    *,
    max_new_tokens: int | None = None,
    quiet: bool = False,
    on_row: Callable[[dict], None] | None = None,
) -> RunStats:
    started = time.perf_counter()
    stats = RunStats()
    done = store.done_keys()
    work = [(task, build_samples(task, engine.tokenizer, options)) for task in tasks]
    configs = [(policy, budget) for policy in policies for budget in budgets]
    total = sum(len(samples) for _, samples in work) * len(configs)
    bar = tqdm(total=total, disable=quiet or not sys.stderr.isatty(), unit="run", dynamic_ncols=True)
    for task, samples in work:
        metric = METRICS[task.metric]
        new_tokens = max_new_tokens or task.max_new_tokens
        for sample in samples:
            pending = [
                (p, b) for p, b in configs if row_key(_key_row(task, sample.sample_id, p, b)) not in done
            ]
            bar.update(len(configs) - len(pending))
            stats.skipped += len(configs) - len(pending)
            if not pending:
                continue
            prefill = engine.prefill(_as_tensor(sample.input_ids), [p for p, _ in pending])
            stats.prefills += 1
            full_cache_decode = None  # every config that keeps the whole prompt decodes to the same tokens
            for policy, budget in pending:
                selection_started = time.perf_counter()
                cache = engine.compress(prefill, policy, budget)
                selection_s = time.perf_counter() - selection_started
                if cache.plan.compressed:
                    decoded = engine.decode(prefill, cache, new_tokens, task.stop_strings)
                else:
                    full_cache_decode = full_cache_decode or engine.decode(prefill, cache, new_tokens, task.stop_strings)
                    decoded = full_cache_decode
                row = {
                    **_key_row(task, sample.sample_id, policy, budget),
                    "model": engine.loaded.name,
                    "policy_options": policy.options,
                    "budget_tokens": round(sum(cache.kept_per_layer) / len(cache.kept_per_layer), 3),
                    "requested_tokens": cache.plan.requested,
                    "context_tokens": prefill.context_len,
                    "kv_kept": cache.kept_per_layer,
                    "kv_bytes": cache.nbytes,
                    "pred": decoded.text,
                    "answers": sample.answers,
                    "score": metric(decoded.text, sample.answers, sample.meta),
                    "new_tokens": len(decoded.tokens),
                    "prefill_s": round(prefill.seconds, 4),
                    "selection_s": round(selection_s, 4),
                    "decode_s": round(decoded.seconds, 4),
                    **sample.extras,
                }
                store.append(row)
                stats.written += 1
                if on_row:
                    on_row(row)
                bar.update(1)
    bar.close()
    stats.seconds = time.perf_counter() - started
    return stats


def _key_row(task: TaskSpec, sample_id: str, policy: Policy, budget: Budget) -> dict:
    return {"task": task.name, "sample_id": sample_id, "policy": policy.label, "budget": budget.value}


def _as_tensor(ids: list[int]):
    import torch

    return torch.tensor([ids], dtype=torch.long)
