"""Conversations (``--query-mode multi-turn``): SCBench's tasks and released files as turns, the cache carried from
turn to turn, one row per turn, and what each turn must equal on the stock model."""

import json
from pathlib import Path

import pytest
import torch

from pkvbench.api import resolve
from pkvbench.cell.budgets import Budget
from pkvbench.cell.schema import EVERY_TURN, MULTI_TURN, ONCE, REFERENCE_ANSWERS
from pkvbench.engine.exactness import generate_reference, stock_attention
from pkvbench.errors import PkvError
from pkvbench.options import RunConfig
from pkvbench.policies import parse_policy
from pkvbench.run.runner import Cell, RunSettings, run_sample
from pkvbench.store.results import row_key
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from tests.helpers import count_calls

DATA = Path(__file__).parent / "data" / "scbench"
GENERATED = ["scbench_kv", "scbench_prefix_suffix", "scbench_vt", "scbench_needles"]


def samples_of(tokenizer, name, **options):
    return build_samples(get_task(name), tokenizer, TaskOptions(**options))


# --- the tasks ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", GENERATED)
def test_generated_conversations_are_reproducible_and_asked_in_turn(tokenizer, name):
    first = samples_of(tokenizer, name, lengths=(600,), limit=2, turns=3)
    again = samples_of(tokenizer, name, lengths=(600,), limit=2, turns=3)
    other_seed = samples_of(tokenizer, name, lengths=(600,), limit=2, turns=3, seed=1)
    assert [s.context_ids for s in first] == [s.context_ids for s in again]
    assert [s.context_ids for s in first] != [s.context_ids for s in other_seed]
    for sample in first:
        assert sample.conversable and len(sample.questions) == 3
        assert abs(len(sample.input_ids) - 600) <= 12, "the first turn's prompt within 2% of --lengths"
        context = tokenizer.decode(sample.context_ids)
        for question in sample.questions:
            assert all(answer in context for answer in question.answers), "every answer is in the context"
            follow = tokenizer.decode(question.follow_ids)
            alone = tokenizer.decode(question.ids).strip()
            assert follow.startswith("<|im_end|>") and "<|im_start|>user\n" in follow
            assert alone.split("<|im_end|>")[0].strip() in follow, "a later turn asks the same question"
            assert tokenizer.decode(question.reply_ids).strip().startswith(question.answers[0])
    assert len({q.answers[0] for q in first[0].questions}) == 3, "each turn asks about another item"


def test_turns_and_lengths_shape_the_generated_tasks(tokenizer):
    short = samples_of(tokenizer, "scbench_kv", lengths=(500,), limit=1, turns=2)[0]
    longer = samples_of(tokenizer, "scbench_kv", lengths=(900,), limit=1)[0]
    assert len(short.questions) == 2 and len(longer.questions) == get_task("scbench_kv").config["defaults"]["turns"]
    assert len(longer.context_ids) > len(short.context_ids) + 300


def test_the_prefix_suffix_list_hides_each_answer_among_decoys(tokenizer):
    sample = samples_of(tokenizer, "scbench_prefix_suffix", lengths=(500,), limit=1, turns=2)[0]
    lines = tokenizer.decode(sample.context_ids).split("\n")
    for question in sample.questions:
        target = question.answers[0]
        assert sum(line.startswith(target[:4]) for line in lines) >= 2
        assert sum(line.endswith(target[-4:]) for line in lines) >= 2
        assert sum(line.startswith(target[:4]) and line.endswith(target[-4:]) for line in lines) == 1


def test_existing_multi_question_tasks_are_conversations(tokenizer):
    for name in ("needle-multi", "niah_multiquery_each"):
        sample = samples_of(tokenizer, name, lengths=(700,), limit=1)[0]
        assert sample.conversable and len(sample.questions) > 1
    single = samples_of(tokenizer, "needle", lengths=(700,), depths=(50,))[0]
    assert single.conversable and len(single.questions) == 1  # a conversation of one turn


