"""The parts every online image recipe builds the same way, and the epoch steps they share.

A recipe's ``main`` stays a readable loop (docs/architecture.md, "Adding a trainer")::

    setup = ImageTraining(cfg, "my_recipe", model=model, dist=dist, ema_decay=cfg.train.ema_decay)
    run, model = setup.run, setup.model
    run.track(old=snapshot)                                   # the recipe's own extra state
    with run:
        while run.next_epoch():
            rollouts, advantages, valid, metrics = setup.collect(run.epoch)
            if setup.updates_policy(metrics):                # run.check_rewards, reward.discriminator
                with setup.training(passes) as bar:          # run.updating(), precision, progress
                    metrics.update(train_epoch(...))
            setup.end_epoch(metrics, rollouts)               # scheduler, reward details, timings, log
    return run.finish()

:class:`ImageTraining` builds the run (:class:`flowrl.run.harness.Run`), the model, the training reward, the
prompt groups, the evaluator (with its hacking panel), AdamW with its warm-up, the EMA and the per-prompt
tracker, and checkpoints them under the names ``model``, ``optimizer``, ``scheduler``, ``ema``, ``tracker``;
a trainable reward in the training reward (the adversarial discriminator) trains on the collected images on
the schedule of ``reward.discriminator`` and is checkpointed as ``reward_models``
(:mod:`flowrl.rl.reward_training`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
from tqdm.auto import tqdm

from flowrl.config import RunConfig, bounds, fail
from flowrl.models.config import ModelConfig
from flowrl.rl.epoch_advantages import LOOP_INPUTS, AdvantageConfig
from flowrl.eval.evaluate import EvalConfig
from flowrl.rl.optim import OptimConfig
from flowrl.rl.sampling import SamplingConfig
from flowrl.run.harness import CheckpointConfig, LogConfig
from rewards.config import RewardConfig

__all__ = ["DataConfig", "OnlineConfig", "ForwardConfig", "UpdateConfig", "ImageTraining", "IMAGE_PLOTS",
           "IMAGE_PLOT_UNITS", "reference_uses", "recorded_reference_declarations"]


@dataclass
class DataConfig:
    train_prompts: str = "shapes:train"  # txt, jsonl, editing shards (a dir of edits-*.tar) or a built-in set
    eval_prompts: str = "shapes:eval"
    num_eval_prompts: int | None = field(default=600, metadata=bounds(ge=1, le=100_000))
    # How training prompts are drawn by task kind (their metadata's "kind"; flowrl/data/prompt_groups.py): balanced
    # (every kind equally often), uniform (every prompt equally often), mixed (kinds in proportion to the share of
    # their recent groups with mixed rewards) or {kind: weight}. A prompt set without kinds is drawn uniformly.
    kind_weights: Literal["balanced", "uniform", "mixed"] | dict[str, float] = "balanced"
    mixed_decay: float = field(default=0.7, metadata=bounds(ge=0, lt=1))  # mixed: weight of the past shares
    mixed_floor: float = field(default=0.25, metadata=bounds(ge=0, le=1))  # mixed: least weight / an equal share


# What tells a user whether an image trainer works, one unit per axis.
IMAGE_PLOTS = {"reward": ["train/reward_mean"], "eval": ["eval/"], "grad_norm": ["train/grad_norm"],
               "signal": ["train/zero_std_frac", "train/clip_frac"],
               "policy": ["train/approx_kl", "train/kl_ref", "hack/kl_to_base"],
               "hack_accuracy": ["hack/accuracy*", "hack/heldout/*"], "hack_objects": ["hack/extra_object*"],
               "hack_pixels": ["hack/bg_shift", "hack/drift_pixel"], "hack_background": ["hack/bg_[rgb]*"],
               "hack_features": ["hack/drift_feature", "hack/diversity"], "hack_flow": ["hack/fm_to_base"],
               "hack_image": ["hack/color_hist_shift", "hack/dark_frac", "hack/saturated_frac", "hack/hf_energy"],
               "hack_entropy": ["hack/color_entropy"], "discriminator": ["adv/d_acc", "adv/d_acc_fresh"],
               "kinds": ["data/weight/*"]}
IMAGE_PLOT_UNITS = {"reward": "training reward (mean +- std over the epoch)", "eval": "held-out score / accuracy",
                    "grad_norm": "gradient norm before clipping", "signal": "fraction",
                    "policy": "KL (nats per element)", "hack_accuracy": "accuracy / held-out reward",
                    "hack_objects": "extra objects per image (rate, mean count)",
                    "hack_pixels": "RGB distance (0-255)", "hack_background": "mean background colour (0-255)",
                    "hack_features": "feature cosine distance",
                    "hack_flow": "mean squared velocity gap to the base on the policy's samples",
                    "hack_image": "fraction (histogram shift: total variation to the base's colours)",
                    "hack_entropy": "colour entropy (bits, 512 cells)",
                    "discriminator": "adversarial discriminator accuracy "
                                     "(fresh: before stepping on the epoch's samples)",
                    "kinds": "share of the next epoch's groups drawn from each task kind"}


@dataclass
class OnlineConfig:
    """The sections every online recipe's ``Config`` composes (a recipe subclasses it, adds its ``train``
    section and may redeclare a section to change its defaults)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def check(self) -> None:
        self.advantage.check_loop("denoising trajectories", LOOP_INPUTS)


