"""Flow-GRPO: online RL of a flow-matching generator against rewards.

Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (2025), with its "Fast"
variant (train a window of the denoising steps), MixGRPO's sliding window and DanceGRPO's constant-noise
SDE as options. One epoch (docs/architecture.md, "One RL step"):

1. the group sampler picks ``groups_per_epoch`` prompts, each ``group_size`` times, with per-sample seeds;
2. ``collect_epoch``: each process rolls out its shard with the configured SDE step inside the training
   window (ODE outside), decodes, and scores in a background thread while the next batch samples;
3. ``compute_advantages``: rewards are gathered, the configured estimator (outcome, tp_grpo, cosine) runs
   on whole groups, and each process keeps its slice;
4. :func:`train_epoch`: for each inner epoch, minibatch and trained step, the rollout's own step function
   re-scores the stored transition under the current policy (``Trajectory.score_step``); clipped policy
   loss + Gaussian KL to the reference (LoRA adapters off, or a frozen copy); one optimizer step per
   minibatch, with gradient clipping and an EMA of the trained weights.

Where this departs from the paper's code (docs/algorithms.md, "Flow-GRPO"):

- the KL is the exact Gaussian KL ``||mu - mu_ref||^2 / (2 std^2)`` with ``std = g_t sqrt(|dt|)``;
  Flow-GRPO divides by ``g_t^2`` only. ``train.kl_beta_units=flow_grpo`` takes a Flow-GRPO beta as is
  (``beta_t = beta |dt_t|`` per step); with ``flowrl`` units (the default) ``kl_beta`` multiplies the
  exact KL;
- log-probs use ``sampling.reduction`` (``mean`` by default, as Flow-GRPO, whose clip ranges assume it);
- samples whose reward is NaN are masked out of the update and counted, instead of poisoning it;
- the loss is normalised by the global number of (sample, trained step) pairs of the minibatch, so one
  process with accumulation ``2a`` and two processes with accumulation ``a`` take the same step;
  ``train.drop_zero_advantage=true`` first drops samples whose advantage is 0 at every step, as Flow-GRPO
  does (constant groups then no longer dilute the policy gradient against the KL);
- gradients flow through both branches of classifier-free guidance (``train.cfg_grad=full``); Flow-GRPO
  detaches the unconditional branch (``cond_only``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.online import OnlineConfig

__all__ = ["TrainConfig", "Config", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig:
    clip_range: float = field(default=1e-4, metadata=bounds(gt=0, lt=1))  # eps_low
    clip_range_high: float | None = field(default=None, metadata=bounds(gt=0))  # DAPO clip-higher
    dual_clip: float | None = field(default=None, metadata=bounds(gt=1))
    kl_beta: float = field(default=0.0, metadata=bounds(ge=0))
    # flowrl: kl_beta multiplies the exact Gaussian KL; flow_grpo: a Flow-GRPO beta, beta_t = beta |dt_t|.
    kl_beta_units: Literal["flowrl", "flow_grpo"] = "flowrl"
    # full: back-propagate through both CFG branches; cond_only: detach the unconditional one (Flow-GRPO).
    cfg_grad: Literal["full", "cond_only"] = "full"
    # Drop samples whose advantage is 0 at every trained step before averaging (Flow-GRPO).
    drop_zero_advantage: bool = False
    aggregation: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    inner_epochs: int = field(default=1, metadata=bounds(ge=1, le=100))
    minibatches: int = field(default=1, metadata=bounds(ge=1, le=10_000))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1, le=4096))  # samples per backward, per process
    ema_decay: float | None = field(default=None, metadata=bounds(gt=0, lt=1))  # None: no EMA


@dataclass
class Config(OnlineConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/flow_grpo"))
    train: TrainConfig = field(default_factory=TrainConfig)

    def check(self) -> None:
        if self.sampling.step == "ode":
            fail("sampling.step", "Flow-GRPO trains stochastic steps; choose flow_sde, dance_sde or cps")
        if self.train.minibatches > self.sampling.samples_per_epoch:
            fail("train.minibatches", "more minibatches than samples per epoch")


def _kl_weights(cfg: TrainConfig, sigmas: torch.Tensor) -> torch.Tensor:
    """``[T]`` beta of each step's KL term (docs/algorithms.md, "KL regularisation")."""
    if cfg.kl_beta_units == "flow_grpo":
        return cfg.kl_beta * (sigmas[:-1] - sigmas[1:]).abs().double()
    return torch.full((sigmas.numel() - 1,), cfg.kl_beta, dtype=torch.float64)


