"""From an epoch's rewards to this process's per-step advantages: the ``advantage`` config section and
:func:`compute_advantages`, the one place the online loop calls an estimator.

Advantages need whole prompt groups, so rewards (and any estimator inputs) are gathered from every
process, the estimator named by ``advantage.estimator`` runs on the whole epoch
(:mod:`flowrl.core.estimators`), and each process keeps its own slice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flowrl.config import bounds, fail
from flowrl.core.estimators import ADVANTAGE_ESTIMATORS, CreditBatch

__all__ = ["AdvantageConfig", "compute_advantages", "advantage_options", "LOOP_INPUTS", "TURN_INPUTS"]

#: The estimator inputs this loop can produce (:mod:`flowrl.rl.credit_inputs`).
LOOP_INPUTS = {"completion_rewards", "step_weights"}


#: The estimator inputs the VLM's episode loop produces (:func:`flowrl.envs.epoch.turn_advantages`).
TURN_INPUTS = {"turn_rewards", "anchor_ids"}
#: Options that apply only to one estimator or normaliser: ``{field: (the names it applies to, its meaning)}``.
#: A value set for another one would be silently ignored, so :meth:`AdvantageConfig.check` refuses it.
_TIED_OPTIONS = {
    "gamma": (("gigpo", "turn_return", "trloo"), "the discount of turn-level credit"),
    "step_weight": (("gigpo",), "the weight of GiGPO's anchor-state term"),
    "tp_balance": (("tp_grpo",), "TP-GRPO's turning-point balance"),
    "cosine_window": (("cosine",), "cosine credit's smoothing window"),
    "cosine_alpha": (("cosine",), "cosine credit's outcome mix"),
}


@dataclass
class AdvantageConfig:
    """The ``advantage`` section of every RL recipe, the image trainers' and the VLM's: from rewards to
    advantages with one estimator of :mod:`flowrl.core.estimators`.

    Each loop produces some estimator inputs and reads some options (:meth:`check_loop`): the image loop's
    denoising trajectories feed the step-credit estimators (``tp_grpo``, ``cosine``), the VLM's episodes the
    turn-level ones (``gigpo``, ``turn_return``, ``trloo``); ``outcome`` runs in both."""

    estimator: str = "outcome"  # a name of flowrl.core.estimators.ADVANTAGE_ESTIMATORS
    # The outcome normalisation: group (the group mean, and the std of std_scope), rloo (the leave-one-out baseline)
    # or per_prompt (per-prompt statistics across epochs; images only). null: the recipe's default (the image
    # recipes: group; the VLM: its algorithm.variant's).
    normalizer: Literal["group", "rloo", "per_prompt"] | None = None
    # normalizer=group: whose std divides. null: the recipe's default (images: group; the VLM: its variant's).
    std_scope: Literal["group", "batch", "none"] | None = None
    eps: float = field(default=1e-4, metadata=bounds(gt=0))
    clip: float = field(default=5.0, metadata=bounds(gt=0))  # advantages are clipped to [-clip, clip]
    # Turn-level credit (the VLM): the discount, and GiGPO's weight of the anchor-state term.
    gamma: float = field(default=0.95, metadata=bounds(ge=0, le=1))
    step_weight: float = field(default=1.0, metadata=bounds(ge=0))
    # normalizer=per_prompt: the rewards kept per prompt, and how many it needs before its own statistics are used.
    per_prompt_buffer: int = field(default=32, metadata=bounds(ge=1))
    per_prompt_min_count: int = field(default=16, metadata=bounds(ge=1))
    negate: bool = False  # control runs only (images): climb the wrong way
    shuffle: bool = False  # control runs only (images): permute whole advantage rows across the epoch
    # tp_grpo: keep equal numbers of positive and negative turning points (largest magnitudes first).
    tp_balance: bool = False
    # cosine: average step contributions over windows of this many steps; alpha mixes in outcome credit.
    cosine_window: int = field(default=1, metadata=bounds(ge=1))
    cosine_alpha: float = field(default=0.0, metadata=bounds(ge=0, le=1))

    def check(self) -> None:
        if self.estimator not in ADVANTAGE_ESTIMATORS.names():
            fail("estimator", f"got {self.estimator!r}; expected one of {', '.join(ADVANTAGE_ESTIMATORS.names())}")
        defaults = AdvantageConfig()
        for name, (users, meaning) in _TIED_OPTIONS.items():
            if getattr(self, name) != getattr(defaults, name) and self.estimator not in users:
                fail(name, f"is {meaning} ({', '.join(users)}); estimator {self.estimator!r} would ignore it: "
                     f"remove it or choose that estimator")
        if self.normalizer != "per_prompt" and (self.per_prompt_buffer, self.per_prompt_min_count) != (
                defaults.per_prompt_buffer, defaults.per_prompt_min_count):
            fail("per_prompt_buffer", "per_prompt_buffer / per_prompt_min_count apply to normalizer: per_prompt only")
        if self.per_prompt_min_count > self.per_prompt_buffer:
            fail("per_prompt_min_count", f"{self.per_prompt_min_count} exceeds per_prompt_buffer "
                 f"{self.per_prompt_buffer} (a history never holds more rewards than the buffer)")

    def check_loop(self, what: str, inputs: set[str], *, normalizers: tuple[str, ...] = ("group", "rloo",
                   "per_prompt"), controls: bool = True) -> None:
        """Refuse what the loop that reads this section cannot do (raised as ``advantage.<field>`` errors from
        the recipe's ``check``).

        Args:
            what: the loop's samples in words, for the error (``"denoising trajectories"``).
            inputs: the estimator inputs the loop produces (:data:`LOOP_INPUTS`, :data:`TURN_INPUTS`).
            normalizers: the outcome normalisations it supports.
            controls: whether it implements the ``negate`` / ``shuffle`` control runs.
        """
        usable = [n for n in ADVANTAGE_ESTIMATORS.names() if set(ADVANTAGE_ESTIMATORS.get(n).needs) <= inputs]
        if self.estimator not in usable:
            fail("advantage.estimator", f"got {self.estimator!r}; expected one of {', '.join(usable)} (the "
                 f"estimators of {what})")
        if self.normalizer is not None and self.normalizer not in normalizers:
            fail("advantage.normalizer", f"got {self.normalizer!r}; the {what} support {', '.join(normalizers)}")
        if not controls and (self.negate or self.shuffle):
            fail("advantage.negate" if self.negate else "advantage.shuffle",
                 f"the control runs are built for the image loop, not for {what}")

    @property
    def needs(self) -> tuple[str, ...]:
        """The optional :class:`flowrl.core.estimators.CreditBatch` inputs the estimator reads."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs


def advantage_options(cfg: AdvantageConfig, tracker=None) -> dict[str, Any]:
    """The estimator keyword options of an ``advantage`` section."""
    return {"normalizer": cfg.normalizer or "group", "std_scope": cfg.std_scope or "group", "eps": cfg.eps,
            "clip": cfg.clip,
            "tp_balance": cfg.tp_balance, "tracker": tracker}


def _shuffle_rows(x: torch.Tensor, valid: torch.Tensor, seed: int, epoch: int) -> torch.Tensor:
    """A random-advantage control: the epoch's advantage rows, permuted among the valid samples."""
    from samplers import derive_seed

    generator = torch.Generator().manual_seed(derive_seed(seed, epoch, 0x5F))
    order = torch.nonzero(valid).flatten()
    x = x.clone()
    x[order] = x[order[torch.randperm(order.numel(), generator=generator)]]
    return x


def compute_advantages(rollouts, cfg: AdvantageConfig, dist, *, seed: int, epoch: int, tracker=None,
                       model=None, reward=None, guidance: float = 1.0, batch_size: int = 32,
                       per_sample: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Gather the epoch's rewards, run the configured estimator on whole groups, keep this process's slice.

    Args:
        rollouts: this process's :class:`flowrl.rl.collect.EpochRollouts`.
        cfg: the ``advantage`` section.
        dist: the run's :class:`flowrl.dist.Dist`.
        seed / epoch: drive the ``shuffle`` control's permutation.
        tracker: the per-prompt history (``normalizer=per_prompt``), owned by the recipe.
        model / reward / guidance / batch_size: for estimators that complete trajectories (``tp_grpo``).
        per_sample: one advantage per sample, ``[n]``, for trainers that use no denoising steps (forward-process
            and preference trainers, whose rollouts may be deterministic); only estimators that need no step
            inputs (``outcome``) apply.

    Returns:
        ``(advantages [n, T] (``[n]`` with ``per_sample``) for the local samples, valid [n] bool (finite
        reward), metrics)``; metrics hold
        ``train/reward_mean``, ``train/reward_std``, ``train/zero_std_frac``, ``train/nan_rewards``,
        ``train/advantage_abs_mean`` (over valid samples and trained steps) and the estimator's
        ``credit/...`` metrics (``credit/extra_nfe`` and ``credit/completion_s`` for completions).
    """
    from flowrl.core.advantages import zero_std_fraction
    from flowrl.rl.credit_inputs import completion_rewards, progress_weights

    estimator = ADVANTAGE_ESTIMATORS.get(cfg.estimator)
    traj = rollouts.trajectory
    steps, T, n_local = traj.trained_steps, traj.num_steps, len(rollouts)
    if per_sample:
        if estimator.needs:
            raise ValueError(f"advantage.estimator {cfg.estimator!r} assigns credit to denoising steps; a "
                             "per-sample advantage needs one that reads only rewards (outcome)")
        steps, T = [0], 1  # one column: the sample's own advantage
    rewards = dist.gather(rollouts.rewards)
    group_ids = dist.gather(rollouts.group_ids)
    valid = torch.isfinite(rewards)
    metrics: dict[str, float] = {}
    inputs: dict[str, torch.Tensor] = {}
    if "completion_rewards" in estimator.needs:
        start = time.perf_counter()
        R_local, nfe = completion_rewards(rollouts, model, reward, guidance=guidance, batch_size=batch_size)
        metrics["credit/completion_s"] = dist.all_reduce_max(time.perf_counter() - start)
        metrics["credit/extra_nfe"] = int(dist.gather(torch.tensor([nfe], dtype=torch.long)).sum())
        inputs["completion_rewards"] = dist.gather(R_local)[valid]
    if "step_weights" in estimator.needs:
        metrics["credit/extra_nfe"] = 0
        inputs["step_weights"] = dist.gather(progress_weights(rollouts, window=cfg.cosine_window,
                                                              alpha=cfg.cosine_alpha))[valid]
    prompts = None
    if cfg.normalizer == "per_prompt":
        prompts = [p for p, ok in zip(dist.gather_object(rollouts.prompts), valid.tolist()) if ok]
    advantages = torch.zeros(rewards.numel(), T)
    if valid.any():
        batch = CreditBatch(rewards=rewards[valid], group_ids=group_ids[valid], steps=steps, num_steps=T,
                            prompts=prompts, **inputs)
        advantages[valid], credit_metrics = estimator(batch, **advantage_options(cfg, tracker))
        metrics.update(credit_metrics)
    if cfg.negate:
        advantages = -advantages
    if cfg.shuffle:
        advantages = _shuffle_rows(advantages, valid, seed, epoch)
    finite = rewards[valid]
    trained = advantages[valid][:, steps] if steps else advantages[valid][:, :0]
    metrics.update({
        "train/reward_mean": float(finite.mean()) if finite.numel() else math.nan,
        "train/reward_std": float(finite.std(unbiased=False)) if finite.numel() else math.nan,
        "train/zero_std_frac": zero_std_fraction(finite, group_ids[valid]) if finite.numel() else math.nan,
        "train/nan_rewards": int((~valid).sum()),
        "train/advantage_abs_mean": float(trained.abs().mean()) if trained.numel() else 0.0,
    })
    local = slice(dist.rank * n_local, (dist.rank + 1) * n_local)
    if per_sample:
        return advantages[local, 0], valid[local], metrics
    return advantages[local], valid[local], metrics
