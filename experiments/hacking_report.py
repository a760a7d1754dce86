"""The analysis of ``experiments/hacking.py``: curves read back from the runs, the summary over seeds, the issue's
rule for a recommended configuration, the tables and the figures.

The rule (issue 20's acceptance), on the means over seeds at the last evaluation, against the base model (every
run's evaluation before training) and the unregularised run (``none``):

- strict accuracy (``hack/accuracy``, the gold) at or above the base's;
- extra-object rate (``hack/extra_object_rate``) within 0.05 of the base's (at most base + 0.05);
- lenient held-out accuracy (``eval/shapes/accuracy``) within 2 points of ``none``'s;
- no task kind's lenient accuracy below its base (``--kind-tolerance`` allows a margin).

The recommended configuration is the variant that meets all four with the highest lenient accuracy; when none
does, the result names none and gives the Pareto front (lenient accuracy, strict accuracy, minus the
extra-object rate) of the variants measured. The screen's ``ranking`` (nearest to meeting the rule,
:func:`shortfall`, then lenient accuracy) picks the final phase's best three.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from experiments.runs import clean, fmt, mean_std, read_curve, restore_record, save_figure

LENIENT, STRICT, EXTRA = "eval/shapes/lenient_accuracy", "hack/accuracy", "hack/extra_object_rate"
KINDS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# hack/kl_to_base for the SDE rollouts of every variant here; hack/fm_to_base is the flow-matching distance.
PANEL = (STRICT, EXTRA, "hack/bg_shift", "hack/drift_pixel", "hack/drift_feature", "hack/diversity",
         "hack/kl_to_base", "hack/fm_to_base")
PROXY = "train/reward_mean"
DISCRIMINATOR = "adv/d_acc_fresh"


def curve(directory: Path, base: dict | None = None) -> dict | None:
    """A run's evaluations: minutes, epochs, every metric of the table and the proxy (the mean training reward of
    the epochs since the previous evaluation; the first evaluation's is the first epoch's). ``base`` (the base
    model's evaluation row) is the first point of a run that did not evaluate at its start."""
    if not (directory / "metrics.jsonl").is_file():
        restore_record(directory)  # a run finished on an earlier machine
    found = read_curve(directory, LENIENT, initial=base)
    if found is None:
        return None
    evals, train = found["evals"], found["rows"]
    keys = (LENIENT, *PANEL, *(f"eval/shapes/{k}" for k in KINDS))
    series = {key: [float(r.get(key, math.nan)) for r in evals] for key in keys}
    proxy, previous = [], -1
    for row in evals:
        epoch = row.get("epoch", 0)
        window = [r[PROXY] for r in train if PROXY in r and previous < r.get("epoch", 0) <= max(epoch, 1)]
        proxy.append(mean_std(window)[0])
        previous = epoch
    series[PROXY] = proxy
    d_acc = [(r["epoch"], r[DISCRIMINATOR]) for r in train if DISCRIMINATOR in r]
    return {"minutes": found["minutes"], "epochs": found["epochs"], "eval_epochs": [r.get("epoch", 0) for r in evals],
            "series": series, "discriminator_accuracy": d_acc}


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
        d_acc = [r["discriminator_accuracy"][-1][1] for r in mine if r["discriminator_accuracy"]]
        if d_acc:
            row[DISCRIMINATOR] = {"end": mean_std(d_acc)}
        out[variant] = row
    return out


def base_values(summary: dict) -> dict[str, float]:
    """The base model's metrics: every run's evaluation before training, averaged."""
    keys = next(iter(summary.values())).keys() - {"seeds", "epochs", "minutes", DISCRIMINATOR, PROXY}
    return {k: mean_std([row[k]["start"][0] for row in summary.values()])[0] for k in sorted(keys)}


def gaps(summary: dict, base: dict[str, float], kind_tolerance: float = 0.0) -> dict[str, dict]:
    """Per variant, what each criterion of the rule lacks, in accuracy units (a gap <= 0 is a criterion met; None
    where a value is missing): ``{"strict", "extra", "lenient", "kinds"}`` and ``low_kinds``, the kinds below base.

    strict: base strict accuracy minus the variant's; extra: its extra-object rate minus (base + 0.05); lenient:
    ``none``'s lenient accuracy minus 0.02 minus the variant's; kinds: the largest drop of a task kind below its base
    (minus ``kind_tolerance``), 0.0 when no kind has both values."""
    reference = summary.get("none")
    ok = lambda x: x is not None and math.isfinite(x)  # noqa: E731
    out = {}
    for variant, row in summary.items():
        end = {k: v["end"][0] for k, v in row.items() if isinstance(v, dict) and "end" in v}
        drops = {k: base[f"eval/shapes/{k}"] - kind_tolerance - end[f"eval/shapes/{k}"] for k in KINDS
                 if ok(end.get(f"eval/shapes/{k}")) and ok(base.get(f"eval/shapes/{k}"))}
        lenient = end.get(LENIENT) if reference is not None else None
        out[variant] = {
            "strict": base[STRICT] - end[STRICT] if ok(end.get(STRICT)) and ok(base.get(STRICT)) else None,
            "extra": end[EXTRA] - (base[EXTRA] + 0.05) if ok(end.get(EXTRA)) and ok(base.get(EXTRA)) else None,
            "lenient": reference[LENIENT]["end"][0] - 0.02 - lenient if ok(lenient) else None,
            "kinds": max(drops.values(), default=0.0),
            "low_kinds": [k for k, drop in drops.items() if drop > 0],
        }
    return out


def criteria(summary: dict, base: dict[str, float], kind_tolerance: float = 0.0) -> dict[str, dict]:
    """Per variant, each criterion of the rule met or not: ``{"strict", "extra", "lenient", "kinds", "all"}`` (bools;
    None where a value is missing), with ``low_kinds`` naming the kinds below base. A criterion is met where its
    :func:`gaps` entry is <= 0."""
    out = {}
    for variant, gap in gaps(summary, base, kind_tolerance).items():
        checks = {name: None if gap[name] is None else gap[name] <= 0
                  for name in ("strict", "extra", "lenient", "kinds")}
        checks["all"] = all(v is True for v in checks.values())
        out[variant] = {**checks, "low_kinds": gap["low_kinds"]}
    return out


def pareto_front(summary: dict) -> list[str]:
    """The variants no other beats on all of (lenient accuracy, strict accuracy, -extra-object rate)."""
    point = {v: (r[LENIENT]["end"][0], r[STRICT]["end"][0], -r[EXTRA]["end"][0]) for v, r in summary.items()
             if all(math.isfinite(x) for x in (r[LENIENT]["end"][0], r[STRICT]["end"][0], r[EXTRA]["end"][0]))}

    def dominated(v: str) -> bool:
        return any(other != v and point[other] != point[v] and all(b >= a for a, b in zip(point[v], point[other]))
                   for other in point)

    return [v for v in point if not dominated(v)]


def shortfall(summary: dict, base: dict[str, float], kind_tolerance: float = 0.0) -> dict[str, float]:
    """Per variant, how far it stands from meeting the rule, in accuracy units: the sum of its :func:`gaps` that are
    positive (what strict accuracy lacks, what the extra-object rate exceeds, what lenient accuracy lacks, the largest
    drop of a task kind); 0 for a variant that passes, missing values counted as met."""
    return {variant: sum(max(0.0, g) for name, g in gap.items() if name != "low_kinds" and g is not None)
            for variant, gap in gaps(summary, base, kind_tolerance).items()}


def ranking(summary: dict, base: dict[str, float], kind_tolerance: float = 0.0) -> list[str]:
    """Regularised variants, nearest to meeting the rule first (:func:`shortfall`), then by lenient accuracy.

    Distance, not the number of criteria met, picks the final phase's variants: a longer budget raises every
    variant's lenient accuracy but also the hacking of a variant that does not stop it (the main job's extra-object
    rate went 0.16 -> 0.47 in 24 epochs and 0.81 in 87), so a variant 5 points short on strict accuracy at the
    screen falls further behind, where one 3 points short on lenient accuracy can close the gap."""
    gap = shortfall(summary, base, kind_tolerance)
    return sorted((v for v in summary if v != "none"), key=lambda v: (gap[v], -summary[v][LENIENT]["end"][0]))


def recommend(summary: dict, checks: dict) -> str | None:
    passing = [v for v in summary if v != "none" and checks[v]["all"]]
    return max(passing, key=lambda v: summary[v][LENIENT]["end"][0]) if passing else None


def markdown(summary: dict, base: dict, checks: dict) -> str:
    keys = (LENIENT, *PANEL, PROXY)
    short = lambda k: k.split("/", 1)[1].replace("shapes/", "")  # noqa: E731
    def cell(row: dict, key: str) -> str:
        mean, std = row.get(key, {"end": (math.nan, math.nan)})["end"]
        return f"{fmt(mean)} ± {fmt(std)}" if row["seeds"] > 1 else fmt(mean)

    lines = ["| variant | seeds | epochs | train min | " + " | ".join(short(k) for k in keys) + " | d_acc | rule |",
             "|---|---|---|---|" + "---|" * (len(keys) + 2)]
    lines.append("| base (start) | | 0 | 0 | " + " | ".join(fmt(base.get(k, math.nan)) for k in keys) + " | | |")
    for variant, row in summary.items():
        c = checks[variant]
        met = "yes" if c["all"] else ", ".join(k for k in ("strict", "extra", "lenient", "kinds") if c[k] is not True)
        d_acc = fmt(row[DISCRIMINATOR]["end"][0]) if DISCRIMINATOR in row else ""
        lines.append(f"| {variant} | {row['seeds']} | {row['epochs']:.0f} | {row['minutes']:.1f} | "
                     + " | ".join(cell(row, k) for k in keys)
                     + f" | {d_acc} | {met if c['all'] else 'fails: ' + met} |")
    lines += ["", "Per task kind (lenient held-out accuracy at the last evaluation; * below base):", "",
              "| variant | " + " | ".join(KINDS) + " |", "|---|" + "---|" * len(KINDS)]
    lines.append("| base (start) | " + " | ".join(fmt(base.get(f"eval/shapes/{k}", math.nan)) for k in KINDS) + " |")
    for variant, row in summary.items():
        lines.append(f"| {variant} | " + " | ".join(
            cell(row, f"eval/shapes/{k}") + ("*" if k in checks[variant]["low_kinds"] else "") for k in KINDS) + " |")
    return "\n".join(lines)


def _colours(variants: list[str]) -> dict[str, tuple]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {v: cmap(i % 20) for i, v in enumerate(variants)}


def plot_tradeoff(runs: dict, base: dict, path: Path, title: str) -> None:
    """Lenient accuracy against strict accuracy and against the extra-object rate: a point per run and
    evaluation (circles seed 0, squares seed 1, ...), lines joining a run's evaluations, the base a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = _colours(list(dict.fromkeys(v for v, _ in runs)))
    markers = "osD^v<>"
    fig, axes = plt.subplots(1, 2, figsize=(14, 6))
    for ax, key, label in ((axes[0], STRICT, "strict accuracy (gold)"),
                           (axes[1], EXTRA, "extra-object rate (gold, lower is better)")):
        for (variant, seed), r in sorted(runs.items()):
            xs, ys = r["series"][key], r["series"][LENIENT]
            ax.plot(xs, ys, color=colours[variant], linewidth=0.8, alpha=0.6)
            ax.scatter(xs, ys, color=colours[variant], marker=markers[seed % len(markers)], s=28,
                       label=f"{variant} s{seed}")
            ax.scatter(xs[-1:], ys[-1:], color=colours[variant], marker=markers[seed % len(markers)], s=90,
                       edgecolors="black")
        ax.scatter([base[key]], [base[LENIENT]], marker="*", s=250, color="black", label="base", zorder=5)
        ax.set_xlabel(label)
        ax.set_ylabel("lenient held-out accuracy (proxy)")
        ax.grid(alpha=0.3)
    axes[1].axvline(base[EXTRA] + 0.05, color="grey", linestyle=":", linewidth=1)
    axes[0].axvline(base[STRICT], color="grey", linestyle=":", linewidth=1)
    axes[1].legend(fontsize=7, ncol=2, loc="best")
    fig.suptitle(title + " (large marker: the last evaluation)")
    save_figure(fig, path)


def distance(r: dict) -> tuple[list[float], str]:
    """Gao et al.'s ``d = sqrt(KL)`` to the base (``hack/kl_to_base``), else the FM distance's root."""
    for key, label in (("hack/kl_to_base", "sqrt KL to base"), ("hack/fm_to_base", "sqrt FM distance to base")):
        values = r["series"][key]
        if any(math.isfinite(v) for v in values):
            return [math.sqrt(max(v, 0.0)) if math.isfinite(v) else math.nan for v in values], label
    return [math.nan] * len(r["minutes"]), "distance to base"


def plot_gold_vs_kl(runs: dict, path: Path, title: str) -> None:
    """Per run: gold (strict accuracy) and proxies (training reward, lenient held-out accuracy) against the
    distance to the base, the over-optimisation picture of Gao et al."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(runs)
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        r = runs[name]
        xs, label = distance(r)
        for key, style, what in ((STRICT, "-o", "gold: strict accuracy"), (PROXY, "--s", "proxy: training reward"),
                                 (LENIENT, ":^", "proxy: lenient held-out")):
            ax.plot(xs, r["series"][key], style, markersize=4, label=what)
        ax.set_title(f"{name[0]} seed {name[1]}", fontsize=9)
        ax.set_xlabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title)
    save_figure(fig, path)


