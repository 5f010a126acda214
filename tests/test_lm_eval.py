"""pkvbench as an lm-eval backend (pkvbench/lm_eval, docs/lm-eval.md): two local lm-eval tasks (a generation and a
multiple-choice one, tests/data/lm_eval/) on the embedded model, offline.

- the grid (full and SnapKV at 16 entries) in one lm-eval run: one prefill per context for both configurations,
  lm-eval's files per configuration, pkvbench's rows with lm-eval's per-document scores, read by ``pkvbench report``;
- the full cache's answers and log-likelihoods equal lm-eval's own ``hf`` backend on the same model;
- SnapKV's answers equal ``pkvbench run``'s on the same prompts (the same text, token count and kept entries);
- a compressed log-likelihood equals one forward pass in which the fed tokens cannot see the evicted entries;
- bad model args, an unknown task, hub data offline, lm-eval missing: one line, exit 2.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")  # the lm-eval extra (scripts/setup.sh installs it; CI runs these tests)

from pkvbench.errors import PkvError
from pkvbench.lm_eval.grid import Continuation, Grid, GridSpec

REPO = Path(__file__).resolve().parent.parent
DATA = "tests/data/lm_eval"  # the task YAMLs name their data files relative to the repository's root
TASKS = ["pkv_gen", "pkv_mc"]
GRID = {"policy": "full+snapkv", "budget": "16", "device": "cpu", "dtype": "float32"}


@pytest.fixture(autouse=True)
def offline_from_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def grid_run(engine, tmp_path_factory):
    """The grid through ``pkvbench lm-eval``'s code, on the session's model; counts the prefills."""
    from pkvbench.lm_eval.run import evaluate_grid

    grid = Grid(GridSpec.parse(GRID), engine=engine)
    prefills = []
    original = engine.prefill
    engine.prefill = lambda ids, *args, **kwargs: prefills.append(ids.shape[1]) or original(ids, *args, **kwargs)
    previous = os.getcwd()
    os.chdir(REPO)
    try:
        run = evaluate_grid(
            TASKS,
            {},
            tmp_path_factory.mktemp("lm") / "out",
            limit=3,
            include_paths=[DATA],
            grid=grid,
            include_defaults=False,
        )
    finally:
        del engine.prefill
        os.chdir(previous)
    return run, prefills


def lm_eval_samples(out: Path, label: str, task: str) -> list[dict]:
    """lm-eval's own per-document log of one configuration (``samples_<task>_<date>.jsonl``)."""
    [path] = (out / "lm_eval" / label / "smollm2-135m").glob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.model
def test_grid_in_one_lm_eval_run(grid_run, capsys):
    from pkvbench.store.results import read_rows

    run, prefills = grid_run
    assert list(run.results) == ["full-b16", "snapkv-b16"]
    # one prefill per context for both configurations: 3 generations, 3 multiple-choice contexts (3 choices each)
    assert len(prefills) == 6
    rows = read_rows(run.out)
    assert len(rows) == 2 * 6
    for label, policy in (("full-b16", "full"), ("snapkv-b16", "snapkv")):
        [results] = (run.out / "lm_eval" / label / "smollm2-135m").glob("results_*.json")
        assert set(json.loads(results.read_text())["results"]) == set(TASKS)
        for task, metric in (("pkv_gen", "exact_match"), ("pkv_mc", "acc")):
            logged = lm_eval_samples(run.out, label, task)
            assert len(logged) == 3
            ours = {r["sample_id"]: r for r in rows if r["task"] == task and r["policy"] == policy}
            assert {str(s["doc_id"]): float(s[metric]) for s in logged} == {k: r["score"] for k, r in ours.items()}
            for row in ours.values():  # full keeps every context token; SnapKV 16 per head
                assert row["budget_tokens"] == (16 if policy == "snapkv" else row["context_tokens"])
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run.out)])
    shown = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "pkv_mc" in shown and "snapkv" in shown


