"""The SD3 and FLUX adapters reproduce diffusers exactly: velocity/timestep convention, CFG and guidance (sampling
against the pipelines and the schedules: test_families.py).

Reference values come from the real diffusers objects: ``FlowMatchEulerDiscreteScheduler`` (``step``,
``set_timesteps``) and the pipelines' own denoising loops (``StableDiffusion3Pipeline.__call__``,
``FluxPipeline.__call__`` with ``output_type="latent"``).
"""

from __future__ import annotations

import copy

import torch

ATOL = 1e-5


def _euler(velocity_fn, x, sigmas, cond):
    """flowrl's Euler ODE: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v(x_i, sigma_i)."""
    for i in range(len(sigmas) - 1):
        x = x + (sigmas[i + 1] - sigmas[i]) * velocity_fn(x, sigmas[i], cond)
    return x


# ---------------------------------------------------------------------------------------- SD3


def test_sd3_velocity_is_the_transformer_output_at_timestep_sigma_times_1000(load):
    """One Euler step with the adapter's velocity equals scheduler.step on the raw model output."""
    model = load("sd3")
    pipe = model.pipeline
    cond = model.encode_prompts(["a red cat", "a dog"])
    x = torch.randn(2, *model.latent_shape)
    scheduler = copy.deepcopy(pipe.scheduler)
    scheduler.set_timesteps(5)
    sigmas = model.sigmas(5)
    for i in (0, 2, 4):  # first, middle and the last step (to sigma = 0)
        t = scheduler.timesteps[i]
        with torch.no_grad():
            out = pipe.transformer(hidden_states=x, timestep=t.expand(2), encoder_hidden_states=cond["prompt_embeds"],
                                   pooled_projections=cond["pooled_prompt_embeds"], return_dict=False)[0]
        scheduler._step_index = i  # scheduler.step indexes its sigmas by position
        expected = scheduler.step(out, t, x, return_dict=False)[0]
        with torch.no_grad():
            v = model.velocity(x, sigmas[i], cond)
        torch.testing.assert_close(t / 1000, sigmas[i])
        torch.testing.assert_close(v, out, rtol=0, atol=1e-6)
        torch.testing.assert_close(x + (sigmas[i + 1] - sigmas[i]) * v, expected, rtol=0, atol=1e-6)


def test_sd3_classifier_free_guidance(load):
    model = load("sd3")
    x = torch.randn(3, *model.latent_shape)
    cond = model.encode_prompts(["a red cat", "a dog", "a red cat"])
    sigma = torch.tensor(0.6)
    with torch.no_grad():
        v_c = model.velocity(x, sigma, cond)
        v_u = model.velocity(x, sigma, model.uncond(3))
        guided = model.velocity_fn(5.0)(x, sigma, cond)
        default = model.velocity_fn()(x, sigma, cond)
    torch.testing.assert_close(guided, v_u + 5.0 * (v_c - v_u), rtol=1e-5, atol=ATOL)
    assert model.default_guidance == 4.5
    torch.testing.assert_close(default, v_u + 4.5 * (v_c - v_u), rtol=1e-5, atol=ATOL)
    assert model.velocity_fn(1.0) == model.velocity


# ---------------------------------------------------------------------------------------- FLUX


def _flux_pipeline_latents(model, prompts, x_t, steps, guidance):
    """FluxPipeline's denoising loop from the same [B, C, H, W] noise, unpacked back to [B, C, H, W]."""
    from diffusers import FluxPipeline

    b, c, h, w = x_t.shape
    packed = FluxPipeline._pack_latents(x_t, b, c, h, w)
    with torch.no_grad():
        out = model.pipeline(prompts, num_inference_steps=steps, guidance_scale=guidance, latents=packed, height=64,
                             width=64, max_sequence_length=model.max_sequence_length, output_type="latent").images
    return FluxPipeline._unpack_latents(out, 64, 64, model.vae_scale_factor)


def test_flux_velocity_is_the_unpacked_transformer_output_at_timestep_sigma(load):
    """The transformer takes sigma (it multiplies by 1000 itself): compare with a direct packed call."""
    from diffusers import FluxPipeline

    model = load("flux")
    pipe = model.pipeline
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red cat", "a dog"])
    sigma = model.sigmas(4)[1]
    packed = FluxPipeline._pack_latents(x, 2, 16, 8, 8)
    with torch.no_grad():
        out = pipe.transformer(hidden_states=packed, timestep=(sigma * 1000).expand(2) / 1000,
                               guidance=torch.full([2], 3.5), pooled_projections=cond["pooled_prompt_embeds"],
                               encoder_hidden_states=cond["prompt_embeds"], txt_ids=torch.zeros(16, 3),
                               img_ids=FluxPipeline._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32),
                               return_dict=False)[0]
        v = model.velocity(x, sigma, cond)
    torch.testing.assert_close(v, FluxPipeline._unpack_latents(out, 64, 64, 8), rtol=0, atol=1e-6)


def test_flux_has_no_cfg_and_uses_the_guidance_embedding(load):
    model = load("flux")
    assert model.uses_cfg is False and model.guidance_embeds and model.default_guidance == 3.5
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red cat", "a dog"])
    sigma = torch.tensor(0.5)
    encoded_before = len(model._prompt_cache)
    with torch.no_grad():
        default = model.velocity(x, sigma, cond)
        same = model.velocity_fn(3.5)(x, sigma, cond)
        other = model.velocity_fn(7.0)(x, sigma, cond)
    assert len(model._prompt_cache) == encoded_before  # no unconditional prompt was encoded: no CFG
    torch.testing.assert_close(same, default, rtol=0, atol=0)
    assert (other - default).abs().max() > 1e-4


def test_flux_without_guidance_embedding_ignores_the_scale(tmp_path):
    """FLUX.1-schnell style (guidance_embeds=False), built from a pipeline object."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from flowrl.models.flux import FluxModel
    from flowrl.testing import tiny_pipeline_components

    components = tiny_pipeline_components("flux", tmp_path)
    config = dict(components["transformer"].config)
    config["guidance_embeds"] = False
    components["transformer"] = FluxTransformer2DModel.from_config(config)
    model = FluxModel(FluxPipeline(**components), resolution=64, max_sequence_length=16)
    assert not model.guidance_embeds
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a red cat", "a dog"])
    with torch.no_grad():
        a = model.velocity_fn(1.0)(x, torch.tensor(0.5), cond)
        b = model.velocity_fn(7.0)(x, torch.tensor(0.5), cond)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    expected = _flux_pipeline_latents(model, ["a red cat", "a dog"], x, 2, 7.0)
    with torch.no_grad():
        ours = _euler(model.velocity_fn(), x, model.sigmas(2), cond)
    torch.testing.assert_close(ours, expected, rtol=0, atol=ATOL)
