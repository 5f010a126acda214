"""KVzip's extra pass: how much the model attends to each prompt entry when it is asked to repeat the prompt.

KVzip (Kim et al., 2025, arXiv 2505.23416; kvpress ``KVzipPress``, the authors' snu-mllab/KVzip) scores a cached
entry by the attention it receives while the model reconstructs the context. After the prefill, the prompt past its
chat prefix (``chat_frame``: the system message and the user turn's opening, as the prompt itself renders them) is
cut into chunks of ``chunk`` tokens; for each chunk one teacher-forced forward pass runs over ``<repeat request>
<end of user turn, start of the answer> <the chunk>`` on top of the full cache, at positions after the prompt. Per
layer, the queries of that pass attend over the first ``sink`` entries, the chunk's entries and the pass's own
tokens (other chunks are left out of the softmax); a chunk entry's score is the largest attention any query of its
KV head's group pays it. The repeat request is kvpress's wording: "\\n\\nRepeat the previous context exactly." for
the first chunk, "…the part of the previous context exactly, starting with" and the previous chunk's last 8 tokens
for the others. The chat prefix and the sinks are always kept (the authors keep the system prompt; kvpress leaves
the prefix's tokens past the sinks unscored, so they go first). One pass per chunk, once per sample, shared by
every budget.
"""

from __future__ import annotations

import torch

from pkvbench.engine.attention import Recorder, flash_kernel, soft_cap_

FIRST_REQUEST = "\n\nRepeat the previous context exactly."
LATER_REQUEST = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk quoted in a later chunk's request
SINK = 4
ROWS_PER_BLOCK = 512  # queries whose attention is materialised at once (memory), on the unfused path
# Bytes of query-by-chunk logits formed at once on the fused path: a block that stays in a core's L2 cache (1 MiB
# ran 1.8x faster than 4 MiB at 2000 tokens on our CPUs, 2 MiB of L2 per core; 256 KiB and less were slower again).
# A GPU needs blocks that fill it: 1 MiB would be hundreds of launches per layer.
BLOCK_BYTES = 2**20
BLOCK_BYTES_GPU = 256 * 2**20


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scaling: float):
    """The device's fused attention (``attention.flash_kernel``): (output ``[1, H, n, d]``, each query's log-sum-exp
    ``[1, H, n]``)."""
    return flash_kernel(query.device, query.dtype)(query, key, value, causal, scaling)


def fusable(query: torch.Tensor) -> bool:
    """Whether the fused path applies: one sequence, a fused kernel with log-sum-exps for the device and dtype
    (``attention.flash_kernel``), in float32 on a CPU, a head size the GPU kernels take."""
    return (
        query.shape[0] == 1
        and flash_kernel(query.device, query.dtype) is not None
        and (query.device.type != "cpu" or query.dtype == torch.float32)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 256
    )


