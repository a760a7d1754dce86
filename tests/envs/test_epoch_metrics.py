"""The epoch metrics every VLM recipe logs (flowrl/envs/epoch.py ``epoch_metrics``): the rollout entropy estimate and
the share of groups with mixed rewards, per reward component, on hand-built episodes."""

from __future__ import annotations

import pytest
import torch

from flowrl.envs.base import Task
from flowrl.envs.epoch import EpochBatch, epoch_metrics
from flowrl.envs.rollout import Episode


def _episode(logprobs: list[list[float]]):
    return Episode(Task("q", "a", "count"), [], logprobs=[torch.tensor(lp) for lp in logprobs],
                   turn_rewards=[0.0] * len(logprobs), counts=dict.fromkeys(
                       ("truncated", "empty", "malformed", "tool_call", "turn_limit"), 0.0))


def test_rollout_entropy_and_mixed_groups():
    episodes = [_episode([[-0.5, -1.5]]), _episode([[-1.0]]), _episode([[-2.0], [-3.0, -1.0]]), _episode([[]])]
    exact = torch.tensor([1.0, 0.0, 1.0, 1.0])  # group 0 mixed, group 1 all right
    scene = torch.tensor([0.5, 0.5, 0.2, 0.7])  # group 0 constant, group 1 mixed
    rewards = exact + scene
    batch = EpochBatch(episodes, torch.tensor([0, 0, 1, 1]), rewards, rewards[:, None], torch.ones(4, 1, dtype=bool),
                       {"exact": exact, "scene": scene}, {k: 0.0 for k in ("truncated", "empty", "malformed",
                                                                            "tool_call", "turn_limit", "rounds",
                                                                            "groups_kept", "zero_std_frac_sampled")}
                       | {"episodes": 4.0})
    m = epoch_metrics(batch, "shapes_vqa")
    # Minus the mean log-prob over the 6 sampled tokens of every turn of every episode.
    assert m["train/rollout_entropy"] == pytest.approx((0.5 + 1.5 + 1.0 + 2.0 + 3.0 + 1.0) / 6)
    assert m["train/mixed_groups/exact"] == 0.5 and m["train/mixed_groups/scene"] == 0.5
    assert m["train/mixed_groups/reward"] == 1.0 == 1 - m["train/zero_std_frac"]
