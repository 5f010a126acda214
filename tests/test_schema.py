"""The result row's schema (pkvbench/cell/schema.py) is the one place its fields and the query modes are spelled: the
runner's rows have exactly its fields, in its order, and the store, the reports and the page derive from it."""

import ast
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import pkvbench
from pkvbench.cell import schema
from pkvbench.cell.budgets import Budget
from pkvbench.cell.kv_formats import KVFormat
from pkvbench.policies import parse_policy
from pkvbench.reports.html_report import CONFIG_FIELDS, sample_fields
from pkvbench.run import runner
from pkvbench.store.results import row_key
from pkvbench.tasks.base import Question, Sample, TaskSpec

EXTRAS = {"length": 500, "needle": 0, "depth": 50.0}  # a task's own columns: after the schema's


def built_row(cell: runner.Cell) -> dict:
    """A row as ``runner._row`` writes it, from stand-ins for what a model run hands it (no model is loaded)."""
    task = TaskSpec("needle", "", "needle", "rouge1", 8, False, {}, version="2", prompt_hash="abc")
    question = Question([5, 6], ["42"], "q1", {"needle": 0, "depth": 50.0})
    sample = Sample("len500", [1, 2, 3], (question,), extras={"length": 500})
    cache = SimpleNamespace(
        plan=SimpleNamespace(context_len=3, requested=2, target_bytes=None),
        kept_per_layer=[2, 2],
        nbytes=100,
        kept=SimpleNamespace(entries=4),
        kept_positions=lambda: [[np.array([0, 1])], [np.array([0, 2])]],
    )
    memory = SimpleNamespace(peak_entries=4, peak_bytes=100, cuts=1, compact_trace=lambda: [[0, 4], [2, 3]])
    answer = SimpleNamespace(text="42", tokens=[7, 8], hit_limit=False, memory=memory, seconds=0.5, batch=1)
    engine = SimpleNamespace(
        geometry=SimpleNamespace(full_bytes=lambda tokens: 1000),
        loaded=SimpleNamespace(name="smollm2-135m"),
        native_format=KVFormat(32, native=True),
    )
    prefill = SimpleNamespace(seconds=1.0, extra_seconds=0.0)
    job = runner._Job(cell, question, cache, 0.1, 0, prefill, cell.kv or engine.native_format)
    texts = {"q1": {"question_text": "What is the code?", "context_head": "The code", "context_tail": ""}}
    return runner._row(engine, task, sample, job, answer, runner.RunSettings(), texts)


SNAPKV = parse_policy("snapkv")
DECODING_ONLY = {field.name for field in schema.ROW if field.only_with == "decode_budget"}
CONVERSATION_ONLY = {field.name for field in schema.ROW if field.only_with == "turn_compression"}


def test_a_row_has_exactly_the_schemas_fields_in_its_order():
    row = built_row(runner.Cell(SNAPKV, Budget(64)))
    assert list(row) == [*(name for name in schema.FIELDS if name not in DECODING_ONLY | CONVERSATION_ONLY), *EXTRAS]
    decoding = built_row(runner.Cell(SNAPKV, Budget(64), decode_budget=32))
    assert list(decoding) == [*(name for name in schema.FIELDS if name not in CONVERSATION_ONLY), *EXTRAS]
    assert decoding["decode_cuts"] == 1 and decoding["kv_trace"] == [[0, 4], [2, 3]]


def test_a_stored_cache_writes_its_storage_with_the_key():
    """A cache stored in another format than the model's own carries its storage in its key (results.row_key),
    and writes it there: right after the query mode."""
    row = built_row(runner.Cell(SNAPKV, Budget(64), schema.AGNOSTIC, KVFormat(4)))
    assert set(row) == set(schema.FIELDS) - DECODING_ONLY - CONVERSATION_ONLY | set(EXTRAS)
    key = ["task", "sample_id", "policy", "budget", "query_mode", *schema.STORAGE, "decode_budget"]
    assert list(row)[: len(key)] == key
    native = built_row(runner.Cell(SNAPKV, Budget(64)))
    assert list(row)[len(key) :] == [name for name in native if name not in key]  # the rest as in any other row
    assert (row["kv_native"], row["kv_bits"]) == (False, 4)


def test_a_column_the_schema_does_not_declare_is_refused():
    with pytest.raises(
        KeyError, match="new_column: not a field of the result row; declare it in pkvbench/cell/schema.py"
    ):
        schema.arrange({"task": "needle", "new_column": 1})


def test_the_store_key_is_the_identity_but_the_model():
    """Each identity field tells rows apart in the store (one folder holds one model: its key leaves the model out,
    tables across folders key on it too)."""
    row = built_row(runner.Cell(SNAPKV, Budget(64), kv=KVFormat(4)))
    changed = {
        "task": "trec",
        "sample_id": "other",
        "policy": "full",
        "budget": 128,
        "query_mode": schema.AGNOSTIC,
        "decode_budget": 32,
        "kv_native": True,
        "kv_bits": 2,
        "kv_group": 64,
        "kv_residual": 16,
        "kv_format": "fp8",
        "turn_compression": schema.EVERY_TURN,
    }
    assert set(changed) | {"model"} == set(schema.fields_of(schema.IDENTITY))
    for name, value in changed.items():
        assert row_key({**row, name: value}) != row_key(row), name
    assert row_key({**row, "model": "other"}) == row_key(row)
    assert schema.TABLE_KEY[0] == "model" and "kv_stored" in schema.TABLE_KEY


def test_the_pages_lists_come_from_the_schema():
    configuration = (set(schema.FIELDS) - {*schema.fields_of(schema.SAMPLE), *schema.fields_of(schema.TEXT)}) | {
        "folder",
        "kv_stored",
        "series",
    }
    assert configuration == CONFIG_FIELDS
    # the sample view shows the sample's own fields: the schema's sample group and the task's columns
    row = built_row(runner.Cell(SNAPKV, Budget(64)))
    assert set(sample_fields(row)) == {*schema.fields_of(schema.SAMPLE), *EXTRAS} - CONVERSATION_ONLY


def test_the_query_modes_are_spelled_only_in_the_schema():
    """No module but the schema writes a query mode's name as a string: the runner, the store, the reports, the
    page, the exports and the command line read the schema's constants."""
    package = Path(pkvbench.__file__).parent
    spelled = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "schema.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in schema.QUERY_MODES
    ]
    assert spelled == []
    assert runner.Cell(SNAPKV, Budget(64)).query_mode == schema.DEFAULT_QUERY_MODE == schema.QUERY_MODES[0]
