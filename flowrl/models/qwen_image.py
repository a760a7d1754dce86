"""Qwen-Image as a flowrl velocity model (diffusers ``QwenImagePipeline``).

Conventions, checked against diffusers (tests/models/test_families.py, tests/models/test_qwen_image.py):

- **Time.** A rectified flow in flowrl's convention (prediction ``eps - x0``). ``QwenImagePipeline`` passes
  ``timestep = t / 1000 = sigma`` and the transformer's timestep embedding scales it by 1000 itself, so the
  adapter feeds ``sigma``.
- **Guidance.** Qwen-Image is not guidance-distilled (``guidance_embeds=False``): the pipeline's "true CFG"
  runs a negative-prompt branch and rescales the guided prediction token by token to the conditional one's norm,
  ``v = g * |v_c| / |g|`` with ``g = v_u + w (v_c - v_u)`` and norms over each packed 2x2 token's 64 features.
  :meth:`QwenImageModel.velocity_fn` does exactly that (scale 4 by default, the pipeline's ``true_cfg_scale``).
  The unconditional branch is the negative prompt ``" "`` (the Qwen-Image model card's), not ``""``.
- **Latents.** flowrl keeps ``[B, 16, H / 8, W / 8]``; ``_predict`` packs 2x2 patches with the pipeline's
  ``_pack_latents`` and gives the transformer ``img_shapes`` ``(1, H / 16, W / 16)`` per image. The VAE is the
  causal 3D one (a frame axis of length 1) normalised per channel: ``z = (latent - latents_mean) / latents_std``.
- **Schedule.** ``linspace(1, 1/n, n)`` time-shifted with ``mu = calculate_shift(image_seq_len)`` (dynamic
  exponential shifting up to 8192 tokens, stretched so the last sigma is ``shift_terminal`` 0.02), then 0.
- **Text.** The pipeline's ``encode_prompt``: the last hidden state of Qwen2.5-VL on the chat template with the
  template's 34 system tokens dropped, and an attention mask. The cache keeps every prompt padded to
  ``max_sequence_length`` (mask 0 on the padding); ``_predict`` cuts a batch to its longest prompt, which is
  the pipeline's own padding.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np
import torch
from torch import nn

from .base import Cond, VelocityFn
from flowrl.config import LoraConfig
from .loading import latent_hw, load_adapter_pipeline, scheduler_sigmas
from .pipeline_model import PipelineModel, resolution_shift

__all__ = ["QwenImageModel", "QWEN_IMAGE_LORA_TARGETS", "QWEN_IMAGE_DEFAULT_MODEL", "qwen_true_cfg"]

QWEN_IMAGE_DEFAULT_MODEL = "Qwen/Qwen-Image"

#: LoRA targets of the Qwen-Image Flow-GRPO examples (verl's examples/flowgrpo_trainer/run_flowgrpo.sh names
#: the same twelve modules): joint attention of both streams and both streams' feed-forward networks.
QWEN_IMAGE_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
]

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "tokenizer"]


def qwen_true_cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's guidance on packed predictions ``[B, tokens, features]``: ``g = v_u + w (v_c - v_u)``
    rescaled per token to the norm of ``v_c`` (``QwenImagePipeline.__call__``)."""
    guided = v_uncond + scale * (v_cond - v_uncond)
    return guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))


def _padded(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> Cond:
    """The text Cond of ``encode_prompt``'s ``(embeds [B, L, D], mask [B, L] or None)`` zero-padded to ``length``
    tokens (mask 0 on the padding), so every cached row has one shape."""
    if mask is None:  # every prompt filled the batch's length
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    pad = length - embeds.shape[1]
    embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
    mask = torch.nn.functional.pad(mask.long(), (0, pad))
    return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}


