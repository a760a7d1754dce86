"""flowrl.testing.fake_accelerator: tensors on a fake ``fakegpu`` device that hold CPU data and follow CUDA's rules.

Every assertion here states what CUDA does (raise, allow, copy, sync), so a wrong fake fails the test.
"""

import copy
import io
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from flowrl.testing import fake_accelerator as fa

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="installing a PrivateUse1 backend breaks CUDA backward passes in this process"),
    pytest.mark.usefixtures("one_thread"),
]

SAME_DEVICE = "Expected all tensors to be on the same device"


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return fa.install()


def _next_line() -> int:
    """The caller's next line number (where the counted call sits)."""
    return sys._getframe(1).f_lineno + 1


def _is_here(where: str, line: int) -> bool:
    path, _, lineno = where.rpartition(":")
    return int(lineno) == line and os.path.samefile(path, __file__)


# ------------------------------------------------------------------------------------------ the device itself

def test_install_is_idempotent_and_the_device_looks_like_an_accelerator(dev):
    assert fa.install() == dev == fa.DEVICE == torch.device("fakegpu", 0)
    assert fa.is_installed()
    x = torch.zeros(2, 3, device=dev)
    assert fa.is_fake(x) and not fa.is_fake(torch.zeros(1))
    assert x.device == dev and x.device.type == fa.DEVICE_TYPE
    assert x.is_cpu is False and x.is_cuda is False
    # Libraries that pick the accelerator themselves keep choosing the CPU in the rest of the process.
    assert torch.accelerator.is_available() is False


@pytest.mark.parametrize("make", [
    lambda d: torch.zeros(2, 3, device=d),
    lambda d: torch.ones(4, device=d),
    lambda d: torch.randn(2, 2, device=d),
    lambda d: torch.rand(3, device=d),
    lambda d: torch.randint(0, 5, (3,), device=d),
    lambda d: torch.arange(5, device=d),
    lambda d: torch.full((2,), 3.0, device=d),
    lambda d: torch.tensor([1.0, 2.0], device=d),
    lambda d: torch.empty(3, device=d),
    lambda d: torch.eye(3, device=d),
    lambda d: torch.linspace(0, 1, 5, device=d),
    lambda d: torch.randperm(4, device=d),
    lambda d: torch.tril_indices(3, 3, device=d),
    lambda d: torch.zeros_like(torch.ones(2), device=d),
    lambda d: torch.ones(2).to(d),
    lambda d: torch.ones(2, device=d).new_zeros(3),
], ids=["zeros", "ones", "randn", "rand", "randint", "arange", "full", "tensor", "empty", "eye", "linspace",
        "randperm", "tril_indices", "zeros_like", "to", "new_zeros"])
def test_factories_make_device_tensors(dev, make):
    t = make(dev)
    assert fa.is_fake(t) and t.device == dev


def test_values_round_trip_and_conversions(dev):
    cpu = torch.arange(6.0).reshape(2, 3)
    x = cpu.to(dev)
    back = x.cpu()
    assert type(back) is torch.Tensor and back.device.type == "cpu" and torch.equal(back, cpu)
    assert torch.equal(x.to("cpu"), cpu)
    half = x.to(torch.float16)
    assert fa.is_fake(half) and half.dtype == torch.float16
    assert torch.equal(torch.tensor([1, 2], device=dev).cpu(), torch.tensor([1, 2]))
    assert x.to(dev) is x  # already there: no copy
    assert torch.ones(2, device=dev).new_zeros(3, device="cpu").device.type == "cpu"


# ------------------------------------------------------------------------------------------ CUDA's device rules

def test_mixed_device_binary_ops_raise(dev):
    x = torch.ones(2, 3, device=dev)
    with pytest.raises(RuntimeError, match=f"{SAME_DEVICE}, but found at least two devices, fakegpu:0 and cpu!"):
        x + torch.ones(2, 3)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.ones(2, 3) * x
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x.add_(torch.ones(3))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):  # a CPU output with a device scalar input
        torch.ones(3).add_(torch.tensor(1.0, device=dev))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):  # an output is never a CPU scalar, even 0-dim
        torch.tensor(1.0).add_(torch.ones(3, device=dev).sum())


