"""Every admitted model family, proven exact on a tiny random model of its own (``docs/models.md``).

Each row builds a 2-layer random-weight model from transformers' config class (no download), saves it with the
embedded model's tokenizer, loads it as a user's folder and checks the engine against the stock model in float32:

- the full cache decodes as the model's own greedy ``generate``;
- StreamingLLM's cache decodes as the stock model over the full cache with the dropped positions masked, and its
  tokens differ from the full cache's (else that check proves nothing);
- a batch of several policies' caches decodes as each alone.

The sliding-window rows take a prompt that fits the window and an answer that carries the sequence past it: the
window must apply while decoding (the defect of issue 41: the full cache left ``generate`` at the 24th token).
Every row also runs the CLI over every policy on a needle prompt of about 100 tokens.

Each row's model is checked again under other configs of its family (``VARIANTS``: windows above, across and below
the prompt, keys of other families, released RoPE scalings), sharing its weights; what the engine cannot run exactly
is refused in one line before the weights load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pkvbench.cell.budgets import Budget
from pkvbench.engine.exactness import generate_reference, masked_reference
from pkvbench.engine.latent import refusal as latent_refusal
from pkvbench.policies.spec import parse_policy
from tests.helpers import decode_one

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


# A small gated-delta-rule layer (Qwen3-Next, Qwen3.5, OLMo-hybrid)
LINEAR_ATTENTION = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}


HYBRID = ["linear_attention", "full_attention"] * 2
# A small Mamba-2 mixer (Bamba, Granite-4, Falcon-H1)
MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_chunk_size": 16}
UNSET = object()  # a setting of TINY that a row leaves to its config class
# A small MLA attention: a latent of 32 values and a rotary key of 16 (the KIVI group divides it); no head_dim
MLA = {
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "num_key_value_heads": 4,
    "head_dim": UNSET,
}
MOE_DENSE = {"first_k_dense_replace": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
NO_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # a config's defaults past our vocabulary


@dataclass(frozen=True)
class Row:
    """One family's tiny model and the prompt it is checked on."""

    name: str
    model_type: str
    settings: dict = field(default_factory=dict)
    length: int = 40  # prompt tokens
    new_tokens: int = 24
    budget: int = 16  # StreamingLLM's entries per head
    norms: float = 0.0  # the spread of random norm weights (a random model's are all ones, so prove nothing)
    grids: tuple[str, ...] = ("memory-bits", "decode-budget")  # the CLI grids it runs (``GRIDS``)

    @property
    def batch(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Its batch test's policies: those whose caches are compressed at the prefill, and those also cut while the
        answer is written. A row whose attention another row proves batches the full cache, one compressed and one
        cut (rows of three lengths, one shrinking): the costliest check of a row proves nothing new on its attention."""
        if self.grids == DECODING_GRID:
            return ("full", "snapkv"), ("snapkv",)
        return ("full", "streamingllm", "snapkv", "h2o"), ("snapkv", "h2o")


# A family whose attention another row proves already (its "how handled" says "as" that family) runs the CLI's
# decode-time grid only: every policy at a memory budget in two widths proves nothing new on it, and costs the most.
DECODING_GRID = ("decode-budget",)


ROWS = [
    Row("llama", "llama"),
    Row("phi3", "phi3", {"partial_rotary_factor": 0.5}),
    Row("olmo2", "olmo2"),
    Row("starcoder2", "starcoder2", {"initializer_range": 0.2}),
    Row("qwen3_moe", "qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    Row("granite", "granite", {"attention_multiplier": 0.3, "residual_multiplier": 0.5, "logits_scaling": 2.0}),
    # Sliding windows the prompt fits but prompt + answer does not (window 128, prompt 120, 24 new tokens).
    Row("mistral-window", "mistral", {"sliding_window": 128}, length=120),
    Row(
        "qwen3-window", "qwen3", {"sliding_window": 128, "use_sliding_window": True, "max_window_layers": 0}, length=120
    ),
    # Mixed: layer 0 global (compressed), layer 1 local (kept whole, under its window).
    Row(
        "qwen2-mixed", "qwen2", {"sliding_window": 128, "use_sliding_window": True, "max_window_layers": 1}, length=120
    ),
    # Gemma: layer 0 local (kept whole, window 64: prompt 60 + 24 new tokens cross it), layer 1 global; the module's
    # scale 1/sqrt(query_pre_attn_scalar), not 1/sqrt(head_dim). Gemma 2 soft-caps its logits (a cap low enough
    # that they bend: the statistics must cap them as the eager kernel does); Gemma 3 rotates its local layer at
    # another base than its global one (the un-rotation must take each layer's own).
    Row(
        "gemma2",
        "gemma2",
        {"sliding_window": 64, "attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 1, "initializer_range": 0.05},
        length=60,
    ),
    Row(
        "gemma3_text",
        "gemma3_text",
        {
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 8,
        },
        length=60,
    ),
    # Layers of two shapes: local (window 32, 2 KV heads of 16, kept whole) and global (1 KV head of 32, values the
    # keys' projection: attention_k_eq_v; a proportional RoPE); v norms, a softmax scale of 1, per-layer inputs.
    Row(
        "gemma4_text",
        "gemma4_text",
        {
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": VOCAB,
        },
        length=60,
    ),
    # Interleaved RoPE (pairs 2i, 2i + 1), q/k layer norms, a logit scale, attention and MLP in parallel.
    Row("cohere", "cohere", {"use_qk_norm": True, "logit_scale": 4.0, "initializer_range": 0.2}),
    # Attention sinks, mixture of experts, eager attention; layer 0 local (window 48, kept whole), layer 1 global.
    Row(
        "gpt_oss",
        "gpt_oss",
        {
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 48,
            "layer_types": ["sliding_attention", "full_attention"],
            "initializer_range": 0.2,
        },
    ),
    Row("mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, grids=DECODING_GRID),
    Row(
        "qwen2_moe",
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
        grids=DECODING_GRID,
    ),
    Row(
        "ministral",
        "ministral",
        {"sliding_window": 128, "layer_types": ["sliding_attention"] * 2},
        length=120,
        grids=DECODING_GRID,
    ),
    Row(
        "olmo3",
        "olmo3",
        {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
        length=60,
        grids=DECODING_GRID,
    ),
    Row("seed_oss", "seed_oss", grids=DECODING_GRID),
    Row("apertus", "apertus", grids=DECODING_GRID),
    Row("arcee", "arcee", grids=DECODING_GRID),
    Row(
        "granitemoe",
        "granitemoe",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "attention_multiplier": 0.3},
        grids=DECODING_GRID,
    ),
    Row("phimoe", "phimoe", {"num_local_experts": 4, "num_experts_per_tok": 2}, grids=DECODING_GRID),
    Row(
        "vaultgemma",
        "vaultgemma",
        {
            "sliding_window": 64,
            "attn_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 1,
            "initializer_range": 0.05,
            "tie_word_embeddings": False,  # tied, its random model repeats its input token whatever the cache
            "layer_types": ["sliding_attention", "full_attention"],
        },
        length=60,
        grids=DECODING_GRID,
    ),
    Row("internlm3", "internlm3", grids=DECODING_GRID),
    # NoPE layers (layer 1: no rotary embedding): un-rotation is the identity there.
    Row("smollm3", "smollm3", {"no_rope_layers": [1, 0], "pad_token_id": 0, "tie_word_embeddings": False}),
    Row(
        "exaone4",
        "exaone4",
        {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},  # layer 1 global and NoPE
        length=60,
        norms=0.5,
    ),
    # RoPE tables laid out as rotate-half's, applied to interleaved pairs (the first half spread over the pairs).
    Row("glm", "glm", {"pad_token_id": 0}),
    Row("glm4", "glm4", {"pad_token_id": 0}, grids=DECODING_GRID),
    Row(
        "glm4_moe",
        "glm4_moe",
        {
            "pad_token_id": 0,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "use_qk_norm": True,
        },
        norms=0.5,
        grids=DECODING_GRID,
    ),
    Row("ernie4_5", "ernie4_5", {"tie_word_embeddings": False}),
    Row(
        "ernie4_5_moe",
        "ernie4_5_moe",
        {"tie_word_embeddings": False, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32},
        grids=DECODING_GRID,
    ),
    Row("helium", "helium", grids=DECODING_GRID),
    # q/k norms after RoPE, with weights that are not all ones.
    Row("hunyuan_v1_dense", "hunyuan_v1_dense", norms=0.5),
    Row("hunyuan_v1_moe", "hunyuan_v1_moe", {"num_experts": 4, "moe_topk": 2}, norms=0.5, grids=DECODING_GRID),
    # Llama 4: layer 0 chunked (kept whole; chunk 24, the prompt of 40 longer, the answer crossing into the next
    # chunk at 48) with RoPE as complex frequencies on interleaved pairs and an L2 norm after it; layer 1 global and
    # NoPE, its queries scaled by position from position 8 on (attn_temperature_tuning, 8192 in the released models).
    Row(
        "llama4_text",
        "llama4_text",
        {
            "layer_types": ["chunked_attention", "full_attention"],
            "no_rope_layers": [1, 0],
            "attention_chunk_size": 24,
            "floor_scale": 8,
            "attn_scale": 0.5,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size_mlp": 128,
            "pad_token_id": 0,
        },
    ),
    Row(
        "dots1",
        "dots1",
        {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1},
        norms=0.5,
        grids=DECODING_GRID,
    ),
    # Hybrids: recurrent (gated delta rule) layers keep a state, kept whole; the attention layers between them are
    # compressed. Layer 0 recurrent: the attention layers are not the model's first.
    Row(
        "qwen3_next",
        "qwen3_next",
        {
            "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
            **LINEAR_ATTENTION,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    Row(
        "qwen3_5_text",
        "qwen3_5_text",
        {"num_hidden_layers": 4, "layer_types": HYBRID, **LINEAR_ATTENTION},
        grids=DECODING_GRID,
    ),
    Row(
        "olmo_hybrid",
        "olmo_hybrid",
        {"num_hidden_layers": 4, "layer_types": HYBRID, **LINEAR_ATTENTION, **NO_IDS},
        grids=DECODING_GRID,
    ),
    # Short convolution layers (a conv state of the last inputs, no recurrent state).
    Row(
        "lfm2",
        "lfm2",
        {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention"] * 2, "initializer_range": 0.2},
    ),
    # Convolution layers, a global layer (compressed, a proportional RoPE: half its pairs at frequency 0) and a local
    # one (window 32, kept whole; prompt 28 + 24 new tokens cross it).
    Row(
        "lfm3",
        "lfm3",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "sliding_attention"],
            "sliding_window": 32,
            "initializer_range": 0.2,
            **NO_IDS,
        },
        length=28,
    ),
    # Mamba-2 layers (a conv and an SSM state).
    Row("bamba", "bamba", {"num_hidden_layers": 4, "attn_layer_indices": [1, 3], **MAMBA2}),
    Row(
        "granitemoehybrid",
        "granitemoehybrid",
        {
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention"] * 2,  # no RoPE, as Granite-4's released hybrids
            "num_local_experts": 4,
            "shared_intermediate_size": 64,
            **MAMBA2,
        },
        grids=DECODING_GRID,
    ),
    # Mamba (1) layers and attention layers without RoPE.
    Row(
        "jamba",
        "jamba",
        {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 1, "mamba_d_state": 8},
        grids=DECODING_GRID,
    ),
    # Mamba-2, attention (no RoPE, at ``mixer``) and MLP blocks (nothing cached).
    Row(
        "nemotron_h",
        "nemotron_h",
        {
            "num_hidden_layers": 6,
            "layers_block_type": ["mamba", "attention", "mlp"] * 2,
            "ssm_state_size": 16,
            "mamba_num_heads": 4,
            "mamba_head_dim": 32,
            "n_groups": 1,
            "chunk_size": 16,
        },
    ),
    # Mamba-2 and attention side by side in every layer: each layer keeps a state and entries.
    Row("falcon_h1", "falcon_h1", {**MAMBA2, "mamba_d_ssm": 64, "mamba_d_head": 16}),
    # MLA: one latent per token (kv_lora_rank values and the shared rotary key), expanded per head in attention.
    Row("deepseek_v2", "deepseek_v2", {**MLA, "q_lora_rank": None, **MOE_DENSE}),
    Row("deepseek_v3", "deepseek_v3", {**MLA, "q_lora_rank": 24, **MOE_DENSE}, grids=DECODING_GRID),
    Row("glm4_moe_lite", "glm4_moe_lite", {**MLA, "q_lora_rank": 24, **MOE_DENSE}, grids=DECODING_GRID),
    # MLA attention layers (no RoPE) between Kimi delta attention layers (recurrent, kept whole).
    Row(
        "kimi_linear",
        "kimi_linear",
        {
            **MLA,
            "num_hidden_layers": 4,
            "layer_types": HYBRID,
            "mlp_layer_types": ["dense"] * 4,
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            **NO_IDS,
        },
    ),
]


def save(row: Row, folder, tokenizer) -> None:
    """The row's random model (seeded) saved in ``folder`` with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {name: value for name, value in {**TINY, **row.settings}.items() if value is not UNSET}
    config = AutoConfig.for_model(row.model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if row.norms and "norm" in name and weight.dim() == 1:
                weight.add_(row.norms * torch.randn_like(weight))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load(folder):
    """A saved model loaded as a user's folder is: through ``load_model``."""
    from pkvbench.engine.generation import Engine
    from pkvbench.engine.models import load_model

    return Engine(load_model(str(folder), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """Each row's model saved once per module, whether a row or its variants asks first: ``saved(name)``."""
    folders = {}

    def folder_of(name: str):
        if name not in folders:
            row = next(row for row in ROWS if row.name == name)
            folders[name] = tmp_path_factory.mktemp(name)
            save(row, folders[name], tokenizer)
        return folders[name]

    return folder_of


@pytest.fixture(scope="module", params=ROWS, ids=lambda row: row.name)
def family(request, saved):
    row = request.param
    folder = saved(row.name)
    return row, load(folder), folder


def prompt(row: Row) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, row.length), generator=torch.Generator().manual_seed(1))


def check_decoding(engine, row: Row) -> None:
    """The full cache decodes as the stock model's ``generate``; StreamingLLM's as the stock model over the full
    cache with the dropped positions masked (a local layer keeping what its window still sees, the last window − 1
    entries, under its window), and not as the full cache (else the masked check proves nothing)."""
    ids = prompt(row)
    full, streaming = parse_policy("full"), parse_policy("streamingllm")
    prefill = engine.prefill(ids, [full, streaming])

    ours = decode_one(engine, prefill, engine.compress(prefill, full, Budget(row.budget)), row.new_tokens).tokens
    reference = generate_reference(engine.model, ids, row.new_tokens)
    assert ours == reference

    compressed = engine.compress(prefill, streaming, Budget(row.budget))
    streamed = decode_one(engine, prefill, compressed, row.new_tokens).tokens
    visible = torch.zeros(row.length, dtype=torch.bool)
    visible[: streaming.sink] = True
    visible[row.length - (row.budget - streaming.sink) :] = True
    architecture = engine.architecture
    for index, layer in enumerate(architecture.attention_layers):  # a local layer keeps what its window still sees
        kept = row.budget if architecture.compressible(layer) else min(row.length, architecture.window(layer) - 1)
        assert compressed.kept.stored(index) == kept
    assert set(compressed.kept.states) == set(architecture.state_layers)  # a hybrid's recurrent states, kept whole
    whole = tuple(
        {architecture.layer_kinds[i] for i in architecture.attention_layers if not architecture.compressible(i)}
    )
    masked = masked_reference(
        engine.model,
        prefill.keys,
        prefill.values,
        visible,
        prefill.first_token,
        row.new_tokens,
        engine.stop_ids,
        whole,
        prefill.states_at[row.length],
    )
    assert streamed == masked
    assert streamed != reference


def check_statistics(engine, row: Row) -> None:
    """The recorded window sums and accumulated attention equal the stock eager kernel's attention weights (the
    module's own scale, soft-cap and sinks, whatever the family) on every attention layer that computes the prompt
    whole; the queries Expected Attention un-rotates equal the queries the model's own kernel gets when its rotary
    embedding turns nothing (each attention module called again on its own input, cos 1 and sin 0): a partial RoPE's
    pass-through dimensions, a NoPE layer or model (un-rotated by the identity) and a norm after RoPE (Hunyuan)
    included. An MLA model's queries are not un-rotated (Expected Attention, their one reader, is refused there)."""
    from pkvbench.engine.attention import StatsRecorder, unrotate
    from pkvbench.engine.exactness import stock_attention
    from pkvbench.policies.base import Needs

    ids = prompt(row)
    needs = Needs(windows=frozenset({8}), accumulated=True, queries=frozenset({row.length}))
    recorder = StatsRecorder(needs, engine.softmaxes, rope=engine.rope, rotation=engine.rotation)
    engine.recorded_forward(ids, recorder)
    modules = engine.architecture.attention_modules(engine.model)
    inputs = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda module, args, kwargs: inputs.setdefault(module.layer_idx, (args, kwargs)), with_kwargs=True
        )
        for module in modules
    ]
    try:
        with stock_attention(engine.model, "eager"), torch.inference_mode():
            weights = engine.model(ids, output_attentions=True, use_cache=False).attentions
    finally:
        for hook in hooks:
            hook.remove()
    layers = engine.architecture.attention_layers
    assert len(weights) == len(layers)  # of the attention layers, in depth order
    unturned = {} if engine.latent else queries_unturned(modules, inputs, engine.softmaxes)
    for layer, attention in zip(layers, weights):
        stats = recorder.layers[row.length, layer]
        window = engine.architecture.prompt_windows[layer]
        if window is None or window >= row.length:  # a local or chunked layer past its reach: never scored
            torch.testing.assert_close(stats.window_scores[8], attention[0, :, -8:].sum(1), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(stats.accumulated, attention[0].sum(1), atol=1e-4, rtol=1e-4)
        if not engine.latent:
            cos, sin = engine.rope(0, row.length, layer)  # each layer's own (Gemma 3's local and global differ)
            plain = unrotate(stats.recent_queries, cos, sin, engine.rotation.interleaved, engine.rotation.scale(layer))
            torch.testing.assert_close(plain, unturned[layer], atol=1e-5, rtol=1e-4)


def queries_unturned(modules, inputs: dict, softmaxes) -> dict:
    """Each attention module called again on its input (``inputs``: layer → its call's args and kwargs) with the
    rotary embedding replaced by the identity (a module given none keeps none): the queries its kernel then gets,
    per layer ``[Hq, T, d]``."""
    from pkvbench.engine.attention import Recorder, recording

    class Queries(Recorder):
        def __init__(self):
            self.softmaxes, self.seen = softmaxes, {}

        def observe(self, layer_idx, query, key, logsumexp=None):
            self.seen[layer_idx] = query[0].float().clone()

    def identity(embedding):
        if embedding is None:  # no RoPE (Jamba, Nemotron-H)
            return None
        if isinstance(embedding, tuple):  # cos, sin
            return torch.ones_like(embedding[0]), torch.zeros_like(embedding[1])
        return torch.ones_like(embedding)  # complex frequencies (Llama 4)

    queries = Queries()
    with recording(queries), torch.inference_mode():
        for module in modules:
            args, kwargs = inputs[module.layer_idx]
            if "position_embeddings" in kwargs:
                kwargs = {**kwargs, "position_embeddings": identity(kwargs["position_embeddings"])}
            module(*args, **kwargs)
    return queries.seen


def test_full_cache_and_streamingllm_decode_as_the_stock_model(family):
    row, engine, _ = family
    check_decoding(engine, row)


def test_statistics_are_the_models_attention_and_queries_unrotate_to_its_own(family):
    row, engine, _ = family
    check_statistics(engine, row)


# --- variants: each row's model (its weights) under other configurations of its family -----------------------------

# Phi-3.5-mini's longrope, scaled down: short factors up to 128 tokens, long ones past (half the head rotates).
LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 128,
        "long_factor": [1.0, 2.0, 4.0, 8.0],
        "short_factor": [1.0, 1.0, 1.5, 2.0],
    },
    "original_max_position_embeddings": 128,
}


