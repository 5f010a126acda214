"""R-KV (Cai et al., 2025, arXiv 2505.24133): importance from the last window's attention, less redundancy.

Rule, per layer and KV head, as the authors' code scores (Zefan-Cai/R-KV ``rkv/compression/r1_kv.py`` and
``rkv/utils.py``, ``d15c976``):

- importance: the logits q·k/√d of the last ``window`` queries over the entries before the window, the maximum over
  each KV head's group of query heads (its ``compute_attention_scores``, pooling ``max``), softmax over those entries
  (the window's own keys left out), the mean over the window's queries, then a 1-D max-pool (``kernel``, stride 1);
- redundancy: the cosine similarity of every pair of keys (the window's included; a key with itself 0); in each row
  the similarity to the *last* key more similar than ``threshold`` is zeroed (so the latest of near-copies is the one
  kept), then each key's mean similarity to all keys, softmax over the keys;
- score = ``mix_lambda`` · importance − (1 − ``mix_lambda``) · redundancy; the top k − window plus the window.

R-KV runs this while the answer is written (every 128 tokens back to its budget, with the last window kept); here
the same rule serves the prefill budget and the decode-time one (``--decode-budget``): its queries are then the
answer's latest. Not carried over: the ``retain_direction`` variants other than ``last`` (their default) and
``retain_ratio`` (used by those variants only); the scale is 1/√d as in its code.
"""

from dataclasses import dataclass
from typing import ClassVar

import torch

from pkvbench.policies.base import LayerStats, Needs, WindowedPolicy
from pkvbench.policies.snapkv import pool_scores


def window_importance(queries: torch.Tensor, keys: torch.Tensor, kernel: int) -> torch.Tensor:
    """``[Hkv, n]``: R-KV's attention of the window ``queries`` ``[Hq, w, d]`` over ``keys`` ``[Hkv, n, d]`` (the
    entries before the window): the group's largest logit, softmax over the n keys, mean over the queries, max-pooled."""
    query_heads, window, dim = queries.shape
    kv_heads = keys.shape[0]
    grouped = queries.float().view(kv_heads, query_heads // kv_heads, window, dim)
    logits = grouped @ keys.float()[:, None].transpose(2, 3) / dim**0.5  # [Hkv, group, w, n]
    attention = logits.amax(dim=1).softmax(dim=-1).mean(dim=1)
    return pool_scores(attention, kernel, "max")


# Bytes of one block of rows of a head's key similarities (float32, plus an int32 index of the same shape): the
# all-pairs matrix of a 32k-token prompt would take 4 GiB per head (13 B × T² with its temporaries); in blocks of
# rows the memory is flat in T. A prompt whose rows fit one block is scored exactly as the whole matrix was.
SIMILARITY_BLOCK_BYTES = 64 * 2**20


def key_redundancy(keys: torch.Tensor, threshold: float, block_bytes: int = SIMILARITY_BLOCK_BYTES) -> torch.Tensor:
    """``[Hkv, n]``: R-KV's redundancy of each key (``cal_similarity``, ``retain_direction="last"``), a head at a
    time and, per head, in blocks of rows (each row is zeroed on its own, and a key's redundancy is its column's
    mean), so that at most ``block_bytes`` of similarities exist at once whatever n."""
    length = keys.shape[1]
    rows = max(1, block_bytes // (8 * length))
    out = []
    for head in keys.float():
        normed = head / (head.norm(dim=-1, keepdim=True) + 1e-8)
        if rows >= length:
            out.append(_similarity_rows(normed, 0, length, threshold).mean(dim=0).softmax(dim=-1))
            continue
        sums = torch.zeros(length, device=keys.device)
        for start in range(0, length, rows):
            sums += _similarity_rows(normed, start, min(length, start + rows), threshold).sum(dim=0)
        out.append((sums / length).softmax(dim=-1))
    return torch.stack(out)


def _similarity_rows(normed: torch.Tensor, start: int, end: int, threshold: float) -> torch.Tensor:
    """Rows ``start``…``end`` of a head's key similarities, R-KV's way: a key with itself 0, and in each row the
    similarity to the last key more similar than ``threshold`` zeroed (column 0 where none is, as the reference's
    max over zeros)."""
    similarity = normed[start:end] @ normed.T
    rows = torch.arange(end - start, device=normed.device)
    similarity[rows, rows + start] = 0.0
    columns = torch.arange(similarity.shape[1], device=similarity.device, dtype=torch.int32)
    last_similar = torch.where(similarity > threshold, columns, 0).amax(dim=-1)
    similarity[rows, last_similar.long()] = 0.0
    return similarity


@dataclass(frozen=True)
class RKV(WindowedPolicy):
    name = "rkv"
    summary = "R-KV: λ·last window's attention (max-pooled) − (1−λ)·key redundancy (cosine); top k-window + window"
    reads_entries = True  # the cached keys themselves (a latent (MLA) cache has none per head: refused)
    positive: ClassVar[tuple[str, ...]] = ("kernel",)
    odd: ClassVar[tuple[str, ...]] = ("kernel",)
    kernel: int = 7
    mix_lambda: float = 0.07
    threshold: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.mix_lambda <= 1:
            raise ValueError(f"{self.name}: mix_lambda is a fraction (0..1)")

    @property
    def needs(self) -> Needs:
        return Needs(queries=frozenset({self.window}))

    def score(self, stats: LayerStats) -> torch.Tensor:
        keys = stats.keys.float()
        queries = stats.last_queries(self.window)
        before = stats.context_len - queries.shape[1]
        importance = window_importance(queries, keys[:, :before], self.kernel)
        redundancy = key_redundancy(keys, self.threshold)[:, :before]
        return self.mix_lambda * importance - (1 - self.mix_lambda) * redundancy
