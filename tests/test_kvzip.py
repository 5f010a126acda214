"""KVzip's repeat passes: the chat frame read from the prompt's own rendering, and the fused scores."""

import copy
import itertools

import pytest
import torch

from pkvbench.engine import reconstruction
from pkvbench.engine.reconstruction import FIRST_REQUEST, LATER_REQUEST, OVERLAP, chat_frame, repeat_inputs
from pkvbench.tasks.base import chat_ids, chat_messages

# A Llama-3-like template (header tokens as plain text for this tokenizer), with no default system message.
HEADERS_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("system", [None, "You are a helpful AI bot. Keep your response short and direct"])
@pytest.mark.parametrize("template", ["smollm2", "headers"])
def test_the_chat_prefix_is_the_prompts_own_up_to_the_users_content(tokenizer, system, template):
    if template == "headers":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = HEADERS_TEMPLATE
    content = "The context: a long story.\n\nThe question?"
    prompt = chat_ids(tokenizer, chat_messages(system, [content]))
    prefix, answer = chat_frame(tokenizer, prompt)
    assert tokenizer.decode(prompt[prefix:]).startswith("The context")
    head = tokenizer.decode(prompt[:prefix])
    assert head.endswith("<|im_start|>user\n" if template == "smollm2" else "user<|end_header_id|>\n\n")
    if system:
        assert system in head
    elif template == "smollm2":
        assert "SmolLM" in head  # its template's default system message is part of the prefix
    assert tokenizer.decode(prompt).endswith(tokenizer.decode(answer))  # the answer's opening ends the prompt
    assert tokenizer.decode(answer).endswith("assistant\n" if template == "smollm2" else "<|end_header_id|>\n\n")


def test_a_prompt_without_the_chat_template_has_no_prefix(tokenizer):
    assert chat_frame(tokenizer, ids(tokenizer, "A plain story. The question?")) == (0, ids(tokenizer, "\n"))


def test_repeat_passes_ask_for_the_prompt_past_its_prefix_chunk_by_chunk(tokenizer):
    system = "You are a helpful AI bot."
    prompt = chat_ids(tokenizer, chat_messages(system, ["word " * 100]))
    prefix, answer = chat_frame(tokenizer, prompt)
    start, passes = repeat_inputs(tokenizer, prompt, 40)
    assert start == prefix and passes[0][:2] == (prefix, prefix + 40)
    assert passes[-1][1] == len(prompt) and all(p[1] == q[0] for p, q in itertools.pairwise(passes))
    first, later = passes[0][2], passes[1][2]
    assert first == ids(tokenizer, FIRST_REQUEST) + answer + prompt[prefix : prefix + 40]
    assert (
        later
        == ids(tokenizer, LATER_REQUEST)
        + prompt[prefix + 40 - OVERLAP : prefix + 40]
        + answer
        + prompt[prefix + 40 : prefix + 80]
    )


@pytest.mark.model
def test_fused_scores_equal_the_unfused_ones(engine, monkeypatch):
    """The fused path (three flash calls, scores from their log-sum-exps) against the model's own kernel plus the
    recorder's softmax, on the real model: several chunks, a system message."""
    from transformers import DynamicCache

    prompt = chat_ids(engine.tokenizer, chat_messages("You answer briefly.", ["Here is a story. " * 40 + "Why?"]))
    cache = DynamicCache()
    engine.recorded_forward(torch.tensor([prompt]), type("Nothing", (), {"needed": False})(), cache)
    layers = [cache.layers[i] for i in range(engine.loaded.num_layers)]
    calls = []
    attend = reconstruction.ReconstructionRecorder.attend

    def counted(self, *args):
        output = attend(self, *args)
        calls.append(output is not None)
        return output

    monkeypatch.setattr(reconstruction.ReconstructionRecorder, "attend", counted)
    fused = torch.stack(engine.reconstruction_scores(layers, prompt, 64))
    assert calls and all(calls), "every layer of every pass took the fused path"
    unfused = torch.stack(engine.reconstruction_scores(layers, prompt, 64, fused=False))
    finite = torch.isfinite(unfused)
    assert torch.equal(torch.isfinite(fused), finite)  # the same entries always kept (prefix, sinks)
    assert len(repeat_inputs(engine.tokenizer, prompt, 64)[1]) >= 3
    torch.testing.assert_close(fused[finite], unfused[finite], rtol=1e-4, atol=1e-7)
