"""``artifact``: does the image have visual artifacts? Reward ``1 - P(artifact)``, in [0, 1].

Two modes, chosen by the arguments:

- **VLM judge** (``model=PATH`` or ``endpoint=URL``, plus any :class:`rewards.vlm_judge.VLMJudge`
  argument): the judge is asked :data:`ARTIFACT_QUESTION` in yes/no mode and the reward is
  ``1 - P(yes)``. Details: ``artifact/p_artifact`` and the judge's ``parsed``/``from_logprobs`` flags.
- **Trained classifier** (``path=DIR`` with ``config.json`` + ``model.safetensors``, written by
  ``flowrl train-reward artifact``): a small CNN on images resized to its ``image_size``, one logit for
  "artifact"; the reward is ``1 - sigmoid(logit)``. Details: ``artifact/p_artifact``.

Training (:func:`train_artifact_classifier`): binary cross-entropy, Adam with a cosine decay, random
horizontal flips; a held-out split (a fraction of the given images, or a fresh synthetic set) reports the
accuracy at threshold 0.5, overall and per artifact kind. Data: ``--clean`` / ``--artifact`` image folders
or webdataset shards, or ``--synthetic shapes`` (``rewards.shapes_synth``: blotches, broken edges, stray
fragments, colour cast, noise and blur on rendered scenes of the shapes world).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._loading import require_files, resolve_device
from .base import Reward, RewardError, RewardOutput

__all__ = ["ArtifactReward", "ArtifactClassifier", "ARTIFACT_QUESTION", "train_artifact_classifier",
           "load_classifier", "save_classifier", "images_from"]

ARTIFACT_QUESTION = ("Does this image have visual artifacts, such as blotches, smudges, noise, blur, broken or "
                     "distorted shapes, stray fragments or an unnatural colour cast? Answer yes or no.")
CLASSIFIER_FILES = ("config.json", "model.safetensors")


class ArtifactClassifier(nn.Module):
    """``[B, 3, S, S]`` in [0, 1] -> ``[B]`` artifact logits.

    Five 3x3 convolutions with batch normalisation and GELU (two at full resolution, two at half, one at
    a quarter), then the mean and the max over positions of the last feature map, then a linear layer. The max
    keeps small local artifacts (a speck, a bite out of an edge) from being averaged away.

    Args:
        image_size: input side ``S`` (images of other sizes are resized, bilinear with antialiasing).
        width: channels of the first stage (doubled in the later ones).
    """

    def __init__(self, image_size: int = 32, width: int = 32):
        super().__init__()
        self.image_size, self.width = int(image_size), int(width)
        w = self.width

        def block(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.GELU()]

        self.features = nn.Sequential(*block(3, w), *block(w, w), *block(w, 2 * w, 2), *block(2 * w, 2 * w),
                                      *block(2 * w, 2 * w, 2))
        self.out = nn.Linear(4 * w, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if tuple(images.shape[-2:]) != (self.image_size, self.image_size):
            images = F.interpolate(images, size=(self.image_size, self.image_size), mode="bilinear",
                                   align_corners=False, antialias=True)
        h = self.features(images * 2.0 - 1.0).flatten(2)  # [B, C, N]
        return self.out(torch.cat([h.mean(-1), h.amax(-1)], dim=1)).squeeze(-1)


def save_classifier(model: ArtifactClassifier, out: str | Path, info: dict[str, Any]) -> Path:
    """Write ``out/model.safetensors`` and ``out/config.json`` (architecture plus ``info``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    config = {"arch": "artifact_cnn", "image_size": model.image_size, "width": model.width, **info}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def load_classifier(path: str | Path, reward: str = "artifact") -> tuple[ArtifactClassifier, dict]:
    """The classifier saved in ``path`` and its config."""
    fix = ("Train one with `flowrl train-reward artifact --synthetic shapes --out DIR` (or --clean/--artifact "
           "image folders) and pass path=DIR.")
    folder = require_files(path, reward, "artifact classifier", CLASSIFIER_FILES, fix)
    try:
        config = json.loads((folder / "config.json").read_text())
        if config.get("arch") != "artifact_cnn":
            raise ValueError(f"arch is {config.get('arch')!r}, expected 'artifact_cnn'")
        model = ArtifactClassifier(int(config["image_size"]), int(config["width"]))
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(folder / "model.safetensors")))
    except (ValueError, KeyError, RuntimeError, OSError) as err:
        raise RewardError(f"{reward}: could not load the classifier in {str(folder)!r} ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:200]}). {fix}") from None
    return model.eval().requires_grad_(False), config


