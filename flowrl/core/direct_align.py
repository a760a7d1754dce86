"""Direct-Align and SRPO's semantic relative reward (Shen, Li, Yang, Zhang, Zhang, Li, Wang, Lu, Tang, "Directly
Aligning the Full Diffusion Trajectory with Fine-Grained Human Preference", 2025): a reward-gradient step at a high
noise level whose clean image is recovered analytically from the noise that was injected.

flowrl follows the authors' FLUX training step (Tencent-Hunyuan/SRPO @ 81e5898, ``fastvideo/SRPO.py``,
``SRPO_train``, with the arguments of ``scripts/finetune/SRPO_training_{hpsv2,ps}.sh``). The conventions are
:mod:`flowrl.core.reward_gradient`'s, which are theirs: ``x_s = (1 - s) x0 + s eps``, ``v = eps - x0``, Euler steps
``x' = x + (s' - s) v(x, s)``. One training step of theirs:

1. roll out a clean sample ``x0`` without gradients from the noise ``eps``; the known noise of the next steps is that
   same initial noise (``noise = input_latents_new``), and flowrl does the same;
2. the **window** (:func:`window`): ``T`` levels (``timestep_length``, 1000) ``w_0 > ... > w_{T-1}`` spaced linearly
   from ``sigma_max`` to ``sigma_min`` (``sigma_schedule[train_timestep]`` of a 50-step shift-3 schedule: 0.964 to
   0.75 in the HPS script, to 0.667 in the PickScore one), a draw ``j ~ U{5, ..., T - 5}`` (:func:`select_range`)
   and the **gap** ``g = min(int((1 - rho) T) + 1, T - j, j)`` (:func:`groundtruth_gap`; ``rho`` is
   ``groundtruth_ratio``, 0.9: the model's step spans about a tenth of the window);
3. **Direct-Align** (:func:`branch_levels`, :func:`recover`), in two branches that share ``j`` and ``x0``:

   - denoising (``m = j``): with ``hi = w_{T - min(m + g, T)}`` and ``lo = w_{T - m}``, inject the known noise at
     ``hi``, ``x_hi = (1 - hi) x0 + hi eps``, take ONE Euler step with gradients down to ``lo``,
     ``x_lo = x_hi + (lo - hi) v(x_hi, hi)``, and remove the rest of the noise analytically,
     ``x0_hat = (x_lo - lo eps) / (1 - lo)``;
   - inversion (``m = max(j - g, 1)``, levels from the same formulas): inject at ``lo``, step with gradients UP to
     ``hi``, recover at ``hi``.

   With the exact velocity ``v = eps - x0`` both give ``x0_hat = x0``; a velocity error ``e = v - (eps - x0)`` gives
   ``x0_hat = x0 - (hi - lo) / (1 - lo) e`` (denoising) and ``x0 + (hi - lo) / (1 - hi) e`` (inversion): the sign flip
   is why the inversion branch's reward *regularises*. Ascending it through an inversion step moves the denoising
   velocity against it;
4. **SRP** (:func:`srp`): each branch scores ``x0_hat`` with the reward ``r`` under two augmentations of the prompt
   ``c`` by a control word (``"<word>. c"``, :func:`augment`; the positive ``SRPO_POSITIVE[step % 4]`` and the
   negative ``SRPO_NEGATIVE[step % 5]``)::

       r_SRP = (1 + k) r(x0_hat, a) - r(x0_hat, b)

   the denoising branch with ``(a, b) = (positive, negative)`` and ``k = discount_pos[m]``, the inversion branch
   with ``(a, b) = (negative, positive)`` and ``k = discount_inv[m]``, where ``discount = linspace(d_0, d_1, T)``
   (:func:`discount_weight`; HPS: ``discount_pos`` 0.1 to 0.25, ``discount_inv`` 0.3 to 0.01; PickScore: 0.1 to 0.5
   and 0.6 to 0.01; index 0 is the clean end of the window). Their CLIP-style rewards compute it in embedding space,
   ``((1 + k) e_a - e_b) . e_img``, which is this difference for any reward linear in the text embedding (PickScore,
   HPS, CLIP score); PickScore's is divided by 20 ("comparable with hps");
5. the loss of each branch is ReFL's hinge ``relu(0.7 - r_SRP)``, and each branch is back-propagated divided by the
   branch count (their ``gradient_accumulation_steps`` 2: one denoising and one inversion pass).

Without control words ``a = b = c`` and ``r_SRP = k r(x0_hat, c)``: the reward of the recovered image weighted by the
timestep's discount, the "pure Direct-Align" the authors' README recommends for rewards SRP does not suit; flowrl
then refuses the inversion branch, which would only push against the reward.

**Where flowrl departs.** The network's time: the authors feed the transformer ``int(1000 s) / 1000`` and, in the
training step, a fixed FLUX guidance 3.5 (the rollout uses ``train_guidence``, 1 or 2); flowrl passes ``s`` and one
guidance. The batch: theirs is one prompt per GPU and one initial noise broadcast to every GPU; flowrl's micro-batches
hold any number of samples, each with its own seeded noise, and draw ``j`` and the control words once per micro-batch.
Not built: the paper's aggregation of rewards over several injected levels under a decaying discount (neither
released script does it); the option of training on real images instead of rollouts; and the later Qwen-Image script
(``fastvideo/SRPO_Qwen.py``: denoising branch only, ``k = 0``, the SRP times a shift-3 discount over ``m``, loss
``-r``). The tests check these functions against numbers produced by ``SRPO_train`` itself on stand-in networks
(tests/core/test_direct_align.py).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from flowrl.core.reward_gradient import Sampled, renoise, truncated_sample

__all__ = ["SRPO_POSITIVE", "SRPO_NEGATIVE", "Levels", "window", "select_range", "groundtruth_gap", "branch_levels",
           "discount_weight", "recover", "srp", "augment"]

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The authors' control words (get_random_realism_adjective, get_random_cg_oily_adjective), written for HPSv2.1.
SRPO_POSITIVE = ("Natural-lighting", "Detail", "Detailed", "Real")
SRPO_NEGATIVE = ("Concept art", "Painting", "Anime", "Flat", "Oil")


class Levels(NamedTuple):
    """One branch's levels: ``index`` ``m`` (the discount's), the injected level ``sigma_from`` where the step with
    gradients starts, and ``sigma_to``, where it ends and the image is recovered."""

    index: int
    sigma_from: float
    sigma_to: float


def window(sigma_max: float, sigma_min: float, length: int) -> torch.Tensor:
    """The ``[length]`` float64 levels from ``sigma_max`` down to ``sigma_min`` (the authors' ``sigmas_l``)."""
    if not 0.0 < sigma_min < sigma_max <= 1.0:
        raise ValueError(f"the window needs 0 < sigma_min < sigma_max <= 1, got {sigma_min}, {sigma_max}")
    return torch.linspace(sigma_max, sigma_min, length, dtype=torch.float64)


def select_range(length: int) -> range:
    """The draws ``j``: the authors' ``random.randint(5, timestep_length - 5)``."""
    if length < 10:
        raise ValueError(f"a window of {length} levels holds no draw in [5, {length - 5}]; use at least 10")
    return range(5, length - 4)


def groundtruth_gap(length: int, groundtruth_ratio: float) -> int:
    """``int((1 - rho) T) + 1``: the window's indices the model's step spans before the draw's bounds apply."""
    if not 0.0 <= groundtruth_ratio < 1.0:
        raise ValueError(f"groundtruth_ratio must be in [0, 1), got {groundtruth_ratio}")
    return int((1 - groundtruth_ratio) * length) + 1


def branch_levels(levels: torch.Tensor, select: int, gap: int, *, invert: bool) -> Levels:
    """The denoising (``invert=False``) or inversion branch's levels for the draw ``select`` (the module docstring,
    step 3; ``levels`` from :func:`window`, ``gap`` from :func:`groundtruth_gap`)."""
    length = levels.numel()
    k = min(length - select, gap, select)
    mid = max(select - k, 1) if invert else select
    start = min(mid + k, length)
    hi, lo = float(levels[length - start]), float(levels[length - mid])
    return Levels(mid, lo, hi) if invert else Levels(mid, hi, lo)


def discount_weight(ends: Sequence[float], length: int, index: int) -> float:
    """``linspace(ends[0], ends[1], length)[index]``: SRP's ``k`` for a branch whose index is ``index``."""
    return float(torch.linspace(ends[0], ends[1], length, dtype=torch.float64)[index])


def recover(velocity: Velocity, x0: torch.Tensor, noise: torch.Tensor, sigma_from: float, sigma_to: float) -> Sampled:
    """Direct-Align's recovered image: ``x0`` noised with the known ``noise`` at ``sigma_from``, one Euler step with
    gradients to ``sigma_to`` (downward: denoising; upward: inversion), then ``(x - sigma_to noise) / (1 - sigma_to)``.
    ``x0`` and ``noise`` carry no gradient; the returned grad point is the step's velocity call."""
    x0, noise = x0.detach(), noise.detach().to(x0)
    x = renoise(x0, noise, sigma_from)
    stepped = truncated_sample(velocity, x, torch.tensor([sigma_from, sigma_to], dtype=torch.float64), grad_steps=1)
    return Sampled((stepped.x - sigma_to * noise) / (1 - sigma_to), stepped.grad_points)


def srp(r_a: torch.Tensor, r_b: torch.Tensor, k: float) -> torch.Tensor:
    """SRP's relative reward ``(1 + k) r_a - r_b`` (the authors' ``SRP_cfg(a, b, image, k)``)."""
    return (1 + k) * r_a - r_b


def augment(prompts: Sequence[str], word: str) -> list[str]:
    """The prompts with a control word in front: ``"<word>. <prompt>"``."""
    return [f"{word}. {p}" for p in prompts]
