"""Policy, KL and preference losses (docs/algorithms.md, sections 5, 6 and 7).

All functions are pure and modality-agnostic: log-probs are ``[B, T]`` with a ``[B, T]`` mask, where T is
the trained denoising steps for images and the tokens (or turns) for language. Reductions are explicit
arguments; world size and gradient accumulation never enter (a recipe that accumulates over
micro-batches weights them itself, e.g. by token counts for ``token_mean``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "KL_KINDS",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "LossOutput",
    "aggregate",
    "clipped_policy_loss",
    "dpo_loss",
    "dppo_policy_loss",
    "gaussian_kl",
    "ipo_loss",
    "kl_estimate",
    "ratio_norm_policy_loss",
    "simpo_loss",
]

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KL_KINDS = ("k1", "k2", "k3")
# Log-ratios are clamped before exponentiating so that one wild sample cannot overflow float32
# (exp(20) ~ 4.9e8); beyond the clamp the gradient is zero, which the clipped loss ignores anyway.
LOG_RATIO_CLAMP = 20.0

POLICY_LOSSES: Registry = Registry("policy loss")
PREFERENCE_LOSSES: Registry = Registry("preference loss")


class LossOutput(NamedTuple):
    """A policy loss and the diagnostics logged with it (docs/algorithms.md, section 5)."""

    loss: Tensor  # [] scalar, carries the graph to logp
    ratio_mean: Tensor  # [] detached, masked token mean of rho = exp(logp - old_logp)
    clip_frac: Tensor  # [] detached, fraction of unmasked elements where a clip changed the objective
    approx_kl: Tensor  # [] detached, masked token mean of (rho - 1) - log rho  (KL(old || new) estimate)


# --------------------------------------------------------------------------------------------------
# helpers


def _as_2d(x: Tensor, name: str) -> Tensor:
    if x.ndim == 1:
        return x.unsqueeze(1)
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape [B, T] or [B]; received {tuple(x.shape)}")
    return x


def _mask_like(mask: Tensor | None, values: Tensor, name: str = "mask") -> Tensor:
    """``mask`` as a float tensor shaped like ``values`` (``[B, T]``); ``None`` means all ones."""
    if mask is None:
        return torch.ones_like(values)
    if mask.ndim == 1 and values.shape[1] == 1:
        mask = mask.unsqueeze(1)
    if tuple(mask.shape) != tuple(values.shape):
        raise ValueError(f"{name} must have shape {list(values.shape)} (like the values); received {list(mask.shape)}")
    return mask.to(device=values.device, dtype=values.dtype)


def _apply_mask(x: Tensor, m: Tensor) -> Tensor:
    # where, not only x * m: padding positions may hold NaN or inf (e.g. -inf log-probs), and NaN * 0 = NaN.
    return torch.where(m != 0, x * m, torch.zeros_like(x))


def _masked_token_mean(x: Tensor, m: Tensor) -> Tensor:
    # The clamp turns an all-masked batch into 0 / tiny = 0 instead of 0 / 0, keeping the graph.
    return _apply_mask(x, m).sum() / m.sum().clamp(min=torch.finfo(m.dtype).tiny)


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}; received {value!r}")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"{', '.join(shapes)} must have the same shape; received {shapes}")


def _check_positive(name: str, value: Any) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a number > 0; received {value!r}")


def _check_clip_ranges(clip_range: Any, clip_range_high: Any, dual_clip: Any) -> float:
    """Validate PPO's clip arguments; returns ``clip_range_high`` (``None`` means ``clip_range``)."""
    if not (isinstance(clip_range, (int, float)) and 0.0 <= clip_range < 1.0):
        raise ValueError(f"clip_range must be a number in [0, 1); received {clip_range!r}")
    if clip_range_high is None:
        clip_range_high = clip_range
    if not (isinstance(clip_range_high, (int, float)) and clip_range_high >= 0.0):
        raise ValueError(f"clip_range_high must be a number >= 0 or None (= clip_range); received {clip_range_high!r}")
    if dual_clip is not None and not (isinstance(dual_clip, (int, float)) and dual_clip > 1.0):
        raise ValueError(f"dual_clip must be a number > 1 or None to disable; received {dual_clip!r}")
    return clip_range_high


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_range: float, clip_range_high: float,
                       dual_clip: float | None) -> tuple[Tensor, Tensor]:
    """Per element ``max(-A rho, -A clip(rho, 1 - clip_range, 1 + clip_range_high))`` (dual clip: for ``A < 0`` at most
    ``-A c``) and where a clip changed the objective."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range_high)
    # torch.where instead of max: the clipped branch is exactly constant, and ties get the plain gradient.
    is_clipped = clipped > unclipped
    loss = torch.where(is_clipped, clipped.detach(), unclipped)
    if dual_clip is not None:
        cap = -adv * dual_clip
        is_dual = (adv < 0) & (loss > cap)
        loss = torch.where(is_dual, cap, loss)
        is_clipped = is_clipped | is_dual
    return loss, is_clipped


# --------------------------------------------------------------------------------------------------
# aggregation


def aggregate(values: Tensor, mask: Tensor | None, mode: str) -> Tensor:
    """Reduce a per-element loss ``L [B, T]`` with mask ``m [B, T]`` to a scalar.

    Modes (docs/algorithms.md, section 5):

    - ``token_mean``: ``sum(L m) / sum(m)``; every unmasked element weighs the same (DAPO).
    - ``seq_mean_token_mean``: the mean over samples of each sample's masked mean (original GRPO).
      Samples whose mask is all zero are left out of the mean over samples.
    - ``seq_mean_token_sum``: the mean over all ``B`` samples of each sample's masked sum.
    - ``seq_mean_token_sum_norm``: ``sum(L m) / (B * T_max)`` (Dr.GRPO). ``T_max`` is taken to be
      ``values.shape[1]``, the padded length of this batch, not a global maximum length: the constant
      only rescales the loss (like a learning-rate factor), and this choice needs no extra argument.
      For denoising, T is the number of trained steps.

    A float mask acts as per-element weights. Masked elements are ignored even if they hold NaN or inf.
    An all-zero mask gives 0 (still attached to the graph, so ``backward`` works and yields zero
    gradients), never NaN.

    Args:
        values: ``[B, T]`` per-element losses (``[B]`` is treated as ``T = 1``).
        mask: ``[B, T]`` bool or float mask, or ``None`` for all ones.
        mode: one of the four modes above.

    Returns:
        ``[]`` scalar.
    """
    _check_choice("mode", mode, AGGREGATIONS)
    values = _as_2d(values, "values")
    m = _mask_like(mask, values)
    masked = _apply_mask(values, m)
    if mode == "token_mean":
        return _masked_token_mean(values, m)
    if mode == "seq_mean_token_sum":
        return masked.sum(dim=1).mean()
    if mode == "seq_mean_token_sum_norm":
        return masked.sum() / (values.shape[0] * values.shape[1])
    counts = m.sum(dim=1)
    valid = counts > 0
    per_sample = masked.sum(dim=1) / counts.clamp(min=torch.finfo(m.dtype).tiny)
    per_sample = torch.where(valid, per_sample, torch.zeros_like(per_sample))
    return per_sample.sum() / valid.sum().clamp(min=1)


# --------------------------------------------------------------------------------------------------
# clipped policy loss


def clipped_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    clip_range: float,
    clip_range_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
) -> LossOutput:
    """PPO/GRPO clipped surrogate with optional clip-higher (DAPO) and dual clip.

    Per element, with ``rho = exp(clamp(logp - old_logp, -20, 20))``:
    ``L = max(-A rho, -A clip(rho, 1 - clip_range, 1 + clip_range_high))``; with dual clip ``c > 1``, for ``A < 0``
    ``L = min(L, -A c)``. ``L`` is then reduced with :func:`aggregate`.

    Where a clip is active the element's loss is a constant, so its gradient is exactly zero; elsewhere
    the gradient is that of ``-A rho``. ``old_logp`` and ``advantages`` are detached. The math runs in at
    least float32 (bf16 log-probs are upcast), and masked positions never reach the loss or the gradient,
    even if their log-probs are ``-inf`` or NaN.

    Diagnostics (detached, always masked token means whatever ``aggregation`` is): ``ratio_mean``,
    ``clip_frac`` (elements where the clipped branch or the dual clip changed the objective; 0 if the
    ratio is inside the range or the clip would only have increased the loss), and
    ``approx_kl = mean((rho - 1) - log rho)`` (the k3 estimate of KL(old || new), >= 0). With an all-zero
    mask all three are 0.

    Args:
        logp: ``[B, T]`` (or ``[B]``, treated as ``T = 1``) log-probs under the current policy.
        old_logp: same shape, log-probs under the policy that generated the samples.
        advantages: ``[B]`` (broadcast over T) or ``[B, T]``.
        mask: ``[B, T]`` bool or float (``[B]`` when ``logp`` is ``[B]``); ``None`` = all ones.
        clip_range: lower clip range, ``rho >= 1 - clip_range``; in ``[0, 1)``.
        clip_range_high: upper clip range, ``rho <= 1 + clip_range_high``; ``None`` means ``clip_range``. DAPO's
            clip-higher uses ``clip_range_high > clip_range``.
        dual_clip: ``c > 1`` caps the loss of negative-advantage elements at ``-A c``; ``None`` disables.
        aggregation: see :func:`aggregate`. Default ``"token_mean"``.

    Returns:
        :class:`LossOutput`.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    clip_range_high = _check_clip_ranges(clip_range, clip_range_high, dual_clip)
    logp2 = _as_2d(logp, "logp")
    if tuple(old_logp.shape) != tuple(logp.shape):
        raise ValueError(
            f"old_logp must have the shape of logp {list(logp.shape)}; received {list(old_logp.shape)}"
        )
    # bf16 would round exp(logp - old_logp) to ~1e-2, coarser than clip ranges like 1e-3: use >= float32.
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp2 = logp2.to(dtype)
    old2 = _as_2d(old_logp, "old_logp").detach().to(dtype)
    B, T = logp2.shape
    adv = advantages.detach()
    if adv.ndim == 1 and adv.shape[0] == B:
        adv = adv.unsqueeze(1)
    elif not (adv.ndim == 2 and tuple(adv.shape) == (B, T)):
        raise ValueError(
            f"advantages must have shape [B] = [{B}] or [B, T] = [{B}, {T}]; received {list(advantages.shape)}"
        )
    adv = adv.to(dtype=logp2.dtype).expand(B, T)
    m = _mask_like(mask, logp2)

    log_ratio = (logp2 - old2).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # Zero the log-ratio at masked (padding) positions so that -inf or NaN there cannot reach the
    # gradient through exp.
    log_ratio = torch.where(m != 0, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    loss, is_clipped = _clipped_surrogate(ratio, adv, clip_range, clip_range_high, dual_clip)

    with torch.no_grad():
        ratio_mean = _masked_token_mean(ratio, m)
        clip_frac = _masked_token_mean(is_clipped.to(m.dtype), m)
        approx_kl = _masked_token_mean((ratio - 1.0) - log_ratio, m)
    return LossOutput(aggregate(loss, m, aggregation), ratio_mean, clip_frac, approx_kl)


POLICY_LOSSES.register("clipped", clipped_policy_loss)


# --------------------------------------------------------------------------------------------------
# policy losses of one Gaussian denoising step (docs/algorithms.md, section 5)
#
# Both variants know that a stochastic step's policy is a Gaussian N(mean, std^2 I) whose std does not
# depend on the weights, so the old and the new transition differ only by their means and their KL is
# exact: ||mean - old_mean||^2 / (2 std^2) (gaussian_kl). One row is one (sample, step) pair.


def _positive(x: Tensor, message: str) -> Tensor:
    """``x``, checked to be > 0 everywhere.

    On the CPU a non-positive entry raises ``ValueError(message)``. On an accelerator the check would be a blocking
    device-to-host read per call (per training pass), so it is made on the device instead: non-positive entries
    become NaN, the loss is NaN, and the guarded optimizer step (:func:`flowrl.run.updates.optimizer_step`) skips
    the update and counts it. Positive entries are returned unchanged.
    """
    if x.device.type == "cpu":
        if not bool((x > 0).all()):
            raise ValueError(message)
        return x
    return torch.where(x > 0, x, torch.full_like(x, float("nan")))


def _per_row_value(name: str, value: float | Tensor, logp: Tensor) -> Tensor:
    """A float or one value per row (``[B]`` or ``[B, 1, ...]``) as ``[B]`` in ``logp``'s working dtype."""
    batch = logp.shape[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        # Filled in on the device (no host-to-device copy); torch.full infers the dtype as as_tensor does.
        x = torch.full((), value, device=logp.device)
    else:
        x = torch.as_tensor(value, device=logp.device)
    x = x.to(torch.promote_types(logp.dtype, torch.float32))
    if x.numel() == 1:
        return x.reshape(1).expand(batch)
    if x.numel() == batch and all(n == 1 for n in x.shape[1:]):
        return x.reshape(batch)
    raise ValueError(f"{name} must be a float or hold one value per row ([B] or [B, 1, ...] with B = {batch}); "
                     f"received shape {list(x.shape)}")


def _step_rows(logp: Tensor, old_logp: Tensor, advantages: Tensor, mean: Tensor, old_mean: Tensor,
               std: float | Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Checked ``[B]`` log-probs, advantages and std and ``[B, ...]`` means, in at least float32."""
    if logp.ndim != 1:
        raise ValueError(f"logp must have shape [B] (one row per sample and step); received {list(logp.shape)}")
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages)
    _check_same_shape(mean=mean, old_mean=old_mean)
    if mean.ndim < 1 or mean.shape[0] != logp.shape[0]:
        raise ValueError(f"mean must have shape [B, ...] with B = {logp.shape[0]}; received {list(mean.shape)}")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    s = _positive(_per_row_value("std", std, logp),
                  "std must be > 0: these losses need a stochastic step (an ODE step has no policy ratio)")
    return (logp.to(dtype), old_logp.detach().to(dtype), advantages.detach().to(dtype), mean.to(dtype),
            old_mean.detach().to(dtype), s)


def ratio_norm_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    std: float | Tensor,
    dt: float | Tensor,
    *,
    clip_range: float,
    clip_range_high: float | None = None,
    dual_clip: float | None = None,
    reduction: str = "mean",
) -> LossOutput:
    """GRPO-Guard's clipped surrogate with RatioNorm and its per-step gradient reweighting.

    Per row ``i`` (one sample at one denoising step), with ``kl_i = gaussian_kl(mean, old_mean, std)`` (the
    exact KL between the old and the new transition, differentiable through ``mean``)::

        log_rho_norm_i = (logp_i - old_logp_i + kl_i) * std_i
        L_i            = max(-A_i rho_i, -A_i clip(rho_i, 1 - clip_range, 1 + clip_range_high)) / |dt_i|,
                         rho_i = exp(log_rho_norm_i)

    and the loss is ``mean_i L_i``. Adding ``kl`` centres the log-ratio (its mean over the old transition's
    samples is ``-kl``) and multiplying by ``std`` makes its spread the same at every step (for a Gaussian
    step ``log_rho_norm = mean_d((x_next - old_mean) (mean - old_mean)) / std`` with ``mean`` reduction);
    dividing by ``|dt|`` evens the steps' gradient sizes. Source and departures: docs/algorithms.md,
    section 5 ("RatioNorm").

    Args:
        logp: ``[B]`` log-probs of the stored transitions under the current policy (``reduction`` as below).
        old_logp: ``[B]`` the same under the policy that sampled them.
        advantages: ``[B]``.
        mean: ``[B, ...]`` the current policy's transition mean.
        old_mean: ``[B, ...]`` the sampling policy's transition mean (recorded at rollout).
        std: the transition's per-element std: a float or one value per row (``[B]`` or ``[B, 1, ...]``), > 0.
        dt: the step length ``sigma_t - sigma_{t+1}`` (its sign is ignored): a float or ``[B]``, != 0.
            (Both checked on the CPU; on an accelerator a violation makes the loss NaN instead, see ``_positive``.)
        clip_range / clip_range_high / dual_clip: as :func:`clipped_policy_loss`, applied to the normalised ratio.
        reduction: the reduction of the log-probs (``mean``: divided by ``D``, Flow-GRPO's and GRPO-Guard's;
            ``sum``), used for ``kl`` too.

    Returns:
        :class:`LossOutput`; ``ratio_mean`` and ``clip_frac`` are of the normalised ratio, ``approx_kl`` the
        k3 estimate from the raw ratio ``exp(logp - old_logp)``.
    """
    _check_choice("reduction", reduction, ("mean", "sum"))
    clip_range_high = _check_clip_ranges(clip_range, clip_range_high, dual_clip)
    logp, old_logp, adv, mean, old_mean, s = _step_rows(logp, old_logp, advantages, mean, old_mean, std)
    step = _positive(_per_row_value("dt", dt, logp).abs(),
                     "dt must be non-zero (the step length sigma_t - sigma_{t+1})")
    bias = gaussian_kl(mean, old_mean, s, reduction=reduction)  # the ratio's mean bias: KL(old || new)
    raw = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = ((logp - old_logp + bias) * s).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    elems, is_clipped = _clipped_surrogate(ratio, adv, clip_range, clip_range_high, dual_clip)
    loss = (elems / step).mean()
    with torch.no_grad():
        approx_kl = (torch.expm1(raw) - raw).mean()
        return LossOutput(loss, ratio.mean(), is_clipped.to(logp.dtype).mean(), approx_kl)


def dppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    std: float | Tensor,
    *,
    threshold: float,
    reduction: str = "mean",
) -> LossOutput:
    """Flow-DPPO's surrogate: no ratio clip, a divergence mask instead.

    Per row ``i`` with ``rho_i = exp(logp_i - old_logp_i)`` and ``kl_i = gaussian_kl(mean, old_mean, std)``
    (the exact KL between the old and the new transition, no gradient)::

        drop_i = kl_i >= threshold  and  ((rho_i > 1 and A_i > 0) or (rho_i < 1 and A_i < 0))
        L_i    = 0 if drop_i else -A_i rho_i

    and the loss is ``mean_i L_i``. A row is masked only when the policy has moved far from the sampling
    policy *and* keeps moving in the direction its advantage pushes; a corrective move (e.g. ``A > 0``,
    ``rho < 1``) always passes. Source: docs/algorithms.md, section 5 ("Flow-DPPO").

    Args:
        logp / old_logp / advantages / mean / old_mean / std: as :func:`ratio_norm_policy_loss`.
        threshold: ``> 0``, the KL (in ``reduction`` units: per element with ``mean``) beyond which the
            mask applies.
        reduction: the log-probs' reduction, used for ``kl`` too.

    Returns:
        :class:`LossOutput`; ``clip_frac`` is the fraction of masked rows.
    """
    _check_choice("reduction", reduction, ("mean", "sum"))
    _check_positive("threshold", threshold)
    logp, old_logp, adv, mean, old_mean, s = _step_rows(logp, old_logp, advantages, mean, old_mean, std)
    with torch.no_grad():
        kl = gaussian_kl(mean.detach(), old_mean, s, reduction=reduction)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    drop = (kl >= threshold) & (((ratio > 1.0) & (adv > 0)) | ((ratio < 1.0) & (adv < 0)))
    # where, not a product: an overflowing ratio times a zero mask would be NaN.
    loss = torch.where(drop, torch.zeros_like(ratio), -adv * ratio).mean()
    if s.device.type != "cpu":  # std enters only the mask: a NaN-marked std (see _positive) must still show
        loss = torch.where(torch.isnan(s).any(), torch.full_like(loss, float("nan")), loss)
    with torch.no_grad():
        approx_kl = (torch.expm1(log_ratio) - log_ratio).mean()
        return LossOutput(loss, ratio.mean(), drop.to(logp.dtype).mean(), approx_kl)


POLICY_LOSSES.register("grpo_guard", ratio_norm_policy_loss)
POLICY_LOSSES.register("flow_dppo", dppo_policy_loss)


# --------------------------------------------------------------------------------------------------
# KL


def kl_estimate(logp: Tensor, logp_ref: Tensor, kind: str) -> Tensor:
    """Element-wise sample estimators of KL(pi || ref) from log-probs of samples drawn from pi.

    With ``delta = logp - logp_ref`` (docs/algorithms.md, section 6): ``k1 = delta`` (unbiased, can be negative),
    ``k2 = delta^2 / 2`` and ``k3 = exp(-delta) - 1 + delta`` (unbiased and >= 0). For k3, ``delta`` is
    clamped to ``[-20, 20]`` before exponentiating (as the policy ratio is), so it stays finite in
    float32; outside that range its gradient is zero. Reduce the result with :func:`aggregate`; whether
    it goes into the reward or the loss is the recipe's choice.

    Args:
        logp: ``[...]`` log-probs under the policy.
        logp_ref: same shape, under the reference policy.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        Tensor shaped like ``logp``.
    """
    _check_choice("kind", kind, KL_KINDS)
    _check_same_shape(logp=logp, logp_ref=logp_ref)
    delta = logp - logp_ref
    if kind == "k1":
        return delta
    if kind == "k2":
        return 0.5 * delta * delta
    delta = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.expm1(-delta) + delta


def gaussian_kl(mean: Tensor, mean_ref: Tensor, std: float | Tensor, *, reduction: str = "mean") -> Tensor:
    """KL between two Gaussian steps with the same std: ``||mean - mean_ref||^2 / (2 std^2)``.

    The squared difference over the non-batch elements is summed (``reduction="sum"``, the exact KL of
    the ``D``-dimensional Gaussians) or averaged (``"mean"``, divided by ``D``, matching a log-prob
    computed with ``reduction="mean"``). Use the same reduction as the log-probs.

    Carrying Flow-GRPO's beta over: Flow-GRPO divides by ``g_t^2`` (the value its step function returns)
    instead of the transition variance ``std^2 = g_t^2 |dt|``, so its KL is flowrl's KL times ``|dt|``.
    The same penalty therefore needs ``beta_flowrl = beta_flowgrpo * |dt|`` (e.g. 10 uniform steps,
    ``|dt| = 0.1``: Flow-GRPO's ``beta = 0.04`` becomes 0.004). With a non-uniform schedule ``|dt|`` varies
    by step, so no single beta matches exactly: the Flow-GRPO recipe's ``train.kl_coef_units=flow_grpo``
    applies ``beta |dt_t|`` per step (docs/algorithms.md, section 6), or pass ``std = g_t`` here instead of the
    transition std. Mean reduction corresponds to Flow-GRPO's ``mean`` over ``(C, H, W)``.

    Args:
        mean: ``[B, ...]`` mean of the policy's transition.
        mean_ref: same shape, mean of the reference's transition at the same state.
        std: the shared per-element std: a float, a ``[B]`` tensor (one std per sample, broadcast over
            the other dims), or a tensor broadcastable to ``mean``. Must be > 0 (checked on the CPU; on an
            accelerator a non-positive std gives a NaN KL instead of an error, see ``_positive``).
        reduction: ``"mean"`` (default) or ``"sum"`` over the non-batch elements.

    Returns:
        ``[B]`` KL per sample (differentiable w.r.t. ``mean``; ``mean_ref`` is not detached, detach it or
        compute it under ``no_grad``).
    """
    _check_choice("reduction", reduction, ("mean", "sum"))
    _check_same_shape(mean=mean, mean_ref=mean_ref)
    if mean.ndim < 1:
        raise ValueError(f"mean must have a batch dimension [B, ...]; received shape {tuple(mean.shape)}")
    if isinstance(std, Tensor):
        if std.ndim == 1 and mean.ndim > 1 and std.shape[0] == mean.shape[0]:
            std = std.reshape(-1, *([1] * (mean.ndim - 1)))
        try:
            ok = torch.broadcast_shapes(std.shape, mean.shape) == mean.shape
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"std must be a float, a [B] = [{mean.shape[0]}] tensor or broadcastable to mean "
                f"{list(mean.shape)}; received shape {list(std.shape)}"
            )
        std = _positive(std, "std must be > 0 everywhere; received a tensor with non-positive entries")
    else:
        _check_positive("std", std)
    per_elem = (mean - mean_ref) ** 2 / (2.0 * std**2)
    flat = per_elem.reshape(mean.shape[0], -1)
    return flat.mean(dim=1) if reduction == "mean" else flat.sum(dim=1)


# --------------------------------------------------------------------------------------------------
# preference losses


def dpo_loss(delta_chosen: Tensor, delta_rejected: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO, optionally conservative (label smoothing), per pair.

    With ``z = Delta_w - Delta_l`` and ``Delta = log pi(y) - log pi_ref(y)``:
    ``-(1 - e) log sigmoid(beta z) - e log sigmoid(-beta z)``. For diffusion, D3PO passes the trajectory
    sum of per-step log-ratios as ``Delta``; Diffusion-DPO passes ``-(err_theta - err_ref)``.

    Args:
        delta_chosen: ``[B]`` policy-minus-reference log-prob of the chosen sample.
        delta_rejected: ``[B]`` the same for the rejected sample.
        beta: inverse temperature, > 0.
        label_smoothing: ``e`` in ``[0, 0.5]``, the assumed probability that a label is flipped. Default 0.

    Returns:
        ``[B]`` per-pair losses.
    """
    _check_positive("beta", beta)
    if not (isinstance(label_smoothing, (int, float)) and 0.0 <= label_smoothing <= 0.5):
        raise ValueError(f"label_smoothing must be a number in [0, 0.5]; received {label_smoothing!r}")
    _check_same_shape(delta_chosen=delta_chosen, delta_rejected=delta_rejected)
    logits = beta * (delta_chosen - delta_rejected)
    loss = -F.logsigmoid(logits)
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-logits)
    return loss


def ipo_loss(delta_chosen: Tensor, delta_rejected: Tensor, *, beta: float) -> Tensor:
    """IPO per pair: ``(Delta_w - Delta_l - 1 / (2 beta))^2``.

    Args:
        delta_chosen: ``[B]`` policy-minus-reference log-prob of the chosen sample.
        delta_rejected: ``[B]`` the same for the rejected sample.
        beta: regularisation strength, > 0 (the target margin is ``1 / (2 beta)``).

    Returns:
        ``[B]`` per-pair losses.
    """
    _check_positive("beta", beta)
    _check_same_shape(delta_chosen=delta_chosen, delta_rejected=delta_rejected)
    return (delta_chosen - delta_rejected - 1.0 / (2.0 * beta)) ** 2


def simpo_loss(avg_logp_chosen: Tensor, avg_logp_rejected: Tensor, *, beta: float, gamma: float) -> Tensor:
    """SimPO per pair (no reference model): ``-log sigmoid(beta (mean_logp_w - mean_logp_l) - gamma)``.

    Args:
        avg_logp_chosen: ``[B]`` length-averaged log-prob of the chosen sample (the masked mean of its
            token log-probs, or of its per-step log-probs for a trajectory).
        avg_logp_rejected: ``[B]`` the same for the rejected sample.
        beta: reward scale, > 0.
        gamma: target reward margin (the paper's ``gamma``, not ``gamma / beta``).

    Returns:
        ``[B]`` per-pair losses.
    """
    _check_positive("beta", beta)
    _check_same_shape(avg_logp_chosen=avg_logp_chosen, avg_logp_rejected=avg_logp_rejected)
    return -F.logsigmoid(beta * (avg_logp_chosen - avg_logp_rejected) - gamma)


PREFERENCE_LOSSES.register("dpo", dpo_loss)
PREFERENCE_LOSSES.register("ipo", ipo_loss)
PREFERENCE_LOSSES.register("simpo", simpo_loss)
