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

from dataclasses import dataclass, field
from pathlib import Path
import torch

from flowrl.config import RunConfig, bounds, fail
from flowrl.data.shapes import TASK_KINDS as _TASK_KINDS
from flowrl.models.shapes import ShapesModel, ShapesModelConfig
from flowrl.recipes import Recipe
from flowrl.rl.optim import OptimConfig
from flowrl.run.harness import CheckpointConfig, EvalSchedule, LogConfig

__all__ = ["Config", "main", "RECIPE"]


@dataclass
class DataConfig:
    batch_size: int = field(default=64, metadata=bounds(ge=1))
    steps_per_epoch: int = field(default=250, metadata=bounds(ge=1))
    # The task kinds the examples cycle through (flowrl.data.shapes.TASK_KINDS); a kind listed k times gets k shares,
    # e.g. [position, position, single_object, two_object, counting, colors, color_attr] puts 2/7 of every batch on
    # relations. Default: every kind once (the shipped model's data).
    kinds: list[str] = field(default_factory=lambda: list(_TASK_KINDS))


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
class EvalConfig(EvalSchedule):
    every_epochs: int = field(default=4, metadata=bounds(ge=1))
    num_prompts: int = field(default=120, metadata=bounds(ge=1))
    steps: int = field(default=20, metadata=bounds(ge=1))
    guidance: float = field(default=1.0, metadata=bounds(ge=0))


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/shapes_pretrain", max_epochs=40))
    model: ShapesModelConfig = field(default_factory=ShapesModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # The learning-rate schedule steps after every optimizer step (flowrl.rl.optim.SCHEDULE_UNITS) and anneals:
    # decay_epochs is a number of epochs (a run can then stop early on a longer schedule and still be reproduced
    # exactly), or `run` (over run.max_epochs).
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=8e-4, weight_decay=0.01, warmup_steps=200,
                                                                   decay_epochs="run"))
    ema: EmaConfig = field(default_factory=EmaConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_epochs=1, every_minutes=5.0))
    # The guidance scale stored with the saved model as its default.
    default_guidance: float = field(default=1.0, metadata=bounds(ge=0))
    # Continue from these weights instead of a random model: "shapes" (the shipped checkpoint) or a model folder
    # written by this recipe. The supervised control of the RL comparison (configs/shapes/continued_pretrain.yaml):
    # the renderer's perfect data, at the RL runs' budget, from their starting point. The model section must then
    # match the folder's architecture (the folder's own config is used; a mismatch is an error).
    init: str | None = None

    def check(self) -> None:
        unknown = sorted(set(self.data.kinds) - set(_TASK_KINDS))
        if unknown or not self.data.kinds:
            fail("data.kinds", f"{'unknown task kinds ' + ', '.join(map(repr, unknown)) if unknown else 'empty'}; "
                 f"list any of {', '.join(_TASK_KINDS)} (a kind listed twice gets two shares)")
        warmup = self.optim.warmup_epochs * self.data.steps_per_epoch + self.optim.warmup_steps
        if warmup > self.run.max_epochs * self.data.steps_per_epoch:
            fail("optim.warmup_steps", f"the warm-up's {warmup} optimizer steps are longer than the whole run "
                 f"({self.run.max_epochs} epochs x {self.data.steps_per_epoch} steps)")
        if self.optim.decay_epochs is None:
            fail("optim.decay_epochs", "pretraining anneals its learning rate: give a number of epochs or run (over "
                 "run.max_epochs); for a constant rate after the warm-up set optim.min_lr_ratio=1")


def _batch(cfg: Config, model: ShapesModel, step: int):
    """The training batch of ``step``: clean images in [-1, 1], tokens, and the step's own noise."""
    from flowrl.data.shapes import render_batch, sample_examples

    n = cfg.data.batch_size
    examples = sample_examples("train", n, seed=cfg.run.seed, start=step * n, kinds=tuple(cfg.data.kinds))
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
    from flowrl.eval.generate import evaluate
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
    # Beside the gold, as an RL run's evaluation reports them: the lenient rule and the extra-object rate.
    if "lenient" in summary:
        metrics["eval/shapes/lenient_accuracy"] = summary["lenient"]
    if "extra" in summary:
        metrics["hack/extra_object_rate"] = summary["extra"]
    return metrics


