"""DMDR: distribution matching distillation with a reward term, and its two dynamic cold-start schedules.

Paper: D. Jiang, D. Liu, Z. Wang, Q. Wu, L. Li, H. Li, X. Jin, D. Liu, Z. Li, M. Wang, P. Gao, H. Yang et al.,
"Distribution Matching Distillation Meets Reinforcement Learning" (DMDR, arXiv 2511.13649). DMDR trains DMD2's
few-step student (:mod:`flowrl.core.distillation`: the student, the frozen teacher as the real score, a fake score
trained on the student's samples) and adds a reward on the student's own clean sample, so that distillation and RL
run at once: the reward pulls the student toward high-reward modes of the teacher's distribution, and the
distribution-matching term keeps it on that distribution (the regulariser a reward-only trainer lacks).

The student's loss on a generator step, as the authors compute it::

    loss = dmd_loss(x0) + lambda * reward_loss(x0)            (:func:`dmdr_generator_loss`)

``x0 = G(z)`` is the student's clean sample with its graph; ``dmd_loss`` is :func:`~flowrl.core.distillation.
dmd_generator_loss` at a noised copy of it; ``reward_loss`` is any scalar carrying the graph to ``x0``: the authors'
class-conditional code uses the cross-entropy of a frozen DINOv2 classifier on the decoded image (``-log p(y | x)``),
a text-to-image reward gives ReFL's ``-mean_b r(decode(x0_b))`` (:func:`reward_loss` has both). The
reward term is off during a cold start of the first ``cold_start`` generator steps (DMD alone).

DMDR's two schedules for that cold start, functions of the generator step ``s`` (generator updates made so far,
:func:`generator_steps_done`) and a horizon ``S`` (the authors' ``dynamic_step``)::

    c(s)   = 0.5 (1 + cos(pi min(s / S, 1)))                   (:func:`cosine_decay`: 1 at s = 0, 0 from s = S on)
    DynaRS: sigma ~ Beta(1 + (a - 1) c(s), 1 + (b - 1) c(s))   (:func:`dynamic_beta_params`, :func:`sample_beta_sigmas`)
    DynaDG: m(s) = m_0 c(s) for s < S, 0 after                 (:func:`dynamic_real_mix`)

Dynamic renoise sampling (DynaRS) draws the noise levels of the DMD point and of the fake score's loss from a Beta
that starts skewed toward noise (the authors' ``a = 4, b = 1.5``) and relaxes to uniform at ``S``; ``S = 0`` keeps the
Beta fixed. Dynamic distribution guidance (DynaDG) evaluates the real score with a fraction ``m(s)`` of what the fake
score has learned, the weights ``W_teacher + m(s) (W_fake - W_teacher)`` (the authors run the fake score's LoRA at
scale ``m`` inside the real score), so early on the real score sits between the teacher and the student's
distribution; ``S = 0`` turns it off (the real score is the teacher).

Conventions, shapes and the DMD term's precision are :mod:`flowrl.core.distillation`'s (``sigma = 1`` noise,
``x_t = (1 - sigma) x0 + sigma eps``, velocity ``v = eps - x0``; samples ``[B, ...]``, per-row values ``[B]``).

Sources, read at these commits and run on the same inputs by ``tests/core/test_dmdr.py``
(``tests/core/distillation_reference/dmdr_reference.json``):

- DMDR, the authors' code (their ImageNet demo; the text-to-image code is not released):
  github.com/vvvvvjdy/dmdr @ 061dc296e570adaae2925241bd1de505376a9fce, ``train_cc/sit/train_sitxl_refl_deepspeed.py``
  (the generator update, lines 482-573: the reward 497-513, the real score's LoRA scale 517-521, the DMD and total
  loss 522-566), ``train_cc/sit/utils.py`` (``sample_continue``, ``sample_discrete``),
  ``train_cc/sit/scripts/{cold_start_sitxl,dmdr_sitxl_refl}.sh`` (the values).
- Flow-Factory's DMDR trainer: github.com/X-GenGroup/Flow-Factory, branch ``DMDR`` @
  1796c8d390cd1c05d8c8c247ec062c838e3c1371, ``src/flow_factory/trainers/DMDR/dmdr.py`` (``DMDRTrainer.optimize``)
  and ``DMDR/dmdr_utils.py``: the same statements on a text-to-image adapter, where the reward term is 0 (its only
  reward is the DINOv2 classifier, which needs class labels) and the example config turns both schedules off
  (``dynamic_step: 0``).

Where flowrl departs:

- **Normaliser.** The authors (and Flow-Factory) add ``1e-8`` to the DMD normaliser; :func:`dmdr_generator_loss`
  takes ``eps`` (its default ``1e-8`` is theirs). The recipe keeps DMD2's ``eps = 0`` so that with the reward off and
  no schedule its student update is DMD2's bit for bit; the two differ only where ``mean_d |x0 - x0_hat_real|`` is
  itself ~1e-8.
- **The cosine.** The authors' ``sample_continue`` takes ``cos(3.141593 x)`` in float32; flowrl ``math.cos(math.pi
  x)`` in float64 (the Beta parameters differ by < 1e-6).
- **The Beta draw.** ``torch.distributions.Beta`` takes no generator; :func:`sample_beta_sigmas` draws it under a
  forked CPU random state seeded from an explicit seed (with the global generator seeded alike, the authors' draw).
- **Reward weight and reduction** are the authors' ``loss_gen = dmd_loss + w * reward_loss``, the DMD term averaged
  over all ``B D`` elements (DMD2's reduction) and the reward term as the reward loss reduces (a mean over rows).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from flowrl.core.distillation import DMDGeneratorOutput, dmd_generator_loss
from flowrl.core.forward_losses import _check_number
from flowrl.core.losses import _check_choice

__all__ = [
    "REWARD_LOSSES",
    "DMDRGeneratorOutput",
    "cosine_decay",
    "dmdr_generator_loss",
    "dynamic_beta_params",
    "dynamic_real_mix",
    "generator_steps_done",
    "reward_loss",
    "sample_beta_sigmas",
]

REWARD_LOSSES = ("negative", "hinge", "log")
# Floor of the rewards under "log" (a probability that underflowed to 0 would give an infinite loss).
LOG_REWARD_FLOOR = 1e-12


class DMDRGeneratorOutput(NamedTuple):
    """DMDR's generator loss, its two terms and what is logged with it."""

    loss: Tensor  # [] float64, dmd.loss + reward_weight * reward_loss, carries the graph to x0
    dmd: DMDGeneratorOutput  # the distribution-matching term (its loss, grad, normaliser, stats)
    reward_loss: Tensor  # [] the reward term as given (unweighted), detached
    stats: dict[str, Tensor]  # dmd's stats plus "dmd_loss", "reward_loss" (detached)


