"""Wan 2.1 / 2.2 text-to-video as a flowrl velocity model (diffusers ``WanPipeline``).

Conventions, checked against diffusers (tests/models/test_families.py, tests/models/test_wan.py):

- **Time and prediction.** ``WanTransformer3DModel`` predicts the flow velocity ``noise - x0`` (flowrl's ``eps -
  x0``) at ``timestep = 1000 sigma``, the scheduler's timestep.
- **Guidance.** Plain CFG ``v_u + w (v_c - v_u)`` (the pipeline's ``guidance_scale``, 5 by default; flowrl's units
  equal Wan's). The unconditional branch is the negative prompt: the pipeline's default is ``""``; Wan's model cards
  give a long one, which the shipped configs set (``model.negative_prompt``).
- **Latents.** Video latents ``[B, 16, F, H / 8, W / 8]`` with ``F = (num_frames - 1) / 4 + 1`` (the causal VAE
  keeps the first frame and compresses the rest 4x in time), as the transformer takes them (it patchifies
  ``(1, 2, 2)`` itself). ``latent_shape`` is ``(C, F, h, w)``. The VAE's latents are normalised per channel:
  ``z = (latent - latents_mean) / latents_std``.
- **Frames.** :meth:`WanModel.decode` returns ``[B, num_frames, 3, H, W]`` in [0, 1]: the pipeline's
  ``output_type="pt"`` frames. Rewards see videos; an image reward scores every frame (rewards/base.py).
- **Schedule.** ``FlowMatchEulerDiscreteScheduler``: its own ``set_timesteps(n)`` sigmas (static ``shift``, the
  flow shift). The real Wan repositories ship ``UniPCMultistepScheduler`` (``use_flow_sigmas``, ``flow_shift``): flowrl
  samples with its Euler / SDE steps on the same flow-shifted sigmas, ``shift(linspace(1, 0, n + 1))``, as the
  Flow-GRPO-style Wan trainers do (a UniPC multistep solve is not reproduced).
- **Text.** UMT5's last hidden state, each prompt's tokens followed by zeros up to ``max_sequence_length`` (226 in
  the pipeline), with no mask: the zeros are part of the transformer's input, so the cache keeps the whole padded
  sequence.
- **Wan 2.2 (A14B).** A second transformer, ``transformer_2``, takes the low-noise steps: the pipeline uses
  ``transformer`` where ``t >= boundary_ratio * 1000`` and ``transformer_2`` below, each with its guidance scale
  (``guidance_scale_2``, default the same). The adapter's denoiser is then :class:`WanExperts`, both experts
  routed per row by sigma; LoRA adapts both (``guidance_scale_2`` other than ``guidance_scale`` is not supported).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .base import Cond
from flowrl.config import LoraConfig
from .loading import latent_hw, load_adapter_pipeline, scheduler_sigmas
from .pipeline_model import PipelineModel

__all__ = ["WanModel", "WanExperts", "WAN_LORA_TARGETS", "WAN_DEFAULT_MODEL", "WAN_DEFAULT_RESOLUTION",
           "WAN_NEGATIVE_PROMPT"]

WAN_DEFAULT_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"

#: Frame size ``(H, W)`` without ``resolution``: Wan's 480p (832 x 480 landscape), the pipeline's default.
WAN_DEFAULT_RESOLUTION = (480, 832)

#: LoRA targets: the self- and cross-attention projections and the feed-forward of every block (the Linear layers
#: of ``WanTransformerBlock`` that diffusers' Wan LoRA loader maps; flowrl's choice of the full set).
WAN_LORA_TARGETS = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"]

#: The negative prompt of Wan's model cards and diffusers' WanPipeline example (English translation).
WAN_NEGATIVE_PROMPT = ("Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, "
                       "images, static, overall gray, worst quality, low quality, JPEG compression residue, ugly, "
                       "incomplete, extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, "
                       "misshapen limbs, fused fingers, still picture, messy background, three legs, many people in "
                       "the background, walking backwards")

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "tokenizer"]


class WanExperts(nn.Module):
    """Wan 2.2's two experts as one denoiser: ``high`` (``transformer``) for ``1000 sigma >= boundary``, ``low``
    (``transformer_2``) below. ``forward`` routes each row to its expert; the peft / diffusers hooks the adapter
    calls (``add_adapter``, ``disable_adapters``, ``enable_adapters``, gradient checkpointing) reach both."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary_timestep: float):
        super().__init__()
        self.high, self.low = high, low
        self.boundary_timestep = float(boundary_timestep)
        self.config = high.config

    def forward(self, *, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                return_dict: bool = False):
        """``hidden_states [B, C, F, h, w]``, ``timestep [B]`` (1000 sigma) -> ``(velocity [B, C, F, h, w],)``."""
        high = timestep >= self.boundary_timestep
        out = None
        for expert, rows in ((self.high, high), (self.low, ~high)):
            if not bool(rows.any()):
                continue
            if bool(rows.all()):
                return (expert(hidden_states=hidden_states, timestep=timestep,
                               encoder_hidden_states=encoder_hidden_states, return_dict=False)[0],)
            part = expert(hidden_states=hidden_states[rows], timestep=timestep[rows],
                          encoder_hidden_states=encoder_hidden_states[rows], return_dict=False)[0]
            out = part.new_zeros(hidden_states.shape) if out is None else out
            out = out.index_put((rows.nonzero().flatten(),), part)
        return (out,)

    def add_adapter(self, config) -> None:
        self.high.add_adapter(config)
        self.low.add_adapter(config)

    def disable_adapters(self) -> None:
        self.high.disable_adapters()
        self.low.disable_adapters()

    def enable_adapters(self) -> None:
        self.high.enable_adapters()
        self.low.enable_adapters()

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def fuse_lora(self, lora_scale: float = 1.0) -> None:
        """Merge each expert's LoRA into its base weights (``flowrl export --format merged``)."""
        self.high.fuse_lora(lora_scale=lora_scale)
        self.low.fuse_lora(lora_scale=lora_scale)

    def unload_lora(self) -> None:
        self.high.unload_lora()
        self.low.unload_lora()


