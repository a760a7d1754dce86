"""Flow-GRPO: online RL of a flow-matching generator against rewards.

Paper: Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL" (2025), with its "Fast"
variant (train a window of the denoising steps), MixGRPO's sliding window and DanceGRPO's constant-noise
SDE as options. One epoch (DESIGN.md, data flow of one RL step):

1. the group sampler picks ``groups_per_epoch`` prompts, each ``group_size`` times, with per-sample seeds;
2. each process rolls out its shard with the configured SDE step inside the training window (ODE outside),
   recording latents and log-probs, decodes, and scores in a background thread while the next batch samples;
3. rewards are gathered, group advantages computed on the whole epoch, and each process keeps its slice;
4. for each inner epoch, minibatch and trained step: the same step function re-scores the stored
   transition under the current policy; clipped policy loss + Gaussian KL to the reference
   (LoRA adapters off, or a frozen copy); gradients accumulate over steps and micro-batches; one
   optimizer step per minibatch, with grad clipping and an EMA of the trained weights.

Where this departs from the paper's code (``MATH.md`` is the reference):
- the KL is the exact Gaussian KL ``||mu - mu_ref||^2 / (2 std^2)`` with ``std = g_t sqrt(|dt|)``;
  Flow-GRPO divides by ``g_t^2`` only, so its beta equals flowrl's beta divided by ``|dt|``
  (flowrl beta = Flow-GRPO beta x |dt|; 0.04 at 10 uniform steps becomes 0.004);
- log-probs use ``reduction`` (``mean`` by default, as Flow-GRPO, whose clip ranges assume it);
- samples whose reward is NaN are masked out of the update and counted, instead of poisoning it;
- the loss is normalised by the global number of (sample, trained step) pairs of the minibatch, so
  one process with accumulation ``2a`` and two processes with accumulation ``a`` take the same step.
  For denoising trajectories every sample trains the same steps, so MATH.md's four aggregation modes
  differ only by a constant factor: ``token_mean`` (default) and ``seq_mean_token_sum`` are offered.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm.auto import tqdm

from flowrl.config import RunConfig, bounds, fail, save_config
from flowrl.recipes import Recipe
from flowrl.registry import Registry

__all__ = ["Config", "main", "RECIPE", "ADVANTAGE_MODES", "EpochSamples", "rollout_epoch", "compute_advantages",
           "train_epoch", "build_model", "build_reward"]


# ============================================================================ config


@dataclass
class LoraConfig:
    rank: int = field(default=32, metadata=bounds(ge=1))
    alpha: float = field(default=64.0, metadata=bounds(gt=0))
    dropout: float = field(default=0.0, metadata=bounds(ge=0, lt=1))
    target_modules: list[str] = field(default_factory=list)  # empty: the adapter's defaults


@dataclass
class ModelConfig:
    name: Literal["shapes", "sd3", "flux"] = "shapes"
    path: str | None = None  # local dir or hub id; None = the shipped shapes model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    lora: LoraConfig | None = None  # None: full fine-tuning
    gradient_checkpointing: bool = False
    resolution: int | None = field(default=None, metadata=bounds(ge=64))  # sd3 / flux only
    # T5 tokens of the text conditioning (sd3 / flux); None: the pipeline's default (256 / 512).
    max_sequence_length: int | None = field(default=None, metadata=bounds(ge=1))


@dataclass
class DataConfig:
    train_prompts: str = "shapes:train"  # txt, jsonl or a built-in set
    eval_prompts: str = "shapes:eval"
    num_eval_prompts: int | None = field(default=600, metadata=bounds(ge=1))


@dataclass
class WindowConfig:
    mode: Literal["fixed", "random", "sliding"] = "fixed"
    start: int = field(default=0, metadata=bounds(ge=0))
    size: int | None = field(default=None, metadata=bounds(ge=1))  # None: every trainable step
    every: int = field(default=1, metadata=bounds(ge=1))  # sliding: epochs per one-step advance
    max_start: int | None = field(default=None, metadata=bounds(ge=0))


@dataclass
class SamplingConfig:
    num_steps: int = field(default=10, metadata=bounds(ge=2))
    eval_num_steps: int = field(default=40, metadata=bounds(ge=1))
    step: Literal["flow_sde", "dance_sde", "cps"] = "flow_sde"
    noise_level: float = field(default=0.7, metadata=bounds(ge=0))  # flow_sde / cps: a; dance_sde: eta
    reduction: Literal["mean", "sum"] = "mean"
    guidance: float = field(default=1.0, metadata=bounds(ge=0))  # rollout and training CFG
    eval_guidance: float | None = field(default=None, metadata=bounds(ge=0))  # None: same as guidance
    window: WindowConfig = field(default_factory=WindowConfig)
    group_size: int = field(default=8, metadata=bounds(ge=2))
    groups_per_epoch: int = field(default=8, metadata=bounds(ge=1))
    batch_size: int = field(default=32, metadata=bounds(ge=1))  # samples per rollout call, per process


@dataclass
class AdvantageConfig:
    estimator: str = "outcome"  # outcome | tp_grpo | cosine (see ADVANTAGE_MODES)
    normalizer: Literal["group", "rloo", "per_prompt"] = "group"
    std_scope: Literal["group", "batch", "none"] = "group"
    eps: float = field(default=1e-4, metadata=bounds(gt=0))
    clip: float = field(default=5.0, metadata=bounds(gt=0))
    per_prompt_buffer: int = field(default=32, metadata=bounds(ge=1))
    per_prompt_min_count: int = field(default=16, metadata=bounds(ge=1))
    negate: bool = False  # control runs only: climb the wrong way
    shuffle: bool = False  # control runs only: permute advantages across the epoch (random-advantage baseline)
    # tp_grpo: keep equal numbers of positive and negative turning points (largest magnitudes first).
    tp_balance: bool = False
    # cosine: average step contributions over windows of this many steps; alpha mixes in outcome credit.
    cosine_window: int = field(default=1, metadata=bounds(ge=1))
    cosine_alpha: float = field(default=0.0, metadata=bounds(ge=0, le=1))


@dataclass
class OptimConfig:
    lr: float = field(default=3e-4, metadata=bounds(gt=0))
    weight_decay: float = field(default=1e-4, metadata=bounds(ge=0))
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = field(default=1e-8, metadata=bounds(gt=0))
    warmup_epochs: int = field(default=0, metadata=bounds(ge=0))
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))


@dataclass
class TrainConfig:
    clip_range: float = field(default=1e-4, metadata=bounds(gt=0, lt=1))  # eps_low
    clip_range_high: float | None = field(default=None, metadata=bounds(gt=0))  # DAPO clip-higher
    dual_clip: float | None = field(default=None, metadata=bounds(gt=1))
    kl_beta: float = field(default=0.0, metadata=bounds(ge=0))  # flowrl convention (see module docstring)
    aggregation: Literal["token_mean", "seq_mean_token_sum"] = "token_mean"
    inner_epochs: int = field(default=1, metadata=bounds(ge=1))
    minibatches: int = field(default=1, metadata=bounds(ge=1))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1))  # samples per backward, per process
    ema_decay: float | None = field(default=None, metadata=bounds(gt=0, lt=1))  # None: no EMA


@dataclass
class RewardConfig:
    # name -> weight, or name -> {"weight": w, "kwargs": {...}} (see rewards.compose.build_reward)
    train: dict[str, Any] = field(default_factory=lambda: {"shapes": 1.0})
    # Rewards scored at evaluation; one that is also in `train` reuses its kwargs.
    eval: list[str] = field(default_factory=lambda: ["shapes"])


@dataclass
class EvalConfig:
    every_epochs: int | None = field(default=5, metadata=bounds(ge=1))
    # Also evaluate each time training time (evaluation excluded) passes a multiple of this.
    every_minutes: float | None = field(default=None, metadata=bounds(gt=0))
    at_start: bool = True
    batch_size: int = field(default=100, metadata=bounds(ge=1))
    grid_size: int = field(default=32, metadata=bounds(ge=0))


@dataclass
class LogConfig:
    backends: list[str] = field(default_factory=list)  # tensorboard, wandb
    project: str = "flowrl"


@dataclass
class CheckpointConfig:
    every_epochs: int = field(default=5, metadata=bounds(ge=1))
    keep: int = field(default=2, metadata=bounds(ge=1))


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/flow_grpo"))
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check(self) -> None:
        if self.advantage.estimator not in ADVANTAGE_MODES:
            fail("advantage.estimator", f"got {self.advantage.estimator!r}, expected one of "
                 f"{', '.join(ADVANTAGE_MODES.names())}")
        w = self.sampling.window
        trainable = self.sampling.num_steps - 1
        if w.size is not None and w.start + w.size > trainable:
            fail("sampling.window", f"start {w.start} + size {w.size} exceeds the {trainable} trainable steps of "
                 f"a {self.sampling.num_steps}-step schedule (the last step is deterministic)")
        if w.mode != "fixed" and w.size is None:
            fail("sampling.window.size", f"a {w.mode} window needs a size")
        if w.max_start is not None and w.size is not None and w.max_start + w.size > trainable:
            fail("sampling.window.max_start", f"max_start {w.max_start} + size {w.size} exceeds the {trainable} "
                 f"trainable steps of a {self.sampling.num_steps}-step schedule; lower max_start to at most "
                 f"{max(trainable - w.size, 0)} or leave it unset (the last start that fits)")
        if self.train.minibatches > self.sampling.groups_per_epoch * self.sampling.group_size:
            fail("train.minibatches", "more minibatches than samples per epoch")
        if not self.reward.train:
            fail("reward.train", "name at least one reward, e.g. {shapes: 1.0}")
        if self.model.name != "shapes" and self.model.path is None:
            fail("model.path", f"{self.model.name} needs a local directory or hub id")


# ============================================================================ components


def build_model(cfg: ModelConfig, device: torch.device):
    """The model adapter named by ``cfg`` (LoRA or full fine-tuning)."""
    from flowrl.models.base import LoraSettings

    dtype = getattr(torch, cfg.dtype)
    lora = None
    if cfg.lora is not None:
        lora = LoraSettings(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                            target_modules=list(cfg.lora.target_modules))
    if cfg.name == "shapes":
        from flowrl.models.shapes import ShapesModel

        return ShapesModel.from_pretrained(cfg.path, device=device, dtype=dtype, lora=lora,
                                           gradient_checkpointing=cfg.gradient_checkpointing)
    from flowrl.models.registry import load_model

    kwargs = {"dtype": dtype, "device": device, "lora": lora, "gradient_checkpointing": cfg.gradient_checkpointing}
    if cfg.resolution is not None:
        kwargs["resolution"] = cfg.resolution
    if cfg.max_sequence_length is not None:
        kwargs["max_sequence_length"] = cfg.max_sequence_length
    return load_model(cfg.name, cfg.path, **kwargs)


def build_reward(spec: dict[str, Any], device: torch.device | str | None = None):
    """One reward from the config's ``{name: weight | {weight, kwargs, transform}}`` mapping; rewards that
    take a ``device`` run on this process's device unless the config sets one."""
    from rewards.compose import build_reward as compose

    return compose(spec, device=None if device is None else str(device))


