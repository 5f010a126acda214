"""Runs a grid: tasks × samples × policies × budgets, one prefill per sample.

The unit of work is a sample with its whole policy × budget grid (so the prefill is shared); ``--shard i/n`` takes
every n-th unit, and ``run_sample`` is all an executor needs to run one.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tqdm import tqdm

from pkvbench.cell import budgets, kv_formats
from pkvbench.cell.budgets import Budget
from pkvbench.cell.fingerprints import fingerprint
from pkvbench.cell.kv_formats import KVFormat
from pkvbench.cell.schema import AGNOSTIC, AWARE, DEFAULT_QUERY_MODE, EVERY_TURN, MODEL_ANSWERS, MULTI_TURN, arrange
from pkvbench.config import int_text
from pkvbench.engine.generation import CompressedCache, Engine, Prefill
from pkvbench.engine.latent import check_policies as check_latent_policies
from pkvbench.engine.models import LoadedModel, ModelShape
from pkvbench.engine.shrinking import start_from
from pkvbench.engine.turns import Conversation, answer_request, extend
from pkvbench.errors import PkvError
from pkvbench.metrics.functions import prepare_prediction
from pkvbench.metrics.registry import METRICS
from pkvbench.options import RunSettings, model_settings  # RunSettings: RunConfig's fields marked SETTING
from pkvbench.policies.base import Policy
from pkvbench.store.results import ResultStore, row_key
from pkvbench.tasks.base import Question, Sample, TaskOptions, TaskSpec
from pkvbench.tasks.registry import build_samples, check_selection


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
            shard = cls(int_text(index), int_text(count))
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


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid: a policy at a budget, with the question inside the compressed prompt
    (``aware``) or added after compression (``agnostic``), its kept entries stored as ``kv`` says (None: the
    model's own cache, in its dtype; docs/memory.md), and, with a ``decode_budget``, the cache cut back to that many
    entries per KV head while the answer is written (``engine/shrinking.py``)."""

    policy: Policy
    budget: Budget
    query_mode: str = DEFAULT_QUERY_MODE
    kv: KVFormat | None = None
    decode_budget: int | None = None
    turn_compression: str | None = None  # a conversation's (``multi-turn``): compressed once, or every turn


def row_identity(task: TaskSpec, sample_id: str, cell: Cell) -> dict:
    stored = {} if cell.kv is None else {"kv_native": False, **kv_fields(cell.kv)}
    turns = {} if cell.turn_compression is None else {"turn_compression": cell.turn_compression}
    return {
        "task": task.name,
        "sample_id": sample_id,
        "policy": cell.policy.label,
        "budget": cell.budget.recorded,
        "query_mode": cell.query_mode,
        **stored,
        "decode_budget": cell.decode_budget,
        **turns,
    }


def load_run_model(config) -> LoadedModel:
    """The model as a run's model options say (``options.model_settings``: a ``RunConfig``'s, a ``ModelSpec``'s)."""
    from pkvbench.engine.models import load_model

    settings = model_settings(config)
    return load_model(settings.pop("model"), **settings)


def kv_fields(fmt: KVFormat) -> dict:
    """How a row records its storage: bits per value, KIVI's group and residual, and a named format with its options
    (None for KIVI's integers, 16 bits and the model's own cache)."""
    named = str(fmt) if fmt.codec != kv_formats.KIVI else None
    return {"kv_bits": fmt.bits, "kv_group": fmt.group, "kv_residual": fmt.residual, "kv_format": named}


@dataclass
class _Job:
    """One row to compute: a cell, a question, the compressed cache and which decode request answers it."""

    cell: Cell
    question: Question
    cache: CompressedCache
    selection_s: float
    request: int
    prefill: Prefill
    fmt: KVFormat  # how the cache is stored (the engine's native format for the model's own cache)


