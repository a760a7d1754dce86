"""Collect one epoch of an online run: roll out, decode, score in the background.

``collect_epoch`` is the first half of every online trainer's epoch (docs/architecture.md, "One RL
step"): for this process's shard of the prompt groups' batch it rolls out with the configured step and
window (recording a ``samplers.Trajectory``), decodes, and hands the images to the reward in a background
thread while the next rollout batch samples (on CUDA on its own stream, so that the reward's kernels run beside
the sampler's instead of queueing behind them). The result, :class:`EpochRollouts`, is the one record that
advantages, credit and the training pass read.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from samplers import Trajectory

__all__ = ["EpochRollouts", "collect_epoch"]


@dataclass
class EpochRollouts:
    """One process's rollouts of an epoch (``n`` samples, ``T`` steps), kept on the CPU.

    Attributes:
        trajectory: the rollout (``latents [n, T + 1, C, H, W]``, ``log_probs [n, T]``, the ``Step`` and
            ``train_mask [T]``; ``x0_preds [n, T, ...]`` when collected with ``store_x0``, ``means [n, T, ...]`` with
            ``store_means``).
        rewards: ``[n]`` float32 training rewards (NaN where the reward failed).
        details: ``{name: [n]}`` reward details.
        prompts / metadata: ``n`` prompts and their metadata.
        group_ids / sample_ids / sample_seeds: ``[n]`` int64, as in
            :class:`flowrl.data.prompt_groups.EpochBatch` (global numbering).
        cond: the text conditioning ``{key: [n, ...]}``.
        images: ``[n, 3, H, W]`` decoded images in [0, 1].
        timings: seconds of ``sampling``, ``scoring`` (reward compute, overlapped) and ``scoring_wait``.
    """

    trajectory: Trajectory
    rewards: torch.Tensor
    details: dict[str, torch.Tensor]
    prompts: list[str]
    metadata: list[dict]
    group_ids: torch.Tensor
    sample_ids: torch.Tensor
    sample_seeds: torch.Tensor
    cond: dict[str, torch.Tensor]
    images: torch.Tensor
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.rewards.numel()

    @property
    def trained_steps(self) -> list[int]:
        return self.trajectory.trained_steps

    def cond_rows(self, rows: torch.Tensor, device: torch.device | str) -> dict[str, torch.Tensor]:
        """The conditioning of ``rows`` on ``device``."""
        return {k: v[rows].to(device) for k, v in self.cond.items()}


def _reward_stream(device: torch.device | str) -> "torch.cuda.Stream | None":
    """The reward thread's own CUDA stream (None off CUDA, where there are no streams to overlap).

    On the sampling thread's stream the reward's kernels would queue behind the next rollout's (and its copies
    would wait for them); on its own stream they run beside them. The new stream first waits for everything
    queued so far on the current one (the reward model's weights were moved there).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


@contextlib.contextmanager
def _on_stream(stream, ready, images: torch.Tensor):
    """Run the block on ``stream`` once ``ready`` (an event recorded on the sampling stream after the decode) has
    passed; a no-op for ``stream=None``.

    An event rather than ``stream.wait_stream(sampling stream)``: by the time this thread runs, the sampling thread
    has queued the next rollout's kernels, and waiting for the whole stream would wait for them too.
    ``record_stream`` tells the caching allocator that ``images`` is used on ``stream``, so its memory is not
    handed to the sampling stream while the reward stream still reads it.
    """
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        images.record_stream(stream)
        yield


def collect_epoch(model, batch, *, step, window, epoch: int, seed: int, reward: Callable, guidance: float,
                  batch_size: int, store_x0: bool = False, store_means: bool = False, velocity_fn=None,
                  progress=None) -> EpochRollouts:
    """Roll out, decode and score this process's shard of an epoch.

    Args:
        model: the model adapter (``flowrl.models.base.FlowModel``); put in eval mode while sampling.
        batch: this process's :class:`flowrl.data.prompt_groups.EpochBatch`.
        step: the ``samplers.Step`` of the trained steps (``flowrl.rl.sampling.rollout_step``).
        window: the ``samplers.Window`` of trained steps (``flowrl.rl.sampling.rollout_window``).
        epoch / seed: drive the window position (the noise comes from ``batch.sample_seeds``).
        reward: ``reward(images, prompts, metadata) -> RewardOutput``.
        guidance: classifier-free guidance scale of the rollout.
        batch_size: samples per rollout call.
        store_x0: record the predicted clean latents (cosine credit needs them).
        store_means: record every step's transition mean (GRPO-Guard's RatioNorm and Flow-DPPO need them).
        velocity_fn: sample with this velocity instead of ``model.velocity_fn(guidance)`` (e.g. a snapshot).
        progress: optional tqdm bar advanced by the number of samples of each rollout call.

    Returns:
        :class:`EpochRollouts` on the CPU.
    """
    from flowrl.models.base import encode_rows
    from rewards.base import checked_reward
    from samplers import initial_noise, rollout

    velocity = velocity_fn or model.velocity_fn(guidance)
    n = len(batch.prompts)
    parts: list[Trajectory] = []
    conds: list[dict[str, torch.Tensor]] = []
    futures: list[Future] = []
    score_seconds = [0.0]
    stream = _reward_stream(model.device)

    def score(decoded: torch.Tensor, ready, prompts: list[str], metadata: list[dict]):
        """In the reward thread: the decoded images to the CPU (the reward sees CPU images, as every caller gives
        them), then the reward. Returns ``(RewardOutput, images [b, 3, H, W] on the CPU)``."""
        with _on_stream(stream, ready, decoded):
            images = decoded.cpu()
            start = time.perf_counter()
            try:
                return checked_reward(reward, images, prompts, metadata), images
            finally:
                score_seconds[0] += time.perf_counter() - start

    t_start = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            for start in range(0, n, batch_size):
                rows = slice(start, min(start + batch_size, n))
                prompts = batch.prompts[rows]
                cond = encode_rows(model, prompts, batch.metadata[rows])  # editing: the source
                x_init = initial_noise(model.latent_shape, batch.sample_seeds[rows], device=model.device)
                traj = rollout(velocity, x_init, step.sigmas, cond=cond, step=step, window=window, iteration=epoch,
                               seed=seed, sample_seeds=batch.sample_seeds[rows], store_x0=store_x0,
                               store_means=store_means, model_dtype=model.dtype)
                decoded = model.decode(traj.x0)
                ready = None
                if stream is not None:  # the decode's point on the sampling stream, for the reward stream to wait on
                    ready = torch.cuda.Event()
                    ready.record(torch.cuda.current_stream(model.device))
                futures.append(pool.submit(score, decoded, ready, prompts, batch.metadata[rows]))
                parts.append(traj.to("cpu"))
                conds.append({k: v.cpu() for k, v in cond.items()})
                if progress is not None:
                    progress.update(rows.stop - rows.start)
            sampling_done = time.perf_counter()
            outputs, images = zip(*[f.result() for f in futures])
    finally:
        if was_training:
            model.train()
    t_end = time.perf_counter()
    return EpochRollouts(
        trajectory=Trajectory.cat(parts),
        rewards=torch.cat([o.scores.float() for o in outputs]),
        details={k: torch.cat([o.details[k].float() for o in outputs]) for k in outputs[0].details},
        prompts=list(batch.prompts),
        metadata=list(batch.metadata),
        group_ids=batch.group_ids,
        sample_ids=batch.sample_ids,
        sample_seeds=batch.sample_seeds,
        cond={k: torch.cat([c[k] for c in conds]) for k in conds[0]},
        images=torch.cat(images),
        # Scoring overlaps sampling: "scoring" is the reward's compute time, "scoring_wait" what sampling
        # did not hide.
        timings={"sampling": sampling_done - t_start, "scoring": score_seconds[0],
                 "scoring_wait": t_end - sampling_done},
    )
