"""What pkvbench must know of a model's architecture, read once from its config: the seam between the engine and
the model families.

Per layer, its attention kind, as transformers' ``cache_utils`` reads it (``config.layer_types``, else inferred:
a ``sliding_window`` makes every layer slide): ``full_attention`` or ``sliding_attention`` (the token at position p
sees positions p − window + 1 … p). How the engine treats them:

- a model whose every layer slides (Mistral-7B-v0.1; Qwen2/Qwen3 with ``use_sliding_window`` and
  ``max_window_layers`` 0) is compressed as any other; the window is applied while decoding (``sliding``);
- in a model that mixes local (sliding) and global layers, the local layers are never compressed by a policy: they
  keep their entries, counted in the row's entries and bytes, and decode under their window; the global layers are
  compressed.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from pkvbench.errors import PkvError

FULL = "full_attention"
SLIDING = "sliding_attention"
ATTENTION_KINDS = (FULL, SLIDING)
# Layer kinds of transformers' ``cache_utils`` that keep a fixed-size state per sequence, not per-token keys and
# values (``engine/recurrent.py``): the state alone; the state beside an attention layer's entries (Falcon-H1's
# layers run both), as which attention kind; nothing cached at all (Nemotron-H's MLP blocks).
STATE_KINDS = ("linear_attention", "conv")
HYBRID_KINDS = {"hybrid": FULL, "hybrid_sliding": SLIDING}
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
LOCAL_AND_GLOBAL = "local (sliding, kept whole) and global (full) per layer_types"
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
TWO_ATTENTIONS = "two attention modules per decoder layer: its cache holds two layers' entries per layer"
MLA_HANDLED = (
    "a layer's cache is one latent head: positions of the latent kept, statistics of the expanded heads folded to "
    "it; the policies that read cached keys or values themselves (marked MLA: refused above) and gqa=query refused"
)
HYBRID_LAYERS = "linear_attention (a recurrent state, kept whole) and full_attention, per layer_types"
MAMBA_LAYERS = "linear_attention (Mamba: a convolution and an SSM state, kept whole) and full_attention"
FAMILIES: dict[str, Family] = {
    "llama": Family(HALF_ROPE + "; Llama 3.1 and YaRN scaling", "the reference layout"),
    "mistral": Family(
        "a sliding window on every layer (Mistral-7B-v0.1)",
        "compressed as any model; the window applied while decoding; prompts up to the window",
        layers=EVERY_LAYER_SLIDES,
    ),
    "qwen2": Family(
        "a sliding window on the layers from max_window_layers on, where use_sliding_window",
        "every layer sliding: as mistral; some: the local layers kept whole",
        layers=WINDOW_LAYERS,
    ),
    "qwen3": Family("q/k norms; an optional sliding window as qwen2", "as qwen2", layers=WINDOW_LAYERS),
    "qwen3_moe": Family("mixture-of-experts MLP; q/k norms", "attention as qwen3", layers=WINDOW_LAYERS),
    "phi3": Family(
        "fused qkv projection; partial RoPE (partial_rotary_factor)",
        "RoPE un-rotated over its width",
        layers=EVERY_LAYER_SLIDES,
    ),
    "olmo2": Family("q/k norms over all heads, after the projection", "attention as llama"),
    "starcoder2": Family(
        "projection biases; an optional sliding window", "as mistral where it slides", layers=EVERY_LAYER_SLIDES
    ),
    "granite": Family("attention, residual and logit multipliers", "the module's own scaling"),
    "gemma2": Family(
        "soft-capped attention logits (attn_logit_softcapping); query_pre_attn_scalar; local and global layers",
        "statistics soft-cap the logits as the model does; the eager kernel (sdpa cannot soft-cap); local layers kept whole",
        layers=LOCAL_AND_GLOBAL,
    ),
    "gemma3_text": Family(
        "per-layer RoPE (local layers at rope_local_base_freq); q/k norms; local and global layers",
        "each layer's own RoPE (un-rotation, decode-time rotation); local layers kept whole",
        layers=LOCAL_AND_GLOBAL,
    ),
    "gpt_oss": Family(
        "attention sinks in the softmax; RoPE tables of one entry per pair; mixture-of-experts MLP; no sdpa kernel; "
        "local and global layers",
        "sinks in every statistic's denominator; eager kernel; RoPE as read from the model; local layers kept whole",
        layers=LOCAL_AND_GLOBAL,
    ),
    "cohere": Family(
        "interleaved RoPE (pairs 2i, 2i + 1); q/k layer norms; a logit scale; attention and MLP in parallel",
        "RoPE's pairing read from the model's own apply_rotary_pos_emb; un-rotated as it pairs",
    ),
    "qwen3_next": Family(
        "hybrid: gated delta rule (linear attention) layers between attention layers; gated attention output; "
        "q/k norms; partial RoPE; mixture-of-experts MLP",
        "the recurrent layers' states kept whole; the attention layers compressed",
        layers=HYBRID_LAYERS,
        kinds=(FULL, "linear_attention"),
    ),
    "qwen3_5_text": Family(
        "hybrid as qwen3_next (gated delta rule and attention layers); dense MLP",
        "as qwen3_next",
        layers=HYBRID_LAYERS,
        kinds=(FULL, "linear_attention"),
    ),
    "olmo_hybrid": Family(
        "hybrid: gated delta rule layers and attention layers (q/k norms over all heads)",
        "as qwen3_next",
        layers=HYBRID_LAYERS,
        kinds=(FULL, "linear_attention"),
    ),
    "lfm2": Family(
        "hybrid: short convolution layers (a state of the last inputs) and attention layers; q/k norms",
        "the convolution layers' states kept whole; the attention layers compressed",
        layers="conv (a convolution state, kept whole) and full_attention, per layer_types",
        kinds=(FULL, "conv"),
    ),
    "lfm3": Family(
        "hybrid: short convolution layers, global and local (sliding) attention layers, per layer_types",
        "the convolution states kept whole; local layers kept whole; global layers compressed",
        layers="conv (kept whole), full_attention and sliding_attention (local, kept whole), per layer_types",
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
        layers=MAMBA_LAYERS,
        kinds=(FULL, "linear_attention"),
    ),
    "granitemoehybrid": Family(
        "hybrid: Mamba-2 layers and attention layers without RoPE (Granite-4; RoPE optional); mixture-of-experts "
        "MLP; multipliers",
        "as bamba; nothing to un-rotate where it has no RoPE",
        layers=MAMBA_LAYERS,
        kinds=(FULL, "linear_attention"),
    ),
    "jamba": Family(
        "hybrid: Mamba layers and attention layers without RoPE (attn_layer_period); mixture-of-experts MLP",
        "as bamba; nothing to un-rotate (no RoPE)",
        layers=MAMBA_LAYERS,
        kinds=(FULL, "linear_attention"),
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
        "compressed_sparse_attention and heavily_compressed_attention layers",
        "",
        refused="its attention compresses its own cache (built-in compressed attention): nothing left to compare",
    ),
    "zamba": Family("hybrid: Mamba layers and one attention block shared by several layers", "", refused=SHARED),
    "zamba2": Family("hybrid: Mamba-2 layers and attention blocks shared by several layers", "", refused=SHARED),
    "minimax": Family(
        "hybrid: lightning (linear) attention and attention layers",
        "",
        refused="it keeps a cache class of its own (MiniMaxCache) and refuses any other, a compressed one included",
    ),
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
    """Refuse, in one line and before the model loads, a family pkvbench has not proven (``FAMILIES``) or layers it
    cannot describe (``config``: a transformers config or anything with its attributes)."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise PkvError(
            f"model {name} is a {model_type!r} model; supported architectures: {', '.join(admitted_families())}"
        )
    if family.refused:
        raise PkvError(f"model {name} is a {model_type!r} model, not supported: {family.refused}")
    kinds = set(getattr(config, "layer_types", None) or ()) - set(family.kinds)
    if kinds:
        raise PkvError(
            f"model {name} has {', '.join(sorted(kinds))} layers; pkvbench runs layers of kinds "
            f"{', '.join(family.kinds)} only in a {model_type!r} model"
        )


