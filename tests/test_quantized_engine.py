"""Stored caches and memory budgets on the real model: exactness, bytes against the stored tensors, a whole run."""

import json

import pytest
import torch

from pkvbench.cell.budgets import Budget, parse_memory
from pkvbench.cell.kv_formats import PROMPT_SCALE, TURBOQUANT, KVFormat, parse_format, planned_bytes
from pkvbench.cli import main
from pkvbench.codecs import fp8, turboquant
from pkvbench.codecs.kivi import dequantize_keys, dequantize_values
from pkvbench.engine.decoding import KeptEntries
from pkvbench.engine.generation import CompressedCache
from pkvbench.engine.quantized import FP8_VARIANTS
from pkvbench.errors import PkvError
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, check_formats, check_memory
from pkvbench.store.results import read_rows
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from tests.helpers import decode_one, quantized_layers

pytestmark = pytest.mark.model


NAMED = [parse_format(spec) for spec in ("fp8", "fp8_e5m2:scale=prompt", "tq4", "tq3", "tq3:qjl=true")]


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
        for fmt in (None, KVFormat(16), KVFormat(4, residual=16), KVFormat(2, group=64, residual=0), *NAMED):
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
        check_formats(engine.shape, [Cell(parse_policy("snapkv"), Budget(64), kv=KVFormat(4, group=48))])
    tiny = Cell(parse_policy("snapkv:window=32"), parse_memory("0.01"), kv=KVFormat(16))
    with pytest.raises(PkvError, match=r"--memory 0.01 is below what snapkv:window=32 at 16 bits .*hold is 0\.1"):
        check_memory(engine.shape, [(task, sample, [tiny])])


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


# --- every format: the stored form is what attention reads --------------------------------------------------------


def read_back(layer, index: int, fmt: KVFormat, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored layer's packed keys and values read back by the codecs themselves (TurboQuant's rotations drawn again
    from the format's seed and the layer's index), ``[heads, q, dim]`` in ``dtype``."""
    keys, values = layer.keys, layer.values
    if fmt.codec in FP8_VARIANTS:
        variant = FP8_VARIANTS[fmt.codec]
        return fp8.dequantize(keys, variant, dtype), fp8.dequantize(values, variant, dtype)
    if fmt.codec == TURBOQUANT:
        heads, dim = layer.residual_keys.shape[0], layer.residual_keys.shape[-1]
        rotation = turboquant.rotations(dim, heads, fmt.seed, index)
        projection = turboquant.projections(dim, heads, fmt.seed, index) if fmt.qjl else None
        return (
            turboquant.dequantize(keys, rotation, dtype, projection),
            turboquant.dequantize(values, rotation, dtype),
        )
    return dequantize_keys(keys, fmt.bits, fmt.group, dtype), dequantize_values(values, fmt.bits, fmt.group, dtype)


def dequantized_whole(cache: CompressedCache, fmt: KVFormat) -> CompressedCache:
    """The reference: the whole stored cache read back at once, each head's packed entries then its 16-bit residual,
    as a cache in the model's dtype (``KeptEntries``) that decodes as an uncompressed-format cache does."""
    stored = cache.kept
    keys, values, lengths, positions = [], [], [], []
    for index, layer in enumerate(stored.layers):
        heads = layer.residual_keys.shape[0]
        packed = read_back(layer, index, fmt, stored.dtype) if layer.keys is not None else (None, None)
        layer_keys, layer_values, layer_positions = [], [], []
        for head in range(heads):
            q, r = int(layer.quantized[head]), int(layer.residual[head])
            parts = [(packed[0], layer.residual_keys), (packed[1], layer.residual_values)]
            head_keys, head_values = (
                torch.cat([*([first[head, :q]] if q else []), rest[head, :r].to(stored.dtype)]) for first, rest in parts
            )
            layer_keys.append(head_keys)
            layer_values.append(head_values)
            where = [layer.packed_positions[head, :q]] if q else []
            layer_positions.append(torch.cat([*where, layer.residual_positions[head, :r]]))
        longest = max(max(len(k) for k in layer_keys), 1)

        def padded(tensors):
            return torch.stack([torch.nn.functional.pad(t, (0, 0, 0, longest - len(t))) for t in tensors])

        keys.append(padded(layer_keys))
        values.append(padded(layer_values))
        lengths.append(torch.tensor([len(k) for k in layer_keys]))
        positions.append(torch.stack([torch.nn.functional.pad(p, (0, longest - len(p))) for p in layer_positions]))
    return CompressedCache(KeptEntries(keys, values, lengths, positions), cache.plan, cache.selected)


@pytest.mark.parametrize("fmt", [KVFormat(4, residual=16), *NAMED], ids=str)
def test_decoding_reads_the_stored_form_token_for_token_as_the_whole_cache_read_back_first(engine, needle, fmt):
    """Per step, attention reads the packed entries read back (bit for bit what the codecs give) and then the
    residual; the tokens are those of a plain cache holding the whole stored cache read back at once."""
    _, _, prefill = needle
    for spec in ("full", "snapkv", "kvzip"):  # every entry, a uniform selection, heads of different lengths
        cache = engine.compress(prefill, parse_policy(spec), Budget(64), fmt=fmt)
        reference = dequantized_whole(cache, fmt)
        layer = quantized_layers([cache.kept], room=1, kv_heads=3)[0]
        new = torch.zeros(1, 3, 1, 64)
        keys, values = layer.update(new, new)
        visible = layer.attention_mask()
        for head in range(3):  # what attention sees of each head: its entries as read back, in order
            seen = (
                visible[0, min(head, visible.shape[1] - 1), 0]
                if visible is not None
                else torch.ones(keys.shape[2], dtype=bool)
            )
            n = int(reference.kept.lengths[0][head])
            assert torch.equal(keys[0, head, seen][:n], reference.kept.keys[0][head, :n])
            assert torch.equal(values[0, head, seen][:n], reference.kept.values[0][head, :n])
        got = decode_one(engine, prefill, cache, 12).tokens
        assert got == decode_one(engine, prefill, reference, 12).tokens, (spec, str(fmt))


