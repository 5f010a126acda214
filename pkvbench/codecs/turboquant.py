"""TurboQuant (Zandieh, Daliri, Hadian, Mirrokni; arXiv 2504.19874, ICLR 2026): pure tensor code, no model.

Each key or value vector x (one token of one head, d channels) is stored on its own, with no scale and no group:

- its length ‖x‖ in 16 bits, and its direction u = x / ‖x‖ rotated by a random orthogonal matrix Π (one per layer
  and KV head, drawn from a seed: the QR factor of a Gaussian matrix, signs fixed so that it is uniform);
- each coordinate of y = Πu as the index of its nearest centroid in a codebook of 2^b values, packed b bits to a
  coordinate (``codecs/bits.py``). After the rotation every coordinate of a unit vector follows the same density,
  f(t) ∝ (1 − t²)^((d−3)/2) on [−1, 1] (the paper's Lemma 1), whatever the input: the codebook is the optimal scalar
  quantizer of that density, found by the Lloyd–Max iteration (the paper's eq. 4), once per (d, b);
- read back as ‖x‖ · Πᵀ c[idx] (``TurboQuant_mse``, the paper's Algorithm 1).

With ``qjl`` (``TurboQuant_prod``, Algorithm 2), b bits are b − 1 of the above and one bit per coordinate of the
residual r = u − Πᵀ c[idx]: the signs of S r for a Gaussian matrix S (d × d, seeded like Π), stored with ‖r‖ in 16
bits, and read back as Πᵀ c[idx] + √(π/2)/d · ‖r‖ · Sᵀ signs. That makes inner products with the stored vector
unbiased (the MSE quantizer shrinks them), at a larger mean squared error.

What the paper proves, and tests check (``tests/test_quantize.py``): for a unit vector the expected squared error
D_mse = E‖x − x̃‖² is at most √3·π/2 · 4^(−b) (Theorem 1: 0.0425 at 3 bits, 0.0106 at 4), about 0.03 and 0.009 at
3 and 4 bits in practice (its finer values); with QJL, for any y the inner product is unbiased and
E|⟨y, x⟩ − ⟨y, x̃⟩|² ≤ √3·π²·‖y‖²/d · 4^(−b) (Theorem 2).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch

from pkvbench.codecs.bits import pack, unpack

GRID_POINTS = 1 << 17  # points of the grid the codebook's integrals are taken on
LLOYD_TOLERANCE = 1e-12  # the iteration stops once no centroid moves more (in units of 1/√d)
LLOYD_ITERATIONS = 20_000


@dataclass
class Rotated:
    """Vectors as TurboQuant stores them: ``codes`` ``[..., T, D·b/8]`` (uint8, the centroids' indices), ``norms``
    ``[..., T]`` (16 bits), the ``codebook`` ``[1, 2^b]`` (float32; a batch of rows: ``[B, 1, 2^b]``), and with QJL
    the residual's ``signs`` ``[..., T, D/8]`` (one bit a coordinate) and ``residual_norms`` ``[..., T]``."""

    codes: torch.Tensor
    norms: torch.Tensor
    codebook: torch.Tensor
    signs: torch.Tensor | None = None
    residual_norms: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(
            t for t in (self.codes, self.norms, self.codebook, self.signs, self.residual_norms) if t is not None
        )

    @property
    def bits(self) -> int:
        """Bits of a coordinate's centroid index."""
        return self.codebook.shape[-1].bit_length() - 1


def coordinate_density(dim: int, points: torch.Tensor) -> torch.Tensor:
    """The density of one coordinate of a uniformly random unit vector in ``dim`` dimensions at ``points`` (float64):
    Γ(d/2) / (√π Γ((d−1)/2)) · (1 − t²)^((d−3)/2) (the paper's Lemma 1)."""
    log_constant = math.lgamma(dim / 2) - math.lgamma((dim - 1) / 2) - 0.5 * math.log(math.pi)
    inside = (1 - points.square()).clamp(min=0)
    return torch.exp(log_constant + torch.xlogy(torch.tensor((dim - 3) / 2, dtype=points.dtype), inside))


@functools.cache
def _lloyd_max(dim: int, bits: int) -> tuple[tuple[float, ...], float]:
    """The 2^bits centroids minimizing E[(X − c(X))²] for X of ``coordinate_density(dim)``, and that cost: Lloyd–Max's
    iteration (boundaries halfway between centroids, each centroid its cell's mean) on a fine grid, in float64, from
    the density's quantiles."""
    count = 1 << bits
    grid = torch.linspace(-1, 1, GRID_POINTS + 1, dtype=torch.float64)
    mass = coordinate_density(dim, grid) * (2 / GRID_POINTS)
    mass[[0, -1]] /= 2  # the trapezoid rule
    mass /= mass.sum()
    cumulative = mass.cumsum(0)
    quantiles = (torch.arange(count, dtype=torch.float64) + 0.5) / count
    centroids = grid[torch.searchsorted(cumulative, quantiles).clamp(max=GRID_POINTS)]
    # a cell's mass and first moment from running sums: the points up to a boundary, at most it, are before it
    zero = torch.zeros(1, dtype=torch.float64)
    mass_before, moment_before = torch.cat([zero, cumulative]), torch.cat([zero, (mass * grid).cumsum(0)])
    first, last = torch.tensor([0]), torch.tensor([GRID_POINTS + 1])
    for _ in range(LLOYD_ITERATIONS):
        edges = torch.searchsorted(grid, (centroids[1:] + centroids[:-1]) / 2, right=True)
        edges = torch.cat([first, edges, last])
        weight = mass_before[edges[1:]] - mass_before[edges[:-1]]
        moment = moment_before[edges[1:]] - moment_before[edges[:-1]]
        moved = torch.where(weight > 0, moment / weight.clamp(min=1e-300), centroids)
        moved = (moved - moved.flip(0)) / 2  # the density is even: so is its optimal quantizer (grid rounding aside)
        done = bool(((moved - centroids).abs() * math.sqrt(dim) < LLOYD_TOLERANCE).all())
        centroids = moved
        if done:
            break
    cells = torch.bucketize(grid, (centroids[1:] + centroids[:-1]) / 2)
    cost = float((mass * (grid - centroids[cells]).square()).sum())
    return tuple(centroids.tolist()), cost


def codebook(dim: int, bits: int) -> torch.Tensor:
    """The optimal scalar quantizer of a rotated unit vector's coordinate in ``dim`` dimensions: 2^bits centroids,
    ascending (float32)."""
    return torch.tensor(_lloyd_max(dim, bits)[0], dtype=torch.float32)


def expected_error(dim: int, bits: int) -> float:
    """The codebook's expected squared error on a unit vector, d · C(f_X, b): the paper's D_mse of TurboQuant_mse."""
    return dim * _lloyd_max(dim, bits)[1]


def _generator(seed: int, layer: int, purpose: str) -> torch.Generator:
    """A generator of its own for each seed, layer and matrix (the rotation, QJL's projection)."""
    digest = hashlib.sha256(f"turboquant:{seed}:{layer}:{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@functools.cache
def _random_matrices(dim: int, heads: int, seed: int, layer: int, purpose: str, device: str) -> torch.Tensor:
    gaussian = torch.randn(heads, dim, dim, generator=_generator(seed, layer, purpose), dtype=torch.float64)
    if purpose == "projection":
        return gaussian.float().to(device)
    q, r = torch.linalg.qr(gaussian)
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]).float().to(device)


