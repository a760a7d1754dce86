"""The ``model`` section of the token-policy recipes (VLM / LM agents) and the policy it names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from flowrl.config import LoraConfig

__all__ = ["PolicyConfig", "build_policy"]


@dataclass
class PolicyConfig:
    path: str | None = None  # a local model folder or hub id; None: the shipped Shapes-VQA model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # None: full fine-tuning (a frozen copy is the KL reference); empty target_modules: every attention and MLP
    # projection of the language model.
    lora: LoraConfig | None = None
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None


def build_policy(cfg: PolicyConfig, device: torch.device):
    """The policy named by ``cfg`` (LoRA or full fine-tuning)."""
    from flowrl.policies import TokenPolicy
    from flowrl.policies.shapes_vlm import resolve_model_path

    return TokenPolicy.from_pretrained(resolve_model_path(cfg.path), dtype=cfg.dtype, device=device, lora=cfg.lora,
                                       gradient_checkpointing=cfg.gradient_checkpointing,
                                       attn_implementation=cfg.attn_implementation)
