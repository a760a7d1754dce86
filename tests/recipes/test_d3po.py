"""D3PO (flowrl/recipes/d3po.py): each group's best and worst rollouts form a pair; updates on the toy flow raise
its known reward, negated rewards lower it. Runs, resume and 2-process equivalence: test_trainers_*.py."""

import math

import pytest
import torch

from flowrl.config import ConfigError, from_dict
from flowrl.data.prompt_groups import PromptGroups
from flowrl.dist import Dist
from flowrl.recipes import d3po
from rewards import RewardOutput

from toy import TOY_SAMPLING, ToyFlow, expected_reward, first_coordinate_reward, flow_grpo_epoch


def test_group_pairs_take_the_best_and_the_worst_finite_reward():
    rewards = torch.tensor([0.2, 0.9, math.nan, 0.1, 0.5, 0.5, 0.7, math.nan, 0.3])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    chosen, rejected = d3po.group_pairs(rewards, groups)
    # group 0: best 0.9 (row 1), worst 0.1 (row 3); group 1: all equal, no pair; group 2: rows 6 and 8.
    assert chosen.tolist() == [1, 6] and rejected.tolist() == [3, 8]


def negated(images, prompts, metadata=None) -> RewardOutput:
    return RewardOutput(-first_coordinate_reward(images, prompts).scores)


def run_updates(reward, epochs: int = 8) -> tuple[float, float]:
    cfg = from_dict(d3po.Config, {"sampling": {**TOY_SAMPLING, "window": {"size": 4}}, "optim": {"lr": 3e-3},
                                  "train": {"beta": 1.0, "micro_batch_size": 8}})
    model, dist = ToyFlow(), Dist(cpu=True)
    model.freeze_reference()
    groups = PromptGroups(["p"] * 8, None, groups=8, group_size=16, seed=0)
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=cfg.optim.lr)
    before = expected_reward(model)
    for epoch in range(epochs):
        rollouts, _, _, _ = flow_grpo_epoch(model, cfg, dist, groups.epoch(epoch), epoch, reward)
        pairs = d3po.group_pairs(rollouts.rewards, rollouts.group_ids)
        assert pairs[0].numel() == 8  # one pair per group
        metrics = d3po.train_epoch(model, optimizer, rollouts, pairs, cfg, dist, epoch)
        assert metrics["train/optimizer_steps"] == 1 and metrics["train/pairs"] == 8
    assert metrics["train/implicit_acc"] > 0.5
    return before, expected_reward(model)


def test_updates_climb_the_reward_and_negated_rewards_descend():
    before, after = run_updates(first_coordinate_reward)
    assert before == pytest.approx(0.0, abs=0.05)
    assert after > before + 0.1, (before, after)
    before_neg, after_neg = run_updates(negated)
    assert after_neg < before_neg - 0.1, (before_neg, after_neg)


def test_deterministic_rollouts_are_a_config_error():
    with pytest.raises(ConfigError, match=r"sampling\.step: D3PO compares the log-probabilities of stochastic steps"):
        from_dict(d3po.Config, {"sampling": {"step": "ode"}})