class ArtifactReward(Reward):
    """``1 - P(artifact)`` from a trained classifier (``path=``) or a VLM judge (``model=`` / ``endpoint=``).

    Args:
        path: folder of a classifier written by ``flowrl train-reward artifact``.
        model, endpoint: a local VLM folder or an OpenAI-compatible URL (judge mode).
        question: the judge's yes/no question (default :data:`ARTIFACT_QUESTION`; ``{prompt}`` is filled in).
        device: where the classifier or local VLM runs.
        batch_size: images per call.
        **judge_kwargs: other :class:`rewards.vlm_judge.VLMJudge` arguments (``api_model``, ``timeout``, ...).
    """

    name = "artifact"

    def __init__(self, path: str | None = None, model: str | None = None, endpoint: str | None = None,
                 question: str = ARTIFACT_QUESTION, device: str = "cpu", batch_size: int = 64, **judge_kwargs):
        given = [name for name, value in (("path", path), ("model", model), ("endpoint", endpoint))
                 if value is not None]
        if len(given) != 1:
            raise RewardError("artifact: pass exactly one of path=<trained classifier folder> (flowrl train-reward "
                              "artifact), model=<local VLM folder> or endpoint=<OpenAI-compatible URL>"
                              + (f"; got {', '.join(given)}" if given else ""))
        self.batch_size = int(batch_size)
        self.judge = None
        if path is not None:
            if judge_kwargs:
                raise RewardError(f"artifact: {', '.join(sorted(judge_kwargs))} apply to the VLM judge, not to a "
                                  "trained classifier (path=)")
            self.device = resolve_device(device)
            self.classifier, self.config = load_classifier(path, self.name)
            self.classifier.to(self.device)
            self.differentiable = True
        else:
            from .vlm_judge import VLMJudge

            if "mode" in judge_kwargs and judge_kwargs["mode"] != "yes_no":
                raise RewardError("artifact: the judge runs in yes_no mode (reward 1 - P(yes))")
            judge_kwargs.pop("mode", None)
            self.judge = VLMJudge(model=model, endpoint=endpoint, mode="yes_no", question=question, device=device,
                                  batch_size=batch_size, **judge_kwargs)
            self.device = self.judge.device
            self.differentiable = False

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        if self.judge is not None:
            out = self.judge(images, prompts, metadata)
            p_artifact = out.scores
            details = {f"{self.name}/p_artifact": p_artifact,
                       **{f"{self.name}/{k.split('/', 1)[-1]}": v for k, v in out.details.items()}}
            return RewardOutput(1.0 - p_artifact, details)
        context = torch.enable_grad() if images.requires_grad else torch.no_grad()
        with context:
            p_artifact = torch.sigmoid(self.classifier(images.to(self.device, torch.float32)))
        return RewardOutput(1.0 - p_artifact, {f"{self.name}/p_artifact": p_artifact.detach()})


# ----------------------------------------------------------------------------------------------- training


def images_from(spec: str, image_size: int, max_images: int = 100_000) -> torch.Tensor:
    """Images of a folder (``.png/.jpg/.jpeg/.webp``) or of webdataset shards, resized (bilinear, antialiased)
    to ``image_size`` x ``image_size``: ``[N, 3, S, S]`` float32 in [0, 1]."""
    import numpy as np

    from flowrl.untrusted import open_image

    from .adversarial_refs import IMAGE_SUFFIXES

    path = Path(spec).expanduser()
    blobs: list[bytes] = []
    if path.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.iterdir()):
        blobs = [p.read_bytes() for p in sorted(path.absolute().iterdir())
                 if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()][:max_images]
    else:
        from flowrl.data.webdataset_io import IMAGE_KEYS, ShardError, iter_raw_samples, shard_paths

        try:
            for _, _, entries in iter_raw_samples(shard_paths(spec)):
                key = next((k for k in IMAGE_KEYS if k in entries), None)
                if key is not None:
                    blobs.append(entries[key])
                if len(blobs) >= max_images:
                    break
        except ShardError as err:
            raise RewardError(f"artifact: {spec!r} is neither a folder of images nor readable shards ({err})") from None
    if not blobs:
        raise RewardError(f"artifact: no images in {spec!r}")
    out = []
    for index, blob in enumerate(blobs):
        try:
            with open_image(blob) as image:
                image = image.convert("RGB")
        except (OSError, ValueError) as err:
            raise RewardError(f"artifact: image {index} of {spec!r} is unreadable: {err}") from None
        tensor = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
        out.append(F.interpolate(tensor, size=(image_size, image_size), mode="bilinear", align_corners=False,
                                 antialias=True).clamp(0, 1))
    return torch.cat(out)


