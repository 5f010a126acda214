"""The statistics the attention hook records, against the naive full softmax."""

import torch

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
        torch.testing.assert_close(accumulated_attention(query, key, 0.25, chunk_bytes=chunk_bytes), expected)
    # Column j is seen by T - j queries, each contributing at most 1.
    assert torch.all(expected <= (37 - torch.arange(37)) + 1e-5)
    torch.testing.assert_close(expected.sum(dim=1), torch.full((6,), 37.0))


def test_window_sums_equal_the_last_rows():
    gen = torch.Generator().manual_seed(1)
    query, key = torch.randn(6, 30, 8, generator=gen), torch.randn(3, 30, 8, generator=gen)
    probs = naive_attention(query, key, 0.3)
    sums = window_attention_sums(query, key, 0.3, {1, 8, 32})
    torch.testing.assert_close(sums[1], probs[:, -1])
    torch.testing.assert_close(sums[8], probs[:, -8:].sum(1))
    torch.testing.assert_close(sums[32], probs.sum(1))  # a window longer than the prompt is the whole prompt
