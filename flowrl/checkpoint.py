"""Atomic, resumable checkpoints.

A checkpoint is a directory ``output_dir/checkpoints/step_<N>/`` holding ``state.pt`` (tensors and
plain Python data only, loaded with ``torch.load(weights_only=True)``) and any files a recipe adds
(e.g. a loadable model directory). It is written under a temporary name and renamed into place, and
``latest`` is rewritten atomically afterwards, so a write killed half-way never damages the last good
checkpoint.

An online run's checkpoint (``flowrl.rl.run.OnlineRun``, docs/distributed.md) also holds
``accelerate/`` (``accelerator.save_state``: the optimizer, sharded under FSDP2 / ZeRO, the gradient scaler,
every process's random generators, and under FSDP2 / ZeRO the model's shards), written by every process
into the same temporary directory before it is renamed, and for LoRA runs of diffusers pipelines ``lora/``
(a diffusers LoRA folder, ``flowrl.export``).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["CheckpointError", "save_checkpoint", "begin_checkpoint", "finish_checkpoint", "abandon_checkpoint",
           "latest_checkpoint", "checkpoints", "load_state", "load_latest_state", "clean_stale_files", "rng_state",
           "set_rng_state", "ACCELERATE_DIR", "LORA_DIR"]

#: Sub-directory of a checkpoint written by ``accelerator.save_state`` (online runs).
ACCELERATE_DIR = "accelerate"
#: Sub-directory of a LoRA checkpoint holding the adapter as a diffusers LoRA folder.
LORA_DIR = "lora"


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


def _write_state(state: dict[str, Any], path: Path) -> None:
    torch.save(state, path)


def _write_failed(final: Path, err: OSError) -> CheckpointError:
    return CheckpointError(f"could not write checkpoint {final}: {err.strerror or err}; free space in "
                           f"{final.parent} (or point run.output_dir elsewhere) and resume from the last checkpoint "
                           "with run.resume=true")


def begin_checkpoint(output_dir: str | Path, step: int, token: str | int | None = None) -> Path:
    """Create the empty temporary directory checkpoint ``step`` is written into (the main process only;
    every process may then write into it, e.g. ``accelerator.save_state``).

    Args:
        token: makes the name unique to this writer (default: this process's id); every process of a run
            must use the main process's.

    Raises:
        CheckpointError: the directory cannot be created (e.g. the disk is full).
    """
    root = Path(output_dir) / "checkpoints"
    tmp = root / f".tmp_step_{step:07d}_{os.getpid() if token is None else token}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failed(root / f"step_{step:07d}", err) from None
    return tmp


def abandon_checkpoint(tmp: Path) -> None:
    """Remove a temporary checkpoint directory after a failed write (the previous checkpoints stay)."""
    shutil.rmtree(tmp, ignore_errors=True)


def finish_checkpoint(tmp: Path, step: int, state: dict[str, Any], *,
                      write_extra: Callable[[Path], None] | None = None, keep: int = 2) -> Path:
    """Write ``state.pt`` (and files from ``write_extra(dir)``) into ``tmp``, rename it to ``step_<N>``,
    point ``latest`` at it, and delete all but the ``keep`` newest checkpoints.

    Raises:
        CheckpointError: a write failed; ``tmp`` is removed and the previous checkpoints are untouched.
    """
    root = tmp.parent
    final = root / f"step_{step:07d}"
    try:
        _write_state(state, tmp / "state.pt")
        if write_extra is not None:
            write_extra(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".latest_{os.getpid()}"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
    except OSError as err:
        abandon_checkpoint(tmp)
        raise _write_failed(final, err) from None
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(output_dir: str | Path, step: int, state: dict[str, Any], *,
                    write_extra: Callable[[Path], None] | None = None, keep: int = 2) -> Path:
    """Write ``state`` (and files from ``write_extra(dir)``) as checkpoint ``step``, atomically, from one
    process (:func:`begin_checkpoint` + :func:`finish_checkpoint`).

    Args:
        output_dir: the run directory; checkpoints go to ``output_dir/checkpoints``.
        step: the counter that names the checkpoint (epoch or optimizer step).
        state: tensors / plain data (no arbitrary objects: they would not load with weights_only).
        write_extra: writes additional files into the (temporary) checkpoint directory.
        keep: how many newest checkpoints to keep (older ones are deleted after the new one is in place).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: the checkpoint could not be written (e.g. the disk is full); the partial copy is
            removed and the previous checkpoints are untouched.
    """
    return finish_checkpoint(begin_checkpoint(output_dir, step), step, state, write_extra=write_extra, keep=keep)


def clean_stale_files(output_dir: str | Path) -> list[Path]:
    """Remove what killed writers left behind (``.tmp_step_*`` directories, ``.latest_<pid>`` pointers).

    Call at the start of a run, before any checkpoint is written. Returns what was removed."""
    root = Path(output_dir) / "checkpoints"
    removed = []
    for path in list(root.glob(".tmp_step_*")) + list(root.glob(".latest_*")) if root.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def checkpoints(output_dir: str | Path) -> list[Path]:
    """A run's complete checkpoint directories, newest first (the ``latest`` pointer's first)."""
    root = Path(output_dir) / "checkpoints"
    complete = sorted((p for p in root.glob("step_*") if (p / "state.pt").is_file()), reverse=True)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in complete:
            complete.remove(named)
            complete.insert(0, named)
    return complete


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory of a run, or None."""
    found = checkpoints(output_dir)
    return found[0] if found else None


def load_state(checkpoint: str | Path, map_location: str | torch.device = "cpu",
               required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load ``state.pt`` of a checkpoint directory safely (``weights_only=True``).

    Raises:
        CheckpointError: no such file, a file torch cannot read (truncated, empty, foreign), or a state that
            lacks one of the ``required`` keys.
    """
    path = Path(checkpoint) / "state.pt"
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(checkpoint)!r} (expected {path}); "
                              "start without run.resume=true or point run.output_dir at the run to resume")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # a truncated or foreign file: say which and what to do
        raise CheckpointError(f"cannot read checkpoint {path}: {' '.join(str(err).split())[:200]}; delete that "
                              "directory to resume from the one before it") from err
    missing = [key for key in required if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (no {', '.join(missing)}); delete that directory "
                              "to resume from the one before it")
    return state


def load_latest_state(output_dir: str | Path, required: tuple[str, ...] = (), *,
                      warn: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that loads and has every ``required`` key; a corrupt newer one is skipped
    with a warning naming it (``warn``).

    Raises:
        CheckpointError: no checkpoint, or none that loads (the message names each and why).
    """
    problems = []
    for checkpoint in checkpoints(output_dir):
        try:
            state = load_state(checkpoint, required=required)
        except CheckpointError as err:
            problems.append(str(err).split("; delete")[0])
            continue
        for problem in problems:
            warn(f"flowrl: warning: {problem}; resuming from {checkpoint} instead")
        return checkpoint, state
    if problems:
        raise CheckpointError("no checkpoint of " + str(output_dir) + " can be read: " + "; ".join(problems)
                              + "; start the run again without run.resume=true")
    raise CheckpointError(f"run.resume=true but {output_dir}/checkpoints holds no checkpoint; run without "
                          "run.resume=true to start fresh")
