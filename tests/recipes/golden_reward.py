"""A smooth reward for the golden-metric tests: cross-CPU rounding moves it by rounding, never by a step.

JPEG size (the reward the first goldens used) jumps by whole bytes when one pixel rounds the other way, so a
golden recorded on one CPU failed on another. This reward is a fixed smooth function of the pixels: the mean
red minus half the mean blue over the top-left quarter of the image, plus a small quadratic term so that its
gradient is not constant. The random tiny model's images vary enough there that group advantages are O(1).
"""

from __future__ import annotations

from rewards import RewardOutput
from rewards.base import Reward, to_image_tensor
from rewards.registry import REWARDS

__all__ = ["SmoothReward", "NAME"]

NAME = "golden_smooth"


class SmoothReward(Reward):
    name = NAME

    def __init__(self, device: str = "cpu", **_):
        pass

    def score(self, images, prompts, metadata=None) -> RewardOutput:
        x = to_image_tensor(images).double()
        quarter = x[:, :, : x.shape[2] // 2, : x.shape[3] // 2]
        red, blue = quarter[:, 0].mean(dim=(1, 2)), quarter[:, 2].mean(dim=(1, 2))
        value = red - 0.5 * blue + 0.25 * (red - 0.5) ** 2
        return RewardOutput(value.float(), {f"{NAME}/red": red.float()})


if NAME not in REWARDS.names():
    REWARDS.register(NAME, SmoothReward)
