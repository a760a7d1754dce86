"""How fast this CPU runs the shapes model, against the machine the committed benchmark records were made on.

A CPU-minute budget (``run.clock=cpu``) does not depend on load, but it does depend on the CPU: one core of
another machine may run the shapes UNet 10-40% faster or slower (measured: the trainers' records were made on an
AMD EPYC core whose bfloat16 Flow-GRPO epoch took 23-25 CPU-s, the 2026-12-01 machine's took 16, a Sapphire Rapids
Xeon core's 20-22), so "10 CPU-minutes" would buy different epochs on each, and a sweep that spans
sessions would compare trainers on unequal budgets.

The benchmarks therefore time a fixed workload at one thread, the mix of an epoch (bfloat16 forward passes
without gradient as in sampling, forward and backward as in training, batch 32), and pass
``run.clock_scale = REFERENCE_SECONDS / this machine's seconds`` to every run: budgets are in *reference
CPU-minutes*, the same training on any CPU. ``FLOWRL_BENCH_CLOCK_SCALE`` sets the scale by hand (1 = as
measured).

``REFERENCE_SECONDS`` is the workload's time on the reference machine. It was derived, not measured there (that
machine was gone): this workload's time here times the ratio of the reference record's epoch times to the same
run's epoch times here (``python benchmarks/calibrate.py --derive RECORD``: the shipped benchmark run, seed 0,
epochs 2-8, the same prompts and images on both machines), for Flow-GRPO and AWM.

    python benchmarks/calibrate.py            # this machine's scale
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The workload's least CPU seconds on the reference machine (see the module docstring): derived 2026-12-02 on a
# Sapphire Rapids Xeon core from two trainers' records. Flow-GRPO (three derivations): 1.74; AWM (its 10-minute
# run): 1.90; REFERENCE_SECONDS is their mean, so either trainer's budget is off by about 4.5% at most (the op mix
# of an epoch differs between trainers, and so does how much each gains from a faster core).
REFERENCE_SECONDS = 1.82
ENV = "FLOWRL_BENCH_CLOCK_SCALE"
_cached: float | None = None


def workload_seconds(repeats: int = 7, batch: int = 32) -> float:
    """Least CPU seconds (the least disturbed by a neighbour's cache and memory traffic), one thread, of two bfloat16 no-grad forwards and one forward + backward of the
    shapes UNet on a batch of ``batch`` noisy latents (an epoch's mix of sampling and training)."""
    import torch

    from flowrl.models.config import ModelConfig, build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = build_model(ModelConfig(name="shapes"), torch.device("cpu"))
        cond = model.encode_prompts(["two red circles above a blue square"] * batch)
        x = torch.randn(batch, *model.latent_shape)
        sigma = torch.full((batch,), 0.5)
        velocity = model.velocity_fn(None)

        def step() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.no_grad():
                    velocity(x, sigma, cond)
                    velocity(x, sigma, cond)
                velocity(x, sigma, cond).float().square().mean().backward()
            model.denoiser.zero_grad(set_to_none=True)

        step()  # warm-up: allocations, oneDNN kernel selection
        times = []
        for _ in range(repeats):
            start = time.process_time()
            step()
            times.append(time.process_time() - start)
        return min(times)
    finally:
        torch.set_num_threads(threads)


def clock_scale() -> float:
    """``run.clock_scale`` for this machine: ``FLOWRL_BENCH_CLOCK_SCALE`` if set, else the reference time over
    this machine's (measured once per process)."""
    global _cached
    if os.environ.get(ENV):
        return float(os.environ[ENV])
    if _cached is None:
        _cached = 1.0 if REFERENCE_SECONDS is None else REFERENCE_SECONDS / workload_seconds()
        print(f"benchmarks: this CPU runs the calibration workload at {_cached:.3f}x the reference machine's speed: "
              f"run.clock_scale={_cached:.3f} (budgets in reference CPU-minutes; {ENV}=1 turns it off)", flush=True)
    return _cached


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a metrics file, plain or gzip-compressed (a committed record)."""
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def epoch_cpu_seconds(rows: list[dict]) -> dict[int, float]:
    """Each epoch's training CPU seconds (differences of ``time/train_min``; the runs compared had scale 1)."""
    train = [(r["epoch"], r["time/train_min"]) for r in rows if "time/epoch_s" in r]
    return {epoch: 60 * (minutes - before) for (epoch, minutes), (_, before) in zip(train[1:], train)}


def derive(record: Path, epochs: range = range(2, 9)) -> dict:
    """``REFERENCE_SECONDS`` from a reference record: rerun its command here for the same epochs and scale this
    machine's workload time by the ratio of epoch times."""
    import subprocess
    import tempfile

    done = json.loads((record / "benchmark_done.json").read_text())
    reference = epoch_cpu_seconds(read_jsonl(record / "metrics.jsonl.gz"))
    with tempfile.TemporaryDirectory() as tmp:
        command = [a for a in done["command"] if not a.startswith(("run.output_dir=", "run.max_minutes=",
                                                                   "run.max_epochs=", "run.clock_scale="))]
        config = next(i for i, a in enumerate(command) if a.endswith(".yaml"))  # its path in that checkout
        command[config] = str(ROOT / "configs" / Path(command[config]).relative_to(Path(command[config]).parents[1]))
        command += [f"run.output_dir={tmp}/run", f"run.max_epochs={max(epochs)}", "eval.every_minutes=null",
                    "eval.every_epochs=100000", "checkpoint.every_epochs=100000"]
        subprocess.run([sys.executable, *command], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        here = epoch_cpu_seconds(read_jsonl(Path(tmp) / "run" / "metrics.jsonl"))
    ratio = sum(reference[e] for e in epochs) / sum(here[e] for e in epochs)
    seconds = workload_seconds()
    return {"epochs": list(epochs), "reference_epoch_s": [reference[e] for e in epochs],
            "here_epoch_s": [here[e] for e in epochs], "epoch_time_ratio": ratio, "workload_s_here": seconds,
            "reference_seconds": seconds * ratio}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="benchmarks/calibrate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--derive", metavar="RECORD", help="derive REFERENCE_SECONDS from a reference run's record")
    args = p.parse_args(argv)
    if args.derive:
        print(json.dumps(derive(Path(args.derive)), indent=2))
        return
    seconds = workload_seconds()
    print(json.dumps({"workload_s": seconds, "reference_s": REFERENCE_SECONDS,
                      "clock_scale": None if REFERENCE_SECONDS is None else REFERENCE_SECONDS / seconds}))


if __name__ == "__main__":
    main(sys.argv[1:])
