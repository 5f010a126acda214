"""`pkvbench report --html`: the page's data from hand-written run folders, the command's errors, the size of a
10,000-row page, and the page itself rendered in headless Chromium (no model is loaded)."""

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

from pkvbench.errors import PkvError
from pkvbench.reports.figures.html_figures import (
    budget_curve_figures,
    curve_points,
    needle_heatmap_figures,
)
from pkvbench.reports.html_report import (
    CONTEXT_EXCERPT_CHARS,
    build_page,
    check_html_target,
    context_excerpt,
    page_data,
    summary_table,
    write_html_report,
)
from pkvbench.reports.report import load_runs

FIXTURE_RUNS = Path(__file__).parent / "fixtures" / "runs"
MODEL = "smollm2-135m"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
RIGHT = f"The best thing to do in San Francisco is to {ANSWER}."
WRONG = "The best thing to do in San Francisco is to visit the Golden Gate Bridge."
REWORDED = f"The best thing to do in San Francisco: {ANSWER}!"
# A prediction that is HTML: the page must show it as text and stay whole.
INJECTED = "</script><b id='injected'>bold?</b> I do not know."
QUESTION = "What is the best thing to do in San Francisco?"
CONTEXT_HEAD, CONTEXT_TAIL = "Want to start a startup? Get funded by", "sit in Dolores Park on a sunny day."
SAMPLES = ("len1000_depth0", "len1000_depth50", "len2000_depth0", "len2000_depth50")
POLICIES = ("full", "streamingllm", "snapkv", "pyramidkv")
BUDGETS = (64, 128)
KEPT = {"full": [1000, 1000, 1000, 1000], "pyramidkv": [110, 80, 48, 18], "snapkv": [64, 64, 64, 64]}


def prediction(sample: str, policy: str, budget: int) -> tuple[str, float]:
    """The fixture's story: len1000_depth50 and len2000_depth50 lost points (PyramidKV and StreamingLLM at 64),
    len2000_depth0 disagrees without losing (SnapKV at 128 rewords the answer), len1000_depth0 agrees."""
    if (sample, policy, budget) == ("len1000_depth50", "pyramidkv", 64):
        return WRONG, 0.2
    if (sample, policy, budget) == ("len2000_depth50", "streamingllm", 64):
        return INJECTED, 0.0
    if (sample, policy, budget) == ("len2000_depth0", "snapkv", 128):
        return REWORDED, 1.0
    return RIGHT, 1.0


