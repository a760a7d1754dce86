"""The Qwen-Image adapter reproduces ``QwenImagePipeline``: a flowrl Euler ODE rollout from the same noise equals
the pipeline's latents and images (guided and unguided), the schedule equals the scheduler's, the cached prompt
rows equal the pipeline's ``encode_prompt``, and LoRA / reference / state behave as for SD3 and FLUX."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from flowrl.config import LoraConfig

from flowrl.models.base import unwrap
from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

ATOL = 1e-5
PROMPTS = ["a red cat", "a blue square on a wooden table"]  # different lengths: the mask matters


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tiny("qwen_image", tmp_path_factory.mktemp("tiny") / "qwen_image")
    finally:
        torch.set_num_threads(threads)


def load(path, **kwargs):
    from flowrl.models.qwen_image import QwenImageModel

    kwargs.setdefault("resolution", TINY_RESOLUTION)
    kwargs.setdefault("max_sequence_length", TINY_MAX_SEQUENCE_LENGTH)
    return QwenImageModel.from_pretrained(path, **kwargs)


def _euler(velocity_fn, x, sigmas, cond):
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


def _pipeline(model, x_t, steps, guidance, output_type):
    """QwenImagePipeline from the same [B, C, H, W] noise; latents come back unpacked to [B, C, H, W]."""
    from diffusers import QwenImagePipeline

    b, c, h, w = x_t.shape
    packed = QwenImagePipeline._pack_latents(x_t.clone(), b, c, h, w)
    negative = [model.negative_prompt] * b if guidance != 1.0 else None
    with torch.no_grad():
        out = model.pipeline(PROMPTS, negative_prompt=negative, true_cfg_scale=guidance, latents=packed,
                             num_inference_steps=steps, height=TINY_RESOLUTION, width=TINY_RESOLUTION,
                             max_sequence_length=model.max_sequence_length, output_type=output_type).images
    if output_type == "latent":
        return QwenImagePipeline._unpack_latents(out, TINY_RESOLUTION, TINY_RESOLUTION, model.vae_scale_factor)[:, :, 0]
    return out


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


@pytest.mark.parametrize("steps,guidance", [(2, 4.0), (3, 4.0), (3, 1.0)])
def test_sampling_matches_the_pipeline(tiny_qwen, steps, guidance):
    """Euler with velocity_fn(guidance) and sigmas(n) from the same noise == QwenImagePipeline, latents and
    images (true CFG with the pipeline's norm rescaling when guidance > 1)."""
    model = load(tiny_qwen)
    x_t = torch.randn(2, *model.latent_shape)
    with torch.no_grad():
        ours = _euler(model.velocity_fn(guidance), x_t, model.sigmas(steps), model.encode_prompts(PROMPTS))
    torch.testing.assert_close(ours, _pipeline(model, x_t, steps, guidance, "latent"), rtol=0, atol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(model.decode(ours), _pipeline(model, x_t, steps, guidance, "pt"), rtol=0,
                                   atol=ATOL)


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


@pytest.mark.parametrize("steps,resolution", [(2, 64), (10, 64), (50, 128)])
def test_sigmas_equal_the_pipeline_schedule(tiny_qwen, steps, resolution):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    model = load(tiny_qwen, resolution=resolution)
    config = model.pipeline.scheduler.config
    assert config.use_dynamic_shifting and config.shift_terminal == 0.02
    mu = calculate_shift((resolution // 16) ** 2, config.base_image_seq_len, config.max_image_seq_len,
                         config.base_shift, config.max_shift)
    scheduler = copy.deepcopy(model.pipeline.scheduler)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # as QwenImagePipeline calls it
    torch.testing.assert_close(model.sigmas(steps), scheduler.sigmas, rtol=0, atol=1e-6)
    assert abs(float(model.sigmas(steps)[-2]) - 0.02) < 1e-6  # the terminal sigma


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


def test_lora_reference_and_state_round_trip(tiny_qwen):
    model = load(tiny_qwen, lora=LoraConfig(rank=4, alpha=8))
    module = unwrap(model.denoiser)
    adapted = [n for n, _ in module.named_modules() if n.endswith(".lora_A")]
    for target in model.default_lora_targets():
        assert any(n.removesuffix(".lora_A").endswith("." + target) for n in adapted), target
    assert all(p.dtype == torch.float32 and "lora_" in n for n, p in module.named_parameters() if p.requires_grad)
    x, sigma, cond = torch.randn(2, *model.latent_shape), torch.tensor(0.5), model.encode_prompts(PROMPTS)
    with model.reference():
        base = model.velocity(x, sigma, cond)
    torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)  # lora_B = 0 at init
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn_like(p))
    policy = model.velocity(x, sigma, cond)
    assert (policy - base).abs().max() > 1e-4
    with model.reference():
        torch.testing.assert_close(model.velocity(x, sigma, cond), base, rtol=0, atol=0)
    state = model.trainable_state_dict()
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.zero_()
    model.load_trainable_state_dict(state)
    torch.testing.assert_close(model.velocity(x, sigma, cond), policy, rtol=0, atol=0)


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
