"""The engine on the real embedded model: exactness first."""

import pytest
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.engine.attention import StatsRecorder, recording
from pkvbench.engine.decoding import KeptEntries
from pkvbench.engine.exactness import generate_reference, masked_reference
from pkvbench.engine.exactness import stock_attention as attention_kernel
from pkvbench.engine.generation import CompressedCache
from pkvbench.policies import Needs, parse_policy
from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.registry import build_samples, get_task
from tests.helpers import decode_one

pytestmark = pytest.mark.model
POLICIES = ["full", "streamingllm", "h2o", "snapkv", "pyramidkv"]


@pytest.fixture(scope="module")
def needle_ids(loaded):
    sample = build_samples(get_task("needle"), loaded.tokenizer, TaskOptions(lengths=(1000,), depths=(50,)))[0]
    return torch.tensor([sample.input_ids])


@pytest.fixture(scope="module")
def prefill(engine, needle_ids):
    return engine.prefill(needle_ids, [parse_policy(p) for p in POLICIES] + [parse_policy("h2o", protocol="reference")])


def test_full_cache_equals_model_generate(engine, loaded, needle_ids, prefill):
    ours = decode_one(engine, prefill, engine.compress(prefill, parse_policy("full"), Budget(128)), 32)
    assert ours.tokens == generate_reference(loaded.model, needle_ids, 32)


def test_every_policy_with_budget_at_least_T_equals_full(engine, prefill):
    full = decode_one(engine, prefill, engine.compress(prefill, parse_policy("full"), Budget(1)), 32).tokens
    for spec in POLICIES[1:]:
        policy = parse_policy(spec)
        for budget in (Budget(prefill.context_len), Budget(5000)):
            cache = engine.compress(prefill, policy, budget)
            assert cache.kept_per_layer == [prefill.context_len] * 30
            assert decode_one(engine, prefill, cache, 32).tokens == full, spec
        # The gather path itself, keeping every entry, is exact too.
        kept = [policy.select(stats, prefill.context_len) for stats in prefill.stats]
        index = [k[:, :, None].expand(-1, -1, prefill.keys[0].shape[-1]) for k in kept]
        gathered = CompressedCache(
            KeptEntries(
                keys=[t[0].gather(1, i) for t, i in zip(prefill.keys, index)],
                values=[t[0].gather(1, i) for t, i in zip(prefill.values, index)],
            ),
            plan=cache.plan,
        )
        assert decode_one(engine, prefill, gathered, 32).tokens == full, spec


def test_compressed_decoding_keeps_original_positions(engine, loaded, needle_ids, prefill):
    """StreamingLLM drops the same positions in every layer and head, so a stock model given the full cache and a
    mask hiding the dropped prompt positions from new tokens must produce the same tokens."""
    cache = engine.compress(prefill, parse_policy("streamingllm"), Budget(64))
    ours = decode_one(engine, prefill, cache, 24).tokens
    length = prefill.context_len
    visible = torch.zeros(length, dtype=torch.bool)
    visible[:4] = True
    visible[length - 60 :] = True
    reference = masked_reference(
        loaded.model, prefill.keys, prefill.values, visible, prefill.first_token, 24, engine.stop_ids
    )
    assert ours == reference