class WanModel(PipelineModel):
    """Wan 2.1 / 2.2 text-to-video behind :class:`~flowrl.models.base.FlowModel`.

    Cond key: ``"prompt_embeds"`` ``[B, max_sequence_length, hidden]`` (UMT5's last hidden state, zero-padded as
    the pipeline pads it). Latents ``[B, 16, F, h, w]``; :meth:`decode` gives frames ``[B, num_frames, 3, H, W]``.

    Args:
        pipeline: a built ``WanPipeline`` (its modules are used, not copied); VAE and text encoder frozen.
        lora: LoRA settings (targets default to :data:`WAN_LORA_TARGETS`; LoRA weights in float32), or None to
            fine-tune the whole transformer (both experts for Wan 2.2).
        gradient_checkpointing: recompute transformer blocks in the backward pass.
        resolution: frame size in pixels, int or ``(H, W)``, a multiple of 16 (default 480 x 832, Wan's 480p).
        num_frames: pixel frames, ``4 k + 1`` (default 81, the pipeline's).
        max_sequence_length: UMT5 tokens (the pipeline's 226).
        guidance_scale: the default CFG scale (5.0, the pipeline's).
        negative_prompt: the unconditional prompt (the pipeline's default ``""``; see :data:`WAN_NEGATIVE_PROMPT`).
    """

    family = "wan"  # its row in flowrl.models.families
    uses_cfg = True

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, num_frames: int = 81,
                 max_sequence_length: int = 226, guidance_scale: float = 5.0, negative_prompt: str = ""):
        if pipeline.transformer is None:
            raise ValueError("WanPipeline without `transformer`: flowrl trains Wan 2.1 (one transformer) or Wan 2.2 "
                             "A14B (transformer and transformer_2); a pipeline with only transformer_2 is not "
                             "supported")
        if getattr(pipeline.config, "expand_timesteps", False):
            raise ValueError("WanPipeline with expand_timesteps (Wan 2.2 TI2V 5B's per-token timesteps) is not "
                             "supported yet; use Wan 2.1 or Wan 2.2 A14B")
        num_frames = int(num_frames)
        temporal = pipeline.vae_scale_factor_temporal
        if num_frames < 1 or (num_frames - 1) % temporal:
            raise ValueError(f"num_frames {num_frames}: Wan's VAE needs num_frames - 1 divisible by {temporal} "
                             f"(e.g. 1, 5, 33, 81)")
        transformer = pipeline.transformer
        self.boundary_ratio = getattr(pipeline.config, "boundary_ratio", None)
        if getattr(pipeline, "transformer_2", None) is not None and self.boundary_ratio is not None:
            boundary = self.boundary_ratio * pipeline.scheduler.config.num_train_timesteps
            denoiser: nn.Module = WanExperts(transformer, pipeline.transformer_2, boundary)
        else:
            denoiser = transformer
        # The input projection's dtype: diffusers keeps some Wan modules (time embedder, norms, scale-shift tables)
        # in float32 whatever the load dtype, so the first parameter need not be in the compute dtype.
        super().__init__(pipeline, ("vae", "text_encoder"), denoiser=denoiser,
                         compute_dtype=transformer.patch_embedding.weight.dtype, lora=lora,
                         gradient_checkpointing=gradient_checkpointing, max_sequence_length=max_sequence_length)
        self.default_guidance = float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.vae_scale_factor = pipeline.vae_scale_factor_spatial
        self.num_frames = num_frames
        self.resolution = resolution or WAN_DEFAULT_RESOLUTION
        height, width = latent_hw(self.resolution, self.vae_scale_factor, transformer.config.patch_size[1])
        self.latent_shape = (transformer.config.in_channels, (num_frames - 1) // temporal + 1, height, width)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = WAN_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        num_frames: int = 81, max_sequence_length: int = 226, guidance_scale: float = 5.0,
                        negative_prompt: str = "", revision: str | None = None, variant: str | None = None,
                        cache_dir: str | None = None, trust_remote_code: bool = False) -> "WanModel":
        """Load from a local pipeline directory or a hub id (``WanPipeline.from_pretrained``); the arguments are
        those of :meth:`FluxModel.from_pretrained <flowrl.models.flux.FluxModel.from_pretrained>` and the
        constructor's.

        Raises:
            ModelLoadError: weights missing (offline, wrong path) or unreadable.
        """
        from diffusers import WanPipeline

        pipeline = load_adapter_pipeline(WanPipeline, path, components=_COMPONENTS, hub_id=WAN_DEFAULT_MODEL,
                                         dtype=dtype, vae_dtype=vae_dtype, device=device, revision=revision,
                                         variant=variant, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   num_frames=num_frames, max_sequence_length=max_sequence_length, guidance_scale=guidance_scale,
                   negative_prompt=negative_prompt)

    # ------------------------------------------------------------------ prompts and velocity

    def uncond(self, batch_size: int = 1) -> Cond:
        """The negative prompt's Cond repeated ``batch_size`` times."""
        return self.encode_prompts([self.negative_prompt] * batch_size)

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        dtype = self._compute_dtype
        timestep = sigma.to(device=x.device, dtype=torch.float32) * self.pipeline.scheduler.config.num_train_timesteps
        return denoiser(hidden_states=x.to(dtype), timestep=timestep,
                        encoder_hidden_states=cond["prompt_embeds"].to(device=x.device, dtype=dtype),
                        return_dict=False)[0]

    # ------------------------------------------------------------------ FlowModel hooks

    def _encode(self, prompts: list[str]) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        embeds = self.pipeline._get_t5_prompt_embeds(prompt=list(prompts), max_sequence_length=self.max_sequence_length,
                                                     device=device)
        return {"prompt_embeds": embeds}

    def _vae_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.pipeline.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(like.device, like.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(like.device, like.dtype)
        return mean, std

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 16, F, h, w]`` -> frames ``[B, num_frames, 3, 8h, 8w]`` float32 in [0, 1] (the pipeline's
        ``latents * std + mean``, VAE decode, ``postprocess_video``). Runs under the caller's grad mode."""
        if latents.dim() != 5:
            raise ValueError(f"Wan decodes video latents [B, C, F, h, w], got shape {tuple(latents.shape)}")
        vae = self.pipeline.vae
        param = next(vae.parameters())
        z = latents.to(device=param.device, dtype=param.dtype)
        mean, std = self._vae_stats(z)
        video = vae.decode(z * std + mean, return_dict=False)[0]  # [B, 3, num_frames, H, W] in [-1, 1]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Videos ``[B, num_frames, 3, H, W]`` in [0, 1] -> latents ``[B, *latent_shape]`` (the posterior's mean,
        normalised per channel). Images ``[B, 3, H, W]`` (Diffusion-DPO's image pairs) are encoded as still clips:
        the image repeated ``num_frames`` times."""
        if images.dim() == 4:
            images = images.unsqueeze(1).expand(-1, self.num_frames, -1, -1, -1)
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(f"Wan encodes videos [B, F, 3, H, W] or images [B, 3, H, W], got {tuple(images.shape)}")
        vae = self.pipeline.vae
        param = next(vae.parameters())
        x = images.to(device=param.device, dtype=param.dtype).permute(0, 2, 1, 3, 4) * 2 - 1
        z = vae.encode(x).latent_dist.mode()
        mean, std = self._vae_stats(z)
        return ((z - mean) / std).float()

    def default_lora_targets(self) -> list[str]:
        return list(WAN_LORA_TARGETS)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas ``[num_steps + 1]``: ``WanPipeline``'s with a ``FlowMatchEulerDiscreteScheduler``
        (``set_timesteps(num_steps)``); for UniPC's flow sigmas, the same flow shift on ``linspace(1, 0, n + 1)``."""
        config = self.pipeline.scheduler.config
        if config.get("use_flow_sigmas"):  # UniPCMultistepScheduler, the real repositories' scheduler
            from samplers import linear_sigmas

            shift = float(config.get("flow_shift") or 1.0)
            s = linear_sigmas(num_steps)
            return shift * s / (1 + (shift - 1) * s)
        return scheduler_sigmas(config, num_steps)