def _unweighted(entry: Any) -> Any:
    return {**entry, "weight": 1.0} if isinstance(entry, dict) else 1.0


# ============================================================================ advantage estimators

ADVANTAGE_MODES: Registry = Registry("advantage estimator")


# Step-level credit (MATH.md section 4) lives in its own module, registered lazily.
ADVANTAGE_MODES.register("tp_grpo", "flowrl.recipes.credit:tp_grpo_advantages")
ADVANTAGE_MODES.register("cosine", "flowrl.recipes.credit:cosine_advantages")


@ADVANTAGE_MODES.register("outcome")
def outcome_advantages(outcome: torch.Tensor, samples: "EpochSamples", **_: Any) -> torch.Tensor:
    """Flow-GRPO: every trained step of a sample gets that sample's advantage. Returns ``[n, T]``."""
    return outcome[:, None].expand(-1, samples.train_mask.numel()).clone()


# ============================================================================ one epoch


@dataclass
class EpochSamples:
    """One process's rollouts of an epoch (``n`` samples, ``T`` steps), kept on the CPU.

    Attributes:
        latents: ``[n, T + 1, C, H, W]`` states.
        log_probs: ``[n, T]`` rollout log-probs (0 at ODE steps).
        train_mask: ``[T]`` bool, the trained steps (the same window for every sample of the epoch).
        rewards: ``[n]`` training rewards (NaN where the reward failed).
        details: ``{name: [n]}`` reward details.
        prompts / metadata / group_ids / sample_ids: as in :class:`flowrl.data.group_sampler.EpochBatch`.
        cond: the text conditioning ``{key: [n, ...]}``.
        step: the ``samplers.Step`` the rollout used (re-scoring uses the same one).
        x0_preds: ``[n, T, C, H, W]`` predicted clean latents (when an estimator needs them).
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    train_mask: torch.Tensor
    rewards: torch.Tensor
    details: dict[str, torch.Tensor]
    prompts: list[str]
    metadata: list[dict]
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    sample_seeds: torch.Tensor
    cond: dict[str, torch.Tensor]
    step: Any
    images: torch.Tensor | None = None
    x0_preds: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _window(cfg: SamplingConfig):
    from samplers import Window

    w = cfg.window
    return Window(mode=w.mode, start=w.start, size=w.size, every=w.every, max_start=w.max_start)


def rollout_epoch(model, batch, cfg: Config, epoch: int, reward, *, store_x0: bool = False,
                  progress: tqdm | None = None) -> EpochSamples:
    """Roll out, decode and score one process's shard of an epoch.

    Scoring runs in a background thread while the next rollout batch samples.
    """
    from samplers import initial_noise, make_step, rollout

    s = cfg.sampling
    sigmas = model.sigmas(s.num_steps)
    step = make_step(s.step, sigmas, **({"eta": s.noise_level} if s.step == "dance_sde" else
                                        {"noise_level": s.noise_level}), reduction=s.reduction)
    velocity = model.velocity_fn(s.guidance)
    device = model.device
    n = len(batch.prompts)
    chunks: list[dict] = []
    futures: list[Future] = []
    score_seconds = [0.0]

    def score(images: torch.Tensor, prompts: list[str], metadata: list[dict]):
        start = time.perf_counter()
        try:
            return reward(images, prompts, metadata)
        finally:
            score_seconds[0] += time.perf_counter() - start

    t_start = time.perf_counter()
    model.eval()
    with ThreadPoolExecutor(max_workers=1) as pool:
        for start in range(0, n, s.batch_size):
            rows = slice(start, min(start + s.batch_size, n))
            prompts = batch.prompts[rows]
            cond = model.encode_prompts(prompts)
            x_init = initial_noise(model.latent_shape, batch.sample_seeds[rows], device=device)
            traj = rollout(velocity, x_init, sigmas, cond=cond, step=step, window=_window(s), iteration=epoch,
                           seed=cfg.run.seed, sample_seeds=batch.sample_seeds[rows], store_x0=store_x0,
                           model_dtype=model.dtype)
            images = model.decode(traj.x0)
            futures.append(pool.submit(score, images.cpu(), prompts, batch.metadata[rows]))
            chunks.append({"latents": traj.latents.cpu(), "log_probs": traj.log_probs.cpu(),
                           "cond": {k: v.cpu() for k, v in cond.items()}, "images": images.cpu(),
                           "x0_preds": traj.x0_preds.cpu() if store_x0 else None, "mask": traj.train_mask})
            if progress is not None:
                progress.update(rows.stop - rows.start)
        sampling_done = time.perf_counter()
        outputs = [f.result() for f in futures]
    t_end = time.perf_counter()
    model.train()
    rewards = torch.cat([o.scores.float() for o in outputs])
    detail_keys = outputs[0].details.keys()
    details = {k: torch.cat([o.details[k].float() for o in outputs]) for k in detail_keys}
    return EpochSamples(
        latents=torch.cat([c["latents"] for c in chunks]),
        log_probs=torch.cat([c["log_probs"] for c in chunks]),
        train_mask=chunks[0]["mask"],
        rewards=rewards,
        details=details,
        prompts=list(batch.prompts),
        metadata=list(batch.metadata),
        group_ids=batch.group_ids,
        sample_ids=batch.sample_ids,
        sample_seeds=batch.sample_seeds,
        cond={k: torch.cat([c["cond"][k] for c in chunks]) for k in chunks[0]["cond"]},
        step=step,
        images=torch.cat([c["images"] for c in chunks]),
        x0_preds=torch.cat([c["x0_preds"] for c in chunks]) if store_x0 else None,
        # Scoring overlaps sampling; "scoring" is the reward compute time, "scoring_wait" what sampling
        # did not hide.
        timings={"sampling": sampling_done - t_start, "scoring": score_seconds[0],
                 "scoring_wait": t_end - sampling_done},
    )


def compute_advantages(samples: EpochSamples, cfg: Config, dist, *, tracker=None, model=None,
                       reward=None, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Gather the epoch's rewards, compute advantages on whole groups, keep this process's slice.

    Returns:
        (advantages ``[n, T]`` for the local samples, valid ``[n]`` bool (finite reward), metrics).
    """
    from flowrl.core.advantages import group_advantages, rloo_advantages, zero_std_fraction

    a = cfg.advantage
    rewards = dist.gather(samples.rewards)
    group_ids = dist.gather(samples.group_ids)
    valid = torch.isfinite(rewards)
    outcome = torch.zeros_like(rewards)
    if valid.any():
        r, g = rewards[valid], group_ids[valid]
        if a.normalizer == "group":
            outcome[valid] = group_advantages(r, g, std_scope=a.std_scope, eps=a.eps, clip=a.clip)
        elif a.normalizer == "rloo":
            outcome[valid] = rloo_advantages(r, g)
        else:
            prompts = dist.gather_object(samples.prompts)
            kept = [p for p, ok in zip(prompts, valid.tolist()) if ok]
            outcome[valid] = tracker.update(kept, r)
    if a.negate:
        outcome = -outcome
    if a.shuffle:  # a control: the same advantage values, attached to random samples
        from samplers import derive_seed

        generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, epoch, 0x5F))
        order = torch.nonzero(valid).flatten()
        outcome[order] = outcome[order[torch.randperm(order.numel(), generator=generator)]]
    local = slice(dist.rank * samples.rewards.numel(), (dist.rank + 1) * samples.rewards.numel())
    estimator = ADVANTAGE_MODES.get(a.estimator)
    advantages = estimator(outcome[local], samples, cfg=cfg, dist=dist, model=model, reward=reward, epoch=epoch,
                           global_outcome=outcome, global_rewards=rewards, global_group_ids=group_ids)
    finite = rewards[valid]
    metrics = {
        "train/reward_mean": float(finite.mean()) if finite.numel() else math.nan,
        "train/reward_std": float(finite.std(unbiased=False)) if finite.numel() else math.nan,
        "train/zero_std_frac": zero_std_fraction(finite, group_ids[valid]) if finite.numel() else math.nan,
        "train/nan_rewards": int((~valid).sum()),
        "train/advantage_abs_mean": float(outcome[valid].abs().mean()) if valid.any() else 0.0,
    }
    metrics.update(getattr(estimator, "last_metrics", {}))  # step-level credit: turning-point rate, extra NFE
    return advantages, valid[local], metrics


