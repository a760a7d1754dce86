"""Which regulariser keeps the main job's gain and loses its hack? Every variant of issue 20's comparison on the
main job (Flow-GRPO on the shapes model, ``configs/shapes/flow_grpo.yaml``, its lenient ``shapes`` reward: the
proxy), with the same seeds and evaluation, every evaluation logging the hacking panel (``hack/*``: the gold is
the strict accuracy and the extra-object rate).

Variants (``variant_overrides``; each adds overrides to the main job's config):

- ``none``: the shipped main job;
- ``artifact_<w>``: + the ``artifact`` reward at weight ``w`` (``--artifact-weights``, default 0.25 0.5 1.0), the
  classifier of ``flowrl train-reward artifact --synthetic shapes`` (trained first into ``--artifact-model``);
- ``adversarial``: + ``adversarial`` (weight ``--adv-weight``) with a discriminator that separates (``--adv-d-steps``
  16 at ``--adv-lr`` 1e-3), warmed up on ``--adv-warmup`` epochs of base samples, then GAN-style every epoch;
  its accuracy on each epoch's new samples is ``adv/d_acc_fresh``;
- ``adversarial_clipped``: the same with IRRL's clipped-linear reward (``clip_margin`` ``--adv-clip-margin``);
- ``kl_low`` / ``kl_high``: Flow-GRPO's KL to the base, beta ``--kl-low`` / ``--kl-high`` in Flow-GRPO's units
  (``train.kl_coef_units=flow_grpo``);
- ``crd_anchor``: CRD's reward-adaptive anchor on that KL (beta ``--kl-high``, floor ``1e-3 beta``);
- ``elastic_reset``: every ``--elastic-every`` epochs the policy to its EMA (decay ``--elastic-decay``), the EMA
  to the base;
- ``base_tail``: the base model takes the last ``--base-last-steps`` denoising steps of rollouts and evaluation;
- ``A+B``: two (or more) of the above together, e.g. ``artifact_1+kl_high`` (each part sets different keys: the
  artifact and adversarial rewards both set the training reward and do not combine).

The base model is evaluated once per seed (``base_s<seed>``), the first point of every run's curves; runs do not
evaluate at their start.

Phases: ``--phase screen`` runs every variant at 10 CPU-minutes, seed 0; ``--phase final`` runs ``none`` and the
best three (``--best A B C``, default the three the screen ranked first) at 30 CPU-minutes, seeds 0 and 1;
``--phase custom`` takes ``--variants``, ``--minutes`` and ``--seeds`` as given. Runs are launched
``--parallel`` at a time, one thread each (``experiments/runs.py``, which keeps a committed record of each
finished run; ``--reuse`` keeps finished runs and resumes interrupted ones). The analysis
(``experiments/hacking_report.py``) writes, into ``--results``, ``hacking_<phase>.json`` (every run: variant,
seed, budget, curves; the summary; the issue's criteria per variant and the recommended configuration),
``hacking_<phase>.md`` (the table and the per-kind table), ``hacking_<phase>.png`` (lenient accuracy against strict
accuracy and against the extra-object rate, a point per run and evaluation), ``hacking_<phase>_gold_vs_kl.png``
(gold and proxy against the distance to the base, per run) and ``hacking_<phase>_curves.png`` (each metric
against training minutes).

    python experiments/hacking.py --phase screen --parallel 2 --reuse
    python experiments/hacking.py --phase final --parallel 2 --reuse          # the screen's best three
    python experiments/hacking.py --phase final --best kl_high crd_anchor base_tail --analyse-only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

from experiments.runs import launch  # noqa: E402

FIXED_VARIANTS = ("none", "adversarial", "adversarial_clipped", "kl_low", "kl_high", "crd_anchor", "elastic_reset",
                  "base_tail")
PHASES = {"screen": {"minutes": 10.0, "seeds": [0]}, "final": {"minutes": 30.0, "seeds": [0, 1]}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("screen", "final", "custom"), default="custom")
    parser.add_argument("--variants", nargs="+", default=None, help="custom phase: the variants (default: all)")
    parser.add_argument("--best", nargs="+", default=None, help="final phase: the variants beside none (default: "
                        "the screen's best three)")
    parser.add_argument("--minutes", type=float, default=None, help="training CPU-minutes per run, one thread "
                        "(default: the phase's; custom 30)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="a budget in epochs instead of minutes (evaluations every third of it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the phase's; custom 0 1")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time, one thread each (default 1)")
    parser.add_argument("--eval-every-minutes", type=float, default=None, help="default: a third of the budget")
    parser.add_argument("--num-eval-prompts", type=int, default=600)
    parser.add_argument("--eval-steps", type=int, default=40)
    parser.add_argument("--max-epochs", type=int, default=100000)
    parser.add_argument("--artifact-weights", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--artifact-model", default=str(ROOT / "experiments" / "out" / "hacking" / "artifact_model"))
    parser.add_argument("--adv-weight", type=float, default=0.3)
    parser.add_argument("--adv-warmup", type=int, default=3, help="discriminator-only epochs first (default 3)")
    parser.add_argument("--adv-d-steps", type=int, default=16, help="discriminator steps per epoch (default 16)")
    parser.add_argument("--adv-lr", type=float, default=1e-3, help="discriminator learning rate (default 1e-3)")
    parser.add_argument("--adv-clip-margin", type=float, default=0.0, help="adversarial_clipped: the reward's cap "
                        "(default 0: the decision boundary)")
    parser.add_argument("--kl-low", type=float, default=0.01, help="kl_low's beta, Flow-GRPO units (default 0.01)")
    parser.add_argument("--kl-high", type=float, default=0.04, help="kl_high's and crd_anchor's beta (default 0.04)")
    parser.add_argument("--elastic-every", type=int, default=10, help="elastic_reset: epochs per reset (default 10)")
    parser.add_argument("--elastic-decay", type=float, default=0.9, help="elastic_reset: EMA decay per epoch")
    parser.add_argument("--base-last-steps", type=int, default=4, help="base_tail: steps the base takes (default 4 "
                        "of 10; the main job's window ends at step 5)")
    parser.add_argument("--kind-tolerance", type=float, default=0.0,
                        help="the rule's 'no kind below base' allows this much (default 0)")
    parser.add_argument("--model-path", default=None, help="the model to tune (default: the shipped one)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="an override for every run")
    parser.add_argument("--out", default=None, help="run folders (default experiments/out/hacking_<phase>)")
    parser.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    parser.add_argument("--reuse", action="store_true", help="keep finished runs, resume interrupted ones")
    parser.add_argument("--analyse-only", action="store_true")
    args = parser.parse_args(argv)
    phase = PHASES.get(args.phase, {"minutes": 30.0, "seeds": [0, 1]})
    args.minutes = phase["minutes"] if args.minutes is None else args.minutes
    args.seeds = phase["seeds"] if args.seeds is None else args.seeds
    args.out = args.out or str(ROOT / "experiments" / "out" / f"hacking_{args.phase}")
    known = all_variants(args)
    args.variants = select_variants(args, known)
    unknown = [part for v in args.variants for part in v.split("+") if part not in known]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {known}, or join them with '+'")
    for variant in args.variants:
        clash = clashing_keys(args, variant)
        if clash:
            parser.error(f"{variant}: its parts set the same key(s) {clash}; combine variants that set different ones")
    return args


def all_variants(args: argparse.Namespace) -> list[str]:
    artifact = [f"artifact_{w:g}" for w in args.artifact_weights]
    return [FIXED_VARIANTS[0], *artifact, *FIXED_VARIANTS[1:]]


def select_variants(args: argparse.Namespace, known: list[str]) -> list[str]:
    """The phase's variants: all (screen), none + the best three (final), or ``--variants`` (custom)."""
    if args.phase == "screen":
        return args.variants or known
    if args.phase == "final":
        best = args.best or screen_best(Path(args.results))
        return ["none", *[v for v in best if v != "none"]]
    return args.variants or known


