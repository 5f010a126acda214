import torch

from pkvbench.engine.generation import Engine


def test_barred_tokens_are_never_chosen_and_logits_stay_untouched():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0])
    assert Engine._greedy(logits, []) == 1
    assert Engine._greedy(logits, [1]) == 3
    assert Engine._greedy(logits, [1, 3]) == 2
    assert logits.tolist() == [0.0, 5.0, 1.0, 4.0]
