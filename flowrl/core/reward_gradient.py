"""Reward-gradient fine-tuning: backpropagate a differentiable reward through the flow-matching ODE sampler.

The sampler is Euler on the model's schedule ``1 = s_0 > s_1 > ... > s_N = 0``::

    x_{k+1} = x_k + (s_{k+1} - s_k) v_theta(x_k, s_k)

and the clean-sample prediction at level ``s`` is ``x0_hat(x_s) = x_s - s v_theta(x_s, s)`` (the flow-matching
convention ``x_s = (1 - s) x0 + s eps``, ``v = eps - x0``). ``velocity(x, s)`` below is any such field with its
conditioning bound; ``s`` is passed as a ``[B]`` tensor.

**ReFL** (Xu et al. 2023, "ImageReward", section 4): roll out without gradients to a step ``k`` drawn uniformly from
the late window of the schedule, take ONE velocity call with gradients there, and score its clean prediction::

    k ~ U{ceil(low N), ..., ceil(high N) - 1}      (:func:`refl_step_range`; the authors: 30..39 of N = 40)
    x0_hat = x_k - s_k v_theta(x_k, s_k)           (:func:`refl_sample`)
    loss = scale * mean_b relu(margin - r(x0_hat_b))   (:func:`refl_loss`; the authors: margin 2, scale = grad_scale)

The authors' training step (THUDM/ImageReward, ``ImageReward/ReFL.py``) departs from the paper in two ways: it feeds
the UNet the step *index* ``mid_timestep`` (30..39) as its timestep, where the latent is at the scheduler's timestep
``timesteps[mid_timestep]`` (about 250 down to 25 of 1000): the network is told the latent is nearly clean; and it
calls ``scheduler.step(noise_pred, t, latents)`` with ``t`` left over from the no-grad loop (``timesteps[mid - 1]``,
one step noisier) to read ``pred_original_sample``. flowrl follows the paper: the velocity is evaluated at the
latent's own level ``s_k`` and the clean prediction uses that same ``s_k`` (for flow matching the step-index time
would be a different, wrong conditioning, and a mismatched level biases ``x0_hat`` by ``(s_{k-1} - s_k) v``). The
paper also mixes in the pretraining loss on a pretraining set; flowrl offers the velocity-space penalty to the
frozen reference instead (the recipe's ``kl_coef``).

**DRaFT-K** (Clark, Vicol, Swersky, Fleet, ICLR 2024, "Directly Fine-Tuning Diffusion Models on Differentiable
Rewards"): the full sampling chain, gradients stopped through all but the last ``K`` steps
(:func:`truncated_sample`), loss ``-mean_b r(x_N)``. ``K = N`` is full backpropagation through the sampler (DRaFT).

**DRaFT-LV** (the same paper, ``K = 1``): sample ``x_N`` with no gradient, re-noise it ``n`` times at the last step's
level ``s = s_{N-1}`` and denoise once with gradients (:func:`lv_rewards`)::

    x^i = (1 - s) x_N + s eps_i,   x0_hat^i = x^i + (s_N - s) v_theta(x^i, s),   loss = -(1/n) sum_i mean_b r(x0_hat^i)

There is no official code. The tests check these against hand-derived gradients on a linear velocity field.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

__all__ = ["GradPoint", "Sampled", "refl_step_range", "refl_loss", "draft_loss", "truncated_sample", "refl_sample",
           "renoise", "lv_rewards"]

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GradPoint(NamedTuple):
    """A velocity call made with gradients: its input ``x`` (detached), level ``sigma`` (float) and output ``v``."""

    x: torch.Tensor
    sigma: float
    v: torch.Tensor


class Sampled(NamedTuple):
    """A sample (or clean prediction) ``x`` and the velocity calls that carry its gradient."""

    x: torch.Tensor
    grad_points: list[GradPoint]


def refl_step_range(num_steps: int, low: float = 0.75, high: float = 1.0) -> range:
    """The steps ReFL may take its gradient step at: ``k`` with ``low <= k / num_steps < high``.

    ``refl_step_range(40) == range(30, 40)``: the authors' ``random.randint(30, 39)`` of 40 steps.

    Raises:
        ValueError: the window holds no step of this schedule, or ``0 <= low < high <= 1`` fails.
    """
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"the ReFL window needs 0 <= low < high <= 1, got low={low}, high={high}")
    start, stop = math.ceil(low * num_steps - 1e-9), min(math.ceil(high * num_steps - 1e-9), num_steps)
    if start >= stop:
        raise ValueError(f"the ReFL window [{low}, {high}) holds no step of a {num_steps}-step schedule; widen it")
    return range(start, stop)


def refl_loss(rewards: torch.Tensor, margin: float | None = 2.0, scale: float = 1.0) -> torch.Tensor:
    """ReFL's loss ``scale * mean relu(margin - r)`` (the authors' ``relu(-rewards + 2).mean() * grad_scale``);
    ``margin=None``: ``-scale * mean r``."""
    if margin is None:
        return -rewards.mean() * scale
    return torch.relu(margin - rewards).mean() * scale


def draft_loss(rewards: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """DRaFT's loss ``-scale * mean r``."""
    return -rewards.mean() * scale