def run_sample(
    engine: Engine, task: TaskSpec, sample: Sample, cells: list[Cell], settings: RunSettings | None = None
) -> Iterator[dict]:
    """Run every cell on every question of ``sample`` and yield one row each.

    One prefill serves the whole grid: the first question's prompt, whose first tokens are the context, with
    statistics recorded at both ends (the context's for query-agnostic cells). Each cell's cache is compressed once
    — an agnostic cell's once for all questions — and all of the sample's caches decode together (in batches of at
    most ``settings.decode_batch`` rows). Only a query-aware cell's later questions need prefills of their own (their
    question is part of what is compressed).
    """
    settings = settings or RunSettings()
    # The texts every row of a question carries, decoded once per question rather than once per row.
    texts = {q.question_id: sample_texts(engine.tokenizer, sample, q) for q in sample.questions}
    modes = {cell.query_mode for cell in cells}
    first, context_len = sample.questions[0], len(sample.context_ids)
    aware_len = len(sample.prompt(first))
    prefill = engine.prefill(
        _as_tensor(sample.prompt(first) if AWARE in modes else sample.context_ids),
        [cell.policy for cell in cells],
        cuts=tuple(n for n, mode in ((aware_len, AWARE), (context_len, AGNOSTIC)) if mode in modes)
        + ((context_len,) if MULTI_TURN in modes else ()),
        decoding=[
            cell.policy for cell in cells if cell.decode_budget is not None or cell.turn_compression == EVERY_TURN
        ],
    )
    conversations = [cell for cell in cells if cell.query_mode == MULTI_TURN]
    cells = [cell for cell in cells if cell.query_mode != MULTI_TURN]
    if conversations:
        yield from _Conversations(engine, task, sample, settings, prefill, conversations).rows(texts)
    if not cells:
        return
    batch = _Batch(engine, task, settings)
    for cell in cells:
        started = time.perf_counter()
        cut = context_len if cell.query_mode == AGNOSTIC else aware_len
        cache = engine.compress(prefill, cell.policy, cell.budget, cut, cell.kv)
        selection_s = time.perf_counter() - started
        for question in sample.questions if cell.query_mode == AGNOSTIC else [first]:
            batch.add(cell, question, prefill, cache, selection_s)
    yield from batch.rows(sample, texts)

    aware_cells = [cell for cell in cells if cell.query_mode == AWARE]
    for question in sample.questions[1:] if aware_cells else []:
        batch = _Batch(engine, task, settings)
        own = engine.prefill(
            _as_tensor(sample.prompt(question)),
            [cell.policy for cell in aware_cells],
            decoding=[cell.policy for cell in aware_cells if cell.decode_budget is not None],
        )
        for cell in aware_cells:
            started = time.perf_counter()
            cache = engine.compress(own, cell.policy, cell.budget, fmt=cell.kv)
            batch.add(cell, question, own, cache, time.perf_counter() - started)
        yield from batch.rows(sample, texts)


class _Batch:
    """The caches of one prefill's cells, decoded together: each cell × question a job, each job pointing at the
    decode request that writes its answer. Uncompressed caches stored alike decode to the same tokens, so they
    share one request per query mode, question and format."""

    def __init__(self, engine: Engine, task: TaskSpec, settings: RunSettings):
        self.engine, self.task, self.settings = engine, task, settings
        self.jobs: list[_Job] = []
        self.requests: list = []
        self.shared: dict[tuple, int] = {}

    def add(self, cell: Cell, question: Question, source: Prefill, cache: CompressedCache, selection_s: float) -> None:
        engine, task, settings = self.engine, self.task, self.settings
        key = (cell.query_mode, question.question_id, id(source), cell.kv)
        schedule = engine.schedule(cell.policy, cell.decode_budget, settings.decode_interval, settings.decode_buffer)
        own = cache.plan.compressed or schedule is not None  # else the full cache, never cut: decoded once
        if own or key not in self.shared:
            self.requests.append(
                engine.request(
                    source,
                    cache,
                    settings.max_new_tokens or task.max_new_tokens,
                    task.stop_strings,
                    task.min_new_tokens,
                    question.ids if cell.query_mode == AGNOSTIC else None,
                    schedule,
                )
            )
            if not own:
                self.shared[key] = len(self.requests) - 1
        which = self.shared[key] if not own else len(self.requests) - 1
        self.jobs.append(_Job(cell, question, cache, selection_s, which, source, cell.kv or engine.native_format))

    def rows(self, sample: Sample, texts: dict[str, dict]) -> Iterator[dict]:
        """Decode every request (in batches of at most ``decode_batch`` rows) and yield each job's row."""
        decoded = self.engine.decode_many(self.requests, self.settings.decode_batch)
        for job in self.jobs:
            yield _row(self.engine, self.task, sample, job, decoded[job.request], self.settings, texts)