@pytest.mark.model
def test_rerun_skips_finished_configurations(grid_run, engine):
    """Each configuration's rows are written last: a rerun into the folder (after an interruption) runs only the
    configurations without rows — here none."""
    from pkvbench.lm_eval.run import evaluate_grid
    from pkvbench.store.results import read_rows

    run, _ = grid_run
    before = read_rows(run.out)
    again = evaluate_grid(
        TASKS,
        {},
        run.out,
        limit=3,
        include_paths=[DATA],
        grid=Grid(GridSpec.parse(GRID), engine=engine),
        include_defaults=False,
    )
    assert again.resumed == ["full-b16", "snapkv-b16"] and again.rows == 0
    assert read_rows(run.out) == before


@pytest.mark.model
def test_full_cache_equals_lm_eval_hf_backend(grid_run, loaded):
    """The same model, tasks and documents through lm-eval's ``hf`` backend: the same answers, the same
    log-likelihoods (float32; one forward pass there, prefill then the fed tokens here) and greedy flags."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    run, _ = grid_run
    hf = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=1)
    manager = TaskManager(include_path=[DATA], include_defaults=False)
    theirs = simple_evaluate(model=hf, tasks=TASKS, task_manager=manager, limit=3, bootstrap_iters=0)["samples"]
    ours = {task: lm_eval_samples(run.out, "full-b16", task) for task in TASKS}
    assert [s["filtered_resps"][0] for s in theirs["pkv_gen"]] == [s["filtered_resps"][0] for s in ours["pkv_gen"]]
    for mine, hf_doc in zip(ours["pkv_mc"], theirs["pkv_mc"]):
        for (logprob, greedy), (hf_logprob, hf_greedy) in zip(mine["filtered_resps"], hf_doc["filtered_resps"]):
            assert float(logprob) == pytest.approx(hf_logprob, abs=1e-4)
            assert greedy == str(hf_greedy)


@pytest.mark.model
def test_compressed_answers_equal_pkvbench_run(grid_run, tmp_path):
    """pkv_gen's prompts as a pkvbench task (tests/data/lm_eval/pkvbench/pkv-gen.yaml: the same text, no chat
    template, the same stops and length) through ``pkvbench run``'s API: SnapKV keeps the same entries and writes the
    same answer, which lm-eval then cuts at its first stop string."""
    from pkvbench.api import RunConfig, evaluate

    run, _ = grid_run
    result = evaluate(
        RunConfig(
            tasks="pkv-gen",
            include_paths=(f"{DATA}/pkvbench",),
            data_dir=DATA,
            verify=False,
            policies="snapkv",
            budgets="16",
            device="cpu",
            dtype="float32",
            out=tmp_path / "run",
            quiet=True,
        )
    )
    theirs = {row["sample_id"]: row for row in result.rows.to_dict("records")}
    rows = [json.loads(line) for line in (run.out / "samples.jsonl").read_text().splitlines()]
    ours = {r["sample_id"]: r for r in rows if r["task"] == "pkv_gen" and r["policy"] == "snapkv"}
    for doc_id, sample_id in enumerate(("farm", "museum", "trip")):
        mine, reference = ours[str(doc_id)], theirs[sample_id]
        assert mine["kept_fingerprint"] == reference["kept_fingerprint"]
        assert mine["new_tokens"] == reference["new_tokens"]
        assert mine["pred"] == reference["pred"].split("\n")[0].split(".")[0]


@pytest.mark.model
def test_compressed_loglikelihood_is_read_over_the_kept_entries(engine):
    """StreamingLLM at 16 keeps the first 4 and the last 12 positions of what it compresses — the context but its last
    token (aware), the context before its question (agnostic) — in every layer and head: the log-likelihood equals
    one forward pass over context and continuation in which the tokens after the compressed part see only those
    entries (and themselves)."""
    import torch

    spec = GridSpec.parse(
        {"policy": "streamingllm", "budget": "16", "query_mode": "aware+agnostic", "question_split": "\n"}
    )
    grid = Grid(spec, engine=engine)
    tokenizer = engine.tokenizer
    passage = "Mira keeps a grey donkey called Pepper, who carries water every morning, and a goat called Clover."
    context = tokenizer.encode(passage + "\nQuestion: Which animal carries water?\nAnswer:")
    split = len(tokenizer.encode(passage))
    continuation = tokenizer.encode(" the grey donkey")
    [[aware, agnostic]] = grid.loglikelihood([Continuation(tuple(context), split, tuple(continuation))])
    sequence = context + continuation[:-1]
    scored_from = len(context) - 1  # the position whose logits predict the continuation's first token
    with torch.inference_mode():
        everything = torch.log_softmax(engine.model(input_ids=torch.tensor([sequence])).logits[0].float(), dim=-1)
    full = sum(float(everything[scored_from + i, token]) for i, token in enumerate(continuation))
    for scored, cut in ((aware, len(context) - 1), (agnostic, split)):
        visible = torch.ones(len(sequence), len(sequence), dtype=torch.bool).tril()
        visible[cut:, :cut] = False
        visible[cut:, [*range(4), *range(cut - 12, cut)]] = True
        with torch.inference_mode():
            logits = engine.model(input_ids=torch.tensor([sequence]), attention_mask=visible[None, None]).logits[0]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        expected = sum(float(logprobs[scored_from + i, token]) for i, token in enumerate(continuation))
        assert scored["logprob"] == pytest.approx(expected, abs=1e-4)
        assert scored["context_tokens"] == cut
        assert abs(full - expected) > 0.01  # what was evicted mattered


@pytest.mark.parametrize(
    "option,value,expected",
    [
        ("--policy", "full,nosuch", "unknown policy 'nosuch'"),
        ("--budget", "0", "budget '0' must be positive"),
        ("--kv-bits", "3", "--kv-bits 3: supported are 2, 4 and 8"),
        ("--policy", "full,snapkv,full", "names full twice; give each value once"),
        ("--query-mode", "agnostic", "needs question_split=TEXT"),
    ],
)
def test_bad_model_args_are_one_line(option, value, expected, tmp_path, capsys):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", "--tasks", "pkv_gen", option, value, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert expected in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_unknown_task_and_hub_data_offline_are_one_line(tmp_path):
    from pkvbench.lm_eval.run import check_data, task_manager

    with pytest.raises(PkvError, match="lm-eval has no task 'pkv_gne' \\(did you mean pkv_gen"):
        task_manager(["pkv_gne"], [DATA], include_defaults=False)
    (tmp_path / "hub.yaml").write_text(
        "task: hub_task\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: question\ndoc_to_choice: '{{choices.text}}'\ndoc_to_target: 0\n"
    )
    manager = task_manager(["hub_task"], [str(tmp_path)], include_defaults=False)
    with pytest.raises(PkvError, match="could not load the data of hub_task: .*needs a local copy"):
        check_data(manager, ["hub_task"])


def test_missing_lm_eval_is_one_line(monkeypatch, tmp_path, capsys):
    from pkvbench.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", "--tasks", "pkv_gen", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err
        == "pkvbench: error: lm-eval is not installed: pip install 'pkvbench[lm-eval]' (lm-eval 0.4.x)\n"
    )


def test_lm_eval_finds_the_backend():
    """Registered under ``pkvbench`` on import, and declared for lm-eval's entry-point discovery; a grid through
    ``lm_eval --model pkvbench`` (one configuration a run) is refused before any model loads."""
    from lm_eval.api.registry import get_model

    from pkvbench.lm_eval.backend import PkvbenchLM

    assert get_model("pkvbench") is PkvbenchLM
    [entry] = [e for e in importlib.metadata.entry_points(group="lm_eval.models") if e.name == "pkvbench"]
    assert entry.load() is PkvbenchLM
    with pytest.raises(PkvError, match="a grid of 2 configurations; .*`pkvbench lm-eval`"):
        PkvbenchLM.create_from_arg_string("policy=full+snapkv,budget=16", {"batch_size": 1, "device": None})


@pytest.mark.model
def test_perplexity_tasks_are_refused(engine):
    from pkvbench.lm_eval.backend import PkvbenchLM

    view = PkvbenchLM(grid=Grid(GridSpec.parse({"policy": "snapkv"}), engine=engine))
    with pytest.raises(PkvError, match="loglikelihood_rolling .* not supported"):
        view.loglikelihood_rolling([])


# --- issue 47: nothing lost, no silent setting, the same rules as `pkvbench run` ----------------------------------


@pytest.fixture
def on_session_model(engine, monkeypatch):
    """``pkvbench lm-eval`` and the backend on the session's model: a grid they build takes the loaded engine."""
    build = Grid.__init__
    monkeypatch.setattr(Grid, "__init__", lambda self, spec, loaded=None: build(self, spec, loaded or engine))


