"""Which trainer learns fastest here: Flow-GRPO (the main job) and its GRPO-Guard (RatioNorm) and Flow-DPPO
variants against CRD, DiffusionNFT, AWM, DGPO, Diffusion-DPO and D3PO on the shapes model, under the same
training-time budget, seeds and eval set.

Each trainer runs its shipped config (``configs/shapes/<trainer>.yaml``) with the benchmark's common overrides
(``--set``, e.g. ``sampling.precision=bfloat16``), every one on the training reward whose optimum is the gold
(strict accuracy), and the two controls: RAFT (``configs/shapes/raft.yaml``) and continued pretraining on the
renderer's data (``configs/shapes/continued_pretrain.yaml``). Runs are ranked by the gold with every task kind at or
above the base model's. Runs are launched one after another (``--parallel 2`` runs two at a time, each with one
thread) by

    python -m flowrl train configs/shapes/<trainer>.yaml run.output_dir=experiments/out/trainers/<trainer>_s<seed>
        run.seed=<seed> run.max_minutes=<minutes> eval.every_minutes=<...> eval.every_epochs=null eval.at_start=false

(the base model is evaluated once, ``base/``, and is every curve's first point). Evaluation time is excluded from
the budget. Outputs (``--results``, default ``experiments/results``):

- ``trainers.png``: held-out accuracy against (a) training minutes and (b) images sampled (thin lines: seeds,
  thick: their mean);
- ``trainers.json`` / ``trainers.md``: accuracy at 10 and 30 training minutes (mean ± std over seeds, linearly
  interpolated between evaluations), accuracy at equal images, per-task accuracy at the end, seconds per epoch
  (on the runs' training clock), images per training minute, epochs and images in the budget;
- ``--sweep``: each trainer's shipped config and a short sweep of its learning rate and its main coefficient
  (``SWEEP``, one at a time), one seed each, reported in ``trainers_sweep.{json,md}`` (per-kind accuracy and the
  hacking panel beside each); ``--from-sweep`` then runs the ``--best`` trainers, each with its best setting
  (every task kind at or above the base first, then accuracy: :func:`sweep_winners`).

Diffusion-DPO trains on offline pairs: ``--make-pairs`` samples the base model (16 images of each of 128
training prompts, 10-step ODE), scores them with the strict shapes reward and keeps, per prompt with both, up to
4 pairs (a correct image preferred to an incorrect one); the images it sampled are reported beside its row.

    python experiments/trainers.py --make-pairs
    python experiments/trainers.py --sweep --minutes 10 --parallel 2 --set sampling.precision=bfloat16
    python experiments/trainers.py --minutes 10 --seeds 0 1 --parallel 2 --set sampling.precision=bfloat16
    python experiments/trainers.py --minutes 30 --seeds 0 1 --trainers nft awm flow_grpo --tag 30min ...
    python experiments/trainers.py --from-sweep --best 4 --minutes 30 --seeds 0 1 --tag 30min ...  # the sweep's best
    python experiments/trainers.py --analyse-only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

from experiments.runs import (DONE, clean, curve_mean, fmt, interp, launch, mean_std, read_curve,  # noqa: E402
                             restore_record, save_figure)

#: The RL trainers, then the two controls a reviewer asks for at the same budget from the same base: online
#: rejection-sampling fine-tuning (RAFT) and continued pretraining on the renderer's perfect data.
TRAINERS = ("flow_grpo", "grpo_guard", "flow_dppo", "crd", "nft", "awm", "dgpo", "dpo", "d3po")
CONTROLS = ("raft", "continued_pretrain")
# The gold: strict accuracy (rewards/shapes.py), per kind as eval/shapes/<kind>; ranked and selected by it.
METRIC = "eval/shapes/accuracy"
KINDS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# Beside the gold: what a duplicating policy games (the lenient rule) and the habit it buys (extra objects).
HACK_PANEL = {"extra_objects": "hack/extra_object_rate", "lenient_accuracy": "eval/shapes/lenient_accuracy"}
# Every trainer's shipped config trains on the shapes reward whose optimum is the gold (configs/shapes/base/online.yaml:
# strict counts and the no-extra-objects guard as a full constraint); nothing is overridden per trainer.
TRAINER_OVERRIDES: dict[str, list[str]] = {}
COLORS = {"flow_grpo": "tab:blue", "grpo_guard": "tab:cyan", "flow_dppo": "tab:olive", "crd": "tab:orange",
          "nft": "tab:green", "awm": "tab:red", "dgpo": "tab:purple", "dpo": "tab:brown", "d3po": "tab:pink",
          "raft": "tab:gray", "continued_pretrain": "black"}
# The sweep: each trainer's learning rate, then its main coefficient, one at a time around the shipped config.
# Flow-GRPO's shapes config takes one optimizer step per epoch on the samples just drawn, so its ratio is 1 at the
# update and its clip never acts: at 1e-4 it clipped nothing in 24 epochs (the training reward at every epoch and
# the evaluation equal the shipped run's), so a wider clip is not run. GRPO-Guard and Flow-DPPO take two steps; in
# its shipped run GRPO-Guard's clip (4e-4 on the normalised ratio) clipped nothing either, so a wider one is not run.
# Four optimizer steps per epoch (train.minibatches) is where the family's trust regions have the most to do.
SWEEP = {
    "flow_grpo": {"optim.lr": [2.5e-5, 1e-4], "train.clip_range": [1e-4], "train.minibatches": [4]},
    # RatioNorm's clip acts on the normalised ratio: 2e-5 is the authors' 1/50 of Flow-GRPO's range.
    "grpo_guard": {"optim.lr": [2.5e-5, 1e-4], "train.clip_range": [2e-5], "train.minibatches": [4]},
    "flow_dppo": {"optim.lr": [2.5e-5, 1e-4], "train.dppo_threshold": [1e-6, 1e-4], "train.minibatches": [4]},
    "crd": {"optim.lr": [3e-5, 3e-4], "train.beta": [0.3, 3.0]},
    "nft": {"optim.lr": [3e-5, 3e-4], "train.beta": [0.1, 0.3]},
    "awm": {"optim.lr": [1e-5, 1e-4], "train.ema_kl_coef": [0.1, 3.0]},
    "dgpo": {"optim.lr": [3e-5, 3e-4], "train.beta": [10.0, 1000.0]},
    "dpo": {"optim.lr": [3e-5, 3e-4], "train.beta": [100.0, 5000.0]},
    "d3po": {"optim.lr": [3e-5, 3e-4], "train.beta": [0.03, 0.3]},
    "raft": {"optim.lr": [1e-5, 3e-5]},  # 1e-4 and above collapse (configs/shapes/raft.yaml)
    "continued_pretrain": {"optim.lr": [2e-4]},
}
PAIRS = ROOT / "experiments" / "out" / "trainers" / "dpo_pairs"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/trainers.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0,
                   help="training CPU-minutes per run (run.max_minutes, one thread)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS + CONTROLS), choices=list(TRAINERS + CONTROLS))
    p.add_argument("--eval-every-minutes", type=float, default=None, help="default: minutes / 2")
    p.add_argument("--max-epochs", type=int, default=100_000, help="run.max_epochs (default: time-bound)")
    p.add_argument("--num-eval-prompts", type=int, default=300, help="data.num_eval_prompts")
    p.add_argument("--eval-steps", type=int, default=20, help="sampling.eval_num_steps")
    p.add_argument("--model-path", default=None, help="model.path (default: the shipped shapes model)")
    p.add_argument("--pairs", default=str(PAIRS), help="Diffusion-DPO's pair shards (pairs.path)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for every run (repeatable), e.g. --set sampling.precision=bfloat16")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (each with OMP_NUM_THREADS=1)")
    p.add_argument("--tag", default="", help="suffix of the run directories and result files (e.g. 30min)")
    p.add_argument("--out", default=str(ROOT / "experiments" / "out" / "trainers"), help="run directories")
    p.add_argument("--results", default=str(ROOT / "experiments" / "results"), help="where trainers*.* go")
    p.add_argument("--reuse", action="store_true", help="skip runs whose directory already has metrics")
    p.add_argument("--sweep", action="store_true", help="the learning-rate / coefficient sweep (first seed only)")
    p.add_argument("--from-sweep", nargs="?", const="trainers_sweep.json", default=None, metavar="SWEEP_JSON",
                   help="run the sweep's best trainers, each with its best setting (no task kind below the base "
                        "first, then accuracy; default file: "
                        "<results>/trainers_sweep.json); --best sets how many")
    p.add_argument("--best", type=int, default=4, help="--from-sweep: how many trainers (default 4)")
    p.add_argument("--make-pairs", action="store_true", help="write Diffusion-DPO's pairs (--pairs) and stop")
    p.add_argument("--pair-prompts", type=int, default=128, help="--make-pairs: training prompts sampled")
    p.add_argument("--analyse-only", action="store_true", help="train nothing; analyse the runs in --out")
    return p.parse_args(argv)


# ============================================================================ Diffusion-DPO's pairs


def make_pairs(out: Path, *, prompts: int, per_prompt: int = 16, pairs_per_prompt: int = 4, steps: int = 10,
               seed: int = 0, model_path: str | None = None, bf16: bool = False) -> dict:
    """Sample the base model on training prompts (``bf16``: under bfloat16 autocast), score strictly, write
    (correct, incorrect) pairs of each prompt."""
    import numpy as np
    import torch

    import rewards
    from flowrl.data.prompts import load_prompts
    from flowrl.data.webdataset_io import write_pair_shards
    from flowrl.models.shapes import ShapesModel
    from flowrl.eval.generate import generate

    train = load_prompts("shapes:train")
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(len(train), generator=generator)[:prompts].tolist()
    model = ShapesModel.from_pretrained(model_path)
    reward = rewards.load("shapes", count_mode="strict")
    pairs, start = [], time.perf_counter()
    for n, i in enumerate(chosen):
        prompt = train.prompts[i]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            images = generate(model, [prompt] * per_prompt,
                              [seed * 1_000_003 + i * per_prompt + k for k in range(per_prompt)], steps=steps,
                              batch_size=per_prompt)
        correct = reward(images, [prompt] * per_prompt, [train.metadata[i]] * per_prompt).details["correct"].bool()
        good, bad = torch.nonzero(correct).flatten().tolist(), torch.nonzero(~correct).flatten().tolist()
        for k in range(min(len(good), len(bad), pairs_per_prompt)):
            to_uint8 = lambda x: (x.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)  # noqa: E731
            pairs.append((to_uint8(images[good[k]]), to_uint8(images[bad[k]]), prompt,
                          {"kind": train.metadata[i].get("kind"), "prompt_index": i}))
        if (n + 1) % 32 == 0:
            print(f"pairs: {n + 1}/{len(chosen)} prompts, {len(pairs)} pairs", flush=True)
    write_pair_shards(pairs, out)
    info = {"prompts": len(chosen), "images_sampled": len(chosen) * per_prompt, "pairs": len(pairs),
            "steps": steps, "bf16": bf16, "seconds": round(time.perf_counter() - start, 1)}
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# ============================================================================ training


def run_dir(out: Path, trainer: str, seed: int, variant: str = "", tag: str = "") -> Path:
    return out / f"{trainer}{'_' + variant if variant else ''}_s{seed}{'_' + tag if tag else ''}"


def common_overrides(args: argparse.Namespace, trainer: str) -> dict:
    every = args.eval_every_minutes or args.minutes / 2
    if trainer == "continued_pretrain":  # the pretraining recipe's own evaluation section: the same prompts and steps
        return {"run.max_minutes": args.minutes, "run.max_epochs": args.max_epochs, "eval.every_minutes": every,
                "eval.every_epochs": 100_000, "eval.at_start": "false", "eval.num_prompts": args.num_eval_prompts,
                "eval.steps": args.eval_steps, **({"init": args.model_path} if args.model_path else {})}
    overrides = {"run.max_minutes": args.minutes, "run.max_epochs": args.max_epochs, "eval.every_minutes": every,
                 "eval.every_epochs": "null", "eval.at_start": "false", "data.num_eval_prompts": args.num_eval_prompts,
                 "sampling.eval_num_steps": args.eval_steps}
    if args.model_path is not None:
        overrides["model.path"] = args.model_path
    if trainer == "dpo":
        overrides["pairs.path"] = args.pairs
    return overrides


def base_evaluation(args: argparse.Namespace) -> dict | None:
    """The shipped model's evaluation, once (a run of 0 epochs evaluates at its start)."""
    out = Path(args.out) / f"base_{args.num_eval_prompts}x{args.eval_steps}"
    if not (out / "metrics.jsonl").is_file():
        restore_record(out)  # measured on an earlier machine
    if not (out / "metrics.jsonl").is_file() and not args.analyse_only:
        overrides = {**common_overrides(args, "flow_grpo"), "run.max_epochs": 0, "eval.at_start": "true"}
        launch([{"config": ROOT / "configs" / "shapes" / "flow_grpo.yaml", "out": out, "overrides": overrides,
                 "extra": [o for o in args.overrides if not o.startswith("sampling.precision")], "label": "base",
                 "reuse": False, "trainer": "base", "seed": 0, "variant": ""}], 1)
    curve = read_curve(out, METRIC)
    return curve["evals"][0] if curve else None