def _minibatch_rows(cfg: Config, epoch: int, inner: int, samples: EpochSamples) -> list[torch.Tensor]:
    """Local row indices of each minibatch. The partition is drawn over global sample ids from
    ``(seed, epoch, inner)``, so it is the same whatever the number of processes."""
    from samplers import derive_seed

    total = int(samples.sample_ids.max()) + 1 if samples.sample_ids.numel() else 0
    generator = torch.Generator().manual_seed(derive_seed(cfg.run.seed, epoch, inner, 0x3B))
    global_order = torch.randperm(max(total, 1), generator=generator)
    global_chunk = torch.empty_like(global_order)
    global_chunk[global_order] = torch.arange(global_order.numel()) * cfg.train.minibatches // global_order.numel()
    chunk_of_local = global_chunk[samples.sample_ids]
    return [torch.nonzero(chunk_of_local == m).flatten() for m in range(cfg.train.minibatches)]


def train_epoch(model, optimizer, samples: EpochSamples, advantages: torch.Tensor, valid: torch.Tensor,
                cfg: Config, dist, epoch: int, *, scheduler=None, ema=None,
                progress: tqdm | None = None) -> dict[str, float]:
    """Clipped policy loss + KL over the trained steps; one optimizer step per minibatch.

    Args:
        advantages: ``[n, T]`` (only trained steps are read).
        valid: ``[n]`` bool, samples that take part (finite reward).
        progress: advanced by the number of samples of every (micro-batch, trained step) pass.

    Returns:
        Means over the epoch of the loss statistics (``train/...``).
    """
    from flowrl.core.losses import clipped_policy_loss, gaussian_kl
    from flowrl.models.base import cond_select

    t_cfg = cfg.train
    device = model.device
    steps = torch.nonzero(samples.train_mask).flatten().tolist()
    velocity = model.velocity_fn(cfg.sampling.guidance)
    params = model.trainable_parameters()
    sums: dict[str, float] = {}
    counts = 0
    optimizer_steps = 0

    def add(key: str, value: float, weight: float) -> None:
        sums[key] = sums.get(key, 0.0) + value * weight

    for inner in range(t_cfg.inner_epochs):
        for rows in _minibatch_rows(cfg, epoch, inner, samples):
            rows = rows[valid[rows]]
            # Global count of (sample, trained step) pairs in this minibatch: every process needs it to
            # normalise its share so that the all-reduced gradient is the global mean.
            n_global = int(dist.gather(torch.tensor([rows.numel()])).sum())
            if n_global == 0 or not steps:
                continue
            micro = list(rows.split(t_cfg.micro_batch_size))
            passes = [(m, t) for m in micro for t in steps]
            # Every process must make the same number of backward calls (DDP collectives).
            n_passes = int(dist.gather(torch.tensor([len(passes)])).max())
            optimizer.zero_grad(set_to_none=True)
            for i in range(n_passes):
                if i < len(passes):
                    m, t = passes[i]
                else:  # pad with a zero-weight pass on an idle process
                    m, t = rows[:1] if rows.numel() else torch.zeros(1, dtype=torch.long), steps[0]
                weight = 0.0 if i >= len(passes) else 1.0
                x = samples.latents[m, t].to(device)
                x_next = samples.latents[m, t + 1].to(device)
                cond = {k: v.to(device) for k, v in cond_select(samples.cond, m).items()}
                sigma = samples.step.sigmas[t].to(device).expand(len(m))
                v = velocity(x.to(model.dtype), sigma, cond)
                out = samples.step(v, x, t, x_next=x_next)
                old = samples.log_probs[m, t].to(device)
                adv = advantages[m, t].to(device)
                policy = clipped_policy_loss(out.log_prob[:, None], old[:, None], adv[:, None], None,
                                             eps_low=t_cfg.clip_range, eps_high=t_cfg.clip_range_high,
                                             dual_clip=t_cfg.dual_clip, aggregation="token_mean")
                loss = policy.loss
                kl_value = torch.zeros((), device=device)
                if t_cfg.kl_beta > 0:
                    with torch.no_grad(), model.reference():
                        v_ref = velocity(x.to(model.dtype), sigma, cond)
                        ref_mean = samples.step(v_ref, x, t, x_next=x_next).mean
                    kl = gaussian_kl(out.mean, ref_mean, out.std, reduction=cfg.sampling.reduction)
                    kl_value = kl.mean()
                    loss = loss + t_cfg.kl_beta * kl_value
                # This pass holds len(m) of the minibatch's n_global samples; token_mean divides by the
                # number of trained steps too. world_size undoes DDP's averaging over processes.
                scale = weight * len(m) / n_global * dist.world_size
                if t_cfg.aggregation == "token_mean":
                    scale /= len(steps)
                dist.backward(loss * scale, model.denoiser, sync=i == n_passes - 1)
                if weight:
                    add("train/loss", float(loss.detach()), len(m))
                    add("train/ratio_mean", float(policy.ratio_mean), len(m))
                    add("train/clip_frac", float(policy.clip_frac), len(m))
                    add("train/approx_kl", float(policy.approx_kl), len(m))
                    add("train/kl_ref", float(kl_value.detach()), len(m))
                    counts += len(m)
                    if progress is not None:
                        progress.update(len(m))
            grad_norm = dist.clip_grad_norm_(params, cfg.optim.grad_clip)
            add("train/grad_norm", float(grad_norm), 1.0)
            optimizer.step()
            optimizer_steps += 1
            if ema is not None:
                ema.step(params)
    if scheduler is not None:
        scheduler.step()
    metrics = {k: v / max(counts, 1) for k, v in sums.items() if k != "train/grad_norm"}
    metrics["train/grad_norm"] = sums.get("train/grad_norm", 0.0) / max(optimizer_steps, 1)
    metrics["train/optimizer_steps"] = optimizer_steps
    metrics["train/lr"] = optimizer.param_groups[0]["lr"]
    return metrics


