"""The torch preprocessing of the CLIP-based rewards equals each library's own processor on PIL images.

The libraries round to uint8 after resizing; comparing on uint8-exact inputs, the remaining difference
is at most about one uint8 level after normalisation (1/255/std ~ 0.015). Without resizing the
results are identical."""

from __future__ import annotations

import pytest
import torch

from rewards import testing
from rewards._preprocess import ImagePreprocess, from_hf_image_processor, from_open_clip
from rewards.base import to_pil_images

SIZES = [(48, 64), (64, 48), (33, 50), (32, 47), (96, 96)]
ONE_LEVEL = 1.05 / 255 / 0.2613  # one uint8 step divided by the smallest CLIP std


def uint8_exact(images: torch.Tensor) -> torch.Tensor:
    return (images * 255).round() / 255


@pytest.fixture(scope="module")
def open_clip_model_and_preprocess(open_clip_dir):
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(open_clip_dir)
    return model, preprocess


@pytest.mark.parametrize("hw", SIZES)
def test_open_clip_preprocess_matches_open_clip(open_clip_model_and_preprocess, hw):
    model, preprocess = open_clip_model_and_preprocess
    images = uint8_exact(testing.random_images(2, *hw, seed=hw[0] * hw[1]))
    reference = torch.stack([preprocess(image) for image in to_pil_images(images)])
    ours = from_open_clip(model)(images)
    assert ours.shape == reference.shape == (2, 3, 32, 32)
    diff = (ours - reference).abs()
    assert diff.max() <= ONE_LEVEL
    assert diff.mean() < 0.01


@pytest.mark.parametrize("hw", SIZES)
def test_hf_preprocess_matches_clip_processor(hf_clip_dirs, hw):
    from transformers import CLIPProcessor

    processor = CLIPProcessor.from_pretrained(hf_clip_dirs[1])
    images = uint8_exact(testing.random_images(2, *hw, seed=hw[0] + hw[1]))
    reference = processor(images=to_pil_images(images), return_tensors="pt").pixel_values
    ours = from_hf_image_processor(processor)(images)
    assert ours.shape == reference.shape == (2, 3, 32, 32)
    diff = (ours - reference).abs()
    assert diff.max() <= ONE_LEVEL
    assert diff.mean() < 0.01


def test_no_resize_is_exact(open_clip_model_and_preprocess, hf_clip_dirs):
    from transformers import CLIPProcessor

    model, preprocess = open_clip_model_and_preprocess
    images = uint8_exact(testing.random_images(2, 32, 32, seed=5))
    pils = to_pil_images(images)
    ref_oc = torch.stack([preprocess(image) for image in pils])
    torch.testing.assert_close(from_open_clip(model)(images), ref_oc, atol=1e-6, rtol=0)
    processor = CLIPProcessor.from_pretrained(hf_clip_dirs[1])
    ref_hf = processor(images=pils, return_tensors="pt").pixel_values
    torch.testing.assert_close(from_hf_image_processor(processor)(images), ref_hf, atol=1e-6, rtol=0)


def test_crop_offsets_follow_each_library():
    """A 15-pixel margin: torchvision (open_clip) rounds 7.5 to 8, transformers floors it to 7."""
    images = torch.arange(32 * 47, dtype=torch.float32).view(1, 1, 32, 47).expand(1, 3, 32, 47) / (32 * 47)
    common = dict(size=(32, 32), mean=(0.0,) * 3, std=(1.0,) * 3)
    rounded = ImagePreprocess(**common, crop_round=True)(images)
    floored = ImagePreprocess(**common, crop_round=False)(images)
    torch.testing.assert_close(rounded, images[..., 8:40])
    torch.testing.assert_close(floored, images[..., 7:39])


def test_preprocess_is_differentiable():
    images = testing.random_images(2, 48, 64).requires_grad_(True)
    pre = ImagePreprocess(size=(32, 32), mean=(0.5,) * 3, std=(0.25,) * 3)
    pre(images).square().sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