@dataclass
class ForwardConfig(OnlineConfig):
    """The sections of a forward-process recipe (:mod:`flowrl.rl.forward`): :class:`OnlineConfig` with
    deterministic (ODE) rollouts by default and checks every forward-process recipe shares: a per-sample advantage
    estimator, and enough rollout-schedule positions for the training times. A recipe adds its ``train`` section
    (a :class:`flowrl.rl.forward.ForwardTrainConfig`) and its defaults."""

    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(step="ode"))

    def check(self) -> None:
        super().check()
        if self.advantage.needs:
            fail("advantage.estimator", f"{self.advantage.estimator!r} assigns credit to denoising steps; this "
                 "trainer uses one advantage per sample: choose outcome")
        self.train.times.check_schedule(self.sampling.num_steps)


@dataclass
class UpdateConfig:
    """The ``train`` fields that shape the update of every trainer but Flow-GRPO (which keeps its own)."""

    inner_epochs: int = field(default=1, metadata=bounds(ge=1, le=100))
    minibatches: int = field(default=1, metadata=bounds(ge=1, le=10_000))  # optimizer steps per inner epoch
    micro_batch_size: int = field(default=32, metadata=bounds(ge=1, le=4096))  # rows per backward, per process
    # The evaluation EMA of the trained weights (None: none), decayed once per optimizer step: after n steps an update
    # weighs ema_decay^n (flowrl.rl.optim.build_ema). The one meaning of `ema_decay` in every config.
    ema_decay: float | None = field(default=None, metadata=bounds(gt=0, lt=1))


def _pixels(model) -> tuple[int, int] | None:
    """The ``(H, W)`` of the model's images, which editing prompts' source images are resized to (None for a model
    without a VAE scale factor: sources keep their own size)."""
    scale = getattr(model, "vae_scale_factor", None)
    if not scale:
        return None
    height, width = model.latent_shape[-2:]  # (C, h, w), or (C, F, h, w) for a video model
    return height * scale, width * scale