def _save_grid(images: torch.Tensor, prompts: list[str], summary: dict, path: Path) -> None:
    """The evaluation's first images, eight prompts to a row, each under its whole prompt."""
    from flowrl.eval.grid import prompt_grid

    path.parent.mkdir(parents=True, exist_ok=True)
    prompt_grid(prompts, {"EMA model": images}, per_row=8).save(path)


def _trainable(model: ShapesModel) -> list[torch.nn.Parameter]:
    return list(model.denoiser.parameters()) + list(model.text_encoder.parameters())


def main(cfg: Config) -> int:
    from diffusers.training_utils import EMAModel

    from flowrl.config import to_dict
    from flowrl.rl.optim import build_optimizer
    from flowrl.run.harness import Run
    from flowrl.run.updates import optimizer_step

    run = Run(cfg.run, "pretrain", schedule=cfg.eval, log=cfg.log, checkpoint=cfg.checkpoint, precision=None,
              reward=None, config=to_dict(cfg), plots={"loss": ["train/loss"], "eval": ["eval/shapes/"]},
              units={"loss": "flow-matching loss", "eval": "held-out accuracy"},
              steps_per_epoch=cfg.data.steps_per_epoch)
    model = _initial_model(cfg)
    model.text_encoder.requires_grad_(True).train()
    model.train()
    params = _trainable(model)
    optimizer, scheduler = build_optimizer(params, cfg.optim, schedule_unit="step",
                                           steps_per_epoch=cfg.data.steps_per_epoch, max_epochs=cfg.run.max_epochs)
    ema = EMAModel(params, decay=cfg.ema.decay, use_ema_warmup=True, inv_gamma=1.0, power=cfg.ema.warmup_power)
    run.track(unet=model.denoiser, text_encoder=model.text_encoder, optimizer=optimizer, scheduler=scheduler, ema=ema)
    run.checkpoint_files(lambda directory: _save_model(model, ema, directory / "model"))
    run.evaluation(lambda epoch, should_stop: _evaluate(cfg, model, ema, run.output_dir, epoch))

    with run:
        while run.next_epoch():
            losses, grad_norm = [], 0.0
            for step in run.steps():
                x0, tokens, noise, t = _batch(cfg, model, step)
                with run.updating():
                    loss = flow_matching_loss(model, x0, tokens, noise, t)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    grad_norm = optimizer_step(optimizer, params, run.dist, grad_clip=cfg.optim.grad_clip, ema=ema,
                                               health=run.health)
                    scheduler.step()
                losses.append(loss.item())
            run.end_epoch({"train/loss": sum(losses) / max(len(losses), 1), "train/grad_norm": grad_norm,
                           "train/lr": scheduler.get_last_lr()[0]})
    _save_model(model, ema, run.output_dir / "model")
    print(f"flowrl: the pretrained model is in {run.output_dir / 'model'}")
    return run.finish()


def _initial_model(cfg: Config) -> ShapesModel:
    """A random model of ``cfg.model``, or the weights of ``cfg.init`` (the EMA weights of a saved folder)."""
    if cfg.init is None:
        return ShapesModel.build(cfg.model, seed=cfg.run.seed, default_guidance=cfg.default_guidance)
    from flowrl.config import ConfigError, to_dict

    model = ShapesModel.from_pretrained(cfg.init, default_guidance=cfg.default_guidance)
    if to_dict(model.config) != to_dict(cfg.model):
        differ = sorted(k for k, v in to_dict(cfg.model).items() if to_dict(model.config).get(k) != v)
        raise ConfigError("init", f"the model at {cfg.init!r} has another architecture than the model section "
                          f"({', '.join(differ)} differ); leave the model section at that model's values")
    return model


def _save_model(model: ShapesModel, ema, path: Path) -> None:
    """Save raw weights and, as the default-loaded ``*_ema`` folders, the EMA weights."""
    import copy

    ema_model = copy.deepcopy(model)
    ema.copy_to(_trainable(ema_model))
    model.save_pretrained(path, ema=ema_model)


RECIPE = Recipe(Config, main)
