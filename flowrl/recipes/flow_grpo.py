"""Flow-GRPO: online RL of a flow-matching generator against rewards.

Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (2025), with its "Fast"
variant (train a window of the denoising steps), MixGRPO's sliding window and DanceGRPO's constant-noise
SDE as options, and two changes of the surrogate (docs/algorithms.md, section 5): GRPO-Guard's RatioNorm
(``train.ratio_norm``, Wang et al. 2025, adopted in Flow-GRPO's code) and Flow-DPPO's divergence mask in place
of the ratio clip (``train.trust_region=dppo``); both compare each step's transition mean with the one
recorded at rollout. One epoch (docs/architecture.md, "One RL step"):

1. the prompt groups pick ``groups_per_epoch`` prompts, each ``group_size`` times, with per-sample seeds;
2. ``collect_epoch``: each process rolls out its shard with the configured SDE step inside the training
   window (ODE outside), decodes, and scores in a background thread while the next batch samples;
3. ``compute_advantages``: rewards are gathered, the configured estimator (outcome, tp_grpo, cosine) runs
   on whole groups, and each process keeps its slice;
4. :func:`train_epoch`: for each inner epoch, minibatch and trained step, the rollout's own step function
   re-scores the stored transition under the current policy (``Trajectory.step`` with ``x_next``, on the
   minibatch's states staged on the device once); clipped policy loss + Gaussian KL to the reference (LoRA
   adapters off, or a frozen copy); one optimizer step per minibatch, with gradient clipping and an EMA of the
   trained weights.

Where this departs from the paper's code (docs/algorithms.md, "Flow-GRPO"):

- the KL is the exact Gaussian KL ``||mu - mu_ref||^2 / (2 std^2)`` with ``std = g_t sqrt(|dt|)``;
  Flow-GRPO divides by ``g_t^2`` only. ``train.kl_coef_units=flow_grpo`` takes a Flow-GRPO beta as is
  (``beta_t = beta |dt_t|`` per step); with ``flowrl`` units (the default) ``kl_coef`` multiplies the
  exact KL;
- log-probs use ``sampling.reduction`` (``mean`` by default, as Flow-GRPO, whose clip ranges assume it);
- samples whose reward is NaN are masked out of the update and counted, instead of poisoning it;
- the loss is normalised by the global number of (sample, trained step) pairs of the minibatch, so one
  process with accumulation ``2a`` and two processes with accumulation ``a`` take the same step;
  ``train.drop_zero_advantage=true`` first drops samples whose advantage is 0 at every step, as Flow-GRPO
  does (constant groups then no longer dilute the policy gradient against the KL);
- regularisers against reward hacking, all off by default: ``train.kl_reward_adaptive`` (CRD's reward-adaptive
  anchor on the KL to the base: each sample's weight ``kl_coef (m + r (1 - m))``), ``train.elastic_reset``
  (Elastic Reset: the policy reset to its EMA and the EMA to the base every few epochs;
  flowrl/rl/elastic_reset.py) and ``sampling.base_last_steps`` (the base model denoises the last steps of every
  rollout and evaluation; flowrl/rl/base_tail.py);
- on-policy distillation (``train.teacher``, off by default; flowrl/rl/teacher.py, after verl-omni's ``distill_kl``):
  a frozen teacher re-scores each trained transition at the student's state and the Gaussian KL between the two
  transitions joins the loss, beside the policy loss or instead of it;
- gradients flow through both branches of classifier-free guidance (``train.cfg_grad=full``); Flow-GRPO
  detaches the unconditional branch (``cond_only``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.elastic_reset import ElasticResetConfig
from flowrl.rl.setup import OnlineConfig
from flowrl.rl.teacher import TeacherConfig

__all__ = ["TrainConfig", "Config", "train_epoch", "reward_adaptive_kl_scale", "main", "RECIPE", "dry_run_memory",
           "dry_run_overrides"]


@dataclass
class TrainConfig:
    clip_range: float = field(default=1e-4, metadata=bounds(gt=0, lt=1))  # the lower ratio clip
    clip_range_high: float | None = field(default=None, metadata=bounds(gt=0))  # DAPO clip-higher
    dual_clip: float | None = field(default=None, metadata=bounds(gt=1))
    kl_coef: float = field(default=0.0, metadata=bounds(ge=0))  # the KL weight to the reference (Flow-GRPO's beta)
    # flowrl: kl_coef multiplies the exact Gaussian KL; flow_grpo: a Flow-GRPO beta, beta_t = beta |dt_t|.
    kl_coef_units: Literal["flowrl", "flow_grpo"] = "flowrl"
    # CRD's reward-adaptive anchor: sample i's KL weight is kl_coef (m + r_i (1 - m)), r_i = clip(A_i, +-c) / (2 c)
    # + 0.5 with c = advantage.clip, and m = kl_floor / kl_coef: rewarded samples are held to the base, unrewarded
    # ones free.
    kl_reward_adaptive: bool = False
    kl_floor: float = field(default=1e-4, metadata=bounds(ge=0))  # the KL weight at reward weight 0
    # full: back-propagate through both CFG branches; cond_only: detach the unconditional one (Flow-GRPO).
    cfg_grad: Literal["full", "cond_only"] = "full"
    # Drop samples whose advantage is 0 at every trained step before averaging (Flow-GRPO).
    drop_zero_advantage: bool = False
    aggregation: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    inner_epochs: int = field(default=1, metadata=bounds(ge=1, le=100))
    minibatches: int = field(default=1, metadata=bounds(ge=1, le=10_000))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1, le=4096))  # samples per backward, per process
    # The evaluation EMA of the trained weights (None: none), decayed once per optimizer step (as
    # flowrl.rl.setup.UpdateConfig's, the one meaning of ema_decay).
    ema_decay: float | None = field(default=None, metadata=bounds(gt=0, lt=1))
    # GRPO-Guard's RatioNorm: clip exp((log rho + KL(old, new)) std) instead of rho, and divide each step's policy
    # loss by |dt| (docs/algorithms.md, section 5). Its published clip ranges are ~1/50 of Flow-GRPO's.
    ratio_norm: bool = False
    # clip: PPO's ratio clip (clip_range, clip_range_high, dual_clip); dppo: Flow-DPPO's divergence mask, no clip.
    trust_region: Literal["clip", "dppo"] = "clip"
    # Flow-DPPO: the exact KL(old || new) of a step (per element with sampling.reduction=mean) beyond which a row
    # that keeps moving the way its advantage pushes is masked.
    dppo_threshold: float = field(default=1e-5, metadata=bounds(gt=0))
    # Elastic Reset: every every_epochs epochs the policy <- its own EMA (decay_per_epoch), that EMA <- the base.
    elastic_reset: ElasticResetConfig | None = None
    # On-policy distillation from a frozen teacher of the same architecture (flowrl/rl/teacher.py; None: off).
    teacher: TeacherConfig | None = None

    @property
    def needs_old_means(self) -> bool:
        """RatioNorm and Flow-DPPO compare the new transition mean with the one recorded at rollout."""
        return self.ratio_norm or self.trust_region == "dppo"


@dataclass
class Config(OnlineConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/flow_grpo"))
    train: TrainConfig = field(default_factory=TrainConfig)

    def check(self) -> None:
        super().check()
        if self.train.kl_reward_adaptive:
            if self.train.kl_coef == 0:
                fail("train.kl_reward_adaptive", "the reward-adaptive anchor weights the KL to the base; set "
                     "train.kl_coef > 0 (its weight at reward weight 1)")
            if self.train.kl_floor > self.train.kl_coef:
                fail("train.kl_floor", f"{self.train.kl_floor} exceeds kl_coef {self.train.kl_coef} (the weight at "
                     "reward weight 0 cannot exceed the weight at reward weight 1)")
        if self.sampling.step == "ode":
            fail("sampling.step", "Flow-GRPO trains stochastic steps; choose flow_sde, dance_sde or cps")
        if self.train.minibatches > self.sampling.samples_per_epoch:
            fail("train.minibatches", "more minibatches than samples per epoch")
        if self.train.trust_region == "dppo":
            if self.train.ratio_norm:
                fail("train.ratio_norm", "GRPO-Guard's RatioNorm normalises the clipped ratio and Flow-DPPO has no "
                     "ratio clip; choose one (train.trust_region=clip with ratio_norm, or dppo without)")
            for name in ("clip_range_high", "dual_clip"):
                if getattr(self.train, name) is not None:
                    fail(f"train.{name}", "Flow-DPPO (train.trust_region=dppo) has no ratio clip; unset it")


def _kl_weights(cfg: TrainConfig, sigmas: torch.Tensor) -> torch.Tensor:
    """``[T]`` beta of each step's KL term (docs/algorithms.md, "KL regularisation")."""
    if cfg.kl_coef_units == "flow_grpo":
        return cfg.kl_coef * (sigmas[:-1] - sigmas[1:]).abs().double()
    return torch.full((sigmas.numel() - 1,), cfg.kl_coef, dtype=torch.float64)