def rotations(dim: int, heads: int, seed: int, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """One uniformly random orthogonal matrix per head ``[heads, dim, dim]`` (float32), from ``seed`` and ``layer``:
    the same on every device and in every run."""
    return _random_matrices(dim, heads, seed, layer, "rotation", str(device))


def projections(dim: int, heads: int, seed: int, layer: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """QJL's Gaussian matrix S per head ``[heads, dim, dim]`` (float32), from ``seed`` and ``layer``."""
    return _random_matrices(dim, heads, seed, layer, "projection", str(device))


def _lookup(table: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Centroids of ``codes`` ``[..., H, T, D]`` from a codebook ``[..., 1, K]`` of matching leading axes (a row's
    ``[1, K]``, a batch's ``[B, 1, K]``): one lookup in the codebooks laid end to end."""
    count = table.shape[-1]
    offsets = torch.arange(0, table.numel(), count, device=codes.device).view(*table.shape[:-2], 1, 1, 1)
    return table.flatten().take(codes.long() + offsets)


def quantize(
    x: torch.Tensor,
    bits: int,
    rotation: torch.Tensor,
    dtype: torch.dtype,
    projection: torch.Tensor | None = None,
) -> Rotated:
    """Vectors ``x`` ``[H, T, D]`` (head h rotated by ``rotation[h]``) in ``bits`` bits a coordinate; with a QJL
    ``projection`` ``[H, D, D]``, b − 1 of them for the centroids and one for the residual's signs. Norms in
    ``dtype`` (16 bits)."""
    dim = x.shape[-1]
    index_bits = bits - 1 if projection is not None else bits
    table = codebook(dim, index_bits).to(x.device)
    x = x.float()
    norms = x.norm(dim=-1)
    unit = x / torch.where(norms > 0, norms, 1.0)[..., None]  # a zero vector stays zero: its norm restores it
    rotated = unit @ rotation.transpose(-1, -2)  # y = Πu, a row per token
    codes = torch.bucketize(rotated, (table[1:] + table[:-1]) / 2)
    stored = Rotated(pack(codes, index_bits), norms.to(dtype), table[None].clone())
    if projection is None:
        return stored
    residual = unit - table[codes] @ rotation  # u − Πᵀ c[idx]
    stored.signs = pack((residual @ projection.transpose(-1, -2) >= 0).to(torch.uint8), 1)
    stored.residual_norms = residual.norm(dim=-1).to(dtype)
    return stored


def dequantize(
    stored: Rotated,
    rotation: torch.Tensor,
    dtype: torch.dtype,
    projection: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quantize``'s vectors back, ``[..., H, T, D]`` in ``dtype`` (computed in float32, rounded once); written into
    ``out`` if given. A batch of rows ``[B, H, ...]`` shares the layer's ``rotation`` and ``projection``."""
    codes = unpack(stored.codes, stored.bits)
    unit = _lookup(stored.codebook, codes) @ rotation  # Πᵀ c[idx], a row per token
    if stored.signs is not None:
        signs = unpack(stored.signs, 1).float() * 2 - 1
        dim = signs.shape[-1]
        scale = math.sqrt(math.pi / 2) / dim * stored.residual_norms.float()
        unit = unit + scale[..., None] * (signs @ projection)  # √(π/2)/d · ‖r‖ · Sᵀ signs
    restored = unit * stored.norms.float()[..., None]
    if out is None:
        return restored.to(dtype)
    return out.copy_(restored)
