"""The Z-Image adapter reproduces ``ZImagePipeline``: a flowrl Euler ODE rollout from the same noise equals the
pipeline's latents and images (with CFG in flowrl's units, w = guidance_scale + 1, and without: Turbo), the schedule
equals the scheduler's, the prediction is the negated transformer output at t = 1 - sigma, and the masked prompt
rows are the pipeline's variable-length embeddings."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]


@pytest.fixture(scope="module")
def tiny_z(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tiny("z_image", tmp_path_factory.mktemp("tiny") / "z_image")
    finally:
        torch.set_num_threads(threads)


def load(path, **kwargs):
    from flowrl.models.z_image import ZImageModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return ZImageModel.from_pretrained(path, **kwargs)


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline(model, x_t, steps, guidance, output_type):
    with torch.no_grad():
        # a copy: ZImagePipeline writes the chat-templated text back into the caller's prompt list
        return model.pipeline(list(PROMPTS), latents=x_t.clone(), guidance_scale=guidance - 1.0,
                              num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                              max_sequence_length=model.max_sequence_length, output_type=output_type).images


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


@pytest.mark.parametrize("steps,guidance", [(1, 1.0), (3, 1.0), (3, 6.0)])
def test_sampling_matches_the_pipeline(tiny_z, steps, guidance):
    model = load(tiny_z)
    x_t = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        ours = _euler(model.velocity_fn(guidance), x_t, model.sigmas(steps), model.encode_prompts(PROMPTS))
        torch.testing.assert_close(ours, _pipeline(model, x_t, steps, guidance, "latent"), rtol=0, atol=ATOL)
        torch.testing.assert_close(model.decode(ours), _pipeline(model, x_t, steps, guidance, "pt"), rtol=0,
                                   atol=ATOL)


@pytest.mark.parametrize("steps", [1, 8, 50])
def test_sigmas_equal_the_scheduler(tiny_z, steps):
    model = load(tiny_z)
    scheduler = copy.deepcopy(model.pipeline.scheduler)
    assert scheduler.config.shift == 3.0 and not scheduler.config.use_dynamic_shifting
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=None)
    torch.testing.assert_close(model.sigmas(steps), scheduler.sigmas, rtol=0, atol=1e-6)


def test_lora_targets_reference_and_gradients(tiny_z):
    model = load(tiny_z, lora=LoraConfig(rank=4, alpha=8))
    module = unwrap(model.denoiser)
    adapted = [n for n, _ in module.named_modules() if n.endswith(".lora_A")]
    for target in model.default_lora_targets():
        assert any(n.removesuffix(".lora_A").endswith("." + target) for n in adapted), target
    assert any(n.startswith("noise_refiner") for n in adapted) and any(n.startswith("context_refiner") for n in adapted)
    x, sigma, cond = torch.randn(2, *model.latent_shape), torch.tensor(0.5), model.encode_prompts(PROMPTS)
    with model.reference():
        base = model.velocity(x, sigma, cond)
    torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    model.train()
    v = model.velocity_fn(6.0)(x, sigma, cond)
    assert (v - model.velocity_fn(6.0)(x, sigma, cond)).abs().max() == 0
    v.pow(2).mean().backward()
    assert all(p.grad is not None for p in model.trainable_parameters())
    with model.reference():
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
