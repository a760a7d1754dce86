"""Flow-matching pretraining of the tiny shapes text-to-image model (docs/algorithms.md, section 1).

Loss: ``t ~ logit-normal(0, 1)``, ``x_t = (1 - t) x0 + t eps``, ``L = mean ||v_hat(x_t, t, c) - (eps - x0)||^2``,
with the prompt dropped to the empty string with probability ``cond_dropout`` so that classifier-free
guidance works. The UNet and the text encoder train together; an EMA of both (with warm-up, so that
early checkpoints are usable) is what evaluation and the saved model use.

Every batch is a pure function of ``(run.seed, step)``: examples come from the shapes world's indexed
stream and the noise, timesteps and dropout from a generator seeded by the step. Together with the
optimizer, LR schedule and EMA state in the checkpoint, a resumed run continues exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.config import RunConfig, bounds, fail, save_config
from flowrl.models.shapes import ShapesModel, ShapesModelConfig
from flowrl.recipes import Recipe

__all__ = ["Config", "main", "RECIPE"]


@dataclass
class DataConfig:
    batch_size: int = field(default=64, metadata=bounds(ge=1))
    steps_per_epoch: int = field(default=250, metadata=bounds(ge=1))


@dataclass
class OptimConfig:
    lr: float = field(default=8e-4, metadata=bounds(gt=0))
    weight_decay: float = field(default=0.01, metadata=bounds(ge=0))
    warmup_steps: int = field(default=200, metadata=bounds(ge=0))
    # Cosine decay to `min_lr_ratio * lr` over `decay_epochs` epochs (None: run.max_epochs), so a run can
    # stop early on a longer schedule and still be reproduced exactly.
    min_lr_ratio: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    decay_epochs: int | None = field(default=None, metadata=bounds(ge=1))
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))


@dataclass
class EmaConfig:
    decay: float = field(default=0.999, metadata=bounds(gt=0, lt=1))
    # diffusers EMAModel warm-up: decay_t = min(decay, 1 - (1 + t)^-power).
    warmup_power: float = field(default=2 / 3, metadata=bounds(gt=0))


@dataclass
class LossConfig:
    cond_dropout: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    logit_normal_mean: float = 0.0
    logit_normal_std: float = field(default=1.0, metadata=bounds(gt=0))


@dataclass
class EvalConfig:
    every_epochs: int = field(default=4, metadata=bounds(ge=1))
    num_prompts: int = field(default=120, metadata=bounds(ge=1))
    steps: int = field(default=20, metadata=bounds(ge=1))
    guidance: float = field(default=1.0, metadata=bounds(ge=0))


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/shapes_pretrain", max_epochs=40))
    model: ShapesModelConfig = field(default_factory=ShapesModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint_minutes: float = field(default=5.0, metadata=bounds(gt=0))
    # The guidance scale stored with the saved model as its default.
    default_guidance: float = field(default=1.0, metadata=bounds(ge=0))

    def check(self) -> None:
        if self.optim.warmup_steps > self.run.max_epochs * self.data.steps_per_epoch:
            fail("optim.warmup_steps", f"{self.optim.warmup_steps} is longer than the whole run "
                 f"({self.run.max_epochs} epochs x {self.data.steps_per_epoch} steps)")


def _lr_lambda(cfg: Config):
    import math

    total = max((cfg.optim.decay_epochs or cfg.run.max_epochs) * cfg.data.steps_per_epoch, 1)
    warmup, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _batch(cfg: Config, model: ShapesModel, step: int):
    """The training batch of ``step``: clean images in [-1, 1], tokens, and the step's own noise."""
    from flowrl.data.shapes import render_batch, sample_examples

    n = cfg.data.batch_size
    examples = sample_examples("train", n, seed=cfg.run.seed, start=step * n)
    generator = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + step)
    drop = torch.rand(n, generator=generator) < cfg.loss.cond_dropout
    prompts = ["" if d else e.prompt for e, d in zip(examples, drop.tolist())]
    x0 = model.encode_images(render_batch([e.scene for e in examples]))
    noise = torch.randn(x0.shape, generator=generator)
    t = torch.sigmoid(cfg.loss.logit_normal_mean + cfg.loss.logit_normal_std * torch.randn(n, generator=generator))
    return x0, model.tokenize(prompts), noise, t


