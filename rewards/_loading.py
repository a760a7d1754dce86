"""Shared helpers for loading reward-model weights from a local path or a hub id.

Every loader turns the libraries' errors (hub connection errors, missing files, bad checkpoints) into
one :class:`~rewards.base.RewardError` that names the files needed and where to put them. Nothing
global is set: no environment variables, no library-wide config.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from .base import RewardError

__all__ = ["looks_like_path", "require_file", "require_dir", "load_errors", "load_state_dict_file",
           "resolve_device", "resolve_dtype", "auto_precision", "OFFLINE_HINT", "refuse_pickle_only"]

OFFLINE_HINT = ("Without internet, download the files elsewhere and pass their local path, or pre-fill the "
                "Hugging Face cache (HF_HOME) and set HF_HUB_OFFLINE=1 so hub look-ups fail fast.")


def looks_like_path(value: str | os.PathLike | None) -> bool:
    """True for strings that are meant as file-system paths rather than hub ids or tags."""
    if value is None:
        return False
    text = str(value)
    return (os.path.isabs(text) or text.startswith((".", "~")) or os.path.exists(os.path.expanduser(text))
            or text.endswith((".pt", ".pth", ".bin", ".safetensors", ".ckpt")))


def require_file(path: str | os.PathLike, reward: str, what: str, fix: str) -> Path:
    """Return ``path`` as a Path, or raise the reward's clear missing-file error."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        raise RewardError(f"{reward}: {what} not found at {str(p)!r}. {fix}")
    return p


def require_dir(path: str | os.PathLike, reward: str, what: str, fix: str) -> Path:
    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        raise RewardError(f"{reward}: {what} directory not found at {str(p)!r}. {fix}")
    return p


def require_files(path: str | os.PathLike, reward: str, what: str, files: tuple[str, ...], fix: str) -> Path:
    """The folder ``path`` (:func:`require_dir`) when it holds every one of ``files``; otherwise a RewardError naming
    the missing files, the expected ones and ``fix``."""
    folder = require_dir(path, reward, what, fix)
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        raise RewardError(f"{reward}: {what} folder {str(folder)!r} lacks {', '.join(missing)} (expected "
                          f"{' and '.join(files)}). {fix}")
    return folder


def refuse_pickle_only(path: str | os.PathLike, reward: str, library: str, class_name: str) -> None:
    """A local model folder whose weights are only pickles (``pytorch_model.bin``) is a RewardError naming
    the conversion: transformers loads them with ``use_safetensors=True`` only, as unpickling can run code."""
    from flowrl.untrusted import pickle_only_weights, safetensors_conversion

    folder = Path(os.path.expanduser(str(path)))
    pickles = pickle_only_weights(folder)
    if pickles:
        raise RewardError(f"{reward}: {str(folder)!r} holds only pickled weights ({', '.join(pickles)}), which can "
                          f"run code when loaded; flowrl reads safetensors only: "
                          f"{safetensors_conversion(folder, library, class_name)}")


@contextmanager
def load_errors(reward: str, what: str, fix: str) -> Iterator[None]:
    """Re-raise any loading failure (hub, OS, bad checkpoint) as one RewardError saying ``fix``."""
    try:
        yield
    except RewardError:
        raise
    except Exception as err:  # hub/OS/format errors of many libraries: all mean "cannot load"
        detail = " ".join(str(err).split())
        if len(detail) > 300:
            detail = detail[:297] + "..."
        raise RewardError(f"{reward}: could not load {what} ({type(err).__name__}: {detail}). {fix}") from err


def load_state_dict_file(path: str | os.PathLike, reward: str, fix: str) -> dict[str, torch.Tensor]:
    """Load a tensor state dict from ``.safetensors`` or a torch file with ``weights_only=True``.

    A checkpoint holding ``{"state_dict": ...}`` is unwrapped, and DistributedDataParallel's
    ``module.`` prefixes are stripped.
    """
    p = require_file(path, reward, "checkpoint", fix)
    with load_errors(reward, f"checkpoint {str(p)!r}", fix + " (The file must be .safetensors or a torch file "
                     "loadable with torch.load(weights_only=True); convert pickled checkpoints once with "
                     "safetensors.torch.save_file.)"):
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(str(p), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RewardError(f"{reward}: checkpoint {str(p)!r} does not hold a state dict of tensors. {fix}")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise RewardError(f"invalid device {device!r}: {err}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RewardError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def auto_precision(device: torch.device) -> str:
    """The ``"auto"`` precision of the CLIP-based rewards (pickscore, hpsv2, clip_score): ``"bf16"`` on a CUDA device,
    ``"fp32"`` elsewhere (a CPU's bfloat16 is emulated or slow, and CPU scores are the recorded ones).

    Half precision is what these models' authors run or trained them in: PickScore was trained under bf16 mixed
    precision (its repository's ``trainer/conf/experiment/clip.yaml``: ``mixed_precision: BF16``, DeepSpeed's bf16
    mode); HPSv2's own scoring (``score.py``, ``hpsv2.img_score``) runs under ``precision='amp'`` and
    ``torch.cuda.amp.autocast()``; OpenAI's ``clip.load`` keeps CLIP's float16 weights on CUDA (float32 only on the
    CPU). A ViT-H-14 in bf16 takes 2 GB instead of 4 GB per copy, and a run holds a training and an evaluation copy
    on every GPU. Scores move by bf16 rounding (about 1e-3 of a cosine); pass ``dtype`` / ``precision`` explicitly
    (``float32`` / ``fp32``) to reproduce float32 numbers, e.g. Flow-GRPO's PickScore, which it scores in float32.
    """
    return "bf16" if device.type == "cuda" else "fp32"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A torch dtype from a name (``"float32"``, ``"bf16"``, ...), a dtype, or ``"auto"`` (:func:`auto_precision` on
    ``device``; the CPU when None)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = auto_precision(device if device is not None else torch.device("cpu"))
    if dtype not in _DTYPES:
        raise RewardError(f"invalid dtype {dtype!r}; valid: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]
