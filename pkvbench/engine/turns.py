"""A conversation's cache carried from turn to turn (``--query-mode multi-turn``, docs/query-modes.md).

Each configuration of a sample holds its own ``Conversation``: the entries its policy kept of the context, then
every token of the conversation since — each turn's question, the answer that followed it — at their original
positions. A turn's new tokens *extend* that cache (``extend``: one forward pass over them on top of the kept
entries, as a question is fed in the query-agnostic mode); nothing before them is computed again. With compression
every turn the cache is then cut back to its budget by the policy's own rule on the cache's entries, as a cut while
the answer is written does (``shrinking``: the conversation's latest queries as the observation window, H2O's sums
carried over every query since the context).

Rows of one extension batch share the tokens they take and where those go (the conversations that agree so far: in
a teacher-forced conversation, all of them); their caches are padded and masked as a decode batch's
(``layers.build_cache``), so a row's numbers do not depend on the others.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pkvbench.engine.attention import decoding
from pkvbench.engine.decoding import DecodeRequest, KeptEntries
from pkvbench.engine.layers import build_cache
from pkvbench.engine.shrinking import DecodeSchedule, DecodeStart, MemoryTracker

# The layer storage whose rows can be cut and that records what a cut scores from (``layers.LAYER_KINDS``).
CUTTABLE = "shrinking"


@dataclass
class Conversation:
    """One configuration's cache in a conversation: its entries with their original positions (``kept.positions``,
    always given), the position the next token takes, and — when it is cut back to its budget after every turn —
    the cut (``schedule``) and what the cut scores from (``start``), carried from one turn to the next."""

    kept: KeptEntries
    position: int
    schedule: DecodeSchedule | None = None
    start: DecodeStart | None = None

    @classmethod
    def of(
        cls,
        kept: KeptEntries,
        position: int,
        schedule: DecodeSchedule | None = None,
        start: DecodeStart | None = None,
    ) -> Conversation:
        """The conversation after a prompt of ``position`` tokens whose compressed cache is ``kept``."""
        if kept.positions is None:  # the whole prompt, in order
            positions = [torch.arange(k.shape[1], device=k.device).expand(k.shape[0], -1) for k in kept.keys]
            kept = dataclasses.replace(kept, positions=positions)
        return cls(kept, position, schedule, start)

    def kept_positions(self) -> list[list[np.ndarray]]:
        """Each layer's and head's entries' positions (what the selection fingerprints hash)."""
        layers = []
        for index, positions in enumerate(self.kept.positions):
            counts = self.kept.lengths[index].tolist() if self.kept.lengths is not None else None
            rows = positions.cpu().numpy()
            layers.append([row[: counts[h]] if counts else row for h, row in enumerate(rows)])
        return layers


@dataclass
class Extended:
    """A conversation after an extension, and the logits after its last new token (``[vocab]``): where the answer
    to a question just fed starts."""

    conversation: Conversation
    logits: torch.Tensor


def extend(
    engine, conversations: list[Conversation], tokens: list[list[int]], cut: bool = False, max_rows: int | None = None
) -> list[Extended]:
    """Each conversation extended by its ``tokens`` (a non-empty list each), then, with ``cut``, cut back to its
    budget where it has a schedule. A conversation with a schedule records, as it takes the tokens, what its cuts
    score from. Conversations that take the same tokens at the same position with caches of the same shape run as
    one batch (at most ``max_rows`` rows)."""
    groups: dict[tuple, list[int]] = {}
    for index, (conversation, new) in enumerate(zip(conversations, tokens)):
        if not new:
            raise ValueError("an extension needs at least one token")
        recording = conversation.schedule is not None
        key = (conversation.kept.heads, tuple(new), conversation.position, recording)
        groups.setdefault(key, []).append(index)
    results: list[Extended | None] = [None] * len(conversations)
    for (_, new, _, recording), members in groups.items():
        step = max_rows or len(members)
        for first in range(0, len(members), step):
            batch = members[first : first + step]
            extended = _extend_batch(engine, [conversations[i] for i in batch], list(new), recording, cut and recording)
            for index, done in zip(batch, extended):
                results[index] = done
    return results