@dataclass(frozen=True)
class Architecture:
    """A model's layers as the engine sees them: what the decoder, its cuts and the statistics need of the model."""

    family: str  # config.model_type
    # per layer: FULL or SLIDING, a kind that keeps a state (STATE_KINDS, HYBRID_KINDS) or nothing (NO_CACHE_KINDS)
    layer_kinds: tuple[str, ...]
    sliding_window: int | None  # the window of the sliding layers
    softcap: float | None = None  # attn_logit_softcapping (Gemma 2): logits become softcap·tanh(logits / softcap)
    kv_heads: int = 0  # the heads of the keys and values the model hands its cache (one latent for MLA)
    query_heads: int = 0
    # Read from the loaded model (``of_model``), per model layer: each attention layer's softmax (None for a layer
    # without attention), a latent (MLA) layer's expansion of its cache into every head's keys and values
    # (``engine/latent.py``; None elsewhere); and how its RoPE turns a head.
    softmaxes: tuple[LayerSoftmax | None, ...] = ()
    expanders: tuple = ()
    rotation: Rotation | None = None

    @classmethod
    def of_model(cls, model) -> Architecture:
        """From a loaded model: its config's facts, and what its modules do."""
        architecture = cls.of(model.config)
        modules = dict(zip(architecture.attention_layers, architecture.attention_modules(model)))
        expanders = tuple(
            modules[layer].expand_kv if layer in modules and latent(modules[layer]) else None
            for layer in range(architecture.num_layers)
        )
        return dataclasses.replace(
            architecture,
            kv_heads=1 if any(expanders) else architecture.kv_heads,
            softmaxes=tuple(architecture._softmaxes(model)),
            expanders=expanders,
            rotation=architecture._rotation(model),
        )

    @classmethod
    def of(cls, config) -> Architecture:
        """From a transformers config (or anything with its attributes)."""
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        kinds = getattr(config, "layer_types", None)
        if not kinds:
            kinds = [SLIDING if window else FULL] * config.num_hidden_layers
        kinds = tuple(kinds)
        if SLIDING not in {HYBRID_KINDS.get(kind, kind) for kind in kinds}:
            window = None
        softcap = getattr(config, "attn_logit_softcapping", None)
        query_heads = getattr(config, "num_attention_heads", 0)
        kv_heads = getattr(config, "num_key_value_heads", None) or query_heads
        return cls(getattr(config, "model_type", "") or "", kinds, window, softcap, kv_heads, query_heads)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def attention_kind(self, layer: int) -> str | None:
        """The kind of the layer's attention (FULL or SLIDING; a hybrid layer's beside its state), None for a layer
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
        """Whether the model caches an MLA latent (``engine/latent.py``; known once loaded: ``of_model``)."""
        return any(self.expanders)

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, None for full attention."""
        return self.sliding_window if self.attention_kind(layer) == SLIDING else None

    @property
    def windows(self) -> list[int | None]:
        return [self.window(layer) for layer in range(self.num_layers)]

    @property
    def every_layer_slides(self) -> bool:
        return all(self.attention_kind(layer) == SLIDING for layer in self.attention_layers)

    @property
    def mixed(self) -> bool:
        """Local (sliding) and global layers both."""
        return any(self.window(layer) for layer in self.attention_layers) and not self.every_layer_slides

    def compressible(self, layer: int) -> bool:
        """Whether a policy may compress the layer: every attention layer but a mixed model's local ones."""
        kind = self.attention_kind(layer)
        return kind is not None and not (self.mixed and kind == SLIDING)

    # --- the loaded model's modules: the one place that names their paths -------------------------------------

    # Where a decoder layer keeps its attention: ``self_attn`` (transformers' shared layout), ``mixer`` (Nemotron-H's
    # blocks, whose one mixer is attention, Mamba or an MLP).
    ATTENTION_MODULES = ("self_attn", "mixer")

    def attention_modules(self, model) -> list:
        """Each attention layer's module (``transformers``' shared layout: ``model.model.layers[i].self_attn``, with
        ``layer_idx``, ``scaling``, ``o_proj``), in the order of ``attention_layers``."""
        layers = model.model.layers
        return [
            next(getattr(layers[i], name) for name in self.ATTENTION_MODULES if getattr(layers[i], name, None))
            for i in self.attention_layers
        ]

    # An attention module's output projection: ``o_proj`` (the shared layout), ``out_proj`` (LFM2).
    OUTPUT_PROJECTIONS = ("o_proj", "out_proj")

    def output_weights(self, model) -> list:
        """Each attention layer's output projection's weight (VATP-style value scores), in the order of
        ``attention_layers``."""
        return [
            next(getattr(module, name) for name in self.OUTPUT_PROJECTIONS if hasattr(module, name)).weight
            for module in self.attention_modules(model)
        ]

    def _softmaxes(self, model) -> list[LayerSoftmax | None]:
        """How each layer turns its logits into attention: its module's own scale (granite's multiplier, not always
        1/sqrt(d)), the model's soft-cap, the module's sinks; None for a layer without attention (a hybrid's
        recurrent layers)."""
        modules = dict(zip(self.attention_layers, self.attention_modules(model)))
        return [
            LayerSoftmax(float(modules[layer].scaling), self.softcap, self.sinks(modules[layer]))
            if layer in modules
            else None
            for layer in range(self.num_layers)
        ]

    @staticmethod
    def rotary(model):
        """The model's rotary embedding module (cos, sin of positions; its width may be part of a head), or None for
        a model without one (NoPE attention: Jamba, Nemotron-H, Granite-4's hybrids)."""
        return getattr(model.model, "rotary_emb", None)

    @property
    def prompt_limit(self) -> int | None:
        """The longest prompt the engine prefills exactly: a compressed sliding layer's statistics assume every
        query sees the whole prompt, so a model whose every layer slides takes prompts up to its window."""
        return self.sliding_window if self.every_layer_slides else None

    # --- soft-capped logits and per-layer RoPE (Gemma 2, Gemma 3) ---------------------------------------------

    def attention_kernel(self, requested: str) -> str:
        """The kernel the model runs on: transformers' sdpa cannot soft-cap logits (it refuses Gemma 2), so a
        soft-capped model takes the eager kernel, which caps them as the model was trained to."""
        return "eager" if self.softcap is not None and requested == "sdpa" else requested

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

    # --- RoPE's pairing, read from the loaded model ------------------------------------------------------------

    def _rotation(self, model) -> Rotation:
        """How the model's RoPE turns a head, read by turning each unit vector of a head with the model's own
        ``apply_rotary_pos_emb`` by a quarter turn: dimension i turns towards its partner, and the dimensions that do
        not turn lie beyond the rotary width."""
        import torch

        module = self.attention_modules(model)[0]
        if latent(module) or self.rotary(model) is None:
            # A latent cache's queries are not un-rotated (Expected Attention, their one reader, is refused there);
            # a model without RoPE has nothing to un-rotate.
            return Rotation(interleaved=False, width=0)
        apply = inspect.getmodule(type(module)).apply_rotary_pos_emb
        dim = module.head_dim
        device = next(model.parameters()).device
        positions = torch.ones(1, dim, dtype=torch.long, device=device)
        cos, sin = self.rope(model, self.attention_layers[0], torch.zeros(1, device=device), positions)
        # Tables of the model's shape that turn every pair a quarter: a pair whose frequency is 0 (LFM3's
        # proportional RoPE) still lies inside the rotary width, as the tables cover it.
        cos, sin = torch.zeros_like(cos, dtype=torch.float), torch.ones_like(sin, dtype=torch.float)
        basis = torch.eye(dim, device=device)[None, None]  # [1, 1, d, d]: d "tokens", each a unit vector
        turned = apply(basis, basis, cos, sin)[0][0, 0].clone()  # row i: where e_i turns
        turned.fill_diagonal_(0.0)
        moving = turned.abs().sum(dim=-1) > 0
        width = int(moving.nonzero().max()) + 1 if bool(moving.any()) else 0
        return Rotation(interleaved=width > 2 and int(turned[0].abs().argmax()) == 1, width=width)

    # --- attention sinks ----------------------------------------------------------------------------------------

    @staticmethod
    def sinks(module):
        """The attention module's sinks ``[Hq]`` (gpt-oss: a learned logit per head that joins the softmax's
        denominator, no value attached), or None."""
        return getattr(module, "sinks", None)


