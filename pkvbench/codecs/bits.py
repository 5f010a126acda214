"""Codes of any width packed into bytes: pure tensor code, shared by the stored formats.

Codes ``[..., D]`` of ``bits`` bits each are one little-endian bit stream along the last axis: code j occupies stream
bits [j·bits, (j + 1)·bits), its lowest bit first, and byte k holds stream bits [8k, 8k + 8), the first in its lowest
bit. Where ``bits`` divides 8 this is KIVI's layout (code j of a byte in bits [j·bits, (j + 1)·bits)); at 3 bits
eight codes fill three bytes and some codes straddle two.
"""

from __future__ import annotations

import functools

import torch


def levels(bits: int) -> int:
    """The largest code: 2^bits − 1."""
    return (1 << bits) - 1


def _weights(count: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << i for i in range(count)], dtype=torch.uint8, device=device)


def packed_width(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits; refused unless they fill whole bytes."""
    if count * bits % 8:
        raise ValueError(f"{count} codes of {bits} bits do not fill whole bytes")
    return count * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (each below 2^bits) → bytes ``[..., D·bits/8]``."""
    *lead, count = codes.shape
    width = packed_width(count, bits)
    codes = codes.to(torch.uint8)
    if 8 % bits == 0:  # whole codes to a byte: shift each into place and add
        grouped = codes.view(*lead, width, 8 // bits)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)
    stream = (codes[..., None] >> torch.arange(bits, dtype=torch.uint8, device=codes.device)) & 1
    return (stream.view(*lead, width, 8) * _weights(8, codes.device)).sum(dim=-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack``: bytes ``[..., B]`` → codes ``[..., B·8/bits]`` (uint8)."""
    *lead, width = packed.shape
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed[..., None] >> shifts) & levels(bits)).flatten(-2)
    stream = (packed[..., None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    per_code = stream.view(*lead, width * 8 // bits, bits)
    return (per_code * _weights(bits, packed.device)).sum(dim=-1, dtype=torch.uint8)


@functools.cache
def _byte_table(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 / bits]``: the codes of every byte, as floats (a byte → its codes in one lookup)."""
    return unpack(torch.arange(256, dtype=torch.uint8, device=device)[:, None], bits).float()


def codes_as_floats(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed bytes ``[..., B]`` → their codes as float32 ``[..., B·8/bits]``. Where ``bits`` divides 8 a table
    lookup per byte, which reads and writes each value once (unpacking with shifts and then converting reads them
    three times)."""
    if 8 % bits:
        return unpack(packed, bits).float()
    return torch.nn.functional.embedding(packed.long(), _byte_table(bits, packed.device)).flatten(-2)
