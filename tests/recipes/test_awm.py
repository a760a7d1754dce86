"""AWM (flowrl/recipes/awm.py): updates on the toy flow raise its known reward, negated advantages lower it.
Runs, resume and 2-process equivalence: test_trainers_*.py."""

import pytest
import torch

from flowrl.config import from_dict
from flowrl.data.group_sampler import GroupSampler
from flowrl.dist import Dist
from flowrl.recipes import awm
from flowrl.rl.snapshots import ParamSnapshot, optimizer_steps

from toy import TOY_SAMPLING, ToyFlow, expected_reward, first_coordinate_reward, forward_epoch_data


def run_updates(negate: bool, epochs: int = 8) -> tuple[float, float]:
    cfg = from_dict(awm.Config, {"sampling": TOY_SAMPLING, "advantage": {"negate": negate}, "optim": {"lr": 3e-3},
                                 "train": {"micro_batch_size": 128, "ema_kl_coef": 0.1}})
    model, dist = ToyFlow(), Dist(cpu=True)
    model.freeze_reference()
    sampler = GroupSampler(["p"] * 8, None, groups=8, group_size=16, seed=0)
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=cfg.optim.lr)
    ema = ParamSnapshot(model, cfg.train.ema.schedule())
    before = expected_reward(model)
    for epoch in range(epochs):
        data, sigmas = forward_epoch_data(model, cfg, dist, sampler.epoch(epoch), epoch, first_coordinate_reward)
        metrics = awm.train_epoch(model, optimizer, data, sigmas, cfg, dist, epoch, ema_snapshot=ema)
        assert metrics["train/ratio_mean"] == 1.0 and metrics["train/grad_norm"] > 0  # on-policy
        ema.update(model, optimizer_steps(optimizer))
    return before, expected_reward(model)


def test_updates_climb_the_reward_and_negated_advantages_descend():
    before, after = run_updates(negate=False)
    assert before == pytest.approx(0.0, abs=0.05)
    assert after > before + 0.1, (before, after)
    before_neg, after_neg = run_updates(negate=True)
    assert before_neg == pytest.approx(before)
    assert after_neg < before_neg - 0.1, (before_neg, after_neg)