def test_recorded_statistics_match_eager_attention(engine, loaded):
    ids = torch.tensor([loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"]])
    with attention_kernel(loaded.model, "eager"), torch.inference_mode():
        attentions = loaded.model(ids, output_attentions=True).attentions
    recorder = StatsRecorder(Needs(windows=frozenset({8}), accumulated=True), engine.softmaxes)
    with recording(recorder), torch.inference_mode():
        loaded.model(ids)
    for layer, probs in enumerate(attentions):
        torch.testing.assert_close(
            recorder.layers[ids.shape[1], layer].window_scores[8], probs[0, :, -8:].sum(1), atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            recorder.layers[ids.shape[1], layer].accumulated, probs[0].sum(1), atol=1e-4, rtol=1e-4
        )


def test_h2o_statistics_come_from_the_kernels_logsumexp(engine, loaded, monkeypatch):
    """The fast path of H2O's statistics (``accumulated_from_logsumexp``) is taken in every layer of the model's own
    prefill: a new keyword argument from transformers once sent it silently to the slower chunked path."""
    import pkvbench.engine.attention as attention

    calls = []
    fused = attention.accumulated_from_logsumexp
    monkeypatch.setattr(attention, "accumulated_from_logsumexp", lambda *a: calls.append(1) or fused(*a))
    engine.prefill(torch.tensor([list(range(100, 164))]), [parse_policy("h2o")])
    assert len(calls) == loaded.num_layers


def test_cache_really_shrinks_to_the_nominal_budget(engine, loaded, prefill):
    per_entry = loaded.num_kv_heads * loaded.head_dim * 2 * 4  # keys and values, float32
    for spec in POLICIES[1:]:
        cache = engine.compress(prefill, parse_policy(spec), Budget(64))
        assert sum(cache.kept_per_layer) == 30 * 64, spec
        assert cache.nbytes == 30 * 64 * per_entry, spec
        for keys, n in zip(cache.kept.keys, cache.plan.per_layer):
            assert keys.shape == (loaded.num_kv_heads, n, loaded.head_dim)
    pyramid = engine.compress(prefill, parse_policy("pyramidkv"), Budget(64)).kept_per_layer
    assert pyramid[0] > 64 > pyramid[-1]


def test_a_cache_of_query_heads_decodes_exactly(engine, loaded, prefill):
    """gqa=query (the reference protocol) stores one set per query head: 3x the bytes on this model. Where every
    head of a group keeps the same positions (StreamingLLM) it must give the KV-head cache's tokens, and with the
    whole prompt kept the full cache's."""
    per_entry = loaded.num_query_heads * loaded.head_dim * 2 * 4
    kv_heads = engine.compress(prefill, parse_policy("streamingllm"), Budget(64))
    query_heads = engine.compress(prefill, parse_policy("streamingllm:gqa=query"), Budget(64))
    assert query_heads.kept.heads == (loaded.num_query_heads,) * 30 and query_heads.nbytes == 30 * 64 * per_entry
    assert decode_one(engine, prefill, query_heads, 24).tokens == decode_one(engine, prefill, kv_heads, 24).tokens
    full = decode_one(engine, prefill, engine.compress(prefill, parse_policy("full"), Budget(1)), 24).tokens
    for spec in ("snapkv", "pyramidkv", "h2o"):
        whole = engine.compress(prefill, parse_policy(spec, protocol="reference"), Budget(5000))
        assert decode_one(engine, prefill, whole, 24).tokens == full, spec


def test_recording_h2o_statistics_leaves_the_prefill_bit_for_bit(engine, needle_ids, prefill):
    """With H2O's accumulated attention recorded, sdpa's attention on CPU comes from the flash kernel directly (for
    its log-sum-exps): the prefill's cache and logits must equal a prefill that records nothing."""
    plain = engine.prefill(needle_ids, [parse_policy("full")])
    assert torch.equal(plain.last_logits, prefill.last_logits)
    assert all(torch.equal(a, b) for a, b in zip(plain.keys, prefill.keys))


@pytest.mark.parametrize("spec", ["full", "snapkv", "pyramidkv", "adakv(snapkv)"])
def test_the_kept_positions_are_the_entries_the_cache_holds(engine, prefill, spec):
    """What the selection fingerprint hashes (``kept_positions``) is what was gathered: each head's stored keys are
    the full cache's keys at exactly those positions, in every layer (AdaKV: heads keep different numbers)."""
    cache = engine.compress(prefill, parse_policy(spec), Budget(64))
    positions = cache.kept_positions()
    assert len(positions) == 30
    for layer, heads in enumerate(positions):
        full = prefill.keys[layer][0]
        for head, kept in enumerate(heads):
            stored = cache.kept.keys[layer][head, : len(kept)]
            assert len(kept) == (cache.kept.lengths[layer][head] if cache.kept.lengths else stored.shape[0])
            assert torch.equal(stored, full[head, torch.as_tensor(kept)]), (spec, layer, head)
    assert sum(len(kept) for heads in positions for kept in heads) == cache.kept.entries
