"""DiffusionNFT (flowrl/recipes/nft.py): updates on the toy flow raise its known reward, negated advantages
lower it; the old snapshot is the sampler. Runs, resume and 2-process equivalence: test_trainers_*.py."""

import pytest
import torch

from flowrl.config import from_dict
from flowrl.data.group_sampler import GroupSampler
from flowrl.dist import Dist
from flowrl.recipes import nft
from flowrl.rl.snapshots import ParamSnapshot, optimizer_steps

from toy import TOY_SAMPLING, ToyFlow, expected_reward, first_coordinate_reward, forward_epoch_data


def run_updates(negate: bool, epochs: int = 8) -> tuple[float, float]:
    cfg = from_dict(nft.Config, {"sampling": TOY_SAMPLING, "advantage": {"negate": negate}, "optim": {"lr": 3e-3},
                                 "train": {"micro_batch_size": 128, "times": {"count": 2}}})
    model, dist = ToyFlow(), Dist(cpu=True)
    model.freeze_reference()
    sampler = GroupSampler(["p"] * 8, None, groups=8, group_size=16, seed=0)
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=cfg.optim.lr)
    old = ParamSnapshot(model, cfg.train.old.schedule())
    before = expected_reward(model)
    for epoch in range(epochs):
        data, sigmas = forward_epoch_data(model, cfg, dist, sampler.epoch(epoch), epoch, first_coordinate_reward,
                                          velocity_fn=old.velocity_fn(model, 1.0))
        metrics = nft.train_epoch(model, optimizer, data, sigmas, cfg, dist, epoch, old=old)
        assert metrics["train/optimizer_steps"] == 1 and metrics["train/grad_norm"] > 0
        old.update(model, optimizer_steps(optimizer))
    return before, expected_reward(model)


def test_updates_climb_the_reward_and_negated_advantages_descend():
    before, after = run_updates(negate=False)
    assert before == pytest.approx(0.0, abs=0.05)  # the base model is centred
    assert after > before + 0.1, (before, after)
    before_neg, after_neg = run_updates(negate=True)
    assert before_neg == pytest.approx(before)
    assert after_neg < before_neg - 0.1, (before_neg, after_neg)
