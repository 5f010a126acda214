"""The one hook into transformers: a registered attention function that records what the policies need.

transformers looks up each attention module's kernel by ``config._attn_implementation`` in its
``AttentionInterface`` registry. We register ``pkvbench+<kernel>`` (e.g. ``pkvbench+sdpa``), which calls the
chosen kernel unchanged and, only while a ``StatsRecorder`` is active (the prefill), records attention statistics
from the post-RoPE queries and keys it is handed; while a batch decodes with rows that cut their caches
(``--decode-budget``), it hands each step's queries to the cache's ``ShrinkingLayer``. The switch is made on one model's config: nothing global is
patched, and other models in the process keep their own kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from pkvbench.engine.cache import FLEX_BLOCK
from pkvbench.engine.probe import LayerSoftmax, Rotation, active_probe, rotate_half
from pkvbench.errors import PkvError
from pkvbench.policies.base import LayerStats, Needs


class Recorder(ABC):
    """What the attention wrapper calls during a recorded forward pass (``StatsRecorder``, KVzip's
    ``reconstruction.ReconstructionRecorder``, ``funnel.FunnelRecorder``). ``softmaxes``: each layer's
    ``architecture.LayerSoftmax``, how its model turns logits into attention (``Engine.softmaxes``)."""

    softmaxes: list[LayerSoftmax]
    needed: bool = True  # False: the wrapper leaves the forward to the model's kernel alone
    wants_logsumexp: bool = False  # True: ``observe`` takes each query's log-sum-exp where the fused kernel gives it
    # True: what it records is attention over the prompt's keys, computed as if every query saw the whole prompt
    # (not so past an all-sliding model's window: ``Engine.recorded_forward`` refuses it there).
    attends_over_prompt: bool = True

    @abstractmethod
    def observe(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, logsumexp: torch.Tensor | None = None
    ) -> None:
        """Called by every attention call of a recorded forward (prefill or not), with post-RoPE queries and keys."""

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor | None:
        """The call's attention output, computed by the recorder itself (KVzip's fused path), or None: the model's
        kernel gives it and ``observe`` sees the call."""
        return None


_ACTIVE_RECORDER: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("pkvbench_recorder", default=None)
# The batch of compressed caches new tokens are decoded from (a ``cache.RaggedCache``), while the engine decodes.
_ACTIVE_DECODE: contextvars.ContextVar = contextvars.ContextVar("pkvbench_decode", default=None)
# Kernels that take the 4-D masks a ragged batch needs (bool for sdpa, additive for eager).
MASKED_KERNELS = ("sdpa", "eager")
PREFIX = "pkvbench+"
# Bytes of float32 attention probabilities materialised at once while accumulating attention over all queries.
# On a CPU small chunks stay in cache (4 MiB ran 1.5x faster than 64 MiB at T=2000 on our CPUs); on a GPU a chunk
# must feed the whole device: at 4 MiB a 32k-token prompt of a 32-head model went one query row per kernel launch,
# and H2O's statistics took 211x a plain prefill on an H200 (scripts/bench_gpu.py, docs/benchmark.md).
ACCUMULATE_CHUNK_BYTES = 4 * 2**20
ACCUMULATE_CHUNK_BYTES_GPU = 512 * 2**20


def chunk_bytes_for(device: torch.device) -> int:
    return ACCUMULATE_CHUNK_BYTES if device.type == "cpu" else ACCUMULATE_CHUNK_BYTES_GPU


def soft_cap_(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scaled attention logits soft-capped in place as the model does before its softmax (Gemma 2's
    ``attn_logit_softcapping``): softcap · tanh(logits / softcap), in its eager kernel's order. No cap: as they are.
    Every statistic that forms logits passes them through here."""
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def attention_softmax(logits: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax over the keys (the last axis) of ``logits`` ``[..., Hq, r, n]``. With attention sinks ``[Hq]``
    (gpt-oss: one learned logit per head), each head's sink joins the denominator as in the model's own kernel:
    p = exp(l − lse′), lse′ = logaddexp(lse, sink); the probabilities over the keys then sum to less than one."""
    if sinks is None:
        return logits.softmax(dim=-1)
    return (logits - with_sinks(logits.logsumexp(dim=-1, keepdim=True), sinks)).exp()


def with_sinks(logsumexp: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Log-sum-exps ``[..., Hq, r, 1]`` over the keys, with each head's sink added to the sum (``attention_softmax``)."""
    if sinks is None:
        return logsumexp
    return torch.logaddexp(logsumexp, sinks.float().view(-1, 1, 1))


def window_attention_probs(query: torch.Tensor, key: torch.Tensor, softmax: LayerSoftmax, rows: int) -> torch.Tensor:
    """``[Hq, rows, T]``: the causal softmax attention of the last ``rows`` queries over all T keys.

    ``query`` is ``[Hq, T, D]`` and ``key`` ``[Hkv, T, D]``, both post-RoPE; query heads share their KV head (GQA);
    ``softmax``: the layer's scale, soft-cap and sinks (every statistic below takes it).
    """
    length = query.shape[1]
    return last_queries_attention(query[:, length - min(rows, length) :], key, softmax)


def last_queries_attention(last: torch.Tensor, key: torch.Tensor, softmax: LayerSoftmax) -> torch.Tensor:
    """``[Hq, r, n]``: the softmax attention of ``last`` ``[Hq, r, D]``, the queries of the tokens of the last r of
    the n entries ``key`` ``[Hkv, n, D]``, over all n, causal among the last r (a prompt's end, or while the answer is
    written a cache's newest entries)."""
    num_query_heads, rows, dim = last.shape
    num_kv_heads, length = key.shape[0], key.shape[1]
    grouped = last.float().reshape(num_kv_heads, num_query_heads // num_kv_heads * rows, dim)
    logits = torch.bmm(grouped, key.float().transpose(1, 2)).mul_(softmax.scaling).view(num_query_heads, rows, length)
    soft_cap_(logits, softmax.softcap)
    query_pos = torch.arange(length - rows, length, device=last.device)[:, None]
    logits.masked_fill_(torch.arange(length, device=last.device)[None, :] > query_pos, float("-inf"))
    return attention_softmax(logits, softmax.sinks)


def last_queries_sums(
    last: torch.Tensor, key: torch.Tensor, softmax: LayerSoftmax, windows: set[int]
) -> dict[int, torch.Tensor]:
    """``window_attention_sums`` from the last queries themselves (``last_queries_attention``)."""
    from_end = last_queries_attention(last, key, softmax).flip(1).cumsum(dim=1)
    rows = from_end.shape[1]
    return {w: from_end[:, min(w, rows) - 1] for w in windows}


def window_attention_sums(
    query: torch.Tensor, key: torch.Tensor, softmax: LayerSoftmax, windows: set[int]
) -> dict[int, torch.Tensor]:
    """For each w in ``windows``: ``[Hq, T]`` sums over the last w queries of their causal softmax attention.

    One softmax over the largest window's queries serves every smaller window.
    """
    probs = window_attention_probs(query, key, softmax, max(windows))
    rows = probs.shape[1]
    # Cumulative sums from the last query backwards: entry r holds the sum over the last r+1 queries.
    from_end = probs.flip(1).cumsum(dim=1)
    return {w: from_end[:, min(w, rows) - 1] for w in windows}


def accumulated_attention(
    query: torch.Tensor, key: torch.Tensor, softmax: LayerSoftmax, chunk_bytes: int | None = None
) -> torch.Tensor:
    """``[Hq, T]``: for each key position, the sum over all T queries of their causal softmax attention to it.

    Queries are processed in chunks so that at most ``chunk_bytes`` of probabilities exist at once (never a full
    T×T matrix per head); a chunk of queries ending at position b only needs keys [0, b).
    """
    num_query_heads, length, dim = query.shape
    num_kv_heads = key.shape[0]
    group = num_query_heads // num_kv_heads
    rows_per_chunk = max(1, (chunk_bytes or chunk_bytes_for(query.device)) // (4 * num_query_heads * length))
    grouped_query = query.float().view(num_kv_heads, group, length, dim)
    keys = key.float()
    totals = torch.zeros(num_query_heads, length, device=query.device)
    for start in range(0, length, rows_per_chunk):
        end = min(length, start + rows_per_chunk)
        chunk = grouped_query[:, :, start:end].reshape(num_kv_heads, group * (end - start), dim)
        logits = torch.bmm(chunk, keys[:, :end].transpose(1, 2)).mul_(softmax.scaling)
        logits = soft_cap_(logits.view(num_query_heads, end - start, end), softmax.softcap)
        query_pos = torch.arange(start, end, device=query.device)[:, None]
        logits.masked_fill_(torch.arange(end, device=query.device)[None, :] > query_pos, float("-inf"))
        totals[:, :end] += attention_softmax(logits, softmax.sinks).sum(dim=1)
    return totals


def bidirectional_attention_sums(
    query: torch.Tensor, key: torch.Tensor, softmax: LayerSoftmax, window: int, chunk_bytes: int | None = None
) -> torch.Tensor:
    """``[Hq, T]``: for each key position, the sum over all T queries of their softmax attention to it, where only
    the last ``window`` queries are causally masked (over the last ``window`` keys) and every earlier query sees all
    T keys, the future included — what the PyramidKV paper's code computed for H2O from 2024-10-13 (KVCache-Factory
    ``98e8228``) to 2026-06-22. Chunked over queries as ``accumulated_attention``."""
    num_query_heads, length, dim = query.shape
    num_kv_heads = key.shape[0]
    group = num_query_heads // num_kv_heads
    rows_per_chunk = max(1, (chunk_bytes or chunk_bytes_for(query.device)) // (4 * num_query_heads * length))
    grouped_query = query.float().view(num_kv_heads, group, length, dim)
    keys = key.float().transpose(1, 2)
    totals = torch.zeros(num_query_heads, length, device=query.device)
    masked_from = length - min(window, length)
    for start in range(0, length, rows_per_chunk):
        end = min(length, start + rows_per_chunk)
        chunk = grouped_query[:, :, start:end].reshape(num_kv_heads, group * (end - start), dim)
        logits = torch.bmm(chunk, keys).mul_(softmax.scaling).view(num_query_heads, end - start, length)
        soft_cap_(logits, softmax.softcap)
        query_pos = torch.arange(start, end, device=query.device)[:, None]
        key_pos = torch.arange(length, device=query.device)[None, :]
        logits.masked_fill_((query_pos >= masked_from) & (key_pos > query_pos), float("-inf"))
        totals += attention_softmax(logits, softmax.sinks).sum(dim=1)
    return totals


def unrotate(
    rotated: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, scale=None
) -> torch.Tensor:
    """The vectors before RoPE: RoPE maps x to x·cos + rotate_half(x)·sin (cos, sin per position, halves equal), so
    x = (y·cos − rotate_half(y)·sin) / (cos² + sin²) (cos² + sin² is the rope's attention scaling squared, 1 mostly).
    Where RoPE is narrower than the head (Phi-3's ``partial_rotary_factor``) the dimensions beyond it pass as they
    are, as the model's ``apply_rotary_pos_emb`` passes them. ``interleaved``: the pairing of ``rotate_half``.
    ``scale`` ``[d]``: the weights of a norm the layer applies after RoPE (Hunyuan, Llama 4), y = w ⊙ R x / rms(x):
    the queries as its kernel would get them unturned are w ⊙ R⁻¹(y / w), R the rotation alone — the norm takes out
    whatever magnitude the tables carry (YaRN's attention factor)."""
    if scale is not None:
        return scale * unrotate(rotated / scale, *unit_tables(cos, sin), interleaved)
    width = cos.shape[-1]
    if width < rotated.shape[-1]:
        return torch.cat([unrotate(rotated[..., :width], cos, sin, interleaved), rotated[..., width:]], dim=-1)
    return (rotated * cos - rotate_half(rotated, interleaved) * sin) / (cos * cos + sin * sin)


def unit_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's tables as the rotation alone: each pair's cos and sin divided by their magnitude (YaRN's attention
    factor, 1 mostly), which a norm after RoPE cancels."""
    magnitude = (cos * cos + sin * sin).sqrt()
    return cos / magnitude, sin / magnitude


def future_query_statistics(
    queries: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sink: int,
    future_cos: torch.Tensor,
    future_sin: torch.Tensor,
    interleaved: bool = False,
    scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expected Attention's statistics of the queries to come (kvpress ``ExpectedAttentionPress``): the mean μ and
    (biased) covariance Σ of the pre-RoPE queries of positions ``sink`` onwards, per query head, rotated by the average
    of the RoPE rotations R_p of the next positions: (R̄μ, R̄ΣR̄ᵀ). ``queries`` is ``[Hq, c, d]`` after RoPE, with
    ``cos``/``sin`` ``[c, d]`` of its positions and ``future_cos``/``future_sin`` ``[f, d]`` of the positions to come
    (``interleaved``: RoPE's pairing, ``rotate_half``; ``scale``: a norm's weights after RoPE, ``unrotate``)."""
    moments = query_moments(queries, cos, sin, sink, interleaved, scale)
    return rotate_moments(*moments, future_cos, future_sin, interleaved, scale)


def query_moments(
    queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sink: int, interleaved: bool = False, scale=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean ``[Hq, d]`` and (biased) covariance ``[Hq, d, d]`` of the pre-RoPE queries from position ``sink`` on
    (``queries`` after RoPE, ``cos``/``sin`` of their positions)."""
    plain = unrotate(queries.float(), cos, sin, interleaved, scale)[:, sink:]
    mean = plain.mean(dim=1)
    centred = plain - mean[:, None]
    return mean, centred.transpose(1, 2) @ centred / plain.shape[1]


def rotate_moments(
    mean: torch.Tensor,
    covariance: torch.Tensor,
    future_cos: torch.Tensor,
    future_sin: torch.Tensor,
    interleaved: bool = False,
    scale=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(R̄μ, R̄ΣR̄ᵀ), R̄ the average RoPE rotation of the positions whose ``future_cos``/``future_sin`` are given
    (with a norm's weights w after RoPE, ``unrotate``: R̄ of the rotations alone, conjugated, diag(w) R̄ diag(w)⁻¹)."""
    if scale is not None:
        future_cos, future_sin = unit_tables(future_cos, future_sin)
    dim, width = mean.shape[-1], future_cos.shape[-1]  # a partial RoPE turns the first `width` dimensions only
    half_turn = rotate_half(torch.eye(width, device=mean.device), interleaved).T  # P with rotate_half(x) = P @ x
    rotation = torch.eye(dim, device=mean.device)
    rotation[:width, :width] = torch.diag(future_cos.mean(dim=0)) + torch.diag(future_sin.mean(dim=0)) @ half_turn
    if scale is not None:
        rotation = scale[:, None] * rotation / scale[None, :]
    return mean @ rotation.T, rotation @ covariance @ rotation.T


class StatsRecorder(Recorder):
    """Collects ``LayerStats`` for every layer during one prefill: of the whole prompt, or of its first c tokens for
    each c in ``cuts`` (the prompt is causal: the first c queries and keys are those of a prefill of c tokens).
    ``softmaxes``: each layer's ``LayerSoftmax`` (required: statistics without the model's scale, soft-cap or sinks
    would be another model's); ``rope(start, count, layer)`` gives the layer's RoPE cos and sin ``[count, d]`` of
    positions start… (query statistics), ``rotation`` how it pairs dimensions (``rotate_half``) and what each layer
    does after RoPE (``architecture.Rotation``)."""

    def __init__(
        self,
        needs: Needs,
        softmaxes: list[LayerSoftmax],
        cuts: tuple[int, ...] = (),
        rope=None,
        rotation: Rotation | None = None,
    ):
        self.windows = set(needs.windows)
        self.accumulated = needs.accumulated
        self.bidirectional = set(needs.bidirectional)
        self.query_stats = set(needs.query_stats)
        self.queries = max(needs.queries, default=0)
        self.query_moments = set(needs.query_moments)
        self.cuts = cuts
        self.rope = rope
        self.rotation = rotation or Rotation(interleaved=False)
        self.softmaxes = softmaxes
        self.layers: dict[tuple[int, int], LayerStats] = {}  # (cut, layer) → statistics

    @property
    def needed(self) -> bool:
        return bool(
            self.windows
            or self.accumulated
            or self.bidirectional
            or self.query_stats
            or self.queries
            or self.query_moments
        )

    @staticmethod
    def _accumulated(q, k, softmax: LayerSoftmax, logsumexp, cut) -> torch.Tensor:
        # The first `cut` queries' log-sum-exps over their (causal) keys are those of a cut. The fused kernel that
        # gives them cannot soft-cap (the wrapper never asks it for a soft-capped call).
        if logsumexp is not None and softmax.softcap is None:
            total = with_sinks(logsumexp[0, :, :cut, None].float(), softmax.sinks)[..., 0]  # a sink's share joins
            return accumulated_from_logsumexp(q, k, total, softmax.scaling)
        return accumulated_attention(q, k, softmax)

    def _query_stats(self, q: torch.Tensor, layer: int) -> dict:
        cut = q.shape[1]
        if not self.query_stats:
            return {}
        cos, sin = self.rope(0, cut, layer)
        out = {}
        for sink, future in self.query_stats:
            future_cos, future_sin = self.rope(cut, future, layer)
            out[sink, future] = future_query_statistics(
                q,
                cos,
                sin,
                min(sink, cut - 1),
                future_cos,
                future_sin,
                self.rotation.interleaved,
                self.rotation.scale(layer),
            )
        return out

    def _query_moments(self, q: torch.Tensor, layer: int) -> dict:
        if not self.query_moments:
            return {}
        cos, sin = self.rope(0, q.shape[1], layer)
        interleaved, scale = self.rotation.interleaved, self.rotation.scale(layer)
        return {
            sink: query_moments(q, cos, sin, min(sink, q.shape[1] - 1), interleaved, scale)
            for sink in self.query_moments
        }

    @property
    def wants_logsumexp(self) -> bool:
        """Accumulated attention is cheap given each query's log-sum-exp (``accumulated_from_logsumexp``)."""
        return self.accumulated

    @property
    def attends_over_prompt(self) -> bool:
        """Window sums, accumulated and bidirectional attention; queries and their moments are the model's own."""
        return bool(self.windows or self.accumulated or self.bidirectional)

    def observe(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, logsumexp: torch.Tensor | None = None
    ) -> None:
        if query.shape[2] != key.shape[2]:
            return  # not a prefill of the whole prompt
        # Batch size is 1 in the engine; statistics drop that axis.
        softmax = self.softmaxes[layer_idx]
        for cut in self.cuts or (key.shape[2],):
            q, k = query[0, :, :cut], key[0, :, :cut]
            self.layers[cut, layer_idx] = LayerStats(
                context_len=cut,
                num_kv_heads=k.shape[0],
                window_scores=window_attention_sums(q, k, softmax, self.windows) if self.windows else {},
                accumulated=self._accumulated(q, k, softmax, logsumexp, cut) if self.accumulated else None,
                bidirectional={w: bidirectional_attention_sums(q, k, softmax, w) for w in self.bidirectional},
                query_stats=self._query_stats(q, layer_idx),
                recent_queries=q[:, max(cut - self.queries, 0) :].float().clone() if self.queries else None,
                query_moments=self._query_moments(q, layer_idx),
            )


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    token = _ACTIVE_RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE_RECORDER.reset(token)


@contextlib.contextmanager
def decoding(cache) -> Iterator:
    """While active, attention reads each layer's mask from ``cache`` (a ``RaggedCache``) instead of the model's."""
    token = _ACTIVE_DECODE.set(cache)
    try:
        yield cache
    finally:
        _ACTIVE_DECODE.reset(token)


def _kernel_for(base: str, module: torch.nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":
        # Each model family keeps its own eager kernel next to its attention class.
        return inspect.getmodule(type(module)).eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


class _OneSetPerQueryHead:
    """The attention module, seen by a kernel as having no key/value groups: for a cache that keeps one set of
    entries per query head, the kernel must not repeat keys and values to the query heads again."""

    num_key_value_groups = 1

    def __init__(self, module: torch.nn.Module):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


# How a decode step attends over rows or heads of different lengths, per device type: "flex" (FlexAttention over
# the whole store with a block mask from the lengths: the padding's blocks are skipped, no mask tensor is formed;
# compiled on CUDA) or "masked" (the model's kernel with a boolean mask). A batch whose rows and heads all hold the
# same count takes neither: the model's kernel with no mask (sdpa's flash kernel on a GPU).
RAGGED_KERNELS = {"cuda": "flex"}
_RAGGED_KERNEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("pkvbench_ragged_kernel", default=None)
# Why compiled FlexAttention could not run in this process (it then masks, as on a CPU); None while it can.
FLEX_FAILURE: str | None = None
# Keyword arguments of a decoding attention call that FlexAttention's path honours (the values it can take below).
_FLEX_KWARGS = {"dropout", "scaling", "position_ids", "is_causal", "output_attentions", "use_cache", "cache_position"}


@contextlib.contextmanager
def ragged_kernel(name: str) -> Iterator[None]:
    """Decode ragged batches with ``name`` ("flex" or "masked") on every device while active (tests run FlexAttention
    eagerly on a CPU this way)."""
    token = _RAGGED_KERNEL.set(name)
    try:
        yield
    finally:
        _RAGGED_KERNEL.reset(token)


def _ragged_kernel_for(device: torch.device) -> str:
    chosen = _RAGGED_KERNEL.get() or RAGGED_KERNELS.get(device.type, "masked")
    return "masked" if chosen == "flex" and device.type == "cuda" and FLEX_FAILURE else chosen


@functools.cache
def _flex_kernel(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic: one compilation serves every batch size and store length (each costs seconds), not one per shape
    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def _flex_decoding(layer, softmax: LayerSoftmax, query: torch.Tensor, kwargs: dict):
    """FlexAttention of the step's queries over the layer's whole store, its block mask built from the lengths
    (``RaggedLayer.block_mask``); the output in transformers' kernels' layout ``[batch, new, Hq, d]``."""
    global FLEX_FAILURE
    keys, values = layer.stores
    compiled = query.device.type == "cuda"
    try:
        output = _flex_kernel(compiled)(
            query,
            keys,
            values,
            block_mask=layer.block_mask(query.shape[1]),
            scale=softmax.scaling,
            enable_gqa=query.shape[1] != keys.shape[1],
        )
    except Exception as exc:  # no compiler for this device (no triton): mask as on a CPU, and say so once
        if not compiled:
            raise
        FLEX_FAILURE = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        warnings.warn(f"FlexAttention unavailable, decoding ragged batches with masks: {FLEX_FAILURE}", stacklevel=2)
        return None
    return output.transpose(1, 2).contiguous(), None


def _flex_applies(base: str, layer, query: torch.Tensor, kwargs: dict) -> bool:
    """FlexAttention computes what the model's sdpa call would (no soft-capping, window, sinks or other extras), for
    a layer whose mask is the lengths' alone (a kind that masks more, a sliding window, overrides ``attention_mask``
    and is left to it), over at most one block of new tokens."""
    return (
        base == "sdpa"
        and layer.masked_by_lengths_alone
        and query.shape[2] <= FLEX_BLOCK
        and not kwargs.get("dropout", 0.0)
        and not set(kwargs) - _FLEX_KWARGS
        and _ragged_kernel_for(query.device) == "flex"
    )


def _decoding_attention(kernel, base: str, cache, module, query, key, value, **kwargs):
    """Attention of new tokens over a ``RaggedLayer``: each row and head sees its own entries and nothing else. A
    layer that records for cuts while the answer is written (``shrinking.ShrinkingLayer``) sees the new queries.

    Rows and heads of one length, one new token: the model's kernel with no mask (flash on a GPU). Otherwise
    FlexAttention or a mask (``RAGGED_KERNELS``). Nothing here reads a tensor back to the host."""
    layer, softmax = cache.layers[module.layer_idx], cache.softmaxes[module.layer_idx]
    layer.observe(query, softmax)
    groups = getattr(module, "num_key_value_groups", 1)
    if key.shape[1] == query.shape[1] and groups > 1:
        module = _OneSetPerQueryHead(module)
    # FlexAttention reads the layer's stores: not where attention reads keys its module expanded (MLA's latent)
    if not layer.uniform and key is layer.keys and _flex_applies(base, layer, query, kwargs):
        output = _flex_decoding(layer, softmax, query, kwargs)
        if output is not None:
            return output
    mask = layer.attention_mask()
    if mask is not None and mask.shape[1] > 1 and groups > 1 and key.shape[1] != query.shape[1]:
        mask = mask.repeat_interleave(groups, dim=1)  # per KV head → per query head, in repeat_kv's order
    if mask is not None and base not in MASKED_KERNELS:
        raise PkvError(
            f"attention kernel {base!r} cannot mask a batch of compressed caches; use sdpa or eager "
            "(or --decode-batch 1 with a policy that keeps the same number of entries in every head)"
        )
    if mask is not None and base == "eager":  # eager adds its mask to the logits
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min
        )
    return kernel(module, query, key, value, mask, **kwargs)


# Keyword arguments of an attention call that the plain causal prefill kernel below ignores safely (transformers 5.2x
# passes ``use_cache`` too; an unknown one falls back to the model's kernel and the chunked statistics, slower:
# ``tests/test_engine.py`` checks that the model's own prefill takes this path).
_PLAIN_PREFILL_KWARGS = {"dropout", "scaling", "position_ids", "is_causal", "output_attentions", "use_cache"}


def flash_kernel(device: torch.device, dtype: torch.dtype):
    """PyTorch's fused attention kernel that returns each query's log-sum-exp on this device for this dtype, as
    ``kernel(query, key, value, causal, scale) -> (output [B, H, n, d], log-sum-exp [B, H, n] float32)`` (keys and
    values with the queries' heads), or None where there is none: the flash kernel for CPUs; on CUDA the flash kernel
    in 16 bits and the memory-efficient one in float32 (which pads its log-sum-exps to 32 queries). Blocks of queries
    and keys, never a T×T matrix."""
    aten = torch.ops.aten
    if device.type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return lambda q, k, v, causal, scale: aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )[:2]
    if device.type != "cuda":
        return None
    if dtype in (torch.float16, torch.bfloat16):
        return lambda q, k, v, causal, scale: aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]

    def efficient(q, k, v, causal, scale):
        output, logsumexp = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[
            :2
        ]
        return output, logsumexp[..., : q.shape[2]]

    return efficient


def _attention_with_logsumexp(base: str, scaling: float, query, key, value, attention_mask, kwargs):
    """The prefill's attention output as the model's sdpa kernel computes it, with each query's log-sum-exp, when
    that is to be had for free: sdpa, causal with no mask, on a CPU in float32 (PyTorch's flash kernel for CPUs: the
    same output, bit for bit, ``tests/test_engine.py``) or on CUDA (the flash kernel in 16 bits, as sdpa picks it;
    ``scripts/bench_gpu.py`` checks the output against sdpa's on the device). Else None."""
    kernel = flash_kernel(query.device, query.dtype)
    if (
        kernel is None
        or base != "sdpa"
        or (query.device.type == "cpu" and query.dtype != torch.float32)
        or query.shape[-1] % 8
        or query.shape[-1] > 256
        or value.shape[-1] != query.shape[-1]  # the kernels take one head size (an MLA value's differs)
        or attention_mask is not None
        or query.shape[2] != key.shape[2]
        or kwargs.get("dropout", 0.0)
        or kwargs.get("is_causal", True) is False
        or set(kwargs) - _PLAIN_PREFILL_KWARGS  # extras the fused kernel cannot apply: softcap, s_aux (sinks), …
    ):
        return None
    group = query.shape[1] // key.shape[1]
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    output, logsumexp = kernel(query, keys, values, True, scaling)
    return output.transpose(1, 2).contiguous(), logsumexp


# A head's log-sum-exps may span this much before exp(−lse) leaves float32's normal range (e⁻⁸⁷) with room to spare.
WEIGHT_RANGE = 60.0


def accumulated_from_logsumexp(
    query: torch.Tensor, key: torch.Tensor, logsumexp: torch.Tensor, scaling: float, kernel=None
) -> torch.Tensor:
    """``accumulated_attention`` given each query's log-sum-exp ``[Hq, T]``, in one fused kernel call
    (``flash_kernel``'s, or ``kernel``).

    Position j's sum over queries r ≥ j of exp(q_r·k_j·s − lse_r) is a kernel call with the roles swapped: "query"
    k_j over "keys" q_r·s, causal once both sequences are reversed. The kernel normalises by its own log-sum-exp L_j
    over r, so each q_r carries the weight exp(m − lse_r) as its value and the sum is out_j · exp(L_j − m), m being
    the head's smallest lse (weights ≤ 1). This keeps the head size the model's (the kernel wants Q, K and V of one
    size): 10% faster at 4000 tokens than carrying −lse_r as an extra key dimension, which is kept for a call where
    any head's log-sum-exps spread wider than ``WEIGHT_RANGE`` (its weights would underflow). PyTorch's flash kernel
    works in blocks, without the T×T matrix. In 16 bits (a GPU's model) the sums come from the kernel's float32
    log-sum-exp instead (``_accumulated_in_sixteen_bits``): a 16-bit output would round them to 3 digits.
    """
    heads, length, dim = query.shape
    kernel = kernel or flash_kernel(query.device, query.dtype)
    keys = key.repeat_interleave(heads // key.shape[0], dim=0)
    if query.dtype != torch.float32:
        return _accumulated_in_sixteen_bits(query, keys, logsumexp, scaling, kernel)
    logsumexp = logsumexp.float()
    smallest = logsumexp.amin(dim=1, keepdim=True)
    if (logsumexp.amax(dim=1, keepdim=True) - smallest).max() > WEIGHT_RANGE:
        return _accumulated_with_bias_dimension(query, keys, logsumexp, scaling, kernel)
    weights = torch.zeros(heads, length, dim, device=query.device)
    weights[..., 0] = (smallest - logsumexp).exp()
    output, normaliser = kernel(keys.flip(1)[None], (query * scaling).flip(1)[None], weights.flip(1)[None], True, 1.0)
    return (output[0, ..., 0].log() + normaliser[0] - smallest).exp().flip(1)


def _accumulated_with_bias_dimension(query, keys, logsumexp, scaling, kernel) -> torch.Tensor:
    """The same sums with −lse_r as an extra dimension of the "keys" ([k_j, 1]·[q_r·s, −lse_r]): exact for any spread
    of the log-sum-exps, at a head size padded from d + 1 to a multiple of 8."""
    heads, length, dim = query.shape
    pad = (-(dim + 1)) % 8  # the kernel runs fastest on head sizes in multiples of 8
    extra = torch.zeros(heads, length, pad, device=query.device)
    as_queries = torch.cat([keys, torch.ones(heads, length, 1, device=query.device), extra], dim=-1).flip(1)
    as_keys = torch.cat([query * scaling, -logsumexp[..., None], extra], dim=-1).flip(1)
    sums = kernel(as_queries[None], as_keys[None], torch.zeros_like(as_keys)[None], True, 1.0)[1]
    return sums[0].flip(1).exp()


def _accumulated_in_sixteen_bits(query, keys, logsumexp, scaling, kernel) -> torch.Tensor:
    """The sums for 16-bit queries and keys as the kernel's own float32 log-sum-exp over [k_j, 1, 1]·[q_r, h_r, l_r]
    at scale s, where h_r + l_r = −lse_r / s split over two 16-bit numbers (a high part and the rest, 16 significant
    bits together): no product is rounded beyond the model's own q and k, no weight underflows, and the output (in 16
    bits) is not read. Head size d + 2, padded to a multiple of 8."""
    heads, length, dim = query.shape
    shift = -logsumexp.float() / scaling
    high = shift.to(query.dtype)
    low = (shift - high.float()).to(query.dtype)
    pad = (-(dim + 2)) % 8
    extra = query.new_zeros(heads, length, pad)
    ones = query.new_ones(heads, length, 2)
    as_queries = torch.cat([keys.to(query.dtype), ones, extra], dim=-1).flip(1)
    as_keys = torch.cat([query, high[..., None], low[..., None], extra], dim=-1).flip(1)
    sums = kernel(as_queries[None], as_keys[None], torch.zeros_like(as_keys)[None], True, scaling)[1]
    return sums[0].float().flip(1).exp()


def _recording_attention(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        probe = active_probe()
        if probe is not None:  # reading what the layer does (``probe.layer_calls``): no attention computed
            return probe.attention(module, query, key, value, attention_mask, **kwargs)
        kernel = _kernel_for(base, module)
        decoding = _ACTIVE_DECODE.get()
        if decoding is not None:
            return _decoding_attention(kernel, base, decoding, module, query, key, value, **kwargs)
        recorder = _ACTIVE_RECORDER.get()
        if recorder is not None and recorder.needed:
            layer, softmax = module.layer_idx, recorder.softmaxes[module.layer_idx]
            if (
                base in MASKED_KERNELS
                and not set(kwargs) - _PLAIN_PREFILL_KWARGS  # a soft-capped call passes softcap: the model's kernel
                and softmax.sinks is None  # a fused output leaves sinks out: the model's kernel
            ):
                output = recorder.attend(layer, query, key, value)  # a recorder that attends itself (KVzip's)
                if output is not None:
                    return output, None
            if recorder.wants_logsumexp:
                fused = _attention_with_logsumexp(base, softmax.scaling, query, key, value, attention_mask, kwargs)
                if fused is not None:
                    output, logsumexp = fused
                    recorder.observe(layer, query, key, logsumexp=logsumexp)
                    return output, None
            recorder.observe(layer, query, key)
        return kernel(module, query, key, value, attention_mask, **kwargs)

    return attention


def install_recording_attention(model) -> str:
    """Switch ``model`` (only it) to the recording wrapper around its current attention kernel."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = model.config._attn_implementation
    if base.startswith(PREFIX):
        return base
    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, _recording_attention(base))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, _probed_mask(ALL_MASK_ATTENTION_FUNCTIONS[base]))
    model.set_attn_implementation(name)
    return name


def _probed_mask(make_mask):
    """The model's own mask interface, except while a probe reads which mask function each layer gets."""

    def mask(*args, **kwargs):
        probe = active_probe()
        if probe is not None:
            return probe.mask(kwargs["mask_function"], kwargs.get("device"))
        return make_mask(*args, **kwargs)

    return mask
