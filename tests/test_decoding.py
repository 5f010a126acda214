"""Decoding: greedy choice, ragged caches and their masks, batch planning, and batched == one at a time."""

import pytest
import torch

from pkvbench.engine.cache import RaggedLayer
from pkvbench.engine.decoding import DecodeRequest, KeptEntries, greedy, plan_batches


def test_barred_tokens_are_never_chosen_and_logits_stay_untouched():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])
    assert greedy(logits, []) == 1
    assert greedy(logits, [1]) == 3
    assert greedy(logits, [1, 3]) == 2
    assert logits.tolist() == [0.0, 5.0, 1.0, 4.0]


def ragged(lengths, dim=2, room=4, kv_heads=None):
    lengths = torch.tensor(lengths)
    batch, heads = lengths.shape
    longest = int(lengths.max())
    keys = torch.arange(batch * heads * longest * dim, dtype=torch.float32).view(batch, heads, longest, dim)
    return RaggedLayer(keys, keys.clone(), lengths, room, kv_heads or heads)


def test_new_tokens_follow_each_rows_own_entries_and_the_mask_hides_padding():
    layer = ragged([[3, 3], [1, 1]])
    new = torch.full((2, 2, 1, 2), -1.0)
    keys, _ = layer.update(new, new)
    assert keys.shape[2] == 4
    assert keys[0, 0, 3].tolist() == [-1, -1] and keys[1, 0, 1].tolist() == [-1, -1]  # right after each row's entries
    mask = layer.attention_mask()
    assert mask.shape == (2, 1, 1, 4)  # every head of a row keeps the same number: one mask row per batch row
    assert mask[0, 0, 0].tolist() == [True, True, True, True]
    assert mask[1, 0, 0].tolist() == [True, True, False, False]


def test_heads_with_different_lengths_get_their_own_mask_and_fed_tokens_are_causal():
    layer = ragged([[2, 4]])
    new = torch.zeros((1, 2, 2, 2))
    layer.update(new, new)
    mask = layer.attention_mask()
    assert mask.shape == (1, 2, 2, 6)
    assert mask[0, 0].tolist() == [[True, True, True, False, False, False], [True, True, True, True, False, False]]
    assert mask[0, 1].tolist() == [[True] * 5 + [False], [True] * 6]


def test_a_single_row_without_padding_needs_no_mask():
    layer = ragged([[5, 5]])
    new = torch.zeros((1, 2, 1, 2))
    layer.update(new, new)
    assert layer.attention_mask() is None


def test_a_cache_of_query_heads_repeats_each_new_entry_to_its_group():
    layer = ragged([[2, 2, 2, 2]], kv_heads=2)  # 4 query heads, 2 KV heads
    new = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1).expand(1, 2, 1, 2)
    keys, _ = layer.update(new, new)
    assert keys[0, :, 2, 0].tolist() == [1.0, 1.0, 2.0, 2.0]


def test_rows_leave_the_batch():
    layer = ragged([[3], [1], [2]])
    layer.select_rows(torch.tensor([0, 2]))
    assert layer.lengths.tolist() == [[3], [2]] and layer.keys.shape[0] == 2


def request(entries, heads=3, feed=(), position=1000):
    keys = [torch.zeros(heads, n, 4) for n in entries]
    return DecodeRequest(KeptEntries(keys, keys), position=position, max_new_tokens=4, feed=feed)


def test_batches_group_alike_rows_and_cap_padding_and_size():
    requests = [
        request([64, 64]),
        request([60, 70]),
        request([1000, 1000]),
        request([64, 64], feed=(1, 2)),
        request([64, 64], heads=9),
    ]
    batches = plan_batches(requests, max_rows=None)
    assert sorted(map(sorted, batches)) == [[0, 1], [2], [3], [4]]  # the full-length row would pad the small ones
    assert all(len(b) == 1 for b in plan_batches(requests, max_rows=1))


