"""lm-eval's requests through pkvbench's engine: every configuration of a grid from one prefill per context.

Nothing here imports lm-eval: the backend (``backend.py``) hands over token ids and generation settings, and gets
one answer per configuration back. The configurations are ``runner.Cell``s, parsed from model args by the same
rules as ``pkvbench run``'s options (``api``), and a generation request runs as a one-question sample through
``runner.run_sample`` — the code ``pkvbench run`` runs a sample's grid with, so the tokens are the same.

- **generate_until**: the context is prefilled once with the full cache; each configuration compresses it (the whole
  context with ``query_mode=aware``; with ``agnostic``, the context up to where ``question_split`` last occurs, the
  rest fed over the compressed cache) and all decode together, greedily, until a stop string or ``max_gen_toks``.
- **loglikelihood**: the context but its last token is compressed (``aware``; ``agnostic``: up to the split), then
  the last context token and the continuation are fed over the compressed cache, and the continuation's
  log-probabilities read from those positions (``engine/scoring.py``). So every continuation token — the first too —
  is predicted from the compressed cache; were the whole context compressed, the first token would come from the
  full-cache prefill, and a one-token answer (a multiple-choice letter) would not feel compression at all.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pkvbench import api
from pkvbench.cell.schema import AGNOSTIC, AWARE, MULTI_TURN, arrange
from pkvbench.config import LIST, MODEL_ARG, PAIR, Option, options_with, whole
from pkvbench.errors import PkvError
from pkvbench.run.runner import (
    Cell,
    RunSettings,
    check_formats,
    check_memory,
    check_policies,
    load_run_model,
    row_identity,
    run_sample,
)
from pkvbench.store.results import row_key
from pkvbench.tasks.base import Sample, TaskSpec


def model_arg_name(declared: Option) -> str:
    """A run option's name as a model arg: its flag's, with underscores (``--kv-bits``: ``kv_bits``)."""
    return declared.flag.removeprefix("--").replace("-", "_")


# The model args: the run options marked MODEL_ARG (options.py), named as their flags. A list option's values (a grid's
# axis, the policies' options) are separated by "+" through ``lm_eval --model_args`` (whose values cannot hold a
# comma), by "+" or "," from Python or ``pkvbench lm-eval``.
MODEL_ARGS = {model_arg_name(declared): declared for declared in options_with(api.RunConfig, MODEL_ARG)}
OTHER_NAMES = {"pretrained": "model"}  # what lm-eval's hf backend calls it
# What lm-eval hands every backend (``create_from_arg_string``'s additional config), of no use to this one: the
# engine batches a request's configurations itself.
IGNORED_ARGS = ("batch_size", "max_batch_size")
OWN_ARGS = ("question_split", "max_length")
# What a generation runs as in runner.run_sample (lm-eval scores the answer: the metric is a placeholder), and what its
# row records of it that is not an lm-eval task's.
STAND_IN_TASK = TaskSpec("lm-eval", "an lm-eval request", "lm-eval", "string_match_part", 0, False, {})
STAND_IN = ("task_version", "task_hash")


def grid_values(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [str(v).strip() for v in value]
    return [part.strip() for part in re.split(r"[+,]", str(value))]


@dataclass
class GridSpec:
    """The model args, checked: the run configuration (model, device, dtype, the grid's axes) and the cells."""

    config: api.RunConfig
    cells: list[Cell]
    question_split: str | None = None  # agnostic: the question starts where this text last occurs in the context
    max_length: int | None = None  # the longest context + answer (None: the model's window)
    resolved: api.ResolvedRun | None = None  # the grid as ``pkvbench run`` resolves its options
    args: dict[str, Any] = field(default_factory=dict)  # as given, for the record

    @property
    def settings(self) -> RunSettings:
        return self.resolved.settings

    @classmethod
    def parse(cls, model_args: Mapping[str, Any]) -> GridSpec:
        """Check every model arg before anything slow, by ``pkvbench run``'s rules and in its words (``api.resolve_grid``,
        the resolver ``run`` uses); a bad one is one line naming what to do (``PkvError``)."""
        given = {k: v for k, v in model_args.items() if v is not None and k not in IGNORED_ARGS}
        known = (*MODEL_ARGS, *OTHER_NAMES, *OWN_ARGS)
        for name, value in given.items():
            if name not in known:
                hint = (
                    f" (a grid's values go in one arg separated by '+': policy=full+{name})"
                    if value in ("", True)
                    else ""
                )
                raise PkvError(f"model arg {name!r} is not one of pkvbench's: {', '.join(known)}{hint}")
        for other, name in OTHER_NAMES.items():
            if other in given and name in given:
                raise PkvError(f"model args {name} and {other} both name the model; give one")
        fields: dict[str, Any] = {}
        for name, value in given.items():
            declared = MODEL_ARGS.get(OTHER_NAMES.get(name, name))
            if declared is None:
                continue  # one of OWN_ARGS
            if declared.kind in (LIST, PAIR):
                values = grid_values(value)
                twice = sorted({v for v in values if values.count(v) > 1})
                if twice:
                    raise PkvError(f"model arg {name}={'+'.join(values)} names {twice[0]} twice; give each value once")
                value = values
            fields[declared.name] = value
        run = api.resolve_grid(api.RunConfig(**fields))
        if MULTI_TURN in run.query_modes:
            raise PkvError(
                f"query mode {MULTI_TURN}: lm-eval's requests are single questions, not conversations; run "
                f"conversations with pkvbench run --query-mode {MULTI_TURN}"
            )
        split = given.get("question_split")
        if AGNOSTIC in run.query_modes and not split:
            raise PkvError(
                "query mode agnostic needs question_split=TEXT (--question-split TEXT): where the question starts in "
                "lm-eval's context (its last occurrence), so that the context before it is compressed and the rest fed "
                "on top"
            )
        if split is not None and AGNOSTIC not in run.query_modes:
            raise PkvError(
                "question_split (--question-split) only sets where the question starts for query mode agnostic, which "
                "this run has none of: give --query-mode agnostic with it, or leave it out (alone it would be ignored)"
            )
        # the shapes of values parsed per name (the same values named twice in other spellings, 128 and 128.0)
        for name, parsed in (("policy", run.policies), ("budget", run.budgets), ("kv_bits", run.formats)):
            if name in given and len(parsed) < len(grid_values(given[name])):
                raise PkvError(f"model arg {name}={given[name]} names one value twice; give each value once")
        max_length = None if given.get("max_length") is None else whole(1)(given["max_length"], "max_length")
        return cls(run.config, run.cells, split, max_length, run, dict(given))

    def split_at(self, context: str) -> int | None:
        """Where the question starts in a context's text: the last occurrence of ``question_split`` (None where it
        does not occur, or only at the very start: then there is no context before the question to compress)."""
        at = context.rfind(self.question_split) if self.question_split else -1
        return at if at > 0 else None

    def missing_split(self) -> PkvError:
        return PkvError(
            f"query mode agnostic: question_split={self.question_split!r} does not occur in a context; choose text "
            "that starts every request's question"
        )

    def check_model(self) -> None:
        """What the model's config decides, checked before anything slow as ``pkvbench run`` checks it (before lm-eval
        indexes a task, before the model loads): a family pkvbench refuses, a KIVI group that does not divide the
        head size."""
        from pkvbench.engine.models import model_context_window, model_shape

        model = self.config.model
        model_context_window(model)  # refuses an architecture pkvbench cannot run, from its config alone
        shape = model_shape(model, api.native_bits(self.config))
        if shape is not None:
            check_formats(shape, self.cells)


def cell_label(cell: Cell) -> str:
    """A configuration's name, also its folder's: ``snapkv_b128``, ``full_ball``, ``snapkv_b64_agnostic_kv4_d128``."""
    parts = [cell.policy.label, f"b{cell.budget.recorded}"]
    if cell.query_mode != AWARE:
        parts.append(cell.query_mode)
    if cell.kv is not None:
        parts.append(f"kv{cell.kv.spec}")
    if cell.decode_budget is not None:
        parts.append(f"d{cell.decode_budget}")
    return re.sub(r"[^A-Za-z0-9.=-]+", "-", "_".join(parts))


@dataclass(frozen=True)
class Generation:
    """One lm-eval generation request as token ids: the context, where its question starts (None: nowhere), the
    answer's limit and stop strings."""

    context: tuple[int, ...]
    question_at: int | None
    max_gen_toks: int
    until: tuple[str, ...]


@dataclass(frozen=True)
class Continuation:
    """One lm-eval loglikelihood request as token ids."""

    context: tuple[int, ...]
    question_at: int | None
    continuation: tuple[int, ...]


class Grid:
    """The loaded model and the grid's cells; answers every request under every cell, each request once."""

    def __init__(self, spec: GridSpec, engine=None):
        from pkvbench.engine.generation import Engine

        self.spec = spec
        if engine is None:
            engine = Engine(load_run_model(spec.config))
        self.engine = engine
        check_formats(engine.shape, spec.cells)
        check_policies(engine.shape, spec.cells, engine.loaded.name)
        self.generated: dict[Generation, list[dict]] = {}  # per request, per cell: run_sample's row
        self.scored: dict[Continuation, list[dict]] = {}  # per request, per cell: log-probability, greedy, measures

    @property
    def labels(self) -> list[str]:
        return [cell_label(cell) for cell in self.spec.cells]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # --- generation ----------------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Generation]) -> list[list[dict]]:
        """Each request's rows, one per cell (``runner.run_sample``'s, whose ``pred`` is the raw answer)."""
        for request in dict.fromkeys(requests):
            if request not in self.generated:
                self.generated[request] = self._generate(request)
        return [self.generated[request] for request in requests]

    def _generate(self, request: Generation) -> list[dict]:
        cut = request.question_at if request.question_at is not None else len(request.context)
        if AGNOSTIC in self.spec.resolved.query_modes and cut >= len(request.context):
            raise self.spec.missing_split()
        sample = Sample.one_question("0", list(request.context), cut, [])
        task = dataclasses.replace(STAND_IN_TASK, max_new_tokens=request.max_gen_toks, stop_strings=request.until)
        cells = self.spec.cells
        check_memory(self.engine.shape, [(task, sample, cells)])
        rows = {row_key(row): row for row in run_sample(self.engine, task, sample, cells, self.spec.settings)}
        return [rows[row_key(row_identity(task, sample.row_id(sample.questions[0]), cell))] for cell in cells]

    # --- log-likelihoods -------------------------------------------------------------------------------------------

    def loglikelihood(self, requests: Sequence[Continuation]) -> list[list[dict]]:
        """Each request's ``{"logprob", "greedy", measures…}`` per cell; one prefill per context."""
        todo = [r for r in dict.fromkeys(requests) if r not in self.scored]
        by_context: dict[tuple, list[Continuation]] = {}
        for request in todo:
            by_context.setdefault((request.context, request.question_at), []).append(request)
        for (context, question_at), group in by_context.items():
            self._score_context(context, question_at, group)
        return [self.scored[request] for request in requests]

    def _score_context(self, context: tuple[int, ...], question_at: int | None, group: list[Continuation]) -> None:
        import torch

        from pkvbench.engine.scoring import score_many

        engine, cells = self.engine, self.spec.cells
        modes = {cell.query_mode for cell in cells}
        if len(context) < 2:
            raise PkvError("a loglikelihood request with an empty context has nothing to compress; not supported")
        aware_cut = len(context) - 1
        if AGNOSTIC in modes and (question_at is None or question_at >= len(context)):
            raise self.spec.missing_split()
        cuts = {AWARE: aware_cut, AGNOSTIC: question_at}
        prefill = engine.prefill(
            torch.tensor([context[: max(cuts[m] for m in modes)]]),
            [cell.policy for cell in cells],
            cuts=tuple(cuts[m] for m in modes),
        )
        caches = [engine.compress(prefill, cell.policy, cell.budget, cuts[cell.query_mode], cell.kv) for cell in cells]
        measures = [self._measures(cache) for cache in caches]
        for request in group:
            results: list[dict | None] = [None] * len(cells)
            for mode in modes:
                members = [i for i, cell in enumerate(cells) if cell.query_mode == mode]
                cut, targets = cuts[mode], request.continuation
                feed = (*context[cut:], *targets[:-1])
                scored = score_many(engine, [caches[i] for i in members], cut, feed, targets)
                for i, result in zip(members, scored):
                    results[i] = {"logprob": result.logprob, "greedy": result.greedy, **measures[i]}
            self.scored[request] = results

    def _measures(self, cache) -> dict:
        """What a result row records of a compressed cache (as ``runner``'s rows do)."""
        full = self.engine.geometry.full_bytes(cache.plan.context_len)
        return {
            "budget_tokens": round(sum(cache.kept_per_layer) / len(cache.kept_per_layer), 3),
            "requested_tokens": cache.plan.requested,
            "context_tokens": cache.plan.context_len,
            "kv_bytes": cache.nbytes,
            "kv_entries": cache.kept.entries,
            "memory_fraction": round(cache.nbytes / full, 6),
        }


def cell_key(cell_or_row: Cell | dict) -> tuple:
    """What tells a configuration's rows from another's: a row's key without its task and document."""
    row = cell_or_row if isinstance(cell_or_row, dict) else row_identity(STAND_IN_TASK, "", cell_or_row)
    return row_key(row)[2:]


def result_row(spec: GridSpec, engine_name: str, cell: Cell, task: str, doc_id: Any, values: dict) -> dict:
    """A line of pkvbench's samples.jsonl for one lm-eval document under one cell: identity, configuration and
    ``values`` (score, pred, answers and what was measured), ordered by the schema."""
    identity = {**row_identity(STAND_IN_TASK, str(doc_id), cell), "task": task}
    own = {"model": engine_name, "protocol": spec.settings.protocol, "policy_options": cell.policy.options}
    # a generation's row comes from runner.run_sample, made for a stand-in task: its identity and task fields go
    return arrange({**identity, **own, **{k: v for k, v in values.items() if k not in (*identity, *STAND_IN)}})
