"""Frozen vision backbones for learned rewards: a global token ``[B, D]`` and patch tokens ``[B, P, D]``.

Two backbones, one interface (:class:`Backbone`):

- ``dinov2``: DINOv2 through transformers' ``Dinov2Model``, loaded offline from a local folder
  (``config.json`` + ``model.safetensors``, e.g. ``facebook/dinov2-base`` downloaded elsewhere). Images
  are resized (bicubic, the whole image, no crop) to ``image_size`` (default: the model's own, 518 for
  the released checkpoints) and normalised with the ImageNet mean and std (or those of a
  ``preprocessor_config.json`` in the folder). Global token: the final layer-normed CLS token; patch
  tokens: the final layer-normed patch tokens.
- ``shapes``: a small convolutional encoder for the 32 x 32 shapes world, shipped with flowrl in
  ``rewards/shapes_encoder/`` (``config.json`` + ``model.safetensors``, 0.2M parameters). Patch
  tokens: a 16 x 16 grid (each token sees about 10 px); global token: a linear map of the grid
  downsampled to 4 x 4. It was trained once by ``flowrl train-reward shapes-encoder --out DIR`` (see
  :func:`train_shapes_encoder`) to reconstruct the image from its patch tokens and to predict, from its
  global token, the scene's counts of each (shape, colour), a 4 x 4 map of where objects are, and the
  background colour, on random scenes of 0-5 objects with random colour casts, noise and blur. So its
  tokens carry what the shapes world's hacks change: counts, positions, colours, the background.

Both backbones end with the same token normalisation (each token divided by its root mean square), and
:meth:`Backbone.forward` is the only path from images to tokens, so a discriminator trained on these
tokens scores exactly the features it was trained on.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._loading import require_dir, require_files, resolve_device
from .base import RewardError

__all__ = ["BackboneFeatures", "Backbone", "Dinov2Backbone", "ShapesEncoder", "ShapesEncoderNet", "load_backbone",
           "rms_normalize", "SHAPES_ENCODER_DIR", "train_shapes_encoder", "DINOV2_FILES"]

SHAPES_ENCODER_DIR = Path(__file__).resolve().parent / "shapes_encoder"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DINOV2_FILES = ("config.json", "model.safetensors")


def rms_normalize(tokens: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each token divided by its root mean square over the last dimension (``[..., D]`` -> ``[..., D]``).

    Keeps the direction of a feature and fixes its scale (every token then has norm ``sqrt(D)``), so the
    discriminator head sees inputs of unit scale per element whatever the backbone.
    """
    return tokens * torch.rsqrt(tokens.float().pow(2).mean(-1, keepdim=True) + eps).to(tokens.dtype)


@dataclass
class BackboneFeatures:
    """Tokens of a batch of images.

    Attributes:
        global_token: ``[B, D]``.
        patch_tokens: ``[B, P, D]``.
    """

    global_token: torch.Tensor
    patch_tokens: torch.Tensor