def lm_eval_cli(capsys, *args: str) -> tuple[int, str]:
    """``pkvbench lm-eval`` on the tests' tasks (one document each): exit code and stderr."""
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", "--include-path", DATA, "--limit", "1", "--device", "cpu", "--dtype", "float32", *args])
    return exit_info.value.code, capsys.readouterr().err


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (but the lock, which each run takes) and its bytes."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != ".pkvbench.lock"
    }


@pytest.fixture
def earlier_run(grid_run, tmp_path) -> Path:
    """A copy of the grid's folder (full and SnapKV at 16): an earlier run that a new one may replace."""
    import shutil

    run, _ = grid_run
    return Path(shutil.copytree(run.out, tmp_path / "earlier"))


@pytest.mark.model
@pytest.mark.parametrize(
    "args,refusal",
    [
        (["--tasks", "pkv_sample"], "task pkv_sample: sampling (do_sample, temperature > 0) is not supported"),
        (["--tasks", "pkv_rolling"], "task pkv_rolling: loglikelihood_rolling (perplexity tasks) is not supported"),
        (
            ["--tasks", "pkv_gen", "--query-mode", "agnostic", "--question-split", "NOWHERE"],
            "question_split='NOWHERE' does not occur in a context",
        ),
    ],
    ids=["sampling", "perplexity", "split-nowhere"],
)
def test_overwrite_refused_by_what_the_requests_say_loses_nothing(earlier_run, args, refusal, capsys, monkeypatch):
    """R1: what only lm-eval's requests tell (a task that samples, a perplexity task, a context without the question
    split) is refused before the model loads, and a folder being replaced keeps its run: rows, record and lm-eval's
    files byte for byte. One line, without lm-eval's own log lines, naming what `pkvbench lm-eval` takes."""
    monkeypatch.setattr(Grid, "__init__", lambda *_: pytest.fail("the model loaded before the refusal"))
    before = snapshot(earlier_run)
    code, err = lm_eval_cli(capsys, *args, "--overwrite", "--out", str(earlier_run))
    assert code == 2 and refusal in err and err.count("\n") == 1, err
    assert "--gen_kwargs" not in err  # R8: no option this command does not have
    assert snapshot(earlier_run) == before


