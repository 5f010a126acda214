"""``pkvbench funnel``: each statistic on hand-made attention, the tables and verdict on hand-made curves, and the
command on the embedded model."""

import json
import math

import pandas as pd
import pytest
import torch

from pkvbench.cell.schema import FUNNEL_STATISTICS
from pkvbench.cli import main
from pkvbench.engine.architecture import LayerSoftmax
from pkvbench.run.funnel import (
    FunnelRecorder,
    attention_statistics,
    change_point,
    funnel_tables,
    sample_frame,
    spearman,
    verdict,
)
from tests.test_stats import naive_attention


def stats_of(rows, visible=None, sink=4, top_k=10):
    """Statistics of one head whose attention rows are ``rows`` (a list of distributions over the same keys)."""
    probs = torch.tensor(rows, dtype=torch.float32)[None]
    visible = torch.tensor(visible or [probs.shape[-1]] * probs.shape[1])
    return {name: float(value[0]) for name, value in attention_statistics(probs, visible, sink, top_k).items()}


def test_uniform_attention_has_entropy_one_and_needs_ninety_percent_of_keys():
    keys = 200
    got = stats_of([[1 / keys] * keys])
    assert got["entropy"] == pytest.approx(1.0, abs=1e-6)
    assert got["top1pct_mass"] == pytest.approx(2 / keys)  # 1% of 200 keys = 2 keys
    assert got["topk_mass"] == pytest.approx(10 / keys)
    assert got["sink_mass"] == pytest.approx(4 / keys)
    assert got["keys_for_90"] == 180 and got["keys_for_90_frac"] == pytest.approx(0.9)


def test_one_hot_attention_has_entropy_zero_and_one_key_holds_everything():
    row = [0.0] * 50
    row[30] = 1.0
    got = stats_of([row])
    assert got["entropy"] == pytest.approx(0.0, abs=1e-7)
    assert got["top1pct_mass"] == got["topk_mass"] == pytest.approx(1.0)
    assert got["sink_mass"] == 0.0
    assert got["keys_for_90"] == 1 and got["keys_for_90_frac"] == pytest.approx(1 / 50)
    row[30], row[2] = 0.0, 1.0  # the same spike on a sink token
    assert stats_of([row])["sink_mass"] == pytest.approx(1.0)


def test_known_distribution():
    masses = [0.05, 0.5, 0.15, 0.3]  # sorted: 0.5, 0.3, 0.15, 0.05
    got = stats_of([masses], sink=1, top_k=2)
    expected_entropy = -sum(p * math.log(p) for p in masses) / math.log(4)
    assert got["entropy"] == pytest.approx(expected_entropy, rel=1e-6)
    assert got["topk_mass"] == pytest.approx(0.8)
    assert got["top1pct_mass"] == pytest.approx(0.5)  # 1% of 4 keys rounds up to one key
    assert got["sink_mass"] == pytest.approx(0.05)
    assert got["keys_for_90"] == 3  # 0.5 + 0.3 = 0.8 falls short, + 0.15 reaches it
    assert stats_of([[0.6, 0.3, 0.1, 0.0]])["keys_for_90"] == 2  # exactly 90% is enough


def test_rows_see_only_their_causal_keys_and_are_averaged():
    # A query that sees one key; one that sees two, evenly; one that sees all four, evenly.
    rows = [[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0.25] * 4]
    got = stats_of(rows, visible=[1, 2, 4], sink=1, top_k=1)
    assert got["entropy"] == pytest.approx((0 + 1 + 1) / 3)
    assert got["keys_for_90"] == pytest.approx((1 + 2 + 4) / 3)
    assert got["keys_for_90_frac"] == pytest.approx((1 + 1 + 1) / 3)
    assert got["topk_mass"] == pytest.approx((1 + 0.5 + 0.25) / 3)
    assert got["top1pct_mass"] == got["topk_mass"]


def test_heads_are_measured_separately():
    probs = torch.stack([torch.full((1, 10), 0.1), torch.eye(10)[:1]])  # head 0 uniform, head 1 one-hot
    got = attention_statistics(probs, torch.tensor([10]), sink=1, top_k=1)
    assert got["entropy"].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert got["keys_for_90"].tolist() == [9.0, 1.0]


def test_recorder_measures_the_last_window_of_causal_softmax_attention():
    gen = torch.Generator().manual_seed(3)
    query, key = torch.randn(6, 40, 8, generator=gen), torch.randn(2, 40, 8, generator=gen)
    recorder = FunnelRecorder([LayerSoftmax(0.3)] * 8, window=5, sink=2, top_k=3)
    recorder.observe(7, query[None], key[None])
    expected = attention_statistics(naive_attention(query, key, 0.3)[:, -5:], torch.arange(36, 41), 2, 3)
    assert set(recorder.layers) == {7}
    for name in FUNNEL_STATISTICS:
        torch.testing.assert_close(recorder.layers[7][name], expected[name])


def records(curve_per_sample):
    """Sample records whose two heads have entropy curve ± 0.1 (other statistics follow the curve)."""
    out = []
    for number, curve in enumerate(curve_per_sample):
        stats = {name: [[value - 0.1, value + 0.1] for value in curve] for name in FUNNEL_STATISTICS}
        out.append({"task": "t", "sample_id": str(number), "context_tokens": 100, "stats": stats})
    return out


