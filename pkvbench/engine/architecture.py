"""What pkvbench must know of a model's architecture: the seam between the engine and the model families.

Each layer's behaviour is read from the model's own code (``engine/probe.py``), never from a config key the model
may ignore or read differently: its window and whether it is causal from the mask the model builds for it, its scale,
soft-cap and sinks from what its attention module passes its kernel, RoPE's pairing from ``apply_rotary_pos_emb``,
RoPE's switches from the rotary embedding. Before the weights load this runs on a model built on the ``meta``
device (``Architecture.read``), so a configuration the model cannot compute, or pkvbench cannot run exactly, is
refused in one line first; once loaded, on the model itself (``Architecture.of_model``).

Per layer, its attention kind: ``full_attention``, or ``sliding_attention`` (the token at position p sees positions
p − window + 1 … p). How the engine treats them:

- a model whose every layer slides (Mistral-7B-v0.1; Qwen2/Qwen3 with ``use_sliding_window`` and
  ``max_window_layers`` 0) is compressed as any other; the window is applied while decoding (``sliding``); a prompt
  longer than the window is run only by policies that score without the prompt's attention (``check_prompt``);
- in a model that mixes local (sliding) and global layers, a policy compresses the global layers; each local layer
  keeps what its window can still see — the prompt's last window − 1 entries, as transformers' sliding cache layer
  keeps them — counted in the row's entries and bytes, and decodes under its window;
- ``chunked_attention`` (Llama 4): the token at position p sees its chunk only, positions p − p mod chunk … p, as
  the model's mask says. A chunked layer is a local layer: never compressed by a policy, it keeps the prompt's last
  chunk − 1 entries (all its chunk can still see; transformers' cache keeps as many) and decodes under its chunk.

Which layers rotate is read the same way: a layer whose attention never calls the model's rotary function is NoPE
(SmolLM3's ``no_rope_layers``, Exaone 4's global layers, Llama 4's every 4th), whatever its config says.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from pkvbench.cell.kv_formats import LayerShape
from pkvbench.engine.probe import LayerSoftmax, Rotation
from pkvbench.errors import PkvError, first_line

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)
# Layer kinds of transformers' ``cache_utils`` that keep a fixed-size state per sequence, not per-token keys and
# values (``engine/recurrent.py``): the state alone; the state beside an attention layer's entries (Falcon-H1's
# layers run both), as which attention kind; nothing cached at all (Nemotron-H's MLP blocks).
STATE_KINDS = ("linear_attention", "conv")
HYBRID_KINDS = {"hybrid": FULL, "hybrid_sliding": SLIDING}
HYBRID_OF = {attention: kind for kind, attention in HYBRID_KINDS.items()}
NO_CACHE_KINDS = ("mlp", "moe", "dummy")


@dataclass(frozen=True)
class Family:
    """A ``config.model_type``: what is special about it and how pkvbench handles it (docs/models.md's matrix), or
    why it is refused. A family is admitted only with its row in ``tests/test_architectures.py``."""

    special: str
    handled: str
    refused: str = ""  # the reason, in one line, where pkvbench does not run it
    layers: str = "full"  # the layer kinds its configs declare (``pkvbench list``)
    kinds: tuple[str, ...] = ATTENTION_KINDS  # the ``layer_types`` pkvbench runs in it (any other is refused)

    @property
    def admitted(self) -> bool:
        return not self.refused


HALF_ROPE = "RoPE over the whole head (rotate-half)"
EVERY_LAYER_SLIDES = "full, or sliding on every layer (sliding_window)"
WINDOW_LAYERS = "full, or sliding from max_window_layers on (use_sliding_window)"
LOCAL_AND_GLOBAL = "local (sliding: its window's entries kept) and global (full) per layer_types"
LATENT_LAYERS = "full (an MLA latent per token: one cache head)"
INDEXED = (
    "a learned indexer picks the keys each query reads (indexed attention): a compression of its own, whose index "
    "cache a policy would have to keep in step"
)
SHARED = (
    "one attention module serves several layers (its layer_idx is -1), so an attention call cannot tell whose cache "
    "it reads"
)
NO_ROW = "not proven yet: no row in tests/test_architectures.py (one row away: its layers are an admitted family's)"
COMPRESSES_ITSELF = "its attention compresses its own cache (built-in compressed attention): nothing left to compare"
OWN_CACHE = "it keeps a cache class of its own (MiniMaxCache) and refuses any other, a compressed one included"
TWO_ATTENTIONS = "two attention modules per decoder layer: its cache holds two layers' entries per layer"
MLA_HANDLED = (
    "a layer's cache is one latent head: positions of the latent kept, statistics of the expanded heads folded to "
    "it; the policies that read cached keys or values themselves (marked MLA: refused above) and gqa=query refused"
)
# A hybrid's recurrent layers and attention layers: what its configs declare and what pkvbench runs of them.
RECURRENT_LAYERS = {
    "layers": "linear_attention (a recurrent state, kept whole) and full_attention, per layer_types",
    "kinds": (FULL, "linear_attention"),
}
MAMBA_LAYERS = {
    "layers": "linear_attention (Mamba: a convolution and an SSM state, kept whole) and full_attention",
    "kinds": (FULL, "linear_attention"),
}
FAMILIES: dict[str, Family] = {
    "llama": Family(HALF_ROPE + "; Llama 3.1 and YaRN scaling", "the reference layout"),
    "mistral": Family(
        "a sliding window on every layer (Mistral-7B-v0.1)",
        "compressed as any model; the window applied while decoding; past the window, only the policies that score "
        "without the prompt's attention",
        layers=EVERY_LAYER_SLIDES,
    ),
    "qwen2": Family(
        "a sliding window on the layers from max_window_layers on, where use_sliding_window",
        "every layer sliding: as mistral; some: the local layers keep what their window sees",
        layers=WINDOW_LAYERS,
    ),
    "qwen3": Family("q/k norms; an optional sliding window as qwen2", "as qwen2", layers=WINDOW_LAYERS),
    "qwen3_moe": Family("mixture-of-experts MLP; q/k norms", "attention as qwen3", layers=WINDOW_LAYERS),
    "phi3": Family(
        "fused qkv projection; partial RoPE (partial_rotary_factor); longrope's tables switch past "
        "original_max_position_embeddings (Phi-3.5, Phi-4-mini)",
        "RoPE un-rotated over its width; a prompt at or below the switch whose answer crosses it refused",
        layers=EVERY_LAYER_SLIDES,
    ),
    "olmo2": Family("q/k norms over all heads, after the projection", "attention as llama"),
    "starcoder2": Family(
        "projection biases; an optional sliding window", "as mistral where it slides", layers=EVERY_LAYER_SLIDES
    ),
    "granite": Family("attention, residual and logit multipliers", "the module's own scaling"),
    "gemma2": Family(
        "soft-capped attention logits (attn_logit_softcapping); query_pre_attn_scalar; local and global layers",
        "statistics soft-cap the logits as the model does; the eager kernel (sdpa cannot soft-cap); local layers keep "
        "what their window sees",
        layers=LOCAL_AND_GLOBAL,
    ),
    "gemma3_text": Family(
        "per-layer RoPE (local layers at rope_local_base_freq); q/k norms; local and global layers",
        "each layer's own RoPE (un-rotation, decode-time rotation); local layers keep what their window sees",
        layers=LOCAL_AND_GLOBAL,
    ),
    "gpt_oss": Family(
        "attention sinks in the softmax; RoPE tables of one entry per pair; mixture-of-experts MLP; no sdpa kernel; "
        "local and global layers",
        "sinks in every statistic's denominator; eager kernel; RoPE as read from the model; local layers keep what "
        "their window sees",
        layers=LOCAL_AND_GLOBAL,
    ),
    "cohere": Family(
        "interleaved RoPE (pairs 2i, 2i + 1); q/k layer norms; a logit scale; attention and MLP in parallel",
        "RoPE's pairing read from the model's own apply_rotary_pos_emb; un-rotated as it pairs",
    ),
    "mixtral": Family(
        "mixture-of-experts MLP; an optional sliding window on every layer",
        "attention as mistral",
        layers=EVERY_LAYER_SLIDES,
    ),
    "qwen2_moe": Family(
        "mixture-of-experts MLP with a shared expert; q/k/v biases; the optional window as qwen2",
        "attention as qwen2",
        layers=WINDOW_LAYERS,
    ),
    "ministral": Family(
        "sliding layers per layer_types (every layer by default)",
        "every layer sliding: as mistral; some: the local layers keep what their window sees",
        layers="sliding on every layer, or " + LOCAL_AND_GLOBAL,
    ),
    "olmo3": Family(
        "q/k norms over all heads; local and global layers, a RoPE per layer kind",
        "each layer's own RoPE; local layers keep what their window sees",
        layers=LOCAL_AND_GLOBAL,
    ),
    "seed_oss": Family("q/k/v biases", "attention as llama"),
    "apertus": Family("q/k norms; Llama 3.1 RoPE scaling; xIELU MLP", "attention as llama"),
    "arcee": Family("an ungated ReLU² MLP", "attention as llama"),
    "granitemoe": Family("mixture-of-experts MLP; granite's multipliers", "the module's own scaling"),
    "phimoe": Family(
        "mixture-of-experts MLP; q/k/v biases; an optional sliding window on every layer",
        "attention as mistral",
        layers=EVERY_LAYER_SLIDES,
    ),
    "vaultgemma": Family(
        "Gemma 2's attention (soft-capped logits, query_pre_attn_scalar) without its post-norms; local and global "
        "layers",
        "as gemma2",
        layers=LOCAL_AND_GLOBAL,
    ),
    "internlm3": Family("optional projection biases; loaded as llama", "as llama"),
    "smollm3": Family(
        "NoPE layers (no_rope_layers: every 4th layer skips RoPE)",
        "which layers rotate read from the model; un-rotation and decode-time rotation the identity on NoPE layers",
        layers="full, NoPE where no_rope_layers says so",
    ),
    "exaone4": Family(
        "q/k norms; local layers with RoPE, global layers NoPE (where sliding_window)",
        "NoPE read from the model; local layers keep what their window sees",
        layers="local (sliding: its window's entries kept; RoPE) and global (full; NoPE) per layer_types, or full "
        "with RoPE on every layer (no sliding_window)",
    ),
    "glm": Family(
        "partial RoPE with interleaved pairs, its tables laid out as rotate-half's (GLM-4)",
        "RoPE's pairing, width and tables read from the model's own apply_rotary_pos_emb",
    ),
    "glm4": Family("GLM's partial interleaved RoPE; norms after attention and MLP", "as glm"),
    "glm4_moe": Family("GLM's partial interleaved RoPE; optional q/k norms; mixture-of-experts MLP", "as glm"),
    "ernie4_5": Family(
        "interleaved RoPE over the whole head, its tables laid out as rotate-half's",
        "RoPE's pairing and tables read from the model's own apply_rotary_pos_emb",
    ),
    "ernie4_5_moe": Family("Ernie 4.5's RoPE; mixture-of-experts MLP", "as ernie4_5"),
    "helium": Family("interleaved RoPE, its tables laid out as rotate-half's", "as ernie4_5"),
    "hunyuan_v1_dense": Family(
        "q/k norms after RoPE",
        "the norm's weights read from the model; un-rotation divides them out, Expected Attention's moments turn "
        "through them",
    ),
    "hunyuan_v1_moe": Family("Hunyuan's norms after RoPE; mixture-of-experts MLP", "as hunyuan_v1_dense"),
    "dots1": Family("q/k norms; mixture-of-experts MLP with shared experts", "attention as qwen3"),
    "llama4_text": Family(
        "chunked layers (attention_chunk_size) with RoPE as complex frequencies and an L2 norm after it; global layers "
        "NoPE (every 4th), their queries scaled by position (attn_temperature_tuning); mixture-of-experts MLP",
        "chunked layers keep the prompt's last chunk − 1 entries, decoding under their chunk; NoPE, the pairing and "
        "the norm read from the model; the temperature's position from the sequence's length as transformers counts it",
        layers="chunked (its last chunk − 1 entries kept; RoPE) and global (full; NoPE) per layer_types",
    ),
    "gemma4_text": Family(
        "layers of two shapes: global layers of another head size and KV heads (global_head_dim, "
        "num_global_key_value_heads), values the keys' projection (attention_k_eq_v), a proportional RoPE; per-layer "
        "inputs; the last layers may reuse earlier layers' caches (num_kv_shared_layers)",
        "each layer's cache shape and RoPE read from the model; local layers keep what their window sees, global ones "
        "compressed; a layer reading another's cache refused",
        layers="local (sliding: its window's entries kept) and global (full; another head size and KV heads) per "
        "layer_types",
    ),
    "qwen3_next": Family(
        "hybrid: gated delta rule (linear attention) layers between attention layers; gated attention output; "
        "q/k norms; partial RoPE; mixture-of-experts MLP",
        "the recurrent layers' states kept whole; the attention layers compressed",
        **RECURRENT_LAYERS,
    ),
    "qwen3_5_text": Family(
        "hybrid as qwen3_next (gated delta rule and attention layers); dense MLP",
        "as qwen3_next",
        **RECURRENT_LAYERS,
    ),
    "olmo_hybrid": Family(
        "hybrid: gated delta rule layers and attention layers (q/k norms over all heads)",
        "as qwen3_next",
        **RECURRENT_LAYERS,
    ),
    "lfm2": Family(
        "hybrid: short convolution layers (a state of the last inputs) and attention layers; q/k norms",
        "the convolution layers' states kept whole; the attention layers compressed",
        layers="conv (a convolution state, kept whole) and full_attention, per layer_types",
        kinds=(FULL, "conv"),
    ),
    "lfm3": Family(
        "hybrid: short convolution layers, global and local (sliding) attention layers, per layer_types; a "
        "proportional RoPE on the global layers (half their pairs at frequency 0)",
        "the convolution states kept whole; local layers keep what their window sees; global layers compressed",
        layers="conv (kept whole), full_attention and sliding_attention (local: its window's entries), per layer_types",
        kinds=(FULL, SLIDING, "conv"),
    ),
    "lfm2_moe": Family(
        "hybrid as lfm2, a mixture-of-experts MLP",
        "",
        refused=NO_ROW,
        layers="conv (a convolution state) and full_attention, per layer_types",
    ),
    "bailing_hybrid": Family(
        "hybrid: linear (delta) attention layers and MLA attention layers, as kimi_linear",
        "",
        refused=NO_ROW,
        layers="linear_attention and full_attention (an MLA latent per token)",
    ),
    "bamba": Family(
        "hybrid: Mamba-2 layers (a convolution and an SSM state) and attention layers (attn_layer_indices)",
        "the Mamba layers' states kept whole; the attention layers compressed",
        **MAMBA_LAYERS,
    ),
    "granitemoehybrid": Family(
        "hybrid: Mamba-2 layers and attention layers without RoPE (Granite-4; RoPE optional); mixture-of-experts "
        "MLP; multipliers",
        "as bamba; nothing to un-rotate where it has no RoPE",
        **MAMBA_LAYERS,
    ),
    "jamba": Family(
        "hybrid: Mamba layers and attention layers without RoPE (attn_layer_period); mixture-of-experts MLP",
        "as bamba; nothing to un-rotate (no RoPE)",
        **MAMBA_LAYERS,
    ),
    "nemotron_h": Family(
        "hybrid: Mamba-2, attention (no RoPE) and MLP blocks, one mixer per block (layers_block_type)",
        "as bamba; the MLP blocks cache nothing; nothing to un-rotate (no RoPE)",
        layers="linear_attention (Mamba-2), full_attention and mlp/moe (nothing cached) blocks",
        kinds=(FULL, "linear_attention", "mlp", "moe"),
    ),
    "falcon_h1": Family(
        "hybrid in every layer: Mamba-2 and attention side by side, each layer a state and per-token entries",
        "each layer's state kept whole, its entries compressed",
        layers="hybrid (a state and per-token entries in every layer)",
        kinds=("hybrid",),
    ),
    "deepseek_v2": Family(
        "multi-head latent attention (MLA): one latent per token, expanded per head in attention; RoPE as complex "
        "rotations; mixture-of-experts MLP",
        MLA_HANDLED,
        layers=LATENT_LAYERS,
    ),
    "deepseek_v3": Family(
        "MLA as deepseek_v2, a compressed query (q_lora_rank), interleaved RoPE weights (rope_interleave)",
        MLA_HANDLED,
        layers=LATENT_LAYERS,
    ),
    "glm4_moe_lite": Family("MLA as deepseek_v3 (GLM-4.7-Flash)", MLA_HANDLED, layers=LATENT_LAYERS),
    "mistral4": Family(
        "MLA as deepseek_v3 (Mistral 4's text model)",
        "",
        refused="transformers maps no causal-LM class to it (Mistral 4 ships as a vision-language model)",
        layers=LATENT_LAYERS,
    ),
    "longcat_flash": Family(
        "MLA, two attention modules in each decoder layer", "", refused=TWO_ATTENTIONS, layers=LATENT_LAYERS
    ),
    "deepseek_v32": Family("MLA with indexed attention (DeepSeek Sparse Attention)", "", refused=INDEXED),
    "glm_moe_dsa": Family("MLA with indexed attention (GLM-5)", "", refused=INDEXED),
    "mistral_large4": Family("indexed attention (Mistral Large 4)", "", refused=INDEXED),
    "glm5_next": Family("indexed attention and linear attention layers", "", refused=INDEXED),
    "deepseek_v4": Family(
        "compressed_sparse_attention and heavily_compressed_attention layers", "", refused=COMPRESSES_ITSELF
    ),
    "zamba": Family("hybrid: Mamba layers and one attention block shared by several layers", "", refused=SHARED),
    "zamba2": Family("hybrid: Mamba-2 layers and attention blocks shared by several layers", "", refused=SHARED),
    "minimax": Family("hybrid: lightning (linear) attention and attention layers", "", refused=OWN_CACHE),
    "kimi_linear": Family(
        "hybrid: Kimi delta attention layers (a recurrent state) and MLA attention layers without RoPE",
        "the recurrent layers' states kept whole; " + MLA_HANDLED,
        layers="linear_attention (a recurrent state, kept whole) and full_attention (an MLA latent per token)",
        kinds=(FULL, "linear_attention"),
    ),
}


def admitted_families() -> list[str]:
    return [name for name, family in FAMILIES.items() if family.admitted]


def check_family(config, name: str) -> None:
    """Refuse, in one line and before the model loads, a family pkvbench has not proven (``FAMILIES``), layers it
    cannot describe or a configuration no model could compute with (``check_config``). ``config``: a transformers
    config or anything with its attributes (a ``config.json`` read as it is)."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise PkvError(
            f"model {name} is a {model_type!r} model; supported architectures: {', '.join(admitted_families())}"
        )
    if family.refused:
        raise PkvError(f"model {name} is a {model_type!r} model, not supported: {family.refused}")
    check_config(config, name)
    kinds = set(getattr(config, "layer_types", None) or ()) - set(family.kinds)
    if kinds:
        raise PkvError(
            f"model {name} has {', '.join(sorted(kinds))} layers; pkvbench runs layers of kinds "
            f"{', '.join(family.kinds)} only in a {model_type!r} model"
        )


