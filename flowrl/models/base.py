"""The model-adapter interface: a generator seen as a velocity model.

Every recipe talks to generators only through :class:`FlowModel`, so the same loop trains the tiny
shapes model, Stable Diffusion 3 and FLUX.1. An adapter

- encodes prompts once per unique prompt (cached) into a ``Cond``: a dict of tensors, batch first;
- predicts the velocity ``v = eps - x0`` at ``(x, sigma, cond)`` in flowrl's time convention
  (sigma = 1 noise, sigma = 0 data), converting from the backbone's own convention;
- decodes latents to images ``[B, 3, H, W]`` in [0, 1];
- owns the trainable parameters (full fine-tuning or LoRA through peft) and a reference context
  (LoRA adapters off, or a frozen copy for full fine-tuning).

The trained network is ``self.denoiser``. Distributed recipes may replace it with the module that
``accelerator.prepare`` returns; adapters always call ``self.denoiser`` and unwrap it where they need
the plain module.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

Cond = dict[str, torch.Tensor]  # each value [B, ...]
VelocityFn = Callable[[torch.Tensor, torch.Tensor, Cond], torch.Tensor]

__all__ = ["Cond", "VelocityFn", "LoraSettings", "FlowModel", "ModelLoadError", "cond_select", "cond_cat",
           "unwrap"]


class ModelLoadError(RuntimeError):
    """A model could not be loaded (missing weights offline, wrong path); the message says the fix."""


@dataclass
class LoraSettings:
    """LoRA through peft: rank, alpha and the module names to adapt (backbone-specific defaults)."""

    rank: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    init: str = "gaussian"


def unwrap(module: nn.Module) -> nn.Module:
    """The plain module under DDP / FSDP / torch.compile wrappers."""
    while True:
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        if inner is None or not isinstance(inner, nn.Module):
            return module
        module = inner


def cond_select(cond: Cond, index: torch.Tensor | slice | list[int]) -> Cond:
    """Rows ``index`` of every tensor in a Cond."""
    return {k: v[index] for k, v in cond.items()}


def cond_cat(conds: list[Cond]) -> Cond:
    """Concatenate Conds along the batch."""
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


class FlowModel(nn.Module):
    """Base class of model adapters. Subclasses implement ``_encode``, ``_predict`` and ``decode``.

    Attributes:
        denoiser: the network that is trained (UNet or transformer).
        latent_shape: ``(C, H, W)`` of one latent.
        uses_cfg: classifier-free guidance applies (False for guidance-distilled FLUX).
        default_guidance: the guidance scale used when a recipe does not set one.
    """

    latent_shape: tuple[int, int, int]
    uses_cfg: bool = True
    default_guidance: float = 1.0

    def __init__(self, denoiser: nn.Module, *, lora: LoraSettings | None = None,
                 gradient_checkpointing: bool = False):
        super().__init__()
        self.denoiser = denoiser
        self._prompt_cache: dict[str, Cond] = {}
        self._reference: nn.Module | None = None
        self.lora = lora
        if gradient_checkpointing:
            self.denoiser.enable_gradient_checkpointing()
        if lora is not None:
            self._add_lora(lora)
        else:
            self.denoiser.requires_grad_(True)

    # ------------------------------------------------------------------ subclass hooks

    def _encode(self, prompts: list[str]) -> Cond:
        """Encode unique prompts (no caching here) into a Cond with batch ``len(prompts)``."""
        raise NotImplementedError

    def _predict(self, denoiser: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """The velocity ``eps - x0`` predicted by ``denoiser`` at ``x [B, C, H, W]``, ``sigma [B]``."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, H, W]`` -> images ``[B, 3, H', W']`` float32 in [0, 1]."""
        raise NotImplementedError

    def default_lora_targets(self) -> list[str]:
        """Module names LoRA adapts when the config names none."""
        raise NotImplementedError

    def sigmas(self, num_steps: int) -> torch.Tensor:
        """The model's sampling schedule ``[num_steps + 1]`` from 1 to 0 (subclasses add shifts)."""
        from samplers import linear_sigmas

        return linear_sigmas(num_steps)

    # ------------------------------------------------------------------ prompts

    @property
    def device(self) -> torch.device:
        return next(unwrap(self.denoiser).parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(unwrap(self.denoiser).parameters()).dtype

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Cond:
        """Cond for ``prompts`` (batch ``len(prompts)``), encoding each unique prompt once and caching it."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self._prompt_cache))
        if missing:
            encoded = self._encode(missing)
            for i, prompt in enumerate(missing):
                self._prompt_cache[prompt] = {k: v[i : i + 1].detach() for k, v in encoded.items()}
        return cond_cat([self._prompt_cache[p] for p in prompts])

    def uncond(self, batch_size: int = 1) -> Cond:
        """The empty-prompt Cond repeated ``batch_size`` times (for classifier-free guidance)."""
        return self.encode_prompts([""] * batch_size)

    def clear_prompt_cache(self) -> None:
        self._prompt_cache.clear()

    # ------------------------------------------------------------------ velocity

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Conditional velocity of the current policy, float32 ``[B, C, H, W]``."""
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])
        return self._predict(self.denoiser, x, sigma, cond).float()

    def velocity_fn(self, guidance_scale: float | None = None, *, detach_uncond: bool = False) -> VelocityFn:
        """``velocity_fn(x, sigma, cond)`` with classifier-free guidance applied when the model uses it.

        ``detach_uncond``: no gradient through the unconditional branch (Flow-GRPO's training; see
        ``samplers.classifier_free_guidance``)."""
        scale = self.default_guidance if guidance_scale is None else guidance_scale
        if not self.uses_cfg or scale == 1.0:
            return self.velocity
        from samplers import classifier_free_guidance

        return classifier_free_guidance(self.velocity, self.uncond(1), scale, detach_uncond=detach_uncond)

    # ------------------------------------------------------------------ training state

    def _add_lora(self, lora: LoraSettings) -> None:
        from peft import LoraConfig

        targets = lora.target_modules or self.default_lora_targets()
        self.denoiser.requires_grad_(False)
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                            target_modules=targets, init_lora_weights=lora.init)
        unwrap(self.denoiser).add_adapter(config)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in unwrap(self.denoiser).parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the trained tensors (LoRA weights, or the whole denoiser), detached on CPU."""
        module = unwrap(self.denoiser)
        names = {n for n, p in module.named_parameters() if p.requires_grad}
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items() if k in names}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        module = unwrap(self.denoiser)
        expected = {n for n, p in module.named_parameters() if p.requires_grad}
        if set(state) != expected:
            missing, extra = sorted(expected - set(state))[:3], sorted(set(state) - expected)[:3]
            raise ModelLoadError(f"checkpoint does not match the model's trainable parameters "
                                 f"(missing e.g. {missing}, unexpected e.g. {extra}); was it saved with the "
                                 f"same model and LoRA settings?")
        module.load_state_dict(state, strict=False)

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Inside this context the adapter predicts with the reference model.

        LoRA: the same network with its adapters disabled. Full fine-tuning: a frozen copy of the
        weights taken when the reference was first needed (call :meth:`freeze_reference` before
        training starts).
        """
        if self.lora is not None:
            module = unwrap(self.denoiser)
            module.disable_adapters()
            try:
                yield
            finally:
                module.enable_adapters()
            return
        if self._reference is None:
            self.freeze_reference()
        trained = self.denoiser
        self.denoiser = self._reference
        try:
            yield
        finally:
            self.denoiser = trained

    def freeze_reference(self) -> None:
        """Keep a frozen copy of the current weights as the reference (full fine-tuning only)."""
        if self.lora is None and self._reference is None:
            reference = copy.deepcopy(unwrap(self.denoiser))
            reference.requires_grad_(False).eval()
            # A plain attribute (not a registered submodule) so it never enters state_dict / DDP.
            object.__setattr__(self, "_reference", reference)