def latent(module) -> bool:
    """Whether an attention module caches a latent and expands it per head inside attention (multi-head latent
    attention, MLA: DeepSeek-V2/V3, Kimi): transformers' MLA modules write the latent and the shared rotary key to the
    cache (``cache.update(latent, rotary key)``) and read them back through their own ``expand_kv``."""
    return callable(getattr(module, "expand_kv", None))


@dataclass(frozen=True)
class LayerSoftmax:
    """How a layer turns q·k into attention weights, as the statistics must too: the logits scaled by ``scaling``,
    soft-capped to softcap·tanh(logits / softcap) where ``softcap`` (Gemma 2), and each head's ``sinks`` logit ``[Hq]``
    joining the denominator where the module has them (gpt-oss; ``attention.attention_softmax``)."""

    scaling: float
    softcap: float | None = None
    sinks: object = None  # a tensor [Hq] or None


@dataclass(frozen=True)
class Rotation:
    """How a model's RoPE turns a head: the first ``width`` dimensions in pairs, dimension i with i + width/2
    (transformers' ``rotate_half``: llama and most) or, ``interleaved``, 2i with 2i + 1 (Cohere); the dimensions
    beyond pass as they are (Phi-3's partial RoPE)."""

    interleaved: bool
    width: int

    def tables(self, cos, sin):
        """The rotary module's cos and sin ``[n, c]`` over the whole rotated width: a module that gives one per pair
        (gpt-oss: c = width / 2) spread to both dimensions of each pair."""
        if cos.shape[-1] == self.width:
            return cos, sin
        if self.interleaved:
            return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        return cos.repeat(1, 2), sin.repeat(1, 2)