# Phi-3.5-MoE's longrope (its short and long mscale), scaled down
PHIMOE_LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 128,
        "long_factor": [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0],
        "short_factor": [1.0, 1.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0],
        "short_mscale": 1.2,
        "long_mscale": 1.3,
    },
    "original_max_position_embeddings": 128,
}
# DeepSeek-V3's released YaRN, scaled down: its mscale_all_dim scales the softmax (by mscale², read from the call)
DEEPSEEK_YARN = {
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 32,
    }
}


@dataclass(frozen=True)
class Variant:
    """A row's model under another config of its family (the same weights: ``saved`` once, linked): windows above,
    across and below the prompt, keys of other families the model ignores, the RoPE scalings its released checkpoints
    use. ``windows``: each layer's window as the model applies it while it generates (None: full attention) — what
    the engine must read from the model, whatever the keys say: its masks, or its cache where that keeps fewer
    entries (a Llama with a stray ``sliding_window``: ``generate``'s cache slides, its masks do not)."""

    row: str
    name: str
    settings: dict
    windows: tuple
    length: int | None = None  # prompt tokens (None: the row's)
    statistics: bool = True  # False: every layer computes the prompt under a window it is longer than (refused)

    @property
    def checked(self) -> Row:
        row = next(row for row in ROWS if row.name == self.row)
        return Row(f"{row.name}-{self.name}", row.model_type, row.settings, self.length or row.length)