@pytest.mark.model
def test_overwrite_refused_mid_run_keeps_the_earlier_run(earlier_run, on_session_model, capsys):
    """R1: a refusal that comes only once a request runs — a memory budget below what SnapKV's window takes on this
    prompt (read from the tokens) — leaves the run being replaced as it was."""
    before = snapshot(earlier_run)
    code, err = lm_eval_cli(
        capsys, "--tasks", "pkv_gen", "--policy", "snapkv", "--memory", "1KiB", "--overwrite", "--out", str(earlier_run)
    )
    assert code == 2 and "--memory 1KiB is below what snapkv" in err, err
    assert snapshot(earlier_run) == before


@pytest.mark.model
def test_a_replaced_run_leaves_nothing_of_itself(earlier_run, on_session_model, capsys):
    """R5: --overwrite replaces rows, record and lm-eval's configuration folders: SnapKV's folder of the earlier run
    goes, the full cache's holds the new run's files only."""
    from pkvbench.store.results import read_rows

    code, err = lm_eval_cli(capsys, "--tasks", "pkv_mc", "--budget", "16", "--overwrite", "--out", str(earlier_run))
    assert code == 0, err
    assert sorted(p.name for p in (earlier_run / "lm_eval").iterdir()) == ["full-b16"]
    files = sorted(p.name.split("_20")[0] for p in (earlier_run / "lm_eval" / "full-b16").rglob("*.json*"))
    assert files == ["results", "samples_pkv_mc"]
    rows = read_rows(earlier_run)
    assert {(r["task"], r["policy"]) for r in rows} == {("pkv_mc", "full")} and len(rows) == 1