def test_scbench_files_load_as_conversations(tokenizer):
    samples = samples_of(tokenizer, "scbench_data_kv", data_dir=str(DATA))
    rows = [json.loads(line) for line in (DATA / "scbench_kv.jsonl").read_text().splitlines()]
    assert [s.sample_id for s in samples] == ["0", "1"]
    for sample, row in zip(samples, rows):
        assert [q.answers for q in sample.questions] == [[t["answer"]] for t in row["multi_turns"]]
        assert [q.question_id for q in sample.questions] == ["t1", "t2", "t3"]
        assert tokenizer.decode(sample.context_ids).rstrip().endswith(row["context"][-40:])
        for question, turn in zip(sample.questions, row["multi_turns"]):
            assert turn["input"].strip() in tokenizer.decode(question.follow_ids)
            assert turn["input"].strip() in tokenizer.decode(question.ids)
    assert [len(s.questions) for s in samples_of(tokenizer, "scbench_data_kv", data_dir=str(DATA), turns=2)] == [2, 2]
    vt = samples_of(tokenizer, "scbench_data_vt", data_dir=str(DATA))[0]
    assert vt.sample_id == "5" and vt.questions[1].answers == ["KLMNO", "PQRST"]
    assert tokenizer.decode(vt.questions[0].reply_ids) == "ABCDE, FGHIJ"


def test_scbench_files_are_cut_in_the_middle_to_fit(tokenizer):
    whole = samples_of(tokenizer, "scbench_data_kv", data_dir=str(DATA), limit=1)[0]
    cut = samples_of(tokenizer, "scbench_data_kv", data_dir=str(DATA), limit=1, max_length=200)[0]
    assert len(cut.input_ids) <= 200 < len(whole.input_ids)
    assert cut.extras["truncated"] and cut.extras["untruncated_tokens"] == len(whole.input_ids)
    assert cut.questions[0].ids == whole.questions[0].ids, "the question is whole"


def test_bad_scbench_files_are_refused_in_a_line(tokenizer, tmp_path):
    with pytest.raises(PkvError, match="scbench_kv.jsonl not found"):
        samples_of(tokenizer, "scbench_data_kv", data_dir=str(tmp_path))
    with pytest.raises(PkvError, match="reads SCBench's released file"):
        samples_of(tokenizer, "scbench_data_kv")
    (tmp_path / "scbench_kv.jsonl").write_text('{"id": 0, "context": "x", "multi_turns": [{"input": "q"}]}\n')
    with pytest.raises(PkvError, match=r"scbench_kv.jsonl, line 1: turn 1 needs an 'input' text and an 'answer'"):
        samples_of(tokenizer, "scbench_data_kv", data_dir=str(tmp_path))


# --- the options ----------------------------------------------------------------------------------------------------


def test_conversation_options_are_checked_before_any_model_loads():
    run = resolve(RunConfig(tasks="scbench_kv", query_modes=MULTI_TURN, turn_compressions="once,every-turn"))
    assert {(c.query_mode, c.turn_compression) for c in run.cells} == {(MULTI_TURN, ONCE), (MULTI_TURN, EVERY_TURN)}
    assert run.settings.turn_answers == "model"
    assert run.recorded_options["turn_compressions"] == [ONCE, EVERY_TURN]
    plain = resolve(RunConfig(tasks="needle", query_modes="aware,multi-turn"))
    assert {c.turn_compression for c in plain.cells} == {None, ONCE}
    assert "turn_compressions" not in resolve(RunConfig(tasks="needle")).recorded_options
    refused = [
        ({"turn_compressions": "once"}, "--turn-compression only sets conversations"),
        ({"query_modes": MULTI_TURN, "turn_compressions": "always"}, "--turn-compression always: valid: once"),
        ({"query_modes": MULTI_TURN, "turn_answers": "golden"}, "--turn-answers golden: valid: model, reference"),
        ({"query_modes": MULTI_TURN, "kv_bits": "4"}, "not carried across turns yet"),
        ({"query_modes": MULTI_TURN, "decode_budgets": "64"}, "not cut while an answer is written yet"),
    ]
    for options, message in refused:
        with pytest.raises(PkvError, match=message):
            resolve(RunConfig(tasks="scbench_kv", **options))


def test_a_turn_compression_is_part_of_the_row_key():
    row = {"task": "t", "sample_id": "s/q0", "policy": "snapkv", "budget": 64, "query_mode": MULTI_TURN}
    assert row_key({**row, "turn_compression": ONCE}) != row_key({**row, "turn_compression": EVERY_TURN})
    assert row_key({"task": "t", "sample_id": "s", "policy": "p", "budget": 64}) == ("t", "s", "p", "64", "aware")


# --- on the model ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def conversation(loaded):
    task = get_task("scbench_kv")
    return task, build_samples(task, loaded.tokenizer, TaskOptions(lengths=(300,), limit=1, turns=3))[0]


