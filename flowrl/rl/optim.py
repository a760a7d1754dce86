"""The ``optim`` section of every recipe: AdamW with a linear warm-up, an optional cosine decay and gradient
clipping; and the evaluation EMA of the trained weights.

Each key names its unit. The schedule advances in the recipe's *schedule unit* (:data:`SCHEDULE_UNITS`), which the
recipe passes to :func:`build_optimizer`:

- ``epoch``: the online recipes (Flow-GRPO, the forward-process and preference trainers, VLM GRPO) step the
  learning-rate schedule once per epoch, so their warm-up is ``warmup_epochs`` (``warmup_steps`` is an error there);
- ``step``: the supervised recipes (``pretrain``, ``vlm_sft``) step it after every optimizer step, so their warm-up
  may be given in optimizer steps (``warmup_steps``), in epochs (``warmup_epochs``), or both (they add up).

``decay_epochs`` counts epochs in every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import bounds

__all__ = ["OptimConfig", "SCHEDULE_UNITS", "build_optimizer", "build_ema"]

#: What one step of the learning-rate schedule is, per kind of recipe (the module docstring).
SCHEDULE_UNITS = {"epoch": "once per epoch (the online recipes)",
                  "step": "after every optimizer step (the supervised recipes: pretrain, vlm_sft)"}


@dataclass
class OptimConfig:
    """AdamW, its learning-rate schedule and gradient clipping: the one ``optim`` section of every recipe."""

    lr: float = field(default=3e-4, metadata=bounds(gt=0))
    weight_decay: float = field(default=1e-4, metadata=bounds(ge=0))
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = field(default=1e-8, metadata=bounds(gt=0))
    # Linear warm-up from lr / n to lr over n schedule steps, n = warmup_epochs (x the optimizer steps of an epoch in
    # the supervised recipes) + warmup_steps (optimizer steps: supervised recipes only).
    warmup_epochs: int = field(default=0, metadata=bounds(ge=0))
    warmup_steps: int = field(default=0, metadata=bounds(ge=0))
    # Cosine decay of the learning rate from lr (after the warm-up) to min_lr_ratio * lr at epoch decay_epochs, flat
    # after it; `run`: at the run's last epoch (run.max_epochs); None: constant after the warm-up (the supervised
    # recipes anneal: they need a number or `run`). In epochs, not minutes, so a run is reproduced exactly: for a
    # time budget, set it near the epochs the budget buys (the shapes main job: ~100 in 30 minutes).
    decay_epochs: int | Literal["run"] | None = field(default=None, metadata=bounds(ge=1))
    min_lr_ratio: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))  # the gradient's global norm is clipped to this


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, *,
                    schedule_unit: Literal["epoch", "step"] = "epoch", steps_per_epoch: int = 1,
                    max_epochs: int | None = None):
    """``(AdamW, LambdaLR)`` of an ``optim`` section.

    The scheduler's factor ramps linearly over the warm-up's ``n`` scheduler steps (from ``1 / n``), then stays 1
    or, with ``decay_epochs``, follows a cosine down to ``min_lr_ratio`` at the decay's last scheduler step (flat
    after it). The recipe steps the scheduler once per ``schedule_unit``.

    Args:
        params: the trained parameters.
        cfg: the ``optim`` section.
        schedule_unit: when the recipe steps the scheduler (:data:`SCHEDULE_UNITS`): ``epoch`` (once per epoch) or
            ``step`` (after every optimizer step).
        steps_per_epoch: the optimizer steps of one epoch (``step`` only; an ``epoch`` schedule has one step per
            epoch whatever this is).
        max_epochs: the run's ``run.max_epochs``, which ``decay_epochs: run`` spans.

    Raises:
        ConfigError: a warm-up in optimizer steps for a schedule that steps per epoch, or ``decay_epochs: run``
            without ``max_epochs``.
    """
    from flowrl.config import ConfigError
    from flowrl.run.updates import warmup_cosine

    if schedule_unit not in SCHEDULE_UNITS:
        raise ValueError(f"schedule_unit must be one of {', '.join(SCHEDULE_UNITS)}, got {schedule_unit!r}")
    per_epoch = steps_per_epoch if schedule_unit == "step" else 1  # scheduler steps of one epoch
    if schedule_unit == "epoch" and cfg.warmup_steps:
        raise ConfigError("optim.warmup_steps", "this recipe steps its learning-rate schedule once per epoch; give "
                          "the warm-up in epochs (optim.warmup_epochs)")
    decay_epochs = cfg.decay_epochs
    if decay_epochs == "run":
        if max_epochs is None:
            raise ConfigError("optim.decay_epochs", "`run` needs the run's length; give a number of epochs")
        decay_epochs = max_epochs
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_epochs * per_epoch + cfg.warmup_steps
    if decay_epochs is None:
        factor = lambda k: min(1.0, (k + 1) / warmup) if warmup else 1.0  # noqa: E731
    else:
        factor = warmup_cosine(decay_epochs * per_epoch, warmup, cfg.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_ema(params: list[torch.nn.Parameter], decay: float | None):
    """diffusers' ``EMAModel`` of ``params`` (None when ``decay`` is None), stepped after every optimizer step
    (:func:`flowrl.run.updates.optimizer_step`): ``decay`` is the EMA's decay per optimizer step."""
    if decay is None:
        return None
    from diffusers.training_utils import EMAModel

    return EMAModel(params, decay=decay)
