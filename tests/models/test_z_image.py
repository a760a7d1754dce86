"""The Z-Image adapter: the prediction is the negated transformer output at t = 1 - sigma, and the masked prompt rows
are the pipeline's variable-length embeddings. Sampling against ``ZImagePipeline`` (CFG in flowrl's units,
w = guidance_scale + 1, and without: Turbo), the schedule and LoRA: test_families.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

PROMPTS = ["a red cat", "a blue square on a wooden table"]


@pytest.fixture
def tiny_z(tiny_dir):
    return tiny_dir("z_image")  # tests/conftest.py: built once per session


def load(path, **kwargs):
    from flowrl.models.z_image import ZImageModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return ZImageModel.from_pretrained(path, **kwargs)


def test_shapes_and_masked_prompts(tiny_z):
    model = load(tiny_z)
    assert model.latent_shape == (16, 8, 8) and model.default_guidance == 1.0
    cond = model.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, TINY_MAX_SEQUENCE_LENGTH, 32)
    rows = model.pipeline._encode_prompt(list(PROMPTS), max_sequence_length=model.max_sequence_length)
    for i, row in enumerate(rows):
        n = int(cond["prompt_embeds_mask"][i].sum())
        assert n == row.shape[0]
        torch.testing.assert_close(cond["prompt_embeds"][i, :n], row, rtol=1e-5, atol=1e-6)
        assert cond["prompt_embeds"][i, n:].abs().max() == 0
    x = torch.randn(2, *model.latent_shape)
    images = model.decode(x)
    assert images.shape == (2, 3, 64, 64) and 0 <= images.min() and images.max() <= 1


def test_velocity_is_minus_the_transformer_output_at_one_minus_sigma(tiny_z):
    model = load(tiny_z)
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(PROMPTS)
    rows = model.pipeline._encode_prompt(list(PROMPTS), max_sequence_length=model.max_sequence_length)
    with torch.no_grad():
        out = model.pipeline.transformer(list(x.unsqueeze(2).unbind(0)), torch.full((2,), 0.3), rows,
                                         return_dict=False)[0]
        v = model.velocity(x, torch.tensor(0.7), cond)
    torch.testing.assert_close(v, -torch.stack(out).squeeze(2), rtol=0, atol=1e-6)
