"""Shared loading and encoding for the open_clip-based rewards (clip_score, hpsv2, aesthetic).

``model_name`` is anything ``open_clip.create_model`` accepts: a built-in architecture name
(``"ViT-H-14"``), ``"local-dir:/path"`` (a folder holding ``open_clip_config.json`` with ``model_cfg`` and
``preprocess_cfg``, plus ``open_clip_model.safetensors`` or ``open_clip_pytorch_model.bin``), or
``"hf-hub:org/repo"``. ``pretrained`` is a tag (``"openai"``, ``"laion2b_s32b_b79k"``, fetched from the hub
once and cached) or a checkpoint file path; checkpoints load with ``weights_only=True``.

Images are preprocessed in torch (:mod:`rewards._preprocess`) with the geometry and normalisation that
open_clip attached to the model, so scores are differentiable with respect to the input images.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._loading import OFFLINE_HINT, load_errors, looks_like_path, require_dir, require_file
from ._preprocess import ImagePreprocess, from_open_clip
from .base import Reward, RewardError

__all__ = ["OpenClipReward", "load_open_clip"]

_PRECISIONS = ("fp32", "fp16", "bf16")


def load_open_clip(reward: str, model_name: str, pretrained: str | None, *, device: torch.device,
                   precision: str = "fp32", cache_dir: str | None = None, require_weights: bool = True,
                   fix: str = ""):
    """Build an open_clip model (eval mode, frozen) and its tokenizer.

    Args:
        reward: reward name for error messages.
        model_name: open_clip architecture name, ``local-dir:PATH`` or ``hf-hub:ID``.
        pretrained: tag or checkpoint path (ignored by open_clip for ``local-dir:``/``hf-hub:``).
        require_weights: raise if no weights were loaded (False when the caller loads its own checkpoint).
        fix: what the user should do, appended to every error.

    Returns:
        ``(model, tokenizer)``.
    """
    if precision not in _PRECISIONS:
        raise RewardError(f"{reward}: precision must be one of {', '.join(_PRECISIONS)}, got {precision!r}")
    try:
        import open_clip
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise RewardError(f"{reward}: open_clip is not installed; pip install open_clip_torch") from err
    if model_name.startswith("local-dir:"):
        folder = require_dir(model_name[len("local-dir:"):], reward, "open_clip model", fix)
        require_file(folder / "open_clip_config.json", reward, "open_clip_config.json", fix)
    elif pretrained and looks_like_path(pretrained):
        require_file(pretrained, reward, "open_clip checkpoint", fix)
    what = f"open_clip model {model_name!r}" + (f" with pretrained={pretrained!r}" if pretrained else "")
    with load_errors(reward, what, f"{fix} {OFFLINE_HINT}".strip()):
        model = open_clip.create_model(model_name, pretrained=pretrained, device=device, precision=precision,
                                       cache_dir=cache_dir, require_pretrained=require_weights,
                                       weights_only=True)
        tokenizer = open_clip.get_tokenizer(model_name, cache_dir=cache_dir)
    model.eval().requires_grad_(False)
    return model, tokenizer


class OpenClipReward(Reward):
    """Base of the open_clip rewards: differentiable image features, cached-per-batch text features."""

    differentiable = True

    def _setup(self, model, tokenizer, device: torch.device) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        # the tower's weight dtype (fp16/bf16 precisions keep some scalars such as logit_scale in fp32)
        tower = getattr(model, "visual", model)
        layers = (m for m in tower.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)))
        self.dtype = next((m.weight.dtype for m in layers), torch.float32)
        self.preprocess: ImagePreprocess = from_open_clip(model)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> L2-normalised image features ``[B, D]`` (float32)."""
        pixels = self.preprocess(images.to(self.device, torch.float32)).to(self.dtype)
        features = self.model.encode_image(pixels).float()
        return features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def encode_texts(self, prompts: Sequence[str]) -> torch.Tensor:
        """Prompts -> L2-normalised text features ``[B, D]``; each distinct prompt is encoded once."""
        unique = list(dict.fromkeys(prompts))
        tokens = self.tokenizer(unique).to(self.device)
        features = self.model.encode_text(tokens).float()
        features = features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        index = torch.tensor([unique.index(p) for p in prompts], device=features.device)
        return features[index]

    def grad_context(self, images: torch.Tensor):
        """Gradients only when the caller asked for them (saves memory when scoring)."""
        return torch.enable_grad() if images.requires_grad else torch.no_grad()
