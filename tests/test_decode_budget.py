"""Cutting the cache while the answer is written (``--decode-budget``), on the real embedded model: exact when the
target holds everything, bounded by target + interval while decoding, and refused with one line where it cannot run.
(Batched decoding with decode budgets: ``tests/test_decoding.py``; the rules on hand-made tensors:
``tests/test_decode_rules.py``.)"""

import json

import pytest
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.policies import parse_policy, registry
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task

NEW_TOKENS = 8


def decode_capable() -> list[str]:
    return [
        name
        for name, cls in registry().items()
        if name != "full" and not getattr(cls, "wraps", False) and cls().decoding_refusal() is None
    ]


@pytest.fixture(scope="module")
def short_prefill(engine, loaded):
    sample = build_samples(get_task("needle"), loaded.tokenizer, TaskOptions(lengths=(300,), depths=(50,)))[0]
    policies = [parse_policy(name) for name in decode_capable()]
    return engine.prefill(torch.tensor([sample.input_ids]), policies, decoding=policies), policies


def decode(engine, prefill, policy, budget, target, interval=4, buffer=8, new_tokens=NEW_TOKENS):
    cache = engine.compress(prefill, policy, Budget.parse(budget))
    schedule = engine.schedule(policy, target, interval, buffer)
    return engine.decoder.decode_batch([engine.request(prefill, cache, new_tokens, schedule=schedule)])[0]


@pytest.mark.model
def test_a_target_that_holds_prompt_and_answer_changes_no_token(engine, short_prefill):
    prefill, policies = short_prefill
    assert len(policies) >= 10
    everything = prefill.context_len + NEW_TOKENS
    for policy in policies:
        for budget in ("cr0", "24"):  # decode-only, and after a prefill budget
            plain = decode(engine, prefill, policy, budget, None)
            kept = decode(engine, prefill, policy, budget, everything, interval=1)
            assert kept.tokens == plain.tokens, (policy.label, budget)
            assert kept.memory.peak_entries == plain.memory.peak_entries


@pytest.mark.model
def test_with_interval_1_the_cache_never_holds_more_than_target_plus_one(engine, short_prefill, loaded):
    prefill, _ = short_prefill
    heads = loaded.num_layers * loaded.num_kv_heads
    target = 40
    assert target < prefill.context_len
    for spec in ("snapkv", "streamingllm", "h2o", "rkv", "pyramidkv"):
        policy = parse_policy(spec)
        decoded = decode(engine, prefill, policy, "cr0", target, interval=1, new_tokens=12)
        memory = decoded.memory
        assert memory.cuts == len(decoded.tokens) - 1  # before every token written
        assert memory.peak_entries <= (target + 1) * heads, spec
        after_cuts = [entries for _, entries in memory.trace[2:-1:2]]  # start, (before, after) per cut, end
        assert len(after_cuts) == memory.cuts and all(entries == target * heads for entries in after_cuts), spec
        assert memory.peak_entries == (target + 1) * heads  # (PyramidKV's pyramid sums to the same)
    # interval 4 after a prefill budget of the target: never more than target + 4
    decoded = decode(engine, prefill, parse_policy("snapkv"), str(target), target, interval=4, new_tokens=12)
    assert decoded.memory.peak_entries <= (target + 4) * heads and decoded.memory.cuts == 2


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--policy", "kvzip", "--decode-budget", "64"], "kvzip cannot cut a cache while the answer is written"),
        (["--policy", "adakv(snapkv)", "--decode-budget", "64"], "prefill-only wrapper"),
        (["--policy", "snapkv", "--decode-budget", "6"], "below the buffer (8)"),
        (["--policy", "snapkv:window=32", "--decode-budget", "16"], "below snapkv:window=32's window (32)"),
        (["--policy", "snapkv", "--decode-budget", "64", "--decode-interval", "0"], "--decode-interval 0"),
        (["--policy", "snapkv", "--decode-budget", "64", "--decode-buffer", "-1"], "--decode-buffer -1"),
        (["--policy", "snapkv", "--decode-budget", "0.5"], "--decode-budget '0.5'"),
        (["--policy", "h2o:scores=all-bidirectional", "--decode-budget", "64"], "no decode-time rule"),
    ],
)
def test_bad_decode_budgets_are_one_line_and_exit_2(capsys, args, expected, tmp_path):
    from pkvbench.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--task", "needle", *args, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and expected in err, err


