"""Sampler overhead: a 10-step Flow-SDE rollout with log-probs vs its bare model calls.

Builds a tiny diffusers ``SD3Transformer2DModel`` from a config (no download), random text
embeddings, and times (median over repeats, interleaved so that machine load hits both alike):

* ``bare``: the 10 model calls alone, on the same inputs the rollout fed the model;
* ``rollout``: ``samplers.rollout(..., step="flow_sde")`` with per-sample seeds and log-probs;
* ``sampler_only``: the same rollout with a velocity function that returns precomputed outputs,
  i.e. the sampler's own cost (step math, per-sample noise, bookkeeping) without the model.

The overhead fraction is ``rollout / bare - 1`` (goal < 5 %); ``sampler_only / bare`` measures the
same thing without the noise of subtracting two timings. By default torch runs one thread and the
headline numbers are this thread's CPU time, which other processes on a shared machine cannot inflate;
wall-clock medians are reported alongside (``--threads 0`` uses torch's default and wall time). Run:
``python benchmarks/sampler_overhead.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

from samplers import initial_noise, make_sample_seeds, rollout, shifted_sigmas  # noqa: E402

CONFIG = dict(
    sample_size=32,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=64,
    caption_projection_dim=128,
    pooled_projection_dim=64,
    out_channels=16,
)
BATCH, STEPS, TOKENS, REPEATS, THREADS = 8, 10, 16, 7, 1
RESULT = ROOT / "benchmarks" / "results" / "sampler_overhead.json"


def _time(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread) for one call of ``fn``."""
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def main(repeats: int = REPEATS, threads: int | None = THREADS, write: bool = True) -> dict:
    """Run the benchmark; returns (and by default writes) the result dict.

    Args:
        repeats: interleaved repeats; medians are reported.
        threads: torch intra-op threads (default 1: stable timings on a shared machine; None keeps
            torch's default). The overhead fraction is a ratio, so it is comparable across settings.
        write: write ``benchmarks/results/sampler_overhead.json``.
    """
    from diffusers import SD3Transformer2DModel
    import diffusers

    if threads is not None:
        torch.set_num_threads(threads)

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**CONFIG).eval()
    enc = torch.randn(BATCH, TOKENS, CONFIG["joint_attention_dim"])
    pooled = torch.randn(BATCH, CONFIG["pooled_projection_dim"])
    cond = {"encoder_hidden_states": enc, "pooled_projections": pooled}

    def velocity(x, sigma, c):
        # SD3 predicts dx/dsigma = eps - x0 with timestep = 1000 sigma: flowrl's convention as is.
        return model(hidden_states=x, timestep=sigma * 1000, return_dict=False, **c)[0]

    sigmas = shifted_sigmas(STEPS, 3.0)
    seeds = make_sample_seeds(0, 0, range(BATCH))
    x_init = initial_noise((CONFIG["in_channels"], CONFIG["sample_size"], CONFIG["sample_size"]), seeds)

    def run_rollout(vfn):
        return rollout(vfn, x_init, sigmas, cond=cond, step="flow_sde", step_kwargs={"noise_level": 0.7},
                       sample_seeds=seeds)

    with torch.no_grad():
        traj = run_rollout(velocity)  # warm-up, and the inputs the bare calls replay
        inputs = [(traj.latents[:, t].contiguous(), sigmas[t].expand(BATCH).contiguous()) for t in range(STEPS)]
        outputs = [velocity(x, s, cond) for x, s in inputs]

    def bare():
        with torch.no_grad():
            for x, s in inputs:
                velocity(x, s, cond)

    def sampler_only():
        it = iter(outputs)
        run_rollout(lambda x, s, c: next(it))

    times = {"bare": [], "rollout": [], "sampler_only": []}
    for _ in range(repeats):
        times["bare"].append(_time(bare))
        times["rollout"].append(_time(lambda: run_rollout(velocity)))
        times["sampler_only"].append(_time(sampler_only))
    wall = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    # With one torch thread all the work runs on this thread, so its CPU time measures the work itself and
    # is immune to other processes preempting us on a shared machine; with more threads only wall time
    # is meaningful.
    single = torch.get_num_threads() == 1
    med = cpu if single else wall
    result = {
        "benchmark": "sampler_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "device": "cpu",
        },
        "setup": {"model": "SD3Transformer2DModel", "config": CONFIG, "batch": BATCH, "steps": STEPS,
                  "step": "flow_sde", "text_tokens": TOKENS, "repeats": repeats, "per_sample_seeds": True},
        "timer": "thread_cpu" if single else "wall",
        "median_s": med,
        "median_wall_s": wall,
        "median_thread_cpu_s": cpu,
        "overhead_fraction": med["rollout"] / med["bare"] - 1.0,
        "sampler_only_fraction": med["sampler_only"] / med["bare"],
        "overhead_fraction_wall": wall["rollout"] / wall["bare"] - 1.0,
        "goal_fraction": 0.05,
    }
    if write:
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print_table(r: dict) -> None:
    w, c = r["median_wall_s"], r["median_thread_cpu_s"]
    print(f"sampler overhead: SD3 tiny, batch {r['setup']['batch']}, {r['setup']['steps']} steps, flow_sde "
          f"({r['machine']['cpu_count']} CPUs, {r['machine']['torch_threads']} torch threads, "
          f"load {r['machine']['load_average_1min']:.1f})")
    print(f"  {'what':<28}{'wall ms':>10}{'cpu ms':>10}")
    for key, label in (("bare", "bare model calls (10)"), ("rollout", "rollout with log-probs"),
                       ("sampler_only", "sampler alone (no model)")):
        print(f"  {label:<28}{w[key] * 1e3:>10.1f}{c[key] * 1e3:>10.1f}")
    print(f"  overhead ({r['timer']} time): rollout / bare - 1 = {r['overhead_fraction'] * 100:+.2f} %, "
          f"sampler alone / bare = {r['sampler_only_fraction'] * 100:.2f} %   (goal < 5 %)")
    print(f"  (wall-clock rollout / bare - 1 = {r['overhead_fraction_wall'] * 100:+.2f} %)")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    res = main(repeats=args.repeats, threads=args.threads or None)
    _print_table(res)
    print(f"wrote {RESULT.relative_to(ROOT)}")
