"""Sigma schedules, from sigma = 1 (noise) down to sigma = 0 (data).

Every schedule here is a float32 tensor ``[n + 1]`` whose first entry is the starting sigma and whose
last entry is exactly 0; step ``t`` goes from ``sigmas[t]`` to ``sigmas[t + 1]`` (docs/algorithms.md, section 1).

``diffusers_flow_sigmas`` reproduces ``diffusers.FlowMatchEulerDiscreteScheduler.set_timesteps`` without
importing diffusers (this package depends on torch and numpy only). It mirrors diffusers' arithmetic
step by step (including its dtypes) so that the result matches bit for bit, because the scheduler's
spacing has two easily missed details:

* the spacing runs from ``sigma_max`` to ``sigma_min`` of the *training* grid, where ``sigma_min`` is
  ``1 / num_train_timesteps`` already shifted once in ``__init__``; with a static shift the inference
  sigmas are therefore shifted again on top of that (SD3 with shift 3.0 ends at ~0.0089, not 0.0);
* the FLUX pipeline does not use that spacing: it passes its own ``sigmas = linspace(1, 1/n, n)`` and
  a resolution-dependent ``mu`` (``flux_pipeline_sigmas``).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

__all__ = [
    "linear_sigmas",
    "shifted_sigmas",
    "shift_sigmas",
    "calculate_shift",
    "diffusers_flow_sigmas",
    "flux_pipeline_sigmas",
]


def _check_steps(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"the number of steps must be a positive int, got {n!r}")
    return int(n)


def linear_sigmas(n: int) -> torch.Tensor:
    """Evenly spaced sigmas for ``n`` steps.

    Args:
        n: number of steps (>= 1).

    Returns:
        float32 ``[n + 1]``: ``1, 1 - 1/n, ..., 1/n, 0``.
    """
    n = _check_steps(n)
    return torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64).to(torch.float32)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Apply SD3's time shift ``sigma' = s sigma / (1 + (s - 1) sigma)`` (keeps 0 and 1 fixed).

    Args:
        sigmas: any-shaped tensor of sigmas in [0, 1].
        shift: ``s > 0``; ``s > 1`` spends more steps at high noise.

    Returns:
        float32 tensor of the same shape (computed in float64).
    """
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    s = torch.as_tensor(sigmas, dtype=torch.float64)
    return (shift * s / (1.0 + (shift - 1.0) * s)).to(torch.float32)