@dataclass
class _Line:
    """One conversation of a sample and the cells it answers for. Cells whose conversations are the same so far share
    one line: a policy at a budget compressed once and every turn, until the first cut; every cache that keeps
    everything and is never cut."""

    cells: list[Cell]
    conversation: Conversation
    plan: budgets.LayerPlan
    selection_s: float
    pending: list[int]  # what the next turn feeds before its answer: its question (after the last answer, if held)
    cut_s: float = 0.0  # seconds of this turn's cut back to the budget (every turn)

    @property
    def cutting(self) -> list[Cell]:
        return [cell for cell in self.cells if cell.turn_compression == EVERY_TURN]


class _Conversations:
    """A sample's questions asked in turn, one conversation per configuration (``--query-mode multi-turn``).

    The context is compressed once per policy and budget from the shared prefill; each turn's question extends each
    conversation's own cache (``engine/turns.py``; nothing of the context is computed again), the answers of all
    conversations decode together as the grid's do, and the answer — the model's own, or the reference
    (``turn_answers``) — becomes part of the conversation before the next question. Compressed every turn, a cache
    is cut back to its budget after each answer. One row per cell and turn."""

    def __init__(
        self, engine: Engine, task: TaskSpec, sample: Sample, settings: RunSettings, prefill: Prefill, cells: list[Cell]
    ):
        if not sample.conversable:
            raise PkvError(
                f"{task.name} {sample.sample_id}: its questions cannot be asked in turn (--query-mode {MULTI_TURN} "
                "needs a task whose questions follow one another: scbench_*, needle-multi, niah_multiquery_each)"
            )
        self.engine, self.task, self.sample, self.settings, self.prefill = engine, task, sample, settings, prefill
        context_len = len(sample.context_ids)
        lines: dict[tuple, _Line] = {}
        for cell in cells:
            same = (cell.policy.label, cell.budget.recorded, cell.kv)
            if same in lines:
                lines[same].cells.append(cell)
                continue
            started = time.perf_counter()
            cache = engine.compress(prefill, cell.policy, cell.budget, context_len, cell.kv)
            conversation = Conversation.of(cache.kept, context_len)
            first = list(sample.questions[0].ids)
            lines[same] = _Line([cell], conversation, cache.plan, time.perf_counter() - started, first)
        self.lines: list[_Line] = []
        whole: _Line | None = None  # every cache that keeps everything and is never cut: one conversation
        for line in lines.values():
            line.conversation = self._recording(line)
            if line.conversation.schedule is None and not line.plan.compressed:
                if whole is not None:
                    whole.cells += line.cells
                    continue
                whole = line
            self.lines.append(line)

    def _recording(self, line: _Line) -> Conversation:
        """The line's conversation, recording from its start what a cut after a turn scores from where one of its
        cells is cut every turn (a budget that keeps everything never is)."""
        cell = line.cutting[0] if line.cutting else None
        if cell is None or cell.budget.keeps_all:
            return line.conversation
        target = max(line.plan.requested, cell.policy.min_budget)
        schedule = self.engine.schedule(cell.policy, target, interval=1, buffer=0)
        if schedule is None:  # a policy that keeps everything
            return line.conversation
        conversation = line.conversation
        start = start_from(self.prefill.stats_at[line.plan.context_len], conversation.kept.positions, schedule.needs)
        return dataclasses.replace(conversation, schedule=schedule, start=start)

    def rows(self, texts: dict[str, dict]) -> Iterator[dict]:
        engine, settings, task = self.engine, self.settings, self.task
        questions = self.sample.questions
        for turn, question in enumerate(questions, start=1):
            lines = self.lines
            conversations = [line.conversation for line in lines]
            extended = extend(engine, conversations, [line.pending for line in lines], False, settings.decode_batch)
            for line, done in zip(lines, extended):
                line.conversation = done.conversation
            max_new_tokens = settings.max_new_tokens or task.max_new_tokens
            requests = [
                answer_request(done, max_new_tokens, task.stop_strings, task.min_new_tokens) for done in extended
            ]
            answers = engine.decode_many(requests, settings.decode_batch)
            asked = len(question.ids if turn == 1 else question.follow_ids)
            for line, answer in zip(lines, answers):
                for cell in line.cells:
                    yield self._row(cell, line, question, turn, asked, answer, texts)
            if turn < len(questions):
                self._close_turn(question, questions[turn], answers)

    def _close_turn(self, question: Question, following: Question, answers: list) -> None:
        """Each conversation takes the turn's answer (the model's, or the reference). The cells of a line that are cut
        every turn go on as a line of their own, extended by the answer and cut back to their budget now; the others
        take the answer with the next question."""
        follow = following.follow_ids
        lines, cutting, spoken_by = [], [], []
        for line, answer in zip(self.lines, answers):
            spoken = list(answer.tokens if self.settings.turn_answers == MODEL_ANSWERS else question.reply_ids)
            # an answer that ended its own turn (with the end-of-turn token the next question starts with)
            rest = follow[1:] if spoken and follow and spoken[-1] == follow[0] else list(follow)
            line.cut_s = 0.0
            cut_cells = line.cutting if line.conversation.schedule is not None and spoken else []
            kept_cells = [cell for cell in line.cells if cell not in cut_cells]
            if cut_cells:
                cut = dataclasses.replace(line, cells=cut_cells, pending=rest)
                cutting.append(cut)
                spoken_by.append(spoken)
                lines.append(cut)
            if kept_cells:
                conversation = line.conversation
                if cut_cells:  # no cell of it is cut any more: nothing more to record
                    conversation = dataclasses.replace(conversation, schedule=None, start=None)
                lines.append(
                    dataclasses.replace(line, cells=kept_cells, conversation=conversation, pending=spoken + rest)
                )
        if cutting:
            started = time.perf_counter()
            conversations = [line.conversation for line in cutting]
            done = extend(self.engine, conversations, spoken_by, True, self.settings.decode_batch)
            seconds = (time.perf_counter() - started) / len(cutting)
            for line, extended in zip(cutting, done):
                line.conversation, line.cut_s = extended.conversation, seconds
        self.lines = lines

    def _row(self, cell: Cell, line: _Line, question: Question, turn: int, asked: int, answer, texts) -> dict:
        """The turn's row: the grid's, of the cache the answer was written from (the conversation so far)."""
        engine, conversation = self.engine, line.conversation
        held = CompressedCache(conversation.kept, line.plan)
        job = _Job(cell, question, held, line.selection_s, 0, self.prefill, engine.native_format)
        turn_fields = {
            "question_tokens": asked,
            "turn": turn,
            "turn_answers": self.settings.turn_answers,
            "conversation_tokens": conversation.position,
            "kept_fingerprint": fingerprint(conversation.kept_positions()),
            "memory_fraction": round(held.nbytes / engine.geometry.full_bytes(conversation.position), 6),
            "selection_s": round(line.selection_s if turn == 1 else line.cut_s, 4),
        }
        return _row(engine, self.task, self.sample, job, answer, self.settings, texts, turn_fields)