def _accuracy_by_kind(logits: torch.Tensor, labels: torch.Tensor, kinds: list[str]) -> dict[str, float]:
    correct = ((logits > 0).float() == labels).float()
    out = {"overall": float(correct.mean())}
    for kind in sorted(set(kinds)):
        mask = torch.tensor([k == kind for k in kinds])
        out[kind] = float(correct[mask].mean())
    return out


@torch.no_grad()
def _logits(model: nn.Module, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    model.eval()
    return torch.cat([model(images[i:i + batch_size]) for i in range(0, images.shape[0], batch_size)])


def train_artifact_classifier(train: tuple[torch.Tensor, torch.Tensor], heldout: tuple[torch.Tensor, torch.Tensor],
                              *, heldout_kinds: list[str] | None = None, image_size: int = 32, width: int = 32,
                              steps: int = 600, batch_size: int = 64, lr: float = 2e-3, seed: int = 0,
                              log: Callable[[str], None] | None = print) -> tuple[ArtifactClassifier, dict]:
    """Train the classifier on ``train = (images [N, 3, H, W] in [0, 1], labels [N] with 1 = artifact)``.

    Minibatches are drawn with a generator seeded by ``seed`` (as are the initial weights); each image is
    flipped horizontally with probability 1/2.

    Returns:
        The model (eval mode) and a report: ``heldout_accuracy`` (threshold 0.5), per-kind accuracies when
        ``heldout_kinds`` is given, ``train_accuracy``, sizes, steps and seconds.
    """
    images, labels = train
    if images.shape[0] != labels.shape[0] or images.shape[0] < 2:
        raise RewardError(f"artifact: need at least 2 training images with one label each, got {images.shape[0]} "
                          f"images and {labels.shape[0]} labels")
    if not (labels.min() == 0 and labels.max() == 1):
        raise RewardError("artifact: the training set needs both clean (0) and artifact (1) images")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ArtifactClassifier(image_size, width)
    generator = torch.Generator().manual_seed(seed)
    if tuple(images.shape[-2:]) != (image_size, image_size):
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False,
                               antialias=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    # Balance the classes whatever their counts: positives weighted by n_clean / n_artifact.
    pos_weight = (labels == 0).sum().float() / (labels == 1).sum().float()
    start = time.perf_counter()
    running = None
    model.train()
    for step in range(steps):
        index = torch.randint(0, images.shape[0], (batch_size,), generator=generator)
        x, y = images[index], labels[index].float()
        flip = torch.rand(batch_size, generator=generator) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        loss = F.binary_cross_entropy_with_logits(model(x), y, pos_weight=pos_weight)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if log is not None and (step % 100 == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps}: loss {running:.4f} ({time.perf_counter() - start:.0f} s)")
    model.eval()
    held_images, held_labels = heldout
    held_logits = _logits(model, held_images)
    report: dict[str, Any] = {
        "heldout_accuracy": float(((held_logits > 0).float() == held_labels).float().mean()),
        "train_accuracy": float(((_logits(model, images) > 0).float() == labels).float().mean()),
        "n_train": int(images.shape[0]), "n_heldout": int(held_images.shape[0]), "steps": steps,
        "batch_size": batch_size, "lr": lr, "seed": seed, "seconds": round(time.perf_counter() - start, 1),
    }
    if heldout_kinds is not None:
        report["heldout_accuracy_by_kind"] = _accuracy_by_kind(held_logits, held_labels, heldout_kinds)
    return model, report
