"""Where RL helps the Shapes-VQA agent, at equal compute: continued SFT, rejection-sampling fine-tuning (RFT) and
GRPO from the same checkpoint, in and out of distribution; and the zoom agent (``--task zoom``): GiGPO against SFT
on zoom demonstrations.

Each method runs its shipped config for ``--minutes`` reference CPU-minutes (one thread), two seeds, on the named
held-out split (``--heldout``, default the split the shipped model was trained on: no training question asks one
of its combinations):

- ``sft``: ``configs/vlm/shapes_vqa_sft_continued.yaml`` (``init_from``, ``data.heldout_combinations``);
- ``rft``: ``configs/vlm/shapes_vqa_rft.yaml`` (``model.path``, ``env.heldout_combinations``);
- ``grpo``: ``configs/vlm/shapes_vqa_grpo.yaml`` (the same);
- ``grpo_episodes``: ``configs/vlm/shapes_vqa_grpo_episodes.yaml``, the task shaped for RL (two questions per episode,
  rewarded only when both are right, step credit; the same).

Every run evaluates at its start and about every 5 minutes: ``eval/vqa/accuracy`` (in distribution: training
questions on scenes of their own stream) and ``eval/vqa_heldout/accuracy`` (the held-out combinations only), per
kind. ``--init DIR`` starts every method from another checkpoint (e.g. an SFT plateau) instead of the shipped model;
``--tag`` names that comparison's folders and files.

``--task zoom`` compares, on the zoom tool's tasks (``eval/zoom/``, 200 held-out tasks), ``sft``
(``configs/vlm/shapes_zoom_sft.yaml``: half zoom demonstrations, half Shapes-VQA, run for the same budget with its
cosine over it) and ``gigpo`` (``configs/vlm/shapes_zoom_gigpo.yaml``); its folders and files start with ``zoom``.

Outputs in ``--results``: ``vlm_compare[_TAG].json``, ``.md`` (the equal-compute table: start and end per split,
mean and std over seeds, per kind, and RL's margin over continued SFT) and ``.png`` (accuracy against training
minutes, in distribution and held out).

    python experiments/vlm_compare.py --seeds 0 1 --minutes 30
    python experiments/vlm_compare.py --init runs/sft_plateau/model --tag plateau
    python experiments/vlm_compare.py --analyse-only
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

from experiments.runs import clean, fmt, launch, mean_std, read_curve, save_figure  # noqa: E402

# Per task: each method's config and the evaluations compared (name -> metric prefix).
TASKS = {
    "vqa": {"methods": {"sft": "shapes_vqa_sft_continued.yaml", "rft": "shapes_vqa_rft.yaml",
                        "grpo": "shapes_vqa_grpo.yaml", "grpo_episodes": "shapes_vqa_grpo_episodes.yaml"},
            "splits": {"in distribution": "eval/vqa/", "held-out combinations": "eval/vqa_heldout/"}},
    "zoom": {"methods": {"sft": "shapes_zoom_sft.yaml", "gigpo": "shapes_zoom_gigpo.yaml"},
             "splits": {"zoom tasks": "eval/zoom/"}},
}
# The zoom SFT stage as a 30-minute run: its epochs (~2.5 reference CPU-minutes each) fill the budget, evaluated as
# often and on as many tasks as GiGPO.
ZOOM_SFT = ["run.max_epochs=12", "eval.every_epochs=2", "eval.at_start=true", "eval.num_zoom_examples=200"]
# The default split's held-out combinations (configs/vlm/shapes_vqa_sft_heldout.yaml): the shipped model's data.
HELDOUT = ("blue circle, green circle, green triangle, red circle, red square, circle left of square, "
           "circle right of triangle, square above triangle")
COLORS = {"sft": "black", "rft": "tab:orange", "grpo": "tab:blue", "grpo_episodes": "tab:purple", "gigpo": "tab:green"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/vlm_compare.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="vqa", choices=list(TASKS))
    p.add_argument("--methods", nargs="+", default=None,
                   choices=sorted({m for t in TASKS.values() for m in t["methods"]}), help="default: the task's all")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--minutes", type=float, default=30.0, help="reference CPU-minutes per run (one thread)")
    p.add_argument("--heldout", default=HELDOUT, help="the held-out combinations, comma-separated")
    p.add_argument("--init", default=None, help="start every method from this model folder (default: shipped)")
    p.add_argument("--tag", default="", help="suffix of the run folders and result files (e.g. plateau)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for every run (repeatable)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (each one thread)")
    p.add_argument("--reuse", action="store_true", help="keep finished runs, resume interrupted ones")
    p.add_argument("--out", default=str(ROOT / "experiments" / "out" / "vlm_compare"), help="run folders")
    p.add_argument("--results", default=str(ROOT / "experiments" / "results"), help="where vlm_compare*.* go")
    p.add_argument("--analyse-only", action="store_true", help="train nothing; analyse the runs in --out")
    args = p.parse_args(argv)
    known = TASKS[args.task]["methods"]
    args.methods = args.methods or list(known)
    if any(m not in known for m in args.methods):
        p.error(f"--task {args.task} compares {', '.join(known)}")
    return args


def prefix(task: str) -> str:
    """The run folders' and result files' prefix of a task: none for Shapes-VQA, ``zoom_`` for the zoom agent."""
    return "" if task == "vqa" else f"{task}_"


def run_name(method: str, seed: int, tag: str = "", task: str = "vqa") -> str:
    return f"{prefix(task)}{method}{'_' + tag if tag else ''}_s{seed}"


def method_overrides(args: argparse.Namespace, method: str) -> list[str]:
    """The split and the starting checkpoint, in each recipe's own keys."""
    combos = f"[{args.heldout}]"
    if args.task == "zoom":
        start = [f"init_from={args.init}" if method == "sft" else f"model.path={args.init}"] if args.init else []
        return (ZOOM_SFT if method == "sft" else []) + start + list(args.overrides)
    if method == "sft":
        out = [f"data.heldout_combinations={combos}"] + ([f"init_from={args.init}"] if args.init else [])
    else:
        out = [f"env.heldout_combinations={combos}"] + ([f"model.path={args.init}"] if args.init else [])
    return out + list(args.overrides)