def plot_curves(runs: dict, path: Path, title: str) -> None:
    """Lenient accuracy and each panel metric against training minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (LENIENT, *PANEL, PROXY)
    colours = _colours(list(dict.fromkeys(v for v, _ in runs)))
    fig, axes = plt.subplots(2, 5, figsize=(22, 8))
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        for (variant, seed), r in sorted(runs.items()):
            ax.plot(r["minutes"], r["series"][key], color=colours[variant], marker=".", linewidth=1.1,
                    linestyle="-" if seed == 0 else "--", label=f"{variant} s{seed}")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("training minutes")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    save_figure(fig, path)


def base_evaluations(base_jobs: list[dict]) -> dict[int, dict]:
    """Per seed, the base model's evaluation row (from its 0-epoch run), where it was made."""
    out = {}
    for job in base_jobs:
        if not (job["out"] / "metrics.jsonl").is_file():
            restore_record(job["out"])
        found = read_curve(job["out"], LENIENT)
        if found is not None:
            out[job["seed"]] = found["evals"][0]
    return out


def report(jobs: list[dict], args: argparse.Namespace, base_jobs: list[dict] = ()) -> dict:
    """Read every job's run, write the results of the phase (module docstring) and return them. ``base_jobs``: the
    base model's evaluation per seed, every run's first point where it did not evaluate at its start."""
    runs, records = {}, []
    bases = base_evaluations(list(base_jobs))
    for job in jobs:
        found = curve(job["out"], bases.get(job["seed"]))
        if found is None:
            print(f"hacking: no evaluations in {job['out']}; left out", flush=True)
            continue
        runs[(job["variant"], job["seed"])] = found
        records.append({"variant": job["variant"], "seed": job["seed"], "budget_minutes": args.minutes,
                        "budget_epochs": args.epochs, "overrides": job["extra"], **found})
    if not runs:
        raise SystemExit(f"hacking: no runs with metrics under {args.out}")
    summary = summarise(runs)
    base = base_values(summary)
    checks = criteria(summary, base, args.kind_tolerance)
    best = recommend(summary, checks)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    stem = f"hacking_{args.phase}"
    budget = f"{args.epochs} epochs" if args.epochs is not None else f"{args.minutes:g} CPU-minutes"
    title = (f"Reward hacking on the shapes model ({args.phase}): Flow-GRPO, lenient reward, {budget}, "
             f"seeds {args.seeds}")
    plot_tradeoff(runs, base, results / f"{stem}.png", title)
    plot_gold_vs_kl(runs, results / f"{stem}_gold_vs_kl.png", title)
    plot_curves(runs, results / f"{stem}_curves.png", title)
    table = markdown(summary, base, checks)
    verdict = (f"Recommended: `{best}` (meets every criterion, highest lenient accuracy)." if best else
               "No variant meets every criterion; Pareto front (lenient, strict, -extra): "
               + ", ".join(f"`{v}`" for v in pareto_front(summary)) + ".")
    settings = {k: v for k, v in vars(args).items() if k not in ("analyse_only", "reuse")}
    result = {"phase": args.phase, "settings": settings, "base": base, "summary": summary, "criteria": checks,
              "recommended": best, "pareto_front": pareto_front(summary),
              "ranking": ranking(summary, base, args.kind_tolerance),
              "shortfall": shortfall(summary, base, args.kind_tolerance),
              "runs": records, "table_md": table}
    (results / f"{stem}.json").write_text(json.dumps(clean(result), indent=2, default=str) + "\n")
    (results / f"{stem}.md").write_text(f"# {stem}\n\n{title}\n\n{table}\n\n{verdict}\n")
    print(table + "\n\n" + verdict, flush=True)
    return clean(result)
