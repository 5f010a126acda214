"""Every figure kind renders from the hand-made run folders (no model): files exist, are PNGs, and come in the
expected number."""

from pathlib import Path

import pytest

from pkvbench.reports.report import load_runs
from pkvbench.store.outputs import MANIFEST

RUNS = Path(__file__).parent / "fixtures" / "runs"
PNG = b"\x89PNG\r\n\x1a\n"


def pngs(folder: Path) -> list[str]:
    files = sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)
    for name in files:
        data = (folder / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    return files


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    from pkvbench.reports.figures.plots import plot_runs

    out = tmp_path_factory.mktemp("figs")
    paths = plot_runs(load_runs([RUNS / "needle_a", RUNS / "needle_more", RUNS / "longbench_llama"]), out)
    return out, paths


def test_needle_heatmaps_one_per_model_policy_budget_plus_the_combined_figure(rendered):
    out, _paths = rendered
    heatmaps = [n for n in pngs(out) if n.startswith("needle_heatmap_")]
    # full, snapkv, pyramidkv at 64 and 0.05 (needle_a) + streamingllm at 64 (needle_more)
    assert heatmaps == sorted(
        f"needle_heatmap_SmolLM2-135M-Instruct_{p}_{b}.png"
        for p, b in [
            ("full", "64"),
            ("full", "0.05"),
            ("snapkv", "64"),
            ("snapkv", "0.05"),
            ("pyramidkv", "64"),
            ("pyramidkv", "0.05"),
            ("streamingllm", "64"),
        ]
    )
    assert "needle_heatmaps_SmolLM2-135M-Instruct_all.png" in pngs(out)


def test_curves_one_figure_per_model(rendered):
    out, paths = rendered
    assert [n for n in pngs(out) if n.startswith("curves_")] == [
        "curves_Meta-Llama-3-8B-Instruct.png",
        "curves_SmolLM2-135M-Instruct.png",
    ]
    # 7 heatmaps + 1 combined + 2 curve figures, nothing else, and the paths returned are those files
    assert len(paths) == 10 and sorted(p.name for p in paths) == pngs(out)


def test_curve_points_and_full_reference():
    from pkvbench.reports.figures.figure_data import curve_table, full_reference

    rows = load_runs([RUNS / "longbench_llama"]).rows
    points = curve_table(rows)
    avg = points[points["task"] == "avg"].set_index("policy")["score"]
    assert avg["snapkv"] == pytest.approx(46.67, abs=0.005)
    assert "pyramidkv" not in avg.index  # an average needs every task
    llama = rows[rows["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"]
    assert full_reference(llama, "trec")[0] == pytest.approx(50.0)


def test_layer_budget_chart(tmp_path):
    from pkvbench.cli import main

    target = tmp_path / "budgets.png"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "budgets",
                "--policy",
                "pyramidkv,snapkv",
                "--budget",
                "128,0.05",
                "--layers",
                "32",
                "--context",
                "8192",
                "--plot",
                str(target),
            ]
        )
    assert exit_info.value.code == 0
    assert pngs(tmp_path) == ["budgets.png"]


def test_plot_cli_and_bad_plot_file(tmp_path, capsys):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(RUNS / "needle_a"), "--out", str(tmp_path / "f")])
    assert exit_info.value.code == 0
    assert "8 figures" in capsys.readouterr().out  # 6 heatmaps + combined + curves
    assert len(pngs(tmp_path / "f")) == 8
    with pytest.raises(SystemExit) as exit_info:
        main(["budgets", "--plot", str(tmp_path / "chart.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "use a .png, .pdf or .svg" in err[0]
