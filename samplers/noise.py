"""Per-sample randomness: a sample's noise derives from its own seed, never from its batch or rank.

docs/architecture.md, "Conventions": every sample's initial noise and SDE noise derive from (seed, epoch, global
sample index). ``make_sample_seeds`` turns that triple into one 63-bit seed per sample; every draw of
the sample then comes from its own ``torch.Generator`` seeded with ``derive_seed(sample_seed, stream,
step)``, drawn on the CPU (CPU generators give the same numbers on every machine and device) and moved
to the target device. So a sample's trajectory is the same whether it is drawn alone, in a batch of 8,
or on another process, and an SDE step's noise does not depend on which other steps drew noise.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

__all__ = ["derive_seed", "make_sample_seeds", "initial_noise", "step_noise", "steps_noise", "sample_generators"]

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1

# Stream tags keep the different uses of one sample seed independent.
STREAM_INITIAL = 0x1A17
STREAM_STEP = 0x57E9
STREAM_WINDOW = 0x3D0


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def derive_seed(*parts: int) -> int:
    """Hash integers into one seed in ``[0, 2^63)`` (SplitMix64 chaining; stable across platforms).

    Args:
        *parts: any Python ints (negative ones are taken modulo 2^64).

    Returns:
        A non-negative int that fits an int64 tensor and ``torch.Generator.manual_seed``.
    """
    h = 0x6A09E667F3BCC908
    for p in parts:
        h = _splitmix64(h ^ (int(p) & _MASK64))
    return h & _MASK63


def make_sample_seeds(seed: int, epoch: int, sample_indices: Iterable[int] | torch.Tensor) -> torch.Tensor:
    """One seed per sample from (run seed, epoch, global sample index).

    Args:
        seed: the run's seed.
        epoch: the iteration / epoch the samples are drawn in.
        sample_indices: global sample indices ``[B]`` (over the whole batch, across processes).

    Returns:
        int64 ``[B]`` on the CPU.
    """
    idx = sample_indices.tolist() if isinstance(sample_indices, torch.Tensor) else list(sample_indices)
    return torch.tensor([derive_seed(seed, epoch, int(i)) for i in idx], dtype=torch.int64)


def _seed_list(sample_seeds: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(sample_seeds, torch.Tensor):
        if sample_seeds.ndim != 1:
            raise ValueError(f"sample_seeds must be a [B] tensor, got shape {tuple(sample_seeds.shape)}")
        return [int(s) for s in sample_seeds.tolist()]
    return [int(s) for s in sample_seeds]


def sample_generators(sample_seeds: torch.Tensor | Sequence[int], *parts: int) -> list[torch.Generator]:
    """One CPU generator per sample, seeded with ``derive_seed(sample_seed, *parts)``."""
    return [torch.Generator().manual_seed(derive_seed(s, *parts)) for s in _seed_list(sample_seeds)]


def _draw(shape: Sequence[int], gens: list[torch.Generator], device, dtype) -> torch.Tensor:
    shape = tuple(int(d) for d in shape)
    out = torch.empty((len(gens),) + shape, dtype=torch.float32)
    for row, gen in zip(out, gens):
        row.normal_(generator=gen)
    return out.to(device=device, dtype=dtype)


def initial_noise(
    shape: Sequence[int],
    sample_seeds: torch.Tensor | Sequence[int],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard-normal initial latents, one independent stream per sample.

    Args:
        shape: the shape of ONE sample (e.g. ``(C, H, W)``), without the batch dimension.
        sample_seeds: int64 ``[B]`` (see ``make_sample_seeds``).
        device: where to put the result (drawn on the CPU, so identical on every device).
        dtype: result dtype (drawn in float32, then cast).

    Returns:
        ``[B, *shape]``; row ``b`` depends only on ``sample_seeds[b]``.
    """
    return _draw(shape, sample_generators(sample_seeds, STREAM_INITIAL), device, dtype)


def step_noise(
    shape: Sequence[int],
    sample_seeds: torch.Tensor | Sequence[int],
    step_index: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard-normal noise for SDE step ``step_index`` of each sample.

    Args:
        shape: the shape of ONE sample, without the batch dimension.
        sample_seeds: int64 ``[B]``.
        step_index: the step's position in the schedule (0-based).
        device, dtype: as in ``initial_noise``.

    Returns:
        ``[B, *shape]``; row ``b`` depends only on ``(sample_seeds[b], step_index)``.
    """
    return _draw(shape, sample_generators(sample_seeds, STREAM_STEP, int(step_index)), device, dtype)


def steps_noise(
    shape: Sequence[int],
    sample_seeds: torch.Tensor | Sequence[int],
    step_indices: Sequence[int],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The SDE noise of several steps at once: ``steps_noise(...)[k]`` equals ``step_noise(..., step_indices[k])``
    bit for bit.

    A rollout draws the noise of all its stochastic steps before the first one and moves it to the device in one
    copy: drawn step by step (on the CPU, see the module docstring), every step would wait for its own blocking
    host-to-device copy. Costs ``K`` times one step's noise of device memory.

    Args:
        shape: the shape of ONE sample, without the batch dimension.
        sample_seeds: int64 ``[B]``.
        step_indices: ``K`` step positions in the schedule (0-based).
        device, dtype: as in ``initial_noise``.

    Returns:
        ``[K, B, *shape]``; ``[k, b]`` depends only on ``(sample_seeds[b], step_indices[k])``.
    """
    shape = tuple(int(d) for d in shape)
    seeds = _seed_list(sample_seeds)
    out = torch.empty((len(step_indices), len(seeds)) + shape, dtype=torch.float32)
    for k, step_index in enumerate(step_indices):
        # The same generators and the same contiguous [*shape] rows as step_noise, hence the same numbers.
        for row, gen in zip(out[k], sample_generators(seeds, STREAM_STEP, int(step_index))):
            row.normal_(generator=gen)
    return out.to(device=device, dtype=dtype)
