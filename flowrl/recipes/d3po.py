"""D3PO: direct preference optimization of the denoising chain, with online pairs.

Paper: Yang et al., "Using Human Feedback to Fine-tune Diffusion Models without Any Reward Model"
(arXiv 2311.13231); objective in docs/trainers.md, "D3PO". The paper learns from human choices between two
samples of a prompt; flowrl's online recipe makes the pairs itself. One epoch:

1. ``collect``: stochastic rollouts (``sampling.step``: Flow-SDE by default) of the prompts' groups with
   per-step log-probabilities in the training window, scored by the reward;
2. pairs: in every group, the best-rewarded rollout is preferred to the worst (groups whose rewards are all
   equal give no pair);
3. :func:`train_epoch`: the stored transitions of both rollouts are re-scored at the trained steps under the
   policy and under the frozen reference (the rollout's own step function: on-policy the ratio is 1), and
   DPO on the log-ratios: ``mode: trajectory`` (flowrl's default) sums them over the trained steps,
   ``mode: per_step`` (the authors' code) applies DPO at every step and averages, each ratio clamped to
   ``[1 - ratio_clip, 1 + ratio_clip]``.

Where flowrl departs: the pairs come from a reward instead of a person (as D3PO's own reward-model
experiments do); the log-probs are exact Gaussian densities of flowrl's step functions (``sampling.reduction:
mean`` divides by the sample size as the authors' DDIM step does, so their ``beta = 0.1`` carries over);
samples whose reward is NaN never enter a pair.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.setup import OnlineConfig, UpdateConfig

__all__ = ["TrainConfig", "Config", "group_pairs", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig(UpdateConfig):
    micro_batch_size: int = field(default=16, metadata=bounds(ge=1, le=4096))  # pairs per backward, per process
    beta: float = field(default=0.1, metadata=bounds(gt=0))
    mode: Literal["trajectory", "per_step"] = "trajectory"
    ratio_clip: float | None = field(default=None, metadata=bounds(gt=0, lt=1))  # per-step ratio clamp (eps)
    label_smoothing: float = field(default=0.0, metadata=bounds(ge=0, le=0.5))  # conservative DPO


@dataclass
class Config(OnlineConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/d3po"))
    train: TrainConfig = field(default_factory=TrainConfig)

    def check(self) -> None:
        super().check()
        if self.sampling.step == "ode":
            fail("sampling.step", "D3PO compares the log-probabilities of stochastic steps; choose flow_sde, "
                 "dance_sde or cps")
        if self.train.minibatches > self.sampling.groups_per_epoch:
            fail("train.minibatches", "more minibatches than prompt groups (one pair per group)")


def group_pairs(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The best and the worst sample of every group with two distinct finite rewards.

    Args:
        rewards: ``[n]`` (NaN: left out).
        group_ids: ``[n]`` (each group's samples all present).

    Returns:
        ``(chosen [P], rejected [P])`` row indices, one pair per group, in ascending group order (ties: the
        first row).
    """
    chosen, rejected = [], []
    for group in torch.unique(group_ids).tolist():
        rows = torch.nonzero((group_ids == group) & torch.isfinite(rewards)).flatten()
        if rows.numel() < 2:
            continue
        r = rewards[rows]
        best, worst = rows[int(torch.argmax(r))], rows[int(torch.argmin(r))]
        if rewards[best] > rewards[worst]:
            chosen.append(int(best))
            rejected.append(int(worst))
    return torch.tensor(chosen, dtype=torch.long), torch.tensor(rejected, dtype=torch.long)


def _step_log_probs(model, rollouts, rows: torch.Tensor, steps: list[int], velocity) -> torch.Tensor:
    """``[len(rows), len(steps)]`` log-probs of the stored transitions of ``rows`` at ``steps``, scored in one
    model call over every (row, step) pair with the rollout's own step function."""
    traj, device = rollouts.trajectory, model.device
    index = torch.tensor(steps, dtype=torch.long).repeat_interleave(len(rows))  # step-major
    x = torch.cat([traj.state(t, rows) for t in steps]).to(device)
    x_next = torch.cat([traj.state(t + 1, rows) for t in steps]).to(device)
    cond = {k: v.repeat(len(steps), *([1] * (v.ndim - 1))) for k, v in rollouts.cond_rows(rows, device).items()}
    v = velocity(x.to(model.dtype), traj.sigmas[index].to(device), cond)
    return traj.step(v, x, index, x_next=x_next).log_prob.view(len(steps), len(rows)).T