def reward_loss(rewards: Tensor, kind: str = "negative", *, margin: float = 2.0) -> Tensor:
    """The reward term's loss on a batch of rewards ``[B]`` (with their graph), reduced by the mean over rows.

    ``"negative"``: ``-mean r`` (DRaFT's, ReFL's without a margin); ``"hinge"``: ``mean relu(margin - r)`` (ReFL's,
    the authors' margin 2 on ImageReward's scale); ``"log"``: ``-mean log r`` for a reward that is a classifier's
    probability of the wanted class, the DMDR authors' cross-entropy (their DINOv2 classifier's ``-log p(y | x)``),
    ``r`` floored at 1e-12.

    Raises:
        ValueError: ``kind`` is not one of ``REWARD_LOSSES``, ``rewards`` is not a floating ``[B]`` tensor, or
            ``"log"`` meets a reward outside ``[0, 1]``.
    """
    _check_choice("kind", kind, REWARD_LOSSES)
    if not isinstance(rewards, Tensor) or rewards.ndim != 1 or not rewards.is_floating_point():
        shape = list(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a floating tensor [B]; received {shape}")
    if kind == "negative":
        return -rewards.mean()
    if kind == "hinge":
        return torch.relu(margin - rewards).mean()
    outside = (rewards < 0) | (rewards > 1)  # NaN is neither: it passes, and the step is skipped downstream
    if bool(outside.any()):
        raise ValueError(f"the reward loss 'log' needs rewards in [0, 1] (a classifier's probability); received "
                         f"{float(rewards[outside][0].detach())!r}: use 'negative' or 'hinge' for this reward")
    return -torch.log(rewards.clamp_min(LOG_REWARD_FLOOR)).mean()


def _check_steps(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0; received {value!r}")
    return value


# --------------------------------------------------------------------------------------------------
# the generator loss


def dmdr_generator_loss(
    x0: Tensor,
    x_t: Tensor,
    sigma: Tensor | float,
    v_real: Tensor,
    v_fake: Tensor,
    reward_loss: Tensor | None,
    *,
    reward_weight: float,
    normalise: bool = True,
    eps: float = 1e-8,
    reduction: str = "mean",
) -> DMDRGeneratorOutput:
    """DMDR's student loss ``dmd_loss + reward_weight * reward_loss`` (the authors' ``loss_gen``).

    The DMD term is :func:`~flowrl.core.distillation.dmd_generator_loss` (its value ``0.5 mean grad^2``, its gradient
    the normalised distribution-matching direction ``grad / (B D)`` on ``x0``); the reward term is added as given, so
    its gradient reaches ``x0`` (and the student) through whatever graph it carries.

    Args:
        x0: ``[B, ...]`` the student's sample, with its graph to the student's parameters.
        x_t: ``[B, ...]`` its noised copy ``(1 - sigma) x0 + sigma eps`` (its graph, if any, is not used).
        sigma: noise level of each row: a float, a 0-d or a ``[B]`` tensor, in ``[0, 1]`` (DynaRS:
            :func:`sample_beta_sigmas`).
        v_real: ``[B, ...]`` the real score's velocity at ``(x_t, sigma)``: the teacher, guided, or under DynaDG the
            teacher with a fraction of the fake score (detached here).
        v_fake: ``[B, ...]`` the fake score's velocity there (detached here).
        reward_loss: ``[]`` the reward loss on ``x0`` with its graph (e.g. ``-mean_b r(decode(x0_b))``, or the
            authors' classifier cross-entropy), or ``None`` (the cold start: the DMD term alone).
        reward_weight: ``lambda >= 0`` (the authors' ``dino_loss_weight``: 0.05 on ImageNet; Flow-Factory's example
            0.5).
        normalise: divide the DMD gradient by ``mean_d |x0 - x0_hat_real|``. Default True.
        eps: added to that normaliser, >= 0. Default 1e-8 (the authors', Flow-Factory's); DMD2's is 0.
        reduction: the DMD term's, ``"mean"`` (default, over all ``B D`` elements) or ``"sum"`` over rows.

    Returns:
        :class:`DMDRGeneratorOutput`; ``stats`` holds the DMD term's (``grad_norm``, ``normaliser``, ``score_gap``,
        ``nonfinite_frac``) and ``dmd_loss``, ``reward_loss`` (0 without a reward term).
    """
    reward_weight = _check_number("reward_weight", reward_weight)
    dmd = dmd_generator_loss(x0, x_t, sigma, v_real, v_fake, normalise=normalise, eps=eps, reduction=reduction)
    if reward_loss is None:
        loss, reward = dmd.loss, torch.zeros((), dtype=torch.float64, device=x0.device)
    else:
        if not isinstance(reward_loss, Tensor) or reward_loss.numel() != 1 or not reward_loss.is_floating_point():
            shape = list(reward_loss.shape) if isinstance(reward_loss, Tensor) else type(reward_loss).__name__
            raise ValueError(f"reward_loss must be a floating scalar tensor (the reduced reward loss); "
                             f"received {shape}")
        reward = reward_loss.reshape(())
        loss = dmd.loss + reward_weight * reward.double()
        reward = reward.detach()
    stats = {**dmd.stats, "dmd_loss": dmd.loss.detach(), "reward_loss": reward.double()}
    return DMDRGeneratorOutput(loss, dmd, reward, stats)


# --------------------------------------------------------------------------------------------------
# the cold start's schedules (DynaRS, DynaDG)


def generator_steps_done(step: int, dfake_gen_update_ratio: int) -> int:
    """Generator updates made before training step ``step`` under DMD2's two time scales
    (:func:`~flowrl.core.distillation.is_generator_step`: the student updates at steps ``0, r, 2r, ...``):
    ``ceil(step / r)``. The authors' ``global_step`` at that point, the clock of the cold start and the schedules."""
    step = _check_steps("step", step)
    if isinstance(dfake_gen_update_ratio, bool) or not isinstance(dfake_gen_update_ratio, int) \
            or dfake_gen_update_ratio < 1:
        raise ValueError(f"dfake_gen_update_ratio must be an integer >= 1; received {dfake_gen_update_ratio!r}")
    return -(-step // dfake_gen_update_ratio)


def cosine_decay(step: int, dynamic_steps: int) -> float:
    """``0.5 (1 + cos(pi min(step / S, 1)))``: 1 at step 0, 0 from step ``S`` on (``S = dynamic_steps > 0``).

    Raises:
        ValueError: ``dynamic_steps`` is 0 (the schedules are off; :func:`dynamic_beta_params` and
            :func:`dynamic_real_mix` say what that means for each) or a count is negative.
    """
    step, dynamic_steps = _check_steps("step", step), _check_steps("dynamic_steps", dynamic_steps)
    if dynamic_steps == 0:
        raise ValueError("cosine_decay needs dynamic_steps > 0 (0 turns the dynamic schedules off)")
    return 0.5 * (1.0 + math.cos(math.pi * min(step / dynamic_steps, 1.0)))


def dynamic_beta_params(alpha: float, beta: float, step: int, dynamic_steps: int) -> tuple[float, float]:
    """DynaRS's Beta parameters at generator step ``step``: ``(1 + (a - 1) c, 1 + (b - 1) c)`` with ``c`` the
    :func:`cosine_decay`, so ``Beta(a, b)`` at step 0 relaxes to ``Beta(1, 1)`` (uniform) at ``dynamic_steps``;
    ``dynamic_steps = 0`` keeps ``(a, b)`` (the authors' ``sample_continue``)."""
    alpha = _check_number("alpha", alpha, positive=True)
    beta = _check_number("beta", beta, positive=True)
    if _check_steps("dynamic_steps", dynamic_steps) == 0:
        _check_steps("step", step)
        return alpha, beta
    c = cosine_decay(step, dynamic_steps)
    return 1.0 + (alpha - 1.0) * c, 1.0 + (beta - 1.0) * c


def dynamic_real_mix(scale: float, step: int, dynamic_steps: int) -> float:
    """DynaDG's fraction of the fake score in the real score at generator step ``step``: ``scale * c`` before
    ``dynamic_steps``, 0 from it on, and always 0 when ``dynamic_steps = 0`` (the authors' ``lora_scale_r``)."""
    scale = _check_number("scale", scale)
    step, dynamic_steps = _check_steps("step", step), _check_steps("dynamic_steps", dynamic_steps)
    if step >= dynamic_steps:
        return 0.0
    return scale * cosine_decay(step, dynamic_steps)


def sample_beta_sigmas(
    batch: int,
    alpha: float,
    beta: float,
    *,
    seed: int,
    step: int = 0,
    dynamic_steps: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """DynaRS's noise levels: ``batch`` draws of ``Beta(a_s, b_s)`` (:func:`dynamic_beta_params`) in ``(0, 1)``.

    Drawn in float32 by ``torch.distributions.Beta`` as the authors' ``sample_continue`` does, under a forked CPU
    random state seeded with ``seed`` (the global generator is left as it was; with it seeded alike, the authors'
    numbers). The level is the noise level itself: no timestep shift (the authors' and Flow-Factory's).

    Args:
        batch: ``B >= 1``.
        alpha, beta: ``a, b > 0`` at step 0 (the authors' ``gui_a = 4``, ``gui_b = 1.5``).
        seed: an integer, the draw's seed.
        step: the generator step (:func:`generator_steps_done`). Default 0.
        dynamic_steps: the schedule's horizon ``S``; 0 (default) keeps ``Beta(a, b)``.
        device: where the result goes. Default CPU.
        dtype: of the result. Default float32.

    Returns:
        ``[B]`` noise levels.
    """
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an integer >= 1; received {batch!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer (randomness is explicit in flowrl); received {seed!r}")
    a, b = dynamic_beta_params(alpha, beta, step, dynamic_steps)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draw = torch.distributions.Beta(torch.tensor(a, dtype=torch.float32),
                                        torch.tensor(b, dtype=torch.float32)).sample((batch,))
    return draw.to(device=device, dtype=dtype)