def test_tables_average_heads_then_samples_with_spread():
    per_layer, per_head = funnel_tables(sample_frame(records([[0.8, 0.4], [0.6, 0.2]])))
    entropy = per_layer[per_layer["statistic"] == "entropy"].set_index("layer")
    assert entropy["mean"].tolist() == pytest.approx([0.7, 0.3])
    assert entropy["std"].tolist() == pytest.approx([math.sqrt(0.02)] * 2)  # over the two samples
    assert entropy["min"].tolist() == pytest.approx([0.6, 0.2]) and entropy["max"].tolist() == pytest.approx([0.8, 0.4])
    assert entropy["head_std"].tolist() == pytest.approx([math.sqrt(0.02)] * 2)  # heads differ by 0.2
    assert entropy["head_min"].tolist() == pytest.approx([0.6, 0.2]) and entropy["head_max"].tolist() == pytest.approx(
        [0.8, 0.4]
    )
    assert entropy["samples"].tolist() == [2, 2]
    assert list(dict.fromkeys(per_layer["statistic"])) == list(FUNNEL_STATISTICS)
    heads = per_head[(per_head["statistic"] == "entropy") & (per_head["layer"] == 0)]
    assert heads["mean"].tolist() == pytest.approx([0.6, 0.8])


def test_spearman_and_change_point():
    layers = pd.Series(range(6), dtype=float)
    assert spearman(layers, pd.Series([9, 7, 5, 4, 2, 1])) == pytest.approx(-1.0)
    assert spearman(layers, pd.Series([1, 2, 3, 5, 8, 9])) == pytest.approx(1.0)
    assert change_point(pd.Series([0.9, 0.8, 0.85, 0.3, 0.2, 0.25])) == 3
    # One outlying bottom layer does not make the split: the step in the rest does.
    assert change_point(pd.Series([0.1, 0.8, 0.8, 0.8, 0.8, 0.2, 0.2, 0.2, 0.2])) == 5


def verdict_for(curve):
    per_layer, _ = funnel_tables(sample_frame(records([curve])))
    return verdict(per_layer, "t", "m", 1, 100, 4)


def test_verdict_reads_the_trend():
    falling = verdict_for([0.9 - 0.05 * i for i in range(12)])
    assert "a strong funnel" in falling and "rho against layer index -1.00" in falling
    assert "premise (larger budgets low, smaller high) fits" in falling
    rising = verdict_for([0.3 + 0.05 * i for i in range(12)])
    assert "opposite of a funnel" in rising and "premise does not hold" in rising
    flat = verdict_for([0.5, 0.6, 0.5, 0.6, 0.5, 0.6, 0.5, 0.6, 0.5, 0.6, 0.5, 0.6])
    assert "does not concentrate with depth" in flat


def test_verdict_sets_the_pyramid_against_the_keys_attention_needs():
    per_layer, _ = funnel_tables(sample_frame(records([[40, 30, 20, 10, 5, 5]])))  # keys_for_90 ± 0.1 per head
    text = verdict(per_layer, "t", "m", 1, 100, 4, pyramid=[50, 40, 30, 20, 10, 4], budget="25")
    assert "At budget 25, PyramidKV keeps 45 entries per head in the lowest third and 7 in the top third" in text
    assert "lies on 35 and 5 keys on average over heads (35 and 5 in each layer's widest head)" in text
    assert "it keeps fewer than the average head's in layers 5." in text


@pytest.mark.model
def test_funnel_command_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "funnel"
    args = ["funnel", "--task", "needle", "--lengths", "400", "--depths", "0,100", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    printed = capsys.readouterr()
    assert exit_info.value.code == 0, printed.err
    assert "2 samples measured, 0 already done" in printed.out
    assert "smollm2-135m on needle (2 samples" in printed.out
    assert (out / "verdict.txt").read_text().strip() in printed.out
    assert (out / "funnel.png").stat().st_size > 10_000
    lines = (out / "funnel_samples.jsonl").read_text().splitlines()
    assert len(lines) == 2
    for name in FUNNEL_STATISTICS:
        assert len(json.loads(lines[0])["stats"][name]) == 30  # layers
        assert len(json.loads(lines[0])["stats"][name][0]) == 9  # query heads
    per_layer = pd.read_csv(out / "funnel.csv")
    assert len(per_layer) == 30 * len(FUNNEL_STATISTICS) and set(per_layer["samples"]) == {2}
    shares = per_layer[per_layer["statistic"] != "keys_for_90"]
    assert shares["mean"].between(0, 1).all()
    assert len(pd.read_csv(out / "funnel_heads.csv")) == 30 * 9 * len(FUNNEL_STATISTICS)

    with pytest.raises(SystemExit) as exit_info:  # the same command again measures nothing new
        main([*args, "--quiet"])
    assert exit_info.value.code == 0
    assert "0 samples measured, 2 already done" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:  # other options into the same folder: one line, exit 2
        main([*args, "--window", "16"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "window differ" in err and len(err.strip().splitlines()) == 1


def test_funnel_rejects_two_budgets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["funnel", "--budget", "64,128"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--budget takes one budget" in err
