"""``clip_directional`` (an editing reward that sees the source image), on constructed inputs: the formula on known
feature vectors, and on a tiny real open_clip model the symmetries the formula implies (no edit scores 0, reversing
the edit negates the score, reversing both the edit and the captions keeps it), plus its one-line errors."""

from __future__ import annotations

import pytest
import torch

from rewards import testing
from rewards.base import RewardError


def test_directional_similarity_on_known_directions():
    from rewards.clip_directional import directional_similarity

    source = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    edited = torch.tensor([[1.0, 1.0, 0.0], [1.0, -2.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    caption = torch.tensor([[0.0, 0.0, 1.0]] * 4)
    target = torch.tensor([[0.0, 3.0, 1.0]] * 4)  # the text moved along +y
    scores = directional_similarity(edited, source, target, caption)
    # along the text direction: 1; opposite: -1; half along it: cos 45 degrees; no edit: 0
    torch.testing.assert_close(scores, torch.tensor([1.0, -1.0, 2 ** -0.5, 0.0]), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    import rewards

    torch.set_num_threads(1)
    return rewards.load("clip_directional", model_name=testing.tiny_open_clip(tmp_path_factory.mktemp("clip")),
                        pretrained=None)


def test_symmetries_on_a_real_clip(reward):
    source, edited = testing.random_images(2, 48, 64, seed=0), testing.random_images(2, 48, 64, seed=1)
    meta = [{"source_image": source[i], "source_caption": "a red cow"} for i in range(2)]
    prompts = ["a blue cow", "a red cow on the grass"]
    out = reward.score(edited, prompts, meta)
    assert out.scores.shape == (2,) and (out.scores.abs() <= 1 + 1e-6).all() and (out.scores.abs() > 1e-4).all()
    assert (out.details["clip_directional/image_change"] > 0).all()
    # the same image back: no edit, score 0
    assert torch.equal(reward.score(source, prompts, meta).scores, torch.zeros(2))
    # the edit reversed (source and edited swapped): the score flips sign
    swapped = [{"source_image": edited[i], "source_caption": "a red cow"} for i in range(2)]
    torch.testing.assert_close(reward.score(source, prompts, swapped).scores, -out.scores, rtol=0, atol=1e-5)
    # the edit and the captions both reversed: the same score (target_caption overrides the prompt)
    both = [{"source_image": edited[i], "source_caption": prompts[i], "target_caption": "a red cow"} for i in range(2)]
    torch.testing.assert_close(reward.score(source, ["ignored", "ignored"], both).scores, out.scores, rtol=0,
                               atol=1e-5)
    # differentiable in the edited image only
    images = edited.clone().requires_grad_(True)
    reward.score(images, prompts, meta).scores.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_missing_source_is_a_one_line_error(reward):
    images = testing.random_images(1, 48, 64)
    with pytest.raises(RewardError, match="needs metadata with its source_image"):
        reward.score(images, ["a cow"], None)
    with pytest.raises(RewardError, match="sample 0 has no source_image / source_caption"):
        reward.score(images, ["a cow"], [{"source_caption": "a cow"}])
