"""Atomic, resumable checkpoints.

A checkpoint is a directory ``output_dir/checkpoints/<unit>_<N>/``, named by what its number counts:
``epoch_<N>`` after N epochs, ``step_<N>`` after N optimizer steps (pretraining and SFT, whose epochs are a
logging period of many steps). It holds ``state.pt`` (tensors and plain Python data only, loaded with
``torch.load(weights_only=True)``) and any files a recipe adds (e.g. a loadable model directory). It is
written under a temporary name, its files are flushed to disk (``fsync``) and it is renamed into place;
``latest`` is rewritten atomically afterwards, so a write killed half-way (or a power cut) never damages the
last good checkpoint. Rotation orders checkpoints by their number, never by name, and never removes the one
just written; a checkpoint found corrupt at resume is set aside (``corrupt_<name>``), not kept among the newest.
Runs written before the ``epoch_`` names (their ``step_<N>`` counted epochs) still resume.

A run's checkpoint (``flowrl.run.harness.Run``, docs/distributed.md) also holds
``accelerate/`` (``accelerator.save_state``: the optimizer, sharded under FSDP2 / ZeRO, the gradient scaler,
every process's random generators, and under FSDP2 / ZeRO the model's shards), written by every process
into the same temporary directory before it is renamed, and for LoRA runs of diffusers pipelines ``lora/``
(a diffusers LoRA folder, ``flowrl.commands.export``).
"""

from __future__ import annotations

from flowrl.errors import FlowrlError

import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["CheckpointError", "save_checkpoint", "begin_checkpoint", "finish_checkpoint", "abandon_checkpoint",
           "latest_checkpoint", "checkpoints", "load_state", "load_latest_state", "clean_stale_files", "rng_state",
           "set_rng_state", "ACCELERATE_DIR", "LORA_DIR", "checkpoint_name", "checkpoint_number", "set_aside"]

#: Sub-directory of a checkpoint written by ``accelerator.save_state`` (online runs).
ACCELERATE_DIR = "accelerate"
#: Sub-directory of a LoRA checkpoint holding the adapter as a diffusers LoRA folder.
LORA_DIR = "lora"


#: The names a checkpoint directory may have: ``<unit>_<number>``.
UNITS = ("epoch", "step")


def checkpoint_name(step: int, unit: str = "epoch") -> str:
    """``epoch_0000012`` / ``step_0000750``: the directory name of checkpoint ``step`` counted in ``unit``."""
    return f"{unit}_{step:07d}"


def checkpoint_number(path: str | Path) -> int | None:
    """The number of a checkpoint directory name (None for anything else)."""
    unit, _, number = Path(path).name.partition("_")
    return int(number) if unit in UNITS and number.isdigit() else None


def _numbered(root: Path) -> list[Path]:
    """Checkpoint directories of ``root``, oldest first by their number (not by name)."""
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_number(p) is not None] if root.is_dir() else []
    return sorted(found, key=lambda p: (checkpoint_number(p), p.name))


def _fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and the folders themselves to disk."""
    for path in sorted(folder.rglob("*")) + [folder]:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass  # a file system without fsync on directories
        finally:
            os.close(fd)


def set_aside(checkpoint: Path) -> Path | None:
    """Rename a corrupt checkpoint to ``corrupt_<name>`` (kept for inspection, out of resume and rotation)."""
    target = checkpoint.with_name(f"corrupt_{checkpoint.name}")
    try:
        if target.exists():
            shutil.rmtree(target)
        os.replace(checkpoint, target)
        return target
    except OSError:
        return None


class CheckpointError(FlowrlError, RuntimeError):
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


def begin_checkpoint(output_dir: str | Path, step: int, token: str | int | None = None, unit: str = "epoch") -> Path:
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
        raise _write_failed(root / checkpoint_name(step, unit), err) from None
    return tmp


def abandon_checkpoint(tmp: Path) -> None:
    """Remove a temporary checkpoint directory after a failed write (the previous checkpoints stay)."""
    shutil.rmtree(tmp, ignore_errors=True)


def finish_checkpoint(tmp: Path, step: int, state: dict[str, Any], *,
                      write_extra: Callable[[Path], None] | None = None, keep: int = 2, unit: str = "epoch") -> Path:
    """Write ``state.pt`` (and files from ``write_extra(dir)``) into ``tmp``, flush it to disk, rename it to
    ``<unit>_<N>``, point ``latest`` at it, and delete all but the ``keep`` newest checkpoints (by number;
    the one just written always stays).

    Raises:
        CheckpointError: a write failed; ``tmp`` is removed and the previous checkpoints are untouched.
    """
    root = tmp.parent
    final = root / checkpoint_name(step, unit)
    try:
        _write_state(state, tmp / "state.pt")
        if write_extra is not None:
            write_extra(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f".latest_{os.getpid()}"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        _fsync_dir(root)
    except OSError as err:
        abandon_checkpoint(tmp)
        raise _write_failed(final, err) from None
    others = [p for p in _numbered(root) if p != final]
    for old in others[: max(len(others) - (keep - 1), 0)] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(folder: Path) -> None:
    """Flush a directory's entries (the renames into it) to disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(output_dir: str | Path, step: int, state: dict[str, Any], *,
                    write_extra: Callable[[Path], None] | None = None, keep: int = 2, unit: str = "epoch") -> Path:
    """Write ``state`` (and files from ``write_extra(dir)``) as checkpoint ``step``, atomically, from one
    process (:func:`begin_checkpoint` + :func:`finish_checkpoint`).

    Args:
        output_dir: the run directory; checkpoints go to ``output_dir/checkpoints``.
        step: the counter that names the checkpoint (``unit``: epoch or optimizer step).
        state: tensors / plain data (no arbitrary objects: they would not load with weights_only).
        write_extra: writes additional files into the (temporary) checkpoint directory.
        keep: how many newest checkpoints to keep (older ones are deleted after the new one is in place).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: the checkpoint could not be written (e.g. the disk is full); the partial copy is
            removed and the previous checkpoints are untouched.
    """
    return finish_checkpoint(begin_checkpoint(output_dir, step, unit=unit), step, state, write_extra=write_extra,
                             keep=keep, unit=unit)


def clean_stale_files(output_dir: str | Path) -> list[Path]:
    """Remove what killed writers left behind (``.tmp_step_*`` / ``.tmp_best_*`` directories, ``.latest_<pid>``
    pointers).

    Call at the start of a run, before any checkpoint is written. Returns what was removed."""
    root = Path(output_dir) / "checkpoints"
    removed = []
    stale = [".tmp_step_*", ".latest_*", ".tmp_best_*", ".old_best_*"]
    for path in [p for pattern in stale for p in root.glob(pattern)] if root.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def checkpoints(output_dir: str | Path) -> list[Path]:
    """A run's complete checkpoint directories, newest first (the ``latest`` pointer's first)."""
    root = Path(output_dir) / "checkpoints"
    complete = [p for p in reversed(_numbered(root)) if (p / "state.pt").is_file()]
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