def _whole_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(config, name: str) -> None:
    """Refuse, in one line, the values of a config no model can be built or run with: what the probe of the model's
    own code (``Architecture.read``) would otherwise stop on with an internal error, or run on silently."""

    def given(key: str):
        try:
            return getattr(config, key, None)
        except RuntimeError:  # a heterogeneous config (Gemma 4) has no global value of a per-layer key: the probe
            return None  # reads each layer's heads and sizes from its attention's call instead

    def refuse(what: str) -> None:
        raise PkvError(f"model {name}: {what}")

    layers = given("num_hidden_layers")
    if layers is not None and (not _whole_number(layers) or layers < 1):
        refuse(f"num_hidden_layers is {layers!r}; a model needs at least one layer")
    heads, kv_heads = given("num_attention_heads"), given("num_key_value_heads")
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if value is not None and (not _whole_number(value) or value < 1):
            refuse(f"{key} is {value!r}; it must be a whole number of heads, at least 1")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        refuse(f"its {kv_heads} KV heads do not divide its {heads} attention heads (each KV head serves a group)")
    window = given("sliding_window")
    if window is not None and not _whole_number(window):
        refuse(f"sliding_window is {window!r}; it must be a whole number of tokens (or null: no window)")
    kinds = given("layer_types")
    if kinds is not None and (not isinstance(kinds, (list, tuple)) or not all(isinstance(k, str) for k in kinds)):
        refuse(f"layer_types must be a list with one layer kind per layer, not {kinds!r}"[:300])
    # A window no layer declares is no window (Qwen2-MoE writes 0 where use_sliding_window is off, every layer full).
    if window is not None and window < 1 and (kinds is None or SLIDING in kinds):
        refuse(f"sliding_window is {window}: a window of {window} tokens hides every token (null: no window)")
    if kinds is not None:
        if _whole_number(layers) and len(kinds) != layers:
            refuse(f"layer_types names {len(kinds)} layers, num_hidden_layers {layers}")
        if SLIDING in kinds and window is None:
            refuse(f"layer {kinds.index(SLIDING)} is a sliding_attention layer, but the config gives no sliding_window")
    softcap = given("attn_logit_softcapping")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        refuse(f"attn_logit_softcapping is {softcap!r}; a soft-cap must be above 0 (it divides the logits; null: none)")


