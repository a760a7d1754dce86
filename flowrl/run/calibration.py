"""A small fixed workload that measures how fast this CPU runs the shapes model *right now*.

``run.clock: reference`` counts a budget in *reference CPU-minutes*: the CPU time the same training would take
on the machine flowrl's committed benchmark records were made on (an idle AMD EPYC core). A plain CPU-minute
budget (``run.clock: cpu``) depends on the CPU (one core of another machine runs the shapes UNet 10-40% faster
or slower) and, on a virtual machine whose vCPUs share physical cores with other tenants or with each other, on
load: on a 2-vCPU Sapphire Rapids VM (2026-12-02/03) the same epoch cost 1.76x the CPU time beside another
one-thread job, and this probe's time varied 0.58-0.96 s from second to second on an idle guest. So the
reference clock re-measures the CPU's speed every few CPU-seconds with :func:`probe_seconds` and values each
stretch of the run's CPU time by ``PROBE_REFERENCE_SECONDS / probe time`` (the mean of the probes at its two
ends); the probes' own time is not counted.

``PROBE_REFERENCE_SECONDS`` is the probe's time on the reference machine, derived (that machine was gone) from
its records: ``python experiments/calibrate.py --derive RECORD`` reruns a record's epochs here on this clock
and scales the constant by the ratio of the record's CPU seconds to the reference seconds measured here.
"""

from __future__ import annotations

import time

import torch

__all__ = ["PROBE_REFERENCE_SECONDS", "PROBE_REFERENCE_SECONDS_FLOAT32", "Probe", "probe_precision",
           "reference_seconds", "probe_seconds"]

# The probe's CPU seconds on the reference machine, at one thread. Derived 2026-12-03 from the Flow-GRPO and
# AWM records (experiments/results/clock_check.json); see the module docstring.
PROBE_REFERENCE_SECONDS = 0.30
# The float32 probe's reference seconds, for CPUs without bfloat16 hardware, where the benchmarks sample in float32
# (bf16 autocast is emulated there, ~30x slower). Derived like the bf16 constant, by rerunning the records' epochs
# in float32 on such a CPU (2026-12-04, a 2-core AVX2 AMD EPYC: Flow-GRPO 0.170, AWM 0.169; clock_check.json): a
# budget then buys the epochs the records' bf16 runs fit.
PROBE_REFERENCE_SECONDS_FLOAT32 = 0.17
PROBE_BATCH = 2


def probe_precision(run_precision: str | None = None) -> str:
    """The probe's precision: the run's compute precision (``sampling.precision``) when it names one, so a float32
    run on a CPU with bf16 hardware is valued by a float32 probe (a CPU's bf16 and float32 speeds differ against the
    reference machine's: on a Sapphire Rapids core 1.73x and 1.06x, so a bf16 probe would count each float32 epoch
    1.6x long and cut the budget's epochs by ~40%); else ``bfloat16`` (the records' sampling precision) on a
    CPU with bf16 hardware and ``float32`` (what runs there use; a bf16 probe would time the emulation)."""
    if run_precision in ("float32", "bfloat16"):
        return run_precision
    from flowrl.hardware import native_bfloat16

    return "bfloat16" if native_bfloat16() else "float32"


def reference_seconds(precision: str | None = None) -> float:
    """The reference machine's seconds for the probe of ``precision`` (default: :func:`probe_precision`)."""
    precision = precision or probe_precision()
    return PROBE_REFERENCE_SECONDS if precision == "bfloat16" else PROBE_REFERENCE_SECONDS_FLOAT32


class Probe:
    """The shapes UNet (random weights, seed 0) and a batch of ``batch`` noisy latents, built once; calling it
    returns the CPU seconds of one workload: two forward passes without gradient (as in sampling) and one
    forward + backward (as in training), at one thread, under bfloat16 autocast or in float32 (``precision``)."""

    def __init__(self, batch: int = PROBE_BATCH, precision: str = "bfloat16"):
        self.precision = precision
        from flowrl.models.config import ModelConfig, build_model

        with torch.random.fork_rng(devices=[]):  # leave the run's random stream untouched
            torch.manual_seed(0)
            self.model = build_model(ModelConfig(name="shapes"), torch.device("cpu"))
            self.cond = self.model.encode_prompts(["two red circles above a blue square"] * batch)
            self.x = torch.randn(batch, *self.model.latent_shape)
        self.sigma = torch.full((batch,), 0.5)
        self.velocity = self.model.velocity_fn(None)
        self()  # warm-up: allocations, oneDNN kernel selection

    def _step(self) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision == "bfloat16"):
            with torch.no_grad():
                self.velocity(self.x, self.sigma, self.cond)
                self.velocity(self.x, self.sigma, self.cond)
            self.velocity(self.x, self.sigma, self.cond).float().square().mean().backward()
        self.model.denoiser.zero_grad(set_to_none=True)

    def __call__(self) -> float:
        """The workload's CPU seconds. Safe to call anywhere in the main thread, also from a signal handler in the
        middle of the run's own code: gradients on, inference mode off, one thread, then everything as it was."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                start = time.process_time()
                self._step()
                return time.process_time() - start
        finally:
            torch.set_num_threads(threads)


_probes: dict[str, Probe] = {}


def probe_seconds(precision: str | None = None) -> float:
    """CPU seconds of one probe workload now, in ``precision`` (default: :func:`probe_precision`; the model is built
    on the first call, once per process and precision)."""
    precision = precision or probe_precision()
    if precision not in _probes:
        _probes[precision] = Probe(precision=precision)
    return _probes[precision]()