def result_row(sample: str, policy: str, budget: int) -> dict:
    length, depth = (int(part) for part in re.findall(r"\d+", sample))
    pred, score = prediction(sample, policy, budget)
    kept = KEPT.get(policy, [budget] * 4)
    return {
        "task": "needle",
        "sample_id": sample,
        "policy": policy,
        "budget": budget,
        "query_mode": "aware",
        "model": MODEL,
        "budget_tokens": sum(kept) / len(kept),
        "context_tokens": length,
        "kv_kept": [k * length // 1000 if policy == "full" else k for k in kept],
        "kv_bytes": 1024 * sum(kept),
        "pred": pred,
        "answers": [ANSWER],
        "score": score,
        "prefill_s": 0.5,
        "decode_s": 0.2,
        "length": length,
        "depth": float(depth),
        "question_text": QUESTION,
        "context_head": CONTEXT_HEAD,
        "context_tail": CONTEXT_TAIL,
    }


def write_run(folder: Path, samples=SAMPLES, shard: str | None = None, policies=POLICIES) -> Path:
    folder.mkdir(parents=True)
    rows = [result_row(s, p, b) for s in samples for p in policies for b in BUDGETS]
    (folder / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    record = {
        "options": {
            "model": MODEL,
            "tasks": ["needle"],
            "policies": list(policies),
            "budgets": list(BUDGETS),
            "protocol": "exact",
            "query_modes": ["aware"],
            "lengths": [1000, 2000],
            "depths": [0, 50],
            "shard": shard,
        },
        "model": {
            "name": MODEL,
            "source": "SmolLM2-135M-Instruct.gguf",
            "device": "cpu",
            "dtype": "float32",
            "layers": 4,
        },
        "policies": {p: {} for p in policies},
        "executor": "local",
        "versions": {"pkvbench": "0.1.0", "torch": "2.13.0", "transformers": "5.0.0", "python": "3.11.2"},
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "started": "2026-01-05T10:00:00+00:00",
    }
    (folder / "run.json").write_text(json.dumps(record, indent=2))
    return folder


@pytest.fixture
def run_folder(tmp_path):
    return write_run(tmp_path / "demo")


def embedded_data(page: str) -> dict:
    """The page's data, as its script reads it."""
    return json.loads(re.search(r'<script type="application/json" id="pkvbench-data">(.*?)</script>', page, re.S)[1])


def sample_entry(data: dict, sample_id: str) -> dict:
    return next(s for s in data["samples"]["samples"] if s["id"] == sample_id)


# --- the page's data ---------------------------------------------------------------------------------------------


def test_summary_is_summary_csv_per_model_with_the_loss_against_the_full_cache(run_folder):
    table = summary_table(load_runs([run_folder]).rows)
    assert list(table.columns[:4]) == ["model", "task", "policy", "budget"]
    assert {"n", "score", "vs full"} <= set(table.columns)
    assert list(dict.fromkeys(table["policy"])) == list(POLICIES)  # the report's order, not alphabetical
    cell = table[(table["policy"] == "pyramidkv") & (table["budget"] == "64")].iloc[0]
    assert cell["n"] == 4
    assert cell["score"] == pytest.approx(80.0)  # (0.2 + 3 × 1) / 4
    assert cell["vs full"] == pytest.approx(-20.0)


def test_samples_carry_every_prediction_and_flag_disagreement_and_lost_points(run_folder):
    data = page_data(load_runs([run_folder]))
    samples = data["samples"]
    assert len(samples["configs"]) == len(POLICIES) * len(BUDGETS)
    assert [c["policy"] for c in samples["configs"]][:2] == ["full", "full"]
    flags = {s["id"]: (s["disagree"], s["lost"]) for s in samples["samples"]}
    assert flags == {
        "len1000_depth0": (False, False),
        "len1000_depth50": (True, True),
        "len2000_depth0": (True, False),
        "len2000_depth50": (True, True),
    }
    sample = sample_entry(data, "len1000_depth50")
    predictions = {
        (samples["configs"][config]["policy"], samples["configs"][config]["budget"]): (pred, score)
        for config, pred, score, _ in sample["rows"]
    }
    assert predictions[("pyramidkv", "64")] == (WRONG, 0.2)
    assert predictions[("full", "128")] == (RIGHT, 1.0)
    assert sample["answers"] == [ANSWER]
    assert sample["question"] == QUESTION
    assert sample["context"] == f"{CONTEXT_HEAD}\n\n[…]\n\n{CONTEXT_TAIL}"
    assert sample["fields"] == {"context_tokens": 1000, "length": 1000, "depth": 50.0}


def test_a_whole_context_of_another_tool_is_cut_to_its_head_and_tail():
    context = "Paul Graham essay text. " * 400
    shown = context_excerpt({"context": context})
    assert len(shown) < CONTEXT_EXCERPT_CHARS + 100 < len(context)
    assert shown.startswith("Paul Graham essay text.") and "characters left out" in shown
    assert context_excerpt({"context_head": "all of it", "context_tail": ""}) == "all of it"
    assert context_excerpt({"pred": "x"}) is None


def test_metadata_names_model_protocol_versions_commit_and_when(run_folder):
    (run,) = page_data(load_runs([run_folder]))["runs"]
    facts = dict(run["facts"])
    assert facts["model"].startswith(f"{MODEL} (SmolLM2-135M-Instruct.gguf, 4 layers")
    assert facts["protocol"] == "exact"
    assert facts["commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert "torch 2.13.0" in facts["versions"]
    assert facts["started"] == "2026-01-05T10:00:00+00:00"
    assert "last row written" in facts
    assert run["options"]["budgets"] == [64, 128]


def test_figures_curves_heatmap_and_layer_budgets(run_folder):
    figures = page_data(load_runs([run_folder]))["figures"]
    assert [f["kind"] for f in figures] == ["curves", "heatmap", "layers"]
    layers = json.dumps(figures[2]["spec"])
    assert '"kept": 64.0' in layers and '"full"' not in layers  # the full cache would flatten the other lines


def test_intervals_in_the_summary_are_drawn_and_hovered(run_folder):
    rows = load_runs([run_folder]).rows
    points = curve_points(rows)
    points["ci_low"], points["ci_high"] = points["score"] - 5, points["score"] + 5
    (figure,) = budget_curve_figures(points, rows)
    spec = json.dumps(figure["spec"])
    assert '"y2": {"field": "ci_high"' in spec
    assert '"field": "ci_low"' in spec and "interval" in figure["caption"]
    no_interval = budget_curve_figures(points.drop(columns=["ci_low", "ci_high"]), rows)
    assert "ci_high" not in json.dumps(no_interval[0]["spec"])


def test_a_policy_missing_at_a_budget_keeps_the_heatmap_grid_aligned():
    """needle_more runs StreamingLLM at 64 only: its square at 0.05 is there, empty, so that Vega-Lite does not shift
    the other policies' cells under the wrong headers."""
    rows = load_runs([FIXTURE_RUNS / "needle_a", FIXTURE_RUNS / "needle_more"]).rows
    (figure,) = needle_heatmap_figures(rows)
    values = figure["spec"]["data"]["values"]
    empty = [v for v in values if v["score"] is None]
    assert [(v["policy"], v["row"]) for v in empty] == [("streamingllm", "budget 0.05")]
    assert {(v["policy"], v["row"]) for v in values} == {
        (policy, f"budget {budget}")
        for policy in ("full", "streamingllm", "snapkv", "pyramidkv")
        for budget in ("64", "0.05")
    }


def test_several_folders_make_one_page(tmp_path):
    first = write_run(tmp_path / "shard1", SAMPLES[:2], shard="1/2")
    second = write_run(tmp_path / "shard2", SAMPLES[2:], shard="2/2")
    data = page_data(load_runs([first, second]))
    assert [s["id"] for s in data["samples"]["samples"]] == list(SAMPLES)
    assert len(data["runs"]) == 2
    assert data["tables"]["summary"]["rows"][0][data["tables"]["summary"]["columns"].index("n")] == 4


def test_repository_fixtures_merge_models_and_compare_with_the_paper():
    data = page_data(load_runs([FIXTURE_RUNS]))
    assert data["comparison"] is not None  # the Llama-3 LongBench fixture shares tasks with Table 1
    assert "narrativeqa" in data["comparison"]["table"]["rows"][0]
    assert any("counted once" in note or "repeat" in note for note in data["notes"])
    assert {f["kind"] for f in data["figures"]} == {"curves", "heatmap"}  # the fixtures record no kv_kept


class References(HTMLParser):
    """The src and href attributes of a page's elements (script contents are not markup, and are not read)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def handle_starttag(self, tag, attrs):
        self.found += [f"<{tag} {name}={value}>" for name, value in attrs if name in ("src", "href")]


def external_references(page: str) -> list[str]:
    parser = References()
    parser.feed(page)
    return [ref for ref in parser.found if "=#" not in ref]  # links within the page are fine


def test_page_is_one_file_that_fetches_nothing_and_keeps_html_in_predictions_as_text(run_folder, tmp_path):
    report = write_html_report([run_folder], tmp_path / "report.html")
    page = report.path.read_text()
    assert report.bytes == len(page.encode())
    assert external_references(page) == []  # scripts, styles and figures are all inline
    assert page.count("</script>") == 3  # data, Vega, the page's script: none from a prediction
    data = embedded_data(page)
    assert any(row[1] == INJECTED for row in sample_entry(data, "len2000_depth50")["rows"])


def test_page_written_from_the_same_rows_is_the_same_but_for_its_time(run_folder):
    runs = load_runs([run_folder])
    first, second = (re.sub(r'"generated":"[^"]+"', "", build_page(runs)) for _ in range(2))
    assert first == second


# --- the command -------------------------------------------------------------------------------------------------


def run_cli(capsys, *args):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_report_html_writes_the_page(run_folder, tmp_path, capsys):
    target = tmp_path / "pages" / "report.html"
    code, out, err = run_cli(capsys, "report", str(run_folder), "--html", str(target))
    assert code == 0, err
    assert out == ""  # the page instead of the table
    assert f"html report → {target}" in err
    assert "pkvbench-data" in target.read_text()
    table = tmp_path / "table.md"
    code, out, err = run_cli(capsys, "report", str(run_folder), "--html", str(target), "--out", str(table))
    assert code == 0, err
    assert "| pyramidkv | 64 |" in table.read_text()  # with --out, the table too


@pytest.mark.parametrize(
    "policies",
    [("full",), ("snapkv",), ("full", "snapkv"), POLICIES],
    ids=["full-alone", "one-policy", "full-and-one", "many"],
)
def test_report_table_figures_and_page_for_one_two_and_many_policies(policies, tmp_path, capsys):
    """Issue 47 R2: under pandas 3 a map over the policy column (an ordered categorical) is itself a categorical
    where the map is one-to-one (full and one other policy), and ``~`` on it failed the page of any folder of one or
    two policies: every report of a folder draws, whatever its policies."""
    folder = write_run(tmp_path / "run", policies=policies)
    code, out, err = run_cli(capsys, "report", str(folder))
    assert code == 0, err
    assert [line.split(" | ")[1] for line in out.splitlines()[2:]] == [p for p in policies for _ in BUDGETS]
    code, out, err = run_cli(capsys, "plot", str(folder), "--out", str(tmp_path / "png"))
    assert code == 0, err
    pngs = sorted(p.name for p in (tmp_path / "png").glob("*.png"))
    assert "curves_SmolLM2-135M-Instruct.png" in pngs
    assert len(pngs) == len(policies) * len(BUDGETS) + 2  # a heatmap per cell, the combined heatmap, the curves
    assert all((tmp_path / "png" / name).read_bytes().startswith(b"\x89PNG") for name in pngs)
    page = tmp_path / "report.html"
    code, out, err = run_cli(capsys, "report", str(folder), "--html", str(page))
    assert code == 0, err
    data = embedded_data(page.read_text())
    drawn = [figure["kind"] for figure in data["figures"]]
    compressed = [p for p in policies if p != "full"]
    # the curves and layer budgets draw the compressed policies (the full cache is the curves' dashed line)
    assert drawn == ["curves", "heatmap", "layers"] if compressed else ["heatmap"]
    assert [c["policy"] for c in data["samples"]["configs"]] == [p for p in policies for _ in BUDGETS]
    assert data["ranks"]["policy"] == {p: i for i, p in enumerate(policies)}


@pytest.mark.parametrize(
    "where,expected",
    [
        ("missing", "no such folder"),
        ("samples.jsonl", "give a file name ending in .html"),
        ("summary.csv", "give a file name ending in .html"),
        ("folder.html", "is a directory"),  # Click says so (dir_okay=False)
        ("under-a-file", "is a file, not a folder"),
    ],
)
def test_bad_html_targets_are_one_line(where, expected, run_folder, tmp_path, capsys):
    (tmp_path / "folder.html").mkdir()
    (tmp_path / "plain-file").write_text("keep me")
    folder, target = (
        str(run_folder),
        {
            "missing": str(tmp_path / "report.html"),
            "samples.jsonl": str(run_folder / "samples.jsonl"),
            "summary.csv": str(run_folder / "summary.csv"),
            "folder.html": str(tmp_path / "folder.html"),
            "under-a-file": str(tmp_path / "plain-file" / "report.html"),
        }[where],
    )
    if where == "missing":
        folder = str(tmp_path / "no-such-run")
    before = (run_folder / "samples.jsonl").read_bytes()
    code, _, err = run_cli(capsys, "report", folder, "--html", target)
    assert code == 2
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("pkvbench: error: ") and expected in line
    assert (run_folder / "samples.jsonl").read_bytes() == before
    assert (tmp_path / "plain-file").read_text() == "keep me"


def test_run_refuses_a_bad_html_path_before_loading_the_model(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", "--out", str(tmp_path / "run"), "--html", str(tmp_path / "report.csv"))
    assert code == 2
    assert "give a file name ending in .html" in err
    assert not (tmp_path / "run").exists()


def test_check_html_target_accepts_a_new_folder(tmp_path):
    assert check_html_target(tmp_path / "new" / "deeper" / "r.html") == tmp_path / "new" / "deeper" / "r.html"
    with pytest.raises(PkvError, match="ending in .html"):
        check_html_target(tmp_path / "r.png")


# --- a 10,000-row run --------------------------------------------------------------------------------------------

BIG_POLICIES = ("full", "streamingllm", "h2o", "snapkv", "pyramidkv")
BIG_BUDGETS = (64, 128, 256, 512)
PAGE_SIZE_LIMIT = 3_000_000  # bytes; docs/report-html.md gives the measured size


def write_big_run(folder: Path) -> Path:
    """500 needle samples × 5 policies × 4 budgets = 10,000 rows, predictions of a typical length (~70 chars)."""
    folder.mkdir(parents=True)
    lines = []
    for i in range(500):
        length, depth = (1000, 2000, 4000, 8000, 16000)[i % 5], (0, 25, 50, 75, 100)[(i // 5) % 5]
        for p, policy in enumerate(BIG_POLICIES):
            for budget in BIG_BUDGETS:
                score = 1.0 if policy == "full" else ((i + p + budget) % 7) / 6
                lines.append(
                    json.dumps(
                        {
                            "task": "needle",
                            "sample_id": f"len{length}_depth{depth}_seed{i}",
                            "policy": policy,
                            "budget": budget,
                            "query_mode": "aware",
                            "model": MODEL,
                            "budget_tokens": float(budget),
                            "context_tokens": length,
                            "kv_kept": [length if policy == "full" else budget] * 30,
                            "pred": f"The best thing to do in San Francisco is option {(i * p + budget) % 13}, sample {i}.",
                            "answers": [ANSWER],
                            "score": score,
                            "length": length,
                            "depth": float(depth),
                        }
                    )
                )
    (folder / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "run.json").write_text(json.dumps({"options": {"model": MODEL}}))
    return folder


def test_a_10000_row_run_makes_a_page_of_a_few_megabytes(tmp_path):
    report = write_html_report([write_big_run(tmp_path / "big")], tmp_path / "big.html")
    assert len(report.runs.rows) == 10_000
    assert report.bytes < PAGE_SIZE_LIMIT, f"{report.bytes / 1e6:.2f} MB"


# --- in a real browser -------------------------------------------------------------------------------------------

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("no chromium on PATH (.ci/run installs it: apt-get install chromium); the page is not rendered")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def test_the_page_renders_in_chromium_offline_and_shows_a_samples_predictions(browser, run_folder, tmp_path):
    from playwright.sync_api import expect  # installed: the browser fixture skips otherwise

    page_file = write_html_report([run_folder], tmp_path / "report.html").path
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems, requests = [], []
    page.on("console", lambda message: message.type == "error" and problems.append(message.text))
    page.on("pageerror", lambda error: problems.append(str(error)))

    def only_the_file(route):  # the page must need nothing else: anything else is counted and refused
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            requests.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_file)
    page.goto(page_file.as_uri())

    # The summary table, sortable.
    table = page.locator("#summary-data")
    assert table.locator("tbody tr").count() == len(POLICIES) * len(BUDGETS)
    assert table.locator("tbody tr").first.locator("td").nth(2).inner_text() == "full"
    table.locator("th", has_text="vs full").click()  # ascending: the biggest loss first (75 vs 100)
    assert table.locator("tbody tr").first.locator("td").nth(2).inner_text() == "streamingllm"

    # Every figure drawn, as SVG.
    page.click("#tabs a[data-tab=figures]")
    page.wait_for_selector("figure.chart .vega-target[data-rendered=true] svg", timeout=30_000)
    page.wait_for_function("document.querySelectorAll('.vega-target[data-rendered=true]').length === 3", timeout=30_000)
    squares = page.locator("figure.chart[data-kind=heatmap] svg.marks g.mark-rect.role-mark path")
    assert squares.count() == len(SAMPLES) * len(POLICIES) * len(BUDGETS)  # a square per cell of each grid

    # The per-sample view: filter, click through, read the predictions.
    page.click("#tabs a[data-tab=samples]")
    page.select_option("#sample-filter", "lost")
    expect(page.locator("#sample-count")).to_have_text("2 of 4 samples")
    # A click sets the address's hash; the page draws the sample on the hashchange event that follows, so wait for it.
    page.click("#sample-list li[data-sample=len1000_depth50] button")
    expect(page.locator("#sample-title")).to_have_text(re.compile(r"^needle · len1000_depth50"))
    assert page.url.endswith("#samples/needle/len1000_depth50")  # a link to this sample
    wrong = page.locator("table.predictions tr[data-policy=pyramidkv][data-budget='64']")
    assert wrong.locator("td.pred").inner_text() == WRONG
    assert "visit" in wrong.locator("td.pred mark").all_inner_texts()  # not in the full cache's prediction
    assert page.locator("table.predictions tr[data-policy=full][data-budget='64'] td.pred").inner_text() == RIGHT
    assert QUESTION in page.inner_text("#sample-detail")
    assert page.locator("details.context pre").is_hidden()  # collapsed until opened
    page.click("details.context summary")
    assert CONTEXT_TAIL in page.locator("details.context pre").inner_text()

    # A prediction that is HTML is shown as text; a link opens its sample directly.
    page.goto(page_file.as_uri() + "#samples/needle/len2000_depth50")
    expect(page.locator("#sample-title")).to_have_text(re.compile(r"^needle · len2000_depth50"))
    injected = page.locator("table.predictions tr[data-policy=streamingllm][data-budget='64'] td.pred")
    assert injected.inner_text() == INJECTED
    assert page.locator("#injected").count() == 0

    page.click("#tabs a[data-tab=run]")
    expect(page.locator("#run")).to_contain_text("0123456789abcdef")
    screenshot = tmp_path / "report.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000
    assert problems == [], problems
    assert requests == [], requests
    page.close()


def test_sample_table_sorts_budgets_as_numbers(browser, tmp_path):
    """128 after 64, and 0.05 (a fraction) after both, as the report orders them; not as strings."""
    rows = [
        {"task": "t", "sample_id": "s", "policy": "full", "budget": b, "score": 1.0, "pred": "x", "model": MODEL}
        for b in (128, 64, 0.05)
    ]
    folder = tmp_path / "budgets"
    folder.mkdir()
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = browser.new_page()
    page.goto(write_html_report([folder], tmp_path / "b.html").path.as_uri())
    assert page.locator("#summary-data th").all_inner_texts().count("decode_budget") == 0  # none set: no column
    header = page.locator("#summary-data th", has_text=re.compile(r"^\s*budget\s*$"))
    header.click()
    budgets = page.locator("#summary-data tbody tr td:nth-child(4)").all_inner_texts()
    assert budgets == ["64", "128", "0.05"]
    header.click()
    assert page.locator("#summary-data tbody tr td:nth-child(4)").all_inner_texts() == ["0.05", "128", "64"]
    page.close()
