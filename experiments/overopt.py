"""Reward over-optimisation under RL: DGPO, Flow-GRPO and the reward-gradient trainers (ReFL, DRaFT-K,
Direct-Align) trained on learned proxies of the shapes world's gold.

The design of Gao, Schulman & Hilton 2023 ("Scaling laws for reward model overoptimization"): the gold is a judge
never trained on (strict accuracy, :func:`rewards.shapes.strict_correct`), the proxy a reward model learned from
``n`` gold labels (:mod:`rewards.shapes_proxy`, trained by ``flowrl train-reward shapes-proxy``), and everything is
read against the distance ``d`` the policy moved from the base.

**Runs.** For each method (``configs/shapes/<method>.yaml``), proxy size ``n``, seed and mitigation, one run trains
on the proxy ``<proxies>/n<n>_s<seed>`` for ``--minutes`` reference CPU-minutes (one thread) and evaluates every
``--eval-every`` minutes (and at its start) on ``--eval-prompts`` held-out prompts, logging:

- the gold (``eval/shapes/accuracy``, per kind) and the proxy it trains on, on the same images
  (``eval/shapes_proxy/mean``, through ``reward.eval``);
- two gold-free signals (``reward.heldout``): a held-out proxy of the same ``n`` and another seed,
  ``<proxies>/n<n>_s3`` (``hack/heldout/heldout_proxy/mean``), and the ensemble of seeds 0-2
  (``hack/heldout/ensemble/mean`` and its members' disagreement ``.../std``);
- the distance to the base: ``hack/kl_to_base`` for Flow-GRPO's SDE rollouts (a transition density), and the
  flow-matching distance ``hack/fm_to_base`` for the ODE trainers (which have none); ``d`` is the square root of
  either (for Gaussian transitions of one variance the KL is proportional to the squared mean difference).

Mitigations (``MITIGATIONS``): ``none`` (no regulariser: ``train.kl_coef=0``), ``kl`` (``train.kl_coef``,
``--kl-coef``), ``ensemble`` (training on the three seeds' ensemble scored ``mean - k std``, Coste et al. 2024),
``elastic_reset`` (Flow-GRPO only: the policy reset to its EMA and the EMA to the base every few epochs, Noukhovitch
et al. 2023), and ``early_stop``, which trains nothing: it replays ``run.stop_on`` (:class:`flowrl.run.harness.
EarlyStop`, on the held-out proxy, ``--patience``) over the ``none`` runs' evaluations and keeps the best one, as a
run with ``run.stop_on`` would.

**Analysis** (``--analyse-only`` redoes it from the run folders or their committed records):

- per run: peak gold (the start included) and final gold, and Gao et al.'s RL form
  ``gold(d) - gold(0) = d (a - b log d)`` fitted by least squares (peak at ``d* = exp(a / b - 1)``);
- per method, size and mitigation: peak and final gold, mean and std over seeds, and whether the mitigation beats
  ``none`` on **both** peak and final gold by one standard error of the gold (binomial, ``--eval-prompts``) on every
  seed;
- the detector: for each gold-free signal (``SIGNALS``), the evaluation its stopping rule keeps and the one it stops
  at, against the gold's peak (lead < 0 < lag, in evaluations and epochs), and the gold lost by keeping it.

Outputs in ``--results``: ``overopt.json``, ``overopt.md`` (the tables), ``overopt.png`` (gold and proxy against
``d`` per method and size).

    flowrl train-reward shapes-proxy --data POOL --n N --seed S --out PROXIES/nN_sS   # S = 0..3, each N
    python experiments/overopt.py --proxies PROXIES --methods dgpo --sizes 500 2000 --seeds 0 1 \\
        --mitigations none ensemble --minutes 20
    python experiments/overopt.py --analyse-only
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

# The RL trainers, then the reward-gradient trainers (the fastest hackers: they climb the proxy's gradient).
METHODS = ("dgpo", "flow_grpo", "refl", "draft", "direct_align")
SIZES = (500, 2000, 8000)
MITIGATIONS = ("none", "kl", "ensemble", "elastic_reset", "early_stop")
TRAINED = ("none", "kl", "ensemble", "elastic_reset")  # early_stop is replayed on the `none` runs
GOLD = "eval/shapes/accuracy"
PROXY = "eval/shapes_proxy/mean"
KINDS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
HELDOUT_SEED = 3  # the held-out proxy of each size: a seed no run trains on
ENSEMBLE_SEEDS = (0, 1, 2)
# Each method's KL coefficient for the `kl` mitigation: DGPO's penalty is mean_d (v - v_ref)^2 (its shapes config
# ships 0.02); Flow-GRPO's is the per-step Gaussian KL (its authors use 0.04 on SD3).
# The reward-gradient trainers' penalty is DGPO's form, at every velocity call that carries gradient.
KL_COEF = {"dgpo": 0.2, "flow_grpo": 0.04, "refl": 0.2, "draft": 0.2, "direct_align": 0.2}
COLORS = {"none": "tab:red", "kl": "tab:blue", "ensemble": "tab:green", "elastic_reset": "tab:purple",
          "early_stop": "tab:orange"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="experiments/overopt.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxies", default=str(ROOT / "experiments" / "out" / "proxies"),
                   help="folder of the trained proxies n<N>_s<S> (S = 0..3)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], choices=list(ENSEMBLE_SEEDS))
    p.add_argument("--mitigations", nargs="+", default=["none"], choices=list(MITIGATIONS))
    p.add_argument("--minutes", type=float, default=20.0, help="reference CPU-minutes per run (one thread)")
    p.add_argument("--max-epochs", type=int, default=100_000, help="run.max_epochs (default: time-bound)")
    p.add_argument("--eval-every", type=float, default=2.5, help="minutes between evaluations")
    p.add_argument("--eval-prompts", type=int, default=300, help="held-out prompts per evaluation")
    p.add_argument("--eval-steps", type=int, default=20, help="ODE steps of the evaluation's images")
    p.add_argument("--kl-coef", type=float, default=None, help="the `kl` mitigation's train.kl_coef (default: "
                   + ", ".join(f"{m} {c:g}" for m, c in KL_COEF.items()) + ")")
    p.add_argument("--ensemble-k", type=float, default=1.0, help="the `ensemble` mitigation's k in mean - k std")
    p.add_argument("--elastic-every", type=int, default=15, help="the `elastic_reset` mitigation's every_epochs")
    p.add_argument("--patience", type=int, default=2, help="early stopping: evaluations without improvement")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="extra override for every run (repeatable)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (each one thread)")
    p.add_argument("--reuse", action="store_true", help="keep finished runs, resume interrupted ones")
    p.add_argument("--out", default=str(ROOT / "experiments" / "out" / "overopt"), help="run folders")
    p.add_argument("--results", default=str(ROOT / "experiments" / "results" / "overopt"), help="tables, figure")
    p.add_argument("--analyse-only", action="store_true", help="train nothing; analyse the runs in --out")
    return p.parse_args(argv)


# ============================================================================ the runs


def _proxy_spec(paths: list[str], **kwargs) -> str:
    """A ``shapes_proxy`` entry's kwargs in the config's flow syntax."""
    path = paths[0] if len(paths) == 1 else "[" + ", ".join(paths) + "]"
    extra = "".join(f", {k}: {v}" for k, v in kwargs.items())
    return f"{{path: {path}{extra}}}"


def run_name(method: str, mitigation: str, n: int, seed: int) -> str:
    return f"{method}_{mitigation}_n{n}_s{seed}"


def run_overrides(args: argparse.Namespace, method: str, mitigation: str, n: int, seed: int) -> list[str]:
    """The overrides of one run (``KEY=VALUE``): its reward, held-out signals, regulariser and evaluation."""
    if mitigation not in TRAINED:
        raise ValueError(f"{mitigation!r} trains no run of its own")
    if mitigation == "elastic_reset" and method != "flow_grpo":
        raise SystemExit(f"overopt: elastic_reset is Flow-GRPO's (train.elastic_reset); {method} has none")
    proxies = Path(args.proxies)
    member = [str(proxies / f"n{n}_s{s}") for s in ENSEMBLE_SEEDS]
    if mitigation == "ensemble":
        train = _proxy_spec(member, aggregate="mean_minus_std", k=args.ensemble_k)
    else:
        train = _proxy_spec([str(proxies / f"n{n}_s{seed}")])
    heldout = (f"[{{heldout_proxy: {{reward: shapes_proxy, kwargs: "
               f"{_proxy_spec([str(proxies / f'n{n}_s{HELDOUT_SEED}')])}}}}}, "
               f"{{ensemble: {{reward: shapes_proxy, kwargs: {_proxy_spec(member)}}}}}]")
    out = [f"reward.train={{shapes_proxy: {{weight: 1.0, kwargs: {train}}}}}", "reward.eval=[shapes, shapes_proxy]",
           f"reward.heldout={heldout}"]
    kl = (args.kl_coef if args.kl_coef is not None else KL_COEF[method]) if mitigation == "kl" else 0.0
    out.append(f"train.kl_coef={kl}")
    if mitigation == "elastic_reset":
        out.append(f"train.elastic_reset={{every_epochs: {args.elastic_every}, decay_per_epoch: 0.9}}")
    return out + list(args.overrides)


def missing_proxies(args: argparse.Namespace) -> list[str]:
    proxies = Path(args.proxies)
    seeds = sorted({*args.seeds, HELDOUT_SEED, *(ENSEMBLE_SEEDS)})
    return [str(proxies / f"n{n}_s{s}") for n in args.sizes for s in seeds
            if not (proxies / f"n{n}_s{s}" / "model.safetensors").is_file()]


def jobs_for(args: argparse.Namespace) -> list[dict]:
    """Seed-major, then size, then mitigation: an interrupted grid still compares the mitigations."""
    jobs = []
    for seed in args.seeds:
        for n in args.sizes:
            for method in args.methods:
                for mitigation in (m for m in args.mitigations if m in TRAINED):
                    if mitigation == "elastic_reset" and method != "flow_grpo":
                        continue
                    name = run_name(method, mitigation, n, seed)
                    jobs.append({
                        "config": ROOT / "configs" / "shapes" / f"{method}.yaml", "out": Path(args.out) / name,
                        "overrides": {"run.seed": seed, "run.max_minutes": args.minutes,
                                      "run.max_epochs": args.max_epochs, "eval.every_minutes": args.eval_every,
                                      "eval.every_epochs": "null",
                                      "eval.at_start": "true", "data.num_eval_prompts": args.eval_prompts,
                                      "sampling.eval_num_steps": args.eval_steps},
                        "extra": run_overrides(args, method, mitigation, n, seed), "label": f"overopt: {name}",
                        "reuse": args.reuse, "method": method, "mitigation": mitigation, "n": n, "seed": seed})
    return jobs


# ============================================================================ analysis


def distance(row: dict) -> float:
    """``d``: the square root of the KL to the base where it is logged (stochastic rollouts), else of the
    flow-matching distance; NaN when neither is."""
    for key in ("hack/kl_to_base", "hack/fm_to_base"):
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return math.sqrt(max(float(value), 0.0))
    return math.nan


def run_points(curve: dict) -> list[dict]:
    """One point per evaluation of a run: epoch, minutes, ``d``, gold (and per kind), proxy, held-out signals."""
    points = []
    for row in curve["evals"]:
        g = lambda key: float(row.get(key, math.nan))  # noqa: E731
        points.append({"epoch": int(row.get("epoch", 0)), "minutes": g("time/train_min"), "d": distance(row),
                       "gold": g(GOLD), "proxy": g(PROXY), "heldout_proxy": g("hack/heldout/heldout_proxy/mean"),
                       "ensemble": g("hack/heldout/ensemble/mean"), "disagreement": g("hack/heldout/ensemble/std"),
                       "diversity": g("hack/diversity"), "reward": math.nan,
                       **{k: g(f"eval/shapes/{k}") for k in KINDS}})
    points[0]["minutes"] = 0.0 if not math.isfinite(points[0]["minutes"]) else points[0]["minutes"]
    # The training reward's mean over the epochs since the previous evaluation (run.stop_on's `while_reward_rises`).
    rows = curve["rows"]
    for i, point in enumerate(points):
        low = points[i - 1]["epoch"] if i else -1
        window = [r["train/reward_mean"] for r in rows if low < r.get("epoch", 0) <= point["epoch"]
                  and math.isfinite(r.get("train/reward_mean", math.nan))]
        point["reward"] = sum(window) / len(window) if window else math.nan
    return points


def fit_rl(points: list[dict]) -> dict | None:
    """Least-squares ``gold(d) - gold(0) = d (a - b log d)`` over a run's points with ``d > 0`` (Gao et al.'s RL
    form); the peak is at ``d* = exp(a / b - 1)`` when ``b > 0``. None with fewer than two such points."""
    import numpy as np

    rows = [p for p in points if math.isfinite(p["d"]) and p["d"] > 0 and math.isfinite(p["gold"])]
    if len(rows) < 2:
        return None
    d = np.array([p["d"] for p in rows])
    gain = np.array([p["gold"] for p in rows]) - points[0]["gold"]
    design = np.stack([d, -d * np.log(d)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, gain, rcond=None)
    peak = math.exp(a / b - 1) if b > 0 else None
    return {"a": float(a), "b": float(b), "d_peak": peak}


def summarise(points: list[dict]) -> dict:
    """Peak (the start included) and final gold of one run, where the peak is, and the fitted RL form."""
    peak = max(range(len(points)), key=lambda i: points[i]["gold"])
    return {"peak_gold": points[peak]["gold"], "peak_index": peak, "peak_epoch": points[peak]["epoch"],
            "peak_d": points[peak]["d"], "final_gold": points[-1]["gold"], "final_proxy": points[-1]["proxy"],
            "start_gold": points[0]["gold"], "final_d": points[-1]["d"], "evaluations": len(points),
            "fit": fit_rl(points)}


def stop_on_replay(points: list[dict], key: str, *, patience: int, mode: str = "max",
                   while_reward_rises: bool = False) -> tuple[int, int | None]:
    """``run.stop_on`` replayed over a run's evaluations on ``key``: ``(kept, stopped)``, the index of the
    evaluation whose checkpoint it keeps and the one at which it stops (None: it would not have stopped)."""
    from types import SimpleNamespace

    from flowrl.run.harness import EarlyStop

    rule = EarlyStop(SimpleNamespace(metric=key, mode=mode, patience=patience, min_delta=0.0,
                                     while_reward_rises=while_reward_rises))
    kept = 0
    for i, point in enumerate(points):
        value = point[key]
        if not math.isfinite(value):
            continue
        improved, stop = rule.update(i, {key: value}, point["reward"] if math.isfinite(point["reward"]) else None)
        if improved:
            kept = i
        if stop:
            return kept, i
    return kept, None


def rise_replay(points: list[dict], key: str, *, rise: float, sign: float = 1.0) -> tuple[int, int | None]:
    """A threshold rule on a signal that drifts one way as the policy leaves the base: stop at the first evaluation
    where ``sign * (value / start - 1) > rise`` and keep the one before it. Returns ``(kept, stopped)``."""
    start = points[0][key]
    if not (math.isfinite(start) and start != 0):
        return len(points) - 1, None
    for i, point in enumerate(points[1:], start=1):
        if math.isfinite(point[key]) and sign * (point[key] / start - 1) > rise:
            return i - 1, i
    return len(points) - 1, None


#: The gold-free stopping rules the detector compares: (name, how it reads a run's points -> (kept, stopped)).
SIGNALS = {
    "held-out proxy, patience": lambda pts, patience: stop_on_replay(pts, "heldout_proxy", patience=patience),
    "ensemble mean, patience": lambda pts, patience: stop_on_replay(pts, "ensemble", patience=patience),
    "ensemble disagreement +25%": lambda pts, patience: rise_replay(pts, "disagreement", rise=0.25),
    "diversity -25%": lambda pts, patience: rise_replay(pts, "diversity", rise=0.25, sign=-1.0),
}


def binomial_se(p: float, count: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / count) if math.isfinite(p) and count > 0 else math.nan


def early_stop_summary(points: list[dict], patience: int) -> dict:
    """The ``early_stop`` mitigation on a ``none`` run: the run ends where ``run.stop_on`` on the held-out proxy
    stops, and its final model is the kept checkpoint."""
    kept, stopped = stop_on_replay(points, "heldout_proxy", patience=patience)
    seen = points[: (stopped if stopped is not None else len(points) - 1) + 1]
    out = summarise(seen)
    out.update(final_gold=points[kept]["gold"], final_proxy=points[kept]["proxy"], final_d=points[kept]["d"],
               kept_index=kept, stopped_index=stopped)
    return out


def mitigation_table(runs: dict, eval_prompts: int) -> list[dict]:
    """Per (method, n, mitigation): peak and final gold over seeds, and whether it beats ``none`` on both by one
    standard error of ``none``'s gold on every seed both have."""
    rows = []
    for (method, n, mitigation) in sorted({(r["method"], r["n"], r["mitigation"]) for r in runs.values()}):
        mine = {r["seed"]: r["summary"] for r in runs.values()
                if (r["method"], r["n"], r["mitigation"]) == (method, n, mitigation)}
        none = {r["seed"]: r["summary"] for r in runs.values() if (r["method"], r["n"], r["mitigation"]) ==
                (method, n, "none")}
        shared = sorted(set(mine) & set(none))
        beats = None
        if mitigation != "none" and shared:
            beats = all(mine[s][k] > none[s][k] + binomial_se(none[s][k], eval_prompts)
                        for s in shared for k in ("peak_gold", "final_gold"))
        peak, final = mean_std([m["peak_gold"] for m in mine.values()]), mean_std([m["final_gold"] for m in
                                                                                    mine.values()])
        rows.append({"method": method, "n": n, "mitigation": mitigation, "seeds": sorted(mine), "peak": peak,
                     "final": final, "beats_none": beats, "compared_seeds": shared})
    return rows


