"""The base model for the last denoising steps (``sampling.base_last_steps: K``): the fix MixGRPO users apply to
late-step reward hacking. The last ``K`` steps of every rollout are taken by the frozen base model, so the
fine textures and details that those steps draw cannot be bent toward the reward; the policy only takes (and
is only trained on) the earlier steps, where the layout forms (the config insists the training window ends
before the tail).

Which steps are the tail is decided by noise level, not by index, so that evaluation on another number of
steps hands over at the same point: a step starting at ``sigma <= sigmas[T - K]`` of the rollout schedule is the
base's. Evaluation uses the same pipeline (the policy, then the base) since that is what the run delivers; its
``hack/*`` distances to the base are then those of the delivered images.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

__all__ = ["tail_sigma", "base_tail_velocity", "base_tail"]

VelocityFn = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
TOLERANCE = 1e-6  # sigmas of two schedules of one model that name the same level differ by rounding only


def tail_sigma(sigmas: torch.Tensor, last_steps: int) -> float:
    """The noise level at which the base takes over: ``sigmas[T - K]`` of the rollout schedule ``[T + 1]``."""
    steps = sigmas.numel() - 1
    if not 1 <= last_steps < steps:
        raise ValueError(f"base_last_steps must be in [1, {steps - 1}] for a {steps}-step schedule, got {last_steps}")
    return float(sigmas[steps - last_steps])


def base_tail_velocity(model, velocity: VelocityFn, base_velocity: VelocityFn, threshold: float) -> VelocityFn:
    """``velocity`` above the noise level ``threshold`` and ``base_velocity`` under ``model.reference()`` at or
    below it. ``sigma [B]`` is one level per row; a batch that mixes levels is split row by row."""

    def tail_velocity(x: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        in_tail = sigma <= threshold + TOLERANCE  # [B]
        if not bool(in_tail.any()):
            return velocity(x, sigma, cond)
        with model.reference():
            base = base_velocity(x, sigma, cond)
        if bool(in_tail.all()):
            return base
        policy = velocity(x, sigma, cond)
        return torch.where(in_tail.view(-1, *([1] * (x.ndim - 1))), base, policy)

    return tail_velocity


@contextlib.contextmanager
def base_tail(model, threshold: float | None) -> Iterator[None]:
    """Inside this context ``model.velocity_fn(...)`` hands the steps at or below ``threshold`` to the base (None:
    unchanged). Used around evaluation, whose sampler and panel ask the model for its velocity function."""
    if threshold is None:
        yield
        return
    original = model.velocity_fn

    def velocity_fn(guidance_scale: float | None = None, *, detach_uncond: bool = False) -> VelocityFn:
        return base_tail_velocity(model, original(guidance_scale, detach_uncond=detach_uncond),
                                  original(guidance_scale), threshold)

    model.velocity_fn = velocity_fn
    try:
        yield
    finally:
        del model.velocity_fn  # the class's method again