def test_fp8_stores_torchs_own_float8_of_the_kept_values_at_vllms_scales(engine, needle):
    _, _, prefill = needle
    policy, budget = parse_policy("snapkv"), Budget(64)
    kept = engine.compress(prefill, policy, budget).kept  # the same entries, in the model's dtype
    for spec in ("fp8", "fp8_e5m2", "fp8:scale=prompt"):
        fmt = parse_format(spec)
        stored = engine.compress(prefill, policy, budget, fmt=fmt).kept
        dtype8 = fp8.VARIANTS[FP8_VARIANTS[fmt.codec]]
        for index, layer in enumerate(stored.layers):
            key_scale, value_scale = layer.keys.scale.item(), layer.values.scale.item()
            if fmt.scale == PROMPT_SCALE:  # calculated from the whole prompt, as vLLM's calc_kv_scales
                assert key_scale == pytest.approx(prefill.keys[index].abs().max().item() / 200, rel=1e-6)
                assert value_scale == pytest.approx(prefill.values[index].abs().max().item() / 100, rel=1e-6)
            else:
                assert key_scale == value_scale == 1.0
            for packed, own, scale in (
                (layer.keys, kept.keys[index], key_scale),
                (layer.values, kept.values[index], value_scale),
            ):
                assert torch.equal(packed.codes, (own / scale).to(dtype8).view(torch.uint8))


@pytest.mark.parametrize("bits", [3, 4])
def test_turboquant_on_the_models_keys_and_values_is_within_the_papers_bound(engine, needle, bits):
    """Real keys (after RoPE, with their outlier channels) and values: the squared error relative to each vector's
    squared length, averaged per layer, is the codebook's expected error (the paper's D_mse ≈ 0.03 at 3 bits, 0.009
    at 4) and within Theorem 1's √3·π/2 · 4^(−b) in every layer."""
    _, _, prefill = needle
    bound = 3**0.5 * torch.pi / 2 * 4.0**-bits
    for tensors in (prefill.keys, prefill.values):
        errors = []
        for index, full in enumerate(tensors):
            x = full[0].float()
            rotation = turboquant.rotations(x.shape[-1], x.shape[0], 0, index)
            restored = turboquant.dequantize(
                turboquant.quantize(x, bits, rotation, torch.float16), rotation, torch.float32
            )
            errors.append(((restored - x).square().sum(-1) / x.square().sum(-1)).mean().item())
        assert max(errors) <= bound
        assert sum(errors) / len(errors) == pytest.approx(turboquant.expected_error(x.shape[-1], bits), rel=0.1)


def test_every_policy_and_format_runs_on_one_prefill_and_the_memory_view_shows_bytes_as_stored(
    tmp_path, capsys, loaded
):
    """Issue 51's grid on one short needle: every policy × every format from one prefill, each row's bytes the
    stored tensors' (the byte formula, held against them elsewhere), the memory view a row per format and budget,
    and the gate's baseline a cell per format."""
    out = tmp_path / "run"
    grid = ["--task", "needle", "--policy", "full,snapkv,pyramidkv", "--kv-bits", "16,fp8,tq4,tq3,4"]
    args = [*grid, "--memory", "0.25,0.125", "--lengths", "300", "--depths", "50", "--max-new-tokens", "6"]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *args, "--quiet", "--out", str(out)])
    assert exit_info.value.code == 0
    assert "25 rows written, 0 already done, 1 prefills" in capsys.readouterr().out  # (1 + 2·2) × 5 formats
    rows = read_rows(out)
    formats = {"16": KVFormat(16), **{spec: parse_format(spec) for spec in ("fp8", "tq4", "tq3")}, "4": KVFormat(4)}
    for row in rows:
        label = row.get("kv_format") or str(row["kv_bits"])
        assert row["kv_bytes"] == planned_bytes(formats[label], row["kv_kept"], 3, 64)
        if row["policy"] != "full":
            assert row["kv_bytes"] <= row["memory_target"]
    with pytest.raises(SystemExit):
        main(["report", str(out), "--view", "memory"])
    text = capsys.readouterr().out
    for label in ("16", "fp8", "tq4", "tq3", "4"):
        for budget in ("mem0.125", "mem0.25", "all"):
            assert f"| {label} | {budget} |" in text, (label, budget, text)
    baseline = tmp_path / "baseline.csv"
    for command in (["--update"], []):
        with pytest.raises(SystemExit) as exit_info:
            main(["check", "--baseline", str(baseline), "--results", str(out), *command])
        assert exit_info.value.code == 0
    cells = baseline.read_text()
    assert all(f",{label}," in cells for label in ("fp8", "tq4", "tq3"))
