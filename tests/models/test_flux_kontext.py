"""The FLUX.1-Kontext adapter reproduces ``FluxKontextPipeline``: a flowrl Euler ODE rollout from the same noise and
the same source image equals the pipeline's latents and images; the source changes the prediction; the prompt
cache keys on prompt and source; a prompt without its source is refused in one line."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

ATOL = 1e-5
PROMPTS = ["make the cat blue", "a red square"]


@pytest.fixture(scope="module")
def tiny_kontext(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tiny("flux_kontext", tmp_path_factory.mktemp("tiny") / "flux_kontext")
    finally:
        torch.set_num_threads(threads)


def load(path, **kwargs):
    from flowrl.models.flux_kontext import FluxKontextModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return FluxKontextModel.from_pretrained(path, **kwargs)


def sources(seed=0, n=2, size=TINY_RESOLUTION):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def rows(images):
    return [{"source_image": image} for image in images]


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline(model, x_t, source, steps, guidance, output_type):
    from diffusers import FluxKontextPipeline

    b, c, h, w = x_t.shape
    packed = FluxKontextPipeline._pack_latents(x_t.clone(), b, c, h, w)
    with torch.no_grad():
        out = model.pipeline(image=source, prompt=PROMPTS, latents=packed, num_inference_steps=steps,
                             guidance_scale=guidance, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                             max_sequence_length=model.max_sequence_length, output_type=output_type,
                             max_area=TINY_RESOLUTION ** 2, _auto_resize=False).images
    if output_type == "latent":
        return FluxKontextPipeline._unpack_latents(out, TINY_RESOLUTION, TINY_RESOLUTION, model.vae_scale_factor)
    return out


@pytest.mark.parametrize("steps,guidance", [(2, 2.5), (4, 4.0)])
def test_sampling_matches_the_pipeline(tiny_kontext, steps, guidance):
    model = load(tiny_kontext)
    assert model.conditions_on_source and not model.uses_cfg and model.latent_shape == (16, 8, 8)
    x_t = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(steps))
    source = sources(steps)
    with torch.no_grad():
        cond = model.encode_prompts(PROMPTS, rows(source))
        ours = _euler(model.velocity_fn(guidance), x_t, model.sigmas(steps), cond)
        torch.testing.assert_close(ours, _pipeline(model, x_t, source, steps, guidance, "latent"), rtol=0, atol=ATOL)
        torch.testing.assert_close(model.decode(ours), _pipeline(model, x_t, source, steps, guidance, "pt"),
                                   rtol=0, atol=ATOL)


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


def test_lora_and_reference(tiny_kontext):
    model = load(tiny_kontext, lora=LoraConfig(rank=4, alpha=8))
    x, sigma = torch.randn(2, *model.latent_shape), torch.tensor(0.5)
    cond = model.encode_prompts(PROMPTS, rows(sources()))
    with model.reference():
        base = model.velocity(x, sigma, cond)
    with torch.no_grad():
        for name, p in unwrap(model.denoiser).named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    assert (model.velocity(x, sigma, cond) - base).abs().max() > 1e-4
    with model.reference():
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
