"""FLUX.1 as a flowrl velocity model (diffusers ``FluxPipeline``).

Conventions, checked against diffusers (tests/models/test_families.py, tests/models/test_conventions.py):

- **Time.** FLUX is a rectified flow in flowrl's convention (``x = (1 - sigma) x0 + sigma eps``,
  prediction ``eps - x0``). ``FluxPipeline`` passes ``timestep = t / 1000 = sigma`` and
  ``FluxTransformer2DModel.forward`` multiplies it (and the guidance value) by 1000 internally, so the
  adapter feeds ``sigma`` itself.
- **Guidance.** FLUX.1-dev is guidance-distilled: no classifier-free guidance (``uses_cfg = False``);
  the guidance scale (3.5 by default, the pipeline's default) goes into the transformer's guidance
  embedding as a ``[B]`` tensor when its config has ``guidance_embeds=True``. FLUX.1-schnell has no
  guidance embedding and ignores the scale.
- **Latents.** flowrl keeps ``[B, 16, H / 8, W / 8]`` latents; ``_predict`` packs them into 2x2 patches
  (``[B, (H/16)(W/16), 64]`` tokens) with the pipeline's own ``_pack_latents``,
  ``_prepare_latent_image_ids`` and ``_unpack_latents``; text ids are zeros, as in the pipeline.
- **Schedule.** ``sigmas(n)`` is what ``FluxPipeline.__call__`` samples with: base sigmas
  ``linspace(1, 1/n, n)`` time-shifted with ``mu = calculate_shift(image_seq_len)`` (dynamic shifting;
  ``image_seq_len`` = number of packed tokens), then 0.
- **Text.** The pipeline's ``encode_prompt`` (T5 sequence + pooled CLIP-L output).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .base import Cond, GuidanceEmbedded
from flowrl.config import LoraConfig
from .loading import latent_hw, load_adapter_pipeline, scheduler_sigmas
from .pipeline_model import PipelineModel, resolution_shift

__all__ = ["FluxModel", "FLUX_LORA_TARGETS", "FLUX_DEFAULT_MODEL"]

#: Flow-GRPO's FLUX base model (gated on the hub: accept its license first).
FLUX_DEFAULT_MODEL = "black-forest-labs/FLUX.1-dev"

#: LoRA targets of Flow-GRPO's FLUX training (scripts/train_flux.py, ``target_modules``; the same list
#: as diffusers' FLUX LoRA examples with ``--lora_layers`` for attention + MLP): attention projections of
#: the image and text streams plus both feed-forward networks. As suffixes, ``attn.to_q/k/v`` also
#: match the single-stream blocks' attention.
FLUX_LORA_TARGETS = [
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]


class FluxModel(GuidanceEmbedded, PipelineModel):
    """FLUX.1 (dev or schnell) behind :class:`~flowrl.models.base.FlowModel`.

    Cond keys: ``"prompt_embeds"`` ``[B, max_sequence_length, 4096]`` (T5) and
    ``"pooled_prompt_embeds"`` ``[B, 768]`` (CLIP-L pooled output).

    ``velocity(x, sigma, cond)`` uses ``default_guidance``; ``velocity_fn(scale)`` uses ``scale`` in the
    guidance embedding (never classifier-free guidance).

    Args:
        pipeline: a built ``FluxPipeline`` (its modules are used, not copied); VAE and text encoders
            are frozen and put in eval mode.
        lora: LoRA settings (targets default to :data:`FLUX_LORA_TARGETS`; LoRA weights in float32),
            or None to fine-tune the whole transformer.
        gradient_checkpointing: recompute transformer blocks in the backward pass.
        resolution: image size in pixels, int or ``(H, W)``, a multiple of 16 (default: the VAE's
            ``sample_size``, 1024 for FLUX.1, the pipeline's default).
        max_sequence_length: T5 tokens (the pipeline's default 512; Flow-GRPO uses 128).
        guidance_scale: the default guidance-embedding value (3.5, the pipeline's default).
    """

    family = "flux"  # its row in flowrl.models.families

    uses_cfg = False

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 3.5):
        super().__init__(pipeline, ("vae", "text_encoder", "text_encoder_2"), lora=lora,
                         gradient_checkpointing=gradient_checkpointing, max_sequence_length=max_sequence_length)
        transformer = pipeline.transformer
        self.default_guidance = float(guidance_scale)
        self.guidance_embeds = bool(transformer.config.guidance_embeds)
        self.vae_scale_factor = pipeline.vae_scale_factor
        if resolution is None:
            # The VAE's sample_size is 1024 for FLUX.1 (the pipeline's default resolution) and the tiny
            # test pipelines' own size for them.
            resolution = getattr(pipeline.vae.config, "sample_size", None)
            if not isinstance(resolution, int) or resolution % 16 or resolution <= 0:
                resolution = pipeline.default_sample_size * self.vae_scale_factor
        self.resolution = resolution
        height, width = latent_hw(resolution, self.vae_scale_factor, 2)  # 2x2 packing
        self.latent_shape = (transformer.config.in_channels // 4, height, width)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = FLUX_DEFAULT_MODEL, *, dtype: torch.dtype | str | None = None,
                        vae_dtype: torch.dtype | str | None = torch.float32, device: torch.device | str | None = None,
                        lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                        resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                        guidance_scale: float = 3.5, revision: str | None = None, variant: str | None = None,
                        cache_dir: str | None = None, trust_remote_code: bool = False) -> "FluxModel":
        """Load from a local pipeline directory or a hub id (``FluxPipeline.from_pretrained``).

        Args:
            path: directory with ``model_index.json`` and the component folders, or a hub id.
            dtype: dtype of the transformer and text encoders (``"bf16"`` is usual for FLUX).
            vae_dtype: dtype of the VAE (float32 by default, as Flow-GRPO; None: same as ``dtype``).
            device: where to put every component (default: CPU).
            lora, gradient_checkpointing, resolution, max_sequence_length, guidance_scale: see the class.
            revision, variant, cache_dir: hub options.
            trust_remote_code: load component code a local pipeline folder ships (off: such a folder is
                refused; only for code you have read).

        Raises:
            ModelLoadError: weights missing (offline, wrong path, gated repo) or unreadable.
        """
        from diffusers import FluxPipeline

        pipeline = load_adapter_pipeline(FluxPipeline, path, components=_COMPONENTS,
                                         hub_id=FLUX_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)

    # ------------------------------------------------------------------ velocity (GuidanceEmbedded's velocity_fn)

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond,
                 guidance: float | None = None) -> torch.Tensor:
        from diffusers import FluxPipeline

        dtype = self._compute_dtype
        batch, channels, height, width = x.shape
        packed = FluxPipeline._pack_latents(x.to(dtype), batch, channels, height, width)
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x.device, dtype)
        prompt_embeds = cond["prompt_embeds"].to(device=x.device, dtype=dtype)
        txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=x.device, dtype=dtype)
        guidance_tensor = None
        if self.guidance_embeds:
            value = self.default_guidance if guidance is None else guidance
            guidance_tensor = torch.full((batch,), value, device=x.device, dtype=torch.float32)
        out = denoiser(
            hidden_states=packed,
            timestep=sigma.to(device=x.device, dtype=dtype),  # the transformer multiplies by 1000
            guidance=guidance_tensor,
            pooled_projections=cond["pooled_prompt_embeds"].to(device=x.device, dtype=dtype),
            encoder_hidden_states=prompt_embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        vsf = self.vae_scale_factor
        return FluxPipeline._unpack_latents(out, height * vsf, width * vsf, vsf)

    # ------------------------------------------------------------------ FlowModel hooks

    def _encode(self, prompts: list[str]) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        prompt_embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def default_lora_targets(self) -> list[str]:
        return list(FLUX_LORA_TARGETS)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas ``[num_steps + 1]`` ``FluxPipeline`` samples with at this resolution."""
        config = self.pipeline.scheduler.config
        _, height, width = self.latent_shape
        mu = resolution_shift(config, (height // 2) * (width // 2))  # 2x2-packed tokens
        base = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        return scheduler_sigmas(config, num_steps, mu=mu, sigmas=base)
