"""What pkvbench must know of a model's architecture, read once from its config: the seam between the engine and
the model families.

Per layer, its attention kind, as transformers' ``cache_utils`` reads it (``config.layer_types``, else inferred:
a ``sliding_window`` makes every layer slide): ``full_attention`` or ``sliding_attention`` (the token at position p
sees positions p − window + 1 … p). How the engine treats them:

- a model whose every layer slides (Mistral-7B-v0.1; Qwen2/Qwen3 with ``use_sliding_window`` and
  ``max_window_layers`` 0) is compressed as any other; the window is applied while decoding (``sliding``);
- in a model that mixes local (sliding) and global layers, the local layers are never compressed by a policy: they
  keep their entries, counted in the row's entries and bytes, and decode under their window; the global layers are
  compressed;
- ``chunked_attention`` (Llama 4, ``attention_chunk_size``): the token at position p sees its chunk only, positions
  p − p mod chunk … p. A chunked layer is kept whole as a local layer is, and decodes under its chunk.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from pkvbench.errors import PkvError

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED)


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
    "smollm3": Family(
        "NoPE layers (no_rope_layers: every 4th layer skips RoPE)",
        "which layers rotate read from the model; un-rotation and decode-time rotation the identity on NoPE layers",
        layers="full, NoPE where no_rope_layers says so",
    ),
    "exaone4": Family(
        "q/k norms; local layers with RoPE, global layers NoPE (where sliding_window)",
        "NoPE read from the model; local layers kept whole",
        layers="local (sliding, kept whole; RoPE) and global (full; NoPE) per layer_types",
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
        "chunked layers kept whole, decoding under their chunk; NoPE, the pairing and the norm read from the model; "
        "the temperature's position from the sequence's length as transformers counts it",
        layers="chunked (kept whole; RoPE) and global (full; NoPE) per layer_types",
    ),
    "gemma4_text": Family(
        "global layers of another head size and KV heads than the local ones (global_head_dim, "
        "num_global_key_value_heads); the last layers reuse earlier layers' caches (num_kv_shared_layers)",
        "",
        refused="layers of different cache shapes, and caches shared between layers",
        layers="local and global per layer_types, of different shapes",
    ),
    "deepseek_v2": Family("multi-head latent attention (MLA)", "", refused=MLA, layers="latent (MLA)"),
    "deepseek_v3": Family("multi-head latent attention (MLA)", "", refused=MLA, layers="latent (MLA)"),
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
    kinds = set(getattr(config, "layer_types", None) or ()) - set(ATTENTION_KINDS)
    if kinds:
        raise PkvError(
            f"model {name} has {', '.join(sorted(kinds))} layers; pkvbench runs layers of kinds "
            f"{', '.join(ATTENTION_KINDS)} only (per-token keys and values)"
        )


@dataclass(frozen=True)
class Architecture:
    """A model's layers as the engine sees them: what the decoder, its cuts and the statistics need of the model."""

    family: str  # config.model_type
    layer_kinds: tuple[str, ...]  # per layer: FULL, SLIDING or CHUNKED (or a kind pkvbench refuses, e.g. linear)
    sliding_window: int | None  # the window of the sliding layers
    softcap: float | None = None  # attn_logit_softcapping (Gemma 2): logits become softcap·tanh(logits / softcap)
    kv_heads: int = 0  # the heads of the keys and values the model hands its cache
    query_heads: int = 0
    chunk: int | None = None  # the chunk of the chunked layers (Llama 4's attention_chunk_size)
    # Read from the loaded model (``of_model``): each layer's softmax, and how its RoPE turns a head.
    softmaxes: tuple[LayerSoftmax, ...] = ()
    rotation: Rotation | None = None

    @classmethod
    def of_model(cls, model) -> Architecture:
        """From a loaded model: its config's facts, and what its modules do."""
        architecture = cls.of(model.config)
        return dataclasses.replace(
            architecture, softmaxes=tuple(architecture._softmaxes(model)), rotation=architecture._rotation(model)
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
        if SLIDING not in kinds:
            window = None
        softcap = getattr(config, "attn_logit_softcapping", None)
        chunk = getattr(config, "attention_chunk_size", None) if CHUNKED in kinds else None
        query_heads = getattr(config, "num_attention_heads", 0)
        kv_heads = getattr(config, "num_key_value_heads", None) or query_heads
        return cls(getattr(config, "model_type", "") or "", kinds, window, softcap, kv_heads, query_heads, chunk)

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def window(self, layer: int) -> int | None:
        """How far back the layer's tokens see: its sliding window, or its chunk (a chunked layer); None for full
        attention."""
        return {SLIDING: self.sliding_window, CHUNKED: self.chunk}.get(self.layer_kinds[layer])

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
        """Whether a policy may compress the layer: every layer but a mixed model's local ones and chunked ones."""
        kind = self.layer_kinds[layer]
        return not (self.mixed and kind == SLIDING) and kind != CHUNKED

    # --- the loaded model's modules: the one place that names their paths -------------------------------------

    @staticmethod
    def attention_modules(model) -> list:
        """Each decoder layer's attention module (``transformers``' shared layout: ``model.model.layers[i]
        .self_attn``, with ``layer_idx``, ``scaling``, ``o_proj``)."""
        return [layer.self_attn for layer in model.model.layers]

    def output_weights(self, model) -> list:
        """Each layer's attention output projection's weight (VATP-style value scores)."""
        return [module.o_proj.weight for module in self.attention_modules(model)]

    def _softmaxes(self, model) -> list[LayerSoftmax]:
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

    # --- how each layer rotates, read from the loaded model ----------------------------------------------------

    def _rotation(self, model) -> Rotation:
        """How each layer's RoPE turns a head, read from what the model does (``_watch_rotary``): a layer whose
        attention never calls a rotary function is NoPE (SmolLM3's ``no_rope_layers``, Exaone 4's global layers,
        Llama 4's every 4th), whatever its config says; a layer whose kernel gets other queries than the function
        gave has a norm after RoPE (Hunyuan: ``_scale_after_rotation``). Then the function turns each unit vector of
        a head at position 1: dimension i turns towards its partner (the pairing), and the dimensions that do not turn
        lie beyond the rotary width."""
        import torch

        modules = self.attention_modules(model)
        calls, kernel_queries = _watch_rotary(model, modules, self._softmaxes(model))
        dim = modules[0].head_dim
        rotates = tuple(layer in calls for layer in range(len(modules)))
        if not calls:
            return Rotation(interleaved=False, width=0, dim=dim, rotates=rotates)
        first = calls[min(calls)]
        with torch.inference_mode():
            scales = tuple(
                _scale_after_rotation(modules[layer], calls[layer], kernel_queries.get(layer), layer)
                if layer in calls
                else None
                for layer in range(len(modules))
            )
        rotation = Rotation(False, dim, dim, rotates, scales, first.function, first.heads_axis)
        device = next(model.parameters()).device
        positions = torch.ones(1, dim, dtype=torch.long, device=device)
        embedding = self.rope(model, min(calls), torch.zeros(1, device=device), positions)
        basis = torch.eye(dim, device=device)[None, None]  # [1, 1, d, d]: d "tokens", each a unit vector
        turned = rotation.turn(basis, embedding)[0, 0].clone()  # row i: where e_i turns
        turned.fill_diagonal_(0.0)
        moving = turned.abs().sum(dim=-1) > 0
        width = int(moving.nonzero().max()) + 1 if bool(moving.any()) else 0
        interleaved = width > 2 and int(turned[0].abs().argmax()) == 1
        return dataclasses.replace(rotation, interleaved=interleaved, width=width)

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
    (transformers' ``rotate_half``: llama and most) or, ``interleaved``, 2i with 2i + 1 (Cohere, GLM); the dimensions
    beyond pass as they are (Phi-3's partial RoPE). ``rotates``: per layer, whether it rotates at all (a NoPE layer
    does not); ``scales``: per layer, a norm's weights after RoPE; ``function``: the model's own rotary function,
    taking queries with their heads on ``heads_axis``."""

    interleaved: bool
    width: int
    dim: int = 0  # the head size
    rotates: tuple[bool, ...] = ()
    scales: tuple = field(default=(), compare=False)  # per layer: a norm's weights [d] after RoPE, or None
    function: Callable | None = field(default=None, compare=False)
    heads_axis: int = 1

    def scale(self, layer: int):
        """Layer ``layer``'s weights of a norm after RoPE ``[d]``, or None."""
        return self.scales[layer] if self.scales else None

    def turn(self, x, embedding):
        """``x`` ``[1, k, n, d]`` turned by the model's own rotary function with ``embedding`` (what its rotary module
        gives for the n positions: cos and sin, or Llama 4's complex frequencies)."""
        arguments = embedding if isinstance(embedding, tuple) else (embedding,)
        laid = x if self.heads_axis == 1 else x.transpose(1, 2)
        turned = self.function(laid, laid, *arguments)[0]
        return turned if self.heads_axis == 1 else turned.transpose(1, 2)

    def tables(self, embedding, layer: int, count: int):
        """Layer ``layer``'s cos and sin ``[count, width]`` (float32) at the ``count`` positions ``embedding`` is of,
        as the model's own function applies them, whatever layout its rotary module gives them in (one entry per
        pair: gpt-oss; the first half spread over the pairs: GLM, Helium, Ernie 4.5; complex: Llama 4): read by
        turning two vectors, 1 and σ (σᵢ = ±1 as ``rotate_half`` signs dimension i), which gives
        y₁ = c + σ·s and y₂ = σ·c − s. A NoPE layer: the identity (cos 1, sin 0)."""
        import torch

        device = _device_of(embedding)
        if not self.rotates[layer]:
            width = self.width or self.dim
            return torch.ones(count, width, device=device), torch.zeros(count, width, device=device)
        from pkvbench.engine.attention import rotate_half

        ones = torch.ones(self.dim, device=device)
        signs = ones.clone()
        signs[: self.width] = rotate_half(ones[: self.width], self.interleaved)
        probes = torch.stack([ones, signs])[None, :, None].expand(1, 2, count, self.dim).contiguous()
        first, second = self.turn(probes, embedding)[0].float()
        signs = signs[: self.width]
        first, second = first[:, : self.width], second[:, : self.width] * signs
        return (first + second) / 2, signs * (first - second) / 2


def _device_of(embedding):
    return (embedding[0] if isinstance(embedding, tuple) else embedding).device


@dataclass(frozen=True)
class _RotaryCall:
    """A layer's call of its model's rotary function: the function, the axis its queries' heads lie on (1, or 2 for
    Llama 4's), and the queries it gave ``[batch, heads, n, d]``."""

    function: Callable
    heads_axis: int
    turned: object


def _watch_rotary(model, modules, softmaxes) -> tuple[dict[int, _RotaryCall], dict]:
    """One forward pass over a few tokens, watching the rotary functions of the model's modeling module
    (``apply_rotary*``) and the queries each layer's kernel gets (``attention.recording``; ``softmaxes``: the
    layers'): per layer that calls one, its call; per layer, its kernel's queries."""
    import torch

    from pkvbench.engine.attention import Recorder, recording  # (attention imports this module)

    class KernelQueries(Recorder):
        def __init__(self):
            self.softmaxes, self.queries = softmaxes, {}

        def observe(self, layer_idx, query, key, logsumexp=None):
            self.queries[layer_idx] = query

    modeling = inspect.getmodule(type(modules[0]))
    names = [name for name, value in vars(modeling).items() if name.startswith("apply_rotary") and callable(value)]
    layer_of = {id(module): index for index, module in enumerate(modules)}
    current: list[int] = []
    calls: dict[int, _RotaryCall] = {}
    heads = model.config.num_attention_heads

    def watched(function):
        def spy(query, *args, **kwargs):
            turned = function(query, *args, **kwargs)
            if current and current[-1] not in calls:
                axis = 1 if query.shape[1] == heads else 2
                calls[current[-1]] = _RotaryCall(function, axis, turned[0] if axis == 1 else turned[0].transpose(1, 2))
            return turned

        return spy

    def enter(module, _):
        current.append(layer_of[id(module)])

    def leave(*_):
        current.pop()

    hooks = [module.register_forward_pre_hook(enter) for module in modules]
    hooks += [module.register_forward_hook(leave) for module in modules]
    originals = {name: getattr(modeling, name) for name in names}
    count = heads + 3  # tokens: never the number of heads, so the layout is plain
    kernel = KernelQueries()
    try:
        for name, function in originals.items():
            setattr(modeling, name, watched(function))
        device = next(model.parameters()).device
        with torch.inference_mode(), recording(kernel):
            model(input_ids=torch.arange(1, count + 1, device=device)[None], use_cache=False)
    finally:
        for name, function in originals.items():
            setattr(modeling, name, function)
        for hook in hooks:
            hook.remove()
    return calls, kernel.queries


def _scale_after_rotation(module, call: _RotaryCall, kernel_query, layer: int):
    """The weights ``[d]`` of a norm a layer applies to its queries after RoPE (Hunyuan's ``query_layernorm``:
    w ⊙ x / rms(x)), found among the attention module's own submodules as the one that turns what the rotary function
    gave into what the kernel got; None where the kernel gets the function's queries as they are. A norm over the
    head commutes with RoPE up to its weights (rms(R x) = rms(x)): un-rotating divides them out first
    (``Rotation.unrotate``). Anything else after RoPE is refused, in one line."""
    import torch

    turned = call.turned
    if kernel_query is None or kernel_query.shape != turned.shape or torch.equal(kernel_query, turned):
        return None
    tolerance = {"atol": 1e-4, "rtol": 1e-3} if turned.dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for child in module.children():
        if isinstance(child, torch.nn.Linear):
            continue
        laid = turned if call.heads_axis == 1 else turned.transpose(1, 2)
        try:
            normed = child(laid)
        except (TypeError, RuntimeError):
            continue
        normed = normed if call.heads_axis == 1 else normed.transpose(1, 2)
        if normed.shape != kernel_query.shape or not torch.allclose(normed, kernel_query, **tolerance):
            continue
        scale = child(torch.ones_like(laid[..., :1, :1, :])).flatten().float()
        weighted = scale * turned.float()  # a norm over the head: the kernel's queries are c·w ⊙ x, c per token
        factor = (weighted * kernel_query.float()).sum(-1, keepdim=True) / (weighted * weighted).sum(-1, keepdim=True)
        if torch.allclose(factor * weighted, kernel_query.float(), **tolerance):
            return scale
    raise PkvError(
        f"layer {layer}'s attention changes its queries after RoPE in a way pkvbench cannot undo (not a norm over "
        "the head); not supported"
    )