def screen_best(results: Path) -> list[str]:
    path = results / "hacking_screen.json"
    if not path.is_file():
        raise SystemExit(f"hacking: --phase final needs --best A B C or the screen's results ({path}); run "
                         f"--phase screen first")
    return json.loads(path.read_text())["ranking"][:3]


def variant_overrides(args: argparse.Namespace, variant: str) -> list[str]:
    """The overrides of ``variant`` on top of the main job's config and the common ones (a combined ``A+B``: A's,
    then B's)."""
    if "+" in variant:
        return [o for part in variant.split("+") for o in variant_overrides(args, part)]
    if variant.startswith("artifact_"):
        weight = float(variant.removeprefix("artifact_"))
        return [f"reward.train={{shapes: 1.0, artifact: {{weight: {weight:g}, "
                f"kwargs: {{path: {args.artifact_model}}}}}}}"]
    if variant in ("adversarial", "adversarial_clipped"):
        clip = f", clip_margin: {args.adv_clip_margin:g}" if variant == "adversarial_clipped" else ""
        return [f"reward.train={{shapes: 1.0, adversarial: {{weight: {args.adv_weight:g}, "
                f"kwargs: {{references: shapes, d_steps: {args.adv_d_steps}, lr: {args.adv_lr:g}{clip}}}}}}}",
                "reward.discriminator.period=1", "reward.discriminator.d_epochs=0",
                "reward.discriminator.d_on_generator_epochs=true",
                f"reward.discriminator.warmup_epochs={args.adv_warmup}"]
    if variant in ("kl_low", "kl_high"):
        beta = args.kl_low if variant == "kl_low" else args.kl_high
        return ["train.kl_coef_units=flow_grpo", f"train.kl_coef={beta:g}"]
    if variant == "crd_anchor":
        return ["train.kl_coef_units=flow_grpo", f"train.kl_coef={args.kl_high:g}", "train.kl_reward_adaptive=true",
                f"train.kl_floor={args.kl_high * 1e-3:g}"]
    if variant == "elastic_reset":
        return [f"train.elastic_reset={{every_epochs: {args.elastic_every}, decay_per_epoch: {args.elastic_decay:g}}}"]
    if variant == "base_tail":
        return [f"sampling.base_last_steps={args.base_last_steps}"]
    return []


