"""The statistics the attention hook records, against the naive full softmax."""

import pytest
import torch

from pkvbench.engine.architecture import LayerSoftmax
from pkvbench.engine.attention import accumulated_attention, window_attention_sums


def naive_attention(query, key, scaling):
    group = query.shape[0] // key.shape[0]
    expanded = key.repeat_interleave(group, dim=0)
    logits = query @ expanded.transpose(1, 2) * scaling
    length = query.shape[1]
    logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    return logits.softmax(-1)


def test_accumulated_attention_equals_column_sums_in_any_chunking():
    gen = torch.Generator().manual_seed(0)
    query, key = torch.randn(6, 37, 16, generator=gen), torch.randn(2, 37, 16, generator=gen)
    expected = naive_attention(query, key, 0.25).sum(dim=1)
    for chunk_bytes in (1, 4 * 6 * 37 * 5, 1 << 30):
        torch.testing.assert_close(
            accumulated_attention(query, key, LayerSoftmax(0.25), chunk_bytes=chunk_bytes), expected
        )
    # Column j is seen by T - j queries, each contributing at most 1.
    assert torch.all(expected <= (37 - torch.arange(37)) + 1e-5)
    torch.testing.assert_close(expected.sum(dim=1), torch.full((6,), 37.0))


def test_window_sums_equal_the_last_rows():
    gen = torch.Generator().manual_seed(1)
    query, key = torch.randn(6, 30, 8, generator=gen), torch.randn(3, 30, 8, generator=gen)
    probs = naive_attention(query, key, 0.3)
    sums = window_attention_sums(query, key, LayerSoftmax(0.3), {1, 8, 32})
    torch.testing.assert_close(sums[1], probs[:, -1])
    torch.testing.assert_close(sums[8], probs[:, -8:].sum(1))
    torch.testing.assert_close(sums[32], probs.sum(1))  # a window longer than the prompt is the whole prompt


def test_accumulated_attention_from_the_kernels_logsumexp():
    """The fused path: each query's log-sum-exp from the flash kernel, then one more kernel call for the sums."""
    from pkvbench.engine.attention import accumulated_from_logsumexp

    gen = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(1, h, 300, 64, generator=gen) for h in (9, 3, 3))
    output, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1), 0.0, True, scale=0.125
    )[:2]
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=0.125, enable_gqa=True
    )
    assert torch.equal(output, reference)  # the same output as the sdpa call transformers makes
    sums = accumulated_from_logsumexp(query[0], key[0], logsumexp[0], 0.125)
    torch.testing.assert_close(sums, naive_attention(query[0], key[0], 0.125).sum(dim=1), rtol=1e-5, atol=1e-5)


def test_accumulated_attention_when_the_log_sum_exps_spread_too_wide_for_value_weights(monkeypatch):
    """A head whose queries' log-sum-exps span more than ``WEIGHT_RANGE`` (exp(−lse) would underflow as a value
    weight) takes the bias-dimension formulation, and the sums stay exact."""
    from pkvbench.engine import attention

    gen = torch.Generator().manual_seed(4)
    query, key = torch.randn(6, 200, 64, generator=gen), torch.randn(2, 200, 64, generator=gen)
    query[:, 100:] *= 40  # later queries' logits reach the hundreds: their lse spread from the first ones'
    logits = query @ key.repeat_interleave(3, 0).transpose(1, 2) * 0.125
    logsumexp = logits.masked_fill(torch.ones(200, 200, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    assert (logsumexp.amax(1) - logsumexp.amin(1)).max() > attention.WEIGHT_RANGE
    expected = naive_attention(query, key, 0.125).sum(dim=1)
    sums = attention.accumulated_from_logsumexp(query, key, logsumexp, 0.125)
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-4)
    # Forced through value weights, the same head loses the columns the spread-out queries attend to.
    monkeypatch.setattr(attention, "WEIGHT_RANGE", float("inf"))
    forced = attention.accumulated_from_logsumexp(query, key, logsumexp, 0.125)
    assert not torch.allclose(forced, expected, rtol=1e-5, atol=1e-4)


def test_accumulated_attention_in_sixteen_bits_reads_the_kernels_float32_log_sum_exp():
    """The GPU's route (a bfloat16 model, the flash kernel): the same sums, within the kernel's float32 accumulation,
    from bfloat16 queries and keys — run here through the CPU's flash kernel in bfloat16, the math the CUDA kernel
    is handed (``scripts/bench_gpu.py``'s exactness block runs it on the device); even where the lse spread wide."""
    from pkvbench.engine import attention

    gen = torch.Generator().manual_seed(5)
    query, key = (torch.randn(h, 300, 64, generator=gen).bfloat16() for h in (6, 2))
    query[:, 150:] *= 20
    kernel = attention.flash_kernel(torch.device("cpu"), torch.bfloat16)
    _, logsumexp = kernel(
        query[None], key.repeat_interleave(3, 0)[None], key.repeat_interleave(3, 0)[None], True, 0.125
    )
    sums = attention.accumulated_from_logsumexp(query, key, logsumexp[0], 0.125, kernel=kernel)
    expected = naive_attention(query.float(), key.float(), 0.125).sum(dim=1)
    assert sums.dtype == torch.float32
    torch.testing.assert_close(sums, expected, rtol=2e-3, atol=1e-4)


def test_bidirectional_sums_leave_only_the_window_block_causal():
    from pkvbench.engine.attention import bidirectional_attention_sums

    gen = torch.Generator().manual_seed(3)
    query, key = torch.randn(4, 20, 8, generator=gen), torch.randn(2, 20, 8, generator=gen)
    logits = query @ key.repeat_interleave(2, 0).transpose(1, 2) * 0.3
    logits[:, -5:, -5:] = logits[:, -5:, -5:].masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(
        bidirectional_attention_sums(query, key, LayerSoftmax(0.3), 5, chunk_bytes=64), logits.softmax(-1).sum(1)
    )


@pytest.mark.parametrize(
    "interleaved,normed", [(False, False), (True, False), (False, True)], ids=["half", "interleaved", "norm-after"]
)
def test_future_query_statistics_rotate_the_mean_and_covariance(interleaved, normed):
    """Against the definition: unrotated queries' mean and covariance, under the average of the future rotations;
    RoPE pairing dimension i with i + d/2 (llama) or 2i with 2i + 1 (cohere, its cos and sin interleaved too). With
    a norm after RoPE (Hunyuan: the kernel gets w ⊙ R_p x / rms(x)), the queries as the kernel gets them unturned are
    w ⊙ x / rms(x), and those to come w ⊙ R_p x / rms(x)."""
    from pkvbench.engine.attention import future_query_statistics, rotate_half

    gen = torch.Generator().manual_seed(4)
    plain = torch.randn(2, 50, 8, generator=gen)
    scale = 1 + 0.5 * torch.randn(8, generator=gen) if normed else None
    frequencies = torch.tensor([1.0, 0.1, 0.01, 0.001])
    frequencies = frequencies.repeat_interleave(2) if interleaved else frequencies.repeat(2)
    angles = torch.arange(60.0)[:, None] * frequencies[None]
    cos, sin = angles.cos(), angles.sin()

    def turn(x, p):  # RoPE at position p, then the norm's weights (the rms is the same turned or not)
        turned = x * cos[p] + rotate_half(x, interleaved) * sin[p]
        return turned if scale is None else scale * turned

    if scale is not None:
        plain = plain / plain.square().mean(-1, keepdim=True).sqrt()
    rotated = turn(plain, slice(0, 50))
    mean, covariance = future_query_statistics(rotated, cos[:50], sin[:50], 4, cos[50:], sin[50:], interleaved, scale)
    unturned = plain if scale is None else scale * plain  # what the kernel gets at position 0
    future = [lambda x, p=p: turn(x if scale is None else x / scale, p) for p in range(50, 60)]

    expected_mean = torch.stack([move(unturned[:, 4:].mean(1)) for move in future]).mean(0)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-5, atol=1e-5)
    matrix = torch.stack([move(torch.eye(8)).T for move in future]).mean(0)  # the average future map as a matrix
    centred = unturned[:, 4:] - unturned[:, 4:].mean(1, keepdim=True)
    expected = matrix @ (centred.transpose(1, 2) @ centred / 46) @ matrix.T
    torch.testing.assert_close(covariance, expected, rtol=1e-4, atol=1e-5)


