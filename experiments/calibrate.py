"""The benchmarks' budget clock: reference CPU-minutes (``run.clock=reference``, :mod:`flowrl.run.calibration`).

A CPU-minute budget (``run.clock=cpu``) depends on the CPU: one core of another machine may run the shapes UNet
10-40% faster or slower (measured: the trainers' records were made on an AMD EPYC core whose bfloat16 Flow-GRPO
epoch took 23-25 CPU-s, the 2026-12-01 machine's took 16, a Sapphire Rapids Xeon core's 20-22), and on a VM
whose vCPUs share execution units, on load (beside another one-thread job an epoch cost 1.76x the CPU time;
on an idle guest a fixed workload's time varied 0.58-0.96 s from second to second). So every benchmark run
counts its budget on the reference clock, which probes the CPU's speed every 5 CPU-seconds and values the
CPU time by it: budgets are in *reference CPU-minutes*, the same training on any CPU and any load.
``FLOWRL_BENCH_CLOCK_SCALE=S`` instead counts plain CPU time times ``S`` (no probes; 1 = as measured).

``flowrl.run.calibration.PROBE_REFERENCE_SECONDS`` (the bf16 probe) and ``PROBE_REFERENCE_SECONDS_FLOAT32`` (the
float32 probe, used on CPUs without bf16 hardware), the probe's time on the reference machine, were derived, not
measured there (that machine was gone): ``--derive RECORD`` reruns a committed record's command here for
epochs 2-16 on the reference clock and scales the constant by the ratio of the record's CPU seconds to the
reference seconds counted here (the same prompts and images on both machines).

    flowrl calibrate                                # this CPU's speed now, against the reference machine
    python experiments/calibrate.py --derive RECORD # the probe's reference seconds from a reference record
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENV = "FLOWRL_BENCH_CLOCK_SCALE"


def budget_clock() -> tuple[str, ...]:
    """The overrides that set every benchmark run's budget clock: the reference clock, or plain CPU time times
    ``FLOWRL_BENCH_CLOCK_SCALE`` when that is set."""
    if os.environ.get(ENV):
        return ("run.clock=cpu", f"run.clock_scale={float(os.environ[ENV]):.4f}")
    return ("run.clock=reference",)


def speed_now(probes: int = 30) -> dict:
    """This CPU's speed now (``flowrl calibrate``)."""
    from flowrl.commands.calibrate import speed_now as measure

    return measure(probes)


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


def derive(record: Path, epochs: range = range(2, 17)) -> dict:
    """The probe's reference seconds from a reference record: rerun its command here for the same epochs on the
    reference clock and scale the constant by the ratio of the record's CPU seconds to the seconds counted here.

    On a CPU without bfloat16 hardware the record's bf16 settings run in float32 (bf16 is refused there), and the
    constant derived is the float32 probe's (``PROBE_REFERENCE_SECONDS_FLOAT32``): a float32 epoch here then
    counts what the record's bf16 epoch counted."""
    import subprocess
    import tempfile

    from flowrl.run.calibration import probe_precision, reference_seconds

    precision = probe_precision()
    used = reference_seconds(precision)

    done = json.loads((record / "benchmark_done.json").read_text())
    reference = epoch_cpu_seconds(read_jsonl(record / "metrics.jsonl.gz"))
    with tempfile.TemporaryDirectory() as tmp:
        command = [a for a in done["command"] if not a.startswith(("run.output_dir=", "run.max_minutes=",
                                                                   "run.max_epochs=", "run.clock_scale=",
                                                                   "run.clock="))]
        if precision == "float32":
            command = [a.replace("=bfloat16", "=float32") if a.endswith("precision=bfloat16") else a for a in command]
        config = next(i for i, a in enumerate(command) if a.endswith(".yaml"))  # its path in that checkout
        command[config] = str(ROOT / "configs" / Path(command[config]).relative_to(Path(command[config]).parents[1]))
        command += [f"run.output_dir={tmp}/run", f"run.max_epochs={max(epochs)}", "eval.every_minutes=null",
                    "eval.every_epochs=100000", "checkpoint.every_epochs=100000", "run.clock=reference",
                    "data.num_eval_prompts=8"]  # the last epoch's evaluation: as short as it gets
        subprocess.run([sys.executable, *command], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        rows = read_jsonl(Path(tmp) / "run" / "metrics.jsonl")
    here = epoch_cpu_seconds(rows)
    ratio = sum(reference[e] for e in epochs) / sum(here[e] for e in epochs)
    rates = [r["time/clock_rate"] for r in rows if "time/clock_rate" in r]
    return {"record": str(record), "epochs": list(epochs), "reference_epoch_s": [reference[e] for e in epochs],
            "here_reference_epoch_s": [here[e] for e in epochs], "clock_rate_min_max": [min(rates), max(rates)],
            "ratio": ratio, "probe_precision": precision, "probe_reference_s_used": used,
            "probe_reference_s": used * ratio}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="experiments/calibrate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--derive", metavar="RECORD", help="derive the probe's reference seconds (of this CPU's probe "
                                                      "precision) from a reference run's record")
    args = p.parse_args(argv)
    if args.derive:
        print(json.dumps(derive(Path(args.derive)), indent=2))
        return
    print(json.dumps(speed_now()))


if __name__ == "__main__":
    main(sys.argv[1:])
