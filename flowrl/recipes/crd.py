"""Centered Reward Distillation (CRD): regress a centred implicit reward onto the centred reward.

Paper: Zhu, Wang, Lathuilière, Kalogeiton, "Diffusion Reinforcement Learning via Centered Reward
Distillation" (arXiv 2603.14128); formula and sources in docs/trainers.md, "CRD". One epoch:

1. ``collect``: the *sampling* snapshot rolls out the prompts' groups (deterministic Euler ODE by default,
   no guidance), the images are scored, the rewards become group advantages;
2. :func:`train_epoch`: each prompt group is noised at one shared ``(t, eps)`` per training time
   (``train.times``: ``share: group``, ``noise: group``); the implicit reward
   ``r_theta = -(err(v) / w - err(v_old) / w_old)`` (adaptive normalisers in float64, ``v_old`` from the
   *old* snapshot) is centred within the group, as is the reward weight ``r = clip(A) / 10 + 0.5``, and
   the loss ``(beta Rtheta - Rc)^2 c / beta`` (``c = advantage.clip``) regresses one onto the other, plus a KL anchor
   ``mean_d (v - v_ref_cfg)^2`` to the frozen base model with classifier-free guidance
   (``train.teacher_guidance``), weighted by ``kappa (m + r (1 - m))``: rewarded samples are held close to
   the teacher, unrewarded ones are free;
3. the old and the sampling snapshots are pulled toward the current weights with their own decay
   schedules (``train.old``: ``min(0.25 + 0.005 s, 0.999)``; ``train.rollout_snapshot``: a copy for 75 optimizer
   steps, then ``min(0.0075 (s - 75), 0.999)``). Both are checkpointed, so resume is exact.

Where flowrl departs from the authors' code (Flow-Factory's ``trainers/crd.py``, written by the paper's first
author): centring is per prompt group at a shared ``(t, eps)``, as the method states, not over a gathered
micro-batch that pools prompts and times (docs/trainers.md explains why); every group's samples are kept on
one process and in one pass, so no gathered group means are needed. Samples whose reward is NaN are left
out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.forward import ForwardTrainConfig, TimesConfig
from flowrl.rl.setup import ForwardConfig
from flowrl.rl.param_snapshots import SnapshotConfig

__all__ = ["TrainConfig", "Config", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig(ForwardTrainConfig):
    times: TimesConfig = field(default_factory=lambda: TimesConfig(count=1, mode="schedule", share="group",
                                                                   noise="group"))
    beta: float = field(default=1.0, metadata=bounds(gt=0))  # the implicit reward's inverse temperature
    kl_coef: float = field(default=0.1, metadata=bounds(ge=0))  # kappa, the KL weight at reward weight 1
    kl_floor: float = field(default=1e-4, metadata=bounds(ge=0))  # the KL weight at reward weight 0
    reward_adaptive: bool = True  # weight the KL by the reward (else kappa for every sample)
    adaptive: bool = True  # adaptive normalisers in the implicit reward (the advantage clip is advantage.clip)
    teacher_guidance: float = field(default=4.5, metadata=bounds(ge=0, le=100))  # CFG of the frozen base anchor
    old: SnapshotConfig = field(default_factory=lambda: SnapshotConfig(start=0, initial=0.25, slope=0.005,
                                                                       maximum=0.999))
    rollout_snapshot: SnapshotConfig = field(default_factory=lambda: SnapshotConfig(start=75, initial=0.0, slope=0.0075,
                                                                           maximum=0.999))


    def check(self) -> None:
        if self.times.noise != "group" or self.times.share == "sample":
            fail("times", "CRD centres within a prompt group at one shared (t, eps): set share to group or batch "
                 "and noise to group")
        if self.kl_floor > self.kl_coef > 0:
            fail("kl_floor", f"{self.kl_floor} exceeds kl_coef {self.kl_coef} (the weight at reward 0 cannot exceed "
                 "the weight at reward 1)")


@dataclass
class Config(ForwardConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/crd"))
    train: TrainConfig = field(default_factory=TrainConfig)


def train_epoch(model, optimizer, data, sigmas, cfg: Config, dist, epoch: int, *, old, ema=None, health=None,
                progress=None) -> dict[str, float]:
    """CRD's loss over the epoch's (group, training time) pairs; one optimizer step per minibatch of groups.

    Args:
        data: the epoch's :class:`flowrl.rl.forward.ForwardData`; every group on this process is whole.
        sigmas: the rollout schedule (training times are drawn from it).
        old: the old :class:`flowrl.rl.param_snapshots.ParamSnapshot` (the implicit reward's baseline).

    Returns:
        ``train/...`` means: ``loss``, ``policy_loss``, ``kl_loss``, ``implicit_reward``, ``kl_ref``,
        ``reward_weight``, ``grad_norm``, ``optimizer_steps``, ``lr``.
    """
    from flowrl.core.forward_losses import crd_loss
    from flowrl.rl.forward import ForwardEpoch

    train = cfg.train
    training = ForwardEpoch(model, optimizer, data, sigmas, train, dist, epoch, seed=cfg.run.seed,
                            grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, whole_groups=True,
                            ema=ema, health=health, progress=progress)
    for minibatch in training.minibatches():
        for batch in minibatch:  # whole groups at one shared noised point per group
            with torch.no_grad():
                v_old = training.velocity(batch, snapshot=old)
                # The KL anchor is the reference at the teacher's guidance scale.
                v_ref = training.velocity(batch, reference=train.teacher_guidance) if train.kl_coef > 0 else None
            out = crd_loss(training.velocity(batch), v_old, v_ref, batch.target, batch.advantages, batch.group_ids,
                           beta=train.beta, kl_coef=train.kl_coef, kl_floor=train.kl_floor,
                           reward_adaptive=train.reward_adaptive, adaptive=train.adaptive, adv_clip=cfg.advantage.clip)
            training.backward(out.loss, batch, policy_loss=out.policy_loss, kl_loss=out.kl_loss, **out.stats)
        training.step()
    return training.metrics()


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run CRD as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.forward import collect_forward, forward_rows, groups_stay_local
    from flowrl.rl.setup import ImageTraining
    from flowrl.rl.param_snapshots import ParamSnapshot, optimizer_steps

    setup = ImageTraining(cfg, "crd", model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                        reference=cfg.train.kl_coef > 0,  # v_ref enters only the KL anchor
                        plot_groups={"crd": ["train/policy_loss", "train/implicit_reward", "train/old_decay",
                                             "train/rollout_snapshot_decay"]})
    run, model = setup.run, setup.model
    groups_stay_local(cfg.sampling, setup.dist)
    old = ParamSnapshot(model, cfg.train.old.schedule())  # the implicit reward's baseline
    rollout_snapshot = ParamSnapshot(model, cfg.train.rollout_snapshot.schedule())  # the weights that roll out
    run.track(old=old, rollout_snapshot=rollout_snapshot)

    with run:
        while run.next_epoch():
            sample_with = rollout_snapshot.velocity_fn(model, cfg.sampling.guidance)
            rollouts, data, metrics = collect_forward(setup, velocity_fn=sample_with)
            if data is not None:
                with setup.training(forward_rows(data, cfg.train)) as bar:
                    metrics.update(train_epoch(model, setup.optimizer, data, setup.sigmas, cfg, setup.dist,
                                               run.epoch, old=old, ema=setup.ema, health=run.health, progress=bar))
            steps = optimizer_steps(setup.optimizer)
            metrics["train/old_decay"] = old.update(model, steps)
            metrics["train/rollout_snapshot_decay"] = rollout_snapshot.update(model, steps)
            setup.end_epoch(metrics, rollouts)
    return run.finish()

RECIPE = Recipe(Config, main)
