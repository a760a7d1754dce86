"""Rollout with per-step log-probabilities, training windows, and batched ODE completion.

``rollout`` runs a schedule from ``x_init`` (at ``sigmas[0]``) to ``sigma = 0`` and records a
``Trajectory``. Steps inside the training window use the chosen stochastic step (``flow_sde`` etc.) and
are trained; all other steps are deterministic Euler (ODE) steps. The final step (to ``sigma = 0``) is
deterministic and never trained unless ``deterministic_last_step=False`` (docs/algorithms.md, section 2).

Randomness: with ``sample_seeds`` (one int64 per sample, see ``samplers.noise``) the SDE noise of
sample ``b`` at step ``t`` comes from ``(sample_seeds[b], t)`` only, so a sample's trajectory does not
depend on its batch, its position in the batch, or the process that drew it. The window never depends
on the process rank: it is a pure function of ``(window, T, iteration, seed)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from .guidance import cond_batch_size, select_cond
from .noise import STREAM_WINDOW, derive_seed, make_sample_seeds, steps_noise
from .steps import Step, StepOutput, euler_step, make_step

__all__ = [
    "Window",
    "WINDOW_MODES",
    "trainable_steps",
    "window_start",
    "train_mask",
    "Trajectory",
    "rollout",
    "ode_complete",
]

VelocityFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
WINDOW_MODES = ("fixed", "random", "sliding")


# ----------------------------------------------------------------------------------------------------
# windows


@dataclass(frozen=True)
class Window:
    """Which consecutive steps use the SDE and are trained: ``[s, s + size)``.

    Attributes:
        mode: ``fixed`` (``s = start``); ``random`` (Flow-GRPO-Fast: ``s`` drawn per rollout call,
            uniformly from ``{start, ..., max_start}``, by a hash of ``(seed, iteration)``); ``sliding``
            (MixGRPO: ``s = start + (iteration // every) mod (max_start - start + 1)``, i.e. it advances by
            one step every ``every`` iterations and wraps back to ``start`` after ``max_start``).
        start: the (smallest) window start, 0-based step index.
        size: number of steps; ``None`` means "up to the last trainable step" (``fixed`` only).
        every: ``sliding`` only: iterations per one-step advance (MixGRPO's shift interval).
        max_start: ``random`` / ``sliding``: the largest start (inclusive). Default: the last start at
            which the window still fits the trainable steps, ``L - size``, where ``L = T - 1`` with a
            deterministic last step (else ``T``).
    """

    mode: str = "fixed"
    start: int = 0
    size: int | None = None
    every: int = 1
    max_start: int | None = None

    def __post_init__(self):
        if self.mode not in WINDOW_MODES:
            raise ValueError(f"window mode must be one of {WINDOW_MODES}, got {self.mode!r}")
        for name in ("start", "every"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int):
                raise ValueError(f"window {name} must be an int, got {val!r}")
        if self.start < 0:
            raise ValueError(f"window start must be >= 0, got {self.start}")
        if self.every < 1:
            raise ValueError(f"window every must be >= 1, got {self.every}")
        if self.size is not None and (isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1):
            raise ValueError(f"window size must be a positive int or None, got {self.size!r}")
        if self.size is None and self.mode != "fixed":
            raise ValueError(f"a {self.mode!r} window needs a size")
        if self.max_start is not None:
            if self.mode == "fixed":
                raise ValueError("max_start applies to 'random' and 'sliding' windows only")
            if isinstance(self.max_start, bool) or not isinstance(self.max_start, int) or self.max_start < self.start:
                raise ValueError(f"window max_start must be an int >= start={self.start}, got {self.max_start!r}")


def _as_window(window: Window | Mapping[str, Any] | None) -> Window | None:
    if window is None or isinstance(window, Window):
        return window
    if isinstance(window, Mapping):
        return Window(**window)
    raise TypeError(f"window must be a Window, a dict of its fields or None, got {type(window).__name__}")


def trainable_steps(num_steps: int, deterministic_last_step: bool = True) -> int:
    """``L``, the number of steps a window may cover: ``T - 1`` with a deterministic last step, else ``T``."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return num_steps - 1 if deterministic_last_step else num_steps


def window_start(
    window: Window | Mapping[str, Any] | None,
    num_steps: int,
    iteration: int = 0,
    seed: int = 0,
    *,
    deterministic_last_step: bool = True,
) -> int:
    """The first trained step of ``window`` for this ``(iteration, seed)``; pure and rank-independent.

    Args:
        window: a ``Window`` (or its fields as a dict); ``None`` means every trainable step (start 0).
        num_steps: ``T``.
        iteration: the training iteration (epoch); drives ``random`` and ``sliding``.
        seed: the run seed; drives ``random``.
        deterministic_last_step: whether the last step is excluded from training.

    Returns:
        The start index ``s``; the window is ``[s, s + size)``.

    Raises:
        ValueError: the window does not fit the ``L`` trainable steps.
    """
    window = _as_window(window)
    L = trainable_steps(num_steps, deterministic_last_step)
    if window is None:
        return 0
    size = window.size if window.size is not None else L - window.start
    if size < 1 or window.start + size > L:
        raise ValueError(
            f"window (mode={window.mode!r}, start={window.start}, size={window.size}) does not fit the {L} trainable "
            f"steps of a {num_steps}-step schedule (deterministic_last_step={deterministic_last_step})"
        )
    if window.mode == "fixed":
        return window.start
    hi = window.max_start if window.max_start is not None else L - size
    if hi + size > L:
        raise ValueError(f"window max_start={hi} with size={size} runs past the {L} trainable steps")
    positions = hi - window.start + 1
    if window.mode == "random":
        return window.start + derive_seed(seed, iteration, STREAM_WINDOW) % positions
    return window.start + (iteration // window.every) % positions  # sliding


def train_mask(
    window: Window | Mapping[str, Any] | None,
    num_steps: int,
    iteration: int = 0,
    seed: int = 0,
    *,
    deterministic_last_step: bool = True,
) -> torch.Tensor:
    """Bool ``[T]``: True at the steps the window samples with the SDE and trains.

    Args: as in ``window_start``. ``window=None`` marks every trainable step.

    Returns:
        bool ``[T]`` (CPU).
    """
    window = _as_window(window)
    L = trainable_steps(num_steps, deterministic_last_step)
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if window is None:
        mask[:L] = True
        return mask
    s = window_start(window, num_steps, iteration=iteration, seed=seed, deterministic_last_step=deterministic_last_step)
    size = window.size if window.size is not None else L - window.start
    mask[s : s + size] = True
    return mask


# ----------------------------------------------------------------------------------------------------
# trajectories


@dataclass
class Trajectory:
    """A recorded rollout. ``B`` samples, ``T`` steps, sample shape ``S`` (e.g. ``C, H, W``); float32.

    The training pass re-scores trained step ``t`` with the same ``Step`` the rollout used::

        x_t = traj.state(t, rows)                      # contiguous float32, as the rollout fed it
        v = velocity_fn(x_t.to(traj.model_dtype), traj.sigmas[t].expand(len(x_t)), cond)
        out = traj.score_step(v, t, rows)              # = traj.step(v, x_t, t, x_next=traj.state(t + 1, rows))

    With unchanged weights (and a deterministic model) this reproduces ``traj.log_probs[rows, t]`` bit
    for bit: the step math is per row and its reductions are batch-invariant.
    """

    latents: torch.Tensor  # [B, T + 1, *S] states; latents[:, 0] = x_init, latents[:, T] = the final sample
    log_probs: torch.Tensor  # [B, T] log-prob of each transition (step.reduction); 0 at ODE steps
    stds: torch.Tensor  # [B, T] per-element transition std; 0 at ODE steps
    sigmas: torch.Tensor  # [T + 1] the schedule (CPU)
    train_mask: torch.Tensor  # [T] bool, the SDE (trained) steps
    step: Step  # the step family, schedule and hyperparameters used at the trained steps
    noise_scales: torch.Tensor  # [T] the noise scale used at each step (g_t / a / eta); 0 at ODE steps
    means: torch.Tensor | None = None  # [B, T, *S] transition means (store_means=True)
    x0_preds: torch.Tensor | None = None  # [B, T, *S] x - sigma v at each step (store_x0=True)
    sample_seeds: torch.Tensor | None = None  # [B] int64 per-sample seeds that drove the noise
    window_start: int | None = None  # first trained step (None when nothing is trained)
    nfe: int = 0  # model evaluations spent (rows x calls)
    model_dtype: torch.dtype = torch.float32  # dtype the states were cast to before each model call

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @property
    def batch_size(self) -> int:
        return self.latents.shape[0]

    @property
    def x0(self) -> torch.Tensor:
        """The final samples ``[B, *S]``."""
        return self.latents[:, -1]

    @property
    def trained_steps(self) -> list[int]:
        """Indices of the trained steps, ascending."""
        return torch.nonzero(self.train_mask).flatten().tolist()

    def state(self, t: int, rows: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The state before step ``t`` of ``rows`` (default all) as a contiguous float32 ``[b, *S]``,
        i.e. exactly the tensor the rollout stepped from (and, cast to ``model_dtype``, fed the model)."""
        x = self.latents[:, t] if rows is None else self.latents[torch.as_tensor(rows).to(self.latents.device), t]
        return x.contiguous()

    def score_step(self, v: torch.Tensor, t: int, rows: torch.Tensor | Sequence[int] | None = None) -> StepOutput:
        """Re-score stored transition ``t`` (of ``rows``, default all) under a new velocity ``v``.

        The stored states are moved to ``v``'s device (a trajectory usually stays on the CPU between
        rollout and training).

        Args:
            v: velocity at ``(latents[rows, t], sigmas[t])``, ``[b, *S]``.
            t: step index.
            rows: optional long index / bool mask of samples.

        Returns:
            ``StepOutput`` whose ``log_prob`` [b] is the new log-prob and ``mean`` the new mean.
        """
        return self.step(v, self.state(t, rows).to(v.device), t, x_next=self.state(t + 1, rows).to(v.device))

    # Fields with one row per sample (indexed by ``select``, concatenated by ``cat``).
    PER_SAMPLE = ("latents", "log_probs", "stds", "means", "x0_preds", "sample_seeds")

    def to(self, device: torch.device | str) -> "Trajectory":
        """The trajectory with its per-sample tensors on ``device`` (schedule, mask and step stay on the CPU)."""
        changes = {name: None if getattr(self, name) is None else getattr(self, name).to(device)
                   for name in self.PER_SAMPLE}
        return replace(self, **changes)

    @classmethod
    def cat(cls, trajectories: Sequence["Trajectory"]) -> "Trajectory":
        """Concatenate trajectories of one rollout configuration along the batch (e.g. the rollout calls
        of an epoch).

        All parts must share the schedule, the trained steps, the step and the model dtype (they were
        sampled by the same configuration); per-sample fields are concatenated and ``nfe`` summed.

        Raises:
            ValueError: an empty list, or parts that differ in schedule, window, step or the optional
                fields they recorded.
        """
        if not trajectories:
            raise ValueError("Trajectory.cat needs at least one trajectory")
        first = trajectories[0]
        for i, other in enumerate(trajectories[1:], start=1):
            if not torch.equal(other.sigmas, first.sigmas) or not torch.equal(other.train_mask, first.train_mask):
                raise ValueError(f"Trajectory.cat: part {i} has a different schedule or trained steps than part 0")
            if other.step is not first.step and repr(other.step) != repr(first.step):
                raise ValueError(f"Trajectory.cat: part {i} used {other.step!r}, part 0 {first.step!r}")
            if other.model_dtype != first.model_dtype:
                raise ValueError(f"Trajectory.cat: part {i} ran the model in {other.model_dtype}, part 0 in "
                                 f"{first.model_dtype}")
            for name in cls.PER_SAMPLE:
                if (getattr(other, name) is None) != (getattr(first, name) is None):
                    raise ValueError(f"Trajectory.cat: part {i} {'lacks' if getattr(other, name) is None else 'has'} "
                                     f"{name}, part 0 does not")
        changes = {name: None if getattr(first, name) is None else torch.cat([getattr(t, name) for t in trajectories])
                   for name in cls.PER_SAMPLE}
        return replace(first, **changes, nfe=sum(t.nfe for t in trajectories))

    def select(self, rows: torch.Tensor | Sequence[int]) -> "Trajectory":
        """The trajectory restricted to ``rows`` (per-sample fields indexed, shared fields kept)."""
        rows = torch.as_tensor(rows)
        changes = {}
        for name in self.PER_SAMPLE:
            val = getattr(self, name)
            changes[name] = None if val is None else val[rows.to(val.device)]
        return replace(self, **changes)


# ----------------------------------------------------------------------------------------------------
# rollout


def _schedule(sigmas: torch.Tensor | Sequence[float]) -> torch.Tensor:
    sig = torch.as_tensor(sigmas).detach().to(device="cpu", dtype=torch.float32).flatten()
    if sig.numel() < 2:
        raise ValueError("a schedule needs at least 2 sigmas")
    if not bool((sig[1:] < sig[:-1]).all()):
        raise ValueError(f"sigmas must be strictly decreasing, got {sig.tolist()}")
    return sig


def rollout(
    velocity_fn: VelocityFn,
    x_init: torch.Tensor,
    sigmas: torch.Tensor | Sequence[float],
    *,
    cond: Any = None,
    step: str | Step = "flow_sde",
    step_kwargs: Mapping[str, Any] | None = None,
    window: Window | Mapping[str, Any] | None = None,
    iteration: int = 0,
    seed: int = 0,
    sample_seeds: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    store_x0: bool = False,
    store_means: bool = False,
    deterministic_last_step: bool = True,
    model_dtype: torch.dtype | None = None,
    enable_grad: bool = False,
) -> Trajectory:
    """Sample ``B`` trajectories and record states, log-probs and stds.

    Args:
        velocity_fn: ``(x [B, *S] in model_dtype, sigma [B] float32, cond) -> v [B, *S]`` (wrap it with
            ``classifier_free_guidance`` for guidance).
        x_init: initial states ``[B, *S]`` at ``sigmas[0]`` (see ``samplers.noise.initial_noise``).
        sigmas: schedule ``[T + 1]``, strictly decreasing to 0.
        cond: condition passed through to ``velocity_fn`` (tensor / dict of tensors, batch first).
        step: a registry name (``ode | flow_sde | dance_sde | cps | ddim``) or a ready ``Step``.
        step_kwargs: the step's hyperparameters (e.g. ``{"noise_level": 0.7, "reduction": "mean"}``);
            only with a name.
        window: which steps use the SDE and are trained (``Window`` or its fields as a dict); ``None``
            trains every trainable step. Ignored (nothing trained) for the deterministic ``ode`` step.
        iteration: training iteration (epoch), for ``random`` / ``sliding`` windows and default seeds.
        seed: run seed, for ``random`` windows and default seeds.
        sample_seeds: int64 ``[B]`` per-sample seeds; the SDE noise of sample ``b`` at step ``t`` is
            ``step_noise(S, sample_seeds[b], t)`` (drawn for every SDE step before the first one, and moved to
            the device in one copy: ``steps_noise``). Without them and without ``generator`` they default
            to ``make_sample_seeds(seed, iteration, range(B))`` (then rows depend on their batch position).
        generator: alternatively, one generator for the whole batch (noise then depends on the batch). It draws
            step by step on its own device: a CPU generator for a GPU rollout costs one copy per SDE step.
        store_x0: also record ``x0_preds`` ``[B, T, *S]`` (``x - sigma v``; for dense credit).
        store_means: also record the transition ``means`` ``[B, T, *S]``.
        deterministic_last_step: keep the final step (to ``sigma = 0``) an untrained Euler step.
        model_dtype: dtype of the states passed to ``velocity_fn`` (default ``x_init.dtype``); the sampler
            state itself is always float32.
        enable_grad: run with autograd enabled (default: under ``torch.no_grad()``).

    Returns:
        ``Trajectory`` (float32 tensors on ``x_init``'s device; ``sigmas`` and ``train_mask`` on the CPU).
    """
    sig = _schedule(sigmas)
    T = sig.numel() - 1
    if isinstance(step, Step):
        if step_kwargs:
            raise ValueError("step_kwargs apply only when step is a registry name, not a ready Step")
        if not torch.equal(step.sigmas, sig):
            raise ValueError("the Step was built for a different schedule than sigmas")
        step_obj = step
    else:
        step_obj = make_step(step, sig, **dict(step_kwargs or {}))
    if x_init.ndim < 1:
        raise ValueError("x_init needs a leading batch dimension")
    B = x_init.shape[0]
    device = x_init.device
    sample_shape = tuple(x_init.shape[1:])
    model_dtype = model_dtype or x_init.dtype
    cb = cond_batch_size(cond)
    if cb is not None and cb != B:
        raise ValueError(f"cond has batch {cb}, x_init has batch {B}")

    if step_obj.stochastic:
        mask = train_mask(window, T, iteration=iteration, seed=seed, deterministic_last_step=deterministic_last_step)
    else:
        mask = torch.zeros(T, dtype=torch.bool)
    start = int(torch.nonzero(mask)[0]) if bool(mask.any()) else None

    if sample_seeds is not None and generator is not None:
        raise ValueError("pass sample_seeds or generator, not both")
    if sample_seeds is not None:
        sample_seeds = torch.as_tensor(sample_seeds, dtype=torch.int64).cpu()
        if sample_seeds.shape != (B,):
            raise ValueError(f"sample_seeds must have shape [{B}], got {tuple(sample_seeds.shape)}")
    elif generator is None:
        sample_seeds = make_sample_seeds(seed, iteration, range(B))

    # Everything a step needs from the host is moved to the device here, once per rollout: on a GPU a step then
    # queues its kernels without waiting for a host-to-device copy. The schedule goes over in one copy (the
    # model's per-row sigma is a view of it); the step's own constants are Python floats (Step._lookup); the
    # noise of every SDE step is drawn now, on the CPU as always (so the numbers are the same), and copied once.
    sig_dev = sig.to(device)
    mask_list = mask.tolist()
    sde_steps = [t for t in range(T) if mask_list[t]]
    noise_of = {t: k for k, t in enumerate(sde_steps)}
    window_noise = (steps_noise(sample_shape, sample_seeds, sde_steps, device=device)
                    if sample_seeds is not None and sde_steps else None)  # [K, B, *S]
    x0_state = x_init.detach().to(torch.float32) if not enable_grad else x_init.to(torch.float32)
    # Preallocated [B, T + 1, *S]: each new state is copied in while it is still in cache (cheaper than
    # one big stack at the end); the loop keeps stepping on the contiguous state itself.
    latents = None if enable_grad else torch.empty((B, T + 1) + sample_shape, dtype=torch.float32, device=device)
    states = [x0_state] if enable_grad else None
    if latents is not None:
        latents[:, 0] = x0_state
    log_probs = torch.zeros(B, T, dtype=torch.float32, device=device)
    stds = torch.zeros(B, T, dtype=torch.float32, device=device)
    means = [] if store_means else None
    x0_preds = [] if store_x0 else None

    grad_ctx = contextlib.nullcontext() if enable_grad else torch.no_grad()
    with grad_ctx:
        x = x0_state
        for t in range(T):
            sigma_b = sig_dev[t].expand(B)
            v = velocity_fn(x.to(model_dtype), sigma_b, cond)
            if v.shape != x.shape:
                raise ValueError(f"velocity_fn returned shape {tuple(v.shape)} for a state of shape {tuple(x.shape)}")
            if mask_list[t]:
                noise = window_noise[noise_of[t]] if window_noise is not None else None
                out = step_obj(v, x, t, noise=noise, generator=generator if noise is None else None)
                log_probs[:, t] = out.log_prob
                stds[:, t] = out.std.reshape(B)
            else:
                out = step_obj.ode(v, x, t)
            if store_means:
                means.append(out.mean)
            if store_x0:
                x0_preds.append(x - sigma_b.reshape((B,) + (1,) * len(sample_shape)) * v.to(torch.float32))
            x = out.x_next
            if latents is not None:
                latents[:, t + 1] = x
            else:
                states.append(x)

    return Trajectory(
        latents=latents if latents is not None else torch.stack(states, dim=1),
        log_probs=log_probs,
        stds=stds,
        sigmas=sig,
        train_mask=mask,
        step=step_obj,
        noise_scales=torch.where(mask, step_obj.noise_scales, torch.zeros_like(step_obj.noise_scales)),
        means=torch.stack(means, dim=1) if store_means else None,
        x0_preds=torch.stack(x0_preds, dim=1) if store_x0 else None,
        sample_seeds=sample_seeds,
        window_start=start,
        nfe=B * T,
        model_dtype=model_dtype,
    )


def ode_complete(
    velocity_fn: VelocityFn,
    x: torch.Tensor,
    sigmas: torch.Tensor | Sequence[float],
    start_index: torch.Tensor | Sequence[int],
    *,
    cond: Any = None,
    model_dtype: torch.dtype | None = None,
    max_batch: int | None = None,
    enable_grad: bool = False,
) -> tuple[torch.Tensor, int]:
    """Finish many partial trajectories with the Euler ODE down to ``sigma = 0``, batched across steps.

    Row ``n`` starts at ``sigmas[start_index[n]]``. Call ``k`` evaluates every row that still has steps
    left, each at its own sigma (the velocity contract takes a per-row sigma), so ``N`` rows finish in
    ``max_n (T - start_index[n])`` calls (more only if ``max_batch`` splits a call) and spend exactly
    ``sum_n (T - start_index[n])`` model evaluations, the minimum. Used for TP-GRPO's ODE completions.

    Args:
        velocity_fn: ``(x [b, *S], sigma [b], cond) -> v``.
        x: ``[N, *S]`` states.
        sigmas: schedule ``[T + 1]``.
        start_index: ``[N]`` ints in ``[0, T]`` (``T``: already finished).
        cond: condition with batch ``N`` (rows are selected per call), or None.
        model_dtype: dtype passed to ``velocity_fn`` (default ``x.dtype``).
        max_batch: optional cap on rows per model call.
        enable_grad: run with autograd enabled (default: under ``torch.no_grad()``).

    Returns:
        ``(x0 [N, *S] float32, nfe)`` with ``nfe`` the model evaluations spent (rows x calls).
    """
    sig = _schedule(sigmas)
    T = sig.numel() - 1
    N = x.shape[0]
    idx = torch.as_tensor(start_index, dtype=torch.long).cpu().flatten()
    if idx.shape != (N,):
        raise ValueError(f"start_index must have shape [{N}], got {tuple(idx.shape)}")
    if N and (int(idx.min()) < 0 or int(idx.max()) > T):
        raise ValueError(f"start_index must lie in [0, {T}], got {idx.tolist()}")
    cb = cond_batch_size(cond)
    if cb is not None and cb != N:
        raise ValueError(f"cond has batch {cb}, x has batch {N}")
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    model_dtype = model_dtype or x.dtype
    device = x.device
    state = x.detach().to(torch.float32).clone() if not enable_grad else x.to(torch.float32).clone()
    nfe = 0
    grad_ctx = contextlib.nullcontext() if enable_grad else torch.no_grad()
    with grad_ctx:
        while True:
            active = torch.nonzero(idx < T).flatten()
            if active.numel() == 0:
                break
            chunks = [active] if max_batch is None else list(active.split(max_batch))
            for rows in chunks:
                everyone = rows.numel() == N
                rows_dev = rows.to(device)
                xr = state if everyone else state[rows_dev]
                s_cur = sig[idx[rows]].to(device)
                s_next = sig[idx[rows] + 1].to(device)
                c = cond if everyone else select_cond(cond, rows)
                v = velocity_fn(xr.to(model_dtype), s_cur, c)
                out = euler_step(v, xr, s_cur, s_next)
                if everyone:
                    state = out.x_next
                else:
                    state[rows_dev] = out.x_next
                nfe += rows.numel()
            idx = torch.where(idx < T, idx + 1, idx)
    return state, nfe