def _row(
    engine: Engine,
    task: TaskSpec,
    sample: Sample,
    job: _Job,
    answer,
    settings: RunSettings,
    texts: dict[str, dict],
    turn: dict | None = None,
) -> dict:
    """A row of the grid; ``turn``: a conversation's turn, its own fields (``_Conversations._row``)."""
    cache, question = job.cache, job.question
    metric = METRICS[task.metric]
    full_bytes = engine.geometry.full_bytes(cache.plan.context_len)
    row = {
        **row_identity(task, sample.row_id(question), job.cell),
        "model": engine.loaded.name,
        **task.identity,
        "protocol": settings.protocol,
        "policy_options": job.cell.policy.options,
        "budget_tokens": round(sum(cache.kept_per_layer) / len(cache.kept_per_layer), 3),
        "requested_tokens": cache.plan.requested,
        "context_tokens": cache.plan.context_len,  # the tokens compressed: the whole prompt, or the context
        "question_tokens": len(question.ids),
        "kv_kept": cache.kept_per_layer,
        "kv_bytes": cache.nbytes,
        "kv_entries": cache.kept.entries,
        "kept_fingerprint": fingerprint(
            cache.kept_positions()
        ),  # what the gate compares (pkvbench/cell/fingerprints.py)
        # how the entries are stored, and the bytes against the full cache's at 16 bits per value (docs/memory.md)
        "kv_native": job.fmt.native,
        **kv_fields(dataclasses.replace(job.fmt, group=settings.kv_group, residual=settings.kv_residual)),
        "memory_target": cache.plan.target_bytes,
        "memory_fraction": round(cache.nbytes / full_bytes, 6),
        "attention_weights": job.cell.policy.needs.attention_weights,
        "pred": answer.text,
        "answers": question.answers,
        "score": metric(prepare_prediction(answer.text, task.postprocess), question.answers, sample.meta),
        "new_tokens": len(answer.tokens),
        "hit_limit": answer.hit_limit,
        # the largest cache while the answer was written (summed over layers and heads; stored bytes per row)
        "peak_kv_entries": answer.memory.peak_entries,
        "peak_kv_bytes": answer.memory.peak_bytes,
        **_decode_fields(job.cell, answer, settings),
        "prefill_s": round(job.prefill.seconds, 4),
        "extra_pass_s": round(job.prefill.extra_seconds, 4),
        "selection_s": round(job.selection_s, 4),
        "decode_s": round(answer.seconds, 4),
        "decode_batch": answer.batch,
        **texts[question.question_id],
        **(turn or {}),
    }
    # the schema (pkvbench/cell/schema.py) orders the fields and refuses one it does not declare; the task's own columns
    # (length, depth, ...) come after them
    return {**arrange(row), **sample.extras, **question.extras}


