"""A toy flow model with a closed-form base velocity, for recipe tests that need a known answer."""

from __future__ import annotations

import torch
from torch import nn

from flowrl.models.base import FlowModel
from rewards import RewardOutput


class ToyFlow(FlowModel):
    """2-D points; data x0 ~ N(0, I), so the base velocity is ``E[eps - x0 | x] = (2 sigma - 1) / s^2 x``
    with ``s^2 = (1 - sigma)^2 + sigma^2``. A zero-initialised MLP adds the trainable correction."""

    latent_shape = (2, 1, 1)

    def __init__(self, hidden: int = 32, **kwargs):
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Linear(3, hidden), nn.SiLU(), nn.Linear(hidden, 2))
        nn.init.zeros_(mlp[2].weight)
        nn.init.zeros_(mlp[2].bias)
        super().__init__(mlp, **kwargs)

    def _encode(self, prompts):
        return {"embedding": torch.zeros(len(prompts), 1)}

    def _predict(self, denoiser, x, sigma, cond):
        s = sigma.view(-1, 1, 1, 1)
        base = (2 * s - 1) / ((1 - s) ** 2 + s**2) * x
        correction = denoiser(torch.cat([x.flatten(1), sigma[:, None]], dim=1)).view_as(x)
        return base + correction

    def decode(self, latents):
        return latents.float()

    def default_lora_targets(self):
        return ["0", "2"]


def first_coordinate_reward(images, prompts, metadata=None) -> RewardOutput:
    """Reward = the first coordinate of the sample: the policy should move its mass to the right."""
    return RewardOutput(images[:, 0, 0, 0].float().clone())


def flow_grpo_epoch(model, cfg, dist, batch, epoch: int, reward, tracker=None):
    """One Flow-GRPO epoch's data, as the recipe's main loop produces it:
    ``(rollouts, advantages [n, T], valid [n], metrics)``."""
    from flowrl.rl.epoch_advantages import compute_advantages
    from flowrl.rl.collect import collect_epoch
    from flowrl.rl.sampling import rollout_step, rollout_window

    s = cfg.sampling
    rollouts = collect_epoch(model, batch, step=rollout_step(s, model.sigmas(s.num_steps)), window=rollout_window(s),
                             epoch=epoch, seed=cfg.run.seed, reward=reward, guidance=s.guidance,
                             batch_size=s.batch_size, store_x0="step_weights" in cfg.advantage.needs,
                             store_means=getattr(cfg.train, "needs_old_means", False))
    advantages, valid, metrics = compute_advantages(rollouts, cfg.advantage, dist, seed=cfg.run.seed, epoch=epoch,
                                                    tracker=tracker, model=model, reward=reward,
                                                    guidance=s.guidance, batch_size=s.batch_size)
    return rollouts, advantages, valid, metrics


def expected_reward(model, steps: int = 10) -> float:
    """Mean first coordinate of 4000 ODE samples at fixed seeds: the toy's expected reward."""
    from flowrl.eval.generate import generate

    images = generate(model, ["p"] * 4000, list(range(10_000, 14_000)), steps=steps, guidance=1.0, batch_size=4000)
    return float(images[:, 0].mean())


def forward_epoch_data(model, cfg, dist, batch, epoch: int, reward, velocity_fn=None):
    """One epoch's data for a forward-process trainer, as its recipe produces it: rollouts with the configured
    (ODE) step, per-sample advantages, as ``(ForwardData, sigmas)``."""
    from flowrl.rl.epoch_advantages import compute_advantages
    from flowrl.rl.collect import collect_epoch
    from flowrl.rl.forward import ForwardData
    from flowrl.rl.sampling import rollout_step, rollout_window

    s = cfg.sampling
    sigmas = model.sigmas(s.num_steps)
    rollouts = collect_epoch(model, batch, step=rollout_step(s, sigmas), window=rollout_window(s), epoch=epoch,
                             seed=cfg.run.seed, reward=reward, guidance=s.guidance, batch_size=s.batch_size,
                             velocity_fn=velocity_fn)
    advantages, valid, _ = compute_advantages(rollouts, cfg.advantage, dist, seed=cfg.run.seed, epoch=epoch,
                                              per_sample=True)
    return ForwardData.from_rollouts(rollouts, advantages, valid), sigmas


TOY_SAMPLING = {"num_steps": 10, "group_size": 16, "groups_per_epoch": 8, "batch_size": 128}


def forward_direction(recipe, train: dict, *, negate: bool, epochs: int = 8, snapshots=None, rollout_snapshot=None,
                      update_snapshots: bool = True, check=None) -> tuple[float, float]:
    """``epochs`` updates of a forward-process recipe on the toy flow from its base model:
    ``(expected reward before, after)``.

    Args:
        recipe: the recipe module (its ``Config`` and ``train_epoch``).
        train: the config's ``train`` section.
        negate: climb the wrong way (``advantage.negate``).
        snapshots: ``{keyword of train_epoch: (cfg) -> DecaySchedule}``, the recipe's snapshots.
        rollout_snapshot: who samples: None (the policy), a keyword of ``snapshots``, or ``(cfg) -> DecaySchedule``
            for a snapshot that only samples.
        update_snapshots: pull every snapshot toward the weights after each epoch.
        check: ``check(metrics)``, called after every epoch.
    """
    import torch

    from flowrl.config import from_dict
    from flowrl.data.prompt_groups import PromptGroups
    from flowrl.dist import Dist
    from flowrl.rl.param_snapshots import ParamSnapshot, optimizer_steps

    cfg = from_dict(recipe.Config, {"sampling": TOY_SAMPLING, "advantage": {"negate": negate}, "optim": {"lr": 3e-3},
                                    "train": {"micro_batch_size": 128, **train}})
    model, dist = ToyFlow(), Dist(cpu=True)
    model.freeze_reference()
    groups = PromptGroups(["p"] * 8, None, groups=8, group_size=16, seed=0)
    optimizer = torch.optim.Adam(model.trainable_parameters(), lr=cfg.optim.lr)
    state = {name: ParamSnapshot(model, schedule(cfg)) for name, schedule in (snapshots or {}).items()}
    rollout = (state.get(rollout_snapshot) if isinstance(rollout_snapshot, str)
               else rollout_snapshot and ParamSnapshot(model, rollout_snapshot(cfg)))
    before = expected_reward(model)
    for epoch in range(epochs):
        velocity_fn = rollout.velocity_fn(model, 1.0) if rollout is not None else None
        data, sigmas = forward_epoch_data(model, cfg, dist, groups.epoch(epoch), epoch, first_coordinate_reward,
                                          velocity_fn=velocity_fn)
        metrics = recipe.train_epoch(model, optimizer, data, sigmas, cfg, dist, epoch, **state)
        assert metrics["train/grad_norm"] > 0
        if check is not None:
            check(metrics)
        for snapshot in {*state.values(), rollout} - {None} if update_snapshots else ():
            snapshot.update(model, optimizer_steps(optimizer))
    return before, expected_reward(model)


def assert_direction(run_updates) -> None:
    """``run_updates(negate)`` raises the toy's expected reward by more than 0.1 from its centred base, and
    lowers it by more than 0.1 when ``negate``."""
    import pytest

    before, after = run_updates(False)
    assert before == pytest.approx(0.0, abs=0.05)  # the base model is centred
    assert after > before + 0.1, (before, after)
    before_neg, after_neg = run_updates(True)
    assert before_neg == pytest.approx(before)
    assert after_neg < before_neg - 0.1, (before_neg, after_neg)
