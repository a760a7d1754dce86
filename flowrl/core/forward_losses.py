"""Forward-process objectives: CRD, DiffusionNFT and AWM (docs/trainers.md).

These trainers sample clean images with any sampler, score them, and train the velocity model on the
flow-matching forward process at fresh noised points ``x_t = (1 - t) x0 + t eps`` with target
``u = eps - x0``. Every function here takes the model's velocity predictions at those points (the
recipe runs the model: the policy ``v``, the "old" snapshot ``v_old``, the frozen reference ``v_ref``)
and returns a loss; nothing here calls a model, draws noise or knows about processes.

Shapes: velocities, targets and samples are ``[B, ...]`` (one row per (sample, training time) pair, at
least one non-batch dimension); per-sample quantities (advantages, times, group ids) are ``[B]``.
``mean_d`` below is the mean over the non-batch elements of one row.

Reductions: each loss is a per-row value reduced by ``reduction``: ``"mean"`` (default, the mean over
the ``B`` rows, as the authors' code does) or ``"sum"`` (a recipe that accumulates micro-batches sums and
divides by the global row count itself, so world size never enters here).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flowrl.core.advantages import _as_group_index
from flowrl.core.losses import LOG_RATIO_CLAMP, _check_choice, _check_same_shape, clipped_policy_loss

__all__ = [
    "AWM_WEIGHTINGS",
    "NORMALISER_FLOOR",
    "REDUCTIONS",
    "ForwardLossOutput",
    "adaptive_normaliser",
    "awm_log_likelihood",
    "awm_loss",
    "crd_loss",
    "group_mean",
    "implicit_reward",
    "nft_loss",
    "reward_adaptive_kl_weight",
    "reward_weights",
    "velocity_error",
]

REDUCTIONS = ("mean", "sum")
AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
# Floor of the adaptive normalisers (DiffusionNFT and CRD clamp mean_d |.| at 1e-5).
NORMALISER_FLOOR = 1e-5
# AWM's numerical offset inside the (generalised) Huber weighting, as in the authors' code.
_HUBER_EPS = 1e-10


class ForwardLossOutput(NamedTuple):
    """A forward-process loss and what is logged with it."""

    loss: Tensor  # [] main term + regularisers, carries the graph to the velocity prediction
    policy_loss: Tensor  # [] detached, the method's main term (same reduction as loss)
    kl_loss: Tensor  # [] detached, the weighted regularisers (same reduction as loss)
    stats: dict[str, Tensor]  # name -> [] detached batch means (e.g. "kl_ref", "implicit_reward")


# --------------------------------------------------------------------------------------------------
# argument checking


def _check_number(name: str, value: Any, *, positive: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value <= 0 if positive else value < 0):
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}; received {value!r}")
    return float(value)


def _check_rows(**tensors: Tensor | None) -> int:
    """All given tensors are ``[B, ...]`` of one shape with a non-batch dimension; returns ``B``."""
    present = {k: v for k, v in tensors.items() if v is not None}
    for name, x in present.items():
        if not isinstance(x, Tensor):
            raise ValueError(f"{name} must be a tensor [B, ...]; received {type(x).__name__}")
        if x.ndim < 2:
            raise ValueError(f"{name} must have shape [B, ...] with at least one non-batch dimension; "
                             f"received {list(x.shape)}")
    _check_same_shape(**present)
    return next(iter(present.values())).shape[0]


def _per_row(name: str, x: Any, batch: int, device: torch.device) -> Tensor:
    """A ``[B]`` tensor of finite values (advantages, times, ...)."""
    x = torch.as_tensor(x, device=device)
    if x.ndim != 1 or x.shape[0] != batch:
        raise ValueError(f"{name} must have shape [B] = [{batch}]; received {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or inf; drop those samples before computing the loss")
    return x


def _times(t: Any, like: Tensor) -> Tensor:
    """``t`` (a float, a 0-d or a ``[B]`` tensor, in [0, 1]) as ``[B, 1, ...]`` broadcastable to ``like``."""
    batch = like.shape[0]
    t = torch.as_tensor(t, device=like.device)
    if not t.is_floating_point():
        t = t.to(like.dtype if like.is_floating_point() else torch.float32)
    if t.ndim == 0:
        t = t.expand(batch)
    t = _per_row("t", t, batch, like.device)
    if bool(((t < 0) | (t > 1)).any()):
        raise ValueError("t must hold noise levels in [0, 1] (sigma = 1 is noise); received values "
                         f"{t.flatten()[:4].tolist()}...")
    return t.reshape(batch, *([1] * (like.ndim - 1)))


def _work_dtype(x: Tensor) -> torch.dtype:
    # bf16 squared errors lose the differences these losses are made of: compute in >= float32.
    return torch.promote_types(x.dtype, torch.float32)


def _row_mean(x: Tensor) -> Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def _reduce(per_row: Tensor, reduction: str) -> Tensor:
    return per_row.mean() if reduction == "mean" else per_row.sum()


# --------------------------------------------------------------------------------------------------
# shared pieces


def reward_weights(advantages: Tensor, *, adv_clip: float = 5.0) -> Tensor:
    """Rewards in ``[0, 1]`` from group advantages: ``r = clamp(clip(A, -c, c) / (2c) + 0.5, 0, 1)``.

    With the default ``c = 5`` this is ``clip(A, -5, 5) / 10 + 0.5`` (DiffusionNFT and CRD).

    Args:
        advantages: ``[B]`` group advantages.
        adv_clip: ``c > 0``, the advantage clip; advantages of ``+-c`` map to 1 and 0.

    Returns:
        ``[B]`` reward weights, detached, in the advantages' dtype.
    """
    adv_clip = _check_number("adv_clip", adv_clip, positive=True)
    a = advantages.detach().clamp(-adv_clip, adv_clip)
    # The authors' order of operations, so the values match theirs bit for bit.
    return ((a / adv_clip) / 2.0 + 0.5).clamp(0.0, 1.0)


def velocity_error(v: Tensor, target: Tensor) -> Tensor:
    """The flow-matching error ``err(v) = mean_d (v - u)^2`` of each row.

    Args:
        v: ``[B, ...]`` velocity prediction.
        target: ``[B, ...]`` target (``u = eps - x0``, or another velocity such as the reference's).

    Returns:
        ``[B]`` in at least float32, differentiable w.r.t. both inputs.
    """
    _check_rows(v=v, target=target)
    dtype = _work_dtype(v)
    return _row_mean((v.to(dtype) - target.to(dtype)).square())


def adaptive_normaliser(pred: Tensor, target: Tensor, *, floor: float = NORMALISER_FLOOR) -> Tensor:
    """``w = stopgrad(max(mean_d |pred - target|, floor))`` in float64 (DiffusionNFT and CRD).

    Dividing a row's squared error by ``w`` makes its gradient scale-free; float64 keeps a tiny ``w``
    from rounding away (the authors compute it in float64 too).

    Args:
        pred: ``[B, ...]`` prediction (a velocity or a clean-sample estimate).
        target: ``[B, ...]`` its target.
        floor: the clamp, > 0. Default 1e-5.

    Returns:
        ``[B]`` float64, detached.
    """
    _check_rows(pred=pred, target=target)
    floor = _check_number("floor", floor, positive=True)
    with torch.no_grad():
        return _row_mean((pred.detach().double() - target.detach().double()).abs()).clamp(min=floor)


def _normalised_error(pred: Tensor, target: Tensor) -> Tensor:
    """``mean_d (pred - target)^2 / w(pred, target)`` per row, float64 (gradient through ``pred``)."""
    w = adaptive_normaliser(pred, target)
    dtype = _work_dtype(pred)
    return _row_mean((pred.to(dtype) - target.to(dtype)).square().double()) / w


def group_mean(values: Tensor, group_ids: Tensor | Any) -> Tensor:
    """Each row's group mean ``mean_{j in g(i)} values_j``, broadcast back to the rows.

    Args:
        values: ``[B]``.
        group_ids: ``[B]`` integer tensor or list of hashable ids (as for ``group_advantages``).

    Returns:
        ``[B]``, differentiable w.r.t. ``values`` (detach it where the method stops the gradient).
    """
    if values.ndim != 1:
        raise ValueError(f"values must have shape [B]; received {list(values.shape)}")
    inverse, n = _as_group_index(group_ids, values.shape[0], values.device)
    zeros = values.new_zeros(n)
    sums = zeros.index_add(0, inverse, values)
    counts = zeros.index_add(0, inverse, torch.ones_like(values))
    return (sums / counts)[inverse]


# --------------------------------------------------------------------------------------------------
# CRD


def implicit_reward(v: Tensor, v_old: Tensor, target: Tensor, *, adaptive: bool = True) -> Tensor:
    """CRD's implicit reward ``r_theta = -(err(v) / w(v) - err(v_old) / w(v_old))``, float64.

    ``err`` is the flow-matching error ``mean_d (. - u)^2`` and ``w`` the adaptive normaliser (float64,
    clamped at 1e-5); ``adaptive=False`` drops the normalisers. ``v_old`` is detached.

    Args:
        v: ``[B, ...]`` the policy's velocity at ``(x_t, t)``.
        v_old: ``[B, ...]`` the old snapshot's velocity at the same point.
        target: ``[B, ...]`` ``u = eps - x0``.
        adaptive: divide each error by its normaliser. Default True.

    Returns:
        ``[B]`` float64, differentiable w.r.t. ``v``.
    """
    _check_rows(v=v, v_old=v_old, target=target)
    v_old = v_old.detach()
    if adaptive:
        return -(_normalised_error(v, target) - _normalised_error(v_old, target))
    return -(velocity_error(v, target) - velocity_error(v_old, target)).double()


def reward_adaptive_kl_weight(r: Tensor, *, kl_coef: float, kl_floor: float = 1e-4) -> Tensor:
    """CRD's KL weight ``kappa (m + r (1 - m))`` with ``m = kl_floor / kappa``.

    A sample with reward weight ``r = 1`` is held to the teacher with strength ``kappa``, one with
    ``r = 0`` with only ``kl_floor``: high-reward samples stay close to the teacher, low-reward ones are
    free to move.

    Args:
        r: ``[B]`` reward weights in ``[0, 1]`` (:func:`reward_weights`).
        kl_coef: ``kappa >= 0``; 0 gives zero weights.
        kl_floor: the weight at ``r = 0``, in ``[0, kappa]``. Default 1e-4.

    Returns:
        ``[B]`` weights in ``r``'s dtype.
    """
    kl_coef = _check_number("kl_coef", kl_coef)
    kl_floor = _check_number("kl_floor", kl_floor)
    if kl_coef == 0.0:
        return torch.zeros_like(r)
    if kl_floor > kl_coef:
        raise ValueError(f"kl_floor must be <= kl_coef (the weight at reward 0 cannot exceed the weight at "
                         f"reward 1); received kl_floor={kl_floor!r}, kl_coef={kl_coef!r}")
    m = kl_floor / kl_coef
    return kl_coef * (m + r * (1.0 - m))


def crd_loss(
    v: Tensor,
    v_old: Tensor,
    v_ref_cfg: Tensor | None,
    target: Tensor,
    advantages: Tensor,
    group_ids: Tensor | Any,
    *,
    beta: float = 1.0,
    kl_coef: float = 0.1,
    kl_floor: float = 1e-4,
    reward_adaptive: bool = True,
    adaptive: bool = True,
    adv_clip: float = 5.0,
    implicit_group_mean: Tensor | None = None,
    reward_group_mean: Tensor | None = None,
    reduction: str = "mean",
) -> ForwardLossOutput:
    """Centered Reward Distillation (docs/trainers.md, "CRD").

    Per row ``i`` (one sample at its group's shared ``(t, eps)``), with ``r = reward_weights(A)``::

        Rc_i     = r_i - mean_{g(i)} r
        Rtheta_i = r_theta_i - stopgrad(mean_{g(i)} r_theta)          (r_theta: implicit_reward)
        policy_i = (beta Rtheta_i - Rc_i)^2 * adv_clip / beta
        kl_i     = kappa (m + r_i (1 - m)) mean_d (v_i - v_ref_cfg_i)^2,  m = kl_floor / kappa

    and the loss reduces ``policy_i + kl_i`` over rows. Centring is per prompt group, as the method states;
    the rows of a group must share ``(t, eps)`` for the prompt's normaliser to cancel (the recipe draws
    them so). ``reward_adaptive=False`` uses the constant weight ``kappa``.

    Args:
        v: ``[B, ...]`` policy velocity at ``x_t``.
        v_old: ``[B, ...]`` old-snapshot velocity (detached here).
        v_ref_cfg: ``[B, ...]`` frozen base model with classifier-free guidance (detached here), or
            ``None`` when ``kl_coef == 0``.
        target: ``[B, ...]`` ``u = eps - x0``.
        advantages: ``[B]`` group advantages.
        group_ids: ``[B]`` prompt group of each row (unused when both group means are given).
        beta: > 0, the implicit reward's inverse temperature. Default 1.0.
        kl_coef: ``kappa >= 0``. Default 0.1.
        kl_floor: KL weight at reward 0, in ``[0, kappa]``. Default 1e-4.
        reward_adaptive: weight the KL by the reward (above) or by ``kappa`` alone. Default True.
        adaptive: adaptive normalisers in the implicit reward. Default True.
        adv_clip: advantage clip inside ``r`` and the loss scale. Default 5.
        implicit_group_mean: ``[B]`` precomputed ``mean_{g(i)} r_theta`` over the whole group, for a group whose
            rows are split across calls or processes (gather ``r_theta`` detached, average per group); ``None``
            computes it from this call's rows. Pass ``reward_group_mean`` with it.
        reward_group_mean: ``[B]`` precomputed ``mean_{g(i)} r`` over the whole group (``r = reward_weights(A,
            adv_clip=adv_clip)`` of every sample of the group); required with ``implicit_group_mean`` and only
            with it. With both, the calls' ``reduction="sum"`` losses add up to the whole group's, and so do
            their gradients.
        reduction: ``"mean"`` (default) or ``"sum"`` over rows.

    Returns:
        :class:`ForwardLossOutput`; ``stats`` holds ``implicit_reward`` (mean ``r_theta``), ``kl_ref``
        (mean ``mean_d (v - v_ref_cfg)^2``, 0 without a reference) and ``reward_weight`` (mean ``r``).
        The loss is float64 (the normalisers are).
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    beta = _check_number("beta", beta, positive=True)
    adv_clip = _check_number("adv_clip", adv_clip, positive=True)
    kl_coef = _check_number("kl_coef", kl_coef)
    if kl_coef > 0 and v_ref_cfg is None:
        raise ValueError("v_ref_cfg is required when kl_coef > 0 (the KL anchor to the CFG-guided base model); "
                         "pass its velocity or set kl_coef=0")
    batch = _check_rows(v=v, v_old=v_old, v_ref_cfg=v_ref_cfg, target=target)
    advantages = _per_row("advantages", advantages, batch, v.device)
    r = reward_weights(advantages, adv_clip=adv_clip).double()

    if (implicit_group_mean is None) != (reward_group_mean is None):
        raise ValueError("implicit_group_mean and reward_group_mean go together: a group split across calls needs "
                         "both of its whole-group means (of r_theta and of the reward weights); pass both or neither")
    r_theta = implicit_reward(v, v_old, target, adaptive=adaptive)
    if implicit_group_mean is None:
        center = group_mean(r_theta.detach(), group_ids)
        r_centred = r - group_mean(r, group_ids)
    else:
        center = _per_row("implicit_group_mean", implicit_group_mean, batch, v.device).detach().double()
        r_centred = r - _per_row("reward_group_mean", reward_group_mean, batch, v.device).detach().double()
    policy = (beta * (r_theta - center) - r_centred) ** 2 * adv_clip / beta

    if v_ref_cfg is not None:
        kl = velocity_error(v, v_ref_cfg.detach())
    else:
        kl = torch.zeros(batch, dtype=_work_dtype(v), device=v.device)
    weight = reward_adaptive_kl_weight(r, kl_coef=kl_coef, kl_floor=kl_floor) if reward_adaptive else kl_coef
    kl_term = weight * kl
    loss = _reduce(policy + kl_term, reduction)
    stats = {"implicit_reward": r_theta.detach().mean(), "kl_ref": kl.detach().mean(), "reward_weight": r.mean()}
    return ForwardLossOutput(loss, _reduce(policy.detach(), reduction), _reduce(kl_term.detach(), reduction), stats)


# --------------------------------------------------------------------------------------------------
# DiffusionNFT


def nft_loss(
    v: Tensor,
    v_old: Tensor,
    v_ref: Tensor | None,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor | float,
    advantages: Tensor,
    *,
    beta: float = 1.0,
    kl_coef: float = 1e-4,
    adv_clip: float = 5.0,
    reduction: str = "mean",
) -> ForwardLossOutput:
    """DiffusionNFT's negative-aware loss (docs/trainers.md, "DiffusionNFT").

    With ``b = beta`` and ``r = reward_weights(A)``::

        v+ = b v + (1 - b) stopgrad(v_old),   v- = (1 + b) stopgrad(v_old) - b v
        x0± = x_t - t v±,   w± = stopgrad(max(mean_d |x0± - x0|, 1e-5))   (float64)
        policy_i = adv_clip * (r_i mean_d (x0+ - x0)^2 / w+ + (1 - r_i) mean_d (x0- - x0)^2 / w-) / b
        kl_i     = mean_d (v - v_ref)^2

    and the loss reduces ``policy_i + kl_coef kl_i`` over rows. Rewarded rows pull ``v`` toward the
    target velocity, unrewarded ones push it away, both relative to the old snapshot.

    Args:
        v: ``[B, ...]`` policy velocity at ``x_t``.
        v_old: ``[B, ...]`` old-snapshot velocity (detached here).
        v_ref: ``[B, ...]`` frozen reference velocity (detached here), or ``None`` when ``kl_coef == 0``.
        x_t: ``[B, ...]`` the noised sample ``(1 - t) x0 + t eps``.
        x0: ``[B, ...]`` the clean sample.
        t: noise level of each row: a float, a 0-d or a ``[B]`` tensor, in ``[0, 1]``.
        advantages: ``[B]`` group advantages.
        beta: ``b > 0``, the implicit policies' step (the paper's beta). Default 1.0.
        kl_coef: >= 0, weight of the reference term. Default 1e-4.
        adv_clip: advantage clip inside ``r`` and the loss scale. Default 5.
        reduction: ``"mean"`` (default) or ``"sum"`` over rows.

    Returns:
        :class:`ForwardLossOutput` (float64 loss); ``stats`` holds ``kl_ref``, ``old_deviation``
        (mean ``mean_d (v - v_old)^2``) and ``reward_weight`` (mean ``r``).
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    beta = _check_number("beta", beta, positive=True)
    kl_coef = _check_number("kl_coef", kl_coef)
    adv_clip = _check_number("adv_clip", adv_clip, positive=True)
    if kl_coef > 0 and v_ref is None:
        raise ValueError("v_ref is required when kl_coef > 0; pass the reference velocity or set kl_coef=0")
    batch = _check_rows(v=v, v_old=v_old, v_ref=v_ref, x_t=x_t, x0=x0)
    advantages = _per_row("advantages", advantages, batch, v.device)
    r = reward_weights(advantages, adv_clip=adv_clip).double()
    tt = _times(t, x0)
    v_old = v_old.detach()

    v_pos = beta * v + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    positive = _normalised_error(x_t - tt * v_pos, x0)
    negative = _normalised_error(x_t - tt * v_neg, x0)
    policy = (r * positive / beta + (1.0 - r) * negative / beta) * adv_clip

    if v_ref is not None:
        kl = velocity_error(v, v_ref.detach())
    else:
        kl = torch.zeros(batch, dtype=_work_dtype(v), device=v.device)
    kl_term = kl_coef * kl
    loss = _reduce(policy + kl_term, reduction)
    stats = {"kl_ref": kl.detach().mean(), "old_deviation": velocity_error(v.detach(), v_old).mean(),
             "reward_weight": r.mean()}
    return ForwardLossOutput(loss, _reduce(policy.detach(), reduction), _reduce(kl_term.detach(), reduction), stats)


# --------------------------------------------------------------------------------------------------
# AWM


def awm_log_likelihood(v: Tensor, target: Tensor, t: Tensor | float, *, weighting: str = "ghuber",
                       power: float = 0.25) -> Tensor:
    """AWM's per-row surrogate log-likelihood: minus a (time-weighted, robust) flow-matching error.

    With ``e = mean_d (v - u)^2`` (float64) and ``t`` the row's noise level:

    - ``uniform``: ``-e``;  ``t``: ``-t e``;  ``t2``: ``-t^2 e``;
    - ``huber``: ``-t (sqrt(e + 1e-10) - 1e-5)``;
    - ``ghuber``: ``-t ((e + 1e-10)^p - (1e-10)^p) / p`` with ``p = power`` (the published setting,
      ``p = 0.25``): large errors count less, so a few badly fitted rows cannot dominate the update.

    Args:
        v: ``[B, ...]`` policy velocity at ``x_t``.
        target: ``[B, ...]`` ``u = eps - x0``.
        t: noise level of each row: a float, a 0-d or a ``[B]`` tensor, in ``[0, 1]``.
        weighting: one of ``uniform``, ``t``, ``t2``, ``huber``, ``ghuber`` (default).
        power: ``p > 0`` for ``ghuber``. Default 0.25.

    Returns:
        ``[B]`` float64, differentiable w.r.t. ``v``.
    """
    _check_choice("weighting", weighting, AWM_WEIGHTINGS)
    power = _check_number("power", power, positive=True)
    _check_rows(v=v, target=target)
    tt = _times(t, v).reshape(-1).double()
    e = _row_mean((v.double() - target.double()).square())
    if weighting == "uniform":
        return -e
    if weighting == "t":
        return -e * tt
    if weighting == "t2":
        return -e * tt**2
    if weighting == "huber":
        return -(torch.sqrt(e + _HUBER_EPS) - math.sqrt(_HUBER_EPS)) * tt
    # The authors' order of operations (and their float64), so values match theirs bit for bit.
    return -(torch.pow(e + _HUBER_EPS, power) - _HUBER_EPS**power) * tt / power


def awm_loss(
    v: Tensor,
    target: Tensor,
    t: Tensor | float,
    advantages: Tensor,
    *,
    old_logp: Tensor | None = None,
    v_ref: Tensor | None = None,
    v_ema: Tensor | None = None,
    kl_coef: float = 0.0,
    ema_kl_coef: float = 0.0,
    weighting: str = "ghuber",
    power: float = 0.25,
    adv_clip: float = 5.0,
    adv_max: float = 1.0,
    clip_range: float | None = None,
    reduction: str = "mean",
) -> ForwardLossOutput:
    """Advantage Weighted Matching (docs/trainers.md, "AWM").

    With ``l = awm_log_likelihood(v, u, t)``, ``A' = clip(A, -adv_clip, adv_clip) / adv_clip * adv_max``
    and ``rho = exp(l - l_old)``, the policy term is the clipped surrogate
    ``max(-A' rho, -A' clip(rho, 1 - c, 1 + c))`` (``flowrl.core.losses.clipped_policy_loss``), or
    ``-A' rho`` when ``clip_range`` is None. On-policy (``old_logp=None``: ``l_old = stopgrad(l)``,
    ``rho = 1``) its gradient is ``A' grad(-l)``: the advantage-weighted flow-matching gradient. Added:
    ``kl_coef mean_d (v - v_ref)^2 + ema_kl_coef mean_d (v - v_ema)^2``.

    Args:
        v: ``[B, ...]`` policy velocity at ``x_t``.
        target: ``[B, ...]`` ``u = eps - x0``.
        t: noise level of each row (float, 0-d or ``[B]``), in ``[0, 1]``.
        advantages: ``[B]`` group advantages.
        old_logp: ``[B]`` ``l`` under the policy that sampled the data (off-policy updates); ``None``
            means on-policy.
        v_ref: ``[B, ...]`` frozen reference velocity (detached here); required when ``kl_coef > 0``.
        v_ema: ``[B, ...]`` EMA-snapshot velocity (detached here); required when ``ema_kl_coef > 0``.
        kl_coef: >= 0. Default 0.
        ema_kl_coef: >= 0. Default 0.
        weighting: see :func:`awm_log_likelihood`. Default ``ghuber``.
        power: ``p`` of ``ghuber``. Default 0.25.
        adv_clip: advantage clip and divisor. Default 5.
        adv_max: > 0, scale of the clipped advantage (the code's ``advantage_max``). Default 1.
        clip_range: ``c`` in ``(0, 1)`` or None (default, unclipped: the authors' ``clip_range = 1``
            never binds on-policy).
        reduction: ``"mean"`` (default) or ``"sum"`` over rows.

    Returns:
        :class:`ForwardLossOutput` (float64 loss); ``stats`` holds ``ratio``, ``clip_frac``,
        ``kl_ref`` and ``kl_ema`` (0 when the velocity is not given).
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    kl_coef = _check_number("kl_coef", kl_coef)
    ema_kl_coef = _check_number("ema_kl_coef", ema_kl_coef)
    adv_clip = _check_number("adv_clip", adv_clip, positive=True)
    adv_max = _check_number("adv_max", adv_max, positive=True)
    if clip_range is not None and not (isinstance(clip_range, (int, float)) and 0 < clip_range < 1):
        raise ValueError(f"clip_range must be a number in (0, 1) or None (no clipping); received {clip_range!r}")
    if kl_coef > 0 and v_ref is None:
        raise ValueError("v_ref is required when kl_coef > 0; pass the reference velocity or set kl_coef=0")
    if ema_kl_coef > 0 and v_ema is None:
        raise ValueError("v_ema is required when ema_kl_coef > 0; pass the EMA snapshot's velocity or set "
                         "ema_kl_coef=0")
    batch = _check_rows(v=v, target=target, v_ref=v_ref, v_ema=v_ema)
    advantages = _per_row("advantages", advantages, batch, v.device)

    logp = awm_log_likelihood(v, target, t, weighting=weighting, power=power)
    old = logp.detach() if old_logp is None else _per_row("old_logp", old_logp, batch, v.device).double()
    adv = (advantages.detach().clamp(-adv_clip, adv_clip) / adv_clip * adv_max).double()
    if clip_range is None:
        log_ratio = (logp - old.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ratio = log_ratio.exp()
        policy = _reduce(-adv * ratio, reduction)
        ratio_mean, clip_frac = ratio.detach().mean(), torch.zeros((), dtype=ratio.dtype, device=v.device)
    else:
        out = clipped_policy_loss(logp, old, adv, clip_range=float(clip_range), aggregation="token_mean")
        policy = out.loss * (batch if reduction == "sum" else 1)
        ratio_mean, clip_frac = out.ratio_mean, out.clip_frac

    zeros = torch.zeros(batch, dtype=_work_dtype(v), device=v.device)
    kl = velocity_error(v, v_ref.detach()) if v_ref is not None else zeros
    kl_ema = velocity_error(v, v_ema.detach()) if v_ema is not None else zeros
    kl_term = _reduce(kl_coef * kl + ema_kl_coef * kl_ema, reduction)
    stats = {"ratio": ratio_mean, "clip_frac": clip_frac, "kl_ref": kl.detach().mean(),
             "kl_ema": kl_ema.detach().mean()}
    return ForwardLossOutput(policy + kl_term, policy.detach(), kl_term.detach(), stats)
