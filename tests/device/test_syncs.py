"""Host/device sync budgets on the fake accelerator (issue 44, item 6), on the tiny SD3 with LoRA and CFG 4.5.

On a GPU every blocking host<->device copy and scalar read stalls the launch pipeline. Budgets:

- a denoising step makes none: an epoch's collection (rollout, decode, reward in its thread) of 6 steps makes
  exactly the copies and reads of one of 3 steps, kind by kind and site by site;
- a Flow-GRPO training pass makes none (the budget is two): 12 passes make what 3 passes make, and an optimizer
  step reads two scalars, its statistics (one ``tolist``) and the gradient norm that guards the update;
- a forward-process pass (DGPO) makes none in flowrl/rl: what is left per pass is DGPO's group index
  (flowrl/core/advantages.py).

Before the change (2026-12, benchmarks/syncs.py): 5 host-to-device copies per denoising step; 18 copies and 6
scalar reads per Flow-GRPO pass; 7 copies, 7 scalar reads and 1 sync per DGPO pass.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from flowrl.testing import TINY_MAX_SEQUENCE_LENGTH, TINY_RESOLUTION, build_tiny

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("d2h", "h2d", "scalar_read", "sync")
GROUPS, GROUP_SIZE = 2, 2

pytestmark = [pytest.mark.device, pytest.mark.usefixtures("one_thread")]


def config(cls, name: str, *extra: str):
    """A shipped SD3 recipe with the tiny pipeline on the fake accelerator, 4 samples in one rollout batch."""
    from flowrl.config import load_config

    overrides = [f"model.path={build_tiny('sd3')}", f"model.resolution={TINY_RESOLUTION}",
                 f"model.max_sequence_length={TINY_MAX_SEQUENCE_LENGTH}", "model.lora={rank: 4, alpha: 8}",
                 "model.dtype=float32", "run.device=fakegpu", "sampling.num_steps=4",
                 f"sampling.group_size={GROUP_SIZE}", f"sampling.groups_per_epoch={GROUPS}",
                 f"sampling.batch_size={GROUPS * GROUP_SIZE}", "train.minibatches=1", *extra]
    return load_config(cls, ROOT / "configs" / "sd3" / f"{name}.yaml", overrides, drop_keys=("recipe",))


def reward(images, prompts, metadata=None):
    from rewards import RewardOutput

    return RewardOutput(images.float().mean(dim=(1, 2, 3)))


def counted(fn) -> Counter:
    """``Counter`` of ``(kind, site)`` of the host/device events of ``fn()``, from every thread."""
    from flowrl.testing import fake_accelerator as fa

    with fa.count_syncs() as syncs:
        fn()
    return syncs.by_site()


def kinds(events: Counter) -> dict[str, int]:
    return {kind: sum(n for (k, _), n in events.items() if k == kind) for kind in KINDS}


def extra_events(more: Counter, fewer: Counter) -> Counter:
    """The events ``more`` has beyond ``fewer`` (what the extra steps or passes cost), by site."""
    diff = Counter(more)
    diff.subtract(fewer)
    return +diff


@pytest.fixture(scope="module")
def sd3(device):
    """``(model, dist)``: the tiny SD3 adapter on the fake accelerator, its reference frozen."""
    from flowrl.dist import Dist
    from flowrl.models.config import build_model
    from flowrl.recipes.flow_grpo import Config

    torch.manual_seed(0)
    model = build_model(config(Config, "flow_grpo_pickscore").model, device)
    model.freeze_reference()
    return model, Dist(device="fakegpu")


def collect(model, dist, cfg, *, per_sample: bool = False):
    """One epoch's rollouts and advantages (``[n]`` with ``per_sample``, else ``[n, T]``), as the recipes' loops
    make them."""
    from flowrl.data.prompt_groups import PromptGroups
    from flowrl.rl.epoch_advantages import compute_advantages
    from flowrl.rl.collect import collect_epoch
    from flowrl.rl.sampling import rollout_step, rollout_window

    s = cfg.sampling
    groups = PromptGroups(["a red apple", "a blue car", "a cat on a mat"], None, groups=s.groups_per_epoch,
                          group_size=s.group_size, seed=cfg.run.seed)
    rollouts = collect_epoch(model, groups.epoch(0), step=rollout_step(s, model.sigmas(s.num_steps)),
                             window=rollout_window(s), epoch=0, seed=cfg.run.seed, reward=reward,
                             guidance=s.guidance, batch_size=s.batch_size,
                             store_means=getattr(cfg.train, "needs_old_means", False))
    advantages, valid, _ = compute_advantages(rollouts, cfg.advantage, dist, seed=cfg.run.seed, epoch=0,
                                              per_sample=per_sample)
    return rollouts, advantages, valid


def test_a_denoising_step_makes_no_copy_and_no_read(sd3):
    """The collection of an epoch (rollout with the SDE at every trainable step, decode, reward) costs the same
    host/device traffic at 6 steps as at 3: nothing per step."""
    from flowrl.recipes.flow_grpo import Config

    model, dist = sd3
    collect(model, dist, config(Config, "flow_grpo_pickscore"))  # warm-up: lazily built caches
    events = {steps: counted(lambda: collect(model, dist, config(Config, "flow_grpo_pickscore",
                                                                 f"sampling.num_steps={steps}")))
              for steps in (6, 3)}
    per_steps = extra_events(events[6], events[3])
    assert not per_steps, f"3 more denoising steps cost {dict(per_steps)}"
    assert events[3] == events[6]  # and none fewer: the counts are the same site by site


@pytest.mark.parametrize("extra", [(), ("train.trust_region=dppo",),
                                   ("train.ratio_norm=true", "train.kl_reward_adaptive=true", "train.kl_coef=0.5")],
                         ids=["clip", "dppo", "ratio_norm-adaptive_kl"])
def test_a_flow_grpo_training_pass_makes_no_copy_and_no_read(sd3, extra):
    """12 training passes (forward, the reference's forward for the KL, backward) cost what 3 cost; an optimizer
    step reads two scalars: its statistics, once, and the gradient norm that guards the update."""
    from flowrl.recipes.flow_grpo import Config, train_epoch
    from flowrl.rl.optim import build_optimizer

    model, dist = sd3
    rollouts, advantages, valid = collect(model, dist, config(Config, "flow_grpo_pickscore", *extra))
    steps = len(rollouts.trained_steps)
    assert steps == 3 and int(valid.sum()) == GROUPS * GROUP_SIZE
    events, passes = {}, {}
    for micro_batch in (GROUPS * GROUP_SIZE, 1):  # 1 x 3 and 4 x 3 passes, one optimizer step
        cfg = config(Config, "flow_grpo_pickscore", *extra, f"train.micro_batch_size={micro_batch}")
        optimizer, _ = build_optimizer(model.trainable_parameters(), cfg.optim)
        passes[micro_batch] = GROUPS * GROUP_SIZE // micro_batch * steps
        events[micro_batch] = counted(lambda: train_epoch(model, optimizer, rollouts, advantages, valid, cfg, dist, 0))
    assert passes == {4: 3, 1: 12}
    per_passes = extra_events(events[1], events[4])
    assert not per_passes, f"9 more training passes cost {dict(per_passes)}"
    epoch = kinds(events[1])
    assert epoch["scalar_read"] == 2, dict(events[1])  # the statistics' tolist and the grad norm
    assert sum(epoch.values()) <= 2 * passes[1], dict(events[1])  # the budget, two per pass, as a total


def test_a_forward_process_pass_makes_no_copy_in_flowrl_rl(sd3):
    """DGPO's passes: the noised points come from the minibatch staged on the device, the statistics stay there
    until the optimizer step. What a pass still costs is DGPO's group index (flowrl/core/advantages.py)."""
    from flowrl.recipes.dgpo import Config, train_epoch
    from flowrl.rl.forward import ForwardData
    from flowrl.rl.optim import build_optimizer
    from flowrl.rl.param_snapshots import ParamSnapshot

    model, dist = sd3
    rollouts, advantages, valid = collect(model, dist, config(Config, "dgpo_pickscore", "train.times.high=1.0"),
                                          per_sample=True)
    data = ForwardData.from_rollouts(rollouts, advantages, valid)
    events = {}
    for micro_batch in (GROUPS * GROUP_SIZE, GROUP_SIZE):  # whole groups: 1 or 2 micro-batches x 4 times
        cfg = config(Config, "dgpo_pickscore", "train.times.high=1.0", f"train.micro_batch_size={micro_batch}")
        optimizer, _ = build_optimizer(model.trainable_parameters(), cfg.optim)
        snapshot = ParamSnapshot(model, cfg.train.ema_snapshot.schedule())
        sigmas = model.sigmas(cfg.sampling.num_steps)
        events[micro_batch] = counted(lambda: train_epoch(model, optimizer, data, sigmas, cfg, dist, 0,
                                                          ema_snapshot=snapshot))
    four, eight = events[GROUPS * GROUP_SIZE], events[GROUP_SIZE]  # 4 and 8 passes
    per_four_passes = extra_events(eight, four)
    assert per_four_passes and all(site.startswith("flowrl/core/advantages.py") for _, site in per_four_passes), \
        dict(per_four_passes)
    # Besides the passes' own, the optimizer step reads two scalars (statistics, gradient norm).
    assert kinds(four)["scalar_read"] - kinds(per_four_passes)["scalar_read"] == 2, dict(four)


def test_statistics_on_the_device_are_read_once_and_equal_reading_each(device):
    """MetricMeans keeps a device value's weighted sum on the device in float64 (the arithmetic of Python's floats,
    in the same order) and reads every pending sum in one tolist: the means are those of reading each value."""
    from flowrl.rl.passes import MetricMeans
    from flowrl.testing import fake_accelerator as fa

    values = torch.randn(7, 2, generator=torch.Generator().manual_seed(0)) * 1e3
    weights = [3, 1, 4, 1, 5, 9, 2]
    on_device, read_each = MetricMeans(), MetricMeans()
    with fa.count_syncs() as syncs:
        for (a, b), w in zip(values.to(device), weights):
            on_device.add(w, a=a, b=b, c=0.5)
        assert syncs.total == 1, syncs.summary()  # the copy of the values above; adding reads nothing
        on_device.flush()
        means = on_device.means()
    assert syncs.scalar_reads == 1, syncs.summary()  # flush: one tolist for every statistic; means: none left
    for (a, b), w in zip(values, weights):
        read_each.add(w, a=float(a), b=float(b), c=0.5)
    assert means == read_each.means()  # bit for bit


def test_step_losses_check_their_std_and_dt_on_the_device(device):
    """On the CPU a non-positive std or a zero dt raises (tests/core/test_losses.py); on a device the check would be
    a blocking read per pass, so it is made there: the loss is NaN (and the guarded optimizer step skips the
    update). Valid inputs give the CPU's numbers."""
    from flowrl.core.losses import dppo_policy_loss, gaussian_kl, ratio_norm_policy_loss
    from flowrl.testing import fake_accelerator as fa

    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, generator=g) for _ in range(3))
    mean, old_mean = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    std = torch.tensor([0.5, 0.2, 0.1])
    cpu = [ratio_norm_policy_loss(logp, old, adv, mean, old_mean, std, 0.1, clip_range=0.2).loss,
           dppo_policy_loss(logp, old, adv, mean, old_mean, std, threshold=1e-3).loss,
           gaussian_kl(mean, old_mean, std)]
    logp, old, adv, mean, old_mean, std = (t.to(device) for t in (logp, old, adv, mean, old_mean, std))
    with fa.count_syncs(fail_on=["scalar_read", "sync", "h2d", "d2h"]):
        on_device = [ratio_norm_policy_loss(logp, old, adv, mean, old_mean, std, 0.1, clip_range=0.2).loss,
                     dppo_policy_loss(logp, old, adv, mean, old_mean, std, threshold=1e-3).loss,
                     gaussian_kl(mean, old_mean, std)]
        bad = [ratio_norm_policy_loss(logp, old, adv, mean, old_mean, std, 0.0, clip_range=0.2).loss,
               dppo_policy_loss(logp, old, adv, mean, old_mean, std * 0, threshold=1e-3).loss,
               gaussian_kl(mean, old_mean, std - 0.2)]
    assert all(torch.equal(a, b.cpu()) for a, b in zip(cpu, on_device))
    assert bool(bad[0].isnan()) and bool(bad[1].isnan()) and bad[2].isnan().tolist() == [False, True, True]
