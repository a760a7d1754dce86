"""``clip_directional``: CLIP directional similarity of an image edit, a reward that sees the source image.

The edit's direction in CLIP's image space, ``f(edited) - f(source)``, is compared with the direction of the
caption change in its text space, ``g(target caption) - g(source caption)`` (the directional CLIP similarity of
StyleGAN-NADA and InstructPix2Pix's evaluation)::

    score = cos(f(edited) - f(source), g(target) - g(source caption))

in [-1, 1]: 1 when the image moved exactly the way the captions did, 0 for an unrelated change or no change at all
(a zero direction scores 0, so copying the source earns nothing), negative for the opposite edit.

Per sample, ``metadata`` gives ``source_image`` (a ``[3, H, W]`` tensor in [0, 1]) and ``source_caption``; the target
caption is ``metadata["target_caption"]`` when present, else the prompt. ``details["clip_directional/image_change"]``
is ``1 - cos(f(edited), f(source))``, how far the edit moved the image at all.
"""

from __future__ import annotations

import torch

from ._loading import resolve_device
from ._open_clip import OpenClipReward, load_open_clip
from .base import RewardError, RewardOutput

__all__ = ["ClipDirectional", "directional_similarity"]


def directional_similarity(edited: torch.Tensor, source: torch.Tensor, target_text: torch.Tensor,
                           source_text: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``cos(edited - source, target_text - source_text)`` row by row for features ``[B, D]``; 0 where either
    direction is (numerically) zero."""
    image_direction = edited - source
    text_direction = target_text - source_text
    norms = image_direction.norm(dim=-1) * text_direction.norm(dim=-1)
    dot = (image_direction * text_direction).sum(-1)
    return torch.where(norms > eps, dot / norms.clamp_min(eps), torch.zeros_like(dot))


class ClipDirectional(OpenClipReward):
    """CLIP directional similarity (see the module docstring). Arguments as :class:`rewards.clip_score.ClipScore`."""

    name = "clip_directional"

    def __init__(self, model_name: str = "ViT-L-14", pretrained: str | None = "openai", device: str = "cpu",
                 precision: str = "fp32", batch_size: int = 32, cache_dir: str | None = None):
        self.batch_size = int(batch_size)
        dev = resolve_device(device)
        fix = ("Pass model_name=<open_clip architecture> and pretrained=<tag or checkpoint file>, or "
               "model_name='local-dir:<folder with open_clip_config.json and the weights>'.")
        model, tokenizer = load_open_clip(self.name, model_name, pretrained, device=dev, precision=precision,
                                          cache_dir=cache_dir, fix=fix)
        self._setup(model, tokenizer, dev)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        if metadata is None or len(metadata) != len(prompts):
            raise RewardError("clip_directional: every sample needs metadata with its source_image and "
                              "source_caption (an editing prompt set gives them)")
        missing = [i for i, m in enumerate(metadata) if "source_image" not in m or "source_caption" not in m]
        if missing:
            raise RewardError(f"clip_directional: sample {missing[0]} has no source_image / source_caption in its "
                              "metadata; give editing prompts (webdataset shards with src.png and txt)")
        sources = torch.stack([torch.as_tensor(m["source_image"], dtype=torch.float32) for m in metadata])
        targets = [str(m.get("target_caption") or p) for m, p in zip(metadata, prompts)]
        with self.grad_context(images):
            edited = self.encode_images(images)
            with torch.no_grad():
                source = self.encode_images(sources)
            scores = directional_similarity(edited, source, self.encode_texts(targets),
                                            self.encode_texts([str(m["source_caption"]) for m in metadata]))
        change = 1.0 - (edited.detach() * source).sum(-1)
        return RewardOutput(scores, {f"{self.name}/image_change": change})