def decode_rows():
    """Rows of a decode-budget grid as the runner writes them: full (never cut) and snapkv at two decode budgets
    and without one, over three samples."""
    rows = []
    for sample, full_length in enumerate((100, 200, 300)):
        for policy, decode_budget, length, peak in (
            ("full", 64, full_length, 9000),
            ("snapkv", None, full_length, 9000),
            ("snapkv", 64, 2 * full_length, 1000),
            ("snapkv", 128, full_length, 2000),
        ):
            rows.append(
                {
                    "task": "list-recall",
                    "sample_id": f"n{sample}",
                    "policy": policy,
                    "budget": "cr0",
                    "query_mode": "aware",
                    "decode_budget": decode_budget,
                    "model": "smollm2-135m",
                    "score": 0.5 if decode_budget == 64 and policy != "full" else 1.0,
                    "new_tokens": length,
                    "hit_limit": length >= 400,
                    "peak_kv_entries": peak,
                    "peak_kv_bytes": peak * 512,
                    **({"kv_trace": [[0, peak], [length, peak]]} if decode_budget else {}),
                }
            )
    return rows


def test_rows_of_different_decode_budgets_are_different_rows(tmp_path):
    from pkvbench.reports.summary import summarize
    from pkvbench.store.results import ResultStore, row_key, unique_rows

    rows = decode_rows()
    assert len({row_key(r) for r in rows}) == len(rows)
    old = {k: v for k, v in rows[1].items() if k != "decode_budget"}  # a row written before decode budgets
    assert row_key(old) == row_key(rows[1])
    assert unique_rows(rows)[1] == 0
    summary = summarize(rows)
    assert list(summary["decode_budget"]) == ["64", "none", "64", "128"]
    assert list(summary["score"]) == [100.0, 100.0, 50.0, 100.0]
    store = ResultStore(tmp_path / "run")
    store.dir.mkdir()
    store.extend(rows)
    assert len(store.done_keys()) == len(rows)


def test_report_shows_score_length_and_peak_per_decode_budget(tmp_path, capsys):
    from pkvbench.cli import main
    from pkvbench.reports.drift import length_table
    from pkvbench.reports.report import load_runs, report_table

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decode_rows()))
    runs = load_runs([folder])
    table = report_table(runs.rows)
    assert list(table["decode_budget"]) == ["64", "none", "64", "128"]
    lengths = length_table(runs.rows)
    snap64 = lengths[(lengths["policy"] == "snapkv") & (lengths["decode_budget"] == "64")].iloc[0]
    assert snap64["new_tokens"] == 400 and snap64["length_ratio"] == 2.0 and snap64["n"] == 3
    assert snap64["hit_limit %"] == pytest.approx(200 / 3, abs=0.01)  # 400 and 600 tokens hit the 400 line
    assert snap64["peak_kv_entries"] == 1000 and snap64["length_ratio ci_low"] == 2.0
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(folder)])
    out = capsys.readouterr().out
    assert exit_info.value.code in (0, None)
    assert "Answer length and the largest cache while decoding" in out and "| decode_budget |" in out


def test_the_html_report_draws_the_cache_over_the_answer(tmp_path):
    from pkvbench.reports.figures.html_figures import decode_memory_figures
    from pkvbench.reports.report import load_runs

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in decode_rows()))
    figures = decode_memory_figures(load_runs([folder]).rows)
    assert [f["kind"] for f in figures] == ["memory"] and "sample n0" in figures[0]["title"]
    values = figures[0]["spec"]["data"]["values"]
    assert {v["policy"] for v in values} == {"full", "snapkv"} and len(values) == 6