def _decode_fields(cell: Cell, answer, settings: RunSettings) -> dict:
    """A decode budget's schedule and what it did: cuts made and the cache's size over the answer (``kv_trace``:
    [tokens so far, entries] at the start, before and after each cut, at the end; at most 64 cuts kept)."""
    if cell.decode_budget is None:
        return {}
    return {
        "decode_interval": settings.decode_interval,
        "decode_buffer": settings.decode_buffer,
        "decode_cuts": answer.memory.cuts,
        "kv_trace": answer.memory.compact_trace(),
    }


EXCERPT_TOKENS = 96  # of the context's start and end, for a person reading the rows (the HTML report's sample view)


def sample_texts(tokenizer, sample: Sample, question: Question) -> dict[str, str]:
    """What a reader needs to judge a prediction: the question's text (the tokens after the context, special
    tokens left out) and the first and last tokens of the context. Decoding a few hundred tokens costs
    microseconds; the whole context would make every row as long as the prompt."""

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).strip()

    # The question ends where the chat template's closing tokens begin (its end-of-turn token; the role name after
    # the next turn's start token is plain text and would read as part of the question).
    special = set(tokenizer.all_special_ids)
    end = next((i for i, token in enumerate(question.ids) if token in special), len(question.ids))
    context = sample.context_ids
    whole = len(context) <= 2 * EXCERPT_TOKENS
    return {
        "question_text": text(question.ids[:end]),
        "context_head": text(context if whole else context[:EXCERPT_TOKENS]),
        "context_tail": "" if whole else text(context[-EXCERPT_TOKENS:]),
    }