def _levels(sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return sigma.to(device=x.device, dtype=torch.float32).expand(x.shape[0])


def truncated_sample(velocity: Velocity, x: torch.Tensor, sigmas: torch.Tensor, *, grad_steps: int) -> Sampled:
    """The Euler ODE sample ``x_N`` from ``x = x_0``, with gradients through the last ``grad_steps`` steps only
    (DRaFT-K: ``grad_steps = K``; ``0``: none; ``N``: the whole chain).

    Args:
        velocity: ``velocity(x, s [B]) -> v``, conditioning bound.
        x: ``[B, ...]`` initial noise.
        sigmas: ``[N + 1]`` schedule.
        grad_steps: ``0 <= grad_steps <= N``.
    """
    n = sigmas.numel() - 1
    if not 0 <= grad_steps <= n:
        raise ValueError(f"grad_steps must be in [0, {n}], got {grad_steps}")
    points: list[GradPoint] = []
    for k in range(n):
        with_grad = k >= n - grad_steps
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            v = velocity(x, _levels(sigmas[k], x))
            if with_grad:
                points.append(GradPoint(x.detach(), float(sigmas[k]), v))
            x = x + (sigmas[k + 1] - sigmas[k]).to(x.dtype) * v.to(x.dtype)
    return Sampled(x, points)


def refl_sample(velocity: Velocity, x: torch.Tensor, sigmas: torch.Tensor, *, step: int) -> Sampled:
    """ReFL's clean prediction: ``step`` Euler steps without gradients from ``x = x_0`` to ``x_step``, then
    ``x0_hat = x_step - s_step v(x_step, s_step)`` with gradients (the module docstring)."""
    n = sigmas.numel() - 1
    if not 0 <= step < n:
        raise ValueError(f"step must be in [0, {n - 1}], got {step}")
    with torch.no_grad():
        x = truncated_sample(velocity, x, sigmas[: step + 1], grad_steps=0).x
    sigma = sigmas[step]
    v = velocity(x, _levels(sigma, x))
    return Sampled(x - sigma.to(x.dtype) * v.to(x.dtype), [GradPoint(x.detach(), float(sigma), v)])


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """``(1 - s) x0 + s eps``: the flow-matching forward process at level ``s``."""
    return (1 - sigma) * x0 + sigma * noise


def lv_rewards(velocity: Velocity, x0: torch.Tensor, sigmas: torch.Tensor, noises: torch.Tensor,
               reward: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, list[GradPoint]]:
    """DRaFT-LV's rewards ``[n, B]``: the (stop-gradient) sample ``x0`` re-noised with each ``noises[i]`` at the last
    step's level ``s_{N-1}`` and denoised by one Euler step to ``s_N`` with gradients, then ``reward(x0_hat) -> [B]``.
    The loss is ``-rewards.mean()`` (the module docstring)."""
    s, s_end = sigmas[-2], sigmas[-1]
    x0 = x0.detach()
    rewards, points = [], []
    for eps in noises:
        x_s = renoise(x0, eps.to(x0), s.to(x0.dtype))
        v = velocity(x_s, _levels(s, x_s))
        points.append(GradPoint(x_s.detach(), float(s), v))
        rewards.append(reward(x_s + (s_end - s).to(x_s.dtype) * v.to(x_s.dtype)))
    return torch.stack(rewards), points