def train_epoch(model, optimizer, rollouts, pairs: tuple[torch.Tensor, torch.Tensor], cfg: Config, dist, epoch: int,
                *, ema=None, health=None, progress=None) -> dict[str, float]:
    """DPO on the trained steps' log-ratios of every pair; one optimizer step per minibatch of pairs.

    Args:
        rollouts: the epoch's :class:`flowrl.rl.collect.EpochRollouts` (this process's samples).
        pairs: ``(chosen [P], rejected [P])`` local rows (:func:`group_pairs`).

    Returns:
        ``train/...`` means: ``loss``, ``log_ratio_chosen``, ``log_ratio_rejected`` (trajectory sums of
        ``logp - logp_ref``), ``kl_ref`` (their mean magnitude), ``implicit_acc`` (pairs whose chosen sample
        has the larger log-ratio), ``pairs``, ``grad_norm``, ``optimizer_steps``, ``lr``.
    """
    from flowrl.core.diffusion_preference import d3po_loss
    from flowrl.rl.passes import (MetricMeans, global_count, minibatch_rows, optimizer_step, pass_scale,
                                  training_passes)

    train, s = cfg.train, cfg.sampling
    steps = rollouts.trained_steps
    velocity = model.velocity_fn(s.guidance)
    params = model.trainable_parameters()
    chosen, rejected = pairs
    stats, grad_norms = MetricMeans(), MetricMeans()
    n_pairs = global_count(dist, chosen)
    for inner in range(train.inner_epochs):
        for idx in minibatch_rows(rollouts.group_ids[chosen], train.minibatches, seed=cfg.run.seed, epoch=epoch,
                                  inner=inner, total=s.groups_per_epoch):
            n_global = global_count(dist, idx)
            if n_global == 0 or not steps:
                continue
            optimizer.zero_grad(set_to_none=True)
            for p in training_passes(idx, [None], train.micro_batch_size, dist):
                m = len(p.rows)
                rows = torch.cat([chosen[p.rows], rejected[p.rows]])
                with torch.no_grad(), model.reference():
                    ref = _step_log_probs(model, rollouts, rows, steps, velocity)
                logp = _step_log_probs(model, rollouts, rows, steps, velocity)
                loss = d3po_loss(logp[:m], ref[:m], logp[m:], ref[m:], beta=train.beta, mode=train.mode,
                                 ratio_clip=train.ratio_clip, label_smoothing=train.label_smoothing).mean()
                dist.backward(loss * pass_scale(p, n_global, dist), model.denoiser, sync=p.sync)
                if p.weight:
                    ratio = (logp.detach() - ref).sum(dim=1)
                    stats.add(m, **{"train/loss": float(loss.detach()),
                                    "train/log_ratio_chosen": float(ratio[:m].mean()),
                                    "train/log_ratio_rejected": float(ratio[m:].mean()),
                                    "train/kl_ref": float(ratio.abs().mean()),
                                    "train/implicit_acc": float((ratio[:m] > ratio[m:]).float().mean())})
                    if progress is not None:
                        progress.update(2 * m * len(steps))
            grad_norms.add(1.0, **{"train/grad_norm": optimizer_step(optimizer, params, dist,
                                                                     grad_clip=cfg.optim.grad_clip, ema=ema,
                                                                     health=health)})
    return {**stats.means(), "train/pairs": n_pairs, "train/grad_norm": grad_norms.means().get("train/grad_norm", 0.0),
            "train/optimizer_steps": int(grad_norms.weights.get("train/grad_norm", 0)),
            "train/lr": optimizer.param_groups[0]["lr"]}


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run D3PO as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.forward import groups_stay_local
    from flowrl.rl.setup import ImageTraining

    setup = ImageTraining(cfg, "d3po", model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                        reference=True,  # the reference's log-probs are in the DPO loss itself
                        plot_groups={"d3po": ["train/log_ratio_chosen", "train/log_ratio_rejected",
                                              "train/implicit_acc"]})
    run, model = setup.run, setup.model
    groups_stay_local(cfg.sampling, setup.dist)

    with run:
        while run.next_epoch():
            rollouts, _, valid, metrics = setup.collect(run.epoch)
            if setup.updates_policy(metrics):
                pairs = group_pairs(torch.where(valid, rollouts.rewards, torch.nan), rollouts.group_ids)
                passes = 2 * pairs[0].numel() * len(rollouts.trained_steps) * cfg.train.inner_epochs
                with setup.training(passes) as bar:
                    metrics.update(train_epoch(model, setup.optimizer, rollouts, pairs, cfg, setup.dist, run.epoch,
                                               ema=setup.ema, health=run.health, progress=bar))
            setup.end_epoch(metrics, rollouts)
    return run.finish()


RECIPE = Recipe(Config, main)
