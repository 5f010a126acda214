"""The question's place: inside the compressed prompt (aware) or added after compression (agnostic)."""

import json
from pathlib import Path

import pytest
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, RunSettings, run_sample
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from tests.helpers import count_calls

TREC = Path(__file__).parents[2] / "shared" / "data" / "trec"
LONGBENCH = Path(__file__).parents[2] / "shared" / "data" / "longbench"
TASKS = ["needle", "needle-reference", "needle-multi", "niah_single_1", "niah_multiquery_each", "vt", "cwe", "fwe"]


def samples_of(tokenizer, name, **options):
    return build_samples(get_task(name), tokenizer, TaskOptions(lengths=(900,), limit=2, **options))


@pytest.mark.parametrize("name", TASKS)
def test_every_task_says_where_its_context_ends(tokenizer, name):
    for sample in samples_of(tokenizer, name):
        assert len(sample.context_ids) > 300
        for question in sample.questions:
            assert 5 < len(question.ids) < 80, "the question part is the question and the template's closing tokens"
            text = tokenizer.decode(question.ids)
            assert "?" in text or "Question" in text or "book" in text
        if len(sample.questions) > 1:
            assert len({sample.row_id(q) for q in sample.questions}) == len(sample.questions)


@pytest.mark.skipif(not TREC.is_dir(), reason="needs ../shared/data/trec")
def test_trec_fewshot_asks_its_question_after_the_examples(tokenizer):
    sample = samples_of(tokenizer, "trec-fewshot", data_dir=str(TREC))[0]
    assert tokenizer.decode(sample.questions[0].ids).startswith("\nQuestion:")
    assert "\nType: " in tokenizer.decode(sample.context_ids[-12:])  # the context ends with a worked example


@pytest.mark.skipif(not LONGBENCH.is_dir(), reason="needs ../shared/data/longbench")
def test_longbench_question_is_the_template_after_the_context(tokenizer):
    sample = build_samples(
        get_task("multifieldqa_zh"), tokenizer, TaskOptions(limit=1, max_length=1500, data_dir=str(LONGBENCH))
    )[0]
    question = tokenizer.decode(sample.questions[0].ids)
    assert question.startswith("\n\n现在请基于上面的文章回答下面的问题") and "问题：" in question
    summary = build_samples(
        get_task("multi_news"), tokenizer, TaskOptions(limit=1, max_length=1500, data_dir=str(LONGBENCH))
    )[0]
    assert "Now, write a one-page summary" in tokenizer.decode(summary.questions[0].ids)
    assert "only the answer instruction" in get_task("multi_news").config["question_part"]


def test_multi_needle_questions_share_one_context(tokenizer):
    samples = build_samples(get_task("needle-multi"), tokenizer, TaskOptions(lengths=(800,)))
    assert [s.sample_id for s in samples] == ["len800_rot0", "len800_rot1", "len800_rot2"]
    depths = [[q.extras["depth"] for q in s.questions] for s in samples]
    assert depths == [[20, 50, 80], [50, 80, 20], [80, 20, 50]]  # every needle at every depth once
    for sample in samples:
        text = tokenizer.decode(sample.context_ids)
        assert "Dolores Park" in text and "smoked paprika" in text and "Comet, Biscuit and Admiral" in text


# --- on the model ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def needle(loaded):
    return build_samples(get_task("needle"), loaded.tokenizer, TaskOptions(lengths=(800,), depths=(30,)))[0]


@pytest.mark.model
def test_agnostic_statistics_saw_no_question_token(engine, needle):
    """Statistics of the context recorded in the whole prompt's prefill equal a prefill of the context alone."""
    policies = [parse_policy("snapkv"), parse_policy("h2o")]
    context_len = len(needle.context_ids)
    both = engine.prefill(torch.tensor([needle.input_ids]), policies, cuts=(context_len, len(needle.input_ids)))
    alone = engine.prefill(torch.tensor([needle.context_ids]), policies)
    for ours, reference in zip(both.stats_at[context_len], alone.stats, strict=True):
        assert ours.context_len == reference.context_len == context_len
        torch.testing.assert_close(ours.window(8), reference.window(8), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            ours.accumulated_attention(), reference.accumulated_attention(), rtol=1e-5, atol=1e-6
        )
    for ours, reference in zip(both.keys, alone.keys, strict=True):
        # the same keys up to float reassociation (the kernels block a longer sequence differently)
        torch.testing.assert_close(ours[:, :, :context_len], reference, rtol=1e-4, atol=1e-4)


