"""Qwen-Image-Edit as a flowrl velocity model (diffusers ``QwenImageEditPipeline``): Qwen-Image that edits a source
image.

Everything Qwen-Image's adapter documents holds (time as ``sigma``, true CFG with the norm rescale on the negative
prompt ``" "``, 2x2 packed latents, the per-channel normalised causal VAE, the dynamically shifted schedule whose
``image_seq_len`` counts the noisy latent's tokens only; :mod:`flowrl.models.qwen_image`). What the editing pipeline
adds, checked against diffusers (tests/models/test_families.py, tests/models/test_qwen_image_edit.py):

- **Source image.** Each prompt's ``metadata["source_image"]`` (``[3, H, W]`` in [0, 1]) becomes an 8-bit RGB image
  (the pipeline takes PIL images; sources read from shards are 8-bit already, so this loses nothing), resized to the
  model's resolution with the pipeline's image processor. It conditions the model twice:

  * the **text encoder** sees it: the pipeline's ``encode_prompt(prompt, image=...)`` runs Qwen2.5-VL through the
    ``Qwen2VLProcessor`` on the editing template (``<|vision_start|><|image_pad|><|vision_end|>`` before the
    instruction) and drops the template's first 64 tokens, so the kept sequence is the source's vision tokens,
    then the instruction;
  * its **VAE latents** (the posterior's mean, normalised per channel: ``_encode_vae_image``) are packed and
    appended after the noisy latent's tokens, with ``img_shapes`` naming both images; the prediction is cut back
    to the noisy latent's tokens.

- **Guidance.** The pipeline encodes the negative prompt with the same source image, so the unconditional branch
  differs per row: the Cond keeps the negative prompt's encoding beside the prompt's
  (``negative_prompt_embeds`` / ``negative_prompt_embeds_mask``) and :meth:`QwenImageModel.velocity_fn` takes both
  branches from it.
- **Resolution.** The pipeline resizes the source to a 1024 x 1024 area at the source's aspect ratio (its
  ``calculate_dimensions(1024 * 1024, ratio)``); flowrl conditions at the model's own resolution, which is the
  pipeline called with ``height = width = resolution`` on a source of that size, and at the default 1024 px exactly
  the pipeline as shipped (the tests replace the 1024 x 1024 area by the tiny model's).
- **Text length.** The pipeline does not truncate the prompt. The cache pads every row to the source's vision tokens
  (a fixed number: every source has the model's resolution) plus ``max_sequence_length`` tokens for the
  instruction and the template's end, and refuses a longer prompt with a message naming the fix.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .base import Cond
from flowrl.config import LoraConfig
from .loading import load_adapter_pipeline
from .qwen_image import QWEN_IMAGE_LORA_TARGETS, QwenImageModel, _padded

__all__ = ["QwenImageEditModel", "QWEN_IMAGE_EDIT_DEFAULT_MODEL", "QWEN_IMAGE_EDIT_LORA_TARGETS"]

#: The released editing model (``QwenImageEditPipeline``; the later Qwen-Image-Edit-2509 / 2511 take several
#: images through ``QwenImageEditPlusPipeline``, which flowrl does not adapt).
QWEN_IMAGE_EDIT_DEFAULT_MODEL = "Qwen/Qwen-Image-Edit"

#: Qwen-Image-Edit's transformer is Qwen-Image's: the same attention and feed-forward modules.
QWEN_IMAGE_EDIT_LORA_TARGETS = list(QWEN_IMAGE_LORA_TARGETS)

_COMPONENTS = ["transformer", "vae", "scheduler", "text_encoder", "tokenizer", "processor"]
#: Cond keys of one guidance branch (what ``_predict`` reads).
_BRANCH = ("prompt_embeds", "prompt_embeds_mask", "image_latents")


class QwenImageEditModel(QwenImageModel):
    """Qwen-Image-Edit behind :class:`~flowrl.models.base.FlowModel`: an editing model (:attr:`conditions_on_source`).

    Cond keys (``T`` = the source's vision tokens + ``max_sequence_length``):

    - ``"prompt_embeds"`` ``[B, T, hidden]`` / ``"prompt_embeds_mask"`` ``[B, T]``: Qwen2.5-VL's last hidden state
      on the source image and the instruction (zero-padded, mask 0 on the padding);
    - ``"negative_prompt_embeds"`` / ``"negative_prompt_embeds_mask"``: the same for the negative prompt with the
      same source (the unconditional branch of guidance);
    - ``"image_latents"`` ``[B, 16, H / 8, W / 8]``: the source's normalised VAE latents.

    Args: those of :class:`~flowrl.models.qwen_image.QwenImageModel` (guidance 4 on the negative prompt ``" "``, the
    Qwen-Image-Edit model card's; ``max_sequence_length``: instruction tokens kept beside the source's, 512 by
    default, the pipeline's default).
    """

    family = "qwen_image_edit"  # its row in flowrl.models.families

    conditions_on_source = True

    def __init__(self, pipeline, *, lora: LoraConfig | dict | None = None, gradient_checkpointing: bool = False,
                 resolution: int | tuple[int, int] | None = None, max_sequence_length: int = 512,
                 guidance_scale: float = 4.0, negative_prompt: str = " "):
        super().__init__(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                         max_sequence_length=max_sequence_length, guidance_scale=guidance_scale,
                         negative_prompt=negative_prompt)
        self._source_tokens: int | None = None  # the source's vision tokens, counted on the first encoding

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike = QWEN_IMAGE_EDIT_DEFAULT_MODEL, *,
                        dtype: torch.dtype | str | None = None, vae_dtype: torch.dtype | str | None = torch.float32,
                        device: torch.device | str | None = None, lora: LoraConfig | dict | None = None,
                        gradient_checkpointing: bool = False, resolution: int | tuple[int, int] | None = None,
                        max_sequence_length: int = 512, guidance_scale: float = 4.0, negative_prompt: str = " ",
                        revision: str | None = None, variant: str | None = None, cache_dir: str | None = None,
                        trust_remote_code: bool = False) -> "QwenImageEditModel":
        """Load from a local pipeline directory or a hub id (``QwenImageEditPipeline.from_pretrained``); the
        arguments are those of :meth:`QwenImageModel.from_pretrained
        <flowrl.models.qwen_image.QwenImageModel.from_pretrained>`.

        Raises:
            ModelLoadError: weights missing (offline, wrong path) or unreadable.
        """
        from diffusers import QwenImageEditPipeline

        pipeline = load_adapter_pipeline(QwenImageEditPipeline, path, components=_COMPONENTS,
                                         hub_id=QWEN_IMAGE_EDIT_DEFAULT_MODEL, dtype=dtype, vae_dtype=vae_dtype,
                                         device=device, revision=revision, variant=variant, cache_dir=cache_dir,
                                         trust_remote_code=trust_remote_code)
        return cls(pipeline, lora=lora, gradient_checkpointing=gradient_checkpointing, resolution=resolution,
                   max_sequence_length=max_sequence_length, guidance_scale=guidance_scale,
                   negative_prompt=negative_prompt)

    # ------------------------------------------------------------------ source image and text

    def _image_size(self) -> tuple[int, int]:
        _, height, width = self.latent_shape
        return height * self.vae_scale_factor, width * self.vae_scale_factor

    def source_images(self, sources: list[torch.Tensor]) -> list:
        """Sources (each ``[3, H, W]`` in [0, 1], any size) -> 8-bit PIL images at the model's resolution, resized
        by the pipeline's image processor (its Lanczos resampling; no-op at that size already): what the
        pipeline's text encoder and VAE see."""
        from PIL import Image

        height, width = self._image_size()
        images = []
        for source in sources:
            pixels = (source.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
            images.append(self.pipeline.image_processor.resize(Image.fromarray(pixels, "RGB"), height, width))
        return images

    @torch.no_grad()
    def encode_sources(self, images: list) -> torch.Tensor:
        """PIL images at the model's resolution (:meth:`source_images`) -> latents ``[B, *latent_shape]``: the
        pipeline's ``preprocess`` (to [-1, 1]) and ``_encode_vae_image`` (the posterior's mean, normalised)."""
        height, width = self._image_size()
        param = next(self.pipeline.vae.parameters())
        pixels = self.pipeline.image_processor.preprocess(images, height, width)
        z = self.pipeline._encode_vae_image(pixels.to(device=param.device, dtype=param.dtype).unsqueeze(2),
                                            generator=None)
        return z[:, :, 0].float()

    def _text_length(self, images: list) -> int:
        """Tokens each cached text row is padded to: the source's vision tokens + ``max_sequence_length``."""
        if self._source_tokens is None:
            vision = self.pipeline.processor.image_processor
            grid = vision(images=images[:1], return_tensors="pt")["image_grid_thw"][0]
            self._source_tokens = int(grid.prod()) // vision.merge_size ** 2
        return self._source_tokens + self.max_sequence_length

    def _encode_text(self, prompts: list[str], images: list) -> Cond:
        device = next(self.pipeline.text_encoder.parameters()).device
        embeds, mask = self.pipeline.encode_prompt(prompt=prompts, image=images, device=device)
        length = self._text_length(images)
        if embeds.shape[1] > length:
            raise ValueError(f"an editing prompt encodes to {embeds.shape[1] - self._source_tokens} text tokens "
                             f"beside the source image's {self._source_tokens}, more than max_sequence_length "
                             f"{self.max_sequence_length}; shorten the instruction or raise model.max_sequence_length")
        return _padded(embeds, mask, length)

    def _encode(self, prompts: list[str], sources: list[torch.Tensor] | None = None) -> Cond:
        if sources is None:
            raise ValueError("QwenImageEditModel edits a source image: call encode_prompts(prompts, metadata) with "
                             "each row's source_image")
        images = self.source_images(sources)
        cond = self._encode_text(prompts, images)
        negative = self._encode_text([self.negative_prompt] * len(prompts), images)  # the pipeline's: same sources
        cond["negative_prompt_embeds"] = negative["prompt_embeds"]
        cond["negative_prompt_embeds_mask"] = negative["prompt_embeds_mask"]
        cond["image_latents"] = self.encode_sources(images)
        return cond

    def uncond(self, batch_size: int = 1) -> Cond:
        raise ValueError("QwenImageEditModel's unconditional branch is the negative prompt on each row's own source: "
                         "it is in the Cond of encode_prompts(prompts, metadata) (negative_prompt_embeds), not a "
                         "Cond of its own")

    # ------------------------------------------------------------------ velocity

    def _cfg_branches(self):
        def branches(cond: Cond, batch: int) -> tuple[Cond, Cond]:
            negative = {"prompt_embeds": cond["negative_prompt_embeds"],
                        "prompt_embeds_mask": cond["negative_prompt_embeds_mask"],
                        "image_latents": cond["image_latents"]}
            return negative, {k: cond[k] for k in _BRANCH}

        return branches

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        from diffusers import QwenImageEditPipeline as Pipeline

        dtype = self._compute_dtype
        batch, channels, height, width = x.shape
        source = cond["image_latents"].to(device=x.device, dtype=dtype)
        src_h, src_w = source.shape[2:]
        tokens = height // 2 * (width // 2)
        packed = torch.cat([Pipeline._pack_latents(x.to(dtype), batch, channels, height, width),
                            Pipeline._pack_latents(source, batch, channels, src_h, src_w)], dim=1)
        out = self._denoise(denoiser, packed, sigma, cond, [(1, height // 2, width // 2), (1, src_h // 2, src_w // 2)])
        vsf = self.vae_scale_factor
        # the noisy latent's tokens; the source's are context only
        return Pipeline._unpack_latents(out[:, :tokens], height * vsf, width * vsf, vsf)[:, :, 0]

    def default_lora_targets(self) -> list[str]:
        return list(QWEN_IMAGE_EDIT_LORA_TARGETS)