@dataclass
class GridPlan:
    """What a run still has to do: each (task, sample) with the cells not yet in the store, in run order."""

    pending: list[tuple[TaskSpec, Sample, list[Cell]]]
    total: int  # rows of the whole grid (of this shard)
    skipped: int  # rows the store already holds
    done: set  # keys of the rows the store holds


def pending_cells(task: TaskSpec, sample: Sample, cells: list[Cell], done: set) -> list[Cell]:
    """The cells of which some row of this sample (one per question) is missing."""
    row_ids = [sample.row_id(q) for q in sample.questions]
    return [cell for cell in cells if any(row_key(row_identity(task, r, cell)) not in done for r in row_ids)]


def plan_grid(
    tasks: list[TaskSpec],
    tokenizer,
    cells: list[Cell],
    options: TaskOptions,
    store: ResultStore,
    shard: Shard | None = None,
    items: list[tuple[TaskSpec, Sample]] | None = None,
) -> GridPlan:
    """What is left to run; ``items`` are the run's samples if already built (``work_items``)."""
    done = store.done_keys()
    items = work_items(tasks, tokenizer, options, shard) if items is None else items
    pending = [(task, sample, pending_cells(task, sample, cells, done)) for task, sample in items]
    total = sum(len(sample.questions) for _, sample in items) * len(cells)
    left = [(task, sample, todo) for task, sample, todo in pending if todo]
    skipped = sum(
        1
        for task, sample in items
        for cell in cells
        for q in sample.questions
        if row_key(row_identity(task, sample.row_id(q), cell)) in done
    )
    return GridPlan(left, total, skipped, done)


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
        self.written: set[tuple] = set(plan.done)  # keys in the store: a sample rerun for a missing row skips these
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
        key = row_key(row)
        if key in self.written:
            return
        self.store.append(row)
        self.written.add(key)
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
    cells: list[Cell],
    options: TaskOptions,
    store: ResultStore,
    *,
    shard: Shard | None = None,
    settings: RunSettings | None = None,
    quiet: bool = False,
    on_row: Callable[[dict], None] | None = None,
    items: list[tuple[TaskSpec, Sample]] | None = None,
) -> RunStats:
    """The local executor: every pending sample in order, in this process (``items``: the samples, if built)."""
    started = time.perf_counter()
    plan = plan_grid(tasks, engine.tokenizer, cells, options, store, shard, items)
    check_formats(engine.shape, cells)  # evaluate checked them from the model's config: again, as loaded
    check_policies(engine.shape, cells, engine.loaded.name)
    check_memory(engine.shape, plan.pending)
    check_prompts(engine.shape, plan.pending, (settings or RunSettings()).max_new_tokens, engine.loaded.name)
    writer = RowWriter(store, plan, started=started, quiet=quiet, on_row=on_row)
    try:
        for task, sample, pending in plan.pending:
            writer.stats.prefills += 1
            for row in run_sample(engine, task, sample, pending, settings):
                writer.write(row)
    finally:
        writer.close()
    return writer.stats


def check_formats(shape: ModelShape, cells: list[Cell]) -> None:
    """Refuse a format that does not fit the model's heads: a KIVI group must divide the head size (values are
    quantized per token in groups of G channels; a latent cache's: its value's, the shared rotary key), and
    TurboQuant's codes must fill whole bytes of a head (of its keys and of its values). ``shape`` is read from the
    model's config: this runs before the model loads (and before ``--overwrite`` deletes anything)."""
    for layer in set(shape.geometry.layers):
        head_dim = layer.value_dim
        for fmt in {cell.kv for cell in cells if cell.kv is not None and cell.kv.quantized}:
            if fmt.kivi and (head_dim % fmt.group or head_dim * fmt.bits % 8):
                fits = ", ".join(str(g) for g in (16, 32, 64) if head_dim % g == 0)
                raise PkvError(
                    f"--kv-group {fmt.group} does not divide the model's head size ({head_dim}): values are "
                    f"quantized per token in groups of G channels; try {fits}"
                )
            if fmt.codec == kv_formats.TURBOQUANT and (layer.key_dim % 8 or head_dim % 8):
                raise PkvError(
                    f"--kv-bits {fmt}: the model's head size ({layer.key_dim}, {head_dim}) is not a multiple of 8, so "
                    f"a head's {fmt.bits}-bit codes do not fill whole bytes"
                )