@torch.inference_mode()
def _extend_batch(
    engine, conversations: list[Conversation], tokens: list[int], recording: bool, cut: bool
) -> list[Extended]:
    """One batch: the conversations take ``tokens`` at the same position, ``recording`` what their cuts score from;
    with ``cut`` each is then cut back to its schedule's targets."""
    decoder = engine.decoder
    position = conversations[0].position
    requests = [
        DecodeRequest(
            kept=c.kept, position=position, max_new_tokens=0, feed=tuple(tokens), schedule=c.schedule, start=c.start
        )
        for c in conversations
    ]
    cache = build_cache(requests, len(tokens), decoder.architecture, CUTTABLE if recording else None)
    ids = torch.tensor([tokens] * len(conversations), device=engine.device)
    steps = torch.arange(position, position + len(tokens), device=engine.device).expand(len(conversations), -1)
    with decoding(cache):
        logits = engine._forward(ids, cache, steps)
    end = position + len(tokens)
    if cut:
        schedules, starts = [c.schedule for c in conversations], [c.start for c in conversations]
        tracker = MemoryTracker(cache, schedules, starts, decoder.architecture, decoder.rope)
        for row, conversation in enumerate(conversations):
            tracker.cut(row, conversation.schedule, conversation.start, end)
    return [
        Extended(_carried(cache, row, conversation, len(tokens), end, recording), logits[row])
        for row, conversation in enumerate(conversations)
    ]


def _carried(cache, row: int, before: Conversation, new: int, end: int, recording: bool) -> Conversation:
    """Row ``row`` of an extension batch as a conversation of its own: its entries, their positions (recorded by a
    layer that can cut; else the earlier ones and then the new tokens', appended to every head) and, where it
    records, what its next cut scores from."""
    keys, values, lengths, positions, queries, accumulated = [], [], [], [], [], []
    for index, layer in enumerate(cache.layers):
        k, v, counts = layer.row_entries(row)
        keys.append(k)
        values.append(v)
        lengths.append(torch.as_tensor(counts))
        if recording:
            positions.append(layer.row_positions(row))
            recorded = layer.row_recorded(row)
            queries.append(recorded[0])
            accumulated.append(recorded[1])
        else:
            positions.append(_appended(before, index, new, end, k.shape[1]))
    ragged = any(bool((n != n[0]).any()) for n in lengths)
    kept = KeptEntries(keys, values, lengths if ragged else None, positions)
    start = before.start
    if recording:
        start = dataclasses.replace(
            before.start or DecodeStart(),
            queries=queries if queries[0] is not None else None,
            accumulated=accumulated if accumulated[0] is not None else None,
        )
    return Conversation(kept, end, before.schedule, start)


def _appended(before: Conversation, layer: int, new: int, end: int, width: int) -> torch.Tensor:
    """A layer's positions ``[heads, width]`` after ``new`` tokens ending before ``end`` were written after each
    head's own entries (padding past a head's count repeats its last position)."""
    old = before.kept.positions[layer]
    counts = (
        before.kept.lengths[layer].to(old.device)[:, None]
        if before.kept.lengths is not None
        else torch.full((old.shape[0], 1), old.shape[1], device=old.device)
    )
    columns = torch.arange(width, device=old.device)[None]
    earlier = torch.nn.functional.pad(old, (0, width - old.shape[1]))
    written = torch.where(columns < counts + new, end - new + columns - counts, end - 1)
    return torch.where(columns < counts, earlier, written)


def answer_request(
    extended: Extended, max_new_tokens: int, stop_strings: tuple[str, ...] = (), min_new_tokens: int = 0
) -> DecodeRequest:
    """Decode the answer to the question an extension just fed: from its logits, on the conversation's cache (the
    answer's own entries stay with the decoder: the conversation takes the answer it keeps by ``extend``)."""
    conversation = extended.conversation
    return DecodeRequest(
        kept=conversation.kept,
        position=conversation.position,
        max_new_tokens=max_new_tokens,
        first_logits=extended.logits,
        stop_strings=tuple(stop_strings),
        min_new_tokens=min_new_tokens,
    )
