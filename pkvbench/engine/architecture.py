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

import inspect
from dataclasses import dataclass

from pkvbench.errors import PkvError

FULL = "full_attention"
SLIDING = "sliding_attention"
ATTENTION_KINDS = (FULL, SLIDING)
MATRIX = "tests/test_architectures.py"


@dataclass(frozen=True)
class Family:
    """A ``config.model_type``: what is special about it and how pkvbench handles it (docs/models.md's matrix), or
    why it is refused. A family is admitted only with its row in ``tests/test_architectures.py``."""

    special: str
    handled: str
    refused: str = ""  # the reason, in one line, where pkvbench does not run it
    layers: str = "full"  # the layer kinds its configs declare (``pkvbench list``)

    @property
    def admitted(self) -> bool:
        return not self.refused


HALF_ROPE = "RoPE over the whole head (rotate-half)"
EVERY_LAYER_SLIDES = "full, or sliding on every layer (sliding_window)"
WINDOW_LAYERS = "full, or sliding from max_window_layers on (use_sliding_window)"
LOCAL_AND_GLOBAL = "local (sliding, kept whole) and global (full) per layer_types"
MLA = "MLA caches a compressed latent"
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
        "every layer sliding: as mistral; some: the local layers kept whole",
        layers=LOCAL_AND_GLOBAL,
    ),
    "olmo3": Family(
        "q/k norms over all heads; local and global layers, a RoPE per layer kind",
        "each layer's own RoPE; local layers kept whole",
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
    "deepseek_v2": Family("multi-head latent attention (MLA)", "", refused=MLA, layers="latent (MLA)"),
    "deepseek_v3": Family("multi-head latent attention (MLA)", "", refused=MLA, layers="latent (MLA)"),
}
# Layer kinds of transformers' cache_utils that hold no per-token keys and values (hybrid linear attention).
RECURRENT_KINDS = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")


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
    kinds = set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_KINDS)
    if kinds:
        raise PkvError(
            f"model {name} has {', '.join(sorted(kinds))} layers; pkvbench runs layers of kinds "
            f"{', '.join(ATTENTION_KINDS)} only (per-token keys and values)"
        )


@dataclass(frozen=True)
class Architecture:
    """A model's layers as the engine sees them."""

    family: str  # config.model_type
    layer_kinds: tuple[str, ...]  # per layer: FULL or SLIDING (or a kind pkvbench refuses, e.g. linear attention)
    sliding_window: int | None  # the window of the sliding layers
    softcap: float | None = None  # attn_logit_softcapping (Gemma 2): logits become softcap·tanh(logits / softcap)

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
        if SLIDING not in kinds:
            window = None
        softcap = getattr(config, "attn_logit_softcapping", None)
        return cls(getattr(config, "model_type", "") or "", kinds, window, softcap)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, None for full attention."""
        return self.sliding_window if self.layer_kinds[layer] == SLIDING else None

    @property
    def windows(self) -> list[int | None]:
        return [self.window(layer) for layer in range(self.num_layers)]

    @property
    def every_layer_slides(self) -> bool:
        return all(kind == SLIDING for kind in self.layer_kinds)

    @property
    def mixed(self) -> bool:
        """Local (sliding) and global layers both."""
        return SLIDING in self.layer_kinds and not self.every_layer_slides

    def compressible(self, layer: int) -> bool:
        """Whether a policy may compress the layer: every layer but a mixed model's local ones."""
        return not (self.mixed and self.layer_kinds[layer] == SLIDING)

    # --- the loaded model's modules: the one place that names their paths -------------------------------------

    @staticmethod
    def attention_modules(model) -> list:
        """Each decoder layer's attention module (``transformers``' shared layout: ``model.model.layers[i]
        .self_attn``, with ``layer_idx``, ``scaling``, ``o_proj``)."""
        return [layer.self_attn for layer in model.model.layers]

    def output_weights(self, model) -> list:
        """Each layer's attention output projection's weight (VATP-style value scores)."""
        return [module.o_proj.weight for module in self.attention_modules(model)]

    def softmaxes(self, model) -> list[LayerSoftmax]:
        """How each layer turns its logits into attention: its module's own scale (granite's multiplier, not always
        1/sqrt(d)), the model's soft-cap, the module's sinks."""
        return [
            LayerSoftmax(float(module.scaling), self.softcap, self.sinks(module))
            for module in self.attention_modules(model)
        ]

    @staticmethod
    def rotary(model):
        """The model's rotary embedding module (cos, sin of positions; its width may be part of a head)."""
        return model.model.rotary_emb

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
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            return rotary(like, positions, layer_type=self.layer_kinds[layer])
        return rotary(like, positions)

    # --- RoPE's pairing, read from the loaded model ------------------------------------------------------------

    def rotation(self, model) -> Rotation:
        """How the model's RoPE turns a head, read by turning each unit vector of a head with the model's own
        ``apply_rotary_pos_emb`` at position 1: dimension i turns towards its partner, and the dimensions that do
        not turn lie beyond the rotary width."""
        import torch

        module = self.attention_modules(model)[0]
        apply = inspect.getmodule(type(module)).apply_rotary_pos_emb
        dim = module.head_dim
        device = next(model.parameters()).device
        positions = torch.ones(1, dim, dtype=torch.long, device=device)
        cos, sin = self.rope(model, 0, torch.zeros(1, device=device), positions)
        basis = torch.eye(dim, device=device)[None, None]  # [1, 1, d, d]: d "tokens", each a unit vector
        turned = apply(basis, basis, cos.float(), sin.float())[0][0, 0].clone()  # row i: where e_i turns
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