def detector_table(runs: dict, patience: int) -> dict:
    """Per signal and ``none`` run: the kept and stopping evaluations against the gold's peak, and the gold lost."""
    table = {}
    for signal, rule in SIGNALS.items():
        rows = []
        for name, r in sorted(runs.items()):
            if r["mitigation"] != "none":
                continue
            pts, peak = r["points"], r["summary"]["peak_index"]
            kept, stopped = rule(pts, patience)
            rows.append({"run": name, "peak": peak, "kept": kept, "stopped": stopped, "kept_lag": kept - peak,
                         "stop_lag": None if stopped is None else stopped - peak,
                         "kept_lag_epochs": pts[kept]["epoch"] - pts[peak]["epoch"],
                         "gold_lost": pts[peak]["gold"] - pts[kept]["gold"]})
        within = sum(abs(row["kept_lag"]) <= 2 for row in rows)
        table[signal] = {"runs": rows, "kept_within_2": within, "count": len(rows)}
    return table


def collect(out: Path, patience: int) -> dict:
    """Every finished or interrupted run in ``out`` (its name tells method, mitigation, n, seed), plus the
    ``early_stop`` replays of the ``none`` runs."""
    runs = {}
    for folder in sorted(p for p in out.glob("*_n*_s*") if p.is_dir()):
        head, _, seed = folder.name.rpartition("_s")
        head, _, n = head.rpartition("_n")
        method = next((m for m in METHODS if head.startswith(m + "_")), None)
        curve = read_curve(folder, GOLD)
        if method is None or curve is None or not seed.isdigit() or not n.isdigit():
            continue
        points = run_points(curve)
        runs[folder.name] = {"method": method, "mitigation": head[len(method) + 1:], "n": int(n), "seed": int(seed),
                             "points": points, "summary": summarise(points)}
    for name, r in list(runs.items()):
        if r["mitigation"] == "none":
            replay = name.replace("_none_", "_early_stop_")
            runs[replay] = {**r, "mitigation": "early_stop", "summary": early_stop_summary(r["points"], patience)}
    return runs