def test_zero_dim_cpu_scalars_are_allowed(dev):
    x = torch.ones(3, device=dev)
    y = x * torch.tensor(2.0)
    assert fa.is_fake(y) and torch.equal(y.cpu(), torch.full((3,), 2.0))
    assert torch.equal((x - torch.tensor(1.0)).cpu(), torch.zeros(3))
    assert torch.equal(torch.where(x > 0, torch.tensor(5.0), torch.tensor(0.0)).cpu(), torch.full((3,), 5.0))
    with pytest.raises(RuntimeError, match="too many CPU scalars"):  # CUDA takes one per TensorIterator op
        torch.addcmul(x, torch.tensor(1.0), torch.tensor(2.0))


def test_cat_of_device_and_cpu_raises(dev):
    with pytest.raises(RuntimeError, match=f"{SAME_DEVICE}, but got tensors is on cpu, different from other "
                                           "tensors on fakegpu:0"):
        torch.cat([torch.ones(2, device=dev), torch.ones(2)])
    with pytest.raises(RuntimeError, match=SAME_DEVICE):  # the generated check also refuses 0-dim CPU tensors
        torch.stack([torch.tensor(1.0, device=dev), torch.tensor(2.0)])


def test_strict_ops_refuse_cpu_operands(dev):
    x = torch.ones(3, 3, device=dev)
    with pytest.raises(RuntimeError, match="got index is on cpu"):
        torch.gather(x, 0, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.index_select(x, 0, torch.tensor([0]))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.zeros(3, device=dev).scatter_(0, torch.tensor([0], device=dev), torch.ones(1))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x @ torch.ones(3, 3)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        F.conv2d(torch.ones(1, 1, 3, 3, device=dev), torch.ones(1, 1, 3, 3))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.nn.Embedding(4, 2).to(dev)(torch.tensor([1, 2]))


def test_where_with_a_device_condition_and_cpu_values_raises(dev):
    mask = torch.ones(3, device=dev) > 0
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        torch.where(mask, torch.ones(3), torch.zeros(3))


def test_cpu_tensor_indexed_by_a_device_mask_raises(dev):
    mask = torch.tensor([True, False, True], device=dev)
    with pytest.raises(RuntimeError, match=r"indices should be either on cpu or on the same device as the "
                                           r"indexed tensor \(cpu\)"):
        torch.arange(3.0)[mask]


def test_device_tensor_indexed_by_a_cpu_index_works_and_counts_one_h2d(dev):
    x = torch.arange(5.0).to(dev)
    index = torch.tensor([4, 0])
    with fa.count_syncs() as syncs:
        line = _next_line()
        picked = x[index]
    assert fa.is_fake(picked) and torch.equal(picked.cpu(), torch.tensor([4.0, 0.0]))
    assert (syncs.h2d, syncs.total) == (1, 1)
    assert _is_here(syncs.events[0].where, line)


def test_device_mask_index_is_a_sync(dev):
    x = torch.arange(4.0).to(dev)
    with fa.count_syncs() as syncs:
        picked = x[x > 1]  # the result size (nonzero) has to come back to the host
    assert torch.equal(picked.cpu(), torch.tensor([2.0, 3.0]))
    assert (syncs.syncs, syncs.total) == (1, 1)


def test_masked_fill_and_index_put_follow_cuda(dev):
    x = torch.ones(3, device=dev)
    with pytest.raises(RuntimeError, match="expected self and mask to be on the same device, but got mask on cpu "
                                           "and self on fakegpu:0"):
        x.masked_fill(torch.tensor([True, False, True]), 0.0)
    filled = x.masked_fill(x > 0, torch.tensor(7.0))  # a 0-dim CPU value is fine
    assert torch.equal(filled.cpu(), torch.full((3,), 7.0))
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        x[torch.tensor([0, 1])] = torch.tensor([5.0, 6.0])  # value on the CPU, not 0-dim
    x[torch.tensor([0, 1])] = torch.tensor(5.0)
    x[torch.tensor([2], device=dev)] = torch.tensor([6.0], device=dev)
    assert torch.equal(x.cpu(), torch.tensor([5.0, 5.0, 6.0]))


def test_in_place_ops_views_and_out_write_through(dev):
    x = torch.zeros(2, 3, device=dev)
    x[0].add_(1.0)  # a view of x
    x[:, 2] = torch.tensor([7.0, 8.0], device=dev)
    x.view(-1)[4] = 5.0
    assert torch.equal(x.cpu(), torch.tensor([[1.0, 1.0, 7.0], [0.0, 5.0, 8.0]]))
    y = x.t()
    y.mul_(2.0)
    assert torch.equal(x.cpu()[0], torch.tensor([2.0, 2.0, 14.0]))
    out = torch.empty(0, device=dev)
    result = torch.add(torch.ones(3, device=dev), 1.0, out=out)
    assert result is out and out.shape == (3,) and torch.equal(out.cpu(), torch.full((3,), 2.0))
    z = torch.arange(6.0, device=dev).reshape(2, 3)
    z.t_()
    assert z.shape == (3, 2) and torch.equal(z.cpu(), torch.arange(6.0).reshape(2, 3).t())


def test_numpy_needs_an_explicit_copy(dev):
    x = torch.ones(2, device=dev)
    with pytest.raises(TypeError, match="can't convert fakegpu:0 device type tensor to numpy"):
        x.numpy()
    assert x.cpu().numpy().tolist() == [1.0, 1.0]


# ------------------------------------------------------------------------------------------ random numbers

def test_cpu_generator_with_a_device_factory_raises(dev):
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="Expected a 'fakegpu' device type for generator but found 'cpu'"):
        torch.randn(3, generator=generator, device=dev)
    with pytest.raises(RuntimeError, match="Expected a 'fakegpu' device type for generator"):
        torch.ones(3, device=dev).uniform_(generator=generator)
    with pytest.raises(NotImplementedError):  # the Python backend API cannot make a device generator
        torch.Generator(device=dev)