def clashing_keys(args: argparse.Namespace, variant: str) -> list[str]:
    """The config keys that more than one part of a combined variant sets (none for a single variant; a part named
    twice clashes with itself, since ``variant_overrides`` would repeat its overrides)."""
    keys = [o.split("=", 1)[0] for part in variant.split("+") for o in variant_overrides(args, part)]
    return sorted({k for k in keys if keys.count(k) > 1})


def uses_artifact(variant: str) -> bool:
    return any(part.startswith("artifact_") for part in variant.split("+"))


def ensure_artifact_model(path: Path) -> None:
    """Train the synthetic-artifact classifier once (``flowrl train-reward artifact --synthetic shapes``)."""
    if (path / "config.json").is_file():
        return
    subprocess.run([sys.executable, "-m", "flowrl", "train-reward", "artifact", "--synthetic", "shapes", "--out",
                    str(path)], cwd=ROOT, check=True)


def budget(args: argparse.Namespace) -> dict:
    if args.epochs is not None:
        return {"run.max_minutes": "null", "run.max_epochs": args.epochs, "eval.every_minutes": "null",
                "eval.every_epochs": max(1, args.epochs // 3)}
    return {"run.max_minutes": args.minutes, "run.max_epochs": args.max_epochs, "eval.every_epochs": "null",
            "eval.every_minutes": args.eval_every_minutes or args.minutes / 3}


def common_overrides(args: argparse.Namespace) -> dict:
    common = {**budget(args), "eval.at_start": "false", "data.num_eval_prompts": args.num_eval_prompts,
              "sampling.eval_num_steps": args.eval_steps}
    if args.model_path is not None:
        common["model.path"] = args.model_path
    return common


def base_jobs(args: argparse.Namespace) -> list[dict]:
    """The base model's evaluation, once per seed (a run of 0 epochs evaluates at its start): every run's first
    point and the criteria's reference. Every variant's model is the base before its first update, so evaluating
    it again at each run's start would cost one evaluation per run for the same numbers."""
    config = ROOT / "configs" / "shapes" / "flow_grpo.yaml"
    overrides = {**common_overrides(args), "run.max_epochs": 0, "eval.at_start": "true"}
    return [{"config": config, "out": Path(args.out) / f"base_s{seed}", "overrides": {**overrides, "run.seed": seed},
             "extra": list(args.overrides), "label": f"hacking {args.phase}: base seed {seed}", "reuse": True,
             "variant": "base", "seed": seed} for seed in args.seeds]


def jobs_for(args: argparse.Namespace) -> list[dict]:
    common = common_overrides(args)
    config = ROOT / "configs" / "shapes" / "flow_grpo.yaml"
    jobs = []
    for seed in args.seeds:  # seed-major: an interrupted benchmark still has every variant for early seeds
        for variant in args.variants:
            jobs.append({"config": config, "out": Path(args.out) / f"{variant}_s{seed}",
                         "overrides": {**common, "run.seed": seed},
                         "extra": [*variant_overrides(args, variant), *args.overrides],
                         "label": f"hacking {args.phase}: {variant} seed {seed}", "reuse": args.reuse,
                         "variant": variant, "seed": seed})
    return jobs


def main(argv: list[str] | None = None) -> dict:
    from experiments.hacking_report import report

    args = parse_args(argv)
    jobs = jobs_for(args)
    if not args.analyse_only:
        if any(uses_artifact(v) for v in args.variants):
            ensure_artifact_model(Path(args.artifact_model))
        launch([*base_jobs(args), *jobs], args.parallel, keys=("variant", "seed"))
    return report(jobs, args, base_jobs(args))


if __name__ == "__main__":
    main()
