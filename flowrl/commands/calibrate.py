"""``flowrl calibrate``: how fast this CPU runs flowrl's reference workload, and the budget settings that make a
CPU run's ``run.max_minutes`` mean the same training here as on the reference machine.

    flowrl calibrate [--probes 30]

A budget in plain CPU time depends on the CPU (one core of another machine runs the shapes UNet 10-40% faster or
slower) and, on a VM, on the neighbours' load. ``run.clock=reference`` values the run's CPU time by a probe of this
CPU's speed every 5 CPU-seconds (:mod:`flowrl.run.calibration`): the same training on any CPU and any load. This
command measures the probe now and prints the two ways to use it: ``run.clock=reference`` (probes during the run),
or ``run.clock=cpu run.clock_scale=S`` with ``S`` the rate measured now (no probes, for an idle machine).
"""

from __future__ import annotations

import statistics
import sys

__all__ = ["speed_now", "main"]


def speed_now(probes: int = 30) -> dict:
    """``probes`` probe times in a row here, and the reference clock's rate at their median (reference seconds per
    CPU-second: above 1 on a CPU faster than the reference machine's)."""
    from flowrl.run import calibration

    times = [calibration.probe_seconds() for _ in range(probes)]
    median = statistics.median(times)
    reference = calibration.reference_seconds()
    return {"probe_precision": calibration.probe_precision(),
            "probe_s": {"min": min(times), "median": median, "max": max(times)},
            "probe_reference_s": reference, "rate_at_median": reference / median}


def main(argv: list[str] | None = None) -> int:
    from flowrl.commands.args import OneLineParser, UsageError, bounded_int

    parser = OneLineParser(prog="flowrl calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=bounded_int(3, 1000, "probes"), default=30,
                        help="probe runs to time (default 30; each takes about a second)")
    try:
        args = parser.parse_args(argv)
    except UsageError as err:
        print(f"flowrl calibrate: error: {err}", file=sys.stderr)
        return 2
    speed = speed_now(args.probes)
    probe = speed["probe_s"]
    print(f"flowrl calibrate: the {speed['probe_precision']} probe took {probe['median']:.3f} s here (min "
          f"{probe['min']:.3f}, max {probe['max']:.3f}) against {speed['probe_reference_s']:.3f} s on the reference "
          f"machine: this CPU runs flowrl at {speed['rate_at_median']:.2f}x the reference")
    print("flowrl calibrate: budgets that mean the same training here: run.clock=reference (probes as it runs), or "
          f"run.clock=cpu run.clock_scale={speed['rate_at_median']:.3f} on an idle machine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
