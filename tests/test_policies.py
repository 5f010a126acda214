"""Each policy's rule on small hand-made tensors, checked against the rule written out longhand."""

import pytest
import torch

from pkvbench.errors import PkvError
from pkvbench.policies import LayerStats, parse_policy


def stats_with(window_scores=None, accumulated=None, heads=4, kv_heads=2, length=20):
    return LayerStats(
        context_len=length, num_kv_heads=kv_heads, window_scores=window_scores or {}, accumulated=accumulated
    )


def rows(t):
    return [r.tolist() for r in t]


def test_full_keeps_everything():
    kept = parse_policy("full").select(stats_with(), 5)
    assert rows(kept) == [list(range(20))] * 2


def test_streamingllm_keeps_sink_and_recent():
    kept = parse_policy("streamingllm").select(stats_with(), 8)
    assert rows(kept) == [[0, 1, 2, 3, 16, 17, 18, 19]] * 2
    kept = parse_policy("streamingllm:sink=2").select(stats_with(), 5)
    assert rows(kept) == [[0, 1, 17, 18, 19]] * 2


def test_snapkv_without_pool_is_top_plus_window():
    scores = torch.zeros(4, 20)
    # KV head 0 = query heads 0,1; KV head 1 = query heads 2,3.
    scores[0, 3] = scores[1, 3] = 1.0
    scores[0, 7] = 0.5
    scores[2, 10] = scores[3, 10] = 2.0
    scores[3, 1] = 1.5
    scores[:, 15] = 9.0  # the last position before the window (16..19)
    policy = parse_policy("snapkv:window=4:pooling=none")
    kept = policy.select(stats_with({4: scores}), 7)
    # head 0 mean: 15 (9), 3 (1), 7 (0.25); head 1: 15 (9), 10 (2), 1 (0.75)
    assert rows(kept) == [[3, 7, 15, 16, 17, 18, 19], [1, 10, 15, 16, 17, 18, 19]]


def test_snapkv_max_pool_spreads_peaks_and_ignores_the_window():
    scores = torch.zeros(2, 20)
    scores[:, 5] = 1.0
    scores[:, 17] = 100.0  # in the window: must not leak into the pooled prefix scores
    policy = parse_policy("snapkv:window=4:kernel=3")
    kept = policy.select(stats_with({4: scores}, kv_heads=1), 7)
    # Pooled prefix (0..15): positions 4,5,6 all score 1; position 15 would score 100 if the window leaked.
    assert rows(kept) == [[4, 5, 6, 16, 17, 18, 19]]


def test_snapkv_ties_go_to_earlier_positions():
    scores = torch.ones(2, 20)
    kept = parse_policy("snapkv:window=4").select(stats_with({4: scores}, kv_heads=1), 6)
    assert rows(kept) == [[0, 1, 16, 17, 18, 19]]


def test_gqa_mean_and_max_differ():
    scores = torch.zeros(2, 20)
    scores[0, 2] = 1.0  # one query head strongly
    scores[0, 9] = scores[1, 9] = 0.6  # both query heads moderately
    common = "snapkv:window=4:pooling=none"
    mean = parse_policy(common).select(stats_with({4: scores}, kv_heads=1), 5)
    most = parse_policy(common + ":gqa=max").select(stats_with({4: scores}, kv_heads=1), 5)
    assert rows(mean) == [[9, 16, 17, 18, 19]]
    assert rows(most) == [[2, 16, 17, 18, 19]]


def test_h2o_accumulated_and_normalized():
    length = 12
    acc = torch.zeros(2, length)
    acc[:, 0] = 6.0  # seen by all 12 queries → 0.5 once normalised
    acc[:, 8] = 2.4  # seen by 4 queries → 0.6 once normalised
    acc[:, 9] = 10.0  # inside the window
    st = stats_with(accumulated=acc, kv_heads=1, length=length)
    assert rows(parse_policy("h2o:window=3").select(st, 4)) == [[0, 9, 10, 11]]
    assert rows(parse_policy("h2o:window=3:normalize=true").select(st, 4)) == [[8, 9, 10, 11]]