# ============================================================================ evaluation


def evaluate_model(model, rewards: dict, prompt_set, cfg: Config, dist, output_dir: Path, epoch: int,
                   ema=None) -> dict[str, float]:
    """Deterministic ODE sampling on the eval prompts (fixed seeds), every eval reward; a sample grid."""
    from flowrl.sample import generate

    n = len(prompt_set)
    per_process = math.ceil(n / dist.world_size)
    rows = list(range(dist.rank * per_process, min((dist.rank + 1) * per_process, n)))
    seeds = [int(prompt_set.metadata[i].get("seed", i)) for i in rows]
    prompts = [prompt_set.prompts[i] for i in rows]
    params = model.trainable_parameters()
    if ema is not None:
        ema.store(params)
        ema.copy_to(params)
    model.eval()
    bar = tqdm(total=len(rows), desc=f"eval (epoch {epoch})", leave=False, disable=not dist.is_main,
               dynamic_ncols=True)
    try:
        images = generate(model, prompts, seeds, steps=cfg.sampling.eval_num_steps,
                          guidance=cfg.sampling.eval_guidance if cfg.sampling.eval_guidance is not None
                          else cfg.sampling.guidance, batch_size=cfg.eval.batch_size, progress=bar.update) if rows else None
    finally:
        bar.close()
        if ema is not None:
            ema.restore(params)
        model.train()
    metrics: dict[str, float] = {}
    pad = per_process - len(rows)  # equal shapes for the gather; padded rows are dropped after it
    for name, reward in rewards.items():
        if images is not None:
            out = reward(images, prompts, [prompt_set.metadata[i] for i in rows])
            scores, correct = out.scores.float(), out.details.get("correct")
        else:
            scores, correct = torch.zeros(0), None
        keep = torch.cat([torch.ones(len(rows)), torch.zeros(pad)])
        scores = dist.gather(torch.cat([scores, torch.zeros(pad)]))[dist.gather(keep) > 0]
        metrics[f"eval/{name}/mean"] = float(scores.mean())
        if correct is not None or name == "shapes":
            correct = correct.float() if correct is not None else torch.zeros(0)
            correct = dist.gather(torch.cat([correct, torch.zeros(pad)]))[dist.gather(keep) > 0]
            metrics[f"eval/{name}/accuracy"] = float(correct.mean())
            kinds = [m.get("kind") for m in prompt_set.metadata[: correct.numel()]]
            for kind in sorted({k for k in kinds if k}):
                selected = torch.tensor([k == kind for k in kinds])
                metrics[f"eval/{name}/{kind}"] = float(correct[selected].mean())
    if dist.is_main and images is not None and cfg.eval.grid_size:
        from flowrl.recipes.pretrain import _save_grid

        k = min(cfg.eval.grid_size, len(rows))
        _save_grid(images[:k], prompts[:k], output_dir / "samples" / f"epoch_{epoch:04d}.png")
    return metrics


