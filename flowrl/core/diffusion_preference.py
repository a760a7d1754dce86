"""Preference objectives for diffusion and flow models: DGPO, Diffusion-DPO and D3PO (docs/trainers.md).

DGPO and Diffusion-DPO compare flow-matching errors ``err = mean_d (u - v)^2`` of the policy and of the
frozen reference at shared noised points (the implicit reward of DPO for diffusion is
``-beta (err_theta - err_ref)``); D3PO compares the per-step log-probabilities of stored denoising
transitions. All three reuse :func:`flowrl.core.losses.dpo_loss` where the objective is plain DPO.

Errors are ``[B]`` (compute them with :func:`flowrl.core.forward_losses.velocity_error`), log-probs are
``[B, T]`` with an optional ``[B, T]`` mask of trained steps. Reduction and normalisation choices are
explicit arguments; nothing here knows about processes or gradient accumulation.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.core.advantages import _as_group_index
from flowrl.core.losses import _apply_mask, _as_2d, _check_choice, _check_same_shape, _mask_like, dpo_loss

__all__ = [
    "D3PO_MODES",
    "DGPOOutput",
    "d3po_loss",
    "dgpo_loss",
    "diffusion_dpo_loss",
]

D3PO_MODES = ("trajectory", "per_step")


class DGPOOutput(NamedTuple):
    """The DGPO loss and what is logged with it."""

    loss: Tensor  # [] carries the graph to err
    group_weight: Tensor  # [] detached, mean over groups of sigmoid(s_g): the weight of each group's update
    clip_frac: Tensor  # [] detached, fraction of rows whose gradient the PPO-style clip removed
    implicit_acc: Tensor  # [] detached, fraction of groups with s_g < 0 (positive half preferred)


def _check_positive(name: str, value: Any) -> float:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0; received {value!r}")
    return float(value)


def _vector(name: str, x: Tensor, batch: int | None = None) -> Tensor:
    if not isinstance(x, Tensor) or x.ndim != 1 or (batch is not None and x.shape[0] != batch):
        want = f"[B] = [{batch}]" if batch is not None else "[B]"
        got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor of shape {want}; received {got}")
    return x


def dgpo_loss(
    err: Tensor,
    err_ref: Tensor,
    advantages: Tensor,
    group_ids: Tensor | Any,
    *,
    beta: float,
    adv_clip: float = 5.0,
    old_err: Tensor | None = None,
    clip_range: float | None = None,
    reduction: str = "mean",
) -> DGPOOutput:
    """Direct Group Preference Optimization (docs/trainers.md, "DGPO").

    For each group ``g`` of ``n_g`` rows (one prompt's samples at shared ``(t, eps)``), with advantages
    clipped to ``[-adv_clip, adv_clip]``::

        s_g    = beta / n_g * sum_{i in g} A_i (err_i - err_ref_i)
        loss_g = softplus(s_g) / beta = -log sigmoid(R(G+) - R(G-)) / beta

    The positive half of the group (``A > 0``) is preferred to the negative half through the
    advantage-weighted DPO implicit rewards ``-beta (err - err_ref)``. Dividing by ``beta`` makes the
    gradient, ``sigmoid(s_g) A_i grad err_i / (n_groups n_g)``, equal to that of the authors' surrogate
    ``mean_i stopgrad(sigmoid(s_g)) A_i err_i``, so their learning rate carries over.

    PPO-style clip (``clip_range`` c with ``old_err``, the fast EMA snapshot's errors): with
    ``rho_i = exp(old_err_i - err_i)``, a row with ``A_i > 0`` and ``rho_i > 1 + c`` or ``A_i <= 0`` and
    ``rho_i < 1 - c`` keeps its value in ``s_g`` but passes no gradient.

    Every group must be complete in the call (the authors all-reduce partial groups across processes;
    a recipe keeps whole groups in a micro-batch or gathers the errors first).

    Args:
        err: ``[B]`` policy flow-matching errors, differentiable.
        err_ref: ``[B]`` reference errors at the same points (detached here).
        advantages: ``[B]`` group advantages.
        group_ids: ``[B]`` prompt group of each row.
        beta: > 0, the DPO inverse temperature (the code's ``beta_dpo``).
        adv_clip: > 0. Default 5.
        old_err: ``[B]`` errors of the snapshot that bounds the update; required with ``clip_range``.
        clip_range: ``c > 0`` or None (default, no clip).
        reduction: ``"mean"`` (default, over groups) or ``"sum"`` (over groups; divide by the global
            group count in the recipe).

    Returns:
        :class:`DGPOOutput`.
    """
    _check_choice("reduction", reduction, ("mean", "sum"))
    beta = _check_positive("beta", beta)
    adv_clip = _check_positive("adv_clip", adv_clip)
    batch = _vector("err", err).shape[0]
    _vector("err_ref", err_ref, batch)
    _vector("advantages", advantages, batch)
    dtype = torch.promote_types(err.dtype, torch.float32)
    err_ref = err_ref.detach().to(dtype)
    adv = advantages.detach().to(dtype).clamp(-adv_clip, adv_clip)

    clipped = torch.zeros(batch, dtype=torch.bool, device=err.device)
    if clip_range is not None:
        clip_range = _check_positive("clip_range", clip_range)
        if old_err is None:
            raise ValueError("old_err is required with clip_range (the errors of the snapshot the ratio is "
                             "taken against); pass it or set clip_range=None")
        _vector("old_err", old_err, batch)
        with torch.no_grad():
            ratio = torch.exp(old_err.detach().to(dtype) - err.detach().to(dtype))
            clipped = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    used = torch.where(clipped, err.detach(), err).to(dtype)

    inverse, n = _as_group_index(group_ids, batch, err.device)
    counts = torch.zeros(n, dtype=dtype, device=err.device).index_add(0, inverse, torch.ones_like(adv))
    # The authors' per-row term (advantage * beta * delta / group size), then the per-group sum.
    term = adv * beta * (used - err_ref) / counts[inverse]
    s = torch.zeros(n, dtype=dtype, device=err.device).index_add(0, inverse, term)
    per_group = F.softplus(s) / beta
    loss = per_group.mean() if reduction == "mean" else per_group.sum()
    with torch.no_grad():
        weight = torch.sigmoid(s).mean()
        acc = (s < 0).to(dtype).mean()
    return DGPOOutput(loss, weight, clipped.to(dtype).mean(), acc)


def diffusion_dpo_loss(
    err_chosen: Tensor,
    err_rejected: Tensor,
    err_ref_chosen: Tensor,
    err_ref_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Diffusion-DPO per pair: :func:`~flowrl.core.losses.dpo_loss` with ``Delta = -(err - err_ref)``.

    ``-log sigmoid(beta (Delta_w - Delta_l))``; the chosen and rejected images must be noised with the
    same ``(t, eps)``. The authors write ``-log sigmoid(-0.5 beta_dpo ((e_w - e_l) - (e_ref_w - e_ref_l)))``
    on epsilon errors: flowrl's ``beta`` is their ``beta_dpo / 2``, and on velocity errors ``beta`` also
    absorbs the factor ``(1 - t)^2`` between epsilon and velocity errors (docs/trainers.md).

    Args:
        err_chosen: ``[B]`` policy error ``mean_d (u - v)^2`` on the chosen image, differentiable.
        err_rejected: ``[B]`` the same for the rejected image (same ``t`` and ``eps``).
        err_ref_chosen: ``[B]`` reference error on the chosen image (detached here).
        err_ref_rejected: ``[B]`` reference error on the rejected image (detached here).
        beta: > 0.
        label_smoothing: conservative DPO's ``e`` in ``[0, 0.5]``. Default 0.

    Returns:
        ``[B]`` per-pair losses.
    """
    _check_same_shape(err_chosen=err_chosen, err_rejected=err_rejected, err_ref_chosen=err_ref_chosen,
                      err_ref_rejected=err_ref_rejected)
    _vector("err_chosen", err_chosen)
    delta_chosen = -(err_chosen - err_ref_chosen.detach())
    delta_rejected = -(err_rejected - err_ref_rejected.detach())
    return dpo_loss(delta_chosen, delta_rejected, beta=beta, label_smoothing=label_smoothing)


def d3po_loss(
    logp_chosen: Tensor,
    logp_ref_chosen: Tensor,
    logp_rejected: Tensor,
    logp_ref_rejected: Tensor,
    mask: Tensor | None = None,
    *,
    beta: float,
    mode: str = "trajectory",
    ratio_clip: float | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """D3PO per pair, from per-step log-probs of the stored denoising transitions.

    With per-step log-ratios ``d_t = logp_t - logp_ref_t`` (``ratio_clip`` eps clamps each to
    ``[log(1 - eps), log(1 + eps)]``, i.e. the ratio to ``[1 - eps, 1 + eps]``, with zero gradient outside):

    - ``trajectory`` (default, flowrl's definition): ``Delta = sum_t m_t d_t`` over the trained steps,
      then ``dpo_loss(Delta_w, Delta_l)``.
    - ``per_step`` (the authors' code): ``mean_t`` over trained steps of ``dpo_loss(d_w,t, d_l,t)``.

    The pair's two trajectories share the step indexing (the same schedule); ``mask`` marks the trained
    steps of both. Use the log-prob reduction the ``beta`` was tuned for (the authors average over ``D``:
    ``reduction="mean"``).

    Args:
        logp_chosen: ``[B, T]`` (or ``[B]``) policy log-probs of the preferred trajectory, differentiable.
        logp_ref_chosen: same shape, reference log-probs (detached here).
        logp_rejected: same shape, policy log-probs of the other trajectory.
        logp_ref_rejected: same shape, reference log-probs (detached here).
        mask: ``[B, T]`` bool or float mask of trained steps, or None for all.
        beta: > 0.
        mode: ``"trajectory"`` or ``"per_step"``.
        ratio_clip: ``eps`` in ``(0, 1)`` or None (default, no clamp).
        label_smoothing: conservative DPO's ``e`` in ``[0, 0.5]``. Default 0.

    Returns:
        ``[B]`` per-pair losses.
    """
    _check_choice("mode", mode, D3PO_MODES)
    _check_same_shape(logp_chosen=logp_chosen, logp_ref_chosen=logp_ref_chosen, logp_rejected=logp_rejected,
                      logp_ref_rejected=logp_ref_rejected)
    if ratio_clip is not None and not (isinstance(ratio_clip, (int, float)) and 0 < ratio_clip < 1):
        raise ValueError(f"ratio_clip must be a number in (0, 1) or None; received {ratio_clip!r}")
    dtype = torch.promote_types(logp_chosen.dtype, torch.float32)
    d_w = (_as_2d(logp_chosen, "logp_chosen").to(dtype) - _as_2d(logp_ref_chosen, "logp_ref_chosen").detach().to(dtype))
    d_l = (_as_2d(logp_rejected, "logp_rejected").to(dtype)
           - _as_2d(logp_ref_rejected, "logp_ref_rejected").detach().to(dtype))
    m = _mask_like(mask, d_w)
    if ratio_clip is not None:
        d_w = d_w.clamp(math.log1p(-ratio_clip), math.log1p(ratio_clip))
        d_l = d_l.clamp(math.log1p(-ratio_clip), math.log1p(ratio_clip))
    # Masked steps may hold -inf or NaN log-probs: zero them before they reach a sum or a gradient.
    d_w = torch.where(m != 0, d_w, torch.zeros_like(d_w))
    d_l = torch.where(m != 0, d_l, torch.zeros_like(d_l))
    if mode == "trajectory":
        return dpo_loss(_apply_mask(d_w, m).sum(dim=1), _apply_mask(d_l, m).sum(dim=1), beta=beta,
                        label_smoothing=label_smoothing)
    per_step = dpo_loss(d_w, d_l, beta=beta, label_smoothing=label_smoothing)
    counts = m.sum(dim=1)
    per_pair = _apply_mask(per_step, m).sum(dim=1) / counts.clamp(min=torch.finfo(m.dtype).tiny)
    return torch.where(counts > 0, per_pair, torch.zeros_like(per_pair))