def test_h2o_window_scores_are_snapkv_without_pool():
    scores = torch.rand(4, 20, generator=torch.Generator().manual_seed(0))
    st = stats_with({8: scores})
    h2o = parse_policy("h2o:scores=window").select(st, 12)
    snap = parse_policy("snapkv:pooling=none").select(st, 12)
    assert torch.equal(h2o, snap)


def test_pyramidkv_selects_like_snapkv():
    scores = torch.rand(4, 20, generator=torch.Generator().manual_seed(1))
    st = stats_with({8: scores})
    assert torch.equal(parse_policy("pyramidkv").select(st, 13), parse_policy("snapkv").select(st, 13))


def test_longhand_snapkv_rule_on_random_scores():
    gen = torch.Generator().manual_seed(2)
    length, window, kernel, k = 40, 5, 7, 15
    scores = torch.rand(6, length, generator=gen)
    kept = parse_policy(f"snapkv:window={window}:kernel={kernel}").select(
        stats_with({window: scores}, kv_heads=2, length=length), k
    )
    prefix = length - window
    for kv in range(2):
        pooled = []
        for q in (3 * kv, 3 * kv + 1, 3 * kv + 2):
            pooled.append(
                [
                    max(scores[q, j].item() for j in range(max(0, i - kernel // 2), min(prefix, i + kernel // 2 + 1)))
                    for i in range(prefix)
                ]
            )
        mean = [sum(col) / 3 for col in zip(*pooled)]
        top = sorted(range(prefix), key=lambda i: (-mean[i], i))[: k - window]
        assert kept[kv].tolist() == sorted(top) + list(range(prefix, length))


def test_budget_at_or_above_context_keeps_all():
    st = stats_with({8: torch.rand(4, 20)}, accumulated=torch.rand(4, 20))
    for spec in ("streamingllm", "h2o", "snapkv", "pyramidkv"):
        assert rows(parse_policy(spec).select(st, 20)) == [list(range(20))] * 2


def test_labels_and_options():
    assert parse_policy("snapkv").label == "snapkv"
    assert parse_policy("snapkv:window=32").label == "snapkv:window=32"
    assert parse_policy("pyramidkv", {"window": "16", "sink": "2"}).window == 16
    assert parse_policy("h2o:normalize=true").normalize is True


@pytest.mark.parametrize(
    "spec",
    [
        "nope",
        "snapkv:windw=3",
        "snapkv:window=x",
        "snapkv:pooling=median",
        "snapkv:kernel=4",
        "h2o:normalize=maybe",
        "snapkv:window",
    ],
)
def test_bad_policy_specs(spec):
    with pytest.raises(PkvError):
        parse_policy(spec)


# --- the field's policies (issue 19) --------------------------------------------------------------------------------


def entry_stats(keys, values=None, windows=None, query_heads=None, weight=None, layer=0):
    heads, length, _ = keys.shape
    return LayerStats(
        context_len=length,
        num_kv_heads=heads,
        num_query_heads=query_heads or heads,
        layer=layer,
        window_scores=windows or {},
        keys=keys,
        values=values if values is not None else keys,
        output_weight=weight,
    )


def test_knorm_keeps_the_smallest_keys():
    norms = torch.tensor([[5.0, 1.0, 3.0, 0.5, 4.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    keys = torch.zeros(2, 5, 2)
    keys[..., 0] = norms
    assert rows(parse_policy("knorm").select(entry_stats(keys), 2)) == [[1, 3], [0, 1]]


def test_keydiff_keeps_the_keys_least_like_the_mean_direction():
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.1], [0.9, 0.0], [0.0, 1.0], [-1.0, 0.2]]])
    assert rows(parse_policy("keydiff").select(entry_stats(keys), 2)) == [[3, 4]]


def test_tova_uses_the_last_querys_attention_averaged_over_all_heads():
    last = torch.tensor(
        [[0.5, 0.1, 0.2, 0.1, 0.1], [0.0, 0.5, 0.2, 0.1, 0.1], [0.1, 0.1, 0.6, 0.1, 0.1], [0.3, 0.1, 0.1, 0.4, 0.1]]
    )  # 4 query heads, 2 KV heads
    stats = entry_stats(torch.zeros(2, 5, 2), windows={1: last}, query_heads=4)
    kept = rows(parse_policy("tova").select(stats, 3))
    assert kept == [[0, 2, 4], [0, 2, 4]]  # mean over all heads: 0.225, 0.2, 0.275, 0.175 (+ the last kept)


def test_random_is_seeded_by_seed_and_layer():
    keys = torch.zeros(3, 40, 2)
    first = parse_policy("random").select(entry_stats(keys, layer=0), 10)
    assert torch.equal(first, parse_policy("random").select(entry_stats(keys, layer=0), 10))
    assert not torch.equal(first, parse_policy("random").select(entry_stats(keys, layer=1), 10))
    assert not torch.equal(first, parse_policy("random:seed=1").select(entry_stats(keys, layer=0), 10))


def test_adakv_gives_spread_heads_the_room_concentrated_heads_do_not_need():
    # KV head 0 puts all its attention on 2 positions, head 1 spreads it; no window, no pooling.
    window = torch.zeros(2, 12)
    window[0, [2, 7]] = 5.0
    window[1, :] = torch.linspace(1.0, 2.0, 12)
    stats = entry_stats(torch.zeros(2, 12, 2), windows={1: window})
    inner = "snapkv:window=1:pooling=none"
    kept = parse_policy(f"adakv({inner}):alpha=0").select(stats, 4)  # 8 entries for the layer
    assert kept.dtype == torch.bool and int(kept.sum()) == 8
    assert kept[0].nonzero().flatten().tolist() == [2, 7, 11] and int(kept[1].sum()) == 5
    floored = parse_policy(f"adakv({inner}):alpha=1").select(stats, 4)  # floor = k: every head keeps k
    assert floored.sum(dim=1).tolist() == [4, 4]


def test_criticalkv_fills_half_of_each_heads_budget_by_value_norm():
    window = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5, 0.4, 0.3, 0.2]])
    values = torch.zeros(1, 8, 2)
    values[0, 6] = 100.0  # a low-scoring entry whose value moves the output most
    weight = torch.eye(2)
    stats = entry_stats(torch.zeros(1, 8, 2), values=values, windows={1: window}, weight=weight)
    plain = parse_policy("adakv(snapkv:window=1:pooling=none):alpha=0").select(stats, 4)
    critical = parse_policy("adakv(snapkv:window=1:pooling=none):alpha=0:critical=true").select(stats, 4)
    assert plain[0].nonzero().flatten().tolist() == [0, 1, 2, 7]
    assert critical[0].nonzero().flatten().tolist() == [0, 1, 6, 7]  # top half by score; then by value norm


