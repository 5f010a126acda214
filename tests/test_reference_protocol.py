"""The reference protocol, proven position for position against a transcription of the PyramidKV paper's code.

The functions prefixed ``reference_`` are written from reading Zefan-Cai/KVCache-Factory (``pyramidkv/
pyramidkv_utils.py``: ``SnapKVCluster``, ``PyramidKVCluster``, ``H2OKVCluster``, ``StreamingLLMKVCluster`` and the
``repeat_kv`` before them in ``llama_model.py``); no code is copied. They work as that code does: on keys and values
repeated to every query head, one query head at a time, on a full attention matrix, with ``torch.topk``. pkvbench's
policies under ``--protocol reference`` must keep the same positions from the same queries and keys, except where
several positions tie (to float precision) for the last places, where the reference's own choice is up to the
backend.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from pkvbench.cell.budgets import Budget, plan
from pkvbench.engine.architecture import LayerSoftmax
from pkvbench.engine.attention import accumulated_attention, bidirectional_attention_sums, window_attention_sums
from pkvbench.policies import LayerStats, parse_policy
from pkvbench.policies.pyramidkv import pyramid_reference

TIE_TOLERANCE = 1e-5  # relative: scores this close to the last kept score may be swapped by float noise


# --- the transcription --------------------------------------------------------------------------------------------


def repeat_kv(key: torch.Tensor, query_heads: int) -> torch.Tensor:
    return key.repeat_interleave(query_heads // key.shape[0], dim=0)


def reference_window_scores(query, key, window):
    """Per query head: the last `window` queries' softmax attention over all T keys (causal only inside the window
    block, where it matters), summed over those queries, for the prefix positions [0, T - window)."""
    heads, length, dim = query.shape
    keys = repeat_kv(key, heads)
    logits = query[:, -window:] @ keys.transpose(1, 2) / math.sqrt(dim)
    block = torch.full((window, window), torch.finfo(logits.dtype).min).triu(1)
    logits[:, :, -window:] += block
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    return probs[:, :, : length - window].sum(dim=1)


def reference_keep(scores, selected, length, window):
    """topk(selected) of the prefix scores, then the window appended; as sorted position sets per head."""
    top = scores.topk(selected, dim=-1).indices
    recent = torch.arange(length - window, length).expand(scores.shape[0], window)
    return [sorted(row) for row in torch.cat([top, recent], dim=1).tolist()]


def reference_snapkv(query, key, budget, window, kernel=7, pooling="max"):
    length = key.shape[1]
    if length < budget:
        return [list(range(length))] * query.shape[0], None
    scores = reference_window_scores(query, key, window)
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    scores = pool(scores[None], kernel_size=kernel, padding=kernel // 2, stride=1)[0]
    return reference_keep(scores, budget - window, length, window), scores


def reference_pyramid_capacity(layer, layers, length, budget, window, beta=20):
    """Selected entries (beyond the window) of `layer`, or None for "keep everything" (T < k), as the code does."""
    if length < budget:
        return None
    min_num = (budget - window) // beta
    max_num = (budget - window) * 2 - min_num
    if max_num >= length - window:
        max_num = length - window
        min_num = (budget - window) * 2 - max_num
    steps = (max_num - min_num) // (layers - 1)
    if length < (budget - window) * 2:
        return budget - window
    return max_num - layer * steps


def reference_h2o(query, key, budget, window, variant):
    heads, length, dim = query.shape
    if length < budget:
        return [list(range(length))] * heads, None
    if variant == "window":
        scores = reference_window_scores(query, key, window)
    else:
        logits = query @ repeat_kv(key, heads).transpose(1, 2) / math.sqrt(dim)
        if variant == "causal":
            logits += torch.full((length, length), torch.finfo(logits.dtype).min).triu(1)
        else:  # 2024-10 .. 2026-06: only the last window x window block is masked
            logits[:, -window:, -window:] += torch.full((window, window), torch.finfo(logits.dtype).min).triu(1)
        scores = logits.softmax(dim=-1, dtype=torch.float32).sum(dim=1)[:, : length - window]
    return reference_keep(scores, budget - window, length, window), scores


def reference_streamingllm(heads, length, budget, window):
    if length < budget:
        return [list(range(length))] * heads
    return [list(range(budget - window)) + list(range(length - window, length))] * heads


# --- the comparison -----------------------------------------------------------------------------------------------


def assert_same_up_to_ties(ours: torch.Tensor, theirs: list[list[int]], scores: torch.Tensor | None):
    assert ours.shape[0] == len(theirs)
    for head, (mine, reference) in enumerate(zip(ours.tolist(), theirs)):
        if mine == reference:
            continue
        assert scores is not None and len(mine) == len(reference), f"head {head}: {mine} vs {reference}"
        kept_scores = scores[head, [p for p in reference if p < scores.shape[1]]]
        threshold = float(kept_scores.min())
        for position in set(mine) ^ set(reference):
            value = float(scores[head, position])
            assert abs(value - threshold) <= TIE_TOLERANCE * max(abs(threshold), 1e-12), (
                f"head {head}: position {position} (score {value}) differs but is not tied with {threshold}"
            )


def random_qk(query_heads, kv_heads, length, seed, dim=16):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(query_heads, length, dim, generator=gen), torch.randn(kv_heads, length, dim, generator=gen)


def stats_of(query, key, windows=(), accumulated=False, bidirectional=()):
    softmax = LayerSoftmax(query.shape[-1] ** -0.5)
    return LayerStats(
        context_len=key.shape[1],
        num_kv_heads=key.shape[0],
        num_query_heads=query.shape[0],
        window_scores=window_attention_sums(query, key, softmax, set(windows)) if windows else {},
        accumulated=accumulated_attention(query, key, softmax) if accumulated else None,
        bidirectional={w: bidirectional_attention_sums(query, key, softmax, w) for w in bidirectional},
    )


CASES = [(4, 4, 50), (4, 4, 300), (9, 3, 50), (9, 3, 300), (9, 3, 2000)]  # (query heads, KV heads, T): MHA and GQA
BUDGETS = [16, 24, 64, 128, 299, 2000, 4096]


@pytest.mark.parametrize("query_heads,kv_heads,length", CASES)
@pytest.mark.parametrize("window", [8, 32])
def test_snapkv_keeps_the_references_positions(query_heads, kv_heads, length, window):
    query, key = random_qk(query_heads, kv_heads, length, seed=length + query_heads)
    stats = stats_of(query, key, windows=[window])
    policy = parse_policy(f"snapkv:window={window}", protocol="reference")
    assert policy.gqa == "query" and policy.ties == "topk"
    for budget in [b for b in BUDGETS if b > window]:
        k = plan(policy, Budget(budget), length, 32).per_layer[0]
        reference, scores = reference_snapkv(query, key, budget, window)
        assert_same_up_to_ties(policy.select(stats, k), reference, scores)


@pytest.mark.parametrize("query_heads,kv_heads,length", CASES)
def test_pyramidkv_keeps_the_references_positions_in_every_layer(query_heads, kv_heads, length):
    window, layers = 8, 30
    policy = parse_policy("pyramidkv", protocol="reference")
    for budget in [b for b in BUDGETS if b > window]:
        per_layer = plan(policy, Budget(budget), length, layers).per_layer
        for layer in (0, 1, 14, 29):
            query, key = random_qk(query_heads, kv_heads, length, seed=layer * 7 + budget)
            stats = stats_of(query, key, windows=[window])
            capacity = reference_pyramid_capacity(layer, layers, length, budget, window)
            if capacity is None:
                assert per_layer[layer] == length
                continue
            assert per_layer[layer] == capacity + window
            scores = F.max_pool1d(reference_window_scores(query, key, window)[None], 7, 1, 3)[0]
            reference = reference_keep(scores, capacity, length, window)
            assert_same_up_to_ties(policy.select(stats, per_layer[layer]), reference, scores)


@pytest.mark.parametrize("query_heads,kv_heads,length", CASES[:4])
@pytest.mark.parametrize(
    "variant,spec",
    [("window", "h2o:scores=window"), ("causal", "h2o"), ("bidirectional", "h2o:scores=all-bidirectional")],
)
def test_h2o_variants_keep_the_references_positions(query_heads, kv_heads, length, variant, spec):
    window = 8
    query, key = random_qk(query_heads, kv_heads, length, seed=3 * length)
    stats = stats_of(query, key, windows=[window], accumulated=True, bidirectional=[window])
    policy = parse_policy(spec, protocol="reference")
    for budget in [b for b in BUDGETS if b > window]:
        reference, scores = reference_h2o(query, key, budget, window, variant)
        assert_same_up_to_ties(policy.select(stats, min(budget, length)), reference, scores)


@pytest.mark.parametrize("length", [50, 300, 2000])
def test_streamingllm_keeps_the_references_positions(length):
    stats = LayerStats(context_len=length, num_kv_heads=3, num_query_heads=9)
    needle_script = parse_policy("streamingllm:recent=32", protocol="reference")  # window 32
    longbench_script = parse_policy("streamingllm", protocol="reference")  # window k - 4: 4 sinks
    for budget in [b for b in BUDGETS if b > 32]:
        k = min(budget, length)
        assert needle_script.select(stats, k).tolist() == reference_streamingllm(9, length, budget, 32)
        assert longbench_script.select(stats, k).tolist() == reference_streamingllm(9, length, budget, budget - 4)


def reference_budgets(layers, length, budget, window, beta=20):
    """Kept entries per layer, window included, as the reference code's branches give them."""
    kept = []
    for layer in range(layers):
        capacity = reference_pyramid_capacity(layer, layers, length, budget, window, beta)
        kept.append(length if capacity is None else capacity + window)
    return kept


