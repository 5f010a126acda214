"""KIVI's quantizer on hand-made tensors: against a longhand transcription of its formulas, packing, error bounds."""

import pytest
import torch

from pkvbench.codecs.kivi import (
    dequantize_keys,
    dequantize_values,
    levels,
    pack,
    quantize_keys,
    quantize_values,
    round_outward,
    unpack,
)


def kivi_longhand(rows: list[list[float]], bits: int) -> tuple[list[int], float, float]:
    """KIVI's formulas (jy-yuan/KIVI quant/new_pack.py), one group at a time, written out: mn = min, mx = max,
    scale = (mx − mn) / (2^bits − 1), code = round(clamp((x − mn) / scale, 0, 2^bits − 1))."""
    flat = [x for row in rows for x in row]
    mn, mx = min(flat), max(flat)
    scale = (mx - mn) / (2**bits - 1)
    codes = [round(min(max((x - mn) / scale, 0), 2**bits - 1)) if scale else 0 for x in flat]
    return codes, scale, mn


def planted(shape, bits, group, axis, seed=0):
    """Values whose every group holds codes 0 and 2^bits − 1 exactly, plus values off the grid by less than a
    quarter step, on scales and minima that 16 bits hold exactly: KIVI's formulas give exact codes on them."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, levels(bits) + 1, shape, generator=generator)
    offsets = (torch.rand(shape, generator=generator) - 0.5) * 0.4  # in steps
    tokens, channels = shape
    groups = range(0, tokens if axis == 0 else channels, group)
    scale = torch.zeros(shape)
    minimum = torch.zeros(shape)
    for number, start in enumerate(groups):
        span = slice(start, start + group)
        step, base = 2.0 ** (-(number % 3)), float(number - 2)
        if axis == 0:  # keys: a group of tokens, per channel
            codes[start, :], codes[min(start + group, tokens) - 1, :] = 0, levels(bits)
            offsets[start, :] = offsets[min(start + group, tokens) - 1, :] = 0
            scale[span], minimum[span] = step, base
        else:  # values: a group of channels, per token
            codes[:, start], codes[:, start + group - 1] = 0, levels(bits)
            offsets[:, start] = offsets[:, start + group - 1] = 0
            scale[:, span], minimum[:, span] = step, base
    return minimum + scale * (codes + offsets).clamp(0, levels(bits)), codes


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("tokens", [32, 37, 5])  # whole groups, a last group of 5, a prompt shorter than a group
def test_keys_per_channel_in_groups_of_tokens_follow_kivi_longhand(bits, tokens):
    group, channels = 16, 8
    x, codes = planted((tokens, channels), bits, group, axis=0)
    stored = quantize_keys(x[None], bits, group, torch.float16)
    got = unpack(stored.codes, bits)[0]
    assert torch.equal(got.long(), codes)
    for number, start in enumerate(range(0, tokens, group)):
        for channel in range(channels):
            column = x[start : start + group, channel].tolist()
            expected, scale, mn = kivi_longhand([column], bits)
            assert got[start : start + group, channel].tolist() == expected
            assert stored.scale[0, number, channel].item() == scale
            assert stored.minimum[0, number, channel].item() == mn
    assert stored.scale.dtype == stored.minimum.dtype == torch.float16
    assert stored.scale.shape == (1, -(-tokens // group), channels)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_per_token_in_groups_of_channels_follow_kivi_longhand(bits):
    group, tokens, channels = 8, 7, 32
    x, codes = planted((tokens, channels), bits, group, axis=1)
    stored = quantize_values(x[None], bits, group, torch.float16)
    got = unpack(stored.codes, bits)[0]
    assert torch.equal(got.long(), codes)
    for token in range(tokens):
        for number, start in enumerate(range(0, channels, group)):
            expected, scale, mn = kivi_longhand([x[token, start : start + group].tolist()], bits)
            assert got[token, start : start + group].tolist() == expected
            assert stored.scale[0, token, number].item() == scale
            assert stored.minimum[0, token, number].item() == mn


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trips_and_puts_the_first_code_in_the_low_bits(bits):
    codes = torch.randint(0, levels(bits) + 1, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).item() == 1 | 2 << 2 | 3 << 4
    assert pack(torch.tensor([9, 4], dtype=torch.uint8), 4).item() == 9 | 4 << 4


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_value_comes_back_within_half_a_step_of_its_group(bits, dtype):
    """Up to float32's rounding of the arithmetic (a part in 10⁴ of a step here)."""
    generator = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 45, 64, generator=generator) * torch.logspace(-3, 2, 64)  # channels of every magnitude
    x[..., 5] = 0.75  # a constant channel that 16 bits hold: scale 0, read back exactly
    keys = quantize_keys(x, bits, 16, dtype)
    key_step = keys.scale.float().repeat_interleave(16, dim=-2)[..., :45, :]
    assert ((dequantize_keys(keys, bits, 16, torch.float32) - x).abs() <= key_step / 2 * (1 + 1e-4)).all()
    assert (keys.scale[..., 5] == 0).all() and (dequantize_keys(keys, bits, 16, torch.float32)[..., 5] == 0.75).all()
    values = quantize_values(x, bits, 16, dtype)
    value_step = values.scale.float().repeat_interleave(16, dim=-1)
    assert ((dequantize_values(values, bits, 16, torch.float32) - x).abs() <= value_step / 2 * (1 + 1e-4)).all()


def test_minima_round_down_and_scales_up_to_16_bits():
    values = torch.tensor([0.1, -0.1, 0.0, 1e-9, -1e-9, 3.0])
    down = round_outward(values, torch.float16, down=True)
    up = round_outward(values, torch.float16, down=False)
    assert (down.float() <= values).all() and (up.float() >= values).all()
    assert (up.float() - down.float() <= values.abs() * 2**-9 + 2**-23).all()  # neighbours, not further
    assert down[5].item() == up[5].item() == 3.0  # exact values stay
