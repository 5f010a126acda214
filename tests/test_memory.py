"""Memory budgets and stored caches, without a model: parsing, the byte arithmetic against the stored tensors, the
entries a memory budget buys, a batch of stored caches attending as each row alone would, and the frontier view."""

import math

import pandas as pd
import pytest
import torch

from pkvbench.cell.budgets import Budget, keeps_fixed_set, parse_budgets, parse_memory
from pkvbench.cell.kv_formats import (
    CacheGeometry,
    KVFormat,
    LayerShape,
    MemoryTooSmall,
    memory_plan,
    parse_format,
    planned_bytes,
)
from pkvbench.codecs.kivi import dequantize_keys, dequantize_values
from pkvbench.engine.decoding import KeptEntries
from pkvbench.engine.generation import kept_bytes
from pkvbench.engine.quantized import StoredEntries
from pkvbench.errors import PkvError
from pkvbench.policies import parse_policy
from pkvbench.reports.axes import order_axes
from tests.helpers import quantized_layers

GEOMETRY = CacheGeometry.uniform(layers=4, kv_heads=3, head_dim=64)
FORMATS = [
    KVFormat(16),
    KVFormat(8),
    KVFormat(4, group=16, residual=5),
    KVFormat(2, group=32, residual=0),
    *(parse_format(spec) for spec in ("fp8", "fp8_e5m2:scale=prompt", "tq4", "tq3", "tq3:qjl=true")),
]


# --- parsing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,value,label",
    [("0.05", 0.05, "mem0.05"), ("1", 1.0, "mem1"), ("2MiB", 2 * 2**20, "mem2MiB"), ("2048KiB", 2**21, "mem2MiB")],
)
def test_memory_budgets_are_fractions_or_sizes_with_a_unit(text, value, label):
    budget = parse_memory(text)
    assert budget.memory and budget.value == value and str(budget) == label
    assert Budget.parse(label) == budget and budget.recorded == label
    assert str(parse_memory("1500KB")) == "mem1500KB" and str(parse_memory("7B")) == "mem7B"


@pytest.mark.parametrize(
    "text,message",
    [
        ("0", "a fraction is above 0 and at most 1"),
        ("1.5", "a fraction is above 0 and at most 1"),
        ("lots", "is not a fraction"),
        ("2XB", "unknown unit 'XB'"),
        ("0.1B", "at least one byte"),
    ],
)
def test_bad_memory_budgets_say_what_is_wrong(text, message):
    with pytest.raises(PkvError, match=message):
        parse_memory(text)


def test_entry_budgets_refuse_memory_and_keep_all_keeps_every_entry():
    with pytest.raises(PkvError, match="memory budgets go in --memory"):
        parse_budgets("128,mem0.05")
    every = Budget.parse("all")
    assert every.keeps_all and every.entries(700) == 700 and every.recorded == "all"
    with pytest.raises(ValueError):
        parse_memory("0.1").entries(700)


def test_only_the_full_cache_keeps_a_fixed_set():
    assert keeps_fixed_set(parse_policy("full"))
    for spec in ("snapkv", "pyramidkv", "streamingllm", "kvzip", "snapkv:window=64"):
        assert not keeps_fixed_set(parse_policy(spec)), spec


# --- bytes: the formula against the stored tensors -------------------------------------------------------------------