VARIANTS = [
    # keys of other families: the masks ignore them (no window on the prompt, no soft-cap), the cache does not
    Variant("llama", "stray-window", {"sliding_window": 16, "use_sliding_window": True}, (16, 16)),
    Variant("olmo2", "stray-window", {"sliding_window": 16}, (16, 16)),
    Variant("cohere", "stray-window", {"sliding_window": 16}, (16, 16)),
    Variant("qwen3_moe", "stray-window-off", {"sliding_window": 16, "use_sliding_window": False}, (None, None)),
    Variant("granite", "stray-softcap", {"attn_logit_softcapping": 2.0}, (None, None)),
    # Qwen's use_sliding_window on families that slide on sliding_window alone, or on layer_types
    Variant("mistral-window", "stray-window-off", {"use_sliding_window": False}, (128, 128)),
    Variant("phi3", "stray-window-off", {"sliding_window": 48, "use_sliding_window": False}, (48, 48)),
    Variant("gemma3_text", "stray-window-off", {"use_sliding_window": False}, (64, None)),
    # windows above, across and below the prompt
    Variant("mistral-window", "window-above", {"sliding_window": 4096}, (4096, 4096)),
    Variant("starcoder2", "window-across", {"sliding_window": 48}, (48, 48)),
    Variant("starcoder2", "window-below", {"sliding_window": 16}, (16, 16), statistics=False),
    Variant("mistral-window", "window-below", {"sliding_window": 32}, (32, 32), statistics=False),
    Variant("qwen3-window", "window-below", {"sliding_window": 32}, (32, 32), statistics=False),
    Variant("qwen2-mixed", "window-below", {"sliding_window": 32}, (None, 32)),
    Variant("gemma2", "window-below", {"sliding_window": 16}, (16, None)),
    Variant("gemma3_text", "window-below", {"sliding_window": 16}, (16, None)),
    Variant("gpt_oss", "window-below", {"sliding_window": 8}, (8, None)),
    Variant("gemma4_text", "window-below", {"sliding_window": 16}, (16, None)),
    # the RoPE scalings of released checkpoints (gpt-oss's row is already YaRN: its config's default)
    Variant(
        "llama",
        "llama3-rope",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        (None, None),
    ),
    Variant(
        "qwen3-window",
        "yarn",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        (128, 128),
    ),
    Variant(
        "gemma3_text",
        "linear-rope",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            }
        },
        (64, None),
    ),
    Variant("phi3", "longrope-past-the-switch", LONGROPE, (None, None), length=140),
    # hybrids and MLA: stray keys, windows below the prompt, the RoPE scalings of their released checkpoints
    Variant("qwen3_next", "stray-window", {"sliding_window": 16, "use_sliding_window": True}, (None, None, None, None)),
    Variant("jamba", "stray-window", {"sliding_window": 16}, (None, None, None, None)),
    Variant("lfm3", "window-below", {"sliding_window": 16}, (None, None, None, 16)),
    Variant(
        "qwen3_5_text",
        "yarn",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
        (None, None, None, None),
    ),
    Variant("apertus", "stray-window", {"sliding_window": 16}, (16, 16)),
    Variant("granitemoehybrid", "stray-window", {"sliding_window": 16}, (None,) * 4),
    Variant("nemotron_h", "stray-window", {"sliding_window": 16}, (None,) * 6),
    Variant("kimi_linear", "stray-window", {"sliding_window": 16}, (None,) * 4),
    # MLA under DeepSeek-V3's released YaRN
    Variant("deepseek_v2", "yarn-mscale", DEEPSEEK_YARN, (None, None)),
    Variant("glm4_moe_lite", "yarn-mscale", DEEPSEEK_YARN, (None, None)),
    Variant("deepseek_v3", "yarn-mscale", DEEPSEEK_YARN, (None, None)),
]