def test_chunkkv_keeps_whole_chunks_the_same_in_every_head():
    window = torch.zeros(4, 30)  # 2 KV heads × 2 query heads; chunks of 5
    window[:, 10:15] = 1.0
    window[0, 21] = 3.0  # one strong position: its chunk's mean (0.3) stays below chunk 10-14's (2.0)
    stats = entry_stats(torch.zeros(2, 30, 2), windows={1: window}, query_heads=4)
    kept = parse_policy("chunkkv(snapkv:window=1:pooling=none):chunk_length=5").select(stats, 11)
    # The chunk holding the window (position 29) first, then the best chunk; a third does not fit in 11.
    assert rows(kept) == [[10, 11, 12, 13, 14, 25, 26, 27, 28, 29]] * 2


def test_chunkkv_share_keeps_the_budgets_share_of_chunks_as_kvpress():
    window = torch.zeros(4, 30)  # 6 chunks of 5; the budget's share of them: int(6 · 11 / 30) = 2
    window[:, 10:15] = 1.0
    window[:, 0:5] = 0.5
    stats = entry_stats(torch.zeros(2, 30, 2), windows={1: window}, query_heads=4)
    kept = parse_policy("chunkkv(snapkv:window=1:pooling=none):chunk_length=5:count=share").select(stats, 11)
    assert rows(kept) == [[10, 11, 12, 13, 14, 25, 26, 27, 28, 29]] * 2  # 2 whole chunks: 10 entries
    more = parse_policy("chunkkv(snapkv:window=1:pooling=none):chunk_length=5:count=share").select(stats, 15)
    assert rows(more) == [[0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 25, 26, 27, 28, 29]] * 2  # int(6·15/30) = 3


