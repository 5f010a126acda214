"""Every admitted model family, proven exact on a tiny random model of its own (``docs/models.md``).

Each row builds a 2-layer random-weight model from transformers' config class (no download), saves it with the
embedded model's tokenizer, loads it as a user's folder and checks the engine against the stock model in float32:

- the full cache decodes as the model's own greedy ``generate``;
- StreamingLLM's cache decodes as the stock model over the full cache with the dropped positions masked, and its
  tokens differ from the full cache's (else that check proves nothing);
- a batch of several policies' caches decodes as each alone.

The sliding-window rows take a prompt that fits the window and an answer that carries the sequence past it: the
window must apply while decoding (the defect of issue 41: the full cache left ``generate`` at the 24th token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pkvbench.budgets import Budget
from pkvbench.engine.exactness import generate_reference, masked_reference
from pkvbench.policies.spec import parse_policy

VOCAB = 49152  # the embedded model's tokenizer
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class Row:
    """One family's tiny model and the prompt it is checked on."""

    name: str
    model_type: str
    settings: dict = field(default_factory=dict)
    length: int = 40  # prompt tokens
    new_tokens: int = 24
    budget: int = 16  # StreamingLLM's entries per head


ROWS = [
    # Sliding windows the prompt fits but prompt + answer does not (window 48, prompt 40, 24 new tokens).
    Row("mistral-window", "mistral", {"sliding_window": 48}),
    Row("qwen3-window", "qwen3", {"sliding_window": 48, "use_sliding_window": True, "max_window_layers": 0}),
]


def build(row: Row, folder, tokenizer):
    """The row's random model (seeded) saved in ``folder`` with the tokenizer; loaded through ``load_model``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model

    config = AutoConfig.for_model(row.model_type, **{**TINY, **row.settings})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Engine(load_model(str(folder), device="cpu", dtype="float32"))


@pytest.fixture(scope="module", params=ROWS, ids=lambda row: row.name)
def family(request, tmp_path_factory, tokenizer):
    row = request.param
    return row, build(row, tmp_path_factory.mktemp(row.name), tokenizer)


def prompt(row: Row) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, row.length), generator=torch.Generator().manual_seed(1))


def test_full_cache_and_streamingllm_decode_as_the_stock_model(family):
    row, engine = family
    ids = prompt(row)
    full, streaming = parse_policy("full"), parse_policy("streamingllm")
    prefill = engine.prefill(ids, [full, streaming])

    ours = engine.decode(prefill, engine.compress(prefill, full, Budget(row.budget)), row.new_tokens).tokens
    reference = generate_reference(engine.model, ids, row.new_tokens)
    assert ours == reference

    compressed = engine.compress(prefill, streaming, Budget(row.budget))
    streamed = engine.decode(prefill, compressed, row.new_tokens).tokens
    visible = torch.zeros(row.length, dtype=torch.bool)
    visible[: streaming.sink] = True
    visible[row.length - (row.budget - streaming.sink) :] = True
    masked = masked_reference(
        engine.model, prefill.keys, prefill.values, visible, prefill.first_token, row.new_tokens, engine.stop_ids
    )
    assert streamed == masked
    assert streamed != reference  # the masked check proves something only where dropping entries changes the answer


def test_a_batch_of_policies_decodes_as_each_alone(family):
    """Caches of several policies, two of them cut again while the answer is written (``--decode-budget``)."""
    row, engine = family
    ids = prompt(row)
    policies = [parse_policy(name) for name in ("full", "streamingllm", "snapkv", "h2o")]
    prefill = engine.prefill(ids, policies, decoding=policies[2:])
    requests = [
        engine.request(prefill, engine.compress(prefill, policy, Budget(row.budget)), row.new_tokens)
        for policy in policies
    ]
    requests += [
        engine.request(
            prefill,
            engine.compress(prefill, policy, Budget(2 * row.budget)),
            row.new_tokens,
            schedule=engine.schedule(policy, row.budget, 4, 4),
        )
        for policy in policies[2:]
    ]
    alone = engine.decode_many(requests, 1)
    together = engine.decode_many(requests)
    assert [d.tokens for d in together] == [d.tokens for d in alone]


@pytest.mark.parametrize("storage", ["ragged", "stored"])
def test_a_sliding_layer_hides_exactly_the_entries_older_than_its_window(storage):
    """Rows of kept entries at scattered original positions (each head its own), one new token at position 60 with a
    window of 32: every row and head sees its kept entries at positions 29 … 59 and the new token, nothing else —
    kept in the model's dtype, or packed in 4 bits (then the window reaches into the packed part and the residual)."""
    from pkvbench.budgets import KVFormat
    from pkvbench.engine.architecture import SLIDING
    from pkvbench.engine.decoding import DecodeRequest, KeptEntries
    from pkvbench.engine.layers import build_cache
    from pkvbench.engine.quantized import StoredEntries

    heads, dim, start, window = 2, 16, 60, 32
    generator = torch.Generator().manual_seed(3)
    requests, kept_positions = [], []
    for count in (40, 25):
        positions = torch.stack(
            [torch.randperm(start, generator=generator)[:count].sort().values for _ in range(heads)]
        )
        kept = KeptEntries([torch.randn(heads, count, dim)], [torch.randn(heads, count, dim)], positions=[positions])
        if storage == "stored":
            kept = StoredEntries.store(kept, KVFormat(4, group=16, residual=5), torch.float32)
        requests.append(DecodeRequest(kept=kept, position=start, max_new_tokens=4))
        kept_positions.append(positions)
    layer = build_cache(requests, room=4, kv_heads=heads, kinds=[SLIDING], windows=[window]).layers[0]
    layer.update(torch.randn(2, heads, 1, dim), torch.randn(2, heads, 1, dim))
    mask = layer.attention_mask()
    if storage == "stored":  # the packed columns' positions, then the residual's
        columns = torch.cat([layer.packed_positions, layer.residual.positions], dim=-1)
    else:
        columns = layer.positions
    for row, positions in enumerate(kept_positions):
        for head in range(heads):
            seen = sorted(columns[row, head][mask[row, min(head, mask.shape[1] - 1), 0]].tolist())
            expected = sorted(p for p in positions[head].tolist() if p > start - window) + [start]
            assert seen == expected
