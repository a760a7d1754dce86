"""DiffusionNFT: online reinforcement of a flow model on the forward process.

Paper: Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (arXiv 2509.16117);
the objective follows the authors' ``scripts/train_nft_sd3.py`` (docs/trainers.md, "DiffusionNFT"). One epoch:

1. ``collect``: the *old* snapshot samples the prompts' groups with any sampler (deterministic Euler ODE
   by default, ``sampling.step``; the authors use a 2nd-order DPM solver), the images are scored and the
   rewards turned into group advantages (group mean, batch std: ``advantage.std_scope: batch``);
2. :func:`train_epoch`: every clean sample is noised afresh at ``train.times.count`` positions of the
   rollout schedule; the loss contrasts an implicit positive policy ``v+ = b v + (1 - b) v_old`` (pulled
   toward the target velocity by rewarded samples) with an implicit negative one
   ``v- = (1 + b) v_old - b v`` (pulled there by unrewarded ones), each error divided by its adaptive
   normaliser, plus ``kl_coef`` times the squared velocity distance to the frozen reference;
3. the old snapshot is pulled toward the current weights, ``old <- d old + (1 - d) theta``, with
   ``d(s) = min(0.001 s, 0.5)`` over optimizer steps (``train.old``).

Training is CFG-free (the policy is trained without guidance; rollouts may use ``sampling.guidance``).

Where flowrl departs from the authors' code:

- the training times are drawn per epoch from the rollout schedule exactly as the code does (a random
  permutation of the positions per sample, its first ``count``), but each is its own pass with its own
  noise, and the loss is averaged over the epoch's (sample, time) pairs with flowrl's global normalisation
  (one process with accumulation ``2a`` = two with ``a``);
- the old snapshot is a copy of the trained tensors evaluated with ``torch.func.functional_call``
  (``flowrl.rl.param_snapshots``) rather than a second LoRA adapter;
- samples whose reward is NaN are left out of the update and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.config import RunConfig, bounds
from flowrl.recipes import Recipe
from flowrl.rl.epoch_advantages import AdvantageConfig
from flowrl.rl.forward import ForwardTrainConfig
from flowrl.rl.setup import ForwardConfig
from flowrl.rl.param_snapshots import SnapshotConfig

__all__ = ["TrainConfig", "Config", "train_epoch", "main", "RECIPE"]


@dataclass
class TrainConfig(ForwardTrainConfig):
    beta: float = field(default=1.0, metadata=bounds(gt=0))  # b, the implicit policies' step (paper's beta)
    kl_coef: float = field(default=1e-4, metadata=bounds(ge=0))  # weight of mean_d (v - v_ref)^2
    # The old snapshot (sampler and v_old): DiffusionNFT's default decay min(0.001 s, 0.5).
    old: SnapshotConfig = field(default_factory=lambda: SnapshotConfig(start=0, initial=0.0, slope=0.001,
                                                                       maximum=0.5))


@dataclass
class Config(ForwardConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/nft"))
    advantage: AdvantageConfig = field(default_factory=lambda: AdvantageConfig(std_scope="batch"))
    train: TrainConfig = field(default_factory=TrainConfig)


def train_epoch(model, optimizer, data, sigmas, cfg: Config, dist, epoch: int, *, old, ema=None, health=None,
                progress=None) -> dict[str, float]:
    """DiffusionNFT's loss over the epoch's (sample, training time) pairs; one optimizer step per minibatch.

    Args:
        data: the epoch's :class:`flowrl.rl.forward.ForwardData` (clean samples, advantages ``[n]``).
        sigmas: the rollout schedule (training times are drawn from it).
        old: the old :class:`flowrl.rl.param_snapshots.ParamSnapshot` (``v_old``).

    Returns:
        ``train/...`` means: ``loss``, ``policy_loss``, ``kl_loss``, ``kl_ref``, ``old_deviation``,
        ``reward_weight``, ``grad_norm``, ``optimizer_steps``, ``lr``.
    """
    from flowrl.core.forward_losses import nft_loss
    from flowrl.rl.forward import ForwardEpoch

    train = cfg.train
    training = ForwardEpoch(model, optimizer, data, sigmas, train, dist, epoch, seed=cfg.run.seed,
                            grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, ema=ema, health=health,
                            progress=progress)
    for minibatch in training.minibatches():
        for batch in minibatch:
            with torch.no_grad():
                v_old = training.velocity(batch, snapshot=old)
                v_ref = training.velocity(batch, reference=True) if train.kl_coef > 0 else None
            out = nft_loss(training.velocity(batch), v_old, v_ref, batch.x_t, batch.x0, batch.t, batch.advantages,
                           beta=train.beta, kl_coef=train.kl_coef, adv_clip=cfg.advantage.clip)
            training.backward(out.loss, batch, policy_loss=out.policy_loss, kl_loss=out.kl_loss, **out.stats)
        training.step()
    return training.metrics()


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run DiffusionNFT as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.forward import collect_forward, forward_rows
    from flowrl.rl.setup import ImageTraining
    from flowrl.rl.param_snapshots import ParamSnapshot, optimizer_steps

    setup = ImageTraining(cfg, "nft", model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                        reference=cfg.train.kl_coef > 0,  # v_ref enters only the KL term
                        plot_groups={"nft": ["train/policy_loss", "train/old_deviation", "train/old_decay"]})
    run, model = setup.run, setup.model
    old = ParamSnapshot(model, cfg.train.old.schedule())  # the sampler, and v_old of the loss
    run.track(old=old)

    with run:
        while run.next_epoch():
            sample_with = old.velocity_fn(model, cfg.sampling.guidance)  # the old snapshot samples
            rollouts, data, metrics = collect_forward(setup, velocity_fn=sample_with)
            if data is not None:
                with setup.training(forward_rows(data, cfg.train)) as bar:
                    metrics.update(train_epoch(model, setup.optimizer, data, setup.sigmas, cfg, setup.dist,
                                               run.epoch, old=old, ema=setup.ema, health=run.health, progress=bar))
            metrics["train/old_decay"] = old.update(model, optimizer_steps(setup.optimizer))
            setup.end_epoch(metrics, rollouts)
    return run.finish()

RECIPE = Recipe(Config, main)
