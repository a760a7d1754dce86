"""Training on the forward process, shared by the trainers that learn from clean samples (CRD,
DiffusionNFT, AWM, DGPO, Diffusion-DPO; docs/trainers.md).

These trainers never re-score denoising steps: each sample ``x0`` (a rollout's final image, or an image of
a preference pair) is noised afresh to ``x_t = (1 - t) x0 + t eps`` at a few training times, and the
objective compares velocity predictions there with the target ``u = eps - x0``. This module holds:

- :class:`TimesConfig` and :func:`draw_times`: how many training times each sample gets per epoch and
  where they come from (positions of the rollout schedule, stratified positions, or uniform times), and who
  shares one draw (each sample, each prompt group, or the whole batch);
- :func:`forward_noise`: the noise ``eps`` of a (sample or group, time) pair;
- :class:`ForwardData` / :class:`ForwardBatch`: what the training pass reads, and one pass's noised
  points with the velocities the objective asked for;
- :class:`ForwardTrainConfig` and :func:`train_forward_epoch`: minibatches (of whole groups when the
  objective compares a group's samples), passes (micro-batch x training time), the velocities of the
  policy, of parameter snapshots and of the reference, the objective, and the optimizer step;
- :func:`forward_epoch`: a recipe's collect-and-train half of an epoch.

Every random draw is a pure function of ``(run seed, epoch, inner epoch, global sample or group id,
time index)``, never of the process, so one process with accumulation ``2a`` and two with ``a`` draw the
same points and take the same step (docs/architecture.md, "Distributed training").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from flowrl.config import bounds, fail
from flowrl.rl.online import OnlineConfig, UpdateConfig
from flowrl.rl.sampling import SamplingConfig

__all__ = ["TimesConfig", "ForwardTrainConfig", "ForwardData", "ForwardBatch", "schedule_positions", "draw_times",
           "forward_noise", "training_guidance", "train_forward_epoch", "forward_epoch", "check_forward_config",
           "groups_stay_local"]

# Stream tags keep the draws of this module independent of the rollout's.
STREAM_TIMES = 0x7D1E5
STREAM_FORWARD_NOISE = 0xF0E95


@dataclass
class TimesConfig:
    """The training times of each sample in one (inner) epoch.

    ``mode``:

    - ``schedule``: ``count`` distinct positions of the rollout schedule, drawn without replacement (a random
      permutation, its first ``count``) from the positions ``i`` with ``round(low T) <= i < round(high T)``
      of the ``T`` rollout times (``sigmas[0] = 1`` is position 0); DiffusionNFT (all 10 positions, 9 drawn),
      DGPO (the first half or 70%);
    - ``stratified``: the same positions split into ``count`` consecutive strata, one position drawn from each
      (AWM's ``discrete_wo_init``);
    - ``uniform``: ``t ~ U(low, high)``, ``count`` independent draws (Diffusion-DPO, CRD on a continuum).

    ``share``: who shares one draw of the times: each ``sample``, each prompt ``group`` or the whole
    ``batch``. ``noise``: who shares one ``eps`` per time: each ``sample`` or each ``group`` (CRD and DGPO
    compare a group's samples at one shared noised point).
    """

    count: int = field(default=1, metadata=bounds(ge=1, le=1000))
    mode: Literal["schedule", "stratified", "uniform"] = "schedule"
    low: float = field(default=0.0, metadata=bounds(ge=0, le=1))
    high: float = field(default=1.0, metadata=bounds(ge=0, le=1))
    share: Literal["sample", "group", "batch"] = "sample"
    noise: Literal["sample", "group"] = "sample"

    def check(self) -> None:
        if self.high <= self.low:
            fail("high", f"{self.high} must exceed low = {self.low}")

    def check_schedule(self, num_steps: int, where: str = "train.times") -> None:
        """Raise a ConfigError when the schedule has too few positions in range for ``count``."""
        from flowrl.config import ConfigError

        if self.mode == "uniform":
            return
        positions = schedule_positions(num_steps, self.low, self.high)
        if len(positions) < self.count:
            raise ConfigError(f"{where}.count", f"{self.count} times per sample, but only {len(positions)} positions "
                              f"of the {num_steps}-step rollout schedule lie in [low, high) = [{self.low}, "
                              f"{self.high}); "
                              "lower count or widen the range")


@dataclass
class ForwardTrainConfig(UpdateConfig):
    """The ``train`` fields every forward-process recipe shares (a recipe's ``TrainConfig`` extends it)."""

    times: TimesConfig = field(default_factory=TimesConfig)


def schedule_positions(num_steps: int, low: float, high: float) -> list[int]:
    """Positions ``i`` of a ``num_steps``-time rollout schedule with ``round(low T) <= i < round(high T)``."""
    return list(range(int(round(low * num_steps)), int(round(high * num_steps))))


def _unit_ids(share: str, group_ids: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    if share == "sample":
        return sample_ids
    if share == "group":
        return group_ids
    return torch.zeros_like(sample_ids)


def draw_times(cfg: TimesConfig, sigmas: torch.Tensor, group_ids: torch.Tensor, sample_ids: torch.Tensor, *,
               seed: int, epoch: int, inner: int = 0) -> torch.Tensor:
    """The training times ``t`` of each local sample, ``[n, count]`` float32 in ``(0, 1]``.

    Args:
        cfg: the ``times`` section.
        sigmas: the rollout schedule ``[T + 1]`` (``sigmas[T] = 0``; positions index ``sigmas[:T]``).
        group_ids / sample_ids: ``[n]`` global ids of the local samples.
        seed / epoch / inner: with the global id of the sharing unit, these fix the draw.
    """
    from samplers import derive_seed

    T = sigmas.numel() - 1
    positions = torch.tensor(schedule_positions(T, cfg.low, cfg.high), dtype=torch.long)
    ids = _unit_ids(cfg.share, group_ids, sample_ids)
    out = torch.empty(ids.numel(), cfg.count, dtype=torch.float32)
    cache: dict[int, torch.Tensor] = {}
    for row, unit in enumerate(ids.tolist()):
        if unit not in cache:
            generator = torch.Generator().manual_seed(derive_seed(seed, epoch, inner, STREAM_TIMES, unit))
            if cfg.mode == "uniform":
                cache[unit] = cfg.low + (cfg.high - cfg.low) * torch.rand(cfg.count, generator=generator)
            elif cfg.mode == "schedule":
                chosen = positions[torch.randperm(positions.numel(), generator=generator)[: cfg.count]]
                cache[unit] = sigmas[chosen].float()
            else:  # stratified: one position from each of `count` consecutive strata
                edges = [positions.numel() * k // cfg.count for k in range(cfg.count + 1)]
                chosen = [positions[lo + int(torch.randint(hi - lo, (1,), generator=generator))]
                          for lo, hi in zip(edges[:-1], edges[1:])]
                cache[unit] = sigmas[torch.stack(chosen)].float()
        out[row] = cache[unit]
    return out


def forward_noise(shape: tuple[int, ...], ids: torch.Tensor, *, seed: int, epoch: int, inner: int, unit: int,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """Standard-normal ``eps [m, *shape]``: row ``i`` depends only on ``(seed, epoch, inner, unit, ids[i])``
    (``ids``: global sample or group ids; rows with the same id share their noise)."""
    from samplers import derive_seed

    out = torch.empty((ids.numel(),) + tuple(shape), dtype=torch.float32)
    drawn: dict[int, int] = {}
    for row, i in enumerate(ids.tolist()):
        if i in drawn:
            out[row] = out[drawn[i]]
            continue
        generator = torch.Generator().manual_seed(derive_seed(seed, epoch, inner, unit, STREAM_FORWARD_NOISE, i))
        out[row].normal_(generator=generator)
        drawn[i] = row
    return out.to(device) if device is not None else out


@dataclass
class ForwardData:
    """What a forward-process training pass reads: ``n`` local clean samples with their condition.

    Attributes:
        x0: ``[n, *S]`` clean samples in the model's latent space (float32).
        cond: the text conditioning ``{key: [n, ...]}``.
        advantages: ``[n]`` (group advantages; Diffusion-DPO: +1 chosen, -1 rejected).
        group_ids / sample_ids: ``[n]`` int64 global ids.
        valid: ``[n]`` bool, rows that take part (finite reward).
    """

    x0: torch.Tensor
    cond: dict[str, torch.Tensor]
    advantages: torch.Tensor
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def from_rollouts(cls, rollouts, advantages: torch.Tensor, valid: torch.Tensor) -> "ForwardData":
        """The final samples of an epoch's rollouts with their per-sample advantages ``[n]``."""
        return cls(x0=rollouts.trajectory.x0, cond=rollouts.cond, advantages=advantages, group_ids=rollouts.group_ids,
                   sample_ids=rollouts.sample_ids, valid=valid)


@dataclass
class ForwardBatch:
    """One pass: ``m`` rows at one training time each, and the velocities there.

    Attributes:
        rows: ``[m]`` local rows of the :class:`ForwardData`.
        t: ``[m]`` noise levels; ``x0``, ``eps``, ``x_t``, ``target`` (``u = eps - x0``): ``[m, *S]``.
        cond: the rows' conditioning; ``advantages`` / ``group_ids``: ``[m]``.
        v: ``[m, *S]`` the policy's velocity at ``x_t`` (with gradient).
        snapshots: ``{name: [m, *S]}`` velocities of the parameter snapshots the objective named (no gradient).
        v_ref: ``[m, *S]`` the reference's velocity (no gradient), or None when not asked for.
    """

    rows: torch.Tensor
    t: torch.Tensor
    x0: torch.Tensor
    eps: torch.Tensor
    x_t: torch.Tensor
    target: torch.Tensor
    cond: dict[str, torch.Tensor]
    advantages: torch.Tensor
    group_ids: torch.Tensor
    v: torch.Tensor | None = None
    snapshots: dict[str, torch.Tensor] = field(default_factory=dict)
    v_ref: torch.Tensor | None = None


def _noised_batch(data: ForwardData, rows: torch.Tensor, times: torch.Tensor, unit: int, cfg: TimesConfig, *,
                  seed: int, epoch: int, inner: int, device) -> ForwardBatch:
    x0 = data.x0[rows].to(device=device, dtype=torch.float32)
    t = times[rows, unit].to(device)
    ids = data.sample_ids[rows] if cfg.noise == "sample" else data.group_ids[rows]
    eps = forward_noise(tuple(x0.shape[1:]), ids, seed=seed, epoch=epoch, inner=inner, unit=unit, device=device)
    tt = t.view(-1, *([1] * (x0.ndim - 1)))
    return ForwardBatch(rows=rows, t=t, x0=x0, eps=eps, x_t=(1 - tt) * x0 + tt * eps, target=eps - x0,
                        cond={k: v[rows].to(device) for k, v in data.cond.items()},
                        advantages=data.advantages[rows].to(device), group_ids=data.group_ids[rows])


Objective = Callable[[ForwardBatch], "tuple[torch.Tensor, dict[str, float]]"]


def training_guidance(model, sampling) -> float:
    """The guidance the policy is trained at: none (1.0) for a model with classifier-free guidance (the
    forward-process trainers train CFG-free), the rollout's for a guidance-distilled model (FLUX.1-dev reads
    its guidance as an input, so training at another value would train another function)."""
    return 1.0 if model.uses_cfg else sampling.guidance


def train_forward_epoch(model, optimizer, data: ForwardData, sigmas: torch.Tensor, cfg, dist, epoch: int, *,
                        objective: Objective, snapshots: dict | None = None, reference: bool | float = False,
                        whole_groups: bool = False, ema=None, health=None, progress=None,
                        after_step: Callable[[], None] | None = None) -> dict[str, float]:
    """One epoch of a forward-process objective: for each inner epoch, minibatch, and pass (micro-batch x
    training time), noise the rows, predict, call ``objective``, back-propagate; one optimizer step per
    minibatch.

    Before the policy's forward pass (which alone carries a gradient) the pass predicts with every snapshot
    in ``snapshots`` (``batch.snapshots[name]``) and, when ``reference`` is set, with the frozen reference
    (``batch.v_ref``). The policy and its snapshots predict at :func:`training_guidance` (CFG-free).

    Args:
        data: the epoch's :class:`ForwardData` (this process's rows).
        sigmas: the rollout schedule ``[T + 1]`` (for ``times.mode`` ``schedule`` / ``stratified``).
        cfg: the recipe's config; its ``train`` section is a :class:`ForwardTrainConfig` (``run.seed``,
            ``optim.grad_clip`` and ``sampling.guidance`` are read too).
        objective: ``objective(batch) -> (loss, stats)``: ``loss`` the mean over the batch's rows, ``stats``
            floats averaged over the epoch (weighted by rows) and logged as ``train/<name>``.
        snapshots: ``{name: ParamSnapshot}`` whose velocities the objective reads.
        reference: False (none), True (the reference at the policy's guidance) or a classifier-free guidance
            scale for the reference (CRD's teacher).
        whole_groups: minibatches and micro-batches hold whole prompt groups (objectives that centre or
            compare within a group); a group must not span processes.
        ema / health: as for :func:`flowrl.rl.passes.optimizer_step`.
        progress: advanced by the rows of every pass.
        after_step: called after every optimizer step (e.g. DGPO's per-step snapshot update).

    Returns:
        ``train/...`` means over the epoch: the objective's stats, ``train/loss``, ``train/grad_norm``,
        ``train/optimizer_steps``, ``train/lr``.
    """
    from flowrl.rl.passes import (MetricMeans, global_count, minibatch_rows, optimizer_step, pass_scale,
                                  training_passes)

    t_cfg, seed = cfg.train, cfg.run.seed
    device = model.device
    snapshots = snapshots or {}
    guidance = training_guidance(model, cfg.sampling)
    velocity = model.velocity_fn(guidance)
    reference_velocity = None
    if reference is not False:
        reference_velocity = model.velocity_fn(guidance if reference is True else float(reference))
    params = model.trainable_parameters()
    units = list(range(t_cfg.times.count))
    stats, grad_norms = MetricMeans(), MetricMeans()
    # Minibatches partition global ids (of groups, when the objective compares a group's samples); the
    # partition must agree across processes, so it is drawn over the global number of ids.
    partition_ids = data.group_ids if whole_groups else data.sample_ids
    total = int(dist.gather(partition_ids.max().view(1)).max()) + 1
    for inner in range(t_cfg.inner_epochs):
        times = draw_times(t_cfg.times, sigmas, data.group_ids, data.sample_ids, seed=seed, epoch=epoch, inner=inner)
        for rows in minibatch_rows(partition_ids, t_cfg.minibatches, seed=seed, epoch=epoch, inner=inner, total=total):
            rows = rows[data.valid[rows]]
            n_global = global_count(dist, rows)
            if n_global == 0:
                continue
            optimizer.zero_grad(set_to_none=True)
            for p in training_passes(rows, units, t_cfg.micro_batch_size, dist,
                                     groups=data.group_ids if whole_groups else None):
                batch = _noised_batch(data, p.rows, times, p.unit, t_cfg.times, seed=seed, epoch=epoch, inner=inner,
                                      device=device)
                x_t = batch.x_t.to(model.dtype)
                with torch.no_grad():
                    for name, snapshot in snapshots.items():
                        with snapshot.active(model):
                            batch.snapshots[name] = velocity(x_t, batch.t, batch.cond).float()
                    if reference_velocity is not None:
                        with model.reference():
                            batch.v_ref = reference_velocity(x_t, batch.t, batch.cond).float()
                batch.v = velocity(x_t, batch.t, batch.cond).float()
                loss, values = objective(batch)
                dist.backward(loss * pass_scale(p, n_global, dist, len(units)), model.denoiser, sync=p.sync)
                if p.weight:
                    values = {f"train/{k}": float(torch.as_tensor(v).detach()) for k, v in values.items()}
                    stats.add(len(p.rows), **values,
                              **{"train/loss": float(loss.detach())})
                    if progress is not None:
                        progress.update(len(p.rows))
            grad_norms.add(1.0, **{"train/grad_norm": optimizer_step(optimizer, params, dist,
                                                                     grad_clip=cfg.optim.grad_clip, ema=ema,
                                                                     health=health)})
            if after_step is not None:
                after_step()
    norm = grad_norms.means().get("train/grad_norm", 0.0)
    return {**stats.means(), "train/grad_norm": norm,
            "train/optimizer_steps": int(grad_norms.weights.get("train/grad_norm", 0)),
            "train/lr": optimizer.param_groups[0]["lr"]}


@dataclass
class ForwardConfig(OnlineConfig):
    """The sections of a forward-process recipe: :class:`OnlineConfig` with deterministic (ODE) rollouts by
    default, checked by :func:`check_forward_config`. A recipe adds its ``train`` section (and its defaults)."""

    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(step="ode"))

    def check(self) -> None:
        check_forward_config(self)


def check_forward_config(cfg) -> None:
    """Config checks every forward-process recipe shares (call from its ``Config.check``): a per-sample
    advantage estimator, and enough rollout-schedule positions for the training times."""
    if cfg.advantage.needs:
        fail("advantage.estimator", f"{cfg.advantage.estimator!r} assigns credit to denoising steps; this trainer "
             "uses one advantage per sample: choose outcome")
    cfg.train.times.check_schedule(cfg.sampling.num_steps)


def groups_stay_local(cfg, dist) -> None:
    """Raise a ConfigError unless every prompt group's samples are on one process (objectives that compare
    a group's samples need the whole group in one pass)."""
    from flowrl.config import ConfigError

    s = cfg.sampling
    if s.groups_per_epoch % dist.world_size:
        raise ConfigError("sampling.groups_per_epoch", f"{s.groups_per_epoch} groups do not split over "
                          f"{dist.world_size} processes; this trainer compares the samples of a group, so each "
                          f"process must hold whole groups: make groups_per_epoch a multiple of {dist.world_size}")


def forward_epoch(online, train_epoch: Callable, *, velocity_fn=None, **state) -> tuple[dict, object]:
    """The collect-and-train half of a forward-process recipe's epoch.

    Rolls out and scores the epoch (:meth:`flowrl.rl.online.OnlineLoop.collect`; ``velocity_fn``: sample with
    e.g. a snapshot), computes one advantage per sample and, unless every reward is NaN, calls the recipe's
    ``train_epoch(model, optimizer, data, sigmas, cfg, dist, epoch, ema=, health=, progress=, **state)`` on
    the epoch's :class:`ForwardData` inside the update block.

    Returns:
        ``(metrics, rollouts)``: the epoch's metrics so far and its rollouts (for ``online.end_epoch``).
    """
    cfg, run = online.cfg, online.run
    rollouts, advantages, valid, metrics = online.collect(run.epoch, velocity_fn=velocity_fn)
    if online.updates_policy(metrics):
        passes = int(valid.sum()) * cfg.train.times.count * cfg.train.inner_epochs
        with online.training(passes) as bar:
            data = ForwardData.from_rollouts(rollouts, advantages, valid)
            metrics.update(train_epoch(online.model, online.optimizer, data, online.sigmas, cfg, online.dist,
                                       run.epoch, ema=online.ema, health=run.health, progress=bar, **state))
    return metrics, rollouts
