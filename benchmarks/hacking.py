"""Does a regulariser stop the main job from gaming its reward? The main job (Flow-GRPO on the shapes model,
``configs/shapes/flow_grpo.yaml``) against the same job with an adversarial reward, with an artifact reward, and
CRD, under the same training-time budget, seeds and eval set, every evaluation logging the hacking panel
(``hack/*``: flowrl/rl/panel.py).

Variants (``VARIANTS``; each adds overrides to its config):

- ``main``: the shipped main job;
- ``adversarial``: + ``adversarial`` (weight ``--adv-weight``) with references rendered by the shapes world for
  each training prompt and the shipped shapes encoder; the discriminator warms up on ``--adv-warmup`` epochs of
  the base model's samples, then trains on every epoch's samples after the policy's update (GAN-style; the
  Adv-GRPO 9-of-10 schedule leaves a 30-minute CPU budget about nine policy epochs);
- ``artifact``: + ``artifact`` (weight ``--artifact-weight``), the classifier of ``flowrl train-reward artifact
  --synthetic shapes`` (trained first into ``--artifact-model`` when that folder is missing);
- ``crd``: ``configs/shapes/crd.yaml`` (it claims less hacking).

Runs are launched ``--parallel`` at a time, one thread each (``benchmarks/runs.py``). Outputs (``--results``):
``hacking.json`` / ``hacking.md`` (per variant, mean over seeds at the end of the budget: held-out accuracy and
its per-task values, strict accuracy, extra-object rate, background shift, pixel / feature drift, diversity, KL to
the base) and ``hacking.png`` (accuracy and each hack metric against training minutes).

    python benchmarks/hacking.py --minutes 30 --seeds 0 1 --parallel 2
    python benchmarks/hacking.py --analyse-only
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

from benchmarks.runs import clean, fmt, launch, mean_std, read_curve, save_figure  # noqa: E402

METRIC = "eval/shapes/accuracy"
KINDS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# hack/kl_to_base is logged for SDE rollouts only (the main job, the adversarial and artifact variants);
# hack/fm_to_base for every trainer, CRD's ODE rollouts included.
PANEL = ("hack/accuracy_strict", "hack/extra_object_rate", "hack/bg_shift", "hack/drift_pixel", "hack/drift_feature",
         "hack/diversity", "hack/kl_to_base", "hack/fm_to_base")
VARIANTS = ("main", "adversarial", "artifact", "crd")
COLORS = {"main": "tab:blue", "adversarial": "tab:red", "artifact": "tab:green", "crd": "tab:orange"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--minutes", type=float, default=30.0, help="training CPU-minutes per run, one thread (default 30)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="a budget in epochs instead of minutes (evaluations every third of it), for runs that "
                             "share a loaded machine")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time, one thread each (default 1)")
    parser.add_argument("--eval-every-minutes", type=float, default=None, help="default: a third of the budget")
    parser.add_argument("--num-eval-prompts", type=int, default=600)
    parser.add_argument("--eval-steps", type=int, default=40)
    parser.add_argument("--max-epochs", type=int, default=100000)
    parser.add_argument("--adv-weight", type=float, default=0.3)
    parser.add_argument("--adv-warmup", type=int, default=3, help="discriminator-only epochs first (default 3)")
    parser.add_argument("--adv-d-steps", type=int, default=1, help="discriminator steps per epoch (default 1)")
    parser.add_argument("--adv-lr", type=float, default=1e-4, help="discriminator learning rate (default 1e-4)")
    parser.add_argument("--artifact-weight", type=float, default=0.5)
    parser.add_argument("--artifact-model", default=str(ROOT / "benchmarks" / "out" / "hacking" / "artifact_model"))
    parser.add_argument("--model-path", default=None, help="the model to tune (default: the shipped one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="an override for every run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "hacking"))
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--reuse", action="store_true", help="keep finished runs")
    parser.add_argument("--analyse-only", action="store_true")
    return parser.parse_args(argv)


def variant_overrides(args: argparse.Namespace, variant: str) -> tuple[Path, list[str]]:
    """The config and the overrides of ``variant`` (on top of the common ones)."""
    shapes = ROOT / "configs" / "shapes"
    if variant == "crd":
        return shapes / "crd.yaml", []
    if variant == "adversarial":
        return shapes / "flow_grpo.yaml", [
            f"reward.train={{shapes: 1.0, adversarial: {{weight: {args.adv_weight}, kwargs: {{references: shapes, "
            f"d_steps: {args.adv_d_steps}, lr: {args.adv_lr}}}}}}}",
            "reward.discriminator.period=1", "reward.discriminator.d_epochs=0",
            "reward.discriminator.d_on_generator_epochs=true", f"reward.discriminator.warmup_epochs={args.adv_warmup}"]
    if variant == "artifact":
        return shapes / "flow_grpo.yaml", [
            f"reward.train={{shapes: 1.0, artifact: {{weight: {args.artifact_weight}, "
            f"kwargs: {{path: {args.artifact_model}}}}}}}"]
    return shapes / "flow_grpo.yaml", []


def ensure_artifact_model(path: Path) -> None:
    """Train the synthetic-artifact classifier once (``flowrl train-reward artifact --synthetic shapes``)."""
    if (path / "config.json").is_file():
        return
    subprocess.run([sys.executable, "-m", "flowrl", "train-reward", "artifact", "--synthetic", "shapes", "--out",
                    str(path)], cwd=ROOT, check=True)


def jobs_for(args: argparse.Namespace) -> list[dict]:
    if args.epochs is not None:
        budget = {"run.max_minutes": "null", "run.max_epochs": args.epochs, "eval.every_minutes": "null",
                  "eval.every_epochs": max(1, args.epochs // 3)}
    else:
        budget = {"run.max_minutes": args.minutes, "run.max_epochs": args.max_epochs, "eval.every_epochs": "null",
                  "eval.every_minutes": args.eval_every_minutes or args.minutes / 3}
    common = {**budget, "eval.at_start": "true", "data.num_eval_prompts": args.num_eval_prompts,
              "sampling.eval_num_steps": args.eval_steps}
    if args.model_path is not None:
        common["model.path"] = args.model_path
    jobs = []
    for seed in args.seeds:  # seed-major: an interrupted benchmark still has every variant for early seeds
        for variant in args.variants:
            config, extra = variant_overrides(args, variant)
            jobs.append({"config": config, "out": Path(args.out) / f"{variant}_s{seed}",
                         "overrides": {**common, "run.seed": seed}, "extra": [*extra, *args.overrides],
                         "label": f"hacking: {variant} seed {seed}", "reuse": args.reuse, "variant": variant,
                         "seed": seed})
    return jobs


def curve(directory: Path) -> dict | None:
    """Accuracy and every panel metric against training minutes (one entry per evaluation)."""
    found = read_curve(directory, METRIC)
    if found is None:
        return None
    evals = found["evals"]
    series = {key: [float(r.get(key, math.nan)) for r in evals] for key in (METRIC, *PANEL)}
    series.update({f"eval/shapes/{k}": [float(r.get(f"eval/shapes/{k}", math.nan)) for r in evals] for k in KINDS})
    return {"minutes": found["minutes"], "epochs": found["epochs"], "final_images": found["final_images"],
            "series": series}


def summarise(runs: dict[tuple[str, int], dict]) -> dict:
    """Per variant: the first and the last evaluation of each metric, mean and std over seeds."""
    out = {}
    for variant in dict.fromkeys(v for v, _ in runs):
        mine = [r for (v, _), r in runs.items() if v == variant]
        row = {"seeds": len(mine), "epochs": mean_std([r["epochs"] for r in mine])[0],
               "minutes": mean_std([r["minutes"][-1] for r in mine])[0]}
        for key in mine[0]["series"]:
            row[key] = {"start": mean_std([r["series"][key][0] for r in mine]),
                        "end": mean_std([r["series"][key][-1] for r in mine])}
        out[variant] = row
    return out


def markdown(summary: dict) -> str:
    keys = (METRIC, *PANEL)
    short = lambda k: k.split("/", 1)[1].replace("shapes/", "")  # noqa: E731
    lines = ["| variant | seeds | epochs | train min | " + " | ".join(short(k) for k in keys) + " |",
             "|---|---|---|---|" + "---|" * len(keys)]
    first = next(iter(summary.values()))
    lines.append("| base (start) | | 0 | 0 | " + " | ".join(fmt(first[k]["start"][0]) for k in keys) + " |")
    for variant, row in summary.items():
        cells = [f"{fmt(row[k]['end'][0])} ± {fmt(row[k]['end'][1])}" if row["seeds"] > 1 else fmt(row[k]["end"][0])
                 for k in keys]
        lines.append(f"| {variant} | {row['seeds']} | {row['epochs']:.0f} | {row['minutes']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Per task (held-out accuracy at the end):", "",
              "| variant | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    lines.append("| base (start) | " + " | ".join(fmt(first[f"eval/shapes/{k}"]["start"][0]) for k in KINDS) + " |")
    for variant, row in summary.items():
        lines.append(f"| {variant} | " + " | ".join(fmt(row[f"eval/shapes/{k}"]["end"][0]) for k in KINDS) + " |")
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int], dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (METRIC, *PANEL)
    fig, axes = plt.subplots(2, 5, figsize=(21, 7.5))
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        for (variant, seed), r in sorted(runs.items()):
            ax.plot(r["minutes"], r["series"][key], color=COLORS[variant], marker=".", linewidth=1.2,
                    alpha=0.9 if seed == min(s for v, s in runs if v == variant) else 0.5,
                    label=variant if seed == min(s for v, s in runs if v == variant) else None)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("training minutes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    jobs = jobs_for(args)
    if not args.analyse_only:
        if "artifact" in args.variants:
            ensure_artifact_model(Path(args.artifact_model))
        launch(jobs, args.parallel, keys=("variant", "seed"))
    runs = {}
    for job in jobs:
        found = curve(job["out"])
        if found is None:
            print(f"hacking: no evaluations in {job['out']}; left out", flush=True)
            continue
        runs[(job["variant"], job["seed"])] = found
    if not runs:
        raise SystemExit(f"hacking: no runs with metrics under {args.out}")
    summary = summarise(runs)
    table = markdown(summary)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    budget = f"{args.epochs} epochs" if args.epochs is not None else f"{args.minutes:g} training minutes"
    plot(runs, results / "hacking.png", f"Hacking panel on the shapes model: {budget}, {len(args.seeds)} seed(s)")
    settings = {k: v for k, v in vars(args).items() if k not in ("analyse_only", "reuse")}
    result = {"settings": settings, "summary": summary, "runs": {f"{v}_s{s}": r for (v, s), r in runs.items()},
              "table_md": table}
    (results / "hacking.json").write_text(json.dumps(clean(result), indent=2, default=str) + "\n")
    (results / "hacking.md").write_text("# hacking\n\n" + table + "\n")
    print(table, flush=True)
    return clean(result)


if __name__ == "__main__":
    main()