def jobs_for(args: argparse.Namespace, winners: list[dict] = ()) -> list[dict]:
    """The runs to train: the sweep's (``--sweep``), each of ``winners`` (:func:`sweep_winners`) per seed, or every
    trainer's shipped config per seed."""
    out, jobs = Path(args.out), []

    def add(trainer: str, seed: int, variant: str = "", extra: list[str] = ()) -> None:
        jobs.append({"config": ROOT / "configs" / "shapes" / f"{trainer}.yaml",
                     "out": run_dir(out, trainer, seed, variant, args.tag),
                     "overrides": {**common_overrides(args, trainer), "run.seed": seed},
                     "extra": [*TRAINER_OVERRIDES.get(trainer, []), *args.overrides, *extra],
                     "label": f"trainers: {trainer} {variant} seed {seed}".replace("  ", " "), "reuse": args.reuse,
                     "trainer": trainer, "seed": seed, "variant": variant, "setting": list(extra)})

    if args.sweep:
        # Every shipped config first, then each trainer's first swept setting, and so on: a sweep cut short by
        # the machine still compares every trainer.
        for trainer in args.trainers:
            add(trainer, args.seeds[0])
        variants = {t: [(key, value) for key, values in SWEEP[t].items() for value in values] for t in args.trainers}
        for k in range(max(map(len, variants.values()), default=0)):
            for trainer in args.trainers:
                if k < len(variants[trainer]):
                    key, value = variants[trainer][k]
                    add(trainer, args.seeds[0], f"{key.split('.')[-1]}={value:g}", [f"{key}={value}"])
    elif winners:
        for seed in args.seeds:
            for winner in winners:
                add(winner["trainer"], seed, winner["variant"], winner["overrides"])
    else:
        for seed in args.seeds:  # seed-major: an interrupted benchmark still has every trainer for early seeds
            for trainer in args.trainers:
                add(trainer, seed)
    return jobs