# ============================================================================ main


def _next_multiple(minutes: float, every: float | None) -> float | None:
    """The next multiple of ``every`` strictly after ``minutes`` (None when ``every`` is None)."""
    return None if every is None else (math.floor(minutes / every + 1e-9) + 1) * every


def _peak_memory_mb() -> float:
    import resource

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run Flow-GRPO as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    from flowrl.checkpoint import CheckpointError, latest_checkpoint, load_state, rng_state, save_checkpoint, set_rng_state
    from flowrl.core.advantages import PerPromptStatTracker
    from flowrl.data.group_sampler import GroupSampler
    from flowrl.data.prompts import load_prompts
    from flowrl.dist import Dist
    from flowrl.logging import MetricsLogger
    from flowrl.runtime import Deadline, GracefulStop, prepare_run

    dist = dist or Dist()
    output_dir = prepare_run(cfg.run)
    if dist.is_main:
        save_config(cfg, output_dir / "config.yaml", extra={"recipe": "flow_grpo"})
    if model is None:
        model = build_model(cfg.model, dist.device)
    model.to(dist.device)
    model.freeze_reference()
    train_reward = build_reward(cfg.reward.train, dist.device)
    # An eval reward that is also a training reward takes the training entry's kwargs (paths, URLs).
    eval_rewards = {name: build_reward({name: _unweighted(cfg.reward.train.get(name, 1.0))}, dist.device)
                    for name in cfg.reward.eval}
    train_set = load_prompts(cfg.data.train_prompts)
    eval_set = load_prompts(cfg.data.eval_prompts, cfg.data.num_eval_prompts)
    sampler = GroupSampler(train_set.prompts, train_set.metadata, groups=cfg.sampling.groups_per_epoch,
                           group_size=cfg.sampling.group_size, seed=cfg.run.seed,
                           num_processes=dist.world_size, rank=dist.rank)
    params = model.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.adam_eps,
                                  weight_decay=cfg.optim.weight_decay)
    warmup = cfg.optim.warmup_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: min(1.0, (e + 1) / warmup) if warmup else 1.0)
    model.denoiser = dist.prepare(model.denoiser)
    ema = None
    if cfg.train.ema_decay is not None:
        from diffusers.training_utils import EMAModel

        ema = EMAModel(params, decay=cfg.train.ema_decay)
    tracker = PerPromptStatTracker(cfg.advantage.per_prompt_buffer, cfg.advantage.per_prompt_min_count,
                                   eps=cfg.advantage.eps, clip=cfg.advantage.clip)
    logger = MetricsLogger(output_dir, backends=cfg.log.backends, enabled=dist.is_main, project=cfg.log.project,
                           plot_groups={"reward": ["train/reward_mean"], "eval": ["eval/"],
                                        "policy": ["train/clip_frac", "train/approx_kl", "train/kl_ref"],
                                        "time": ["time/"]})
    epoch, images_sampled, train_minutes_before, wall_minutes_before = 0, 0, 0.0, 0.0

    if cfg.run.resume:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise CheckpointError(f"run.resume=true but {output_dir}/checkpoints holds no checkpoint; "
                                  "run without run.resume=true to start fresh")
        state = load_state(checkpoint)
        model.load_trainable_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if ema is not None:
            ema.load_state_dict(state["ema"])
        tracker.load_state_dict(state["tracker"])
        set_rng_state(state["rng"])
        epoch, images_sampled = int(state["epoch"]), int(state["images_sampled"])
        train_minutes_before = float(state["train_minutes"])
        wall_minutes_before = float(state["wall_minutes"])
        logger.truncate_after(epoch)
        if dist.is_main:
            print(f"flowrl: resumed from {checkpoint} at epoch {epoch}")

    def checkpoint_now() -> None:
        if not dist.is_main:
            return
        state = {"model": model.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "ema": ema.state_dict() if ema is not None else {},
                 "tracker": tracker.state_dict(), "rng": rng_state(), "epoch": epoch,
                 "images_sampled": images_sampled, "train_minutes": deadline.elapsed_minutes(),
                 "wall_minutes": wall_minutes_before + deadline.wall_minutes()}
        save_checkpoint(output_dir, epoch, state, keep=cfg.checkpoint.keep)

    deadline = Deadline(cfg.run.max_minutes, already_spent=train_minutes_before)
    next_eval_minutes = _next_multiple(train_minutes_before, cfg.eval.every_minutes)
    needs_x0 = cfg.advantage.estimator == "cosine"
    samples_per_epoch = cfg.sampling.groups_per_epoch * cfg.sampling.group_size
    status = "finished"
    with GracefulStop() as stop:
        if epoch == 0 and cfg.eval.at_start:
            with deadline.excluded():
                metrics = evaluate_model(model, eval_rewards, eval_set, cfg, dist, output_dir, 0, ema)
            logger.log({"epoch": 0, "images_sampled": 0, "time/train_min": 0.0,
                        "time/wall_min": deadline.wall_minutes(), **metrics})
            logger.plot()
            if dist.is_main:
                print("epoch 0: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k.endswith(("accuracy", "mean"))))
        bar = tqdm(total=cfg.run.max_epochs, initial=epoch, desc="flow_grpo", disable=not dist.is_main,
                   dynamic_ncols=True)
        while epoch < cfg.run.max_epochs:
            t0 = time.perf_counter()
            batch = sampler.epoch(epoch)
            inner = tqdm(total=len(batch.prompts), desc=f"epoch {epoch + 1} sampling", leave=False,
                         disable=not dist.is_main, dynamic_ncols=True)
            try:
                samples = rollout_epoch(model, batch, cfg, epoch, train_reward, store_x0=needs_x0, progress=inner)
            except Exception as err:
                # Nothing is lost: the last completed epoch is saved before the error surfaces.
                inner.close()
                checkpoint_now()
                saved = f"(checkpoint of epoch {epoch} saved in {output_dir}/checkpoints; resume with run.resume=true)"
                from flowrl.train import user_errors

                if isinstance(err, user_errors()):
                    raise type(err)(f"{err} {saved}") from err
                raise RuntimeError(f"epoch {epoch + 1}: sampling or scoring failed ({type(err).__name__}: {err}) "
                                   f"{saved}") from err
            inner.close()
            t1 = time.perf_counter()
            advantages, valid, metrics = compute_advantages(samples, cfg, dist, tracker=tracker, model=model,
                                                            reward=train_reward, epoch=epoch)
            t2 = time.perf_counter()
            if metrics["train/nan_rewards"] == samples_per_epoch:
                checkpoint_now()
                print(f"flowrl: every reward of epoch {epoch + 1} is NaN; check the reward "
                      f"({cfg.reward.train}) — stopping (checkpoint of epoch {epoch} saved)")
                status = "all rewards NaN"
                break
            # One tick per (sample, trained step) forward-backward pass.
            passes = int(valid.sum()) * int(samples.train_mask.sum()) * cfg.train.inner_epochs
            train_bar = tqdm(total=passes, desc=f"epoch {epoch + 1} training",
                             leave=False, disable=not dist.is_main, dynamic_ncols=True)
            metrics.update(train_epoch(model, optimizer, samples, advantages, valid, cfg, dist, epoch,
                                       scheduler=scheduler, ema=ema, progress=train_bar))
            train_bar.close()
            t3 = time.perf_counter()
            epoch += 1
            images_sampled += samples_per_epoch
            for key, value in samples.details.items():
                gathered = dist.gather(value)
                finite = gathered[torch.isfinite(gathered)]
                metrics[f"train/reward/{key}"] = float(finite.mean()) if finite.numel() else math.nan
            metrics.update({
                "epoch": epoch, "images_sampled": images_sampled,
                "time/sampling_s": samples.timings["sampling"], "time/scoring_s": samples.timings["scoring"],
                "time/scoring_wait_s": samples.timings["scoring_wait"], "time/advantages_s": t2 - t1,
                "time/training_s": t3 - t2, "time/epoch_s": t3 - t0,
                "time/train_min": deadline.elapsed_minutes(),
                "memory/peak_mb": _peak_memory_mb(),
            })
            stopping = dist.any(stop.requested or deadline.passed())
            due = (cfg.eval.every_epochs is not None and epoch % cfg.eval.every_epochs == 0) or (
                next_eval_minutes is not None and deadline.elapsed_minutes() >= next_eval_minutes)
            if due or stopping or epoch == cfg.run.max_epochs:
                with deadline.excluded():
                    metrics.update(evaluate_model(model, eval_rewards, eval_set, cfg, dist, output_dir, epoch, ema))
                next_eval_minutes = _next_multiple(deadline.elapsed_minutes(), cfg.eval.every_minutes)
            metrics["time/wall_min"] = wall_minutes_before + deadline.wall_minutes()
            logger.log(metrics)
            logger.plot()
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['train/reward_mean']:.3f}",
                            **({"eval": f"{metrics['eval/shapes/accuracy']:.3f}"} if "eval/shapes/accuracy" in metrics else {}))
            if epoch % cfg.checkpoint.every_epochs == 0 or stopping or epoch == cfg.run.max_epochs:
                checkpoint_now()
            if stopping:
                status = stop.reason or "time budget reached"
                break
        bar.close()
    logger.close()
    if dist.is_main:
        print(f"flowrl: flow_grpo stopped at epoch {epoch}/{cfg.run.max_epochs} ({status}); "
              f"outputs in {output_dir}")
    dist.close()
    return 0


RECIPE = Recipe(Config, main)