def test_fake_generators_and_the_device_default_generator(dev):
    a = torch.randn(4, generator=fa.fake_generator(3), device=dev)
    b = torch.randn(4, generator=fa.fake_generator(3), device=dev)
    assert fa.fake_generator(3).device == dev and fa.fake_generator(3).initial_seed() == 3
    assert torch.equal(a.cpu(), b.cpu())
    assert not torch.equal(a.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(3)))  # like CUDA
    torch.manual_seed(5)
    cpu_first = torch.randn(3)
    torch.manual_seed(5)
    device_draw = torch.randn(3, device=dev)
    F.dropout(torch.ones(8, device=dev), 0.5)  # no generator argument: drawn from the device stream too
    cpu_after = torch.randn(3)
    assert torch.equal(cpu_first, cpu_after)  # device draws leave the CPU stream alone
    torch.manual_seed(5)
    assert torch.equal(torch.randn(3, device=dev).cpu(), device_draw.cpu())
    with torch.random.fork_rng(device_type=fa.DEVICE_TYPE):
        forked = torch.randn(3, device=dev)
    assert torch.equal(torch.randn(3, device=dev).cpu(), forked.cpu())


# ------------------------------------------------------------------------------------------ sync counting

def test_item_counts_one_scalar_read_at_its_line(dev):
    x = torch.ones(3, device=dev)
    with fa.count_syncs() as syncs:
        line = _next_line()
        value = x.sum().item()
    assert value == 3.0
    assert (syncs.scalar_reads, syncs.total) == (1, 1)
    assert syncs.events[0].kind == "scalar_read" and _is_here(syncs.events[0].where, line)


