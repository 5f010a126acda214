"""Decode-time cuts (``--decode-budget``) on hand-made tensors: each policy's rule while the answer is written equals
a longhand reference, the statistics a cut scores from are what they say, and a ``ShrinkingLayer`` cuts one row
without touching the others."""

import math

import pytest
import torch

from pkvbench.engine.architecture import LayerSoftmax
from pkvbench.engine.attention import last_queries_sums
from pkvbench.engine.shrinking import DecodeSchedule, RowMemory, ShrinkingLayer, prefill_needs
from pkvbench.policies import LayerStats, parse_policy, registry

N, KV_HEADS, QUERY_HEADS, DIM, WINDOW = 14, 2, 4, 4, 3
SCALE = 1 / math.sqrt(DIM)
GROUP = QUERY_HEADS // KV_HEADS


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV_HEADS, N, DIM, generator=gen)
    values = torch.randn(KV_HEADS, N, DIM, generator=gen)
    queries = torch.randn(QUERY_HEADS, WINDOW, DIM, generator=gen)
    return keys, values, queries


def longhand_window_sums(queries, keys, w):
    """Sum over the last w queries (the tokens of the last w entries) of their causal softmax attention."""
    out = [[0.0] * N for _ in range(QUERY_HEADS)]
    for head in range(QUERY_HEADS):
        for i in range(WINDOW - w, WINDOW):
            column = N - WINDOW + i  # this query's own entry
            logits = [float(queries[head, i] @ keys[head // GROUP, j]) * SCALE for j in range(column + 1)]
            top = max(logits)
            total = sum(math.exp(x - top) for x in logits)
            for j, x in enumerate(logits):
                out[head][j] += math.exp(x - top) / total
    return out


def longhand_top(scores, k, recent):
    """Per head: the last ``recent`` columns plus the k − recent best of the others (earlier column on ties)."""
    kept = []
    for head_scores in scores:
        candidates = sorted(range(N - recent), key=lambda j: (-head_scores[j], j))[: k - recent]
        kept.append(sorted(candidates + list(range(N - recent, N))))
    return kept


def group_mean(per_query_head):
    return [
        [sum(per_query_head[h][j] for h in range(g * GROUP, (g + 1) * GROUP)) / GROUP for j in range(N)]
        for g in range(KV_HEADS)
    ]


def max_pool(row, kernel):
    half = kernel // 2
    return [max(row[max(0, j - half) : j + half + 1]) for j in range(len(row))]


def test_last_queries_sums_are_the_causal_attention_of_the_newest_entries_tokens():
    keys, _, queries = tensors()
    sums = last_queries_sums(queries, keys, LayerSoftmax(SCALE), {1, WINDOW})
    for w in (1, WINDOW):
        expected = longhand_window_sums(queries, keys, w)
        assert torch.allclose(sums[w], torch.tensor(expected), atol=1e-5)


def decode_stats(policy, seed=0, **extra):
    keys, values, queries = tensors(seed)
    windows = policy.decoding_needs.windows
    return LayerStats(
        context_len=N,
        num_kv_heads=KV_HEADS,
        num_query_heads=QUERY_HEADS,
        layer=2,
        window_scores={w: torch.tensor(longhand_window_sums(queries, keys, w)) for w in windows},
        keys=keys,
        values=values,
        recent_queries=queries,
        positions=torch.tensor([[0, 1, 2, 3, 9, 15, 20, 30, 31, 33, 40, 41, 42, 43]] * KV_HEADS),
        end=44,
        **extra,
    )


@pytest.mark.parametrize("k,buffer", [(8, 0), (8, 5), (6, 6), (N, 2), (N + 3, 0)])
def test_snapkv_while_decoding(k, buffer):
    policy = parse_policy(f"snapkv:window={WINDOW}:kernel=3")
    stats = decode_stats(policy)
    keys, _, queries = tensors()
    sums = longhand_window_sums(queries, keys, WINDOW)
    pooled = [max_pool(row[: N - WINDOW], 3) + [0.0] * WINDOW for row in sums]
    recent = min(max(WINDOW, buffer), k)
    expected = list(map(list, [range(N)] * KV_HEADS)) if k >= N else longhand_top(group_mean(pooled), k, recent)
    assert policy.select_while_decoding(stats, k, buffer).tolist() == expected


def test_streamingllm_keeps_its_sinks_and_the_newest_entries():
    policy = parse_policy("streamingllm:sink=2")
    kept = policy.select_while_decoding(decode_stats(policy), 7, buffer=3)
    assert kept.tolist() == [[0, 1, 9, 10, 11, 12, 13]] * KV_HEADS


def test_tova_while_decoding_follows_the_latest_query_over_all_heads():
    policy = parse_policy("tova")
    stats = decode_stats(policy)
    keys, _, queries = tensors()
    last = longhand_window_sums(queries, keys, 1)
    mean = [sum(last[h][j] for h in range(QUERY_HEADS)) / QUERY_HEADS for j in range(N)]
    assert policy.select_while_decoding(stats, 6, buffer=2).tolist() == longhand_top([mean] * KV_HEADS, 6, 2)


@pytest.mark.parametrize("normalize", [False, True])
def test_h2o_carries_its_sums_and_normalizes_by_the_queries_since_each_position(normalize):
    policy = parse_policy(f"h2o:window=2:normalize={str(normalize).lower()}")
    gen = torch.Generator().manual_seed(3)
    accumulated = torch.rand(QUERY_HEADS, N, generator=gen) * 5
    stats = decode_stats(policy, accumulated=accumulated)
    positions = stats.positions[0].tolist()
    per_query_head = [
        [float(accumulated[h, j]) / ((44 - positions[j]) if normalize else 1) for j in range(N)]
        for h in range(QUERY_HEADS)
    ]
    expected = longhand_top(group_mean(per_query_head), 8, 4)
    assert policy.select_while_decoding(stats, 8, buffer=4).tolist() == expected


def test_knorm_and_keydiff_score_the_cache_keys():
    keys, _, _ = tensors()
    knorm = parse_policy("knorm")
    norms = [[-float(keys[h, j].norm()) for j in range(N)] for h in range(KV_HEADS)]
    assert knorm.select_while_decoding(decode_stats(knorm), 5, buffer=2).tolist() == longhand_top(norms, 5, 2)
    keydiff = parse_policy("keydiff")
    unit = [[keys[h, j] / keys[h, j].norm() for j in range(N)] for h in range(KV_HEADS)]
    anchors = [sum(unit[h]) / N for h in range(KV_HEADS)]
    cosines = [
        [-float(keys[h, j] @ anchors[h] / (keys[h, j].norm() * anchors[h].norm())) for j in range(N)]
        for h in range(KV_HEADS)
    ]
    assert keydiff.select_while_decoding(decode_stats(keydiff), 5, buffer=2).tolist() == longhand_top(cosines, 5, 2)


def test_random_draws_afresh_at_each_cut_and_the_same_for_the_same_cut():
    policy = parse_policy("random")
    stats = decode_stats(policy)
    first = policy.select_while_decoding(stats, 6, buffer=2)
    assert torch.equal(first, policy.select_while_decoding(stats, 6, buffer=2))
    later = LayerStats(**{**stats.__dict__, "end": 60})
    assert not torch.equal(first, policy.select_while_decoding(later, 6, buffer=2))
    assert all(row[-2:] == [N - 2, N - 1] for row in first.tolist())


def test_expected_attention_while_decoding():
    policy = parse_policy("expected_attention:sink=2")
    gen = torch.Generator().manual_seed(5)
    mean = torch.randn(QUERY_HEADS, DIM, generator=gen)
    spread = torch.randn(QUERY_HEADS, DIM, DIM, generator=gen)
    covariance = spread @ spread.transpose(1, 2) / DIM
    stats = decode_stats(policy, query_stats={(2, 512): (mean, covariance)})
    keys, values, _ = tensors()
    scores = []
    for g in range(KV_HEADS):
        per_head = []
        for h in range(g * GROUP, (g + 1) * GROUP):
            logits = [
                float(mean[h] @ keys[g, j]) / math.sqrt(DIM)
                + float(keys[g, j] @ covariance[h] @ keys[g, j]) / (2 * DIM)
                for j in range(2, N)
            ]
            top = max(logits)
            total = sum(math.exp(x - top) for x in logits)
            per_head.append([math.exp(x - top) / total for x in logits])
        expected = [sum(col) / GROUP for col in zip(*per_head)]
        scores.append([math.inf, math.inf] + [a * float(values[g, j + 2].norm()) for j, a in enumerate(expected)])
    assert policy.select_while_decoding(stats, 7, buffer=3).tolist() == longhand_top(scores, 7, 3)


@pytest.mark.parametrize("length", [7, 64, 301])
def test_rkv_redundancy_in_row_blocks_equals_the_whole_matrixs_and_keeps_the_same_entries(length):
    """R-KV's redundancy computed a few rows at a time (flat memory in T) against the whole similarity matrix at
    once (what it computed before): the same scores to float rounding and the same top entries per head."""
    from pkvbench.policies.rkv import key_redundancy

    generator = torch.Generator().manual_seed(length)
    keys = torch.randn(3, length, 16, generator=generator)
    keys[:, length // 2 :] += keys[:, : length - length // 2]  # near-copies, so the threshold's zeroing matters
    whole = key_redundancy(keys, 0.5)
    for block_bytes in (8 * length, 8 * length * 5):  # one row, five rows per block
        blocked = key_redundancy(keys, 0.5, block_bytes=block_bytes)
        torch.testing.assert_close(blocked, whole, rtol=1e-5, atol=1e-7)
        k = max(1, length // 4)
        assert (blocked.topk(k).indices.sort().values == whole.topk(k).indices.sort().values).all()


def test_rkv_importance_less_redundancy():
    policy = parse_policy(f"rkv:window={WINDOW}:kernel=3:mix_lambda=0.3:threshold=0.2")
    stats = decode_stats(policy)
    keys, _, queries = tensors()
    before = N - WINDOW
    scores = []
    for g in range(KV_HEADS):
        attention = [0.0] * before
        for i in range(WINDOW):
            logits = [
                max(float(queries[h, i] @ keys[g, j]) for h in range(g * GROUP, (g + 1) * GROUP)) / math.sqrt(DIM)
                for j in range(before)
            ]
            top = max(logits)
            total = sum(math.exp(x - top) for x in logits)
            for j, x in enumerate(logits):
                attention[j] += math.exp(x - top) / total / WINDOW
        importance = max_pool(attention, 3)
        unit = [keys[g, j] / (keys[g, j].norm() + 1e-8) for j in range(N)]
        similarity = [[0.0 if i == j else float(unit[i] @ unit[j]) for j in range(N)] for i in range(N)]
        for i in range(N):
            similar = [j for j in range(N) if similarity[i][j] > 0.2]
            similarity[i][max(similar) if similar else 0] = 0.0
        mean = [sum(similarity[i][j] for i in range(N)) / N for j in range(N)]
        top = max(mean)
        total = sum(math.exp(x - top) for x in mean)
        redundancy = [math.exp(x - top) / total for x in mean]
        scores.append([0.3 * importance[j] - 0.7 * redundancy[j] for j in range(before)] + [0.0] * WINDOW)
    kept = policy.select_while_decoding(stats, 8, buffer=2)
    assert kept.tolist() == longhand_top(scores, 8, WINDOW)
    assert torch.equal(policy.select(stats, 8), kept), "after the prefill the same rule"


def decode_capable():
    return [
        name
        for name, cls in registry().items()
        if not getattr(cls, "wraps", False) and cls().decoding_refusal() is None
    ]


def test_which_policies_can_cut_while_decoding():
    assert set(decode_capable()) >= {
        "full",
        "streamingllm",
        "snapkv",
        "tova",
        "knorm",
        "keydiff",
        "h2o",
        "random",
        "expected_attention",
        "rkv",
    }
    for spec in ("kvzip", "adakv(snapkv)", "chunkkv(snapkv)", "h2o:scores=all-bidirectional", "snapkv:gqa=query"):
        refusal = parse_policy(spec).decoding_refusal()
        assert refusal and "\n" not in refusal


def test_the_prefill_records_the_prompts_last_queries_for_the_first_cuts():
    needs = prefill_needs(parse_policy("snapkv:window=16"))
    assert needs.windows == {16} and needs.queries == {16}
    assert prefill_needs(parse_policy("h2o")).accumulated
    assert prefill_needs(parse_policy("expected_attention:sink=4")).query_moments == {4}
    pyramid = DecodeSchedule.make(parse_policy("pyramidkv"), 64, 8, 8, 4)
    assert pyramid.targets(1000)[0] > 64 > pyramid.targets(1000)[-1] and sum(pyramid.targets(1000)) == 4 * 64
    assert pyramid.targets(60) == [60] * 4  # a target that holds the whole cache cuts nothing
    assert DecodeSchedule.make(parse_policy("full"), 64, 8, 8, 4).cuts_nothing


def layer(lengths, accumulate=True, window=2):
    lengths = torch.tensor(lengths)
    batch, heads = lengths.shape
    longest = int(lengths.max())
    keys = torch.arange(batch * heads * longest * 2, dtype=torch.float32).view(batch, heads, longest, 2)
    positions = torch.arange(longest).expand(batch, heads, longest) * 10
    queries = torch.zeros(batch, heads * 2, window, 2) if window else None
    counts = torch.ones(batch, dtype=torch.long) if window else None
    accumulated = torch.ones(batch, heads * 2, longest) if accumulate else None
    return ShrinkingLayer(keys, keys.clone(), lengths, 3, heads, positions.clone(), queries, counts, accumulated)


def test_a_cut_compacts_one_row_and_leaves_the_others():
    cache = layer([[5, 5], [4, 4]])
    before = cache.keys[1].clone()
    cache.keep(0, torch.tensor([[0, 3, 4], [1, 2, 4]]))
    assert cache.lengths.tolist() == [[3, 3], [4, 4]]
    assert torch.equal(cache.keys[1], before[:, :4]) and cache.keys.shape[2] == 4
    assert cache._positions[0, :, :3].tolist() == [[0, 30, 40], [10, 20, 40]]
    assert cache._accumulated[0, :, 3:].abs().sum() == 0  # columns to be written start from nothing
    cache.next_position = 50
    new = torch.full((2, 2, 1, 2), 7.0)
    cache.update(new, new)
    assert cache.lengths.tolist() == [[4, 4], [5, 5]]
    assert cache._positions[0, :, 3].tolist() == [50, 50] and cache._positions[1, :, 4].tolist() == [50, 50]
    query = torch.randn(2, 4, 1, 2)
    cache.observe(query, LayerSoftmax(1.0))
    assert cache.query_counts.tolist() == [2, 2] and torch.equal(cache._queries[:, :, -1], query[:, :, 0])
    # each row's new attention sums to one per query head over its own entries
    assert torch.allclose(cache._accumulated[0, :, :4].sum(-1), torch.tensor([1.0 + 3, 1 + 3, 1 + 3, 1 + 3]))


def test_the_trace_keeps_the_start_the_end_and_at_most_64_cuts():
    memory = RowMemory()
    memory.note(0, 1000, 1, attended=False)
    for cut in range(1, 201):
        memory.note(cut * 4, 700, 1)
        memory.note(cut * 4, 600, 1, attended=False)
    memory.note(803, 650, 1)
    trace = memory.compact_trace()
    assert trace[0] == [0, 1000] and trace[-1] == [803, 650] and len(trace) <= 2 * 64 + 4
    assert memory.peak_entries == 700


def test_the_attention_wrapper_hands_each_steps_queries_to_a_shrinking_layer():
    from types import SimpleNamespace

    from pkvbench.engine.attention import _decoding_attention
    from pkvbench.engine.cache import RaggedCache

    shrinking = layer([[3, 3]], accumulate=True)
    cache = RaggedCache([shrinking], [LayerSoftmax(0.5)])
    new = torch.ones((1, 2, 1, 2))
    cache.update(new, new, 0)
    query = torch.randn(1, 4, 1, 2)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=2)
    _decoding_attention(
        lambda *args, **kwargs: (None, None), "sdpa", cache, module, query, shrinking.keys, shrinking.values
    )
    assert torch.equal(shrinking._queries[0, :, -1], query[0, :, 0]) and shrinking.query_counts.tolist() == [2]
    assert torch.allclose(shrinking._accumulated[0, :, :4].sum(-1), torch.full((4,), 4.0))
