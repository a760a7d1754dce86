"""Video rewards on constructed videos: image rewards score every frame (mean by default, min through
``per_frame``), min <= mean, a still video has the maximal temporal consistency and shuffled noise a low one, and
the composites hand videos to their terms."""

from __future__ import annotations

import pytest
import torch

from rewards import Reward, RewardError, RewardOutput, build_reward, load


class Brightness(Reward):
    """The mean pixel value of each image: easy to predict per frame."""

    name = "brightness"
    differentiable = True

    def score(self, images, prompts, metadata):
        assert images.dim() == 4  # an image reward never sees a clip
        return RewardOutput(images.mean(dim=(1, 2, 3)), {"brightness/x2": 2 * images.mean(dim=(1, 2, 3))})


def ramp(b=2, f=4, size=8):
    """Frame k of video i has every pixel at (k + 1) / (f + 1) * (i + 1) / b."""
    levels = (torch.arange(f) + 1.0) / (f + 1)
    scale = (torch.arange(b) + 1.0) / b
    return (scale.view(b, 1) * levels.view(1, f)).view(b, f, 1, 1, 1).expand(b, f, 3, size, size).clone()


def test_an_image_reward_scores_each_frame_and_means_them():
    videos = ramp()
    out = Brightness()(videos, ["a", "b"])
    expected = videos.mean(dim=(2, 3, 4)).mean(dim=1)
    torch.testing.assert_close(out.scores, expected)
    torch.testing.assert_close(out.details["brightness/x2"], 2 * expected)
    batched = Brightness()
    batched.batch_size = 3  # 8 frames in batches of 3
    torch.testing.assert_close(batched(videos, ["a", "b"]).scores, expected)


def test_per_frame_min_is_at_most_the_mean_and_is_the_worst_frame():
    videos = torch.rand(3, 5, 3, 8, 8)
    mean = PerFrame(Brightness(), "mean")(videos, ["a"] * 3).scores
    low = PerFrame(Brightness(), "min")(videos, ["a"] * 3).scores
    assert (low <= mean + 1e-7).all() and (low < mean).any()
    torch.testing.assert_close(low, videos.mean(dim=(2, 3, 4)).amin(dim=1))
    torch.testing.assert_close(PerFrame(Brightness())(videos[:, 0], ["a"] * 3).scores, videos[:, 0].mean(dim=(1, 2, 3)))
    with pytest.raises(RewardError, match="reduce 'max' unknown"):
        PerFrame(Brightness(), "max")


def test_per_frame_from_a_spec_and_gradients_through_min():
    reward = build_reward({"per_frame": {"kwargs": {"reward": "jpeg_incompressibility", "reduce": "min"}}})
    videos = torch.rand(2, 3, 3, 16, 16)
    videos[0, 1] = 0.5  # a flat frame compresses well: the worst frame of video 0
    out = reward(videos, ["a", "b"])
    frame_kb = load("jpeg_incompressibility")(videos.flatten(0, 1), ["a"] * 6).scores.view(2, 3)
    torch.testing.assert_close(out.scores, frame_kb.amin(dim=1))
    x = torch.rand(2, 3, 3, 8, 8, requires_grad=True)
    PerFrame(Brightness(), "min")(x, ["a", "b"]).scores.sum().backward()
    assert (x.grad.flatten(2).sum(2) > 0).sum() == 2  # one frame per video gets the gradient


def test_temporal_consistency_still_is_max_and_noise_is_low():
    reward = load("temporal_consistency")
    still = torch.rand(1, 1, 3, 16, 16).expand(1, 6, 3, 16, 16)
    noise = torch.rand(1, 6, 3, 16, 16)
    slow = torch.linspace(0, 0.5, 6).view(1, 6, 1, 1, 1).expand(1, 6, 3, 16, 16)
    scores = reward(torch.cat([still, noise, slow]), ["a"] * 3).scores
    assert scores[0] == 1.0
    assert abs(float(scores[1]) - 2 / 3) < 0.03  # E|u - v| = 1/3 for independent uniform frames
    torch.testing.assert_close(scores[2], torch.tensor(0.9))  # 0.1 change a step
    shuffled = torch.rand(1, 6, 3, 16, 16).sort(dim=1).values[:, torch.randperm(6)]
    assert reward(shuffled, ["a"]).scores[0] < scores[2]
    assert reward(noise[:, :1], ["a"]).scores[0] == 1.0  # one frame: nothing changes
    with pytest.raises(RewardError, match="scores videos"):
        reward(torch.rand(2, 3, 8, 8), ["a", "b"])


def test_a_weighted_sum_hands_videos_to_each_term():
    reward = build_reward({"temporal_consistency": 1.0, "per_frame": {"weight": 2.0, "kwargs": {
        "reward": "jpeg_compressibility", "reduce": "mean"}}})
    videos = torch.rand(2, 3, 3, 16, 16)
    out = reward(videos, ["a", "b"])
    expected = (load("temporal_consistency")(videos, ["a", "b"]).scores
                + 2 * load("jpeg_compressibility")(videos, ["a", "b"]).scores)
    torch.testing.assert_close(out.scores, expected)


from rewards.video import PerFrame  # noqa: E402