def below_base(value: float, base_value: float) -> bool:
    """A kind's accuracy below the base model's (beyond float rounding): a gain that hides a regression."""
    return value < base_value - 1e-9


def kinds_below_base(run: dict) -> list[str]:
    """The task kinds whose accuracy at a run's last evaluation is below its first (the base model's, which
    :func:`read_curve` puts first): the regressions an average hides."""
    start, end = run["evals"][0], run["evals"][-1]
    return [k for k in KINDS if below_base(float(end.get(f"eval/shapes/{k}", math.nan)),
                                           float(start.get(f"eval/shapes/{k}", math.nan)))]


def sweep_winners(sweep: dict, count: int) -> list[dict]:
    """Each trainer's best setting in a sweep result (``trainers_sweep.json``), the ``count`` best trainers, best
    first: ``[{"trainer", "variant", "overrides", "accuracy", "kinds_below_base"}]`` (``variant`` "" for the
    shipped config).

    Best means: keeps every task kind at or above the base model (a gain that hides a regression is not a gain,
    and ``make demo`` must keep every kind), then the higher accuracy at the last evaluation. A trainer with no
    such setting enters with its most accurate one, after every trainer that has one."""
    def rank(entry: dict) -> tuple[bool, float]:
        return not entry["kinds_below_base"], entry["accuracy"]

    best: dict[str, dict] = {}
    for run in sweep["runs"].values():
        entry = {"trainer": run["trainer"], "variant": run["variant"], "overrides": run["overrides"],
                 "accuracy": run["accuracy"][-1], "kinds_below_base": kinds_below_base(run)}
        if run["trainer"] not in best or rank(entry) > rank(best[run["trainer"]]):
            best[run["trainer"]] = entry
    return sorted(best.values(), key=rank, reverse=True)[:count]


