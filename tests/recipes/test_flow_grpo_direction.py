"""Direction: a few Flow-GRPO updates on a toy problem with a known answer raise the expected reward,
and the same updates with negated advantages lower it. (A loop can pass the on-policy-ratio test and
still climb the wrong way; this test catches it.)"""

import pytest
import torch

from flowrl.config import from_dict
from flowrl.data.prompt_groups import PromptGroups
from flowrl.dist import Dist
from flowrl.recipes.flow_grpo import Config, train_epoch
from flowrl.eval.generate import generate

from toy import ToyFlow, first_coordinate_reward, flow_grpo_epoch


def expected_reward(model) -> float:
    images = generate(model, ["p"] * 4000, list(range(10_000, 14_000)), steps=10, guidance=1.0, batch_size=4000)
    return float(images[:, 0].mean())


def run_updates(negate: bool, epochs: int = 6, train: dict | None = None,
                log: list | None = None) -> tuple[float, float]:
    cfg = from_dict(Config, {
        "run": {"seed": 0},
        "sampling": {"num_steps": 10, "group_size": 16, "groups_per_epoch": 8, "batch_size": 128},
        "advantage": {"negate": negate},
        "optim": {"lr": 3e-3},
        "train": {"clip_range": 0.2, "micro_batch_size": 128, **(train or {})},
    })
    model = ToyFlow()
    dist = Dist(cpu=True)
    groups = PromptGroups(["p"] * 8, None, groups=8, group_size=16, seed=0)
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=cfg.optim.lr)
    before = expected_reward(model)
    for epoch in range(epochs):
        samples, advantages, valid, _ = flow_grpo_epoch(model, cfg, dist, groups.epoch(epoch), epoch,
                                                        first_coordinate_reward)
        metrics = train_epoch(model, optimizer, samples, advantages, valid, cfg, dist, epoch)
        if log is not None:
            log.append(metrics)
    return before, expected_reward(model)


def test_updates_climb_the_reward_and_negated_advantages_descend():
    before, after = run_updates(negate=False)
    assert before == pytest.approx(0.0, abs=0.05)  # the base model is centred
    assert after > before + 0.1, (before, after)
    before_neg, after_neg = run_updates(negate=True)
    assert before_neg == pytest.approx(before)
    assert after_neg < before_neg - 0.1, (before_neg, after_neg)


# GRPO-Guard's RatioNorm and Flow-DPPO change the surrogate; two minibatches per epoch so that their trust regions
# act on the second (off-policy) one, and they do: some rows are clipped (RatioNorm) or masked (Flow-DPPO).
@pytest.mark.parametrize("train", [{"ratio_norm": True, "clip_range": 1e-3, "minibatches": 2},
                                   {"trust_region": "dppo", "dppo_threshold": 1e-4, "minibatches": 2}],
                         ids=["ratio_norm", "flow_dppo"])
def test_ratio_norm_and_flow_dppo_climb_the_reward_and_negated_advantages_descend(train):
    log = []
    before, after = run_updates(negate=False, train=train, log=log)
    assert after > before + 0.1, (before, after)
    assert all(m["train/kl_old"] > 0 for m in log) and any(m["train/clip_frac"] > 0 for m in log)
    before_neg, after_neg = run_updates(negate=True, train=train)
    assert after_neg < before_neg - 0.1, (before_neg, after_neg)