def jobs_for(args: argparse.Namespace) -> list[dict]:
    """Seed-major: an interrupted comparison still has every method for its first seed."""
    jobs = []
    for seed in args.seeds:
        for method in args.methods:
            name = run_name(method, seed, args.tag, args.task)
            overrides = {"run.seed": seed, "run.max_minutes": args.minutes}
            if method != "sft":  # the SFT config bounds its epochs to fit the budget (its cosine anneals over them)
                overrides["run.max_epochs"] = 100_000
            jobs.append({"config": ROOT / "configs" / "vlm" / TASKS[args.task]["methods"][method],
                         "out": Path(args.out) / name,
                         "overrides": overrides, "extra": method_overrides(args, method),
                         "label": f"vlm_compare: {name}", "reuse": args.reuse, "method": method, "seed": seed})
    return jobs


def split_curve(directory: Path, prefix: str) -> dict | None:
    """One split's evaluations of a run: minutes, overall accuracy, and the per-kind accuracies at each."""
    curve = read_curve(directory, prefix + "accuracy")
    if curve is None:
        return None
    kinds = sorted({k[len(prefix):] for row in curve["evals"] for k in row if k.startswith(prefix)
                    and "/" not in k[len(prefix):] and k[len(prefix):] not in ("accuracy", "scene_f1", "all_right",
                                                                                "malformed_frac", "turn_limit_frac")})
    return {"minutes": curve["minutes"], "accuracy": curve["accuracy"],
            "kinds": {k: [float(r.get(prefix + k, math.nan)) for r in curve["evals"]] for k in kinds}}


def collect(out: Path, tag: str, task: str = "vqa") -> dict:
    runs = {}
    for method in TASKS[task]["methods"]:
        for folder in sorted(out.glob(f"{prefix(task)}{method}{'_' + tag if tag else ''}_s*")):
            seed = folder.name.rpartition("_s")[2]
            if not seed.isdigit():
                continue
            splits = {name: split_curve(folder, key) for name, key in TASKS[task]["splits"].items()}
            if all(s is not None for s in splits.values()):
                runs[folder.name] = {"method": method, "seed": int(seed), "splits": splits}
    return runs


