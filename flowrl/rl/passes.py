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

from flowrl.run.updates import UpdateHealth, optimizer_step  # noqa: F401  (re-exported: the trainers' loop)

__all__ = ["minibatch_rows", "TrainingPass", "training_passes", "pass_layout", "stage_rows", "global_count",
           "pass_scale", "UpdateHealth", "optimizer_step", "MetricMeans"]


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


def pass_layout(passes: Sequence[TrainingPass]) -> tuple[torch.Tensor, list[slice]]:
    """The rows of ``passes`` laid out so that every pass reads a contiguous slice.

    A trainer gathers its per-row data of a minibatch in this order and moves it to the device once (one copy per
    tensor, :func:`stage_rows`); each pass then reads ``staged[slice]``, a view: no index tensor and no
    host-to-device copy per pass, which on a GPU would make every pass wait for the copy. Passes over the same
    rows (one micro-batch at several steps or times), and a padding pass over a prefix of one, share a slice.

    Args:
        passes: the passes of one optimizer step (:func:`training_passes`).

    Returns:
        ``(order, slices)``: ``order`` a CPU long tensor ``[k]`` of local rows (a row may appear twice when two
        passes overlap without being equal), ``slices[i]`` the positions in ``order`` of ``passes[i].rows``.
    """
    order: list[int] = []
    first: dict[int, int] = {}  # row -> its first position in order
    seen: dict[tuple[int, ...], slice] = {}
    slices: list[slice] = []
    for p in passes:
        rows = tuple(int(r) for r in p.rows.tolist())
        if rows in seen:
            slices.append(seen[rows])
            continue
        start = first.get(rows[0], -1) if rows else 0
        if start < 0 or any(first.get(r) != start + i for i, r in enumerate(rows)):
            start = len(order)
            order.extend(rows)
            for i, r in enumerate(rows):
                first.setdefault(r, start + i)
        seen[rows] = slices_i = slice(start, start + len(rows))
        slices.append(slices_i)
    return torch.tensor(order, dtype=torch.long), slices


def stage_rows(tensor: torch.Tensor, order: torch.Tensor, device: torch.device | str, *,
               dim1: Sequence[int] | None = None, transpose: bool = False) -> torch.Tensor:
    """``tensor[order]`` (rows first) on ``device``, gathered where ``tensor`` lives and moved in one copy.

    Args:
        tensor: ``[n, ...]`` per-row data (usually on the CPU).
        order: ``[k]`` local rows (:func:`pass_layout`).
        device: where the passes run.
        dim1: keep only these positions of dimension 1 (e.g. the trained steps of ``[n, T, ...]``).
        transpose: return ``[d1, k, ...]`` instead of ``[k, d1, ...]``, so that ``staged[j, slice]`` is contiguous
            (what a pass reads for one step is then laid out as the unstaged gather was).

    Returns:
        ``[k, ...]`` (or ``[k, len(dim1), ...]``, or transposed), contiguous, on ``device``.
    """
    out = tensor[order.to(tensor.device)]
    if dim1 is not None:
        out = out[:, torch.as_tensor(list(dim1), dtype=torch.long, device=out.device)]
    if transpose:
        out = out.transpose(0, 1)
    return out.contiguous().to(device)


def pass_scale(p: TrainingPass, n_global: int, dist, units_per_sample: int = 1) -> float:
    """The factor of a pass's mean loss such that the all-reduced gradient is the minibatch's mean.

    The pass holds ``len(p.rows)`` of the minibatch's ``n_global`` samples (times ``units_per_sample``
    units each); ``world_size`` undoes DDP's averaging over processes.
    """
    return p.weight * len(p.rows) / n_global * dist.world_size / units_per_sample


class MetricMeans:
    """Weighted means of per-pass statistics (e.g. weighted by the samples of each pass).

    A value may be a number or a one-element tensor. A tensor on an accelerator is not read when it is added:
    reading it (``float(t)``) would block the host until the device has caught up, once per statistic per pass.
    Its weighted sum is kept on the device, in float64, and :meth:`flush` reads every pending sum in one
    ``torch.stack(...).tolist()`` (the trainers flush once per optimizer step). float64 arithmetic on the device
    is the same IEEE arithmetic as Python's floats, in the same order, so the means equal those of reading each
    value at once, bit for bit. (MPS has no float64: its values are read at once.)
    """

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, weight: float, **values: float | torch.Tensor) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                value = value.detach().reshape(())  # one element, as float(value) requires
                if value.device.type in ("cpu", "mps"):  # a CPU read costs nothing; MPS has no float64
                    term = float(value) * weight
                else:
                    term = value.double() * weight
            else:
                term = float(value) * weight
            self.sums[key] = self.sums.get(key, 0.0) + term
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def flush(self) -> None:
        """Read the sums still on a device: one ``tolist()`` per device (a blocking read; call it where the host
        waits for the device anyway, e.g. at the optimizer step)."""
        pending: dict[torch.device, list[str]] = {}
        for key, value in self.sums.items():
            if isinstance(value, torch.Tensor):
                pending.setdefault(value.device, []).append(key)
        for keys in pending.values():
            self.sums.update(zip(keys, torch.stack([self.sums[k] for k in keys]).tolist()))

    def means(self) -> dict[str, float]:
        self.flush()
        return {k: v / self.weights[k] if self.weights[k] else 0.0 for k, v in self.sums.items()}