def kept_entries(lengths_per_layer: list[list[int]], heads=3, dim=64, seed=0) -> KeptEntries:
    """Hand-made kept entries: per layer, heads keeping the given numbers (padded to the fullest with their last)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values, lengths = [], [], []
    for counts in lengths_per_layer:
        stored = max(max(counts), 1)
        keys.append(torch.randn(heads, stored, dim, generator=generator) * 3)
        values.append(torch.randn(heads, stored, dim, generator=generator))
        lengths.append(torch.tensor(counts))
    ragged = any(len(set(c)) > 1 for c in lengths_per_layer)
    return KeptEntries(keys, values, lengths if ragged else None)


LAYOUTS = [
    [[40, 40, 40], [7, 7, 7]],  # uniform layers of different sizes
    [[40, 12, 3], [0, 5, 33], [0, 0, 0]],  # heads keeping different numbers, one keeping none, a layer keeping none
]


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_byte_formula_is_what_the_stored_tensors_hold(fmt, layout):
    kept = kept_entries(layout)
    stored = StoredEntries.store(kept, fmt, torch.float16)
    held = sum(t.numel() * t.element_size() for layer in stored.layers for t in layer.tensors)
    assert stored.nbytes == held == kept_bytes(kept, fmt)
    assert stored.entries == sum(sum(counts) for counts in layout)
    # KIVI stores each head's last R entries in 16 bits, the rest packed; FP8 and TurboQuant pack every entry
    for layer, counts in zip(stored.layers, layout):
        assert layer.residual.tolist() == [min(n, fmt.recent) if fmt.quantized else n for n in counts]


U8, F16, F32 = torch.uint8, torch.float16, torch.float32


@pytest.mark.parametrize(
    "spec,keys,values",
    [
        # a byte a value, and the layer's scale in float32 (vLLM's k_scale / v_scale)
        ("fp8", [((3, 40, 64), U8), ((1, 1, 1), F32)], [((3, 40, 64), U8), ((1, 1, 1), F32)]),
        # b bits a coordinate, a 16-bit norm a vector, the codebook of 2^b float32 centroids
        (
            "tq4",
            [((3, 40, 32), U8), ((3, 40), F16), ((1, 16), F32)],
            [((3, 40, 32), U8), ((3, 40), F16), ((1, 16), F32)],
        ),
        ("tq3", [((3, 40, 24), U8), ((3, 40), F16), ((1, 8), F32)], [((3, 40, 24), U8), ((3, 40), F16), ((1, 8), F32)]),
        # QJL: the keys' centroids in 2 bits, then a sign bit a coordinate and the residual's norm
        (
            "tq3:qjl=true",
            [((3, 40, 16), U8), ((3, 40), F16), ((1, 4), F32), ((3, 40, 8), U8), ((3, 40), F16)],
            [((3, 40, 24), U8), ((3, 40), F16), ((1, 8), F32)],
        ),
    ],
)
def test_named_formats_store_the_tensors_their_codec_says(spec, keys, values):
    fmt = parse_format(spec)
    layer = StoredEntries.store(kept_entries([[40, 40, 40]]), fmt, torch.float16).layers[0]
    for part, expected in ((layer.keys, keys), (layer.values, values)):
        assert [(tuple(t.shape), t.dtype) for t in part.tensors] == expected
    assert layer.residual_keys.shape == (3, 0, 64)  # nothing in 16 bits: every kept entry is packed
    expected_bytes = sum(
        math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in keys + values
    )
    assert layer.codec is not None and fmt.layer_bytes(3, 64, [40, 40, 40]) == expected_bytes


def test_the_model_dtype_format_is_the_kept_tensors_bytes():
    for layout in LAYOUTS:
        kept = kept_entries(layout)
        own = sum(t.numel() * t.element_size() for t in (*kept.keys, *kept.values))
        assert kept_bytes(kept, KVFormat(32, native=True)) == own


def test_a_stored_head_reads_back_its_own_entries_in_order():
    kept = kept_entries([[40, 12, 3]])
    fmt = KVFormat(8, group=8, residual=5)
    layer = StoredEntries.store(kept, fmt, torch.float16).layers[0]
    keys = dequantize_keys(layer.keys, fmt.bits, fmt.group, torch.float32)
    values = dequantize_values(layer.values, fmt.bits, fmt.group, torch.float32)
    for head, n in enumerate([40, 12, 3]):
        q = n - min(n, 5)
        restored = torch.cat([keys[head, :q], layer.residual_keys[head, : n - q].float()])
        assert torch.allclose(restored, kept.keys[0][head, :n], atol=0.1)  # 8 bits of a range of about 20
        assert torch.equal(layer.residual_keys[head, : n - q], kept.keys[0][head, q:n].half())
        assert torch.allclose(
            torch.cat([values[head, :q], layer.residual_values[head, : n - q].float()]),
            kept.values[0][head, :n],
            atol=0.03,
        )


# --- what a memory budget buys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["snapkv", "pyramidkv", "streamingllm", "snapkv:gqa=query"])
@pytest.mark.parametrize("fmt", [KVFormat(32, native=True), *FORMATS], ids=str)
@pytest.mark.parametrize("memory", ["0.05", "0.12", "0.25", "300KiB"])
def test_a_memory_budget_keeps_the_most_entries_that_fit(spec, fmt, memory):
    policy, length = parse_policy(spec), 1000
    heads = 9 if "gqa=query" in spec else 3
    budget = parse_memory(memory)
    full = GEOMETRY.full_bytes(length)
    assert full == 2 * 4 * 3 * 1000 * 64 * 2
    target = budget.target_bytes(full)
    try:
        plan = memory_plan(policy, budget, length, GEOMETRY, fmt, heads)
    except MemoryTooSmall as exc:
        assert exc.needed > target
        return
    spent = planned_bytes(fmt, plan.per_layer, heads, 64)
    assert plan.target_bytes == target and spent <= target
    if plan.requested < length:  # one more entry per head and layer would not fit
        more = policy.layer_budgets(plan.requested + 1, length, GEOMETRY.num_layers)
        assert planned_bytes(fmt, more, heads, 64) > target
    if spec == "pyramidkv" and plan.requested < length:
        assert plan.per_layer[0] > plan.per_layer[-1]  # the pyramid's own per-layer budgets are what is counted


def test_fewer_bits_buy_more_entries_and_the_residual_is_paid_in_16_bits():
    policy, budget = parse_policy("snapkv"), parse_memory("0.12")
    kept = {
        str(fmt): memory_plan(policy, budget, 2000, GEOMETRY, fmt).requested
        for fmt in (KVFormat(32, native=True), KVFormat(16), KVFormat(4), KVFormat(2), KVFormat(2, residual=32))
    }
    assert kept["32"] == 120 and kept["16"] == 240  # 12% of 2000 tokens at 16 bits
    # 4 bits, per head and channel, in bits: the residual's 128 keys and values at 16, then per packed entry a key
    # and a value code of 4, a value group's scale and minimum (32 bits per 32 channels: 1), and per 32 packed
    # entries a key group's (32): of 0.12·2000·2·16 = 7680
    packed = max(q for q in range(2000) if 2 * 16 * 128 + 9 * q + 32 * -(-q // 32) <= 7680)
    assert kept["4"] == 128 + packed == 483
    assert kept["2 r32"] > kept["2"] > kept["4"]


def test_a_memory_budget_below_a_policys_floor_names_what_it_needs():
    with pytest.raises(MemoryTooSmall, match=r"--memory 0.001: snapkv:window=32 at 16 bits .* needs at least"):
        memory_plan(parse_policy("snapkv:window=32"), parse_memory("0.001"), 2000, GEOMETRY, KVFormat(16))


# --- a batch of stored caches attends as each row alone ------------------------------------------------------------


def attend(query, keys, values, visible):
    """One query ``[heads, dim]`` over ``[heads, n, dim]`` keys and values where ``visible`` ``[heads, n]``."""
    logits = torch.einsum("hd,hnd->hn", query, keys).masked_fill(~visible, -math.inf)
    return torch.einsum("hn,hnd->hd", logits.softmax(-1), values)


@pytest.mark.parametrize("fmt", [KVFormat(4, group=16, residual=5), *FORMATS[4:]], ids=str)
def test_a_batch_of_stored_caches_attends_to_each_rows_own_entries(fmt):
    rows = [kept_entries(layout, seed=i) for i, layout in enumerate([[[40, 12, 3]], [[9, 9, 9]], [[70, 1, 30]]])]
    stored = [StoredEntries.store(kept, fmt, torch.float16) for kept in rows]
    layer = quantized_layers(stored, room=4, kv_heads=3)[0]
    for row, own in enumerate(stored):  # what a row holds in the batch is what it stores alone, not the batch's padding
        assert layer.held(row) == (int(own.layers[0].lengths.sum()), sum(t.nbytes for t in own.layers[0].tensors))
    generator = torch.Generator().manual_seed(7)
    new_keys, new_values = torch.randn(3, 3, 1, 64, generator=generator), torch.randn(3, 3, 1, 64, generator=generator)
    keys, values = layer.update(new_keys, new_values)
    mask = layer.attention_mask()
    assert keys.dtype == torch.float32 and mask.shape == (3, 3, 1, keys.shape[2])
    query = torch.randn(3, 3, 64, generator=generator)
    for row, (kept, own) in enumerate(zip(rows, stored)):
        # alone: the row's own entries, dequantized, then the new token (in 16 bits, as the residual keeps it)
        one = quantized_layers([own], room=4, kv_heads=3)[0]
        alone_keys, alone_values = one.update(new_keys[row : row + 1], new_values[row : row + 1])
        alone_mask = one.attention_mask()
        alone_visible = alone_mask[0, :, 0] if alone_mask is not None else torch.ones(alone_keys.shape[1:3], dtype=bool)
        expected = attend(query[row], alone_keys[0], alone_values[0], alone_visible.expand(3, -1))
        got = attend(query[row], keys[row], values[row], mask[row, :, 0])
        assert torch.allclose(got, expected, atol=1e-6)
        assert int(mask[row, :, 0].sum()) == sum(kept.lengths[0].tolist() if kept.lengths else [9, 9, 9]) + 3
    layer.select_rows(torch.tensor([2]), [2])
    keys, _ = layer.update(new_keys[2:], new_values[2:])
    assert keys.shape[0] == 1 and int(layer.attention_mask()[0, :, 0].sum()) == 70 + 1 + 30 + 6


# --- the frontier ----------------------------------------------------------------------------------------------------


def frontier_rows() -> pd.DataFrame:
    """Two targets, SnapKV at 16 and 4 bits, and the full cache at 16 (too big) and 2 bits (fits the larger target):
    twenty samples of one task, SnapKV at 4 bits right on all of them at 12%."""
    rows = []
    for sample in range(20):
        for policy, bits, budget, size, target, score in [
            ("snapkv", 16, "mem0.05", 48, 50, sample % 2),
            ("snapkv", 4, "mem0.05", 49, 50, sample % 3 == 0),
            ("snapkv", 16, "mem0.12", 110, 120, sample % 2),
            ("snapkv", 4, "mem0.12", 118, 120, 1),
            ("full", 16, "all", 1000, None, 1),
            ("full", 2, "all", 115, None, sample % 2),
        ]:
            rows.append(
                {
                    "model": "m",
                    "task": "needle",
                    "sample_id": str(sample),
                    "policy": policy,
                    "budget": budget,
                    "query_mode": "aware",
                    "kv_bits": str(bits),
                    "kv_stored": "" if bits == 32 else str(bits),
                    "kv_bytes": size,
                    "memory_target": target,
                    "memory_fraction": size / 1000,
                    "budget_tokens": size,
                    "kv_entries": size * 2,
                    "score": float(score),
                }
            )
    return order_axes(pd.DataFrame(rows))  # as report.load_runs gives them


def test_the_frontier_marks_the_pareto_front_and_compares_each_target_with_its_best():
    from pkvbench.reports import frontier

    rows = frontier_rows()
    assert frontier.has_frontier(rows)
    points = frontier.points(rows).set_index(["policy", "kv_bits", "budget"])
    front = points.index[points["front"] == "*"].tolist()
    # 16-bit SnapKV at 5% scores as well as at 12% and as the full cache at 2 bits, on fewer bytes; 4-bit SnapKV at
    # 12% as well as the full cache, on a tenth of its bytes
    assert front == [("snapkv", "16", "mem0.05"), ("snapkv", "4", "mem0.12")]
    assert points.loc[("snapkv", "4", "mem0.12"), "memory"] == 11.8
    compared = frontier.comparisons(rows)
    at_12 = compared[compared["target"] == "mem0.12"]
    assert set(at_12["best"]) == {"snapkv · 4 bits"}
    assert set(at_12["cell"]) == {"snapkv · 16 bits", "full · 2 bits"}  # the full cache at 2 bits fits 12%
    assert set(compared[compared["target"] == "mem0.05"]["cell"]) == {"snapkv · 4 bits"}
    decided = at_12.set_index("cell")["verdict"]
    assert decided["snapkv · 16 bits"] == "snapkv · 4 bits better"
    text = frontier.frontier_markdown(rows)
    assert "## Accuracy per byte" in text and "snapkv · 4 bits better" in text


def test_the_memory_view_has_a_row_per_format_and_budget_with_its_bytes_as_stored():
    from pkvbench.reports import frontier

    table = frontier.storage(frontier_rows())
    assert table[["kv_bits", "budget"]].values.tolist() == [
        ["16", "mem0.05"],
        ["16", "mem0.12"],
        ["16", "all"],
        ["4", "mem0.05"],
        ["4", "mem0.12"],
        ["2", "all"],
    ]
    row = table.set_index(["kv_bits", "budget"]).loc[("4", "mem0.12")]
    assert (row["kv_bytes"], row["memory"], row["bytes/entry"], row["target"], row["n"]) == (118, 11.8, 0.5, 120, 20)


def test_lm_eval_and_the_gate_tell_formats_of_the_same_bits_apart():
    """The cell key holds the format: fp8 and fp8_e5m2 (8 bits both), tq3 with and without QJL, are cells apart in
    lm-eval's configurations and in the store's (and so the gate's) keys."""
    from pkvbench.lm_eval.grid import GridSpec, cell_label
    from pkvbench.run.runner import row_identity
    from pkvbench.store.results import row_key, stored_as
    from pkvbench.tasks.registry import get_task

    spec = GridSpec.parse({"policy": "snapkv", "memory": "0.25", "kv_bits": "16+8+fp8+fp8_e5m2+tq3+tq3:qjl=true"})
    assert [cell_label(cell).split("-kv")[1] for cell in spec.cells] == [
        "16",
        "8",
        "fp8",
        "fp8-e5m2",
        "tq3",
        "tq3-qjl=true",
    ]
    rows = [row_identity(get_task("needle"), "s", cell) for cell in spec.cells]
    assert len({row_key(row) for row in rows}) == 6
    assert [stored_as(row) for row in rows] == ["16", "8", "fp8", "fp8_e5m2", "tq3", "tq3:qjl=true"]


# --- bad input: one line, exit 2 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["--kv-bits", "3"],
            "--kv-bits 3: supported are 2, 4 and 8 (KIVI's integers), 16, the model's own 32, and fp8, fp8_e5m2, tq4, "
            "tq3",
        ),
        (["--kv-bits", "16,fp8:scale=2"], "--kv-bits fp8: option scale=2: one of 1, prompt"),
        (["--kv-bits", "tq3:rotation=hadamard"], "tq3 has no option 'rotation'; its options: qjl, seed"),
        (["--kv-bits", "tq4:qjl"], "'qjl' is not of the form name=value (e.g. tq4:qjl=true)"),
        (["--kv-bits", "fp8,tq3", "--kv-group", "16"], "--kv-group only sets KIVI's formats"),
        (["--kv-bits", "32", "--dtype", "bfloat16", "--device", "cpu"], "the model computes in 16 bits"),
        (["--kv-bits", "4", "--kv-group", "0"], "--kv-group 0: must be at least 1"),
        (["--memory", "0.05", "--budget", "64"], "--memory and --budget together"),
        (["--memory", "0.05", "--policy", "full"], "full keeps a fixed set of entries"),
        (["--memory", "1.5"], "a fraction is above 0 and at most 1"),
        (["--memory", "2 parsecs"], "unknown unit 'parsecs'"),
        (["--budget", "mem0.05"], "memory budgets go in --memory"),
    ],
)
def test_bad_bits_and_memory_are_one_clear_line(args, expected, tmp_path, capsys):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and expected in err, err
    assert not (tmp_path / "o").exists()


