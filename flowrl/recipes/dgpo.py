"""Direct Group Preference Optimization (DGPO): DPO between the positive and the negative half of each
prompt group, with advantage weights, on deterministic rollouts.

Paper: Luo, Hu, Tang, "Reinforcing Diffusion Models by Direct Group Preference Optimization" (ICLR 2026,
arXiv 2510.08425); the objective follows the authors' ``train_sd3_dgpo.py`` (docs/trainers.md, "DGPO").
One epoch:

1. ``collect``: deterministic ODE rollouts of the prompts' groups (from the policy, or from the EMA
   snapshot once ``train.sample_from_ema_after`` optimizer steps are done), scored, turned into group
   advantages;
2. :func:`train_epoch`: the whole batch shares its training times (``train.times.share: batch``, drawn
   without replacement from the first ``high`` fraction of the rollout schedule) and each group shares its
   noise; per group ``s_g = beta / n_g sum_i A_i (err_i - err_ref_i)`` (flow-matching errors of the policy
   and of the frozen reference) and the loss ``softplus(s_g) / beta`` prefers the positive half of the group
   (``A > 0``) to the negative half; plus ``kl_coef mean_d (v - v_ref)^2``. With ``train.clip_range`` a row
   whose error ratio to the EMA snapshot's, ``exp(err_ema - err)``, left ``[1 - c, 1 + c]`` in its
   advantage's direction passes no gradient (PPO-style);
3. the EMA snapshot is pulled toward the current weights after every optimizer step (``train.ema_snapshot``:
   ``min(0.001 s, 0.3)``), as the authors do.

Where flowrl departs: each group's sum is divided by the number of its samples present in the pass (the
code divides by the configured group size and all-reduces partial groups; equal for complete groups), and
every group is kept on one process and in one pass; samples whose reward is NaN are left out and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.epoch_advantages import AdvantageConfig
from flowrl.rl.forward import ForwardTrainConfig, TimesConfig
from flowrl.rl.setup import ForwardConfig
from flowrl.rl.param_snapshots import SnapshotConfig

__all__ = ["TrainConfig", "Config", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig(ForwardTrainConfig):
    times: TimesConfig = field(default_factory=lambda: TimesConfig(count=2, mode="schedule", high=0.5, share="batch",
                                                                   noise="group"))
    beta: float = field(default=100.0, metadata=bounds(gt=0))  # the DPO inverse temperature (beta_dpo)
    kl_coef: float = field(default=0.02, metadata=bounds(ge=0))  # mean_d (v - v_ref)^2 to the frozen reference
    clip_range: float | None = field(default=None, metadata=bounds(gt=0))  # PPO-style clip against the EMA
    ema_snapshot: SnapshotConfig = field(default_factory=lambda: SnapshotConfig(start=0, initial=0.0, slope=0.001,
                                                                       maximum=0.3))
    # Roll out with the EMA snapshot from this many optimizer steps on (None: always the policy).
    sample_from_ema_after: int | None = field(default=None, metadata=bounds(ge=0))


    def check(self) -> None:
        if self.times.noise != "group":
            fail("times.noise", "DGPO compares a group's samples at shared noise: set it to group")


@dataclass
class Config(ForwardConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/dgpo"))
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(std_scope="batch"))
    train: TrainConfig = field(default_factory=TrainConfig)


def train_epoch(model, optimizer, data, sigmas, cfg: Config, dist, epoch: int, *, ema_snapshot, ema=None,
                health=None, progress=None) -> dict[str, float]:
    """DGPO's loss over the epoch's (group, training time) pairs; one optimizer step per minibatch of groups,
    each followed by the EMA snapshot's update.

    Args:
        data: the epoch's :class:`flowrl.rl.forward.ForwardData`; every group on this process is whole.
        sigmas: the rollout schedule (training times are drawn from it).
        ema_snapshot: the EMA :class:`flowrl.rl.param_snapshots.ParamSnapshot` (clip baseline, optional sampler).

    Returns:
        ``train/...`` means: ``loss``, ``policy_loss``, ``kl_ref``, ``group_weight``, ``clip_frac``,
        ``implicit_acc``, ``grad_norm``, ``optimizer_steps``, ``lr``, ``ema_decay`` (the last update's).
    """
    from flowrl.core.diffusion_preference import dgpo_loss
    from flowrl.core.forward_losses import velocity_error
    from flowrl.rl.forward import ForwardEpoch
    from flowrl.rl.param_snapshots import optimizer_steps

    train = cfg.train
    training = ForwardEpoch(model, optimizer, data, sigmas, train, dist, epoch, seed=cfg.run.seed,
                            grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, whole_groups=True,
                            ema=ema, health=health, progress=progress)
    decay = None
    for minibatch in training.minibatches():
        for batch in minibatch:  # whole groups, all at one shared noised point per group
            with torch.no_grad():
                v_ema = training.velocity(batch, snapshot=ema_snapshot) if train.clip_range is not None else None
                v_ref = training.velocity(batch, reference=True)
            v = training.velocity(batch)
            err, err_ref = velocity_error(v, batch.target), velocity_error(v_ref, batch.target)
            old_err = velocity_error(v_ema, batch.target) if v_ema is not None else None
            out = dgpo_loss(err, err_ref, batch.advantages, batch.group_ids, beta=train.beta,
                            adv_clip=cfg.advantage.clip, old_err=old_err, clip_range=train.clip_range)
            kl = velocity_error(v, v_ref).mean()
            training.backward(out.loss + train.kl_coef * kl, batch, policy_loss=out.loss.detach(), kl_ref=kl.detach(),
                              group_weight=out.group_weight, clip_frac=out.clip_frac, implicit_acc=out.implicit_acc)
        training.step()
        decay = ema_snapshot.update(model, optimizer_steps(optimizer))  # as the authors: after every step
    metrics = training.metrics()
    if decay is not None:
        metrics["train/ema_decay"] = decay
    return metrics


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run DGPO as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.forward import collect_forward, forward_rows, groups_stay_local
    from flowrl.rl.setup import ImageTraining
    from flowrl.rl.param_snapshots import ParamSnapshot, optimizer_steps

    setup = ImageTraining(cfg, "dgpo", model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                        reference=True,  # err_ref is in the DPO loss itself
                        plot_groups={"dgpo": ["train/policy_loss", "train/group_weight", "train/implicit_acc"]})
    run, model = setup.run, setup.model
    groups_stay_local(cfg.sampling, setup.dist)
    ema_snapshot = ParamSnapshot(model, cfg.train.ema_snapshot.schedule())  # updated after every optimizer step
    run.track(ema_snapshot=ema_snapshot)
    after = cfg.train.sample_from_ema_after

    with run:
        while run.next_epoch():
            from_ema = after is not None and optimizer_steps(setup.optimizer) >= after
            rollout_velocity = ema_snapshot.velocity_fn(model, cfg.sampling.guidance) if from_ema else None
            rollouts, data, metrics = collect_forward(setup, velocity_fn=rollout_velocity)
            if data is not None:
                with setup.training(forward_rows(data, cfg.train)) as bar:
                    metrics.update(train_epoch(model, setup.optimizer, data, setup.sigmas, cfg, setup.dist,
                                               run.epoch, ema_snapshot=ema_snapshot, ema=setup.ema,
                                               health=run.health, progress=bar))
            metrics["train/sampled_from_ema"] = int(from_ema)
            setup.end_epoch(metrics, rollouts)
    return run.finish()

RECIPE = Recipe(Config, main)