def markdown(runs: dict, mitigations: list[dict], detector: dict, args: argparse.Namespace) -> str:
    lines = ["# Reward over-optimisation under RL (`experiments/overopt.py`)", "",
             f"Gold: strict accuracy on {args.eval_prompts} held-out prompts (one standard error ~"
             f"{binomial_se(0.5, args.eval_prompts):.3f}); `d` = sqrt(KL to the base) for Flow-GRPO, "
             "sqrt(flow-matching distance) for the ODE trainers; early stopping replays `run.stop_on` on the held-out "
             f"proxy (patience {args.patience}) over the `none` runs.", "",
             "## Peak and final gold per mitigation", "",
             "| method | n | mitigation | seeds | peak gold | final gold | beats none (peak and final, +1 SE, every "
             "seed) |", "|---|---|---|---|---|---|---|"]
    for row in mitigations:
        beats = "" if row["beats_none"] is None else ("yes" if row["beats_none"] else "no")
        lines.append(f"| {row['method']} | {row['n']} | {row['mitigation']} | {len(row['seeds'])} | "
                     f"{fmt(row['peak'][0])} ± {fmt(row['peak'][1])} | {fmt(row['final'][0])} ± "
                     f"{fmt(row['final'][1])} | {beats} |")
    lines += ["", "## Runs", "", "| run | evals | gold start / peak (d) / final | proxy final | fit a, b (d*) | "
              + " / ".join(KINDS) + " at the end |", "|---|---|---|---|---|---|"]
    for name, r in sorted(runs.items()):
        s, fit, end = r["summary"], r["summary"]["fit"], r["points"][-1]
        fit_text = "" if fit is None else (f"{fit['a']:.3f}, {fit['b']:.3f} "
                                           f"({'-' if fit['d_peak'] is None else format(fit['d_peak'], '.3f')})")
        lines.append(f"| {name} | {s['evaluations']} | {fmt(s['start_gold'])} / {fmt(s['peak_gold'])} "
                     f"({fmt(s['peak_d'])}) / {fmt(s['final_gold'])} | {fmt(s['final_proxy'])} | {fit_text} | "
                     + " / ".join(fmt(end[k], 2) for k in KINDS) + " |")
    lines += ["", "## The detector: where each gold-free rule stops against the gold's peak", "",
              "Lag in evaluations (kept checkpoint minus the gold's peak; negative: before it), per `none` run.", "",
              "| signal | kept within 2 evaluations | runs: kept lag / stop lag / gold lost |", "|---|---|---|"]
    for signal, t in detector.items():
        cells = "; ".join(f"{row['run']}: {row['kept_lag']:+d} / {'-' if row['stop_lag'] is None else row['stop_lag']}"
                          f" / {row['gold_lost']:.3f}" for row in t["runs"])
        lines.append(f"| {signal} | {t['kept_within_2']} of {t['count']} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["method"], r["n"]) for r in runs.values()})
    if not keys:
        return
    methods, sizes = sorted({k[0] for k in keys}), sorted({k[1] for k in keys})
    fig, axes = plt.subplots(len(methods), len(sizes), figsize=(4.2 * len(sizes), 3.4 * len(methods)), squeeze=False)
    for r in runs.values():
        if r["mitigation"] == "early_stop":
            continue
        ax = axes[methods.index(r["method"])][sizes.index(r["n"])]
        pts = [p for p in r["points"] if math.isfinite(p["d"])]
        color = COLORS.get(r["mitigation"], "gray")
        label = r["mitigation"] if r["seed"] == min(x["seed"] for x in runs.values()) else None
        ax.plot([p["d"] for p in pts], [p["gold"] for p in pts], "-o", ms=3, color=color, label=label)
        ax.plot([p["d"] for p in pts], [p["proxy"] for p in pts], "--", color=color, alpha=0.6)
    for (method, n) in keys:
        ax = axes[methods.index(method)][sizes.index(n)]
        ax.set_title(f"{method}, proxy n={n}")
        ax.set_xlabel("d (sqrt KL or sqrt FM distance)")
        ax.set_ylabel("gold (solid), proxy (dashed)")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def analyse(args: argparse.Namespace) -> dict:
    runs = collect(Path(args.out), args.patience)
    mitigations = mitigation_table(runs, args.eval_prompts)
    detector = detector_table(runs, args.patience)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("analyse_only",)}, "runs": runs,
              "mitigations": mitigations, "detector": detector}
    (results / "overopt.json").write_text(json.dumps(clean(report), indent=1) + "\n")
    (results / "overopt.md").write_text(markdown(runs, mitigations, detector, args))
    plot(runs, results / "overopt.png")
    print(f"overopt: {len(runs)} runs analysed; wrote {results}/overopt.{{json,md,png}}")
    return report


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.analyse_only:
        missing = missing_proxies(args)
        if missing:
            raise SystemExit("overopt: no trained proxy in " + ", ".join(missing) + "; train each with "
                             "`flowrl train-reward shapes-proxy --data POOL --n N --seed S --out DIR`")
        launch(jobs_for(args), args.parallel, keys=("method", "mitigation", "n", "seed"))
    return analyse(args)


if __name__ == "__main__":
    main()