def variant_folder(folder, settings: dict, target):
    """``folder``'s model (its files linked) under its config updated with ``settings``."""
    import json

    target.mkdir()
    for file in folder.iterdir():
        if file.name != "config.json":
            (target / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **settings}))
    return target


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v.row}-{v.name}")
def test_a_variant_is_read_from_the_model_and_decodes_as_it(variant, saved, tmp_path):
    """Each layer's window as the model's own masks apply it (not as a stray key says), then the checks of the rows:
    the full cache as ``generate``, StreamingLLM as the masked stock model, the statistics as the eager kernel's
    weights — where the prompt is longer than an all-sliding model's window, the statistics are refused instead."""
    from pkvbench.errors import PkvError
    from pkvbench.policies.base import Needs

    engine = load(variant_folder(saved(variant.row), variant.settings, tmp_path / "model"))
    row = variant.checked
    assert engine.architecture.windows == variant.windows
    check_decoding(engine, row)
    if variant.statistics:
        check_statistics(engine, row)
        return
    from pkvbench.engine.attention import StatsRecorder

    with pytest.raises(PkvError, match="exceeds the sliding window"):
        engine.recorded_forward(prompt(row), StatsRecorder(Needs(accumulated=True), engine.softmaxes))


# Families whose config reads YaRN as another scaling: their own scaling's variants above prove them.
RESCALED_OTHERWISE = {
    "phi3": "Phi-3's config reads YaRN as longrope (its longrope variants above)",
    "phimoe": "PhiMoE's config takes a scaled RoPE as its longrope (short_mscale and long_mscale)",
}


