"""KVzip's extra pass: how much the model attends to each prompt entry when it is asked to repeat the prompt.

KVzip (Kim et al., 2025, arXiv 2505.23416; kvpress ``KVzipPress``, the authors' snu-mllab/KVzip) scores a cached
entry by the attention it receives while the model reconstructs the context. After the prefill, the prompt (past
its chat-template prefix) is cut into chunks of ``chunk`` tokens; for each chunk one teacher-forced forward pass runs
over ``<repeat request> <end of user turn, start of the answer> <the chunk>`` on top of the full cache, at positions
after the prompt. Per layer, the queries of that pass attend over the first ``sink`` entries, the chunk's entries
and the pass's own tokens (other chunks are left out of the softmax); a chunk entry's score is the largest attention
any query of its KV head's group pays it. The repeat request is kvpress's wording: "\\n\\nRepeat the previous context
exactly." for the first chunk, "…the part of the previous context exactly, starting with" and the previous chunk's
last 8 tokens for the others. The chat-template prefix and the sinks are always kept (the authors keep the system
prefix; kvpress leaves its tokens past the sinks unscored, so they go first). One pass per chunk, once per sample,
shared by every budget: about the cost of a second prefill.
"""

from __future__ import annotations

import torch

FIRST_REQUEST = "\n\nRepeat the previous context exactly."
LATER_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk quoted in a later chunk's request
SINK = 4
ROWS_PER_BLOCK = 512  # queries whose attention is materialised at once (memory)


class ReconstructionRecorder:
    """Scores the entries ``[start, end)`` of a prompt of ``length`` tokens during one repeat pass, per layer."""

    needed = True

    def __init__(self, length: int, start: int, end: int, sink: int):
        self.length, self.start, self.end, self.sink = length, start, end, sink
        self.scores: dict[int, torch.Tensor] = {}

    def observe(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        q, k = query[0].float(), key[0].float()  # [Hq, n, d], [Hkv, length + n, d]
        query_heads, new, dim = q.shape
        kv_heads = k.shape[0]
        group = query_heads // kv_heads
        columns = torch.cat(
            [torch.arange(self.sink), torch.arange(self.start, self.end), torch.arange(self.length, self.length + new)]
        ).to(k.device)
        subset = k[:, columns]  # [Hkv, s, d]
        first_new = self.sink + self.end - self.start
        best = torch.zeros(kv_heads, self.end - self.start, device=k.device)
        grouped = q.view(kv_heads, group, new, dim)
        for row in range(0, new, ROWS_PER_BLOCK):
            rows = min(new, row + ROWS_PER_BLOCK) - row
            block = grouped[:, :, row : row + rows].reshape(kv_heads, group * rows, dim)
            logits = torch.bmm(block, subset.transpose(1, 2)).mul_(scaling).view(kv_heads, group, rows, -1)
            position = torch.arange(row, row + rows, device=k.device)[:, None]
            future = torch.arange(subset.shape[1] - first_new, device=k.device)[None, :] > position
            logits[..., first_new:].masked_fill_(future, float("-inf"))
            chunk = logits.softmax(dim=-1)[..., self.sink : first_new]  # [Hkv, group, rows, chunk]
            best = torch.maximum(best, chunk.amax(dim=(1, 2)))
        self.scores[layer_idx] = best


def chat_parts(tokenizer) -> tuple[list[int], list[int]] | None:
    """The tokens a chat template puts before a user message and after it (up to the answer), or None."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    marker = "\u2063dummy context\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    before, after = text.split(marker, 1)
    return (
        list(tokenizer(before, add_special_tokens=False)["input_ids"]),
        list(tokenizer(after, add_special_tokens=False)["input_ids"]),
    )


def repeat_inputs(tokenizer, prompt: list[int], chunk: int) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """(tokens always kept at the start: the chat prefix, or 0; [(start, end, repeat pass input ids)] per chunk).
    A prompt that does not start with the tokenizer's chat prefix is repeated after a plain newline."""
    parts = chat_parts(tokenizer)
    prefix, suffix = 0, list(tokenizer("\n", add_special_tokens=False)["input_ids"])
    if parts is not None and parts[0] and prompt[: len(parts[0])] == parts[0]:
        prefix, suffix = len(parts[0]), parts[1]
    passes = []
    for start in range(prefix, len(prompt), chunk):
        end = min(len(prompt), start + chunk)
        if start == prefix:
            request = list(tokenizer(FIRST_REQUEST, add_special_tokens=False)["input_ids"])
        else:
            request = (
                list(tokenizer(LATER_REQUEST, add_special_tokens=False)["input_ids"]) + prompt[start - OVERLAP : start]
            )
        passes.append((start, end, request + suffix + prompt[start:end]))
    return prefix, passes