def test_cpu_counts_one_d2h(dev):
    x = torch.ones(3, device=dev)
    with fa.count_syncs() as syncs:
        line = _next_line()
        x.cpu()
    assert (syncs.d2h, syncs.total) == (1, 1)
    assert _is_here(syncs.events[0].where, line)


def test_every_kind_of_scalar_read_and_copy_is_counted(dev):
    x = torch.tensor([1.0, 2.0], device=dev)
    cpu = torch.zeros(2)
    with fa.count_syncs() as syncs:
        float(x[0]), int(x[0]), bool(x[0] > 0), x.tolist(), f"{x[1]:.1f}"
        if x[0]:
            pass
        cpu.copy_(x)   # d2h
        x.to("cpu")    # d2h
        x.copy_(cpu)   # h2d
        torch.tensor([1, 2], device=dev)  # h2d
        torch.ones(2).to(dev)  # h2d
    assert (syncs.scalar_reads, syncs.d2h, syncs.h2d, syncs.syncs) == (6, 2, 3, 0)
    site = f"{os.path.relpath(__file__)}:"
    assert syncs.summary().startswith("2 d2h: ") and site in syncs.summary()


def test_fail_on_raises_at_the_sync(dev):
    x = torch.ones(3, device=dev)
    with fa.count_syncs(fail_on=["scalar_read"]) as syncs:
        x.cpu()  # only counted
        with pytest.raises(fa.SyncError, match="scalar_read on fakegpu at .*test_fake_accelerator.py"):
            x.sum().item()
    assert syncs.d2h == 1


def test_backward_is_device_only_and_its_copies_are_attributed_to_autograd(dev):
    w = torch.ones(3, device=dev, requires_grad=True)
    leaf = torch.ones(3, requires_grad=True)  # a CPU leaf moved to the device: its gradient comes back
    with fa.count_syncs() as syncs:
        loss = (w * leaf.to(dev)).sum()
        loss.backward()
    assert fa.is_fake(w.grad) and torch.equal(w.grad.cpu(), torch.ones(3))
    assert leaf.grad.device.type == "cpu" and torch.equal(leaf.grad, torch.ones(3))
    assert syncs.by_site() == {("h2d", syncs.events[0].where): 1, ("d2h", "<autograd backward>"): 1}


# ------------------------------------------------------------------------------------------ modules and training

def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, device, foreach: bool) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=foreach)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 4, generator=generator).to(device)
        y = torch.randn(5, 2, generator=generator).to(device)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("foreach", [False, True], ids=["single_tensor", "foreach"])
def test_training_on_the_device_matches_the_cpu(dev, foreach):
    reference = _tiny_model()
    _train(reference, "cpu", foreach)
    model = _tiny_model()
    params = list(model.parameters())
    model.to(dev)
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * 4  # identity kept, as on CUDA
    assert all(isinstance(p, torch.nn.Parameter) and fa.is_fake(p) for p in model.parameters())
    with fa.count_syncs() as syncs:
        _train(model, dev, foreach)
    assert all(fa.is_fake(p.grad) for p in model.parameters())
    for trained, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained.cpu(), expected, atol=1e-6, rtol=0)
    assert (syncs.h2d, syncs.total) == (6, 6)  # the batches; AdamW itself never syncs


def test_to_cpu_and_on_device_keep_parameter_identity(dev):
    model = _tiny_model()
    params = list(model.parameters())
    with fa.on_device(model) as device:
        assert device == dev and all(fa.is_fake(p) for p in model.parameters())
    assert [p is q for p, q in zip(model.parameters(), params)] == [True] * 4
    assert all(p.device.type == "cpu" and type(p) is torch.nn.Parameter for p in model.parameters())
    fa.to_device(model)
    fa.to_cpu(model)
    assert list(model.parameters())[0] is params[0]