class QwenImageModel(PipelineModel):
    """Qwen-Image behind :class:`~flowrl.models.base.FlowModel`.

    Cond keys: ``"prompt_embeds"`` ``[B, max_sequence_length, hidden]`` (Qwen2.5-VL's last hidden state,
    zero-padded) and ``"prompt_embeds_mask"`` ``[B, max_sequence_length]`` (1 on the prompt's tokens).

    Args:
        pipeline: a built ``QwenImagePipeline`` (its modules are used, not copied); VAE and text encoder frozen.
        lora: LoRA settings (targets default to :data:`QWEN_IMAGE_LORA_TARGETS`; LoRA weights in float32), or
            None to fine-tune the whole transformer.
        gradient_checkpointing: recompute transformer blocks in the backward pass.
        resolution: image size in pixels, int or ``(H, W)``, a multiple of 16 (default 1024, the pipeline's).
        max_sequence_length: text tokens kept after the template (the pipeline's default 512).
        guidance_scale: the default guidance (4.0, the pipeline's ``true_cfg_scale``).
        negative_prompt: the unconditional prompt of guidance.
    """

    family = "qwen_image"  # its row in flowrl.models.families

    uses_cfg = True

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 4.0, negative_prompt: str = " "):
        super().__init__(pipeline, ("vae", "text_encoder"), lora=lora, gradient_checkpointing=gradient_checkpointing,
                         max_sequence_length=max_sequence_length)
        transformer = pipeline.transformer
        self.default_guidance = float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.guidance_embeds = bool(transformer.config.guidance_embeds)
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.resolution = resolution or pipeline.default_sample_size * self.vae_scale_factor
        height, width = latent_hw(self.resolution, self.vae_scale_factor, 2)  # 2x2 packing
        self.latent_shape = (transformer.config.in_channels // 4, height, width)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = QWEN_IMAGE_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        max_sequence_length: int = 512, guidance_scale: float = 4.0, negative_prompt: str = " ",
                        revision: str | None = None, variant: str | None = None, cache_dir: str | None = None,
                        trust_remote_code: bool = False) -> "QwenImageModel":
        """Load from a local pipeline directory or a hub id (``QwenImagePipeline.from_pretrained``); the
        arguments are those of :meth:`FluxModel.from_pretrained <flowrl.models.flux.FluxModel.from_pretrained>`.

        Raises:
            ModelLoadError: weights missing (offline, wrong path) or unreadable.
        """
        from diffusers import QwenImagePipeline

        pipeline = load_adapter_pipeline(QwenImagePipeline, path, components=_COMPONENTS,
                                         hub_id=QWEN_IMAGE_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale,
                   negative_prompt=negative_prompt)

    # ------------------------------------------------------------------ prompts and velocity

    def uncond(self, batch_size: int = 1) -> Cond:
        """The negative prompt's Cond repeated ``batch_size`` times."""
        return self.encode_prompts([self.negative_prompt] * batch_size)

    def velocity_fn(self, guidance_scale: float | None = None, *, detach_uncond: bool = False) -> VelocityFn:
        """``velocity_fn(x, sigma, cond)`` with Qwen-Image's norm-rescaled guidance (see the module docstring),
        both branches in one batched call, unconditional first (as ``samplers.classifier_free_guidance``).

        ``detach_uncond``: no gradient through the unconditional branch."""
        from diffusers import QwenImagePipeline
        from samplers.guidance import concat_cond

        scale = self.default_guidance if guidance_scale is None else float(guidance_scale)
        if scale == 1.0:
            return self.velocity
        branches = self._cfg_branches()

        def guided(x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
            b, c, h, w = x.shape
            sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(b)
            both = concat_cond(*branches(cond, b))
            v = self.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), both)
            packed = QwenImagePipeline._pack_latents(v, 2 * b, c, h, w)
            v_u, v_c = packed.chunk(2)
            if detach_uncond:
                v_u = v_u.detach()
            out = qwen_true_cfg(v_u, v_c, scale)
            vsf = self.vae_scale_factor
            return QwenImagePipeline._unpack_latents(out, h * vsf, w * vsf, vsf)[:, :, 0]

        return guided

    def _cfg_branches(self) -> Callable[[Cond, int], tuple[Cond, Cond]]:
        """``branches(cond, batch) -> (unconditional Cond, conditional Cond)`` of guidance, each of ``batch`` rows:
        here the negative prompt's Cond (encoded once, when the velocity function is made) beside ``cond``.
        Editing subclasses take both from ``cond`` (their negative prompt sees each row's source)."""
        from samplers.guidance import expand_cond

        uncond = self.uncond(1)
        return lambda cond, batch: (expand_cond(uncond, batch), cond)

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        from diffusers import QwenImagePipeline

        batch, channels, height, width = x.shape
        packed = QwenImagePipeline._pack_latents(x.to(self._compute_dtype), batch, channels, height, width)
        out = self._denoise(denoiser, packed, sigma, cond, [(1, height // 2, width // 2)])
        vsf = self.vae_scale_factor
        return QwenImagePipeline._unpack_latents(out, height * vsf, width * vsf, vsf)[:, :, 0]

    def _denoise(self, denoiser: nn.Module, tokens: torch.Tensor, sigma: torch.Tensor, cond: Cond,
                 shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        """The transformer on packed image tokens ``[B, N, 64]`` (the images of ``shapes``, ``(frames, h, w)`` in
        packed tokens each, one after the other) and ``cond``'s text cut to the batch's longest prompt (the
        pipeline's own padding): the prediction ``[B, N, 64]``."""
        mask = cond["prompt_embeds_mask"].to(tokens.device)
        length = max(int(mask.sum(dim=1).max()), 1)
        return denoiser(
            hidden_states=tokens,
            timestep=sigma.to(device=tokens.device, dtype=tokens.dtype),  # the transformer multiplies by 1000
            guidance=None,
            encoder_hidden_states=cond["prompt_embeds"][:, :length].to(device=tokens.device, dtype=tokens.dtype),
            encoder_hidden_states_mask=mask[:, :length],
            img_shapes=[list(shapes)] * tokens.shape[0],
            return_dict=False,
        )[0]

    # ------------------------------------------------------------------ FlowModel hooks

    def _encode(self, prompts: list[str]) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        embeds, mask = self.pipeline.encode_prompt(prompt=prompts, device=device,
                                                   max_sequence_length=self.max_sequence_length)
        return _padded(embeds, mask, self.max_sequence_length)

    def _vae_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.pipeline.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 16, h, w]`` -> images ``[B, 3, 8h, 8w]`` float32 in [0, 1] (the pipeline's
        ``latents * std + mean``, one-frame VAE decode, postprocess)."""
        vae = self.pipeline.vae
        param = next(vae.parameters())
        z = latents.to(device=param.device, dtype=param.dtype).unsqueeze(2)
        mean, std = self._vae_stats(z)
        images = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] -> latents ``[B, *latent_shape]`` (the posterior's mean,
        normalised per channel; the inverse of :meth:`decode` up to the VAE's own error)."""
        vae = self.pipeline.vae
        param = next(vae.parameters())
        x = (images.to(device=param.device, dtype=param.dtype) * 2 - 1).unsqueeze(2)
        z = vae.encode(x).latent_dist.mode()
        mean, std = self._vae_stats(z)
        return ((z - mean) / std)[:, :, 0].float()

    def default_lora_targets(self) -> list[str]:
        return list(QWEN_IMAGE_LORA_TARGETS)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas ``[num_steps + 1]`` ``QwenImagePipeline`` samples with at this resolution."""
        config = self.pipeline.scheduler.config
        if num_steps < 2 and config.get("shift_terminal"):
            raise ValueError(f"Qwen-Image samples with at least 2 steps: its schedule is stretched to end at "
                             f"shift_terminal {config.get('shift_terminal')}, which one step cannot (got {num_steps})")
        _, height, width = self.latent_shape
        mu = resolution_shift(config, (height // 2) * (width // 2))  # 2x2-packed tokens
        return scheduler_sigmas(config, num_steps, mu=mu, sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
