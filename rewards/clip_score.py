"""``clip_score``: image-text cosine similarity under an open_clip model.

Score conventions (``convention=``):

- ``"cosine"`` (default): ``cos(image, text)`` in [-1, 1], typically 0.2-0.4 for matching pairs.
- ``"x100"``: ``100 * cos`` (the scale torchmetrics and most papers report, without its ``max(., 0)``).
- ``"clipscore"``: ``2.5 * max(cos, 0)``, CLIP-S of Hessel et al. 2021 (zero gradient where cos < 0).

``details["clip_score/cosine"]`` always holds the raw cosine.

Precision: ``precision="auto"`` (the default) runs the model in bfloat16 on CUDA and float32 elsewhere
(:func:`rewards._loading.auto_precision`: OpenAI's own loader keeps CLIP in float16 on CUDA); ``precision="fp32"``
gives float32 scores.
"""

from __future__ import annotations

import torch

from ._loading import auto_precision, resolve_device
from ._open_clip import OpenClipReward, load_open_clip
from .base import RewardError, RewardOutput

__all__ = ["ClipScore"]

_CONVENTIONS = ("cosine", "x100", "clipscore")


class ClipScore(OpenClipReward):
    """CLIP image-text similarity.

    Args:
        model_name: open_clip architecture (``"ViT-L-14"``), ``"local-dir:PATH"`` or ``"hf-hub:ID"``.
        pretrained: tag (``"openai"``) or checkpoint file; ignored for ``local-dir:``/``hf-hub:``.
        convention: ``"cosine"``, ``"x100"`` or ``"clipscore"`` (see the module docstring).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"auto"``.
        precision: ``"auto"`` (bf16 on CUDA, fp32 elsewhere), ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        batch_size: preferred batch size.
        cache_dir: where open_clip caches downloaded weights.
    """

    name = "clip_score"

    def __init__(self, model_name: str = "ViT-L-14", pretrained: str | None = "openai", convention: str = "cosine",
                 device: str = "cpu", precision: str = "auto", batch_size: int = 32, cache_dir: str | None = None):
        if convention not in _CONVENTIONS:
            raise RewardError(f"clip_score: convention must be one of {', '.join(_CONVENTIONS)}, got {convention!r}")
        self.convention = convention
        self.batch_size = int(batch_size)
        dev = resolve_device(device)
        precision = auto_precision(dev) if precision == "auto" else precision
        fix = ("Pass model_name=<open_clip architecture> and pretrained=<tag or path to the checkpoint "
               "(open_clip_pytorch_model.bin / .safetensors)>, or model_name='local-dir:<folder with "
               "open_clip_config.json and the weights>'.")
        model, tokenizer = load_open_clip(self.name, model_name, pretrained, device=dev, precision=precision,
                                          cache_dir=cache_dir, fix=fix)
        self._setup(model, tokenizer, dev)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        with self.grad_context(images):
            image_features = self.encode_images(images)
            text_features = self.encode_texts(prompts)
            cosine = (image_features * text_features).sum(-1)
            if self.convention == "x100":
                scores = 100.0 * cosine
            elif self.convention == "clipscore":
                scores = 2.5 * cosine.clamp_min(0.0)
            else:
                scores = cosine
        return RewardOutput(scores, {f"{self.name}/cosine": cosine.detach()})
