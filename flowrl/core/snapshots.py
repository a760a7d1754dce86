"""Parameter snapshots of the forward-process trainers: decay schedules and the EMA-style update.

CRD keeps an "old" snapshot (for its implicit reward) and a "sampling" snapshot (for rollouts);
DiffusionNFT keeps an old snapshot that is also its sampler; AWM and DGPO keep a fast EMA snapshot. After
an epoch (DGPO: after every optimizer step) each is pulled toward the current weights,
``snap <- d snap + (1 - d) theta``, with a decay ``d`` that depends on the number of optimizer steps
taken so far (docs/trainers.md, "Snapshots"). Both pieces are pure: a schedule is a function of the step,
the update touches only the tensors it is given (e.g. the LoRA weights of a snapshot adapter), so a
recipe can store snapshots wherever it likes and save them in its checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = [
    "CRD_OLD_DECAY",
    "CRD_SAMPLING_DECAY",
    "DecaySchedule",
    "EMA_REF_DECAY",
    "NFT_DECAY",
    "NFT_OCR_DECAY",
    "snapshot_decay",
    "update_snapshot_",
]


def _number(name: str, value, *, lo: float | None = None, hi: float | None = None) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and lo is not None:
        ok = value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        bounds = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ValueError(f"{name} must be a finite number{bounds}; received {value!r}")
    return float(value)


def snapshot_decay(step: int, *, start: int = 0, initial: float = 0.0, slope: float = 0.0,
                   maximum: float = 0.0) -> float:
    """The decay ``d(s)`` of a snapshot after ``s`` optimizer steps.

    ``d(s) = initial`` for ``s < start``, else ``min(initial + (s - start) * slope, maximum)``.
    ``d = 0`` makes the snapshot a copy of the current weights, ``d = 1`` freezes it.

    Args:
        step: optimizer steps taken so far, ``>= 0``.
        start: the step ``s0`` from which the decay grows.
        initial: ``v0``, the decay before ``start`` (and at it), in ``[0, 1]``.
        slope: growth per optimizer step, ``>= 0``.
        maximum: ``vmax``, the cap, in ``[0, 1]``.

    Returns:
        The decay, a float in ``[0, 1]``.
    """
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise ValueError(f"step must be an integer >= 0 (optimizer steps taken); received {step!r}")
    if not (isinstance(start, int) and not isinstance(start, bool) and start >= 0):
        raise ValueError(f"start must be an integer >= 0; received {start!r}")
    initial = _number("initial", initial, lo=0.0, hi=1.0)
    slope = _number("slope", slope, lo=0.0)
    maximum = _number("maximum", maximum, lo=0.0, hi=1.0)
    if step < start:
        return initial
    return min(initial + (step - start) * slope, maximum)


@dataclass(frozen=True)
class DecaySchedule:
    """A decay schedule ``d(s)`` (see :func:`snapshot_decay`); call it with the step.

    Attributes:
        start: the step ``s0`` from which the decay grows.
        initial: ``v0``, in ``[0, 1]``.
        slope: growth per optimizer step, ``>= 0``.
        maximum: ``vmax``, in ``[0, 1]``.
    """

    start: int = 0
    initial: float = 0.0
    slope: float = 0.0
    maximum: float = 0.0

    def __post_init__(self) -> None:
        snapshot_decay(0, start=self.start, initial=self.initial, slope=self.slope, maximum=self.maximum)

    def __call__(self, step: int) -> float:
        return snapshot_decay(step, start=self.start, initial=self.initial, slope=self.slope, maximum=self.maximum)


# DiffusionNFT's `return_decay` presets (decay_type 1, the default, and 2, used for OCR).
NFT_DECAY = DecaySchedule(start=0, initial=0.0, slope=0.001, maximum=0.5)
NFT_OCR_DECAY = DecaySchedule(start=75, initial=0.0, slope=0.0075, maximum=0.999)
# CRD: the old snapshot lags from the start; the sampler stays on-policy for 75 steps, then lags.
CRD_OLD_DECAY = DecaySchedule(start=0, initial=0.25, slope=0.005, maximum=0.999)
CRD_SAMPLING_DECAY = NFT_OCR_DECAY
# AWM's KL-EMA snapshot ("linear": min(0.3, 0.001 s)) and DGPO's ema_ref.
EMA_REF_DECAY = DecaySchedule(start=0, initial=0.0, slope=0.001, maximum=0.3)


@torch.no_grad()
def update_snapshot_(snapshot: Sequence[Tensor], params: Sequence[Tensor], decay: float) -> None:
    """Pull a snapshot toward the current weights in place: ``snap <- d snap + (1 - d) theta``.

    ``decay = 0`` copies ``params`` exactly (also over non-finite snapshot values, which ``0 * inf``
    would turn into NaN); ``decay = 1`` leaves the snapshot unchanged. Parameters are cast to each
    snapshot tensor's dtype and device, so a float32 snapshot of bf16 weights works.

    Args:
        snapshot: tensors updated in place (e.g. the snapshot adapter's weights), in the same order as
            ``params``.
        params: the current weights, same shapes; read only.
        decay: ``d`` in ``[0, 1]``.
    """
    decay = _number("decay", decay, lo=0.0, hi=1.0)
    snapshot, params = list(snapshot), list(params)
    if len(snapshot) != len(params):
        raise ValueError(f"snapshot and params must list the same tensors; received {len(snapshot)} and "
                         f"{len(params)} tensors")
    for i, (s, p) in enumerate(zip(snapshot, params)):
        if tuple(s.shape) != tuple(p.shape):
            raise ValueError(f"snapshot tensor {i} has shape {list(s.shape)} but parameter {i} has "
                             f"{list(p.shape)}; pass the tensors in the same order")
    for s, p in zip(snapshot, params):
        p = p.detach().to(device=s.device, dtype=s.dtype)
        if decay == 0.0:
            s.copy_(p)
        elif decay < 1.0:
            # The authors' arithmetic (d * snap + (1 - d) * theta), not lerp, so values match theirs.
            s.mul_(decay).add_(p, alpha=1.0 - decay)
