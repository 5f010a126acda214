"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi Linear's attention layers): a cache of one latent per
token, expanded per head inside attention.

transformers caches, per MLA layer and token, the compressed latent (``kv_lora_rank`` values, after its norm) as the
layer's "keys" and the shared rotary key (``qk_rope_head_dim`` values, after RoPE) as its "values", both with one head
(``[batch, 1, T, d]``); the attention module expands them into every head's keys and values at each call
(``expand_kv``). pkvbench follows the cache:

- a layer's cache is one latent "head": a policy keeps positions of the latent, one set for every head;
- statistics come from the expanded per-head attention, as the attention kernel sees it, and fold to the latent as
  grouped-query attention folds a group: every query head in the one group (``LayerStats.num_kv_heads`` is 1);
- bytes are the latent's and the rotary key's (what MLA engines store), measured off the model's own cache;
- a cut while the answer is written scores with the expanded keys (``ShrinkingLayer.expand``);
- a rule that reads the cached keys or values themselves (KNorm's norms, KeyDiff's similarities, R-KV's
  redundancy, Expected Attention's projections, CriticalKV's value norms) has no per-head keys or values to read and
  is refused, as is a cache of one set per query head (``gqa=query``).
"""

from __future__ import annotations

import torch

from pkvbench.errors import PkvError

LATENT_REFUSAL = "an MLA cache holds one latent per token, not per-head keys and values"


def refusal(policy) -> str | None:
    """Why ``policy`` cannot run on an MLA model, in one line, or None."""
    if policy.per_query_head:
        return f"{policy.label}: gqa=query keeps one set per query head; {LATENT_REFUSAL}"
    if policy.reads_entries:
        return f"{policy.label} reads the cached keys or values themselves; {LATENT_REFUSAL}"
    return None


def check_policies(policies, model: str) -> None:
    """Refuse, in one line, a policy an MLA model cannot run (``refusal``)."""
    for policy in policies:
        reason = refusal(policy)
        if reason:
            raise PkvError(f"model {model} caches an MLA latent: {reason}")


def fold(scores: torch.Tensor, heads: int) -> torch.Tensor:
    """Per-head scores ``[H, T]`` of the expanded heads folded to the cache's ``heads`` (one for a latent) by their
    largest, as KVzip folds a group of query heads."""
    return scores.view(heads, -1, scores.shape[-1]).amax(dim=1)
