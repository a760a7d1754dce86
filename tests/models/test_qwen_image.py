"""The Qwen-Image adapter: the cached prompt rows equal the pipeline's ``encode_prompt``, guidance is the norm-rescaled
true CFG, one step is refused, encode_images inverts decode's normalisation, gradient checkpointing and a bf16 base.
Sampling against ``QwenImagePipeline`` (guided and unguided), the schedule and LoRA / reference / state:
test_families.py."""

from __future__ import annotations

import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]  # different lengths: the mask matters


@pytest.fixture
def tiny_qwen(tiny_dir):
    return tiny_dir("qwen_image")  # tests/conftest.py: built once per session


def load(path, **kwargs):
    from flowrl.models.qwen_image import QwenImageModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return QwenImageModel.from_pretrained(path, **kwargs)


def test_shapes_cond_and_decode(tiny_qwen):
    model = load(tiny_qwen)
    assert model.latent_shape == (16, 8, 8) and model.uses_cfg and model.default_guidance == 4.0
    cond = model.encode_prompts(PROMPTS + PROMPTS[:1])
    assert cond["prompt_embeds"].shape == (3, TINY_MAX_SEQUENCE_LENGTH, 32)
    lengths = cond["prompt_embeds_mask"].sum(1).tolist()
    assert lengths[0] == lengths[2] < lengths[1]  # "a red cat" is shorter; padding is masked
    assert cond["prompt_embeds"][0, lengths[0]:].abs().max() == 0
    # the cached rows equal the pipeline's own encode_prompt
    ref, mask = model.pipeline.encode_prompt(PROMPTS, max_sequence_length=model.max_sequence_length)
    torch.testing.assert_close(cond["prompt_embeds"][:2, : ref.shape[1]], ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(cond["prompt_embeds_mask"][:2, : ref.shape[1]], mask.long())
    x = torch.randn(2, *model.latent_shape)
    v = model.velocity(x, torch.tensor(0.7), model.encode_prompts(PROMPTS))
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    images = model.decode(x)
    assert images.shape == (2, 3, 64, 64) and 0 <= images.min() and images.max() <= 1


def test_guidance_is_the_norm_rescaled_combination(tiny_qwen):
    from diffusers import QwenImagePipeline

    model = load(tiny_qwen)
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(PROMPTS)
    sigma = torch.tensor(0.6)
    with torch.no_grad():
        v_c = QwenImagePipeline._pack_latents(model.velocity(x, sigma, cond), 2, 16, 8, 8)
        v_u = QwenImagePipeline._pack_latents(model.velocity(x, sigma, model.uncond(2)), 2, 16, 8, 8)
        guided = QwenImagePipeline._pack_latents(model.velocity_fn(5.0)(x, sigma, cond), 2, 16, 8, 8)
    plain = v_u + 5.0 * (v_c - v_u)
    torch.testing.assert_close(guided, plain * v_c.norm(dim=-1, keepdim=True) / plain.norm(dim=-1, keepdim=True),
                               rtol=1e-5, atol=ATOL)
    torch.testing.assert_close(guided.norm(dim=-1), v_c.norm(dim=-1), rtol=1e-5, atol=ATOL)  # norms kept
    assert (guided - plain).abs().max() > 1e-3  # the rescale does something here
    assert model.velocity_fn(1.0) == model.velocity


def test_one_step_is_refused_with_the_reason(tiny_qwen):
    """shift_terminal stretches linspace(1, 1/n, n) so its last value is 0.02: with n = 1 diffusers divides by
    zero (NaN sigmas); flowrl says why instead."""
    with pytest.raises(ValueError, match="at least 2 steps"):
        load(tiny_qwen).sigmas(1)


def test_encode_images_inverts_the_normalisation(tiny_qwen):
    """encode_images undoes decode's per-channel statistics: on the VAE's own reconstruction it is a fixed point
    up to the VAE's error, and it equals (mode - mean) / std computed by hand."""
    model = load(tiny_qwen)
    images = torch.rand(2, 3, 64, 64)
    z = model.encode_images(images)
    vae = model.pipeline.vae
    raw = vae.encode(images.unsqueeze(2) * 2 - 1).latent_dist.mode()[:, :, 0]
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1)
    torch.testing.assert_close(z, (raw - mean) / std, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        decoded = vae.decode((z * std + mean).unsqueeze(2), return_dict=False)[0][:, :, 0]
    torch.testing.assert_close(model.decode(z), (decoded / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)


def test_gradient_checkpointing_and_bf16_base(tiny_qwen):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(3)
        model = load(tiny_qwen, lora=LoraConfig(rank=4, alpha=8), gradient_checkpointing=checkpointing)
        with torch.no_grad():
            for name, p in unwrap(model.denoiser).named_parameters():
                if "lora_B" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        model.train()
        x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(1))
        model.velocity_fn(4.0)(x, torch.tensor(0.5), model.encode_prompts(PROMPTS)).pow(2).mean().backward()
        # the last block's text-stream outputs are discarded, so its txt_mlp gets no gradient
        grads.append({n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for n, p in unwrap(model.denoiser).named_parameters() if p.requires_grad})
    assert sum(bool(g.abs().max() > 0) for g in grads[0].values()) > 0.5 * len(grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-5, msg=name)
    model = load(tiny_qwen, dtype="bf16", lora=LoraConfig(rank=4, alpha=8))
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}
    assert next(model.pipeline.vae.parameters()).dtype == torch.float32
    v = model.velocity(torch.randn(2, *model.latent_shape), torch.tensor(0.5), model.encode_prompts(PROMPTS))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
