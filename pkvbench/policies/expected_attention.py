"""Expected Attention (Devoto, Jeblick, Jégou, 2025, arXiv 2510.00636): the attention future queries can be
expected to pay each entry.

Rule, per layer (kvpress ``ExpectedAttentionPress``): queries to come are modelled as Gaussian, with the mean μ and
covariance Σ of the prompt's pre-RoPE queries from position ``sink`` on, rotated by the average RoPE rotation R̄ of
the next ``future`` positions (μ̄ = R̄μ, Σ̄ = R̄ΣR̄ᵀ; the engine records them). For key k_j of a non-sink position,
per query head h, the expected exponentiated logit is exp(μ̄_h·k_j/√d + k_jᵀΣ̄_h k_j/(2d)) (the Gaussian's moment
generating function; ``covariance=false`` drops the second term); softmax over the non-sink positions, mean over the
group's query heads; with ``vnorm`` the score is (a + ``epsilon``)·‖v_j‖₂. The first ``sink`` positions are always
kept. kvpress's leaderboard runs it inside AdaKV with epsilon 0.01: ``adakv(expected_attention:epsilon=0.01)``.
"""

from dataclasses import dataclass

import torch

from pkvbench.policies.base import LayerStats, Needs, ScoringPolicy


@dataclass(frozen=True)
class ExpectedAttention(ScoringPolicy):
    name = "expected_attention"
    summary = "expected attention of future queries (Gaussian over the prompt's queries) × value norm; sinks kept"
    reads_entries = True  # the cached keys and values (a latent (MLA) cache has none per head: refused)
    future: int = 512
    sink: int = 4
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0

    @property
    def needs(self) -> Needs:
        return Needs(query_stats=frozenset({(self.sink, self.future)}))

    @property
    def min_budget(self) -> int:
        return max(self.sink, 1)

    def score(self, stats: LayerStats) -> torch.Tensor:
        mean, covariance = stats.future_queries(self.sink, self.future)  # [Hq, d], [Hq, d, d]
        query_heads, kv_heads = stats.query_heads, stats.num_kv_heads
        sink = min(self.sink, stats.context_len - 1)
        keys = stats.keys.float()[:, sink:].repeat_interleave(query_heads // kv_heads, dim=0)  # [Hq, n, d]
        dim = keys.shape[-1]
        logits = (keys @ mean[:, :, None])[..., 0] / dim**0.5
        if self.covariance:
            logits = logits + ((keys @ covariance) * keys).sum(dim=-1) / (2 * dim)
        expected = logits.softmax(dim=-1).view(kv_heads, query_heads // kv_heads, -1).mean(dim=1)
        if self.vnorm:
            expected = (expected + self.epsilon) * stats.values.float()[:, sink:].norm(dim=-1)
        sinks = expected.new_full((kv_heads, sink), float("inf"))
        return torch.cat([sinks, expected], dim=1)