def test_a_grid_of_budgets_shares_a_batch_up_to_one_full_cache_of_padding():
    grid = [request([n, n], position=2000) for n in (64, 128, 256, 512) for _ in range(4)]
    # 64…256 padded to 256 add 7,680 entries, below one full cache (2 layers × 3 heads × 2000 = 12,000); adding a 512
    # row would add 26,112, more than the full cache and than half the 13,824 kept.
    assert [len(b) for b in plan_batches(grid, max_rows=None)] == [12, 4]
    assert [len(b) for b in plan_batches(grid, max_rows=5)] == [5, 5, 5, 1]


POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv", "h2o:scores=window", "snapkv:window=32"]
DECODE_POLICIES = ["streamingllm", "h2o", "snapkv", "tova", "rkv", "expected_attention", "random"]


@pytest.mark.model
def test_batched_decoding_gives_the_tokens_of_one_at_a_time(engine, loaded):
    """Every policy × budget on a needle prompt, with a stop string and a minimum length in play, some of them
    stored in fewer bits, and rows that cut their caches while decoding on their own schedules: decoding all
    configurations of a sample together yields exactly the tokens (and cache sizes) each gives alone."""
    from pkvbench.budgets import Budget
    from pkvbench.kv_formats import KVFormat
    from pkvbench.policies import parse_policy, registry
    from pkvbench.tasks.base import TaskOptions
    from pkvbench.tasks.registry import build_samples, get_task

    # every registered policy (a wrapper around SnapKV), and the head-wise and per-query-head cache layouts
    others = [
        f"{name}(snapkv)" if getattr(cls, "wraps", False) else name
        for name, cls in registry().items()
        if name not in POLICIES
    ]
    policies = [parse_policy(p) for p in [*POLICIES, *others, "adakv(snapkv):critical=true", "snapkv:gqa=query"]]
    # one prompt: each request is decoded twice (alone, then batched), the test's whole cost; a second prompt adds no path
    samples = build_samples(get_task("needle"), loaded.tokenizer, TaskOptions(lengths=(700,), depths=(100,)))
    # Rows that cut their cache while the answer is written, on schedules of their own: decode-only (every 3 tokens
    # back to 48 entries) and after a prefill budget (every 5 tokens back to 24), beside rows that never cut.
    cutting = [parse_policy(p) for p in DECODE_POLICIES]
    schedules = [("cr0", 48, 3), ("16", 24, 5)]
    differ, batched_rows = 0, 0
    for number, sample in enumerate(samples):
        prefill = engine.prefill(torch.tensor([sample.input_ids]), policies, decoding=cutting)
        requests = [
            engine.request(prefill, engine.compress(prefill, p, Budget(b)), 16, stop_strings=(".",), min_new_tokens=2)
            for p in policies
            for b in (16, 0.1)
        ]
        # caches stored in 16 bits and KIVI's integers (engine/quantized.py): uniform, head-wise and per-query-head
        requests += [
            engine.request(prefill, engine.compress(prefill, p, Budget(0.1), fmt=f), 16, stop_strings=(".",))
            for p in policies
            if p.label in ("full", "snapkv", "kvzip", "adakv(snapkv)", "snapkv:gqa=query")
            for f in (KVFormat(16), KVFormat(4, residual=8), KVFormat(2, group=16, residual=0))
        ]
        requests += [
            engine.request(
                prefill,
                engine.compress(prefill, p, Budget.parse(budget)),
                16,
                stop_strings=(".",),
                min_new_tokens=2,
                schedule=engine.schedule(p, target, interval, 4),
            )
            for p in (cutting if number == 0 else [])
            for budget, target, interval in schedules
        ]
        alone = [engine.decoder.decode_batch([r])[0] for r in requests]
        together = engine.decode_many(requests)
        batched_rows += sum(d.batch > 1 for d in together)
        differ += sum(a.tokens != b.tokens for a, b in zip(alone, together))
        assert [a.memory for a in alone] == [b.memory for b in together]  # the same cuts and cache sizes
    assert batched_rows > len(samples) * 10
    assert differ == 0