def train_epoch(model, optimizer, rollouts, advantages: torch.Tensor, valid: torch.Tensor, cfg: Config, dist,
                epoch: int, *, ema=None, health=None, progress=None) -> dict[str, float]:
    """Clipped policy loss + KL over the trained steps; one optimizer step per minibatch.

    Args:
        rollouts: the epoch's :class:`flowrl.rl.collect.EpochRollouts` (this process's samples).
        advantages: ``[n, T]`` (only trained steps are read).
        valid: ``[n]`` bool, samples that take part (finite reward).
        health: a :class:`flowrl.rl.passes.UpdateHealth` that counts updates skipped for non-finite values.
        progress: advanced by the number of samples of every (micro-batch, trained step) pass.

    Returns:
        Means over the epoch of the loss statistics (``train/...``).
    """
    from flowrl.core.losses import clipped_policy_loss, gaussian_kl
    from flowrl.rl.passes import (MetricMeans, global_count, minibatch_rows, optimizer_step, pass_scale,
                                  training_passes)

    t_cfg = cfg.train
    traj = rollouts.trajectory
    steps = traj.trained_steps
    device = model.device
    velocity = model.velocity_fn(cfg.sampling.guidance, detach_uncond=t_cfg.cfg_grad == "cond_only")
    kl_weights = _kl_weights(t_cfg, traj.sigmas)
    params = model.trainable_parameters()
    take_part = valid.clone()
    if t_cfg.drop_zero_advantage and steps:
        take_part &= (advantages[:, steps] != 0).any(dim=1)
    stats, grad_norms = MetricMeans(), MetricMeans()
    for inner in range(t_cfg.inner_epochs):
        for rows in minibatch_rows(rollouts.sample_ids, t_cfg.minibatches, seed=cfg.run.seed, epoch=epoch,
                                   inner=inner, total=cfg.sampling.samples_per_epoch):
            rows = rows[take_part[rows]]
            n_global = global_count(dist, rows)
            if n_global == 0 or not steps:
                continue
            optimizer.zero_grad(set_to_none=True)
            for p in training_passes(rows, steps, t_cfg.micro_batch_size, dist):
                m, t = p.rows, p.unit
                x = traj.state(t, m).to(device)
                sigma, cond = traj.sigmas[t].to(device).expand(len(m)), rollouts.cond_rows(m, device)
                out = traj.score_step(velocity(x.to(model.dtype), sigma, cond), t, m)
                policy = clipped_policy_loss(out.log_prob[:, None], traj.log_probs[m, t].to(device)[:, None],
                                             advantages[m, t].to(device)[:, None], None,
                                             eps_low=t_cfg.clip_range, eps_high=t_cfg.clip_range_high,
                                             dual_clip=t_cfg.dual_clip, aggregation="token_mean")
                loss, kl = policy.loss, torch.zeros((), device=device)
                if t_cfg.kl_beta > 0:
                    with torch.no_grad(), model.reference():
                        ref_mean = traj.score_step(velocity(x.to(model.dtype), sigma, cond), t, m).mean
                    kl = gaussian_kl(out.mean, ref_mean, out.std, reduction=cfg.sampling.reduction).mean()
                    loss = loss + float(kl_weights[t]) * kl
                units = len(steps) if t_cfg.aggregation == "token_mean" else 1
                dist.backward(loss * pass_scale(p, n_global, dist, units), model.denoiser, sync=p.sync)
                if p.weight:
                    stats.add(len(m), **{"train/loss": float(loss.detach()), "train/ratio_mean": float(policy.ratio_mean),
                                         "train/clip_frac": float(policy.clip_frac),
                                         "train/approx_kl": float(policy.approx_kl), "train/kl_ref": float(kl.detach())})
                    if progress is not None:
                        progress.update(len(m))
            grad_norms.add(1.0, **{"train/grad_norm": optimizer_step(optimizer, params, dist,
                                                                     grad_clip=cfg.optim.grad_clip, ema=ema,
                                                                     health=health)})
    metrics = {**stats.means(), "train/grad_norm": grad_norms.means().get("train/grad_norm", 0.0),
               "train/optimizer_steps": int(grad_norms.weights.get("train/grad_norm", 0)),
               "train/lr": optimizer.param_groups[0]["lr"],
               "train/dropped_zero_advantage": int((valid & ~take_part).sum())}
    return metrics


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run Flow-GRPO as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.online import OnlineLoop

    online = OnlineLoop(cfg, "flow_grpo", model=model, dist=dist, ema_decay=cfg.train.ema_decay)
    run, model, s = online.run, online.model, cfg.sampling

    with run:
        while run.next_epoch():
            epoch = run.epoch
            rollouts, advantages, valid, metrics = online.collect(epoch, store_x0="step_weights" in cfg.advantage.needs)
            if online.updates_policy(metrics):  # False: every reward NaN, or a discriminator-only epoch
                # One tick per (sample, trained step) forward-backward pass.
                passes = int(valid.sum()) * len(rollouts.trained_steps) * cfg.train.inner_epochs
                with online.training(passes) as bar:
                    metrics.update(train_epoch(model, online.optimizer, rollouts, advantages, valid, cfg, online.dist,
                                               epoch, ema=online.ema, health=run.health, progress=bar))
            online.end_epoch(metrics, rollouts)
    return run.finish()


RECIPE = Recipe(Config, main)