def shifted_sigmas(n: int, shift: float) -> torch.Tensor:
    """Evenly spaced sigmas for ``n`` steps, then SD3-shifted (``shift = 1`` gives ``linear_sigmas``).

    Args:
        n: number of steps (>= 1).
        shift: time shift ``s > 0`` (SD3 uses 3.0).

    Returns:
        float32 ``[n + 1]`` from 1 down to 0.
    """
    n = _check_steps(n)
    s = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64)
    return shift_sigmas(s, shift)


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent ``mu``: linear in the number of image tokens.

    Same signature and arithmetic as ``diffusers.pipelines.flux.pipeline_flux.calculate_shift``.

    Args:
        image_seq_len: number of latent tokens (``(H / 16) * (W / 16)`` for FLUX at ``H x W`` pixels).
        base_seq_len, max_seq_len: the two sequence lengths the line passes through ...
        base_shift, max_shift: ... with these values of ``mu``.

    Returns:
        ``mu`` (a float) for ``diffusers_flow_sigmas(..., use_dynamic_shifting=True, mu=mu)``.
    """
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def diffusers_flow_sigmas(
    num_steps: int,
    *,
    shift: float = 1.0,
    use_dynamic_shifting: bool = False,
    mu: float | None = None,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    base_image_seq_len: int = 256,
    max_image_seq_len: int = 4096,
    image_seq_len: int | None = None,
    num_train_timesteps: int = 1000,
    time_shift_type: str = "exponential",
    shift_terminal: float | None = None,
    sigmas: Sequence[float] | np.ndarray | None = None,
) -> torch.Tensor:
    """The ``sigmas`` of a diffusers ``FlowMatchEulerDiscreteScheduler`` after ``set_timesteps``.

    The keyword arguments are the scheduler's config fields (pass ``**scheduler.config`` minus the ones
    not listed) plus the ``set_timesteps`` arguments ``mu`` and ``sigmas``. Karras / exponential / beta
    sigma conversions and ``invert_sigmas`` are not supported (no flow model in flowrl uses them).

    Args:
        num_steps: number of inference steps.
        shift: static shift (SD3: 3.0); ignored when ``use_dynamic_shifting``.
        use_dynamic_shifting: FLUX-style shift ``exp(mu) / (exp(mu) + (1/sigma - 1))``.
        mu: the dynamic shift; computed with ``calculate_shift(image_seq_len, ...)`` when None and
            ``image_seq_len`` is given.
        base_shift, max_shift, base_image_seq_len, max_image_seq_len: ``calculate_shift`` parameters.
        image_seq_len: number of latent tokens, used only to compute ``mu``.
        num_train_timesteps: the training grid size (1000).
        time_shift_type: ``"exponential"`` (FLUX, SD3.5) or ``"linear"``.
        shift_terminal: stretch the schedule so that its last non-zero sigma equals this value.
        sigmas: custom base sigmas (``set_timesteps(sigmas=...)``); their length must be ``num_steps``.

    Returns:
        float32 ``[num_steps + 1]``, ending with the scheduler's terminal 0. Timesteps for a diffusers
        model are ``sigmas[:-1] * num_train_timesteps``.
    """
    num_steps = _check_steps(num_steps)
    if time_shift_type not in ("exponential", "linear"):
        raise ValueError(f"time_shift_type must be 'exponential' or 'linear', got {time_shift_type!r}")
    if use_dynamic_shifting and mu is None:
        if image_seq_len is None:
            raise ValueError("use_dynamic_shifting=True needs mu=... or image_seq_len=... (to compute mu)")
        mu = calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len, base_shift, max_shift)

    # Scheduler.__init__: the training grid (torch float32, as diffusers computes it).
    n_train = num_train_timesteps
    grid = np.linspace(1, n_train, n_train, dtype=np.float32)[::-1].copy()
    train_sigmas = torch.from_numpy(grid).to(dtype=torch.float32) / n_train
    if not use_dynamic_shifting:
        train_sigmas = shift * train_sigmas / (1 + (shift - 1) * train_sigmas)
    sigma_max = train_sigmas[0].item()
    sigma_min = train_sigmas[-1].item()

    # set_timesteps: 1. base sigmas (numpy float64 from the default spacing, float32 when custom).
    if sigmas is None:
        timesteps = np.linspace(sigma_max * n_train, sigma_min * n_train, num_steps)
        s = timesteps / n_train
    else:
        s = np.array(sigmas).astype(np.float32)
        if len(s) != num_steps:
            raise ValueError(f"custom sigmas must have num_steps={num_steps} entries, got {len(s)}")

    # 2. shifting.
    if use_dynamic_shifting:
        if time_shift_type == "exponential":
            s = math.exp(mu) / (math.exp(mu) + (1 / s - 1) ** 1.0)
        else:
            s = mu / (mu + (1 / s - 1) ** 1.0)
    else:
        s = shift * s / (1 + (shift - 1) * s)

    # 3. optional stretch to a terminal value.
    if shift_terminal:
        one_minus_z = 1 - s
        scale_factor = one_minus_z[-1] / (1 - shift_terminal)
        s = 1 - (one_minus_z / scale_factor)

    # 5./6. float32 tensor plus the terminal zero.
    out = torch.from_numpy(np.asarray(s)).to(dtype=torch.float32)
    return torch.cat([out, torch.zeros(1, dtype=torch.float32)])


def flux_pipeline_sigmas(
    num_steps: int,
    image_seq_len: int,
    *,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
    base_image_seq_len: int = 256,
    max_image_seq_len: int = 4096,
    **scheduler_config,
) -> torch.Tensor:
    """The sigmas ``diffusers.FluxPipeline`` samples with: custom ``linspace(1, 1/n, n)`` plus ``mu``.

    Args:
        num_steps: number of inference steps.
        image_seq_len: number of packed latent tokens (``(H // 16) * (W // 16)`` at ``H x W`` pixels).
        base_shift, max_shift, base_image_seq_len, max_image_seq_len: the scheduler config values.
        **scheduler_config: further ``diffusers_flow_sigmas`` keywords (e.g. ``time_shift_type``).

    Returns:
        float32 ``[num_steps + 1]`` ending in 0.
    """
    num_steps = _check_steps(num_steps)
    mu = calculate_shift(image_seq_len, base_image_seq_len, max_image_seq_len, base_shift, max_shift)
    base = np.linspace(1.0, 1 / num_steps, num_steps)
    return diffusers_flow_sigmas(
        num_steps,
        use_dynamic_shifting=True,
        mu=mu,
        base_shift=base_shift,
        max_shift=max_shift,
        base_image_seq_len=base_image_seq_len,
        max_image_seq_len=max_image_seq_len,
        sigmas=base,
        **scheduler_config,
    )