@pytest.mark.model
def test_a_run_in_a_folder_in_use_is_refused_before_anything(earlier_run, capsys, monkeypatch):
    """Two `pkvbench lm-eval` runs into one folder at once: the second is refused before its model loads, and the
    folder stays the first's."""
    from pkvbench.store.lock import FolderLock

    monkeypatch.setattr(Grid, "__init__", lambda *_: pytest.fail("the model loaded"))
    before = snapshot(earlier_run)
    with FolderLock(earlier_run):  # the first run, holding the folder
        for extra in ([], ["--overwrite"]):
            code, err = lm_eval_cli(capsys, "--tasks", "pkv_mc", *extra, "--out", str(earlier_run))
            assert code == 2 and "in use" in err and err.count("\n") == 1, err
    assert snapshot(earlier_run) == before


@pytest.mark.model
def test_decode_budget_fills_in_run_s_schedule(on_session_model, tmp_path, capsys):
    """R3: --decode-budget through `pkvbench lm-eval` and through lm-eval's own backend: the interval and buffer
    take `run`'s implied values (16, 8), as the rows record."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import pkvbench.lm_eval.backend  # noqa: F401  (registers "pkvbench")
    from pkvbench.store.results import read_rows

    out = tmp_path / "decoding"
    code, err = lm_eval_cli(
        capsys, "--tasks", "pkv_gen", "--policy", "snapkv", "--decode-budget", "12", "--out", str(out)
    )
    assert code == 0, err
    [row] = read_rows(out)
    assert (row["decode_budget"], row["decode_interval"], row["decode_buffer"]) == (12, 16, 8)
    assert GridSpec.parse({"policy": "snapkv", "decode_budget": "12"}).settings.decode_buffer == 8
    results = lm_eval.simple_evaluate(
        model="pkvbench",
        model_args="policy=snapkv,budget=16,decode_budget=12",
        tasks=["pkv_gen"],
        task_manager=TaskManager(include_path=[DATA], include_defaults=False),
        limit=1,
        bootstrap_iters=0,
    )
    assert "pkv_gen" in results["results"]


@pytest.mark.model
def test_kv_bits_grid_takes_run_s_kivi_options_and_rows_say_what_was_used(on_session_model, tmp_path, capsys):
    """R4: a --kv-bits grid through `pkvbench lm-eval` with --kv-group and --kv-residual: each configuration stored
    as asked, and every row (generations and log-likelihoods) records the group and residual it used."""
    from pkvbench.store.results import read_rows

    out = tmp_path / "kivi"
    grid = ["--policy", "snapkv", "--budget", "16", "--kv-bits", "4,8", "--kv-group", "16", "--kv-residual", "8"]
    code, err = lm_eval_cli(capsys, "--tasks", "pkv_gen,pkv_mc", *grid, "--out", str(out))
    assert code == 0, err
    assert sorted(p.name for p in (out / "lm_eval").iterdir()) == ["snapkv-b16-kv4", "snapkv-b16-kv8"]
    rows = read_rows(out)
    assert len(rows) == 4
    assert {(r["task"], r["kv_bits"], r["kv_group"], r["kv_residual"]) for r in rows} == {
        (task, bits, 16, 8) for task in ("pkv_gen", "pkv_mc") for bits in (4, 8)
    }


# R7: values `pkvbench run` refuses are refused here too, in its words (model args, and the command line's options).
SAME_RULES = [
    ({"kv_group": 16}, {"kv_group": 16}),
    ({"decode_interval": 4}, {"decode_interval": 4}),
    (
        {"policy": "snapkv", "decode_budget": "32", "kv_bits": "4"},
        {"policies": "snapkv", "decode_budgets": "32", "kv_bits": "4"},
    ),
    ({"query_mode": "nosuch"}, {"query_modes": "nosuch"}),
    ({"protocol": "nosuch"}, {"protocol": "nosuch"}),
    ({"kv_bits": "4", "kv_residual": -1}, {"kv_bits": "4", "kv_residual": -1}),
]


@pytest.mark.parametrize("model_args,run_options", SAME_RULES, ids=lambda v: ",".join(map(str, v)))
def test_model_args_are_refused_as_run_refuses_them(model_args, run_options):
    from pkvbench.api import RunConfig, resolve

    with pytest.raises(PkvError) as run_refusal:
        resolve(RunConfig(**run_options))
    with pytest.raises(PkvError) as lm_eval_refusal:
        GridSpec.parse(model_args)
    assert str(lm_eval_refusal.value) == str(run_refusal.value)


@pytest.mark.parametrize(
    "model_args,refusal",
    [
        ({"question_split": "Question:"}, "question_split (--question-split) only sets where the question starts"),
        ({"model": "smollm2-135m", "pretrained": "smollm2-135m"}, "model args model and pretrained both name"),
    ],
)
def test_what_run_has_no_rule_for_is_refused_too(model_args, refusal):
    with pytest.raises(PkvError, match=re.escape(refusal)):
        GridSpec.parse(model_args)


@pytest.mark.model
def test_a_kivi_group_the_model_cannot_take_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """R7: kv_group=7 divides no head of the model: refused from its config, as `run` refuses it."""
    monkeypatch.setattr(Grid, "__init__", lambda *_: pytest.fail("the model loaded"))
    code, err = lm_eval_cli(
        capsys, "--tasks", "pkv_mc", "--kv-bits", "4", "--kv-group", "7", "--out", str(tmp_path / "o")
    )
    assert code == 2 and "--kv-group 7 does not divide the model's head size (64)" in err, err
    code, err = lm_eval_cli(capsys, "--tasks", "pkv_mc", "--question-split", "Q", "--out", str(tmp_path / "o"))
    assert code == 2 and "only sets where the question starts for query mode agnostic" in err, err
    assert not (tmp_path / "o").exists()


def test_a_refused_family_is_refused_before_lm_eval_indexes_a_task(tmp_path, capsys, monkeypatch):
    """R9: a model folder of a family pkvbench refuses (mistral4) is refused from its config, before lm-eval
    indexes a task, in the words `pkvbench run` uses."""
    from pkvbench.lm_eval import run as lm_eval_run

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral4"}))
    monkeypatch.setattr(lm_eval_run, "task_manager", lambda *_: pytest.fail("lm-eval indexed its tasks"))
    code, err = lm_eval_cli(capsys, "--tasks", "pkv_mc", "--model", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2 and "'mistral4' model, not supported: transformers maps no causal-LM class to it" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()


def test_lm_eval_s_own_command_line_is_told_its_own_remedy():
    """R8: the backend made by `lm_eval` (which has --gen_kwargs) names that option; `pkvbench lm-eval` its own."""
    from pkvbench.lm_eval.backend import greedy_settings

    assert greedy_settings("t", {"until": ["\n"], "do_sample": False})["max_gen_toks"] == 256
    with pytest.raises(PkvError, match=r"pass --gen_kwargs do_sample=false,temperature=0"):
        greedy_settings("t", {"do_sample": True})
    with pytest.raises(PkvError, match=r"sampling .* not supported"):
        greedy_settings("t", {"temperature": 0.7})


SIX = {"policy": "full+snapkv+streamingllm", "budget": "8+16", "device": "cpu", "dtype": "float32"}
KILLED = """
import os, signal, sys
from pkvbench.lm_eval.run import evaluate_grid
from pkvbench.store.results import ResultStore

