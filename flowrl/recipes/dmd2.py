"""DMD2: distil the model (the teacher) into a few-step student by distribution matching.

Paper: Yin, Gharbi, Park, Zhang, Shechtman, Durand, Freeman, "Improved Distribution Matching Distillation for Fast
Image Synthesis" (DMD2, NeurIPS 2024). The losses, their sources and the conversions to flowrl's velocity convention
are in :mod:`flowrl.core.distillation`; docs/trainers.md ("Distillation: DMD2") says where this recipe follows the
authors' training loop (github.com/tianweiy/DMD2 ``main/train_sd.py``, ``main/sd_unified_model.py``) and where it
departs. Three networks share the one model:

- the **student** (the generator ``G``): the trained weights (the whole denoiser, or the LoRA), initialised from the
  teacher, sampled on a fixed few-step schedule ``model.sigmas(train.student_steps)`` by the Euler ODE, the sampler
  the shared evaluator runs at ``sampling.eval_num_steps`` (which must equal ``student_steps``);
- the frozen **real score**, the teacher: ``model.reference()`` (LoRA adapters off, or the frozen copy of a full
  fine-tune), guided at ``train.real_guidance``;
- the **fake score**: a second trainable copy of the trained tensors (:class:`FakeScore`, swapped into the same
  network while it runs), unguided, with its own AdamW (``train.fake_lr``).

One training step ``g`` (global: ``epoch * steps_per_epoch + i``; ``train.minibatches`` steps per pass over the
epoch's prompts, ``train.inner_epochs`` passes) on micro-batches of ``train.micro_batch_size`` prompts:

1. **backward simulation** (DMD2's multi-step generator): a level ``k`` of the student's schedule is drawn uniformly
   from ``0..student_steps-1`` (one per step, the same on every process); the student runs, without gradients, its
   first ``k`` Euler steps from the samples' seeded noise, reaching ``x_k`` at ``sigma_k``;
2. the student's sample is its clean prediction there, ``x0 = x_k - sigma_k v_G(x_k, sigma_k)``, with gradients on a
   generator step (:func:`flowrl.core.distillation.is_generator_step`: ``g % dfake_gen_update_ratio == 0``);
3. on a generator step, the **DMD loss** (:func:`flowrl.core.distillation.dmd_generator_loss`, regression-free): a
   noise level drawn by :func:`~flowrl.core.distillation.sample_dmd_timesteps` (``min_step_percent`` ..
   ``max_step_percent`` of an ``num_train_timesteps``-step table of the model's own schedule), ``x_t = (1 - sigma)
   x0 + sigma eps``, the teacher's guided and the fake score's unguided velocities there; back-propagated into the
   student, whose optimizer steps (:func:`flowrl.run.updates.optimizer_step`, clip ``optim.grad_clip``);
4. at every step, the **fake-score loss** (:func:`~flowrl.core.distillation.fake_score_loss`, ``train.fake_weighting``)
   on the same detached samples (made before the student's update, as DMD2), at levels drawn over the whole table,
   back-propagated into the fake score, whose optimizer steps through the same guarded helper.

The GAN term is not implemented (``train.gan_weight`` must be 0). No reward trains anything; the evaluation's rewards
score the student at ``student_steps`` steps. Multi-process runs: DDP (the fake score's gradients are averaged
across processes); FSDP / DeepSpeed are refused (the fake score's tensors are not sharded).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch
from torch import nn

from flowrl.config import RunConfig, bounds, fail
from flowrl.recipes import Recipe
from flowrl.rl.sampling import SamplingConfig
from flowrl.rl.setup import OnlineConfig, UpdateConfig

__all__ = ["TrainConfig", "Config", "FakeScore", "StepHooks", "student_sample", "fake_score_update", "train_epoch",
           "main", "run_distillation", "RECIPE", "dry_run_overrides", "dry_run_work", "dry_run_memory"]

# Streams of derive_seed (distinct from the samplers' and the forward trainers').
STREAM_SIMULATION, STREAM_DMD, STREAM_FAKE = 0xD3D201, 0xD3D202, 0xD3D203


@dataclass
class TrainConfig(UpdateConfig):
    """``minibatches``: training steps per pass over the epoch's prompts (each a fake-score update, and a student
    update on the generator's steps); ``micro_batch_size``: prompts per backward (UpdateConfig's)."""

    student_steps: int = field(default=4, metadata=bounds(ge=1, le=100))  # the student's schedule (DMD2: 4)
    backward_simulation: bool = True  # False: the student is trained at pure noise only (a one-step generator)
    dfake_gen_update_ratio: int = field(default=5, metadata=bounds(ge=1, le=1000))  # fake updates per student update
    real_guidance: float = field(default=1.0, metadata=bounds(ge=0, le=100))  # the teacher's CFG (FLUX: embedded)
    min_step_percent: float = field(default=0.02, metadata=bounds(ge=0, le=1))  # the DMD point's range (DMD2's)
    max_step_percent: float = field(default=0.98, metadata=bounds(ge=0, le=1))
    num_train_timesteps: int = field(default=1000, metadata=bounds(ge=2, le=100_000))  # the table's length N
    fake_weighting: Literal["velocity", "epsilon", "edm"] = "velocity"  # fake_score_loss's weighting
    fake_lr: float | None = field(default=None, metadata=bounds(gt=0))  # None: optim.lr (DMD2 uses one lr)
    gan_weight: float = field(default=0.0, metadata=bounds(ge=0))  # DMD2's GAN term: not implemented, must be 0
    micro_batch_size: int = field(default=4, metadata=bounds(ge=1, le=4096))


@dataclass
class Config(OnlineConfig):
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/dmd2"))
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(step="ode", eval_num_steps=4))
    train: TrainConfig = field(default_factory=TrainConfig)

    def check(self) -> None:
        super().check()
        t, s = self.train, self.sampling
        if t.gan_weight > 0:
            fail("train.gan_weight", "DMD2's GAN term (a classifier head on the fake score's features) is not "
                 "implemented in this recipe; set it to 0")
        if s.eval_num_steps != t.student_steps:
            fail("sampling.eval_num_steps", f"the student is a {t.student_steps}-step generator and is evaluated at "
                 f"its own schedule: set sampling.eval_num_steps={t.student_steps} (or train.student_steps="
                 f"{s.eval_num_steps})")
        if s.base_last_steps:
            fail("sampling.base_last_steps", "the student takes every step of its schedule; set it to 0")
        if t.max_step_percent < t.min_step_percent:
            fail("train.max_step_percent", f"{t.max_step_percent} is below min_step_percent {t.min_step_percent}")
        if s.samples_per_epoch < t.minibatches:
            fail("train.minibatches", f"{t.minibatches} training steps need at least as many samples per epoch "
                 f"({s.samples_per_epoch})")


# --------------------------------------------------------------------------------------------------
# the fake score: a second set of the trained tensors on the same network


class FakeScore:
    """DMD2's fake score: a trainable copy of the model's trained tensors (the whole denoiser of a full fine-tune, the
    LoRA weights otherwise), initialised from them when built (before training: the teacher's function), run on the
    model's own network by swapping its tensors into the trained parameters (:meth:`active`). Checkpointed by
    ``state_dict`` / ``load_state_dict``."""

    def __init__(self, model):
        self.params = {name: nn.Parameter(p.detach().clone(), requires_grad=True)
                       for name, p in self._named_live(model)}
        if not self.params:
            raise ValueError("the model has no trainable parameters to copy into a fake score")

    @staticmethod
    def _named_live(model) -> list[tuple[str, nn.Parameter]]:
        from flowrl.models.base import unwrap

        return [(name, p) for name, p in unwrap(model.denoiser).named_parameters() if p.requires_grad]

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params.values())

    @contextlib.contextmanager
    def active(self, model) -> Iterator[None]:
        """Inside this context the model's trained parameters hold the fake score's values (and the fake score's the
        student's); a backward inside it puts the fake score's gradients in the trained parameters' ``.grad``, which
        :meth:`take_grads` moves over. A swap rather than ``torch.func.functional_call``: a checkpointed block
        recomputes its forward during the backward, outside any functional call, and must see the same tensors."""
        live = self._live(model)

        def swap():
            with torch.no_grad():
                for p, f in zip(live, self.params.values()):
                    p.data, f.data = f.data, p.data

        swap()
        try:
            yield
        finally:
            swap()

    def _live(self, model) -> list[nn.Parameter]:
        live = [p for _, p in self._named_live(model)]
        if len(live) != len(self.params):
            raise ValueError("the model's trainable parameters changed since the fake score was built")
        return live

    @contextlib.contextmanager
    def mixed(self, model, scale: float) -> Iterator[None]:
        """Inside this context the model predicts with the teacher plus ``scale`` of what the fake score has learned:
        the weights ``W_teacher + scale (W_fake - W_teacher)`` (DMDR's dynamic distribution guidance,
        :func:`flowrl.core.dmdr.dynamic_real_mix`). ``scale = 0`` is ``model.reference()``, the teacher itself. A LoRA's
        update is linear in its ``B``, so the mix runs the fake score's adapters with ``B`` scaled (the authors' LoRA
        scale); a full fine-tune interpolates every trained tensor between the frozen reference copy and the fake
        score's. For forward passes without gradients (the real score)."""
        if scale == 0:
            with model.reference():
                yield
            return
        from flowrl.models.base import unwrap

        live = self._live(model)
        if model.lora is not None:
            values = [f.detach() * scale if "lora_B" in name else f.detach() for name, f in self.params.items()]
        else:
            with model.reference():
                teacher = dict(unwrap(model.denoiser).named_parameters())
            values = [torch.lerp(teacher[name].detach().to(f.device, f.dtype), f.detach(), scale)
                      for name, f in self.params.items()]
        saved = [p.data for p in live]
        with torch.no_grad():
            for p, v in zip(live, values):
                p.data = v
        try:
            yield
        finally:
            with torch.no_grad():
                for p, d in zip(live, saved):
                    p.data = d

    def take_grads(self, model) -> None:
        """Move the gradients a backward inside :meth:`active` left in the trained parameters to the fake score's."""
        for (_, p), f in zip(self._named_live(model), self.params.values()):
            if p.grad is not None:
                f.grad = p.grad if f.grad is None else f.grad + p.grad
                p.grad = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.params.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.params):
            raise ValueError("the checkpoint's fake score does not match the model's trainable parameters (was it "
                             "saved with the same model and LoRA settings?)")
        with torch.no_grad():
            for k, p in self.params.items():
                p.copy_(state[k].to(p.device, p.dtype))


