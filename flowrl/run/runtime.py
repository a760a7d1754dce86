"""Run plumbing shared by the recipes: output directory, determinism, and a graceful stop on
Ctrl-C / SIGTERM (the loop finishes its step, checkpoints, then exits)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from flowrl.config import RunConfig

__all__ = ["GracefulStop", "prepare_run", "Deadline", "CpuDeadline", "ReferenceDeadline", "make_deadline"]


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

    def close(self) -> None:
        """The run is over (the reference clock stops its probe timer)."""


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


class ReferenceDeadline(CpuDeadline):
    """``run.max_minutes`` in reference CPU-minutes: this process's CPU time valued by how fast the CPU runs a
    fixed probe workload now, against the reference machine (:mod:`flowrl.run.calibration`), evaluation excluded.

    Every ``probe_every`` CPU-seconds the probe runs, outside the budget: from a ``SIGPROF`` interval timer on
    the process's CPU time (so it samples the CPU's speed all through an epoch, between two Python bytecodes of
    the main thread), or, where no timer can be set (not the main thread), when the loop asks :meth:`passed`.
    The CPU time between two probes counts ``reference_seconds / mean(their times)`` times over, the time since
    the last probe at the last probe's rate. So the budget buys the same training on a faster or slower CPU,
    and on a VM whose cores slow down when a neighbour (or another tenant) is busy. No probe runs inside
    :meth:`excluded` (evaluation). :meth:`close` stops the timer.
    """

    def __init__(self, minutes: float | None, already_spent: float = 0.0, scale: float = 1.0,
                 probe: Callable[[], float] | None = None, reference_seconds: float | None = None,
                 probe_every: float = 5.0, timer: bool = True, precision: str | None = None):
        from flowrl.run import calibration

        precision = calibration.probe_precision(precision)  # the run's compute precision, else the CPU's default
        self.probe = probe or functools.partial(calibration.probe_seconds, precision)
        self.reference_seconds = reference_seconds or calibration.reference_seconds(precision)
        self.probe_every = probe_every
        self.probes: list[float] = []  # every probe's CPU seconds, for the run's record
        self._busy = False  # inside a probe or an excluded stretch: the timer waits
        super().__init__(minutes, already_spent, scale)
        self.counted_minutes = 0.0  # reference minutes up to the last probe
        self._last_probe = self._run_probe()
        self._last_cpu = self._training_cpu()
        self._previous_handler = None
        if timer:
            try:
                self._previous_handler = signal.signal(signal.SIGPROF, self._on_timer)
            except ValueError:  # not the main thread: probe from passed() only
                pass
            else:
                signal.setitimer(signal.ITIMER_PROF, probe_every, probe_every)

    def close(self) -> None:
        """Stop the probe timer (the run is over)."""
        if self._previous_handler is not None:
            signal.setitimer(signal.ITIMER_PROF, 0)
            signal.signal(signal.SIGPROF, self._previous_handler)
            self._previous_handler = None

    def _training_cpu(self) -> float:
        return time.process_time() - self.start_cpu - self.excluded_cpu

    def _run_probe(self) -> float:
        self._busy = True
        try:
            start = time.process_time()
            seconds = self.probe()
            self.excluded_cpu += time.process_time() - start
        finally:
            self._busy = False
        self.probes.append(seconds)
        return seconds

    def _probe_now(self) -> None:
        seconds = self._run_probe()
        cpu = self._training_cpu()
        mean_probe = (self._last_probe + seconds) / 2
        self.counted_minutes += self.scale * self.reference_seconds / mean_probe * (cpu - self._last_cpu) / 60
        self._last_probe, self._last_cpu = seconds, cpu

    def _on_timer(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if not self._busy:
            self._probe_now()

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        busy, self._busy = self._busy, True
        try:
            with super().excluded():
                yield
        finally:
            self._busy = busy

    def rate(self) -> float:
        """Reference seconds per CPU-second at the last probe (``run.clock_scale`` included)."""
        return self.scale * self.reference_seconds / self._last_probe

    def passed(self) -> bool:
        if self._previous_handler is None and self._training_cpu() - self._last_cpu >= self.probe_every:
            self._probe_now()
        return super().passed()

    def elapsed_minutes(self) -> float:
        """Reference training minutes, this session and earlier ones, evaluation and probes excluded."""
        return (self.already_spent + self.counted_minutes
                + self.rate() * (self._training_cpu() - self._last_cpu) / 60.0)


def make_deadline(clock: str, minutes: float | None, already_spent: float = 0.0, scale: float = 1.0,
                  precision: str | None = None) -> Deadline:
    """The budget ``run.clock`` names: wall-clock (:class:`Deadline`), CPU time (:class:`CpuDeadline`) or
    reference CPU time (:class:`ReferenceDeadline`, probing in ``precision``, the run's ``sampling.precision``),
    the measured time multiplied by ``scale`` (``run.clock_scale``)."""
    if clock == "reference":
        return ReferenceDeadline(minutes, already_spent, scale, precision=precision)
    kind = CpuDeadline if clock == "cpu" else Deadline
    return kind(minutes, already_spent, scale)


def prepare_run(run: RunConfig) -> Path:
    """Apply the process settings of ``run`` (determinism, threads, denormals, ``run.tf32``, the seed); returns the
    output directory's path (created when the run claims it: :func:`flowrl.run.folder.prepare_output_dir`)."""
    output_dir = Path(run.output_dir)
    if run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    if getattr(run, "threads", None):
        torch.set_num_threads(run.threads)
    torch.set_flush_denormal(run.flush_denormal)  # returns False (and does nothing) where the CPU cannot
    # run.tf32: TF32 tensor cores for float32 matmuls and convolutions on CUDA; the CPU kernels never read these.
    torch.backends.cuda.matmul.allow_tf32 = run.tf32
    torch.backends.cudnn.allow_tf32 = run.tf32
    torch.manual_seed(run.seed)
    return output_dir
