"""The ``sampling`` section of an online run, and the rollout step and window it configures.

``samplers`` is torch-only and knows nothing of configs, so its typed config lives here, beside the
loop that turns it into a ``samplers.Step`` and ``samplers.Window``. A step's default noise level is
decided in one place, :func:`samplers.noise_kwargs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from flowrl.config import bounds, fail

__all__ = ["WindowConfig", "SamplingConfig", "NOISE_STD_RATIO_LIMIT", "rollout_notes", "student_notes", "rollout_step",
           "rollout_window", "autocast"]


@dataclass
class WindowConfig:
    mode: Literal["fixed", "random", "sliding"] = "fixed"
    start: int = field(default=0, metadata=bounds(ge=0))
    size: int | None = field(default=None, metadata=bounds(ge=1))  # None: every trainable step
    every: int = field(default=1, metadata=bounds(ge=1))  # sliding: epochs per one-step advance
    max_start: int | None = field(default=None, metadata=bounds(ge=0))


@dataclass
class SamplingConfig:
    num_steps: int = field(default=10, metadata=bounds(ge=2, le=1000))
    eval_num_steps: int = field(default=40, metadata=bounds(ge=1, le=1000))
    step: Literal["flow_sde", "dance_sde", "cps", "ode"] = "flow_sde"
    # flow_sde / cps: a; dance_sde: eta. None: the step's own default (0.7, 0.7, 0.3).
    noise_level: float | None = field(default=None, metadata=bounds(ge=0, le=10))
    reduction: Literal["mean", "sum"] = "mean"
    guidance: float = field(default=1.0, metadata=bounds(ge=0, le=100))  # rollout and training CFG
    eval_guidance: float | None = field(default=None, metadata=bounds(ge=0, le=100))  # None: same as guidance
    window: WindowConfig = field(default_factory=WindowConfig)
    group_size: int = field(default=8, metadata=bounds(ge=2, le=4096))
    groups_per_epoch: int = field(default=8, metadata=bounds(ge=1, le=100_000))
    batch_size: int = field(default=32, metadata=bounds(ge=1, le=4096))  # samples per rollout call, per process
    # Compute dtype of the model in rollouts and in training (torch.autocast: matmuls and convolutions in
    # bfloat16, step math and losses in float32). Rollout and re-scoring use the same one, so the on-policy
    # ratio stays 1; evaluation always runs in the model's own dtype.
    precision: Literal["float32", "bfloat16"] = "float32"
    # The base model takes the last K steps of every rollout and evaluation (MixGRPO users' fix for late-step
    # hacking; flowrl/rl/base_tail.py); the training window must end before them. 0: the policy takes every step.
    base_last_steps: int = field(default=0, metadata=bounds(ge=0, le=999))

    def check(self) -> None:
        w = self.window
        trainable = self.num_steps - 1
        k = self.base_last_steps
        schedule = f"a {self.num_steps}-step schedule (steps 0..{trainable - 1}; the last step is deterministic)"
        if w.mode == "fixed" and w.max_start is not None:
            fail("window.max_start", "max_start applies to random and sliding windows; unset it for a fixed window")
        if w.max_start is not None and w.max_start < w.start:
            fail("window.max_start", f"{w.max_start} is below window.start {w.start}; set it to at least {w.start}")
        if w.mode != "fixed" and w.size is None:
            fail("window.size", f"a {w.mode} window needs a size")
        if w.start >= trainable:
            fail("window.start", f"{w.start} leaves no trainable step of {schedule}; set window.start to at most "
                 f"{trainable - 1}")
        if w.size is not None and w.start + w.size > trainable:
            fail("window", f"start {w.start} + size {w.size} exceeds the {trainable} trainable steps of {schedule}; "
                 f"set window.size to at most {trainable - w.start}")
        if w.max_start is not None and w.size is not None and w.max_start + w.size > trainable:
            fail("window.max_start", f"max_start {w.max_start} + size {w.size} exceeds the {trainable} "
                 f"trainable steps of a {self.num_steps}-step schedule; lower max_start to at most "
                 f"{max(trainable - w.size, 0)} or leave it unset (the last start that fits)")
        if k >= self.num_steps:
            fail("base_last_steps", f"{k} of a {self.num_steps}-step schedule leaves the policy no step; use at "
                 f"most {self.num_steps - 1}")
        if k and self.step != "ode":
            end = window_end(w, trainable)
            if end > self.num_steps - k:
                fail("base_last_steps", f"the base model takes steps {self.num_steps - k}..{self.num_steps - 1} but "
                     f"the training window reaches step {end - 1}; the policy is trained on its own steps only: set "
                     f"window.size / window.max_start so that the window ends by step {self.num_steps - k - 1}")

    @property
    def samples_per_epoch(self) -> int:
        return self.groups_per_epoch * self.group_size


def window_end(w: WindowConfig, trainable: int) -> int:
    """One past the last step the window ``w`` can train, of ``trainable`` trainable steps."""
    if w.size is None:
        return trainable
    if w.mode == "fixed":
        return w.start + w.size
    return (w.max_start if w.max_start is not None else trainable - w.size) + w.size


#: A trained SDE step whose state carries more than this multiple of its level's noise
#: (:func:`samplers.noise_std_ratio`) makes a run warn: the few-step case (docs/trainers.md, "Few-step students").
#: Flow-SDE at a = 0.7 reaches 1.32 and 1.49 at steps 1 and 2 of 4 linear steps; the published many-step windows stay
#: under it (1.08 over the shapes main job's, 1.24 at the last stochastic step of SD3.5's 10 shifted steps).
NOISE_STD_RATIO_LIMIT = 1.25


def rollout_notes(cfg: SamplingConfig, sigmas: torch.Tensor) -> list[str]:
    """Warnings about the rollout's SDE on the schedule ``sigmas`` (none for the ODE): the worst trained step (of any
    draw of the window) whose state carries more than :data:`NOISE_STD_RATIO_LIMIT` times the noise of its level. An
    Euler-Maruyama SDE step (``flow_sde``, ``dance_sde``) does that on a few large steps, so the rollouts are noisier
    than the ODE samples the model is evaluated on; ``cps`` keeps the level at any step size."""
    from samplers import noise_std_ratio

    if cfg.step == "ode":
        return []
    ratios = noise_std_ratio(rollout_step(cfg, sigmas))
    steps = [t for t in range(cfg.window.start, window_end(cfg.window, cfg.num_steps - 1))
             if ratios[t] > NOISE_STD_RATIO_LIMIT]
    if not steps:
        return []
    t = max(steps, key=lambda i: float(ratios[i]))
    return [f"sampling.step={cfg.step} on this {cfg.num_steps}-step schedule: the state after trained step {t} "
            f"(sigma {float(sigmas[t]):.3g} -> {float(sigmas[t + 1]):.3g}) carries {float(ratios[t]):.2f}x the noise "
            "of its level (an Euler-Maruyama step this large adds more noise than its drift removes), so the rollouts "
            "are noisier than the ODE samples the model is evaluated on; sampling.step=cps keeps the level at any "
            "step size (or lower sampling.noise_level, or move the window later) (docs/trainers.md, \"Few-step "
            "students\")"]


def student_notes(student_steps: int | None, cfg: SamplingConfig, sample_steps: int | None = None,
                  sample_key: str = "sampling.num_steps") -> list[str]:
    """Warnings when the model is a few-step student (``student_steps``: the steps it was distilled at, from its
    export, :func:`flowrl.models.resolve.exported_student_steps`) and the run samples it (``sample_steps`` set by
    ``sample_key``, default ``sampling.num_steps``) or evaluates it (``sampling.eval_num_steps``) on another
    schedule."""
    if not student_steps:
        return []
    sample_steps = cfg.num_steps if sample_steps is None else sample_steps
    off = [f"samples it at {sample_steps} steps ({sample_key})"] if sample_steps != student_steps else []
    if cfg.eval_num_steps != student_steps:
        off.append(f"evaluates it at {cfg.eval_num_steps} (sampling.eval_num_steps)")
    if not off:
        return []
    return [f"model.path is a {student_steps}-step student (its flowrl_export.json), distilled on the model's "
            f"{student_steps}-step schedule; this run {' and '.join(off)}: set {sample_key}={student_steps} "
            f"sampling.eval_num_steps={student_steps} to train and evaluate it on its own schedule (e.g. "
            "configs/shapes/flow_grpo_student.yaml)"]


def rollout_step(cfg: SamplingConfig, sigmas: torch.Tensor):
    """The ``samplers.Step`` of the training rollout (and of re-scoring) on schedule ``sigmas``."""
    from samplers import make_step, noise_kwargs

    return make_step(cfg.step, sigmas, **noise_kwargs(cfg.step, cfg.noise_level), reduction=cfg.reduction)


def rollout_window(cfg: SamplingConfig):
    """The ``samplers.Window`` of trained steps."""
    from samplers import Window

    w = cfg.window
    return Window(mode=w.mode, start=w.start, size=w.size, every=w.every, max_start=w.max_start)


def autocast(cfg: SamplingConfig, device: torch.device | str):
    """The ``torch.autocast`` context of ``sampling.precision`` on ``device`` (a no-op for float32).

    Autocast is thread-local: a reward scored in a background thread keeps float32."""
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=cfg.precision == "bfloat16")
