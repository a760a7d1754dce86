"""The components of a tiny but real Qwen-Image-Edit pipeline (``QwenImageEditPipeline``), built offline.

Qwen-Image-Edit takes Qwen-Image's components (:mod:`flowrl.testing.tiny_qwen_image`, same seeds: the transformer,
the causal 3D VAE with per-channel statistics, the Qwen2.5-VL text encoder with its vision tower and the word-level
tokenizer) plus a ``Qwen2VLProcessor``, through which the text encoder sees the source image inside the prompt.

Two things keep what the adapter depends on:

- the tokenizer keeps a run of punctuation (``"),"``) and the ``'s`` of a possessive whole, as Qwen2Tokenizer does,
  so the editing template's part before the image is exactly the 64 tokens the pipeline drops
  (``prompt_template_encode_start_idx``) and the kept sequence starts at ``<|vision_start|>`` as with the real one;
- the processor's ``Qwen2VLImageProcessor`` has the tiny vision tower's patch size, temporal patch and merge size
  (4, 2, 2) and is bounded to at most 32 x 32 pixels, so a source becomes a handful of vision tokens (16 at most).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["qwen_image_edit_components", "MIN_PIXELS", "MAX_PIXELS"]

#: The processor's pixel bounds (the real one allows 3136 to 12845056).
MIN_PIXELS, MAX_PIXELS = 16 * 16, 32 * 32


def _edit_pre_tokenizer():
    """tiny_qwen_image's pre-tokenizer with punctuation runs and ``'s`` kept whole (Qwen2Tokenizer's split)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"'s|[^\w\s]+"), behavior="isolated"),
    ])


def _processor(tok):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    patches = dict(patch_size=4, temporal_patch_size=2, merge_size=2,
                   size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    # the processor needs a video processor too; the editing pipeline never gives it a video
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**patches), tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor(**patches))


def qwen_image_edit_components(workdir: str | Path) -> dict:
    """Keyword arguments of ``QwenImageEditPipeline(...)`` for a tiny random-weight Qwen-Image-Edit."""
    from .tiny_qwen_image import qwen_image_components

    components = qwen_image_components(workdir)
    tok = components["tokenizer"]
    tok.backend_tokenizer.pre_tokenizer = _edit_pre_tokenizer()  # the same vocabulary, so the same text encoder
    components["processor"] = _processor(tok)
    return components