def test_a_hybrid_models_state_is_paid_for_first_and_counted_in_the_full_cache():
    """A geometry with a recurrent state (kept whole, whatever the budget): the full cache that fractions are of holds
    it, a memory plan's bytes hold it, and a budget below the state alone is too small for any policy."""
    state = 100_000
    geometry = CacheGeometry((LayerShape(2, 64, 64), LayerShape(1, 32, 16)), state_bytes=state)
    length = 1000
    entries = 2 * 1000 * 128 * 2 + 1 * 1000 * 48 * 2  # each layer's heads × tokens × (key + value) × 16 bits
    assert geometry.full_bytes(length) == entries + state
    snapkv, fmt = parse_policy("snapkv"), KVFormat(16, native=True)
    plan = memory_plan(snapkv, Budget(0.5, memory=True), length, geometry, fmt)
    assert geometry.planned_bytes(fmt, plan.per_layer) <= plan.target_bytes
    assert geometry.planned_bytes(fmt, plan.per_layer) - state == sum(
        fmt.layer_bytes(layer.heads, layer.key_dim, [n] * layer.heads, layer.value_dim)
        for layer, n in zip(geometry.layers, plan.per_layer)
    )
    with pytest.raises(MemoryTooSmall):
        memory_plan(snapkv, Budget(state - 1, memory=True), length, geometry, fmt)