# Keyword arguments of an attention call whose effect pkvbench knows: the scale, the soft-cap and the sinks enter
# its statistics; the window reaches sdpa and eager through the mask; the rest change nothing it computes.
KNOWN_ATTENTION_ARGUMENTS = frozenset(
    {"dropout", "scaling", "softcap", "s_aux", "sliding_window", "position_ids", "use_cache", "cache_position"}
    | {"mamba_attention_mask"}  # Falcon-H1 hands its Mamba mixer's padding mask to both mixers
)


@dataclass(frozen=True)
class Architecture:
    """A model's layers as the engine sees them: what the decoder, its cuts and the statistics need of the model,
    read from what the model's code does (``engine/probe.py``)."""

    family: str  # config.model_type
    # Per model layer: FULL, SLIDING or CHUNKED, as its attention's mask says; a layer that keeps a state, the kind
    # its config declares (STATE_KINDS; HYBRID_KINDS beside its attention) or nothing (NO_CACHE_KINDS).
    layer_kinds: tuple[str, ...]
    # Per model layer: the window a new token sees while the answer is written (None: everything, or no attention):
    # its mask's, or the window of the model's own cache where that keeps fewer (a stray sliding_window on Llama:
    # ``generate``'s cache slides, its masks do not); a chunked layer's: its chunk.
    windows: tuple[int | None, ...]
    # Per model layer: the window of the mask it computes the prompt with (``prompt_limit``: the statistics' reach).
    prompt_windows: tuple[int | None, ...] = ()
    query_heads: int = 0
    # Per attention layer: the heads, key and value sizes of what it writes to its cache, as the probe's cache holds
    # them (an MLA latent's one head: ``kv_lora_rank`` and the shared rotary key), its reach where local.
    cache_shapes: tuple[LayerShape, ...] = ()
    # Per model layer: how it turns logits into attention (the sinks' values only once the weights are loaded; None
    # for a layer without attention), and a latent (MLA) layer's expansion of its cache into every head's keys and
    # values (``engine/latent.py``; None elsewhere).
    softmaxes: tuple[LayerSoftmax | None, ...] = ()
    expanders: tuple = ()
    rotation: Rotation | None = None  # how its RoPE turns a head (read from the loaded model)
    rope_switch: int | None = None  # the longest sequence rotated by RoPE's short tables (``probe.rope_switch``)

    @classmethod
    def read(cls, config, name: str = "the model", weights=None) -> Architecture:
        """Before the weights load: the model built on the ``meta`` device from ``config`` and probed; refuses, in
        one line, what it cannot compute or pkvbench cannot run exactly, and (``weights``: a folder of
        ``.safetensors`` files) weights whose shapes are not the config's."""
        import torch
        from transformers import AutoModelForCausalLM

        check_family(config, name)
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        except (ValueError, TypeError, AttributeError, KeyError, RuntimeError, ZeroDivisionError) as exc:
            raise PkvError(f"model {name}: its config cannot build the model: {first_line(exc)}") from None
        if weights is not None:
            check_weights(model, weights, name)
        return cls._probed(model, name)[0]

    @classmethod
    def of_model(cls, model, name: str = "the model") -> Architecture:
        """From a loaded model: what its modules do, its sinks' values and RoPE's pairing, per layer, included."""
        architecture, calls = cls._probed(model, name)
        return dataclasses.replace(architecture, rotation=architecture._rotation(model, calls))

    @classmethod
    def _probed(cls, model, name: str) -> tuple[Architecture, dict]:
        """The architecture read from ``model``'s attention calls (``probe.layer_calls``), and those calls."""
        from pkvbench.engine.attention import install_recording_attention
        from pkvbench.engine.probe import cache_windows, layer_calls, mask_reach, rope_switch

        install_recording_attention(model)  # the probe reads the calls through pkvbench's wrapper
        config = model.config
        count = len(model.model.layers)
        # The kinds the config declares: the model's own cache builds a state layer (or none) from them, and a
        # layer of such a kind runs no attention; every other layer's attention is read from its call.
        declared = tuple(getattr(config, "layer_types", None) or (FULL,) * count)
        modules = {
            layer: cls._attention_module(model.model.layers[layer])
            for layer in range(count)
            if declared[layer] not in STATE_KINDS + NO_CACHE_KINDS
        }
        try:
            calls, cache = layer_calls(model, modules)
        except (ValueError, TypeError, AttributeError, KeyError, RuntimeError, ZeroDivisionError) as exc:
            if "meta tensors" in str(exc):  # the probe runs on the meta device: shapes, no values
                raise PkvError(
                    f"model {name}: its code branches on a tensor's value while it runs (PhiMoE's longrope picks its "
                    "scale by the sequence's length so), which pkvbench cannot read before the weights load; not "
                    "supported"
                ) from None
            raise PkvError(f"model {name}: its config cannot run the model: {first_line(exc)}") from None
        missing = [layer for layer in modules if layer not in calls]
        if not modules or missing:
            raise PkvError(f"model {name}: layer {missing[0] if missing else 0} calls no attention pkvbench can read")
        # A layer that attends but writes nothing to the model's own cache reads another layer's (Gemma 4's last
        # num_kv_shared_layers): one cache, two layers' attention, which no policy of one layer's scores can cut.
        borrowing = [layer for layer in modules if getattr(cache.layers[layer], "keys", None) is None]
        if borrowing:
            raise PkvError(
                f"model {name}: layer {borrowing[0]} attends over a cache another layer writes (num_kv_shared_layers); "
                "pkvbench compresses each layer's own cache"
            )
        reaches: dict[int, object] = {}  # one read per mask the model builds, whatever the layers sharing it
        kinds, windows, prompt_windows, softmaxes = [], [], [], []
        cached = cache_windows(config, modules)
        for layer in range(count):
            if layer not in modules:  # a state, or nothing, kept whole
                kinds.append(declared[layer])
                windows.append(None)
                prompt_windows.append(None)
                softmaxes.append(None)
                continue
            call = calls[layer]
            key = id(call.mask) if call.mask is not None else -int(call.is_causal) - 1
            if key not in reaches:
                reaches[key] = mask_reach(call.mask, call.is_causal)
            reach = reaches[key]
            if not reach.causal:
                raise PkvError(
                    f"model {name}: layer {layer} attends to later tokens (not causal, e.g. "
                    "use_bidirectional_attention); pkvbench runs causal attention only"
                )
            if not reach.pattern:
                raise PkvError(
                    f"model {name}: layer {layer}'s attention mask is neither causal, a sliding window nor chunked"
                )
            if reach.window == 0:
                raise PkvError(f"model {name}: layer {layer}'s window hides every token (sliding_window 0?)")
            unknown = sorted(set(call.kwargs) - KNOWN_ATTENTION_ARGUMENTS)
            if unknown:
                raise PkvError(
                    f"model {name}: layer {layer}'s attention takes {', '.join(unknown)}, which pkvbench does not model"
                )
            if call.query_heads % call.kv_heads:
                raise PkvError(
                    f"model {name}: its {call.kv_heads} KV heads do not divide its {call.query_heads} attention heads"
                )
            softcap = call.kwargs.get("softcap")
            if softcap is not None and not softcap > 0:
                raise PkvError(
                    f"model {name}: layer {layer} soft-caps its logits at {softcap!r}; a cap must be above 0"
                )
            scaling = call.kwargs.get("scaling")
            seen = reach.chunk or reach.window  # how far back its tokens see over the prompt
            window = min((w for w in (seen, cached[layer]) if w is not None), default=None)
            kind = CHUNKED if reach.chunk else FULL if window is None else SLIDING
            kinds.append(HYBRID_OF[kind] if declared[layer] in HYBRID_KINDS else kind)  # a state beside it
            windows.append(window)
            prompt_windows.append(seen)
            softmaxes.append(
                LayerSoftmax(
                    float(scaling) if scaling is not None else call.head_dim**-0.5, softcap, call.kwargs.get("s_aux")
                )
            )
        first = calls[min(calls)]
        rotary = getattr(model.model, "rotary_emb", None)
        attention_kinds = tuple(
            HYBRID_KINDS.get(kind, kind) for kind in kinds if HYBRID_KINDS.get(kind, kind) in ATTENTION_KINDS
        )
        switch = None if rotary is None else rope_switch(type(rotary), config, attention_kinds)
        expanders = tuple(
            modules[layer].expand_kv if layer in modules and latent(modules[layer]) else None for layer in range(count)
        )
        architecture = cls(
            getattr(config, "model_type", "") or "",
            tuple(kinds),
            tuple(windows),
            tuple(prompt_windows),
            query_heads=first.query_heads,
            softmaxes=tuple(softmaxes),
            expanders=expanders,
            rope_switch=switch,
        )
        written = [cache.layers[layer] for layer in architecture.attention_layers]
        shapes = tuple(
            LayerShape(entries.keys.shape[1], entries.keys.shape[-1], entries.values.shape[-1], reach)
            for entries, reach in zip(written, architecture.local)
        )
        return dataclasses.replace(architecture, cache_shapes=shapes), calls

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def attention_kind(self, layer: int) -> str | None:
        """The kind of the layer's attention (FULL, SLIDING or CHUNKED; a hybrid layer's beside its state), None for a layer
        that keeps no per-token entries."""
        kind = HYBRID_KINDS.get(self.layer_kinds[layer], self.layer_kinds[layer])
        return kind if kind in ATTENTION_KINDS else None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep per-token entries, in depth order: every layer of an attention-only model, a hybrid
        model's attention layers. Budgets, plans and statistics run over these; the others keep their state whole."""
        return tuple(layer for layer in range(self.num_layers) if self.attention_kind(layer))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that keep a fixed-size state per sequence (``engine/recurrent.py``)."""
        return tuple(
            layer for layer, kind in enumerate(self.layer_kinds) if kind in STATE_KINDS or kind in HYBRID_KINDS
        )

    @property
    def latent(self) -> bool:
        """Whether the model caches an MLA latent (``engine/latent.py``)."""
        return any(self.expanders)

    def window(self, layer: int) -> int | None:
        """How far back the layer's tokens see: its sliding window, or its chunk (a chunked layer); None for full
        attention."""
        return self.windows[layer]

    @property
    def sliding_window(self) -> int | None:
        """The narrowest window of any layer (None: no layer slides)."""
        return min((w for w in self.windows if w is not None), default=None)

    @property
    def every_layer_slides(self) -> bool:
        return all(self.attention_kind(layer) == SLIDING for layer in self.attention_layers)

    @property
    def mixed(self) -> bool:
        """Local (sliding) and global layers both."""
        return (
            any(self.attention_kind(layer) == SLIDING for layer in self.attention_layers)
            and not self.every_layer_slides
        )

    def compressible(self, layer: int) -> bool:
        """Whether a policy may compress the layer: every attention layer but a mixed model's local ones and chunked
        ones."""
        kind = self.attention_kind(layer)
        return kind is not None and not (self.mixed and kind == SLIDING) and kind != CHUNKED

    @property
    def local(self) -> tuple[int | None, ...]:
        """Per attention layer (``attention_layers``): a mixed model's local layer's reach — the prompt entries its
        window can still see from the next token on (window − 1), all it keeps, as transformers' sliding cache layer
        — or None where a policy compresses the layer (``kv_formats.CacheGeometry.local``)."""
        return tuple(None if self.compressible(layer) else self.windows[layer] - 1 for layer in self.attention_layers)

    @property
    def softcapped(self) -> bool:
        return any(softmax is not None and softmax.softcap is not None for softmax in self.softmaxes)

    # --- the loaded model's modules: the one place that names their paths -------------------------------------

    # Where a decoder layer keeps its attention: ``self_attn`` (transformers' shared layout), ``mixer`` (Nemotron-H's
    # blocks, whose one mixer is attention, Mamba or an MLP).
    ATTENTION_MODULES = ("self_attn", "mixer")

    @classmethod
    def _attention_module(cls, decoder_layer):
        return next(
            getattr(decoder_layer, name) for name in cls.ATTENTION_MODULES if getattr(decoder_layer, name, None)
        )

    def attention_modules(self, model) -> list:
        """Each attention layer's module (``transformers``' shared layout: ``model.model.layers[i].self_attn``, with
        ``layer_idx``, ``o_proj``), in the order of ``attention_layers``."""
        return [self._attention_module(model.model.layers[layer]) for layer in self.attention_layers]

    # An attention module's output projection: ``o_proj`` (the shared layout), ``out_proj`` (LFM2).
    OUTPUT_PROJECTIONS = ("o_proj", "out_proj")

    def output_weight(self, model, layer: int):
        """Attention layer ``layer``'s (an index of ``attention_layers``) output projection's weight (VATP-style
        value scores), where accelerate keeps it (``placement.onloaded``: an offloaded one is read on the CPU, not
        onto the layer's device)."""
        from pkvbench.engine.placement import stored

        module = self.attention_modules(model)[layer]
        return stored(
            next(getattr(module, name) for name in self.OUTPUT_PROJECTIONS if hasattr(module, name)), "weight"
        )

    @staticmethod
    def rotary(model):
        """The model's rotary embedding module (cos, sin of positions; its width may be part of a head), or None for
        a model without one (NoPE attention: Jamba, Nemotron-H, Granite-4's hybrids)."""
        return getattr(model.model, "rotary_emb", None)

    @property
    def prompt_window(self) -> int | None:
        """The narrowest window any layer computes the prompt under (None: none has one)."""
        return min((w for w in self.prompt_windows if w is not None), default=None)

    @property
    def prompt_limit(self) -> int | None:
        """The longest prompt whose attention statistics the engine computes exactly: they assume every query sees
        the whole prompt, so on a model whose every layer computes the prompt under a window, prompts up to its
        (narrowest) window."""
        windows = [self.prompt_windows[layer] for layer in self.attention_layers] if self.prompt_windows else []
        if windows and all(w is not None for w in windows):
            return min(windows)
        return None

    def check_rope(self, length: int, new_tokens: int, name: str = "the model") -> None:
        """Refuse, in one line, an answer of up to ``new_tokens`` after a prompt of ``length`` tokens that carries the
        sequence across RoPE's switch (``rope_switch``): the prompt's cached keys keep the tables of its side, where
        the model's own ``generate`` computes every key again with the other's."""
        switch = self.rope_switch
        if switch is not None and length <= switch < length + new_tokens - 1:
            raise PkvError(
                f"model {name} switches its RoPE tables past {switch} tokens (longrope): a prompt of {length} tokens "
                f"and an answer of up to {new_tokens} cross it, and the prompt's cached keys would keep the short "
                f"tables; use prompts above {switch} tokens or answers of {switch - length + 1} tokens at most"
            )

    def check_window(self, length: int, policies, name: str = "the model") -> None:
        """Refuse, in one line, a policy that scores from the prompt's attention (``attention_statistics``) on a
        prompt of ``length`` tokens past an all-sliding model's window: pkvbench computes those statistics as if
        every query saw the whole prompt. The other policies run there exactly."""
        limit = self.prompt_limit
        if limit is None or length <= limit:
            return
        for policy in policies:
            if attention_statistics(policy.needs) or attention_statistics(policy.decoding_needs):
                raise PkvError(
                    f"{policy.label} scores from the prompt's attention, which pkvbench computes as if every query "
                    f"saw the whole prompt: model {name} slides a window of {limit} tokens on every layer, and a "
                    f"prompt of {length} tokens exceeds it (policies that score from keys, queries or positions — "
                    "full, streamingllm, knorm, keydiff, random, rkv, expected_attention — run on it)"
                )

    # --- soft-capped logits and per-layer RoPE (Gemma 2, Gemma 3) ---------------------------------------------

    def attention_kernel(self, requested: str) -> str:
        """The kernel the model runs on: transformers' sdpa cannot soft-cap logits (it refuses Gemma 2), so a
        soft-capped model takes the eager kernel, which caps them as the model was trained to."""
        return "eager" if self.softcapped and requested == "sdpa" else requested

    def rope(self, model, layer: int, like, positions) -> tuple:
        """The RoPE cos and sin layer ``layer`` rotates its queries and keys at ``positions`` ``[1, n]`` with (``like``:
        a tensor of the dtype and device wanted): the model's one rotary embedding, or, where the model calls it per
        layer type (Gemma 3: the local layers at ``rope_local_base_freq``), the layer's own."""
        rotary = self.rotary(model)
        if rotary is None:  # no RoPE: tables of width 0, which turn nothing (``Rotation.tables``, ``unrotate``)
            empty = like.new_ones((1, positions.shape[-1], 0))
            return empty, empty.new_zeros(empty.shape)
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            return rotary(like, positions, layer_type=self.attention_kind(layer))
        return rotary(like, positions)

    # --- how each layer rotates, read from the loaded model ----------------------------------------------------

    def _rotation(self, model, calls: dict) -> Rotation:
        """How each layer's RoPE turns a head, read from the probe's calls (``probe.layer_calls``): a layer whose
        attention never called the model's rotary function is NoPE (SmolLM3's ``no_rope_layers``, Exaone 4's global
        layers, Llama 4's every 4th, every layer of Jamba or Nemotron-H), whatever its config says; a layer whose
        kernel got other queries than the function gave has a norm after RoPE (Hunyuan:
        ``probe.scale_after_rotation``). Then the function turns each unit vector of a head by a quarter turn:
        dimension i turns towards its partner (the pairing), and the dimensions that do not turn lie beyond the
        rotary width. A latent (MLA) layer's queries are never un-rotated (Expected Attention, their one reader, is
        refused there): it counts as not rotating."""
        import torch

        from pkvbench.engine.placement import execution_device
        from pkvbench.engine.probe import scale_after_rotation

        dims = tuple(calls[layer].head_dim if layer in calls else 0 for layer in range(self.num_layers))
        rotates = tuple(
            layer in calls and calls[layer].rotary is not None and not self.latent for layer in range(self.num_layers)
        )
        if not any(rotates):
            return Rotation(interleaved=False, widths=(0,) * self.num_layers, dims=dims, rotates=rotates)
        modules = dict(zip(self.attention_layers, self.attention_modules(model)))
        with torch.inference_mode():
            scales = tuple(
                scale_after_rotation(modules[layer], calls[layer]) if rotates[layer] else None
                for layer in range(self.num_layers)
            )
        call = calls[rotates.index(True)].rotary
        rotation = Rotation(False, dims, dims, rotates, scales, call.function, call.heads_axis, call.pair, call.options)
        device = execution_device(self.rotary(model))
        widths, pairings = [], set()
        for layer in range(self.num_layers):
            if not rotates[layer]:
                widths.append(0)
                continue
            dim = dims[layer]
            positions = torch.ones(1, dim, dtype=torch.long, device=device)
            embedding = self.rope(model, layer, torch.zeros(1, device=device), positions)
            # Tables of the model's layout that turn every pair a quarter (cos 0, sin 1; complex frequencies: i): a
            # pair whose frequency is 0 (LFM3's proportional RoPE) still lies inside the width, as the tables cover it.
            if isinstance(embedding, tuple):
                quarter = (torch.zeros_like(embedding[0]), torch.ones_like(embedding[1]))
            else:
                quarter = torch.full_like(embedding, 1j)
            basis = torch.eye(dim, device=device)[None, None]  # [1, 1, d, d]: d "tokens", each a unit vector
            turned = rotation.turn(basis, quarter)[0, 0].clone()  # row i: where e_i turns
            turned.fill_diagonal_(0.0)
            moving = turned.abs().sum(dim=-1) > 0
            width = int(moving.nonzero().max()) + 1 if bool(moving.any()) else 0
            widths.append(width)
            pairings.add(width > 2 and int(turned[0].abs().argmax()) == 1)
        if len(pairings) > 1:
            raise PkvError(
                f"model {self.family}: its layers pair RoPE's dimensions differently (rotate_half and interleaved)"
            )
        return dataclasses.replace(rotation, interleaved=pairings.pop(), widths=tuple(widths))


def check_weights(model, folder, name: str) -> None:
    """Refuse weights (the ``.safetensors`` files in ``folder``, read from their headers) whose shapes are not those
    the config gives ``model`` (built from it, on any device): a ``head_dim`` or head count the weights were not
    made with would load only by re-drawing them."""
    from safetensors import safe_open

    expected = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as stored:
            for key in stored.keys():  # noqa: SIM118 (a safetensors file is not iterable)
                shape = tuple(stored.get_slice(key).get_shape())
                if key in expected and expected[key] != shape:
                    raise PkvError(
                        f"model {name}: its config makes {key} of shape {list(expected[key])}, its weights hold "
                        f"{list(shape)}: the config (head_dim, heads, sizes) is not the weights'"
                    )


def latent(module) -> bool:
    """Whether an attention module caches a latent and expands it per head inside attention (multi-head latent
    attention, MLA: DeepSeek-V2/V3, Kimi): transformers' MLA modules write the latent and the shared rotary key to the
    cache (``cache.update(latent, rotary key)``) and read them back through their own ``expand_kv``."""
    return callable(getattr(module, "expand_kv", None))


def attention_statistics(needs) -> bool:
    """Whether a policy's ``Needs`` include statistics of the prompt's attention (window sums, accumulated or
    bidirectional attention, KVzip's reconstruction), which assume every query sees the whole prompt."""
    return bool(needs.windows or needs.accumulated or needs.bidirectional or needs.reconstruction)
