"""FLUX.1-Kontext as a flowrl velocity model (diffusers ``FluxKontextPipeline``): FLUX.1 that edits a source image.

Everything FLUX.1's adapter documents holds (time as ``sigma``, the guidance embedding, no CFG, 2x2 packing, the
dynamically shifted schedule, T5 + CLIP text; :mod:`flowrl.models.flux`). What Kontext adds, checked against
diffusers (tests/models/test_families.py, tests/models/test_flux_kontext.py):

- **Source image.** Each prompt's ``metadata["source_image"]`` (``[3, H, W]`` in [0, 1]) is resized to the model's
  resolution, encoded with the VAE (the posterior's mean, ``(z - shift_factor) * scaling_factor``, as
  ``_encode_vae_image`` with ``sample_mode="argmax"``) and kept in the Cond as ``"image_latents"``; the prompt cache
  keys on the prompt and a hash of the source, so a source is encoded once.
- **Tokens.** ``_predict`` appends the source's packed tokens after the noisy latent's, with position ids whose
  first coordinate is 1 (the pipeline's ``image_ids[..., 0] = 1``), and keeps only the first (noisy-latent) tokens
  of the prediction. The schedule's ``image_seq_len`` counts the noisy latent's tokens only, as the pipeline's.
- **Resolution.** The pipeline by default snaps the source to one of Kontext's preferred resolutions
  (``_auto_resize``) and scales its output to a ``max_area`` of 1024 x 1024; flowrl draws and conditions at the
  model's own resolution, which is the pipeline called with ``height = width = resolution``,
  ``max_area = resolution ** 2`` and ``_auto_resize=False``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .base import Cond
from flowrl.config import LoraConfig
from .flux import FLUX_LORA_TARGETS, FluxModel
from .loading import load_adapter_pipeline

__all__ = ["FluxKontextModel", "FLUX_KONTEXT_DEFAULT_MODEL", "FLUX_KONTEXT_LORA_TARGETS"]

#: The released Kontext model (gated on the hub: accept its license first).
FLUX_KONTEXT_DEFAULT_MODEL = "black-forest-labs/FLUX.1-Kontext-dev"

#: Kontext's transformer is FLUX.1's: the same attention and feed-forward modules.
FLUX_KONTEXT_LORA_TARGETS = list(FLUX_LORA_TARGETS)

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"]


class FluxKontextModel(FluxModel):
    """FLUX.1-Kontext behind :class:`~flowrl.models.base.FlowModel`: an editing model
    (:attr:`conditions_on_source`).

    Cond keys: FLUX.1's ``"prompt_embeds"`` and ``"pooled_prompt_embeds"``, plus ``"image_latents"``
    ``[B, 16, H / 8, W / 8]``, the source image's VAE latents in the transformer's space.

    Args: those of :class:`~flowrl.models.flux.FluxModel` (guidance 2.5 by default, the pipeline's).
    """

    family = "flux_kontext"  # its row in flowrl.models.families

    conditions_on_source = True

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 2.5):
        super().__init__(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                         max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = FLUX_KONTEXT_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        max_sequence_length: int = 512, guidance_scale: float = 2.5, revision: str | None = None,
                        variant: str | None = None, cache_dir: str | None = None,
                        trust_remote_code: bool = False) -> "FluxKontextModel":
        """Load from a local pipeline directory or a hub id (``FluxKontextPipeline.from_pretrained``); the
        arguments are those of :meth:`FluxModel.from_pretrained <flowrl.models.flux.FluxModel.from_pretrained>`.

        Raises:
            ModelLoadError: weights missing (offline, wrong path, gated repo) or unreadable.
        """
        from diffusers import FluxKontextPipeline

        pipeline = load_adapter_pipeline(FluxKontextPipeline, path, components=_COMPONENTS,
                                         hub_id=FLUX_KONTEXT_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale)

    # ------------------------------------------------------------------ source image and velocity

    def _image_size(self) -> tuple[int, int]:
        _, height, width = self.latent_shape
        return height * self.vae_scale_factor, width * self.vae_scale_factor

    @torch.no_grad()
    def encode_sources(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """Source images (each ``[3, H, W]`` in [0, 1], any size) -> latents ``[B, *latent_shape]``: resized to
        the model's resolution with the pipeline's image processor, then the VAE posterior's mean."""
        height, width = self._image_size()
        processor, vae = self.pipeline.image_processor, self.pipeline.vae
        param = next(vae.parameters())
        # the pipeline's own steps: resize + preprocess (to [-1, 1]), then _encode_vae_image's argmax latents
        images = torch.cat([processor.preprocess(processor.resize(s.unsqueeze(0), height, width), height, width)
                            for s in sources]).to(device=param.device, dtype=param.dtype)
        z = vae.encode(images).latent_dist.mode()
        return ((z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor).float()

    def _encode(self, prompts: list[str], sources: list[torch.Tensor] | None = None) -> Cond:
        if sources is None:
            raise ValueError("FluxKontextModel edits a source image: call encode_prompts(prompts, metadata) with "
                             "each row's source_image")
        cond = super()._encode(prompts)
        cond["image_latents"] = self.encode_sources(sources)
        return cond

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond,
                 guidance: float | None = None) -> torch.Tensor:
        from diffusers import FluxKontextPipeline as Pipeline

        dtype = self._compute_dtype
        batch, channels, height, width = x.shape
        source = cond["image_latents"].to(device=x.device, dtype=dtype)
        src_h, src_w = source.shape[2:]
        tokens = height // 2 * (width // 2)
        packed = torch.cat([Pipeline._pack_latents(x.to(dtype), batch, channels, height, width),
                            Pipeline._pack_latents(source, batch, channels, src_h, src_w)], dim=1)
        img_ids = Pipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x.device, dtype)
        source_ids = Pipeline._prepare_latent_image_ids(batch, src_h // 2, src_w // 2, x.device, dtype)
        source_ids[..., 0] = 1  # the source's tokens sit on a second "frame" of the position grid
        prompt_embeds = cond["prompt_embeds"].to(device=x.device, dtype=dtype)
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
            txt_ids=torch.zeros(prompt_embeds.shape[1], 3, device=x.device, dtype=dtype),
            img_ids=torch.cat([img_ids, source_ids]),
            return_dict=False,
        )[0][:, :tokens]  # the noisy latent's tokens; the source's are context only
        vsf = self.vae_scale_factor
        return Pipeline._unpack_latents(out, height * vsf, width * vsf, vsf)

    def default_lora_targets(self) -> list[str]:
        return list(FLUX_KONTEXT_LORA_TARGETS)
