"""Stored caches and memory budgets on the real model: exactness, bytes against the stored tensors, a whole run."""

import json

import pytest
import torch

from pkvbench.cell.budgets import Budget, parse_memory
from pkvbench.cell.kv_formats import KVFormat, planned_bytes
from pkvbench.cli import main
from pkvbench.errors import PkvError
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, check_formats, check_memory
from pkvbench.store.results import read_rows
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from tests.helpers import decode_one

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def needle(engine, loaded):
    task = get_task("needle")
    sample = build_samples(task, loaded.tokenizer, TaskOptions(lengths=(300,), depths=(50,)))[0]
    policies = [parse_policy(p) for p in ("full", "snapkv", "kvzip")]
    return task, sample, engine.prefill(torch.tensor([sample.input_ids]), policies)


def test_eight_bits_with_nothing_to_quantize_is_the_16_bit_cache(engine, needle):
    """R ≥ T: every entry is in the 16-bit residual; the stored tensors and the tokens are the 16-bit cache's."""
    _, _, prefill = needle
    for spec in ("full", "snapkv"):
        policy = parse_policy(spec)
        sixteen = engine.compress(prefill, policy, Budget(64), fmt=KVFormat(16))
        eight = engine.compress(prefill, policy, Budget(64), fmt=KVFormat(8, residual=prefill.context_len))
        assert all(layer.keys is None for layer in eight.kept.layers)
        for a, b in zip(sixteen.kept.layers, eight.kept.layers):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors, b.tensors))
        assert decode_one(engine, prefill, sixteen, 12).tokens == decode_one(engine, prefill, eight, 12).tokens


def test_kv_bytes_are_the_stored_tensors_and_memory_budgets_hold(engine, loaded, needle):
    _, _, prefill = needle
    full = engine.geometry.full_bytes(prefill.context_len)
    for spec in ("snapkv", "kvzip", "full"):
        policy = parse_policy(spec)
        for fmt in (None, KVFormat(16), KVFormat(4, residual=16), KVFormat(2, group=64, residual=0)):
            for budget in (Budget(48), parse_memory("0.1"), parse_memory("0.3")):
                if spec == "full" and budget.memory:
                    continue
                cache = engine.compress(prefill, policy, budget, fmt=fmt)
                stored = cache.kept.layers if fmt else None
                tensors = [t for layer in stored for t in layer.tensors] if stored else cache.kept.keys
                held = sum(t.nbytes for t in tensors) + (0 if stored else sum(t.nbytes for t in cache.kept.values))
                assert cache.nbytes == held
                if budget.memory:
                    assert cache.nbytes <= cache.plan.target_bytes == budget.target_bytes(full)
                if spec != "kvzip":  # heads keep the same number: the formula needs only the plan
                    fmt_or_own = fmt or engine.native_format
                    expected = planned_bytes(fmt_or_own, cache.plan.per_layer, loaded.num_kv_heads, loaded.head_dim)
                    assert cache.nbytes == expected


def test_a_group_that_does_not_divide_the_head_or_a_memory_below_the_floor_is_refused(engine, loaded, needle):
    task, sample, _ = needle
    with pytest.raises(PkvError, match=r"--kv-group 48 does not divide the model's head size \(64\)"):
        check_formats(loaded.shape, [Cell(parse_policy("snapkv"), Budget(64), kv=KVFormat(4, group=48))])
    tiny = Cell(parse_policy("snapkv:window=32"), parse_memory("0.01"), kv=KVFormat(16))
    with pytest.raises(PkvError, match=r"--memory 0.01 is below what snapkv:window=32 at 16 bits .*hold is 0\.1"):
        check_memory(loaded.shape, [(task, sample, [tiny])])


def test_a_memory_grid_runs_on_one_prefill_per_sample_and_reports_its_frontier(tmp_path, capsys, loaded):
    out = tmp_path / "run"
    args = [
        "run",
        "--task",
        "needle",
        "--policy",
        "full,snapkv,pyramidkv",
        "--kv-bits",
        "32,4,2",
        "--kv-residual",
        "16",
        "--memory",
        "0.1,0.25",
        "--lengths",
        "300",
        "--depths",
        "50",
        "--max-new-tokens",
        "6",
        "--quiet",
        "--out",
        str(out),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0
    assert "15 rows written, 0 already done, 1 prefills" in capsys.readouterr().out  # (1 + 2·2) × 3 bits
    rows = read_rows(out)
    full = [r for r in rows if r["policy"] == "full"]
    assert sorted(r["kv_bits"] for r in full) == [2, 4, 32] and {r["budget"] for r in full} == {"all"}
    for row in rows:
        assert row["kv_native"] == (row["kv_bits"] == 32) and (row["kv_group"], row["kv_residual"]) == (32, 16)
        fmt = KVFormat(row["kv_bits"], 32, 16, native=row["kv_native"])
        assert row["kv_bytes"] == planned_bytes(fmt, row["kv_kept"], 3, 64)
        if row["policy"] != "full":
            assert row["kv_bytes"] <= row["memory_target"] and row["budget"] in ("mem0.1", "mem0.25")
            assert row["attention_weights"] == "window"
    with pytest.raises(SystemExit):
        main(args)  # resumed: nothing left to do
    assert "0 rows written, 15 already done, 0 prefills" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["report", str(out)])
    text = capsys.readouterr().out
    assert "## Accuracy per byte" in text and "| snapkv | 4 r16 | mem0.1 |" in text and " [" in text
    assert json.loads((out / "run.json").read_text())["options"]["kv_bits"] == [32, 4, 2]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--kv-bits", "4", "--kv-group", "48"], "--kv-group 48 does not divide the model's head size (64)"),
        (["--kv-bits", "16", "--memory", "0.01"], "the smallest memory every cell of this grid can hold is 0.1"),
    ],
)
def test_bad_input_the_model_decides_is_one_line_and_exit_2(args, expected, tmp_path, capsys, loaded):
    """Refused before any prefill, after the model says its head size and the prompts their lengths."""
    out = tmp_path / "o"
    common = ["--task", "needle", "--policy", "snapkv:window=32", "--lengths", "300", "--depths", "50"]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *common, *args, "--quiet", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (out / "samples.jsonl").exists()