# ============================================================================ analysis


def summarise(runs: dict[tuple[str, int], dict], trainers: list[str], pair_images: float | None) -> dict:
    """Per trainer, mean and std over its seeds; ``unfinished`` counts the runs whose process has not finished
    (``finished`` false: an interim table, their last evaluation is an earlier one), ``*_n`` the seeds whose
    curve reaches each point."""
    equal_images = min(r["images"][-1] for (t, _), r in runs.items() if t != "dpo") if any(
        t != "dpo" for t, _ in runs) else math.nan
    out: dict = {"equal_images": equal_images, "trainers": {}}
    for trainer in trainers:
        mine = [r for (t, _), r in sorted(runs.items()) if t == trainer]
        if not mine:
            continue
        entry: dict = {"seeds": len(mine), "setting": mine[0].get("variant", ""),
                       "unfinished": sum(not r.get("finished", True) for r in mine)}
        for minutes in (10, 30):
            at = [interp(minutes, r["minutes"], r["accuracy"]) for r in mine]
            entry[f"acc_at_{minutes}min"], entry[f"acc_at_{minutes}min_std"] = mean_std(at)
            entry[f"acc_at_{minutes}min_n"] = sum(math.isfinite(x) for x in at)
        entry["acc_at_equal_images"], entry["acc_at_equal_images_std"] = mean_std(
            [interp(equal_images, r["images"], r["accuracy"]) for r in mine])
        entry["acc_final"], entry["acc_final_std"] = mean_std([r["accuracy"][-1] for r in mine])
        for kind in KINDS:
            entry[kind] = mean_std([float(r["evals"][-1].get(f"eval/shapes/{kind}", math.nan)) for r in mine])[0]
        for key, metric in HACK_PANEL.items():  # the hacking panel at the last evaluation: what the accuracy cost
            entry[key], entry[key + "_std"] = mean_std([float(r["evals"][-1].get(metric, math.nan)) for r in mine])
        for key in ("final_images", "final_minutes", "epochs", "epoch_s", "sampling_s", "training_s"):
            entry[key] = mean_std([float(r[key]) for r in mine])[0]
        entry["images_per_min"] = entry["final_images"] / entry["final_minutes"] if entry["final_minutes"] else math.nan
        # On the run's own clock (reference CPU time for the benchmark's runs), unlike epoch_s (wall seconds, which
        # a neighbouring job stretches).
        entry["clock_s_per_epoch"] = 60 * entry["final_minutes"] / entry["epochs"] if entry["epochs"] else math.nan
        if trainer == "dpo" and pair_images:
            entry["offline_images"] = pair_images
        out["trainers"][trainer] = entry
    return out