def yarn_scaled(rope: dict) -> dict:
    """``rope`` (a config's ``rope_parameters``: one dict, or one per layer type) under YaRN, as long-context
    releases ship it: its own base and partial rotation kept, the frequencies interpolated by 4 and every cos and sin
    scaled by YaRN's attention factor."""
    if "rope_type" not in rope:  # per layer type (Gemma 3 and 4)
        return {kind: yarn_scaled(parameters) for kind, parameters in rope.items()}
    if rope["rope_type"] != "default":  # a proportional RoPE (LFM3, Gemma 4's global layers) has no YaRN form
        return rope
    return {**rope, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_each_row_under_yarn_reads_its_rope_from_the_model_and_decodes_as_it(family, tmp_path):
    """Every row's model (its weights) under YaRN over its own RoPE: the windows are the row's, and the checks of the
    rows hold — the un-rotated queries included, whose tables now carry YaRN's interpolated frequencies and scale. A
    row whose model has no RoPE has nothing to scale."""
    import json

    row, engine, folder = family
    rope = json.loads((folder / "config.json").read_text()).get("rope_parameters")
    if engine.latent:
        pytest.skip(f"{row.name}: MLA, whose queries nothing un-rotates (DeepSeek-V3's YaRN variant above)")
    if not rope or not any(engine.rotation.rotates):
        pytest.skip(f"{row.name} has no RoPE")
    if row.model_type in RESCALED_OTHERWISE:
        pytest.skip(RESCALED_OTHERWISE[row.model_type])
    settings = {"rope_parameters": yarn_scaled(rope)}
    if settings["rope_parameters"] == rope:
        pytest.skip(f"{row.name}'s RoPE is {rope.get('rope_type')}, its row's own, not the default YaRN scales")
    if any(scale is not None for scale in engine.rotation.scales):
        # A norm after RoPE (Hunyuan, Llama 4) takes YaRN's factor a out of the queries, but not out of its ε:
        # un-rotated, they are off by about ε(1 − 1/a²) / (2 · mean q²) (1e-4 here), which no rotation restores.
        # With ε → 0 the rotation itself is checked exactly.
        settings["rms_norm_eps"] = 1e-30
    variant = load(variant_folder(folder, settings, tmp_path / "model"))
    assert variant.architecture.windows == engine.architecture.windows
    check_decoding(variant, row)
    check_statistics(variant, row)


def refuse_loading(monkeypatch) -> None:
    """Make loading weights fail loudly: a refusal that comes first is one that came before loading."""
    import transformers

    def loading(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)


@pytest.mark.parametrize(
    "row,settings,grid,reason",
    [
        (
            "gemma3_text",
            {"use_bidirectional_attention": True},
            [],
            "layer 0 attends to later tokens (not causal, e.g. use_bidirectional_attention)",
        ),
        (
            "qwen2-mixed",
            {
                "use_sliding_window": False,
                "sliding_window": None,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            [],
            "layer 1 is a sliding_attention layer, but the config gives no sliding_window",
        ),
        (
            "qwen2-mixed",
            {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1},
            [],
            "layer 1 is a sliding_attention layer, but the config gives no sliding_window",
        ),
        (
            "phi3",
            LONGROPE,
            ["--max-new-tokens", "64"],  # a prompt of about 100 tokens and its answer cross 128
            "switches its RoPE tables past 128 tokens (longrope): a prompt of",
        ),
        (
            "mistral-window",
            {"sliding_window": 32},
            ["--policy", "full,snapkv"],
            "snapkv scores from the prompt's attention, which pkvbench computes as if every query saw the whole prompt",
        ),
        (
            "phimoe",
            PHIMOE_LONGROPE,
            [],
            "its code branches on a tensor's value while it runs (PhiMoE's longrope",
        ),
    ],
    ids=[
        "bidirectional",
        "qwen2-layer-types-no-window",
        "qwen2-window-layers-no-window",
        "longrope-across",
        "sliding-snapkv",
        "phimoe-longrope",
    ],
)
def test_a_variant_pkvbench_cannot_run_exactly_is_refused_in_one_line_before_loading(
    row, settings, grid, reason, saved, tmp_path, monkeypatch, capsys
):
    from pkvbench.cli import main

    folder = variant_folder(saved(row), settings, tmp_path / "model")
    capsys.readouterr()  # what saving the row's model printed, where this test saves it first
    refuse_loading(monkeypatch)
    args = ["run", "--model", str(folder), "--task", "needle", "--lengths", "100", "--depths", "50", "--quiet"]
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *args,
                "--out",
                str(tmp_path / "run"),
                *(grid if "--max-new-tokens" in grid else [*grid, "--max-new-tokens", "5"]),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and reason in err and len(err.strip().splitlines()) == 1, err


def test_past_an_all_sliding_window_the_policies_that_score_without_attention_run(saved, tmp_path, capsys):
    """A prompt longer than the window of every layer: full and StreamingLLM (exact there, ``VARIANTS``) and the
    policies that score from keys or queries run; only those that score from the prompt's attention are refused."""
    from pkvbench.cli import main

    folder = variant_folder(saved("mistral-window"), {"sliding_window": 32}, tmp_path / "model")
    args = ["run", "--model", str(folder), "--task", "needle", "--lengths", "100", "--depths", "50", "--quiet"]
    policies = "full,streamingllm,knorm,expected_attention"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--max-new-tokens", "5", "--policy", policies, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 0, capsys.readouterr().err


def test_a_batch_of_policies_decodes_as_each_alone(family):
    """Caches of several policies, some of them cut again while the answer is written (``--decode-budget``;
    ``Row.batch``), and, where the model keeps states, two of another prompt's prefill (a hybrid's rows each carry
    their own prefill's states)."""
    row, engine, _ = family
    ids = prompt(row)
    policies, cut = ([parse_policy(name) for name in names] for names in row.batch)
    prefill = engine.prefill(ids, policies, decoding=cut)
    sources = [(prefill, policy) for policy in policies]
    if engine.architecture.state_layers:  # the full cache and one compressed, of another prompt
        other_ids = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(2))
        others = [parse_policy("full"), parse_policy("snapkv")]
        other = engine.prefill(other_ids, others)
        sources += [(other, policy) for policy in others]
    requests = [
        engine.request(source, engine.compress(source, policy, Budget(row.budget)), row.new_tokens)
        for source, policy in sources
    ]
    requests += [
        engine.request(
            prefill,
            engine.compress(prefill, policy, Budget(2 * row.budget)),
            row.new_tokens,
            schedule=engine.schedule(policy, row.budget, 4, 4),
        )
        for policy in cut
    ]
    alone = engine.decode_many(requests, 1)
    together = engine.decode_many(requests)
    assert [d.tokens for d in together] == [d.tokens for d in alone]


def test_a_question_fed_after_compression_decodes_as_the_stock_model(family):
    """The full cache of the context (the prompt's first tokens), the question fed on top of it, decodes as the
    stock model's ``generate`` on the whole prompt: a hybrid's states are the context's own, not the prompt's."""
    row, engine, _ = family
    ids = prompt(row)
    context = row.length - 8
    prefill = engine.prefill(ids, [parse_policy("full")], cuts=(context, row.length))
    cache = engine.compress(prefill, parse_policy("full"), Budget(row.budget), cut=context)
    request = engine.request(prefill, cache, row.new_tokens, question=ids[0, context:].tolist())
    assert engine.decode_many([request])[0].tokens == generate_reference(engine.model, ids, row.new_tokens)


def test_the_cache_is_measured_off_the_model_and_its_state_counted(family):
    """The cache's shape read before the model loads (the probe's, on the meta device: each attention layer's heads
    and sizes, a latent's one head) is what a prefill of the loaded model fills; a state's bytes are known once it
    has loaded, and every compressed cache's bytes hold its states."""
    from pkvbench.engine.models import model_shape
    from pkvbench.engine.recurrent import state_bytes

    row, engine, folder = family
    forecast = model_shape(str(folder), 32)
    ids = prompt(row)
    prefill = engine.prefill(ids, [parse_policy("streamingllm")])
    filled = [(keys.shape[1], keys.shape[-1], values.shape[-1]) for keys, values in zip(prefill.keys, prefill.values)]
    assert [(layer.heads, layer.key_dim, layer.value_dim) for layer in forecast.geometry.layers] == filled
    assert forecast.geometry.local == engine.geometry.local and forecast.latent == engine.latent
    states = prefill.states_at[row.length]
    assert state_bytes(states) == engine.geometry.state_bytes
    assert (forecast.geometry.state_bytes is None) == bool(engine.architecture.state_layers)
    cache = engine.compress(prefill, parse_policy("streamingllm"), Budget(row.budget))
    entries = sum(t.nbytes for t in (*cache.kept.keys, *cache.kept.values))
    assert cache.nbytes == entries + state_bytes(states)


@pytest.mark.parametrize("kind", ["sliding_attention", "chunked_attention"], ids=["sliding", "chunked"])
@pytest.mark.parametrize("storage", ["ragged", "stored"])
def test_a_sliding_layer_hides_exactly_the_entries_older_than_its_window(storage, kind):
    """Rows of kept entries at scattered original positions (each head its own), one new token at position 60 with a
    window of 32: every row and head sees its kept entries at positions 29 … 59 and the new token, nothing else —
    kept in the model's dtype, or packed in 4 bits (then the window reaches into the packed part and the residual).
    A chunked layer of chunk 32: positions 32 … 59 (the new token's chunk) and the new token."""
    from pkvbench.cell.kv_formats import KVFormat, LayerShape
    from pkvbench.engine.architecture import Architecture
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
    architecture = Architecture(
        "test", (kind,), (window,), query_heads=heads, cache_shapes=(LayerShape(heads, dim, dim, window - 1),)
    )
    layer = build_cache(requests, room=4, architecture=architecture).layers[0]
    layer.update(torch.randn(2, heads, 1, dim), torch.randn(2, heads, 1, dim))
    mask = layer.attention_mask()
    if storage == "stored":  # the packed columns' positions, then the residual's
        columns = torch.cat([layer.packed_positions, layer.residual.positions], dim=-1)
    else:
        columns = layer.positions
    for row, positions in enumerate(kept_positions):
        for head in range(heads):
            seen = sorted(columns[row, head][mask[row, min(head, mask.shape[1] - 1), 0]].tolist())
            oldest = start - start % window if kind == "chunked_attention" else start - window + 1
            expected = sorted(p for p in positions[head].tolist() if p >= oldest) + [start]
            assert seen == expected


def test_decode_time_statistics_soft_cap_their_logits_as_the_models_eager_kernel():
    """While the answer is written (``--decode-budget``) a cut scores from the latest queries' attention and H2O's
    running sums: with soft-capped logits (Gemma 2) both equal the weights of Gemma 2's own eager kernel."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from pkvbench.engine.architecture import LayerSoftmax
    from pkvbench.engine.shrinking import ShrinkingLayer
    from pkvbench.policies.base import Needs

    heads, group, dim, count, window, scaling, softcap = 2, 2, 16, 12, 4, 0.5, 2.0
    generator = torch.Generator().manual_seed(5)

    def draw(*shape):  # logits of ±10 and more: the cap bends them
        return 2 * torch.randn(*shape, generator=generator)

    keys, positions = draw(1, heads, count, dim), torch.arange(count).expand(1, heads, count).clone()
    layer = ShrinkingLayer(
        keys,
        keys.clone(),
        torch.full((1, heads), count),
        2,
        heads,
        positions,
        queries=draw(1, heads * group, window, dim),
        query_counts=torch.tensor([window]),
        accumulated=torch.zeros(1, heads * group, count),
        start=count,
    )
    new_key, query = draw(1, heads, 1, dim), draw(1, heads * group, 1, dim)
    layer.update(new_key, new_key.clone())
    layer.observe(query, LayerSoftmax(scaling, softcap))
    module = SimpleNamespace(num_key_value_groups=group, training=False)
    _, weights = eager_attention_forward(
        module, query, layer.keys, layer.values, None, scaling=scaling, softcap=softcap
    )
    torch.testing.assert_close(layer._accumulated[0, :, : count + 1], weights[0, :, 0])

    softmax = LayerSoftmax(scaling, softcap)
    stats = layer.row_stats(0, 0, Needs(windows=frozenset({window})), softmax, count + 1, heads * group)
    latest = layer._queries  # the window's queries, the new one last, at positions count + 1 - window … count
    entries, rows = torch.arange(count + 1), torch.arange(count + 1 - window, count + 1)
    causal = torch.zeros(window, count + 1).masked_fill_(entries[None] > rows[:, None], torch.finfo(torch.float32).min)
    _, weights = eager_attention_forward(
        module, latest, layer.keys, layer.values, causal, scaling=scaling, softcap=softcap
    )
    torch.testing.assert_close(stats.window_scores[window], weights[0].sum(1))


EVERY_POLICY = "full,streamingllm,h2o,snapkv,pyramidkv,random,knorm,keydiff,tova,rkv,expected_attention,kvzip,adakv(snapkv),chunkkv(snapkv)"
# One policy of each kind of decode-time statistic: none, accumulated, a window's, R-KV's queries, query moments.
CUT_WHILE_DECODING = "streamingllm,h2o,snapkv,rkv,expected_attention"


GRIDS = {
    # 0.6 of the full cache: above a mixed model's floor (its local layer, half of qwen2-mixed's, is kept whole)
    "memory-bits": ["--policy", EVERY_POLICY, "--memory", "0.6", "--kv-bits", "16,4", "--kv-group", "16"],
    "decode-budget": ["--policy", CUT_WHILE_DECODING, "--budget", "32", "--decode-budget", "24"]
    + ["--decode-interval", "4"],
}


def test_the_cli_runs_its_grids_on_the_family(family, tmp_path, capsys):
    """The user's path: ``pkvbench run --model FOLDER`` over every policy, at a memory budget in 16 and 4 bits, and
    cutting the cache while the answer is written (the row's ``grids``)."""
    from pkvbench.cli import main

    row, engine, folder = family
    args = ["run", "--model", str(folder), "--task", "needle", "--lengths", "100", "--depths", "50"]
    for grid in row.grids:
        options = GRIDS[grid]
        if engine.latent:  # an MLA model refuses the policies that read per-head keys or values (tested below)
            at = options.index("--policy") + 1
            runnable = ",".join(p for p in options[at].split(",") if not latent_refusal(parse_policy(p)))
            options = [*options[:at], runnable, *options[at + 1 :]]
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--max-new-tokens", "5", "--quiet", "--out", str(tmp_path / grid), *options])
        assert exit_info.value.code == 0, f"{grid}: {capsys.readouterr().err}"
        assert (tmp_path / grid / "summary.csv").is_file()


def test_a_statistic_beyond_the_machines_memory_is_one_line_naming_the_length():
    from pkvbench.engine.generation import too_big_for_memory
    from pkvbench.errors import PkvError

    failure = "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate"
    expected = "rkv's scores on a prompt of 32768 tokens need more memory than is free"
    with pytest.raises(PkvError, match=expected), too_big_for_memory("rkv's scores", 32768):
        raise RuntimeError(failure)
    # any other error stays what it is
    with pytest.raises(RuntimeError, match="shape mismatch"), too_big_for_memory("rkv's scores", 32768):
        raise RuntimeError("shape mismatch")


@pytest.mark.parametrize(
    "config,reason",
    [
        ({"model_type": "deepseek_v32"}, "'deepseek_v32' model, not supported: a learned indexer picks the keys"),
        ({"model_type": "zamba2"}, "'zamba2' model, not supported: one attention module serves several layers"),
        ({"model_type": "falcon"}, "'falcon' model; supported architectures: llama, mistral, qwen2, qwen3"),
        (
            {
                "model_type": "gemma4_text",
                **TINY,
                "num_hidden_layers": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "sliding_window": 16,
                "num_kv_shared_layers": 2,
                "hidden_size_per_layer_input": 0,
            },
            "layer 2 attends over a cache another layer writes (num_kv_shared_layers)",
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]},
            "has linear_attention layers",
        ),
    ],
    ids=["indexed-attention", "shared-attention", "unknown-family", "shared-caches", "linear-attention"],
)
def test_a_family_pkvbench_cannot_run_is_refused_in_one_line_before_the_model_loads(config, reason, tmp_path, capsys):
    """A folder holding only a config (no weights, no tokenizer): the refusal comes from the config alone."""
    import json

    from pkvbench.cli import main

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--model", str(tmp_path), "--out", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and reason in err and len(err.strip().splitlines()) == 1, err


