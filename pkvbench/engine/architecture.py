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

from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_attention"
ATTENTION_KINDS = (FULL, SLIDING)


@dataclass(frozen=True)
class Architecture:
    """A model's layers as the engine sees them."""

    family: str  # config.model_type
    layer_kinds: tuple[str, ...]  # per layer: FULL or SLIDING (or a kind pkvbench refuses, e.g. linear attention)
    sliding_window: int | None  # the window of the sliding layers

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
        return cls(getattr(config, "model_type", "") or "", kinds, window)

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

    @property
    def prompt_limit(self) -> int | None:
        """The longest prompt the engine prefills exactly: a compressed sliding layer's statistics assume every
        query sees the whole prompt, so a model whose every layer slides takes prompts up to its window."""
        return self.sliding_window if self.every_layer_slides else None
