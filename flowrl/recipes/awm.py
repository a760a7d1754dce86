"""Advantage Weighted Matching (AWM): the pretraining loss on the policy's own samples, weighted by the
group advantage.

Paper: Xue, Ge, Zhang, Li, Ma, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion
Models" (arXiv 2509.25050); the objective follows the authors' ``train_sd3_awm.py`` (docs/trainers.md,
"AWM"). One epoch:

1. ``collect``: the policy samples the prompts' groups (deterministic Euler ODE by default; the authors use
   a deterministic SA-Solver), the images are scored, the rewards become group advantages (group mean,
   batch std);
2. :func:`train_epoch`: each clean sample is noised afresh (its own ``eps``) at ``train.times.count``
   training times, by default one from each of ``count`` strata of the rollout schedule's positions, shared
   by the whole batch (``share: batch``); the loss is ``-A' l`` with ``l`` minus the (generalised-Huber,
   ``t``-weighted) flow-matching error and ``A' = clip(A, -5, 5) / 5`` (on-policy: the PPO ratio is 1, so
   its gradient is the advantage-weighted flow-matching gradient), plus ``kl_coef mean_d (v - v_ref)^2``
   to the frozen reference and ``ema_kl_coef mean_d (v - v_ema)^2`` to a fast EMA snapshot;
3. the EMA snapshot is pulled toward the current weights after every epoch (``train.ema_snapshot``:
   ``min(0.001 s, 0.3)``).

Where flowrl departs: every update is treated as on-policy (the authors' ``clip_range = 1`` never binds on
their one-step-per-epoch schedule; with ``train.minibatches > 1`` flowrl's later minibatches are slightly
off-policy and unclipped); the EMA snapshot is evaluated with ``torch.func.functional_call``; samples
whose reward is NaN are left out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from typing import Literal

from flowrl.config import RunConfig, bounds
from flowrl.recipes import Recipe
from flowrl.rl.epoch_advantages import AdvantageConfig
from flowrl.rl.forward import ForwardTrainConfig, TimesConfig
from flowrl.rl.setup import ForwardConfig
from flowrl.rl.param_snapshots import SnapshotConfig

__all__ = ["TrainConfig", "Config", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig(ForwardTrainConfig):
    times: TimesConfig = field(default_factory=lambda: TimesConfig(count=2, mode="stratified", share="batch"))
    weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber"  # the surrogate log-likelihood
    power: float = field(default=0.25, metadata=bounds(gt=0))  # p of ghuber
    # A' = clip(A, -c, c) / c * adv_max with c = advantage.clip (the one advantage clip of the run)
    adv_max: float = field(default=1.0, metadata=bounds(gt=0))
    kl_coef: float = field(default=1e-3, metadata=bounds(ge=0))  # to the frozen reference
    ema_kl_coef: float = field(default=0.0, metadata=bounds(ge=0))  # to the fast EMA snapshot
    ema_snapshot: SnapshotConfig = field(default_factory=lambda: SnapshotConfig(start=0, initial=0.0, slope=0.001,
                                                                       maximum=0.3))


@dataclass
class Config(ForwardConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/awm"))
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(std_scope="batch"))
    train: TrainConfig = field(default_factory=TrainConfig)


def train_epoch(model, optimizer, data, sigmas, cfg: Config, dist, epoch: int, *, ema_snapshot=None, ema=None,
                health=None, progress=None) -> dict[str, float]:
    """AWM's loss over the epoch's (sample, training time) pairs; one optimizer step per minibatch.

    Args:
        data: the epoch's :class:`flowrl.rl.forward.ForwardData`.
        sigmas: the rollout schedule (training times are drawn from it).
        ema_snapshot: the fast EMA :class:`flowrl.rl.param_snapshots.ParamSnapshot` (needed when ``ema_kl_coef > 0``).

    Returns:
        ``train/...`` means: ``loss``, ``policy_loss``, ``kl_loss``, ``kl_ref``, ``kl_ema``, ``ratio``,
        ``grad_norm``, ``optimizer_steps``, ``lr``.
    """
    from flowrl.core.forward_losses import awm_loss
    from flowrl.rl.forward import ForwardEpoch

    train = cfg.train
    training = ForwardEpoch(model, optimizer, data, sigmas, train, dist, epoch, seed=cfg.run.seed,
                            grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, ema=ema, health=health,
                            progress=progress)
    for minibatch in training.minibatches():
        for batch in minibatch:
            with torch.no_grad():
                v_ema = training.velocity(batch, snapshot=ema_snapshot) if train.ema_kl_coef > 0 else None
                v_ref = training.velocity(batch, reference=True) if train.kl_coef > 0 else None
            out = awm_loss(training.velocity(batch), batch.target, batch.t, batch.advantages, v_ref=v_ref, v_ema=v_ema,
                           kl_coef=train.kl_coef, ema_kl_coef=train.ema_kl_coef, weighting=train.weighting,
                           power=train.power, adv_clip=cfg.advantage.clip, adv_max=train.adv_max)
            training.backward(out.loss, batch, policy_loss=out.policy_loss, kl_loss=out.kl_loss,
                              kl_ref=out.stats["kl_ref"], kl_ema=out.stats["kl_ema"], ratio_mean=out.stats["ratio"])
        training.step()
    return training.metrics()


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run AWM as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.forward import collect_forward, forward_rows
    from flowrl.rl.setup import ImageTraining
    from flowrl.rl.param_snapshots import ParamSnapshot, optimizer_steps

    setup = ImageTraining(cfg, "awm", model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                        reference=cfg.train.kl_coef > 0,  # the KL term (ema_kl_coef's anchor is a snapshot)
                        plot_groups={"awm": ["train/policy_loss", "train/kl_ref", "train/kl_ema"]})
    run, model = setup.run, setup.model
    ema_snapshot = ParamSnapshot(model, cfg.train.ema_snapshot.schedule()) if cfg.train.ema_kl_coef > 0 else None
    run.track(ema_snapshot=ema_snapshot)

    with run:
        while run.next_epoch():
            rollouts, data, metrics = collect_forward(setup)
            if data is not None:
                with setup.training(forward_rows(data, cfg.train)) as bar:
                    metrics.update(train_epoch(model, setup.optimizer, data, setup.sigmas, cfg, setup.dist,
                                               run.epoch, ema_snapshot=ema_snapshot, ema=setup.ema,
                                               health=run.health, progress=bar))
            if ema_snapshot is not None:
                metrics["train/ema_decay"] = ema_snapshot.update(model, optimizer_steps(setup.optimizer))
            setup.end_epoch(metrics, rollouts)
    return run.finish()

RECIPE = Recipe(Config, main)
