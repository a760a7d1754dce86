"""Reward-gradient fine-tuning (ReFL, DRaFT-K, DRaFT-LV, Direct-Align): backpropagate a differentiable reward through
the sampler.

Papers: Xu, Liu, Wu, Tong, Li, Ding, Tang, Dong, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation" (NeurIPS 2023), its ReFL; Clark, Vicol, Swersky, Fleet, "Directly Fine-Tuning Diffusion
Models on Differentiable Rewards" (ICLR 2024), DRaFT-K and DRaFT-LV; Shen, Li, Yang, Zhang, Zhang, Li, Wang, Lu,
Tang, "Directly Aligning the Full Diffusion Trajectory with Fine-Grained Human Preference" (2025), Direct-Align and
SRPO's relative reward. The formulas and the departures from the authors' scripts are in
:mod:`flowrl.core.reward_gradient`, :mod:`flowrl.core.direct_align` and docs/trainers.md ("Reward-gradient
trainers"). One epoch:

1. the epoch's prompts (``sampling.groups_per_epoch x group_size``, as every online trainer draws them) are split
   into ``train.minibatches`` optimizer steps of micro-batches of ``train.micro_batch_size``;
2. per micro-batch, the policy's own Euler ODE sampler (``model.sigmas(sampling.num_steps)``,
   ``model.velocity_fn(sampling.guidance)``) runs from the samples' seeded noise: ``train.method`` ``refl`` takes
   its one gradient step at a step drawn uniformly from ``[refl_low, refl_high)`` of the schedule and scores the clean
   prediction there; ``draft`` keeps gradients through the last ``train.k`` steps and scores the sample; ``draft_lv``
   samples without gradients, re-noises the sample ``train.lv_samples`` times at the last step's level and denoises
   once with gradients; ``direct_align`` samples without gradients, injects the sample's own initial noise at a level
   drawn from the window ``[da_sigma_min, da_sigma_max]``, takes one step with gradients and recovers the clean image
   analytically (and, with ``da_discount_inv``, an inversion branch: one step up the noise levels, back-propagated
   separately);
3. the latents are decoded with gradients (``model.decode``) and the training reward scores the images (which
   require grad); the loss (ReFL's ``loss_scale * mean relu(margin - r)``, DRaFT's ``-loss_scale * mean r``;
   Direct-Align's on SRP's ``srp_scale ((1 + k) r(x, "<positive word>. prompt") - r(x, "<negative word>. prompt"))``,
   ``k`` the branch's discount at the drawn level, ``k r(x, prompt)`` without control words), plus
   ``kl_coef mean_d (v - v_ref)^2`` to the frozen reference at every velocity call that carries gradient, is
   back-propagated; each minibatch ends with the shared guarded optimizer step (gradient clipping at
   ``optim.grad_clip``, a non-finite gradient skipped and counted).

The training reward must be differentiable: a reward that declares it is not is refused when the config loads, one
whose builder decides (e.g. ``artifact``, ``jpeg_*``) when the run sets up. Where flowrl departs: each epoch draws
fresh prompts and noise (no pretraining-data loss as in the ImageReward paper; ``kl_coef`` is the regulariser); the
ReFL step and Direct-Align's level and control words are drawn once per micro-batch (the authors: once per batch);
samples whose reward is NaN make the step's gradient non-finite, which skips it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.sampling import SamplingConfig
from flowrl.rl.setup import OnlineConfig, UpdateConfig

__all__ = ["TrainConfig", "Config", "not_differentiable", "check_differentiable", "train_epoch", "main", "RECIPE",
           "dry_run_overrides", "dry_run_work"]


@dataclass
class TrainConfig(UpdateConfig):
    """``inner_epochs``: passes over the epoch's samples (the same prompts and initial noise, the updated policy);
    ``minibatches``: optimizer steps per pass; ``micro_batch_size``: samples per backward (UpdateConfig's)."""

    method: Literal["refl", "draft", "draft_lv", "direct_align"] = "draft"
    k: int = field(default=1, metadata=bounds(ge=1, le=1000))  # draft: steps with gradient at the chain's end
    lv_samples: int = field(default=2, metadata=bounds(ge=1, le=64))  # draft_lv: re-noisings of each sample
    refl_low: float = field(default=0.75, metadata=bounds(ge=0, lt=1))  # refl: the window [low, high) of the
    refl_high: float = field(default=1.0, metadata=bounds(gt=0, le=1))  # schedule's steps (authors: 30..39 of 40)
    # The hinge relu(margin - r) (ReFL's authors: 2, on ImageReward's scale); None: -r (DRaFT's loss).
    margin: float | None = None
    loss_scale: float = field(default=1.0, metadata=bounds(gt=0))  # ReFL's grad_scale (the authors: 1e-3)
    kl_coef: float = field(default=0.0, metadata=bounds(ge=0))  # mean_d (v - v_ref)^2 to the frozen reference
    # direct_align (flowrl/core/direct_align.py; the authors' argument in brackets, defaults their HPS script's):
    # the window of injected levels, noisiest to cleanest [sigma_schedule[train_timestep] of 50 shift-3 steps]
    da_sigma_max: float = field(default=0.9643, metadata=bounds(gt=0, le=1))
    da_sigma_min: float = field(default=0.75, metadata=bounds(gt=0, lt=1))
    da_length: int = field(default=1000, metadata=bounds(ge=10, le=100_000))  # levels in it [timestep_length]
    # the share of the window's span not taken by the model's step [groundtruth_ratio]
    da_groundtruth_ratio: float = field(default=0.9, metadata=bounds(ge=0, lt=1))
    # SRP's k at the window's clean end and at its noisy end, denoising branch [discount_pos]
    da_discount: tuple[float, float] = (0.1, 0.25)
    # the same for the inversion branch [discount_inv] (0.3, 0.01); null: no inversion branch (needs control words)
    da_discount_inv: tuple[float, float] | None = None
    # SRP's control words, cycled per micro-batch (the authors': SRPO_POSITIVE, SRPO_NEGATIVE); empty: none, the
    # reward of the prompt itself times k
    srp_positive: list[str] = field(default_factory=list)
    srp_negative: list[str] = field(default_factory=list)
    srp_scale: float = field(default=1.0, metadata=bounds(gt=0))  # the objective's scale (authors: PickScore / 20)
    micro_batch_size: int = field(default=4, metadata=bounds(ge=1, le=4096))  # samples per backward, per process


@dataclass
class Config(OnlineConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/reward_gradient"))
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(step="ode"))
    train: TrainConfig = field(default_factory=TrainConfig)

    def check(self) -> None:
        super().check()
        t, s = self.train, self.sampling
        if t.method == "refl":
            from flowrl.core.reward_gradient import refl_step_range

            try:
                refl_step_range(s.num_steps, t.refl_low, t.refl_high)
            except ValueError as err:
                fail("train.refl_low", str(err))
        if t.method == "direct_align":
            from flowrl.core.direct_align import window

            try:
                window(t.da_sigma_max, t.da_sigma_min, t.da_length)
            except ValueError as err:
                fail("train.da_sigma_min", str(err))
            if bool(t.srp_positive) != bool(t.srp_negative):
                fail("train.srp_negative" if t.srp_positive else "train.srp_positive", "SRP needs control words on "
                     "both sides (srp_positive and srp_negative), or none")
            if t.da_discount_inv is not None and not t.srp_positive:
                fail("train.da_discount_inv", "the inversion branch ascends the negative control word's reward; "
                     "without control words (train.srp_positive, srp_negative) it only pushes against the reward: "
                     "set the words or da_discount_inv: null")
        if t.method == "draft" and t.k > s.num_steps:
            fail("train.k", f"{t.k} steps with gradient exceed the {s.num_steps} of the schedule; use at most "
                 f"{s.num_steps} (that is full backpropagation)")
        if s.base_last_steps:
            fail("sampling.base_last_steps", "the reward-gradient trainers back-propagate through the policy's own "
                 "last steps; set it to 0")
        if s.groups_per_epoch * s.group_size < t.minibatches:
            fail("train.minibatches", f"{t.minibatches} optimizer steps need at least as many samples per epoch "
                 f"({s.groups_per_epoch * s.group_size})")
        for name in not_differentiable(self.reward.train):
            fail("reward.train", f"{name} is not differentiable, and {t.method} back-propagates the reward into the "
                 "images: train on a differentiable reward (shapes_proxy, pickscore, aesthetic, hpsv2, clip_score) "
                 "or use a policy-gradient trainer (flow_grpo, nft)")


def _declared_not_differentiable(registered: str) -> bool:
    """Whether the reward registered as ``registered`` declares ``differentiable = False`` in its own class (a reward
    whose instances decide, e.g. ``artifact``, is checked once built: :func:`check_differentiable`)."""
    from rewards.base import Reward
    from rewards.registry import REWARDS

    cls = REWARDS.get(registered)
    if not isinstance(cls, type):
        return False
    declared = [c for c in cls.__mro__ if c is not Reward and "differentiable" in vars(c)]
    return bool(declared) and vars(declared[0])["differentiable"] is False


def not_differentiable(spec: Any) -> list[str]:
    """The entries of a ``reward.train`` spec (a mapping, as rewards.compose reads it) whose reward declares it is not
    differentiable."""
    if isinstance(spec, str):
        from rewards.compose import parse_reward_string

        spec = parse_reward_string(spec)
    found: list[str] = []
    for key, entry in (spec or {}).items():
        if key == "gated" and isinstance(entry, dict):
            for side in ("alignment", "quality"):
                found += [f"gated.{name}" for name in not_differentiable(entry.get(side))]
            continue
        registered = entry.get("reward", key) if isinstance(entry, dict) else key
        if _declared_not_differentiable(registered):
            found.append(key if registered == key else f"{key} ({registered})")
    return found


def check_differentiable(reward, spec: Any) -> None:
    """Raise a one-line ConfigError unless the built training reward is differentiable."""
    from flowrl.config import ConfigError

    if not getattr(reward, "differentiable", False):
        names = ", ".join(spec) if isinstance(spec, dict) else str(spec)
        raise ConfigError("reward.train", f"{names} built a reward that is not differentiable ({reward!r}); the "
                          "reward-gradient trainers back-propagate the reward into the images: train on a "
                          "differentiable reward (shapes_proxy, pickscore, aesthetic, hpsv2, clip_score)")


def _velocity_at_reference(model, guidance: float, point, cond) -> torch.Tensor:
    with torch.no_grad(), model.reference():
        x = point.x.to(model.dtype)
        return model.velocity_fn(guidance)(x, torch.full((x.shape[0],), point.sigma, device=x.device), cond).float()


def train_epoch(setup, batch, cfg: Config, epoch: int, *, progress=None) -> dict[str, float]:
    """One epoch of the configured method on this process's share of the epoch's samples (``batch``, a
    :class:`flowrl.data.prompt_groups.EpochBatch`).

    Returns:
        ``train/...``: ``reward_mean``, ``reward_std``, ``nan_rewards``, ``loss``, ``kl_ref``, ``grad_norm``,
        ``optimizer_steps``, ``lr``; for ReFL ``refl_step`` (the mean gradient step index); for Direct-Align ``srp``
        (the objective the hinge acts on, mean over branches and samples) and ``da_sigma`` (the denoising branch's
        mean injected level), its ``reward_mean`` the denoising branch's reward under the positive prompt.
    """
    from flowrl.core import direct_align as da
    from flowrl.core import reward_gradient as rg
    from flowrl.models.base import encode_rows
    from flowrl.run.updates import optimizer_step
    from samplers import initial_noise
    from samplers.noise import derive_seed

    model, dist, t, s = setup.model, setup.dist, cfg.train, cfg.sampling
    reward, sigmas = setup.reward, setup.sigmas.to(model.device)
    params = model.trainable_parameters()
    velocity = model.velocity_fn(s.guidance)
    n = len(batch.prompts)
    bounds_ = [round(i * n / t.minibatches) for i in range(t.minibatches + 1)]
    window = rg.refl_step_range(s.num_steps, t.refl_low, t.refl_high) if t.method == "refl" else None
    if t.method == "direct_align":
        levels = da.window(t.da_sigma_max, t.da_sigma_min, t.da_length)
        draws, gap = da.select_range(t.da_length), da.groundtruth_gap(t.da_length, t.da_groundtruth_ratio)
    minibatches = [(lo, hi) for _ in range(t.inner_epochs) for lo, hi in zip(bounds_[:-1], bounds_[1:])]
    per_epoch = sum(len(range(lo, hi, t.micro_batch_size)) for lo, hi in minibatches)
    rewards_all, losses, kls, norms, steps_used, srps, da_sigmas = [], [], [], [], [], [], []
    micro = 0
    for lo, hi in minibatches:
        if hi <= lo:
            continue
        starts = list(range(lo, hi, t.micro_batch_size))
        for start in starts:
            rows = slice(start, min(start + t.micro_batch_size, hi))
            prompts, metadata = batch.prompts[rows], batch.metadata[rows]
            seeds = batch.sample_seeds[rows]
            cond = encode_rows(model, prompts, metadata)
            x = initial_noise(model.latent_shape, seeds, device=model.device)
            gen = torch.Generator().manual_seed(derive_seed(cfg.run.seed, epoch, int(seeds[0]), micro))
            index = epoch * per_epoch + micro  # the control words' turn
            micro += 1
            share = (rows.stop - rows.start) / (hi - lo)

            def v_fn(x_, sigma_):
                return velocity(x_.to(model.dtype), sigma_, cond).float()

            def score(latents):
                images = model.decode(latents)
                return reward(images, prompts, metadata).scores.to(latents.device).float()

            def direct_align_passes():
                """Direct-Align's branches, each yielded (and back-propagated) before the next is built."""
                with torch.no_grad():
                    x0 = rg.truncated_sample(v_fn, x, sigmas, grad_steps=0).x
                select = draws[int(torch.randint(len(draws), (1,), generator=gen))]
                pos = neg = prompts
                if t.srp_positive:
                    pos = da.augment(prompts, t.srp_positive[index % len(t.srp_positive)])
                    neg = da.augment(prompts, t.srp_negative[index % len(t.srp_negative)])
                branches = [(False, pos, neg, t.da_discount)]
                if t.da_discount_inv is not None:
                    branches.append((True, neg, pos, t.da_discount_inv))
                for invert, a, b, ends in branches:
                    lv = da.branch_levels(levels, select, gap, invert=invert)
                    out = da.recover(v_fn, x0, x, lv.sigma_from, lv.sigma_to)
                    images = model.decode(out.x)
                    r_a = reward(images, a, metadata).scores.to(x.device).float()
                    r_b = r_a if b is a else reward(images, b, metadata).scores.to(x.device).float()
                    objective = t.srp_scale * da.srp(r_a, r_b, da.discount_weight(ends, t.da_length, lv.index))
                    srps.append((float(objective.detach().mean()) / len(branches), share))
                    if not invert:
                        da_sigmas.append((lv.sigma_from, share))
                    loss_ = rg.refl_loss(objective, t.margin, t.loss_scale) / len(branches)
                    yield loss_, out.grad_points, None if invert else r_a, len(branches)

            if t.method == "direct_align":
                passes = direct_align_passes()
            elif t.method == "draft_lv":
                with torch.no_grad():
                    x_n = rg.truncated_sample(v_fn, x, sigmas, grad_steps=0).x
                noises = torch.randn((t.lv_samples, *x.shape), generator=gen).to(x.device)
                r_all, points = rg.lv_rewards(v_fn, x_n, sigmas, noises, score)
                # [B] each sample's mean over its re-noisings; margin None: -mean r (DRaFT)
                passes = [(rg.refl_loss(r_all.flatten(), t.margin, t.loss_scale), points, r_all.mean(0), 1)]
            else:
                if t.method == "refl":
                    k = window[int(torch.randint(len(window), (1,), generator=gen))]
                    steps_used.append(k)
                    out = rg.refl_sample(v_fn, x, sigmas, step=k)
                else:
                    out = rg.truncated_sample(v_fn, x, sigmas, grad_steps=t.k)
                r_mean = score(out.x)
                passes = [(rg.refl_loss(r_mean, t.margin, t.loss_scale), out.grad_points, r_mean, 1)]
            for j, (loss, points, r_mean, n_passes) in enumerate(passes):
                kl = torch.zeros((), device=loss.device)
                if t.kl_coef > 0:
                    for p in points:  # each pass's mean over its calls, the passes' mean over the micro-batch
                        v_ref = _velocity_at_reference(model, s.guidance, p, cond)
                        kl = kl + (p.v - v_ref).pow(2).mean() / (len(points) * n_passes)
                last = start == starts[-1] and j == n_passes - 1
                dist.backward((loss + t.kl_coef * kl) * share, model.denoiser, sync=last)
                if r_mean is not None:
                    rewards_all.append(r_mean.detach().float().cpu())
                losses.append((float(loss.detach()), share))
                kls.append((float(kl.detach()), share))
            if progress is not None:
                progress.update(rows.stop - rows.start)
        norms.append(optimizer_step(setup.optimizer, params, dist, grad_clip=cfg.optim.grad_clip, ema=setup.ema,
                                    health=setup.run.health))
        setup.optimizer.zero_grad(set_to_none=True)
    rewards = dist.gather(torch.cat(rewards_all))
    finite = rewards[torch.isfinite(rewards)]
    steps = len(norms)
    metrics = {"train/reward_mean": float(finite.mean()) if finite.numel() else math.nan,
               "train/reward_std": float(finite.std()) if finite.numel() > 1 else 0.0,
               "train/nan_rewards": int(rewards.numel() - finite.numel()),
               "train/loss": sum(v * w for v, w in losses) / steps, "train/kl_ref": sum(v * w for v, w in kls) / steps,
               "train/grad_norm": sum(norms) / steps, "train/optimizer_steps": steps,
               "train/lr": setup.optimizer.param_groups[0]["lr"]}
    if steps_used:
        metrics["train/refl_step"] = sum(steps_used) / len(steps_used)
    if da_sigmas:  # a micro-batch's srps sum to its mean over the branches
        metrics["train/srp"] = sum(v * w for v, w in srps) / steps
        metrics["train/da_sigma"] = sum(v * w for v, w in da_sigmas) / steps
    return metrics


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run the configured reward-gradient trainer. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.rl.setup import ImageTraining

    setup = ImageTraining(cfg, "reward_gradient", model=model, dist=dist, ema_decay=cfg.train.ema_decay,
                          per_sample=True, reference=cfg.train.kl_coef > 0,
                          plot_groups={"reward_gradient": ["train/loss", "train/refl_step", "train/srp"]})
    run = setup.run
    check_differentiable(setup.reward, cfg.reward.train)
    samples = cfg.sampling.samples_per_epoch
    with run:
        while run.next_epoch():
            batch = setup.prompt_groups.epoch(run.epoch)
            start = time.perf_counter()
            with setup.training(len(batch.prompts)) as bar:
                metrics = train_epoch(setup, batch, cfg, run.epoch, progress=bar)
            run.check_rewards(metrics, samples)
            metrics["time/sampling_s"] = time.perf_counter() - start  # sampling and training are one pass
            setup.end_epoch(metrics)
    return run.finish()


def dry_run_overrides(data: dict, workdir) -> list[str]:
    """The dry run's stand-in reward scores JPEG size, which has no gradient: put a tiny differentiable aesthetic
    reward (random open_clip and MLP written under ``workdir``) in its place."""
    from pathlib import Path

    from flowrl.commands.dryrun import STAND_IN_REWARD

    train = (data.get("reward") or {}).get("train")
    if not isinstance(train, dict):
        return []
    notes = []
    for name, entry in list(train.items()):
        if isinstance(entry, dict) and entry.get("reward") == STAND_IN_REWARD:
            from rewards.testing import tiny_aesthetic

            model_name, mlp_path = tiny_aesthetic(Path(workdir) / "stand_in_aesthetic")
            train[name] = {"reward": "aesthetic", "weight": entry.get("weight", 1.0),
                           "kwargs": {"model_name": model_name, "mlp_path": mlp_path}}
            notes.append(f"reward.train.{name}: the stand-in is a tiny random aesthetic reward (differentiable)")
    return notes


RECIPE = Recipe(Config, main)


def dry_run_work(cfg: Config) -> list[str]:
    """One epoch's work for the dry run's report (flowrl/commands/dryrun.py): the sampling chain runs inside the
    training step, so its calls with gradients are the ones that cost memory."""
    t, s = cfg.train, cfg.sampling
    samples, steps = s.samples_per_epoch, s.num_steps
    with_grad = {"refl": "1 velocity call with gradients at a step of the ReFL window, the steps before it without",
                 "draft": f"the last {t.k} with gradients, the {steps - t.k} before without",
                 "draft_lv": f"all {steps} without gradients, then {t.lv_samples} re-noised one-step denoisings with "
                             "gradients",
                 "direct_align": f"all {steps} without gradients, then the sample re-noised with its own initial noise "
                                 f"and one step with gradients ({1 if t.da_discount_inv is None else 2} branch(es), "
                                 "each decoded, scored"
                                 f"{' twice (SRP)' if t.srp_positive else ''} and back-propagated in turn)"}[t.method]
    return [f"{samples} samples per epoch ({s.groups_per_epoch} prompts x {s.group_size}) x {t.inner_epochs} pass(es), "
            f"each a {steps}-step ODE chain ({t.method}: {with_grad}); the clean samples decoded and scored with "
            f"gradients, back-propagated in micro-batches of {t.micro_batch_size}; {t.minibatches * t.inner_epochs} "
            "optimizer step(s) per epoch"]