def summary(runs: dict, task: str = "vqa") -> dict:
    """Per method and split: start and end accuracy (mean, std over seeds), per kind at the end, and per seed."""
    out, splits = {}, TASKS[task]["splits"]
    for method in TASKS[task]["methods"]:
        mine = [r for r in runs.values() if r["method"] == method]
        if not mine:
            continue
        out[method] = {}
        for split in splits:
            curves = [r["splits"][split] for r in mine]
            kinds = sorted({k for c in curves for k in c["kinds"]})
            out[method][split] = {
                "seeds": [r["seed"] for r in mine],
                "start": mean_std([c["accuracy"][0] for c in curves]),
                "end": mean_std([c["accuracy"][-1] for c in curves]),
                "end_minutes": mean_std([c["minutes"][-1] for c in curves]),
                "kinds_end": {k: mean_std([c["kinds"].get(k, [math.nan])[-1] for c in curves]) for k in kinds}}
    for method in (m for m in TASKS[task]["methods"] if m != "sft"):
        if method in out and "sft" in out:
            for split in splits:
                out[method][split]["margin_over_sft"] = out[method][split]["end"][0] - out["sft"][split]["end"][0]
    return out


def markdown(result: dict, args: argparse.Namespace) -> str:
    start = f"`{args.init}`" if args.init else "the shipped model"
    compared = {"vqa": "continued SFT, rejection sampling and GRPO", "zoom": "SFT on zoom demonstrations and GiGPO"}
    lines = [f"# Equal compute: {compared[args.task]} from {start}", "",
             f"{args.minutes:g} reference CPU-minutes per run (one thread); accuracy at the start and at the last "
             "evaluation, mean ± std over seeds; the margin is the method's end minus SFT's.", ""]
    for split in TASKS[args.task]["splits"]:
        rows = [(m, s[split]) for m, s in result["summary"].items()]
        kinds = sorted({k for _, s in rows for k in s["kinds_end"]})
        lines += [f"## {split}", "", "| method | seeds | start | end | margin over SFT | " + " / ".join(kinds)
                  + " at the end |", "|---|---|---|---|---|---|"]
        for method, s in rows:
            margin = s.get("margin_over_sft")
            lines.append(f"| {method} | {len(s['seeds'])} | {fmt(s['start'][0])} | {fmt(s['end'][0])} ± "
                         f"{fmt(s['end'][1])} | {'' if margin is None else f'{margin:+.3f}'} | "
                         + " / ".join(fmt(s["kinds_end"].get(k, (math.nan,))[0], 2) for k in kinds) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(runs: dict, path: Path, splits: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(splits), figsize=(5.2 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        labelled = set()
        for r in runs.values():
            c = r["splits"][split]
            ax.plot(c["minutes"], c["accuracy"], "-o", ms=3, color=COLORS[r["method"]],
                    label=None if r["method"] in labelled else r["method"])
            labelled.add(r["method"])
        ax.set_title(split)
        ax.set_xlabel("training reference CPU-minutes")
        ax.set_ylabel("accuracy")
        ax.legend(fontsize=8)
    save_figure(fig, path)


def analyse(args: argparse.Namespace) -> dict:
    runs = collect(Path(args.out), args.tag, args.task)
    result = {"settings": {k: v for k, v in vars(args).items() if k != "analyse_only"}, "runs": runs,
              "summary": summary(runs, args.task)}
    results = Path(args.results)
    name = f"vlm_compare_{prefix(args.task)}".rstrip("_") + (f"_{args.tag}" if args.tag else "")
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(clean(result), indent=1) + "\n")
    (results / f"{name}.md").write_text(markdown(result, args))
    if runs:
        plot(runs, results / f"{name}.png", TASKS[args.task]["splits"])
    print(f"vlm_compare: {len(runs)} runs analysed; wrote {results}/{name}.{{json,md,png}}")
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.analyse_only:
        launch(jobs_for(args), args.parallel, keys=("method", "seed"))
    return analyse(args)


if __name__ == "__main__":
    main()
