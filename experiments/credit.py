"""Credit assignment on the shapes model: outcome (Flow-GRPO) vs TP-GRPO vs dense cosine credit.

Trains each method with the same seeds and the same compute budget (``run.max_minutes`` of training time,
evaluation excluded, see ``flowrl.run.runtime.Deadline``), one run after another, by launching

    python -m flowrl train configs/shapes/<config>.yaml run.output_dir=experiments/out/credit/<method>_s<seed>
        run.seed=<seed> run.max_minutes=<minutes> eval.every_minutes=<...> eval.every_epochs=null ...

(``outcome`` -> ``flow_grpo.yaml``, ``tp_grpo`` -> ``tp_grpo.yaml``, ``cosine`` -> ``cosine_grpo.yaml``; the
three differ only in ``advantage``; ``shuffled``, the random-advantage control, is ``flow_grpo.yaml`` with
``advantage.shuffle=true``). Evaluation runs on a training-time schedule, so every method gets
held-out points at the same minutes whatever its epoch length. Then it reads each run's ``metrics.jsonl`` and
writes

- ``experiments/results/credit.png``: held-out accuracy (``eval/shapes/accuracy``) against (a) images sampled
  and (b) training wall time, one panel each (thin lines: seeds; thick: their mean);
- ``experiments/results/credit.json`` and ``credit.md``: accuracy at equal images (the fewest images any run
  sampled) and at equal time (the shortest training time of any run), mean and std over seeds, linearly
  interpolated between evaluations; and the cost per epoch: seconds, the advantage step's seconds, and
  TP-GRPO's extra model evaluations (the logged ``credit/extra_nfe`` when the recipe logs it, else computed
  from the run's saved config as ``samples x sum over trained steps of the remaining steps``).

Run (the full benchmark takes ``len(methods) x len(seeds) x minutes`` plus evaluation)::

    python experiments/credit.py --minutes 30 --seeds 0 1 2
    python experiments/credit.py --analyse-only            # re-plot existing runs
    python experiments/credit.py --model-path DIR --minutes 0.05 --max-epochs 2 --num-eval-prompts 4 \\
        --set sampling.num_steps=3 --set sampling.group_size=2 ...       # smoke test on a tiny model
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

from experiments.runs import clean, curve_mean, interp, mean_std, read_curve, save_figure, train_run  # noqa: E402
from experiments.runs import fmt as _fmt  # noqa: E402
from experiments.runs import median as _median  # noqa: E402

CONFIGS = {"outcome": "flow_grpo", "tp_grpo": "tp_grpo", "cosine": "cosine_grpo", "shuffled": "flow_grpo"}
# The control: outcome credit with the epoch's advantages randomly permuted across samples, so the update
# has the same size and noise but no information; whatever it gains is not learning from the reward.
METHOD_OVERRIDES = {"shuffled": ["advantage.shuffle=true"]}
METRIC = "eval/shapes/accuracy"
COLORS = {"outcome": "tab:blue", "tp_grpo": "tab:red", "cosine": "tab:green", "shuffled": "tab:gray"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/credit.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0,
                   help="training CPU-minutes per run (run.max_minutes, one thread)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--eval-every-minutes", type=float, default=None,
                   help="evaluation interval in training minutes (default minutes / 8)")
    p.add_argument("--max-epochs", type=int, default=100_000, help="run.max_epochs (default: time-bound)")
    p.add_argument("--num-eval-prompts", type=int, default=None, help="data.num_eval_prompts (config: 600)")
    p.add_argument("--model-path", default=None, help="model.path (default: the shipped shapes model)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for every run (repeatable), e.g. --set sampling.batch_size=32")
    p.add_argument("--out", default=str(ROOT / "experiments" / "out" / "credit"), help="run directories")
    p.add_argument("--results", default=str(ROOT / "experiments" / "results"), help="where credit.* go")
    p.add_argument("--reuse", action="store_true", help="skip runs whose directory already has metrics")
    p.add_argument("--analyse-only", action="store_true", help="train nothing; analyse the runs in --out")
    return p.parse_args(argv)


# ============================================================================ training


def run_dir(out: Path, method: str, seed: int) -> Path:
    return out / f"{method}_s{seed}"


def train(method: str, seed: int, args: argparse.Namespace) -> dict:
    """One training run as a subprocess; its log goes to ``<run dir>/train.log``."""
    out = run_dir(Path(args.out), method, seed)
    every = args.eval_every_minutes or args.minutes / 8
    overrides = {
        "run.seed": seed, "run.max_minutes": args.minutes, "run.max_epochs": args.max_epochs,
        "eval.every_minutes": every, "eval.every_epochs": "null",
    }
    if args.num_eval_prompts is not None:
        overrides["data.num_eval_prompts"] = args.num_eval_prompts
    if args.model_path is not None:
        overrides["model.path"] = args.model_path
    result = train_run(ROOT / "configs" / "shapes" / f"{CONFIGS[method]}.yaml", out, overrides,
                       [*METHOD_OVERRIDES.get(method, []), *args.overrides], reuse=args.reuse,
                       label=f"credit: {method} seed {seed}")
    return {"method": method, "seed": seed, **result}


# ============================================================================ analysis


def _analytic_extra_nfe(directory: Path) -> float:
    """TP-GRPO's completion cost per epoch from the run's saved config (fixed windows)."""
    import yaml

    cfg = yaml.safe_load((directory / "config.yaml").read_text())
    if cfg.get("advantage", {}).get("estimator") != "tp_grpo":
        return 0.0
    s = cfg["sampling"]
    T, window = int(s["num_steps"]), s.get("window") or {}
    start = int(window.get("start") or 0)
    size = window.get("size")
    n = (T - 1 - start) if size is None else int(size)
    return float(s["groups_per_epoch"] * s["group_size"] * sum(T - start - t for t in range(n)))


def load_run(directory: Path) -> dict | None:
    curve = read_curve(directory, METRIC)
    if curve is None:
        return None
    rows = curve.pop("rows")
    steady = rows[1:] or rows
    logged_nfe = [r["credit/extra_nfe"] for r in steady if "credit/extra_nfe" in r]
    samples_per_epoch = None
    num_steps = None
    if (directory / "config.yaml").is_file():
        import yaml

        cfg = yaml.safe_load((directory / "config.yaml").read_text())
        samples_per_epoch = cfg["sampling"]["groups_per_epoch"] * cfg["sampling"]["group_size"]
        num_steps = cfg["sampling"]["num_steps"]
    extra_nfe = _median(logged_nfe) if logged_nfe else (
        _analytic_extra_nfe(directory) if (directory / "config.yaml").is_file() else math.nan)
    curve.pop("evals")
    return {
        **curve,
        "extra_nfe_per_epoch": extra_nfe,
        "extra_nfe_source": "logged" if logged_nfe else "config",
        "rollout_nfe_per_epoch": float(samples_per_epoch * num_steps) if samples_per_epoch else math.nan,
        "tp_rate": _median([r["credit/tp_rate"] for r in steady if "credit/tp_rate" in r]),
    }


def summarise(runs: dict[tuple[str, int], dict], methods: list[str]) -> dict:
    """Accuracy at equal images / equal time and per-epoch cost, per method (mean and std over seeds)."""
    equal_images = min(r["images"][-1] for r in runs.values())
    equal_minutes = min(r["minutes"][-1] for r in runs.values())
    out: dict = {"equal_images": equal_images, "equal_minutes": equal_minutes, "methods": {}}
    for method in methods:
        mine = [r for (m, _), r in sorted(runs.items()) if m == method]
        if not mine:
            continue
        at_images = [interp(equal_images, r["images"], r["accuracy"]) for r in mine]
        at_minutes = [interp(equal_minutes, r["minutes"], r["accuracy"]) for r in mine]
        final = [r["accuracy"][-1] for r in mine]
        initial = [r["accuracy"][0] for r in mine]
        entry = {"seeds": len(mine)}
        for key, values in (("acc_at_equal_images", at_images), ("acc_at_equal_minutes", at_minutes),
                            ("acc_final", final), ("acc_initial", initial)):
            entry[key], entry[key + "_std"] = mean_std(values)
        for key in ("final_images", "final_minutes", "epochs", "epoch_s", "advantages_s", "sampling_s",
                    "training_s", "extra_nfe_per_epoch", "rollout_nfe_per_epoch", "tp_rate"):
            entry[key] = mean_std([float(r[key]) for r in mine])[0]
        out["methods"][method] = entry
    base = out["methods"].get("outcome")
    for method, entry in out["methods"].items():
        if base is not None:
            entry["extra_epoch_s_vs_outcome"] = entry["epoch_s"] - base["epoch_s"]
            entry["extra_advantages_s_vs_outcome"] = entry["advantages_s"] - base["advantages_s"]
        nfe, rollout = entry["extra_nfe_per_epoch"], entry["rollout_nfe_per_epoch"]
        entry["extra_nfe_vs_rollout"] = nfe / rollout if rollout and math.isfinite(rollout) else math.nan
    return out


def markdown(summary: dict) -> str:
    ei, em = summary["equal_images"], summary["equal_minutes"]
    lines = [
        f"| method | seeds | accuracy @ {ei:.0f} images | accuracy @ {em:.1f} train min | final accuracy "
        f"| images in budget | epochs | s / epoch | advantage s / epoch | extra s / epoch vs outcome "
        f"| extra NFE / epoch (x rollout) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, e in summary["methods"].items():
        lines.append(
            f"| {method} | {e['seeds']} | {_fmt(e['acc_at_equal_images'])} ± {_fmt(e['acc_at_equal_images_std'])} "
            f"| {_fmt(e['acc_at_equal_minutes'])} ± {_fmt(e['acc_at_equal_minutes_std'])} "
            f"| {_fmt(e['acc_final'])} ± {_fmt(e['acc_final_std'])} | {_fmt(e['final_images'], 0)} "
            f"| {_fmt(e['epochs'], 1)} | {_fmt(e['epoch_s'], 2)} | {_fmt(e['advantages_s'], 2)} "
            f"| {_fmt(e.get('extra_epoch_s_vs_outcome', math.nan), 2)} "
            f"| {_fmt(e['extra_nfe_per_epoch'], 0)} ({_fmt(e['extra_nfe_vs_rollout'], 2)}x) |")
    lines.append("")
    lines.append("Accuracy: held-out `eval/shapes/accuracy`, mean ± std over seeds, linearly interpolated between "
                 "evaluations. Equal images = the fewest images any run sampled; equal time = the shortest training "
                 "time (evaluation excluded) of any run. Per-epoch times are medians over epochs after the first.")
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int], dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label, budget in ((axes[0], "images", "images sampled", summary["equal_images"]),
                                   (axes[1], "minutes", "training wall time (min, evaluation excluded)",
                                    summary["equal_minutes"])):
        for method in summary["methods"]:
            mine = [r for (m, _), r in sorted(runs.items()) if m == method]
            color = COLORS.get(method)
            for r in mine:
                ax.plot(r[key], r["accuracy"], color=color, alpha=0.3, linewidth=0.8)
            grid, means = curve_mean(mine, key)
            seeds = f"{len(mine)} seed{'s' if len(mine) > 1 else ''}"
            ax.plot(grid, means, color=color, linewidth=2.2, label=f"{method} ({seeds})")
        ax.axvline(budget, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("(a) accuracy vs images sampled")
    axes[1].set_title("(b) accuracy vs training time")
    control = " (grey: random-advantage control)" if any(m == "shuffled" for m, _ in runs) else ""
    fig.suptitle(f"Credit assignment on the shapes model: outcome vs TP-GRPO vs cosine{control}")
    save_figure(fig, path)


# ============================================================================ main


def main(argv: list[str] | None = None) -> dict:
    """Train (unless ``--analyse-only``), analyse, plot; returns the result dict (also written as JSON)."""
    args = parse_args(argv)
    out = Path(args.out)
    launched = []
    if not args.analyse_only:
        for seed in args.seeds:  # seed-major: an interrupted benchmark still has every method for early seeds
            for method in args.methods:
                launched.append(train(method, seed, args))
    runs = {}
    for method in args.methods:
        for seed in args.seeds:
            data = load_run(run_dir(out, method, seed))
            if data is None:
                print(f"credit: no evaluated metrics in {run_dir(out, method, seed)}; left out", flush=True)
            else:
                runs[(method, seed)] = data
    if not runs:
        raise SystemExit(f"credit: no runs with metrics under {out}")
    summary = summarise(runs, args.methods)
    table = markdown(summary)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    figure = results / "credit.png"
    plot(runs, summary, figure)
    result = {
        "settings": {"minutes": args.minutes, "seeds": args.seeds, "methods": args.methods,
                     "eval_every_minutes": args.eval_every_minutes or args.minutes / 8,
                     "max_epochs": args.max_epochs, "num_eval_prompts": args.num_eval_prompts,
                     "model_path": args.model_path, "overrides": args.overrides, "out": str(out)},
        "launched": launched,
        "summary": summary,
        "runs": {f"{m}_s{s}": r for (m, s), r in runs.items()},
        "table_md": table,
        "figure": str(figure),
    }
    (results / "credit.json").write_text(json.dumps(clean(result), indent=2) + "\n")
    (results / "credit.md").write_text("# Credit assignment benchmark (shapes)\n\n" + table + "\n")
    print(table, flush=True)
    return clean(result)


if __name__ == "__main__":
    main()