def reward_adaptive_kl_scale(train: TrainConfig, advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """``[b]`` CRD's per-sample KL scale ``m + r (1 - m)`` (``r = reward_weights(A)``, ``m = kl_floor / kl_coef``)
    for advantages ``[b]``: 1 at advantage ``+adv_clip`` (``advantage.clip``) and above, ``m`` at ``-adv_clip`` and
    below (docs/trainers.md, "CRD"); it multiplies each step's ``kl_coef`` weight."""
    from flowrl.core.forward_losses import reward_adaptive_kl_weight, reward_weights

    r = reward_weights(advantages, adv_clip=adv_clip)
    return reward_adaptive_kl_weight(r, kl_coef=1.0, kl_floor=train.kl_floor / train.kl_coef)


def _policy_loss(train: TrainConfig, out, old_logp: torch.Tensor, old_mean: torch.Tensor | None,
                 advantages: torch.Tensor, dt: float, reduction: str):
    """The policy term of one pass (its rows at one trained step) and, for RatioNorm and Flow-DPPO, the exact KL
    between the rollout's and the current transition (``train/kl_old``; None otherwise).

    Args:
        out: the current policy's ``StepOutput`` of the stored transitions (``[b]`` log-probs, ``[b, ...]`` means).
        old_logp: ``[b]`` the rollout's log-probs; ``old_mean``: ``[b, ...]`` its transition means (RatioNorm and
            Flow-DPPO only, else None); ``advantages``: ``[b]``; all on ``out``'s device.
        dt: the step's length ``sigma_t - sigma_{t+1}`` (RatioNorm).
    """
    from flowrl.core.losses import clipped_policy_loss, dppo_policy_loss, gaussian_kl, ratio_norm_policy_loss

    if not train.needs_old_means:
        return clipped_policy_loss(out.log_prob[:, None], old_logp[:, None], advantages[:, None], None,
                                   clip_range=train.clip_range, clip_range_high=train.clip_range_high,
                                   dual_clip=train.dual_clip, aggregation="token_mean"), None
    with torch.no_grad():
        kl_old = gaussian_kl(out.mean, old_mean, out.std, reduction=reduction).mean()
    if train.trust_region == "dppo":
        return dppo_policy_loss(out.log_prob, old_logp, advantages, out.mean, old_mean, out.std,
                                threshold=train.dppo_threshold, reduction=reduction), kl_old
    return ratio_norm_policy_loss(out.log_prob, old_logp, advantages, out.mean, old_mean, out.std, dt,
                                  clip_range=train.clip_range, clip_range_high=train.clip_range_high,
                                  dual_clip=train.dual_clip, reduction=reduction), kl_old


def train_epoch(model, optimizer, rollouts, advantages: torch.Tensor, valid: torch.Tensor, cfg: Config, dist,
                epoch: int, *, ema=None, health=None, progress=None) -> dict[str, float]:
    """Clipped policy loss (or its RatioNorm / Flow-DPPO variant) + KL over the trained steps; one optimizer step
    per minibatch.

    Host/device traffic (benchmarks/syncs.py counts it): a minibatch's data (the states its passes read, the
    rollout's log-probs and means, the advantages, the conditioning) is gathered on the CPU in the order of its
    passes and moved to the device in one copy per tensor; a pass reads contiguous slices of it, and its
    statistics stay on the device until the optimizer step (:class:`flowrl.rl.passes.MetricMeans`). A training
    pass thus makes no host/device copy and no blocking read; an optimizer step makes the staging copies, the
    gathers of the counts, one read of the statistics and the read of the gradient norm that guards the update.

    Args:
        rollouts: the epoch's :class:`flowrl.rl.collect.EpochRollouts` (this process's samples; with
            ``train.ratio_norm`` or ``trust_region=dppo`` collected with ``store_means=True``).
        advantages: ``[n, T]`` (only trained steps are read).
        valid: ``[n]`` bool, samples that take part (finite reward).
        health: a :class:`flowrl.rl.passes.UpdateHealth` that counts updates skipped for non-finite values.
        progress: advanced by the number of samples of every (micro-batch, trained step) pass.

    Returns:
        Means over the epoch of the loss statistics (``train/...``).
    """
    from flowrl.core.losses import gaussian_kl
    from flowrl.rl.passes import (MetricMeans, global_count, minibatch_rows, optimizer_step, pass_layout,
                                  pass_scale, stage_rows, training_passes)

    train = cfg.train
    teacher = train.teacher
    traj = rollouts.trajectory
    steps = traj.trained_steps
    device = model.device
    velocity = model.velocity_fn(cfg.sampling.guidance, detach_uncond=train.cfg_grad == "cond_only")
    kl_weights = _kl_weights(train, traj.sigmas)
    params = model.trainable_parameters()
    if teacher is not None and not model.has_teacher:
        raise ValueError("train.teacher is set but the model has no teacher: flowrl.rl.teacher.attach_teacher first")
    if train.needs_old_means and traj.means is None:
        raise ValueError("train.ratio_norm / trust_region=dppo need the rollout's transition means: collect the "
                         "epoch with store_means=True")
    # The schedule on the device once: a pass's per-row sigma is a view of it.
    sigmas = traj.sigmas.to(device)
    # The states the passes read (each trained step's and the one after it), and where each sits in the staging.
    states = sorted(set(steps) | {t + 1 for t in steps})
    state_at = {s: i for i, s in enumerate(states)}
    step_at = {t: i for i, t in enumerate(steps)}
    take_part = valid.clone()
    if train.drop_zero_advantage and steps:
        take_part &= (advantages[:, steps] != 0).any(dim=1)
    stats, grad_norms = MetricMeans(), MetricMeans()
    for inner in range(train.inner_epochs):
        for rows in minibatch_rows(rollouts.sample_ids, train.minibatches, seed=cfg.run.seed, epoch=epoch,
                                   inner=inner, total=cfg.sampling.samples_per_epoch):
            rows = rows[take_part[rows]]
            n_global = global_count(dist, rows)
            if n_global == 0 or not steps:
                continue
            optimizer.zero_grad(set_to_none=True)
            passes = training_passes(rows, steps, train.micro_batch_size, dist)
            # The minibatch's data on the device, laid out so that each pass reads slices (see the docstring);
            # per step ([steps or states, k, ...]) where a pass reads one step, so its slice is contiguous.
            order, slices = pass_layout(passes)
            x_staged = stage_rows(traj.latents, order, device, dim1=states, transpose=True)
            old_logp_staged = stage_rows(traj.log_probs, order, device, transpose=True)  # [T, k]
            adv_staged = stage_rows(advantages, order, device, transpose=True)  # [T, k]
            old_mean_staged = (stage_rows(traj.means, order, device, dim1=steps, transpose=True)
                               if train.needs_old_means else None)
            cond_staged = {k: stage_rows(v, order, device) for k, v in rollouts.cond.items()}
            for p, sl in zip(passes, slices):
                m, t = p.rows, p.unit
                x, x_next = x_staged[state_at[t], sl], x_staged[state_at[t + 1], sl]
                sigma, cond = sigmas[t].expand(len(m)), {k: v[sl] for k, v in cond_staged.items()}
                adv = adv_staged[t, sl]
                out = traj.step(velocity(x.to(model.dtype), sigma, cond), x, t, x_next=x_next)
                policy, kl_old = _policy_loss(train, out, old_logp_staged[t, sl],
                                              None if old_mean_staged is None else old_mean_staged[step_at[t], sl],
                                              adv, float(traj.sigmas[t] - traj.sigmas[t + 1]), cfg.sampling.reduction)
                kl, extra = torch.zeros((), device=device), {}
                loss = policy.loss if teacher is None or teacher.policy_loss else torch.zeros((), device=device)
                if train.kl_coef > 0:
                    with torch.no_grad(), model.reference():
                        ref_mean = traj.step(velocity(x.to(model.dtype), sigma, cond), x, t, x_next=x_next).mean
                    kl_rows = gaussian_kl(out.mean, ref_mean, out.std, reduction=cfg.sampling.reduction)  # [b]
                    kl = kl_rows.mean()
                    if train.kl_reward_adaptive:
                        scale = reward_adaptive_kl_scale(train, adv, cfg.advantage.clip).to(kl_rows.dtype)
                        loss = loss + float(kl_weights[t]) * (scale * kl_rows).mean()
                        extra["train/kl_scale"] = scale.mean()
                    else:
                        loss = loss + float(kl_weights[t]) * kl
                if teacher is not None:  # the teacher's transition at the student's state, same step function
                    with torch.no_grad(), model.teacher():
                        teacher_mean = traj.step(velocity(x.to(model.dtype), sigma, cond), x, t, x_next=x_next).mean
                    distill = gaussian_kl(out.mean, teacher_mean, out.std, reduction=cfg.sampling.reduction).mean()
                    loss = loss + teacher.coef * distill
                    extra["train/distill_kl"] = distill
                units = len(steps) if train.aggregation == "token_mean" else 1
                dist.backward(loss * pass_scale(p, n_global, dist, units), model.denoiser, sync=p.sync)
                if p.weight:  # device tensors: read at the optimizer step, all at once
                    stats.add(len(m), **{"train/loss": loss, "train/ratio_mean": policy.ratio_mean,
                                         "train/clip_frac": policy.clip_frac, "train/approx_kl": policy.approx_kl,
                                         "train/kl_ref": kl, **({} if kl_old is None else {"train/kl_old": kl_old}),
                                         **extra})
                    if progress is not None:
                        progress.update(len(m))
            stats.flush()  # the step's one read of its statistics, before the gradient norm's
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
    from flowrl.rl.setup import ImageTraining

    setup = ImageTraining(cfg, "flow_grpo", model=model, dist=dist, ema_decay=cfg.train.ema_decay,
                          reference=cfg.train.kl_coef > 0)
    run, model = setup.run, setup.model
    if cfg.train.teacher is not None:
        from flowrl.rl.teacher import attach_teacher

        attach_teacher(model, cfg.model, cfg.train.teacher, setup.dist.device)
    elastic = None
    if cfg.train.elastic_reset is not None:
        from flowrl.rl.elastic_reset import ElasticReset

        elastic = ElasticReset(model, cfg.train.elastic_reset)  # before `with run`: its base is the starting model
        run.track(elastic_reset=elastic)

    with run:
        while run.next_epoch():
            epoch = run.epoch
            rollouts, advantages, valid, metrics = setup.collect(epoch, store_x0="step_weights" in cfg.advantage.needs,
                                                                  store_means=cfg.train.needs_old_means)
            if setup.updates_policy(metrics):  # False: every reward NaN, or a discriminator-only epoch
                # One tick per (sample, trained step) forward-backward pass.
                passes = int(valid.sum()) * len(rollouts.trained_steps) * cfg.train.inner_epochs
                with setup.training(passes) as bar:
                    metrics.update(train_epoch(model, setup.optimizer, rollouts, advantages, valid, cfg, setup.dist,
                                               epoch, ema=setup.ema, health=run.health, progress=bar))
            if elastic is not None:
                metrics.update(elastic.end_epoch(model, epoch))
            setup.end_epoch(metrics, rollouts)
    return run.finish()


def dry_run_overrides(data: dict, workdir) -> list[str]:
    """The dry run replaces the model by a tiny one (flowrl/commands/dryrun.py); on-policy distillation's teacher
    becomes that same tiny model, the student's stand-in (the real teacher's architecture is checked at the real
    run's start)."""
    teacher = (data.get("train") or {}).get("teacher")
    if not isinstance(teacher, dict) or not teacher.get("path"):
        return []
    real, teacher["path"] = teacher["path"], data["model"]["path"]
    found = "found" if Path(real).is_dir() else "MISSING (write it with `flowrl export RUN --format merged --out DIR`)"
    return [f"train.teacher.path: the tiny model in place of {real}: {found}"]


def dry_run_memory(cfg: Config) -> dict:
    """What the dry run's memory estimate adds for this recipe (flowrl/commands/dryrun.py): the teacher's denoiser
    of on-policy distillation, in the loaded dtype."""
    return {"teacher": cfg.train.teacher is not None}


RECIPE = Recipe(Config, main)
