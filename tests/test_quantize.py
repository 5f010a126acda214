"""The codecs on hand-made tensors: KIVI's quantizer against a longhand transcription of its formulas, packing, error
bounds; FP8 against torch's own float8 round trip; TurboQuant against the paper's distortion bounds."""

import math

import pytest
import torch

from pkvbench.codecs import fp8, turboquant
from pkvbench.codecs.bits import levels, pack, unpack
from pkvbench.codecs.kivi import dequantize_keys, dequantize_values, quantize_keys, quantize_values, round_outward


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


# --- packing codes of any width ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_codes_of_any_width_round_trip_as_one_little_endian_bit_stream(bits):
    codes = torch.randint(0, levels(bits) + 1, (2, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (2, 5, 64 * bits // 8) and torch.equal(unpack(packed, bits), codes)
    stream = sum(int(code) << (bits * j) for j, code in enumerate(codes[0, 0].tolist()))
    assert packed[0, 0].tolist() == list(stream.to_bytes(64 * bits // 8, "little"))
    with pytest.raises(ValueError, match="do not fill whole bytes"):
        pack(codes[..., :7], 3)


# --- FP8, as vLLM stores it -------------------------------------------------------------------------------------------


def float8_longhand(byte: int, variant: str) -> float:
    """An OCP float8 byte read by hand: sign, exponent, mantissa (e4m3fn: bias 7, no infinities, S.1111.111 NaN;
    e5m2: bias 15, IEEE-like)."""
    exponent_bits, mantissa_bits = (4, 3) if variant == "e4m3" else (5, 2)
    bias = (1 << (exponent_bits - 1)) - 1
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = byte & ((1 << mantissa_bits) - 1)
    if exponent == 0:  # subnormal
        return sign * mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    return sign * (1 + mantissa / (1 << mantissa_bits)) * 2.0 ** (exponent - bias)


@pytest.mark.parametrize("variant", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, "calculated"])
def test_fp8_storage_is_torchs_own_float8_round_trip_of_the_same_values_and_scale(variant, scale):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, 64, generator=generator) * torch.logspace(-4, 1.5, 64)  # subnormals to tens
    scale = fp8.unit_scale() if scale == 1.0 else fp8.calculated_scale(x, fp8.KEY_RANGE)
    stored = fp8.quantize(x, scale, variant)
    assert stored.codes.dtype == torch.uint8 and stored.codes.shape == x.shape and stored.scale.dtype == torch.float32
    own = (x / scale).to(fp8.VARIANTS[variant])  # torch's cast: to nearest, ties to even
    assert torch.equal(stored.codes, own.view(torch.uint8))
    assert torch.equal(fp8.dequantize(stored, variant, torch.float32), own.float() * scale)
    # and the bytes are OCP's float8, read by hand
    sample = stored.codes.flatten()[::97]
    restored = fp8.dequantize(fp8.Fp8(sample, fp8.unit_scale()), variant, torch.float32).flatten()
    assert restored.tolist() == [float8_longhand(int(b), variant) for b in sample]


@pytest.mark.parametrize("variant,largest", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_fp8_saturates_beyond_its_largest_finite_value_as_vllm_converts(variant, largest):
    x = torch.tensor([[[1e6, -1e6, largest * 1.5, 1.0]]])
    restored = fp8.dequantize(fp8.quantize(x, fp8.unit_scale(), variant), variant, torch.float32)
    assert restored.flatten().tolist() == [largest, -largest, largest, 1.0]


def test_a_calculated_fp8_scale_is_the_largest_magnitude_over_vllms_divisors():
    keys = torch.tensor([[[0.5, -30.0], [2.0, 4.0]]])
    assert fp8.calculated_scale(keys, fp8.KEY_RANGE).item() == pytest.approx(30.0 / 200)
    assert fp8.calculated_scale(keys, fp8.VALUE_RANGE).item() == pytest.approx(30.0 / 100)
    assert fp8.calculated_scale(torch.zeros(2, 3), fp8.KEY_RANGE).item() == 1.0
    assert fp8.calculated_scale(keys, fp8.KEY_RANGE).shape == (1, 1, 1)


# --- TurboQuant -------------------------------------------------------------------------------------------------------

# The paper's figures (arXiv 2504.19874): Theorem 1, D_mse ≤ √3·π/2 · 4^(−b) for a unit vector, with the finer values
# D_mse ≈ 0.36, 0.117, 0.03, 0.009 at b = 1…4; Theorem 2, D_prod ≤ √3·π² · ‖y‖²/d · 4^(−b); the codebooks at 1 and 2
# bits for a large d, ±√(2/π)/√d and ±0.453/√d, ±1.51/√d.
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


def mse_bound(bits: int) -> float:
    return math.sqrt(3) * math.pi / 2 * 4.0**-bits


def prod_bound(bits: int, dim: int) -> float:
    return math.sqrt(3) * math.pi**2 / dim * 4.0**-bits


def unit_vectors(count: int, dim: int = 64, heads: int = 2, seed: int = 0) -> torch.Tensor:
    x = torch.randn(heads, count, dim, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def test_the_codebook_is_lloyd_max_for_a_rotated_coordinate_as_the_paper_derives():
    dim = 128
    one, two = turboquant.codebook(dim, 1) * math.sqrt(dim), turboquant.codebook(dim, 2) * math.sqrt(dim)
    assert one.tolist() == pytest.approx([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], rel=0.01)
    assert two.tolist() == pytest.approx([-1.51, -0.453, 0.453, 1.51], rel=0.01)
    for dim in (64, 128):
        for bits in (1, 2, 3, 4):
            table = turboquant.codebook(dim, bits)
            assert table.shape == (2**bits,) and bool((table.diff() > 0).all())
            assert torch.allclose(table, -table.flip(0), atol=1e-4 / math.sqrt(dim))  # the density is symmetric
            # the expected error of a unit vector, d · C(f_X, b): the paper's finer values, within its Theorem 1
            error = turboquant.expected_error(dim, bits)
            assert error == pytest.approx(PAPER_MSE[bits], rel=0.15) and error <= mse_bound(bits)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_turboquant_mse_on_random_unit_vectors_is_the_codebooks_and_within_theorem_1(bits):
    x = unit_vectors(4000)
    rotation = turboquant.rotations(64, 2, seed=0, layer=0)
    stored = turboquant.quantize(x, bits, rotation, torch.float16)
    error = (turboquant.dequantize(stored, rotation, torch.float32) - x).square().sum(-1).mean().item()
    assert error == pytest.approx(turboquant.expected_error(64, bits), rel=0.05)
    assert error <= mse_bound(bits)


def test_turboquant_keeps_a_vectors_length_and_a_zero_vector_stays_zero():
    x = unit_vectors(10) * torch.tensor([0.0, 7.5])[:, None, None]
    rotation = turboquant.rotations(64, 2, seed=1, layer=3)
    restored = turboquant.dequantize(turboquant.quantize(x, 4, rotation, torch.float16), rotation, torch.float32)
    assert torch.equal(restored[0], torch.zeros(10, 64))
    relative = (restored[1] - x[1]).norm(dim=-1) / 7.5
    assert bool((relative < 0.2).all())


def test_rotations_are_orthogonal_seeded_and_their_own_per_layer_and_head():
    first = turboquant.rotations(64, 3, seed=0, layer=0)
    assert torch.allclose(first @ first.transpose(-1, -2), torch.eye(64).expand(3, -1, -1), atol=1e-5)
    assert torch.equal(first, turboquant._random_matrices(64, 3, 0, 0, "rotation", "cpu").clone())
    again = turboquant._random_matrices.__wrapped__(64, 3, 0, 0, "rotation", "cpu")  # drawn anew from the seed
    assert torch.equal(first, again)
    assert not torch.allclose(first[0], first[1])
    for other in (turboquant.rotations(64, 3, seed=0, layer=1), turboquant.rotations(64, 3, seed=1, layer=0)):
        assert not torch.allclose(first, other)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_qjl_makes_inner_products_unbiased_within_theorem_2(bits):
    """The MSE quantizer shrinks inner products (a slope below 1); TurboQuant_prod's are unbiased (slope 1) and their
    squared error is within Theorem 2's bound."""
    dim, x = 64, unit_vectors(3000, heads=1)
    y = torch.randn(1, 50, dim, generator=torch.Generator().manual_seed(9))
    rotation = turboquant.rotations(dim, 1, seed=0, layer=0)
    projection = turboquant.projections(dim, 1, seed=0, layer=0)
    exact = (x[0] @ y[0].T).flatten()

    def slope_and_error(restored):
        estimate = (restored[0] @ y[0].T).flatten()
        slope = float((estimate * exact).sum() / exact.square().sum())
        return slope, float((estimate - exact).square().mean() / y.square().sum(-1).mean())

    mse = turboquant.dequantize(turboquant.quantize(x, bits - 1, rotation, torch.float16), rotation, torch.float32)
    prod = turboquant.quantize(x, bits, rotation, torch.float16, projection)
    assert prod.bits == bits - 1 and prod.signs.shape == (1, 3000, dim // 8)
    prod_slope, prod_error = slope_and_error(turboquant.dequantize(prod, rotation, torch.float32, projection))
    mse_slope, _ = slope_and_error(mse)
    assert mse_slope < 0.99 and prod_slope == pytest.approx(1.0, abs=0.03)
    assert prod_error <= prod_bound(bits, dim)