def per_kind_cell(value: float, base_value: float) -> str:
    """A kind's accuracy for a table, ``*`` when below the base model's: a gain that hides a regression."""
    return fmt(value, 2) + ("*" if below_base(value, base_value) else "")


def markdown(summary: dict, base: dict | None) -> str:
    kinds = " | ".join(KINDS)
    lines = [f"| trainer | seeds | accuracy @ 10 min | accuracy @ 30 min "
             f"| accuracy @ {summary['equal_images']:.0f} images | final | {kinds} | extra objects | lenient acc. "
             "| s / epoch | images / min | epochs | images |",
             "|---|---|---|---|---|---|" + "---|" * len(KINDS) + "---|---|---|---|---|---|"]
    start = {k: (base or {}).get(f"eval/shapes/{k}", math.nan) for k in KINDS}
    if base is not None:
        per_kind = " | ".join(fmt(start[k], 2) for k in KINDS)
        panel = " | ".join(fmt(base.get(metric, math.nan)) for metric in HACK_PANEL.values())
        lines.append(f"| base model | | {fmt(base[METRIC])} | | | | {per_kind} | {panel} | | | 0 | 0 |")
    for trainer, e in summary["trainers"].items():
        def pm(key: str) -> str:
            if not math.isfinite(e[key]):
                return "n/a"
            seeds = e.get(key + "_n", e["seeds"])  # a point not every seed's curve reaches yet says so
            partial = f" ({seeds} of {e['seeds']})" if seeds < e["seeds"] else ""
            return f"{fmt(e[key])} ± {fmt(e[key + '_std'])}{partial}"

        def kind(k: str) -> str:
            return per_kind_cell(e[k], start[k])

        images = fmt(e["final_images"], 0) + (f" (+{e['offline_images']:.0f} offline)" if "offline_images" in e else "")
        name = f"{trainer} ({e['setting']})" if e.get("setting") else trainer
        if e.get("unfinished"):
            name += f", {e['unfinished']} of {e['seeds']} runs unfinished"
        lines.append(f"| {name} | {e['seeds']} | {pm('acc_at_10min')} | {pm('acc_at_30min')} | "
                     f"{pm('acc_at_equal_images')} | {pm('acc_final')} | "
                     + " | ".join(kind(k) for k in KINDS) + f" | {pm('extra_objects')} | {pm('lenient_accuracy')}"
                     + f" | {fmt(e['clock_s_per_epoch'], 1)} | {fmt(e['images_per_min'], 0)} | {fmt(e['epochs'], 1)} "
                     f"| {images} |")
    lines.append("")
    lines.append("Held-out strict accuracy (`eval/shapes/accuracy`, the gold), mean ± std over seeds, linearly "
                 "interpolated between evaluations; per-task strict accuracies (* below the base model), the "
                 "extra-object rate (the hacking panel) and the lenient rule's accuracy (a proxy duplicates game) at "
                 "each run's last evaluation (mean over seeds); seconds per epoch and images per minute "
                 "on the runs' training clock (evaluation excluded): training minutes x 60 / epochs, images "
                 "sampled / training minutes.")
    return "\n".join(lines)