def answers_of(engine, task, sample, cells, settings, monkeypatch):
    """Each turn's rows and the answers' tokens, as the runner decoded them (one list of rows and tokens per turn)."""
    decoded = []
    original = engine.decode_many

    def recorded(requests, max_rows=None):
        answers = original(requests, max_rows)
        decoded.append([a.tokens for a in answers])
        return answers

    monkeypatch.setattr(engine, "decode_many", recorded)
    rows = list(run_sample(engine, task, sample, cells, settings))
    return rows, decoded


def closed(answer: list[int], follow: list[int]) -> list[int]:
    """The tokens between an answer and the next question: the answer, then the follow-up (its end-of-turn token
    once, where the answer ended with it)."""
    return answer + (follow[1:] if answer[-1] == follow[0] else follow)


@pytest.mark.model
@pytest.mark.parametrize("answers", ["model", REFERENCE_ANSWERS])
def test_the_full_cache_answers_every_turn_as_generate_over_the_conversation(
    engine, loaded, conversation, answers, monkeypatch
):
    task, sample = conversation
    cells = [Cell(parse_policy("full"), Budget(64), MULTI_TURN, turn_compression=c) for c in (ONCE, EVERY_TURN)]
    rows, decoded = answers_of(
        engine, task, sample, cells, RunSettings(max_new_tokens=10, turn_answers=answers), monkeypatch
    )
    assert len(decoded) == 3 and all(len(turn) == 1 for turn in decoded), (
        "the full cache's cells share one conversation"
    )
    assert [(r["turn"], r["turn_compression"]) for r in rows] == [(t, c) for t in (1, 2, 3) for c in (ONCE, EVERY_TURN)]
    ids = list(sample.context_ids) + list(sample.questions[0].ids)
    for turn, question in enumerate(sample.questions):
        [tokens] = decoded[turn]
        assert tokens == generate_reference(loaded.model, torch.tensor([ids]), 10), f"turn {turn + 1}"
        row = rows[2 * turn]
        assert row["conversation_tokens"] == len(ids) and row["kv_entries"] == len(ids) * 30 * 3
        if turn + 1 < len(sample.questions):
            spoken = tokens if answers == "model" else question.reply_ids
            ids += closed(list(spoken), sample.questions[turn + 1].follow_ids)


def masked_turns(model, context: list[int], visible: torch.Tensor, turns, new_tokens: int, stop_ids, cut=None):
    """The stock model's greedy answers over a conversation whose dropped positions are masked: the full cache of the
    context, then each turn's tokens (``turns[t](previous answer)``) fed and its answer decoded token by token, every
    token seeing only the positions ``visible`` (the context's kept ones, then everything after); ``cut(visible,
    answer)`` hides more after an answer (compression every turn), once the answer is in the cache."""
    from transformers import DynamicCache

    def step(ids: list[int], cache, mask: torch.Tensor):
        start = mask.shape[0] - len(ids)
        out = model(
            input_ids=torch.tensor([ids]),
            attention_mask=mask.long()[None],
            position_ids=torch.arange(start, mask.shape[0])[None],
            past_key_values=cache,
            use_cache=True,
        )
        return int(out.logits[0, -1].argmax())

    answers = []
    with stock_attention(model), torch.inference_mode():
        cache = DynamicCache()
        step(context, cache, torch.ones(len(context), dtype=torch.bool))
        for make_turn in turns:
            ids = make_turn(answers[-1] if answers else None)
            if answers and cut is not None:  # the answer's last token goes in first, then the cut, then the question
                visible = torch.cat([visible, torch.ones(1, dtype=torch.bool)])
                step(ids[:1], cache, visible)
                visible = cut(visible)
                ids = ids[1:]
            visible = torch.cat([visible, torch.ones(len(ids), dtype=torch.bool)])
            tokens = [step(ids, cache, visible)]
            while len(tokens) < new_tokens and tokens[-1] not in stop_ids:
                visible = torch.cat([visible, torch.ones(1, dtype=torch.bool)])
                tokens.append(step(tokens[-1:], cache, visible))
            answers.append(tokens)
    return answers


