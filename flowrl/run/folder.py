"""The run folder contract every recipe shares (``run.output_dir``).

- **Guard.** A folder that holds a run (its config, metrics or checkpoints) is an error unless ``run.resume``
  (continue it) or ``run.overwrite`` (start over). A fresh run never appends to, or replaces, someone's files.
- **Marker.** flowrl writes ``.flowrl_run`` (JSON: recipe, creation time) into every run folder it creates.
  ``run.overwrite`` removes only the files a run writes (:data:`RUN_FILES`), and only in a folder with that
  marker: a folder flowrl did not create is never emptied.
- **Lock.** The main process holds an exclusive ``fcntl`` lock on ``.flowrl_lock`` for the whole run, so two
  jobs on one folder (a scheduler's requeue while the first still runs) cannot interleave their checkpoints
  and metrics: the second stops with an error naming the holder (host and process id).

Every process checks (so all raise the same error); only the main process changes the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

__all__ = ["RUN_FILES", "MARKER", "LOCK", "RunLock", "check_output_dir", "prepare_output_dir", "holds_run"]

#: What a run writes into its folder (and what ``run.overwrite`` removes).
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "plots", "samples", "tensorboard", "wandb", "error.log",
             "model")
MARKER = ".flowrl_run"
LOCK = ".flowrl_lock"


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds a run: a config, metrics or checkpoints."""
    return out.is_dir() and any((out / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


class RunLock:
    """An exclusive, advisory lock on ``<run folder>/.flowrl_lock`` held while the run lives.

    The lock is the operating system's (``fcntl.flock``): it disappears with the process, so a killed run
    never leaves a stale lock behind; the file keeps the holder's host and process id for the message.
    """

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK
        self._fd: int | None = None

    def acquire(self) -> None:
        """Raises:
            ConfigError: another process holds the lock (the message names it)."""
        import fcntl

        from flowrl.config import ConfigError

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            try:
                holder = os.read(fd, 512).decode("utf-8", "replace").strip() or "another process"
            finally:
                os.close(fd)
            raise ConfigError("run.output_dir", f"{self.path.parent} is in use by {holder}; wait for that run to "
                              "end (or stop it), or choose another run.output_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                 .encode())
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _write_marker(out: Path, recipe: str) -> None:
    marker = out / MARKER
    if not marker.is_file():
        tmp = out / f".{MARKER}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"recipe": recipe, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        os.replace(tmp, marker)


def check_output_dir(run) -> None:
    """Refuse a ``run.output_dir`` the run could not claim, touching nothing: a run checks this before its model
    loads and claims the folder (:func:`prepare_output_dir`) only once it can start, so a run that fails to start
    (a mistyped model path, no GPU) leaves nothing behind that blocks the corrected command.

    Raises:
        ConfigError / CheckpointError: as :func:`prepare_output_dir`, for the same causes it can see without writing.
    """
    from flowrl.config import ConfigError

    out = Path(run.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("run.output_dir", f"{out} is a file, not a folder; choose another run.output_dir")
    existing = next(p for p in (out, *out.parents) if p.exists())  # the folder the run would be created in
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "Not a directory" if not existing.is_dir() else "Permission denied"
        raise ConfigError("run.output_dir", f"cannot write to {out}: {why}; choose a writable run.output_dir")
    has_run = holds_run(out)
    if has_run and not run.resume and not run.overwrite:
        raise ConfigError("run.output_dir", f"{out} holds an earlier run; continue it with run.resume=true, start "
                          "over with run.overwrite=true (deletes its metrics and checkpoints), or choose another "
                          "run.output_dir")
    if has_run and run.overwrite and not (out / MARKER).is_file():
        raise ConfigError("run.output_dir", f"run.overwrite=true, but {out} was not created by flowrl (it has no "
                          f"{MARKER} marker), so nothing in it is deleted; delete its files yourself or choose "
                          "another run.output_dir")
    if run.resume:
        from flowrl.run.checkpoint_files import CheckpointError, checkpoints

        if not checkpoints(out):  # say so before a model loads
            raise CheckpointError(f"run.resume=true but {out}/checkpoints holds no checkpoint; run without "
                                  "run.resume=true to start fresh")


def prepare_output_dir(run, dist, recipe: str = "run") -> tuple[Path, RunLock | None]:
    """Create ``run.output_dir`` for a fresh run, a resume or an overwrite (``run`` is a RunConfig), lock it,
    and return ``(folder, lock)`` (the lock: main process only; release it when the run ends).

    Stale temporary files of killed checkpoint writers are removed.

    Raises:
        ConfigError: the folder is a file, cannot be created or written, holds a run nobody asked to resume
            or overwrite, is an overwrite target flowrl did not create, or is locked by another run.
        CheckpointError: ``run.resume`` with no checkpoint to resume from.
    """
    from flowrl.run.checkpoint_files import clean_stale_files
    from flowrl.config import ConfigError

    out = Path(run.output_dir)
    check_output_dir(run)
    has_run = holds_run(out)
    dist.barrier()  # every process has looked before the main one changes anything
    lock, error = None, None
    if dist.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock = RunLock(out)
            lock.acquire()
            if has_run and run.overwrite:
                for name in RUN_FILES:
                    target = out / name
                    shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
            _write_marker(out, recipe)
        except ConfigError as err:
            error = err
        except OSError as err:
            error = ConfigError("run.output_dir", f"cannot write to {out}: {err.strerror or err}; choose a writable "
                                "run.output_dir")
        if error is None:
            clean_stale_files(out)
        elif lock is not None:
            lock.release()
    if dist.any(error is not None):
        raise error or ConfigError("run.output_dir", f"the main process could not prepare {out}; see its message")
    return out, lock