def sweep_markdown(runs: dict[tuple[str, str], dict], base: dict | None = None) -> str:
    """The sweep's tables: each trainer's best setting (:func:`sweep_winners`, best first), then a row per run;
    each row with its accuracy, per-kind accuracy (``*`` below the base) and the hacking panel at its last
    evaluation."""
    kinds = " | ".join(KINDS)
    columns = (f"| accuracy at the end | {kinds} | extra objects | lenient acc. | training minutes | epochs | images |",
               "---|" * (len(KINDS) + 6))

    def cells(r: dict) -> str:
        end = r["evals"][-1]

        def kind(k: str) -> str:
            value, start = end.get(f"eval/shapes/{k}", math.nan), (base or {}).get(f"eval/shapes/{k}", math.nan)
            return per_kind_cell(value, start)

        return (f"{fmt(r['accuracy'][-1])} | " + " | ".join(kind(k) for k in KINDS)
                + f" | {fmt(end.get('hack/extra_object_rate', math.nan))} "
                f"| {fmt(end.get('eval/shapes/lenient_accuracy', math.nan))} | {fmt(r['final_minutes'], 1)} "
                f"| {r['epochs']} | {r['final_images']:.0f} |")

    winners = sweep_winners({"runs": {f"{t} {v}": r for (t, v), r in runs.items()}}, len(runs))
    lines = [f"| rank | trainer | best setting {columns[0]}", "|---|---|---|" + columns[1]]
    for rank, w in enumerate(winners, 1):
        lines.append(f"| {rank} | {w['trainer']} | {w['variant'] or 'shipped config'} | "
                     + cells(runs[(w["trainer"], w["variant"])]))
    lines += ["", "Each trainer's best setting: every task kind at or above the base model first, then the accuracy "
              "at the end (`--from-sweep` runs the first `--best` of them at the comparison's budget).", "",
              f"| trainer | setting {columns[0]}", "|---|---|" + columns[1]]
    for (trainer, variant), r in sorted(runs.items()):
        lines.append(f"| {trainer} | {variant or 'shipped config'} | " + cells(r))
    lines.append("")
    lines.append("Held-out strict accuracy (`eval/shapes/accuracy`, the gold) and per-kind strict accuracy at each "
                 "run's last evaluation (* below the base model); extra objects from the hacking panel; the lenient "
                 "rule's accuracy beside them.")
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int], dict], summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in ((axes[0], "minutes", "reference CPU-minutes of training (evaluation excluded)"),
                           (axes[1], "images", "images sampled")):
        for trainer in summary["trainers"]:
            mine = [r for (t, _), r in sorted(runs.items()) if t == trainer]
            if key == "images" and trainer == "dpo":
                continue  # offline: it samples nothing while it trains
            color = COLORS.get(trainer)
            for r in mine:
                ax.plot(r[key], r["accuracy"], color=color, alpha=0.35, linewidth=0.8, marker=".", markersize=3)
            grid, means = curve_mean(mine, key)
            seeds = f"{len(mine)} seed{'s' * (len(mine) > 1)}"
            setting = summary["trainers"][trainer].get("setting")
            name = f"{trainer} {setting}" if setting else trainer
            ax.plot(grid, means, color=color, linewidth=2.2, label=f"{name} ({seeds})")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("(a) accuracy vs training time")
    axes[1].set_title("(b) accuracy vs images sampled (Diffusion-DPO: offline)")
    fig.suptitle(title)
    save_figure(fig, path)