@pytest.mark.model
@pytest.mark.parametrize("compression", [ONCE, EVERY_TURN])
def test_streamingllm_turns_equal_the_stock_model_with_the_dropped_positions_masked(
    engine, loaded, conversation, compression, monkeypatch
):
    task, sample = conversation
    budget, sink = 48, 4
    cells = [Cell(parse_policy("streamingllm"), Budget(budget), MULTI_TURN, turn_compression=compression)]
    rows, decoded = answers_of(engine, task, sample, cells, RunSettings(max_new_tokens=10), monkeypatch)
    ours = [turn[0] for turn in decoded]

    def kept(visible: torch.Tensor) -> torch.Tensor:
        """StreamingLLM's cut of the visible positions: the first ``sink`` of them and the newest."""
        held = visible.nonzero().flatten()
        cut = torch.zeros_like(visible)
        cut[torch.cat([held[:sink], held[-(budget - sink) :]])] = True
        return cut

    context = list(sample.context_ids)
    questions = sample.questions

    def turn(index):
        if index == 0:
            return lambda _: list(questions[0].ids)
        # the answer's tokens but its last are in the cache already, as decoding wrote them
        return lambda answer: closed(answer, questions[index].follow_ids)[len(answer) - 1 :]

    reference = masked_turns(
        loaded.model,
        context,
        kept(torch.ones(len(context), dtype=torch.bool)),
        [turn(i) for i in range(len(questions))],
        10,
        engine.stop_ids,
        kept if compression == EVERY_TURN else None,
    )
    assert ours == reference
    assert ours[1] != ours[0] or ours[2] != ours[0], "the turns ask different things"
    if compression == EVERY_TURN:  # cut back to the budget before each later question
        assert [r["kv_entries"] for r in rows[1:]] == [
            (budget + len(sample.questions[t].follow_ids) - (ours[t - 1][-1] == sample.questions[t].follow_ids[0])) * 90
            for t in (1, 2)
        ]


@pytest.mark.model
def test_policies_and_budgets_share_the_prefill_and_batch_their_turns(engine, conversation, monkeypatch):
    task, sample = conversation
    calls = count_calls(monkeypatch, engine, "prefill", "compress")
    policies = ("snapkv", "h2o", "pyramidkv")
    cells = [
        Cell(parse_policy(p), Budget.parse(b), MULTI_TURN, turn_compression=c)
        for p in policies
        for b in ("32", "0.2")
        for c in (ONCE, EVERY_TURN)
    ]
    settings = RunSettings(max_new_tokens=6, turn_answers=REFERENCE_ANSWERS)
    rows, decoded = answers_of(engine, task, sample, cells, settings, monkeypatch)
    assert calls == {"prefill": 1, "compress": 6}, "one prefill per sample, one compression per policy and budget"
    assert len(rows) == 3 * len(cells) and len({row_key(r) for r in rows}) == len(rows)
    assert [len(turn) for turn in decoded] == [6, 12, 12], "once and every turn share the first turn"
    assert max(r["decode_batch"] for r in rows if r["turn"] == 3) > 1, "a turn's answers decode together"
    every = [r for r in rows if r["turn_compression"] == EVERY_TURN and r["turn"] > 1]
    once = {(r["policy"], r["budget"], r["turn"]): r for r in rows if r["turn_compression"] == ONCE}
    for row in every:
        assert row["kv_entries"] < once[row["policy"], row["budget"], row["turn"]]["kv_entries"]
        assert row["turn_answers"] == REFERENCE_ANSWERS and row["selection_s"] > 0


@pytest.mark.model
def test_a_multi_turn_run_reports_by_turn_and_passes_its_gate(tmp_path, loaded, capsys):
    from pkvbench.cli import main

    def run(*args):
        with pytest.raises(SystemExit) as exit_info:
            main(list(args))
        out = capsys.readouterr()
        assert exit_info.value.code == 0, out.err
        return out.out

    folder = tmp_path / "run"
    common = ["--task", "scbench_kv", "--query-mode", "multi-turn", "--policy", "full,snapkv,pyramidkv"]
    common += ["--budget", "32,0.12", "--lengths", "300", "--limit", "1", "--turns", "2", "--max-new-tokens", "8"]
    text = run("run", *common, "--out", str(folder), "--quiet")
    assert "12 rows written, 0 already done, 1 prefills" in text  # 3 policies × 2 budgets × 2 turns
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    assert {(r["sample_id"], r["turn"]) for r in rows} == {("len300_0/q0", 1), ("len300_0/q1", 2)}
    report = run("report", str(folder))
    assert "Accuracy by turn" in report and "turn 1" in report and "turn 2" in report
    baseline = tmp_path / "baseline.csv"
    run("check", "--baseline", str(baseline), "--results", str(folder), "--update")
    assert "check passed" in run("check", "--baseline", str(baseline), "--results", str(folder))