def test_conv_and_attention_forward_equal_the_cpu(dev):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(6)
    q, k, v = torch.randn(3, 2, 2, 5, 8).unbind(0)
    torch.testing.assert_close(F.conv2d(x.to(dev), w.to(dev), b.to(dev), padding=1).cpu(),
                               F.conv2d(x, w, b, padding=1), atol=1e-6, rtol=0)
    # The device runs SDPA's math backend, the CPU its flash kernel: equal up to rounding.
    torch.testing.assert_close(F.scaled_dot_product_attention(q.to(dev), k.to(dev), v.to(dev)).cpu(),
                               F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)
    for op in (lambda t: F.group_norm(t, 2), lambda t: F.layer_norm(t, (8,)), lambda t: F.softmax(t, -1)):
        torch.testing.assert_close(op(x.to(dev)).cpu(), op(x), atol=1e-6, rtol=0)


def test_autocast_follows_cuda_op_lists(dev):
    linear = torch.nn.Linear(4, 4).to(dev)
    x = torch.randn(2, 4, device=dev)
    with torch.autocast(fa.DEVICE_TYPE, dtype=torch.bfloat16):
        y = linear(x)
        assert y.dtype == torch.bfloat16
        assert F.layer_norm(y, (4,)).dtype == torch.float32
        assert torch.softmax(y, -1).dtype == torch.float32
        assert (y.float() ** 2).mean().dtype == torch.float32
    assert linear(x).dtype == torch.float32


def test_state_dict_round_trip(dev, tmp_path):
    model = _tiny_model().to(dev)
    path = tmp_path / "state.pt"
    with fa.count_syncs() as syncs:
        torch.save(model.state_dict(), path)
    assert syncs.d2h == 4  # saving copies each tensor to the host
    on_cpu = torch.load(path, map_location="cpu")
    assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in on_cpu.values())
    restored = torch.load(path)  # without map_location: back on the device, as CUDA checkpoints are
    assert all(fa.is_fake(t) for t in restored.values())
    cpu_model = _tiny_model()
    torch.manual_seed(1)
    for p in cpu_model.parameters():
        p.data.normal_()
    with fa.count_syncs() as syncs:
        model.load_state_dict(cpu_model.state_dict())  # copy_ from the CPU into the device parameters
    assert syncs.h2d == 4
    assert all(fa.is_fake(p) for p in model.parameters())
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        assert torch.equal(p.cpu(), q)
    for key, value in model.state_dict().items():
        assert torch.equal(on_cpu[key], restored[key].cpu()) and fa.is_fake(value)


def test_deepcopy_of_a_module_on_the_device(dev):
    model = _tiny_model().to(dev)
    clone = copy.deepcopy(model)
    for p, q in zip(clone.parameters(), model.parameters()):
        assert p is not q and isinstance(p, torch.nn.Parameter) and fa.is_fake(p) and p.requires_grad
        assert torch.equal(p.cpu(), q.cpu())
    next(clone.parameters()).data.add_(1.0)
    assert not torch.equal(next(clone.parameters()).cpu(), next(model.parameters()).cpu())


def test_torch_save_of_a_whole_module_keeps_parameters(dev):
    model = _tiny_model().to(dev)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(isinstance(p, torch.nn.Parameter) and fa.is_fake(p) for p in loaded.parameters())


def test_ema_shadow_left_on_the_cpu_is_caught(dev):
    from diffusers.training_utils import EMAModel

    model = torch.nn.Linear(3, 2)
    ema = EMAModel(model.parameters())
    model.to(dev)
    with pytest.raises(RuntimeError, match=SAME_DEVICE):
        ema.step(model.parameters())
    ema.to(dev)
    ema.step(model.parameters())
    assert all(fa.is_fake(p) for p in ema.shadow_params)


def test_cpu_scalar_requiring_grad_is_refused_with_a_clear_error(dev):
    # A documented deviation: CUDA allows it, the fake cannot route its gradient back to the CPU.
    scale = torch.tensor(2.0, requires_grad=True)
    with pytest.raises(NotImplementedError, match="0-dim tensor that requires grad"):
        torch.ones(3, device=dev) * scale
    with torch.no_grad():
        assert fa.is_fake(torch.ones(3, device=dev) * scale)
