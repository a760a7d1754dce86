"""``hpsv2``: Human Preference Score v2 / v2.1 (Wu et al. 2023).

An open_clip ViT-H-14 whose weights are replaced by the HPS checkpoint (``HPS_v2.1_compressed.pt`` or
``HPS_v2_compressed.pt``, a ``{"state_dict": ...}`` of tensors, loaded with ``weights_only=True``; a
``.safetensors`` file works too). The score follows the reference implementation
(``hpsv2.img_score``): the cosine of the L2-normalised image and text features, *without* CLIP's
logit scale, so typical values are 0.2-0.35. Unlike the reference, the ViT-H-14 architecture is built
without first downloading the LAION weights that the checkpoint overwrites anyway.

Precision: ``precision="auto"`` (the default) runs the model in bfloat16 on CUDA and float32 elsewhere
(:func:`rewards._loading.auto_precision`: the reference scoring itself runs under half-precision autocast);
``precision="fp32"`` gives float32 scores.
"""

from __future__ import annotations

import torch

from ._loading import OFFLINE_HINT, auto_precision, load_errors, load_state_dict_file, looks_like_path, resolve_device
from ._open_clip import OpenClipReward, load_open_clip
from .base import RewardError, RewardOutput

__all__ = ["HPSv2"]

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2.1": "HPS_v2.1_compressed.pt", "v2.0": "HPS_v2_compressed.pt"}


class HPSv2(OpenClipReward):
    """HPS v2.x preference score.

    Args:
        checkpoint: path to ``HPS_v2.1_compressed.pt`` (or ``.safetensors``); ``None`` fetches
            ``HPS_FILES[version]`` from the hub repo ``xswu/HPSv2`` (or its cached copy).
        version: ``"v2.1"`` (default) or ``"v2.0"``, used only when ``checkpoint`` is ``None``.
        model_name: open_clip architecture the checkpoint belongs to (``"ViT-H-14"``); tests pass a tiny
            ``local-dir:`` config here.
        local_files_only: with ``checkpoint=None``, only look in the hub cache (no network).
        device, precision, batch_size, cache_dir: as for :class:`~rewards.clip_score.ClipScore` (``precision``
            ``"auto"``: bf16 on CUDA, fp32 elsewhere).
    """

    name = "hpsv2"

    def __init__(self, checkpoint: str | None = None, version: str = "v2.1", model_name: str = "ViT-H-14",
                 device: str = "cpu", precision: str = "auto", batch_size: int = 32, cache_dir: str | None = None,
                 local_files_only: bool = False):
        if version not in HPS_FILES:
            raise RewardError(f"hpsv2: version must be one of {', '.join(HPS_FILES)}, got {version!r}")
        self.batch_size = int(batch_size)
        dev = resolve_device(device)
        precision = auto_precision(dev) if precision == "auto" else precision
        filename = HPS_FILES[version]
        fix = (f"Download {filename} (hub repo {HPS_REPO}) and pass checkpoint=/path/to/{filename}.")
        if checkpoint is None:
            with load_errors(self.name, f"{filename} from the hub repo {HPS_REPO}", f"{fix} {OFFLINE_HINT}"):
                from huggingface_hub import hf_hub_download

                checkpoint = hf_hub_download(HPS_REPO, filename, cache_dir=cache_dir,
                                             local_files_only=local_files_only)
        elif not looks_like_path(checkpoint):
            raise RewardError(f"hpsv2: checkpoint {checkpoint!r} is not a file path. {fix}")
        state = load_state_dict_file(checkpoint, self.name, fix)  # checks the file before building the model
        model, tokenizer = load_open_clip(self.name, model_name, None, device=dev, precision=precision,
                                          cache_dir=cache_dir, require_weights=False, fix=fix)
        with load_errors(self.name, f"checkpoint {str(checkpoint)!r} into {model_name}", fix):
            model.load_state_dict(state, strict=True)
        model.eval().requires_grad_(False)
        self._setup(model, tokenizer, dev)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> RewardOutput:
        with self.grad_context(images):
            scores = (self.encode_images(images) * self.encode_texts(prompts)).sum(-1)
        return RewardOutput(scores, {})
