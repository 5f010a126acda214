"""kvpress's result layout from a pkvbench run folder (no model)."""

import json

import pandas as pd
import yaml

from pkvbench.cli import main


def row(task, sample, policy, budget, mode, score, kept=3000, length=4000):
    return {
        "task": task,
        "sample_id": sample,
        "policy": policy,
        "budget": budget,
        "query_mode": mode,
        "score": score,
        "pred": f"answer {sample}",
        "answers": ["1234567"],
        "budget_tokens": kept,
        "context_tokens": length,
        "length": length,
        "model": "smollm2-135m",
    }


def test_export_writes_kvpress_folders(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        row("niah_single_1", "len4000_0", "adakv(expected_attention:epsilon=0.01)", "cr0.25", "agnostic", 1.0),
        row("niah_single_1", "len4000_1", "adakv(expected_attention:epsilon=0.01)", "cr0.25", "agnostic", 0.0),
        row("vt", "len4000_0", "adakv(expected_attention:epsilon=0.01)", "cr0.25", "agnostic", 0.6),
        row("niah_single_1", "len4000_0", "snapkv:window=64:kernel=5:pooling=avg", "cr0.875", "aware", 1.0),
        row("niah_single_1", "len4000_0", "full", 128, "aware", 1.0, kept=4000),
    ]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "run.json").write_text(json.dumps({"options": {"model": "smollm2-135m"}}))
    try:
        main(["export", str(run), "--format", "kvpress", "--out", str(tmp_path / "kv")])
    except SystemExit as exit_info:
        assert exit_info.code == 0, capsys.readouterr().err
    folders = sorted(p.name for p in (tmp_path / "kv").iterdir() if p.is_dir())
    assert folders == [
        "ruler__4000__SmolLM2-135M-Instruct__expected_attention__0.25",
        "ruler__4000__SmolLM2-135M-Instruct__no_press__0.00__query_aware",
        "ruler__4000__SmolLM2-135M-Instruct__snapkv__0.88__query_aware",  # kvpress writes 0.875 as 0.88 too
    ]
    folder = tmp_path / "kv" / folders[0]
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics == {"niah_single_1": {"string_match": 50.0}, "vt": {"string_match": 60.0}}
    predictions = pd.read_csv(folder / "predictions.csv")
    assert {"task", "answer", "predicted_answer", "compression_ratio"} <= set(predictions.columns)
    assert len(predictions) == 3 and set(predictions["compression_ratio"]) == {0.25}
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["press"] == "expected_attention" and config["query_aware"] is False


def test_ranking_averages_task_means_per_ratio_and_ranks_against_the_full_cache(tmp_path):
    from pkvbench.reports.axes import order_axes
    from pkvbench.reports.export import leaderboard_ranking

    rows = order_axes(
        pd.DataFrame(
            [
                # tova: niah 1.0 and 0.0 at cr0.5 (mean 0.5), vt 1.0 → 75.0 at cr0.5; 0.0 everywhere at cr0.75 → avg 37.5
                row("niah_single_1", "len4000_0", "tova", "cr0.5", "agnostic", 1.0),
                row("niah_single_1", "len4000_1", "tova", "cr0.5", "agnostic", 0.0),
                row("vt", "len4000_0", "tova", "cr0.5", "agnostic", 1.0),
                row("niah_single_1", "len4000_0", "tova", "cr0.75", "agnostic", 0.0),
                row("vt", "len4000_0", "tova", "cr0.75", "agnostic", 0.0),
                # knorm: 1.0 everywhere → avg 100, rank 1 above tova
                *(
                    row(t, "len4000_0", "knorm", b, "agnostic", 1.0)
                    for t in ("niah_single_1", "vt")
                    for b in ("cr0.5", "cr0.75")
                ),
                row("niah_single_1", "len4000_0", "full", "cr0.5", "agnostic", 1.0, kept=4000),
            ]
        )
    )
    table = leaderboard_ranking(rows).set_index("policy")
    assert list(table.index) == ["full", "knorm", "tova"]
    assert table.loc["full", "rank"] == 0 and table.loc["knorm", "rank"] == 1 and table.loc["tova", "rank"] == 2
    assert (
        table.loc["tova", "cr0.5"] == 75.0 and table.loc["tova", "cr0.75"] == 0.0 and table.loc["tova", "avg"] == 37.5
    )
    assert table.loc["knorm", "avg ci_low"] == table.loc["knorm", "avg ci_high"] == 100.0  # nothing varies
    assert table.loc["tova", "cr0.5 ci_low"] <= 75.0 <= table.loc["tova", "cr0.5 ci_high"]
    assert table.loc["tova", "n"] == 5


def test_a_policy_is_named_as_kvpress_s_press_only_with_the_presss_settings():
    from pkvbench.reports.export import kvpress_name

    assert kvpress_name("snapkv:window=64:kernel=5:pooling=avg") == "snapkv"
    assert kvpress_name("snapkv") == "pkvbench_snapkv"  # window 8, max-pooling: pkvbench's own SnapKV
    assert kvpress_name("knorm:ties=topk") == "knorm" and kvpress_name("knorm") == "pkvbench_knorm"
    assert kvpress_name("chunkkv(snapkv:window=64:kernel=5:pooling=avg):count=share:pinned=max+1") == "chunkkv"
    assert kvpress_name("chunkkv(snapkv:window=64:kernel=5:pooling=avg):count=share") != "chunkkv"  # window at +inf
    assert kvpress_name("chunkkv(snapkv:window=64:kernel=5:pooling=avg)").startswith("chunkkv-snapkv")
    assert kvpress_name("adakv(snapkv:window=64:kernel=5:pooling=avg):critical=true") == "critical_adakv_snapkv"
    assert kvpress_name("adakv(expected_attention:epsilon=0.01)") == "expected_attention"
    assert kvpress_name("h2o:window=32") == "h2o-window=32"
