"""Pure denoising steps with exact Gaussian log-probabilities (docs/algorithms.md, section 2).

Every step maps the state ``x`` at ``sigma`` to ``x_next`` at ``sigma_next < sigma`` given the model's
velocity ``v`` (``v = eps - x0``, docs/algorithms.md, section 1) and returns ``StepOutput(x_next, log_prob, mean,
std)``. Conventions shared by all functions in this module:

* **float32 math.** ``v``, ``x`` (and a given ``x_next``) are cast to float32 first, whatever their
  dtype (bf16 model outputs included); every returned tensor is float32. The caller casts ``x_next``
  back to the model dtype if it wants to.
* **Times** ``sigma`` / ``sigma_next`` (and noise scales) are Python floats, 0-d tensors or ``[B]``
  tensors (one value per row, so rows at different steps can share a call). Floats cost no host/device
  traffic (they are filled in on ``x``'s device), which is why ``Step`` passes its schedule's constants as
  floats: a step on a GPU then never waits for a host-to-device copy.
* **Randomness** only from ``noise=`` (a standard-normal tensor shaped like ``x``) or ``generator=``;
  never from the global RNG. Passing ``x_next=`` scores that stored transition instead of sampling:
  the mean is recomputed from ``(v, x)`` and ``log_prob = log N(x_next; mean, std^2)``. Sampling
  computes its log-prob from the sampled ``x_next`` by the very same code, so re-scoring a stored
  transition with the same inputs returns the stored log-prob bit for bit (on-policy ratio exactly 1).
* **Deterministic steps** (std = 0: the Euler step, or any SDE step with noise scale 0) return
  ``x_next = mean`` and ``log_prob = 0`` (not NaN); a zero noise scale reproduces the Euler step.
* ``reduction="mean"`` divides the summed log-density by ``D`` (Flow-GRPO's convention, which its clip
  ranges assume); ``"sum"`` is the exact density of the whole sample.

The registry at the bottom names the step families (``ode | flow_sde | dance_sde | cps | ddim``) and
``make_step`` binds one to a schedule, giving rollout and the training pass one calling convention:
``step(v, x, index, *, generator=None, noise=None, x_next=None) -> StepOutput``.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import torch

__all__ = [
    "StepOutput",
    "gaussian_log_prob",
    "euler_step",
    "sde_step",
    "cps_step",
    "ddim_step",
    "flow_ddim_step",
    "flow_grpo_noise_scale",
    "constant_noise_scale",
    "noise_std_ratio",
    "StepSpec",
    "Step",
    "STEPS",
    "UnknownStepError",
    "get_step",
    "make_step",
    "step_names",
]

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_REDUCTIONS = ("mean", "sum")

Number = float | int | torch.Tensor


class StepOutput(NamedTuple):
    """Result of one step. All fields float32.

    Shapes for a state ``x`` of shape ``[B, *S]`` (``D = prod(S)`` elements per sample):
    """

    x_next: torch.Tensor  # [B, *S] the sampled (or the given, when scoring) next state
    log_prob: torch.Tensor  # [B] log N(x_next; mean, std^2), summed over D ("sum") or / D ("mean"); 0 if std = 0
    mean: torch.Tensor  # [B, *S] mean of the Gaussian transition
    std: torch.Tensor  # [B, 1, ..., 1] (same ndim as x) per-element std of the transition, one value per sample


# ----------------------------------------------------------------------------------------------------
# helpers


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _per_row(value: Number, x: torch.Tensor, name: str) -> torch.Tensor:
    """A float, 0-d or ``[B]`` value as a float32 ``[B, 1, ..., 1]`` tensor on ``x``'s device.

    Every coefficient is materialised at the batch size before any arithmetic, so a row's numbers do
    not depend on whether its time came as a float (rollout) or as a ``[B]`` tensor (training).

    A Python number is filled in on the device (``torch.full``): ``torch.as_tensor(float, device=gpu)`` would
    build it on the host and copy it over, a blocking host-to-device copy per call (three per denoising step).
    Both round the number to float32 the same way, so the values are identical.
    """
    b = x.shape[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full((b,) + (1,) * (x.ndim - 1), float(value), dtype=torch.float32, device=x.device)
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        t = t.expand(b)
    elif t.ndim == 1 and t.shape[0] in (1, b):
        t = t.expand(b)
    else:
        raise ValueError(f"{name} must be a float, a 0-d tensor or a [B={b}] tensor, got shape {tuple(t.shape)}")
    return t.reshape((b,) + (1,) * (x.ndim - 1)).contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.to(torch.float32)


def _check_pair(v: torch.Tensor, x: torch.Tensor, names=("v", "x")) -> None:
    if v.shape != x.shape:
        raise ValueError(
            f"{names[0]} and {names[1]} must have the same shape, got {tuple(v.shape)} and {tuple(x.shape)}"
        )
    if x.ndim < 1:
        raise ValueError(f"{names[1]} needs a leading batch dimension")


def _flow_inputs(v: torch.Tensor, x: torch.Tensor, sigma: Number, sigma_next: Number):
    """Checked float32 ``v, x`` and per-row ``sigma, sigma_next, dt`` (each ``[B, 1, ..., 1]``)."""
    _check_pair(v, x)
    v, x = _f32(v), _f32(x)
    s_cur = _per_row(sigma, x, "sigma")
    s_next = _per_row(sigma_next, x, "sigma_next")
    return v, x, s_cur, s_next, s_next - s_cur


def gaussian_log_prob(
    x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float, reduction: str = "mean"
) -> torch.Tensor:
    """Exact log-density of ``x_next`` under ``N(mean, std^2 I)``, per sample.

    ``sum``: ``-||x_next - mean||^2 / (2 std^2) - D log std - (D / 2) log(2 pi)`` over the ``D`` elements;
    ``mean``: that divided by ``D``. Elements whose std is 0 contribute 0 (a deterministic step has no
    density; flowrl scores it 0 rather than NaN or -inf).

    The per-sample reduction over ``D`` accumulates in float64 (the elementwise math is float32): a
    float32 sum's rounding depends on how the kernel splits the reduction, which changes with the batch
    size and thread count, and would make a sample's log-prob depend on its batch. Rounded to float32
    at the end, the result is the same whatever the batch. Note that ``sum`` log-probs are ``O(D)``, so
    their float32 resolution is about ``D * 1e-7``; ratios of ``mean`` log-probs resolve ~1e-7.

    Args:
        x_next: ``[B, *S]``.
        mean: ``[B, *S]``.
        std: float, or a tensor that broadcasts to ``[B, *S]`` under torch's rules: per sample as
            ``[B, 1, ..., 1]`` (a bare ``[B]`` would broadcast against the LAST dimension) or per element.
        reduction: ``"mean"`` or ``"sum"``.

    Returns:
        float32 ``[B]``.
    """
    _check_reduction(reduction)
    x_next, mean = _f32(x_next), _f32(mean)
    if x_next.shape != mean.shape:
        raise ValueError(f"x_next and mean must have the same shape, got {tuple(x_next.shape)} and {tuple(mean.shape)}")
    if isinstance(std, torch.Tensor):
        std = _f32(std.to(mean.device))
    else:  # filled in on the device: no host-to-device copy (see _per_row)
        std = torch.full((), float(std), dtype=torch.float32, device=mean.device)
    b = mean.shape[0]
    d = mean[0].numel() if mean.ndim > 0 else 1
    diff = x_next - mean
    per_sample = std.ndim == 0 or (
        std.ndim == mean.ndim and std.shape[0] in (1, b) and all(n == 1 for n in std.shape[1:])
    )
    if per_sample:
        # one std per sample: reduce ||diff||^2 first, then add the closed-form terms.
        s = std.reshape(-1).expand(b) if std.numel() == 1 else std.reshape(b)
        s = s.to(torch.float64)
        positive = s > 0
        safe = torch.where(positive, s, torch.ones_like(s))
        sq = torch.sum((diff * diff).reshape(b, -1), dim=1, dtype=torch.float64)
        if reduction == "sum":
            lp = -sq / (2.0 * safe * safe) - d * torch.log(safe) - d * _LOG_SQRT_2PI
        else:
            lp = -(sq / d) / (2.0 * safe * safe) - torch.log(safe) - _LOG_SQRT_2PI
        return torch.where(positive, lp, torch.zeros_like(lp)).to(torch.float32)
    # per-element std
    positive = std > 0
    safe = torch.where(positive, std, torch.ones_like(std))
    elem = -(diff * diff) / (2.0 * (safe * safe)) - torch.log(safe) - _LOG_SQRT_2PI
    elem = torch.where(positive, elem, torch.zeros_like(elem))
    elem = elem.expand(torch.broadcast_shapes(elem.shape, x_next.shape)).reshape(b, -1)
    lp = torch.sum(elem, dim=1, dtype=torch.float64)
    lp = lp if reduction == "sum" else lp / d
    return lp.to(torch.float32)


def _draw_or_score(
    mean: torch.Tensor,
    std: torch.Tensor,
    *,
    generator: torch.Generator | None,
    noise: torch.Tensor | None,
    x_next: torch.Tensor | None,
    reduction: str,
) -> StepOutput:
    """Shared tail of every stochastic step: sample ``mean + std * z`` (or take ``x_next``), then score."""
    _check_reduction(reduction)
    if x_next is not None:
        if x_next.shape != mean.shape:
            raise ValueError(f"x_next has shape {tuple(x_next.shape)}, expected {tuple(mean.shape)}")
        x_next = _f32(x_next)
    elif noise is not None:
        if noise.shape != mean.shape:
            raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(mean.shape)}")
        x_next = mean + std * _f32(noise).to(mean.device)
    elif generator is not None:
        z = torch.randn(mean.shape, generator=generator, dtype=torch.float32, device=generator.device)
        x_next = mean + std * z.to(mean.device)
    elif bool((std == 0).all()):
        x_next = mean
    else:
        raise ValueError(
            "a stochastic step needs noise=... or generator=... (flowrl never draws from the global RNG), "
            "or x_next=... to score a stored transition"
        )
    return StepOutput(x_next, gaussian_log_prob(x_next, mean, std, reduction), mean, std)


# ----------------------------------------------------------------------------------------------------
# step functions


def euler_step(v: torch.Tensor, x: torch.Tensor, sigma: Number, sigma_next: Number) -> StepOutput:
    """Deterministic Euler step of the flow ODE: ``x_next = x + (sigma_next - sigma) v``.

    Args:
        v: velocity ``[B, *S]`` (any float dtype).
        x: state at ``sigma``, ``[B, *S]``.
        sigma, sigma_next: float, 0-d or ``[B]``.

    Returns:
        ``StepOutput`` with ``mean = x_next``, ``std = 0`` ``[B, 1, ..., 1]`` and ``log_prob = 0`` ``[B]``.
    """
    v, x, _, _, dt = _flow_inputs(v, x, sigma, sigma_next)
    x_next = x + dt * v
    zeros = torch.zeros_like(dt)
    return StepOutput(x_next, torch.zeros(x.shape[0], dtype=torch.float32, device=x.device), x_next, zeros)


def sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Number,
    sigma_next: Number,
    *,
    g: Number,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Marginal-preserving Flow-SDE step (Flow-GRPO's conversion; Dance-SDE with a constant ``g``).

    Euler-Maruyama step of ``dx = [v - (g^2 / 2) grad log p] dsigma + g dW`` with the score
    ``-eps_hat / sigma``:
    ``eps_hat = x + (1 - sigma) v``, ``mean = x + dt v + (g^2 / (2 sigma)) eps_hat dt``,
    ``std = g sqrt(-dt)``, ``dt = sigma_next - sigma < 0``.

    With ``g = flow_grpo_noise_scale(sigmas, a)[t]`` and ``reduction="mean"`` this is Flow-GRPO's
    ``sde_step_with_logprob`` (whose ``std_dev_t`` is our ``g``; its transition std is ``g sqrt(-dt)``).
    With ``g = 0`` it is exactly ``euler_step`` (and ``log_prob = 0``). ``sigma`` must be > 0.

    Args:
        v: velocity ``[B, *S]``.
        x: state ``[B, *S]``.
        sigma, sigma_next: float, 0-d or ``[B]``.
        g: noise scale (float, 0-d or ``[B]``), >= 0.
        generator: source of the Gaussian draw when ``noise`` is not given.
        noise: standard-normal ``[B, *S]`` to use instead of drawing.
        x_next: a stored next state to score instead of sampling.
        reduction: ``"mean"`` (divide by D, Flow-GRPO) or ``"sum"`` (exact density).

    Returns:
        ``StepOutput``; ``std`` is ``[B, 1, ..., 1]``.
    """
    v, x, s, _, dt = _flow_inputs(v, x, sigma, sigma_next)
    g = _per_row(g, x, "g")
    # mean = x + dt v + k eps_hat dt with k = g^2 / (2 sigma), eps_hat = x + (1 - sigma) v, collected as
    # x (1 + k dt) + v (dt + k dt (1 - sigma)) (Flow-GRPO's form): two per-sample coefficients and three
    # full-size ops; with g = 0 the coefficients are exactly 1 and dt, i.e. bit-identical to Euler.
    kdt = (g * g / (2.0 * s)) * dt
    mean = x * (1.0 + kdt) + v * (dt + kdt * (1.0 - s))
    std = g * torch.sqrt(-dt)
    return _draw_or_score(mean, std, generator=generator, noise=noise, x_next=x_next, reduction=reduction)


