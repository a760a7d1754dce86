"""The ``optim`` section of an online run: AdamW with a linear warm-up and an optional cosine decay, and the EMA
of trained weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.config import bounds

__all__ = ["OptimConfig", "build_optimizer", "build_ema"]


@dataclass
class OptimConfig:
    lr: float = field(default=3e-4, metadata=bounds(gt=0))
    weight_decay: float = field(default=1e-4, metadata=bounds(ge=0))
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = field(default=1e-8, metadata=bounds(gt=0))
    warmup_epochs: int = field(default=0, metadata=bounds(ge=0))
    # Cosine decay of the learning rate from lr (after the warm-up) to min_lr_ratio * lr at epoch decay_epochs,
    # flat after it; None keeps it constant. In epochs, not minutes, so a run is reproduced exactly: for a
    # time budget, set it near the epochs the budget buys (the main job: ~100 in 30 minutes).
    decay_epochs: int | None = field(default=None, metadata=bounds(ge=1))
    min_lr_ratio: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig):
    """``(AdamW, LambdaLR)``: the learning rate ramps linearly over ``warmup_epochs`` scheduler steps
    (the recipes step the scheduler once per epoch), then stays constant or, with ``decay_epochs``, follows a
    cosine down to ``min_lr_ratio * lr``."""
    from flowrl.run.updates import warmup_cosine

    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_epochs
    if cfg.decay_epochs is None:
        factor = lambda e: min(1.0, (e + 1) / warmup) if warmup else 1.0  # noqa: E731
    else:
        factor = warmup_cosine(cfg.decay_epochs, warmup, cfg.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_ema(params: list[torch.nn.Parameter], decay: float | None):
    """diffusers' ``EMAModel`` of ``params`` (None when ``decay`` is None)."""
    if decay is None:
        return None
    from diffusers.training_utils import EMAModel

    return EMAModel(params, decay=decay)
