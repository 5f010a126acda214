"""KIVI's quantizer (Liu et al., ICML 2024; jy-yuan/KIVI ``quant/new_pack.py``): pure tensor code, no model.

Asymmetric min–max integers of ``bits`` bits (2, 4 or 8): a group of values with minimum m and maximum M is stored
as codes c = round((x − m) / s), s = (M − m) / (2^bits − 1), clamped to [0, 2^bits − 1], and read back as c·s + m.
**Keys** are quantized per channel, in groups of ``group`` consecutive tokens (outlier channels keep their own
scale); **values** per token, in groups of ``group`` consecutive channels. Each group's scale and minimum are stored
in 16 bits. Codes are packed along the channel axis, 8 / bits to a byte, the first code in the lowest bits
(``codecs/bits.py``).

Where pkvbench differs from KIVI's code, and why:
- KIVI requires whole groups of keys (T a multiple of G); here the last group of tokens may be shorter (its own
  minimum and maximum), so a kept set of any size can be stored.
- KIVI computes in float16 throughout. Here minima and scales are computed in float32 and rounded to the 16-bit
  storage type *outwards* (the minimum down, the scale up), then the codes are computed from the stored values: so
  every group's range fits its 2^bits − 1 steps and each dequantized value is within half a step of the original,
  which rounding to nearest cannot promise at 8 bits (255 steps of a scale rounded down overshoot the maximum).
- A group whose values are all equal has scale 0: its codes are 0 and it reads back as its minimum (KIVI divides by
  zero there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkvbench.codecs.bits import codes_as_floats, levels, pack


def round_outward(values: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """``values`` (float32) in the 16-bit ``dtype``, rounded toward −∞ (``down``) or +∞ rather than to nearest: the
    nearest value, stepped one unit in the last place where it fell on the wrong side."""
    nearest = values.to(dtype)
    wrong = nearest.float() > values if down else nearest.float() < values
    if not bool(wrong.any()):
        return nearest
    bits = nearest.view(torch.int16)
    # In sign–magnitude order, one step away from zero is +1 on the integer view, one step toward it −1; from ±0
    # the next value is the smallest subnormal of the wanted sign.
    away = (nearest < 0) if down else (nearest > 0)
    toward = (nearest > 0) if down else (nearest < 0)
    smallest = torch.tensor(-32767 if down else 1, dtype=torch.int16, device=values.device)  # 0x8001 / 0x0001
    stepped = torch.where(away, bits + 1, torch.where(toward, bits - 1, smallest)).view(dtype)
    return torch.where(wrong, stepped, nearest)


@dataclass
class Quantized:
    """Packed codes ``[..., T, D·bits/8]`` (uint8) with their groups' ``scale`` and ``minimum`` (16-bit): keys'
    ``[..., ceil(T/G), D]``, values' ``[..., T, D/G]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.codes, self.scale, self.minimum


def _quantize_groups(groups: torch.Tensor, bits: int, dtype: torch.dtype, axis: int) -> tuple[torch.Tensor, ...]:
    """Min–max codes of ``groups`` (float32), each group spanning ``axis``: (codes as stored values' integers,
    scale, minimum), the last two in ``dtype`` with ``axis`` kept as size 1."""
    minimum = round_outward(groups.amin(dim=axis, keepdim=True), dtype, down=True)
    spread = groups.amax(dim=axis, keepdim=True) - minimum.float()
    scale = round_outward(spread / levels(bits), dtype, down=False)
    step = scale.float()
    codes = ((groups - minimum.float()) / torch.where(step > 0, step, 1.0)).round().clamp(0, levels(bits))
    return codes.to(torch.uint8), scale, minimum


def quantize_keys(keys: torch.Tensor, bits: int, group: int, dtype: torch.dtype) -> Quantized:
    """Keys ``[..., T, D]``: per channel, in groups of ``group`` consecutive tokens (the last group may be shorter)."""
    *lead, length, dim = keys.shape
    count = -(-length // group)
    padded = keys.float()
    if count * group != length:  # repeat the last token: a group's minimum and maximum stay its own tokens'
        padded = torch.cat([padded, padded[..., -1:, :].expand(*lead, count * group - length, dim)], dim=-2)
    codes, scale, minimum = _quantize_groups(padded.view(*lead, count, group, dim), bits, dtype, axis=-2)
    codes = codes.view(*lead, count * group, dim)[..., :length, :]
    return Quantized(pack(codes, bits), scale.squeeze(-2), minimum.squeeze(-2))


def quantize_values(values: torch.Tensor, bits: int, group: int, dtype: torch.dtype) -> Quantized:
    """Values ``[..., T, D]``: per token, in groups of ``group`` consecutive channels (``group`` divides D)."""
    *lead, length, dim = values.shape
    if dim % group:
        raise ValueError(f"a group of {group} channels does not divide the head size {dim}")
    codes, scale, minimum = _quantize_groups(values.float().view(*lead, length, dim // group, group), bits, dtype, -1)
    return Quantized(pack(codes.view(*lead, length, dim), bits), scale.squeeze(-1), minimum.squeeze(-1))


def dequantize_keys(
    stored: Quantized, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``quantize_keys``'s keys back, ``[..., T, D]`` in ``dtype`` (computed in float32, rounded once). With ``out``
    (``[..., ceil(T/G)·G, D]``, e.g. a slice of the buffer attention reads) they are written there, and the columns
    past T are the last group's padding."""
    packed = stored.codes
    *lead, length, _ = packed.shape
    count = stored.scale.shape[-2]
    if count * group != length:  # whole groups to multiply by their scale
        packed = torch.nn.functional.pad(packed, (0, 0, 0, count * group - length))
    codes = codes_as_floats(packed, bits)
    dim = codes.shape[-1]
    grouped = codes.view(*lead, count, group, dim)
    scale, minimum = stored.scale[..., None, :].float(), stored.minimum[..., None, :].float()
    if out is None or dtype != torch.float32:
        restored = torch.addcmul(minimum, grouped, scale).view(*lead, count * group, dim)
        return restored[..., :length, :].to(dtype) if out is None else out.copy_(restored)
    torch.addcmul(minimum, grouped, scale, out=out.view(*lead, count, group, dim))
    return out


def dequantize_values(
    stored: Quantized, bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``quantize_values``'s values back, ``[..., T, D]`` in ``dtype`` (written into ``out`` if given)."""
    codes = codes_as_floats(stored.codes, bits)
    *lead, length, dim = codes.shape
    grouped = codes.view(*lead, length, dim // group, group)
    scale, minimum = stored.scale[..., None].float(), stored.minimum[..., None].float()
    if out is None or dtype != torch.float32:
        restored = torch.addcmul(minimum, grouped, scale).view(*lead, length, dim)
        return restored.to(dtype) if out is None else out.copy_(restored)
    torch.addcmul(minimum, grouped, scale, out=out.view(*lead, length, dim // group, group))
    return out