def cps_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Number,
    sigma_next: Number,
    *,
    noise_level: Number,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """Coefficient-preserving step (CPS): ``x_next = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) eps_hat + s z``.

    ``s = sigma_next sin(a pi / 2)`` with ``a = noise_level``; ``mean`` as above, ``std = s``. The
    log-prob is the **exact Gaussian density** ``log N(x_next; mean, s^2)``, not Flow-GRPO's CPS surrogate
    ``-mean((x_next - mean)^2)`` (no variance, no constants); clip ranges tuned for the surrogate do not
    carry over.

    The mean is evaluated in the algebraically identical form
    ``x + dt v - (s^2 / (sqrt(sigma_next^2 - s^2) + sigma_next)) eps_hat``
    (because ``(1 - sigma_next) x0_hat + sigma_next eps_hat = x + dt v``), so that ``a = 0`` is exactly the
    Euler step and the final step to ``sigma_next = 0`` (where ``s = 0``) has no 0 / 0.

    Marginals: CPS keeps ``x_sigma``'s marginal exactly when ``x0_hat`` and ``eps_hat`` are the sample's
    own ``x0`` and noise, at any step size. With a model that predicts posterior means (the best a model
    can do) the fresh noise does not make up for the predictions' lost variance: for Gaussian data one
    small step scales the variance by ``1 - r (1 - r) (1 - cos(a pi / 2))^2``, ``r = sigma^2 / Var(x_sigma)``,
    a per-step bias that finer schedules do not remove (unlike ``sde_step``). docs/algorithms.md does not claim
    otherwise; see tests/samplers/test_marginals.py.

    Args:
        v: velocity ``[B, *S]``.
        x: state ``[B, *S]``.
        sigma, sigma_next: float, 0-d or ``[B]``.
        noise_level: ``a`` in [0, 1] (float, 0-d or ``[B]``); ``a = 1`` makes the mean pure ``x0_hat``.
        generator, noise, x_next, reduction: as in ``sde_step``.

    Returns:
        ``StepOutput``; ``std`` is ``[B, 1, ..., 1]``.
    """
    v, x, s_cur, s_next, dt = _flow_inputs(v, x, sigma, sigma_next)
    a = _per_row(noise_level, x, "noise_level")
    std = s_next * torch.sin(a * (math.pi / 2.0))
    mean = _coefficient_preserving_mean(x, v, s_cur, dt, s_next, std)
    return _draw_or_score(mean, std, generator=generator, noise=noise, x_next=x_next, reduction=reduction)


