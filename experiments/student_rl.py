"""RL on a few-step student against the same trainer on its teacher (issue 49): strict accuracy against training
CPU-minutes, the rollout throughput, and the hacking panel's blur and diversity signals, from finished runs.

Each ``--teacher`` / ``--student`` is ``LABEL=DIR``, a run folder or its committed record (``metrics.jsonl`` or
``metrics.jsonl.gz``, and ``config.yaml``). The target is the teachers' mean strict accuracy at their last
evaluation (their 30-minute point); a student meets it when one of its evaluations reaches it within half the
teachers' training minutes.

Per evaluation: training minutes (the run's clock, reference CPU-minutes at one thread), epoch, strict accuracy and
per kind, the extra-object rate, and the panel's high-frequency energy (``hack/hf_energy``: blur lowers it) and
diversity (``hack/diversity``). Per run: images sampled per training minute (rollouts and updates together).

    python experiments/student_rl.py --teacher "DGPO, teacher, seed 0=RECORD" --student "DGPO, student=RUN" \\
        [--results experiments/results]

Writes ``student_rl.{json,md,png}`` in ``--results``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

from experiments.runs import clean, fmt, read_rows, save_figure  # noqa: E402

METRIC = "eval/shapes/accuracy"
KINDS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
PANEL = {"extra": "hack/extra_object_rate", "hf_energy": "hack/hf_energy", "diversity": "hack/diversity"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/student_rl.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher", action="append", default=[], metavar="LABEL=DIR", help="an RL run on the teacher")
    p.add_argument("--student", action="append", default=[], metavar="LABEL=DIR", help="an RL run on the student")
    p.add_argument("--results", default=str(ROOT / "experiments" / "results"), help="where student_rl.* go")
    args = p.parse_args(argv)
    if not args.teacher or not args.student:
        p.error("give at least one --teacher and one --student run")
    for spec in args.teacher + args.student:
        if "=" not in spec:
            p.error(f"{spec!r}: expected LABEL=DIR")
    return args


def images_per_epoch(directory: Path) -> int | None:
    """Rollout images per epoch from the run's config (groups x group size), None if it does not say."""
    import yaml

    path = directory / "config.yaml"
    if not path.is_file():
        return None
    sampling = (yaml.safe_load(path.read_text()) or {}).get("sampling") or {}
    groups, size = sampling.get("groups_per_epoch"), sampling.get("group_size")
    return int(groups) * int(size) if groups and size else None


def run_summary(label: str, directory: Path) -> dict:
    """A run's evaluations (minutes, epoch, strict, per kind, panel) and its images per training minute."""
    rows = read_rows(directory)
    evals = [r for r in rows if isinstance(r.get(METRIC), (int, float)) and math.isfinite(r[METRIC])]
    if not evals:
        raise SystemExit(f"student_rl: {directory} has no evaluation of {METRIC}")
    points = [{"minutes": float(r.get("time/train_min", 0.0)), "epoch": int(r.get("epoch", 0)), "strict": r[METRIC],
               "per_kind": {k: r.get(f"eval/shapes/{k}", math.nan) for k in KINDS},
               **{name: r.get(key, math.nan) for name, key in PANEL.items()}} for r in evals]
    trained = [r for r in rows if "time/train_min" in r and "epoch" in r]
    per_epoch = images_per_epoch(directory)
    last = trained[-1] if trained else None
    rate = (per_epoch * last["epoch"] / last["time/train_min"]
            if per_epoch and last and last["time/train_min"] > 0 else math.nan)
    return {"label": label, "dir": str(directory), "evals": points, "images_per_minute": rate}


def first_reaching(points: list[dict], target: float) -> float:
    """The training minutes of the first evaluation at or above ``target`` (NaN if none)."""
    return next((p["minutes"] for p in points if p["strict"] >= target - 1e-9), math.nan)


def analyse(teachers: list[dict], students: list[dict]) -> dict:
    finals = [t["evals"][-1] for t in teachers]
    target = sum(p["strict"] for p in finals) / len(finals)
    budget = sum(p["minutes"] for p in finals) / len(finals) / 2
    for s in students:
        s["reaches_target_at"] = first_reaching(s["evals"], target)
        s["meets"] = bool(math.isfinite(s["reaches_target_at"]) and s["reaches_target_at"] <= budget + 1e-9)
        s["best_strict"] = max(p["strict"] for p in s["evals"])
    return {"target": target, "half_budget_minutes": budget, "teachers": teachers, "students": students}


def markdown(result: dict) -> str:
    lines = ["# RL on the few-step student against RL on the teacher (shapes, strict accuracy)", "",
             f"Target: the teachers' mean strict accuracy at their last evaluation, **{result['target']:.3f}**; a "
             f"student meets it if it reaches it within **{result['half_budget_minutes']:.1f}** training minutes "
             "(half the teachers').", "",
             "| run | minutes | epoch | strict | " + " / ".join(KINDS) + " | extra objects | hf energy | diversity |",
             "|---|---|---|---|---|---|---|---|"]
    for role in ("teachers", "students"):
        for run in result[role]:
            for p in run["evals"]:
                kinds = " / ".join(fmt(p["per_kind"][k], 2) for k in KINDS)
                lines.append(f"| {run['label']} | {p['minutes']:.1f} | {p['epoch']} | {fmt(p['strict'])} | {kinds} | "
                             f"{fmt(p['extra'])} | {fmt(p['hf_energy'], 4)} | {fmt(p['diversity'])} |")
    lines += ["", "| run | images sampled per training minute | best strict | reaches the target at (minutes) "
              "| meets it in half the time |", "|---|---|---|---|---|"]
    for run in result["teachers"]:
        lines.append(f"| {run['label']} | {fmt(run['images_per_minute'], 0)} | "
                     f"{fmt(max(p['strict'] for p in run['evals']))} | | |")
    for run in result["students"]:
        lines.append(f"| {run['label']} | {fmt(run['images_per_minute'], 0)} | {fmt(run['best_strict'])} | "
                     f"{fmt(run['reaches_target_at'], 1)} | {'yes' if run['meets'] else 'no'} |")
    return "\n".join(lines) + "\n"


def figure(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for role, style in (("teachers", "-"), ("students", "--")):
        for run in result[role]:
            minutes = [p["minutes"] for p in run["evals"]]
            ax.plot(minutes, [p["strict"] for p in run["evals"]], style, marker="o", label=run["label"])
            bx.plot(minutes, [p["hf_energy"] for p in run["evals"]], style, marker="o", label=run["label"])
    ax.axhline(result["target"], color="gray", lw=0.8, ls=":")
    ax.axvline(result["half_budget_minutes"], color="gray", lw=0.8, ls=":")
    ax.set(xlabel="training CPU-minutes (one thread)", ylabel="strict accuracy (held out)",
           title="teacher (solid) and 4-step student (dashed)")
    bx.set(xlabel="training CPU-minutes (one thread)", ylabel="high-frequency energy (blur lowers it)",
           title="the panel's sharpness signal")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    split = [spec.split("=", 1) for spec in args.teacher + args.student]
    runs = [run_summary(label, Path(directory)) for label, directory in split]
    result = analyse(runs[:len(args.teacher)], runs[len(args.teacher):])
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "student_rl.json").write_text(json.dumps(clean(result), indent=1))
    (out / "student_rl.md").write_text(markdown(result))
    figure(result, out / "student_rl.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