@pytest.mark.model
def test_the_full_cache_answers_the_same_with_the_question_before_or_after(engine, loaded):
    """Prefilling the context and then the question is the same computation as prefilling both: same tokens."""
    options = TaskOptions(lengths=(700,), depths=(0, 60), limit=2)
    for name in ("needle", "niah_single_1", "vt"):
        task = get_task(name)
        for sample in build_samples(task, loaded.tokenizer, options):
            cells = [Cell(parse_policy("full"), Budget(64), mode) for mode in ("aware", "agnostic")]
            rows = list(run_sample(engine, task, sample, cells, RunSettings(max_new_tokens=24)))
            assert rows[0]["pred"] == rows[1]["pred"], (name, sample.sample_id)
            assert [r["query_mode"] for r in rows] == ["aware", "agnostic"]


@pytest.mark.model
def test_the_question_is_never_evicted(engine, needle, monkeypatch):
    from pkvbench.engine.cache import RaggedCache
    from pkvbench.engine.decoding import BatchDecoder

    context_len = len(needle.context_ids)
    question = needle.questions[0].ids
    prefill = engine.prefill(torch.tensor([needle.input_ids]), [parse_policy("snapkv")], cuts=(context_len,))
    cache = engine.compress(prefill, parse_policy("snapkv"), Budget(32), context_len)
    assert cache.plan.context_len == context_len and cache.kept_per_layer == [32] * 30
    seen = []
    original = BatchDecoder.cache_for

    def spy(self, requests, room):
        ragged = original(self, requests, room)
        seen.append(ragged)
        return ragged

    monkeypatch.setattr(BatchDecoder, "cache_for", spy)
    engine.decoder.decode_batch([engine.request(prefill, cache, 1, question=question)])
    monkeypatch.undo()
    ragged: RaggedCache = seen[0]
    # After the question was fed: the 32 kept context entries and every question token, in every layer and head.
    assert {int(n) for layer in ragged.layers for n in layer.lengths.flatten()} == {32 + len(question)}


@pytest.mark.model
def test_one_prefill_and_one_compression_serve_every_question(engine, loaded, monkeypatch):
    task = get_task("needle-multi")
    sample = build_samples(task, loaded.tokenizer, TaskOptions(lengths=(700,), limit=1))[0]
    calls = count_calls(monkeypatch, engine, "prefill", "compress")
    cells = [Cell(parse_policy(p), Budget(48), "agnostic") for p in ("full", "snapkv", "pyramidkv")]
    rows = list(run_sample(engine, task, sample, cells, RunSettings(max_new_tokens=16)))
    assert calls == {"prefill": 1, "compress": 3}
    assert len(rows) == 9 and {r["sample_id"] for r in rows} == {f"len700_rot0/q{i}" for i in range(3)}
    assert {r["needle"] for r in rows} == {0, 1, 2} and all(r["query_mode"] == "agnostic" for r in rows)
    # Query-aware, each question is part of what is compressed: a prefill of its own.
    calls.update(prefill=0, compress=0)
    rows = list(
        run_sample(engine, task, sample, [Cell(parse_policy("snapkv"), Budget(48))], RunSettings(max_new_tokens=16))
    )
    assert calls == {"prefill": 3, "compress": 3} and len(rows) == 3


@pytest.mark.model
def test_both_modes_from_one_prefill_per_sample_on_the_command_line(tmp_path, loaded, capsys):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "run",
                "--task",
                "needle",
                "--query-mode",
                "aware,agnostic",
                "--policy",
                "full,snapkv,pyramidkv",
                "--budget",
                "64",
                "--lengths",
                "600",
                "--depths",
                "0,100",
                "--out",
                str(tmp_path),
                "--quiet",
            ]
        )
    out = capsys.readouterr()
    assert exit_info.value.code == 0, out.err
    assert "12 rows written, 0 already done, 2 prefills" in out.out
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted({(r["policy"], r["query_mode"]) for r in rows}) == sorted(
        (p, m) for p in ("full", "snapkv", "pyramidkv") for m in ("aware", "agnostic")
    )
    summary = (tmp_path / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("task,policy,budget,query_mode") and len(summary) == 7
    agnostic = [r for r in rows if r["query_mode"] == "agnostic"]
    assert all(r["context_tokens"] + r["question_tokens"] == 600 for r in agnostic)
