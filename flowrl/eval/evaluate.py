"""Held-out evaluation of an online run: deterministic ODE samples of the eval prompts at fixed seeds,
scored by every eval reward, with per-task accuracy and a sample grid."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from flowrl.config import bounds
from flowrl.eval.panel import HackingConfig, HackingPanel, gather_images, with_reference
from flowrl.run.harness import EvalSchedule

__all__ = ["EvalConfig", "Evaluator"]


@dataclass
class EvalConfig(EvalSchedule):
    """The ``eval`` section of the image recipes: when (:class:`flowrl.run.harness.EvalSchedule`) and how."""

    every_epochs: int | None = field(default=5, metadata=bounds(ge=1))
    batch_size: int = field(default=100, metadata=bounds(ge=1, le=4096))
    grid_size: int = field(default=32, metadata=bounds(ge=0, le=1024))
    # The evaluation's ODE sampling (and the hacking panel's) under bfloat16 autocast or in float32. On the
    # shapes model 20 steps in bfloat16 cost 0.3x of 40 in float32 for the same held-out accuracy (README).
    precision: Literal["float32", "bfloat16"] = "float32"
    hacking: HackingConfig = field(default_factory=HackingConfig)  # the hack/* panel (flowrl/eval/panel.py)


class Evaluator:
    """Evaluates a model on a prompt set, split across processes, and gathers the scores.

    Args:
        cfg: the ``eval`` section.
        rewards: ``{name: reward}`` scored on every image (a reward whose output has ``details["correct"]``,
            or the ``shapes`` reward, also yields ``eval/<name>/accuracy`` and one ``eval/<name>/<kind>``
            per task kind in the prompts' metadata; ``details["lenient"]``, the shapes reward's lenient rule,
            ``eval/<name>/lenient_accuracy`` and ``eval/<name>/lenient/<kind>``).
        prompt_set: the eval prompts; each row's ``metadata["seed"]`` (default: its index) fixes its noise.
        steps / guidance: the ODE sampling of the evaluation.
        dist: the run's :class:`flowrl.dist.Dist`.
        output_dir: the run directory (grids go to ``samples/epoch_<N>.png``: base vs current model).
        logger: the run's :class:`flowrl.run.metrics.MetricsLogger` (grids also go to TensorBoard / wandb).
        heldout: ``{name: reward}`` of ``reward.heldout``, scored in the hacking panel.
        kl_step / kl_guidance: the training rollout's ``samplers.Step`` and guidance (``hack/kl_to_base``).
        fm_sigmas: the schedule of the policy's samples for ``hack/fm_to_base`` (default ``kl_step``'s).
    """

    def __init__(self, cfg: EvalConfig, rewards: dict, prompt_set, *, steps: int, guidance: float, dist,
                 output_dir: Path, logger=None, heldout: dict | None = None, kl_step=None,
                 kl_guidance: float | None = None, fm_sigmas: torch.Tensor | None = None):
        self.cfg, self.rewards, self.prompt_set = cfg, rewards, prompt_set
        self.steps, self.guidance, self.dist, self.output_dir = steps, guidance, dist, Path(output_dir)
        self.logger = logger
        self._base: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
        self.panel = HackingPanel(cfg.hacking, list(prompt_set.prompts), list(prompt_set.metadata),
                                  heldout=heldout or {}, kl_step=kl_step, kl_guidance=kl_guidance,
                                  fm_sigmas=fm_sigmas, steps=steps,
                                  guidance=guidance, batch_size=cfg.batch_size, dist=dist) \
            if cfg.hacking.enabled else None

    def __call__(self, model, epoch: int, ema=None, should_stop=None) -> dict[str, float]:
        """``{"eval/<reward>/mean": ..., "eval/<reward>/accuracy": ..., ...}``; the EMA weights (if any) are
        swapped in for the evaluation and restored afterwards.

        ``should_stop`` is polled before every model call; when it returns True the evaluation raises
        ``flowrl.commands.sample.GenerationInterrupted`` (the run discards the partial evaluation)."""
        from rewards.base import checked_reward
        from flowrl.eval.generate import generate

        dist, prompt_set = self.dist, self.prompt_set
        n = len(prompt_set)
        # Every process draws the same number of rows (FSDP2: the same forwards); padded rows are dropped below.
        drawn, real = dist.even_shard(n)
        per_process = len(drawn)
        seeds = [int(prompt_set.metadata[i].get("seed", i)) for i in drawn]
        prompts = [prompt_set.prompts[i] for i in drawn]
        params = model.trainable_parameters()
        if ema is not None:
            ema.store(params)
            ema.copy_to(params)
        model.eval()
        bar = tqdm(total=len(drawn), desc=f"eval (epoch {epoch})", leave=False, disable=not dist.is_main,
                   dynamic_ncols=True)
        panel: dict[str, float] = {}
        try:
            with self._precision(model):
                drawn_images = generate(model, prompts, seeds, steps=self.steps, guidance=self.guidance,
                                        batch_size=self.cfg.batch_size, progress=bar.update, should_stop=should_stop,
                                        metadata=[prompt_set.metadata[i] for i in drawn]) if drawn else None
                images = drawn_images[:real] if real else None
                if self.panel is not None:  # with the evaluated (EMA) weights still in place
                    every = gather_images(dist, images, n, per_process)
                    all_seeds = [int(m.get("seed", i)) for i, m in enumerate(prompt_set.metadata)]
                    panel = self.panel(model, epoch, every, all_seeds, should_stop=should_stop)
        finally:
            bar.close()
            if ema is not None:
                ema.restore(params)
            model.train()
        rows = drawn[:real]
        seeds, prompts = seeds[:real], prompts[:real]
        metrics: dict[str, float] = {}
        local_scores: dict[str, torch.Tensor] = {}
        local_correct: dict[str, torch.Tensor] = {}  # the gold's verdict where a reward gives one (the grid says it)
        pad = per_process - real  # equal shapes for the gather; padded rows are dropped after it
        keep = dist.gather(torch.cat([torch.ones(real), torch.zeros(pad)])) > 0
        kinds = [m.get("kind") for m in prompt_set.metadata]

        def gathered(values: torch.Tensor | None) -> torch.Tensor:
            local = values.float() if values is not None else torch.zeros(0)
            return dist.gather(torch.cat([local, torch.zeros(pad)]))[keep]

        def accuracies(prefix: str, correct: torch.Tensor, per_kind: str) -> None:
            metrics[f"{prefix}accuracy"] = float(correct.mean())
            for kind in sorted({k for k in kinds if k}):
                selected = torch.tensor([k == kind for k in kinds])
                metrics[f"{per_kind}{kind}"] = float(correct[selected].mean())

        for name, reward in self.rewards.items():
            details = {}
            if images is not None:
                out = checked_reward(reward, images, prompts, [prompt_set.metadata[i] for i in rows])
                local_scores[name], details = out.scores.float(), out.details
                if "correct" in details:
                    local_correct[name] = details["correct"]
            metrics[f"eval/{name}/mean"] = float(gathered(local_scores.get(name)).mean())
            # Every process gathers the same keys: one whose shard is empty still takes part (shapes' are known).
            if "correct" in details or name == "shapes":
                accuracies(f"eval/{name}/", gathered(details.get("correct")), f"eval/{name}/")
            if "lenient" in details or name == "shapes":  # the shapes reward's proxy, beside the gold
                accuracies(f"eval/{name}/lenient_", gathered(details.get("lenient")), f"eval/{name}/lenient/")
        metrics.update(panel)
        k = min(self.cfg.grid_size, per_process, n)  # the grid: the first rows, which the main process holds
        if k:
            # Every process draws the grid's base images (FSDP2: the same forwards); the main process saves it.
            grid = list(range(k))
            grid_prompts = [prompt_set.prompts[i] for i in grid]
            grid_seeds = [int(prompt_set.metadata[i].get("seed", i)) for i in grid]
            grid_metadata = [prompt_set.metadata[i] for i in grid]
            base = self._base_images(model, epoch, drawn_images[:k], grid_prompts, grid_seeds, grid_metadata)
            if dist.is_main:
                self._save_grid(epoch, images[:k], grid_prompts, grid_seeds,
                                {name: (s[:k], local_correct[name][:k] if name in local_correct else None)
                                 for name, s in local_scores.items()}, base)
        return metrics

    def _precision(self, model):
        """``eval.precision``'s autocast context on the model's device (images come back as float32)."""
        return torch.autocast(torch.device(model.device).type, dtype=torch.bfloat16,
                              enabled=self.cfg.precision == "bfloat16")

    def _base_images(self, model, epoch: int, images: torch.Tensor, prompts: list[str], seeds: list[int],
                     metadata: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The base model's images of the grid's prompts and seeds, and their scores (computed once: at the
        evaluation before training they are the current images; otherwise the reference weights draw them)."""
        from rewards.base import checked_reward
        from flowrl.eval.generate import generate

        if self._base is None:
            if self.panel is not None:  # drew every eval row already (rank 0's rows come first)
                base = self.panel.base_images(model, epoch, images, seeds)[: images.shape[0]]
            else:
                def draw():
                    with self._precision(model):
                        return generate(model, prompts, seeds, steps=self.steps, guidance=self.guidance,
                                        batch_size=self.cfg.batch_size, metadata=metadata)

                base = images if epoch == 0 else with_reference(model, draw)
            outputs = {name: checked_reward(reward, base, prompts, metadata) for name, reward in self.rewards.items()}
            self._base = (base, {name: (out.scores.float(), out.details.get("correct"))
                                 for name, out in outputs.items()})
        return self._base

    def _save_grid(self, epoch: int, images: torch.Tensor, prompts: list[str], seeds: list[int],
                   scores: dict[str, tuple[torch.Tensor, torch.Tensor | None]], base: tuple) -> None:
        """``samples/epoch_<N>.png``: each grid prompt drawn by the base model (``base``: images and their scores) and
        by the model at this epoch from the same noise, side by side under the whole prompt, four prompts to a row,
        captioned with every eval reward's score and, where the reward judges correctness (the shapes reward's gold,
        strict accuracy), "correct" or "wrong"; also sent to TensorBoard / wandb. ``scores``: ``{name: (scores [k],
        correct [k] or None)}``."""
        from flowrl.eval.grid import prompt_grid

        base, base_scores = base

        def captions(values: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> list[str]:
            def line(name: str, score: torch.Tensor, correct: torch.Tensor | None, i: int) -> str:
                verdict = "" if correct is None else (" correct" if float(correct[i]) > 0.5 else " wrong")
                return f"{name} {float(score[i]):.2f}{verdict}"

            return ["\n".join(line(name, *v, i) for name, v in values.items()) for i in range(len(prompts))]

        current = f"epoch {epoch}"
        grid = prompt_grid(prompts, {"base": base, current: images},
                           {"base": captions(base_scores), current: captions(scores)},
                           notes=[f"seed {s}" for s in seeds])
        path = self.output_dir / "samples" / f"epoch_{epoch:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
        if self.logger is not None:
            self.logger.log_image("samples", grid, step=epoch)
