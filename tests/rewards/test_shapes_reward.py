"""The verifiable shapes reward on rendered scenes: accurate clean and degraded, fractional scores,
blind to noise, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

import rewards
from flowrl.data.shapes import Scene, SceneObject, render_batch, sample_examples
from rewards import RewardError
from rewards.shapes import ShapesReward


@pytest.fixture(scope="module")
def examples():
    return sample_examples("eval", 300, seed=5)


@pytest.fixture(scope="module")
def reward():
    return rewards.load("shapes")


def _degrade(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Gaussian blur of radius 1, then Gaussian pixel noise of std 0.05 (images in [0, 1])."""
    blurred = np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(1)), dtype=np.float32) / 255.0
    return np.clip(blurred + rng.normal(0.0, 0.05, blurred.shape), 0.0, 1.0).astype(np.float32)


def test_registry_builds_the_shapes_reward(reward):
    assert isinstance(reward, ShapesReward) and reward.name == "shapes" and not reward.differentiable


def test_accuracy_on_clean_renders(examples, reward):
    out = reward(render_batch([e.scene for e in examples]), [e.prompt for e in examples])
    assert out.scores.shape == (300,) and set(out.details) >= {"correct", "objects"}
    assert out.details["correct"].mean().item() >= 0.99
    assert torch.equal(out.details["correct"], (out.scores == 1).float())


def test_accuracy_with_blur_and_noise(examples, reward):
    rng = np.random.default_rng(0)
    images = torch.from_numpy(np.stack([_degrade(e.image, rng) for e in examples])).permute(0, 3, 1, 2)
    out = reward(images, [e.prompt for e in examples])
    assert out.details["correct"].mean().item() >= 0.95


def test_scores_are_fractions_of_constraints(reward):
    circle = SceneObject("circle", "red", 9.0, 16.0, 11.0)
    square = SceneObject("square", "blue", 23.0, 16.0, 10.0)
    both, one = render_batch([Scene((circle, square))]), render_batch([Scene((circle,))])
    images = torch.cat([both, one, one, both, both])
    prompts = ["a circle and a square", "a circle and a square", "a red circle and a blue square",
               "a red circle left of a blue square", "a red circle right of a blue square"]
    out = reward(images, prompts)
    # 2/2; 1 of 2 shapes; circle + red circle of 4; all 5 (shapes, colours, relation); 4 of 5.
    assert out.scores.tolist() == pytest.approx([1.0, 0.5, 0.5, 1.0, 0.8])
    assert out.details["correct"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert out.details["objects"].tolist() == [2.0, 1.0, 1.0, 2.0, 2.0]


def test_noise_images_are_not_correct(examples, reward):
    generator = torch.Generator().manual_seed(0)
    noise = torch.rand(len(examples), 3, 32, 32, generator=generator)
    out = reward(noise, [e.prompt for e in examples])
    assert out.details["correct"].mean().item() < 0.02


def test_unparseable_prompt_raises_a_clear_reward_error(reward):
    with pytest.raises(RewardError) as info:
        reward(torch.ones(2, 3, 32, 32), ["a circle", "a photo of a dog"])
    message = str(info.value)
    assert message.startswith("shapes reward: cannot parse prompt 'a photo of a dog'")
    assert "a red circle and a blue square" in message and "\n" not in message
