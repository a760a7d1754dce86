"""FLUX.2 as flowrl velocity models: [klein] (diffusers ``Flux2KleinPipeline``) and [dev] (``Flux2Pipeline``).

Conventions of [klein], checked against diffusers (tests/models/test_families.py, tests/models/test_flux2.py):

- **Time.** A rectified flow in flowrl's convention; the pipeline passes ``timestep / 1000 = sigma`` and the
  transformer scales it itself, so the adapter feeds ``sigma``.
- **Guidance.** [klein] base samples with classifier-free guidance ``neg + w (pos - neg)`` (``guidance_scale`` 4 by
  default, the empty prompt as negative), exactly flowrl's; the step-distilled [klein] (``is_distilled``) has no
  guidance (``uses_cfg = False``) and no guidance embedding.
- **Latents.** flowrl keeps the transformer's own space, ``[B, 128, H / 16, W / 16]``: the VAE's 32 channels
  patchified 2x2 and normalised by the VAE's batch-norm statistics (``(z - running_mean) / sqrt(running_var +
  eps)``). Tokens are those positions in row-major order (``_pack_latents``), with 4-axis ids ``(0, h, w, 0)``
  (``_prepare_latent_ids``); ``decode`` undoes the normalisation and the patchify before ``vae.decode``.
- **Schedule.** ``linspace(1, 1/n, n)`` time-shifted with FLUX.2's empirical ``mu(image_seq_len, n)``, then 0.
- **Text.** The pipeline's ``encode_prompt``: Qwen3's hidden states 9, 18 and 27 stacked along the features, every
  prompt padded to ``max_sequence_length`` (fixed length, no mask), text ids ``(0, 0, 0, l)``.

[dev] (:class:`Flux2DevModel`, tests/models/test_flux2_dev.py) has the same transformer class, VAE, latent space,
schedule and text ids; it differs in two places:

- **Guidance.** [dev] is guidance-distilled: no CFG (``uses_cfg = False``); the guidance scale (4 by default, the
  pipeline's) goes into the transformer's guidance embedding as a ``[B]`` tensor, as FLUX.1-dev's does.
- **Text.** Mistral Small 3.1 (``Mistral3ForConditionalGeneration``) on the pipeline's system message + prompt
  chat (``PixtralProcessor.apply_chat_template``), padded and truncated to ``max_sequence_length``; hidden states
  10, 20 and 30 stacked along the features.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from .base import Cond, GuidanceEmbedded
from flowrl.config import LoraConfig
from .loading import latent_hw, load_adapter_pipeline, scheduler_sigmas
from .pipeline_model import PipelineModel

__all__ = ["Flux2KleinModel", "Flux2DevModel", "FLUX2_LORA_TARGETS", "FLUX2_KLEIN_DEFAULT_MODEL",
           "FLUX2_DEV_DEFAULT_MODEL"]

FLUX2_KLEIN_DEFAULT_MODEL = "black-forest-labs/FLUX.2-klein-base-4B"
#: FLUX.2 [dev] (gated on the hub: accept its license first).
FLUX2_DEV_DEFAULT_MODEL = "black-forest-labs/FLUX.2-dev"

#: LoRA targets: the attention projections and feed-forward layers of the double-stream blocks and the fused
#: QKV + MLP-in projection of the single-stream blocks. (The single blocks' output projection is also named
#: ``attn.to_out``, the same suffix as the double blocks' ``ModuleList``, which peft cannot adapt; name it with its
#: block path, e.g. ``single_transformer_blocks.0.attn.to_out``, to train it too.)
FLUX2_LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                      "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                      "ff_context.linear_out", "attn.to_qkv_mlp_proj"]

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "tokenizer"]


class Flux2KleinModel(PipelineModel):
    """FLUX.2 [klein] behind :class:`~flowrl.models.base.FlowModel`.

    Cond key: ``"prompt_embeds"`` ``[B, max_sequence_length, 3 * hidden]``.

    Args:
        pipeline: a built ``Flux2KleinPipeline``; VAE and text encoder are frozen.
        lora, gradient_checkpointing: as for the other adapters (targets default to :data:`FLUX2_LORA_TARGETS`).
        resolution: pixels, int or ``(H, W)``, a multiple of 16 (default 1024, the pipeline's).
        max_sequence_length: text tokens (the pipeline's default 512).
        guidance_scale: the default CFG scale (4, the pipeline's; unused by the distilled model).
    """

    family = "flux2_klein"  # its row in flowrl.models.families

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 4.0):
        super().__init__(pipeline, ("vae", "text_encoder"), lora=lora, gradient_checkpointing=gradient_checkpointing,
                         max_sequence_length=max_sequence_length)
        transformer = pipeline.transformer
        self.uses_cfg = not bool(pipeline.config.get("is_distilled", False))  # Flux2Pipeline ([dev]) has none
        self.default_guidance = float(guidance_scale) if self.uses_cfg else 1.0
        self.vae_scale_factor = pipeline.vae_scale_factor
        self.resolution = resolution or pipeline.default_sample_size * self.vae_scale_factor
        height, width = latent_hw(self.resolution, self.vae_scale_factor, 2)
        self.latent_shape = (transformer.config.in_channels, height // 2, width // 2)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = FLUX2_KLEIN_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        max_sequence_length: int = 512, guidance_scale: float = 4.0, revision: str | None = None,
                        variant: str | None = None, cache_dir: str | None = None,
                        trust_remote_code: bool = False) -> "Flux2KleinModel":
        """Load from a local pipeline directory or a hub id (``Flux2KleinPipeline.from_pretrained``).

        Raises:
            ModelLoadError: weights missing (offline, wrong path, gated repo) or unreadable.
        """
        from diffusers import Flux2KleinPipeline

        pipeline = load_adapter_pipeline(Flux2KleinPipeline, path, components=_COMPONENTS,
                                         hub_id=FLUX2_KLEIN_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)

    # ------------------------------------------------------------------ velocity

    def _guidance(self, batch: int, device: torch.device, guidance: float | None) -> torch.Tensor | None:
        """The transformer's ``guidance`` input: none for [klein] (no guidance embedding)."""
        return None

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond,
                 guidance: float | None = None) -> torch.Tensor:
        pipe = type(self.pipeline)
        dtype = self._compute_dtype
        batch, channels, height, width = x.shape
        embeds = cond["prompt_embeds"].to(device=x.device, dtype=dtype)
        out = denoiser(
            hidden_states=pipe._pack_latents(x.to(dtype)),  # [B, h w, 128], row-major
            encoder_hidden_states=embeds,
            timestep=sigma.to(device=x.device, dtype=dtype),  # the transformer multiplies by 1000
            img_ids=pipe._prepare_latent_ids(x).to(x.device),
            txt_ids=pipe._prepare_text_ids(embeds).to(x.device),
            guidance=self._guidance(batch, x.device, guidance),
            return_dict=False,
        )[0]
        return out.permute(0, 2, 1).reshape(batch, channels, height, width)

    # ------------------------------------------------------------------ FlowModel hooks

    def _encode(self, prompts: list[str]) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        embeds, _ = self.pipeline.encode_prompt(prompt=list(prompts), device=device,
                                                max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds}

    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vae = self.pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, 128, h, w]`` -> images ``[B, 3, 16h, 16w]`` float32 in [0, 1] (the pipeline's
        de-normalisation, unpatchify, VAE decode and postprocess)."""
        vae = self.pipeline.vae
        param = next(vae.parameters())
        z = latents.to(device=param.device, dtype=param.dtype)
        mean, std = self._bn_stats(z)
        images = vae.decode(type(self.pipeline)._unpatchify_latents(z * std + mean), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] -> latents ``[B, *latent_shape]`` (the posterior's mode, patchified and
        normalised as the pipeline encodes its reference images)."""
        vae = self.pipeline.vae
        param = next(vae.parameters())
        z = vae.encode(images.to(device=param.device, dtype=param.dtype) * 2 - 1).latent_dist.mode()
        z = type(self.pipeline)._patchify_latents(z)
        mean, std = self._bn_stats(z)
        return ((z - mean) / std).float()

    def default_lora_targets(self) -> list[str]:
        return list(FLUX2_LORA_TARGETS)

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The sigmas ``[num_steps + 1]`` ``Flux2KleinPipeline`` (and ``Flux2Pipeline``) samples with here."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu  # [klein]'s is a copy

        config = self.pipeline.scheduler.config
        _, height, width = self.latent_shape
        mu = compute_empirical_mu(image_seq_len=height * width, num_steps=num_steps)
        base = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        return scheduler_sigmas(config, num_steps, mu=mu, sigmas=base)


class Flux2DevModel(GuidanceEmbedded, Flux2KleinModel):
    """FLUX.2 [dev] behind :class:`~flowrl.models.base.FlowModel` (see the module docstring): [klein]'s adapter
    with the guidance embedding instead of CFG and Mistral Small 3.1 as the text encoder.

    Cond key: ``"prompt_embeds"`` ``[B, max_sequence_length, 3 * hidden]``.

    ``velocity(x, sigma, cond)`` uses ``default_guidance``; ``velocity_fn(scale)`` puts ``scale`` in the guidance
    embedding (never classifier-free guidance).

    Args: those of :class:`Flux2KleinModel`; ``guidance_scale`` is the guidance-embedding value (4, the pipeline's).
    """

    family = "flux2"  # its row in flowrl.models.families

    uses_cfg = False

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 4.0):
        if not pipeline.transformer.config.guidance_embeds:
            raise ValueError("Flux2DevModel needs FLUX.2 [dev]'s guidance-distilled transformer (guidance_embeds="
                             "True); a transformer without a guidance embedding is [klein]: use model.name "
                             "flux2_klein")
        super().__init__(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                         max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)
        self.uses_cfg = False
        self.default_guidance = float(guidance_scale)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = FLUX2_DEV_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        max_sequence_length: int = 512, guidance_scale: float = 4.0, revision: str | None = None,
                        variant: str | None = None, cache_dir: str | None = None,
                        trust_remote_code: bool = False) -> "Flux2DevModel":
        """Load from a local pipeline directory or a hub id (``Flux2Pipeline.from_pretrained``).

        Raises:
            ModelLoadError: weights missing (offline, wrong path, gated repo) or unreadable.
        """
        from diffusers import Flux2Pipeline

        pipeline = load_adapter_pipeline(Flux2Pipeline, path, components=_COMPONENTS,
                                         hub_id=FLUX2_DEV_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)


    def _guidance(self, batch: int, device: torch.device, guidance: float | None) -> torch.Tensor:
        value = self.default_guidance if guidance is None else guidance
        return torch.full((batch,), value, device=device, dtype=torch.float32)