def test_pkvbench_list_shows_every_family_its_layer_kinds_and_what_is_refused(capsys):
    """Every family of the seam's table, admitted or refused, with its layer kinds, in ``pkvbench list`` and in
    docs/models.md's matrix; each admitted family has its row in this matrix (a family is admitted only with one)."""
    import re
    from pathlib import Path

    from pkvbench.cli import main
    from pkvbench.engine.architecture import FAMILIES

    with pytest.raises(SystemExit) as exit_info:
        main(["list"])
    assert exit_info.value.code == 0
    listed = capsys.readouterr().out
    for name, family in FAMILIES.items():
        assert f"  {name} " in listed and f"layers: {family.layers}" in listed
        assert (family.handled if family.admitted else f"refused: {family.refused}") in listed
    assert {name for name, family in FAMILIES.items() if family.admitted} == {row.model_type for row in ROWS}
    docs = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    matrix = docs[docs.index("## The matrix") :].split("\n## ")[0]
    documented = {name for line in matrix.splitlines() for name in re.findall(r"`(\w+)`", line.split(" | ")[0])}
    assert set(FAMILIES) <= documented, set(FAMILIES) - documented


def test_an_mla_model_refuses_a_policy_that_reads_per_head_keys_in_one_line_before_it_loads(
    tmp_path, capsys, tokenizer
):
    """A folder with an MLA config and a tokenizer, no weights: ``--policy knorm`` (norms of per-head keys, which a
    latent cache has not) is refused from the config, before the model would load."""
    from transformers import AutoConfig

    from pkvbench.cli import main

    AutoConfig.for_model("deepseek_v3", vocab_size=VOCAB).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["run", "--model", str(tmp_path), "--task", "needle", "--lengths", "100", "--depths", "50"]
            + ["--policy", "snapkv,knorm", "--out", str(tmp_path / "run"), "--quiet"]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "caches an MLA latent: knorm reads the cached keys or values themselves" in err
