"""scripts/bench_gpu.py --tiny: the GPU benchmark's whole code path, on CPU with a 2-layer random model."""

import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

import pandas as pd
from click.testing import CliRunner

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_gpu.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_gpu_benchmark_runs_every_measurement_and_the_exactness_checks_pass(tmp_path):
    bench_gpu = load_script()
    result = CliRunner().invoke(bench_gpu.main, ["--tiny", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    table = pd.read_csv(tmp_path / "bench_gpu.csv")
    assert (tmp_path / "bench_gpu.md").read_text().startswith("`scripts/bench_gpu.py --tiny` on ")
    assert not table.note.fillna("").str.startswith("failed").any(), table.note.tolist()
    exactness = table[table.measure.str.startswith("exactness")]
    assert len(exactness) == 9, exactness.measure.tolist()
    compared = exactness.measure.str.contains("vs")  # the statistics' fused routes against their references
    assert (exactness[~compared].note == "pass").all(), exactness.note.tolist()
    assert exactness[compared].note.str.endswith("entries shared 1.000").all(), exactness.note.tolist()
    h2o = exactness[exactness.measure.str.contains("H2O's sums")].set_index("model").note
    assert h2o["tiny (float32)"].startswith("fused")  # bfloat16 on a CPU takes the chunked route by design
    statistics = table[table.measure.str.startswith("prefill + statistics")]
    assert len(statistics) == 2 * len(bench_gpu.STATISTICS) and (statistics.ours_s > 0).all()
    placed = table[table.measure.str.startswith("device map")]
    assert len(placed) == 1 and placed.note.iloc[0].startswith("pass: 18 cells"), placed.note.tolist()
    assert placed.ours_s.iloc[0] > 0 and placed.ratio.iloc[0] > 0  # the placement's cost
    grid = table[table.measure.str.startswith("grid of 20")].iloc[0]
    assert "0 rows differ" in grid.note
    sync = table[table.measure.str.contains("set_sync_debug_mode")].note
    assert len(sync) == 1 and sync.iloc[0].startswith("pass"), sync.tolist()
    decode = table[table.measure.str.startswith("decode per token")]
    assert len(decode) == 3 and (decode.floor_s > 0).all() and (decode.vs_floor > 0).all()
    assert decode.note.str.endswith("kernel share n/a off CUDA").all(), decode.note.tolist()
    peer = table[table.measure.str.startswith("peer")].iloc[0]
    kvpress = [os.environ["PKVBENCH_KVPRESS_PATH"]] if os.environ.get("PKVBENCH_KVPRESS_PATH") else []
    if importlib.machinery.PathFinder.find_spec("kvpress", [*kvpress, *sys.path]) is None:
        assert peer.note.startswith("skipped: kvpress is not installed"), peer.note
    else:  # kvpress's pipeline on the grid's cells, the same model and prompt: the full cache's tokens are ours
        assert peer.baseline_s > 0 and peer.ratio > 0 and "20 calls" in peer.note, peer.note
        assert "full cache 4/4" in peer.note, peer.note


def test_the_full_size_configurations_have_the_published_parameter_counts():
    """Built on the meta device (no memory): Meta's model cards give 8,030,261,248 and 1,235,814,400 parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    bench_gpu = load_script()
    counts = {}
    for name in ("llama-3.1-8b", "llama-3.2-1b"):
        config = AutoConfig.for_model(**bench_gpu.read_config(bench_gpu.CONFIGS / f"{name}.json"))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counts[name] = sum(p.numel() for p in model.parameters())
    assert counts == {"llama-3.1-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400}


def test_the_device_map_check_fails_where_a_weight_is_read_outside_its_forward(monkeypatch):
    """The check against the engine as it was before issue 50: CriticalKV read each layer's output projection
    straight off the module, which accelerate keeps on the meta device between forwards where it offloaded the
    layer. The check names the cell and says FAIL (on a GPU, the layers run on the CPU fail more: each layer's cache
    and indices on its own device)."""
    from pkvbench.engine.architecture import Architecture

    bench_gpu = load_script()
    monkeypatch.setattr(
        Architecture, "output_weight", lambda self, model, layer: self.attention_modules(model)[layer].o_proj.weight
    )
    (placed,) = bench_gpu.device_map_check("cpu", 128, 4)
    assert placed["note"].startswith("FAIL: 1 of 18 cells: adakv(snapkv):critical=true: "), placed["note"]
