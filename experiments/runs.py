"""Shared machinery of the training benchmarks (``experiments/credit.py``, ``experiments/trainers.py``): launch a
training run as a subprocess on a training-time budget, read its evaluations back, and summarise curves over
seeds (interpolation at equal images / equal minutes, mean and spread).

A run is ``python -m flowrl train CONFIG run.output_dir=DIR run.seed=S run.max_minutes=M eval.every_minutes=E
eval.every_epochs=null ...``; evaluation runs on a training-time schedule (``flowrl.run.runtime.Deadline`` excludes
it from the budget), so every method gets held-out points at the same minutes whatever its epoch length.

Budgets are in reference CPU-minutes at one thread (``run.clock=reference run.threads=1``, which every run gets
first, so a benchmark's own overrides may change them; see ``experiments/calibrate.py``): a budget buys the same
training on CPUs of other speeds and beside other work (``experiments/results/clock_check.json``).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every benchmark run's budget: reference CPU-minutes (experiments/calibrate.py), one thread, so that a budget buys
# the same epochs on any CPU and beside any load.
CPU_BUDGET = ("run.threads=1",)


def cpu_budget() -> tuple[str, ...]:
    from experiments.calibrate import budget_clock

    return (*budget_clock(), *CPU_BUDGET)

__all__ = ["ROOT", "RECORDS", "record_dir", "save_record", "restore_record", "run_command", "settings_mismatch",
           "check_reusable", "train_run", "launch", "interp", "median", "mean_std", "fmt", "clean", "read_curve",
           "curve_mean", "save_figure"]


DONE = "benchmark_done.json"  # written beside a run's metrics when its process finished with exit status 0
# Where a finished run's record (its metrics, config and DONE file, a few tens of KB) is copied, so that results
# survive the machine: ``<RECORDS>/<out's parent folder>/<out's name>/``, committed with the benchmark's tables.
# A later ``--reuse`` on a machine without the run folder restores it from there instead of training again.
RECORDS = Path(os.environ.get("FLOWRL_BENCH_RECORDS", ROOT / "experiments" / "results" / "records"))
RECORD_FILES = ("metrics.jsonl", "config.yaml", DONE)


def record_dir(out: Path) -> Path:
    """The committed record of the run folder ``out``."""
    return RECORDS / out.parent.name / out.name


def save_record(out: Path) -> Path:
    """Copy a finished run's record files (metrics gzip-compressed) to ``record_dir(out)``."""
    import gzip

    dest = record_dir(out)
    dest.mkdir(parents=True, exist_ok=True)
    for name in RECORD_FILES:
        src = out / name
        if not src.is_file():
            continue
        if name.endswith(".jsonl"):
            with open(src, "rb") as f, gzip.GzipFile(dest / (name + ".gz"), "wb", mtime=0) as g:
                shutil.copyfileobj(f, g)
        else:
            shutil.copy2(src, dest / name)
    return dest


def restore_record(out: Path) -> bool:
    """Recreate a finished run's folder from its record (True when there was one)."""
    import gzip

    src = record_dir(out)
    if not (src / DONE).is_file():
        return False
    out.mkdir(parents=True, exist_ok=True)
    for name in RECORD_FILES:
        if (src / (name + ".gz")).is_file():
            with gzip.open(src / (name + ".gz"), "rb") as g, open(out / name, "wb") as f:
                shutil.copyfileobj(g, f)
        elif (src / name).is_file():
            shutil.copy2(src / name, out / name)
    return True


_CHECKOUT = re.compile(r"(^|=)/\S*?/(?=(?:configs|benchmarks|experiments)/)")


def run_command(config: Path, out: Path, overrides: dict, extra: list[str] = (), *, resume: bool = False) -> list[str]:
    """The ``python -m flowrl train ...`` command of one benchmark run."""
    return [sys.executable, "-m", "flowrl", "train", str(config), f"run.output_dir={out}", *cpu_budget(),
            *[f"{k}={v}" for k, v in overrides.items()], *extra, *(["run.resume=true"] if resume else [])]


def _settings(command: list[str]) -> list[str]:
    """A run command's arguments after ``train``, without the output folder and the resume flag, with the checkout
    part of paths dropped (``/work/main/configs/shapes/x.yaml`` -> ``configs/shapes/x.yaml``): what stays the same
    for the same run on another machine or in another sitting."""
    args = command[command.index("train") + 1:] if "train" in command else list(command)
    return [_CHECKOUT.sub(r"\1", a) for a in args if not a.startswith("run.output_dir=") and a != "run.resume=true"]