def check_policies(shape: ModelShape, cells: list[Cell], model: str) -> None:
    """Refuse a policy the model's cache cannot serve: on an MLA model, one that reads per-head keys or values
    (``engine/latent.py``). From the config, before the model loads; again once it has."""
    if shape.latent:
        check_latent_policies([cell.policy for cell in cells], model)


def check_prompts(
    shape: ModelShape, pending: list[tuple[TaskSpec, Sample, list[Cell]]], max_new_tokens: int | None, name: str
) -> None:
    """Refuse what the model cannot run exactly on these prompts (``engine.architecture.Architecture``'s
    ``check_rope`` and ``check_window``), from its config and the prompts' lengths: before the model loads."""
    architecture = shape.architecture
    if architecture is None:
        return
    for task, sample, cells in pending:
        prompts = [len(sample.prompt(question)) for question in sample.questions]
        for length in prompts:
            architecture.check_rope(length, max_new_tokens or task.max_new_tokens, name)
        for mode, length in ((AWARE, max(prompts)), (AGNOSTIC, len(sample.context_ids))):  # what each prefills
            architecture.check_window(length, [cell.policy for cell in cells if cell.query_mode == mode], name)


def check_memory(shape: ModelShape, pending: list[tuple[TaskSpec, Sample, list[Cell]]]) -> None:
    """Refuse a memory budget that some cell cannot hold on some prompt (a policy's floor — its window, its sinks —
    stored in the cell's format takes more): a memory column must hold every cell. The message names the smallest
    value every cell can hold. Needs the model's config and the prompts' lengths only: runs before the model loads
    (a hybrid model's once it has: its state's bytes are measured on the loaded model, ``Engine.shape``)."""
    geometry = shape.geometry
    if geometry.state_bytes is None:
        return
    short: dict[Budget, tuple[float, str]] = {}
    for _task, sample, cells in pending:
        for cell in cells:
            if not cell.budget.memory:
                continue
            prompts = (
                [sample.context_ids]
                if cell.query_mode in (AGNOSTIC, MULTI_TURN)
                else map(sample.prompt, sample.questions)
            )
            fmt = cell.kv or shape.native_format
            heads = cell.policy.query_sets(shape.query_heads)
            for length in {len(ids) for ids in prompts}:
                needed = kv_formats.floor_bytes(cell.policy, length, geometry, fmt, heads)
                full = geometry.full_bytes(length)
                if needed > cell.budget.target_bytes(full):
                    smallest = needed / full if isinstance(cell.budget.value, float) else needed
                    if smallest > short.get(cell.budget, (0.0, ""))[0]:
                        short[cell.budget] = (smallest, f"{cell.policy.label} at {fmt} bits on {length} tokens")
    if short:
        budget, (smallest, what) = next(iter(short.items()))
        if isinstance(smallest, float):
            value = f"{math.ceil(smallest * 1e4) / 1e4:g}"
        else:
            value = budgets.byte_size(-(-smallest // 1024) * 1024)
        raise PkvError(
            f"--memory {str(budget).removeprefix(budgets.MEMORY_PREFIX)} is below what {what} can hold (its "
            f"smallest cache); the smallest memory every cell of this grid can hold is {value}"
        )


def _as_tensor(ids: list[int]):
    import torch

    return torch.tensor([ids], dtype=torch.long)
