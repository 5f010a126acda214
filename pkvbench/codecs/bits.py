"""Codes of any width packed into bytes: pure tensor code, shared by the stored formats.

Codes ``[..., D]`` of ``bits`` bits each are one little-endian bit stream along the last axis: code j occupies stream
bits [j·bits, (j + 1)·bits), its lowest bit first, and byte k holds stream bits [8k, 8k + 8), the first in its lowest
bit. Where ``bits`` divides 8 this is KIVI's layout (code j of a byte in bits [j·bits, (j + 1)·bits)); at 3 bits
eight codes fill three bytes and some codes straddle two.
"""

from __future__ import annotations

import functools
import math

import torch


def levels(bits: int) -> int:
    """The largest code: 2^bits − 1."""
    return (1 << bits) - 1


def _group(bits: int) -> tuple[int, int]:
    """The fewest codes that fill whole bytes, and those bytes: 8 codes in 3 bytes at 3 bits, 2 in 1 at 4."""
    codes = 8 // math.gcd(bits, 8)
    return codes, bits * codes // 8


def packed_width(count: int, bits: int) -> int:
    """Bytes of ``count`` codes of ``bits`` bits; refused unless they fill whole bytes."""
    if count * bits % 8:
        raise ValueError(f"{count} codes of {bits} bits do not fill whole bytes")
    return count * bits // 8


def _word_type(size: int) -> torch.dtype:
    return torch.uint8 if size == 1 else torch.int64  # a group of bytes read as one little-endian integer


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[..., D]`` (each below 2^bits) → bytes ``[..., D·bits/8]``: each group of codes one integer, code j
    shifted by j·bits, written out as its bytes, the lowest first."""
    *lead, count = codes.shape
    width = packed_width(count, bits)
    per_group, size = _group(bits)
    kind = _word_type(size)
    shifts = torch.arange(0, bits * per_group, bits, dtype=kind, device=codes.device)
    words = (codes.view(*lead, count // per_group, per_group).to(kind) << shifts).sum(dim=-1, dtype=kind)
    if size == 1:
        return words
    places = torch.arange(0, 8 * size, 8, dtype=kind, device=codes.device)
    return ((words[..., None] >> places) & 0xFF).to(torch.uint8).view(*lead, width)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack``: bytes ``[..., B]`` → codes ``[..., B·8/bits]`` (uint8)."""
    *lead, width = packed.shape
    per_group, size = _group(bits)
    kind = _word_type(size)
    words = packed
    if size > 1:
        places = torch.arange(0, 8 * size, 8, dtype=kind, device=packed.device)
        words = (packed.view(*lead, width // size, size).to(kind) << places).sum(dim=-1, dtype=kind)
    shifts = torch.arange(0, bits * per_group, bits, dtype=kind, device=packed.device)
    return ((words[..., None] >> shifts) & levels(bits)).to(torch.uint8).flatten(-2)


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
