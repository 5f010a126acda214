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
