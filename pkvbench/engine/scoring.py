"""Log-probabilities of given tokens over compressed caches: lm-eval's ``loglikelihood`` requests
(``pkvbench/lm_eval``).

A request feeds tokens on top of one compressed cache at their original positions (as a query-agnostic question is
fed, ``Engine.request``) and reads the log-probability of each target token from the logits of the fed position
before it. Requests that feed the same tokens from the same position over caches of the same shape run as one batch
(``decoding.plan_batches``), so a grid of configurations of one context and continuation costs one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkvbench.engine.attention import decoding
from pkvbench.engine.decoding import DecodeRequest, plan_batches


@dataclass(frozen=True)
class Scored:
    logprob: float  # the targets' log-probabilities, summed
    greedy: bool  # whether greedy decoding would have produced every target


def score_many(engine, caches: list, position: int, feed: tuple[int, ...], targets: tuple[int, ...]) -> list[Scored]:
    """Feed ``feed`` over each compressed cache in ``caches`` (``CompressedCache``) from ``position`` on, and score
    ``targets``: the last ``len(targets)`` fed positions predict them (``feed`` ends with all targets but the
    last)."""
    if not 0 < len(targets) <= len(feed):
        raise ValueError(f"{len(targets)} targets cannot be read from {len(feed)} fed tokens")
    requests = [DecodeRequest(cache.kept, position, 0, feed=tuple(feed)) for cache in caches]
    scored: list[Scored | None] = [None] * len(requests)
    for batch in plan_batches(requests, None):
        for index, result in zip(batch, _score_batch(engine, [requests[i] for i in batch], targets)):
            scored[index] = result
    return scored


@torch.inference_mode()
def _score_batch(engine, requests: list[DecodeRequest], targets: tuple[int, ...]) -> list[Scored]:
    feed, position = requests[0].feed, requests[0].position
    cache = engine.decoder.cache_for(requests, room=len(feed))
    ids = torch.tensor([feed] * len(requests), device=engine.device)
    positions = torch.arange(position, position + len(feed), device=engine.device).expand(len(requests), -1)
    with decoding(cache):
        logits = engine.logits(ids, cache, positions, keep=len(targets))
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [batch, targets, vocab]
    wanted = torch.tensor(targets, device=engine.device)
    picked = logprobs.gather(2, wanted.expand(len(requests), -1)[..., None])[..., 0]
    greedy = (logprobs.argmax(dim=-1) == wanted).all(dim=1)
    return [Scored(float(p.sum()), bool(g)) for p, g in zip(picked, greedy)]