def _coefficient_preserving_mean(x, v, s_cur, dt, s_next, std):
    """``(1 - sigma') x0_hat + sqrt(sigma'^2 - std^2) eps_hat`` as ``x + dt v - c eps_hat``.

    ``c = sigma' - sqrt(sigma'^2 - std^2) = std^2 / (sqrt(sigma'^2 - std^2) + sigma')`` (no cancellation,
    no 0 / 0 at ``sigma' = 0``), collected as ``x (1 - c) + v (dt - c (1 - sigma))``; ``std = 0`` gives
    exactly the Euler step.
    """
    keep = torch.sqrt(torch.clamp(s_next * s_next - std * std, min=0.0))
    denom = keep + s_next
    c = torch.where(std > 0, (std * std) / torch.where(denom > 0, denom, torch.ones_like(denom)), torch.zeros_like(std))
    return x * (1.0 - c) + v * (dt - c * (1.0 - s_cur))


def ddim_step(
    eps_hat: torch.Tensor,
    x: torch.Tensor,
    alpha_bar: Number,
    alpha_bar_prev: Number,
    *,
    eta: Number,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """DDIM step with ``eta`` for epsilon-prediction diffusion (DDPO / D3PO baselines).

    ``x0_hat = (x - sqrt(1 - ab_t) eps_hat) / sqrt(ab_t)``,
    ``s_t = eta sqrt((1 - ab_prev) / (1 - ab_t)) sqrt(1 - ab_t / ab_prev)``,
    ``mean = sqrt(ab_prev) x0_hat + sqrt(1 - ab_prev - s_t^2) eps_hat``, ``std = s_t``.
    ``eta = 0`` is deterministic DDIM (log_prob 0); ``eta = 1`` is DDPM's posterior variance.

    Args:
        eps_hat: predicted noise ``[B, *S]``.
        x: state ``[B, *S]`` in the variance-preserving parametrisation ``sqrt(ab) x0 + sqrt(1 - ab) eps``.
        alpha_bar, alpha_bar_prev: cumulative alphas at this and the next (less noisy) step, in (0, 1];
            float, 0-d or ``[B]``.
        eta: float, 0-d or ``[B]``, >= 0.
        generator, noise, x_next, reduction: as in ``sde_step``.

    Returns:
        ``StepOutput``; ``std`` is ``[B, 1, ..., 1]``.
    """
    _check_pair(eps_hat, x, ("eps_hat", "x"))
    eps_hat, x = _f32(eps_hat), _f32(x)
    ab = _per_row(alpha_bar, x, "alpha_bar")
    ab_prev = _per_row(alpha_bar_prev, x, "alpha_bar_prev")
    eta = _per_row(eta, x, "eta")
    x0_hat = (x - torch.sqrt(1.0 - ab) * eps_hat) / torch.sqrt(ab)
    std = eta * torch.sqrt((1.0 - ab_prev) / (1.0 - ab)) * torch.sqrt(torch.clamp(1.0 - ab / ab_prev, min=0.0))
    mean = torch.sqrt(ab_prev) * x0_hat + torch.sqrt(torch.clamp(1.0 - ab_prev - std * std, min=0.0)) * eps_hat
    return _draw_or_score(mean, std, generator=generator, noise=noise, x_next=x_next, reduction=reduction)


def flow_ddim_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: Number,
    sigma_next: Number,
    *,
    eta: Number,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    reduction: str = "mean",
) -> StepOutput:
    """``ddim_step`` for a flow model, written in flow coordinates (the registry's ``ddim``).

    The flow path ``(1 - sigma) x0 + sigma eps`` is the variance-preserving path rescaled by
    ``n(sigma) = sqrt((1 - sigma)^2 + sigma^2)``, with ``ab = (1 - sigma)^2 / n^2``. DDIM on that VP path,
    mapped back (``x_flow = n x_vp``), is a coefficient-preserving step with ``std = n(sigma_next) s_t``:
    ``mean = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std^2) eps_hat``. Using flow coordinates keeps
    the first step (``sigma = 1``, ``ab = 0``) finite and scores the density of the flow latent that
    rollout stores. ``eta = 0`` is exactly the Euler step.

    Args:
        v: velocity ``[B, *S]``.
        x: state ``[B, *S]`` (flow parametrisation).
        sigma, sigma_next: float, 0-d or ``[B]``.
        eta: DDIM's eta (float, 0-d or ``[B]``).
        generator, noise, x_next, reduction: as in ``sde_step``.

    Returns:
        ``StepOutput``; ``std`` is ``[B, 1, ..., 1]``.
    """
    v, x, s_cur, s_next, dt = _flow_inputs(v, x, sigma, sigma_next)
    eta = _per_row(eta, x, "eta")
    # 1 - ab = sigma^2 / n^2, and ab_t / ab_prev; s_t as in ddim_step, then std = n(sigma_next) s_t.
    n2_cur = (1.0 - s_cur) ** 2 + s_cur * s_cur
    n2_next = (1.0 - s_next) ** 2 + s_next * s_next
    one_minus_ab = s_cur * s_cur / n2_cur
    one_minus_ab_prev = s_next * s_next / n2_next
    ab = (1.0 - s_cur) ** 2 / n2_cur
    ab_prev = (1.0 - s_next) ** 2 / n2_next
    ratio = torch.where(
        ab_prev > 0, ab / torch.where(ab_prev > 0, ab_prev, torch.ones_like(ab_prev)), torch.zeros_like(ab)
    )
    s_t = eta * torch.sqrt(one_minus_ab_prev / one_minus_ab) * torch.sqrt(torch.clamp(1.0 - ratio, min=0.0))
    std = torch.sqrt(n2_next) * s_t
    mean = _coefficient_preserving_mean(x, v, s_cur, dt, s_next, std)
    return _draw_or_score(mean, std, generator=generator, noise=noise, x_next=x_next, reduction=reduction)