# ============================================================================ main


def main(argv: list[str] | None = None) -> dict:
    """Train (unless ``--analyse-only``), analyse, plot; returns the result dict (also written as JSON)."""
    args = parse_args(argv)
    out, results = Path(args.out), Path(args.results)
    if args.make_pairs:
        info = make_pairs(Path(args.pairs), prompts=args.pair_prompts, model_path=args.model_path,
                          bf16=any(o == "sampling.precision=bfloat16" for o in args.overrides))
        print(json.dumps(info), flush=True)
        return info
    winners = []
    if args.from_sweep and not args.sweep:
        path = Path(args.from_sweep) if Path(args.from_sweep).is_absolute() else results / args.from_sweep
        if not path.is_file():
            raise SystemExit(f"trainers: --from-sweep needs the sweep's results ({path}); run --sweep first")
        winners = sweep_winners(json.loads(path.read_text()), args.best)
        args.trainers = [w["trainer"] for w in winners]
        print("trainers: the sweep's best: " + ", ".join(
            f"{w['trainer']} {w['variant'] or '(shipped)'} {w['accuracy']:.3f}"
            + (f" (below the base: {' '.join(w['kinds_below_base'])})" if w["kinds_below_base"] else "")
            for w in winners), flush=True)
    base = base_evaluation(args)
    jobs = jobs_for(args, winners)
    launched = [] if args.analyse_only else launch(jobs, args.parallel)
    runs = {}
    for job in jobs:
        if not (job["out"] / "metrics.jsonl").is_file():
            restore_record(job["out"])  # a run finished on an earlier machine
        curve = read_curve(job["out"], METRIC, initial=base)
        if curve is None:
            print(f"trainers: no evaluated metrics in {job['out']}; left out", flush=True)
            continue
        curve.pop("rows")
        curve.update(trainer=job["trainer"], variant=job["variant"], overrides=job["setting"],
                     finished=(job["out"] / DONE).is_file())
        runs[(job["trainer"], job["variant"] if args.sweep else job["seed"])] = curve
    if not runs:
        raise SystemExit(f"trainers: no runs with metrics under {out}")
    results.mkdir(parents=True, exist_ok=True)
    name = "trainers_sweep" if args.sweep else "trainers" + (f"_{args.tag}" if args.tag else "")
    settings = {**{k: v for k, v in vars(args).items() if k not in ("analyse_only", "reuse")}, "winners": winners}
    if args.sweep:
        table = sweep_markdown(runs, base)
        result = {"settings": settings, "launched": launched, "runs": {f"{t} {v}": r for (t, v), r in runs.items()},
                  "table_md": table}
    else:
        pair_info = Path(args.pairs) / "info.json"
        pair_images = json.loads(pair_info.read_text())["images_sampled"] if pair_info.is_file() else None
        summary = summarise(runs, args.trainers, pair_images)
        table = markdown(summary, base)
        plot(runs, summary, results / f"{name}.png",
             f"Trainers on the shapes model: {args.minutes:g} reference CPU-minutes of training, one thread, "
             f"{len(args.seeds)} seed(s)")
        result = {"settings": settings, "launched": launched, "base": base, "summary": summary,
                  "runs": {f"{t}_s{s}": r for (t, s), r in runs.items()}, "table_md": table,
                  "figure": str(results / f"{name}.png")}
    (results / f"{name}.json").write_text(json.dumps(clean(result), indent=2, default=str) + "\n")
    (results / f"{name}.md").write_text(f"# {name}\n\n" + table + "\n")
    print(table, flush=True)
    return clean(result)


if __name__ == "__main__":
    main()
