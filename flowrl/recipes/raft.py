"""Online rejection-sampling fine-tuning (RAFT): the pretraining loss on the policy's own samples that pass.

Paper: Dong, Xiong, Goyal, Pan, Diao, Zhang, Shum, Zhang, "RAFT: Reward rAnked FineTuning for Generative Foundation
Model Alignment" (TMLR 2023), the image case of their section 4. It is the control an RL comparison owes a reader:
supervised learning on the policy's own best samples, with no negative signal and no advantage. One epoch:

1. ``collect``: the policy samples the prompts' groups (deterministic ODE rollouts, as the forward-process
   trainers), the images are scored;
2. the samples that pass are kept (``train.select``): ``correct`` keeps those whose reward detail ``correct`` is 1
   (the shapes reward's gold, strict accuracy), ``best`` the highest-reward sample of each group (the paper's
   best-of-k ranking; a group whose rewards are all equal keeps none), ``above`` those whose reward reaches
   ``train.threshold``;
3. :func:`train_epoch`: the flow-matching loss ``mean_d (v(x_t, t) - (eps - x0))^2`` on the kept samples, each
   noised afresh at ``train.times.count`` training times (uniform in ``(0, 1)`` by default), plus
   ``kl_coef mean_d (v - v_ref)^2`` to the frozen reference.

Where flowrl departs: the paper collects a large pool per stage and fine-tunes for several epochs on it; here each
epoch's kept samples are trained on once, the online form (the same budget shape as the RL trainers it is compared
with). Samples whose reward is NaN are never kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.forward import ForwardTrainConfig, TimesConfig
from flowrl.rl.setup import ForwardConfig

__all__ = ["TrainConfig", "Config", "selected", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig(ForwardTrainConfig):
    times: TimesConfig = field(default_factory=lambda: TimesConfig(count=2, mode="uniform", low=0.0, high=1.0))
    select: Literal["correct", "best", "above"] = "correct"
    threshold: float = 1.0  # select: above
    kl_coef: float = field(default=0.0, metadata=bounds(ge=0))  # mean_d (v - v_ref)^2 to the frozen reference


@dataclass
class Config(ForwardConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/raft"))
    train: TrainConfig = field(default_factory=TrainConfig)

    def check(self) -> None:
        super().check()
        if self.train.select == "correct" and not self.reward.train:
            fail("train.select", "correct keeps the samples whose training reward says details['correct'] = 1; "
                 "configure reward.train")


def selected(rewards: torch.Tensor, group_ids: torch.Tensor, details: dict[str, torch.Tensor], select: str,
             threshold: float = 1.0) -> torch.Tensor:
    """Which samples RAFT trains on, ``[n]`` bool (module docstring; NaN rewards never).

    Args:
        rewards / group_ids: ``[n]`` the epoch's rewards and global group ids (whole groups).
        details: the reward's details ``{name: [n]}`` (``correct`` for ``select="correct"``).
        select: ``correct``, ``best`` or ``above``.

    Raises:
        ValueError: ``select="correct"`` with a reward that reports no ``correct`` detail.
    """
    finite = torch.isfinite(rewards)
    if select == "correct":
        if "correct" not in details:
            raise ValueError("train.select: correct needs a training reward that reports details['correct'] (the "
                             "shapes reward does); use best or above for this reward")
        return finite & (details["correct"] > 0.5)
    if select == "above":
        return finite & (rewards >= threshold)
    keep = torch.zeros_like(finite)
    for group in torch.unique(group_ids).tolist():
        rows = torch.nonzero((group_ids == group) & finite).flatten()
        if rows.numel() and bool(rewards[rows].max() > rewards[rows].min()):
            keep[rows[rewards[rows].argmax()]] = True
    return keep


def train_epoch(model, optimizer, data, sigmas, cfg: Config, dist, epoch: int, *, ema=None, health=None,
                progress=None) -> dict[str, float]:
    """The flow-matching loss on the epoch's kept samples (``data.valid``); one optimizer step per minibatch.

    Returns:
        ``train/...`` means: ``loss``, ``fm_loss``, ``kl_ref``, ``grad_norm``, ``optimizer_steps``, ``lr``.
    """
    from flowrl.core.forward_losses import velocity_error
    from flowrl.rl.forward import ForwardEpoch

    train = cfg.train
    training = ForwardEpoch(model, optimizer, data, sigmas, train, dist, epoch, seed=cfg.run.seed,
                            grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, ema=ema, health=health,
                            progress=progress)
    for minibatch in training.minibatches():
        for batch in minibatch:
            v = training.velocity(batch)
            fm = velocity_error(v, batch.target).mean()
            kl = torch.zeros((), device=v.device)
            if train.kl_coef > 0:
                with torch.no_grad():
                    v_ref = training.velocity(batch, reference=True)
                kl = velocity_error(v, v_ref).mean()
            training.backward(fm + train.kl_coef * kl, batch, fm_loss=fm.detach(), kl_ref=kl.detach())
        training.step()
    return training.metrics()


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run RAFT as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.forward import collect_forward, forward_rows
    from flowrl.rl.setup import ImageTraining

    setup = ImageTraining(cfg, "raft", model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                        reference=cfg.train.kl_coef > 0,  # the KL term
                        plot_groups={"raft": ["train/fm_loss", "train/kept_frac"]})
    run, model = setup.run, setup.model

    with run:
        while run.next_epoch():
            rollouts, data, metrics = collect_forward(setup)
            if data is not None:
                dist = setup.dist
                local = slice(dist.rank * len(rollouts), (dist.rank + 1) * len(rollouts))
                keep = selected(dist.gather(rollouts.rewards), dist.gather(rollouts.group_ids),
                                {k: dist.gather(v) for k, v in rollouts.details.items()}, cfg.train.select,
                                cfg.train.threshold)
                data.valid = data.valid & keep[local]
                metrics["train/kept_frac"] = float(keep.float().mean())
                if int(keep.sum()):
                    with setup.training(forward_rows(data, cfg.train)) as bar:
                        metrics.update(train_epoch(model, setup.optimizer, data, setup.sigmas, cfg, setup.dist,
                                                   run.epoch, ema=setup.ema, health=run.health, progress=bar))
            setup.end_epoch(metrics, rollouts)
    return run.finish()


RECIPE = Recipe(Config, main)
