"""ParamSnapshot (flowrl/rl/param_snapshots.py): predicting with a snapshot equals predicting with its weights loaded,
leaves the live parameters and their gradients alone, follows its decay schedule, and round-trips a checkpoint."""

import pytest
import torch

from flowrl.core.snapshots import DecaySchedule
from flowrl.models.base import ModelLoadError
from flowrl.rl.param_snapshots import ParamSnapshot, optimizer_steps

from toy import ToyFlow


def perturbed(model, scale=0.3):
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(scale * torch.randn_like(p))


def test_snapshot_predicts_with_its_own_weights_and_leaves_the_policy_alone():
    torch.manual_seed(0)
    model = ToyFlow()
    perturbed(model)
    snapshot = ParamSnapshot(model)  # a copy of the weights now
    x, sigma, cond = torch.randn(5, 2, 1, 1), torch.rand(5), model.encode_prompts(["p"] * 5)
    before = model.velocity(x, sigma, cond).detach()
    perturbed(model)  # the policy moves on
    v = model.velocity(x, sigma, cond)
    with snapshot.active(model):
        v_snap = model.velocity(x, sigma, cond)
    assert torch.allclose(v_snap, before, atol=1e-6) and not torch.allclose(v, before)
    assert torch.equal(model.velocity(x, sigma, cond), v)  # live weights untouched
    # The snapshot's pass may come after the policy's and still leaves the policy's gradient exact.
    v.square().sum().backward()
    grads = [p.grad.clone() for p in model.trainable_parameters()]
    model.zero_grad()
    model.velocity(x, sigma, cond).square().sum().backward()
    assert all(torch.allclose(a, p.grad) for a, p in zip(grads, model.trainable_parameters()))
    assert torch.allclose(snapshot.velocity_fn(model, 1.0)(x, sigma, cond), before, atol=1e-6)


def test_update_follows_the_schedule_and_the_state_round_trips():
    model = ToyFlow()
    snapshot = ParamSnapshot(model, DecaySchedule(start=0, initial=0.25, slope=0.25, maximum=0.5))
    start = {k: v.clone() for k, v in snapshot.tensors.items()}
    perturbed(model)
    live = {n: p.detach().clone() for n, p in model.denoiser.named_parameters()}
    assert snapshot.update(model, 1) == 0.5  # min(0.25 + 0.25 * 1, 0.5)
    for name, tensor in snapshot.tensors.items():
        assert torch.allclose(tensor, 0.5 * start[name] + 0.5 * live[name])
    copy = ParamSnapshot(ToyFlow())
    copy.load_state_dict(snapshot.state_dict())
    assert all(torch.equal(copy.tensors[k], v) for k, v in snapshot.tensors.items())
    with pytest.raises(ModelLoadError, match="snapshot does not match the model's trainable parameters"):
        copy.load_state_dict({"0.weight": torch.zeros(1)})


def test_optimizer_steps_counts_adam_steps():
    model = ToyFlow()
    optimizer = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    assert optimizer_steps(optimizer) == 0
    for _ in range(3):
        model.velocity(torch.randn(2, 2, 1, 1), torch.rand(2), model.encode_prompts(["p"] * 2)).sum().backward()
        optimizer.step()
    assert optimizer_steps(optimizer) == 3
