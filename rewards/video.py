"""Video rewards: ``per_frame`` (any image reward on every frame, reduced by mean or min) and
``temporal_consistency`` (how little consecutive frames change).

Every image reward already scores videos frame by frame with the mean over frames (rewards/base.py);
``per_frame`` makes the reduction explicit and configurable, e.g. in YAML::

    reward:
      train:
        per_frame: {kwargs: {reward: pickscore, reduce: min}}   # the worst frame's PickScore
        temporal_consistency: 0.5

``temporal_consistency`` is ``1 - mean |f_{t+1} - f_t|``: the mean absolute change of each pixel channel between
consecutive frames (values in [0, 1]) subtracted from 1. A still video scores 1 (the maximum); independent uniform
noise frames score about ``2 / 3`` (``E|u - v| = 1 / 3``); a one-frame video scores 1 (nothing changes). It rewards
stillness as much as coherence, so weight it against a per-frame quality reward, never alone. Detail
``temporal_consistency/max_change``: the largest consecutive-frame change of each video.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import FRAME_REDUCTIONS, Reward, RewardError, RewardOutput, score_frames

__all__ = ["PerFrame", "TemporalConsistency"]


class PerFrame(Reward):
    """The image reward ``reward`` (a registered name, built with ``kwargs``; or a Reward) on every frame of a
    video ``[B, F, 3, H, W]``, reduced per video with ``reduce`` (``"mean"`` or ``"min"``). Images
    ``[B, 3, H, W]`` are scored by the inner reward unchanged."""

    accepts_video = True

    def __init__(self, reward: str | Reward = "", reduce: str = "mean", kwargs: dict[str, Any] | None = None):
        if reduce not in FRAME_REDUCTIONS:
            raise RewardError(f"per_frame: reduce {reduce!r} unknown; valid: {', '.join(FRAME_REDUCTIONS)}")
        if isinstance(reward, str):
            if not reward:
                raise RewardError("per_frame needs the image reward to apply, e.g. "
                                  "per_frame: {kwargs: {reward: pickscore, reduce: min}}")
            from .registry import load

            reward = load(reward, **(kwargs or {}))
        elif kwargs:
            raise RewardError("per_frame: kwargs go with a reward name, not a built Reward")
        if getattr(reward, "accepts_video", False):
            raise RewardError(f"per_frame: {reward.name} scores whole videos itself; give an image reward")
        self.reward, self.reduce = reward, reduce
        self.name = f"per_frame_{reduce}({reward.name})"
        self.differentiable = reward.differentiable
        self.batch_size = reward.batch_size
        self.device = reward.device

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        if images.dim() == 5:
            return score_frames(self.reward, images, prompts, metadata, self.reduce)
        return self.reward(images, prompts, metadata)


class TemporalConsistency(Reward):
    """``1 - mean |f_{t+1} - f_t|`` per video ``[B, F, 3, H, W]`` in [0, 1] (see the module docstring);
    differentiable. Images are refused: there is no motion to measure."""

    name = "temporal_consistency"
    differentiable = True
    accepts_video = True

    def __init__(self, batch_size: int = 64, device: str = "cpu"):
        self.batch_size = int(batch_size)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        if images.dim() != 5:
            raise RewardError(f"temporal_consistency scores videos [B, F, 3, H, W]; got images of shape "
                              f"{tuple(images.shape)} (a video model's frames are needed)")
        if images.shape[1] < 2:
            ones = images.new_ones(images.shape[0])
            return RewardOutput(ones, {f"{self.name}/max_change": torch.zeros_like(ones)})
        change = (images[:, 1:] - images[:, :-1]).abs().flatten(2).mean(dim=2)  # [B, F - 1]
        return RewardOutput(1.0 - change.mean(dim=1), {f"{self.name}/max_change": change.amax(dim=1).detach()})