# ----------------------------------------------------------------------------------------------------
# noise scales per step


def flow_grpo_noise_scale(sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
    """Flow-GRPO's per-step noise scale ``g_t = a sqrt(sigma_t / (1 - sigma_t))``.

    At ``sigma_t = 1`` the denominator uses ``1 - sigmas[1]`` (the schedule's second sigma) to stay
    finite, as Flow-GRPO does. Computed in float64, returned in float32.

    Near ``sigma = 1`` this ``g`` is stiff: ``g_0^2 |dt_0| = a^2`` and step ``i``'s drift correction is
    about ``a^2 / (2 i)`` whatever the step size, so the first few SDE steps do not preserve the marginal
    exactly however fine the schedule (+6 % variance after step 0 for ``a = 0.7``); the SDE is
    marginal-preserving up to discretisation error away from ``sigma = 1``.

    Args:
        sigmas: schedule ``[T + 1]`` (1 down to 0).
        noise_level: ``a`` (Flow-GRPO's ``noise_level``, e.g. 0.7).

    Returns:
        float32 ``[T]``, one value per step (the step from ``sigmas[t]`` to ``sigmas[t + 1]``).
    """
    s = torch.as_tensor(sigmas, dtype=torch.float64).flatten()
    if s.numel() < 2:
        raise ValueError("a schedule needs at least 2 sigmas")
    cur = s[:-1]
    denom_sigma = torch.where(cur >= 1.0, s[1].expand_as(cur), cur)
    return (noise_level * torch.sqrt(cur / (1.0 - denom_sigma))).to(torch.float32)


def constant_noise_scale(sigmas: torch.Tensor, eta: float) -> torch.Tensor:
    """Dance-SDE's noise scale: ``g_t = eta`` at every step.

    Args:
        sigmas: schedule ``[T + 1]``.
        eta: the constant (DanceGRPO uses 0.3).

    Returns:
        float32 ``[T]``.
    """
    n = torch.as_tensor(sigmas).numel() - 1
    if n < 1:
        raise ValueError("a schedule needs at least 2 sigmas")
    return torch.full((n,), float(eta), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# registry and the uniform step interface


StepKernel = Callable[..., StepOutput]


def _ode_kernel(v, x, sigma, sigma_next, scale, *, generator=None, noise=None, x_next=None, reduction="mean"):
    out = euler_step(v, x, sigma, sigma_next)
    if x_next is None:
        return out
    # Scoring a stored deterministic transition: the stored state is kept as is, its log-prob is 0.
    return StepOutput(_f32(x_next), out.log_prob, out.mean, out.std)


def _sde_kernel(v, x, sigma, sigma_next, scale, **kw):
    return sde_step(v, x, sigma, sigma_next, g=scale, **kw)


def _cps_kernel(v, x, sigma, sigma_next, scale, **kw):
    return cps_step(v, x, sigma, sigma_next, noise_level=scale, **kw)


def _ddim_kernel(v, x, sigma, sigma_next, scale, **kw):
    return flow_ddim_step(v, x, sigma, sigma_next, eta=scale, **kw)


@dataclass(frozen=True)
class StepSpec:
    """One registered step family.

    Attributes:
        name: registry name.
        kernel: ``kernel(v, x, sigma, sigma_next, scale, *, generator, noise, x_next, reduction)``.
        noise_scales: ``noise_scales(sigmas, **hyperparams) -> float32 [T]``, the per-step scale the
            kernel receives (``g_t``, CPS's ``a`` or DDIM's ``eta``; zeros for the ODE).
        defaults: the family's hyperparameters and their defaults (besides ``reduction``).
        stochastic: whether the family samples (False only for ``ode``).
        doc: one line for listings.
    """

    name: str
    kernel: StepKernel
    noise_scales: Callable[..., torch.Tensor]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    stochastic: bool = True
    doc: str = ""


def _ode_scales(sigmas):
    return torch.zeros(torch.as_tensor(sigmas).numel() - 1, dtype=torch.float32)


def _flow_sde_scales(sigmas, noise_level):
    return flow_grpo_noise_scale(sigmas, noise_level)


def _eta_scales(sigmas, eta):
    return constant_noise_scale(sigmas, eta)


def _noise_level_scales(sigmas, noise_level):
    return constant_noise_scale(sigmas, noise_level)


# Module-level functions only (no lambdas), so that a Step / Trajectory pickles (torch.save, gather_object).
STEPS: dict[str, StepSpec] = {
    "ode": StepSpec("ode", _ode_kernel, _ode_scales, {}, False, "deterministic Euler step of the flow ODE"),
    "flow_sde": StepSpec("flow_sde", _sde_kernel, _flow_sde_scales, {"noise_level": 0.7}, True,
                         "Flow-GRPO's marginal-preserving SDE, g_t = a sqrt(sigma / (1 - sigma))"),
    "dance_sde": StepSpec("dance_sde", _sde_kernel, _eta_scales, {"eta": 0.3}, True,
                          "DanceGRPO's SDE, the same drift with constant g_t = eta"),
    "cps": StepSpec("cps", _cps_kernel, _noise_level_scales, {"noise_level": 0.7}, True,
                    "coefficient-preserving sampling, s = sigma_next sin(a pi / 2)"),
    "ddim": StepSpec("ddim", _ddim_kernel, _eta_scales, {"eta": 1.0}, True,
                     "DDIM with eta on the equivalent variance-preserving path"),
}


class UnknownStepError(KeyError):
    """An unknown step name; the message lists the valid ones."""

    def __init__(self, name: str, valid: list[str]):
        close = difflib.get_close_matches(str(name), valid, n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        self.message = f"unknown step {name!r}{hint}; valid names: {', '.join(valid)}"
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.message


def step_names() -> list[str]:
    """The registered step names, in registry order."""
    return list(STEPS)


def get_step(name: str) -> StepSpec:
    """The registered ``StepSpec`` for ``name``.

    Raises:
        UnknownStepError: (a ``KeyError``) for an unknown name, listing the valid ones.
    """
    try:
        return STEPS[name]
    except (KeyError, TypeError):
        raise UnknownStepError(name, list(STEPS)) from None


def noise_kwargs(name: str, noise_level: float | None) -> dict[str, float]:
    """The hyperparameters of step ``name`` for a generic "noise level" setting.

    Configs and command lines expose one ``noise_level`` knob; each stochastic family calls it by its own
    name (``noise_level`` = Flow-SDE's / CPS's ``a``, ``eta`` = Dance-SDE's / DDIM's constant). This is the
    one place that maps the knob to the family and decides its default: ``None`` leaves the family's own
    default (:data:`STEPS`), e.g. ``eta = 0.3`` for ``dance_sde``, never another family's.

    Returns:
        ``{}`` for ``None`` or the deterministic ``ode``; else ``{family_name: float(noise_level)}``.

    Raises:
        UnknownStepError: unknown ``name``.
    """
    spec = get_step(name)
    if noise_level is None or not spec.defaults:
        return {}
    (key,) = spec.defaults  # every stochastic family has exactly one noise hyperparameter
    return {key: float(noise_level)}


@dataclass(frozen=True, eq=False)
class Step:
    """A step family bound to a schedule and its hyperparameters: the one step interface.

    Rollout samples with ``step(v, x, t, generator=... | noise=...)``; the training pass re-scores the
    stored transition with ``step(v_new, latents[:, t], t, x_next=latents[:, t + 1])``. Both go through
    the same kernel with the same per-step sigma and noise scale, so the on-policy ratio is exactly 1.

    Attributes:
        name: registry name.
        sigmas: float32 ``[T + 1]`` schedule.
        noise_scales: float32 ``[T]`` per-step scale passed to the kernel (``g_t``, ``a`` or ``eta``).
        hyperparams: the resolved hyperparameters, ``reduction`` included (enough to rebuild the step
            with ``make_step(name, sigmas, **hyperparams)``).
        spec: the registry entry.
    """

    name: str
    sigmas: torch.Tensor
    noise_scales: torch.Tensor
    hyperparams: Mapping[str, Any]
    spec: StepSpec

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @property
    def reduction(self) -> str:
        return self.hyperparams["reduction"]

    @property
    def stochastic(self) -> bool:
        return self.spec.stochastic

    def _lookup(self, table: torch.Tensor, index, x: torch.Tensor) -> float | torch.Tensor:
        """``table[index]``: a Python float for an int index, a ``[B]`` tensor on ``x``'s device for a tensor index.

        The tables live on the CPU. An int index (rollout, and the training pass of one step) reads a constant of
        the schedule as a float, which the kernels fill in on the device (``_per_row``): no host-to-device copy
        per step, where a 0-d CPU tensor moved to the device would be one blocking copy per lookup. The float
        holds the float32 table value exactly, so the step's numbers are the same either way.
        """
        if isinstance(index, torch.Tensor):
            idx = index.to(device=table.device, dtype=torch.long)
            if idx.ndim > 1:
                raise ValueError(f"index must be an int or a [B] tensor, got shape {tuple(idx.shape)}")
            return table[idx].to(x.device)
        return float(table[int(index)])

    def _check_index(self, index) -> None:
        lo, hi = (int(index.min()), int(index.max())) if isinstance(index, torch.Tensor) else (int(index), int(index))
        if lo < 0 or hi >= self.num_steps:
            raise IndexError(f"step index {index} out of range for a {self.num_steps}-step schedule")

    def __call__(
        self,
        v: torch.Tensor,
        x: torch.Tensor,
        index: int | torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        x_next: torch.Tensor | None = None,
    ) -> StepOutput:
        """Step ``index`` of the schedule (``sigmas[index] -> sigmas[index + 1]``).

        Args:
            v: velocity at ``(x, sigmas[index])``, ``[B, *S]``.
            x: state ``[B, *S]``.
            index: int, or a ``[B]`` long tensor (rows at different steps).
            generator, noise: randomness for sampling (see the module docstring).
            x_next: stored next state ``[B, *S]`` to score instead of sampling.

        Returns:
            ``StepOutput`` (float32).
        """
        self._check_index(index)
        sigma = self._lookup(self.sigmas, index, x)
        sigma_next = self._lookup(
            self.sigmas, index + 1 if not isinstance(index, torch.Tensor) else index.long() + 1, x
        )
        scale = self._lookup(self.noise_scales, index, x)
        return self.spec.kernel(
            v, x, sigma, sigma_next, scale, generator=generator, noise=noise, x_next=x_next, reduction=self.reduction
        )

    def ode(self, v: torch.Tensor, x: torch.Tensor, index: int | torch.Tensor) -> StepOutput:
        """The deterministic Euler step at ``index`` (used outside the training window)."""
        self._check_index(index)
        sigma = self._lookup(self.sigmas, index, x)
        sigma_next = self._lookup(
            self.sigmas, index + 1 if not isinstance(index, torch.Tensor) else index.long() + 1, x
        )
        return euler_step(v, x, sigma, sigma_next)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparams.items())
        return f"Step({self.name!r}, T={self.num_steps}, {hp})"


def noise_std_ratio(step: Step) -> torch.Tensor:
    """Per step, the noise the state a step reaches carries, over the noise its schedule level should carry.

    Every step here moves the velocity's clean estimate ``x0_hat = x - sigma v`` and noise estimate
    ``eps_hat = x + (1 - sigma) v`` to the next level as ``x_next = (1 - sigma_next) x0_hat + c eps_hat + std z``;
    the Euler step has ``c = sigma_next``, ``std = 0``. With ``eps_hat`` of unit variance per element and independent of
    the fresh draw ``z`` (exact at ``sigma = 1``, where ``eps_hat`` is the initial noise), the state then carries noise
    of std ``sqrt(c^2 + std^2)``, and this returns ``sqrt(c^2 + std^2) / sigma_next``: 1 for the ODE and for the
    coefficient-preserving steps (``cps``, ``ddim``) at any step size; for the Euler-Maruyama SDE steps (``flow_sde``,
    ``dance_sde``) ``c = sigma_next - g^2 |dt| / (2 sigma)``, which tends to 1 only as the steps get small. With a
    few large steps the SDE adds more noise than its drift removes: ``flow_sde`` at ``a = 0.7`` gives 1.07 at the
    first of 10 linear steps, 1.15 / 1.32 / 1.49 at the first three of 4 (docs/trainers.md, "Few-step students").

    Computed by the step's own kernel (``x = sigma``, ``v = 1``: ``x0_hat = 0``, ``eps_hat = 1``, no draw), in float64
    from its float32 outputs.

    Returns:
        float64 ``[T]``; NaN at a step to ``sigma_next = 0`` (no noise left to compare with).
    """
    out = torch.full((step.num_steps,), math.nan, dtype=torch.float64)
    for t in range(step.num_steps):
        sigma, sigma_next = float(step.sigmas[t]), float(step.sigmas[t + 1])
        if sigma_next <= 0:
            continue
        one = torch.ones(1, 1, dtype=torch.float32)
        res = step.spec.kernel(one, sigma * one, sigma, sigma_next, float(step.noise_scales[t]),
                               noise=torch.zeros_like(one), reduction=step.reduction)
        c, std = float(res.mean.reshape(-1)[0]), float(res.std.reshape(-1)[0])
        out[t] = math.sqrt(c * c + std * std) / sigma_next
    return out


def make_step(name: str, sigmas: torch.Tensor, **hyperparams: Any) -> Step:
    """Bind the step family ``name`` to a schedule.

    Args:
        name: one of ``step_names()``: ``ode | flow_sde | dance_sde | cps | ddim``.
        sigmas: schedule ``[T + 1]`` from 1 (or the start sigma) down to 0.
        **hyperparams: the family's hyperparameters (``flow_sde``: ``noise_level=0.7``; ``dance_sde``:
            ``eta=0.3``; ``cps``: ``noise_level=0.7``; ``ddim``: ``eta=1.0``) and ``reduction``
            (``"mean"``, the default as in Flow-GRPO, or ``"sum"``).

    Returns:
        A ``Step``.

    Raises:
        UnknownStepError: unknown ``name``.
        TypeError: a hyperparameter the family does not take (the message lists the ones it does).
    """
    spec = get_step(name)
    sig = torch.as_tensor(sigmas).detach().to(device="cpu", dtype=torch.float32).flatten().clone()
    if sig.numel() < 2:
        raise ValueError("a schedule needs at least 2 sigmas")
    if not bool((sig[1:] < sig[:-1]).all()):
        raise ValueError(f"sigmas must be strictly decreasing, got {sig.tolist()}")
    allowed = dict(spec.defaults)
    allowed["reduction"] = "mean"
    unknown = sorted(set(hyperparams) - set(allowed))
    if unknown:
        raise TypeError(
            f"step {name!r} got unknown hyperparameter(s) {unknown}; it takes {sorted(allowed)}"
        )
    resolved = {**allowed, **hyperparams}
    _check_reduction(resolved["reduction"])
    fam_hp = {k: resolved[k] for k in spec.defaults}
    for k, val in fam_hp.items():
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val < 0:
            raise ValueError(f"step {name!r}: {k} must be a finite number >= 0, got {val!r}")
    scales = spec.noise_scales(sig, **fam_hp).to(torch.float32)
    return Step(name=name, sigmas=sig, noise_scales=scales, hyperparams=resolved, spec=spec)
