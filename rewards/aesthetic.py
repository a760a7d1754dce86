"""``aesthetic``: the LAION improved aesthetic predictor (Schuhmann et al., used by DDPO and Flow-GRPO).

An MLP ``768 -> 1024 -> 128 -> 64 -> 16 -> 1`` (dropouts 0.2, 0.2, 0.1, inactive at eval) on the
L2-normalised image embedding of CLIP ViT-L/14 (OpenAI weights). The MLP weights are the
``sac+logos+ava1-l14-linearMSE.pth`` state dict (keys ``layers.{0,2,4,6,7}.{weight,bias}``), loaded with
``weights_only=True`` (``.safetensors`` also works). Scores are on the AVA 1-10 scale, typically 4-7.

The CLIP tower is open_clip's ``ViT-L-14`` with ``pretrained="openai"``, numerically the OpenAI
checkpoint the predictor was trained on; its preprocessing runs in torch so gradients reach the images.
The MLP input width is read from the checkpoint (768 for the real one) and must equal the CLIP
embedding width.
"""

from __future__ import annotations

import torch
from torch import nn

from ._loading import load_state_dict_file, resolve_device
from ._open_clip import OpenClipReward, load_open_clip
from .base import RewardError, RewardOutput

__all__ = ["AestheticMLP", "Aesthetic", "AESTHETIC_WEIGHTS"]

AESTHETIC_WEIGHTS = "sac+logos+ava1-l14-linearMSE.pth"
_SOURCE = "https://github.com/christophschuhmann/improved-aesthetic-predictor"


class AestheticMLP(nn.Module):
    """The LAION aesthetic head, layer for layer (so its state dict keys match the published file)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.input_size = input_size
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:  # [B, D] -> [B, 1]
        return self.layers(embeddings)


class Aesthetic(OpenClipReward):
    """LAION aesthetic score of CLIP ViT-L/14 image embeddings (the prompt is ignored).

    Args:
        mlp_path: the predictor weights (``sac+logos+ava1-l14-linearMSE.pth``).
        model_name, pretrained: the CLIP tower (default ``"ViT-L-14"`` / ``"openai"``; a tag is fetched
            from the hub once and cached, or pass the checkpoint file path).
        device, precision, batch_size, cache_dir: as for :class:`~rewards.clip_score.ClipScore`.
    """

    name = "aesthetic"

    def __init__(self, mlp_path: str = AESTHETIC_WEIGHTS, model_name: str = "ViT-L-14",
                 pretrained: str | None = "openai", device: str = "cpu", precision: str = "fp32",
                 batch_size: int = 32, cache_dir: str | None = None):
        self.batch_size = int(batch_size)
        dev = resolve_device(device)
        fix = (f"Download {AESTHETIC_WEIGHTS} from {_SOURCE} and pass mlp_path=/path/to/{AESTHETIC_WEIGHTS}; "
               f"the CLIP tower is open_clip model_name/pretrained (e.g. ViT-L-14 + the OpenAI checkpoint file).")
        state = load_state_dict_file(mlp_path, self.name, fix)
        if "layers.0.weight" not in state:
            raise RewardError(f"aesthetic: {mlp_path!r} is not an aesthetic-predictor state dict (no "
                              f"'layers.0.weight'; keys: {sorted(state)[:6]}). {fix}")
        mlp = AestheticMLP(int(state["layers.0.weight"].shape[1]))
        try:
            mlp.load_state_dict(state, strict=True)
        except RuntimeError as err:
            raise RewardError(f"aesthetic: {mlp_path!r} does not match the predictor MLP "
                              f"({' '.join(str(err).split())[:200]}). {fix}") from None
        model, tokenizer = load_open_clip(self.name, model_name, pretrained, device=dev, precision=precision,
                                          cache_dir=cache_dir, fix=fix)
        self._setup(model, tokenizer, dev)
        embed_dim = int(getattr(model.visual, "output_dim", mlp.input_size))
        if embed_dim != mlp.input_size:
            raise RewardError(f"aesthetic: the MLP expects {mlp.input_size}-d embeddings but {model_name} gives "
                              f"{embed_dim}-d; the LAION predictor needs CLIP ViT-L-14 (768-d).")
        self.mlp = mlp.to(dev).eval().requires_grad_(False)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        with self.grad_context(images):
            scores = self.mlp(self.encode_images(images)).squeeze(-1)
        return RewardOutput(scores, {})