written = []
extend = ResultStore.extend


def extend_then_die(self, rows):  # the third configuration: its lm-eval files are written, its rows not
    if len(written) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(rows)
    extend(self, rows)


ResultStore.extend = extend_then_die
evaluate_grid({tasks!r}, {grid!r}, sys.argv[1], limit=1, include_paths=[{data!r}], include_defaults=False)
"""
TIMES = ("prefill_s", "extra_pass_s", "selection_s", "decode_s")  # seconds: the only fields of a row that vary


def lm_eval_files(out: Path) -> list[tuple[str, object]]:
    """lm-eval's files per configuration, each named without its date, with what varies between two runs left out
    (a configuration written twice has its files twice)."""
    files = []
    for path in sorted((out / "lm_eval").rglob("*.json*")):
        name = str(path.relative_to(out)).split("_20")[0]
        if path.suffix == ".json":
            results = json.loads(path.read_text())
            files.append(
                (name, {k: v for k, v in results.items() if k not in ("date", "total_evaluation_time_seconds")})
            )
        else:
            files.append((name, path.read_text()))
    return sorted(files, key=lambda file: file[0])


@pytest.mark.model
def test_a_grid_killed_mid_configuration_resumes_to_the_uninterrupted_run(engine, tmp_path):
    """A six-configuration grid killed (SIGKILL) after the third configuration's lm-eval files were written and
    before its rows: the rerun keeps the two finished configurations, writes the third anew and the other three;
    its rows and lm-eval's files equal those of a run never interrupted."""
    import subprocess

    from pkvbench.lm_eval.run import evaluate_grid
    from pkvbench.store.results import read_rows

    killed, whole = tmp_path / "killed", tmp_path / "whole"
    script = KILLED.format(tasks=TASKS, grid=SIX, data=DATA)
    done = subprocess.run([sys.executable, "-c", script, str(killed)], cwd=REPO, capture_output=True, timeout=900)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert len({r["policy"] + str(r["budget"]) for r in read_rows(killed)}) == 2
    assert len(list((killed / "lm_eval").iterdir())) == 3  # the third's files, without its rows

    def run(out: Path):
        grid = Grid(GridSpec.parse(SIX), engine=engine)
        return evaluate_grid(TASKS, {}, out, limit=1, include_paths=[DATA], grid=grid, include_defaults=False)

    resumed, uninterrupted = run(killed), run(whole)
    assert len(resumed.resumed) == 2 and resumed.resumed == list(uninterrupted.seconds)[:2]
    assert len(resumed.seconds) == 4 and len(uninterrupted.seconds) == 6

    def rows(out: Path) -> list[dict]:
        return sorted(({k: v for k, v in r.items() if k not in TIMES} for r in read_rows(out)), key=json.dumps)

    assert rows(killed) == rows(whole) and len(rows(whole)) == 6 * 2
    assert lm_eval_files(killed) == lm_eval_files(whole)
    assert len(lm_eval_files(whole)) == 6 * 3  # per configuration: its results, and its samples of each task