class ImageTraining:
    """The shared parts of an online recipe (see the module docstring).

    Args:
        cfg: the recipe's config (``run``, ``model``, ``data``, ``sampling``, ``advantage``, ``optim``,
            ``reward``, ``eval``, ``log``, ``checkpoint`` sections).
        recipe: the recipe's registry name.
        model / dist: injected model adapter and :class:`flowrl.dist.Dist` (tests, notebooks).
        ema_decay: decay of the evaluation EMA of the trained weights (None: no EMA).
        plot_groups: extra plots beside :data:`IMAGE_PLOTS`, as for :class:`flowrl.run.harness.Run`.
        per_sample: advantages are one per sample (``[n]``; trainers without denoising-step credit).
        rollouts: False for offline trainers (no training reward, prompt groups or advantage tracker; the
            config then needs no ``advantage`` section and no training prompts).
        reference: whether the recipe's objective uses the reference model with this config (e.g.
            ``cfg.train.kl_coef > 0``; DGPO, Diffusion-DPO and D3PO always). With the evaluation's and sampling's
            uses (:func:`reference_uses`) it decides whether a full fine-tune keeps a frozen copy of the denoiser;
            without one, ``model.reference()`` raises. Default True: a recipe that does not say keeps the copy.
        train_reward: False for a recipe that samples prompts but trains without a reward (DMD2's distillation):
            ``reward.train`` is not built (its model would cost memory for nothing); the evaluation's reward is.
        sample_steps: ``(steps, key)``: the steps the recipe samples its training images with and the key that sets
            them, for a recipe that does not roll out at ``sampling.num_steps`` (DMD2: ``train.student_steps``). A
            model exported as a few-step student that is sampled or evaluated on another schedule gets a warning
            (:func:`flowrl.rl.sampling.student_notes`), as does an SDE whose few large steps overshoot the noise
            level (:func:`flowrl.rl.sampling.rollout_notes`).

    Attributes:
        run, dist, model, reward, prompt_groups, evaluator, optimizer, scheduler, ema, tracker; and, for online
        recipes, ``sigmas`` (the rollout schedule), ``step`` and ``window`` (the rollout's ``samplers.Step``
        and ``samplers.Window``, from the ``sampling`` section).
    """

    def __init__(self, cfg, recipe: str, *, model=None, dist=None, ema_decay: float | None = None,
                 plot_groups: dict[str, list[str]] | None = None, per_sample: bool = False, rollouts: bool = True,
                 reference: bool = True, train_reward: bool = True, sample_steps: tuple[int, str] | None = None):
        from flowrl.core.advantages import PerPromptStatTracker
        from flowrl.data.prompt_groups import PromptGroups
        from flowrl.data.prompts import load_prompts
        from flowrl.eval.evaluate import Evaluator
        from flowrl.config import to_dict
        from flowrl.rl.optim import build_ema, build_optimizer
        from flowrl.rl.reward_training import RewardTraining
        from flowrl.run.checkpoints import TrainableWeights
        from flowrl.run.harness import Run

        self.cfg, self.recipe, self.per_sample = cfg, recipe, per_sample
        self.reference_uses = reference_uses(cfg.sampling, cfg.eval, reference)  # why it is needed (empty: it is not)
        for declared in _RECORDERS:
            declared.append(reference)
        self.run = run = Run(cfg.run, recipe, schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint,
                             precision=cfg.sampling.precision, reward=str(cfg.reward.train), config=to_dict(cfg),
                             dist=dist, plots={**IMAGE_PLOTS, **(plot_groups or {})}, units=IMAGE_PLOT_UNITS,
                             counters=("images_sampled",))
        self.dist, s = run.dist, cfg.sampling
        from flowrl.hardware import check_bfloat16

        check_bfloat16(s.precision, self.dist.device, "sampling.precision")
        check_bfloat16(cfg.eval.precision, self.dist.device, "eval.precision")
        self.model = model = self._prepare_model(model)
        self.reward = self.prompt_groups = self.tracker = None
        if rollouts:
            # A recipe that trains without a reward (distillation) builds none: a reward model costs memory.
            self.reward = cfg.reward.build_train(self.dist.device) if train_reward else None
            train_set = load_prompts(cfg.data.train_prompts, resolution=_pixels(model))
            d = cfg.data
            self.prompt_groups = PromptGroups(train_set.prompts, train_set.metadata, groups=s.groups_per_epoch,
                                              group_size=s.group_size, seed=cfg.run.seed,
                                              num_processes=self.dist.world_size, rank=self.dist.rank,
                                              kind_weights=d.kind_weights, mixed_decay=d.mixed_decay,
                                              mixed_floor=d.mixed_floor)
            if d.kind_weights == "mixed":  # the weights follow the rewards: part of the checkpoint
                run.track(prompt_groups=self.prompt_groups)
            a = cfg.advantage
            self.tracker = PerPromptStatTracker(a.per_prompt_buffer, a.per_prompt_min_count, eps=a.eps, clip=a.clip)
        self.reward_training = RewardTraining(self.reward, cfg.reward.discriminator, self.dist)
        run.track(reward_models=self.reward_training if self.reward_training else None)
        self.step = self.window = None
        if rollouts:
            from flowrl.rl.sampling import rollout_step, rollout_window

            self.sigmas = model.sigmas(s.num_steps)
            self.step, self.window = rollout_step(s, self.sigmas), rollout_window(s)
            self._few_step_warnings(sample_steps)
        self.evaluator = Evaluator(cfg.eval, cfg.reward.build_eval(self.dist.device),
                                   load_prompts(cfg.data.eval_prompts, cfg.data.num_eval_prompts,
                                                resolution=_pixels(model)),
                                   steps=s.eval_num_steps, guidance=s.guidance if s.eval_guidance is None
                                   else s.eval_guidance, dist=self.dist, output_dir=run.output_dir,
                                   logger=run.logger, heldout=cfg.reward.build_heldout(self.dist.device),
                                   kl_step=self.step, kl_guidance=s.guidance, fm_sigmas=model.sigmas(s.num_steps))
        self.optimizer, self.scheduler = build_optimizer(model.trainable_parameters(), cfg.optim,
                                                         schedule_unit="epoch", max_epochs=cfg.run.max_epochs)
        # Together: FSDP2 swaps the optimizer's parameters for the sharded ones, DeepSpeed builds one engine.
        model.denoiser, self.optimizer = self.dist.prepare_training(
            model.denoiser, self.optimizer, micro_batch_size=cfg.train.micro_batch_size, grad_clip=cfg.optim.grad_clip)
        self.ema = build_ema(model.trainable_parameters(), ema_decay)  # the prepared (possibly sharded) ones
        run.track(model=TrainableWeights(model, module=model.denoiser), optimizer=self.optimizer,
                  scheduler=self.scheduler, ema=self.ema, tracker=self.tracker)
        # sampling.base_last_steps: the base model takes the tail of every rollout and evaluation (from this level).
        self.tail_sigma = None
        if rollouts and s.base_last_steps:
            from flowrl.rl.base_tail import tail_sigma

            self.tail_sigma = tail_sigma(self.sigmas, s.base_last_steps)
        run.evaluation(self._evaluate)
        self._train_start = time.perf_counter()

    def _few_step_warnings(self, sample_steps: tuple[int, str] | None) -> None:
        """Warn (main process) when a few-step student runs off its schedule or the SDE overshoots its noise levels
        (docs/trainers.md, "Few-step students")."""
        from flowrl.models.resolve import exported_student_steps
        from flowrl.rl.sampling import rollout_notes, student_notes

        s = self.cfg.sampling
        steps, key = sample_steps if sample_steps is not None else (None, "sampling.num_steps")
        notes = student_notes(exported_student_steps(self.cfg.model.path), s, steps, key)
        if sample_steps is None:  # the rollout samples with sampling.step
            notes += rollout_notes(s, self.sigmas)
        if self.dist.is_main:
            for note in notes:
                print(f"flowrl: warning: {note}", file=sys.stderr, flush=True)

    def _evaluate(self, epoch: int, should_stop) -> dict[str, float]:
        from flowrl.rl.base_tail import base_tail

        with base_tail(self.model, self.tail_sigma):
            return self.evaluator(self.model, epoch, self.ema, should_stop)

    def _prepare_model(self, model=None):
        """Build the model of ``cfg.model`` (unless one is given), move it to this process's device, keep the
        reference weights of a full fine-tune only when something uses them (:attr:`reference_uses`), and keep
        float32 master weights for a full fine-tune of a 16-bit model (before the optimizer sees them)."""
        self.dist.check_model_dtype(self.cfg.model.dtype)  # the launch config's mixed precision must agree
        if model is None:
            from flowrl.models.config import build_model

            self._check_device(self.cfg.model)
            model = build_model(self.cfg.model, self.dist.device)
        model.to(self.dist.device)
        if self.reference_uses:
            model.freeze_reference()  # full fine-tuning: a copy in the loaded dtype (LoRA: adapters off, no copy)
        model.keep_float32_master_weights()  # full fine-tuning in bf16 / fp16 only
        return model

    def _check_device(self, model_cfg) -> None:
        """A real-size model must not land on the CPU unless ``run.device=cpu`` says so (sized from its configs, before
        any weight loads: :func:`flowrl.models.footprint.footprint`)."""
        from flowrl.hardware import check_not_silently_cpu

        if self.cfg.run.device != "auto" or self.dist.device.type != "cpu" or model_cfg.name == "shapes":
            return
        from flowrl.models.footprint import footprint

        fp = footprint(model_cfg)
        denoiser = None if fp is None else max(fp.params.get("transformer", 0), fp.params.get("unet", 0)) or None
        check_not_silently_cpu(self.cfg.run.device, self.dist.device, denoiser,
                               f"{model_cfg.name} {model_cfg.path or ''}".strip())

    def precision(self):
        """The ``sampling.precision`` autocast context (rollouts and training, never evaluation)."""
        from flowrl.rl.sampling import autocast

        return autocast(self.cfg.sampling, self.dist.device)

    def collect(self, epoch: int, *, velocity_fn=None, store_x0: bool = False, store_means: bool = False):
        """Roll out, decode and score this process's shard of ``epoch``, then compute advantages.

        Args:
            epoch: the epoch (drives prompts, seeds and the window).
            velocity_fn: sample with this velocity (e.g. a snapshot's) instead of the policy's.
            store_x0: keep the predicted clean latents of every step (cosine credit).
            store_means: keep every step's transition mean (RatioNorm, Flow-DPPO).

        Returns:
            ``(rollouts, advantages, valid, metrics)`` as :func:`flowrl.rl.collect.collect_epoch` and
            :func:`flowrl.rl.epoch_advantages.compute_advantages` return them (``metrics`` with
            ``time/advantages_s``).
        """
        from flowrl.rl.epoch_advantages import compute_advantages
        from flowrl.rl.collect import collect_epoch

        cfg, dist, s = self.cfg, self.dist, self.cfg.sampling
        if self.tail_sigma is not None:
            from flowrl.rl.base_tail import base_tail_velocity

            velocity_fn = base_tail_velocity(self.model, velocity_fn or self.model.velocity_fn(s.guidance),
                                             self.model.velocity_fn(s.guidance), self.tail_sigma)
        bar = tqdm(total=s.samples_per_epoch // dist.world_size, desc=f"epoch {epoch + 1} sampling", leave=False,
                   disable=not dist.is_main, dynamic_ncols=True)
        with bar, self.precision():
            rollouts = collect_epoch(self.model, self.prompt_groups.epoch(epoch), step=self.step, window=self.window,
                                     epoch=epoch, seed=cfg.run.seed, reward=self.reward, guidance=s.guidance,
                                     batch_size=s.batch_size, store_x0=store_x0, store_means=store_means,
                                     velocity_fn=velocity_fn, progress=bar)
        start = time.perf_counter()
        with self.precision():
            advantages, valid, metrics = compute_advantages(
                rollouts, cfg.advantage, dist, seed=cfg.run.seed, epoch=epoch, tracker=self.tracker, model=self.model,
                reward=self.reward, guidance=s.guidance, batch_size=s.batch_size, per_sample=self.per_sample)
        metrics.update(self.reward_training.update(epoch, rollouts))  # after scoring: the rewards used the old head
        metrics.update(self.prompt_groups.observe(epoch, dist.gather(rollouts.rewards)))  # the next epoch's kinds
        self._train_start = time.perf_counter()
        metrics["time/advantages_s"] = self._train_start - start
        return rollouts, advantages, valid, metrics

    def updates_policy(self, metrics: dict) -> bool:
        """Whether this epoch updates the policy: not on a discriminator-only epoch of ``reward.discriminator``,
        nor when every reward is NaN (:meth:`flowrl.run.harness.Run.check_rewards`, which also stops a run
        whose rewards stay degenerate)."""
        if not self.reward_training.trains_policy(self.run.epoch):
            return False
        return self.run.check_rewards(metrics, self.cfg.sampling.samples_per_epoch)

    @contextlib.contextmanager
    def training(self, total: int, epoch: int | None = None) -> Iterator:
        """The update block: ``run.updating()``, the precision context and a progress bar of ``total`` ticks."""
        epoch = self.run.epoch if epoch is None else epoch
        with self.run.updating(), self.precision(), tqdm(total=total, desc=f"epoch {epoch + 1} training",
                                                         leave=False, disable=not self.dist.is_main,
                                                         dynamic_ncols=True) as bar:
            yield bar

    def end_epoch(self, metrics: dict, rollouts=None, *, images: int | None = None) -> None:
        """Step the learning-rate schedule, add the reward details and timings of ``rollouts``, and close
        the epoch (:meth:`flowrl.run.harness.Run.end_epoch`: evaluate if due, log, checkpoint).

        ``images``: images sampled this epoch (default ``sampling.samples_per_epoch``)."""
        self.scheduler.step()
        if rollouts is not None:
            for key, value in rollouts.details.items():
                gathered = self.dist.gather(value)
                finite = gathered[torch.isfinite(gathered)]
                metrics[f"train/reward/{key}"] = float(finite.mean()) if finite.numel() else math.nan
            metrics.update({"time/sampling_s": rollouts.timings["sampling"],
                            "time/scoring_s": rollouts.timings["scoring"],
                            "time/scoring_wait_s": rollouts.timings["scoring_wait"]})
        metrics["time/training_s"] = time.perf_counter() - self._train_start
        self.run.end_epoch(metrics, images_sampled=self.cfg.sampling.samples_per_epoch if images is None else images)


