"""Storage formats: how a compressed cache stores its kept entries (``KVFormat``: the model's own dtype, 16 bits,
KIVI's 8/4/2-bit integers, FP8 as vLLM stores it, TurboQuant), the bytes a cache of some entries takes in one
(``CacheGeometry``, ``planned_bytes``), and how many entries a memory budget buys (``memory_plan``).

Pure arithmetic, no tensors: ``codecs/`` holds the quantizers themselves (``kivi.py``, ``fp8.py``,
``turboquant.py``), and a test holds these byte counts against the stored tensors' own sizes (docs/memory.md). A
memory budget's parsing is a budget's (``budgets.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pkvbench.cell.budgets import MEMORY_PREFIX, Budget, LayerPlan, layer_budgets
from pkvbench.config import excerpt, option_text, parse_int
from pkvbench.errors import PkvError

KV_BITS = (2, 4, 8, 16, 32)  # --kv-bits as a number: below 16 KIVI's integers, 32 only where the model computes so
QUANTIZED_BITS = (2, 4, 8)
DEFAULT_GROUP = 32  # KIVI's G: tokens per key group (per channel), channels per value group (per token)
DEFAULT_RESIDUAL = 128  # KIVI's R: the most recent entries kept at 16 bits
SIXTEEN_BITS = 2  # bytes of a value at 16 bits: scales, minima, norms, the residual, and the reference full cache
FLOAT32 = 4  # bytes of an FP8 scale and of a TurboQuant centroid

# The codecs (``codecs/``): KIVI's integers (and, at 16 bits and wider, no codec), FP8 e4m3 and e5m2, TurboQuant.
KIVI, FP8, FP8_E5M2, TURBOQUANT = "kivi", "fp8", "fp8_e5m2", "turboquant"
# The formats --kv-bits names beside its numbers: name → (codec, bits per value).
NAMED = {"fp8": (FP8, 8), "fp8_e5m2": (FP8_E5M2, 8), "tq4": (TURBOQUANT, 4), "tq3": (TURBOQUANT, 3)}
UNIT_SCALE, PROMPT_SCALE = "1", "prompt"  # an FP8 layer's scale: vLLM's default 1.0, or calculated from the prompt
# Each codec's options (``--kv-bits fp8:scale=prompt``, ``tq3:qjl=true:seed=1``): name → default; KVFormat's fields.
CODEC_OPTIONS: dict[str, dict[str, Any]] = {
    FP8: {"scale": UNIT_SCALE},
    FP8_E5M2: {"scale": UNIT_SCALE},
    TURBOQUANT: {"qjl": False, "seed": 0},
}
OPTION_CHOICES = {"scale": (UNIT_SCALE, PROMPT_SCALE)}
SEED_RANGE = (0, 2**63 - 1)


@dataclass(frozen=True)
class LayerShape:
    """One layer of per-token entries: the heads its cache holds and the values of each entry's key and of its value
    (a latent (MLA) cache: one "head", the latent as its key and the shared rotary key as its value)."""

    heads: int
    key_dim: int
    value_dim: int
    # A mixed model's local (sliding) layer's reach: the prompt entries its window can still see, all it keeps
    # (``budgets.layer_budgets``); None where a policy compresses the layer.
    reach: int | None = None

    def full_bytes(self, context_len: int) -> int:
        """Its entries of ``context_len`` tokens at 16 bits per value (a local layer: what its window sees)."""
        entries = context_len if self.reach is None else min(context_len, self.reach)
        return self.heads * entries * (self.key_dim + self.value_dim) * SIXTEEN_BITS


@dataclass(frozen=True)
class CacheGeometry:
    """The shape of a model's cache: its layers of per-token entries in depth order (a hybrid model's attention
    layers; each its own heads and sizes), and the bytes of the fixed per-sequence state its recurrent and
    convolution layers keep whatever the prompt's length (kept whole, in the dtypes the model keeps them; None
    where that is not known before the model loads)."""

    layers: tuple[LayerShape, ...]
    state_bytes: int | None = 0

    @classmethod
    def uniform(cls, layers: int, kv_heads: int, head_dim: int, local: Sequence[int | None] = ()) -> CacheGeometry:
        """``layers`` layers of ``kv_heads`` heads of ``head_dim`` values (``local``: each one's reach), no state."""
        local = tuple(local) or (None,) * layers
        return cls(tuple(LayerShape(kv_heads, head_dim, head_dim, reach) for reach in local))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def local(self) -> tuple[int | None, ...]:
        return tuple(layer.reach for layer in self.layers)

    def layer_budgets(self, policy, k: int, context_len: int) -> list[int]:
        return layer_budgets(policy, k, context_len, self.num_layers, self.local)

    def full_bytes(self, context_len: int) -> int:
        """The model's own full cache of ``context_len`` tokens at 16 bits per value (a local layer holding what its
        window sees), and the state: what memory fractions are of."""
        return sum(layer.full_bytes(context_len) for layer in self.layers) + (self.state_bytes or 0)

    def planned_bytes(self, fmt: KVFormat, per_layer: Sequence[int], heads: int | None = None) -> int:
        """Bytes of a cache whose layers keep ``per_layer`` entries in each head (``heads``: as many heads in every
        layer, one set per query head; else each layer's own), and the state."""
        entries = sum(
            fmt.layer_bytes(heads or layer.heads, layer.key_dim, [n] * (heads or layer.heads), layer.value_dim)
            for layer, n in zip(self.layers, per_layer)
        )
        return entries + (self.state_bytes or 0)


@dataclass(frozen=True)
class KVFormat:
    """How a compressed cache stores its kept entries.

    ``native``: the model's own cache at its dtype (``bits`` is the dtype's width): today's cache, token for token.
    ``bits`` 16 (where the model computes wider): every entry in 16 bits, widened for attention. ``bits`` 8/4/2:
    KIVI — per head, the last ``residual`` kept entries in 16 bits, the ones before them as packed integers, keys per
    channel in groups of ``group`` tokens, values per token in groups of ``group`` channels, each group's scale and
    minimum in 16 bits (``pkvbench.codecs.kivi``).

    ``codec`` FP8 / FP8_E5M2 (``bits`` 8): every kept entry one float8 byte a value, a float32 scale per layer for
    its keys and one for its values, 1.0 or (``scale`` PROMPT_SCALE) calculated from the prompt as vLLM's
    ``--calculate-kv-scales`` does (``pkvbench.codecs.fp8``). ``codec`` TURBOQUANT (``bits`` 4 or 3): every kept key
    and value rotated (one random rotation per layer and KV head, from ``seed``) and stored as ``bits``-bit indices
    of the Lloyd–Max codebook of a rotated coordinate, with its norm in 16 bits and each codebook in float32; with
    ``qjl`` the keys spend one of their bits on QJL's signs of the residual, stored with its norm in 16 bits
    (``pkvbench.codecs.turboquant``). New tokens, for every codec, go into the 16-bit residual."""

    bits: int
    group: int = DEFAULT_GROUP
    residual: int = DEFAULT_RESIDUAL
    native: bool = False
    codec: str = KIVI
    scale: str = UNIT_SCALE  # FP8's
    qjl: bool = False  # TurboQuant's
    seed: int = 0  # TurboQuant's

    @property
    def kivi(self) -> bool:
        """KIVI's integers: the formats ``--kv-group`` and ``--kv-residual`` shape."""
        return self.codec == KIVI and self.bits in QUANTIZED_BITS

    @property
    def quantized(self) -> bool:
        """Stored in a codec (packed), not as plain 16-bit or native values."""
        return self.kivi or self.codec != KIVI

    @property
    def name(self) -> str:
        """What ``--kv-bits`` calls the format, without its options: ``4``, ``16``, ``fp8``, ``tq3``."""
        if self.codec == KIVI:
            return str(self.bits)
        return next(name for name, kind in NAMED.items() if kind == (self.codec, self.bits))

    @property
    def spec(self) -> str:
        """What ``--kv-bits`` takes for the format: ``4``, ``fp8``, ``tq3:qjl=true`` (the options that differ from
        their defaults; KIVI's group and residual are options of their own)."""
        if self.codec == KIVI:
            return self.name
        defaults = CODEC_OPTIONS[self.codec]
        changed = [f"{k}={option_text(v)}" for k, v in self.options.items() if v != defaults[k]]
        return ":".join([self.name, *changed])

    @property
    def options(self) -> dict[str, Any]:
        """The codec's options (KIVI's group and residual are run options of their own)."""
        return {option: getattr(self, option) for option in CODEC_OPTIONS.get(self.codec, {})}

    @property
    def recent(self) -> int:
        """Each head's last kept entries that stay in 16 bits: KIVI's residual; none where every entry is packed."""
        return self.residual if self.kivi else 0

    def split(self, length: int) -> tuple[int, int]:
        """A head's ``length`` kept entries → (quantized, residual): the last ``recent`` stay in 16 bits."""
        if not self.quantized:
            return 0, length
        residual = min(self.recent, length)
        return length - residual, residual

    def layer_bytes(self, heads: int, head_dim: int, lengths: Sequence[int], value_dim: int | None = None) -> int:
        """Bytes one layer's stored tensors hold when its ``heads`` heads keep ``lengths`` entries (each head's
        count; heads that keep fewer are padded to the fullest, as stored), keys (``head_dim`` values each) and
        values (``value_dim``, default ``head_dim``) together."""
        value_dim = head_dim if value_dim is None else value_dim
        width = head_dim + value_dim
        if self.native:  # [heads, n, dim] keys and values; a layer that keeps nothing still stores one masked slot
            return heads * max(max(lengths), 1) * width * self.bits // 8
        parts = [self.split(n) for n in lengths]
        quantized, residual = max(q for q, _ in parts), max(r for _, r in parts)
        total = heads * residual * width * SIXTEEN_BITS
        return total + (self.packed_bytes(heads, head_dim, quantized, value_dim) if quantized else 0)

    def packed_bytes(self, heads: int, head_dim: int, count: int, value_dim: int | None = None) -> int:
        """Bytes of ``count`` packed entries per head of one layer, keys (``head_dim`` values) and values
        (``value_dim``, default ``head_dim``: an MLA latent's differ), with what reads them back."""
        value_dim = head_dim if value_dim is None else value_dim
        entries = heads * count
        if self.codec in (FP8, FP8_E5M2):
            return entries * (head_dim + value_dim) + 2 * FLOAT32  # a byte a value; a scale for keys, one for values
        if self.codec == TURBOQUANT:

            def indices(bits: int, dim: int) -> int:  # the codes and a norm per vector, and the codebook they index
                return entries * (dim * bits // 8 + SIXTEEN_BITS) + (1 << bits) * FLOAT32

            if not self.qjl:
                return indices(self.bits, head_dim) + indices(self.bits, value_dim)
            qjl = entries * (head_dim // 8 + SIXTEEN_BITS)  # the keys' residual signs and norm
            return indices(self.bits - 1, head_dim) + qjl + indices(self.bits, value_dim)
        return (
            entries * (head_dim + value_dim) * self.bits // 8  # packed codes of keys and values
            + 2 * heads * -(-count // self.group) * head_dim * SIXTEEN_BITS  # keys' scales and minima
            + 2 * entries * (value_dim // self.group) * SIXTEEN_BITS  # values' scales and minima
        )

    def __str__(self) -> str:
        """``4`` (KIVI's defaults), ``4 g64 r32``, ``16``, ``32``, ``fp8``, ``fp8:scale=prompt``, ``tq3:qjl=true``:
        ``spec``, and KIVI's group and residual where they differ from their defaults."""
        if not self.kivi:
            return self.spec
        extra = (f" g{self.group}" if self.group != DEFAULT_GROUP else "") + (
            f" r{self.residual}" if self.residual != DEFAULT_RESIDUAL else ""
        )
        return f"{self.bits}{extra}"


def supported_formats() -> str:
    return f"2, 4 and 8 (KIVI's integers), 16, the model's own 32, and {', '.join(NAMED)} (docs/memory.md)"


def parse_format(text: Any, what: str = "--kv-bits") -> KVFormat:
    """One ``--kv-bits`` value: a number (KIVI's bits, 16, the model's width: checked against the model by the
    caller) or a named format with its options, ``fp8:scale=prompt``, ``tq3:qjl=true:seed=7``."""
    name, *pairs = [part.strip() for part in str(text).split(":")]
    if name not in NAMED:
        bits = parse_int(name, what) if name and not any(c.isalpha() for c in name) else None
        if pairs or bits not in KV_BITS:
            raise PkvError(f"{what} {excerpt(str(text))}: supported are {supported_formats()}")
        return KVFormat(bits)
    codec, bits = NAMED[name]
    defaults = CODEC_OPTIONS[codec]
    given: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = (part.strip() for part in pair.partition("="))
        if not sep or not key or not value:
            raise PkvError(
                f"{what} {excerpt(str(text))}: {pair!r} is not of the form name=value (e.g. {_example(name)})"
            )
        if key not in defaults:
            raise PkvError(
                f"{what} {excerpt(str(text))}: {name} has no option {key!r}; its options: {', '.join(defaults)}"
            )
        if key in given:
            raise PkvError(f"{what} {excerpt(str(text))}: option {key} is given twice; give it once")
        given[key] = _option_value(key, value, defaults[key], f"{what} {name}: option {key}")
    return KVFormat(bits, codec=codec, **given)


def _example(name: str) -> str:
    codec = NAMED[name][0]
    return f"{name}:scale={PROMPT_SCALE}" if codec in (FP8, FP8_E5M2) else f"{name}:qjl=true"


def _option_value(key: str, text: str, default: Any, what: str) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise PkvError(f"{what}={excerpt(text)}: expected true or false")
        return text.lower() in ("true", "1", "yes")
    if isinstance(default, int):
        return parse_int(text, what, *SEED_RANGE)
    if text not in OPTION_CHOICES[key]:
        raise PkvError(f"{what}={excerpt(text)}: one of {', '.join(OPTION_CHOICES[key])}")
    return text


def format_of_row(bits: Any, group: Any, residual: Any, named: Any) -> KVFormat:
    """A row's storage (``kv_bits``, ``kv_group``, ``kv_residual``, and ``kv_format`` where it names a codec)."""
    if isinstance(named, str) and named:
        return parse_format(named, "kv_format")
    return KVFormat(int(bits), int(group), int(residual))


def label_width(label: str) -> float | None:
    """Bits per value of a storage label as tables show it (``4 g64 r32``, ``fp8``, ``tq3:qjl=true``), None where it
    names none (``native``)."""
    head = str(label).split(" ")[0]
    try:
        return float(parse_format(head).bits)
    except PkvError:
        return float(head) if head.replace(".", "").isdigit() else None


def largest(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest k in [low, high] with ``fits(k)``, for ``fits`` true up to some k and false after (binary
    search, then a step up while the next one fits too: a few bytes of rounding may break monotony); None if even
    ``low`` does not fit."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def planned_bytes(fmt: KVFormat, per_layer: Sequence[int], heads: int, head_dim: int) -> int:
    """Bytes of a cache whose layers keep ``per_layer`` entries in each of ``heads`` heads of ``head_dim`` values
    (``CacheGeometry.planned_bytes``: each layer its own shape, and the state)."""
    return CacheGeometry.uniform(len(per_layer), heads, head_dim).planned_bytes(fmt, per_layer)


class MemoryTooSmall(PkvError):
    """A memory budget below what a policy's smallest cache takes (its floor: window, sinks) in a format."""

    def __init__(self, budget: Budget, needed: int, full_bytes: int, what: str):
        self.needed = needed  # bytes of the smallest cache
        self.smallest = needed / full_bytes if isinstance(budget.value, float) else needed
        super().__init__(
            f"--memory {str(budget).removeprefix(MEMORY_PREFIX)}: {what} needs at least {needed} bytes "
            f"({needed / full_bytes:.4g} of the full cache)"
        )


def floor_bytes(policy, context_len: int, geometry: CacheGeometry, fmt: KVFormat, heads: int | None = None) -> int:
    """The bytes of the smallest cache ``policy`` keeps (its floor: window, sinks) in ``fmt``."""
    floor = min(max(policy.min_budget, 1), context_len)
    return geometry.planned_bytes(fmt, geometry.layer_budgets(policy, floor, context_len), heads)


def memory_plan(
    policy, budget: Budget, context_len: int, geometry: CacheGeometry, fmt: KVFormat, heads: int | None = None
) -> LayerPlan:
    """The most entries ``policy`` can keep in ``fmt`` within a memory ``budget`` (as close to it as whole entries
    allow): every layer's tensors counted (codes, scales, minima, residual, PyramidKV's per-layer budgets), and the
    state of a hybrid model's recurrent layers, kept whole. ``heads``: the cache's heads per layer where not the
    layers' own (the query heads for a policy that keeps one set per query head). Raises ``MemoryTooSmall`` when even
    the policy's floor does not fit."""
    full = geometry.full_bytes(context_len)
    target = budget.target_bytes(full)

    def cost(k: int) -> int:
        return geometry.planned_bytes(fmt, geometry.layer_budgets(policy, k, context_len), heads)

    k = largest(min(max(policy.min_budget, 1), context_len), context_len, lambda k: cost(k) <= target)
    if k is None:
        needed = floor_bytes(policy, context_len, geometry, fmt, heads)
        raise MemoryTooSmall(budget, needed, full, f"{policy.label} at {fmt} bits on {context_len} tokens")
    per_layer = geometry.layer_budgets(policy, k, context_len)
    return LayerPlan(requested=k, effective=k, per_layer=per_layer, context_len=context_len, target_bytes=target)
