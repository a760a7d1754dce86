"""The reward interface: ``reward(images, prompts, metadata=None) -> RewardOutput``.

Images arrive as a ``[B, 3, H, W]`` float tensor in [0, 1] or as a list of PIL images; subclasses
implement :meth:`Reward.score` on the tensor form and never see PIL unless they ask for it.

Videos (a video model's frames, ``[B, F, 3, H, W]`` in [0, 1]) are scored by every reward: an image reward
(``accepts_video`` False, the default) scores each of the ``B * F`` frames with its video's prompt and reduces
them per video with its ``frame_reduce`` (``"mean"`` by default; :class:`rewards.video.PerFrame` picks ``"min"``),
its details averaged over frames; a reward with ``accepts_video`` True (the temporal-consistency reward, the
composites, which hand videos on to their terms) sees the whole clips.
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

__all__ = ["RewardOutput", "Reward", "RewardError", "checked_reward", "to_image_tensor", "to_media_tensor",
           "to_pil_images", "score_frames", "FRAME_REDUCTIONS"]

#: How per-frame scores become one score per video.
FRAME_REDUCTIONS = ("mean", "min")


class RewardError(FlowrlError, RuntimeError):
    """A reward cannot run (missing weights, bad input, unreachable server); the message says the fix."""


@dataclass
class RewardOutput:
    """Scores of one batch.

    Attributes:
        scores: ``[B]`` float32, the reward used for training (higher is better).
        details: name -> ``[B]`` tensors (components, accuracy flags, ...), logged per reward.
    """

    scores: torch.Tensor  # [B]
    details: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [B]

    def __post_init__(self) -> None:
        if self.scores.dim() != 1:
            raise ValueError(f"RewardOutput.scores must be [B], got shape {tuple(self.scores.shape)}")
        for name, value in self.details.items():
            if value.shape != self.scores.shape:
                raise ValueError(f"RewardOutput.details[{name!r}] has shape {tuple(value.shape)}, "
                                 f"expected {tuple(self.scores.shape)}")

    def to(self, device: torch.device | str) -> "RewardOutput":
        return RewardOutput(self.scores.to(device), {k: v.to(device) for k, v in self.details.items()})

    @staticmethod
    def cat(outputs: Sequence["RewardOutput"]) -> "RewardOutput":
        """Concatenate batch-wise (all outputs must have the same detail keys)."""
        scores = torch.cat([o.scores for o in outputs])
        keys = outputs[0].details.keys() if outputs else []
        return RewardOutput(scores, {k: torch.cat([o.details[k] for o in outputs]) for k in keys})


def to_image_tensor(images: Any) -> torch.Tensor:
    """Images as a ``[B, 3, H, W]`` float32 tensor in [0, 1].

    Accepts such a tensor (any float dtype, values clamped), a uint8 tensor, or a list of PIL images of
    one size. Raises :class:`RewardError` for anything else, naming what was received.
    """
    if isinstance(images, torch.Tensor):
        if images.dim() != 4 or images.shape[1] != 3:
            raise RewardError(f"images must be a [B, 3, H, W] tensor, got shape {tuple(images.shape)}")
        if images.dtype == torch.uint8:
            return images.float() / 255.0
        return images.float().clamp(0.0, 1.0)
    if isinstance(images, (list, tuple)):
        from PIL import Image

        if not images:
            return torch.zeros(0, 3, 1, 1)
        arrays = []
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise RewardError(f"images[{i}] is a {type(image).__name__}; expected a PIL image")
            arrays.append(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)
        sizes = {a.shape for a in arrays}
        if len(sizes) > 1:
            raise RewardError(f"PIL images of different sizes {sorted(sizes)}; resize them to one size "
                              "or score them in separate calls")
        return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
    raise RewardError(f"images must be a [B, 3, H, W] tensor or a list of PIL images, got {type(images).__name__}")


def to_media_tensor(images: Any) -> torch.Tensor:
    """Images as :func:`to_image_tensor` gives them, or videos ``[B, F, 3, H, W]`` (float in [0, 1] or uint8) as a
    float32 tensor in [0, 1]."""
    if isinstance(images, torch.Tensor) and images.dim() == 5:
        if images.shape[2] != 3:
            raise RewardError(f"videos must be a [B, F, 3, H, W] tensor, got shape {tuple(images.shape)}")
        if images.dtype == torch.uint8:
            return images.float() / 255.0
        return images.float().clamp(0.0, 1.0)
    return to_image_tensor(images)


def score_frames(reward: "Reward", videos: torch.Tensor, prompts: list[str], metadata: list[dict] | None,
                 reduce: str = "mean") -> RewardOutput:
    """``reward`` on every frame of ``videos [B, F, 3, H, W]`` (each frame with its video's prompt and metadata
    row), reduced per video with ``reduce`` (``"mean"`` or ``"min"`` over frames); details are frame means.
    Gradients flow through ``"mean"`` and ``"min"`` alike (for a differentiable reward)."""
    if reduce not in FRAME_REDUCTIONS:
        raise RewardError(f"frame reduction {reduce!r} unknown; valid: {', '.join(FRAME_REDUCTIONS)}")
    b, f = videos.shape[:2]
    frames = videos.reshape(b * f, *videos.shape[2:])
    rows = [i for i in range(b) for _ in range(f)]
    out = reward._score_images(frames, [prompts[i] for i in rows], [metadata[i] for i in rows] if metadata else None)
    scores = out.scores.reshape(b, f)
    scores = scores.mean(dim=1) if reduce == "mean" else scores.amin(dim=1)
    return RewardOutput(scores, {k: v.reshape(b, f).float().mean(dim=1) for k, v in out.details.items()})


def to_pil_images(images: torch.Tensor) -> list:
    """``[B, 3, H, W]`` in [0, 1] -> list of RGB PIL images (rounded to uint8)."""
    from PIL import Image

    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in array]


class Reward:
    """Base class of every reward model.

    Subclasses set the class attributes and implement :meth:`score`.

    Attributes:
        name: registry name.
        differentiable: gradients flow from scores back to the input images.
        batch_size: preferred batch size; ``__call__`` splits larger batches.
        device: where the model runs.
    """

    name: str = "reward"
    differentiable: bool = False
    batch_size: int = 32
    device: torch.device = torch.device("cpu")
    #: ``score`` takes videos ``[B, F, 3, H, W]`` itself; False: an image reward, applied to every frame.
    accepts_video: bool = False
    #: How an image reward's frame scores become a video's score (``"mean"`` or ``"min"``).
    frame_reduce: str = "mean"

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        """Score ``images [B, 3, H, W]`` in [0, 1] against ``prompts`` (length B)."""
        raise NotImplementedError

    def __call__(self, images: Any, prompts: Sequence[str], metadata: Sequence[dict] | None = None) -> RewardOutput:
        tensor = to_media_tensor(images)
        prompts = list(prompts)
        if len(prompts) != tensor.shape[0]:
            raise RewardError(f"{self.name}: got {tensor.shape[0]} images but {len(prompts)} prompts")
        if metadata is not None and len(metadata) != len(prompts):
            raise RewardError(f"{self.name}: got {len(prompts)} prompts but {len(metadata)} metadata rows")
        meta = list(metadata) if metadata is not None else None
        if tensor.dim() == 5 and not self.accepts_video:
            return score_frames(self, tensor, prompts, meta, self.frame_reduce)
        return self._score_images(tensor, prompts, meta)

    def _score_images(self, tensor: torch.Tensor, prompts: list[str], meta: list[dict] | None) -> RewardOutput:
        """:meth:`score` in batches of ``batch_size``."""
        if tensor.shape[0] <= self.batch_size:
            return self.score(tensor, prompts, meta)
        outputs = []
        for start in range(0, tensor.shape[0], self.batch_size):
            end = start + self.batch_size
            outputs.append(self.score(tensor[start:end], prompts[start:end], meta[start:end] if meta else None))
        return RewardOutput.cat(outputs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, differentiable={self.differentiable})"


def checked_reward(reward: Callable, images: torch.Tensor, prompts: list[str], metadata: list[dict]):
    """``reward(images, prompts, metadata)``, with a reward that crashes or answers the wrong shape turned into
    a one-line :class:`rewards.RewardError` that names it.

    The one place reward outputs enter a run: scores and details come back as float32 tensors on the CPU, whatever
    device the reward model runs on (PickScore, HPSv2 and CLIP built on a GPU answer on it), so advantages, the
    evaluation's gathers and the logs never mix devices.

    Raises:
        RewardError: the reward raised (its own ``RewardError`` passes through unchanged), returned something
            that is not a ``RewardOutput``, or a number of scores other than the number of images.
    """
    name = getattr(reward, "name", None) or type(reward).__name__
    try:
        out = reward(images, prompts, metadata)
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(f"the reward {name} failed: {type(err).__name__}: {' '.join(str(err).split())[:300]}") \
            from err
    if not isinstance(out, RewardOutput):
        raise RewardError(f"the reward {name} returned a {type(out).__name__}; a reward must return a RewardOutput")
    if out.scores.numel() != len(prompts):
        raise RewardError(f"the reward {name} returned {out.scores.numel()} scores for {len(prompts)} images; a "
                          "reward must return one score per image")
    # One device-to-host copy per tensor, here rather than wherever a score is read.
    return RewardOutput(out.scores.detach().float().cpu(),
                        {key: value.detach().float().cpu() for key, value in out.details.items()})