# Active recorders of the reference declarations of the OnlineLoops built inside them (the dry run's).
_RECORDERS: list[list[bool]] = []


@contextlib.contextmanager
def recorded_reference_declarations() -> Iterator[list[bool]]:
    """The ``reference`` argument of every :class:`ImageTraining` built inside the block, in order (the dry run reads
    what the recipe declared for its config, to size the real run's memory)."""
    declared: list[bool] = []
    _RECORDERS.append(declared)
    try:
        yield declared
    finally:
        _RECORDERS.remove(declared)


def reference_uses(sampling: SamplingConfig, eval_cfg: EvalConfig, objective: bool) -> list[str]:
    """What uses the reference (base) model in a run; empty when nothing does, and then a full fine-tune keeps no
    frozen copy of its denoiser (a LoRA's reference is free: its adapters off).

    Args:
        sampling / eval_cfg: the run's ``sampling`` and ``eval`` sections.
        objective: the recipe's declaration: its objective uses the reference with this config.

    Returns:
        One short phrase per use: the objective; ``sampling.base_last_steps`` (the base takes the last steps of
        every rollout); the evaluation's hacking panel (the base model's images for ``hack/drift_*``, and
        ``hack/kl_to_base`` / ``hack/fm_to_base``); the sample grid's base-model column (``eval.grid_size``),
        drawn by the reference weights whenever the first evaluation of a process comes after training started
        (``eval.at_start: false``, or a resumed run). The run evaluates at least at its last epoch, so these
        count whenever they are enabled.
    """
    uses = ["the objective"] if objective else []
    if sampling.base_last_steps:
        uses.append("sampling.base_last_steps")
    if eval_cfg.hacking.enabled:
        uses.append("eval.hacking (the base model's images and hack/*_to_base)")
    if eval_cfg.grid_size:
        uses.append("eval.grid_size (the base model's column of the sample grid)")
    return uses