def settings_mismatch(out: Path, command: list[str]) -> str | None:
    """Why the finished run in ``out`` (or its record) cannot stand for ``command``: the arguments that differ
    (``None`` when it can, or when there is no finished run to compare)."""
    done = out / DONE if (out / DONE).is_file() else record_dir(out) / DONE
    if not done.is_file():
        return None
    recorded = _settings(json.loads(done.read_text()).get("command", []))
    wanted = _settings(command)
    if recorded == wanted:
        return None
    only_recorded = [a for a in recorded if a not in wanted]
    only_wanted = [a for a in wanted if a not in recorded]
    if not only_recorded and not only_wanted:
        return "the same arguments in another order"
    return f"it was made with {' '.join(only_recorded) or '(nothing more)'}, this run asks for " \
           f"{' '.join(only_wanted) or '(nothing more)'}"


def check_reusable(jobs: list[dict]) -> None:
    """Stop, before anything trains, when ``--reuse`` would take a finished run made with other settings (another
    precision, budget or evaluation) for one of ``jobs``: results of different settings never mix in a table."""
    problems = []
    for job in jobs:
        if not job.get("reuse"):
            continue
        why = settings_mismatch(job["out"], run_command(job["config"], job["out"], job["overrides"], job["extra"]))
        if why:
            problems.append(f"  {job['out']} (record {record_dir(job['out'])}): {why}")
    if problems:
        raise SystemExit("benchmark: --reuse would mix runs made with other settings:\n" + "\n".join(problems)
                         + "\nMove those folders and records aside (or delete them), or give this benchmark "
                           "another --tag / --out so both sets of runs are kept.")


def train_run(config: Path, out: Path, overrides: dict, extra: list[str] = (), *, reuse: bool = False,
              label: str = "run") -> dict:
    """One training run as a subprocess; its log goes to ``<out>/train.log``.

    With ``reuse``, a finished run (``benchmark_done.json``) is kept, and an interrupted one (a killed benchmark,
    a machine that went away) resumes from its last checkpoint with ``run.resume=true``: a benchmark that spans
    sessions is started again with the same command. Without it, or with nothing to resume, the run starts
    fresh. Returns ``{"status": ok | failed | reused, "returncode", "seconds"}``."""
    from flowrl.run.checkpoint_files import checkpoints

    if reuse and (out / DONE).is_file():
        print(f"{label}: reusing {out}", flush=True)
        return {"status": "reused", "returncode": 0}
    if reuse and not (out.is_dir() and checkpoints(out)) and restore_record(out):
        print(f"{label}: reusing the record {record_dir(out)}", flush=True)
        return {"status": "reused", "returncode": 0}
    resume = reuse and out.is_dir() and bool(checkpoints(out))
    if not resume:
        if out.exists():
            shutil.rmtree(out)  # a fresh run
        out.mkdir(parents=True)
    command = run_command(config, out, overrides, extra, resume=resume)
    print(f"{label}: {'resuming: ' if resume else ''}{' '.join(command[1:])}", flush=True)
    start = time.time()
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {**os.environ, "PYTHONPATH": path}
    with open(out / "train.log", "a" if resume else "w") as log:
        proc = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    # Exit 3 (flowrl.run.harness.NO_USABLE_REWARD): the run ran to its end but no epoch had a usable reward; its curve
    # is a result (it learned nothing), so it is analysed like any finished run and flagged.
    status = "ok" if proc.returncode in (0, 3) else "failed"
    if proc.returncode == 3:
        print(f"{label}: no epoch had a usable reward (flat curve)", flush=True)
    if status == "failed":
        tail = (out / "train.log").read_text().splitlines()[-15:]
        print(f"{label} FAILED (exit {proc.returncode}); last lines:\n  " + "\n  ".join(tail), flush=True)
    else:
        (out / DONE).write_text(json.dumps({"command": command[1:], "seconds": round(time.time() - start, 1),
                                            "returncode": proc.returncode}) + "\n")
        save_record(out)
    return {"status": status, "returncode": proc.returncode, "no_usable_reward": proc.returncode == 3,
            "seconds": round(time.time() - start, 1)}


def launch(jobs: list[dict], parallel: int, keys: tuple[str, ...] = ("trainer", "seed", "variant")) -> list[dict]:
    """Run ``jobs`` (``config``, ``out``, ``overrides``, ``extra``, ``label``, ``reuse``), ``parallel`` at a time;
    each result carries the job's ``keys``."""
    from concurrent.futures import ThreadPoolExecutor

    os.environ["OMP_NUM_THREADS"] = "1"  # each run one thread: runs side by side do not fight over cores

    def one(job: dict) -> dict:
        result = train_run(job["config"], job["out"], job["overrides"], job["extra"], reuse=job["reuse"],
                           label=job["label"])
        return {**{k: job[k] for k in keys}, **result}

    check_reusable(jobs)
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return list(pool.map(one, jobs))


def interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Linear interpolation of (xs, ys) (xs increasing) at x; NaN outside the range."""
    if not xs or x < xs[0] - 1e-9 or x > xs[-1] + 1e-9:
        return math.nan
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def median(values: list[float]) -> float:
    v = sorted(x for x in values if isinstance(x, (int, float)) and math.isfinite(x))
    if not v:
        return math.nan
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std of the finite values (NaN, NaN when there are none)."""
    v = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    if not v:
        return math.nan, math.nan
    mean = sum(v) / len(v)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))


def fmt(x: float, digits: int = 3) -> str:
    return "n/a" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{digits}f}"


def clean(x):
    """``x`` with non-finite floats as None (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clean(v) for v in x]
    return x


def read_rows(folder: Path) -> list[dict]:
    """The metric rows of a run folder (``metrics.jsonl``) or of its committed record (``metrics.jsonl.gz``).

    Raises:
        SystemExit: the folder holds neither.
    """
    for name, opener in (("metrics.jsonl", open), ("metrics.jsonl.gz", gzip.open)):
        path = folder / name
        if path.is_file():
            with opener(path, "rt") as f:
                return [json.loads(line) for line in f if line.strip()]
    raise SystemExit(f"{folder} holds no metrics.jsonl(.gz): give a run folder or its record")


def read_curve(directory: Path, metric: str, *, initial: dict | None = None) -> dict | None:
    """A run's evaluations and costs from ``<directory>/metrics.jsonl`` (None without any evaluation).

    Args:
        directory: the run directory.
        metric: the held-out metric (e.g. ``eval/shapes/accuracy``); rows where it is finite are evaluations.
        initial: an evaluation row to put first (epoch 0, 0 images, 0 minutes) when the run did not evaluate
            at its start, e.g. the base model's, measured once for every run of a benchmark. A run with no
            evaluation of its own (still before its first) gives None, not a curve of this one point.

    Returns:
        ``images``, ``minutes``, ``accuracy`` (one entry per evaluation), ``evals`` (the evaluation rows),
        ``epochs``, ``final_images``, ``final_minutes``, the medians over training epochs after the first of
        ``epoch_s``, ``sampling_s``, ``training_s``, ``advantages_s``, and ``rows`` (the training rows).
    """
    from flowrl.run.metrics import read_metrics

    path = directory / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = read_metrics(path)
    evals = [r for r in rows if metric in r and math.isfinite(r[metric])]
    if not evals:  # no evaluation of its own (a run in progress): not a curve of the base's one point
        return None
    if initial is not None and not any(r.get("epoch") == 0 for r in evals):
        evals = [{"epoch": 0, "images_sampled": 0, "time/train_min": 0.0, **initial}] + evals
    train_rows = [r for r in rows if "train/loss" in r or "train/reward_mean" in r]
    steady = train_rows[1:] or train_rows  # skip the first epoch (warm-up) when there are others
    return {
        "images": [float(r.get("images_sampled", 0)) for r in evals],
        "minutes": [float(r.get("time/train_min", 0.0)) for r in evals],
        "accuracy": [float(r[metric]) for r in evals],
        "evals": evals,
        "epochs": int(max((r.get("epoch", 0) for r in rows), default=0)),
        "final_images": float(max((r.get("images_sampled", 0) for r in rows), default=0)),
        "final_minutes": float(max((r.get("time/train_min", 0.0) for r in rows), default=0.0)),
        "epoch_s": median([r.get("time/epoch_s", math.nan) for r in steady]),
        "sampling_s": median([r.get("time/sampling_s", math.nan) for r in steady]),
        "training_s": median([r.get("time/training_s", math.nan) for r in steady]),
        "advantages_s": median([r.get("time/advantages_s", math.nan) for r in steady]),
        "rows": train_rows,
    }


def save_figure(fig, path: Path) -> None:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curve_mean(curves: list[dict], key: str, top: float | None = None, points: int = 51) -> tuple[list, list]:
    """The mean over runs of accuracy against ``key`` (``images`` or ``minutes``) on a common grid up to ``top``
    (default: the shortest run's last point)."""
    top = min(c[key][-1] for c in curves) if top is None else top
    grid = [top * i / (points - 1) for i in range(points)]
    return grid, [mean_std([interp(x, c[key], c["accuracy"]) for c in curves])[0] for x in grid]
