"""RAFT (flowrl/recipes/raft.py): which samples it keeps, and that it trains on them only."""

import pytest
import torch

from flowrl.recipes.raft import selected


def test_selection_rules_hand_values():
    rewards = torch.tensor([0.2, 0.9, 0.9, float("nan"), 0.5, 0.5, 0.1, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])
    correct = {"correct": torch.tensor([0, 1, 1, 1, 0, 0, 0, 1.0])}
    # correct: the gold's passes, never a NaN reward
    assert selected(rewards, groups, correct, "correct").tolist() == [False, True, True, False, False, False, False,
                                                                      True]
    # best: one per group with a spread (the first of a tie); a group of equal rewards keeps none
    assert selected(rewards, groups, correct, "best").tolist() == [False, True, False, False, False, False, False,
                                                                   True]
    assert selected(rewards, groups, correct, "above", threshold=0.9).tolist() == [False, True, True, False, False,
                                                                                   False, False, True]
    with pytest.raises(ValueError, match="needs a training reward that reports details\\['correct'\\]"):
        selected(rewards, groups, {}, "correct")