class Backbone(nn.Module):
    """A frozen feature extractor. Subclasses implement :meth:`preprocess` and :meth:`tokens`.

    Attributes:
        name: ``"dinov2"`` or ``"shapes"``.
        dim: token width ``D``.
    """

    name = "backbone"
    dim: int
    image_size: int  # square input side S
    num_patches: int  # P

    def resize(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> ``[B, 3, S, S]`` in [0, 1] (a no-op when already ``S x S``).

        Reference images of other sizes are resized with this same function when they are drawn, so
        real and generated images reach the network through one resampling each.
        """
        raise NotImplementedError

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, S, S]`` in [0, 1] -> the network's input."""
        raise NotImplementedError

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, 3, H, W]`` in [0, 1] -> the network's input."""
        return self.normalize(self.resize(images))

    def tokens(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw ``(global [B, D], patches [B, P, D])`` of preprocessed input."""
        raise NotImplementedError

    def forward(self, images: torch.Tensor) -> BackboneFeatures:
        """``[B, 3, H, W]`` in [0, 1] -> normalised tokens (differentiable with respect to ``images``)."""
        device = next(self.parameters()).device
        pixels = self.preprocess(images.to(device, torch.float32))
        global_token, patch_tokens = self.tokens(pixels)
        return BackboneFeatures(rms_normalize(global_token.float()), rms_normalize(patch_tokens.float()))

    def freeze(self) -> "Backbone":
        self.eval()
        self.requires_grad_(False)
        return self

    def train(self, mode: bool = True) -> "Backbone":  # frozen: never in training mode
        return super().train(False)


# ----------------------------------------------------------------------------------------------- DINOv2


class Dinov2Backbone(Backbone):
    """DINOv2 (``transformers.Dinov2Model``) from a local folder; see the module docstring.

    Args:
        path: folder with ``config.json`` and ``model.safetensors``.
        image_size: square input side (a multiple of the patch size; default: the model's ``image_size``).
        device, dtype: where and in what precision the backbone runs (tokens are returned in float32).
    """

    name = "dinov2"

    def __init__(self, path: str | Path | None, image_size: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, reward: str = "adversarial"):
        super().__init__()
        from transformers import Dinov2Model

        fix = ("Download a DINOv2 checkpoint on a machine with internet (e.g. `huggingface-cli download "
               "facebook/dinov2-base --local-dir DIR`, which writes config.json and model.safetensors), copy DIR "
               "here and pass backbone_path=DIR.")
        if path is None:
            raise RewardError(f"{reward}: the dinov2 backbone needs backbone_path=<folder with "
                              f"{' and '.join(DINOV2_FILES)}>; nothing is downloaded. {fix}")
        folder = require_files(path, reward, "DINOv2", DINOV2_FILES, fix)
        try:
            self.model = Dinov2Model.from_pretrained(str(folder), local_files_only=True, dtype=dtype,
                                                     use_safetensors=True)
        except Exception as err:  # corrupt or foreign files: one clear error
            raise RewardError(f"{reward}: could not load DINOv2 from {str(folder)!r} ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:300]}). {fix}") from None
        config = self.model.config
        size = int(image_size or config.image_size)
        if size % config.patch_size:
            raise RewardError(f"{reward}: image_size {size} is not a multiple of DINOv2's patch size "
                              f"{config.patch_size}")
        mean, std = IMAGENET_MEAN, IMAGENET_STD
        processor_file = folder / "preprocessor_config.json"
        if processor_file.is_file():
            processor = json.loads(processor_file.read_text())
            mean = tuple(processor.get("image_mean", mean))
            std = tuple(processor.get("image_std", std))
        self.image_size = size
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.dim = int(config.hidden_size)
        self.num_patches = (size // config.patch_size) ** 2
        self.to(resolve_device(device))
        self.freeze()

    def resize(self, images: torch.Tensor) -> torch.Tensor:
        if tuple(images.shape[-2:]) == (self.image_size, self.image_size):
            return images
        size = (self.image_size, self.image_size)
        # bicubic overshoots at edges; clamp as an image library does when it rounds to uint8
        return F.interpolate(images, size=size, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return ((images - self.mean) / self.std).to(self.model.dtype)

    def tokens(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(pixel_values=pixels).last_hidden_state  # [B, 1 + P, D], layer-normed
        return hidden[:, 0], hidden[:, 1:]


# ----------------------------------------------------------------------------------------------- shapes


class ShapesEncoderNet(nn.Module):
    """The shapes encoder's network: ``[B, 3, S, S]`` normalised pixels -> ``(global [B, D], patches [B, P, D])``.

    Args:
        width: channels of the full-resolution stem.
        dim: token width ``D`` (also the channels of the patch grid).
        image_size: input side ``S`` (a multiple of 8); ``P = (S / 2)^2``.
    """

    def __init__(self, width: int = 32, dim: int = 64, image_size: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.GELU(),
                                  nn.Conv2d(width, width, 3, padding=1), nn.GELU())
        self.patch = nn.Sequential(nn.Conv2d(width, dim, 3, stride=2, padding=1), nn.GELU(),
                                   nn.Conv2d(dim, dim, 3, padding=1))  # S/2 x S/2 grid of patch tokens
        self.pool = nn.Sequential(nn.GELU(), nn.Conv2d(dim, dim, 3, stride=2, padding=1), nn.GELU(),
                                  nn.Conv2d(dim, dim, 3, stride=2, padding=1), nn.GELU())  # S/8 x S/8
        self.global_proj = nn.Linear(dim * (image_size // 8) ** 2, dim)
        self.dim = dim

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grid = self.patch(self.stem(pixels))  # [B, D, S/2, S/2]
        global_token = self.global_proj(self.pool(grid).flatten(1))  # [B, D]
        return global_token, grid.flatten(2).transpose(1, 2)  # [B, D], [B, P, D]


class ShapesEncoder(Backbone):
    """The shipped frozen encoder of the shapes world (see the module docstring).

    Images of any size are box-filtered to the encoder's ``image_size`` (32) and mapped to [-1, 1].

    Args:
        path: folder with ``config.json`` and ``model.safetensors`` (default: the shipped encoder).
        device: where it runs.
    """

    name = "shapes"

    def __init__(self, path: str | Path | None = None, device: str = "cpu", reward: str = "adversarial"):
        super().__init__()
        folder = Path(path) if path is not None else SHAPES_ENCODER_DIR
        fix = ("Rebuild it with `flowrl train-reward shapes-encoder --out DIR` and pass backbone_path=DIR (the "
               "shipped one lives in rewards/shapes_encoder/).")
        require_dir(folder, reward, "shapes encoder", fix)
        config_file, weights_file = folder / "config.json", folder / "model.safetensors"
        if not config_file.is_file() or not weights_file.is_file():
            raise RewardError(f"{reward}: shapes encoder folder {str(folder)!r} needs config.json and "
                              f"model.safetensors. {fix}")
        from safetensors.torch import load_file

        self.config = json.loads(config_file.read_text())
        self.image_size = int(self.config["image_size"])
        self.net = ShapesEncoderNet(width=int(self.config["width"]), dim=int(self.config["dim"]),
                                    image_size=self.image_size)
        try:
            self.net.load_state_dict(load_file(str(weights_file)))
        except (RuntimeError, OSError) as err:
            raise RewardError(f"{reward}: shapes encoder weights {str(weights_file)!r} do not fit its config "
                              f"({' '.join(str(err).split())[:200]}). {fix}") from None
        self.dim = self.net.dim
        self.num_patches = (self.image_size // 2) ** 2
        self.to(resolve_device(device))
        self.freeze()

    def resize(self, images: torch.Tensor) -> torch.Tensor:
        return shapes_resize(images, self.image_size)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return images * 2.0 - 1.0

    def tokens(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(pixels)


def shapes_resize(images: torch.Tensor, image_size: int) -> torch.Tensor:
    """``[B, 3, H, W]`` in [0, 1] -> ``[B, 3, S, S]``: box-filtered (area) like the shapes world's own
    renderer, which draws at 8x and box-filters down; a no-op at ``S x S``."""
    if tuple(images.shape[-2:]) == (image_size, image_size):
        return images
    return F.interpolate(images, size=(image_size, image_size), mode="area")


def load_backbone(name: str = "shapes", path: str | Path | None = None, *, image_size: int | None = None,
                  device: str = "cpu", dtype: str | torch.dtype = "float32", reward: str = "adversarial") -> Backbone:
    """The frozen backbone ``name`` (``"shapes"`` or ``"dinov2"``); errors name the files it needs."""
    from ._loading import resolve_dtype

    if name == "shapes":
        return ShapesEncoder(path, device=device, reward=reward)
    if name == "dinov2":
        return Dinov2Backbone(path, image_size=image_size, device=device, dtype=resolve_dtype(dtype), reward=reward)
    raise RewardError(f"{reward}: unknown backbone {name!r}; valid: shapes, dinov2")


# ----------------------------------------------------------------------------------------------- building


def _encoder_batch(seed: int, step: int, batch_size: int, image_size: int):
    """One training batch of the shapes encoder: images ``[B, 3, S, S]`` in [0, 1] and targets ``[B, 37]``
    (scene counts and occupancy ``[34]``, then the background colour ``[3]``)."""
    import numpy as np

    from .shapes_synth import random_scene, render_scenes, scene_targets

    images, targets = [], []
    for i in range(batch_size):
        rng = np.random.default_rng([seed, step, i])
        scene = random_scene(rng, max_objects=5, resolution=image_size)
        image = render_scenes([scene])[0]
        tint = np.ones(3, dtype=np.float32)
        if rng.uniform() < 0.4:  # a colour cast: the background becomes the tint
            tint = (1.0 - rng.uniform(0.0, 0.4) * (1.0 - rng.uniform(0.0, 1.0, size=3))).astype(np.float32)
            image = image * tint
        if rng.uniform() < 0.2:
            from scipy import ndimage

            sigma = float(rng.uniform(0.3, 1.5))
            image = ndimage.gaussian_filter(image, sigma=(sigma, sigma, 0), mode="nearest")
        if rng.uniform() < 0.2:
            image = image + rng.normal(0, rng.uniform(0.01, 0.1), size=image.shape)
        images.append(np.clip(image, 0, 1).astype(np.float32))
        targets.append(np.concatenate([scene_targets(scene), tint]))
    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    return x, torch.from_numpy(np.stack(targets).astype(np.float32))


class _Decoder(nn.Module):
    """Reconstructs the image from the patch grid (training only; not shipped)."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        self.net = nn.Sequential(nn.ConvTranspose2d(dim, width, 4, stride=2, padding=1), nn.GELU(),
                                 nn.Conv2d(width, width, 3, padding=1), nn.GELU(), nn.Conv2d(width, 3, 3, padding=1))

    def forward(self, patches: torch.Tensor, side: int) -> torch.Tensor:
        grid = patches.transpose(1, 2).reshape(patches.shape[0], patches.shape[2], side, side)
        return self.net(grid)


def train_shapes_encoder(out: str | Path, *, steps: int = 3000, batch_size: int = 64, lr: float = 2e-3,
                         seed: int = 0, width: int = 32, dim: int = 64, image_size: int = 32,
                         log=print) -> dict:
    """Train the shapes encoder and write ``out/config.json`` and ``out/model.safetensors``.

    Objective: ``mse(decoder(rms_normalize(patches)), image) + mse(head(rms_normalize(global)), targets)``,
    the targets being the scene's (shape, colour) counts, its 4 x 4 occupancy map and the background
    colour (:func:`_encoder_batch`). The decoder and the target head are discarded. Adam with a cosine
    learning-rate decay. Batch ``i`` of step ``s`` depends only on ``(seed, s, i)`` and the initial weights
    on ``seed``, so on one torch build and one thread the result is bit-for-bit reproducible.

    Returns:
        The config written (architecture, training settings, final losses, seconds).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = ShapesEncoderNet(width=width, dim=dim, image_size=image_size)
        decoder = _Decoder(dim, width)
        target_head = nn.Sequential(nn.Linear(dim, 128), nn.GELU(), nn.Linear(128, 37))
    params = list(net.parameters()) + list(decoder.parameters()) + list(target_head.parameters())
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    start = time.perf_counter()
    recon_avg = target_avg = None
    for step in range(steps):
        images, targets = _encoder_batch(seed, step, batch_size, image_size)
        global_token, patches = net(images * 2 - 1)  # ShapesEncoder.normalize
        recon = decoder(rms_normalize(patches), image_size // 2)
        recon_loss = F.mse_loss(recon, images * 2 - 1)
        target_loss = F.mse_loss(target_head(rms_normalize(global_token)), targets)
        loss = recon_loss + target_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        r, t = recon_loss.item(), target_loss.item()  # running averages for the log
        recon_avg = r if recon_avg is None else 0.98 * recon_avg + 0.02 * r
        target_avg = t if target_avg is None else 0.98 * target_avg + 0.02 * t
        if log is not None and (step % 250 == 0 or step == steps - 1):
            log(f"step {step + 1}/{steps}: reconstruction {recon_avg:.4f}, scene targets {target_avg:.4f} "
                f"({time.perf_counter() - start:.0f} s)")
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(out / "model.safetensors"))
    config = {
        "arch": "shapes_encoder", "width": width, "dim": dim, "image_size": image_size,
        "patch_grid": image_size // 2, "token_norm": "rms",
        "built_by": f"flowrl train-reward shapes-encoder --out DIR --steps {steps} --batch-size {batch_size} "
                    f"--lr {lr} --seed {seed}",
        "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed,
        "final_reconstruction_mse": round(recon_avg, 6), "final_target_mse": round(target_avg, 6),
        "seconds": round(time.perf_counter() - start, 1), "torch": torch.__version__,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config