def flow_matching_loss(model: ShapesModel, x0: torch.Tensor, tokens: dict, noise: torch.Tensor,
                       t: torch.Tensor) -> torch.Tensor:
    """docs/algorithms.md, section 1: ``mean ||v_hat(x_t, t) - (eps - x0)||^2`` with ``x_t = (1 - t) x0 + t eps``."""
    t_ = t.view(-1, 1, 1, 1)
    x_t = (1 - t_) * x0 + t_ * noise
    cond = model.encode_text(tokens)
    v_hat = model._predict(model.denoiser, x_t, t, cond).float()
    return torch.nn.functional.mse_loss(v_hat, noise - x0)


def _evaluate(cfg: Config, model: ShapesModel, ema, output_dir: Path, epoch: int) -> dict:
    from flowrl.data.shapes import eval_prompt_set
    from flowrl.sample import evaluate
    from rewards import load as load_reward

    params = _trainable(model)
    ema.store(params)
    ema.copy_to(params)
    model.eval()
    # The text encoder trains here, so prompt embeddings cached at an earlier evaluation are stale.
    model.clear_prompt_cache()
    try:
        rows = eval_prompt_set(cfg.eval.num_prompts)
        summary, images = evaluate(model, load_reward("shapes"), rows, steps=cfg.eval.steps,
                                   guidance=cfg.eval.guidance)
    finally:
        ema.restore(params)
        model.clear_prompt_cache()
        model.train()
    _save_grid(images[:64], [r[0] for r in rows[:64]], summary, output_dir / "samples" / f"epoch_{epoch:04d}.png")
    metrics = {"eval/shapes/accuracy": summary["overall"], "eval/shapes/mean": summary["score_mean"]}
    metrics.update({f"eval/shapes/{k}": v["accuracy"] for k, v in summary["kinds"].items()})
    return metrics


def _save_grid(images: torch.Tensor, prompts: list[str], summary: dict, path: Path, columns: int = 8) -> None:
    """The evaluation's first images, eight to a row, each captioned with its prompt (wrapped)."""
    import textwrap

    from flowrl.grid import image_grid

    rows = (len(prompts) + columns - 1) // columns
    pad = rows * columns - len(prompts)
    images = torch.cat([images, torch.ones(pad, *images.shape[1:])]) if pad else images
    captions = ["\n".join(textwrap.wrap(p, 20)[:3]) for p in prompts] + [""] * pad
    grid = image_grid(images, [f"{r * columns}-{min((r + 1) * columns, len(prompts)) - 1}" for r in range(rows)],
                      [str(c) for c in range(columns)], captions, row_label_width=60)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def _trainable(model: ShapesModel) -> list[torch.nn.Parameter]:
    return list(model.denoiser.parameters()) + list(model.text_encoder.parameters())


