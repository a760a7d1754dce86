"""Run plumbing shared by the recipes: output directory, determinism, and a graceful stop on
Ctrl-C / SIGTERM (the loop finishes its step, checkpoints, then exits)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Iterator

import torch

from flowrl.config import RunConfig

__all__ = ["GracefulStop", "prepare_run", "Deadline", "CpuDeadline", "make_deadline", "resolve_device"]


class GracefulStop:
    """Turns SIGINT / SIGTERM into a flag the training loop polls between steps.

    A second Ctrl-C while the checkpoint is being written is ignored, so the checkpoint completes;
    use ``kill -9`` to abort without saving.
    """

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if not self.requested:
            self.reason = signal.Signals(signum).name
            print(f"\n[flowrl] {self.reason} received: finishing the current step, saving a checkpoint, "
                  "then stopping", flush=True)
        self.requested = True

    def __enter__(self) -> "GracefulStop":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Deadline:
    """``run.max_minutes`` as a check the loop can call.

    The budget counts training time: time spent inside :meth:`excluded` (evaluation) does not count,
    so runs with different evaluation schedules get the same training budget. ``scale`` (``run.clock_scale``)
    multiplies this session's measured time: reference-machine minutes on a CPU of another speed.
    """

    def __init__(self, minutes: float | None, already_spent: float = 0.0, scale: float = 1.0):
        self.start = time.monotonic()
        self.minutes = minutes
        self.already_spent = already_spent  # training minutes of earlier sessions (resume), already scaled
        self.scale = scale
        self.excluded_seconds = 0.0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.excluded_seconds += time.monotonic() - start

    def wall_minutes(self) -> float:
        """Wall-clock minutes of this session."""
        return (time.monotonic() - self.start) / 60.0

    def elapsed_minutes(self) -> float:
        """Training minutes, this session and earlier ones, evaluation excluded."""
        return self.already_spent + self.scale * (time.monotonic() - self.start - self.excluded_seconds) / 60.0

    def passed(self) -> bool:
        return self.minutes is not None and self.elapsed_minutes() >= self.minutes


class CpuDeadline(Deadline):
    """``run.max_minutes`` counted in this process's CPU time (all its threads), evaluation excluded.

    On a shared machine wall time depends on everyone else's load; CPU time hardly does, so a budget in CPU
    minutes buys the same training on an idle machine and beside other jobs. At ``run.threads=1`` a CPU minute
    is a wall minute of one busy core.
    """

    def __init__(self, minutes: float | None, already_spent: float = 0.0, scale: float = 1.0):
        super().__init__(minutes, already_spent, scale)
        self.start_cpu = time.process_time()
        self.excluded_cpu = 0.0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        start, start_wall = time.process_time(), time.monotonic()
        try:
            yield
        finally:
            self.excluded_cpu += time.process_time() - start
            self.excluded_seconds += time.monotonic() - start_wall

    def elapsed_minutes(self) -> float:
        """Training CPU minutes, this session and earlier ones, evaluation excluded."""
        return self.already_spent + self.scale * (time.process_time() - self.start_cpu - self.excluded_cpu) / 60.0


def make_deadline(clock: str, minutes: float | None, already_spent: float = 0.0, scale: float = 1.0) -> Deadline:
    """The budget ``run.clock`` names: wall-clock (:class:`Deadline`) or CPU time (:class:`CpuDeadline`),
    the measured time multiplied by ``scale`` (``run.clock_scale``)."""
    kind = CpuDeadline if clock == "cpu" else Deadline
    return kind(minutes, already_spent, scale)


def prepare_run(run: RunConfig) -> Path:
    """Create the output directory and apply the determinism settings. Returns the output directory."""
    output_dir = Path(run.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    if getattr(run, "threads", None):
        torch.set_num_threads(run.threads)
    torch.manual_seed(run.seed)
    return output_dir


def resolve_device(text: str | None) -> torch.device:
    """A ``--device`` argument: None means cuda when available, else cpu.

    Only devices that can run flowrl here pass: ``cpu``, ``cuda[:N]`` with that GPU present, and ``mps``
    on a Mac whose Metal backend is available. ``meta`` (tensors without data) and other accelerator
    types are refused with the devices that would work.

    Raises:
        ValueError: not a usable device here (the message says the fix).
    """
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    usable = "cpu" + (", cuda" if torch.cuda.is_available() else "")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {text!r} is not a torch device; use {usable} (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text!r}: no CUDA device is available here; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {text!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}; "
                             "use one of those")
        return device
    if device.type == "meta":
        raise ValueError(f"--device {text!r}: meta tensors hold no data, so nothing can be generated or scored on "
                         f"them; use {usable}")
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {text!r}: Apple's Metal (MPS) backend is not available on this machine; "
                             f"use {usable}")
        return device
    raise ValueError(f"--device {text!r}: flowrl runs on cpu, cuda or mps, not {device.type}; use {usable}")
