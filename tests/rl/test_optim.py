"""The online runs' learning-rate schedule (flowrl/rl/optim.py): constant after the warm-up by default, or a
cosine to min_lr_ratio * lr at decay_epochs, and the same after a resume from the scheduler's state."""

import math

import pytest
import torch

from flowrl.rl.optim import OptimConfig, build_optimizer


def _lrs(cfg: OptimConfig, epochs: int, *, resume_at: int | None = None) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer, scheduler = build_optimizer([param], cfg)
    lrs = []
    for epoch in range(epochs):
        if resume_at is not None and epoch == resume_at:  # a new process loads the saved states
            saved = (optimizer.state_dict(), scheduler.state_dict())
            optimizer, scheduler = build_optimizer([param], cfg)
            optimizer.load_state_dict(saved[0])
            scheduler.load_state_dict(saved[1])
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_default_is_constant_after_a_linear_warmup():
    assert _lrs(OptimConfig(lr=1e-4), 4) == pytest.approx([1e-4] * 4)
    assert _lrs(OptimConfig(lr=1e-4, warmup_epochs=4), 6) == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4])


def test_cosine_decay_reaches_min_ratio_at_decay_epochs_and_stays():
    lrs = _lrs(OptimConfig(lr=1e-4, decay_epochs=10, min_lr_ratio=0.2), 13)
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[5] == pytest.approx(1e-4 * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.5))))  # halfway: 0.6 lr
    assert lrs[10] == pytest.approx(2e-5) and lrs[12] == pytest.approx(2e-5)
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_warmup_then_cosine_and_exact_resume():
    cfg = OptimConfig(lr=1e-3, warmup_epochs=2, decay_epochs=8, min_lr_ratio=0.0)
    straight = _lrs(cfg, 10)
    assert straight[:3] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert straight[8] == pytest.approx(0.0, abs=1e-12)
    assert _lrs(cfg, 10, resume_at=5) == pytest.approx(straight)


def test_every_recipe_has_the_one_optim_section():
    """One optimizer config for every recipe (online and supervised, image and VLM), built by one builder; and every
    recipe has the sections :class:`flowrl.run.harness.Run` takes."""
    import dataclasses
    import typing

    from flowrl.recipes import RECIPES

    from flowrl.run.harness import EvalSchedule

    for name in RECIPES.names():
        cls = RECIPES.get(name).config_class
        hints = typing.get_type_hints(cls)
        assert hints["optim"] is OptimConfig, name
        # ... and the sections the run harness takes, the eval section with the harness's schedule keys.
        assert {f.name for f in dataclasses.fields(cls)} >= {"run", "optim", "eval", "log", "checkpoint"}, name
        assert issubclass(hints["eval"], EvalSchedule), name


def test_a_supervised_schedule_counts_optimizer_steps_and_decays_in_epochs():
    """schedule_unit=step (pretrain, vlm_sft): the scheduler steps after every optimizer step; the warm-up is in
    optimizer steps (warmup_steps) plus whole epochs (warmup_epochs), the decay in epochs (or the whole run)."""
    param = torch.nn.Parameter(torch.zeros(2))

    def lrs(cfg, steps, **kwargs):
        optimizer, scheduler = build_optimizer([param], cfg, schedule_unit="step", **kwargs)
        out = []
        for _ in range(steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    # 4 optimizer steps per epoch: 1 epoch + 2 steps of warm-up = 6 steps; decay over 3 epochs = 12 steps.
    cfg = OptimConfig(lr=1.0, warmup_epochs=1, warmup_steps=2, decay_epochs=3, min_lr_ratio=0.0)
    got = lrs(cfg, 14, steps_per_epoch=4)
    assert got[:6] == pytest.approx([k / 6 for k in range(1, 7)])
    assert got[12] == pytest.approx(0.0, abs=1e-12) and got[13] == pytest.approx(0.0, abs=1e-12)
    # decay_epochs: run spans run.max_epochs epochs of steps_per_epoch steps (the supervised recipes' default).
    run = OptimConfig(lr=1.0, warmup_steps=2, decay_epochs="run", min_lr_ratio=0.0)
    assert lrs(run, 9, steps_per_epoch=4, max_epochs=2) == pytest.approx(
        lrs(OptimConfig(lr=1.0, warmup_steps=2, decay_epochs=2, min_lr_ratio=0.0), 9, steps_per_epoch=4))


def test_a_warmup_in_optimizer_steps_is_an_error_where_the_schedule_steps_per_epoch():
    from flowrl.config import ConfigError

    with pytest.raises(ConfigError, match=r"^optim.warmup_steps: this recipe steps its learning-rate schedule once per "
                                          r"epoch; give the warm-up in epochs \(optim.warmup_epochs\)"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1))], OptimConfig(warmup_steps=10), schedule_unit="epoch")


def test_supervised_recipes_must_anneal():
    """Their decay_epochs null used to mean the whole run; it now means constant in every recipe, so a supervised
    config that leaves it null is an error that names both fixes (not a silently constant rate)."""
    from flowrl.config import ConfigError, from_dict
    from flowrl.recipes import pretrain, vlm_sft

    for module in (pretrain, vlm_sft):
        assert from_dict(module.Config, {}).optim.decay_epochs == "run"
        with pytest.raises(ConfigError, match=r"^optim.decay_epochs: .* anneals its learning rate: give a number of "
                                              r"epochs or run"):
            from_dict(module.Config, {"optim": {"decay_epochs": None}})
