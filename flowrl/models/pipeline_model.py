"""What every adapter of a diffusers pipeline shares (SD3, FLUX.1 / Kontext, FLUX.2, Qwen-Image / Edit, Z-Image,
Wan): the pipeline's text encoders and VAE frozen and registered, its transformer trained (fully or through LoRA
kept in float32), VAE decoding and encoding, and the resolution-dependent schedule shift of its scheduler.

Memory options (``model.offload_text_encoders``, ``model.vae_slicing``, ``model.vae_tiling``; :func:`build_model
<flowrl.models.config.build_model>` applies them, an adapter built directly keeps everything resident and whole):

- **Text encoders offloaded.** The text encoders are frozen in every family (LoRA and full fine-tuning train the
  transformer only) and each prompt is encoded once into the prompt cache, so they are idle almost all the time:
  :meth:`PipelineModel.set_text_encoder_offload` keeps them on the CPU and lends them to the model's device for each
  call that encodes uncached prompts (all of a pipeline's text encoders together: one encode call uses each), then
  points their parameters back at the CPU copies (no device-to-host copy: the weights never change). T5-XXL's
  9.5 GB (SD3, FLUX.1) or Qwen2.5-VL's 16 GB (Qwen-Image) then occupy the device only while new prompts are
  encoded, between rollout batches, never beside the training step's activations. Encoding on the device keeps
  it fast (a CPU would take seconds per prompt for T5-XXL); the copy in costs about 0.5 s for T5-XXL from pinned
  memory on PCIe 5, once per batch that brings new prompts.
- **VAE slicing / tiling.** diffusers' own ``vae.enable_slicing()`` decodes (and encodes) a batch one image at a
  time (the same images, a batch's activations divided by its size: a 1024 px decode of 8 images in float32
  needs tens of GB whole); ``vae.enable_tiling()`` decodes an image larger than the VAE's tile size in
  overlapping tiles blended at the seams (diffusers' threshold: ``AutoencoderKL`` tiles latents larger than its
  config's ``sample_size`` pixels, 1024 for SD3 / FLUX.1; the Wan and Qwen-Image VAEs tile above 256 px). Tiling
  changes the images slightly at the seams, so it is off by default.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from .base import FlowModel, unwrap
from flowrl.config import LoraConfig
from .loading import as_lora_config, freeze_, upcast_trainable_, vae_decode, vae_encode

__all__ = ["PipelineModel", "resolution_shift", "OffloadedModule"]


class PipelineModel(FlowModel):
    """A :class:`FlowModel` around a built diffusers pipeline.

    Args:
        pipeline: the pipeline; kept as ``self.pipeline`` (not an ``nn.Module``: tokenizers, scheduler,
            ``encode_prompt``), its progress bar off.
        frozen: the pipeline's parts that are never trained (e.g. ``("vae", "text_encoder")``); missing ones (an
            SD3 pipeline without its T5) are skipped. They are frozen and registered in ``self.frozen``, so that
            ``.to(device)`` moves them and ``train()`` keeps them in eval mode (text encoders offloaded by
            :meth:`set_text_encoder_offload` leave it and stay on the CPU).
        denoiser: what trains (default ``pipeline.transformer``; Wan 2.2 passes its two experts).
        compute_dtype: the dtype the transformer computes in (default: its first parameter's, taken before
            float32 LoRA weights exist).
        lora, gradient_checkpointing: as for :class:`FlowModel`; LoRA weights are kept in float32.
        max_sequence_length: text tokens the prompt encoder keeps.
    """

    def __init__(self, pipeline, frozen: tuple[str, ...], *, denoiser: nn.Module | None = None,
                 compute_dtype: torch.dtype | None = None, lora: LoraConfig | dict | None = None,
                 gradient_checkpointing: bool = False, max_sequence_length: int = 512):
        parts = {name: getattr(pipeline, name, None) for name in frozen}
        freeze_(*parts.values())
        compute_dtype = compute_dtype or next(pipeline.transformer.parameters()).dtype
        super().__init__(denoiser if denoiser is not None else pipeline.transformer, lora=as_lora_config(lora),
                         gradient_checkpointing=gradient_checkpointing)
        self._compute_dtype = compute_dtype
        self.pipeline = pipeline
        self.pipeline.set_progress_bar_config(disable=True)
        self.frozen = nn.ModuleDict({k: m for k, m in parts.items() if m is not None})
        self.max_sequence_length = int(max_sequence_length)
        # set_text_encoder_offload: {name: OffloadedModule}, kept out of the module tree so `.to()` leaves them
        object.__setattr__(self, "_offloaded", {})

    # ------------------------------------------------------------------ memory options

    @property
    def text_encoders(self) -> dict[str, nn.Module]:
        """The pipeline's text encoders this adapter uses, resident or offloaded, by component name."""
        resident = {k: m for k, m in self.frozen.items() if k.startswith("text_encoder")}
        return {**resident, **{k: o.module for k, o in self._offloaded.items()}}

    def set_text_encoder_offload(self, enabled: bool = True) -> None:
        """Keep the text encoders on the CPU and lend them to the device only to encode uncached prompts
        (``enabled``), or keep them resident on the model's device (see the module docstring).

        Offloaded encoders leave :attr:`frozen` (so ``model.to(device)`` does not move them back) and stay frozen
        and in eval mode; :attr:`text_encoders` lists them either way.
        """
        if enabled:
            for name in [k for k in self.frozen if k.startswith("text_encoder")]:
                module = self.frozen[name]
                del self.frozen[name]
                self._offloaded[name] = OffloadedModule(module)
        else:
            device = self.device
            for name, offloaded in list(self._offloaded.items()):
                self.frozen[name] = offloaded.module.to(device)
                del self._offloaded[name]

    @contextlib.contextmanager
    def _text_encoders_on_device(self) -> Iterator[None]:
        if not self._offloaded:
            yield
            return
        device = self.device
        with contextlib.ExitStack() as stack:
            for offloaded in self._offloaded.values():
                stack.enter_context(offloaded.lent(device))
            yield

    def set_vae_memory(self, *, slicing: bool = True, tiling: bool = False) -> None:
        """Decode a batch one image at a time (``slicing``) and large images in tiles (``tiling``), through the
        VAE's own ``enable_slicing()`` / ``enable_tiling()`` (see the module docstring)."""
        vae = self.pipeline.vae
        vae.enable_slicing() if slicing else vae.disable_slicing()
        vae.enable_tiling() if tiling else vae.disable_tiling()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self.pipeline.vae, latents)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` in [0, 1] at the model's resolution -> latents ``[B, *latent_shape]``
        (the VAE posterior's mean; Diffusion-DPO's offline pairs)."""
        return vae_encode(self.pipeline.vae, images)

    def _add_lora(self, lora: LoraConfig) -> None:
        super()._add_lora(lora)
        upcast_trainable_(unwrap(self.denoiser))

    def train(self, mode: bool = True):
        super().train(mode)
        self.frozen.eval()  # text encoders and VAE never use dropout (offloaded ones stay in eval mode)
        return self


class OffloadedModule:
    """A frozen module kept on the CPU and lent to a device for the length of a ``with`` block.

    Lending puts a device copy of every parameter and buffer in the module's tables; the end of the block puts the
    original CPU tensors back, so the device copies are freed without a device-to-host copy and the CPU tensors are
    never changed. The first lending to a CUDA device pins them (page-locked: the copies in are asynchronous and
    about twice as fast). Tied weights stay tied. Only for modules whose weights never change (frozen text encoders).

    Args:
        module: the frozen module (moved to the CPU here).
    """

    def __init__(self, module: nn.Module):
        self.module = module.to("cpu")
        self._pinned = False

    def _pin(self) -> None:
        for param in self.module.parameters():
            param.data = param.data.pin_memory()
        for owner in self.module.modules():
            for key, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[key] = buffer.pin_memory()
        self._pinned = True

    @contextlib.contextmanager
    def lent(self, device: torch.device) -> Iterator[nn.Module]:
        """The module on ``device`` inside the block, back on its CPU tensors after it (a no-op on the CPU)."""
        device = torch.device(device)
        if device.type == "cpu":
            yield self.module
            return
        if device.type == "cuda" and not self._pinned:
            self._pin()
        saved: list[tuple[dict, str, torch.Tensor]] = []  # (owner's table, key, CPU tensor)
        copies: dict[int, torch.Tensor] = {}  # id of a CPU tensor -> its device copy (tied weights share one)
        try:
            for owner in self.module.modules():
                for table in (owner._parameters, owner._buffers):
                    for key, tensor in table.items():
                        if tensor is None:
                            continue
                        if id(tensor) not in copies:
                            moved = tensor.detach().to(device, non_blocking=True)
                            copies[id(tensor)] = nn.Parameter(moved, requires_grad=False) \
                                if isinstance(tensor, nn.Parameter) else moved
                        saved.append((table, key, tensor))
                        table[key] = copies[id(tensor)]
            yield self.module
        finally:
            for table, key, tensor in saved:
                table[key] = tensor


def resolution_shift(scheduler_config: Any, image_seq_len: int, *, max_shift: float = 1.15) -> float:
    """The schedule shift ``mu`` a diffusers pipeline computes for ``image_seq_len`` image tokens, from its
    scheduler config's ranges (``base_image_seq_len`` 256, ``max_image_seq_len`` 4096, ``base_shift`` 0.5,
    ``max_shift``: the defaults where the config has none)."""
    from samplers import calculate_shift

    config = scheduler_config
    return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", max_shift))
