"""Optimizer updates every recipe shares: the guarded optimizer step (a non-finite gradient skips the update
and is counted), and the warmup + cosine learning-rate schedule of the supervised recipes."""

from __future__ import annotations

import math

import torch

__all__ = ["UpdateHealth", "optimizer_step", "warmup_cosine"]


class UpdateHealth:
    """Counts optimizer updates skipped for a non-finite loss or gradient, in total and in a row."""

    def __init__(self) -> None:
        self.skipped = 0
        self.in_a_row = 0

    def record(self, finite: bool) -> None:
        self.skipped += not finite
        self.in_a_row = 0 if finite else self.in_a_row + 1


def optimizer_step(optimizer, params: list[torch.nn.Parameter], dist, *, grad_clip: float, ema=None,
                   health: UpdateHealth | None = None) -> float:
    """Clip the (all-reduced) gradients, step, update the EMA. Returns the gradient norm before clipping.

    A non-finite gradient norm (a NaN or inf loss, an exploding step) skips the update: the weights, the
    optimizer's moments and the EMA stay as they were, and ``health`` counts it. The norm is computed on the
    all-reduced gradients, so every process takes the same decision.
    """
    grad_norm = float(dist.clip_grad_norm_(params, grad_clip))
    finite = math.isfinite(grad_norm)
    if health is not None:
        health.record(finite)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    optimizer.step()
    if ema is not None:
        ema.step(params)
    return grad_norm


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float):
    """``factor(step)`` for ``torch.optim.lr_scheduler.LambdaLR``: linear warmup over ``warmup_steps`` (from
    ``1 / warmup_steps``), then a cosine from 1 down to ``min_ratio`` at ``total_steps``, flat after it."""
    total = max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min((step - warmup_steps) / max(total - warmup_steps, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