def test_attention_sinks_join_every_statistics_denominator():
    """gpt-oss's sinks (one learned logit per query head) as its eager kernel applies them: a column of the logits
    softmaxed with the keys and dropped. Window sums, accumulated attention (chunked, and from the kernel's
    log-sum-exp with the sink added), bidirectional sums and the last queries' sums while decoding."""
    from pkvbench.engine.attention import (
        StatsRecorder,
        bidirectional_attention_sums,
        flash_kernel,
        last_queries_sums,
    )
    from pkvbench.policies.base import Needs

    gen = torch.Generator().manual_seed(5)
    query, key = torch.randn(4, 30, 8, generator=gen), torch.randn(2, 30, 8, generator=gen)
    sinks = torch.randn(4, generator=gen) * 2

    def with_sink_column(logits):  # [Hq, r, n] → the model's softmax over [logits, sink], the sink dropped
        column = sinks.view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        return torch.cat([logits, column], dim=-1).softmax(-1)[..., :-1]

    expanded = key.repeat_interleave(2, dim=0)
    logits = query @ expanded.transpose(1, 2) * 0.3
    causal = logits.masked_fill(torch.ones(30, 30, dtype=torch.bool).triu(1), float("-inf"))
    probs = with_sink_column(causal)
    assert float(probs.sum(-1).max()) < 0.999  # the sink takes a share

    softmax = LayerSoftmax(0.3, sinks=sinks)
    torch.testing.assert_close(window_attention_sums(query, key, softmax, {8})[8], probs[:, -8:].sum(1))
    torch.testing.assert_close(last_queries_sums(query[:, -8:], key, softmax, {8})[8], probs[:, -8:].sum(1))
    torch.testing.assert_close(accumulated_attention(query, key, softmax, chunk_bytes=512), probs.sum(1))
    _, logsumexp = flash_kernel(query.device, query.dtype)(query[None], expanded[None], expanded[None], True, 0.3)
    from_logsumexp = StatsRecorder._accumulated(query, key, softmax, logsumexp, 30)
    torch.testing.assert_close(from_logsumexp, probs.sum(1), rtol=1e-4, atol=1e-5)
    bidirectional = logits.clone()
    bidirectional[:, -5:, -5:] = causal[:, -5:, -5:]
    torch.testing.assert_close(
        bidirectional_attention_sums(query, key, softmax, 5, chunk_bytes=64),
        with_sink_column(bidirectional).sum(1),
    )
    recorder = StatsRecorder(Needs(accumulated=True), [LayerSoftmax(0.3), softmax])
    recorder.observe(1, query[None], key[None])
    torch.testing.assert_close(recorder.layers[30, 1].accumulated, probs.sum(1))
