"""The ``model`` section of the token-policy recipes (VLM / LM agents) and the policy it names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import bounds

__all__ = ["PolicyLoraConfig", "PolicyConfig", "build_policy"]


@dataclass
class PolicyLoraConfig:
    rank: int = field(default=16, metadata=bounds(ge=1))
    alpha: float = field(default=32.0, metadata=bounds(gt=0))
    dropout: float = field(default=0.0, metadata=bounds(ge=0, lt=1))
    target_modules: list[str] = field(default_factory=list)


@dataclass
class PolicyConfig:
    path: str | None = None  # a local model folder or hub id; None: the shipped Shapes-VQA model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: PolicyLoraConfig | None = None  # None: full fine-tuning (a frozen copy is the KL reference)
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None


def build_policy(cfg: PolicyConfig, device: torch.device):
    """The policy named by ``cfg`` (LoRA or full fine-tuning)."""
    from flowrl.policies import LoraSpec, TokenPolicy
    from flowrl.policies.shapes_vlm import resolve_model_path

    lora = None
    if cfg.lora is not None:
        lora = LoraSpec(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                        target_modules=tuple(cfg.lora.target_modules))
    return TokenPolicy.from_pretrained(resolve_model_path(cfg.path), dtype=cfg.dtype, device=device, lora=lora,
                                       gradient_checkpointing=cfg.gradient_checkpointing,
                                       attn_implementation=cfg.attn_implementation)