def test_chunkkv_pinned_max_plus_1_lets_a_chunk_partly_in_the_window_lose_as_kvpress():
    """kvpress pads SnapKV's window with the highest score + 1: the chunk holding the window (one position of five)
    then averages (max + 1) / 5 and loses to a chunk of high scores; at +inf (pkvbench's default) it always wins."""
    window = torch.zeros(4, 30)  # 6 chunks of 5, the window is position 29; one chunk's share of k = 5
    window[:, 10:15] = 1.0
    stats = entry_stats(torch.zeros(2, 30, 2), windows={1: window}, query_heads=4)
    spec = "chunkkv(snapkv:window=1:pooling=none):chunk_length=5:count=share"
    assert rows(parse_policy(spec).select(stats, 5)) == [[25, 26, 27, 28, 29]] * 2
    assert rows(parse_policy(f"{spec}:pinned=max+1").select(stats, 5)) == [[10, 11, 12, 13, 14]] * 2


def test_random_per_layer_false_draws_the_same_scores_in_every_layer():
    keys = torch.zeros(3, 40, 2)
    policy = parse_policy("random:per_layer=false:seed=7")
    first = policy.select(entry_stats(keys, layer=0), 10)
    assert torch.equal(first, policy.select(entry_stats(keys, layer=5), 10))
    expected = torch.rand(3, 40, generator=torch.Generator().manual_seed(7))  # kvpress's RandomPress(seed=7)
    assert rows(first) == rows(torch.topk(expected, 10).indices.sort().values)


def test_criticalkv_epsilon_is_in_kvpress_units_of_the_inner_score():
    # SnapKV's score sums its window's attention where kvpress's averages it; the same epsilon must weigh the same.
    from pkvbench.policies.adakv import AdaKV
    from pkvbench.policies.snapkv import SnapKV

    class Averaged(SnapKV):  # kvpress's scale: the window's mean attention
        def score(self, stats):
            return super().score(stats) / self.window

        @property
        def score_scale(self):
            return 1.0

    sums = torch.rand(1, 24, generator=torch.Generator().manual_seed(1)) * 4e-3
    values = 1 + torch.rand(1, 24, 2, generator=torch.Generator().manual_seed(101))  # norms within 2x: epsilon matters
    stats = entry_stats(torch.zeros(1, 24, 2), values=values, windows={4: sums}, weight=torch.eye(2))

    def kept(inner, epsilon):
        return AdaKV(inner=inner, alpha=0.0, critical=True, epsilon=epsilon).select(stats, 12)

    summed, averaged = SnapKV(window=4, pooling="none"), Averaged(window=4, pooling="none")
    assert torch.equal(kept(summed, 1e-3), kept(averaged, 1e-3))
    assert not torch.equal(kept(summed, 1e-3), kept(averaged, 1e-3 / 4))  # what an unscaled epsilon would mean


@pytest.mark.parametrize(
    ("spec", "label"),
    [
        ("snapkv", "snapkv:window=64:kernel=5:pooling=avg"),
        ("pyramidkv", "pyramidkv:window=64:kernel=5:pooling=avg"),
        ("knorm", "knorm:ties=topk"),
        ("random", "random:per_layer=false"),
        ("chunkkv(snapkv)", "chunkkv(snapkv:window=64:kernel=5:pooling=avg):count=share:pinned=max+1"),
        ("adakv(snapkv):critical=true", "adakv(snapkv:window=64:kernel=5:pooling=avg):critical=true"),
        ("snapkv:window=32", "snapkv:window=32:kernel=5:pooling=avg"),  # an option given wins
        ("tova", "tova"),
        ("kvzip", "kvzip"),
    ],
)
def test_the_kvpress_preset(spec, label):
    assert parse_policy(spec, protocol="kvpress").label == label
