"""What differs between model families: chat markup, the image placeholder, and how image tensors batch.

Everything else (building inputs, generating, re-scoring) is shared code in :mod:`flowrl.policies.inputs`
and :mod:`flowrl.policies.policy`. A family is chosen from the model's ``config.model_type``.

Markup per family (the text between turns; the processor expands the image placeholder into the image
tokens of each image, so their number always equals the number of image features):

- ``qwen2_vl`` / ``qwen2_5_vl`` / ``qwen3_vl``: ChatML (``<|im_start|>user\\n ... <|im_end|>\\n``), images as
  ``<|vision_start|><|image_pad|><|vision_end|>``, tool results inside ``<tool_response>`` in a user turn
  (as Qwen2.5's chat template renders the ``tool`` role). Qwen3-VL's processor returns the same keys
  (``mm_token_type_ids`` per token; ``pixel_values`` as flat patches and ``image_grid_thw`` per image).
- ``idefics3`` / ``smolvlm``: ``User:... <end_of_utterance>\\nAssistant:``, images as ``<image>``.
- ``causal_lm`` (any ``AutoModelForCausalLM``): ChatML when the tokenizer knows ``<|im_start|>``, else the
  plain ``User:`` / ``Assistant:`` form; no images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Family", "FAMILIES", "family_for_model_type", "ROLES"]

ROLES = ("system", "user", "tool", "assistant")


@dataclass(frozen=True)
class Family:
    """Chat markup and image batching of one model family.

    Attributes:
        name: registry name.
        model_types: ``config.model_type`` values of this family.
        starts: role -> text that opens a turn of that role.
        ends: role -> text that closes it. The assistant's end starts with the end-of-turn token the model
            generates itself (its generated ids keep it; only the rest is appended as prompt text).
        image_marker: text that stands for one image; the processor expands it.
        token_keys: per-token processor outputs (``[1, T]``) concatenated along the sequence.
        image_keys: per-image processor outputs, batched by :meth:`collate_images`.
        vision: whether the family takes images.
    """

    name: str
    model_types: tuple[str, ...]
    starts: dict[str, str]
    ends: dict[str, str]
    image_marker: str = ""
    token_keys: tuple[str, ...] = ("input_ids", "attention_mask")
    image_keys: tuple[str, ...] = ()
    vision: bool = True
    padded_images: bool = False  # image tensors are [1, n_images, ...] per sample and pad across the batch
    extra: dict[str, Any] = field(default_factory=dict)

    def collate_images(self, per_sample: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Batch the image tensors of ``B`` samples (each a dict of this family's image keys, or empty).

        Flat families (Qwen2-VL) concatenate patches and grids along dim 0 in sample order; padded families
        (Idefics3) stack ``[B, max_images, ...]`` with all-zero padding images, which the model skips.
        """
        keys = [k for k in self.image_keys if any(k in s for s in per_sample)]
        if not keys:
            return {}
        if not self.padded_images:
            return {k: torch.cat([s[k] for s in per_sample if k in s], dim=0) for k in keys}
        out = {}
        for key in keys:
            shaped = [s[key] for s in per_sample if key in s]
            tail = shaped[0].shape[2:]
            n_max = max(t.shape[1] for t in shaped)
            batch = torch.zeros((len(per_sample), n_max, *tail), dtype=shaped[0].dtype)
            for i, s in enumerate(per_sample):
                if key in s:
                    batch[i, : s[key].shape[1]] = s[key][0]
            out[key] = batch
        return out


_CHATML = dict(
    starts={"system": "<|im_start|>system\n", "user": "<|im_start|>user\n",
            "tool": "<|im_start|>user\n<tool_response>\n", "assistant": "<|im_start|>assistant\n"},
    ends={"system": "<|im_end|>\n", "user": "<|im_end|>\n", "tool": "\n</tool_response><|im_end|>\n",
          "assistant": "<|im_end|>\n"},
)
_IDEFICS = dict(
    starts={"system": "System:", "user": "User:", "tool": "User:", "assistant": "Assistant:"},
    ends={"system": "<end_of_utterance>\n", "user": "<end_of_utterance>\n", "tool": "<end_of_utterance>\n",
          "assistant": "<end_of_utterance>\n"},
)
_PLAIN = dict(
    starts={"system": "System: ", "user": "User: ", "tool": "Tool: ", "assistant": "Assistant: "},
    ends={"system": "\n", "user": "\n", "tool": "\n", "assistant": "\n"},
)

FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family("qwen2_vl", ("qwen2_vl",), image_marker="<|vision_start|><|image_pad|><|vision_end|>",
                       token_keys=("input_ids", "attention_mask", "mm_token_type_ids"),
                       image_keys=("pixel_values", "image_grid_thw"), **_CHATML),
    "qwen2_5_vl": Family("qwen2_5_vl", ("qwen2_5_vl",), image_marker="<|vision_start|><|image_pad|><|vision_end|>",
                         token_keys=("input_ids", "attention_mask", "mm_token_type_ids"),
                         image_keys=("pixel_values", "image_grid_thw"), **_CHATML),
    "qwen3_vl": Family("qwen3_vl", ("qwen3_vl",), image_marker="<|vision_start|><|image_pad|><|vision_end|>",
                       token_keys=("input_ids", "attention_mask", "mm_token_type_ids"),
                       image_keys=("pixel_values", "image_grid_thw"), **_CHATML),
    "idefics3": Family("idefics3", ("idefics3",), image_marker="<image>",
                       image_keys=("pixel_values", "pixel_attention_mask"), padded_images=True, **_IDEFICS),
    "smolvlm": Family("smolvlm", ("smolvlm",), image_marker="<image>",
                      image_keys=("pixel_values", "pixel_attention_mask"), padded_images=True, **_IDEFICS),
    "causal_lm": Family("causal_lm", (), vision=False, **_CHATML),
    "causal_lm_plain": Family("causal_lm_plain", (), vision=False, **_PLAIN),
}


def family_for_model_type(model_type: str, tokenizer=None) -> Family:
    """The family of a ``config.model_type``; any other type is a text-only causal LM (ChatML markup when
    the tokenizer has ``<|im_start|>``, else plain ``User:`` / ``Assistant:`` lines)."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    if tokenizer is not None and "<|im_start|>" in tokenizer.get_vocab():
        return FAMILIES["causal_lm"]
    return FAMILIES["causal_lm_plain"]
