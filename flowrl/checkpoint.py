"""Atomic, resumable checkpoints.

A checkpoint is a directory ``output_dir/checkpoints/step_<N>/`` holding ``state.pt`` (tensors and
plain Python data only, loaded with ``torch.load(weights_only=True)``) and any files a recipe adds
(e.g. a loadable model directory). It is written under a temporary name and renamed into place, and
``latest`` is rewritten atomically afterwards, so a write killed half-way never damages the last good
checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["CheckpointError", "save_checkpoint", "latest_checkpoint", "load_state", "rng_state",
           "set_rng_state"]


class CheckpointError(RuntimeError):
    """A checkpoint to resume from is missing or unreadable; the message says what to do."""


def rng_state() -> dict[str, Any]:
    """The state of every random generator a run draws from."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # Plain lists rather than numpy arrays, so that torch.load(weights_only=True) reads them back.
    numpy_state = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(output_dir: str | Path, step: int, state: dict[str, Any], *,
                    write_extra: Callable[[Path], None] | None = None, keep: int = 2) -> Path:
    """Write ``state`` (and files from ``write_extra(dir)``) as checkpoint ``step``, atomically.

    Args:
        output_dir: the run directory; checkpoints go to ``output_dir/checkpoints``.
        step: the counter that names the checkpoint (epoch or optimizer step).
        state: tensors / plain data (no arbitrary objects: they would not load with weights_only).
        write_extra: writes additional files into the (temporary) checkpoint directory.
        keep: how many newest checkpoints to keep (older ones are deleted after the new one is in place).

    Returns:
        The checkpoint directory.
    """
    root = Path(output_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    if write_extra is not None:
        write_extra(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = root / f".latest_{os.getpid()}"
    pointer.write_text(final.name)
    os.replace(pointer, root / "latest")
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    root = Path(output_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / "state.pt").is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / "state.pt").is_file())
    return complete[-1] if complete else None


def load_state(checkpoint: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load ``state.pt`` of a checkpoint directory safely (``weights_only=True``)."""
    path = Path(checkpoint) / "state.pt"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(checkpoint)!r} (expected {path}); "
                              "start without run.resume=true or point run.output_dir at the run to resume")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which and what to do
        raise CheckpointError(f"cannot read checkpoint {path}: {err}; delete that directory to resume "
                              "from the one before it") from err
