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
