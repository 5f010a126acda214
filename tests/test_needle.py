import pytest

from pkvbench.tasks.base import TaskOptions
from pkvbench.tasks.needle import insert_at_sentence_end
from pkvbench.tasks.registry import build_samples, get_task

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."


def test_insert_at_sentence_end():
    text = "One two. Three four. Five six."
    assert insert_at_sentence_end(text, "|N|", 12) == "One two.|N| Three four. Five six."
    assert insert_at_sentence_end(text, "|N|", 3) == "|N|One two. Three four. Five six."
    assert insert_at_sentence_end(text, "|N|", len(text)) == text + "|N|"


@pytest.mark.model
def test_needle_prompts_have_the_requested_length_and_hold_the_needle(loaded):
    tokenizer = loaded.tokenizer
    samples = build_samples(get_task("needle"), tokenizer, TaskOptions(lengths=(500, 1000, 3000), depths=(0, 33, 100)))
    assert [s.sample_id for s in samples][:3] == ["len500_depth0", "len500_depth33", "len500_depth100"]
    for sample in samples:
        assert abs(len(sample.input_ids) - sample.extras["length"]) <= 2
        text = tokenizer.decode(sample.input_ids)
        assert text.count(NEEDLE) == 1
        assert sample.answers == [NEEDLE]
        before = text.split(NEEDLE)[0]
        assert before.endswith(".\n") or before.endswith("<|im_start|>user\n\n"), before[-40:]
    # Deeper needles sit further into the prompt.
    offsets = [tokenizer.decode(s.input_ids).index(NEEDLE) for s in samples if s.extras["length"] == 3000]
    assert offsets == sorted(offsets) and offsets[0] < offsets[-1]