# --------------------------------------------------------------------------------------------------
# the pieces of one step


def student_sample(model, noise: torch.Tensor, cond, student_sigmas: torch.Tensor, level: int, guidance: float,
                   *, grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DMD2's backward simulation on the student's Euler ODE: run the student's first ``level`` steps from ``noise``
    without gradients, then predict the clean sample at ``student_sigmas[level]`` (with gradients when ``grad``).
    The same chain as ReFL's clean prediction (:func:`flowrl.core.reward_gradient.refl_sample`), in float32.

    Returns:
        ``(x0 [B, *S] float32, x_level [B, *S])``: the student's sample and the state it was predicted from.
    """
    from flowrl.core.reward_gradient import refl_sample

    velocity = model.velocity_fn(guidance)

    def v_fn(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return velocity(x.to(model.dtype), sigma, cond).float()

    with torch.set_grad_enabled(grad):
        out = refl_sample(v_fn, noise.float(), student_sigmas.float(), step=level)
    return out.x, out.grad_points[0].x


def _noised(x0: torch.Tensor, sigma: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    eps = torch.randn(x0.shape, generator=generator).to(x0.device)
    s = sigma.to(x0.device, torch.float32).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * eps, eps


def fake_score_update(model, fake: FakeScore, x0: torch.Tensor, cond, sigma: torch.Tensor, generator, *,
                      guidance: float, weighting: str, scale: float = 1.0, dist=None, sync: bool = True) -> float:
    """The fake score's denoising loss on the student's (detached) samples ``x0`` at noise levels ``sigma``,
    back-propagated (times ``scale``) into the fake score's tensors only. Call it inside ``fake.active(model)`` and
    call ``fake.take_grads(model)`` after the last micro-batch (``dist.backward`` with ``sync`` on the last: the DDP
    reduction of the accumulated gradients). Returns the loss."""
    from flowrl.core.distillation import fake_score_loss

    x0 = x0.detach()
    x_t, eps = _noised(x0, sigma, generator)
    v = model.velocity_fn(guidance)(x_t.to(model.dtype), sigma.to(x0.device, torch.float32), cond).float()
    out = fake_score_loss(v, x0, eps, sigma.to(x0.device), weighting=weighting)
    if dist is None:
        (out.loss * scale).backward()
    else:
        dist.backward(out.loss * scale, model.denoiser, sync=sync)
    return float(out.loss.detach())


def _dmd_point(model, real_score, fake: FakeScore, x0: torch.Tensor, cond, sigma: torch.Tensor, generator, *,
               real_guidance: float, fake_guidance: float):
    """The DMD point ``x_t = (1 - sigma) x0 + sigma eps`` and the real and fake scores' velocities there (no gradients;
    ``real_score`` is the context the real score runs in: the teacher's ``model.reference()``)."""
    with torch.no_grad():
        x_t, _ = _noised(x0.detach(), sigma, generator)
        s = sigma.to(x0.device, torch.float32)
        xin = x_t.to(model.dtype)
        with real_score:
            v_real = model.velocity_fn(real_guidance)(xin, s, cond).float()
        with fake.active(model):
            v_fake = model.velocity_fn(fake_guidance)(xin, s, cond).float()
    return x_t, s, v_real, v_fake


class StepHooks:
    """The places where a recipe built on DMD2's training step (:func:`train_epoch`) changes it: DMDR
    (flowrl/recipes/dmdr.py) adds a reward term and its cold-start schedules. Each default here is DMD2's, so
    ``train_epoch`` without hooks is DMD2. ``step`` is the global training step."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def dmd_sigma(self, step: int, batch_size: int, generator: torch.Generator, table: torch.Tensor) -> torch.Tensor:
        """``[B]`` noise levels of the DMD point (DMD2: steps over ``min_step_percent``..``max_step_percent``)."""
        from flowrl.core.distillation import sample_dmd_timesteps

        t = self.cfg.train
        return sample_dmd_timesteps(batch_size, generator=generator, min_step_percent=t.min_step_percent,
                                    max_step_percent=t.max_step_percent, num_train_timesteps=t.num_train_timesteps,
                                    sigma_table=table).sigma

    def fake_sigma(self, step: int, batch_size: int, generator: torch.Generator, table: torch.Tensor) -> torch.Tensor:
        """``[B]`` noise levels of the fake score's loss (DMD2: the whole table)."""
        from flowrl.core.distillation import sample_dmd_timesteps

        return sample_dmd_timesteps(batch_size, generator=generator, min_step_percent=0.0, max_step_percent=1.0,
                                    num_train_timesteps=self.cfg.train.num_train_timesteps, sigma_table=table).sigma

    def real_score(self, model, fake: FakeScore, step: int):
        """The context the real score runs in (DMD2: the frozen teacher)."""
        return model.reference()

    def generator_loss(self, step: int, x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor,
                       v_real: torch.Tensor, v_fake: torch.Tensor, prompts, metadata):
        """The student's loss on one micro-batch, an object with ``loss`` (carrying the graph to ``x0``) and ``stats``
        (``score_gap``; ``dmd_loss`` when the loss has other terms). DMD2: the regression-free DMD loss."""
        from flowrl.core.distillation import dmd_generator_loss

        return dmd_generator_loss(x0, x_t, sigma, v_real, v_fake)

    def metrics(self) -> dict[str, float]:
        """The epoch's extra ``train/...`` values (DMD2: none)."""
        return {}


def _generator(*parts: int) -> torch.Generator:
    from samplers.noise import derive_seed

    return torch.Generator().manual_seed(derive_seed(*parts))


def train_epoch(setup, fake: FakeScore, fake_optimizer, batch, cfg: Config, epoch: int, *,
                progress=None, hooks: StepHooks | None = None) -> dict[str, float]:
    """One epoch of DMD2 steps on this process's share of the epoch's prompts (``batch``, an
    :class:`flowrl.data.prompt_groups.EpochBatch`); see the module docstring. ``hooks`` (default DMD2's own) is how a
    recipe built on this step changes its noise levels, real score and student loss (:class:`StepHooks`).

    Returns:
        ``train/...``: ``dmd_loss`` and ``grad_norm`` (means over the generator steps; NaN in an epoch without one),
        ``fake_loss``, ``fake_grad_norm`` (means over every step), ``generator_steps``, ``fake_steps``,
        ``simulation_level`` (the mean level of the backward simulation), ``score_gap``, ``lr``, ``fake_lr``.
    """
    from flowrl.core.distillation import is_generator_step
    from flowrl.models.base import encode_rows
    from flowrl.rl.forward import training_guidance
    from flowrl.run.updates import optimizer_step
    from samplers import initial_noise

    model, dist, t, s = setup.model, setup.dist, cfg.train, cfg.sampling
    hooks = StepHooks(cfg) if hooks is None else hooks
    seed = cfg.run.seed
    params, fake_params = model.trainable_parameters(), fake.parameters()
    student_sigmas = model.sigmas(t.student_steps).to(torch.float32)
    table = model.sigmas(t.num_train_timesteps).flip(0)[: t.num_train_timesteps].to(torch.float32).clamp(0, 1)
    fake_guidance = training_guidance(model, s.guidance)  # none for a CFG model (the authors' unguided fake score)
    n = len(batch.prompts)
    bounds_ = [round(i * n / t.minibatches) for i in range(t.minibatches + 1)]
    steps_per_epoch = t.inner_epochs * t.minibatches
    dmd, norms, fake_losses, fake_norms, levels, gaps = [], [], [], [], [], []
    i = 0
    for _ in range(t.inner_epochs):
        for lo, hi in zip(bounds_[:-1], bounds_[1:]):
            step = epoch * steps_per_epoch + i
            i += 1
            generator_step = is_generator_step(step, t.dfake_gen_update_ratio)
            level = 0
            if t.backward_simulation and t.student_steps > 1:  # one level per step, the same on every process
                level = int(torch.randint(t.student_steps, (1,), generator=_generator(seed, STREAM_SIMULATION, step)))
            levels.append(level)
            starts = list(range(lo, hi, t.micro_batch_size)) if hi > lo else []
            samples = []
            setup.optimizer.zero_grad(set_to_none=True)
            step_dmd = []
            for j, start in enumerate(starts):
                rows = slice(start, min(start + t.micro_batch_size, hi))
                cond = encode_rows(model, batch.prompts[rows], batch.metadata[rows])
                noise = initial_noise(model.latent_shape, batch.sample_seeds[rows], device=model.device)
                x0, _ = student_sample(model, noise, cond, student_sigmas, level, s.guidance, grad=generator_step)
                gen = _generator(seed, STREAM_DMD, step, int(batch.sample_seeds[rows][0]))
                samples.append((x0.detach(), cond, int(batch.sample_seeds[rows][0])))
                share = (rows.stop - rows.start) / (hi - lo)
                if generator_step:
                    sigma = hooks.dmd_sigma(step, x0.shape[0], gen, table)
                    point = _dmd_point(model, hooks.real_score(model, fake, step), fake, x0, cond, sigma, gen,
                                       real_guidance=t.real_guidance, fake_guidance=fake_guidance)
                    out = hooks.generator_loss(step, x0, *point, batch.prompts[rows], batch.metadata[rows])
                    dist.backward(out.loss.float() * share, model.denoiser, sync=j == len(starts) - 1)
                    step_dmd.append((float(out.stats.get("dmd_loss", out.loss).detach()), share))
                    gaps.append(float(out.stats["score_gap"]))
            if generator_step and starts:
                norms.append(optimizer_step(setup.optimizer, params, dist, grad_clip=cfg.optim.grad_clip,
                                            ema=setup.ema, health=setup.run.health))
                dmd.append(sum(v * w for v, w in step_dmd))
            setup.optimizer.zero_grad(set_to_none=True)
            # the fake score's turn, on the samples the student made before its update (DMD2's order)
            fake_optimizer.zero_grad(set_to_none=True)
            step_fake = 0.0
            with fake.active(model):
                for j, (x0, cond, first_seed) in enumerate(samples):
                    share = x0.shape[0] / (hi - lo)
                    gen = _generator(seed, STREAM_FAKE, step, first_seed)
                    sigma = hooks.fake_sigma(step, x0.shape[0], gen, table)
                    step_fake += share * fake_score_update(model, fake, x0, cond, sigma, gen, guidance=fake_guidance,
                                                           weighting=t.fake_weighting, scale=share, dist=dist,
                                                           sync=j == len(samples) - 1)
                    if progress is not None:
                        progress.update(x0.shape[0])
                fake.take_grads(model)
            if samples:
                fake_norms.append(optimizer_step(fake_optimizer, fake_params, dist, grad_clip=cfg.optim.grad_clip,
                                                 health=setup.run.health))
                fake_losses.append(step_fake)
            fake_optimizer.zero_grad(set_to_none=True)

    def mean(values):
        return sum(values) / len(values) if values else math.nan

    return {"train/dmd_loss": mean(dmd), "train/grad_norm": mean(norms), "train/fake_loss": mean(fake_losses),
            "train/fake_grad_norm": mean(fake_norms), "train/generator_steps": len(norms),
            "train/fake_steps": len(fake_norms), "train/simulation_level": mean(levels), "train/score_gap": mean(gaps),
            "train/lr": setup.optimizer.param_groups[0]["lr"], "train/fake_lr": fake_optimizer.param_groups[0]["lr"],
            **hooks.metrics()}


def main(cfg: Config, *, model=None, dist=None) -> int:
    """Run DMD2 as configured. ``model`` / ``dist`` may be injected (tests, notebooks)."""
    return run_distillation(cfg, "dmd2", model=model, dist=dist,
                            plot_groups={"dmd2": ["train/dmd_loss", "train/fake_loss"],
                                         "dmd2_grad_norm": ["train/grad_norm", "train/fake_grad_norm"]})


def run_distillation(cfg: Config, recipe: str, *, model=None, dist=None, train_reward: bool = False,
                     plot_groups: dict | None = None, hooks=None) -> int:
    """The run of a recipe built on DMD2's step: the setup, the fake score with its optimizer and schedule (tracked, so
    a resumed run continues exactly), then :func:`train_epoch` per epoch. ``train_reward``: build the training reward
    (DMD2 trains on none; the evaluation's stays); ``hooks``: ``hooks(setup) -> StepHooks`` (default DMD2's)."""
    import dataclasses

    from flowrl.config import ConfigError
    from flowrl.rl.optim import build_optimizer
    from flowrl.rl.setup import ImageTraining

    setup = ImageTraining(cfg, recipe, model=model, dist=dist, ema_decay=cfg.train.ema_decay, per_sample=True,
                          reference=True,  # the teacher is the real score
                          train_reward=train_reward, plot_groups=plot_groups,
                          sample_steps=(cfg.train.student_steps, "train.student_steps"))
    run = setup.run
    if setup.dist.shards_weights:
        raise ConfigError("run", f"DMD2's fake score is a second, unsharded copy of the trained tensors; run it on one "
                          f"GPU or under DDP (configs/accelerate/multi_gpu.yaml), not {setup.dist.backend}")
    step_hooks = hooks(setup) if hooks is not None else None
    fake = FakeScore(setup.model)
    optim = cfg.optim if cfg.train.fake_lr is None else dataclasses.replace(cfg.optim, lr=cfg.train.fake_lr)
    fake_optimizer, fake_scheduler = build_optimizer(fake.parameters(), optim, schedule_unit="epoch",
                                                     max_epochs=cfg.run.max_epochs)
    run.track(fake_score=fake, fake_optimizer=fake_optimizer, fake_scheduler=fake_scheduler)
    with run:
        while run.next_epoch():
            batch = setup.prompt_groups.epoch(run.epoch)
            with setup.training(len(batch.prompts) * cfg.train.inner_epochs) as bar:
                metrics = train_epoch(setup, fake, fake_optimizer, batch, cfg, run.epoch, progress=bar,
                                      hooks=step_hooks)
            fake_scheduler.step()
            setup.end_epoch(metrics)
    return run.finish()


def dry_run_overrides(data: dict, workdir) -> list[str]:
    """The dry run shrinks ``sampling.eval_num_steps``; the student's schedule follows it (the two must agree)."""
    sampling, train = data.get("sampling") or {}, data.get("train") or {}
    steps = sampling.get("eval_num_steps")
    if isinstance(steps, int) and train.get("student_steps") != steps:
        train["student_steps"] = steps
        return [f"train.student_steps: {steps} (the dry run's sampling.eval_num_steps)"]
    return []


RECIPE = Recipe(Config, main)


def dry_run_memory(cfg: Config) -> dict:
    """What the dry run's memory estimate adds and leaves out for this recipe (flowrl/commands/dryrun.py): the fake
    score (a second float32 copy of the trained tensors with its own AdamW), and no training reward."""
    return {"fake_score": True, "train_reward": False}


def dry_run_work(cfg: Config) -> list[str]:
    """One epoch's work for the dry run's report (flowrl/commands/dryrun.py)."""
    t, s = cfg.train, cfg.sampling
    steps = t.minibatches * t.inner_epochs
    return [f"{s.samples_per_epoch} prompts per epoch ({s.groups_per_epoch} x {s.group_size}) x {t.inner_epochs} "
            f"pass(es) in {steps} step(s), micro-batches of {t.micro_batch_size}: each step draws the student's "
            f"samples (backward simulation: up to {t.student_steps - 1} student calls without gradients, then one) "
            "and updates the fake score on them (one forward-backward each)",
            f"every {t.dfake_gen_update_ratio}th step is also a generator step: the teacher (guidance "
            f"{t.real_guidance:g}) and the fake score score the noised samples, and the student's call back-propagates "
            "the distribution-matching loss"]
