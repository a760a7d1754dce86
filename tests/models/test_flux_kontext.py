"""The FLUX.1-Kontext adapter: the source changes the prediction; the prompt cache keys on prompt and source; a prompt
without its source is refused in one line. Sampling against ``FluxKontextPipeline`` from the same source images and
LoRA: test_families.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

PROMPTS = ["make the cat blue", "a red square"]


@pytest.fixture
def tiny_kontext(tiny_dir):
    return tiny_dir("flux_kontext")  # tests/conftest.py: built once per session


def load(path, **kwargs):
    from flowrl.models.flux_kontext import FluxKontextModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return FluxKontextModel.from_pretrained(path, **kwargs)


def sources(seed=0, n=2, size=TINY_RESOLUTION):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def rows(images):
    return [{"source_image": image} for image in images]


def test_the_source_conditions_the_prediction_and_keys_the_cache(tiny_kontext):
    model = load(tiny_kontext)
    x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.7)
    a, b = sources(1), sources(2)
    cond_a = model.encode_prompts(PROMPTS, rows(a))
    assert cond_a["image_latents"].shape == (2, 16, 8, 8)
    from flowrl.models.loading import vae_encode

    torch.testing.assert_close(cond_a["image_latents"], vae_encode(model.pipeline.vae, a), rtol=1e-5, atol=1e-6)
    cond_b = model.encode_prompts(PROMPTS, rows(b))
    assert len(model._prompt_cache) == 4  # same prompts, other sources: new cache rows
    assert (model.velocity(x, sigma, cond_a) - model.velocity(x, sigma, cond_b)).abs().max() > 1e-4
    again = model.encode_prompts(PROMPTS, rows(a.clone()))  # equal content: a cache hit
    assert len(model._prompt_cache) == 4
    torch.testing.assert_close(again["image_latents"], cond_a["image_latents"], rtol=0, atol=0)
    # a PIL source and a larger one are resized to the model's resolution
    from PIL import Image

    pil = Image.fromarray((a[0].permute(1, 2, 0).numpy() * 255).round().astype("uint8"))
    big = torch.nn.functional.interpolate(a[:1], size=(128, 128), mode="bilinear")
    assert model.encode_prompts(PROMPTS[:1], [{"source_image": pil}])["image_latents"].shape == (1, 16, 8, 8)
    assert model.encode_prompts(PROMPTS[:1], [{"source_image": big}])["image_latents"].shape == (1, 16, 8, 8)


def test_a_prompt_without_its_source_is_refused(tiny_kontext):
    model = load(tiny_kontext)
    with pytest.raises(ValueError, match="prompt 0: FluxKontextModel edits a source image and got no source_image"):
        model.encode_prompts(PROMPTS)
    with pytest.raises(ValueError, match=r"prompt 1: .* of shape \(8,\)"):
        model.encode_prompts(PROMPTS, [{"source_image": sources()[0]}, {"source_image": torch.zeros(8)}])
