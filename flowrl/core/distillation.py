"""Distribution matching distillation (DMD / DMD2): the student's, the fake score's and the GAN losses.

Paper: T. Yin, M. Gharbi, T. Park, R. Zhang, E. Shechtman, F. Durand, W. T. Freeman, "Improved Distribution
Matching Distillation for Fast Image Synthesis" (DMD2, NeurIPS 2024), after T. Yin et al., "One-step Diffusion
with Distribution Matching Distillation" (DMD, CVPR 2024).

Three networks: a few-step student ``G`` (the generator), the frozen teacher (the "real score") and a "fake
score" initialised from the teacher and trained by denoising on the student's own samples. The student
follows the difference of the two scores at a noised copy of its sample; DMD2 drops DMD's regression loss,
updates the fake score several times per student step (two time scales: :func:`is_generator_step`) and can
add a GAN term, a classifier head on the fake score's features trained to tell real images from the
student's. Every function here takes model outputs and returns a loss; nothing here runs a model, draws
noise (except :func:`sample_dmd_timesteps`, from an explicit generator) or knows about processes.

Conventions (flowrl's, docs/algorithms.md section 1): ``sigma = 1`` is noise, ``sigma = 0`` data,
``x_t = (1 - sigma) x0 + sigma eps``, models predict the velocity ``v = eps - x0`` and
``x0_hat = x_t - sigma v_hat``. Shapes: samples and velocities are ``[B, ...]`` (at least one non-batch
dimension); per-row quantities are ``[B]``; ``mean_d`` is the mean over one row's ``D`` elements.

The generator loss (:func:`dmd_generator_loss`), as the authors compute it::

    p_real = x0 - x0_hat_real,  p_fake = x0 - x0_hat_fake          (x0 predictions at the same x_t, sigma)
    grad   = (p_real - p_fake) / mean_d |p_real|                    (= (x0_hat_fake - x0_hat_real) / w)
    loss   = 0.5 * mean (x0 - stopgrad(x0 - grad))^2                (d loss / d x0 = grad / (B D))

A gradient step on ``x0`` moves it along ``x0_hat_real - x0_hat_fake``: toward what the teacher denoises it
to and away from what the fake score (the student's own distribution) does. In scores,
``grad = sigma^2 / (1 - sigma) * (s_fake - s_real) / w`` with ``s = grad log p_sigma``, a positive factor,
so the sign is the same whether DMD's ``s_fake - s_real`` is read as scores or as x0 predictions.

Sources, read at these commits and run on the same inputs by ``tests/core/test_distillation.py``
(``tests/core/distillation_reference/dmd2_reference.json``):

- DMD2, the authors' code: github.com/tianweiy/DMD2 @ 8d8fa55633d47cfb81bbc7a892e7248f9518763f,
  ``main/sd_guidance.py`` (SD v1.5 / SDXL, epsilon prediction on the DDPM schedule):
  ``compute_distribution_matching_loss`` (lines 168-255), ``compute_loss_fake`` (257-310),
  ``compute_generator_clean_cls_loss`` (312-324), ``compute_guidance_clean_cls_loss`` (369-395);
  ``main/edm/edm_guidance.py`` (ImageNet 64, EDM x0 prediction on Karras sigmas), the same four methods;
  ``main/train_sd.py`` / ``main/edm/train_edm.py`` (loss weights, ``dfake_gen_update_ratio``, step range).
- Flow-Factory's DMD trainer (flow matching, velocity prediction): github.com/X-GenGroup/Flow-Factory, branch
  ``DMDR`` @ 1796c8d390cd1c05d8c8c247ec062c838e3c1371, ``src/flow_factory/trainers/DMD/dmd.py``,
  ``DMDTrainer.optimize`` (fake-score loss lines 620-637, DMD loss lines 704-742).

Where the two differ, and what flowrl does:

- **Parameterisation.** DMD2 works in epsilon (SD) or x0 (EDM) prediction, Flow-Factory and flowrl in
  velocity. The DMD gradient depends only on the x0 predictions, which every parameterisation shares, so it is
  unchanged by the conversion. To feed DMD2's models to these functions: on the DDPM schedule
  (``x = sqrt(ab) x0 + sqrt(1 - ab) eps``) take ``sigma = sqrt(1 - ab) / (sqrt(ab) + sqrt(1 - ab))``,
  ``x_t = x / (sqrt(ab) + sqrt(1 - ab))``, ``x0_hat = (x - sqrt(1 - ab) eps_hat) / sqrt(ab)`` and
  ``v = eps_hat - x0_hat``; on EDM's (``x = x0 + s eps``) take ``sigma = s / (1 + s)``, ``x_t = x / (1 + s)``
  and ``v = (x - x0_hat) / s - x0_hat``. Classifier-free guidance on epsilon equals guidance on the velocity
  (both are affine in the prediction with weights summing to 1), so the teacher's guided velocity can be
  passed as ``v_real``. DMD2 guides the real score (1.75 on SD v1.5, 8 on SDXL) and never the fake one.
- **Normaliser.** Both divide by ``mean_d |x0 - x0_hat_real|``; Flow-Factory adds 1e-8 (``eps=1e-8`` here).
  flowrl defaults to DMD2's ``eps = 0``: the authors' number, and the two differ only where the normaliser
  itself is ~1e-8. Both then apply ``torch.nan_to_num``, which sends ``0 / 0`` to 0 but ``c / 0`` to the
  largest float; flowrl sets every non-finite element to 0 instead (so a row whose normaliser is 0 gets no
  gradient, rather than an overflow) and reports their fraction as ``stats["nonfinite_frac"]``. On finite
  inputs with a non-zero normaliser the result is the authors'.
- **Precision.** DMD2 (SD) forms the x0 predictions and the gradient in float64 and the loss in float32;
  Flow-Factory in the autocast dtype. flowrl forms all of them in float64 (the loss too, so
  ``x0 - stopgrad(x0 - grad)`` is ``grad`` up to float64 rounding even for bf16 samples).
- **Sign and reduction** agree: ``0.5 * mse(x0, x0 - grad)`` averaged over all ``B * D`` elements, which is
  ``reduction="mean"`` of the per-row ``0.5 mean_d grad^2``. Carry DMD2's loss weights (``gen_cls_loss_weight``
  5e-3 SDXL, 1e-3 SD v1.5, 3e-3 ImageNet; ``guidance_cls_loss_weight`` 1e-2) over only with that reduction:
  the ``1 / (B D)`` is what they were tuned against.
- **Fake-score loss.** DMD2 (SD) trains the fake score on the epsilon error at DDPM steps uniform in
  ``[0, 1000)``, which in flowrl's terms is the velocity error weighted by ``(1 - sigma)^2``
  (``weighting="epsilon"``); EDM on the x0 error weighted by ``1 / s^2 + 1 / sigma_data^2``, i.e.
  ``(1 - sigma)^2 + sigma^2 / sigma_data^2`` on the velocity error (``weighting="edm"``). Flow-Factory uses
  the plain velocity error, which flowrl follows by default (``weighting="velocity"``): it is the teacher's
  own flow-matching pretraining loss (docs/algorithms.md section 1), so the fake score, a copy of the teacher, starts
  at the objective's optimum for the teacher's distribution.
- **Times.** DMD2 draws the DMD point's step uniformly from the integers ``[int(0.02 N), int(0.98 N)]`` of its
  ``N = 1000``-step schedule (:func:`sample_dmd_timesteps`, with the same draw). flowrl maps step ``k`` to
  ``sigma = k / N`` on the flow model's own schedule (then its shift, e.g. SD3's 3.0), or through any table
  of sigmas (e.g. DDPM steps converted as above, which reproduces DMD2's noised points exactly).
  Flow-Factory draws a continuous ``sigma ~ Beta(a, b)`` (example ``a = 4, b = 1.5``) instead; flowrl does not
  provide it (torch's Beta sampler takes no generator).
- **GAN terms** exist only in DMD2: the generator's non-saturating ``softplus(-D(G(z)))`` and the
  classifier's ``softplus(D(fake)) + softplus(-D(real))``, means taken separately over the fake and the real
  batch (as the SD code; the EDM code's mean of the sum is the same for equal batch sizes). The head, its
  features (the fake score's bottleneck) and DMD2's optional noising of its inputs ("diffusion GAN", steps
  uniform in ``[0, 1000)``) are the recipe's.
- Left to the recipe: DMD's regression loss (dropped by DMD2), DMD2's backward simulation (training a
  multi-step student on its own intermediate samples), Flow-Factory's DINOv2 reward term, the optimisers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from flowrl.core.forward_losses import REDUCTIONS, _check_number, _check_rows, _reduce, _row_mean, _times, _work_dtype
from flowrl.core.losses import _check_choice

__all__ = [
    "FAKE_SCORE_WEIGHTINGS",
    "DMDGeneratorOutput",
    "DMDTimesteps",
    "DistillationLossOutput",
    "dmd_generator_loss",
    "dmd_gradient",
    "dmd_step_range",
    "fake_score_loss",
    "gan_discriminator_loss",
    "gan_generator_loss",
    "is_generator_step",
    "sample_dmd_timesteps",
]

FAKE_SCORE_WEIGHTINGS = ("velocity", "epsilon", "edm")


class DMDGeneratorOutput(NamedTuple):
    """The DMD generator loss and what is logged with it."""

    loss: Tensor  # [] float64, carries the graph to x0; d loss / d x0 = grad / (B D) with reduction "mean"
    grad: Tensor  # [B, ...] float64, detached: the normalised DMD gradient
    normaliser: Tensor  # [B] float64, detached: mean_d |x0 - x0_hat_real| + eps (ones when normalise=False)
    stats: dict[str, Tensor]  # name -> [] detached batch means


class DistillationLossOutput(NamedTuple):
    """A fake-score or GAN loss and what is logged with it."""

    loss: Tensor  # [] carries the graph to the prediction / logits
    stats: dict[str, Tensor]  # name -> [] detached batch means


class DMDTimesteps(NamedTuple):
    """Steps drawn for the DMD noised point."""

    index: Tensor  # [B] long, the step on an N-step schedule (DMD2's ``timesteps``)
    sigma: Tensor  # [B] the noise level in [0, 1] of that step (flowrl's convention)


# --------------------------------------------------------------------------------------------------
# generator: the distribution-matching gradient


def _sigmas(sigma: Any, like: Tensor) -> Tensor:
    """``sigma`` as ``[B, 1, ...]`` (forward_losses' check of noise levels, its messages naming ``sigma``)."""
    try:
        return _times(sigma, like)
    except ValueError as e:
        raise ValueError("sigma" + str(e)[1:] if str(e).startswith("t ") else str(e)) from None


def dmd_gradient(
    x0: Tensor,
    x_t: Tensor,
    sigma: Tensor | float,
    v_real: Tensor,
    v_fake: Tensor,
    *,
    normalise: bool = True,
    eps: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The normalised distribution-matching gradient ``(p_real - p_fake) / w`` (DMD2's ``grad``), float64.

    ``x0_hat = x_t - sigma v`` for the real (teacher) and the fake score; ``p = x0 - x0_hat``;
    ``w = mean_d |p_real| + eps`` per row. Non-finite elements (a zero normaliser, non-finite inputs) are set
    to 0. Nothing here carries a gradient.

    Args:
        x0: ``[B, ...]`` the student's sample.
        x_t: ``[B, ...]`` its noised copy ``(1 - sigma) x0 + sigma eps``.
        sigma: noise level of each row: a float, a 0-d or a ``[B]`` tensor, in ``[0, 1]``.
        v_real: ``[B, ...]`` the teacher's (guided) velocity at ``(x_t, sigma)``.
        v_fake: ``[B, ...]`` the fake score's velocity there.
        normalise: divide by ``w`` (DMD2 and Flow-Factory do). Default True.
        eps: added to the normaliser, >= 0. Default 0 (DMD2); Flow-Factory uses 1e-8.

    Returns:
        ``(grad [B, ...], normaliser [B], nonfinite [B, ...] bool)``, float64, detached; ``normaliser`` is
        ones when ``normalise`` is False and ``nonfinite`` marks the elements set to 0.
    """
    eps = _check_number("eps", eps)
    _check_rows(x0=x0, x_t=x_t, v_real=v_real, v_fake=v_fake)
    with torch.no_grad():
        s = _sigmas(sigma, x0).double()
        x0d, xt = x0.detach().double(), x_t.detach().double()
        p_real = x0d - (xt - s * v_real.detach().double())
        p_fake = x0d - (xt - s * v_fake.detach().double())
        # The authors' order of operations: (p_real - p_fake) / w, not (x0_hat_fake - x0_hat_real) / w.
        if normalise:
            w = _row_mean(p_real.abs()) + eps
            grad = (p_real - p_fake) / w.reshape(-1, *([1] * (x0.ndim - 1)))
        else:
            w = torch.ones(x0.shape[0], dtype=torch.float64, device=x0.device)
            grad = p_real - p_fake
        nonfinite = ~torch.isfinite(grad)
        grad = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
    return grad, w, nonfinite


def dmd_generator_loss(
    x0: Tensor,
    x_t: Tensor,
    sigma: Tensor | float,
    v_real: Tensor,
    v_fake: Tensor,
    *,
    normalise: bool = True,
    eps: float = 0.0,
    reduction: str = "mean",
) -> DMDGeneratorOutput:
    """The student's DMD loss ``0.5 * mean_d (x0 - stopgrad(x0 - grad))^2`` per row, reduced over rows.

    Its value is ``0.5 * mean_d grad^2`` and its gradient w.r.t. ``x0`` is ``grad / D`` per row (divided by
    ``B`` again with ``reduction="mean"``): the stop-gradient target hands the distribution-matching gradient
    :func:`dmd_gradient` to autograd, through ``x0 = G(z)`` into the student.

    Args:
        x0: ``[B, ...]`` the student's sample, with its graph to the student's parameters.
        x_t: ``[B, ...]`` the noised point ``(1 - sigma) x0 + sigma eps`` (its graph, if any, is not used).
        sigma: noise level of each row: a float, a 0-d or a ``[B]`` tensor, in ``[0, 1]``
            (:func:`sample_dmd_timesteps`).
        v_real: ``[B, ...]`` the frozen teacher's velocity at ``(x_t, sigma)``, with classifier-free guidance
            if used (detached here).
        v_fake: ``[B, ...]`` the fake score's velocity there, unguided (detached here).
        normalise: divide by ``mean_d |x0 - x0_hat_real|`` (DMD2, Flow-Factory). Default True.
        eps: added to that normaliser, >= 0. Default 0 (DMD2); Flow-Factory's is 1e-8.
        reduction: ``"mean"`` (default, DMD2's mean over all ``B D`` elements) or ``"sum"`` over rows.

    Returns:
        :class:`DMDGeneratorOutput`: the float64 loss, ``grad`` and ``normaliser`` (detached), and ``stats``:
        ``grad_norm`` (mean per-row L2 norm of ``grad``), ``normaliser`` (mean ``w``), ``score_gap`` (mean
        ``mean_d |x0_hat_fake - x0_hat_real|``), ``nonfinite_frac`` (fraction of elements set to 0).
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    grad, w, nonfinite = dmd_gradient(x0, x_t, sigma, v_real, v_fake, normalise=normalise, eps=eps)
    x0d = x0.double()
    target = (x0d - grad).detach()
    loss = _reduce(0.5 * _row_mean((x0d - target).square()), reduction)
    with torch.no_grad():
        gap = grad * w.reshape(-1, *([1] * (grad.ndim - 1)))
        stats = {
            "grad_norm": grad.reshape(grad.shape[0], -1).norm(dim=1).mean(),
            "normaliser": w.mean(),
            "score_gap": _row_mean(gap.abs()).mean(),
            "nonfinite_frac": nonfinite.double().mean(),
        }
    return DMDGeneratorOutput(loss, grad, w, stats)


# --------------------------------------------------------------------------------------------------
# fake score: denoising on the student's samples


def fake_score_loss(
    v_fake: Tensor,
    x0: Tensor,
    noise: Tensor,
    sigma: Tensor | float,
    *,
    weighting: str = "velocity",
    sigma_data: float = 0.5,
    reduction: str = "mean",
) -> DistillationLossOutput:
    """The fake score's denoising loss on the student's samples: ``mean_d lambda(sigma) (v_fake - (eps - x0))^2``.

    ``lambda`` by ``weighting``: ``"velocity"`` 1 (flow matching, Flow-Factory; the default);
    ``"epsilon"`` ``(1 - sigma)^2``, the epsilon error ``(eps_hat - eps)^2`` of DMD2's SD code;
    ``"edm"`` ``(1 - sigma)^2 + sigma^2 / sigma_data^2``, DMD2's ImageNet (EDM) x0 loss
    ``(1 / s^2 + 1 / sigma_data^2) (x0_hat - x0)^2`` with ``s = sigma / (1 - sigma)``.
    ``x0`` and ``noise`` are detached (no gradient reaches the student).

    Args:
        v_fake: ``[B, ...]`` the fake score's velocity at ``x_t = (1 - sigma) x0 + sigma noise``.
        x0: ``[B, ...]`` the student's samples.
        noise: ``[B, ...]`` the noise that made ``x_t``.
        sigma: noise level of each row: a float, a 0-d or a ``[B]`` tensor, in ``[0, 1]``. DMD2 draws it
            uniformly over the whole schedule (``sample_dmd_timesteps(min_step_percent=0,
            max_step_percent=1)``).
        weighting: one of ``FAKE_SCORE_WEIGHTINGS``. Default ``"velocity"``.
        sigma_data: ``> 0``, the data scale of ``"edm"`` (0.5, as DMD2). Unused otherwise.
        reduction: ``"mean"`` (default, the mean over all elements as the authors) or ``"sum"`` over rows.

    Returns:
        :class:`DistillationLossOutput` (loss in at least float32); ``stats`` holds ``velocity_mse`` (the
        unweighted ``mean_d (v_fake - u)^2``, batch mean).
    """
    _check_choice("weighting", weighting, FAKE_SCORE_WEIGHTINGS)
    _check_choice("reduction", reduction, REDUCTIONS)
    sigma_data = _check_number("sigma_data", sigma_data, positive=True)
    _check_rows(v_fake=v_fake, x0=x0, noise=noise)
    dtype = _work_dtype(v_fake)
    s = _sigmas(sigma, x0).to(dtype)
    u = noise.detach().to(dtype) - x0.detach().to(dtype)
    err = (v_fake.to(dtype) - u).square()
    if weighting == "velocity":
        per_row = _row_mean(err)
    else:
        lam = (1.0 - s).square()
        if weighting == "edm":
            lam = lam + s.square() / sigma_data**2
        per_row = _row_mean(lam * err)
    stats = {"velocity_mse": _row_mean(err.detach()).mean()}
    return DistillationLossOutput(_reduce(per_row, reduction), stats)


# --------------------------------------------------------------------------------------------------
# DMD2's GAN terms (a classifier head on the fake score's features)


def _logits(name: str, x: Any) -> Tensor:
    if not isinstance(x, Tensor) or x.ndim < 1 or not x.is_floating_point():
        shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating tensor [B] or [B, ...] of classifier logits; received {shape}")
    x = x.to(_work_dtype(x))
    return x.reshape(x.shape[0], -1).mean(dim=1) if x.ndim > 1 else x


def gan_generator_loss(logits_fake: Tensor, *, reduction: str = "mean") -> DistillationLossOutput:
    """DMD2's generator GAN loss, non-saturating: ``softplus(-D(G(z))) = -log sigmoid(D(G(z)))``.

    Args:
        logits_fake: ``[B]`` or ``[B, ...]`` the classifier's logits on the student's samples, with the graph to
            the student (a row's several logits, e.g. DMD2's ``[B, 1]``, are averaged).
        reduction: ``"mean"`` (default, DMD2) or ``"sum"`` over rows.

    Returns:
        :class:`DistillationLossOutput` (loss in at least float32); ``stats`` holds ``p_fake``, the mean
        ``sigmoid(D)`` on the student's samples.
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    fake = _logits("logits_fake", logits_fake)
    stats = {"p_fake": torch.sigmoid(fake.detach()).mean()}
    return DistillationLossOutput(_reduce(F.softplus(-fake), reduction), stats)


def gan_discriminator_loss(
    logits_real: Tensor, logits_fake: Tensor, *, reduction: str = "mean"
) -> DistillationLossOutput:
    """DMD2's classifier loss ``mean softplus(D(fake)) + mean softplus(-D(real))`` (a logistic GAN loss).

    The means are separate, so the real and fake batches may differ in size (DMD2's SD code; its EDM code
    averages the sum, the same for equal sizes). The student's samples are the authors' detached inputs:
    pass logits computed on ``x0.detach()``.

    Args:
        logits_real: ``[B_real]`` or ``[B_real, ...]`` logits on real images (label 1).
        logits_fake: ``[B_fake]`` or ``[B_fake, ...]`` logits on the student's samples (label 0).
        reduction: ``"mean"`` (default, as above) or ``"sum"`` (the sum of both batches' per-row terms).

    Returns:
        :class:`DistillationLossOutput` (loss in at least float32); ``stats`` holds ``p_real`` and ``p_fake``,
        the mean ``sigmoid(D)`` on each batch (DMD2's ``pred_realism_on_real`` / ``_on_fake``).
    """
    _check_choice("reduction", reduction, REDUCTIONS)
    real, fake = _logits("logits_real", logits_real), _logits("logits_fake", logits_fake)
    loss = _reduce(F.softplus(fake), reduction) + _reduce(F.softplus(-real), reduction)
    stats = {"p_real": torch.sigmoid(real.detach()).mean(), "p_fake": torch.sigmoid(fake.detach()).mean()}
    return DistillationLossOutput(loss, stats)


# --------------------------------------------------------------------------------------------------
# times and the two time scales


def _check_percent(name: str, value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1]; received {value!r}")
    return float(value)


def _check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; received {value!r}")
    return value


def dmd_step_range(
    min_step_percent: float = 0.02, max_step_percent: float = 0.98, num_train_timesteps: int = 1000
) -> tuple[int, int]:
    """DMD2's range of steps for the DMD noised point: ``[int(min N), min(int(max N) + 1, N))``.

    The authors' integer arithmetic, truncation included (``int(0.98 * 1000) = 980``): the defaults give
    steps 20..980 of 1000, ``max_step_percent=1`` the whole schedule.

    Args:
        min_step_percent: the lowest step as a fraction of the schedule, in [0, 1]. Default 0.02.
        max_step_percent: the highest, in [min_step_percent, 1]. Default 0.98.
        num_train_timesteps: ``N >= 1``, the schedule's length. Default 1000.

    Returns:
        ``(low, high)``: draw integers in ``[low, high)``.
    """
    lo = _check_percent("min_step_percent", min_step_percent)
    hi = _check_percent("max_step_percent", max_step_percent)
    n = _check_count("num_train_timesteps", num_train_timesteps)
    if hi < lo:
        raise ValueError(f"max_step_percent must be >= min_step_percent; received {hi!r} < {lo!r}")
    low, high = int(lo * n), min(int(hi * n) + 1, n)
    if low >= high:
        raise ValueError(f"min_step_percent={lo!r} leaves no step of a {n}-step schedule (int({lo!r} * {n}) = {low})")
    return low, high


def sample_dmd_timesteps(
    batch: int,
    *,
    generator: torch.Generator,
    min_step_percent: float = 0.02,
    max_step_percent: float = 0.98,
    num_train_timesteps: int | None = None,
    shift: float = 1.0,
    sigma_table: Tensor | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DMDTimesteps:
    """DMD2's time sampling for the DMD point: steps uniform over :func:`dmd_step_range`, as noise levels.

    The steps are ``torch.randint(low, high, [batch], generator=generator)``, the authors' draw (with the
    global generator seeded alike, the same integers). Step ``k`` becomes ``u = k / N`` on the flow model's own
    schedule, shifted as the model is (``sigma = shift u / (1 + (shift - 1) u)``, SD3: 3.0), or
    ``sigma_table[k]`` when a table is given (e.g. DDPM steps converted to flow sigmas,
    ``sqrt(1 - ab_k) / (sqrt(ab_k) + sqrt(1 - ab_k))``, to reproduce DMD2's SD noised points).

    Args:
        batch: ``B >= 1``.
        generator: the ``torch.Generator`` the steps are drawn from (on the device it is on).
        min_step_percent: the lowest step as a fraction of the schedule. Default 0.02. The fake-score loss
            and DMD2's diffusion GAN use the whole schedule: 0 and 1.
        max_step_percent: the highest. Default 0.98.
        num_train_timesteps: ``N``; ``None`` (default) means 1000, or ``len(sigma_table)`` with a table (a
            given ``N`` must then equal it).
        shift: ``> 0``, the model's timestep shift, applied to ``k / N``. Default 1. Not with ``sigma_table``.
        sigma_table: ``[N]`` noise levels in [0, 1] of the schedule's steps, or ``None`` for ``k / N``.
        device: where the result goes. Default: the generator's device.
        dtype: of ``sigma``. Default float32.

    Returns:
        :class:`DMDTimesteps` ``(index [B] long, sigma [B])``.
    """
    batch = _check_count("batch", batch)
    shift = _check_number("shift", shift, positive=True)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (randomness is explicit in flowrl); "
                         f"received {type(generator).__name__}")
    if sigma_table is not None:
        if shift != 1.0:
            raise ValueError("shift and sigma_table are alternatives: a table already holds the shifted sigmas")
        if not isinstance(sigma_table, Tensor) or sigma_table.ndim != 1:
            raise ValueError("sigma_table must be a 1-d tensor [N] of noise levels")
        if num_train_timesteps is not None and num_train_timesteps != sigma_table.shape[0]:
            raise ValueError(f"num_train_timesteps must equal len(sigma_table) = {sigma_table.shape[0]}; "
                             f"received {num_train_timesteps!r}")
        if not bool(((sigma_table >= 0) & (sigma_table <= 1)).all()):
            raise ValueError("sigma_table must hold noise levels in [0, 1] (sigma = 1 is noise)")
        num_train_timesteps = sigma_table.shape[0]
    elif num_train_timesteps is None:
        num_train_timesteps = 1000
    low, high = dmd_step_range(min_step_percent, max_step_percent, num_train_timesteps)
    index = torch.randint(low, high, (batch,), generator=generator, device=generator.device)
    device = generator.device if device is None else torch.device(device)
    index = index.to(device)
    if sigma_table is not None:
        sigma = sigma_table.to(device)[index].to(dtype)
    else:
        u = index.double() / num_train_timesteps
        sigma = (shift * u / (1.0 + (shift - 1.0) * u)).to(dtype)
    return DMDTimesteps(index, sigma)


def is_generator_step(step: int, dfake_gen_update_ratio: int) -> bool:
    """DMD2's two time scales: the student updates when ``step % ratio == 0``, the fake score at every step.

    So over ``r`` steps the fake score takes ``r`` updates and the student one (DMD2: ``r = 5`` on SDXL and
    ImageNet, 10 on SD v1.5; 1 is DMD's single time scale). Flow-Factory updates the student at the last of
    each ``r`` inner steps instead: the same ratio, one step later in the cycle.

    Args:
        step: the training step, >= 0.
        dfake_gen_update_ratio: ``r >= 1``.

    Returns:
        Whether this step also updates the student.
    """
    step = _check_count("step", step, minimum=0)
    ratio = _check_count("dfake_gen_update_ratio", dfake_gen_update_ratio)
    return step % ratio == 0
