"""Host/device syncs of a tiny SD3 run, counted on the fake accelerator: per denoising step and per training pass.

On a GPU every blocking host<->device copy and every scalar read (``.item()``, ``float(t)``, ``bool(t)``,
``.tolist()``) stalls the launch pipeline: the CPU waits for the GPU to drain before it can queue more work. This
script runs the real code paths on ``fakegpu`` (flowrl/testing/fake_accelerator.py, a CPU-backed device that counts
that traffic with the line of each event) on the tiny SD3 pipeline (``flowrl.testing.build_tiny("sd3")``, LoRA,
classifier-free guidance 4.5, the shipped ``configs/sd3/*`` recipes) and counts:

* **rollout**: ``samplers.rollout`` with the model's guided velocity and the recipe's Flow-SDE step, for a long
  and a short schedule; ``per step = (count(long) - count(short)) / (long - short)``, the rest is a fixed cost of
  the rollout call;
* **Flow-GRPO**: ``flowrl.recipes.flow_grpo.train_epoch`` on one epoch of rollouts, with few and with many
  training passes (micro-batch x trained step: the recipe's forward+backward, the reference forward for the KL);
  ``per pass = (count(many) - count(few)) / (many - few)``, the rest belongs to the optimizer step
  (gathers, the grad-norm read that guards the update, the stats read once);
* **DGPO** (a forward-process trainer, flowrl/rl/forward.py): its ``train_epoch`` the same way.

Each count is split by kind (``d2h``, ``h2d``, ``scalar_read``, ``sync``) with the sites that scale with the
steps / passes; the table also shows the whole calls (each training epoch makes one optimizer step). Run from the
repository root::

    OMP_NUM_THREADS=1 python benchmarks/syncs.py [--json OUT]

CPU only (the fake accelerator refuses to install where CUDA is available); under a minute on one core. Results
on 2026-12 (tiny SD3): 5 host-to-device copies per denoising step and 18 copies + 6 scalar reads per Flow-GRPO pass
before the sync cuts, none after (tests/device/test_syncs.py holds the budgets).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from anywhere without installing the package
    sys.path.insert(0, str(ROOT))

KINDS = ("d2h", "h2d", "scalar_read", "sync")
#: Denoising steps of the long and the short rollout (their difference gives the per-step count).
ROLLOUT_STEPS = (6, 3)
#: Samples of the training epoch: 2 groups of 2; the rollout schedule's 3 trainable steps.
GROUPS, GROUP_SIZE, TRAIN_STEPS = 2, 2, 4


def _tiny_overrides(family: str = "sd3") -> list[str]:
    from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

    return [f"model.name={family}", f"model.path={build_tiny(family)}", f"model.resolution={TINY_RESOLUTION}",
            f"model.max_sequence_length={TINY_MAX_SEQUENCE_LENGTH}", "model.lora={rank: 4, alpha: 8}",
            "model.dtype=float32", "run.device=fakegpu", f"sampling.num_steps={TRAIN_STEPS}",
            f"sampling.group_size={GROUP_SIZE}", f"sampling.groups_per_epoch={GROUPS}",
            f"sampling.batch_size={GROUPS * GROUP_SIZE}", "train.minibatches=1"]


def _config(recipe_cls, name: str, extra: list[str] = ()):
    from flowrl.config import load_config

    return load_config(recipe_cls, ROOT / "configs" / "sd3" / f"{name}.yaml", _tiny_overrides() + list(extra),
                       drop_keys=("recipe",))


def _reward(images, prompts, metadata=None):
    """A cheap, varied reward (the counts are of the trainer, not of a reward model)."""
    from rewards import RewardOutput

    return RewardOutput(images.float().mean(dim=(1, 2, 3)))


def _count(fn) -> Counter:
    """``Counter`` of ``(kind, site)`` of the events ``fn()`` causes."""
    from flowrl.testing import fake_accelerator as fa

    with fa.count_syncs() as syncs:
        fn()
    return syncs.by_site()


def _by_kind(events: Counter) -> dict[str, float]:
    out = {kind: float(sum(n for (k, _), n in events.items() if k == kind)) for kind in KINDS}
    out["total"] = sum(out[k] for k in KINDS)
    return out


def _marginal(many: Counter, few: Counter, units: int) -> tuple[dict[str, float], list[dict]]:
    """``(per unit by kind, top sites per unit)`` of the events ``units`` more steps / passes add."""
    many_kinds, few_kinds = _by_kind(many), _by_kind(few)
    per_unit = {k: (many_kinds[k] - few_kinds[k]) / units for k in many_kinds}
    sites = Counter(many)
    sites.subtract(few)
    top = [{"kind": kind, "site": site, "per_unit": n / units} for (kind, site), n in sites.most_common() if n > 0]
    return per_unit, top


def measure_rollout(model, cfg) -> dict:
    """Syncs of ``samplers.rollout`` per denoising step and per rollout call."""
    from flowrl.models.base import encode_rows
    from flowrl.rl.sampling import rollout_step, rollout_window
    from samplers import initial_noise, make_sample_seeds, rollout

    s = cfg.sampling
    prompts = ["a red apple", "a blue car"] * GROUP_SIZE
    seeds = make_sample_seeds(cfg.run.seed, 0, range(len(prompts)))
    with torch.no_grad():
        cond = encode_rows(model, prompts, [{}] * len(prompts))
    velocity = model.velocity_fn(s.guidance)
    counts = {}
    for steps in ROLLOUT_STEPS:
        sigmas = model.sigmas(steps)
        step = rollout_step(s, sigmas)
        x_init = initial_noise(model.latent_shape, seeds, device=model.device)

        def run():
            rollout(velocity, x_init, step.sigmas, cond=cond, step=step, window=rollout_window(s), iteration=0,
                    seed=cfg.run.seed, sample_seeds=seeds, model_dtype=model.dtype)

        run()  # warm-up: lazily built caches (e.g. the guidance's unconditional embedding) are not a step's cost
        counts[steps] = _count(run)
    long, short = ROLLOUT_STEPS
    per_step, top = _marginal(counts[long], counts[short], long - short)
    short_kinds = _by_kind(counts[short])
    fixed = {k: short_kinds[k] - short * per_step[k] for k in short_kinds}
    return {"per_step": per_step, "per_rollout_call": fixed, "top_sites_per_step": top,
            "counts": {f"{k} steps": _by_kind(v) for k, v in counts.items()},
            "sites": {f"{k} steps": _sites(v) for k, v in counts.items()}}


def _epoch(model, cfg, dist, *, per_sample: bool):
    """One epoch of rollouts and advantages (``[n]`` with ``per_sample``, else ``[n, T]``), as the recipes' loops
    produce them (not counted)."""
    from flowrl.data.prompt_groups import PromptGroups
    from flowrl.rl.epoch_advantages import compute_advantages
    from flowrl.rl.collect import collect_epoch
    from flowrl.rl.sampling import rollout_step, rollout_window

    s = cfg.sampling
    groups = PromptGroups(["a red apple", "a blue car", "a cat on a mat"], None, groups=s.groups_per_epoch,
                          group_size=s.group_size, seed=cfg.run.seed)
    rollouts = collect_epoch(model, groups.epoch(0), step=rollout_step(s, model.sigmas(s.num_steps)),
                             window=rollout_window(s), epoch=0, seed=cfg.run.seed, reward=_reward,
                             guidance=s.guidance, batch_size=s.batch_size,
                             store_means=getattr(cfg.train, "needs_old_means", False))
    advantages, valid, _ = compute_advantages(rollouts, cfg.advantage, dist, seed=cfg.run.seed, epoch=0,
                                              per_sample=per_sample)
    return rollouts, advantages, valid


def measure_flow_grpo(model, dist) -> dict:
    """Syncs of Flow-GRPO's training epoch per training pass and per optimizer step."""
    from flowrl.recipes.flow_grpo import Config, train_epoch
    from flowrl.rl.optim import build_optimizer

    n = GROUPS * GROUP_SIZE
    cfg = _config(Config, "flow_grpo_pickscore")
    rollouts, advantages, valid = _epoch(model, cfg, dist, per_sample=False)
    steps = len(rollouts.trained_steps)
    counts, passes = {}, {}
    for mbs in (n, 1):
        run_cfg = _config(Config, "flow_grpo_pickscore", [f"train.micro_batch_size={mbs}"])
        optimizer, _ = build_optimizer(model.trainable_parameters(), run_cfg.optim)
        take_part = int(valid.sum())
        passes[mbs] = -(-take_part // mbs) * steps

        def run():
            train_epoch(model, optimizer, rollouts, advantages, valid, run_cfg, dist, 0)

        counts[mbs] = _count(run)
    return _training_result(counts[n], counts[1], passes[n], passes[1])


def measure_dgpo(model, dist) -> dict:
    """Syncs of DGPO's training epoch (a forward-process trainer) per training pass and per optimizer step."""
    from flowrl.recipes.dgpo import Config, train_epoch
    from flowrl.rl.forward import ForwardData
    from flowrl.rl.optim import build_optimizer
    from flowrl.rl.param_snapshots import ParamSnapshot

    n = GROUPS * GROUP_SIZE
    cfg = _config(Config, "dgpo_pickscore", ["train.times.high=1.0"])
    rollouts, advantages, valid = _epoch(model, cfg, dist, per_sample=True)
    data = ForwardData.from_rollouts(rollouts, advantages, valid)
    counts, passes = {}, {}
    for mbs in (n, GROUP_SIZE):  # DGPO's micro-batches hold whole groups
        run_cfg = _config(Config, "dgpo_pickscore", ["train.times.high=1.0", f"train.micro_batch_size={mbs}"])
        optimizer, _ = build_optimizer(model.trainable_parameters(), run_cfg.optim)
        snapshot = ParamSnapshot(model, run_cfg.train.ema_snapshot.schedule())
        passes[mbs] = (n // mbs) * run_cfg.train.times.count

        def run():
            train_epoch(model, optimizer, data, model.sigmas(run_cfg.sampling.num_steps), run_cfg, dist, 0,
                        ema_snapshot=snapshot)

        counts[mbs] = _count(run)
    return _training_result(counts[n], counts[GROUP_SIZE], passes[n], passes[GROUP_SIZE])


def _training_result(few: Counter, many: Counter, few_passes: int, many_passes: int) -> dict:
    per_pass, top = _marginal(many, few, many_passes - few_passes)
    few_kinds = _by_kind(few)
    fixed = {k: few_kinds[k] - few_passes * per_pass[k] for k in few_kinds}
    return {"per_pass": per_pass, "per_optimizer_step": fixed, "top_sites_per_pass": top,
            "counts": {f"{few_passes} passes, 1 optimizer step": few_kinds,
                       f"{many_passes} passes, 1 optimizer step": _by_kind(many)},
            "sites": {f"{few_passes} passes": _sites(few), f"{many_passes} passes": _sites(many)}}


def _sites(events: Counter) -> list[dict]:
    return [{"kind": kind, "site": site, "count": n} for (kind, site), n in events.most_common()]


def measure() -> dict:
    """Build the tiny SD3 run on the fake accelerator and count; returns the result dict."""
    from flowrl.dist import Dist
    from flowrl.models.config import build_model
    from flowrl.recipes.flow_grpo import Config
    from flowrl.testing import fake_accelerator as fa

    device = fa.install()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = _config(Config, "flow_grpo_pickscore")
    dist = Dist(device="fakegpu")
    model = build_model(cfg.model, device)
    model.freeze_reference()
    return {"device": f"{device} (flowrl's CPU-backed fake accelerator)", "model": "tiny SD3, LoRA r4, CFG 4.5",
            "rollout": measure_rollout(model, cfg), "flow_grpo": measure_flow_grpo(model, dist),
            "dgpo": measure_dgpo(model, dist)}


def _fmt(d: dict) -> str:
    return " ".join(f"{d[k]:6.2f}" for k in (*KINDS, "total"))


def report(result: dict) -> str:
    """The result as a plain-text table (whole calls, then per step / per pass) with the sites per step / pass."""
    header = f"{'':52s} " + " ".join(f"{k:>6s}" for k in ("d2h", "h2d", "scalar", "sync", "total"))
    lines = [f"syncs on {result['device']}, {result['model']}", header]
    for name, key, per in (("rollout", "rollout", "per_step"), ("Flow-GRPO train_epoch", "flow_grpo", "per_pass"),
                           ("DGPO train_epoch", "dgpo", "per_pass")):
        for what, counts in result[key]["counts"].items():
            lines.append(f"{name + ', ' + what:52s} {_fmt(counts)}")
        label = "  per denoising step" if per == "per_step" else "  per training pass"
        lines.append(f"{label:52s} {_fmt(result[key][per])}")
    for name, key, top in (("rollout, per step", "rollout", "top_sites_per_step"),
                           ("Flow-GRPO, per pass", "flow_grpo", "top_sites_per_pass"),
                           ("DGPO, per pass", "dgpo", "top_sites_per_pass")):
        sites = result[key][top]
        lines.append(f"\nsites, {name}:" + ("" if sites else " none"))
        lines += [f"  {s['per_unit']:5.2f} {s['kind']:11s} {s['site']}" for s in sites[:12]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the result as JSON here")
    args = parser.parse_args(argv)
    result = measure()
    print(report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
