"""FP8 as vLLM stores a KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``): pure tensor code, no model.

Every value x of a layer's keys (and, with their own scale, its values) is stored as one byte, the float8 number
nearest to x / s, and read back as that number times s. The formats are OCP's: **e4m3** (``torch.float8_e4m3fn``:
4 exponent bits, 3 mantissa bits, finite up to ±448, no infinities) and **e5m2** (``torch.float8_e5m2``: 5 and 2,
up to ±57344). The scale s is one float32 per layer and tensor (vLLM's per-tensor ``k_scale`` / ``v_scale``):

- **1.0** unless calibrated: vLLM's default (``calculate_kv_scales=False``);
- **calculated from the prompt** as vLLM's ``--calculate-kv-scales`` does (``Attention.calc_kv_scales``): the largest
  magnitude of the layer's keys over every head and token, divided by 200 (``K_SCALE_CONSTANT``), and of its values
  by 100 (``V_SCALE_CONSTANT``). vLLM computes them once, from the first prompt the engine runs, and keeps them;
  pkvbench computes them from each sample's own prompt (the whole prompt, before any entry is dropped).

Values beyond the format's largest finite number saturate to it (vLLM converts with ``__NV_SATFINITE``; torch's
cast to e5m2 would give an infinity). The division and the product are computed in float32, as vLLM's kernels do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

VARIANTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
KEY_RANGE = 200.0  # vLLM's K_SCALE_CONSTANT: a calculated key scale is max|k| / 200
VALUE_RANGE = 100.0  # vLLM's V_SCALE_CONSTANT: a calculated value scale is max|v| / 100


@dataclass
class Fp8:
    """The float8 bytes ``[..., T, D]`` (uint8: each value's bits) and the layer's scale (float32, one value, shaped
    ``[1, 1, 1]`` to broadcast over heads, tokens and channels)."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale


def unit_scale(device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's default scale, 1.0, as a layer stores it."""
    return torch.ones((1, 1, 1), dtype=torch.float32, device=device)


def calculated_scale(prompt: torch.Tensor, divisor: float) -> torch.Tensor:
    """A scale calculated from a layer's ``prompt`` keys or values (any shape): max |x| / ``divisor``, in float32 (1.0
    where every value is 0: no scale would make a difference)."""
    largest = prompt.detach().abs().amax().float()
    scale = torch.where(largest > 0, largest / divisor, torch.ones_like(largest))
    return scale.reshape(1, 1, 1)


def quantize(x: torch.Tensor, scale: torch.Tensor, variant: str) -> Fp8:
    """``x`` ``[..., T, D]`` stored at ``scale`` in ``variant`` (``e4m3`` or ``e5m2``)."""
    fp8 = VARIANTS[variant]
    largest = torch.finfo(fp8).max
    scaled = (x.float() / scale.reshape((1,) * x.dim())).clamp(-largest, largest)
    return Fp8(scaled.to(fp8).view(torch.uint8), scale.reshape(1, 1, 1).float())


@functools.cache
def _byte_values(variant: str, device: torch.device) -> torch.Tensor:
    """``[256]``: every float8 byte's value as float32, torch's own conversion (a byte → its value in one lookup, on
    a CPU several times faster than converting)."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(VARIANTS[variant]).float()


def dequantize(stored: Fp8, variant: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``quantize``'s values back, ``[..., T, D]`` in ``dtype`` (computed in float32, rounded once); written into
    ``out`` if given. A batch of rows ``[B, ..., T, D]`` carries a scale per row ``[B, 1, 1, 1]``."""
    values = _byte_values(variant, stored.codes.device).take(stored.codes.long())
    if out is not None and dtype == torch.float32:
        return torch.mul(values, stored.scale, out=out)
    restored = (values * stored.scale).to(dtype)
    return restored if out is None else out.copy_(restored)
