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

__all__ = ["AdvantageConfig", "compute_advantages", "advantage_options", "LOOP_INPUTS"]

#: The estimator inputs this loop can produce (:mod:`flowrl.rl.credit_inputs`).
LOOP_INPUTS = {"completion_rewards", "step_weights"}


@dataclass
class AdvantageConfig:
    estimator: str = "outcome"  # a name of flowrl.core.estimators.ADVANTAGE_ESTIMATORS
    normalizer: Literal["group", "rloo", "per_prompt"] = "group"  # the outcome normalisation
    std_scope: Literal["group", "batch", "none"] = "group"  # normalizer=group: whose std divides
    eps: float = field(default=1e-4, metadata=bounds(gt=0))
    clip: float = field(default=5.0, metadata=bounds(gt=0))
    per_prompt_buffer: int = field(default=32, metadata=bounds(ge=1))
    per_prompt_min_count: int = field(default=16, metadata=bounds(ge=1))
    negate: bool = False  # control runs only: climb the wrong way
    shuffle: bool = False  # control runs only: permute whole advantage rows across the epoch
    # tp_grpo: keep equal numbers of positive and negative turning points (largest magnitudes first).
    tp_balance: bool = False
    # cosine: average step contributions over windows of this many steps; alpha mixes in outcome credit.
    cosine_window: int = field(default=1, metadata=bounds(ge=1))
    cosine_alpha: float = field(default=0.0, metadata=bounds(ge=0, le=1))

    def check(self) -> None:
        usable = [name for name in ADVANTAGE_ESTIMATORS.names()
                  if set(ADVANTAGE_ESTIMATORS.get(name).needs) <= LOOP_INPUTS]
        if self.estimator not in usable:
            fail("estimator", f"got {self.estimator!r}; expected one of {', '.join(usable)} (the estimators of "
                 "denoising trajectories)")
        if self.per_prompt_min_count > self.per_prompt_buffer:
            fail("per_prompt_min_count", f"{self.per_prompt_min_count} exceeds per_prompt_buffer "
                 f"{self.per_prompt_buffer} (a history never holds more rewards than the buffer)")

    @property
    def needs(self) -> tuple[str, ...]:
        """The optional :class:`flowrl.core.estimators.CreditBatch` inputs the estimator reads."""
        return ADVANTAGE_ESTIMATORS.get(self.estimator).needs


def advantage_options(cfg: AdvantageConfig, tracker=None) -> dict[str, Any]:
    """The estimator keyword options of an ``advantage`` section."""
    return {"normalizer": cfg.normalizer, "std_scope": cfg.std_scope, "eps": cfg.eps, "clip": cfg.clip,
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