class ReconstructionRecorder(Recorder):
    """Scores the entries ``[start, end)`` of a prompt of ``length`` tokens during one repeat pass, per layer.

    Two ways to the same scores. ``attend`` (the fused path, used where ``fusable``) replaces the pass's attention:
    the pass's queries see the whole prompt and their own tokens causally, and that attention is computed as three
    fused kernel calls over a partition of the keys — the sinks and the chunk (S), the pass's own tokens (O, causal),
    the rest of the prompt (R) — merged by their log-sum-exps into the output the model's kernel gives (to float
    rounding). The scores' softmax runs over S and O only, whose log-sum-exp L is the first two calls' merged, so a
    chunk entry's score is exp(max over the group's queries of q·k·scale − L): one product of the queries with the
    chunk's keys in cache-sized blocks, with no softmax and no second pass over the prompt. ``observe`` (the other
    way) forms the queries' attention over S and O and takes its softmax; the model's own kernel gives the output.
    A soft-capped model (Gemma 2) takes ``observe`` (the fused kernel cannot soft-cap), its logits capped as the
    model caps them.
    """

    def __init__(self, softmaxes: list, length: int, start: int, end: int, sink: int, fused: bool = True):
        self.softmaxes = softmaxes
        self.length, self.start, self.end, self.sink = length, start, end, sink
        self.fused = fused
        self.scores: dict[int, torch.Tensor] = {}

    def attend(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor | None:
        """The pass's attention output ``[1, n, Hq, d]`` (the layout of transformers' kernels), its scores recorded;
        None where the fused path does not apply (the caller then uses ``observe`` and the model's kernel)."""
        if not self.fused or not fusable(query) or value.shape[-1] != query.shape[-1]:
            return None  # (the fused kernels take values of the queries' size: not MLA's)
        group = query.shape[1] // key.shape[1]
        length, new = self.length, query.shape[2]
        scaling = self.softmaxes[layer_idx].scaling

        def part(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
            """The columns in ``spans`` of ``[1, Hkv, m, d]``, repeated to every query head as repeat_kv does."""
            joined = torch.cat([tensor[:, :, a:b] for a, b in spans if b > a], dim=2)
            return joined.repeat_interleave(group, dim=1) if group > 1 else joined

        spans = {
            "scored": [(0, self.sink), (self.start, self.end)],
            "own": [(length, length + new)],
            "rest": [(self.sink, self.start), (self.end, length)],
        }
        calls = [
            _flash(query, part(key, columns), part(value, columns), name == "own", scaling)
            for name, columns in spans.items()
            if any(b > a for a, b in columns)
        ]
        total = torch.stack([lse for _, lse in calls]).logsumexp(dim=0)  # [1, Hq, n]: over every key
        output = torch.zeros_like(calls[0][0], dtype=torch.float32)  # merged in float32, whatever the model's dtype
        for part_output, part_lse in calls:  # each call's output weighted by its share of the softmax
            output.addcmul_(part_output, (part_lse - total).exp_()[..., None])
        scored = torch.logaddexp(calls[0][1], calls[1][1])[0]  # [Hq, n]: the sinks, the chunk, the pass's own tokens
        self.scores[layer_idx] = self._chunk_scores(
            query[0].float(), key[0, :, self.start : self.end].float(), scored, scaling
        )
        return output.to(query.dtype).transpose(1, 2).contiguous()

    def observe(
        self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, logsumexp: torch.Tensor | None = None
    ) -> None:
        softmax = self.softmaxes[layer_idx]
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
            logits = torch.bmm(block, subset.transpose(1, 2)).mul_(softmax.scaling).view(kv_heads, group, rows, -1)
            soft_cap_(logits, softmax.softcap)
            position = torch.arange(row, row + rows, device=k.device)[:, None]
            future = torch.arange(subset.shape[1] - first_new, device=k.device)[None, :] > position
            logits[..., first_new:].masked_fill_(future, float("-inf"))
            chunk = logits.softmax(dim=-1)[..., self.sink : first_new]  # [Hkv, group, rows, chunk]
            best = torch.maximum(best, chunk.amax(dim=(1, 2)))
        self.scores[layer_idx] = best

    @staticmethod
    def _chunk_scores(query: torch.Tensor, keys: torch.Tensor, logsumexp: torch.Tensor, scaling: float):
        """``[Hkv, c]``: for each of the chunk's ``keys`` ``[Hkv, c, d]``, exp(the largest q·k·scaling − L of its
        group's queries ``[Hq, n, d]``), L being each query's ``logsumexp`` ``[Hq, n]``."""
        query_heads, new, dim = query.shape
        kv_heads, count = keys.shape[0], keys.shape[1]
        group = query_heads // kv_heads
        # Rows in (query, head of the group) order, so that a block of queries is a contiguous slice.
        rows = query.reshape(kv_heads, group, new, dim).transpose(1, 2).reshape(kv_heads, new * group, dim)
        shift = (-logsumexp).reshape(kv_heads, group, new).transpose(1, 2).reshape(kv_heads, new * group, 1)
        transposed = keys.transpose(1, 2)
        block_bytes = BLOCK_BYTES if query.device.type == "cpu" else BLOCK_BYTES_GPU
        step = max(1, block_bytes // (4 * query_heads * count)) * group
        best = torch.full((kv_heads, count), float("-inf"), device=query.device)
        for first in range(0, new * group, step):
            block = torch.baddbmm(
                shift[:, first : first + step], rows[:, first : first + step], transposed, alpha=scaling
            )
            best = torch.maximum(best, block.amax(dim=1))
        return best.exp()


# Stand-ins for a message's content while a chat template is rendered: invisible separators no template alters.
_USER = "\u2063user\u2063"
_SYSTEM = "\u2063system\u2063"


def _render(tokenizer, system: str | None) -> str:
    messages = [{"role": "system", "content": system}] if system is not None else []
    return tokenizer.apply_chat_template(
        [*messages, {"role": "user", "content": _USER}], add_generation_prompt=True, tokenize=False
    )


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_frame(tokenizer, prompt: list[int]) -> tuple[int, list[int]]:
    """How a chat prompt frames its first user message: (the tokens before that message's content — the chat prefix
    — counted in ``prompt``; the tokens that end a user turn and open the answer), read from the prompt's own
    rendering.

    The prefix is the chat template's rendering of the prompt's own system message (or of none, where the template
    then inserts its default one) up to the user's content, and must be exactly what the prompt's first tokens spell:
    the system message is read back from the prompt's text between the template's system opening and the text that
    closes it and opens the user turn, and rendered again to check. The answer's opening is what the template puts
    after a user message when a generation prompt is added (tokenized alone, as kvpress does). A prompt that is not
    such a rendering (no chat template, or a task run with ``chat_template=false``) has no prefix and is repeated
    after a newline, as kvpress does without a template.
    """
    plain = (0, _ids(tokenizer, "\n"))
    if getattr(tokenizer, "chat_template", None) is None:
        return plain
    before, after = _render(tokenizer, None).split(_USER, 1)
    answer = _ids(tokenizer, after)
    candidates = []
    try:
        framed = _render(tokenizer, _SYSTEM)
    except Exception:  # a template without a system role (it raises): only the lone user message is possible
        framed = ""
    if _SYSTEM in framed and framed.index(_SYSTEM) < framed.find(_USER):
        opening = framed[: framed.index(_SYSTEM)]
        closing = framed[framed.index(_SYSTEM) + len(_SYSTEM) : framed.index(_USER)]
        text = tokenizer.decode(prompt)
        end = text.find(closing, len(opening)) if text.startswith(opening) and closing else -1
        if end >= 0:
            candidates.append(_render(tokenizer, text[len(opening) : end]).split(_USER, 1)[0])
    for text in [*candidates, before]:
        count = _covering(tokenizer, prompt, text)
        if count:
            return count, answer
    return plain


def _covering(tokenizer, prompt: list[int], text: str) -> int:
    """How many of the prompt's first tokens spell ``text`` exactly, or 0. Usually ``text``'s own tokens; but a
    template's last characters may be tokenized apart once the content follows them (SmolLM2's tokenizer writes "\\n\\n"
    as one token, and as two before a word), so nearby counts are tried by the text they decode to."""
    own = _ids(tokenizer, text)
    if own and prompt[: len(own)] == own:
        return len(own)
    for count in range(max(1, len(own) - 2), min(len(prompt), len(own) + 3) + 1):
        if tokenizer.decode(prompt[:count]) == text:
            return count
    return 0


def repeat_inputs(tokenizer, prompt: list[int], chunk: int) -> tuple[int, list[tuple[int, int, list[int]]]]:
    """(the chat prefix's length, always kept; [(start, end, repeat pass input ids)] per chunk of the rest)."""
    prefix, answer = chat_frame(tokenizer, prompt)
    passes = []
    for start in range(prefix, len(prompt), chunk):
        end = min(len(prompt), start + chunk)
        if start == prefix:
            request = _ids(tokenizer, FIRST_REQUEST)
        else:
            request = _ids(tokenizer, LATER_REQUEST) + prompt[start - OVERLAP : start]
        passes.append((start, end, request + answer + prompt[start:end]))
    return prefix, passes