def main(cfg: Config) -> int:
    from diffusers.training_utils import EMAModel

    from flowrl.checkpoint import latest_checkpoint, load_state, save_checkpoint
    from flowrl.logging import MetricsLogger
    from flowrl.runtime import Deadline, GracefulStop, prepare_run

    output_dir = prepare_run(cfg.run)
    save_config(cfg, output_dir / "config.yaml", extra={"recipe": "pretrain"})
    model = ShapesModel.build(cfg.model, seed=cfg.run.seed, default_guidance=cfg.default_guidance)
    model.text_encoder.requires_grad_(True).train()
    model.train()
    params = _trainable(model)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    ema = EMAModel(params, decay=cfg.ema.decay, use_ema_warmup=True, inv_gamma=1.0, power=cfg.ema.warmup_power)
    total_steps = cfg.run.max_epochs * cfg.data.steps_per_epoch
    step, minutes_before = 0, 0.0
    logger = MetricsLogger(output_dir, plot_groups={"loss": ["train/loss"], "eval": ["eval/shapes/"]})

    if cfg.run.resume:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            print(f"flowrl: run.resume=true but {output_dir}/checkpoints has no checkpoint; "
                  "run without run.resume=true to start fresh")
            return 2
        state = load_state(checkpoint)
        model.denoiser.load_state_dict(state["unet"])
        model.text_encoder.load_state_dict(state["text_encoder"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        ema.load_state_dict(state["ema"])
        step = int(state["step"])
        minutes_before = float(state.get("train_minutes", 0.0))
        logger.truncate_after(step // cfg.data.steps_per_epoch)
        print(f"flowrl: resumed from {checkpoint} at step {step}")
    elif (output_dir / "metrics.jsonl").exists():
        (output_dir / "metrics.jsonl").unlink()

    def checkpoint_now() -> None:
        state = {"unet": model.denoiser.state_dict(), "text_encoder": model.text_encoder.state_dict(),
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "ema": ema.state_dict(), "step": step, "train_minutes": deadline.elapsed_minutes()}
        save_checkpoint(output_dir, step, state, write_extra=lambda d: _save_model(model, ema, d / "model"))

    deadline = Deadline(cfg.run.max_minutes, already_spent=minutes_before)
    last_checkpoint = time.monotonic()
    progress = tqdm(total=total_steps, initial=step, desc="pretrain", dynamic_ncols=True)
    losses: list[float] = []
    epoch_start = time.monotonic()
    with GracefulStop() as stop:
        if step == 0:
            with deadline.excluded():
                logger.log({"epoch": 0, "step": 0, **_evaluate(cfg, model, ema, output_dir, 0)})
        while step < total_steps:
            x0, tokens, noise, t = _batch(cfg, model, step)
            loss = flow_matching_loss(model, x0, tokens, noise, t)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            ema.step(params)
            step += 1
            losses.append(loss.item())
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if step % cfg.data.steps_per_epoch == 0:
                epoch = step // cfg.data.steps_per_epoch
                metrics = {"epoch": epoch, "step": step, "train/loss": sum(losses) / len(losses),
                           "train/grad_norm": float(grad_norm), "train/lr": scheduler.get_last_lr()[0],
                           "time/epoch_seconds": time.monotonic() - epoch_start,
                           "time/minutes": deadline.elapsed_minutes()}
                losses = []
                if epoch % cfg.eval.every_epochs == 0 or step == total_steps:
                    with deadline.excluded():
                        metrics.update(_evaluate(cfg, model, ema, output_dir, epoch))
                    progress.write(f"epoch {epoch}: eval accuracy {metrics['eval/shapes/accuracy']:.3f}")
                logger.log(metrics)
                logger.plot()
                epoch_start = time.monotonic()
            if stop.requested or deadline.passed():
                break
            if time.monotonic() - last_checkpoint > cfg.checkpoint_minutes * 60:
                checkpoint_now()
                last_checkpoint = time.monotonic()
    progress.close()
    checkpoint_now()
    _save_model(model, ema, output_dir / "model")
    logger.close()
    reason = stop.reason or ("time budget reached" if deadline.passed() else "finished")
    print(f"flowrl: pretraining stopped at step {step}/{total_steps} ({reason}); model saved to {output_dir / 'model'}")
    return 0


def _save_model(model: ShapesModel, ema, path: Path) -> None:
    """Save raw weights and, as the default-loaded ``*_ema`` folders, the EMA weights."""
    import copy

    ema_model = copy.deepcopy(model)
    ema.copy_to(_trainable(ema_model))
    model.save_pretrained(path, ema=ema_model)


RECIPE = Recipe(Config, main)
