"""The training pass's bookkeeping, shared by every online trainer: minibatches, the forward-backward
passes of one optimizer step, the optimizer step itself, and weighted metric means.

Invariance (docs/architecture.md, "Distributed training"): one process with accumulation ``2a`` and two
processes with accumulation ``a`` take the same optimizer step. Three rules make that so:

- the minibatch partition is drawn over *global* sample ids from ``(seed, epoch, inner epoch)``, so it
  does not depend on the number of processes (:func:`minibatch_rows`);
- every loss is scaled by its share of the minibatch's *global* sample count, times the world size
  (DDP averages gradients over processes): :func:`pass_scale`;
- every process makes the same number of backward calls (DDP's collectives must pair up): an idle
  process pads with zero-weight passes (:func:`training_passes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from flowrl.updates import UpdateHealth, optimizer_step  # noqa: F401  (re-exported: the trainers' loop)

__all__ = ["minibatch_rows", "TrainingPass", "training_passes", "global_count", "pass_scale", "UpdateHealth",
           "optimizer_step", "MetricMeans"]


def minibatch_rows(sample_ids: torch.Tensor, minibatches: int, *, seed: int, epoch: int,
                   inner: int, total: int | None = None) -> list[torch.Tensor]:
    """Local row indices of each of ``minibatches`` minibatches.

    Args:
        sample_ids: ``[n]`` global sample ids of this process's rows (or global group ids: each group then
            falls into one minibatch whole).
        minibatches: optimizer steps per inner epoch.
        seed / epoch / inner: the partition is a pure function of these and the global ids.
        total: the number of global ids (samples or groups in the epoch). Default: the largest local id + 1,
            which is the global number only on the last process; pass it when several processes train with
            more than one minibatch, or their partitions disagree.

    Returns:
        ``minibatches`` long tensors of local row indices (a partition of ``range(n)``).
    """
    from samplers import derive_seed

    if total is None:
        total = int(sample_ids.max()) + 1 if sample_ids.numel() else 0
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch, inner, 0x3B))
    global_order = torch.randperm(max(total, 1), generator=generator)
    global_chunk = torch.empty_like(global_order)
    global_chunk[global_order] = torch.arange(global_order.numel()) * minibatches // global_order.numel()
    chunk_of_local = global_chunk[sample_ids]
    return [torch.nonzero(chunk_of_local == m).flatten() for m in range(minibatches)]


def global_count(dist, rows: torch.Tensor) -> int:
    """The number of rows over every process (each process needs it to normalise its share)."""
    return int(dist.gather(torch.tensor([rows.numel()])).sum())


@dataclass
class TrainingPass:
    """One forward-backward pass.

    Attributes:
        rows: ``[m]`` local sample rows.
        unit: what the pass trains on those rows besides the samples (a denoising step index for
            Flow-GRPO; ``None`` when the rows are the whole unit).
        weight: 1, or 0 for a padding pass of a process with fewer passes (its loss must not count).
        sync: the last pass before the optimizer step: gradients are all-reduced on its backward.
    """

    rows: torch.Tensor
    unit: Any
    weight: float
    sync: bool


def _group_micro_batches(rows: torch.Tensor, groups: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Consecutive whole groups of ``rows`` (ordered by group), as many as fit in ``micro_batch_size`` rows
    (at least one group per micro-batch)."""
    order = torch.argsort(groups[rows], stable=True)
    rows = rows[order]
    _, counts = torch.unique_consecutive(groups[rows], return_counts=True)
    micro, current, size = [], [], 0
    for chunk in rows.split(counts.tolist()):
        if current and size + chunk.numel() > micro_batch_size:
            micro.append(torch.cat(current))
            current, size = [], 0
        current.append(chunk)
        size += chunk.numel()
    if current:
        micro.append(torch.cat(current))
    return micro


def training_passes(rows: torch.Tensor, units: Sequence[Any], micro_batch_size: int, dist, *,
                    groups: torch.Tensor | None = None) -> list[TrainingPass]:
    """The passes of one optimizer step: every micro-batch of ``rows`` times every unit, padded so that
    every process makes the same number of backward calls.

    ``groups`` (``[n]`` group id of every local row): micro-batches hold whole groups, for objectives that
    compare the samples of a group (a group larger than ``micro_batch_size`` is one micro-batch)."""
    if groups is None:
        micro = [m for m in rows.split(micro_batch_size) if m.numel()]  # (an empty tensor splits into one empty chunk)
    else:
        micro = _group_micro_batches(rows, groups, micro_batch_size)
    real = [(m, u) for m in micro for u in units]
    count = int(dist.gather(torch.tensor([len(real)])).max())
    if groups is None:
        filler_rows = rows[:1] if rows.numel() else torch.zeros(1, dtype=torch.long)
    else:  # a whole group, so that the objective sees the shape it expects
        filler_rows = micro[0] if micro else torch.nonzero(groups == groups[0]).flatten()
    filler = (filler_rows, units[0] if units else None)
    return [TrainingPass(*(real[i] if i < len(real) else filler), weight=1.0 if i < len(real) else 0.0,
                         sync=i == count - 1) for i in range(count)]


def pass_scale(p: TrainingPass, n_global: int, dist, units_per_sample: int = 1) -> float:
    """The factor of a pass's mean loss such that the all-reduced gradient is the minibatch's mean.

    The pass holds ``len(p.rows)`` of the minibatch's ``n_global`` samples (times ``units_per_sample``
    units each); ``world_size`` undoes DDP's averaging over processes.
    """
    return p.weight * len(p.rows) / n_global * dist.world_size / units_per_sample


class MetricMeans:
    """Weighted means of per-pass statistics (e.g. weighted by the samples of each pass)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, weight: float, **values: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {k: v / self.weights[k] if self.weights[k] else 0.0 for k, v in self.sums.items()}
