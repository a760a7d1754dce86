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

__all__ = ["WindowConfig", "SamplingConfig", "rollout_step", "rollout_window", "autocast"]


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
        if k >= self.num_steps:
            fail("base_last_steps", f"{k} of a {self.num_steps}-step schedule leaves the policy no step; use at "
                 f"most {self.num_steps - 1}")
        if k and self.step != "ode":
            end = window_end(w, trainable)
            if end > self.num_steps - k:
                fail("base_last_steps", f"the base model takes steps {self.num_steps - k}..{self.num_steps - 1} but "
                     f"the training window reaches step {end - 1}; the policy is trained on its own steps only: set "
                     f"window.size / window.max_start so that the window ends by step {self.num_steps - k - 1}")
        if w.size is not None and w.start + w.size > trainable:
            fail("window", f"start {w.start} + size {w.size} exceeds the {trainable} trainable steps of "
                 f"a {self.num_steps}-step schedule (the last step is deterministic)")
        if w.mode != "fixed" and w.size is None:
            fail("window.size", f"a {w.mode} window needs a size")
        if w.max_start is not None and w.size is not None and w.max_start + w.size > trainable:
            fail("window.max_start", f"max_start {w.max_start} + size {w.size} exceeds the {trainable} "
                 f"trainable steps of a {self.num_steps}-step schedule; lower max_start to at most "
                 f"{max(trainable - w.size, 0)} or leave it unset (the last start that fits)")

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
