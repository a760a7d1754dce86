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
- :class:`ForwardTrainConfig` and :class:`ForwardEpoch`: the epoch a recipe drives in its own loop: minibatches
  (of whole groups when the objective compares a group's samples), passes (micro-batch x training time), the
  velocities of the policy, of parameter snapshots and of the reference, the backward pass and the optimizer
  step (the recipe writes its objective inline between them).

Every random draw is a pure function of ``(run seed, epoch, inner epoch, global sample or group id,
time index)``, never of the process, so one process with accumulation ``2a`` and two with ``a`` draw the
same points and take the same step (docs/architecture.md, "Distributed training").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

from flowrl.config import bounds, fail
from flowrl.rl.setup import UpdateConfig

__all__ = ["TimesConfig", "ForwardTrainConfig", "ForwardData", "ForwardBatch", "schedule_positions", "draw_times",
           "forward_noise", "training_guidance", "ForwardEpoch", "forward_rows", "collect_forward", "groups_stay_local"]

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
            first = int(round(self.low * num_steps))
            fixes = [f"{where}.count={len(positions)}"] if positions else []
            if first + self.count <= num_steps:  # the high that takes `count` positions from low on
                fixes.append(f"{where}.high={(first + self.count) / num_steps:g}")
            elif self.count <= num_steps:
                fixes.append(f"{where}.low={(num_steps - self.count) / num_steps:g} and {where}.high=1.0")
            elif not positions:
                fixes.append(f"{where}.count={num_steps}, low=0.0 and high=1.0 (the whole schedule)")
            raise ConfigError(f"{where}.count", f"{self.count} times per sample, but only {len(positions)} positions "
                              f"of the {num_steps}-step rollout schedule lie in [low, high) = [{self.low}, "
                              f"{self.high}) (positions round(low T) <= i < round(high T) of sigma_0 = 1 > ... > "
                              f"sigma_{num_steps - 1}); set " + " or ".join(fixes))


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
        advantages: ``[n]`` per-sample advantages of an online epoch; None for offline preference pairs, which
            have labels instead (``chosen``).
        group_ids / sample_ids: ``[n]`` int64 global ids (a preference pair is a group of two).
        valid: ``[n]`` bool, rows that take part (finite reward).
        chosen: ``[n]`` bool preference labels of offline pairs (Diffusion-DPO): True for the chosen image of its
            pair, False for the rejected one; None for rollouts.
    """

    x0: torch.Tensor
    cond: dict[str, torch.Tensor]
    advantages: torch.Tensor | None
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    valid: torch.Tensor
    chosen: torch.Tensor | None = None

    @classmethod
    def from_rollouts(cls, rollouts, advantages: torch.Tensor, valid: torch.Tensor) -> "ForwardData":
        """The final samples of an epoch's rollouts with their per-sample advantages ``[n]``."""
        return cls(x0=rollouts.trajectory.x0, cond=rollouts.cond, advantages=advantages, group_ids=rollouts.group_ids,
                   sample_ids=rollouts.sample_ids, valid=valid)


@dataclass
class ForwardBatch:
    """One pass: ``m`` rows at one training time each.

    Attributes:
        rows: ``[m]`` local rows of the :class:`ForwardData`.
        t: ``[m]`` noise levels; ``x0``, ``eps``, ``x_t``, ``target`` (``u = eps - x0``): ``[m, *S]``.
        cond: the rows' conditioning; ``advantages`` (None for preference pairs) / ``group_ids``: ``[m]``.
        training_pass: the :class:`flowrl.rl.passes.TrainingPass` it belongs to (its weight and sync flag).
        chosen: ``[m]`` bool preference labels (offline pairs; None for rollouts).
    """

    rows: torch.Tensor
    t: torch.Tensor
    x0: torch.Tensor
    eps: torch.Tensor
    x_t: torch.Tensor
    target: torch.Tensor
    cond: dict[str, torch.Tensor]
    advantages: torch.Tensor | None
    group_ids: torch.Tensor
    training_pass: object = None
    chosen: torch.Tensor | None = None


class _StagedMinibatch:
    """One minibatch's per-row data on the device, laid out so that every pass reads contiguous slices.

    Gathered on the CPU in the order of :func:`flowrl.rl.passes.pass_layout` and moved in one copy per tensor (the
    clean samples, the training times, the noise of every training time, the conditioning, the advantages): a
    pass then makes no host-to-device copy, where building each pass's noised points on the host would make it
    wait for five or six. The noise of each (row, time) is :func:`forward_noise`'s, so the points are the same.
    """

    def __init__(self, data: ForwardData, passes, times: torch.Tensor, cfg: TimesConfig, *, seed: int, epoch: int,
                 inner: int, device):
        from flowrl.rl.passes import pass_layout, stage_rows

        self.data = data
        order, self.slices = pass_layout(passes)
        self.x0 = stage_rows(data.x0, order, device).to(torch.float32)  # [k, *S]
        self.t = stage_rows(times, order, device, transpose=True)  # [count, k]
        ids = (data.sample_ids if cfg.noise == "sample" else data.group_ids)[order]
        units = sorted({p.unit for p in passes})
        self.unit_at = {u: i for i, u in enumerate(units)}
        # [units, k, *S]: drawn on the CPU (as forward_noise always is) and moved in one copy.
        self.eps = torch.stack([forward_noise(tuple(data.x0.shape[1:]), ids, seed=seed, epoch=epoch, inner=inner,
                                              unit=u) for u in units]).to(device)
        self.cond = {k: stage_rows(v, order, device) for k, v in data.cond.items()}
        self.advantages = None if data.advantages is None else stage_rows(data.advantages, order, device)
        self.chosen = None if data.chosen is None else stage_rows(data.chosen, order, device)

    def batch(self, p, sl: slice) -> ForwardBatch:
        """The noised points of pass ``p`` (its rows are ``sl`` of the staging)."""
        x0, t, eps = self.x0[sl], self.t[p.unit, sl], self.eps[self.unit_at[p.unit], sl]
        tt = t.view(-1, *([1] * (x0.ndim - 1)))
        return ForwardBatch(rows=p.rows, t=t, x0=x0, eps=eps, x_t=(1 - tt) * x0 + tt * eps, target=eps - x0,
                            cond={k: v[sl] for k, v in self.cond.items()},
                            advantages=None if self.advantages is None else self.advantages[sl],
                            group_ids=self.data.group_ids[p.rows], training_pass=p,
                            chosen=None if self.chosen is None else self.chosen[sl])


def training_guidance(model, rollout_guidance: float) -> float:
    """The guidance the policy is trained at: none (1.0) for a model with classifier-free guidance (the
    forward-process trainers train CFG-free), the rollout's (``sampling.guidance``) for a guidance-distilled model
    (FLUX.1-dev reads its guidance as an input, so training at another value would train another function)."""
    return 1.0 if model.uses_cfg else rollout_guidance


class ForwardEpoch:
    """One epoch of a forward-process objective, driven by the recipe's own loop::

        epoch = ForwardEpoch(model, optimizer, data, sigmas, cfg.train, dist, epoch_index, seed=cfg.run.seed,
                             grad_clip=cfg.optim.grad_clip, guidance=cfg.sampling.guidance, whole_groups=True)
        for minibatch in epoch.minibatches():            # one optimizer step each
            for batch in minibatch:                      # a micro-batch's rows noised at one training time
                with torch.no_grad():
                    v_ref = epoch.velocity(batch, reference=True)
                v = epoch.velocity(batch)                # the policy, with gradient
                loss = my_loss(v, v_ref, batch.target, batch.advantages)
                epoch.backward(loss, batch, my_stat=...)  # scaled to the minibatch's global mean
            epoch.step()                                 # clip, step, EMA; skips a non-finite update
        return epoch.metrics()

    For each inner epoch the training times are drawn (:func:`draw_times`), minibatches partition global ids
    (of groups with ``whole_groups``, for objectives that compare a group's samples: a group must not span
    processes), and a minibatch's passes are its micro-batches times its training times, padded so that every
    process makes the same number of backward calls (:func:`flowrl.rl.passes.training_passes`). A minibatch's
    clean samples, times, noise, conditioning and advantages go to the device once, when its first pass is built
    (:class:`_StagedMinibatch`), and the statistics of :meth:`backward` stay there until :meth:`step` reads them
    in one go: a pass makes no host/device copy and no blocking read of its own.

    Args:
        model / optimizer: the policy adapter and its (prepared) optimizer.
        data: this process's :class:`ForwardData`.
        sigmas: the rollout schedule ``[T + 1]`` (for ``times.mode`` ``schedule`` / ``stratified``).
        train: the recipe's ``train`` section (a :class:`ForwardTrainConfig`).
        dist / epoch: the run's :class:`flowrl.dist.Dist` and the epoch index (it seeds every draw).
        seed: the run's seed (``run.seed``), which with the epoch seeds every draw.
        grad_clip: the gradient clip of the optimizer step (``optim.grad_clip``).
        guidance: the rollout's guidance (``sampling.guidance``): the training guidance of a guidance-distilled
            model (:func:`training_guidance`).
        ema / health / progress: the evaluation EMA, the run's update health, a progress bar (rows of passes).
    """

    def __init__(self, model, optimizer, data: ForwardData, sigmas: torch.Tensor, train: ForwardTrainConfig, dist,
                 epoch: int, *, seed: int, grad_clip: float, guidance: float, whole_groups: bool = False, ema=None,
                 health=None, progress=None):
        from flowrl.rl.passes import MetricMeans

        self.model, self.optimizer, self.data, self.sigmas = model, optimizer, data, sigmas
        self.train, self.dist, self.epoch, self.whole_groups = train, dist, epoch, whole_groups
        self.seed, self.grad_clip = seed, grad_clip
        self.ema, self.health, self.progress = ema, health, progress
        self.guidance = training_guidance(model, guidance)
        self.params = model.trainable_parameters()
        self.units = list(range(train.times.count))
        self.stats, self.grad_norms = MetricMeans(), MetricMeans()
        self._n_global = 0

    def minibatches(self) -> Iterator[Iterator[ForwardBatch]]:
        """Each minibatch's passes as noised :class:`ForwardBatch` es (built lazily, one at a time)."""
        from flowrl.rl.passes import global_count, minibatch_rows, training_passes

        t, data, seed = self.train, self.data, self.seed
        # The partition must agree across processes, so it is drawn over the global number of ids.
        ids = data.group_ids if self.whole_groups else data.sample_ids
        total = int(self.dist.gather(ids.max().view(1)).max()) + 1
        for inner in range(t.inner_epochs):
            times = draw_times(t.times, self.sigmas, data.group_ids, data.sample_ids, seed=seed, epoch=self.epoch,
                               inner=inner)
            for rows in minibatch_rows(ids, t.minibatches, seed=seed, epoch=self.epoch, inner=inner, total=total):
                rows = rows[data.valid[rows]]
                self._n_global = global_count(self.dist, rows)
                if self._n_global == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                passes = training_passes(rows, self.units, t.micro_batch_size, self.dist,
                                         groups=data.group_ids if self.whole_groups else None)
                yield self._noised(passes, times, inner)

    def _noised(self, passes, times: torch.Tensor, inner: int) -> Iterator[ForwardBatch]:
        """The passes' noised points, one at a time; the minibatch is staged on the device at the first."""
        staged = _StagedMinibatch(self.data, passes, times, self.train.times, seed=self.seed, epoch=self.epoch,
                                  inner=inner, device=self.model.device)
        for p, sl in zip(passes, staged.slices):
            yield staged.batch(p, sl)

    def velocity(self, batch: ForwardBatch, *, snapshot=None, reference: bool | float = False) -> torch.Tensor:
        """``[m, *S]`` float32 velocity at ``batch.x_t``: the policy's at the training guidance; with ``snapshot``
        (a :class:`flowrl.rl.param_snapshots.ParamSnapshot`) that snapshot's; with ``reference`` the frozen reference's
        (``True``: at the training guidance; a number: at that classifier-free guidance scale, CRD's teacher).
        Call the non-policy ones under ``torch.no_grad()``."""
        guidance = self.guidance if isinstance(reference, bool) else float(reference)
        x_t = batch.x_t.to(self.model.dtype)
        predict = self.model.velocity_fn(guidance)
        if snapshot is not None:
            with snapshot.active(self.model):
                return predict(x_t, batch.t, batch.cond).float()
        if reference is not False:
            with self.model.reference():
                return predict(x_t, batch.t, batch.cond).float()
        return predict(x_t, batch.t, batch.cond).float()

    def backward(self, loss: torch.Tensor, batch: ForwardBatch, **stats) -> None:
        """Back-propagate ``loss`` (the mean over the batch's rows) scaled to its share of the minibatch's
        global mean; ``stats`` (numbers or 0-d tensors) are averaged over the epoch, weighted by rows, and
        reported as ``train/<name>`` beside ``train/loss``."""
        from flowrl.rl.passes import pass_scale

        p = batch.training_pass
        self.dist.backward(loss * pass_scale(p, self._n_global, self.dist, len(self.units)), self.model.denoiser,
                           sync=p.sync)
        if p.weight:  # a padding pass's numbers do not count
            # Device tensors stay on the device until the optimizer step reads them all at once (MetricMeans);
            # numbers become CPU tensors first, as they always did (a float is logged at float32 precision).
            values = {f"train/{k}": torch.as_tensor(v) for k, v in stats.items()}
            self.stats.add(len(p.rows), **values, **{"train/loss": loss})
            if self.progress is not None:
                self.progress.update(len(p.rows))

    def step(self) -> float:
        """The minibatch's optimizer step (:func:`flowrl.run.updates.optimizer_step`); returns the gradient norm."""
        from flowrl.run.updates import optimizer_step

        self.stats.flush()  # the step's one read of its statistics, before the gradient norm's
        norm = optimizer_step(self.optimizer, self.params, self.dist, grad_clip=self.grad_clip, ema=self.ema,
                              health=self.health)
        self.grad_norms.add(1.0, **{"train/grad_norm": norm})
        return norm

    def metrics(self) -> dict[str, float]:
        """``train/...`` means over the epoch: the recipe's stats, ``loss``, ``grad_norm``, ``optimizer_steps``,
        ``lr``."""
        norm = self.grad_norms.means().get("train/grad_norm", 0.0)
        return {**self.stats.means(), "train/grad_norm": norm,
                "train/optimizer_steps": int(self.grad_norms.weights.get("train/grad_norm", 0)),
                "train/lr": self.optimizer.param_groups[0]["lr"]}


def groups_stay_local(sampling, dist) -> None:
    """Raise a ConfigError unless every prompt group's samples are on one process (objectives that compare
    a group's samples need the whole group in one pass). ``sampling``: the run's ``sampling`` section."""
    from flowrl.config import ConfigError

    s = sampling
    if s.groups_per_epoch % dist.world_size:
        raise ConfigError("sampling.groups_per_epoch", f"{s.groups_per_epoch} groups do not split over "
                          f"{dist.world_size} processes; this trainer compares the samples of a group, so each "
                          f"process must hold whole groups: make groups_per_epoch a multiple of {dist.world_size}")


def forward_rows(data: ForwardData, train: ForwardTrainConfig) -> int:
    """Rows the epoch's passes process (valid samples x training times x inner epochs of the ``train`` section): a
    progress bar's total."""
    return int(data.valid.sum()) * train.times.count * train.inner_epochs


def collect_forward(setup, *, velocity_fn=None):
    """A forward-process recipe's collection: roll out and score the epoch with :class:`flowrl.rl.setup.ImageTraining`
    (``velocity_fn``: sample with e.g. a snapshot), one advantage per sample, and the clean samples the update
    trains on.

    Returns:
        ``(rollouts, data, metrics)``: ``data`` is the epoch's :class:`ForwardData`, or None when this epoch does
        not update the policy (:meth:`flowrl.rl.setup.ImageTraining.updates_policy`).
    """
    rollouts, advantages, valid, metrics = setup.collect(setup.run.epoch, velocity_fn=velocity_fn)
    data = ForwardData.from_rollouts(rollouts, advantages, valid) if setup.updates_policy(metrics) else None
    return rollouts, data, metrics
