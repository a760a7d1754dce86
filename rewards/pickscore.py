"""``pickscore``: PickScore (Kirstain et al. 2023), a CLIP-H fine-tuned on Pick-a-Pic preferences.

Loaded with transformers: ``CLIPModel.from_pretrained(model)`` and ``CLIPProcessor.from_pretrained(processor)``,
each a local folder or a hub id (defaults ``yuvalkirstain/PickScore_v1`` and
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``, as in the reference code). The score is the reference one,
``logit_scale.exp() * cos(image, text)`` (about 18-23 for real images; ``logit_scale.exp()`` is 100 for
the released model). The processor supplies the tokenizer and the image geometry/normalisation; the
image preprocessing itself runs in torch on the tensor so the score is differentiable.

Precision: ``dtype="auto"`` (the default) runs the model in bfloat16 on CUDA and float32 elsewhere
(:func:`rewards._loading.auto_precision`: PickScore was trained under bf16 mixed precision); ``dtype="float32"``
reproduces the reference code's float32 scores (the model card's snippet and Flow-GRPO score in float32).
"""

from __future__ import annotations

import torch

from ._loading import (OFFLINE_HINT, load_errors, looks_like_path, refuse_pickle_only, require_dir, resolve_device,
                       resolve_dtype)
from ._preprocess import ImagePreprocess, from_hf_image_processor
from .base import Reward, RewardError, RewardOutput

__all__ = ["PickScore", "PICKSCORE_MODEL", "PICKSCORE_PROCESSOR", "image_features", "text_features"]

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"


def _as_tensor(output) -> torch.Tensor:
    """transformers 4.x returns features as a tensor, 5.x as a ModelOutput with ``pooler_output``."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def image_features(model, pixel_values: torch.Tensor) -> torch.Tensor:
    return _as_tensor(model.get_image_features(pixel_values=pixel_values))


def text_features(model, **tokens) -> torch.Tensor:
    return _as_tensor(model.get_text_features(**tokens))


class PickScore(Reward):
    """PickScore preference reward.

    Args:
        model: local folder (``config.json`` + ``model.safetensors``) or hub id of the CLIPModel.
        processor: local folder or hub id of the CLIPProcessor (tokenizer + image processor files).
        device: ``"cpu"``, ``"cuda"``, ... or ``"auto"``.
        dtype: ``"auto"`` (bfloat16 on CUDA, float32 elsewhere; see the module docstring), ``"float32"``,
            ``"float16"`` or ``"bfloat16"``.
        batch_size: preferred batch size.
        local_files_only: never contact the hub (use the local cache only).
    """

    name = "pickscore"
    differentiable = True

    def __init__(self, model: str = PICKSCORE_MODEL, processor: str = PICKSCORE_PROCESSOR, device: str = "cpu",
                 dtype: str = "auto", batch_size: int = 32, local_files_only: bool = False):
        from transformers import CLIPModel, CLIPProcessor

        self.batch_size = int(batch_size)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        fix = (f"Pass model=<folder with config.json and model.safetensors of {PICKSCORE_MODEL}> and "
               f"processor=<folder with the tokenizer and preprocessor files of {PICKSCORE_PROCESSOR}>.")
        for value, what in ((model, "PickScore model"), (processor, "CLIP processor")):
            if looks_like_path(value):  # a path, not a hub id: check it before transformers guesses
                require_dir(value, self.name, what, fix)
        if looks_like_path(model):
            refuse_pickle_only(model, self.name, "transformers", "CLIPModel")
        with load_errors(self.name, f"the CLIP processor {processor!r}", f"{fix} {OFFLINE_HINT}"):
            self.processor = CLIPProcessor.from_pretrained(processor, local_files_only=local_files_only)
        with load_errors(self.name, f"the PickScore model {model!r}", f"{fix} {OFFLINE_HINT}"):
            self.model = CLIPModel.from_pretrained(model, local_files_only=local_files_only, dtype=self.dtype,
                                                   use_safetensors=True)
        self.model.to(self.device).eval().requires_grad_(False)
        try:
            self.preprocess: ImagePreprocess = from_hf_image_processor(self.processor)
        except ValueError as err:
            raise RewardError(f"pickscore: {err}") from None
        self.max_length = min(int(getattr(self.processor.tokenizer, "model_max_length", 77) or 77),
                              int(self.model.config.text_config.max_position_embeddings))

    @torch.no_grad()
    def encode_texts(self, prompts: list[str]) -> torch.Tensor:
        unique = list(dict.fromkeys(prompts))
        tokens = self.processor.tokenizer(unique, padding=True, truncation=True, max_length=self.max_length,
                                          return_tensors="pt").to(self.device)
        features = text_features(self.model, **tokens).float()
        features = features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return features[torch.tensor([unique.index(p) for p in prompts], device=features.device)]

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        pixels = self.preprocess(images.to(self.device, torch.float32)).to(self.dtype)
        features = image_features(self.model, pixels).float()
        return features / features.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        context = torch.enable_grad() if images.requires_grad else torch.no_grad()
        with context:
            cosine = (self.encode_images(images) * self.encode_texts(prompts)).sum(-1)
            scores = self.model.logit_scale.exp().float() * cosine
        return RewardOutput(scores, {f"{self.name}/cosine": cosine.detach()})