@pytest.mark.parametrize("layers", [24, 28, 30, 32, 80])
def test_pyramid_budget_arithmetic_equals_the_references(layers):
    lengths = sorted(
        {100, 101, 127, 128, 129, 240, 241, 250, 256, 500, 1000, 4095, 8000, 8192, 32768, 130000}
        | set(range(100, 600, 37))
    )
    for window in (8, 32):
        for budget in (40, 64, 96, 128, 256, 512, 1024, 2048, 4096):
            for length in lengths:
                ours = pyramid_reference(min(budget, length), length, layers, window=window, beta=20)
                assert ours == reference_budgets(layers, length, budget, window), (layers, window, budget, length)


def test_the_reference_overspends_and_exact_does_not():
    policy = parse_policy("pyramidkv", protocol="reference")
    assert sum(plan(policy, Budget(128), 8000, 32).per_layer) == 4272  # mean 133.5, as the code
    assert sum(plan(parse_policy("pyramidkv"), Budget(128), 8000, 32).per_layer) == 32 * 128
    # k <= T < 2(k - w): the code falls back to uniform budgets
    assert set(plan(policy, Budget(128), 200, 32).per_layer) == {128}


def test_fraction_budgets_round_half_to_even_under_the_reference_protocol():
    from pkvbench.cell.budgets import parse_budgets

    assert parse_budgets("0.125", "half-even")[0].entries(100) == 12  # round(12.5) = 12, as Python's round
    assert parse_budgets("0.125")[0].entries(100) == 13  # pkvbench: half up


def test_wrappers_run_under_the_reference_protocol_as_pkvbench_selects():
    """AdaKV and ChunkKV are not the paper's rules: under --protocol reference they (and their inner policy) keep
    pkvbench's defaults, instead of failing on the reference's one set per query head."""
    from pkvbench.policies.spec import parse_policy

    for spec in ("adakv(snapkv)", "chunkkv(pyramidkv)"):
        assert parse_policy(spec, protocol="reference") == parse_policy(spec)
    assert parse_policy("snapkv", protocol="reference").gqa == "query"  # the paper's own rules still change
