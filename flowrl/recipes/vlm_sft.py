"""Supervised training of a VLM policy on Shapes-VQA (and zoom-tool demonstrations): the shipped tiny model.

Loss: the mean negative log-likelihood of the answer tokens (and of the end-of-turn token that closes
each answer), ``-sum(logp * m) / sum(m)``, with the loss mask of :func:`flowrl.policies.build_inputs`: the
prompt and the tool results are context, never targets. The inputs are built by the same function the RL
recipes use, so the model is trained on exactly the token layout it will act in.

Data: every batch is a pure function of ``(run.seed, step)``: Shapes-VQA training examples (kinds cycling)
plus a fraction ``data.zoom_fraction`` of zoom-environment demonstrations, half of which zoom into the
quadrant that holds the objects before answering and half answer from the low-resolution view. The
demonstrations teach the tool's format; *when* the tool pays is left to RL (``configs/vlm/shapes_zoom_gigpo.yaml``).

The model is built in code from ``model`` (a ``Qwen2VLForConditionalGeneration``, see
``flowrl/policies/shapes_vlm.py``), or continued from ``init_from``. Evaluation (greedy, held-out split)
logs ``eval/vqa/accuracy`` and one ``eval/vqa/<kind>`` per question kind. The run stops at
``run.max_epochs`` or ``run.max_minutes``; the model is saved to ``output_dir/model``.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import ClassVar, Literal
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flowrl.config import RunConfig, bounds, fail, save_config
from flowrl.policies.shapes_vlm import ShapesVLMConfig
from flowrl.recipes import Recipe

__all__ = ["Config", "main", "RECIPE"]


@dataclass
class DataConfig:
    batch_size: int = field(default=64, metadata=bounds(ge=1))
    steps_per_epoch: int = field(default=100, metadata=bounds(ge=1))
    zoom_fraction: float = field(default=0.25, metadata=bounds(ge=0, le=1))
    zoom_tool_fraction: float = field(default=0.5, metadata=bounds(ge=0, le=1))


@dataclass
class OptimConfig:
    lr: float = field(default=1e-3, metadata=bounds(gt=0))
    weight_decay: float = field(default=0.01, metadata=bounds(ge=0))
    warmup_steps: int = field(default=100, metadata=bounds(ge=0))
    min_lr_ratio: float = field(default=0.1, metadata=bounds(ge=0, le=1))
    # Cosine decay over this many epochs (None: run.max_epochs), so a run stopped early and resumed with a
    # longer max_epochs keeps its schedule.
    decay_epochs: int | None = field(default=None, metadata=bounds(ge=1))
    grad_clip: float = field(default=1.0, metadata=bounds(gt=0))


@dataclass
class EvalConfig:
    every_epochs: int = field(default=2, metadata=bounds(ge=1))
    num_examples: int = field(default=500, metadata=bounds(ge=1))
    num_zoom_examples: int = field(default=100, metadata=bounds(ge=0))
    batch_size: int = field(default=100, metadata=bounds(ge=1))


@dataclass
class Config:
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/shapes_vqa_sft", max_epochs=40))
    model: ShapesVLMConfig = field(default_factory=ShapesVLMConfig)
    init_from: str | None = None  # a saved model folder to continue from (None: build from `model`)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint_minutes: float = field(default=5.0, metadata=bounds(gt=0))

    RENAMED: ClassVar[dict[str, str]] = {"threads": "run.threads", "clock": "run.clock"}

    def check(self) -> None:
        if self.model.hidden_size % self.model.heads:
            fail("model.heads", f"{self.model.heads} does not divide hidden_size {self.model.hidden_size}")
        if self.model.image_size % (2 * self.model.patch_size):
            fail("model.patch_size", f"image_size {self.model.image_size} must be a multiple of 2 x patch_size")


def _lr_factor(cfg: Config):
    total = max((cfg.optim.decay_epochs or cfg.run.max_epochs) * cfg.data.steps_per_epoch, 1)
    warmup, floor = cfg.optim.warmup_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def batch_conversations(cfg: Config, step: int) -> list:
    """The training conversations of ``step`` (a pure function of ``(run.seed, step)``)."""
    from flowrl.data.vqa import sample_vqa
    from flowrl.envs.zoom import demonstration, zoom_tasks
    from flowrl.policies import Turn

    n = cfg.data.batch_size
    n_zoom = round(n * cfg.data.zoom_fraction)
    examples = sample_vqa("train", n - n_zoom, seed=cfg.run.seed, start=step * n)
    conversations = [[Turn("user", e.question, [e.image()]), Turn("assistant", e.answer)] for e in examples]
    if n_zoom:
        rng = random.Random(cfg.run.seed * 1_000_003 + step)
        for task in zoom_tasks("train", n_zoom, seed=cfg.run.seed, start=step * n):
            conversations.append(demonstration(task, rng.random() < cfg.data.zoom_tool_fraction))
    return conversations


def sft_loss(policy, conversations) -> torch.Tensor:
    """Mean NLL of the trained (assistant) tokens over the batch.

    Conversations are scored in buckets of equal turn count (single-turn questions apart from tool
    demonstrations), so short sequences are not padded to the longest; the loss is still the mean over all
    trained tokens of the batch.
    """
    buckets: dict[int, list] = {}
    for conversation in conversations:
        buckets.setdefault(len(conversation), []).append(conversation)
    total, count = 0.0, 0.0
    for group in buckets.values():
        inputs = policy.build_inputs(group)
        logp = policy.score(inputs)
        mask = inputs.loss_mask.to(logp.device)
        total = total - (logp * mask).sum()
        count += float(mask.sum())
    return total / max(count, 1.0)


def _evaluate(cfg: Config, policy) -> dict[str, float]:
    from flowrl.envs.evaluate import evaluate_policy

    metrics = evaluate_policy(policy, "shapes_vqa", cfg.eval.num_examples, batch_size=cfg.eval.batch_size)
    if cfg.eval.num_zoom_examples:
        metrics.update(evaluate_policy(policy, "shapes_zoom", cfg.eval.num_zoom_examples, batch_size=cfg.eval.batch_size))
    return metrics


def main(cfg: Config) -> int:
    from flowrl.checkpoint import CheckpointError, latest_checkpoint, load_state, save_checkpoint
    from flowrl.logging import MetricsLogger
    from flowrl.policies import TokenPolicy
    from flowrl.policies.shapes_vlm import build_model
    from flowrl.runtime import GracefulStop, make_deadline, prepare_run

    output_dir = prepare_run(cfg.run)
    save_config(cfg, output_dir / "config.yaml", extra={"recipe": "vlm_sft"})
    if cfg.init_from:
        policy = TokenPolicy.from_pretrained(cfg.init_from)
    else:
        model, processor = build_model(cfg.model, seed=cfg.run.seed)
        policy = TokenPolicy(model, processor)
    policy.train()
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(cfg))
    total_steps = cfg.run.max_epochs * cfg.data.steps_per_epoch
    step, minutes_before = 0, 0.0
    logger = MetricsLogger(output_dir, plot_groups={"loss": ["train/loss"], "eval": ["eval/vqa/", "eval/zoom/accuracy"]})
    if cfg.run.resume:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise CheckpointError(f"run.resume=true but {output_dir}/checkpoints holds no checkpoint; "
                                  "run without run.resume=true to start fresh")
        state = load_state(checkpoint)
        policy.load_trainable_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, minutes_before = int(state["step"]), float(state["train_minutes"])
        logger.truncate_after(step // cfg.data.steps_per_epoch)
        print(f"flowrl: resumed from {checkpoint} at step {step}")
    elif (output_dir / "metrics.jsonl").exists():
        (output_dir / "metrics.jsonl").unlink()

    deadline = make_deadline(cfg.run.clock, cfg.run.max_minutes, minutes_before)

    def checkpoint_now() -> None:
        state = {"model": policy.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "step": step, "train_minutes": deadline.elapsed_minutes()}
        save_checkpoint(output_dir, step, state)

    last_checkpoint = time.monotonic()
    progress = tqdm(total=total_steps, initial=step, desc="vlm_sft", dynamic_ncols=True)
    losses: list[float] = []
    epoch_start = time.monotonic()
    with GracefulStop() as stop:
        if step == 0:
            with deadline.excluded():
                logger.log({"epoch": 0, "step": 0, "time/train_min": 0.0, **_evaluate(cfg, policy)})
        while step < total_steps:
            loss = sft_loss(policy, batch_conversations(cfg, step))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            progress.update(1)
            progress.set_postfix(loss=f"{loss.item():.4f}")
            epoch_done = step % cfg.data.steps_per_epoch == 0
            stopping = stop.requested or deadline.passed()
            if epoch_done or stopping or step == total_steps:
                epoch = math.ceil(step / cfg.data.steps_per_epoch)
                metrics = {"epoch": epoch, "step": step, "train/loss": sum(losses) / max(len(losses), 1),
                           "train/grad_norm": float(grad_norm), "train/lr": scheduler.get_last_lr()[0],
                           "time/epoch_s": time.monotonic() - epoch_start, "time/train_min": deadline.elapsed_minutes(),
                           "time/wall_min": deadline.wall_minutes()}
                losses = []
                if epoch % cfg.eval.every_epochs == 0 or stopping or step == total_steps:
                    with deadline.excluded():
                        metrics.update(_evaluate(cfg, policy))
                    progress.write(f"epoch {epoch}: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()
                                                                   if k.startswith("eval/") and k.endswith("accuracy")))
                logger.log(metrics)
                logger.plot()
                epoch_start = time.monotonic()
            if stopping:
                break
            if time.monotonic() - last_checkpoint > cfg.checkpoint_minutes * 60:
                checkpoint_now()
                last_checkpoint = time.monotonic()
    progress.close()
    checkpoint_now()
    policy.save_pretrained(output_dir / "model")
    logger.close()
    reason = stop.reason or ("time budget reached" if deadline.passed() else "finished")
    print(f"flowrl: vlm_sft stopped at step {step}/{total_steps} ({reason}); model saved to {output_dir / 'model'}")
    return 0


RECIPE = Recipe(Config, main)
